//! A transfer's timeout covers the lookup of the handle's owner, in the
//! async API and the blocking one: with an owner whose listener never
//! accepts (its queue full, so a lookup would wait for na-sm's 5 s
//! handshake timeout), a transfer given 300 ms answers `Timeout` within
//! about that, not after the lookup's bound. Likewise a plain handler's
//! third-party transfer (`BulkCtx::allow_any_owner`) within its engine's
//! handler transfer timeout, a batch an application starts with
//! `Engine::bulk_start_batch_within`, and one it moves and waits for with
//! `Engine::bulk_batch`.

use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{Bulk, BulkOp, RpcError, Span};
use na_core::Access;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::{Add, BlobExpose, BlobPut};
mod common;

const TIMEOUT: Duration = Duration::from_millis(300);
/// The timeout of what must succeed.
const T: Duration = Duration::from_secs(10);

/// A listener in `dir` named like an sm instance of this process, whose
/// accept queue is full (it never accepts), and a remote handle it
/// "owns". Keep the listener and the queued stream alive.
fn stuck_owner(dir: &std::path::Path) -> (UnixListener, UnixStream, Bulk) {
    let pid = std::process::id();
    let path = dir.join(format!("{pid}-stuck.sock"));
    let listener = UnixListener::bind(&path).unwrap();
    // Backlog 0 makes one pending connection fill the queue.
    common::sys::listen(listener.as_fd(), 0).expect("listen(2) on our socket");
    let queued = UnixStream::connect(&path).expect("the first connection is queued");
    let seg = na_core::RemoteSegment {
        addr: 4096,
        len: 4096,
        key: 0,
    };
    let mem = na_core::RemoteMem::new(vec![seg], Access::ReadOnly)
        .unwrap()
        .to_bytes();
    let remote = Bulk::from_desc(hg_rpc::BulkDesc {
        owner: format!("sm://{pid}-stuck"),
        mem: serde_bytes::ByteBuf::from(mem),
        inline: None,
    })
    .unwrap();
    (listener, queued, remote)
}

