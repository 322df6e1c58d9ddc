//! An origin's own pull budget and the spilled outputs of its calls, with
//! a server process (`hg-rpc-testpeer`) over na-sm: outputs that find no
//! room wait for it and all arrive intact (blocking and async API); a
//! call given up on while its output waits lets the target release it at
//! once; an output whose room a deferred request held goes when that
//! request is dropped unanswered; and an output no budget of this origin
//! can hold fails with its own error.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{Engine, RpcError};
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{client, dir, endpoint, Server};
mod held_budget;
use held_budget::{budget_held, HeldParts};

const MIB: u64 = 1 << 20;
const T: Duration = Duration::from_secs(30);

/// How long a round of megabyte calls may take at most: a hang detector.
/// Their (de)serialization is CPU work: while `Fill`'s output was a
/// `Vec<u8>`, (de)serialized byte by byte in a debug build, a loaded
/// 2-core box took up to 50 s for a round of 24 (the server's answers and
/// the client's pulls together; 30 s was the bound of each). As one byte
/// string (`ByteBuf`) a round takes about a second; the bound stays
/// generous.
const ROUND: Duration = Duration::from_secs(120);

/// Drives `c` until every call of `ids` has its outcome (at most [`ROUND`]).
fn finish_all(c: &mut Engine, ids: &[hg_rpc::CallId], what: &str) {
    let end = Instant::now() + ROUND;
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

/// How many `Fill` calls the server at `uri` has answered (asked by a
/// client of its own, `probe`, so that the engine under test is not
/// driven).
fn fills_answered(probe: &mut Engine, uri: &str) -> u64 {
    let s = probe.lookup(uri).unwrap();
    probe.call::<FillsAnswered>(&s, &(), T).unwrap()
}

/// Waits (at most [`ROUND`]) until the server at `uri` has answered `n`
/// `Fill` calls in all: their responses have gone out, and wait for the
/// origin, which is not driven meanwhile, so that they arrive together.
/// (A fixed pause let a loaded box answer only some of them in time: each
/// was then pulled as it came, and none ever waited for room.)
fn wait_fills_answered(probe: &mut Engine, uri: &str, n: u64) {
    let end = Instant::now() + ROUND;
    loop {
        let answered = fills_answered(probe, uri);
        if answered >= n {
            return;
        }
        assert!(
            Instant::now() < end,
            "the server answered {answered} of {n} Fill calls"
        );
        std::thread::sleep(Duration::from_millis(20));
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
    let mut probe = client(&d);
    for round in 0..3u64 {
        let answered = fills_answered(&mut probe, &srv.uri);
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
        wait_fills_answered(&mut probe, &srv.uri, answered + 24);
        finish_all(&mut c, &ids, "1 MiB outputs");
        for (id, seed) in calls {
            let out = c
                .take_response::<Fill>(id)
                .expect("finished")
                .unwrap_or_else(|e| panic!("round {round}, call {seed}: {}", na_core::ErrorChain(&e)));
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
            h.call::<Digest>(&to, &ByteBuf::from(fill_pattern(MIB, 5)), T)
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
        let out = out.unwrap_or_else(|e| panic!("call {seed}: {}", na_core::ErrorChain(&e)));

        assert!(out == fill_pattern(MIB, seed), "call {seed}: corrupted");
    }
    let held = tokio::task::spawn_blocking(move || holder.join().unwrap())
        .await
        .unwrap();
    assert_eq!(held.unwrap(), (MIB, fnv(&fill_pattern(MIB, 5))));
    let st = c.stats();
    assert_eq!((st.in_flight, st.errors, st.outputs_waited), (0, 1, 9), "{st:?}");
}

/// A client whose pull budget (1.5 MiB) is held by a 1 MiB input it
/// pulled for a deferred handler of its own (the request taken, in hand,
/// unanswered), and a call of its to a server process whose 1 MiB
/// spilled output waits for that room. Returns the client, the server,
/// the call, the request, and the peer that sent it (a thread that keeps
/// its engine, and so its connection, until told to end).
struct HeldBudget {
    c: Engine,
    _srv: Server,
    call: hg_rpc::CallId,
    req: Option<hg_rpc::DeferredRequest>,
    end_holder: std::sync::mpsc::Sender<()>,
    holder: std::thread::JoinHandle<hg_rpc::Result<(u64, u64)>>,
}

fn budget_held_by_a_deferred_request(d: &std::path::Path) -> HeldBudget {
    let HeldParts {
        mut c,
        srv,
        req,
        end_holder,
        holder,
    } = budget_held(d);
    assert_eq!(
        req.payload.len() as u64,
        MIB + 3,
        "the pulled input (and its length prefix)"
    );
    let s = c.lookup(&srv.uri).unwrap();
    let call = c.forward::<Fill>(&s, &(MIB, 7)).unwrap();
    let end = Instant::now() + T;
    while c.outputs_waiting() == 0 {
        assert!(Instant::now() < end, "the output did not wait: {:?}", c.stats());
        c.progress(Some(Duration::from_millis(10))).unwrap();
        c.trigger().unwrap();
    }
    HeldBudget {
        c,
        _srv: srv,
        call,
        req: Some(req),
        end_holder,
        holder,
    }
}

impl HeldBudget {
    /// Runs `turn` on the client until the call finishes; past `T`, fails
    /// with `stuck` and the client's stats.
    fn turn_until_finished(&mut self, stuck: &str, mut turn: impl FnMut(&mut Engine)) {
        let end = Instant::now() + T;
        while !self.c.is_finished(self.call) {
            assert!(Instant::now() < end, "{stuck}: {:?}", self.c.stats());
            turn(&mut self.c);
        }
    }

    /// The call's output arrived intact; the peer whose request was
    /// dropped unanswered timed out.
    fn check_and_end(mut self) {
        let out = self
            .c
            .take_response::<Fill>(self.call)
            .expect("finished")
            .unwrap();
        assert!(out == fill_pattern(MIB, 7), "corrupted");
        let st = self.c.stats();
        assert_eq!((st.in_flight, st.errors, st.outputs_waited), (0, 0, 1), "{st:?}");
        let _ = self.end_holder.send(());
        let r = self.holder.join().unwrap();
        assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    }
}

/// A deferred request dropped unanswered gives its pulled input's room
/// back: the output that waited for it is pulled as the engine goes
/// idle ([`Engine::try_wait`]), with no pull ending and no timeout.
/// Driven only by `progress_now`, `trigger` and `try_wait`.
#[test]
fn a_deferred_request_dropped_unanswered_lets_the_waiting_output_go_at_try_wait() {
    let d = dir("out-wait-dropped");
    let mut h = budget_held_by_a_deferred_request(&d);
    drop(h.req.take());
    h.turn_until_finished(
        "the output still waits after the request holding its room was dropped",
        |c| {
            c.progress_now().unwrap();
            c.trigger().unwrap();
            let _ = c.try_wait().unwrap();
        },
    );
    h.check_and_end();
}

/// As above, with the request dropped on another thread while the
/// client sleeps in a blocking `progress` far longer than the test's
/// bound: the drop wakes the sleep (the endpoint's waker), and the
/// output is pulled.
#[test]
fn a_deferred_request_dropped_on_another_thread_does_not_leave_progress_asleep() {
    let d = dir("out-wait-dropped-thread");
    let mut h = budget_held_by_a_deferred_request(&d);
    let req = h.req.take();
    let dropper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(req);
    });
    h.turn_until_finished(
        "the output still waits after the request holding its room was dropped",
        |c| {
            c.progress(Some(T + T)).unwrap();
            c.trigger().unwrap();
        },
    );
    dropper.join().unwrap();
    h.check_and_end();
}

/// As above, with the client driven by an event loop of the user's own:
/// `progress_now`, `trigger`, then `try_wait` and a sleep on the engine's
/// fd bounded by `next_expiry` (far longer than the test's bound when it
/// says nothing, as it does here). The drop makes the fd readable (the
/// endpoint's waker), so the loop wakes, and its next `try_wait` moves
/// the output.
#[test]
fn a_deferred_request_dropped_on_another_thread_does_not_leave_an_own_event_loop_asleep() {
    use std::os::fd::{AsFd, AsRawFd};
    let d = dir("out-wait-dropped-loop");
    let mut h = budget_held_by_a_deferred_request(&d);
    // The engine's epoll set, as a loop of the user's own would sleep on.
    let fd = common::sys::dup(h.c.endpoint().as_raw_fd()).expect("dup(2) of the engine's fd");
    let req = h.req.take();
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let dropper = std::thread::spawn({
        let dropped = dropped.clone();
        move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(req);
            dropped.store(true, std::sync::atomic::Ordering::Release);
        }
    });
    let (mut sleeps_held, end) = (0u32, Instant::now() + T);
    loop {
        h.c.progress_now().unwrap();
        h.c.trigger().unwrap();
        if h.c.is_finished(h.call) {
            break;
        }
        assert!(
            Instant::now() < end,
            "the output still waits after the request holding its room was dropped \
             (the loop slept past it): {:?}",
            h.c.stats()
        );
        if !h.c.try_wait().unwrap() {
            continue;
        }
        let held = !dropped.load(std::sync::atomic::Ordering::Acquire);
        let left =
            h.c.next_expiry()
                .map(|at| at.saturating_duration_since(Instant::now()));
        if held {
            sleeps_held += 1;
        }
        common::sys::poll_readable(fd.as_fd(), Some(left.unwrap_or(T + T).min(T + T))).expect("poll(2)");
    }
    dropper.join().unwrap();
    assert!(
        sleeps_held > 0,
        "the loop never slept while the request held the room: the test did not test it"
    );
    h.check_and_end();
}

