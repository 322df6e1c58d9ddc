//! The RMA transfer-thread pool (`SmConfig::rma_threads` > 0): jobs (see
//! `job`) queued per peer, run by at most N threads named `qs-sm-rma-K`,
//! each started when a peer's turn finds no thread idle or starting (none
//! before the first batch); results queued for the owner, whom a worker
//! wakes through an eventfd in the plugin's epoll set.
//!
//! At most one job per peer runs at a time: a peer whose memory stalls the
//! kernel holds one thread, and its own later jobs wait in its queue
//! behind it, so other peers' jobs go on as long as fewer than N peers are
//! stuck; with N stuck, they wait queued (the caller never blocks). A
//! peer's queue is bounded ([`RMA_QUEUE_PER_PEER`] jobs): a batch past it
//! is refused whole.
//!
//! Nothing waits for a worker: dropping the pool lets idle workers exit
//! and leaves a stuck one to end when its system call does (it holds only
//! Arcs: the shared state, its job's handles). A forked child has no
//! workers; its inherited plugin refuses all work (see
//! `SmPlugin::check_not_inherited`) and its drop does not touch the pool's
//! lock, which a parent's thread may have held at the fork.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use na_core::fasthash::FastMap;
use na_core::{NaError, OpId, Result, RmaDir};

use super::hooks::Hooks;
use super::job::{Job, JobResult};
use crate::config::{RMA_QUEUE_PER_PEER, RMA_QUIET_YIELD_EVERY};
use crate::sys::cma::IovLists;
use crate::sys::eventfd::EventFd;

/// A job running this long is reported (debug level, at most once per
/// [`STUCK_REPORT_EVERY`]): its peer's memory probably stalls. A busy
/// owner stops yielding its core to a pool in which no job started or
/// ended for this long (see [`RmaPool::look`]).
const STUCK_AFTER: Duration = Duration::from_secs(1);
/// See [`STUCK_AFTER`].
const STUCK_REPORT_EVERY: Duration = Duration::from_secs(10);
/// How often submits and cancels look for stuck jobs at most.
const STUCK_CHECK_EVERY: Duration = Duration::from_millis(250);
/// The most jobs whose room [`RmaPool::put_scratch`] keeps: a batch of up
/// to this many jobs (same-direction runs, split at `IOV_MAX`) allocates
/// no list of them.
const SCRATCH_KEEP: usize = 64;

/// One peer's jobs.
#[derive(Default)]
struct PeerQueue {
    jobs: VecDeque<Job>,
    /// When its running job started, while one runs.
    running: Option<Instant>,
}

/// What the workers and the owner share, under the lock.
#[derive(Default)]
struct State {
    /// Peers with jobs queued or running: an entry goes as soon as
    /// neither is left (none for a peer whose batch was refused).
    queues: FastMap<u64, PeerQueue>,
    /// Peers with jobs queued and none running, in turn.
    ready: VecDeque<u64>,
    threads: usize,
    idle: usize,
    /// Threads started that have not taken the lock yet (neither idle nor
    /// busy: each will look at `ready` first).
    starting: usize,
    done: Vec<JobResult>,
    closing: bool,
}

