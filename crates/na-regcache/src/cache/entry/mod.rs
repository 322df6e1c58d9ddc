//! One registration and the handle users hold on it: the entry and its
//! backend here, its handle count in [`refs`], the public handle in
//! [`handle`].

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use super::shared::{Reserved, Shared};
use super::table::Table;
use crate::monitor::{Monitor, Watch};
use crate::registrar::{Access, Registrar};
use crate::stats::Stats;
use crate::sys::mem::ForkGuard;

mod handle;
mod refs;

pub use handle::Registration;
pub(crate) use refs::Refs;
pub use refs::MAX_HANDLES;

/// What every entry needs to deregister itself: the registrar, the counters,
/// the monitor (to unsubscribe) and the fork guard.
pub(crate) struct Backend<R: Registrar> {
    pub registrar: R,
    pub stats: Stats,
    pub monitor: Option<Arc<dyn Monitor>>,
    pub fork_guard: Option<ForkGuard>,
    /// Set when the cache is dropped: clears the validity of unwatched
    /// handles (watched ones are cleared by an invalidation of everything).
    pub closed: AtomicBool,
}

impl<R: Registrar> Backend<R> {
    /// False in a forked child of the process that built the cache.
    #[inline]
    pub fn in_owner(&self) -> bool {
        self.fork_guard.as_ref().is_none_or(ForkGuard::in_creator)
    }
}

/// Slot number of an entry that is not in the cache.
pub(crate) const NO_SLOT: u32 = u32::MAX;

/// A registration of `[start, end)`. Deregistered when the last `Arc` drops,
/// which the cache arranges to happen outside its lock.
pub(crate) struct Entry<R: Registrar> {
    pub start: usize,
    pub end: usize,
    pub access: Access,
    /// Cleared by invalidation (and when the cache is dropped).
    pub valid: AtomicBool,
    /// Live handles, and whether the entry is in the cache index.
    pub refs: Refs,
    /// CLOCK second-chance bit, set by hits.
    pub referenced: AtomicBool,
    /// Slot in the cache's table (set on insertion), `NO_SLOT` when never cached.
    pub slot: AtomicU32,
    /// The monitor's subscription, if any.
    pub watch: Option<Watch>,
    /// For a watched registration outside the index (handed out uncached,
    /// for peers, or superseded): its tracking slot, or the invalidation
    /// generation it was made at if it got none (see [`Entry::track_since`]).
    tracker: OnceLock<Tracker<R>>,
    region: Option<R::Region>,
    pub backend: Arc<Backend<R>>,
}

/// What an entry outside the index checks its validity against.
struct Tracker<R: Registrar> {
    shared: Arc<Shared<R>>,
    /// The cache's invalidation generation when the entry was made.
    gen: u64,
    /// Made while its range was settling (a discard raced the miss past
    /// its settle retries or its wait budget): stale from then on.
    stale_at: Option<Instant>,
    /// Its slot in `shared.tracked` (exact), or `None` (only if the slot
    /// table could not grow): the table's history since `gen` decides
    /// (conservative once it wrapped).
    slot: Option<usize>,
}

impl<R: Registrar> Entry<R> {
    pub fn new(
        backend: &Arc<Backend<R>>,
        (start, end, access): (usize, usize, Access),
        region: R::Region,
        watch: Option<Watch>,
    ) -> Entry<R> {
        backend
            .stats
            .bytes_registered
            .fetch_add((end - start) as u64, Ordering::Relaxed);
        Entry {
            start,
            end,
            access,
            valid: AtomicBool::new(true),
            refs: Refs(AtomicUsize::new(0)),
            referenced: AtomicBool::new(false),
            slot: AtomicU32::new(NO_SLOT),
            watch,
            tracker: OnceLock::new(),
            region: Some(region),
            backend: Arc::clone(backend),
        }
    }

    /// table, write-locked: a later invalidation then finds the entry's
    /// tracking slot, one of reservation `r`. Allocates nothing.
    pub fn track_since(
        &self,
        shared: Arc<Shared<R>>,
        t: &Table<R>,
        r: &mut Reserved<'_>,
        gen: u64,
        stale_at: Option<Instant>,
    ) {
        if self.tracker.get().is_some() {
            // Set once, when the entry left (or never entered) the index.
            return;
        }
        let slot = shared.track(t, r, gen, self.start, self.end);
        self.track_with(shared, gen, stale_at, slot);
    }

