//! The state shared by a cache and its monitor: the table behind a
//! big-reader lock, the backend, and the lock-free monitor pre-filter.

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use super::coalesce::Pending;
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
    /// (a registration outside the index without a tracking slot, which
    /// only a slot table that cannot grow leaves, compares it with the
    /// one it was made at).
    pub generation: AtomicU64,
    /// The ranges of registrations in use outside the index and of the
    /// spans misses are registering (see [`TrackSlot`]), which every
    /// invalidation checks exactly.
    pub tracked: TrackedRanges,
    /// The spans misses are registering right now, for concurrent misses
    /// of one range to wait for (see `coalesce`).
    pub pending: Pending,
}

/// Slots in the first chunk of [`TrackedRanges`]; chunk `c` holds
/// `FIRST_CHUNK << c`.
const FIRST_CHUNK: usize = 1024;
/// Chunks at most: `FIRST_CHUNK * (2^CHUNKS - 1)` slots (about 10^9, so
/// never reached: beyond them a registration would fall back on the
/// table's short history of invalidations, conservatively).
const CHUNKS: usize = 20;

const SLOT_FREE: u8 = 0;
const SLOT_LIVE: u8 = 1;
const SLOT_HIT: u8 = 2;

/// The range of one registration in use outside the index (memory
/// exposed to peers, an uncached fallback, a superseded entry), or of a
/// span a miss is registering (until it is inserted or retried). An
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

/// The [`TrackSlot`]s, in chunks of doubling size that are made as
/// needed, before the cache lock is taken ([`TrackedRanges::reserve`]),
/// and never moved or freed while the cache lives: claiming and marking,
/// under the lock, allocate nothing (marking runs inside the allocator
/// hook), and a slot's index stays good for lock-free reads.
///
/// Every claim is backed by a reservation: `promised` counts the slots
/// claimed and not released plus those reserved and not claimed, and a
/// reservation returns only once the chunks hold that many slots. So a
/// claim, made under the write lock with a reservation in hand, always
/// finds a free slot.
pub struct TrackedRanges {
    chunks: [OnceLock<Box<[TrackSlot]>>; CHUNKS],
    /// Slots in the chunks made (grows only).
    capacity: AtomicUsize,
    /// Slots claimed and not released, plus slots reserved and not claimed.
    promised: AtomicUsize,
    /// Slots claimed and not released (a mark stops once it saw as many).
    live: AtomicUsize,
    /// One past the highest slot ever claimed: scans stop there.
    high: AtomicUsize,
    /// Where the next claim starts looking for a free slot (a hint).
    next: AtomicUsize,
}

/// Slots reserved for claims under the next write lock; what is left
/// unclaimed is given back on drop.
pub struct Reserved<'a> {
    ranges: &'a TrackedRanges,
    left: usize,
}

impl Reserved<'_> {
    /// Slots reserved and not claimed yet.
    pub fn left(&self) -> usize {
        self.left
    }

    /// Reserves `more` slots (makes chunks: call without the cache lock).
    pub fn add(&mut self, more: usize) {
        self.ranges.promise(more);
        self.left += more;
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.ranges.promised.fetch_sub(self.left, Ordering::AcqRel);
    }
}

/// Chunk and offset of slot `i`.
#[inline]
fn locate(i: usize) -> (usize, usize) {
    let q = i / FIRST_CHUNK + 1;
    let c = (usize::BITS - 1 - q.leading_zeros()) as usize;
    (c, i - FIRST_CHUNK * ((1 << c) - 1))
}

impl TrackedRanges {
    /// The first chunk made; the others as reservations need them.
    pub fn new() -> TrackedRanges {
        let t = TrackedRanges {
            chunks: [const { OnceLock::new() }; CHUNKS],
            capacity: AtomicUsize::new(0),
            promised: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
            high: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
        };
        t.grow_to(1);
        t
    }

    /// Slot `i`, if its chunk was made.
    #[inline]
    fn slot(&self, i: usize) -> Option<&TrackSlot> {
        let (c, o) = locate(i);
        self.chunks.get(c)?.get()?.get(o)
    }

    /// Every slot of the chunks made, in index order.
    fn made(&self) -> impl Iterator<Item = &TrackSlot> {
        self.chunks.iter().map_while(OnceLock::get).flat_map(|c| c.iter())
    }

