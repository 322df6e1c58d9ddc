//! Peers that stop in the middle of the RDMA CM handshake, built from the
//! sys layer (no plugin on their side): one connects and never completes
//! the handshake (librdmacm sends the final RTU only when the connecting
//! side reads its CM event), one listens and never answers a connect
//! request. The plugin must end either set-up at its own deadline
//! (`VerbsConfig::setup_timeout`), also while it sleeps, instead of
//! holding the connection for the kernel's retries (a minute or more).
//!
//! A third case is a handshake that completes for the peer but whose
//! end never reaches the listener (a lost ready-to-use message, RTU): the
//! first message the peer sends proves the connection, and the listener
//! must answer it instead of holding its reply until the set-up deadline
//! tears the connection down. Here the listener plugin ignores its
//! `Established` event (a test hook); `tests/lost_rtu.rs` has a raw peer
//! that really sends no RTU.
//!
//! Without an RDMA device the RDMA part cannot run: the tests say so loudly
//! (and check the clear "no RDMA device" error).

mod common;

use std::net::{SocketAddr, SocketAddrV4};
use std::os::fd::AsFd;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use na_core::{Endpoint, NaError, OpId};
use na_verbs::sys::*;

/// How long each blocking progress call may sleep: far beyond `SETUP`, so
/// only the plugin's own timer ends the sleep on time.
const SLEEP: Duration = Duration::from_secs(20);
/// When the deadline must have been acted on (the kernel's own retries
/// take a minute or more).
const LATEST: Duration = Duration::from_secs(8);

/// Connects to `dst` with a valid hello and then never reads its CM
/// channel, so the handshake is never completed; holds everything until
/// `stop` says so (or is dropped).
fn stall_connecting(ip: std::net::Ipv4Addr, dst: SocketAddr, stop: mpsc::Receiver<()>) {
    let who = "staller";
    let (_ch, id, ctx) = raw_resolved(dst, who);
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    let cq = CompletionQueue::new(&ctx, 16, None).expect("cq");
    let attr = small_qp_attr(&cq);
    let _qp = id.create_qp(&pd, attr).expect("rdma_create_qp");
    let param = raw_connect_param(ip, 4);
    id.connect(&param).expect("connect");
    let _ = stop.recv_timeout(WAIT);
}

/// A listener that gets a connect request and never accepts nor rejects
/// it: a plugin connecting to it must give up at its deadline.
#[test]
fn an_incoming_connection_that_stalls_is_torn_down_at_the_setup_deadline() {
    let Some(env) = rdma_env("an_incoming_connection_that_stalls_is_torn_down_at_the_setup_deadline") else {
        return;
    };
    let (mut ep, id) = setup_plugin(&env, true, false);
    let port = port_of(ep.self_addr(id).unwrap().uri());
    let dst = SocketAddr::V4(SocketAddrV4::new(env.ip, port));
    let (stop, stopped) = mpsc::channel();
    let ip = env.ip;
    let staller = std::thread::spawn(move || stall_connecting(ip, dst, stopped));
    // The connect request arrives: the connection is accepted and waits.
    let end = Instant::now() + WAIT;
    while ep.plugin(id).unwrap().stats().peers == 0 {
        assert!(Instant::now() < end, "the connect request never came");
        ep.progress(Some(Duration::from_millis(50))).unwrap();
    }
    let since = Instant::now();
    // Sleep on the endpoint's fd as an event loop does, far longer than
    // the deadline each time: the plugin's timer must wake it. (A
    // `progress` call would sleep its whole timeout: tearing down an
    // incoming set-up completes no operation.)
    while ep.plugin(id).unwrap().stats().handshakes_refused == 0 {
        assert!(
            since.elapsed() < LATEST,
            "the stalled set-up was kept past {LATEST:?}: {:?}",
            ep.plugin(id).unwrap().stats()
        );
        if ep.try_wait().expect("try_wait") {
            poll_readable(ep.as_fd(), Some(SLEEP)).expect("poll on the endpoint");
        }
        ep.progress(Some(Duration::ZERO)).unwrap();
    }
    let took = since.elapsed();
    eprintln!("stalled incoming set-up ended after {took:?} (deadline {SETUP:?})");
    assert!(took < LATEST, "the sleeper woke only after {took:?}");
    let st = ep.plugin(id).unwrap().stats();
    assert_eq!(st.peers, 0, "the stalled connection still counts: {st:?}");
    assert_eq!(st.protocol_errors, 0, "a stall is not a protocol error: {st:?}");
    stop.send(()).ok();
    staller.join().expect("staller thread");
}

