//! A hostile server that answers every call with a forged "bulk handle"
//! naming the client's own address makes the client refuse a transfer
//! each time (`self_rma.rs`): that cannot flood the client's log. The
//! warning comes at the 1st, 2nd, 4th... refusal, the others at debug
//! level, and `PluginStats::self_rma_refused` counts every one (as in
//! na-verbs; before 2026-11-29 na-sm warned at every refusal and counted
//! none). A binary of its own, for the global tracing subscriber (a
//! thread-local one would share tracing's per-callsite interest cache
//! with threads that have none).

use na_core::{Access, MemHandle, NaError, OpId, Plugin, PluginId, RemoteMem, RemoteSegment, Rma};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::private_dir;

#[test]
fn refused_self_transfers_are_all_counted_and_warned_at_powers_of_two() {
    let log = na_testsuite::log::CapturedLog::install_global();
    let dir = private_dir("self-rma-log");
    let mut p = SmPlugin::new(PluginId(1), SmConfig::default().with_dir(&dir)).unwrap();
    let me = p.self_addr();
    // Memory lent to someone else, and a descriptor of it with the wrong
    // key (what a hostile server that knows where it lies forges).
    let lent = MemHandle::zeroed(64, Access::ReadWrite);
    p.mem_register(&lent).unwrap();
    let seg = p.mem_describe(&lent).unwrap().segments()[0];
    let forged = RemoteMem::new(
        vec![RemoteSegment {
            key: seg.key.wrapping_add(1),
            ..seg
        }],
        Access::ReadWrite,
    )
    .unwrap();
    let src = MemHandle::new(vec![vec![0x55; 64]], Access::ReadOnly);
    p.mem_register(&src).unwrap();
    const TRIES: u64 = 9;
    for i in 0..TRIES {
        let e = p
            .rma(&me, &[Rma::put(&src, 0, &forged, 0, 64, OpId(i))])
            .expect_err("a put through a forged descriptor");
        assert!(
            matches!(&e, NaError::Rma { .. })
                && na_core::ErrorChain(&e).to_string().contains("forged or stale"),
            "try {i}: {}",
            na_core::ErrorChain(&e)
        );
    }
    assert!(
        lent.to_vec().iter().all(|&b| b == 0),
        "the lent memory was written"
    );
    let st = p.stats();
    assert_eq!(st.self_rma_refused, TRIES, "not every refusal counted: {st:?}");

    log.assert_throttled("sm: refused a transfer to this process", "refused", TRIES);
    let _ = std::fs::remove_dir_all(&dir);
}
