//! The lock-protected state of a cache: a slot table, a sorted index of
//! ranges none of which contains another (see [`Table::superseded`]), a
//! CLOCK (second-chance) hand approximating LRU
//! over idle entries, and a list of invalidated ("zombie") entries awaiting
//! deregistration. Hits only need the read lock: they bump the entry's user
//! count and set its `referenced` bit; releasing a handle takes no lock.
//! The cache counts the entries in the index that are in use
//! (`Stats::busy_cached`, see `entry::Refs`): while none is idle, a miss
//! that needs room and `take_idle` sweep nothing.
//!
//! Every method runs under the cache lock and **never allocates or frees
//! memory**: the index and slot vectors are reserved for `max_count`
//! entries up front, and `Arc`s that leave the table are moved into
//! vectors the caller reserved before locking (and drops after unlocking);
//! a method that would need more room than such a vector has takes what
//! fits, or nothing, and says so. Freeing could unmap a page registered
//! with userfaultfd, and allocating too: an allocator that purges memory
//! inside `malloc` (jemalloc's decay, mimalloc's collect) may `madvise`
//! or unmap a watched range there. Either blocks the thread on the
//! monitor's reader, which needs this lock to apply the event.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::entry::Entry;
use crate::registrar::{Access, Registrar};
use crate::stats::StripedCounter;

const NIL: u32 = u32::MAX;
/// Invalidations remembered for misses racing with them.
const RING: usize = 64;
/// Slots an eviction sweep ([`Table::insert`], [`Table::take_idle`])
/// looks at under one hold of the write lock: past them it stops, the
/// caller lets the lock go (readers, so hits, get in) and calls again, and
/// the sweep goes on where it stopped. Without the bound, a miss of a full
/// cache whose entries were all in use looked at every slot twice (two
/// CLOCK turns) under the lock before giving up, up to 2 million entry
/// loads at the largest `max_count`, blocking every hit meanwhile.
pub(crate) const SWEEP_STEP: usize = 256;

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    Live,
    Zombie,
}

struct Slot<R: Registrar> {
    entry: Option<Arc<Entry<R>>>,
    state: State,
    /// Next zombie.
    next: u32,
}

#[derive(Clone, Copy)]
struct Item {
    start: usize,
    end: usize,
    slot: u32,
}

/// Outcome of [`Table::insert`]; the entries it took out (superseded or
/// evicted) are in its `doomed` vector, to drop after unlocking.
pub(crate) enum Insert {
    /// Inserted.
    Done {
        /// Idle entries evicted to make room.
        evicted: usize,
    },
    /// Not enough idle entries to make room: hand the registration out uncached.
    NoRoom {
        /// Idle entries evicted on the way.
        evicted: usize,
    },
    /// Nothing done: `doomed` needs room for `need` more entries (reserve
    /// it after unlocking, then lock and try again).
    Short {
        /// Spare capacity `doomed` needs.
        need: usize,
    },
    /// The eviction sweep looked at [`SWEEP_STEP`] slots without making
    /// enough room yet: unlock (the victims are in `doomed`, idle, out of
    /// the table), lock and call again with the same [`Sweep`].
    Paused {
        /// Idle entries evicted so far in this call.
        evicted: usize,
    },
}

/// The progress of one insertion's eviction sweep across lock holds:
/// slots looked at since the last victim (two CLOCK turns without one
/// mean nothing can be evicted).
#[derive(Default)]
pub(crate) struct Sweep {
    fruitless: usize,
}

/// What one step of the CLOCK sweep found.
enum Victim {
    /// An idle entry whose second chance is used up: its slot.
    Found(u32),
    /// Two full turns without one.
    None,
    /// This hold's budget of slots is spent.
    Paused,
}

pub(crate) struct Table<R: Registrar> {
    slots: Vec<Slot<R>>,
    free: Vec<u32>,
    index: Vec<Item>,
    hand: usize,
    zombie_head: u32,
    zombies: usize,
    live: usize,
    bytes: usize,
    gen: u64,
    ring: [(u64, usize, usize); RING],
    max_count: usize,
    max_bytes: usize,
    /// Slots the eviction sweeps looked at ([`crate::CacheStats::sweep_steps`]).
    sweep_steps: u64,
    /// Entries inserted so far ([`Table::inserts`]).
    inserts: u64,
}

