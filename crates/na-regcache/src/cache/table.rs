//! The lock-protected state of a cache: a slot table, a sorted index of
//! non-overlapping ranges, a CLOCK (second-chance) hand approximating LRU
//! over idle entries, and a list of invalidated ("zombie") entries awaiting
//! deregistration. Hits only need the read lock: they bump the entry's user
//! count and set its `referenced` bit; releasing a handle takes no lock.
//!
//! Every method runs under the cache lock and **never frees memory**: the
//! index and slot vectors are reserved for `max_count` entries up front, and
//! `Arc`s that leave the table are moved into vectors that the caller drops
//! after unlocking. Freeing could unmap a page registered with userfaultfd
//! and block on the monitor thread, which needs this lock. `invalidate`
//! additionally never allocates (it runs inside the global allocator hook).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::entry::Entry;
use crate::registrar::{Access, Registrar};

const NIL: u32 = u32::MAX;
/// Invalidations remembered for misses racing with them.
const RING: usize = 64;

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

/// Outcome of [`Table::insert`]; drop `doomed` (superseded or evicted
/// entries) after unlocking.
pub(crate) enum Insert<R: Registrar> {
    /// Inserted.
    Done {
        doomed: Vec<Arc<Entry<R>>>,
        evicted: usize,
    },
    /// Not enough idle entries to make room: hand the registration out uncached.
    NoRoom {
        doomed: Vec<Arc<Entry<R>>>,
        evicted: usize,
    },
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
        }
    }

    pub fn live(&self) -> usize {
        self.live
    }

    pub fn generation(&self) -> u64 {
        self.gen
    }

    /// Index positions of the items overlapping `[start, end)`.
    fn overlapping(&self, start: usize, end: usize) -> std::ops::Range<usize> {
        let lo = self.index.partition_point(|it| it.end <= start);
        let hi = lo + self.index[lo..].partition_point(|it| it.start < end);
        lo..hi
    }

    /// The cached entry containing `[start, end)` with at least `access`.
    #[inline]
    pub fn lookup(&self, start: usize, end: usize, access: Access) -> Option<&Arc<Entry<R>>> {
        let pos = self.index.partition_point(|it| it.start <= start);
        let it = self.index.get(pos.checked_sub(1)?)?;
        if it.end < end {
            return None;
        }
        let e = self.slots[it.slot as usize].entry.as_ref()?;
        e.access.contains(access).then_some(e)
    }

    /// A hit on `e` (read lock suffices): one more user, second chance.
    /// Returns true when `e` was idle.
    #[inline]
    pub fn acquire(e: &Entry<R>) -> bool {
        if !e.referenced.load(Ordering::Relaxed) {
            e.referenced.store(true, Ordering::Relaxed);
        }
        e.users.fetch_add(1, Ordering::AcqRel) == 0
    }

    /// The union of `[start, end)` and every cached range it overlaps, with
    /// the union of their access rights (registered as one on a miss).
    pub fn span(&self, start: usize, end: usize, access: Access) -> (usize, usize, Access) {
        let (mut s, mut e, mut a) = (start, end, access);
        for it in &self.index[self.overlapping(start, end)] {
            s = s.min(it.start);
            e = e.max(it.end);
            if let Some(en) = &self.slots[it.slot as usize].entry {
                a = a | en.access;
            }
        }
        (s, e, a)
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

    /// Inserts `entry` (one user), superseding the entries it overlaps and
    /// evicting idle entries (least recently used first) to respect the limits.
    pub fn insert(&mut self, entry: Arc<Entry<R>>) -> Insert<R> {
        let len = entry.end - entry.start;
        let over = self.overlapping(entry.start, entry.end);
        let freed_count = over.len();
        let freed_bytes: usize = self.index[over.clone()].iter().map(|it| it.end - it.start).sum();
        let mut count = self.live + self.zombies - freed_count;
        let mut bytes = self.bytes - freed_bytes;
        if len > self.max_bytes {
            return Insert::NoRoom {
                doomed: Vec::new(),
                evicted: 0,
            };
        }
        // Upper bound of the victims: exact for the count limit; for the
        // byte limit, every live entry. (Allocating is fine here; freeing is not.)
        let bound = if bytes + len > self.max_bytes {
            self.live
        } else {
            (count + 1).saturating_sub(self.max_count)
        };
        let mut doomed = Vec::with_capacity(freed_count + bound);
        for i in over.clone() {
            let slot = self.index[i].slot;
            doomed.push(self.free_slot(slot));
        }
        self.index.drain(over);
        let mut evicted = 0;
        while count + 1 > self.max_count || bytes + len > self.max_bytes {
            let Some(slot) = self.clock_victim() else {
                return Insert::NoRoom { doomed, evicted };
            };
            let start = self.slots[slot as usize].entry.as_ref().map_or(0, |e| e.start);
            self.index_remove(slot, start);
            let e = self.free_slot(slot);
            count -= 1;
            bytes -= e.end - e.start;
            doomed.push(e);
            evicted += 1;
        }
        let slot = self.alloc_slot();
        entry.slot.store(slot, Ordering::Relaxed);
        entry.cached.store(true, Ordering::Release);
        entry.users.fetch_add(1, Ordering::AcqRel);
        let pos = self.index.partition_point(|it| it.start < entry.start);
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
        let s = &mut self.slots[slot as usize];
        s.entry = Some(entry);
        s.state = State::Live;
        Insert::Done { doomed, evicted }
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
                e.cached.store(false, Ordering::Release);
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

    /// Takes the invalidated entries out (drop them after unlocking).
    pub fn take_zombies(&mut self) -> Vec<Arc<Entry<R>>> {
        let mut out = Vec::with_capacity(self.zombies);
        self.drain_zombies(&mut out);
        out
    }

    /// Moves the zombies into `out`, whose spare capacity must suffice.
    fn drain_zombies(&mut self, out: &mut Vec<Arc<Entry<R>>>) {
        debug_assert!(out.capacity() - out.len() >= self.zombies);
        while self.zombie_head != NIL {
            let slot = self.zombie_head;
            self.zombie_head = self.slots[slot as usize].next;
            self.zombies -= 1;
            self.live += 1; // free_slot accounts a live entry
            out.push(self.free_slot(slot));
        }
    }

    /// Takes every idle entry out (drop after unlocking).
    pub fn take_idle(&mut self) -> Vec<Arc<Entry<R>>> {
        let mut out = Vec::with_capacity(self.live);
        for slot in 0..self.slots.len() as u32 {
            let s = &self.slots[slot as usize];
            let start = match (&s.entry, s.state) {
                (Some(e), State::Live) if e.users.load(Ordering::Acquire) == 0 => e.start,
                _ => continue,
            };
            self.index_remove(slot, start);
            out.push(self.free_slot(slot));
        }
        out
    }

    /// Second-chance sweep: the next live, unused entry whose referenced
    /// bit is clear (clearing bits on the way). None after two full turns.
    fn clock_victim(&mut self) -> Option<u32> {
        let n = self.slots.len();
        for _ in 0..2 * n {
            self.hand = (self.hand + 1) % n;
            let s = &self.slots[self.hand];
            let (Some(e), State::Live) = (&s.entry, s.state) else {
                continue;
            };
            if e.users.load(Ordering::Acquire) != 0 {
                continue;
            }
            if e.referenced.swap(false, Ordering::Relaxed) {
                continue;
            }
            return Some(self.hand as u32);
        }
        None
    }

    /// Takes everything out and marks it invalid (the cache is going away).
    pub fn take_all(&mut self) -> Vec<Arc<Entry<R>>> {
        let mut out = Vec::with_capacity(self.zombies + self.index.len());
        self.drain_zombies(&mut out);
        while let Some(it) = self.index.pop() {
            let e = self.free_slot(it.slot);
            e.valid.store(false, Ordering::Release);
            out.push(e);
        }
        out
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
        e.cached.store(false, Ordering::Release);
        s.state = State::Free;
        self.free.push(slot);
        self.live -= 1;
        self.bytes -= e.end - e.start;
        e
    }
}
