//! [`TokenSlab`]: values in reusable slots, named from outside by
//! generational tokens, for plugins' peer tables.
//!
//! A plugin hands addresses to its user, and an address names a peer by
//! the token stored in its [`Addr`](crate::Addr). Peers come and go (a
//! client that connects, dies and reconnects makes a new peer each time),
//! so their slots must be reused, or the table grows for the plugin's
//! lifetime. An address the user still holds must never reach a slot's
//! next occupant: a token is the slot index (low 32 bits) plus the slot's
//! generation (high 32 bits), and a slot's generation moves on each time
//! its value is removed. A stale token then resolves to
//! [`TokenState::Released`] ("that peer went earlier"), never to the new
//! occupant.
//!
//! Generations stay below 2^31: a slot that used them all is retired
//! (never reused) instead of wrapping, so no token ever repeats, and no
//! token equals `u64::MAX`, which plugins may keep for their own address.
//! Inside a plugin, values are named by slot index while something the
//! plugin tracks (a connection, a held message) guarantees the value is
//! there; [`at`](TokenSlab::at) and [`remove_at`](TokenSlab::remove_at)
//! take indices.

/// Generations stay below this (see the module docs).
const GEN_LIMIT: u32 = 1 << 31;

struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

/// What a token names now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenState {
    /// The value in this slot index.
    Live(usize),
    /// A value of this slab that was removed since.
    Released,
    /// Never a token of this slab.
    Unknown,
}

/// Slots with a free list, addressed by generational tokens (see the
/// module docs).
pub struct TokenSlab<T> {
    slots: Vec<Slot<T>>,
    free: Vec<usize>,
    len: usize,
}

impl<T> Default for TokenSlab<T> {
    fn default() -> Self {
        TokenSlab {
            slots: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }
}

/// The token of slot `idx` in generation `generation`.
fn token(idx: usize, generation: u32) -> u64 {
    u64::from(generation) << 32 | idx as u64
}

/// Splits a token into slot index and generation.
fn split(tok: u64) -> (usize, u32) {
    ((tok & 0xffff_ffff) as usize, (tok >> 32) as u32)
}

impl<T> TokenSlab<T> {
    /// An empty slab.
    pub fn new() -> Self {
        Self::default()
    }

    /// Inserts the value `make(token)` builds (it may store its own token,
    /// in an address say) and returns its slot index and token.
    ///
    /// # Panics
    /// If 2^32 slots are occupied or retired at once.
    pub fn insert_with(&mut self, make: impl FnOnce(u64) -> T) -> (usize, u64) {
        let idx = self.free.pop().unwrap_or_else(|| {
            assert!(self.slots.len() < 1 << 32, "token slab full");
            self.slots.push(Slot {
                generation: 0,
                value: None,
            });
            self.slots.len() - 1
        });
        let slot = &mut self.slots[idx];
        let tok = token(idx, slot.generation);
        slot.value = Some(make(tok));
        self.len += 1;
        (idx, tok)
    }

    /// What `tok` names now.
    pub fn resolve(&self, tok: u64) -> TokenState {
        let (idx, generation) = split(tok);
        let Some(slot) = self.slots.get(idx) else {
            return TokenState::Unknown;
        };
        match slot.value {
            Some(_) if slot.generation == generation => TokenState::Live(idx),
            // Only earlier generations were handed out: an empty slot's
            // current generation is its next occupant's, not yet issued.
            _ if generation < slot.generation => TokenState::Released,
            _ => TokenState::Unknown,
        }
    }

    /// The value `tok` names, if it is still there (one bounds check and
    /// one compare: plugins call it per operation).
    pub fn get(&self, tok: u64) -> Option<&T> {
        let (idx, generation) = split(tok);
        let slot = self.slots.get(idx)?;
        if slot.generation != generation {
            return None;
        }
        slot.value.as_ref()
    }

    /// Mutable [`get`](Self::get).
    pub fn get_mut(&mut self, tok: u64) -> Option<&mut T> {
        let (idx, generation) = split(tok);
        let slot = self.slots.get_mut(idx)?;
        if slot.generation != generation {
            return None;
        }
        slot.value.as_mut()
    }

    /// The token of the value in slot `idx`, if there is one.
    pub fn token_at(&self, idx: usize) -> Option<u64> {
        let slot = self.slots.get(idx)?;
        slot.value.as_ref().map(|_| token(idx, slot.generation))
    }

    /// The value in slot `idx`, if any.
    pub fn at(&self, idx: usize) -> Option<&T> {
        self.slots.get(idx)?.value.as_ref()
    }

    /// The value in slot `idx`, if any, mutably.
    pub fn at_mut(&mut self, idx: usize) -> Option<&mut T> {
        self.slots.get_mut(idx)?.value.as_mut()
    }

