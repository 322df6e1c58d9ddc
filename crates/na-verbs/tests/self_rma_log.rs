//! A hostile server that answers every call with a forged "bulk handle"
//! naming the client's own address makes the client refuse a transfer
//! each time (`self_rma.rs`): that cannot flood the client's log. The
//! warning comes at the 1st, 2nd, 4th... refusal, the others at debug
//! level, and `PluginStats::self_rma_refused` counts every one. A binary
//! of its own, for the global tracing subscriber (a thread-local one
//! would share tracing's per-callsite interest cache with threads that
//! have none).
//!
//! Without an RDMA device the RDMA part cannot run: the test says so
//! loudly (and checks the clear "no RDMA device" error).

mod common;

use na_core::{Access, MemHandle, NaError, OpId, RemoteMem, RemoteSegment};

use common::pair::node;

#[test]
fn refused_self_transfers_are_all_counted_and_warned_at_powers_of_two() {
    let test = "refused_self_transfers_are_all_counted_and_warned_at_powers_of_two";
    let Some(env) = common::rdma_env(test) else {
        return;
    };
    let log = na_testsuite::log::CapturedLog::install_global();
    let (mut ep, id) = node(&env, false);
    let own_uri = ep.self_addr(id).unwrap().uri().to_owned();
    let own = ep.lookup(&own_uri).unwrap();
    // Memory lent to someone else, and a descriptor of it without the
    // secret (what a hostile server that guessed the rkey forges).
    let lent = MemHandle::new(vec![vec![0xAA; 4096]], Access::ReadWrite);
    let p = ep.plugin_mut(id).unwrap();
    p.mem_register(&lent).unwrap();
    let seg = p.mem_describe(&lent).unwrap().segments()[0];
    let forged = RemoteMem::new(
        vec![RemoteSegment {
            key: seg.key & 0xffff_ffff,
            ..seg
        }],
        Access::ReadWrite,
    )
    .unwrap();
    let src = MemHandle::new(vec![vec![0x55; 4096]], Access::ReadOnly);
    const TRIES: u64 = 9;
    for i in 0..TRIES {
        let e = ep
            .put(&src, 0, &forged, 0, 4096, &own, OpId(i))
            .expect_err("a put through a forged descriptor");
        assert!(
            matches!(&e, NaError::Rma { .. })
                && na_core::ErrorChain(&e).to_string().contains("forged or stale"),
            "try {i}: {}",
            na_core::ErrorChain(&e)
        );
    }
    assert!(
        lent.to_vec().iter().all(|&b| b == 0xAA),
        "the lent memory was written"
    );
    let st = ep.plugin(id).unwrap().stats();
    assert_eq!(st.self_rma_refused, TRIES, "not every refusal counted: {st:?}");

    log.assert_throttled("verbs: refused a transfer to this process", "refused", TRIES);
}
