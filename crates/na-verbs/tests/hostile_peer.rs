//! A peer that breaks the verbs plugin's protocol on purpose, built from
//! the sys layer and the wire format (no plugin on its side): it connects
//! with a valid hello, then sends without waiting for credits, paced so
//! the listener's reposts keep up. The listening plugin must count
//! the credits it gave, cut the connection at the first message beyond
//! them, and hold no more than its bound.
//!
//! Without an RDMA device the RDMA part cannot run: the test says so loudly
//! (and checks the clear "no RDMA device" error).

mod common;

use common::flood::*;
use common::raw_peer::{RawPeer, RawQp};
use common::*;

/// Runs the flooder (its hello naming `hello_ip`) against a new listening
/// plugin that posts no receive; returns what each side saw.
fn against_listener(
    env: &RdmaEnv,
    hello_ip: std::net::Ipv4Addr,
    attack: Attack,
) -> (Flood, na_core::PluginStats) {
    let (mut ep, id) = listener(env);
    let seen = attack_listener(env, &mut ep, id, hello_ip, attack);
    let st = ep.plugin(id).unwrap().stats();
    eprintln!(
        "flooder: {} of {FLOOD} delivered, stopped by {:?}; listener: protocol_errors {} queued_arrivals {}",
        seen.delivered, seen.stopped_by, st.protocol_errors, st.queued_arrivals
    );
    (seen, st)
}

#[test]
fn a_peer_that_ignores_its_credits_is_cut_off_and_holds_are_bounded() {
    let Some(env) = rdma_env("a_peer_that_ignores_its_credits_is_cut_off_and_holds_are_bounded") else {
        return;
    };
    let (seen, st) = against_listener(&env, env.ip, Attack::Flood);
    assert!(st.protocol_errors >= 1, "the violation was not noticed: {st:?}");
    assert!(
        seen.stopped_by.is_some() && seen.delivered < FLOOD,
        "the flooder was never cut off ({} delivered)",
        seen.delivered
    );
    let bound = u64::from(MAX_HELD) + 2 * u64::from(DEPTH);
    assert!(
        st.queued_arrivals <= bound,
        "{} messages held, bound {bound}",
        st.queued_arrivals
    );
}

/// A hello is a claim of identity: the address it names must be the one
/// the connection comes from, or a peer could pass for another (take its
/// replies, or make it look dead by disconnecting).
#[test]
fn a_hello_naming_another_address_is_rejected() {
    let Some(env) = rdma_env("a_hello_naming_another_address_is_rejected") else {
        return;
    };
    let other = std::net::Ipv4Addr::new(10, 77, 0, 99);
    assert_ne!(other, env.ip);
    let (seen, st) = against_listener(&env, other, Attack::Flood);
    let why = seen.stopped_by.unwrap_or_default();
    assert!(
        seen.delivered == 0 && why.contains("REJECTED"),
        "a spoofed hello was accepted: {why:?}, {} delivered",
        seen.delivered
    );
    assert!(st.protocol_errors >= 1, "{st:?}");
    assert_eq!(st.peers, 0, "a peer was recorded for a refused hello: {st:?}");
}

/// We never send RDMA WRITE with immediate; one from a peer consumes a
/// receive buffer: a protocol violation that ends the connection (the
/// buffer was silently lost before).
#[test]
fn a_write_with_immediate_is_a_protocol_violation() {
    let Some(env) = rdma_env("a_write_with_immediate_is_a_protocol_violation") else {
        return;
    };
    let (seen, st) = against_listener(&env, env.ip, Attack::WriteWithImm);
    assert!(st.protocol_errors >= 1, "not noticed: {st:?}");
    let why = seen.stopped_by.unwrap_or_default();
    assert!(ended_after_connect(&why), "the connection was not ended: {why}");
}

/// Receive buffers of [`small_receiver`]: a header and this many bytes.
const SMALL: usize = 8;

/// A raw peer whose hello promises 4096-byte messages but whose receives
/// hold [`SMALL`] bytes of payload: it sends one unexpected message
/// ("ping", tag 9) and returns the status of its first receive (the
/// listener's reply, too long for it) or of a failed send.
fn small_receiver(ip: std::net::Ipv4Addr, dst: std::net::SocketAddr) -> String {
    let peer = RawPeer::new(dst, "small receiver", SMALL, RawQp::Cm);
    peer.connect(&raw_connect_param(ip, 4));
    peer.send_unexpected(9, b"ping");
    loop {
        let wc = peer.next_wc();
        if RawPeer::is_recv(&wc) || !wc.is_ok() {
            return format!("work request {}: {}", wc.wr_id, wc.status_str());
        }
    }
}

/// A send the peer's receive buffer cannot hold fails on the device with
/// a status other than a flush, a retry or RNR exhaustion, or a remote
/// access error (soft-RoCE: "remote operation error"): the connection
/// goes, and the send ends as `PeerGone` naming its own length and the
/// device's status (it was reported as an RMA failure of `byte_len`
/// bytes, a field that is undefined for send completions).
#[test]
fn a_send_the_peer_cannot_receive_fails_as_peer_gone_with_its_length() {
    use na_core::{Endpoint, NaError, OpId};
    use std::time::{Duration, Instant};
    let Some(env) = rdma_env("a_send_the_peer_cannot_receive_fails_as_peer_gone_with_its_length") else {
        return;
    };
    let (mut srv, sid) = plugin_with(&env, true, |_| {});
    let port = port_of(srv.self_addr(sid).unwrap().uri());
    let dst = std::net::SocketAddr::V4(std::net::SocketAddrV4::new(env.ip, port));
    srv.post_recv_unexpected(sid, Vec::new(), OpId(1)).unwrap();
    let ip = env.ip;
    let peer = std::thread::spawn(move || small_receiver(ip, dst));
    let wait_for = |srv: &mut Endpoint, op: OpId| {
        let end = Instant::now() + WAIT;
        loop {
            assert!(Instant::now() < end, "{op:?} did not complete within {WAIT:?}");
            srv.progress(Some(Duration::from_millis(20))).unwrap();
            if let Some(c) = std::iter::from_fn(|| srv.pop_completion()).find(|c| c.op == op) {
                return c;
            }
        }
    };
    let req = wait_for(&mut srv, OpId(1));
    assert_eq!(req.buf.as_deref(), Some(&b"ping"[..]), "{:?}", req.status);
    let src = req.source.clone().expect("a request has a source");
    let reply = vec![7u8; 1024];
    srv.send_unexpected(&src, 9, &reply, OpId(2)).unwrap();
    let sent = wait_for(&mut srv, OpId(2));
    let seen = peer.join().expect("small receiver thread");
    let err = sent
        .status
        .expect_err("a reply the peer cannot hold was reported sent");
    eprintln!("listener's send: {}; peer: {seen}", na_core::ErrorChain(&err));

    assert!(matches!(err, NaError::PeerGone { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("send of 1024 bytes failed"), "{msg}");
    assert!(
        !msg.contains("flush"),
        "the send's own status is not named: {msg}"
    );
}
