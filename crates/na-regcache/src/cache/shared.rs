//! The state shared by a cache and its monitor: the table behind a
//! big-reader lock, the backend, and the lock-free monitor pre-filter.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

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
    /// (uncached registrations compare it with the one they were made at).
    pub generation: AtomicU64,
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
