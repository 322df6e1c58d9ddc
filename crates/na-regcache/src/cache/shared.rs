//! The state shared by a cache and its monitor: the table behind a
//! big-reader lock, the backend, and the lock-free monitor pre-filter.

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use super::entry::Backend;
use super::table::Table;
use crate::monitor::InvalidationSink;
use crate::registrar::Registrar;
use crate::sys::brlock::{BrLock, WriteGuard};

/// State shared by the cache, its handles and its monitor.
pub(crate) struct Shared<R: Registrar> {
    pub backend: Arc<Backend<R>>,
    pub table: BrLock<Table<R>>,
    pub caching: bool,
    /// Lookups wait for in-flight changes too ([`crate::Consistency::InFlight`]).
    pub in_flight: bool,
    /// Lower/upper bound of every range ever cached or being registered
    /// (lock-free pre-filter for monitors).
    pub lo: AtomicUsize,
    pub hi: AtomicUsize,
    /// Invalidated entries waiting to be deregistered (a hint).
    pub zombies: AtomicUsize,
    /// The table's invalidation generation, readable without the lock
    /// (a registration outside the index that found no tracking slot
    /// compares it with the one it was made at).
    pub generation: AtomicU64,
    /// The ranges of registrations in use outside the index (see
    /// [`TrackSlot`]), which every invalidation checks exactly.
    pub tracked: TrackedRanges,
}

/// Most registrations outside the index whose invalidation is tracked
/// exactly; beyond it one falls back on the table's short history of
/// invalidations, which says "changed" once that history wrapped.
pub const TRACK_SLOTS: usize = 4096;

const SLOT_FREE: u8 = 0;
const SLOT_LIVE: u8 = 1;
const SLOT_HIT: u8 = 2;

/// The range of one registration in use outside the index (memory
/// exposed to peers, an uncached fallback, a superseded entry). An
/// invalidation marks every overlapping slot hit: exact, however many
/// invalidations of other ranges come (the table's ring of recent
/// invalidations keeps only the last 64, and made such registrations
/// invalid after any 64 unrelated unmaps).
#[derive(Default)]
pub struct TrackSlot {
    start: AtomicUsize,
    end: AtomicUsize,
    state: AtomicU8,
}

/// A fixed array of [`TrackSlot`]s, allocated with the cache: marking them
/// allocates nothing (it runs inside the allocator hook).
pub struct TrackedRanges {
    slots: Box<[TrackSlot]>,
    /// One past the highest slot ever claimed: scans stop there.
    high: AtomicUsize,
}

impl TrackedRanges {
    pub fn new() -> TrackedRanges {
        TrackedRanges {
            slots: (0..TRACK_SLOTS).map(|_| TrackSlot::default()).collect(),
            high: AtomicUsize::new(0),
        }
    }

    /// Claims a slot for `[start, end)`, already hit if `changed`. Call
    /// with the table's write lock held (claims and marks take turns
    /// under it); `None` if every slot is in use.
    fn claim(&self, start: usize, end: usize, changed: bool) -> Option<usize> {
        let i = self
            .slots
            .iter()
            .position(|s| s.state.load(Ordering::Acquire) == SLOT_FREE)?;
        let s = &self.slots[i];
        s.start.store(start, Ordering::Relaxed);
        s.end.store(end, Ordering::Relaxed);
        s.state
            .store(if changed { SLOT_HIT } else { SLOT_LIVE }, Ordering::Release);
        self.high.fetch_max(i + 1, Ordering::Relaxed);
        Some(i)
    }

