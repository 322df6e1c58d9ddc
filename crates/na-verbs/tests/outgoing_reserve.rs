//! Incoming connections share the connection limit with our own outgoing
//! ones, and nothing closes an idle incoming connection: without a
//! reserve, peers that connect and stay idle take every slot, and the
//! listener can no longer call anyone. `VerbsConfig::outgoing_reserve`
//! keeps slots for outgoing connections: once incoming ones fill their
//! share, the next one is rejected with a reason its connecting side
//! names, and counted in `PluginStats::handshakes_refused`, while the
//! listener's own lookup of another listener still connects. The same
//! scenario without a reserve (`Some(0)`) is the negative control: there
//! the listener's outgoing connection fails at the limit.
//!
//! Without an RDMA device the RDMA part cannot run: the test says so
//! loudly (and checks the clear "no RDMA device" error).

mod common;

use std::time::{Duration, Instant};

use common::*;
use na_core::{Completion, Endpoint, NaError, OpId, OpKind, PluginId};

/// The server's `max_conns`: the default reserve is then 1 slot.
const MAX_CONNS: usize = 4;

/// Progresses every endpoint until `eps[who]` yields a completion.
fn drive_until(eps: &mut [&mut Endpoint], who: usize, what: &str) -> Completion {
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < WAIT, "{what}: no completion within {WAIT:?}");
        for ep in eps.iter_mut() {
            ep.progress(Some(Duration::from_millis(5))).unwrap();
        }
        if let Some(c) = eps[who].pop_completion() {
            return c;
        }
    }
}

/// A client whose set-up deadline is far past the test's waits.
fn client(env: &RdmaEnv) -> (Endpoint, PluginId) {
    plugin_with(env, false, |cfg| cfg.setup_timeout = 4 * WAIT)
}

/// The listener's outcome with `reserve`: fills its incoming share with
/// idle clients (each sends one message, which the server holds), checks
/// what the next incoming connection gets, then sends to another listener
/// and returns how that send ended.
fn scenario(env: &RdmaEnv, reserve: Option<usize>) -> Result<(), NaError> {
    let (mut srv, sid) = plugin_with(env, true, |cfg| {
        cfg.max_conns = MAX_CONNS;
        cfg.outgoing_reserve = reserve;
        cfg.setup_timeout = 4 * WAIT;
    });
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    let share = MAX_CONNS - na_verbs::config::outgoing_reserve(MAX_CONNS, reserve);
    // Idle peers: connected, one message each, then nothing.
    let mut idle = Vec::new();
    for i in 0..share {
        let (mut cli, _) = client(env);
        let dest = cli.lookup(&uri).unwrap();
        cli.send_unexpected(&dest, 7, b"idle", OpId(1)).unwrap();
        let done = drive_until(&mut [&mut cli, &mut srv], 0, "an idle peer's send");
        assert!(
            done.status.is_ok(),
            "reserve {reserve:?}: idle peer {i} of {share} was not let in: {:?}",
            done.status
        );
        idle.push(cli);
    }
    let refused_before = srv.plugin(sid).unwrap().stats().handshakes_refused;
    // One more incoming connection: past the share (or, without a
    // reserve, the whole limit).
    let (mut extra, _) = client(env);
    let dest = extra.lookup(&uri).unwrap();
    extra.send_unexpected(&dest, 7, b"one too many", OpId(2)).unwrap();
    let done = drive_until(&mut [&mut extra, &mut srv], 0, "the extra peer's send");
    assert_eq!((done.op, done.kind), (OpId(2), OpKind::SendUnexpected));
    let want = if share < MAX_CONNS {
        "too many incoming connections"
    } else {
        "too many connections"
    };
    match &done.status {
        Err(NaError::PeerGone { reason, .. }) => assert!(
            reason.contains("rejected") && reason.contains(want),
            "reserve {reserve:?}: the reject did not carry the listener's reason `{want}`: {reason}"
        ),
        other => panic!("reserve {reserve:?}: the connection past the incoming share: {other:?}"),
    }
    let st = srv.plugin(sid).unwrap().stats();
    assert_eq!(
        st.handshakes_refused,
        refused_before + 1,
        "reserve {reserve:?}: the refused connection was not counted: {st:?}"
    );
    assert_eq!(
        st.protocol_errors, 0,
        "a full listener counted as the peer's fault: {st:?}"
    );
    // Our own call out, to another listener, with the idle peers still
    // connected.
    let (mut other, oid) = plugin_with(env, true, |_| {});
    let other_uri = other.self_addr(oid).unwrap().uri().to_owned();
    let dest = srv.lookup(&other_uri).unwrap();
    srv.send_unexpected(&dest, 9, b"calling out", OpId(3))?;
    let done = drive_until(&mut [&mut srv, &mut other], 0, "the listener's own send");
    assert_eq!((done.op, done.kind), (OpId(3), OpKind::SendUnexpected));
    drop(idle);
    done.status
}

#[test]
fn the_outgoing_reserve_keeps_slots_idle_incoming_peers_cannot_take() {
    let test = "the_outgoing_reserve_keeps_slots_idle_incoming_peers_cannot_take";
    let Some(env) = rdma_env(test) else {
        return;
    };
    // The default reserve (1 of 4): three idle peers, the fourth refused,
    // our own call out connects.
    if let Err(e) = scenario(&env, None) {
        panic!(
            "{test}: with the default reserve the listener could not call out: {}",
            na_core::ErrorChain(&e)
        );
    }
    // An explicit reserve of 2: two idle peers, the third refused.
    if let Err(e) = scenario(&env, Some(2)) {
        panic!(
            "{test}: with a reserve of 2 the listener could not call out: {}",
            na_core::ErrorChain(&e)
        );
    }
}

#[test]
fn without_a_reserve_idle_incoming_peers_block_calling_out() {
    let test = "without_a_reserve_idle_incoming_peers_block_calling_out";
    let Some(env) = rdma_env(test) else {
        return;
    };
    match scenario(&env, Some(0)) {
        Err(e) => {
            let msg = na_core::ErrorChain(&e).to_string();
            eprintln!("{test}: the listener's call out failed, as it must without a reserve: {msg}");
            assert!(
                msg.contains("connection limit"),
                "{test}: failed for another reason than the limit: {msg}"
            );
        }
        Ok(()) => panic!("{test}: the listener called out although idle peers held every slot"),
    }
}