    /// Like [`track_since`](Self::track_since) with a slot claimed
    /// already (live since generation `gen`, under the write lock), or
    /// `None` (then the history since `gen` decides). No lock needed.
    pub fn track_with(
        &self,
        shared: Arc<Shared<R>>,
        gen: u64,
        stale_at: Option<Instant>,
        slot: Option<usize>,
    ) {
        if let Err(t) = self.tracker.set(Tracker {
            shared,
            gen,
            stale_at,
            slot,
        }) {
            // Tracked already (cannot happen for a new entry): give the
            // new slot back.
            if let Some(i) = t.slot {
                t.shared.tracked.release(i);
            }
        }
    }

    /// The validity flag, and for a tracked uncached entry the absence of
    /// invalidations of its range and of its stale time (either clears the
    /// flag for good). False in a forked child of the process that made
    /// the cache, without a look at the cache (whose lock a parent thread
    /// may have held at the fork).
    #[inline]
    pub fn is_valid(&self) -> bool {
        if !self.valid.load(Ordering::Acquire) || !self.backend.in_owner() {
            return false;
        }
        match self.tracker.get() {
            Some(t)
                if t.stale_at.is_some_and(|at| Instant::now() >= at)
                    || match t.slot {
                        Some(i) => t.shared.tracked.hit(i),
                        None => !t.shared.unchanged_since(t.gen, self.start, self.end),
                    } =>
            {
                self.valid.store(false, Ordering::Release);
                false
            }
            Some(_) => true,
            // Watched: an invalidation clears the flag (the cache's drop
            // invalidates everything). Unwatched (monitor refused the
            // range, caching disabled, the `none` monitor): only the
            // cache's drop does.
            None if self.watch.is_some() => true,
            None if self.backend.closed.load(Ordering::Acquire) => {
                self.valid.store(false, Ordering::Release);
                false
            }
            None => true,
        }
    }

    pub fn region(&self) -> &R::Region {
        // Present from construction until drop.
        self.region.as_ref().expect("entry region present until drop")
    }
}

impl<R: Registrar> Drop for Entry<R> {
    fn drop(&mut self) {
        if let Some(Tracker {
            shared,
            slot: Some(i),
            ..
        }) = self.tracker.get()
        {
            shared.tracked.release(*i);
        }
        let Some(region) = self.region.take() else { return };
        let b = &self.backend;
        if !b.in_owner() {
            // A forked child must not touch the parent's registrations (for
            // io_uring and verbs the device context is shared with the parent).
            std::mem::forget(region);
            return;
        }
        if let (Some(m), Some(w)) = (&b.monitor, &self.watch) {
            m.unsubscribe(w);
        }
        b.stats
            .bytes_registered
            .fetch_sub((self.end - self.start) as u64, Ordering::Relaxed);
        if let Err(e) = b.registrar.deregister(region) {
            Stats::bump(&b.stats.deregister_failures);
            tracing::warn!(start = self.start, len = self.end - self.start, error = %crate::error::Chain(&e), "deregistration failed");
        }
    }
}

/// A test seam: [`Entry::release`] calls [`in_release`](tests::in_release)
/// between its two steps (uncounting the entry and lowering its user
/// count), so a unit test can look at the counts in that window.
#[cfg(test)]
pub(crate) mod tests {
    use std::cell::RefCell;

    thread_local! {
        /// Run (once per step, taken out while it runs) by releases on
        /// this thread.
        pub static IN_RELEASE: RefCell<Option<Box<dyn Fn()>>> = RefCell::new(None);
    }

    /// Runs the calling thread's hook, if any.
    pub fn in_release<T>(_: &T) {
        if let Some(f) = IN_RELEASE.with(|h| h.borrow_mut().take()) {
            f();
            IN_RELEASE.with(|h| *h.borrow_mut() = Some(f));
        }
    }
}
