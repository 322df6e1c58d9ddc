//! Peer death: every operation involving a killed peer completes with an
//! error, nothing hangs, and the survivor keeps serving others.

use std::time::{Duration, Instant};

use na_core::{NaError, OpId, ProgressMode};

use crate::{Node, PeerProc, Transport};

/// The server is SIGKILLed under echo traffic with receives posted that it
/// will never answer: each completes once, with `PeerGone` for the
/// receives, within the timeout; new sends are refused.
pub fn server_killed(t: &Transport) {
    server_killed_under(t, ProgressMode::Blocking);
}

/// [`server_killed`] with a busy-polling client, which never sleeps: it must
/// notice the death while it spins.
pub fn server_killed_busy(t: &Transport) {
    server_killed_under(t, ProgressMode::Busy);
}

fn server_killed_under(t: &Transport, mode: ProgressMode) {
    let mut server = PeerProc::spawn(t, &["server"]);
    let mut n = Node::new(t, mode, false);
    let addr = n.ep.lookup(&server.uri).expect("lookup");
    let never: Vec<OpId> = (0..100)
        .map(|i| {
            let op = n.op();
            n.ep.post_recv_expected(&addr, 50_000 + i, Vec::new(), op)
                .expect("post");
            op
        })
        .collect();
    let mut flood = Vec::new();
    for i in 0..400u32 {
        let (r, s) = (n.op(), n.op());
        n.ep.post_recv_expected(&addr, i, Vec::new(), r).expect("post");
        n.ep.send_unexpected(&addr, i, &[b'e'; 512], s).expect("send");
        flood.push((r, s));
    }
    n.wait(flood[10].0).status.expect("early echo");
    server.kill();
    let start = Instant::now();
    for op in never {
        let e = n.wait(op).status.expect_err("a receive from a dead peer");
        assert!(matches!(e, NaError::PeerGone { .. }), "{e}");
    }
    for (r, s) in flood.into_iter().skip(11) {
        let _ = n.wait(r);
        let _ = n.wait(s);
    }
    eprintln!(
        "{} ({mode}): every operation completed {:?} after the kill",
        t.name,
        start.elapsed()
    );
    assert!(start.elapsed() < t.timeout);
    let op = n.op();
    match n.ep.send_unexpected(&addr, 1, b"x", op) {
        Err(e) => assert!(matches!(e, NaError::PeerGone { .. }), "{e}"),
        Ok(()) => panic!("a send to a peer known dead must be refused"),
    }
    assert_eq!(n.stats().in_flight, 0);
    assert_eq!(n.stats().peers, 0);
}

/// A client is SIGKILLed mid-traffic while the server has a receive posted
/// that only it could satisfy: the receive fails with `PeerGone`, and a new
/// client is served normally.
pub fn client_killed(t: &Transport) {
    let mut n = Node::new(t, ProgressMode::default(), true);
    let me = n.ep.self_addr(n.id).expect("self").uri().to_owned();
    let mut victim = PeerProc::spawn(t, &["client", &me, "1000000"]);
    let mut served = 0;
    let (_, victim_addr) = n.serve_echo(t.timeout, || {
        served += 1;
        served > 200
    });
    let victim_addr = victim_addr.expect("the victim sent something");
    assert_eq!(n.stats().peers, 1);
    let r = n.op();
    n.ep.post_recv_expected(&victim_addr, u32::MAX, Vec::new(), r)
        .expect("post");
    victim.kill();
    let e = n.wait(r).status.expect_err("a receive from a dead client");
    assert!(matches!(e, NaError::PeerGone { .. }), "{e}");
    let mut honest = PeerProc::spawn(t, &["client", &me, "500"]);
    n.serve_echo(t.timeout * 3, || honest.exited());
    assert!(
        honest.wait(Duration::from_secs(1)),
        "the next client failed after a peer died"
    );
    assert_eq!(honest.line(t.timeout), "CLIENT OK 500");
}
