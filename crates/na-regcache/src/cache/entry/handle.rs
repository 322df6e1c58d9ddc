//! The public handle on a registration.

use std::sync::Arc;

use super::{Entry, MAX_HANDLES};
use crate::registrar::{Access, Registrar};

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
    ///
    /// A panic, not an abort as `Arc`'s overflow is: the clone takes back
    /// the one it added before it panics, so the count stays below the
    /// bit (by 2^30 less the threads cloning at that moment) and the
    /// registration stays usable; a caller that catches the panic loses
    /// nothing. Holding that many handles takes 4 GiB of them on a 32-bit
    /// target (all its address space), so only `mem::forget` gets there;
    /// on a 64-bit one (2^62) nothing does.
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