impl<R: Registrar> Table<R> {
    pub fn new(max_count: usize, max_bytes: usize) -> Table<R> {
        Table {
            slots: Vec::with_capacity(max_count),
            free: Vec::with_capacity(max_count),
            index: Vec::with_capacity(max_count),
            hand: 0,
            zombie_head: NIL,
            zombies: 0,
            live: 0,
            bytes: 0,
            gen: 0,
            ring: [(0, 0, 0); RING],
            max_count,
            max_bytes,
            sweep_steps: 0,
            inserts: 0,
        }
    }

    /// Slots the eviction sweeps looked at so far.
    pub fn sweep_steps(&self) -> u64 {
        self.sweep_steps
    }

    /// How many entries in the index are idle (no handle), from the count
    /// of those in use (`busy`, the cache's `Stats::busy_cached`): eight
    /// loads instead of a sweep. Under the write lock no hit runs, so
    /// nothing makes an entry busy meanwhile; the last handle's release
    /// uncounts its entry before the entry's user count reaches zero, so
    /// an entry whose count reads zero is never counted busy (one being
    /// dropped right now may be counted idle a moment early: a sweep then
    /// looks at it and passes it by).
    fn idle(&self, busy: &StripedCounter) -> usize {
        self.live.saturating_sub(busy.sum() as usize)
    }

    /// Entries inserted into the index so far: a miss notes it with its
    /// span, and only when it moved since may an entry the span does not
    /// cover overlap the request (see `Miss::raced_hit`).
    pub fn inserts(&self) -> u64 {
        self.inserts
    }

    pub fn live(&self) -> usize {
        self.live
    }

    pub fn generation(&self) -> u64 {
        self.gen
    }

    /// Index positions of the items overlapping `[start, end)`. The
    /// index is sorted by start, and no item contains another, so the
    /// ends increase with the starts: both searches are on monotone
    /// predicates.
    fn overlapping(&self, start: usize, end: usize) -> std::ops::Range<usize> {
        let lo = self.index.partition_point(|it| it.end <= start);
        let hi = lo + self.index[lo..].partition_point(|it| it.start < end);
        lo..hi
    }

    /// How many cached entries an insertion of `[start, end)` now would
    /// supersede ([`Table::superseded`]): those it contains, or those
    /// containing it, not those that only overlap it (which stay). A
    /// miss reserves a tracking slot for each (one superseded while in
    /// use is tracked outside the index). Returns at once when nothing
    /// overlaps the range.
    pub fn supersedes(&self, start: usize, end: usize) -> usize {
        self.superseded(start, end).len()
    }

    /// The cached entry containing `[start, end)` with at least `access`:
    /// [`lookup_last`](Self::lookup_last), then, when that finds none,
    /// [`span_or_cover`](Self::span_or_cover)'s walk. A hit looks only
    /// at the first (`Cache::look_up`, which walks on in its miss path).
    pub fn lookup(&self, start: usize, end: usize, access: Access) -> Option<&Arc<Entry<R>>> {
        self.lookup_last(start, end, access)
            .or_else(|| self.span_or_cover(start, end, access).err())
    }

    /// The last entry starting at or before `start`, if it contains
    /// `[start, end)` with at least `access`: the hit path. No entry
    /// contains another, so the ends increase with the starts and it ends
    /// last of those: it covers the range if any of them does. But an
    /// earlier one may cover it with rights it lacks (entries that only
    /// overlap, from two misses of overlapping requests registered at
    /// once, see [`Table::superseded`], hold each its own request's
    /// rights): a lookup that finds nothing here walks on with
    /// [`span_or_cover`](Self::span_or_cover).
    #[inline]
    pub fn lookup_last(&self, start: usize, end: usize, access: Access) -> Option<&Arc<Entry<R>>> {
        let pos = self.index.partition_point(|it| it.start <= start);
        let it = self.index.get(pos.checked_sub(1)?)?;
        if it.end < end {
            return None;
        }
        let e = self.slots[it.slot as usize].entry.as_ref()?;
        e.access.contains(access).then_some(e)
    }

