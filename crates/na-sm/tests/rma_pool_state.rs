//! The RMA transfer-thread pool's own state, seen through its test probe
//! (`SmPlugin::debug_rma_pool`, feature `test-hooks`): a refused batch
//! leaves no trace of its peer in the pool, a batch refused because no
//! thread could start is taken back whole, a child forked while
//! another thread holds the pool's lock never takes it (it would wait for
//! ever: the holder is not in the child), and a peer whose pidfd could
//! not be duplicated for its jobs has it duplicated for its next batch.
//!
//! The peer is a forked child whose memory is never really reached: the
//! transfers name an address it does not map, and fail there (`EFAULT`),
//! which is all a pool's bookkeeping needs.

use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::time::{Duration, Instant};

use na_core::{
    Access, Addr, Completion, MemHandle, NaError, OpId, Plugin, PluginId, RemoteMem, RemoteSegment, Rma,
};
use na_sm::{SmConfig, SmPlugin, RMA_QUEUE_PER_PEER};

mod common;
use common::{private_dir, sys, wait_child, KillOnDrop};

/// How long any step may take (generous: a loaded box).
const BOUND: Duration = Duration::from_secs(20);

/// Bytes each transfer moves.
const LEN: u64 = 8;

/// A peer process (forked): connects to `uri` in `dir`, says hello with an
/// unexpected message, reports `S` on its pipe, and drives its plugin
/// until it is killed.
fn fork_peer(dir: &Path, uri: &str) -> KillOnDrop {
    let (mut said_r, said_w) = common::pipe();
    let child = sys::fork();
    assert!(child >= 0, "fork");
    if child == 0 {
        drop(said_r);
        let code = (|| {
            use std::os::fd::AsFd;
            let cfg = SmConfig::default().with_dir(dir).with_name("peer");
            let Ok(mut p) = SmPlugin::new(PluginId(2), cfg) else {
                return 2;
            };
            let Ok(to) = p.lookup(uri) else { return 3 };
            if p.send_unexpected(&to, 0, b"hello", OpId(1)).is_err() {
                return 4;
            }
            sys::write(said_w.as_fd(), b"S");
            loop {
                let _ = p.progress();
                while p.pop_completion().is_some() {}
                std::thread::sleep(Duration::from_millis(2));
            }
        })();
        sys::exit_now(code);
    }
    let kill = KillOnDrop::new(child);
    drop(said_w);
    let mut said = [0u8; 1];
    said_r.read_exact(&mut said).expect("the peer said nothing");
    assert_eq!(said[0], b'S');
    kill
}

/// A listening plugin with two transfer threads and a peer process: (the
/// plugin, the peer's address, its killer, the directory).
fn scene(tag: &str) -> (SmPlugin, Addr, KillOnDrop, std::path::PathBuf) {
    let dir = private_dir(tag);
    let cfg = SmConfig {
        rma_threads: Some(2),
        ..SmConfig::listening().with_dir(&dir)
    };
    let mut p = SmPlugin::new(PluginId(1), cfg).unwrap();
    let uri = p.self_addr().uri().to_owned();
    let kill = fork_peer(&dir, &uri);
    p.post_recv_unexpected(Vec::with_capacity(64), OpId(1)).unwrap();
    let hello = wait_for(&mut p, &[OpId(1)]).remove(0);
    hello.status.expect("the peer's hello");
    (p, hello.source.expect("a source"), kill, dir)
}

/// Drives `p` until each of `ops` completed (within [`BOUND`]): their
/// completions, in the order of `ops`.
fn wait_for(p: &mut SmPlugin, ops: &[OpId]) -> Vec<Completion> {
    let end = Instant::now() + BOUND;
    let mut got: Vec<Completion> = Vec::new();
    while ops.iter().any(|op| !got.iter().any(|c| c.op == *op)) {
        assert!(Instant::now() < end, "{ops:?} did not all complete: {got:?}");
        p.progress().unwrap();
        got.extend(std::iter::from_fn(|| p.pop_completion()));
        std::thread::sleep(Duration::from_millis(1));
    }
    ops.iter()
        .map(|op| {
            got.iter()
                .position(|c| c.op == *op)
                .map(|i| got.remove(i))
                .unwrap()
        })
        .collect()
}

/// Memory of the peer's that it does not map (so every transfer fails
/// there, once a thread runs it): room for `n` transfers.
fn unmapped_remote(n: usize) -> RemoteMem {
    let seg = RemoteSegment {
        addr: 4096,
        len: LEN * n as u64,
        key: 0,
    };
    RemoteMem::new(vec![seg], Access::ReadWrite).unwrap()
}