/// A plugin sends to a listener that never answers the connect request:
/// the send fails with `PeerGone` at the set-up deadline.
#[test]
fn a_connection_to_a_listener_that_never_answers_fails_at_the_setup_deadline() {
    let Some(env) = rdma_env("a_connection_to_a_listener_that_never_answers_fails_at_the_setup_deadline")
    else {
        return;
    };
    let ch = EventChannel::new().expect("event channel");
    let listener = CmId::new(&ch, PortSpace::Tcp).expect("cm id");
    listener
        .bind(SocketAddr::V4(SocketAddrV4::new(env.ip, 0)))
        .expect("bind");
    listener.listen(4).expect("listen");
    let port = listener.local_addr().expect("bound address").port();
    let (mut ep, id) = setup_plugin(&env, false, false);
    let uri = format!("verbs://{}/{}:{port}", env.device, env.ip);
    let to = ep.lookup(&uri).expect("lookup");
    let start = Instant::now();
    ep.send_unexpected(&to, 1, b"hello?", OpId(7))
        .expect("the send is queued");
    let done = loop {
        assert!(
            start.elapsed() < LATEST,
            "the send still waits after {LATEST:?}: {:?}",
            ep.plugin(id).unwrap().stats()
        );
        ep.progress(Some(SLEEP)).unwrap();
        if let Some(c) = std::iter::from_fn(|| ep.pop_completion()).find(|c| c.op == OpId(7)) {
            break c;
        }
    };
    let took = start.elapsed();
    eprintln!(
        "send to a silent listener failed after {took:?}: {:?}",
        done.status
    );
    match done.status {
        Err(NaError::PeerGone { reason, .. }) => {
            assert!(reason.contains("set-up did not finish"), "{reason}")
        }
        other => panic!("expected PeerGone, got {other:?}"),
    }
    assert!(
        took >= SETUP && took < LATEST,
        "failed after {took:?}, deadline {SETUP:?}"
    );
    assert_eq!(ep.plugin(id).unwrap().stats().peers, 0);
    // The connect request did reach the listener (and was left unanswered).
    let ev = wait_cm(&ch, CmEventKind::ConnectRequest, "listener");
    drop(ev);
}

