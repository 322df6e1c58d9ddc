//! One registration and the handle users hold on it.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use super::shared::{Reserved, Shared};
use super::table::Table;
use crate::monitor::{Monitor, Watch};
use crate::registrar::{Access, Registrar};
use crate::stats::{Stats, StripedCounter};
use crate::sys::brlock::stripe;
use crate::sys::mem::ForkGuard;

/// What every entry needs to deregister itself: the registrar, the counters,
/// the monitor (to unsubscribe) and the fork guard.
pub(crate) struct Backend<R: Registrar> {
    pub registrar: R,
    pub stats: Stats,
    pub monitor: Option<Arc<dyn Monitor>>,
    pub fork_guard: Option<ForkGuard>,
    /// Set when the cache is dropped: clears the validity of unwatched
    /// handles (watched ones are cleared by an invalidation of everything).
    pub closed: AtomicBool,
}

impl<R: Registrar> Backend<R> {
    /// False in a forked child of the process that built the cache.
    #[inline]
    pub fn in_owner(&self) -> bool {
        self.fork_guard.as_ref().is_none_or(ForkGuard::in_creator)
    }
}

/// Slot number of an entry that is not in the cache.
pub(crate) const NO_SLOT: u32 = u32::MAX;

/// The [`Refs`] bit set while the entry is in the cache index.
const INDEXED: usize = 1 << (usize::BITS - 1);

/// Handles one registration may have at most: 2^62 on 64-bit targets,
/// 2^30 on 32-bit ones (reachable only by leaking handles). Acquiring
/// one more is refused ([`Error::TooManyHandles`](crate::Error::TooManyHandles))
/// before the count can reach the `INDEXED` bit (the top bit of the
/// word that holds the count): an acquisition adds one, compares the
/// count it read and takes the one back if that was at the limit, so the
/// count exceeds the limit by at most the threads acquiring at that
/// moment, far fewer than the `INDEXED / 2` between the limit and the
/// bit.
pub const MAX_HANDLES: usize = INDEXED >> 1;

/// An entry's count of live handles and whether it is in the cache index,
/// in one word. The last handle's drop and the table taking the entry out
/// of the index (under the write lock) thus see each other's change, and
/// the counts of entries in use inside and outside the index
/// ([`Stats::busy_cached`], [`Stats::busy_outside`]) stay exact: the
/// table tells from them, without a sweep, that no cached entry is idle.
pub(crate) struct Refs(AtomicUsize);

impl Refs {
    /// Live handles (the insertion's own counts as one until it returns).
    #[inline]
    pub fn users(&self) -> usize {
        self.0.load(Ordering::Acquire) & !INDEXED
    }

    /// True while the entry is in the cache index.
    #[inline]
    pub fn indexed(&self) -> bool {
        self.0.load(Ordering::Acquire) & INDEXED != 0
    }
}

/// A registration of `[start, end)`. Deregistered when the last `Arc` drops,
/// which the cache arranges to happen outside its lock.
pub(crate) struct Entry<R: Registrar> {
    pub start: usize,
    pub end: usize,
    pub access: Access,
    /// Cleared by invalidation (and when the cache is dropped).
    pub valid: AtomicBool,
    /// Live handles, and whether the entry is in the cache index.
    pub refs: Refs,
    /// CLOCK second-chance bit, set by hits.
    pub referenced: AtomicBool,
    /// Slot in the cache's table (set on insertion), `NO_SLOT` when never cached.
    pub slot: AtomicU32,
    /// The monitor's subscription, if any.
    pub watch: Option<Watch>,
    /// For a watched registration outside the index (handed out uncached,
    /// for peers, or superseded): its tracking slot, or the invalidation
    /// generation it was made at if it got none (see [`Entry::track_since`]).
    tracker: OnceLock<Tracker<R>>,
    region: Option<R::Region>,
    pub backend: Arc<Backend<R>>,
}

