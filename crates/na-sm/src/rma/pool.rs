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

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use na_core::fasthash::FastMap;
use na_core::{NaError, OpId, Result, RmaDir};

use super::job::{Job, JobResult};
use crate::config::RMA_QUEUE_PER_PEER;
use crate::sys::cma::IovLists;
use crate::sys::eventfd::EventFd;

/// A job running this long is reported (debug level, at most once per
/// [`STUCK_REPORT_EVERY`]): its peer's memory probably stalls.
const STUCK_AFTER: Duration = Duration::from_secs(1);
/// See [`STUCK_AFTER`].
const STUCK_REPORT_EVERY: Duration = Duration::from_secs(10);
/// How often submits and cancels look for stuck jobs at most.
const STUCK_CHECK_EVERY: Duration = Duration::from_millis(250);

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
    queues: HashMap<u64, PeerQueue>,
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
    /// Each peer's pidfd, duplicated once for its jobs (`None`: it has
    /// none); dropped when it goes.
    pub pidfds: HashMap<u64, Option<Arc<std::os::fd::OwnedFd>>>,
    /// The fork generation the pool was made in.
    generation: u64,
    /// When [`report_stuck`](Self::report_stuck) looks next.
    next_stuck_check: Option<Instant>,
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
            }),
            max_threads,
            ops: FastMap::default(),
            next_job: 0,
            pidfds: HashMap::new(),
            generation: crate::sys::fork::generation(),
            next_stuck_check: None,
        }
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

    /// (jobs queued, jobs running).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.shared.waiting.load(Ordering::Relaxed),
            self.shared.running.load(Ordering::Relaxed),
        )
    }

    /// Queues `jobs` for `peer`, starting a worker if one is needed and
    /// allowed. Refused whole (nothing queued) past the peer's bound, or
    /// when no worker runs and none can be started.
    pub fn submit(&mut self, peer: u64, jobs: Vec<Job>) -> Result<()> {
        if jobs.is_empty() {
            // Nothing to run: no turn for the peer (an idle queue in the
            // ready list would get a second turn from its next submit).
            return Ok(());
        }
        let mut st = self.shared.lock();
        let q = st.queues.entry(peer).or_default();
        if q.jobs.len() + jobs.len() > RMA_QUEUE_PER_PEER {
            let (queued, running) = (q.jobs.len(), q.running.is_some());
            return Err(NaError::Plugin {
                plugin: "sm",
                message: format!(
                    "RMA batch refused, nothing started: {queued} transfer jobs already wait for this peer \
                     (at most {RMA_QUEUE_PER_PEER}, na_sm::RMA_QUEUE_PER_PEER){}; wait for completions",
                    if running { ", behind one still running" } else { "" }
                ),
            });
        }
        let was_idle = q.jobs.is_empty() && q.running.is_none();
        let n = jobs.len() as u64;
        q.jobs.extend(jobs);
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
                    // Nobody would run them: take them back.
                    if let Some(q) = st.queues.get_mut(&peer) {
                        let keep = q.jobs.len() - n as usize;
                        q.jobs.truncate(keep);
                    }
                    st.ready.retain(|&p| p != peer || !was_idle);
                    return Err(NaError::sys("starting an sm RMA transfer thread", e));
                }
                Err(e) => {
                    tracing::warn!(error = %na_core::ErrorChain(&e), "sm: starting another RMA transfer thread failed; the running ones go on");
                    break;
                }
            }
        }
        self.shared.waiting.fetch_add(n, Ordering::Relaxed);
        drop(st);
        self.shared.work.notify_one();
        self.report_stuck();
        Ok(())
    }

    fn spawn(&self, k: usize) -> std::io::Result<()> {
        let shared = Arc::clone(&self.shared);
        std::thread::Builder::new()
            .name(format!("qs-sm-rma-{k}"))
            .spawn(move || worker(&shared))
            .map(drop)
    }

    /// Takes every result that waits.
    pub fn take_done(&mut self) -> Vec<JobResult> {
        let mut st = self.shared.lock();
        self.shared.done_len.store(0, Ordering::Release);
        std::mem::take(&mut st.done)
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
        shared.running.fetch_add(1, Ordering::Relaxed);
        drop(st);
        let result = job.run(&mut lists);
        // The handles go before the result is reported: once a transfer
        // completes, `MemHandle::into_buffers` must succeed.
        drop(job);
        st = shared.lock();
        shared.running.fetch_sub(1, Ordering::Relaxed);
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
