//! hg-rpc over na-sm with a separate server process (`hg-rpc-testpeer`):
//! typed calls and their errors, one-way calls, many in flight, self-forwards,
//! a server killed mid-call, hostile input, several contexts. (Spilled
//! arguments: `spilled_args.rs`; bulk transfers: `bulk_transfers.rs`.)

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use hg_rpc::{Rpc, RpcError};
use na_core::OpId;
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{assert_refused_at_start, client, dir, posted_ops, Server};

const T: Duration = Duration::from_secs(10);

/// Same name as `test.add` with another input type: the server cannot decode it.
struct AddWrongType;
impl Rpc for AddWrongType {
    const NAME: &'static str = "test.add";
    type Input = String;
    type Output = u64;
}

/// The name of the engine's own release message.
struct Reserved;
impl Rpc for Reserved {
    const NAME: &'static str = "hg.release-output";
    type Input = ();
    type Output = ();
}

/// Registered nowhere.
struct Missing;
impl Rpc for Missing {
    const NAME: &'static str = "test.missing";
    type Input = ();
    type Output = ();
}

#[test]
fn typed_calls_and_each_kind_of_error() {
    let d = dir("typed");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    assert_eq!(c.call::<Add>(&s, &(40, 2), T).unwrap(), 42);
    assert_eq!(
        c.call::<Echo>(&s, &ByteBuf::from(b"hello".to_vec()), T).unwrap(),
        b"hello"
    );
    match c.call::<Fail>(&s, &"boom".to_string(), T) {
        Err(RpcError::Handler { message, .. }) => assert_eq!(message, "boom"),
        other => panic!("expected a handler error, got {other:?}"),
    }
    match c.call::<Add>(&s, &(u64::MAX, 1), T) {
        Err(RpcError::Handler { message, .. }) => assert_eq!(message, "overflow"),
        other => panic!("expected a handler error, got {other:?}"),
    }
    assert!(matches!(
        c.call::<Missing>(&s, &(), T),
        Err(RpcError::UnknownRpc { .. })
    ));
    assert!(matches!(
        c.call::<AddWrongType>(&s, &"x".repeat(40), T),
        Err(RpcError::Decode { what: "input", .. })
    ));
    // Inputs and outputs just over the eager size spill both ways.
    assert_eq!(
        c.call::<Echo>(&s, &ByteBuf::from(vec![3; 5000]), T).unwrap(),
        vec![3; 5000]
    );
    // The server still serves after all of that.
    assert_eq!(c.call::<Add>(&s, &(1, 2), T).unwrap(), 3);
    let st = c.stats();
    assert_eq!(st.in_flight, 0);
    assert!(st.errors >= 4, "{st:?}");
}