/// What an entry outside the index checks its validity against.
struct Tracker<R: Registrar> {
    shared: Arc<Shared<R>>,
    /// The cache's invalidation generation when the entry was made.
    gen: u64,
    /// Made while its range was settling (a discard raced the miss past
    /// its settle retries or its wait budget): stale from then on.
    stale_at: Option<Instant>,
    /// Its slot in `shared.tracked` (exact), or `None` (only if the slot
    /// table could not grow): the table's history since `gen` decides
    /// (conservative once it wrapped).
    slot: Option<usize>,
}

impl<R: Registrar> Entry<R> {
    pub fn new(
        backend: &Arc<Backend<R>>,
        (start, end, access): (usize, usize, Access),
        region: R::Region,
        watch: Option<Watch>,
    ) -> Entry<R> {
        backend
            .stats
            .bytes_registered
            .fetch_add((end - start) as u64, Ordering::Relaxed);
        Entry {
            start,
            end,
            access,
            valid: AtomicBool::new(true),
            refs: Refs(AtomicUsize::new(0)),
            referenced: AtomicBool::new(false),
            slot: AtomicU32::new(NO_SLOT),
            watch,
            tracker: OnceLock::new(),
            region: Some(region),
            backend: Arc::clone(backend),
        }
    }

    /// A new entry (out of the index) whose count already says `users`
    /// handles: for tests of the limit, which real handles would take
    /// 2^62 leaks to reach.
    #[cfg(test)]
    pub fn with_users(
        backend: &Arc<Backend<R>>,
        range: (usize, usize, Access),
        region: R::Region,
        users: usize,
    ) -> Entry<R> {
        let e = Entry::new(backend, range, region, None);
        e.refs.0.store(users, Ordering::Relaxed);
        e
    }

    /// Adds `n` (wrapping) to the user count as is: for tests of the
    /// limit on an entry in the index.
    #[cfg(test)]
    pub fn add_users(&self, n: usize) {
        self.refs.0.fetch_add(n, Ordering::Relaxed);
    }

    /// Makes an entry that stays out of the index answer validity checks
    /// from the cache's invalidations of its range after generation `gen`,
    /// and (if given) from the clock: stale from `stale_at` on. `t` is the
    /// table, write-locked: a later invalidation then finds the entry's
    /// tracking slot, one of reservation `r`. Allocates nothing.
    pub fn track_since(
        &self,
        shared: Arc<Shared<R>>,
        t: &Table<R>,
        r: &mut Reserved<'_>,
        gen: u64,
        stale_at: Option<Instant>,
    ) {
        if self.tracker.get().is_some() {
            // Set once, when the entry left (or never entered) the index.
            return;
        }
        let slot = shared.track(t, r, gen, self.start, self.end);
        self.track_with(shared, gen, stale_at, slot);
    }

    /// Like [`track_since`](Self::track_since) with a slot claimed
    /// already (live since generation `gen`, under the write lock), or
    /// `None` (then the history since `gen` decides). No lock needed.
    pub fn track_with(
        &self,
        shared: Arc<Shared<R>>,
        gen: u64,
        stale_at: Option<Instant>,
        slot: Option<usize>,
    ) {
        if let Err(t) = self.tracker.set(Tracker {
            shared,
            gen,
            stale_at,
            slot,
        }) {
            // Tracked already (cannot happen for a new entry): give the
            // new slot back.
            if let Some(i) = t.slot {
                t.shared.tracked.release(i);
            }
        }
    }