    /// A hit on `e` (read lock suffices): one more user, second chance.
    /// False if `e` has the most users it may have (see
    /// [`MAX_HANDLES`](super::entry::MAX_HANDLES)).
    #[inline]
    #[must_use]
    pub fn acquire(e: &Entry<R>) -> bool {
        if !e.referenced.load(Ordering::Relaxed) {
            e.referenced.store(true, Ordering::Relaxed);
        }
        e.acquire_cached()
    }

    /// The union of `[start, end)` and every cached range it overlaps, with
    /// the union of their access rights (registered as one on a miss);
    /// or, found on the way, an entry that contains `[start, end)` with at
    /// least `access`. The miss path of a lookup ([`Cache::look_up`]):
    /// [`lookup_last`](Self::lookup_last) looked at the last entry
    /// starting at or before `start` only, and an earlier one of a pair
    /// may have the rights it lacks. (Until 2026-11-29 a separate second
    /// look, `lookup_earlier`, made a binary search of its own for the
    /// at most four entries before the last, called from the hit code:
    /// +1.1 instructions per hit, +130 per miss; this walk visits the
    /// overlapping entries anyway.)
    ///
    /// [`Cache::look_up`]: super::Cache::look_up
    pub fn span_or_cover(
        &self,
        start: usize,
        end: usize,
        access: Access,
    ) -> Result<(usize, usize, Access), &Arc<Entry<R>>> {
        let (mut s, mut e, mut a) = (start, end, access);
        for it in &self.index[self.overlapping(start, end)] {
            s = s.min(it.start);
            e = e.max(it.end);
            if let Some(en) = &self.slots[it.slot as usize].entry {
                if it.start <= start && it.end >= end && en.access.contains(access) {
                    return Err(en);
                }
                a = a | en.access;
            }
        }
        Ok((s, e, a))
    }

    /// Index positions of the entries an insertion of `[start, end)`
    /// supersedes: those it contains, else those containing it (never
    /// both: the index holds no entry inside another). Each kind is a
    /// contiguous run of the overlapping items, whose starts and ends
    /// both increase.
    ///
    /// **Entries that only overlap it stay cached (since 2026-11-29).**
    /// Such a pair arises only when two misses of overlapping requests
    /// register at once (each notes its span, the request merged with
    /// the entries it overlaps, before the other's insertion): the later
    /// insertion used to supersede the earlier, so the next request of
    /// the earlier range missed and registered again (the union).
    /// Keeping both is correct: the index stays sorted by start with
    /// increasing ends, so [`lookup`](Self::lookup) still finds a
    /// covering entry with one search, and an invalidation (or a sweep,
    /// which takes entries one by one) still finds every entry
    /// overlapping a range (`overlapping`); each entry has its own
    /// monitor subscription (counted per page range, so the shared pages
    /// stay watched while either lives). The price: the shared pages are
    /// pinned twice while both live, and counted twice against the byte
    /// limit, which bounds what is registered, summed over the entries
    /// (`CacheConfig::max_bytes`: each registration pins, and is charged
    /// for, its pages on its own); and a request covered by the pair but
    /// by neither alone misses and registers the union, which contains
    /// both and so supersedes both. An entry
    /// containing the new one is still superseded (it lacks the
    /// request's rights, or the miss could not take it: see
    /// `Miss::raced_hit`), so no entry ever contains another.
    fn superseded(&self, start: usize, end: usize) -> std::ops::Range<usize> {
        let over = self.overlapping(start, end);
        if over.is_empty() {
            // The common case: nothing to supersede.
            return over;
        }
        let run = &self.index[over.clone()];
        // Inside `[start, end)`: a suffix by start, a prefix of that by end.
        let lo = run.partition_point(|it| it.start < start);
        let hi = lo + run[lo..].partition_point(|it| it.end <= end);
        if lo < hi {
            return over.start + lo..over.start + hi;
        }
        // Containing it: a suffix by end, a prefix of that by start.
        let lo = run.partition_point(|it| it.end < end);
        let hi = lo + run[lo..].partition_point(|it| it.start <= start);
        over.start + lo..over.start + hi
    }