/// The request holding the room is dropped (on another thread, in a real
/// loop) in the window between `try_wait`'s retry of the waiting output
/// (which still found no room) and the loop's sleep: the room is back
/// but nothing retried the output, and `next_expiry` says nothing (the
/// client keeps nothing with a TTL), so the drop must make the engine's
/// fd readable: the sleep ends at once (once it slept until the next
/// traffic, forever; then `next_expiry` was bounded by a 10 ms recheck
/// while requests held room, now gone).
#[test]
fn a_deferred_request_dropped_between_try_wait_and_the_sleep_wakes_the_fd() {
    use std::os::fd::{AsFd, AsRawFd};
    let d = dir("out-wait-dropped-window");
    let mut h = budget_held_by_a_deferred_request(&d);
    let end = Instant::now() + T;
    loop {
        assert!(
            Instant::now() < end,
            "the engine never went idle: {:?}",
            h.c.stats()
        );
        h.c.progress_now().unwrap();
        h.c.trigger().unwrap();
        if h.c.try_wait().unwrap() {
            break;
        }
    }
    assert_eq!(h.c.outputs_waiting(), 1, "the output moved with its room held");
    let fd = common::sys::dup(h.c.endpoint().as_raw_fd()).expect("dup(2) of the engine's fd");
    assert!(
        !common::sys::poll_readable(fd.as_fd(), Some(Duration::ZERO)).expect("poll(2)"),
        "idle, the fd is not readable yet: the test would not test the drop's wake-up"
    );
    // The drop lands after try_wait looked at the budget.
    drop(h.req.take());
    assert_eq!(
        h.c.next_expiry(),
        None,
        "no deadline: the fd's wake-up is what ends the sleep"
    );
    assert!(
        common::sys::poll_readable(fd.as_fd(), Some(T)).expect("poll(2)"),
        "an own event loop would sleep with the waiting output's room back unseen"
    );
    h.turn_until_finished("the output still waits", |c| {
        c.progress_now().unwrap();
        c.trigger().unwrap();
        let _ = c.try_wait().unwrap();
    });
    h.check_and_end();
}