/// `n` transfers of `local` to or from `remote`, gets and puts in turn (so
/// that each is a run, and a job, of its own), ids from `first`.
fn alternating<'a>(local: &'a MemHandle, remote: &'a RemoteMem, n: usize, first: u64) -> Vec<Rma<'a>> {
    (0..n)
        .map(|i| {
            let at = LEN * i as u64;
            let op = OpId(first + i as u64);
            if i % 2 == 0 {
                Rma::get(local, at, remote, at, LEN, op)
            } else {
                Rma::put(local, at, remote, at, LEN, op)
            }
        })
        .collect()
}

/// A batch refused for the peer's queue bound (one job more than it
/// holds) leaves no queue entry for that peer; nor does a batch that ran.
#[test]
fn a_batch_refused_for_the_queue_bound_leaves_no_queue_entry() {
    let (mut p, peer, kill, dir) = scene("pool-refused-entry");
    let probe = p.debug_rma_pool().unwrap();
    assert_eq!(probe.queue_entries(), 0);
    let n = RMA_QUEUE_PER_PEER + 1;
    let local = MemHandle::zeroed(LEN as usize * n, Access::ReadWrite);
    let remote = unmapped_remote(n);
    let e = p
        .rma(&peer, &alternating(&local, &remote, n, 100))
        .expect_err("a batch of one job past the bound");
    assert!(
        e.to_string().contains("RMA_QUEUE_PER_PEER"),
        "{}",
        na_core::ErrorChain(&e)
    );
    assert_eq!(
        probe.queue_entries(),
        0,
        "the refused batch left its peer a queue entry with nothing in it"
    );
    assert_eq!(local.holders(), 0, "the refused jobs' handles are gone");
    assert_eq!(p.stats().in_flight, 0);
    // A batch that runs: its entry goes with its last job.
    let ops = alternating(&local, &remote, 2, 100);
    p.rma(&peer, &ops).unwrap();
    for c in wait_for(&mut p, &[OpId(100), OpId(101)]) {
        assert!(matches!(c.status, Err(NaError::Rma { .. })), "{c:?}");
    }
    assert_eq!(probe.queue_entries(), 0);
    drop((p, kill));
    let _ = std::fs::remove_dir_all(&dir);
}

/// No transfer thread can start (the probe makes the spawn fail): the
/// batch is refused whole and taken back: no queue entry, no op in
/// flight (its ids are free at once), no clone of its handle left, the
/// pool's lock not held; once threads can start, the same batch runs.
#[test]
fn a_batch_refused_for_want_of_a_thread_is_taken_back_whole() {
    let (mut p, peer, kill, dir) = scene("pool-spawn-fails");
    let probe = p.debug_rma_pool().unwrap();
    probe.fail_spawns(true);
    let local = MemHandle::zeroed(LEN as usize * 4, Access::ReadWrite);
    let remote = unmapped_remote(4);
    let ops = alternating(&local, &remote, 4, 200);
    let e = p.rma(&peer, &ops).expect_err("no thread to run it");
    assert!(
        e.to_string().contains("starting an sm RMA transfer thread"),
        "{}",
        na_core::ErrorChain(&e)
    );
    assert_eq!(probe.queue_entries(), 0, "the refused batch left a queue entry");
    assert!(!probe.locked());
    assert_eq!(local.holders(), 0, "a refused job's handle clone is left");
    assert_eq!(p.stats().in_flight, 0);
    assert_eq!(p.stats().rma_offloaded, 0);
    probe.fail_spawns(false);
    p.rma(&peer, &ops).unwrap();
    let ids: Vec<OpId> = ops.iter().map(|o| o.op).collect();
    for c in wait_for(&mut p, &ids) {
        assert!(matches!(c.status, Err(NaError::Rma { .. })), "{c:?}");
    }
    assert_eq!(probe.queue_entries(), 0);
    drop((p, kill));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A child forked while another thread holds the pool's lock, with
/// transfers in the pool: its inherited plugin cancels one (completing it
/// `Canceled`) and is dropped without taking that lock (it would wait for
/// ever: the holder is not in the child). The parent's transfers are
/// untouched and complete once the lock goes.
#[test]
fn a_child_forked_while_the_pool_lock_is_held_never_takes_it() {
    let (p, peer, kill, dir) = scene("pool-fork");
    let mut p = Some(p);
    let parent = p.as_mut().unwrap();
    let probe = parent.debug_rma_pool().unwrap();
    let local = MemHandle::zeroed(LEN as usize * 2, Access::ReadWrite);
    let remote = unmapped_remote(2);
    parent.rma(&peer, &alternating(&local, &remote, 2, 300)).unwrap();
    let hold = probe.hold();
    assert!(probe.locked());
    let child = sys::fork();
    assert!(child >= 0, "fork");
    if child == 0 {
        // The child's copy of the lock is held by a thread it does not
        // have; `hold` (its copy) must never be dropped here.
        let code = (|| {
            let Some(mut mine) = p.take() else { return 2 };
            if mine.cancel(OpId(300)).is_err() {
                return 3;
            }
            match mine.pop_completion() {
                Some(c) if c.op == OpId(300) && matches!(c.status, Err(NaError::Canceled)) => {}
                _ => return 4,
            }
            drop(mine);
            0
        })();
        sys::exit_now(code);
    }
    let status = wait_child(child, BOUND);
    drop(hold);
    assert_eq!(
        status,
        Some(0),
        "the child hung (None: it waited for the pool's lock) or failed"
    );
    // The parent's two transfers were not canceled: both end (failing at
    // the unmapped address).
    let parent = p.as_mut().unwrap();
    for c in wait_for(parent, &[OpId(300), OpId(301)]) {
        assert!(matches!(c.status, Err(NaError::Rma { .. })), "{c:?}");
    }
    assert_eq!(probe.queue_entries(), 0);
    drop((p, kill));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether this kernel has pidfds: `pidfd_open` of this process works
/// (`ENOSYS` before Linux 5.3). Decided by the kernel alone, apart from
/// the plugin and its test hooks.
fn kernel_has_pidfds() -> bool {
    match sys::pidfd_open(std::process::id() as libc::pid_t) {
        Ok(_) => true,
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => false,
        Err(e) => panic!("pidfd_open of this process failed, not for want of pidfds: {e}"),
    }
}

/// How many pidfds of process `pid` this process holds (descriptors
/// whose `/proc/self/fdinfo` says `Pid:` and that pid), not counting
/// `except`.
fn pidfds_of(pid: libc::pid_t, except: Option<RawFd>) -> usize {
    let want = format!("Pid:\t{pid}");
    std::fs::read_dir("/proc/self/fdinfo")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let fd: RawFd = e.file_name().to_str()?.parse().ok()?;
            let info = std::fs::read_to_string(e.path()).ok()?;
            (Some(fd) != except && info.lines().any(|l| l == want)).then_some(fd)
        })
        .count()
}

