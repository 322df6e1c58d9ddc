//! `AsyncEngine::lookup` and async bulk transfers never block the engine
//! while they connect: a peer whose listener never accepts (its accept
//! queue full: hung, overloaded or hostile) makes only the task that looks
//! it up wait, while other tasks' calls to a healthy server (a separate
//! process) go on, and the wait ends with the error a blocking lookup
//! gives, after `SmConfig::handshake_timeout`.

use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{AsyncEngine, Bulk, BulkOp, Engine, RpcError};
use na_core::{Access, Addr, Endpoint, NaError, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;

mod common;
mod logged;
use common::Server;

/// The client's handshake timeout: how long a lookup of the stuck peer
/// waits before it fails. Long, so that the calls made meanwhile finish
/// before it even on a loaded 2-core machine (each takes well under a
/// millisecond unloaded; CI runs the suite in parallel).
const HANDSHAKE: Duration = Duration::from_secs(10);

/// Calls made to the healthy server while the lookup waits.
const CALLS: u64 = 50;

const T: Duration = Duration::from_secs(10);

/// An sm endpoint in `dir` with the test's handshake timeout.
fn endpoint(dir: &Path) -> Endpoint {
    let cfg = SmConfig {
        handshake_timeout: HANDSHAKE,
        ..SmConfig::default()
    }
    .with_dir(dir);
    let mut ep = Endpoint::new(ProgressMode::default()).unwrap();
    ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    ep
}

/// A client engine (not listening) in `dir`, driven by tokio.
fn client(dir: &Path) -> AsyncEngine {
    let ep = endpoint(dir);
    let id = ep.plugin_ids().next().unwrap();
    AsyncEngine::spawn(Engine::new(ep, id).unwrap()).unwrap()
}

/// A listener at the socket an sm address of this process would use
/// (`sm://<pid>-stuck-<tag>` in `dir`: each test's own, as the waits'
/// record names them) that never accepts, its queue full; returns its
/// address and what must live as long as it should.
fn stuck_listener(dir: &Path, tag: &str) -> (String, UnixListener, UnixStream) {
    let pid = std::process::id();
    let path = dir.join(format!("{pid}-stuck-{tag}.sock"));
    let listener = UnixListener::bind(&path).unwrap();
    // A backlog of 0 makes one queued connection fill the queue.
    common::sys::listen(listener.as_fd(), 0).expect("listen(2) on our socket");
    let queued = UnixStream::connect(&path).expect("the first connection is queued");
    (format!("sm://{pid}-stuck-{tag}"), listener, queued)
}

/// Makes [`CALLS`] calls to `srv` one after the other.
async fn calls(c: &AsyncEngine, srv: &Addr) {
    for i in 0..CALLS {
        assert_eq!(c.call::<Add>(srv, &(i, 1), T).await.unwrap(), i + 1);
    }
}

/// The lookup timeout of `stuck`: a transport error of the lookup, naming
/// the peer, whose source timed out.
fn assert_lookup_timeout(r: Result<(), RpcError>, stuck: &str) -> NaError {
    match r {
        Err(RpcError::Transport(e @ NaError::Lookup { .. })) => {
            let NaError::Lookup { uri, source } = &e else {
                unreachable!()
            };
            assert_eq!(uri, stuck);
            assert_eq!(source.kind(), std::io::ErrorKind::TimedOut, "{source}");
            assert!(source.to_string().contains("not accepting"), "{source}");
            e
        }
        other => panic!("expected the lookup's timeout, got {other:?}"),
    }
}

/// While `what` (the task `waiting`) waits on the stuck peer, [`CALLS`]
/// calls finish, and `what` is still waiting then: a lookup that held the
/// engine (or the runtime's workers: a pause fires no timer then) would
/// hold the calls until it ended. The calls start once hg-rpc has said
/// that `what` waits for `stuck` (its first attempt found the queue full),
/// or once `what` has ended (a lookup that held the engine through its
/// wait says nothing, and the check then fails): not after a guessed
/// pause, which a loaded machine could end before the lookup had even
/// begun. No wall-clock bound on the calls: under load they may be slow,
/// but they cannot finish behind a held engine.
async fn served_meanwhile<W>(
    c: &hg_rpc::AsyncEngine,
    s: &na_core::Addr,
    waiting: &tokio::task::JoinHandle<W>,
    stuck: &str,
    what: &str,
) {
    let t0 = Instant::now();
    while !logged::said("lookup waits", |p| p == stuck) && !waiting.is_finished() {
        assert!(t0.elapsed() < 2 * HANDSHAKE, "{what} neither waited nor ended");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    calls(c, s).await;
    assert!(
        !waiting.is_finished(),
        "{CALLS} calls took {:?} from the start of {what}'s wait, not done before it gave up (handshake timeout {HANDSHAKE:?})",
        t0.elapsed()
    );
}

/// `what` gave up after about the handshake timeout, not before.
fn assert_waited_the_timeout(waited: Duration, what: &str) {
    assert!(
        waited >= HANDSHAKE - Duration::from_millis(100) && waited < HANDSHAKE + Duration::from_secs(30),
        "{what} gave up after {waited:?}, the handshake timeout is {HANDSHAKE:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_of_a_peer_that_never_accepts_does_not_hold_up_other_calls() {
    let d = common::dir("async-lookup");
    let srv = Server::start(&d);
    let c = Arc::new(client(&d));
    let s = c.lookup(&srv.uri).await.unwrap();
    let (stuck, _listener, _queued) = stuck_listener(&d, "lookup");
    logged::install();

    // The blocking lookup, from a thread of its own at the same time: the
    // error to expect.
    let blocking = {
        let (d, stuck) = (d.to_path_buf(), stuck.clone());
        std::thread::spawn(move || endpoint(&d).lookup(&stuck).map(|_| ()))
    };
    let lookup = {
        let (c, stuck) = (c.clone(), stuck.clone());
        tokio::spawn(async move {
            let t0 = Instant::now();
            let r = c.lookup(&stuck).await.map(|_| ());
            (r, t0.elapsed())
        })
    };
    served_meanwhile(&c, &s, &lookup, &stuck, "the lookup").await;
    let (r, waited) = lookup.await.unwrap();
    let e = assert_lookup_timeout(r, &stuck);
    assert_waited_the_timeout(waited, "the lookup");
    let blocking_err = blocking.join().unwrap().expect_err("nobody accepts");
    assert_eq!(
        e.to_string(),
        blocking_err.to_string(),
        "not the blocking lookup's error"
    );
    // The engine still serves.
    assert_eq!(c.call::<Add>(&s, &(2, 3), T).await.unwrap(), 5);
}

/// A transfer with a handle whose owner is the stuck peer: its start looks
/// the owner up, and waits as the lookup does, without the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_with_a_peer_that_never_accepts_does_not_hold_up_other_calls() {
    let d = common::dir("async-lookup-bulk");
    let srv = Server::start(&d);
    let c = Arc::new(client(&d));
    let s = c.lookup(&srv.uri).await.unwrap();
    let (stuck, _listener, _queued) = stuck_listener(&d, "bulk");
    logged::install();
    // A descriptor as a peer would send it, naming the stuck owner.
    let theirs = c.expose(vec![vec![7; 4096]], Access::ReadWrite).unwrap();
    let mut desc = theirs.desc().into_owned();
    desc.owner = stuck.clone();
    let remote = Bulk::from_desc(desc).unwrap();
    let local = c.expose(vec![vec![0; 4096]], Access::ReadWrite).unwrap();
    let transfer = {
        let c = c.clone();
        tokio::spawn(async move {
            let t0 = Instant::now();
            let r = c.bulk(BulkOp::Pull, &remote, 0, &local, 0, 4096, T).await;
            (r, t0.elapsed())
        })
    };
    served_meanwhile(&c, &s, &transfer, &stuck, "the transfer's lookup").await;
    let (r, waited) = transfer.await.unwrap();
    assert_lookup_timeout(r, &stuck);
    assert_waited_the_timeout(waited, "the transfer");
    assert_eq!(c.call::<Add>(&s, &(2, 3), T).await.unwrap(), 5);
    assert_eq!(c.stats().bulk_in_flight, 0);
}