    /// Marks every live slot overlapping `[start, end)` hit. Call with the
    /// table's write lock held.
    fn mark(&self, start: usize, end: usize) {
        let high = self.high.load(Ordering::Relaxed).min(self.slots.len());
        for s in &self.slots[..high] {
            if s.state.load(Ordering::Acquire) == SLOT_LIVE
                && s.start.load(Ordering::Relaxed) < end
                && s.end.load(Ordering::Relaxed) > start
            {
                // Not a plain store: the owner may free the slot meanwhile
                // (a freed slot stays free).
                let _ = s
                    .state
                    .compare_exchange(SLOT_LIVE, SLOT_HIT, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
    }

    /// True once slot `i` was hit.
    pub fn hit(&self, i: usize) -> bool {
        self.slots[i].state.load(Ordering::Acquire) == SLOT_HIT
    }

    /// Frees slot `i` (its registration is gone). No lock needed.
    pub fn release(&self, i: usize) {
        self.slots[i].state.store(SLOT_FREE, Ordering::Release);
    }
}

impl<R: Registrar> Shared<R> {
    pub fn lock(&self) -> WriteGuard<'_, Table<R>> {
        self.table.write()
    }

    /// Invalidates `[start, end)` under the write lock, publishes the new
    /// generation and returns how many entries became zombies. Allocation-
    /// and free-free (it runs inside the allocator hook).
    pub fn invalidate_range(&self, start: usize, end: usize) -> usize {
        let mut t = self.lock();
        let n = t.invalidate(start, end);
        self.tracked.mark(start, end);
        self.generation.store(t.generation(), Ordering::Release);
        drop(t);
        if n > 0 {
            self.zombies.fetch_add(n, Ordering::SeqCst);
            let s = &self.backend.stats;
            s.invalidations.fetch_add(n as u64, Ordering::Relaxed);
        }
        n
    }

    /// False once an invalidation since generation `gen0` may have covered
    /// `[start, end)` (an uncached registration made at `gen0`). One load
    /// while nothing was invalidated; else a read-locked look at the
    /// table's ring of recent invalidations (conservative when it wrapped).
    pub fn unchanged_since(&self, gen0: u64, start: usize, end: usize) -> bool {
        self.generation.load(Ordering::Acquire) == gen0 || !self.table.read().changed_since(gen0, start, end)
    }

    /// Starts tracking `[start, end)` for a registration outside the index
    /// made at generation `gen`: a slot, hit at once if an invalidation
    /// since `gen` may have covered it. `t` is the table, write-locked.
    /// `None` when every slot is in use (then the registration checks the
    /// table's history instead).
    /// Nothing is logged here: the lock is held, and a subscriber that
    /// freed a large block would re-enter it through the allocator hook.
    pub fn track(&self, t: &Table<R>, gen: u64, start: usize, end: usize) -> Option<usize> {
        self.tracked.claim(start, end, t.changed_since(gen, start, end))
    }

    /// Claims a tracking slot for `[start, end)` now, live (not hit): for
    /// a registration about to be made, so that an invalidation while it
    /// is made marks it exactly, however many come. `t` is the table,
    /// write-locked. Release it with [`TrackedRanges::release`] if no entry
    /// takes it.
    pub fn claim_live(&self, _t: &Table<R>, start: usize, end: usize) -> Option<usize> {
        self.tracked.claim(start, end, false)
    }

    /// Widens the monitor pre-filter to cover `[start, end)`.
    pub fn widen(&self, start: usize, end: usize) {
        if self.lo.load(Ordering::SeqCst) > start {
            self.lo.fetch_min(start, Ordering::SeqCst);
        }
        if self.hi.load(Ordering::SeqCst) < end {
            self.hi.fetch_max(end, Ordering::SeqCst);
        }
    }
}

impl<R: Registrar> InvalidationSink for Shared<R> {
    fn invalidate(&self, start: usize, end: usize) {
        // In a forked child the parent's cache is dead weight (its
        // registrations are not the child's), and its lock may have been
        // held by a parent thread at the fork: never take it there.
        if !self.backend.in_owner() {
            return;
        }
        self.invalidate_range(start, end);
    }

    fn may_overlap(&self, start: usize, end: usize) -> bool {
        start < self.hi.load(Ordering::SeqCst) && end > self.lo.load(Ordering::SeqCst)
    }
}
