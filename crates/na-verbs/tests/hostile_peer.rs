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
    assert!(
        why.contains("DISCONNECTED"),
        "the connection was not ended: {why}"
    );
}
