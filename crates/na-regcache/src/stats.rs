//! Counters a user can read ([`CacheStats`]) and that are emitted via tracing.

use std::fmt;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

use crate::sys::brlock::{stripe, Padded, STRIPES};

/// A snapshot of the cache counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStats {
    /// Lookups served by a cached registration.
    pub hits: u64,
    /// Lookups that registered memory for the cache.
    pub misses: u64,
    /// Idle entries deregistered to respect a limit or after a failed registration.
    pub evictions: u64,
    /// Entries dropped because a monitor saw their mapping change.
    pub invalidations: u64,
    /// Registrations handed out without caching them.
    pub uncached: u64,
    /// Registrations made by [`Cache::get_unshared`](crate::Cache::get_unshared)
    /// (exposed memory: never cached, deregistered with their last handle).
    pub unshared: u64,
    /// Registrations the registrar refused (before or after retrying).
    pub register_failures: u64,
    /// Deregistrations the registrar reported as failed.
    pub deregister_failures: u64,
    /// Entries currently in the cache index.
    pub entries: u64,
    /// Bytes currently registered through this cache (cached, uncached and
    /// invalidated-but-still-held).
    pub bytes_registered: u64,
    /// Registrations currently referenced by at least one handle.
    pub in_use: u64,
    /// Slots the eviction sweeps looked at (the CLOCK hand of a miss that
    /// needs room, and [`Cache::evict_idle`](crate::Cache::evict_idle)).
    /// A sweep starts only while the cache holds an idle entry: a miss of
    /// a full cache whose entries are all in use looks at none.
    pub sweep_steps: u64,
    /// Misses that waited for another thread's registration of a span
    /// covering their request (concurrent misses of one range, coalesced).
    pub coalesce_waits: u64,
    /// Of those, the waits that ended in a hit on that registration (the
    /// others registered on their own: it failed, was handed out uncached,
    /// or was invalidated meanwhile). Counted in `hits` too.
    pub coalesced: u64,
    /// Of those, the waits that ran out their bound
    /// ([`COALESCE_WAIT`](crate::COALESCE_WAIT)) first.
    pub coalesce_timeouts: u64,
    /// Misses that, about to insert their registration, found an entry
    /// another thread cached meanwhile covering their request with its
    /// rights (one their own registration would not cover, so superseding
    /// it would lose range or rights): served by that entry, their own
    /// registration deregistered. Counted in `hits` and in `misses` too
    /// (the miss registered memory for the cache, then threw it away).
    pub raced_hits: u64,
}

impl fmt::Display for CacheStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "hits={} misses={} evictions={} invalidations={} uncached={} unshared={} entries={} bytes_registered={} in_use={} sweep_steps={} coalesce_waits={} coalesced={} coalesce_timeouts={} raced_hits={}",
            self.hits,
            self.misses,
            self.evictions,
            self.invalidations,
            self.uncached,
            self.unshared,
            self.entries,
            self.bytes_registered,
            self.in_use,
            self.sweep_steps,
            self.coalesce_waits,
            self.coalesced,
            self.coalesce_timeouts,
            self.raced_hits
        )
    }
}

/// A counter updated on hot paths by many threads: one padded atomic per
/// stripe, summed on read.
#[derive(Default)]
pub(crate) struct StripedCounter([Padded<AtomicI64>; STRIPES]);

impl StripedCounter {
    #[inline]
    pub fn add(&self, n: i64) {
        self.0[stripe()].0.fetch_add(n, Relaxed);
    }

    /// Adds `n` on stripe `stripe` (the calling thread's, looked up
    /// beforehand: [`stripe`]).
    #[inline]
    pub fn add_at(&self, stripe: usize, n: i64) {
        self.0[stripe].0.fetch_add(n, Relaxed);
    }

    /// Adds `n` on the first stripe, touching no thread-local: for the
    /// rare updates made under the cache's write lock (the sum is the same).
    pub fn add_locked(&self, n: i64) {
        self.0[0].0.fetch_add(n, Relaxed);
    }

    pub fn sum(&self) -> u64 {
        self.0.iter().map(|c| c.0.load(Relaxed)).sum::<i64>().max(0) as u64
    }
}

/// The live counters (relaxed atomics; a snapshot is not a transaction).
#[derive(Default)]
pub(crate) struct Stats {
    pub hits: StripedCounter,
    pub misses: AtomicU64,
    pub evictions: AtomicU64,
    pub invalidations: AtomicU64,
    pub uncached: AtomicU64,
    pub unshared: AtomicU64,
    pub register_failures: AtomicU64,
    pub deregister_failures: AtomicU64,
    pub entries: AtomicU64,
    pub bytes_registered: AtomicU64,
    /// Entries in the cache index with at least one handle: the table's
    /// live entries less these are idle (evictable). Updated on the same
    /// transitions as `in_use` was (a hit on an idle entry, the last
    /// handle's drop), so hits pay nothing more.
    pub busy_cached: StripedCounter,
    /// Registrations outside the index with at least one handle (uncached,
    /// unshared, superseded or invalidated while in use).
    pub busy_outside: StripedCounter,
    /// See [`CacheStats::coalesce_waits`] (misses only).
    pub coalesce_waits: AtomicU64,
    /// See [`CacheStats::coalesced`].
    pub coalesced: AtomicU64,
    /// See [`CacheStats::coalesce_timeouts`].
    pub coalesce_timeouts: AtomicU64,
    /// See [`CacheStats::raced_hits`].
    pub raced_hits: AtomicU64,
}

impl Stats {
    pub fn bump(c: &AtomicU64) {
        c.fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.sum(),
            misses: self.misses.load(Relaxed),
            evictions: self.evictions.load(Relaxed),
            invalidations: self.invalidations.load(Relaxed),
            uncached: self.uncached.load(Relaxed),
            unshared: self.unshared.load(Relaxed),
            register_failures: self.register_failures.load(Relaxed),
            deregister_failures: self.deregister_failures.load(Relaxed),
            entries: self.entries.load(Relaxed),
            bytes_registered: self.bytes_registered.load(Relaxed),
            in_use: self.busy_cached.sum() + self.busy_outside.sum(),
            sweep_steps: 0,
            coalesce_waits: self.coalesce_waits.load(Relaxed),
            coalesced: self.coalesced.load(Relaxed),
            coalesce_timeouts: self.coalesce_timeouts.load(Relaxed),
            raced_hits: self.raced_hits.load(Relaxed),
        }
    }
}