    /// Removes the value `tok` names; its token (and every earlier one of
    /// the slot) resolves to [`TokenState::Released`] from now on.
    pub fn remove(&mut self, tok: u64) -> Option<T> {
        match self.resolve(tok) {
            TokenState::Live(idx) => self.remove_at(idx),
            _ => None,
        }
    }

    /// Removes the value in slot `idx`, if any (see [`remove`](Self::remove)).
    pub fn remove_at(&mut self, idx: usize) -> Option<T> {
        let slot = self.slots.get_mut(idx)?;
        let value = slot.value.take()?;
        self.len -= 1;
        slot.generation += 1;
        if slot.generation < GEN_LIMIT {
            self.free.push(idx);
        }
        Some(value)
    }

    /// Values held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if no value is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// One past the highest slot index ever used: the range of
    /// [`at`](Self::at).
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// The values with their slot indices.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s.value.as_ref()?)))
    }

    /// The values with their slot indices, mutably.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (usize, &mut T)> {
        self.slots
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s.value.as_mut()?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token in an empty slot's current generation was never issued
    /// (it belongs to the slot's next occupant): unknown, not released.
    #[test]
    fn a_never_issued_token_of_an_emptied_slot_is_unknown() {
        let mut s = TokenSlab::new();
        let (a, ta) = s.insert_with(|t| t);
        assert_eq!(s.remove(ta), Some(ta));
        let next = token(a, split(ta).1 + 1);
        assert_eq!(s.resolve(ta), TokenState::Released);
        assert_eq!(s.resolve(next), TokenState::Unknown);
        // Once issued, it is live; after removal, released.
        let (b, tb) = s.insert_with(|t| t);
        assert_eq!((b, tb), (a, next));
        assert_eq!(s.resolve(next), TokenState::Live(a));
        s.remove(tb);
        assert_eq!(s.resolve(next), TokenState::Released);
    }

    #[test]
    fn a_removed_value_s_token_never_reaches_the_slot_s_next_value() {
        let mut s = TokenSlab::new();
        let (a, ta) = s.insert_with(|t| ("a", t));
        assert_eq!(s.get(ta), Some(&("a", ta)));
        assert_eq!(s.resolve(ta), TokenState::Live(a));
        assert_eq!(s.remove(ta), Some(("a", ta)));
        assert_eq!((s.len(), s.get(ta)), (0, None));
        assert_eq!(s.resolve(ta), TokenState::Released);
        let (b, tb) = s.insert_with(|t| ("b", t));
        assert_eq!(b, a, "the slot is reused");
        assert_ne!(tb, ta);
        assert_eq!(s.resolve(ta), TokenState::Released);
        assert_eq!(s.get(ta), None);
        assert_eq!(s.remove(ta), None, "a stale token removes nothing");
        assert_eq!(s.get(tb), Some(&("b", tb)));
        assert_eq!(s.token_at(b), Some(tb));
        // Tokens from elsewhere: a slot never made, a generation not yet reached.
        assert_eq!(s.resolve(token(9, 0)), TokenState::Unknown);
        assert_eq!(s.resolve(token(b, 7)), TokenState::Unknown);
        assert_eq!(s.resolve(u64::MAX), TokenState::Unknown);
    }

    #[test]
    fn a_slot_whose_generations_are_used_up_is_retired_not_wrapped() {
        let mut s = TokenSlab::new();
        let (a, _) = s.insert_with(|_| 1);
        s.slots[a].generation = GEN_LIMIT - 1;
        let old = s.token_at(a).unwrap();
        assert_eq!(s.remove_at(a), Some(1));
        let (b, tb) = s.insert_with(|_| 2);
        assert_ne!(b, a, "a retired slot is not reused");
        assert_eq!(s.resolve(old), TokenState::Released);
        assert_eq!(s.resolve(tb), TokenState::Live(b));
        assert_eq!(s.slot_count(), 2);
    }

    #[test]
    fn iteration_sees_exactly_the_values_held() {
        let mut s = TokenSlab::new();
        let toks: Vec<u64> = (0..5).map(|i| s.insert_with(|_| i).1).collect();
        s.remove(toks[1]);
        s.remove(toks[3]);
        let seen: Vec<(usize, i32)> = s.iter().map(|(i, v)| (i, *v)).collect();
        assert_eq!(seen, vec![(0, 0), (2, 2), (4, 4)]);
        for (_, v) in s.iter_mut() {
            *v *= 10;
        }
        assert_eq!(s.at(4), Some(&40));
        assert_eq!(s.at(1), None);
        assert_eq!((s.len(), s.is_empty()), (3, false));
    }
}
