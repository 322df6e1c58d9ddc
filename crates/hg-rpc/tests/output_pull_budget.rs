//! An origin's own pull budget and the spilled outputs of its calls, with
//! a server process (`hg-rpc-testpeer`) over na-sm: outputs that find no
//! room wait for it and all arrive intact (blocking and async API); a
//! call given up on while its output waits lets the target release it at
//! once; and an output no budget of this origin can hold fails with its
//! own error.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{Engine, RpcError};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{client, dir, endpoint, Server};

const MIB: u64 = 1 << 20;
const T: Duration = Duration::from_secs(30);

/// Drives `c` until every call of `ids` has its outcome (at most [`T`]).
fn finish_all(c: &mut Engine, ids: &[hg_rpc::CallId], what: &str) {
    let end = Instant::now() + T;
    while !ids.iter().all(|id| c.is_finished(*id)) {
        assert!(
            Instant::now() < end,
            "{what}: calls did not finish: {:?}",
            c.stats()
        );
        c.progress(Some(Duration::from_millis(10))).unwrap();
        c.trigger().unwrap();
    }
}

#[test]
fn spilled_outputs_past_the_origin_s_pull_budget_wait_for_room_and_all_arrive() {
    let d = dir("out-budget");
    let srv = Server::start(&d);
    let mut c = client(&d);
    // Room for two 1 MiB outputs at once; 24 arrive together.
    c.set_max_pull_bytes(2 * MIB + MIB / 2);
    let s = c.lookup(&srv.uri).unwrap();
    for round in 0..3u64 {
        let calls: Vec<_> = (0..24u64)
            .map(|i| {
                let seed = round * 100 + i;
                (c.forward::<Fill>(&s, &(MIB, seed)).unwrap(), seed)
            })
            .collect();
        let ids: Vec<_> = calls.iter().map(|(id, _)| *id).collect();
        // Not driven meanwhile: the responses arrive together, as from
        // many targets at once (one by one, each output is pulled before
        // the next comes).
        std::thread::sleep(Duration::from_secs(1));
        finish_all(&mut c, &ids, "1 MiB outputs");
        for (id, seed) in calls {
            let out = c
                .take_response::<Fill>(id)
                .expect("finished")
                .unwrap_or_else(|e| panic!("round {round}, call {seed}: {e}"));
            assert!(
                out == fill_pattern(MIB, seed),
                "round {round}, call {seed}: corrupted"
            );
        }
    }
    let st = c.stats();
    assert!(
        st.outputs_waited > 0,
        "no output ever waited for room: the test did not test it ({st:?})"
    );
    assert_eq!(
        (st.in_flight, st.errors, c.outputs_waiting()),
        (0, 0, 0),
        "{st:?}"
    );
}

