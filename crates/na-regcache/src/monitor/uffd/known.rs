//! The table of page ranges the monitor registered with the kernel and
//! not unmapped since (see the module docs of [`super`]: a subscription of
//! a remembered range skips the `UFFDIO_REGISTER` ioctl; the reader
//! forgets every range an UNMAP or REMAP overlaps before it invalidates).

use crate::sys::mem::page_size;

use super::Shared;

/// Sets (of `WAYS` ranges each) of the table of ranges known to be registered.
pub(super) const SETS: usize = 512;
pub(super) const WAYS: usize = 4;

/// The table of page ranges registered with the kernel and not unmapped since.
pub(super) struct Known {
    pub(super) sets: [[(usize, usize); WAYS]; SETS],
    /// Bumped by every `forget`: a range found unknown before a forget is
    /// not remembered after it (its registration may predate the change).
    pub(super) forgets: u64,
}

impl Shared {
    fn known_set(first: usize) -> usize {
        (first / page_size()).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (usize::BITS - SETS.trailing_zeros())
    }

    /// `Ok(())` when `range` is known to be registered; otherwise the
    /// forget generation to pass to [`Shared::remember`].
    pub(super) fn is_known(&self, range: (usize, usize)) -> Result<(), u64> {
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if known.sets[Self::known_set(range.0)].contains(&range) {
            Ok(())
        } else {
            Err(known.forgets)
        }
    }

    /// Remembers `range` (most recent first in its set; the oldest way is
    /// dropped), unless a `forget` ran since generation `forgets` was read:
    /// that forget may have been for the very mapping just registered.
    pub(super) fn remember(&self, range: (usize, usize), forgets: u64) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if known.forgets != forgets {
            return;
        }
        let set = &mut known.sets[Self::known_set(range.0)];
        set.rotate_right(1);
        set[0] = range;
    }

    /// Forgets every remembered range overlapping `[start, end)` (allocation-free).
    pub(super) fn forget(&self, start: usize, end: usize) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known.forgets = known.forgets.wrapping_add(1);
        for k in known.sets.iter_mut().flatten() {
            if k.0 < end && k.1 > start {
                *k = (0, 0);
            }
        }
    }
}
