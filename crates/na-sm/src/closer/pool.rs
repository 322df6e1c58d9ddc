//! The closing threads: what [`super`] closes off the engine's threads is
//! dropped here, by one thread usually and by up to
//! [`MAX_CLOSING_THREADS`] when closes get stuck.
//!
//! One thread is started on first use (again in a forked child). A
//! release that never ends (a lingering socket, a FUSE file whose daemon
//! does not answer) holds its thread; once every thread has been in one
//! drop for [`CLOSE_STALL`], the next hand-off (or the next
//! [`super::congested`] check that would refuse a handshake) starts
//! another, which takes the queue on. So one stuck close no longer holds
//! every descriptor queued behind it, and with them every listener's
//! handshakes; a peer has to jam all of them at once. The threads stay
//! (at most [`MAX_CLOSING_THREADS`] per process, parked while idle).
//!
//! If no thread can be started, what is handed over is dropped in place,
//! and each hand-off tries again; the failure is logged once, when it
//! begins, not at every try (and its end once).

use std::cell::RefCell;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crate::sys::fork;

use super::{Item, PENDING_FDS};

/// Most threads one process runs to close what peers passed it: one at
/// first, another each time every running one has been stuck in a close
/// for [`CLOSE_STALL`].
pub const MAX_CLOSING_THREADS: usize = 4;

/// How long every closing thread must have been in one drop before
/// another is started: far longer than any close that does not wait on
/// someone else (microseconds), short enough that a jam refuses
/// handshakes only briefly.
pub const CLOSE_STALL: Duration = Duration::from_millis(100);

/// The closing threads of one fork generation.
struct Pool {
    /// The fork generation they were started in.
    generation: u64,
    tx: Sender<Item>,
    /// Shared by the threads: the one holding its lock waits in `recv`.
    rx: Arc<Mutex<Receiver<Item>>>,
    /// Per thread: when its current drop began ([`now_ticks`]), 0 while
    /// it waits for work.
    busy: Vec<Arc<AtomicU64>>,
}

static CLOSER: Mutex<Option<Pool>> = Mutex::new(None);

/// Items handed to this generation's closing threads and not dropped yet
/// (counted or not in `PENDING_FDS`): what `probe` (test hooks) reports as queued.
static ITEMS: AtomicUsize = AtomicUsize::new(0);

/// In a forked child: the items queued are its parent's threads' (see
/// [`super::reset_count_in_child`]).
pub(crate) fn reset_items_in_child() {
    ITEMS.store(0, Ordering::Relaxed);
}

/// Whether the last attempt to start a closing thread failed. Without a
/// thread every hand-off tries again (and closes in place), so the
/// failure is logged when this turns true, not at every try.
static SPAWN_FAILING: Flag = Flag::new();

/// In a forked child: a failure to start a closing thread was its
/// parent's, and the child starts its own pool. Without this, a child
/// forked during a spell of failures would not say when its own starts
/// fail (the spell's warning was said, by the parent), and would say that
/// a thread "could be started again" at its first start.
pub(crate) fn reset_spawn_failing_in_child() {
    SPAWN_FAILING.0.store(false, Ordering::Relaxed);
}

/// Whether the last attempt to start a closing thread failed (for the
/// fork tests: set with [`set_spawn_failing`]).
#[cfg(test)]
pub(crate) fn spawn_failing() -> bool {
    SPAWN_FAILING.0.load(Ordering::Relaxed)
}

/// Sets the flag of a failing start, as a failed start would.
#[cfg(test)]
pub(crate) fn set_spawn_failing(to: bool) {
    SPAWN_FAILING.set(to);
}

/// A boolean that says when it changes.
struct Flag(AtomicBool);

impl Flag {
    const fn new() -> Flag {
        Flag(AtomicBool::new(false))
    }

    /// Sets it to `to`; true if that changed it.
    fn set(&self, to: bool) -> bool {
        self.0.swap(to, Ordering::Relaxed) != to
    }
}

fn lock() -> MutexGuard<'static, Option<Pool>> {
    CLOSER.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Nanoseconds since the first call, plus one (never 0).
fn now_ticks() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let ns = EPOCH.get_or_init(Instant::now).elapsed().as_nanos();
    u64::try_from(ns).unwrap_or(u64::MAX - 1) + 1
}

impl Pool {
    /// A pool with its first thread, or `None` if no thread can be started.
    fn start(generation: u64) -> Option<Pool> {
        let (tx, rx) = channel::<Item>();
        let mut pool = Pool {
            generation,
            tx,
            rx: Arc::new(Mutex::new(rx)),
            busy: Vec::new(),
        };
        pool.spawn().then_some(pool)
    }