/// A budget set larger while an output waits for room lets it go at
/// once: driven only by `progress_now` and `trigger` (which look at no
/// waiting output), with the request that holds the room still in hand.
#[test]
fn a_larger_pull_budget_lets_the_waiting_output_go_at_once() {
    let d = dir("out-wait-budget-raised");
    let mut h = budget_held_by_a_deferred_request(&d);
    h.c.set_max_pull_bytes(4 * MIB);
    h.turn_until_finished("the output still waits under a budget with room", |c| {
        c.progress_now().unwrap();
        c.trigger().unwrap();
    });
    drop(h.req.take());
    h.check_and_end();
}

#[test]
fn a_call_given_up_while_its_output_waits_lets_the_target_release_it_at_once() {
    let d = dir("out-wait-abandon");
    let (ep, id) = endpoint(&d, true);
    let mut srv = Engine::new(ep, id).unwrap();
    srv.register::<Fill>(|(len, seed)| Ok(fill_output(len, seed)))
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

/// Drives `c` with `turn` until call `id` finishes (at most [`T`]; past
/// it, fails with `stuck`).
fn turn_until(c: &mut Engine, id: hg_rpc::CallId, stuck: &str, mut turn: impl FnMut(&mut Engine)) {
    let end = Instant::now() + T;
    while !c.is_finished(id) {
        assert!(Instant::now() < end, "{stuck}: {:?}", c.stats());
        turn(c);
    }
}

/// A second server's spilled output waits behind the head (whose room a
/// deferred request holds), and that server dies: the output leaves the
/// queue at once, its descriptor freed, and its call fails with
/// `PeerGone`, while the head still finds no room (the client is driven
/// by `progress_now` and `trigger` only, which give no budget back). It
/// stayed queued, holding its copy, until room came back to the head.
/// (The other way an output is no longer wanted, its call given up on,
/// leaves at once already: the test above.)
#[test]
fn a_waiting_output_whose_target_died_leaves_the_queue_while_the_head_still_waits() {
    let d = dir("out-wait-target-gone");
    let mut h = budget_held_by_a_deferred_request(&d);
    let doomed = Server::start(&d);
    let s2 = h.c.lookup(&doomed.uri).unwrap();
    let call2 = h.c.forward::<Fill>(&s2, &(MIB, 8)).unwrap();
    let end = Instant::now() + T;
    while h.c.outputs_waiting() < 2 {
        assert!(
            Instant::now() < end,
            "the second output did not wait: {:?}",
            h.c.stats()
        );
        h.c.progress(Some(Duration::from_millis(10))).unwrap();
        h.c.trigger().unwrap();
    }
    let held = h.c.output_wait_bytes();
    assert!(held > 0, "the waiting outputs hold nothing: {held}");
    drop(doomed);
    turn_until(&mut h.c, call2, "the dead target's call did not fail", |c| {
        c.progress_now().unwrap();
        c.trigger().unwrap();
    });
    assert!(
        !h.c.is_finished(h.call),
        "the head moved: the test did not test it"
    );
    assert_eq!(
        h.c.outputs_waiting(),
        1,
        "the dead target's output still waits behind the head"
    );
    assert!(h.c.output_wait_bytes() < held, "its descriptor is still held");
    assert_eq!(h.c.stats().outputs_target_gone, 1, "{:?}", h.c.stats());
    match h.c.take_response::<Fill>(call2) {
        Some(Err(RpcError::Transport(na_core::NaError::PeerGone { .. }))) => {}
        other => panic!("expected PeerGone, got {:?}", other.map(|r| r.map(|v| v.len()))),
    }
    // The head goes once its room is back, intact.
    drop(h.req.take());
    h.turn_until_finished("the head still waits", |c| {
        c.progress_now().unwrap();
        c.trigger().unwrap();
        let _ = c.try_wait().unwrap();
    });
    let out = h.c.take_response::<Fill>(h.call).expect("finished").unwrap();
    assert!(out == fill_pattern(MIB, 7), "corrupted");
    // (The one error: the dead target's call.)
    let st = h.c.stats();
    assert_eq!(
        (st.in_flight, st.errors, st.outputs_waited, h.c.outputs_waiting()),
        (0, 1, 2, 0),
        "{st:?}"
    );
    assert_eq!(h.c.output_wait_bytes(), 0);
}

/// `next_expiry` sets no recheck deadline for waiting outputs (the client
/// keeps nothing with a TTL, so it says nothing): neither while a
/// deferred request holds their room (its drop wakes the engine), nor
/// once the request is dropped and a blocking `progress` moved the
/// output, nor while later outputs wait for room that only pulls in
/// flight hold, the client driven without `try_wait`. (It once said
/// 10 ms while requests held room, and the note that they had outlived
/// them until the next idle `try_wait`: an engine driven by `progress`
/// woke every 10 ms.)
#[test]
fn next_expiry_sets_no_recheck_for_waiting_outputs() {
    let d = dir("out-wait-recheck-ends");
    let mut h = budget_held_by_a_deferred_request(&d);
    let end = Instant::now() + T;
    while !h.c.try_wait().unwrap() {
        assert!(Instant::now() < end, "never idle: {:?}", h.c.stats());
        h.c.progress_now().unwrap();
        h.c.trigger().unwrap();
    }
    assert_eq!(h.c.outputs_waiting(), 1, "the output moved with its room held");
    assert_eq!(
        h.c.next_expiry(),
        None,
        "a recheck while the request holds the room"
    );
    drop(h.req.take());
    h.turn_until_finished("the output still waits", |c| {
        c.progress(Some(Duration::from_millis(10))).unwrap();
        c.trigger().unwrap();
    });
    let out = h.c.take_response::<Fill>(h.call).expect("finished").unwrap();
    assert!(out == fill_pattern(MIB, 7), "corrupted");
    // Eight 1 MiB outputs at once, room for one: the others wait for the
    // pulls in flight.
    let s = h.c.lookup(&h._srv.uri).unwrap();
    let mut probe = client(&d);
    let answered = fills_answered(&mut probe, &h._srv.uri);
    let ids: Vec<_> = (0..8u64)
        .map(|i| h.c.forward::<Fill>(&s, &(MIB, 20 + i)).unwrap())
        .collect();
    // Answered together while the client is not driven.
    wait_fills_answered(&mut probe, &h._srv.uri, answered + 8);
    let (mut looked, end) = (0u32, Instant::now() + T);
    while !ids.iter().all(|id| h.c.is_finished(*id)) {
        assert!(Instant::now() < end, "calls did not finish: {:?}", h.c.stats());
        h.c.progress_now().unwrap();
        h.c.trigger().unwrap();
        if h.c.outputs_waiting() > 0 {
            looked += 1;
            let at = h.c.next_expiry();
            assert!(
                at.is_none(),
                "a recheck {:?} ahead with no deferred request left ({:?})",
                at.map(|t| t.saturating_duration_since(Instant::now())),
                h.c.stats()
            );
        }
    }
    assert!(looked > 0, "no output waited: the test did not test it");
    for (i, id) in ids.into_iter().enumerate() {
        let out = h.c.take_response::<Fill>(id).expect("finished").unwrap();
        assert!(out == fill_pattern(MIB, 20 + i as u64), "call {i}: corrupted");
    }
    let _ = h.end_holder.send(());
    let _ = h.holder.join().unwrap();
}