struct Shared {
    state: Mutex<State>,
    work: Condvar,
    /// `state.done.len()`, readable without the lock.
    done_len: AtomicUsize,
    /// Jobs queued, and running (for `PluginStats`; no lock).
    waiting: AtomicU64,
    running: AtomicU64,
    /// Made readable (a write of 0, see `EventFd::signal`) when results
    /// arrive for an owner that has taken none since.
    wake: EventFd,
    /// Batches queued, jobs taken up by a thread, jobs ended: what a busy
    /// owner's yields watch (see [`RmaPool::look`]).
    activity: AtomicU64,
    /// The test hooks (`hooks`: nothing in a user's build).
    hooks: Hooks,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// An op in the pool: its job, direction and peer.
#[derive(Clone, Copy)]
pub(crate) struct PoolOp {
    pub job: u64,
    pub dir: RmaDir,
    pub peer: u64,
}

/// The owner's side of the pool (the plugin holds it).
pub(crate) struct RmaPool {
    shared: Arc<Shared>,
    max_threads: usize,
    /// Ops handed to the pool and not completed yet.
    pub ops: FastMap<OpId, PoolOp>,
    next_job: u64,
    /// Each peer's pidfd, duplicated once for its jobs (a peer with none
    /// is not kept: it is looked for again, see `peer_pidfd_for_jobs`);
    /// dropped when the peer goes.
    pub pidfds: FastMap<u64, Arc<std::os::fd::OwnedFd>>,
    /// An empty list kept for its capacity: a batch's jobs are built in
    /// it ([`take_scratch`](Self::take_scratch)) and [`submit`](Self::submit)
    /// hands it back drained, so a batch allocates no list of its own.
    scratch: Vec<Job>,
    /// The same for the results [`take_done`](Self::take_done) swaps out.
    spare_done: Vec<JobResult>,
    /// The fork generation the pool was made in.
    generation: u64,
    /// When [`report_stuck`](Self::report_stuck) looks next.
    next_stuck_check: Option<Instant>,
    /// `activity` as [`look`](Self::look) last saw it, and when it saw
    /// it change.
    seen_activity: u64,
    changed_at: Option<Instant>,
    /// While the pool is quiet, when a spin yields next (see
    /// [`look`](Self::look)); `None` until the quiet is first seen.
    quiet_yield_at: Option<Instant>,
    /// Whether a busy owner's spins yield its core (see
    /// [`owner_yield`](Self::owner_yield)).
    yielding: bool,
}

impl RmaPool {
    /// A pool of at most `max_threads` workers (none started yet); `wake`
    /// is the eventfd the plugin polls for results.
    pub fn new(max_threads: usize, wake: EventFd) -> RmaPool {
        RmaPool {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                work: Condvar::new(),
                done_len: AtomicUsize::new(0),
                waiting: AtomicU64::new(0),
                running: AtomicU64::new(0),
                wake,
                activity: AtomicU64::new(0),
                hooks: Hooks::new(),
            }),
            max_threads,
            ops: FastMap::default(),
            next_job: 0,
            pidfds: FastMap::default(),
            scratch: Vec::new(),
            spare_done: Vec::new(),
            generation: crate::sys::fork::generation(),
            next_stuck_check: None,
            seen_activity: 0,
            changed_at: None,
            quiet_yield_at: None,
            yielding: false,
        }
    }

    /// A duplicate of peer pidfd `fd` for its jobs (a test probe may make
    /// it fail: `RmaPoolProbe::fail_pidfd_dups`).
    pub fn dup_pidfd(&self, fd: &std::os::fd::OwnedFd) -> std::io::Result<std::os::fd::OwnedFd> {
        if self.shared.hooks.pidfd_dup_fails() {
            return Err(std::io::Error::from_raw_os_error(libc::EMFILE));
        }
        fd.try_clone()
    }

    /// A fresh job serial.
    pub fn next_job_id(&mut self) -> u64 {
        self.next_job += 1;
        self.next_job
    }

    /// Results wait to be taken.
    #[inline]
    pub fn has_done(&self) -> bool {
        self.shared.done_len.load(Ordering::Acquire) > 0
    }

    /// The owner's look at the pool at `now`, made by each progress call
    /// while transfers are out: its spins yield (see
    /// [`owner_yield`](Self::owner_yield)) until the pool has been quiet
    /// (no batch queued, no job taken up or ended) for [`STUCK_AFTER`],
    /// and then once per [`RMA_QUIET_YIELD_EVERY`] (a running job may
    /// need the owner's core, however long it has run).
    pub fn look(&mut self, now: Instant) {
        let activity = self.shared.activity.load(Ordering::Relaxed);
        let changed_at = match self.changed_at {
            Some(t) if activity == self.seen_activity => t,
            _ => {
                self.seen_activity = activity;
                self.quiet_yield_at = None;
                *self.changed_at.insert(now)
            }
        };
        if now.saturating_duration_since(changed_at) < STUCK_AFTER {
            self.yielding = true;
            return;
        }
        // Quiet: the first yield comes a gap after the quiet was seen.
        let at = *self.quiet_yield_at.get_or_insert(now + RMA_QUIET_YIELD_EVERY);
        self.yielding = now >= at;
        if self.yielding {
            self.quiet_yield_at = Some(now + RMA_QUIET_YIELD_EVERY);
        }
    }

    /// A busy owner's spin with transfers out and no result waiting:
    /// gives up the core (true) while the pool is active (see
    /// [`look`](Self::look)), for a transfer thread placed on the
    /// owner's core, which a spinning owner would keep from running
    /// (busy `hg-perf bw` with 2 threads fell to 0.2-0.45x of the CMA
    /// floor at 1 MiB; with the yield 0.80-0.85x). A pool quiet that long
    /// has its jobs stuck in the kernel (or moving one huge window): a
    /// yield per progress call would cost a system call each, and on a
    /// loaded core a time slice, for as long as a stalling peer pleases.
    /// Then false but once per [`RMA_QUIET_YIELD_EVERY`]: the spin runs
    /// its checks. (Never false for good: a thread that shares the
    /// owner's core and real-time priority runs only when it yields.)
    pub fn owner_yield(&self) -> bool {
        if !self.yielding {
            return false;
        }
        self.shared.hooks.owner_yielded();
        std::thread::yield_now();
        true
    }

    /// (jobs queued, jobs running).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.shared.waiting.load(Ordering::Relaxed),
            self.shared.running.load(Ordering::Acquire),
        )
    }

    /// The empty list a batch's jobs are built in (give it back through
    /// [`submit`](Self::submit), or [`put_scratch`](Self::put_scratch)).
    pub fn take_scratch(&mut self) -> Vec<Job> {
        std::mem::take(&mut self.scratch)
    }

    /// Keeps `jobs` for the next batch, dropping what it still holds (a
    /// refused batch's jobs, with their handles: here, out of the pool's
    /// lock). A list grown past [`SCRATCH_KEEP`] jobs is let go.
    pub fn put_scratch(&mut self, mut jobs: Vec<Job>) {
        jobs.clear();
        if jobs.capacity() <= SCRATCH_KEEP {
            self.scratch = jobs;
        }
    }

    /// Queues `jobs` for `peer` (the list comes back empty, for
    /// [`put_scratch`](Self::put_scratch)), starting a worker if one is
    /// needed and allowed. Refused whole (nothing queued, the jobs left
    /// in the list) past the peer's bound, or when no worker runs and none
    /// can be started. A refusal leaves no trace of the peer: no queue
    /// entry, no turn.
    pub fn submit(&mut self, peer: u64, jobs: &mut Vec<Job>) -> Result<()> {
        if jobs.is_empty() {
            // Nothing to run: no turn for the peer (an idle queue in the
            // ready list would get a second turn from its next submit).
            return Ok(());
        }
        let mut st = self.shared.lock();
        // Looked at before any entry is made: a refused batch must not
        // leave an empty one behind (it would stay until the peer goes).
        let (queued, running) = st
            .queues
            .get(&peer)
            .map_or((0, false), |q| (q.jobs.len(), q.running.is_some()));
        if queued + jobs.len() > RMA_QUEUE_PER_PEER {
            drop(st);
            return Err(NaError::Plugin {
                plugin: "sm",
                message: format!(
                    "RMA batch refused, nothing started: {queued} transfer jobs already wait for this peer \
                     (at most {RMA_QUEUE_PER_PEER}, na_sm::RMA_QUEUE_PER_PEER){}; wait for completions",
                    if running { ", behind one still running" } else { "" }
                ),
            });
        }
        let was_idle = queued == 0 && !running;
        let n = jobs.len();
        st.queues.entry(peer).or_default().jobs.extend(jobs.drain(..));
        if was_idle {
            st.ready.push_back(peer);
        }
        // Workers: one per ready peer beyond the idle ones and those
        // starting, up to the cap.
        while st.ready.len() > st.idle + st.starting && st.threads < self.max_threads {
            match self.spawn(st.threads) {
                Ok(()) => {
                    st.threads += 1;
                    st.starting += 1;
                }
                Err(e) if st.threads == 0 => {
                    // Nobody would run them: take them back (into the
                    // caller's list, dropped out of the lock), and the
                    // peer's entry and turn if it had nothing before.
                    if let Some(q) = st.queues.get_mut(&peer) {
                        let keep = q.jobs.len() - n;
                        jobs.extend(q.jobs.drain(keep..));
                    }
                    if was_idle {
                        st.queues.remove(&peer);
                        st.ready.retain(|&p| p != peer);
                    }
                    drop(st);
                    return Err(NaError::sys("starting an sm RMA transfer thread", e));
                }
                Err(e) => {
                    tracing::warn!(error = %na_core::ErrorChain(&e), "sm: starting another RMA transfer thread failed; the running ones go on");
                    break;
                }
            }
        }
        self.shared.waiting.fetch_add(n as u64, Ordering::Relaxed);
        self.shared.activity.fetch_add(1, Ordering::Relaxed);
        self.yielding = true;
        drop(st);
        self.shared.work.notify_one();
        self.report_stuck();
        Ok(())
    }

    fn spawn(&self, k: usize) -> std::io::Result<()> {
        if self.shared.hooks.spawn_fails() {
            return Err(std::io::Error::from_raw_os_error(libc::EAGAIN));
        }
        let shared = Arc::clone(&self.shared);
        std::thread::Builder::new()
            .name(format!("qs-sm-rma-{k}"))
            .spawn(move || worker(&shared))
            .map(drop)
    }

    /// Takes every result that waits (the list comes from an earlier
    /// call's [`put_done`](Self::put_done): no allocation per take).
    pub fn take_done(&mut self) -> Vec<JobResult> {
        let mut out = std::mem::take(&mut self.spare_done);
        let mut st = self.shared.lock();
        self.shared.done_len.store(0, Ordering::Release);
        std::mem::swap(&mut out, &mut st.done);
        out
    }

    /// Gives back the list [`take_done`](Self::take_done) returned, once
    /// emptied, for the workers' next results.
    pub fn put_done(&mut self, mut done: Vec<JobResult>) {
        done.clear();
        self.spare_done = done;
    }

    /// Cancels `op`: forgotten here (its result, if its job runs, is
    /// dropped), and taken out of its job if that has not started. Its
    /// direction, if it was in the pool.
    pub fn cancel(&mut self, op: OpId) -> Option<RmaDir> {
        let p = self.ops.remove(&op)?;
        if self.forked() {
            return Some(p.dir);
        }
        let mut st = self.shared.lock();
        let mut emptied = None;
        let mut freed = Vec::new();
        if let Some(q) = st.queues.get_mut(&p.peer) {
            if let Some(i) = q.jobs.iter().position(|j| j.id == p.job) {
                if q.jobs[i].remove(op, &mut freed) && q.jobs[i].ops.is_empty() {
                    emptied = q.jobs.remove(i);
                    self.shared.waiting.fetch_sub(1, Ordering::Relaxed);
                }
            }
            // Nothing of the peer waits or runs any more: its turn goes
            // too, or a later submit (finding it idle) would queue a
            // second turn, and two threads could run its jobs at once.
            if q.jobs.is_empty() && q.running.is_none() {
                st.queues.remove(&p.peer);
                st.ready.retain(|&r| r != p.peer);
            }
        }
        drop(st);
        // Dropped out of the lock, with their handles.
        drop((emptied, freed));
        self.report_stuck();
        Some(p.dir)
    }

    /// Peer `peer` went away: its queued jobs are dropped, and every op of
    /// it still in the pool (queued or running: a running one's result is
    /// dropped when it comes) is returned, forgotten here, to be failed.
    pub fn peer_gone(&mut self, peer: u64) -> Vec<(OpId, RmaDir)> {
        let failed: Vec<(OpId, RmaDir)> = self
            .ops
            .iter()
            .filter(|(_, p)| p.peer == peer)
            .map(|(op, p)| (*op, p.dir))
            .collect();
        for (op, _) in &failed {
            self.ops.remove(op);
        }
        self.pidfds.remove(&peer);
        if self.forked() {
            return failed;
        }
        let mut st = self.shared.lock();
        let dropped = match st.queues.get_mut(&peer) {
            Some(q) => {
                let jobs = std::mem::take(&mut q.jobs);
                if q.running.is_none() {
                    st.queues.remove(&peer);
                    st.ready.retain(|&r| r != peer);
                }
                jobs
            }
            None => VecDeque::new(),
        };
        self.shared
            .waiting
            .fetch_sub(dropped.len() as u64, Ordering::Relaxed);
        drop(st);
        drop(dropped);
        failed
    }

    /// Logs (debug level, throttled) a job running for more than
    /// [`STUCK_AFTER`]: its peer's memory probably stalls the kernel.
    /// This is a forked child's copy of the pool: its lock may have been
    /// held by a parent's thread at the fork, which does not exist here
    /// (so it would never be let go). The inherited plugin refuses work
    /// (`check_not_inherited`); what does reach the pool here (a cancel,
    /// the drop) leaves the lock alone.
    fn forked(&self) -> bool {
        crate::sys::fork::generation() != self.generation
    }

    /// Looks at most every [`STUCK_CHECK_EVERY`] (a busy caller submits
    /// far more often), and says so at most every [`STUCK_REPORT_EVERY`].
    fn report_stuck(&mut self) {
        if self.counts().1 == 0 {
            return;
        }
        let now = Instant::now();
        if self.next_stuck_check.is_some_and(|t| now < t) {
            return;
        }
        self.next_stuck_check = Some(now + STUCK_CHECK_EVERY);
        let st = self.shared.lock();
        let stuck: Vec<(u64, Duration)> = st
            .queues
            .iter()
            .filter_map(|(p, q)| Some((*p, now.duration_since(q.running?))))
            .filter(|(_, d)| *d > STUCK_AFTER)
            .collect();
        let waiting: usize = st.queues.values().map(|q| q.jobs.len()).sum();
        drop(st);
        if let Some((peer, longest)) = stuck.iter().max_by_key(|(_, d)| *d) {
            self.next_stuck_check = Some(now + STUCK_REPORT_EVERY);
            tracing::debug!(
                stuck = stuck.len(),
                longest = ?longest,
                peer_token = peer,
                waiting,
                "sm: RMA transfer jobs running for over {STUCK_AFTER:?} (a peer's memory stalls the kernel?)"
            );
        }
    }
}

