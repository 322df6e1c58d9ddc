//! What the tests of hostile descriptors share: descriptors whose last
//! close blocks ([`blocking_close`]), jamming na-sm's closing threads with them, flooding a
//! listener with refused descriptors, and counting what this process has
//! open.
//!
//! The closing threads, their queue and the descriptor table are the
//! process's, not a plugin's: a test that measures them must be alone in
//! its process ([`alone`]).

#![allow(dead_code)]

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use na_core::{OpId, Plugin, PluginId};
use na_sm::sys::socket::send_with_fds;
use na_sm::{
    debug_closing_threads, ClosingThreads, SmConfig, SmPlugin, MAX_CLOSING_THREADS, MAX_NESTED_DEPTH,
    MAX_NESTED_FDS,
};

use crate::common::private_dir;
use crate::common::sys::{send_fds, SCM_MAX_FD};

/// How long a close of [`lingering_socket`] (or [`blocking_close`]) would block.
pub const LINGER: Duration = Duration::from_secs(20);

/// Runs a test alone in a process of its own (see [`na_sm::debug_run_alone`]).
#[allow(unused_imports)] // not every test binary that includes this module runs a test alone
pub use na_sm::debug_run_alone as alone;

/// A loopback TCP connection whose peer never reads, its send queue full,
/// with `SO_LINGER` on: its last close waits up to `LINGER`.
pub fn lingering_socket() -> (TcpListener, TcpStream) {
    lingering_for(LINGER)
}

/// [`lingering_socket`], lingering for `linger`.
pub fn lingering_for(linger: Duration) -> (TcpListener, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut s = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    s.set_nonblocking(true).unwrap();
    let chunk = vec![0u8; 1 << 16];
    loop {
        match s.write(&chunk) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("filling the socket: {e}"),
        }
    }
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: linger.as_secs() as libc::c_int,
    };
    let r = crate::common::sys::set_linger(s.as_fd(), &linger);
    assert_eq!(r, 0, "SO_LINGER");
    (listener, s)
}

/// A listening plugin in a new private directory named by `tag`: (the
/// directory, the plugin, its URI, its socket's path).
pub fn listener(tag: &str) -> (PathBuf, SmPlugin, String, PathBuf) {
    let dir = private_dir(tag);
    let srv = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(&dir)).unwrap();
    let uri = srv.self_addr().uri().to_owned();
    let path = dir.join(format!("{}.sock", uri.trim_start_matches("sm://")));
    (dir, srv, uri, path)
}

/// Progresses `srv` until it has refused at least `want` handshakes in
/// all (at most 30 s: far longer than refusing a flood takes, even on a
/// loaded box), and returns the count.
pub fn refusals_reaching(srv: &mut SmPlugin, want: u64) -> u64 {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let now = srv.stats().handshakes_refused;
        assert!(
            now >= want || Instant::now() < end,
            "only {now} of {want} handshakes refused"
        );
        if now >= want {
            return now;
        }
        settle_for(srv, Duration::from_millis(5));
    }
}

/// Progresses `srv` until the closing threads stand as `cond` says (see
/// [`ClosingThreads`]), at most `limit`, and returns where they stand;
/// panics saying `what` if they never do. What the tests wait for
/// instead of a fixed time: a loaded box may run a closing thread late.
pub fn wait_closers(
    srv: &mut SmPlugin,
    what: &str,
    limit: Duration,
    cond: impl Fn(&ClosingThreads) -> bool,
) -> ClosingThreads {
    let end = Instant::now() + limit;
    loop {
        let now = debug_closing_threads();
        if cond(&now) {
            return now;
        }
        assert!(Instant::now() < end, "{what} within {limit:?}: {now:?}");
        settle_for(srv, Duration::from_millis(2));
    }
}

/// Progresses `srv` for `time`.
pub fn settle_for(srv: &mut SmPlugin, time: Duration) {
    let end = Instant::now() + time;
    while Instant::now() < end {
        srv.progress().unwrap();
    }
}