    /// The validity flag, and for a tracked uncached entry the absence of
    /// invalidations of its range and of its stale time (either clears the
    /// flag for good). False in a forked child of the process that made
    /// the cache, without a look at the cache (whose lock a parent thread
    /// may have held at the fork).
    #[inline]
    pub fn is_valid(&self) -> bool {
        if !self.valid.load(Ordering::Acquire) || !self.backend.in_owner() {
            return false;
        }
        match self.tracker.get() {
            Some(t)
                if t.stale_at.is_some_and(|at| Instant::now() >= at)
                    || match t.slot {
                        Some(i) => t.shared.tracked.hit(i),
                        None => !t.shared.unchanged_since(t.gen, self.start, self.end),
                    } =>
            {
                self.valid.store(false, Ordering::Release);
                false
            }
            Some(_) => true,
            // Watched: an invalidation clears the flag (the cache's drop
            // invalidates everything). Unwatched (monitor refused the
            // range, caching disabled, the `none` monitor): only the
            // cache's drop does.
            None if self.watch.is_some() => true,
            None if self.backend.closed.load(Ordering::Acquire) => {
                self.valid.store(false, Ordering::Release);
                false
            }
            None => true,
        }
    }

    /// One more user of an entry in the index (a hit, read lock held);
    /// the first one counts it busy (under the lock: a sweep, which
    /// needs the write lock, never counts an entry held by a hit idle).
    /// False, and no user more, if the entry has [`MAX_HANDLES`] users
    /// already (a compare of the count the addition read, only when it
    /// was not zero).
    #[inline]
    #[must_use]
    pub fn acquire_cached(&self) -> bool {
        let old = self.refs.0.fetch_add(1, Ordering::AcqRel) & !INDEXED;
        if old == 0 {
            self.backend.stats.busy_cached.add(1);
        } else if old >= MAX_HANDLES {
            self.release();
            return false;
        }
        true
    }

    /// One more user of an entry that has one (a handle's clone); false,
    /// and no user more, if it has [`MAX_HANDLES`] already.
    #[inline]
    #[must_use]
    pub fn acquire_more(&self) -> bool {
        // A handle's entry has a user already: never the first.
        if self.refs.0.fetch_add(1, Ordering::AcqRel) & !INDEXED >= MAX_HANDLES {
            self.release();
            return false;
        }
        true
    }

    /// The first user of an entry outside the index (handed out uncached,
    /// for peers), counted busy.
    pub fn acquire_outside(&self) {
        self.refs.0.fetch_add(1, Ordering::AcqRel);
        self.backend.stats.busy_outside.add(1);
    }

    /// One user less; the last one counts the entry busy no longer, inside
    /// or outside the index as it is at that moment. No lock.
    ///
    /// The last user uncounts the entry *before* its user count reaches
    /// zero (and counts it back if the count changed meanwhile: a hit or a
    /// clone, or the entry leaving the index), so `busy_cached` never
    /// counts an entry whose count reads zero: a miss that finds no idle
    /// entry by the count is right, not a release behind. (Before, the
    /// count reached zero first, and for the few instructions until the
    /// striped counter followed, or as long as the thread was preempted
    /// there, a miss of a full cache answered "no room" and a failed
    /// registration evicted nothing, though the entry was idle.) The
    /// other way round is harmless: counted idle a moment early, the entry
    /// is still held, so a sweep looks at it and passes it by.
    #[inline]
    pub fn release(&self) {
        // The thread's stripe first: nothing is live across its lookup.
        let stripe = stripe();
        let cur = self.refs.0.load(Ordering::Relaxed);
        let last = cur & !INDEXED == 1;
        if last {
            self.busy(cur).add_at(stripe, -1);
            #[cfg(test)]
            tests::in_release(self);
        }
        if !self.lower(cur) {
            self.release_contended(cur, last);
        }
    }

    /// [`release`](Self::release) once its first try found the user count
    /// changed since it loaded `cur` (uncounted if `last`): counts the
    /// entry back and tries again until the count stays put.
    #[cold]
    #[inline(never)]
    fn release_contended(&self, mut cur: usize, mut last: bool) {
        loop {
            if last {
                self.busy(cur).add(1);
            }
            cur = self.refs.0.load(Ordering::Relaxed);
            last = cur & !INDEXED == 1;
            if last {
                self.busy(cur).add(-1);
                #[cfg(test)]
                tests::in_release(self);
            }
            if self.lower(cur) {
                return;
            }
        }
    }