#[test]
fn timeout_then_late_response_is_discarded() {
    let d = dir("timeout");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let t0 = Instant::now();
    // The handler sleeps 2 s: a call that waited for it (instead of timing
    // out after 100 ms) takes that long; the margin absorbs a loaded machine.
    match c.call::<Sleep>(&s, &2000, Duration::from_millis(100)) {
        Err(RpcError::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(
        t0.elapsed() < Duration::from_millis(1500),
        "timeout took {:?}",
        t0.elapsed()
    );
    // The next call gets its own answer, not the late one.
    assert_eq!(c.call::<Add>(&s, &(5, 6), T).unwrap(), 11);
}

#[test]
fn one_way_calls_arrive() {
    let d = dir("oneway");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    for i in 1..=100u64 {
        c.forward_one_way::<Record>(&s, &i).unwrap();
    }
    // Requests from one origin are served in order, so Count sees all 100.
    assert_eq!(c.call::<Count>(&s, &(), T).unwrap(), (100, 5050));
}

#[test]
fn ten_thousand_calls_with_a_thousand_in_flight() {
    let d = dir("many");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let (total, window) = (10_000u64, 1_000usize);
    let mut inflight = std::collections::VecDeque::new();
    let (mut next, mut done) = (0u64, 0u64);
    let deadline = Instant::now() + Duration::from_secs(60);
    while done < total {
        while next < total && inflight.len() < window {
            inflight.push_back((next, c.forward::<Add>(&s, &(next, 1)).unwrap()));
            next += 1;
        }
        assert!(Instant::now() < deadline, "only {done} of {total} calls finished");
        c.progress(Some(Duration::from_millis(100))).unwrap();
        c.trigger().unwrap();
        while let Some(&(i, id)) = inflight.front() {
            match c.take_response::<Add>(id) {
                Some(r) => {
                    assert_eq!(r.unwrap(), i + 1);
                    inflight.pop_front();
                    done += 1;
                }
                None => break,
            }
        }
    }
    assert_eq!(c.stats().in_flight, 0);
    // Every receive buffer a response used is posted again: all 64 (plus
    // the watch on the server).
    assert_eq!(posted_ops(&mut c), c.posted_receives() as u64 + 1);
}

#[test]
fn self_forward_runs_the_handler_without_the_network() {
    let d = dir("self");
    let mut c = client(&d);
    c.register::<Add>(|(a, b)| Ok(a * 10 + b)).unwrap();
    let me = c.self_addr().clone();
    assert_eq!(c.call::<Add>(&me, &(4, 2), T).unwrap(), 42);
    // "Wait forever" as the largest timeout is a timeout, not an overflow.
    assert_eq!(c.call::<Add>(&me, &(1, 3), Duration::MAX).unwrap(), 13);
    assert!(matches!(
        c.call::<Missing>(&me, &(), T),
        Err(RpcError::UnknownRpc { .. })
    ));
    // Registration errors.
    assert!(matches!(
        c.register::<Add>(|_| Ok(0)),
        Err(RpcError::Registration { .. })
    ));
    assert!(matches!(
        c.register::<AddWrongType>(|_| Ok(0)),
        Err(RpcError::Registration { .. })
    ));
    // The engine's own message: a handler there would never run, and
    // its callers would wait out their timeout.
    match c.register::<Reserved>(|()| Ok(())) {
        Err(RpcError::Registration { reason, .. }) => {
            assert!(reason.contains("keeps for itself"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert!(c.register_deferred::<Reserved>().is_err());
}

#[test]
fn server_killed_mid_call_fails_the_call_before_its_timeout() {
    let d = dir("kill");
    let mut srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    assert_eq!(c.call::<Add>(&s, &(1, 1), T).unwrap(), 2);
    // Several calls in flight (the server runs them one after another):
    // the peer's end must fail every one of them.
    let ids: Vec<_> = (0..3).map(|_| c.forward::<Sleep>(&s, &10_000).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    srv.child.kill().unwrap();
    let t0 = Instant::now();
    for id in ids {
        let r = loop {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "no error within 5 s of the kill"
            );
            if let Some(r) = c.take_response::<Sleep>(id) {
                break r;
            }
            c.progress(Some(Duration::from_millis(100))).unwrap();
            c.trigger().unwrap();
        };
        assert!(matches!(r, Err(RpcError::Transport(_))), "{r:?}");
    }
    assert_eq!(c.stats().in_flight, 0);
}

#[test]
fn hostile_input_gets_no_crash_and_the_server_keeps_serving() {
    let d = dir("hostile");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let mut good = Vec::new();
    hg_rpc::header::Header {
        flags: hg_rpc::header::FLAG_CHECKSUM,
        status: hg_rpc::header::Status::Ok,
        rpc_id: hg_rpc::rpc_id(Add::NAME),
        cookie: 7,
        payload_len: 0,
        checksum: 0,
    }
    .encode_with(&[1, 2], &mut good);
    let mut huge_len = good.clone();
    huge_len[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut bad_sum = good.clone();
    *bad_sum.last_mut().unwrap() ^= 1;
    let garbage: Vec<Vec<u8>> = vec![
        Vec::new(),
        b"garbage".to_vec(),
        good[..20].to_vec(),
        huge_len,
        bad_sum,
        (0..4000u32).map(|i| (i * 7) as u8).collect(),
    ];
    for (i, g) in garbage.iter().enumerate() {
        c.endpoint()
            .send_unexpected(&s, 0, g, OpId(1 << 50 | i as u64))
            .unwrap();
    }
    assert_eq!(c.call::<Add>(&s, &(20, 22), T).unwrap(), 42);
    assert_eq!(
        c.call::<Echo>(&s, &ByteBuf::from(vec![9; 1000]), T).unwrap(),
        vec![9; 1000]
    );
}

/// Several contexts: the server runs three engines (threads, one address
/// each), the client two (threads); every client context calls every
/// server context concurrently and each response reaches the context that
/// made the call.
#[test]
fn several_contexts_on_both_sides() {
    let d = dir("contexts");
    let mut child = common::testpeer()
        .env("QS_SM_DIR", &d)
        .env("HG_TESTPEER_CONTEXTS", "3")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut uris = Vec::new();
    for _ in 0..3 {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let (ctx, uri) = match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["CTX", i, uri] => (i.parse::<u64>().unwrap(), uri.to_owned()),
            ["ADDR", uri] => (0, uri.to_owned()),
            _ => panic!("unexpected line {line:?}"),
        };
        uris.push((ctx, uri));
    }
    let _srv = Server {
        child,
        uri: uris[2].1.clone(),
        log: None,
    };
    let threads: Vec<_> = (0..2u64)
        .map(|me| {
            let (d, uris) = (d.to_path_buf(), uris.clone());
            std::thread::spawn(move || {
                let mut c = client(&d);
                for round in 0..200u64 {
                    for (want, uri) in &uris {
                        let s = c.endpoint().lookup(uri).unwrap();
                        let token = me * 1_000_000 + round;
                        let (ctx, echoed) = c.call::<WhoAmI>(&s, &token, T).unwrap();
                        assert_eq!(echoed, token, "a response reached the wrong origin context");
                        assert_eq!(ctx, *want, "the call ran in the wrong target context");
                    }
                }
                c.stats().calls
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), 600);
    }
}

#[test]
fn a_bad_receive_mode_variable_is_a_clear_error_at_start() {
    for (value, why) in [
        ("pulled", "expected pull or posted"),
        ("", "expected pull or posted"),
    ] {
        let d = dir("bad-recv-mode");
        assert_refused_at_start(&d, hg_rpc::engine::RECV_MODE_ENV, value, why);
    }
    // Both valid values start a server that answers.
    for value in ["pull", "posted"] {
        let d = dir(&format!("recv-mode-{value}"));
        let server = Server::with_envs(&[
            ("QS_SM_DIR", d.as_os_str()),
            (hg_rpc::engine::RECV_MODE_ENV, value.as_ref()),
        ]);
        let mut c = client(&d);
        let s = c.endpoint().lookup(&server.uri).unwrap();
        assert_eq!(
            c.call::<Add>(&s, &(2, 3), T).unwrap(),
            5,
            "server in {value} mode"
        );
    }
}