/// The async API, with the pull budget held by an input pulled for an
/// async handler of the client itself (it answers when told): every
/// output waits until that request is answered, and a call that times
/// out meanwhile leaves; then all the others arrive intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_calls_whose_outputs_wait_for_an_async_handler_s_input_all_succeed() {
    let d = dir("out-budget-async");
    let srv = Server::start(&d);
    let (ep, id) = endpoint(&d, true);
    let mut e = Engine::new(ep, id).unwrap();
    e.set_max_pull_bytes(MIB + MIB / 2);
    let c = Arc::new(hg_rpc::AsyncEngine::spawn(e).unwrap());
    let go = Arc::new(tokio::sync::Notify::new());
    let g = go.clone();
    c.register_async::<Digest, _, _>(move |data| {
        let g = g.clone();
        async move {
            g.notified().await;
            Ok((data.len() as u64, fnv(&data)))
        }
    })
    .unwrap();
    // A peer sends the client a 1 MiB input: pulled, then held by the
    // handler, it takes the budget's room for an output.
    let c_uri = c.self_addr().uri().to_owned();
    let holder = std::thread::spawn({
        let d = d.to_path_buf();
        move || {
            let mut h = client(&d);
            let to = h.lookup(&c_uri).unwrap();
            h.call::<Digest>(&to, &fill_pattern(MIB, 5), T)
        }
    });
    let end = Instant::now() + T;
    while c.stats().deferred_in_flight == 0 {
        assert!(
            Instant::now() < end,
            "the held input never arrived: {:?}",
            c.stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let s = c.lookup(&srv.uri).await.unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for seed in 0..8u64 {
        let (c, s) = (c.clone(), s.clone());
        tasks.spawn(async move { (c.call::<Fill>(&s, &(MIB, seed), T).await, seed) });
    }
    let end = Instant::now() + T;
    while c.stats().outputs_waited < 8 {
        let st = c.stats();
        assert_eq!(st.errors, 0, "calls failed instead of waiting for room: {st:?}");
        assert!(Instant::now() < end, "outputs did not wait: {st:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // One more, that times out while its output waits.
    let late = tokio::spawn({
        let (c, s) = (c.clone(), s.clone());
        async move { c.call::<Fill>(&s, &(MIB, 99), Duration::from_secs(3)).await }
    });
    while c.stats().outputs_waited < 9 {
        assert!(
            Instant::now() < end,
            "the last output did not wait: {:?}",
            c.stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    match late.await.unwrap() {
        Err(RpcError::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {:?}", other.map(|v| v.len())),
    }
    go.notify_one();
    while let Some(r) = tasks.join_next().await {
        let (out, seed) = r.unwrap();
        let out = out.unwrap_or_else(|e| panic!("call {seed}: {e}"));
        assert!(out == fill_pattern(MIB, seed), "call {seed}: corrupted");
    }
    let held = tokio::task::spawn_blocking(move || holder.join().unwrap())
        .await
        .unwrap();
    assert_eq!(held.unwrap(), (MIB, fnv(&fill_pattern(MIB, 5))));
    let st = c.stats();
    assert_eq!((st.in_flight, st.errors, st.outputs_waited), (0, 1, 9), "{st:?}");
}

#[test]
fn a_call_given_up_while_its_output_waits_lets_the_target_release_it_at_once() {
    let d = dir("out-wait-abandon");
    let (ep, id) = endpoint(&d, true);
    let mut srv = Engine::new(ep, id).unwrap();
    srv.register::<Fill>(|(len, seed)| Ok(fill_pattern(len, seed)))
        .unwrap();
    let mut c = client(&d);
    // One 1 MiB pull at a time.
    c.set_max_pull_bytes(MIB + MIB / 2);
    let s = c.lookup(srv.self_addr().uri()).unwrap();
    let ids: Vec<_> = (0..4u64)
        .map(|i| c.forward::<Fill>(&s, &(MIB, i)).unwrap())
        .collect();
    let end = Instant::now() + T;
    while c.outputs_waiting() == 0 {
        assert!(
            Instant::now() < end,
            "no output waited: {:?} {:?}",
            c.stats(),
            srv.stats()
        );
        for e in [&mut srv, &mut c] {
            e.progress(Some(Duration::from_millis(1))).unwrap();
            e.trigger().unwrap();
        }
    }
    // Given up on (timeouts, dropped futures): the waiting ones leave at
    // once, with nothing left for the client to do about them.
    for id in &ids {
        c.abandon(*id);
    }
    assert_eq!(c.outputs_waiting(), 0);
    assert_eq!(c.stats().in_flight, 0);
    // Only the server runs: what it still keeps is the one output whose
    // pull is in flight (released when the client sees the pull end);
    // the waiting ones were released by the client's abandon itself.
    let end = Instant::now() + T;
    while srv.stats().exposed_outputs > 1 {
        assert!(
            Instant::now() < end,
            "outputs of calls given up on stay exposed: {:?}",
            srv.stats()
        );
        srv.progress(Some(Duration::from_millis(5))).unwrap();
        srv.trigger().unwrap();
    }
    // Both run: the last one goes too, and no outcome is filed.
    let end = Instant::now() + T;
    while srv.stats().exposed_outputs > 0 {
        assert!(Instant::now() < end, "an output stays exposed: {:?}", srv.stats());
        for e in [&mut srv, &mut c] {
            e.progress(Some(Duration::from_millis(1))).unwrap();
            e.trigger().unwrap();
        }
    }
    for id in ids {
        assert!(c.take_response::<Fill>(id).is_none());
    }
    // The engine goes on.
    let id = c.forward::<Fill>(&s, &(MIB, 9)).unwrap();
    let end = Instant::now() + T;
    let out = loop {
        assert!(Instant::now() < end, "no answer");
        for e in [&mut srv, &mut c] {
            e.progress(Some(Duration::from_millis(1))).unwrap();
            e.trigger().unwrap();
        }
        if let Some(r) = c.take_response::<Fill>(id) {
            break r.unwrap();
        }
    };
    assert!(out == fill_pattern(MIB, 9));
}

#[test]
fn an_output_larger_than_the_origin_ever_pulls_fails_with_output_too_large() {
    let d = dir("out-never-fits");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.lookup(&srv.uri).unwrap();
    c.set_max_pull_bytes(MIB / 2);
    match c.call::<Fill>(&s, &(MIB, 1), T) {
        Err(e @ RpcError::OutputTooLarge { .. }) => {
            let msg = e.to_string();
            let RpcError::OutputTooLarge { rpc, len, max, bound } = e else {
                unreachable!()
            };
            assert_eq!(
                (rpc.as_str(), max, bound),
                ("test.fill", MIB / 2, "Engine::set_max_pull_bytes")
            );
            // The output and its length prefix.
            assert!((MIB..MIB + 16).contains(&len), "{len}");
            assert!(
                msg.contains("handler ran") && msg.contains("set_max_pull_bytes"),
                "{msg}"
            );
        }
        other => panic!("expected OutputTooLarge, got {other:?}"),
    }
    // The other bound: the largest spilled output this origin accepts.
    c.set_max_pull_bytes(16 * MIB);
    c.set_max_spill(MIB / 4);
    match c.call::<Fill>(&s, &(MIB, 2), T) {
        Err(RpcError::OutputTooLarge { max, bound, .. }) => {
            assert_eq!((max, bound), (MIB / 4, "Engine::set_max_spill"));
        }
        other => panic!("expected OutputTooLarge, got {other:?}"),
    }
    // With room, the same call works.
    c.set_max_spill(16 * MIB);
    assert!(c.call::<Fill>(&s, &(MIB, 3), T).unwrap() == fill_pattern(MIB, 3));
    let st = c.stats();
    assert_eq!((st.errors, st.in_flight, st.outputs_waited), (2, 0, 0), "{st:?}");
}
