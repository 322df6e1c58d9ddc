//! The calls in flight of an engine, by cookie. No I/O.
//!
//! A slab: a cookie is a slot index (low 32 bits) and that slot's
//! generation (high 32 bits, never 0), so finding a call is an index and a
//! compare, not a hash lookup, and a late or forged response whose cookie
//! names a reused slot does not match the slot's new call. Freed slots are
//! reused newest first (their memory is likely still in cache).
//!
//! A call keeps its slot (its index is in the cookie the peer echoes), so
//! the memory of a burst comes back from the top: once the table is
//! mostly empty, the slots of its upper half are no longer reused as they
//! free up, and go when all have (see [`CallTable::shrink`]).

/// Calls (or anything) by cookie.
pub(crate) struct CallTable<T> {
    slots: Vec<Slot<T>>,
    /// Indices of empty slots below `limit`; the last is reused first.
    free: Vec<u32>,
    /// While the table gives its upper slots back ([`shrink`](Self::shrink)):
    /// the first of them, which are not reused when they free up;
    /// `usize::MAX` otherwise.
    limit: usize,
    /// Empty slots at or above `limit` (so not in `free`): once every
    /// slot there is, they are given back.
    holes: usize,
    /// The highest generation of any slot given back: a slot made again
    /// starts above it, so no cookie of a call before (a late or forged
    /// response) matches a call after it.
    gen_floor: u32,
}

/// Slots a table keeps; past this it gives the memory of a burst back
/// ([`CallTable::shrink`]).
pub(crate) const KEEP_SLOTS: usize = 1024;

struct Slot<T> {
    /// Generation of the current (or last) occupant; 0: never used.
    gen: u32,
    value: Option<T>,
}

/// A cookie that no call ever has (generation 0).
pub(crate) const NO_CALL: u64 = 0;

fn cookie(index: u32, gen: u32) -> u64 {
    u64::from(gen) << 32 | u64::from(index)
}

fn next_gen(gen: u32) -> u32 {
    gen.checked_add(1).unwrap_or(1)
}

impl<T> Default for CallTable<T> {
    fn default() -> Self {
        CallTable {
            slots: Vec::new(),
            free: Vec::new(),
            limit: usize::MAX,
            holes: 0,
            gen_floor: 0,
        }
    }
}

impl<T> CallTable<T> {
    /// The cookie the next [`insert`](Self::insert) will return.
    pub fn next_cookie(&self) -> u64 {
        match self.free.last() {
            Some(&i) => cookie(i, next_gen(self.slots[i as usize].gen)),
            None => cookie(self.slots.len() as u32, next_gen(self.gen_floor)),
        }
    }

    /// Stores `value`; returns its cookie.
    #[inline]
    pub fn insert(&mut self, value: T) -> u64 {
        let index = match self.free.pop() {
            Some(i) => i,
            None => self.grow(),
        };
        let slot = &mut self.slots[index as usize];
        slot.gen = next_gen(slot.gen);
        slot.value = Some(value);
        cookie(index, slot.gen)
    }

    fn slot_of(&self, cookie: u64) -> Option<usize> {
        let index = cookie as u32 as usize;
        let gen = (cookie >> 32) as u32;
        (self.slots.get(index)?.gen == gen && gen != 0).then_some(index)
    }

    /// The cookie of the occupant of slot `index` (the low 32 bits of
    /// its cookies), if it has one.
    pub fn cookie_in_slot(&self, index: u32) -> Option<u64> {
        let slot = self.slots.get(index as usize)?;
        slot.value.as_ref().map(|_| cookie(index, slot.gen))
    }

    /// The value under `cookie`, if it is still there.
    pub fn get(&self, cookie: u64) -> Option<&T> {
        self.slots[self.slot_of(cookie)?].value.as_ref()
    }

    /// The value under `cookie`, mutably.
    pub fn get_mut(&mut self, cookie: u64) -> Option<&mut T> {
        let i = self.slot_of(cookie)?;
        self.slots[i].value.as_mut()
    }

    /// Removes the value of `cookie` if `take` says so of it: one
    /// lookup where a `get` and a `remove` would make two.
    #[inline]
    pub fn remove_if(&mut self, cookie: u64, take: impl FnOnce(&T) -> bool) -> Option<T> {
        let i = self.slot_of(cookie)?;
        let slot = &mut self.slots[i];
        if !take(slot.value.as_ref()?) {
            return None;
        }
        let value = slot.value.take();
        self.release(i);
        value
    }

