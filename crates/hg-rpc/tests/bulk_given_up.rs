//! Blocking transfers given up on: a forgotten one (`forget_bulk`) and
//! one past its timeout (`bulk`) leave no outcome and nothing in flight,
//! and the engine's next transfers work. Two engines of this process
//! over real sm plugins.

use std::time::Duration;

use hg_rpc::{Engine, RpcError};

mod common;
#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use common::{dir, endpoint};
mod routing_helpers;
use routing_helpers::{pump, pump_both, T};
/// A transfer given up on (`forget_bulk`, or `bulk` timing out) leaves no
/// outcome behind; the engine's next transfers work.
#[test]
fn a_forgotten_transfer_leaves_no_outcome() {
    use hg_rpc::{Bulk, BulkOp};
    use na_core::Access;
    let d = dir("forget-bulk");
    let (ep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    let (ep, cid) = endpoint(&d, false);
    let mut c = Engine::new(ep, cid).unwrap();
    let data: Vec<u8> = (0..50_000u32).map(|i| i as u8).collect();
    let remote: Bulk = srv.expose(vec![data.clone()], Access::ReadOnly).unwrap();
    let remote: Bulk = postcard::from_bytes(&postcard::to_allocvec(&remote).unwrap()).unwrap();
    c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    let dst = c.expose(vec![vec![0; 50_000]], Access::ReadWrite).unwrap();
    let id = c.bulk_start(BulkOp::Pull, &remote, 0, &dst, 0, 50_000).unwrap();
    c.forget_bulk(id);
    // Given up, but not ended until the transport says so.
    assert_eq!(c.stats().bulk_in_flight, 1);
    pump_both(&mut c, &mut srv, "settle", |_, _| true);
    pump(&mut c, Duration::from_millis(20));
    assert!(
        c.take_bulk(id).is_none(),
        "a forgotten transfer's outcome was kept"
    );
    assert_eq!(c.stats().bulk_in_flight, 0);
    let r = c.bulk(BulkOp::Pull, &remote, 0, &dst, 0, 50_000, Duration::ZERO);
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    c.bulk(BulkOp::Pull, &remote, 100, &dst, 0, 1000, T).unwrap();
    let mut got = vec![0; 1000];
    dst.local().unwrap().read_at(0, &mut got).unwrap();
    assert_eq!(got, data[100..1100]);
}

/// `bulk` past its timeout cancels the transfer and waits for the
/// transport to end it before it returns: then nothing touches either
/// handle's memory any more, and the owner of the remote handle may free
/// it. Over sm a transfer's end is reported at the next progress call, so
/// a timeout of zero always leaves one to wait for: once `bulk` returned,
/// the transport has nothing in flight and nothing left to report. (Over
/// RDMA, where a READ stays on the wire, see
/// `a_timed_out_bulk_has_ended_when_it_returns_over_verbs`.)
#[test]
fn a_timed_out_bulk_has_ended_when_it_returns() {
    use hg_rpc::{Bulk, BulkOp};
    use na_core::Access;
    let d = dir("timed-out-bulk");
    let (ep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    let (ep, cid) = endpoint(&d, false);
    let mut c = Engine::new(ep, cid).unwrap();
    let data: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
    let remote: Bulk = srv.expose(vec![data.clone()], Access::ReadOnly).unwrap();
    let remote: Bulk = postcard::from_bytes(&postcard::to_allocvec(&remote).unwrap()).unwrap();
    c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    let dst = c.expose(vec![vec![0; 50_000]], Access::ReadWrite).unwrap();
    // What the transport still has to do or say about transfers.
    let left = |c: &mut Engine| {
        let ep = c.endpoint();
        ep.progress_now().unwrap();
        (
            ep.plugin(cid).unwrap().stats().in_flight,
            ep.pending_completions(),
        )
    };
    // The engine's own posted receives (QS_RPC_RECV=posted) stay in flight.
    c.progress_now().unwrap();
    let (receives, _) = left(&mut c);
    for round in 0..3 {
        let r = c.bulk(BulkOp::Pull, &remote, 0, &dst, 0, 50_000, Duration::ZERO);
        assert!(matches!(r, Err(RpcError::Timeout { .. })), "round {round}: {r:?}");
        assert_eq!(
            left(&mut c),
            (receives, 0),
            "round {round}: bulk returned before its canceled transfer ended"
        );
        assert_eq!(c.stats().bulk_in_flight, 0, "round {round}");
    }
    c.bulk(BulkOp::Pull, &remote, 100, &dst, 0, 1000, T).unwrap();
    let mut got = vec![0; 1000];
    dst.local().unwrap().read_at(0, &mut got).unwrap();
    assert_eq!(got, data[100..1100]);
    assert_eq!(left(&mut c), (receives, 0));
}