    /// Starts one more thread; false if it cannot be started.
    fn spawn(&mut self) -> bool {
        let rx = Arc::clone(&self.rx);
        let busy = Arc::new(AtomicU64::new(0));
        let mine = Arc::clone(&busy);
        let spawned = std::thread::Builder::new()
            .name("qs-sm-closer".into())
            .spawn(move || loop {
                let item = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
                let Ok(item) = item else { return };
                mine.store(now_ticks(), Ordering::Relaxed);
                close_now(item);
                mine.store(0, Ordering::Relaxed);
                ITEMS.fetch_sub(1, Ordering::Relaxed);
            });
        match spawned {
            Ok(_) => {
                if SPAWN_FAILING.set(false) {
                    tracing::info!("sm: a closing thread could be started again");
                }
                self.busy.push(busy);
                if self.busy.len() > 1 {
                    tracing::warn!(
                        threads = self.busy.len(),
                        stall = ?CLOSE_STALL,
                        "sm: every closing thread is stuck in a close (a peer's descriptor): started another"
                    );
                }
                true
            }
            Err(e) => {
                if SPAWN_FAILING.set(true) {
                    tracing::warn!(
                        error = %na_core::ErrorChain(&e),
                        "sm: cannot start a closing thread (said once until one starts again)"
                    );
                }
                false
            }
        }
    }

    /// Starts another thread if every one has been stuck in a drop for
    /// [`CLOSE_STALL`] and there are fewer than [`MAX_CLOSING_THREADS`].
    fn relieve(&mut self) {
        if self.busy.len() >= MAX_CLOSING_THREADS {
            return;
        }
        if self.busy.iter().all(stuck_since(now_ticks())) {
            self.spawn();
        }
    }
}

/// Whether a thread (its `busy` word) has been in one drop for at least
/// [`CLOSE_STALL`] at `now` ([`now_ticks`]).
fn stuck_since(now: u64) -> impl Fn(&Arc<AtomicU64>) -> bool {
    let stall = u64::try_from(CLOSE_STALL.as_nanos()).unwrap_or(u64::MAX);
    move |b| {
        let since = b.load(Ordering::Relaxed);
        since != 0 && now.saturating_sub(since) >= stall
    }
}

/// Where this process's closing threads stand: what tests wait for
/// instead of sleeping for a fixed time (see [`probe`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg(any(test, feature = "test-hooks"))]
pub struct ClosingThreads {
    /// Closing threads started (in this fork generation).
    pub threads: usize,
    /// Of them, those in a drop now.
    pub busy: usize,
    /// Of them, those in one drop for at least [`CLOSE_STALL`]: with all
    /// of them so, the next hand-off starts another thread.
    pub stuck: usize,
    /// Items handed over and not dropped yet (being dropped included).
    pub queued: usize,
}

#[cfg(any(test, feature = "test-hooks"))]
impl ClosingThreads {
    /// True when nothing handed over waits or is being dropped.
    pub fn idle(&self) -> bool {
        self.queued == 0 && self.busy == 0
    }
}

/// Where the closing threads stand now (a test hook: `na_sm::debug_closing_threads`).
#[cfg(any(test, feature = "test-hooks"))]
pub fn probe() -> ClosingThreads {
    let generation = fork::generation();
    let closer = lock();
    let Some(pool) = closer.as_ref().filter(|p| p.generation == generation) else {
        return ClosingThreads::default();
    };
    let now = now_ticks();
    ClosingThreads {
        threads: pool.busy.len(),
        busy: pool
            .busy
            .iter()
            .filter(|b| b.load(Ordering::Relaxed) != 0)
            .count(),
        stuck: pool.busy.iter().filter(|b| stuck_since(now)(b)).count(),
        queued: ITEMS.load(Ordering::Relaxed),
    }
}

/// Drops `item` and counts its descriptors off; a panic in the drop is
/// caught (a closing thread never ends).
fn close_now((item, fds): Item) {
    let _ = std::panic::catch_unwind(AssertUnwindSafe(move || drop(item)));
    PENDING_FDS.fetch_sub(fds, Ordering::Relaxed);
}

/// Hands `item` to the closing threads (started, or relieved, first), or
/// drops it here if none can be started.
pub(super) fn send(item: Item) {
    let generation = fork::generation();
    let mut closer = lock();
    if closer.as_ref().is_none_or(|p| p.generation != generation) {
        // Inherited through a fork: the threads are the parent's. The
        // pool is forgotten, not dropped (dropping touches the channel's
        // state, which one of them may have held at the fork).
        if let Some(old) = closer.take() {
            std::mem::forget(old);
        }
        *closer = Pool::start(generation);
    }
    let Some(pool) = closer.as_mut() else {
        drop(closer);
        close_now(item);
        return;
    };
    pool.relieve();
    ITEMS.fetch_add(1, Ordering::Relaxed);
    if let Err(returned) = pool.tx.send(item) {
        // Cannot happen while the pool holds the receiver; closed here if
        // it does, and a new pool next time.
        ITEMS.fetch_sub(1, Ordering::Relaxed);
        *closer = None;
        drop(closer);
        close_now(returned.0);
    }
}