    /// Takes the value under `cookie` out; its slot is free again.
    pub fn remove(&mut self, cookie: u64) -> Option<T> {
        let i = self.slot_of(cookie)?;
        let value = self.slots[i].value.take()?;
        self.release(i);
        Some(value)
    }

    /// Slot `i` was emptied: reused, unless it is one of those the table
    /// gives back.
    #[inline(always)]
    fn release(&mut self, i: usize) {
        if i < self.limit {
            self.free.push(i as u32);
        } else {
            self.release_upper();
        }
    }

    /// One more upper slot is empty (given back by the next
    /// [`shrink`](Self::shrink) once all are: not on the call's path).
    #[cold]
    #[inline(never)]
    fn release_upper(&mut self) {
        self.holes += 1;
    }

    /// A new slot, at the end (as [`next_cookie`](Self::next_cookie) says).
    /// With none free below `limit` the table no longer shrinks: its upper
    /// slots are reused again.
    #[cold]
    #[inline(never)]
    fn grow(&mut self) -> u32 {
        if self.limit != usize::MAX {
            for i in self.limit..self.slots.len() {
                if self.slots[i].value.is_none() {
                    self.free.push(i as u32);
                }
            }
            (self.limit, self.holes) = (usize::MAX, 0);
        }
        self.slots.push(Slot {
            gen: self.gen_floor,
            value: None,
        });
        (self.slots.len() - 1) as u32
    }

    /// Gives back the slots from `len` on, all empty and none in `free`;
    /// their generations raise the floor.
    fn truncate_to(&mut self, len: usize) {
        let top = self.slots[len..].iter().map(|s| s.gen).max().unwrap_or(0);
        self.gen_floor = self.gen_floor.max(top);
        self.slots.truncate(len);
        self.slots.shrink_to_fit();
        self.free.shrink_to_fit();
        (self.limit, self.holes) = (usize::MAX, 0);
    }