/// A descriptor whose last close blocks for [`LINGER`] although na-sm
/// sets the sockets it discards to abort at their close and reads out
/// the UNIX sockets it discards first: a [`lingering_socket`] in flight
/// (queued, never read) inside a chain of UNIX sockets one level deeper
/// than na-sm reads out (`MAX_NESTED_DEPTH`), so the close of the
/// deepest one it reaches releases that socket's last reference. Where
/// the kernel refuses such a chain (older kernels refuse to pass a UNIX
/// socket nested more than 4 deep, `ETOOMANYREFS`; the limit went with
/// the rewrite of the AF_UNIX garbage collector, around Linux 6.10), the
/// [`stuffed_blocking_close_for`] one instead. Also returns the TCP
/// socket's peer (keep it: it never reads).
pub fn blocking_close() -> (TcpListener, UnixStream) {
    blocking_close_for(LINGER)
}

/// [`blocking_close`], blocking for `linger`.
pub fn blocking_close_for(linger: Duration) -> (TcpListener, UnixStream) {
    if !kernel_nests_deeply() {
        return stuffed_blocking_close_for(linger);
    }
    let (peer, tcp) = lingering_for(linger);
    (peer, nested(tcp.into(), MAX_NESTED_DEPTH + 1))
}

/// Whether a UNIX socket nested one level deeper than a
/// [`blocking_close`] chain can be built (and so that chain passed).
fn kernel_nests_deeply() -> bool {
    static DEEP: OnceLock<bool> = OnceLock::new();
    *DEEP.get_or_init(|| {
        let (end, _) = UnixStream::pair().unwrap();
        try_nested(end.into(), MAX_NESTED_DEPTH + 2).is_ok()
    })
}

/// A descriptor whose last close blocks for `linger`, on any kernel: a
/// UNIX socket with more descriptors in flight than na-sm takes out
/// before a close (`MAX_NESTED_FDS`, here dups of a pipe's end), then a
/// [`lingering_socket`] behind them. Also returns the TCP socket's peer.
pub fn stuffed_blocking_close_for(linger: Duration) -> (TcpListener, UnixStream) {
    let (peer, tcp) = lingering_for(linger);
    let (carrier, other) = UnixStream::pair().unwrap();
    let (r, _w) = crate::common::pipe();
    let dups: Vec<OwnedFd> = (0..SCM_MAX_FD)
        .map(|_| r.as_fd().try_clone_to_owned().unwrap())
        .collect();
    let raw: Vec<_> = dups.iter().map(|d| d.as_raw_fd()).collect();
    for _ in 0..=MAX_NESTED_FDS / SCM_MAX_FD {
        send_fds(other.as_fd(), b"s", &raw).unwrap();
    }
    send_with_fds(other.as_fd(), b"x", &[tcp.as_fd()]).unwrap();
    drop((tcp, other, dups));
    (peer, carrier)
}

/// `fd` in flight inside `levels` UNIX sockets, each queued (never read)
/// on the next: the outermost one's reading end (`levels` >= 1). This
/// process keeps no other copy of any of them.
pub fn nested(fd: OwnedFd, levels: usize) -> UnixStream {
    try_nested(fd, levels).unwrap()
}

/// [`nested`], or the error of the send that failed.
fn try_nested(fd: OwnedFd, levels: usize) -> std::io::Result<UnixStream> {
    assert!(levels >= 1);
    let mut inner = fd;
    for _ in 0..levels {
        let (carrier, other) = UnixStream::pair().unwrap();
        send_with_fds(other.as_fd(), b"x", &[inner.as_fd()])?;
        drop((inner, other));
        inner = carrier.into();
    }
    Ok(UnixStream::from(inner))
}

/// Jams a closing thread of the listener at `path`: a hello carrying
/// `jam` (a [`blocking_close`] descriptor), whose last close (ours, once
/// the listener refuses the hello) blocks.
pub fn jam_with(path: &Path, jam: UnixStream) {
    let conn = UnixStream::connect(path).unwrap();
    send_with_fds(conn.as_fd(), b"hello", &[jam.as_fd()]).unwrap();
    drop((jam, conn));
}

