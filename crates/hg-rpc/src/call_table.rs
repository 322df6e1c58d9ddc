//! The calls in flight of an engine, by cookie. No I/O.
//!
//! A slab: a cookie is a slot index (low 32 bits) and that slot's
//! generation (high 32 bits, never 0), so finding a call is an index and a
//! compare, not a hash lookup, and a late or forged response whose cookie
//! names a reused slot does not match the slot's new call. Freed slots are
//! reused newest first (their memory is likely still in cache).

/// Calls (or anything) by cookie.
pub(crate) struct CallTable<T> {
    slots: Vec<Slot<T>>,
    /// Indices of empty slots; the last is reused first.
    free: Vec<u32>,
    /// The highest generation of any slot given back by
    /// [`shrink_if_empty`](CallTable::shrink_if_empty): a slot made again
    /// starts above it, so no cookie of a call before the shrink (a late
    /// or forged response) matches a call after it.
    gen_floor: u32,
}

/// Slots a table keeps when it empties; past this it gives the memory of
/// a burst back ([`CallTable::shrink_if_empty`]).
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
        let index = self.free.pop().unwrap_or_else(|| {
            self.slots.push(Slot {
                gen: self.gen_floor,
                value: None,
            });
            (self.slots.len() - 1) as u32
        });
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
        self.free.push(i as u32);
        value
    }

    /// Takes the value under `cookie` out; its slot is free again.
    pub fn remove(&mut self, cookie: u64) -> Option<T> {
        let i = self.slot_of(cookie)?;
        let value = self.slots[i].value.take()?;
        self.free.push(i as u32);
        Some(value)
    }

    /// Every value with its cookie.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((cookie(i as u32, s.gen), s.value.as_ref()?)))
    }

    /// Number of values stored.
    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Slots the table holds, used or not (its memory).
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Gives the slots back when the table is empty and holds more than
    /// [`KEEP_SLOTS`] (after a burst of calls in flight); a no-op
    /// otherwise, in two compares. Cookies stay unique: the generations
    /// given back raise the floor new slots start from.
    pub fn shrink_if_empty(&mut self) {
        if self.slots.len() <= KEEP_SLOTS || self.free.len() != self.slots.len() {
            return;
        }
        let top = self.slots.iter().map(|s| s.gen).max().unwrap_or(0);
        self.gen_floor = self.gen_floor.max(top);
        self.slots = Vec::new();
        self.free = Vec::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        t.shrink_if_empty();
        assert_eq!(t.capacity(), 3 * KEEP_SLOTS, "not empty: kept");
        for &k in old[10..].iter().chain(&reused) {
            t.remove(k);
        }
        t.shrink_if_empty();
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
        t.shrink_if_empty();
        assert_eq!(t.capacity(), 20);
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