    /// Makes chunks until they hold `want` slots (allocates: never under
    /// the cache lock).
    fn grow_to(&self, want: usize) {
        if self.capacity.load(Ordering::Acquire) >= want {
            return;
        }
        let mut cap = 0;
        for (c, chunk) in self.chunks.iter().enumerate() {
            let size = FIRST_CHUNK << c;
            chunk.get_or_init(|| (0..size).map(|_| TrackSlot::default()).collect());
            cap += size;
            if cap >= want {
                break;
            }
        }
        self.capacity.fetch_max(cap, Ordering::AcqRel);
    }

    /// Counts `n` more slots promised and makes chunks to hold them all.
    fn promise(&self, n: usize) {
        let want = self.promised.fetch_add(n, Ordering::AcqRel) + n;
        self.grow_to(want);
    }

    /// Reserves `n` slots for claims under the next write lock. Call
    /// without the cache lock: it may make a chunk.
    pub fn reserve(&self, n: usize) -> Reserved<'_> {
        self.promise(n);
        Reserved {
            ranges: self,
            left: n,
        }
    }

    /// Claims a slot of reservation `r` for `[start, end)`, already hit if
    /// `changed`. Call with the table's write lock held (claims and marks
    /// take turns under it). `None` only if `r` is used up (or the chunks
    /// could not grow): the caller then falls back on the history.
    fn claim(&self, r: &mut Reserved<'_>, start: usize, end: usize, changed: bool) -> Option<usize> {
        if r.left == 0 || !std::ptr::eq(r.ranges, self) {
            return None;
        }
        let cap = self.capacity.load(Ordering::Acquire);
        let from = self.next.load(Ordering::Relaxed).min(cap);
        let (i, s) = (from..cap).chain(0..from).find_map(|i| {
            self.slot(i)
                .filter(|s| s.state.load(Ordering::Acquire) == SLOT_FREE)
                .map(|s| (i, s))
        })?;
        s.start.store(start, Ordering::Relaxed);
        s.end.store(end, Ordering::Relaxed);
        self.live.fetch_add(1, Ordering::AcqRel);
        s.state
            .store(if changed { SLOT_HIT } else { SLOT_LIVE }, Ordering::Release);
        self.high.fetch_max(i + 1, Ordering::Relaxed);
        self.next.store(i + 1, Ordering::Relaxed);
        r.left -= 1;
        Some(i)
    }

    /// Marks every live slot overlapping `[start, end)` hit. Call with the
    /// table's write lock held (no claim meanwhile: the slots in use only
    /// get fewer, so the scan stops once it saw as many as were live).
    fn mark(&self, start: usize, end: usize) {
        let high = self.high.load(Ordering::Relaxed);
        let mut unseen = self.live.load(Ordering::Acquire);
        for s in self.made().take(high) {
            if unseen == 0 {
                break;
            }
            let state = s.state.load(Ordering::Acquire);
            if state == SLOT_FREE {
                continue;
            }
            unseen -= 1;
            if state == SLOT_LIVE
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

    /// True once slot `i` was hit (lock-free: an index math and two loads).
    #[inline]
    pub fn hit(&self, i: usize) -> bool {
        self.slot(i)
            .is_none_or(|s| s.state.load(Ordering::Acquire) == SLOT_HIT)
    }

    /// Frees slot `i` (its registration is gone). No lock needed.
    pub fn release(&self, i: usize) {
        let Some(s) = self.slot(i) else { return };
        s.state.store(SLOT_FREE, Ordering::Release);
        self.live.fetch_sub(1, Ordering::AcqRel);
        self.promised.fetch_sub(1, Ordering::AcqRel);
        self.next.fetch_min(i, Ordering::Relaxed);
    }
}

/// The tracking slot a miss claims for the span it is registering (see
/// [`Shared::track`]), or none (only if the slot table could not
/// grow). Released when dropped or replaced, unless an entry took it
/// ([`Claimed::take`]). Releasing is lock-free and allocation-free.
pub struct Claimed<'a> {
    ranges: &'a TrackedRanges,
    slot: Option<usize>,
}

impl<'a> Claimed<'a> {
    /// No slot yet.
    pub fn new(ranges: &'a TrackedRanges) -> Claimed<'a> {
        Claimed { ranges, slot: None }
    }

    /// Holds `slot` from now on, releasing the one held before.
    pub fn set(&mut self, slot: Option<usize>) {
        if let Some(i) = std::mem::replace(&mut self.slot, slot) {
            self.ranges.release(i);
        }
    }

    /// Whether an invalidation marked the slot since it was claimed;
    /// `None` without a slot (then the table's history has to tell).
    pub fn hit(&self) -> Option<bool> {
        self.slot.map(|i| self.ranges.hit(i))
    }

    /// The slot, no longer released here: its new owner releases it.
    pub fn take(&mut self) -> Option<usize> {
        self.slot.take()
    }
}

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        self.set(None);
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
    /// made at generation `gen`, or for a miss's span about to be
    /// registered (noted at `gen`): a slot of reservation `r`, hit at once
    /// if an invalidation since `gen` may have covered it. `t` is the table,
    /// write-locked. `None` only when `r` is used up (then the
    /// registration checks the table's history instead).
    /// Nothing is logged here: the lock is held, and a subscriber that
    /// freed a large block would re-enter it through the allocator hook.
    pub fn track(
        &self,
        t: &Table<R>,
        r: &mut Reserved<'_>,
        gen: u64,
        start: usize,
        end: usize,
    ) -> Option<usize> {
        self.tracked
            .claim(r, start, end, t.changed_since(gen, start, end))
    }