    /// True when an invalidation since generation `gen0` may overlap `[start, end)`.
    pub fn changed_since(&self, gen0: u64, start: usize, end: usize) -> bool {
        if self.gen == gen0 {
            return false;
        }
        if self.gen - gen0 > RING as u64 {
            return true;
        }
        (gen0 + 1..=self.gen).any(|g| {
            let (rg, s, e) = self.ring[g as usize % RING];
            rg != g || (s < end && e > start)
        })
    }

    /// Upper bound of the entries an insertion of `[start, end)` takes out
    /// of the table now (those it supersedes, and the idle ones it would
    /// evict to respect the limits): the spare capacity
    /// [`Table::insert`] wants in its `doomed` vector.
    pub fn doom_bound(&self, start: usize, end: usize) -> usize {
        let len = end - start;
        if len > self.max_bytes {
            return 0;
        }
        let over = self.superseded(start, end);
        let freed_count = over.len();
        let freed_bytes: usize = self.index[over].iter().map(|it| it.end - it.start).sum();
        let count = self.live + self.zombies - freed_count;
        let bytes = self.bytes - freed_bytes;
        // Victims are live entries other than the superseded ones: exact
        // for the count limit; for the byte limit, all of them.
        let victims = if bytes + len > self.max_bytes {
            self.live - freed_count
        } else {
            (count + 1).saturating_sub(self.max_count)
        };
        freed_count + victims
    }

    /// The index positions of the entries an insertion of `[start, end)`
    /// supersedes ([`Table::superseded`]), if it fits within the limits
    /// once they are gone (without evicting anything). The range is no
    /// larger than the byte limit (callers check first: no sum here
    /// overflows).
    #[inline]
    fn fits(&self, start: usize, end: usize) -> Option<std::ops::Range<usize>> {
        let over = self.superseded(start, end);
        let freed_bytes: usize = self.index[over.clone()].iter().map(|it| it.end - it.start).sum();
        let count = self.live + self.zombies - over.len();
        let bytes = self.bytes - freed_bytes;
        (count < self.max_count && bytes + (end - start) <= self.max_bytes).then_some(over)
    }

    /// Whether an insertion of `[start, end)` now would find no room
    /// ([`Insert::NoRoom`]): too large for the cache, or over its limits
    /// once the entries it overlaps are superseded while every entry is in
    /// use (`busy` counts those, see [`Table::insert`]). A miss asks it
    /// before it registers, to let those waiting for its registration
    /// make their own (see `coalesce`); it may be wrong by the time the
    /// miss inserts.
    pub fn no_room(&self, start: usize, end: usize, busy: &StripedCounter) -> bool {
        let len = end - start;
        if len > self.max_bytes {
            return true;
        }
        if self.live + self.zombies < self.max_count && self.bytes + len <= self.max_bytes {
            // Room without superseding anything (the common case: no
            // look at the index).
            return false;
        }
        self.idle(busy) == 0 && self.fits(start, end).is_none()
    }