impl Drop for RmaPool {
    fn drop(&mut self) {
        // In a forked child the lock may be held by a parent's thread that
        // does not exist here: leave it (the child has no workers).
        if self.forked() {
            return;
        }
        let mut st = self.shared.lock();
        st.closing = true;
        let queued: Vec<PeerQueue> = st.queues.drain().map(|(_, q)| q).collect();
        st.ready.clear();
        st.done.clear();
        drop(st);
        self.shared.work.notify_all();
        drop(queued);
    }
}

/// A transfer thread: runs the ready peers' jobs in turn, one per peer at
/// a time, until the pool closes.
fn worker(shared: &Shared) {
    let mut lists = IovLists::default();
    let mut st = shared.lock();
    st.starting -= 1;
    loop {
        if st.closing {
            st.threads -= 1;
            return;
        }
        let Some(peer) = st.ready.pop_front() else {
            st.idle += 1;
            st = shared.work.wait(st).unwrap_or_else(PoisonError::into_inner);
            st.idle -= 1;
            continue;
        };
        let Some(job) = st.queues.get_mut(&peer).and_then(|q| {
            let job = q.jobs.pop_front()?;
            q.running = Some(Instant::now());
            Some(job)
        }) else {
            // Gone (`peer_gone`, `cancel` take its turn out too; kept as
            // a guard): nothing of it waits any more.
            st.queues
                .retain(|p, q| *p != peer || q.running.is_some() || !q.jobs.is_empty());
            continue;
        };
        shared.waiting.fetch_sub(1, Ordering::Relaxed);
        // Activity first: who sees the job running (`counts`, Acquire)
        // sees the activity it made too.
        shared.activity.fetch_add(1, Ordering::Relaxed);
        shared.running.fetch_add(1, Ordering::Release);
        drop(st);
        shared.hooks.job_started(job.checks_pidfd());
        let result = job.run(&mut lists);
        // The handles go before the result is reported: once a transfer
        // completes, `MemHandle::into_buffers` must succeed.
        drop(job);
        st = shared.lock();
        shared.running.fetch_sub(1, Ordering::Relaxed);
        shared.activity.fetch_add(1, Ordering::Relaxed);
        if let Some(q) = st.queues.get_mut(&peer) {
            q.running = None;
            if q.jobs.is_empty() {
                st.queues.remove(&peer);
            } else {
                st.ready.push_back(peer);
            }
        }
        if st.closing {
            continue;
        }
        let first = st.done.is_empty();
        st.done.push(result);
        shared.done_len.store(st.done.len(), Ordering::Release);
        if first {
            if let Err(e) = shared.wake.signal() {
                tracing::warn!(error = %na_core::ErrorChain(&e), "sm: an RMA transfer thread could not wake its owner");
            }
        }
    }
}