/// The answer is the transfer's timeout, within 2 s.
fn check(r: hg_rpc::Result<()>, took: Duration) {
    match r {
        Err(RpcError::Timeout { millis, .. }) => assert_eq!(millis, TIMEOUT.as_millis()),
        other => panic!("expected the transfer's timeout, got {other:?} after {took:?}"),
    }
    assert!(
        took < Duration::from_secs(2),
        "answered after {took:?}: the lookup's wait was not bounded by the timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_transfers_timeout_covers_the_lookup_of_its_owner() {
    let d = common::dir("bulk-stuck-owner-async");
    let (_listener, _queued, remote) = stuck_owner(&d);
    let c = common::async_engine(&d, false);
    let local = c.expose(vec![vec![0; 4096]], Access::ReadWrite).unwrap();
    let t0 = Instant::now();
    let r = c.bulk(BulkOp::Pull, &remote, 0, &local, 0, 4096, TIMEOUT).await;
    check(r, t0.elapsed());
}

#[test]
fn a_blocking_transfers_timeout_covers_the_lookup_of_its_owner() {
    let d = common::dir("bulk-stuck-owner-blocking");
    let (_listener, _queued, remote) = stuck_owner(&d);
    let mut c = common::client(&d);
    let local = c.expose(vec![vec![0; 4096]], Access::ReadWrite).unwrap();
    let t0 = Instant::now();
    let r = c.bulk(BulkOp::Pull, &remote, 0, &local, 0, 4096, TIMEOUT);
    check(r, t0.elapsed());
}

/// A plain handler (its engine driven by a thread of its own, its handler
/// transfer timeout 300 ms) pulls from a third party's handle whose owner
/// never accepts: it fails within about that, and its caller gets the
/// handler's error, not an answer after the lookup's 5 s bound.
#[test]
fn a_plain_handlers_transfer_timeout_covers_the_lookup_of_its_owner() {
    let d = common::dir("bulk-stuck-owner-handler");
    let (_listener, _queued, remote) = stuck_owner(&d);
    let (ep, id) = common::endpoint(&d, true);
    let mut srv = hg_rpc::Engine::new(ep, id).unwrap();
    srv.set_handler_transfer_timeout(TIMEOUT);
    srv.register_with_bulk::<BlobPut>(|ctx, (_key, data)| {
        ctx.allow_any_owner();
        let local = ctx.expose(vec![vec![0; 4096]], Access::ReadWrite)?;
        ctx.transfer(BulkOp::Pull, &data, 0, &local, 0, 4096)?;
        Ok(0)
    })
    .unwrap();
    let uri = srv.self_addr().uri().to_owned();
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let server = std::thread::spawn(move || {
        while !stopped.load(Ordering::Relaxed) {
            srv.progress(Some(Duration::from_millis(10))).unwrap();
            srv.trigger().unwrap();
        }
    });
    let mut c = common::client(&d);
    let s = c.endpoint().lookup(&uri).unwrap();
    let t0 = Instant::now();
    let r = c.call::<BlobPut>(&s, &("k".into(), remote), Duration::from_secs(20));
    let took = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    server.join().unwrap();
    match r {
        // `BulkCtx` fails as `Engine::bulk` does past its timeout, the
        // lookup included: `RpcError::Timeout`.
        Err(RpcError::Handler { message, .. }) => {
            assert_eq!(message, "bulk transfer timed out after 300 ms", "{message}")
        }
        other => panic!("expected the handler's transfer error, got {other:?} after {took:?}"),
    }
    assert!(
        took < Duration::from_secs(2),
        "answered after {took:?}: the lookup's wait was not bounded by the handler transfer timeout"
    );
}

/// `Engine::bulk_start_batch_within`, the start of a batch by application
/// code: with an owner that never accepts, it answers the caller's
/// timeout within about that (`bulk_start_batch` waits for na-sm's 5 s
/// bound), with nothing started; with an owner that answers (a server
/// process exposing a blob), its spans start and move the data.
#[test]
fn a_blocking_batch_starts_timeout_covers_the_lookup_of_its_owner() {
    let d = common::dir("bulk-stuck-owner-batch");
    let (_listener, _queued, remote) = stuck_owner(&d);
    let mut c = common::client(&d);
    let local = c.expose(vec![vec![0; 4096]], Access::ReadWrite).unwrap();
    let spans = [0, 2048].map(|at| Span {
        remote_offset: at,
        local_offset: at,
        len: 2048,
    });
    let t0 = Instant::now();
    let r = c.bulk_start_batch_within(BulkOp::Pull, &remote, &local, &spans, TIMEOUT);
    check(r.map(drop), t0.elapsed());
    assert_eq!(c.stats().bulk_in_flight, 0, "a transfer started");

    let srv = common::Server::start(&d);
    let s = c.lookup(&srv.uri).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + i / 256) as u8).collect();
    let put = c.expose(vec![data.clone()], Access::ReadOnly).unwrap();
    c.call::<BlobPut>(&s, &("k".into(), put), T).unwrap();
    let theirs = c.call::<BlobExpose>(&s, &("k".into(), 1024), T).unwrap();
    let ids = c
        .bulk_start_batch_within(BulkOp::Pull, &theirs, &local, &spans, T)
        .unwrap();
    let end = Instant::now() + T;
    for id in ids {
        let r = loop {
            if let Some(r) = c.take_bulk(id) {
                break r;
            }
            assert!(Instant::now() < end, "the transfers did not end");
            c.progress(Some(Duration::from_millis(10))).unwrap();
            c.trigger().unwrap();
        };
        r.unwrap();
    }
    assert!(local.local().unwrap().to_vec() == data, "pulled other data");
}

/// `Engine::bulk_batch` (start a batch and wait for all of it): with an
/// owner that never accepts, it answers its timeout within about that
/// (the lookup alone would wait for na-sm's 5 s bound), with nothing left
/// in flight; the engine then calls a server process and moves a batch
/// with it as before.
#[test]
fn a_blocking_batchs_timeout_covers_the_lookup_of_its_owner() {
    let d = common::dir("bulk-stuck-owner-wait-batch");
    let (_listener, _queued, remote) = stuck_owner(&d);
    let mut c = common::client(&d);
    let local = c.expose(vec![vec![0; 4096]], Access::ReadWrite).unwrap();
    let spans = [0, 2048].map(|at| Span {
        remote_offset: at,
        local_offset: at,
        len: 2048,
    });
    let t0 = Instant::now();
    let r = c.bulk_batch(BulkOp::Pull, &remote, &local, &spans, TIMEOUT);
    check(r, t0.elapsed());
    assert_eq!(c.stats().bulk_in_flight, 0, "a transfer was left in flight");

    let srv = common::Server::start(&d);
    let s = c.lookup(&srv.uri).unwrap();
    assert_eq!(c.call::<Add>(&s, &(2, 3), T).unwrap(), 5);
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 11 + i / 256) as u8).collect();
    let put = c.expose(vec![data.clone()], Access::ReadOnly).unwrap();
    c.call::<BlobPut>(&s, &("k".into(), put), T).unwrap();
    let theirs = c.call::<BlobExpose>(&s, &("k".into(), 1024), T).unwrap();
    c.bulk_batch(BulkOp::Pull, &theirs, &local, &spans, T).unwrap();
    assert!(local.local().unwrap().to_vec() == data, "pulled other data");
    assert_eq!(c.stats().bulk_in_flight, 0);
}
