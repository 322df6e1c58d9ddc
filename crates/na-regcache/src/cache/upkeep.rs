//! The cache's upkeep around the lookups: registering (with one retry
//! after evicting idle entries), reaping invalidated entries, eviction
//! and invalidation by hand, the counters, and the cache's drop.

use std::sync::atomic::Ordering;

use super::{table, Cache};
use crate::error::{Error, Result};
use crate::monitor::InvalidationSink;
use crate::registrar::{Access, Registrar};
use crate::stats::{CacheStats, Stats};

impl<R: Registrar> Cache<R> {
    /// Registers `[addr, addr+len)`; on failure evicts every idle entry and
    /// retries once.
    pub(super) fn register(&self, addr: usize, len: usize, access: Access) -> Result<R::Region> {
        let b = &self.shared.backend;
        match b.registrar.register(addr, len, access) {
            Ok(r) => Ok(r),
            Err(first) => {
                Stats::bump(&b.stats.register_failures);
                let evicted = self.evict_idle();
                if evicted == 0 {
                    return Err(Error::Register {
                        addr,
                        len,
                        source: Box::new(first),
                    });
                }
                tracing::debug!(evicted, error = %crate::error::Chain(&first), "registration failed: evicted idle entries, retrying");
                b.registrar.register(addr, len, access).map_err(|e| {
                    Stats::bump(&b.stats.register_failures);
                    Error::Register {
                        addr,
                        len,
                        source: Box::new(e),
                    }
                })
            }
        }
    }

    /// Deregisters invalidated entries (whose handles, if any, keep their
    /// registration alive until they drop). The room to take them out is
    /// made before the lock, from the `zombies` hint; if more came
    /// meanwhile, again for those.
    pub(super) fn reap(&self) {
        let sh = &self.shared;
        let mut zombies = Vec::new();
        let mut want = sh.zombies.load(Ordering::SeqCst);
        loop {
            zombies.reserve(want);
            let left = {
                let mut t = sh.lock();
                let left = t.take_zombies(&mut zombies);
                sh.zombies.store(left, Ordering::SeqCst);
                left
            };
            zombies.clear();
            if left == 0 {
                return;
            }
            want = left;
        }
    }

    /// Deregisters every idle entry; returns how many were evicted. In a
    /// forked child of the process that made the cache: 0, and nothing is
    /// touched (see [`Cache::invalidate`]).
    pub fn evict_idle(&self) -> usize {
        let sh = &self.shared;
        if !sh.backend.in_owner() {
            return 0;
        }
        let mut idle = Vec::new();
        let mut n = 0;
        // Where the sweep goes on: it looks at a bounded stretch of slots
        // per hold of the write lock (see `table::SWEEP_STEP`).
        let mut cursor = 0;
        loop {
            // Room for every live entry (at most a stretch's worth),
            // made before the write lock.
            let live = sh.table.read().live();
            idle.reserve(live.clamp(1, table::SWEEP_STEP));
            let more = sh
                .lock()
                .take_idle(&mut idle, &mut cursor, &sh.backend.stats.busy_cached);
            n += idle.len();
            idle.clear();
            if !more {
                break;
            }
        }
        sh.backend.stats.evictions.fetch_add(n as u64, Ordering::Relaxed);
        self.reap();
        n
    }

    /// Invalidates `[addr, addr+len)` by hand (an application that knows it
    /// is about to remap memory, or changed it in a way no monitor sees:
    /// see the crate docs on shared file mappings).
    ///
    /// Does nothing in a forked child of the process that made the cache:
    /// the cache is the parent's (the child cannot get registrations from
    /// it), and a parent thread may have held its lock at the fork, so a
    /// child never takes it. The same holds for every method: in a child
    /// [`evict_idle`](Self::evict_idle) returns 0, [`stats`](Self::stats)
    /// zeros, [`log_stats`](Self::log_stats) logs nothing, `get` and
    /// `get_unshared` return [`Error::ForkedChild`], and a handle's
    /// [`Registration::is_valid`](super::Registration::is_valid) is false.
    pub fn invalidate(&self, addr: usize, len: usize) {
        if !self.shared.backend.in_owner() {
            return;
        }
        self.shared.invalidate(addr, addr.saturating_add(len));
        self.reap();
    }

    /// A snapshot of the counters. All zero in a forked child of the
    /// process that made the cache (the child has no use of it, and never
    /// takes its lock: see [`Cache::invalidate`]).
    pub fn stats(&self) -> CacheStats {
        if !self.shared.backend.in_owner() {
            return CacheStats::default();
        }
        let mut s = self.shared.backend.stats.snapshot();
        let t = self.shared.table.read();
        s.entries = t.live() as u64;
        s.sweep_steps = t.sweep_steps();
        s
    }

    /// Emits the counters as a tracing event (target `na_regcache`).
    /// Nothing in a forked child of the process that made the cache.
    pub fn log_stats(&self) {
        if !self.shared.backend.in_owner() {
            return;
        }
        let s = self.stats();
        tracing::info!(
            monitor = self.monitor_name,
            hits = s.hits,
            misses = s.misses,
            evictions = s.evictions,
            invalidations = s.invalidations,
            uncached = s.uncached,
            entries = s.entries,
            bytes_registered = s.bytes_registered,
            in_use = s.in_use,
            sweep_steps = s.sweep_steps,
            coalesce_waits = s.coalesce_waits,
            coalesced = s.coalesced,
            coalesce_timeouts = s.coalesce_timeouts,
            "registration cache stats"
        );
    }
}

impl<R: Registrar> Drop for Cache<R> {
    fn drop(&mut self) {
        let sh = &self.shared;
        if !sh.backend.in_owner() {
            // A forked child: the locks may have been held by parent
            // threads at the fork, and the registrations are the parent's
            // (entries skip deregistering in a child). Touch nothing.
            return;
        }
        let sink = match (&sh.backend.monitor, self.sink) {
            (Some(m), Some(id)) => m.detach(id),
            _ => None,
        };
        drop(sink);
        self.log_stats();
        // Handles still alive keep their registration but are no longer
        // monitored: they are marked invalid (those outside the index
        // through their tracking slots, or the generation, by one
        // invalidation of everything; unwatched ones through `closed`).
        sh.backend.closed.store(true, Ordering::Release);
        sh.invalidate_range(0, usize::MAX);
        // Everything is a zombie now (bar entries a racing miss inserted).
        let mut all = Vec::new();
        let mut want = sh.zombies.load(Ordering::SeqCst);
        loop {
            all.reserve(want.max(1));
            let left = sh.lock().take_all(&mut all);
            all.clear();
            if left == 0 {
                break;
            }
            want = left;
        }
    }
}