/// Test hook (`test-hooks` feature): a view of a pool's shared state from
/// outside, for tests of what its lock guards (see
/// `SmPlugin::debug_rma_pool`). It holds the state alive, nothing more.
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub struct RmaPoolProbe {
    shared: Arc<Shared>,
}

#[cfg(feature = "test-hooks")]
impl RmaPoolProbe {
    /// Whether some thread (this one included) holds the pool's lock now.
    pub fn locked(&self) -> bool {
        matches!(
            self.shared.state.try_lock(),
            Err(std::sync::TryLockError::WouldBlock)
        )
    }

    /// How many peers have a queue entry (jobs queued or running).
    pub fn queue_entries(&self) -> usize {
        self.shared.lock().queues.len()
    }

    /// Makes every later attempt to start a transfer thread fail (`EAGAIN`),
    /// or lets them succeed again.
    pub fn fail_spawns(&self, fail: bool) {
        self.shared.hooks.set_fail_spawns(fail);
    }

    /// (threads started, those of them that have not taken the pool's
    /// lock yet). A thread names itself (`qs-sm-rma-K`) before it takes
    /// the lock: with none starting, every thread started has its name.
    pub fn threads(&self) -> (usize, usize) {
        let st = self.shared.lock();
        (st.threads, st.starting)
    }