/// The listener never sees `Established` for a connection (as when the
/// peer's ready-to-use message is lost: RDMA CM would report it only after
/// resending its reply, seconds later). The client's first message
/// establishes the connection: the listener's reply, sent after the
/// set-up deadline has passed, arrives, and nothing was torn down.
#[test]
fn a_listener_that_misses_the_established_event_answers_the_first_message() {
    let Some(env) = rdma_env("a_listener_that_misses_the_established_event_answers_the_first_message") else {
        return;
    };
    let (mut srv, sid) = setup_plugin(&env, true, true);
    let (mut cli, cid) = setup_plugin(&env, false, false);
    let to = cli.lookup(srv.self_addr(sid).unwrap().uri()).expect("lookup");
    srv.post_recv_unexpected(sid, Vec::new(), OpId(1)).unwrap();
    cli.post_recv_expected(&to, 9, Vec::new(), OpId(2)).unwrap();
    cli.send_unexpected(&to, 9, b"ping", OpId(3)).unwrap();
    let drive = |srv: &mut Endpoint, cli: &mut Endpoint, want: OpId, on_srv: bool| {
        let end = Instant::now() + LATEST;
        loop {
            assert!(
                Instant::now() < end,
                "{want:?} did not complete within {LATEST:?}"
            );
            srv.progress(Some(Duration::ZERO)).unwrap();
            cli.progress(Some(Duration::ZERO)).unwrap();
            let ep = if on_srv { &mut *srv } else { &mut *cli };
            if let Some(c) = std::iter::from_fn(|| ep.pop_completion()).find(|c| c.op == want) {
                return c;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    let req = drive(&mut srv, &mut cli, OpId(1), true);
    assert_eq!(req.buf.as_deref(), Some(&b"ping"[..]), "{:?}", req.status);
    let src = req.source.clone().expect("a request has a source");
    // Past the set-up deadline: a connection still waiting for its
    // established event would be torn down now.
    let past = Instant::now() + SETUP + SETUP / 2;
    while Instant::now() < past {
        srv.progress(Some(Duration::from_millis(20))).unwrap();
        cli.progress(Some(Duration::ZERO)).unwrap();
    }
    srv.send_expected(&src, 9, b"pong", OpId(4)).unwrap();
    let sent = drive(&mut srv, &mut cli, OpId(4), true);
    sent.status.as_ref().expect("the reply was sent");
    let reply = drive(&mut srv, &mut cli, OpId(2), false);
    assert_eq!(reply.buf.as_deref(), Some(&b"pong"[..]), "{:?}", reply.status);
    let st = srv.plugin(sid).unwrap().stats();
    assert_eq!(st.handshakes_refused, 0, "the connection was torn down: {st:?}");
    assert_eq!(st.peers, 1, "{st:?}");
    assert_eq!(cli.plugin(cid).unwrap().stats().peers, 1);
}

/// A connector that never sends its ready-to-use message (RTU) nor any
/// message: the listener's side of the connection is accepted and never
/// established, and the set-up deadline ends it. The peer is rejected
/// (by the kernel's CM as the listener destroys the id: no reason), and
/// neither side blocks. An `rdma_reject` of the listener's own at that
/// point, which would carry a reason, left the reply MAD outstanding and
/// blocked both sides' `rdma_destroy_id` (the listener's in `progress`)
/// for 75 s, past this test's bound.
#[test]
fn an_accepted_connection_ended_before_it_is_established_is_rejected_without_blocking() {
    let test = "an_accepted_connection_ended_before_it_is_established_is_rejected_without_blocking";
    let Some(env) = rdma_env(test) else {
        return;
    };
    let (mut ep, id) = setup_plugin(&env, true, false);
    let port = port_of(ep.self_addr(id).unwrap().uri());
    let dst = SocketAddr::V4(SocketAddrV4::new(env.ip, port));
    let ip = env.ip;
    let peer = std::thread::spawn(move || {
        use common::raw_peer::{RawPeer, RawQp};
        let peer = RawPeer::new(dst, "peer without RTU", 64, RawQp::Own);
        peer.connect(&raw_connect_param(ip, 4));
        // Nothing more: the listener waits for the RTU or a message.
        next_cm(&peer.ch)
        // (The peer's id is destroyed here.)
    });
    let start = Instant::now();
    while !peer.is_finished() {
        assert!(
            start.elapsed() < 2 * WAIT,
            "the raw peer never heard from the listener"
        );
        ep.progress(Some(Duration::from_millis(20))).unwrap();
    }
    let ev = peer.join().expect("raw peer thread");
    let took = start.elapsed();
    eprintln!(
        "{test}: the raw peer got {} and was gone after {took:?}",
        ev.kind.name()
    );
    assert_eq!(ev.kind, CmEventKind::Rejected, "status {}", ev.status);
    // Far beyond the 1 s deadline and a loaded VM's delays, far short of
    // the blocked destroy.
    assert!(
        took < 2 * WAIT,
        "a side blocked tearing the connection down: {took:?}"
    );
    let st = ep.plugin(id).unwrap().stats();
    assert_eq!(st.handshakes_refused, 1, "{st:?}");
}
