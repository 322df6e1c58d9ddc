//! A peer whose largest message is 0 bytes (`VerbsConfig::max_msg_size`
//! 0: it takes empty messages only) says so in its hello, and a 0 there
//! is a size, not "unknown": a longer message to it fails alone with
//! `MessageTooLarge`, whether it was queued before the connection knew
//! the peer's size or sent after, and empty messages still go through.
//! Before, a 0 was taken as "unknown": the message went out, the peer
//! took it as a protocol violation and the connection died.
//!
//! Without an RDMA device the RDMA part cannot run: the test says so
//! loudly (and checks the clear "no RDMA device" error).

mod common;

use std::time::{Duration, Instant};

use common::*;
use na_core::{Completion, Endpoint, NaError, OpId};

/// Drives both sides until `cli` has a completion; returns it.
fn next_completion(srv: &mut Endpoint, cli: &mut Endpoint) -> Completion {
    let end = Instant::now() + WAIT;
    loop {
        assert!(Instant::now() < end, "no completion within {WAIT:?}");
        srv.progress(Some(Duration::from_millis(5))).unwrap();
        cli.progress(Some(Duration::from_millis(5))).unwrap();
        if let Some(c) = cli.pop_completion() {
            return c;
        }
    }
}

fn assert_too_large(status: Result<(), NaError>, when: &str) {
    match status {
        Err(NaError::MessageTooLarge { len: 1, max: 0, .. }) => {}
        other => panic!("a 1-byte message to a peer that takes 0 bytes, {when}: {other:?}"),
    }
}

#[test]
fn a_peers_zero_max_msg_size_is_a_size_not_unknown() {
    let Some(env) = rdma_env("a_peers_zero_max_msg_size_is_a_size_not_unknown") else {
        return;
    };
    let (mut srv, sid) = plugin_with(&env, true, |cfg| cfg.max_msg_size = 0);
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    let (mut cli, _) = plugin_with(&env, false, |_| {});
    let dest = cli.lookup(&uri).unwrap();
    // Queued while connecting: the peer's size is not known yet.
    cli.send_unexpected(&dest, 1, &[7], OpId(1)).unwrap();
    cli.send_unexpected(&dest, 2, &[], OpId(2)).unwrap();
    srv.post_recv_unexpected(sid, Vec::new(), OpId(10)).unwrap();
    let first = next_completion(&mut srv, &mut cli);
    assert_eq!(first.op, OpId(1));
    assert_too_large(first.status, "queued before the connection was up");
    let second = next_completion(&mut srv, &mut cli);
    assert_eq!(second.op, OpId(2));
    second.status.expect("an empty message");
    // Once connected the size is known at the call.
    assert_too_large(cli.send_unexpected(&dest, 3, &[7], OpId(3)), "once connected");
    // The empty message arrived, and the connection still works.
    let end = Instant::now() + WAIT;
    let got = loop {
        assert!(Instant::now() < end, "the listener never got the empty message");
        srv.progress(Some(Duration::from_millis(5))).unwrap();
        cli.progress(Some(Duration::from_millis(5))).unwrap();
        if let Some(c) = srv.pop_completion() {
            break c;
        }
    };
    assert_eq!((got.op, got.tag), (OpId(10), 2));
    got.status.expect("the empty message");
    cli.send_unexpected(&dest, 4, &[], OpId(4)).unwrap();
    let fourth = next_completion(&mut srv, &mut cli);
    assert_eq!(fourth.op, OpId(4));
    fourth
        .status
        .expect("another empty message on the same connection");
    let st = srv.plugin(sid).unwrap().stats();
    assert_eq!((st.violations, st.protocol_errors), (0, 0), "{st:?}");
}
