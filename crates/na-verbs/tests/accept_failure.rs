//! A listener whose `rdma_accept` fails (after it set up the QP and the
//! buffers) rejects the connection at once, saying why in the reject's
//! private data: the connecting side's send fails promptly with
//! `PeerGone` naming the listener's reason, instead of waiting for its
//! CM's retries or its set-up deadline. The failure is provoked with
//! `VerbsConfig::debug.accept_responder_resources`: an accept that
//! offers more RDMA read resources than the device has (soft-RoCE offers
//! no resource limit that fails `rdma_accept` itself).
//!
//! Without an RDMA device the RDMA part cannot run: the test says so
//! loudly (and checks the clear "no RDMA device" error).

mod common;

use std::time::{Duration, Instant};

use common::*;
use na_core::{NaError, OpId, OpKind};

#[test]
fn a_failed_accept_rejects_the_peer_with_its_reason() {
    let test = "a_failed_accept_rejects_the_peer_with_its_reason";
    let Some(env) = rdma_env(test) else {
        return;
    };
    let (mut srv, sid) = plugin_with(&env, true, |cfg| {
        // Past any device's max_qp_rd_atom (soft-RoCE: 128); 255 would
        // mean "the most the device has" to librdmacm.
        cfg.debug.accept_responder_resources = Some(254);
    });
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    let (mut cli, _) = plugin_with(&env, false, |cfg| {
        // Far beyond the test's own deadline: a connector left waiting
        // must show as that, not as a set-up timeout.
        cfg.setup_timeout = 4 * WAIT;
    });
    let dest = cli.lookup(&uri).unwrap();
    cli.send_unexpected(&dest, 7, b"hello", OpId(1)).unwrap();
    let start = Instant::now();
    let done = loop {
        assert!(
            start.elapsed() < WAIT,
            "the connecting side was not told within {WAIT:?}: it was left waiting"
        );
        srv.progress(Some(Duration::from_millis(10))).unwrap();
        cli.progress(Some(Duration::from_millis(10))).unwrap();
        if let Some(c) = cli.pop_completion() {
            break c;
        }
    };
    eprintln!(
        "{test}: the send ended after {:?}: {:?}",
        start.elapsed(),
        done.status
    );
    assert_eq!((done.op, done.kind), (OpId(1), OpKind::SendUnexpected));
    match done.status {
        Err(NaError::PeerGone { reason, .. }) => assert!(
            reason.contains("rejected") && reason.contains("the listener could not accept the connection"),
            "the reject did not carry the listener's reason: {reason}"
        ),
        other => panic!("the send to a listener that could not accept: {other:?}"),
    }
    let st = srv.plugin(sid).unwrap().stats();
    assert_eq!(st.accept_errors, 1, "the failed accept was not counted: {st:?}");
    assert_eq!(
        st.protocol_errors, 0,
        "our own failure counted as the peer's: {st:?}"
    );
}
