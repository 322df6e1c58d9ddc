//! The state shared by a cache and its monitor: the table behind a
//! big-reader lock, the backend, and the lock-free monitor pre-filter.

use std::sync::atomic::{AtomicUsize, Ordering};
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
}

impl<R: Registrar> Shared<R> {
    pub fn lock(&self) -> WriteGuard<'_, Table<R>> {
        self.table.write()
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
        let n = self.lock().invalidate(start, end);
        if n > 0 {
            self.zombies.fetch_add(n, Ordering::SeqCst);
            let s = &self.backend.stats;
            s.invalidations.fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    fn may_overlap(&self, start: usize, end: usize) -> bool {
        start < self.hi.load(Ordering::SeqCst) && end > self.lo.load(Ordering::SeqCst)
    }
}