    /// Makes the next `n` duplicates of a peer's pidfd for its jobs fail
    /// (`EMFILE`, as if our descriptors had run out).
    pub fn fail_pidfd_dups(&self, n: usize) {
        self.shared.hooks.set_fail_pidfd_dups(n);
    }

    /// How many of the failures [`fail_pidfd_dups`](Self::fail_pidfd_dups)
    /// asked for are still to come.
    pub fn pidfd_dup_failures_left(&self) -> usize {
        self.shared.hooks.pidfd_dup_failures_left()
    }

    /// Jobs a transfer thread started with their peer's pidfd to check
    /// (the others run without the pid check).
    pub fn pidfd_checked_jobs(&self) -> u64 {
        self.shared.hooks.pidfd_checked_jobs()
    }

    /// How many times a busy owner gave up its core for the transfer
    /// threads (`yield_now` in its spin while transfers were out).
    pub fn owner_yields(&self) -> u64 {
        self.shared.hooks.owner_yields()
    }

    /// Takes the pool's lock on a thread of its own and holds it until
    /// the returned value is dropped (returns once it is held). A process
    /// forked meanwhile must not drop that value (its thread is not there).
    pub fn hold(&self) -> RmaPoolHold {
        let shared = Arc::clone(&self.shared);
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let st = shared.lock();
            let _ = held_tx.send(());
            let _ = release_rx.recv();
            drop(st);
        });
        let _ = held_rx.recv();
        RmaPoolHold {
            release: Some(release_tx),
            thread: Some(thread),
        }
    }
}