    /// Inserts `entry` (one user), superseding the entries it contains or
    /// that contain it ([`Table::superseded`]; those that only overlap it
    /// stay) and evicting idle entries (least recently used first) to respect the
    /// limits. The entries taken out are pushed on `doomed`, whose spare
    /// capacity must be at least [`doom_bound`](Self::doom_bound): if it is
    /// not, nothing happens and the outcome says how much is needed.
    ///
    /// Evicts first and supersedes last, so that an insertion paused by
    /// the sweep's bound ([`Insert::Paused`]) has only taken idle entries
    /// out (nobody holds them, nothing needs tracking them); `sweep`
    /// carries the sweep's progress to the next call.
    pub fn insert(
        &mut self,
        entry: &Arc<Entry<R>>,
        doomed: &mut Vec<Arc<Entry<R>>>,
        sweep: &mut Sweep,
    ) -> Insert {
        let len = entry.end - entry.start;
        if len > self.max_bytes {
            return Insert::NoRoom { evicted: 0 };
        }
        let need = self.doom_bound(entry.start, entry.end);
        if doomed.capacity() - doomed.len() < need {
            return Insert::Short { need };
        }
        let mut evicted = 0;
        let mut budget = SWEEP_STEP;
        let over = loop {
            // Recomputed after each victim: it may have been one of them.
            if let Some(over) = self.fits(entry.start, entry.end) {
                break over;
            }
            if self.idle(&entry.backend.stats.busy_cached) == 0 {
                // Every entry is in use: a sweep would find nothing (it
                // used to look at every slot twice to learn that).
                return Insert::NoRoom { evicted };
            }
            let slot = match self.clock_victim(&mut budget, sweep) {
                Victim::Found(slot) => slot,
                Victim::None => return Insert::NoRoom { evicted },
                Victim::Paused => return Insert::Paused { evicted },
            };
            let start = self.slots[slot as usize].entry.as_ref().map_or(0, |e| e.start);
            self.index_remove(slot, start);
            doomed.push(self.free_slot(slot));
            evicted += 1;
        };
        for i in over.clone() {
            let slot = self.index[i].slot;
            doomed.push(self.free_slot(slot));
        }
        self.index.drain(over);
        let slot = self.alloc_slot();
        entry.slot.store(slot, Ordering::Relaxed);
        entry.enter_index();
        let pos = self.index.partition_point(|it| it.start < entry.start);
        // No entry contains another: the neighbours end before it and after it.
        debug_assert!(pos == 0 || self.index[pos - 1].end < entry.end);
        debug_assert!(self
            .index
            .get(pos)
            .is_none_or(|it| it.start > entry.start && it.end > entry.end));
        self.index.insert(
            pos,
            Item {
                start: entry.start,
                end: entry.end,
                slot,
            },
        );
        self.live += 1;
        self.bytes += len;
        self.inserts += 1;
        let s = &mut self.slots[slot as usize];
        s.entry = Some(Arc::clone(entry));
        s.state = State::Live;
        Insert::Done { evicted }
    }

    /// Drops every entry overlapping `[start, end)` from the index and clears
    /// its validity flag; the entries wait on the zombie list for
    /// [`Table::take_zombies`]. Allocation- and free-free. Returns how many.
    pub fn invalidate(&mut self, start: usize, end: usize) -> usize {
        self.gen += 1;
        self.ring[self.gen as usize % RING] = (self.gen, start, end);
        let over = self.overlapping(start, end);
        let n = over.len();
        for i in over.clone() {
            let slot = self.index[i].slot;
            let s = &mut self.slots[slot as usize];
            if let Some(e) = &s.entry {
                e.valid.store(false, Ordering::Release);
                e.leave_index();
            }
            s.state = State::Zombie;
            s.next = self.zombie_head;
            self.zombie_head = slot;
        }
        self.index.drain(over);
        self.live -= n;
        self.zombies += n;
        n
    }

    /// Moves invalidated entries into `out`, as many as its spare capacity
    /// holds (drop them after unlocking); returns how many are left.
    pub fn take_zombies(&mut self, out: &mut Vec<Arc<Entry<R>>>) -> usize {
        while self.zombie_head != NIL && out.len() < out.capacity() {
            let slot = self.zombie_head;
            self.zombie_head = self.slots[slot as usize].next;
            self.zombies -= 1;
            self.live += 1; // free_slot accounts a live entry
            out.push(self.free_slot(slot));
        }
        self.zombies
    }

