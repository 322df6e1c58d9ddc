//! Every bulk transfer an engine starts ends in `RpcStats::bulk_done` or
//! `bulk_failed` (`bulk_bytes` adds up what the done ones moved): an
//! origin's `Engine::bulk*` and `AsyncEngine::bulk`, a plain handler's
//! `BulkCtx`, an async handler's `AsyncBulkCtx`; one refused at its start
//! counts nowhere. A handler reads the counters through `BulkCtx::stats`
//! (a `CountedStats`: each as `Engine::stats` has it);
//! `AsyncEngine::try_stats` answers `None` in a plain handler of its
//! engine instead of panicking.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use hg_rpc::{
    Access, AsyncEngine, Bulk, BulkDesc, BulkOp, CountedStats, Engine, Rpc, RpcError, RpcStats, Span,
};
use na_core::{RemoteMem, RemoteSegment};

mod common;
use common::{async_engine, call_both, client, dir, endpoint, Server};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;

/// Generous, for a loaded 2-core machine.
const T: Duration = Duration::from_secs(60);

/// Pulls 64 bytes at the given offset of the caller's handle; answers them.
struct Pull64;
impl Rpc for Pull64 {
    const NAME: &'static str = "bulk_counters.pull64";
    type Input = (Bulk, u64);
    type Output = Vec<u8>;
}

/// Whether the engine's counters could be read from its plain handler.
struct Peek;
impl Rpc for Peek {
    const NAME: &'static str = "bulk_counters.peek";
    type Input = ();
    type Output = bool;
}

/// (done, failed, bytes, in flight).
fn bulk(st: &RpcStats) -> (u64, u64, u64, u64) {
    (st.bulk_done, st.bulk_failed, st.bulk_bytes, st.bulk_in_flight)
}

/// (done, failed, bytes) as a handler reads them.
fn counted_bulk(st: &CountedStats) -> (u64, u64, u64) {
    (st.bulk_done, st.bulk_failed, st.bulk_bytes)
}

fn data() -> Vec<u8> {
    (0..4096).map(|i| (i % 251) as u8).collect()
}

#[test]
fn blocking_transfers_count_in_the_engine_that_started_them() {
    let d = dir("bulk-counters");
    let (ep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    srv.register_with_bulk::<Pull64>(move |ctx, (remote, at)| {
        let local = ctx.expose(vec![vec![0; 64]], Access::ReadWrite)?;
        let r = ctx.transfer(BulkOp::Pull, &remote, at, &local, 0, 64);
        // The handler's view: this request handled, its transfer counted.
        s2.lock().unwrap().push(ctx.stats());
        r?;
        Ok(local.to_vec()?)
    })
    .unwrap();
    let mut c = client(&d);
    let mine = c.expose(vec![data()], Access::ReadOnly).unwrap();
    // A handler's transfer (an RMA over sm), then one refused at its start.
    assert_eq!(
        call_both::<Pull64>(&mut c, &mut srv, &(mine.clone(), 8)).unwrap(),
        data()[8..72]
    );
    assert!(call_both::<Pull64>(&mut c, &mut srv, &(mine.clone(), 4090)).is_err());
    assert_eq!(bulk(&srv.stats()), (1, 0, 64, 0));
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        (seen[0].handled, counted_bulk(&seen[0])),
        (1, (1, 0, 64)),
        "{:?}",
        seen[0]
    );
    assert_eq!(
        (seen[1].handled, counted_bulk(&seen[1])),
        (2, (1, 0, 64)),
        "{:?}",
        seen[1]
    );
    // The owner of the handle started nothing.
    assert_eq!(bulk(&c.stats()), (0, 0, 0, 0));

    // An origin's copy between two handles of its own (done as it starts).
    let into = c.expose(vec![vec![0; 4096]], Access::ReadWrite).unwrap();
    c.bulk(BulkOp::Pull, &mine, 0, &into, 0, 100, T).unwrap();
    assert_eq!(bulk(&c.stats()), (1, 0, 100, 0));
    // An RMA batch of two spans with a server process's handle, one of
    // them in a page nothing maps there: one done, one failed (at its
    // end: na-sm refuses a forged handle of this process at the start).
    let peer = Server::start(&d);
    let p = c.lookup(&peer.uri).unwrap();
    assert_eq!(
        c.call::<rpcs::BlobPut>(&p, &("k".into(), mine.clone()), T)
            .unwrap(),
        rpcs::fnv(&data())
    );
    let theirs = c.call::<rpcs::BlobExpose>(&p, &("k".into(), 1000), T).unwrap();
    let desc = theirs.desc().into_owned();
    let mut segs = RemoteMem::from_bytes(&desc.mem).unwrap().segments().to_vec();
    segs.push(RemoteSegment {
        addr: 0x1000,
        len: 4096,
        key: 0,
    });
    let remote = Bulk::from_desc(BulkDesc {
        owner: desc.owner.clone(),
        mem: serde_bytes::ByteBuf::from(RemoteMem::new(segs, Access::ReadOnly).unwrap().to_bytes()),
        inline: None,
    })
    .unwrap();
    let spans = [
        Span {
            remote_offset: 0,
            local_offset: 0,
            len: 1000,
        },
        Span {
            remote_offset: 5000,
            local_offset: 1000,
            len: 100,
        },
    ];
    match c.bulk_batch(BulkOp::Pull, &remote, &into, &spans, T) {
        Err(RpcError::Transport(_)) => {}
        other => panic!("expected the unmapped span's transport error, got {other:?}"),
    }
    assert_eq!(bulk(&c.stats()), (2, 1, 1100, 0));
    // Refused at its start: counted nowhere.
    assert!(c.bulk(BulkOp::Pull, &remote, 8000, &into, 0, 1000, T).is_err());
    assert_eq!(bulk(&c.stats()), (2, 1, 1100, 0));
}