    /// Every value with its cookie.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((cookie(i as u32, s.gen), s.value.as_ref()?)))
    }

    /// Number of values stored.
    #[inline]
    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len() - self.holes
    }

    /// Slots the table holds, used or not (its memory).
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Gives memory back after a burst, at a moment with nothing else to
    /// do (the engine about to sleep); a no-op in a few compares unless the
    /// table holds more than [`KEEP_SLOTS`] and at most a quarter of them
    /// are used. An empty table gives every slot back at once. Otherwise
    /// its upper half (above [`KEEP_SLOTS`]) is no longer reused as calls
    /// there end, and is given back by the first call of this after the
    /// last has; calls in between take slots below. If those run out
    /// first (the calls in flight doubled), the upper slots are reused
    /// again, and a later call of this tries anew. Each step costs at most
    /// the slots it looks at, paid for by the calls that made them;
    /// cookies stay unique: the generations given back raise the floor
    /// new slots start from.
    pub fn shrink(&mut self) {
        let cap = self.slots.len();
        if self.limit != usize::MAX {
            if self.holes == cap - self.limit {
                self.truncate_to(self.limit);
            }
            return;
        }
        if cap <= KEEP_SLOTS || self.len() * 4 > cap {
            return;
        }
        if self.len() == 0 {
            self.free = Vec::new();
            self.truncate_to(0);
            return;
        }
        let limit = (cap / 2).max(KEEP_SLOTS);
        let free = self.free.len();
        self.free.retain(|&i| (i as usize) < limit);
        (self.limit, self.holes) = (limit, free - self.free.len());
        if self.holes == cap - limit {
            self.truncate_to(limit);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_names_its_current_occupant_only() {
        let mut t = CallTable::default();
        assert_eq!(t.cookie_in_slot(0), None, "no slot");
        let a = t.insert(1u8);
        assert_eq!(t.cookie_in_slot(a as u32), Some(a));
        t.remove(a);
        assert_eq!(t.cookie_in_slot(a as u32), None, "empty slot");
        let b = t.insert(2);
        assert_eq!(b as u32, a as u32, "same slot");
        assert_eq!(
            t.cookie_in_slot(b as u32),
            Some(b),
            "the new occupant, not the old"
        );
    }

    #[test]
    fn cookies_of_reused_slots_do_not_match_old_ones() {
        let mut t = CallTable::default();
        assert_eq!(t.get(NO_CALL), None::<&u32>);
        let a = t.next_cookie();
        assert_eq!(t.insert(10), a);
        let b = t.insert(20);
        assert_ne!(a, b);
        assert_eq!((t.get(a), t.get(b), t.len()), (Some(&10), Some(&20), 2));
        assert_eq!(t.remove_if(a, |v| *v == 11), None, "not taken");
        assert_eq!(t.remove_if(a, |v| *v == 10), Some(10));
        assert_eq!(t.remove(a), None, "removed once");
        // The freed slot is reused under a new cookie; the old one is stale.
        let c = t.next_cookie();
        assert_eq!(t.insert(30), c);
        assert_eq!(c as u32, a as u32, "same slot");
        assert_ne!(c, a);
        assert_eq!((t.get(a), t.get(c)), (None, Some(&30)));
        *t.get_mut(c).unwrap() += 1;
        let mut all: Vec<_> = t.iter().map(|(k, v)| (k, *v)).collect();
        all.sort();
        assert_eq!(all, {
            let mut v = vec![(b, 20), (c, 31)];
            v.sort();
            v
        });
        // Cookies a peer may forge: out of range, generation 0, wrong one.
        for forged in [u64::MAX, 5, (b >> 32) << 32 | 7, b ^ 1 << 40] {
            assert_eq!(t.get(forged), None, "{forged:#x}");
            assert_eq!(t.remove(forged), None);
        }
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn a_table_that_empties_after_a_burst_gives_its_slots_back_and_keeps_cookies_unique() {
        let mut t = CallTable::default();
        let old: Vec<u64> = (0..3 * KEEP_SLOTS as u32).map(|i| t.insert(i)).collect();
        // Reuse some slots so that generations differ.
        for &k in &old[..10] {
            t.remove(k);
        }
        let reused: Vec<u64> = (0..10).map(|i| t.insert(100_000 + i)).collect();
        t.shrink();
        assert_eq!(t.capacity(), 3 * KEEP_SLOTS, "not empty: kept");
        for &k in old[10..].iter().chain(&reused) {
            t.remove(k);
        }
        t.shrink();
        assert_eq!(
            (t.capacity(), t.len()),
            (0, 0),
            "empty past KEEP_SLOTS: given back"
        );
        let new: Vec<u64> = (0..20).map(|i| t.insert(200_000 + i)).collect();
        for k in old.iter().chain(&reused) {
            assert_eq!(t.get(*k), None, "an old cookie {k:#x} matches a new call");
            assert!(!new.contains(k), "cookie {k:#x} given twice");
        }
        assert_eq!(t.get(new[3]), Some(&200_003));
        // A small table is kept as it is.
        for k in new {
            t.remove(k);
        }
        t.shrink();
        assert_eq!(t.capacity(), 20);
    }

    /// Index of `cookie`'s slot.
    fn index(cookie: u64) -> usize {
        cookie as u32 as usize
    }

    /// Inserts `value`, checking that `next_cookie` said its cookie.
    fn put(t: &mut CallTable<u32>, value: u32) -> u64 {
        let said = t.next_cookie();
        let k = t.insert(value);
        assert_eq!(k, said, "next_cookie and insert differ");
        k
    }

    #[test]
    fn a_mostly_empty_table_gives_its_upper_half_back_once_the_calls_there_end() {
        const N: usize = 4 * KEEP_SLOTS;
        let mut t = CallTable::default();
        let old: Vec<u64> = (0..N as u32).map(|i| put(&mut t, i)).collect();
        let (low, high) = (old[5], old[N - 10]);
        for &k in &old {
            if k != low && k != high {
                t.remove(k);
            }
        }
        t.shrink();
        // A call in the upper half holds it: nothing given back yet.
        assert_eq!((t.capacity(), t.len()), (N, 2));
        t.shrink();
        assert_eq!((t.capacity(), t.len()), (N, 2), "a second call changes nothing");
        let mid: Vec<u64> = (0..100).map(|i| put(&mut t, 10_000 + i)).collect();
        assert!(mid.iter().all(|&k| index(k) < N / 2), "an upper slot reused");
        assert_eq!(t.len(), 102);
        assert_eq!(t.remove(high), Some(N as u32 - 10));
        assert_eq!((t.capacity(), t.len()), (N, 101), "given back on a call's path");
        t.shrink();
        assert_eq!((t.capacity(), t.len()), (N / 2, 101), "the upper half given back");
        assert_eq!(t.get(low), Some(&5));
        assert_eq!(t.get(mid[7]), Some(&10_007));
        // Grown again over the slots given back: no cookie matches an old
        // call's, nor is given twice.
        let new: Vec<u64> = (0..(N - 101) as u32).map(|i| put(&mut t, 20_000 + i)).collect();
        assert_eq!((t.capacity(), t.len()), (N, N));
        let mut seen = std::collections::HashSet::new();
        for &k in old.iter().filter(|&&k| k != low) {
            assert_eq!(t.get(k), None, "an old cookie {k:#x} matches a new call");
            seen.insert(k);
        }
        for &k in mid.iter().chain(&new).chain([&low]) {
            assert!(seen.insert(k), "cookie {k:#x} given twice");
        }
        // Emptied: all given back at once.
        for k in mid.into_iter().chain(new).chain([low]) {
            assert!(t.remove(k).is_some());
        }
        t.shrink();
        assert_eq!((t.capacity(), t.len()), (0, 0));
        let k = put(&mut t, 1);
        assert!(!seen.contains(&k), "cookie {k:#x} given again after emptying");
    }

    #[test]
    fn a_table_that_fills_up_while_it_shrinks_reuses_its_upper_slots() {
        const N: usize = 4 * KEEP_SLOTS;
        let mut t = CallTable::default();
        let old: Vec<u64> = (0..N as u32).map(|i| put(&mut t, i)).collect();
        for &k in &old[..N - 1] {
            t.remove(k);
        }
        t.shrink();
        assert_eq!((t.capacity(), t.len()), (N, 1));
        // Every slot below the upper half taken, then one more call: the
        // table grows, and the upper slots serve again.
        let below: Vec<u64> = (0..(N / 2) as u32).map(|i| put(&mut t, i)).collect();
        assert!(below.iter().all(|&k| index(k) < N / 2));
        let grown = put(&mut t, 7);
        assert_eq!((index(grown), t.capacity(), t.len()), (N, N + 1, N / 2 + 2));
        let upper: Vec<u64> = (0..(N / 2 - 1) as u32).map(|i| put(&mut t, i)).collect();
        assert!(upper.iter().all(|&k| (N / 2..N - 1).contains(&index(k))));
        assert_eq!((t.capacity(), t.len()), (N + 1, N + 1));
        for k in below.into_iter().chain(upper).chain([grown, old[N - 1]]) {
            assert!(t.remove(k).is_some());
        }
        assert_eq!(t.len(), 0);
        t.shrink();
        assert_eq!(t.capacity(), 0);
    }

    /// Bursts up and down with `shrink` between (and at random in the
    /// middle of the calls' ends), against a model: every value stays
    /// under its cookie, `len` counts them, no cookie is given twice, and
    /// memory does come back while calls are in flight.
    #[test]
    fn bursts_with_shrinks_between_keep_every_call_and_cookie() {
        let mut t = CallTable::default();
        let mut live: Vec<(u64, u32)> = Vec::new();
        let mut given = std::collections::HashSet::new();
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        };
        let (mut value, mut shrunk_in_flight) = (0u32, 0);
        for _ in 0..40 {
            let high = next(6 * KEEP_SLOTS);
            let low = next(40);
            while live.len() < high {
                value += 1;
                let k = put(&mut t, value);
                assert!(given.insert(k), "cookie {k:#x} given twice");
                live.push((k, value));
            }
            while live.len() > low {
                let (k, v) = live.swap_remove(next(live.len()));
                assert_eq!(t.remove(k), Some(v));
                assert_eq!(t.get(k), None);
                if next(64) == 0 {
                    let cap = t.capacity();
                    t.shrink();
                    if t.capacity() < cap && !live.is_empty() {
                        shrunk_in_flight += 1;
                    }
                }
            }
            // Idle; then, mostly, the calls left end one by one, each
            // followed by a new one (a long poll, say): the upper half comes
            // back. Else the next burst finds the table shrinking.
            t.shrink();
            let cap = t.capacity();
            let rearmed = if next(3) == 0 { 0 } else { live.len() };
            for _ in 0..rearmed {
                let (k, v) = live.remove(0);
                assert_eq!(t.remove(k), Some(v));
                value += 1;
                let k = put(&mut t, value);
                assert!(given.insert(k), "cookie {k:#x} given twice");
                live.push((k, value));
            }
            t.shrink();
            if t.capacity() < cap && !live.is_empty() {
                shrunk_in_flight += 1;
            }
            assert_eq!(t.len(), live.len());
            for &(k, v) in &live {
                assert_eq!(t.get(k), Some(&v));
            }
        }
        assert!(shrunk_in_flight > 0, "never shrunk with calls in flight");
    }

    #[test]
    fn generations_wrap_past_zero() {
        let mut t = CallTable::default();
        let k = t.insert(1u8);
        t.remove(k);
        t.slots[0].gen = u32::MAX - 1;
        let k = t.insert(2);
        assert_eq!(k >> 32, u64::from(u32::MAX));
        t.remove(k);
        let k = t.insert(3);
        assert_eq!(k >> 32, 1, "generation 0 is skipped");
        assert_eq!(t.get(k), Some(&3));
    }
}