/// A peer's pidfd that could not be duplicated for its jobs (the probe
/// makes the duplicate fail once, as a full descriptor table would) is
/// not remembered as missing: the peer's next batch duplicates it, and
/// its job checks it before it moves anything (so do later ones, from the
/// kept duplicate). (Checked: with the lack of a pidfd cached, as before,
/// the second job runs unchecked and this fails.) Not run only where the
/// kernel has no pidfds; where it has, the connection is seen to hold
/// one (among our descriptors) before the hook is trusted, so a hook
/// that failed no duplicate fails the test. (Checked: with the hook
/// failing none, this fails on that; it reported "not run" before.)
#[test]
fn a_pidfd_whose_duplicate_failed_is_duplicated_for_the_next_batch() {
    let (mut p, peer, kill, dir) = scene("pool-pidfd-retry");
    if !kernel_has_pidfds() {
        na_core::testing::report_not_run(
            "na-sm rma_pool_state: this kernel has no pidfds (pidfd_open: ENOSYS), nor has the peer's connection",
        );
        drop((p, kill));
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    // The connection's own pidfd of the peer (the killer holds another).
    let killers = kill.pidfd().map(|fd| fd.as_raw_fd());
    assert!(
        pidfds_of(kill.pid(), killers) >= 1,
        "the peer's connection holds no pidfd of it (pid {}), on a kernel with pidfds",
        kill.pid()
    );
    let probe = p.debug_rma_pool().unwrap();
    probe.fail_pidfd_dups(1);
    let local = MemHandle::zeroed(LEN as usize, Access::ReadWrite);
    let remote = unmapped_remote(1);
    let batch = |p: &mut SmPlugin, op: u64| {
        p.rma(&peer, &[Rma::get(&local, 0, &remote, 0, LEN, OpId(op))])
            .unwrap();
        let c = wait_for(p, &[OpId(op)]).remove(0);
        assert!(matches!(c.status, Err(NaError::Rma { .. })), "{c:?}");
    };
    batch(&mut p, 400);
    assert_eq!(
        probe.pidfd_dup_failures_left(),
        0,
        "the connection has a pidfd, but the hook failed no duplicate of it (is `fail_pidfd_dups` still used?)"
    );
    assert_eq!(
        probe.pidfd_checked_jobs(),
        0,
        "a job checked a pidfd whose duplicate failed"
    );
    batch(&mut p, 401);
    assert_eq!(
        probe.pidfd_checked_jobs(),
        1,
        "the next batch's job ran without the peer's pidfd: its lack was remembered"
    );
    batch(&mut p, 402);
    assert_eq!(probe.pidfd_checked_jobs(), 2, "the kept duplicate was not used");
    drop((p, kill));
    let _ = std::fs::remove_dir_all(&dir);
}
