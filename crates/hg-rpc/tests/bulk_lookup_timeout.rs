//! A transfer's timeout covers the lookup of the handle's owner, in the
//! async API and the blocking one: with an owner whose listener never
//! accepts (its queue full, so a lookup would wait for na-sm's 5 s
//! handshake timeout), a transfer given 300 ms answers `Timeout` within
//! about that, not after the lookup's bound.

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use hg_rpc::{Bulk, BulkOp, RpcError};
use na_core::Access;

mod common;

const TIMEOUT: Duration = Duration::from_millis(300);

/// A listener in `dir` named like an sm instance of this process, whose
/// accept queue is full (it never accepts), and a remote handle it
/// "owns". Keep the listener and the queued stream alive.
fn stuck_owner(dir: &std::path::Path) -> (UnixListener, UnixStream, Bulk) {
    let pid = std::process::id();
    let path = dir.join(format!("{pid}-stuck.sock"));
    let listener = UnixListener::bind(&path).unwrap();
    // SAFETY (test): listen(2) on a socket we own; backlog 0 makes one
    // pending connection fill the queue.
    assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
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
