//! An entry's handle count and its "in the index" bit, in one word, and
//! the acquisitions and releases that keep the counts of entries in use
//! exact.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::Entry;
use crate::registrar::Registrar;
use crate::stats::StripedCounter;
use crate::sys::brlock::stripe;

#[cfg(test)]
use super::{tests, Backend};
#[cfg(test)]
use crate::registrar::Access;
#[cfg(test)]
use std::sync::Arc;

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
/// ([`Stats::busy_cached`](crate::stats::Stats::busy_cached),
/// [`Stats::busy_outside`](crate::stats::Stats::busy_outside)) stay exact: the
/// table tells from them, without a sweep, that no cached entry is idle.
pub(crate) struct Refs(pub(super) AtomicUsize);

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

impl<R: Registrar> Entry<R> {
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
}