/// Jams every closing thread of the listener at `path` (`srv`), one
/// [`blocking_close_for`] `linger` each: each jam is handed over once the
/// threads before it have been stuck for longer than `CLOSE_STALL`, so
/// that another thread is started to take it. Returns the lingering
/// sockets' peers (keep them: they never read).
pub fn jam_every_closing_thread(srv: &mut SmPlugin, path: &Path, linger: Duration) -> Vec<TcpListener> {
    let peers = (0..MAX_CLOSING_THREADS)
        .map(|started| {
            let (peer, jam) = blocking_close_for(linger);
            jam_with(path, jam);
            // Until the thread that took this jam, and each one before it,
            // has been stuck past `CLOSE_STALL` as the pool judges it, so
            // the next jam starts another (a loaded box may take a while
            // to run the thread: no fixed wait).
            let n = started + 1;
            wait_closers(
                srv,
                &format!("{n} closing threads stuck in jams"),
                linger / 2,
                |c| c.threads == n && c.stuck == n,
            );
            peer
        })
        .collect();
    assert_eq!(
        closing_threads(),
        MAX_CLOSING_THREADS,
        "not every closing thread was started"
    );
    peers
}

/// na-sm's closing threads running in this process.
pub fn closing_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == "qs-sm-closer")
        .count()
}

/// Hellos of 4 socket ends each (`count` of them, or as many as the
/// listener's queue takes), each refused with its descriptors. Returns
/// how many connections it made.
pub fn flood(srv: &mut SmPlugin, path: &Path, count: usize) -> u64 {
    let mut made = 0;
    for _ in 0..count {
        let Ok(conn) = UnixStream::connect(path) else {
            // The accept queue is full: accepts are paused.
            break;
        };
        made += 1;
        let (a, b) = UnixStream::pair().unwrap();
        let (c, d) = UnixStream::pair().unwrap();
        let fds = [a.as_fd(), b.as_fd(), c.as_fd(), d.as_fd()];
        let _ = send_with_fds(conn.as_fd(), b"hello", &fds);
        drop((a, b, c, d, conn));
        srv.progress().unwrap();
    }
    made
}

/// Progresses `srv` after a [`flood`] of `made` hellos (begun with
/// `refused_before` handshakes refused) until its accepts have paused
/// for congestion (`flow_blocked` > 0) or it has refused every hello of
/// the flood, whichever comes first (at most 30 s), and returns its
/// `flow_blocked` count. What a test of the bound waits for instead of a
/// fixed time: a listener driven by busy `progress` calls polls its
/// socket events only now and then (`EVENT_POLL_INTERVAL`), so on a
/// loaded box a short settle may see few of the flood's hellos read and
/// the bound not yet reached; a listener without the bound reads every
/// hello and never pauses, which ends the wait as soon.
pub fn congested_or_all_refused(srv: &mut SmPlugin, refused_before: u64, made: u64) -> u64 {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let st = srv.stats();
        if st.flow_blocked > 0 || st.handshakes_refused >= refused_before + made {
            return st.flow_blocked;
        }
        assert!(
            Instant::now() < end,
            "neither paused nor done with the flood in 30 s: {} of {made} hellos refused",
            st.handshakes_refused - refused_before
        );
        settle_for(srv, Duration::from_millis(5));
    }
}

/// Descriptors this process has open.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// An honest client's message to `srv` (at `uri`) arrives within 10 s.
pub fn serves_an_honest_client(srv: &mut SmPlugin, dir: &Path, uri: &str) {
    assert!(
        honest_client_served(srv, dir, uri, Duration::from_secs(10)),
        "the honest message never arrived"
    );
}

/// Whether an honest client's message to `srv` (at `uri`) arrives within
/// `limit`.
pub fn honest_client_served(srv: &mut SmPlugin, dir: &Path, uri: &str, limit: Duration) -> bool {
    let mut c = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(dir)).unwrap();
    let to = c.lookup(uri).unwrap();
    srv.post_recv_unexpected(Vec::new(), OpId(1)).unwrap();
    c.send_unexpected(&to, 3, b"honest", OpId(2)).unwrap();
    let end = Instant::now() + limit;
    while Instant::now() < end {
        c.progress().unwrap();
        srv.progress().unwrap();
        if let Some(k) = std::iter::from_fn(|| srv.pop_completion()).find(|k| k.op == OpId(1)) {
            assert_eq!(k.buf.as_deref(), Some(&b"honest"[..]));
            return true;
        }
    }
    false
}