    /// Claims a tracking slot of reservation `r` for `[start, end)` now,
    /// live (not hit): for a registration about to be made (by
    /// `get_unshared`), so that an invalidation while it is made
    /// marks it exactly, however many of other ranges come. `t` is the
    /// table, write-locked. Release it with [`TrackedRanges::release`] (or
    /// through a [`Claimed`]) if no entry takes it.
    pub fn claim_live(&self, _t: &Table<R>, r: &mut Reserved<'_>, start: usize, end: usize) -> Option<usize> {
        self.tracked.claim(r, start, end, false)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn slot_indices_map_onto_doubling_chunks() {
        assert_eq!(locate(0), (0, 0));
        assert_eq!(locate(FIRST_CHUNK - 1), (0, FIRST_CHUNK - 1));
        assert_eq!(locate(FIRST_CHUNK), (1, 0));
        assert_eq!(locate(3 * FIRST_CHUNK - 1), (1, 2 * FIRST_CHUNK - 1));
        assert_eq!(locate(3 * FIRST_CHUNK), (2, 0));
        let last = FIRST_CHUNK * ((1 << CHUNKS) - 1) - 1;
        assert_eq!(locate(last), (CHUNKS - 1, (FIRST_CHUNK << (CHUNKS - 1)) - 1));
    }

    /// Claims past the first chunks grow the table; marks stay exact and
    /// released slots are reused.
    #[test]
    fn the_table_grows_and_marks_exactly() {
        let t = TrackedRanges::new();
        let n = 5 * FIRST_CHUNK;
        let mut r = t.reserve(n);
        let ids: Vec<_> = (0..n)
            .map(|i| t.claim(&mut r, i * 10, i * 10 + 5, false).expect("reserved"))
            .collect();
        assert_eq!(r.left(), 0);
        assert!(t.claim(&mut r, 0, 1, false).is_none(), "beyond the reservation");
        drop(r);
        t.mark(10 * (n - 1), 10 * (n - 1) + 1);
        t.mark(3, 4);
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(t.hit(id), i == 0 || i == n - 1, "slot of #{i}");
        }
        let cap = t.capacity.load(Ordering::Relaxed);
        for &id in &ids {
            t.release(id);
        }
        assert_eq!(t.promised.load(Ordering::Relaxed), 0);
        let mut r = t.reserve(n);
        for i in 0..n {
            assert!(t.claim(&mut r, i, i + 1, true).is_some());
        }
        assert_eq!(
            t.capacity.load(Ordering::Relaxed),
            cap,
            "released slots are reused"
        );
    }

    /// Threads reserving, claiming under a lock (as the cache does) and
    /// releasing without it: every claim backed by a reservation finds a
    /// slot, however the table grows meanwhile.
    #[test]
    fn a_reserved_claim_always_finds_a_slot() {
        let t = TrackedRanges::new();
        let lock = Mutex::new(());
        std::thread::scope(|s| {
            for k in 1..=4usize {
                let (t, lock) = (&t, &lock);
                s.spawn(move || {
                    let mut held = Vec::new();
                    for round in 0..200 {
                        let mut r = t.reserve(k * 7);
                        let g = lock.lock().unwrap();
                        for _ in 0..k * 7 {
                            held.push(t.claim(&mut r, round, round + 1, false).expect("a reserved slot"));
                        }
                        drop(g);
                        if round % 50 == 49 {
                            for id in held.drain(..) {
                                t.release(id);
                            }
                        }
                    }
                    for id in held {
                        t.release(id);
                    }
                });
            }
        });
        assert_eq!(t.promised.load(Ordering::Relaxed), 0);
        assert_eq!(t.live.load(Ordering::Relaxed), 0);
        assert!(t.capacity.load(Ordering::Relaxed) > FIRST_CHUNK, "grew meanwhile");
    }
}