/// Answers nothing; its handler records `BulkCtx::stats`.
struct Look;
impl Rpc for Look {
    const NAME: &'static str = "bulk_counters.look";
    type Input = ();
    type Output = ();
}

#[test]
fn a_handler_reads_every_counted_field_as_the_engine_counts_it() {
    let d = dir("bulk-counters-look");
    let (ep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    srv.register_with_bulk::<Look>(move |ctx, ()| {
        s2.lock().unwrap().push(ctx.stats());
        Ok(())
    })
    .unwrap();
    let mut c = client(&d);
    // The first answer makes `bytes_sent` non-zero.
    call_both::<Look>(&mut c, &mut srv, &()).unwrap();
    let before = srv.stats();
    assert!(before.bytes_sent > 0 && before.handled == 1, "{before:?}");
    call_both::<Look>(&mut c, &mut srv, &()).unwrap();
    let seen = seen.lock().unwrap().clone();
    // Between the two reads only the second request was counted (its
    // answer is sent after its handler returns).
    let mut want = CountedStats::from(&before);
    want.handled += 1;
    assert_eq!(
        seen.last(),
        Some(&want),
        "every counted field as the engine had it"
    );
    assert_eq!(seen[0].handled, 1);
}

#[test]
fn async_transfers_count_and_try_stats_never_panics() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let d = dir("bulk-counters-async");
        let srv = Arc::new(async_engine(&d, true));
        srv.register_async_with_bulk::<Pull64, _, _>(|ctx, (remote, at)| async move {
            let local = ctx.expose(vec![vec![0; 64]], Access::ReadWrite)?;
            ctx.transfer(BulkOp::Pull, &remote, at, &local, 0, 64, T).await?;
            Ok(local.to_vec()?)
        })
        .unwrap();
        // A plain handler of the engine: `stats` would panic there.
        let weak: Weak<AsyncEngine> = Arc::downgrade(&srv);
        srv.register::<Peek>(move |()| Ok(weak.upgrade().ok_or("gone")?.try_stats().is_some()))
            .unwrap();
        let c = async_engine(&d, false);
        let s = c.lookup(srv.self_addr().uri()).await.unwrap();
        let mine = c.expose(vec![data()], Access::ReadOnly).unwrap();
        let got = c.call::<Pull64>(&s, &(mine.clone(), 8), T).await.unwrap();
        assert_eq!(got, data()[8..72]);
        assert!(
            !c.call::<Peek>(&s, &(), T).await.unwrap(),
            "read in its own plain handler"
        );
        let st = srv.try_stats().expect("readable outside its handlers");
        assert_eq!(bulk(&st), (1, 0, 64, 0));
        let mut full = srv.stats();
        full.driver_sleeps = st.driver_sleeps;
        assert_eq!(st, full, "try_stats is stats");
        // The origin's own, through the async twin of `Engine::bulk`.
        let into = c.expose(vec![vec![0; 4096]], Access::ReadWrite).unwrap();
        c.bulk(BulkOp::Pull, &mine, 0, &into, 0, 300, T).await.unwrap();
        assert_eq!(bulk(&c.stats()), (1, 0, 300, 0));
    });
}