    /// Lowers the user count from `cur` by one, if it still is `cur`.
    #[inline]
    fn lower(&self, cur: usize) -> bool {
        self.refs
            .0
            .compare_exchange(cur, cur - 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    /// The count of busy entries that counts this one, by the refs word `refs`.
    #[inline]
    fn busy(&self, refs: usize) -> &StripedCounter {
        let s = &self.backend.stats;
        if refs & INDEXED != 0 {
            &s.busy_cached
        } else {
            &s.busy_outside
        }
    }

    /// Enters the index with one user (the inserting miss). Under the
    /// write lock; the entry must not be in the index.
    pub fn enter_index(&self) {
        let old = self.refs.0.fetch_add(INDEXED + 1, Ordering::AcqRel);
        debug_assert!(old & INDEXED == 0, "entered the index twice");
        if old & !INDEXED == 0 {
            self.backend.stats.busy_cached.add_locked(1);
        }
    }

    /// Leaves the index (under the write lock): if it is in use, its users
    /// now hold it outside. Does nothing if it was not in the index.
    pub fn leave_index(&self) {
        let old = self.refs.0.fetch_and(!INDEXED, Ordering::AcqRel);
        if old & INDEXED != 0 && old & !INDEXED != 0 {
            let s = &self.backend.stats;
            s.busy_cached.add_locked(-1);
            s.busy_outside.add_locked(1);
        }
    }

    pub fn region(&self) -> &R::Region {
        // Present from construction until drop.
        self.region.as_ref().expect("entry region present until drop")
    }
}

impl<R: Registrar> Drop for Entry<R> {
    fn drop(&mut self) {
        if let Some(Tracker {
            shared,
            slot: Some(i),
            ..
        }) = self.tracker.get()
        {
            shared.tracked.release(*i);
        }
        let Some(region) = self.region.take() else { return };
        let b = &self.backend;
        if !b.in_owner() {
            // A forked child must not touch the parent's registrations (for
            // io_uring and verbs the device context is shared with the parent).
            std::mem::forget(region);
            return;
        }
        if let (Some(m), Some(w)) = (&b.monitor, &self.watch) {
            m.unsubscribe(w);
        }
        b.stats
            .bytes_registered
            .fetch_sub((self.end - self.start) as u64, Ordering::Relaxed);
        if let Err(e) = b.registrar.deregister(region) {
            Stats::bump(&b.stats.deregister_failures);
            tracing::warn!(start = self.start, len = self.end - self.start, error = %e, "deregistration failed");
        }
    }
}

/// A reference-counted handle on a registration covering at least the
/// requested range. Dropping the last handle of a cached registration makes
/// it idle (evictable); of an uncached one, deregisters it.
pub struct Registration<R: Registrar> {
    pub(crate) entry: Arc<Entry<R>>,
}

impl<R: Registrar> Registration<R> {
    /// The registrar's value (for verbs: the MR with lkey/rkey).
    pub fn region(&self) -> &R::Region {
        self.entry.region()
    }

    /// Start of the registered range (may be below the requested address).
    pub fn addr(&self) -> usize {
        self.entry.start
    }

    /// Length of the registered range.
    pub fn len(&self) -> usize {
        self.entry.end - self.entry.start
    }

    /// Never true (ranges are non-empty); provided for API symmetry.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The registration's access rights.
    pub fn access(&self) -> Access {
        self.entry.access
    }

    /// False once a monitor saw the mapping change or
    /// [`Cache::invalidate`](crate::Cache::invalidate) covered it, once the
    /// cache was dropped, and always in a forked child of the process that
    /// made the cache. Two loads (the flag and the cache's fork guard). A
    /// watched registration outside the index (handed out uncached or for
    /// peers, or superseded by a wider one) adds two loads: where its
    /// tracking slot is, and the slot, which every invalidation of its
    /// range marks (the slot table grows as needed, so every such
    /// registration has one). An unwatched
    /// one (see [`Registration::is_cached`]) adds one load of the cache's
    /// "dropped" flag: only the cache's drop (or a fork) makes it false.
    /// With userfaultfd, the flag is cleared by the reader thread a few
    /// microseconds after the kernel released the unmapping thread; use
    /// [`Registration::is_valid_now`] to close that window.
    #[inline]
    pub fn is_valid(&self) -> bool {
        self.entry.is_valid()
    }

    /// Like [`Registration::is_valid`] after waiting for the monitor's
    /// in-flight events, so a change that completed before this call counts.
    /// Always false in a forked child of the process that made the cache.
    pub fn is_valid_now(&self) -> bool {
        if !self.entry.backend.in_owner() {
            // A forked child: the parent's registration is not the child's,
            // and the monitor's reader (a parent thread) does not run here.
            return false;
        }
        if let Some(m) = &self.entry.backend.monitor {
            // No system call: the changes that returned are the ones to see.
            m.sync();
            if let Some(w) = &self.entry.watch {
                if m.changed(w) {
                    return false;
                }
            }
        }
        self.is_valid()
    }

    /// True while the registration is in the cache (false: uncached
    /// fallback, or evicted/invalidated since). An uncached fallback made
    /// because the cache was full, or because discards of its range kept
    /// racing the miss, is watched: its validity flag clears when its range
    /// changes (and, for one made while a discard settled, when the settle
    /// time ends). One made with caching
    /// disabled, because the monitor refused the range, or (with the
    /// `none` monitor) by `get_unshared` or after registering a merged
    /// range failed, is not watched: its validity flag clears only when the
    /// cache is dropped. Use it for the operation at hand and drop it.
    pub fn is_cached(&self) -> bool {
        self.entry.refs.indexed()
    }
}

impl<R: Registrar> Registration<R> {
    /// One more handle on the same registration, or
    /// [`Error::TooManyHandles`](crate::Error::TooManyHandles) if it has
    /// [`MAX_HANDLES`] already (only reachable by leaking handles).
    pub fn try_clone(&self) -> crate::Result<Registration<R>> {
        if !self.entry.acquire_more() {
            return Err(crate::Error::TooManyHandles {
                addr: self.entry.start,
                len: self.entry.end - self.entry.start,
                max: MAX_HANDLES,
            });
        }
        Ok(Registration {
            entry: Arc::clone(&self.entry),
        })
    }
}

impl<R: Registrar> Clone for Registration<R> {
    /// One more handle on the same registration.
    ///
    /// # Panics
    ///
    /// If the registration has [`MAX_HANDLES`] handles already (2^30 on
    /// 32-bit targets; only reachable by leaking handles): the count
    /// would otherwise run into the bit that says the entry is cached.
    /// [`Registration::try_clone`] returns an error instead.
    fn clone(&self) -> Self {
        match self.try_clone() {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        }
    }
}

impl<R: Registrar> Drop for Registration<R> {
    fn drop(&mut self) {
        // Idle cached entries stay in the table (the CLOCK hand finds them);
        // the last Arc of an uncached or detached entry deregisters it.
        self.entry.release();
    }
}

impl<R: Registrar> std::fmt::Debug for Registration<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("access", &self.access())
            .field("valid", &self.is_valid())
            .field("cached", &self.is_cached())
            .finish()
    }
}

/// A test seam: [`Entry::release`] calls [`in_release`](tests::in_release)
/// between its two steps (uncounting the entry and lowering its user
/// count), so a unit test can look at the counts in that window.
#[cfg(test)]
pub(crate) mod tests {
    use std::cell::RefCell;

    thread_local! {
        /// Run (once per step, taken out while it runs) by releases on
        /// this thread.
        pub static IN_RELEASE: RefCell<Option<Box<dyn Fn()>>> = RefCell::new(None);
    }

    /// Runs the calling thread's hook, if any.
    pub fn in_release<T>(_: &T) {
        if let Some(f) = IN_RELEASE.with(|h| h.borrow_mut().take()) {
            f();
            IN_RELEASE.with(|h| *h.borrow_mut() = Some(f));
        }
    }
}
