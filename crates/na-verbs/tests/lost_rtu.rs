//! A peer whose ready-to-use message (RTU) never reaches the listener: it
//! moves its own QP through its states (`rdma_init_qp_attr`) and never
//! calls `rdma_establish`, as when the RTU is lost on the wire. The
//! listening plugin must answer its first message (which establishes the
//! connection) instead of holding the reply until the set-up deadline
//! tears the connection down, and tell RDMA CM (`rdma_notify`), which
//! would otherwise resend its reply and finally report the peer
//! unreachable. One test in its own binary: it installs the global
//! `tracing` subscriber to see the listener's log.
//!
//! Without an RDMA device the RDMA part cannot run: the test says so
//! loudly (and checks the clear "no RDMA device" error).

mod common;

use std::net::{SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use common::raw_peer::{RawPeer, RawQp, SEND_WR};
use common::*;
use na_core::{Endpoint, OpId};

/// When the listener must have answered (far below the kernel CM's own
/// retries, a minute or more).
const LATEST: Duration = Duration::from_secs(8);

/// A peer that connects with a QP it moves through its states itself and
/// never sends the RTU (no `rdma_establish`), then sends one unexpected
/// message (tag 9, "ping") and returns the payload of the first message
/// it receives back.
fn peer_without_rtu(ip: std::net::Ipv4Addr, dst: SocketAddr) -> Vec<u8> {
    let peer = RawPeer::new(dst, "peer without RTU", 4096, RawQp::Own);
    let who = peer.who;
    // With a QP of its own, librdmacm hands the reply over instead of
    // answering it: no RTU goes out unless `rdma_establish` is called.
    peer.connect(&raw_connect_param(ip, 4));
    peer.send_unexpected(9, b"ping");
    let mut wc = peer.next_wc();
    // The send's completion, or (if the reply already came) the receive's.
    if wc.wr_id == SEND_WR {
        assert_ok(&[wc], who);
        wc = peer.next_wc();
    }
    assert!(wc.is_ok() && RawPeer::is_recv(&wc), "{who}: {wc:?}");
    peer.message(&wc, 4096).1
}

/// A peer whose RTU never comes (see [`peer_without_rtu`]): its message
/// establishes the connection, RDMA CM takes the `rdma_notify` (the
/// listener logs that it told it, which it does only when the call
/// succeeds), and the listener's reply, sent after the set-up deadline,
/// arrives. Without the first-message rule the reply would wait and the
/// connection be torn down at the deadline.
#[test]
fn a_peer_whose_rtu_never_comes_is_answered_and_rdma_cm_is_told() {
    let Some(env) = rdma_env("a_peer_whose_rtu_never_comes_is_answered_and_rdma_cm_is_told") else {
        return;
    };
    // The global subscriber, in a binary of this one test (see
    // CapturedLog::install_global).
    let log = na_testsuite::log::CapturedLog::install_global();
    let (mut srv, sid) = setup_plugin(&env, true, false);
    let port = port_of(srv.self_addr(sid).unwrap().uri());
    let dst = SocketAddr::V4(SocketAddrV4::new(env.ip, port));
    srv.post_recv_unexpected(sid, Vec::new(), OpId(1)).unwrap();
    let ip = env.ip;
    let peer = std::thread::spawn(move || peer_without_rtu(ip, dst));
    let wait_for = |srv: &mut Endpoint, op: OpId, peer: &std::thread::JoinHandle<Vec<u8>>| {
        let end = Instant::now() + LATEST;
        loop {
            assert!(Instant::now() < end, "{op:?} did not complete within {LATEST:?}");
            // A peer that failed says why (its panic), not our timeout.
            assert!(
                !peer.is_finished() || op != OpId(1),
                "the raw peer ended before its message came"
            );
            srv.progress(Some(Duration::from_millis(20))).unwrap();
            if let Some(c) = std::iter::from_fn(|| srv.pop_completion()).find(|c| c.op == op) {
                return c;
            }
        }
    };
    let req = wait_for(&mut srv, OpId(1), &peer);
    assert_eq!(req.buf.as_deref(), Some(&b"ping"[..]), "{:?}", req.status);
    let src = req.source.clone().expect("a request has a source");
    let past = Instant::now() + SETUP + SETUP / 2;
    while Instant::now() < past {
        srv.progress(Some(Duration::from_millis(20))).unwrap();
    }
    srv.send_expected(&src, 9, b"pong", OpId(2)).unwrap();
    let sent = wait_for(&mut srv, OpId(2), &peer);
    sent.status.as_ref().expect("the reply was sent");
    assert_eq!(peer.join().expect("peer thread"), b"pong");
    let st = srv.plugin(sid).unwrap().stats();
    assert_eq!(st.handshakes_refused, 0, "the connection was torn down: {st:?}");
    let text = log.text();
    assert!(
        text.contains("established by it, RDMA CM told"),
        "rdma_notify did not succeed; log:\n{text}"
    );
}