    /// Moves idle entries of the slots from `*cursor` on into `out`, as
    /// many as its spare capacity holds, looking at [`SWEEP_STEP`] slots
    /// at most (drop them after unlocking); advances `*cursor` past the
    /// slots looked at. Returns true while slots are left to look at
    /// (call again, after unlocking, with the same cursor). Stops as soon
    /// as no entry is idle (`busy`: the cache's `Stats::busy_cached`),
    /// without looking at the rest.
    pub fn take_idle(
        &mut self,
        out: &mut Vec<Arc<Entry<R>>>,
        cursor: &mut usize,
        busy: &StripedCounter,
    ) -> bool {
        let mut idle = self.idle(busy);
        let stop = cursor.saturating_add(SWEEP_STEP).min(self.slots.len());
        while *cursor < stop {
            if idle == 0 {
                *cursor = self.slots.len();
                return false;
            }
            self.sweep_steps += 1;
            let slot = *cursor as u32;
            let s = &self.slots[slot as usize];
            if let (Some(e), State::Live) = (&s.entry, s.state) {
                if e.refs.users() == 0 {
                    if out.len() == out.capacity() {
                        return true;
                    }
                    let start = e.start;
                    self.index_remove(slot, start);
                    out.push(self.free_slot(slot));
                    idle -= 1;
                }
            }
            *cursor += 1;
        }
        *cursor < self.slots.len()
    }

    /// Second-chance sweep: the next live, unused entry whose referenced
    /// bit is clear (clearing bits on the way), looking at no more than
    /// `budget` slots (counted down); [`Victim::None`] once `sweep` has
    /// seen two full turns without one.
    fn clock_victim(&mut self, budget: &mut usize, sweep: &mut Sweep) -> Victim {
        let n = self.slots.len();
        while sweep.fruitless < 2 * n {
            if *budget == 0 {
                return Victim::Paused;
            }
            *budget -= 1;
            sweep.fruitless += 1;
            self.sweep_steps += 1;
            self.hand = (self.hand + 1) % n;
            let s = &self.slots[self.hand];
            let (Some(e), State::Live) = (&s.entry, s.state) else {
                continue;
            };
            if e.refs.users() != 0 {
                continue;
            }
            if e.referenced.swap(false, Ordering::Relaxed) {
                continue;
            }
            sweep.fruitless = 0;
            return Victim::Found(self.hand as u32);
        }
        Victim::None
    }

    /// Moves every entry into `out` (invalidated ones first), marking each
    /// invalid (the cache is going away), as many as its spare capacity
    /// holds (drop them after unlocking); returns how many are left.
    pub fn take_all(&mut self, out: &mut Vec<Arc<Entry<R>>>) -> usize {
        self.take_zombies(out);
        while out.len() < out.capacity() {
            let Some(it) = self.index.pop() else { break };
            let e = self.free_slot(it.slot);
            e.valid.store(false, Ordering::Release);
            out.push(e);
        }
        self.zombies + self.index.len()
    }

    /// Entries in the index with at least one handle, counted slot by
    /// slot (what `Stats::busy_cached` counts without looking).
    #[cfg(test)]
    pub fn count_in_use(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.state == State::Live && s.entry.as_ref().is_some_and(|e| e.refs.users() > 0))
            .count()
    }

    /// Removes the index item of `slot`, which starts at `start`.
    fn index_remove(&mut self, slot: u32, start: usize) {
        let pos = self.index.partition_point(|it| it.start < start);
        if self.index.get(pos).is_some_and(|it| it.slot == slot) {
            self.index.remove(pos);
        }
    }

    fn alloc_slot(&mut self) -> u32 {
        if let Some(s) = self.free.pop() {
            return s;
        }
        debug_assert!(self.slots.len() < self.max_count);
        self.slots.push(Slot {
            entry: None,
            state: State::Free,
            next: NIL,
        });
        (self.slots.len() - 1) as u32
    }

    /// Frees a live slot (already out of the index) and returns its entry.
    fn free_slot(&mut self, slot: u32) -> Arc<Entry<R>> {
        let s = &mut self.slots[slot as usize];
        let e = s.entry.take().expect("freed slot holds an entry");
        // Out of the index (a zombie left it already).
        e.leave_index();
        s.state = State::Free;
        self.free.push(slot);
        self.live -= 1;
        self.bytes -= e.end - e.start;
        e
    }
}