/// [`Pool::relieve`] of this generation's pool, if there is one.
pub(super) fn relieve() {
    let generation = fork::generation();
    if let Some(pool) = lock().as_mut().filter(|p| p.generation == generation) {
        pool.relieve();
    }
}

thread_local! {
    /// The pool's lock, held by the thread that forks from just before
    /// to just after (see `sys::fork`).
    static HELD_FOR_FORK: RefCell<Option<MutexGuard<'static, Option<Pool>>>> = const { RefCell::new(None) };
}

/// Takes the pool's lock before a fork (`pthread_atfork`'s prepare
/// handler), so a child never finds it held by a thread it does not have.
pub(crate) fn hold_across_fork() {
    let guard = lock();
    let _ = HELD_FOR_FORK.try_with(|h| *h.borrow_mut() = Some(guard));
}

/// Lets the lock go after a fork, in the parent and in the child.
pub(crate) fn release_after_fork() {
    let _ = HELD_FOR_FORK.try_with(|h| h.borrow_mut().take());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::{Receiver, Sender};

    /// Its drop waits until told to go on (or 30 s): a close that is stuck.
    struct Stuck(Receiver<()>);

    impl Drop for Stuck {
        fn drop(&mut self) {
            let _ = self.0.recv_timeout(Duration::from_secs(30));
        }
    }

    /// Says on which thread it was dropped.
    struct Report(Sender<std::thread::ThreadId>);

    impl Drop for Report {
        fn drop(&mut self) {
            let _ = self.0.send(std::thread::current().id());
        }
    }

    /// A failure to start a closing thread is said once per spell: the
    /// flag reports a change only, and a start that works ends the spell.
    #[test]
    fn a_failing_start_is_reported_once_until_one_works() {
        let failing = Flag::new();
        assert!(failing.set(true), "the first failure");
        assert!(!failing.set(true), "a repeated failure");
        assert!(!failing.set(true), "a repeated failure");
        assert!(failing.set(false), "a start that works");
        assert!(!failing.set(false), "another start that works");
        assert!(failing.set(true), "the first failure of a new spell");
    }

    /// Far longer than a hand-off and a drop take, even on a loaded box.
    const T: Duration = Duration::from_secs(30);

    /// Waits (at most [`T`]) until `cond` holds; panics saying `what` if
    /// it never does.
    fn wait_for(what: &str, cond: impl Fn() -> bool) {
        let end = Instant::now() + T;
        while !cond() {
            assert!(Instant::now() < end, "never {what}: {:?}", probe());
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// With every closing thread stuck in a drop for [`CLOSE_STALL`], the
    /// next hand-off starts another thread, which drops what comes next
    /// while the stuck drops go on; no more than [`MAX_CLOSING_THREADS`]
    /// are started. (Each hand-off waits until the threads holding the
    /// stuck drops have been stuck that long, as the pool itself judges
    /// it, not for a fixed time: a loaded box may run a thread late.)
    #[test]
    fn a_stuck_drop_does_not_hold_what_comes_after_it() {
        let mut release = Vec::new();
        for _ in 0..MAX_CLOSING_THREADS {
            let (go, wait) = channel();
            send((Box::new(Stuck(wait)), 0));
            release.push(go);
            let n = release.len();
            wait_for(&format!("{n} closing threads stuck"), || probe().stuck >= n);
            let (tx, rx) = channel();
            send((Box::new(Report(tx)), 0));
            let all_stuck = n == MAX_CLOSING_THREADS;
            // Held with every thread stuck: a second is plenty to see it
            // held (it can only fail if it is not).
            let dropped = rx.recv_timeout(if all_stuck { Duration::from_secs(1) } else { T });
            let threads = probe().threads;
            assert!(threads <= MAX_CLOSING_THREADS, "{threads} closing threads");
            if !all_stuck {
                assert!(dropped.is_ok(), "held behind {n} stuck drops");
                continue;
            }
            // Every thread stuck: it waits for one of them.
            assert!(dropped.is_err(), "dropped with all {threads} threads stuck");
            drop(release.remove(0));
            assert!(rx.recv_timeout(T).is_ok(), "held after a drop ended");
        }
    }
}