/// See [`RmaPoolProbe::hold`]: the lock goes when this does.
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub struct RmaPoolHold {
    release: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[cfg(feature = "test-hooks")]
impl Drop for RmaPoolHold {
    fn drop(&mut self) {
        drop(self.release.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(feature = "test-hooks")]
impl RmaPool {
    /// See [`RmaPoolProbe`].
    pub fn probe(&self) -> RmaPoolProbe {
        RmaPoolProbe {
            shared: Arc::clone(&self.shared),
        }
    }
}

#[cfg(all(test, feature = "test-hooks"))]
mod tests {
    use std::sync::atomic::AtomicU8;

    use na_core::{Access, MemHandle, PluginId, RemoteMem, RemoteSegment, Rma};

    use super::*;

    /// A registration that records, when it is dropped (with the last
    /// clone of its handle), whether the pool's lock was held then.
    struct LockSpy {
        probe: RmaPoolProbe,
        seen: Arc<AtomicU8>,
    }

    const NOT_DROPPED: u8 = 0;
    const DROPPED_LOCKED: u8 = 1;
    const DROPPED_FREE: u8 = 2;

    impl Drop for LockSpy {
        fn drop(&mut self) {
            let s = if self.probe.locked() {
                DROPPED_LOCKED
            } else {
                DROPPED_FREE
            };
            self.seen.store(s, Ordering::SeqCst);
        }
    }

    /// A batch refused because no thread could start comes back to the
    /// caller whole, and its jobs (with the last clone of their handle,
    /// whose drop may run a plugin's deregistration) are dropped out of
    /// the pool's lock; nothing of the peer stays in the pool.
    #[test]
    fn a_batch_refused_for_want_of_a_thread_is_dropped_out_of_the_lock() {
        let mut pool = RmaPool::new(2, EventFd::new().unwrap());
        pool.probe().fail_spawns(true);
        let seen = Arc::new(AtomicU8::new(NOT_DROPPED));
        let mut jobs = {
            let local = MemHandle::zeroed(16, Access::ReadWrite);
            let spy = LockSpy {
                probe: pool.probe(),
                seen: Arc::clone(&seen),
            };
            local.attach_registration(PluginId(9), Arc::new(spy));
            let seg = RemoteSegment {
                addr: 4096,
                len: 16,
                key: 0,
            };
            let remote = RemoteMem::new(vec![seg], Access::ReadWrite).unwrap();
            let ops = [
                Rma::get(&local, 0, &remote, 0, 8, OpId(1)),
                Rma::put(&local, 8, &remote, 8, 8, OpId(2)),
            ];
            vec![
                Job::new(1, 7, 1, &ops[..1], None),
                Job::new(2, 7, 1, &ops[1..], None),
            ]
        };
        let e = pool.submit(7, &mut jobs).expect_err("no thread could start");
        assert!(
            e.to_string().contains("starting an sm RMA transfer thread"),
            "{e}"
        );
        assert_eq!(
            seen.load(Ordering::SeqCst),
            NOT_DROPPED,
            "the refused jobs were dropped inside submit (under its lock)"
        );
        assert_eq!(jobs.len(), 2, "the refused jobs come back to the caller");
        assert_eq!(pool.probe().queue_entries(), 0);
        assert_eq!(pool.counts(), (0, 0));
        pool.put_scratch(jobs);
        assert_eq!(seen.load(Ordering::SeqCst), DROPPED_FREE);
    }
}
