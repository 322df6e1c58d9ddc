//! No thread allocates or frees memory while it holds a cache lock.
//!
//! The userfaultfd reader takes each cache's lock to apply an event, and
//! the kernel holds the changing thread until the event is read. An
//! allocator that purges memory inside `malloc` (jemalloc's decay,
//! mimalloc's collect) may `madvise` a watched range on any allocation, so
//! a thread that allocates under the cache lock can wait there on the
//! reader, which waits on the lock: a deadlock. Freeing is the same (and
//! with the allocator hook, a large free takes the cache lock itself).
//!
//! The crate is built with `lock-audit` here (a self dev-dependency): it
//! counts the cache locks each thread holds, and this binary's global
//! allocator counts the allocations and frees made meanwhile.

mod common;

use std::alloc::System;
use std::backtrace::Backtrace;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use common::sys::{self, AllocCall, AllocObserver, Observed, PAGE};
use na_regcache::{Access, Cache, CacheConfig, MonitorChoice};

const W: Access = Access::LOCAL_WRITE;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);
static FREES: AtomicUsize = AtomicUsize::new(0);
static CAPTURED: AtomicBool = AtomicBool::new(false);
/// Where the first allocation or free under a cache lock was made.
static FIRST: Mutex<Option<String>> = Mutex::new(None);

thread_local! {
    /// Set while this thread records a backtrace (which allocates).
    static RECORDING: Cell<bool> = const { Cell::new(false) };
}

/// Counts `what` in `counter` if the calling thread holds a cache lock;
/// the first time, records where.
fn audit(counter: &AtomicUsize, what: &str) {
    if na_regcache::cache_locks_held().is_none_or(|n| n == 0) {
        return;
    }
    if RECORDING.try_with(Cell::get).unwrap_or(true) {
        return;
    }
    counter.fetch_add(1, Ordering::Relaxed);
    if CAPTURED.swap(true, Ordering::Relaxed) {
        return;
    }
    RECORDING.with(|r| r.set(true));
    let trace = format!("{what} under a cache lock at:\n{}", Backtrace::force_capture());
    *FIRST.lock().unwrap_or_else(|p| p.into_inner()) = Some(trace);
    RECORDING.with(|r| r.set(false));
}

/// Audits every call of the global allocator: allocations and
/// reallocations count in `ALLOCS`, frees in `FREES`. Reads
/// const-initialized thread-locals without destructors, and allocates (a
/// backtrace) only once, re-entrantly guarded.
struct Audit;

impl AllocObserver for Audit {
    fn before(&self, call: AllocCall) -> bool {
        match call {
            AllocCall::Alloc | AllocCall::AllocZeroed => audit(&ALLOCS, "allocation"),
            AllocCall::Dealloc => audit(&FREES, "free"),
            AllocCall::Realloc => audit(&ALLOCS, "reallocation"),
        }
        false
    }
    fn after(&self, _: AllocCall, _: bool) {}
}

/// Forwards to `System`, audited by [`Audit`].
#[global_allocator]
static ALLOC: Observed<System, Audit> = Observed {
    inner: System,
    observer: Audit,
};

/// Every path that takes the lock: misses that evict by count and by
/// bytes, merge with and supersede entries in use, find no room (uncached
/// fallback); invalidations by hand and by the monitor's reader (an
/// unmap), reaping, `get_unshared` (enough to grow the tracking slots),
/// `evict_idle`, `stats`, and the cache's drop with entries and handles
/// alive.
#[test]
fn no_cache_lock_is_held_across_an_allocation_or_a_free() {
    if na_regcache::cache_locks_held().is_none() {
        na_core::testing::report_not_run(
            "na-regcache no_cache_lock_is_held_across_an_allocation_or_a_free: the lock audit needs debug assertions (a release build of the tests)",
        );
        return;
    }
    let cfg = CacheConfig {
        max_count: 8,
        max_bytes: 24 * PAGE,
        monitor: MonitorChoice::Uffd,
        ..CacheConfig::default()
    };
    let c = Cache::new(common::NoopRegistrar, cfg).unwrap();
    let pages = 256;
    let arena = sys::map_anon(None, pages * PAGE).unwrap();
    sys::touch(arena, pages * PAGE, 1);
    let at = |i: usize| arena + i * PAGE;
    for _round in 0..4 {
        // Evictions by count, then by bytes (8 x 4 pages over 24).
        for i in 0..32 {
            drop(c.get(at(2 * i), PAGE, W).unwrap());
        }
        for i in 0..8 {
            drop(c.get(at(4 * i + 96), 4 * PAGE, W).unwrap());
        }
        // A request overlapping an entry in use supersedes it (which is
        // then tracked outside the index).
        let mut held = vec![c.get(at(200), 2 * PAGE, W).unwrap()];
        held.push(c.get(at(201), 2 * PAGE, W).unwrap());
        assert!(!held[0].is_cached() && held[1].is_cached());
        // Every entry in use: the next miss finds no room.
        for i in 0..8 {
            held.push(c.get(at(210 + 2 * i), PAGE, W).unwrap());
        }
        let uncached = c.get(at(240), PAGE, W).unwrap();
        assert!(!uncached.is_cached());
        // Invalidations by hand make zombies, which the next miss reaps.
        c.invalidate(at(200), 4 * PAGE);
        assert!(!held[1].is_valid());
        drop(c.get(at(250), PAGE, W).unwrap());
        let unshared: Vec<_> = (0..64).map(|i| c.get_unshared(at(i), PAGE, W).unwrap()).collect();
        c.invalidate(at(3), PAGE);
        assert!(!unshared[3].is_valid() && unshared[4].is_valid());
        drop((unshared, uncached, held));
        c.evict_idle();
        let _ = c.stats();
        c.log_stats();
    }
    // More registrations for peers than the first chunk of tracking
    // slots holds: the slot table grows (outside the lock).
    let unshared: Vec<_> = (0..2500)
        .map(|i| c.get_unshared(at(i % 64), PAGE, W).unwrap())
        .collect();
    c.invalidate(at(5), PAGE);
    assert!(!unshared[2245].is_valid() && unshared[2244].is_valid());
    drop(unshared);
    // An unmap, applied by the monitor's reader thread.
    let extra = sys::map_anon(None, 4 * PAGE).unwrap();
    sys::touch(extra, 4 * PAGE, 1);
    let h = c.get(extra, 4 * PAGE, W).unwrap();
    sys::unmap(extra, 4 * PAGE).unwrap();
    assert!(!h.is_valid_now());
    drop(h);
    drop(c.get(at(0), PAGE, W).unwrap());
    // The cache's drop, with entries (one in use) in its index.
    let alive = c.get(at(2), PAGE, W).unwrap();
    drop(c);
    assert!(!alive.is_valid());
    drop(alive);
    sys::unmap(arena, pages * PAGE).unwrap();
    assert_nothing_under_a_lock();
}

/// A cache larger than one stretch of the eviction sweep (which lets the
/// lock go and takes it again between stretches, see `table::SWEEP_STEP`):
/// a miss with every entry in use (the sweep pauses all the way, then
/// finds no room), one after an entry far along was let go (it pauses,
/// then evicts it), and `evict_idle` of them all.
#[test]
fn a_paused_eviction_sweep_allocates_nothing_under_the_lock() {
    if na_regcache::cache_locks_held().is_none() {
        na_core::testing::report_not_run(
            "na-regcache a_paused_eviction_sweep_allocates_nothing_under_the_lock: the lock audit needs debug assertions (a release build of the tests)",
        );
        return;
    }
    const N: usize = 1000;
    let cfg = CacheConfig {
        max_count: N,
        monitor: MonitorChoice::Uffd,
        ..CacheConfig::default()
    };
    let c = Cache::new(common::NoopRegistrar, cfg).unwrap();
    let pages = 2 * N + 4;
    let arena = sys::map_anon(None, pages * PAGE).unwrap();
    sys::touch(arena, pages * PAGE, 1);
    let at = |i: usize| arena + 2 * i * PAGE;
    let mut held: Vec<_> = (0..N).map(|i| c.get(at(i), PAGE, W).unwrap()).collect();
    assert!(held.iter().all(|h| h.is_cached()));
    let full = c.get(at(N), PAGE, W).unwrap();
    assert!(!full.is_cached(), "every entry in use: no room");
    drop(full);
    drop(held.remove(N - 2));
    let evicting = c.get(at(N), PAGE, W).unwrap();
    assert!(evicting.is_cached(), "the idle entry was found and evicted");
    let s = c.stats();
    assert_eq!((s.entries, s.evictions, s.uncached), (N as u64, 1, 1), "{s}");
    drop((held, evicting));
    assert_eq!(c.evict_idle(), N);
    drop(c);
    sys::unmap(arena, pages * PAGE).unwrap();
    assert_nothing_under_a_lock();
}

/// No allocation or free was counted under a cache lock (else: where the
/// first one was made, the crate's frames of its backtrace).
fn assert_nothing_under_a_lock() {
    let (allocs, frees) = (ALLOCS.load(Ordering::Relaxed), FREES.load(Ordering::Relaxed));
    let first = FIRST.lock().unwrap_or_else(|p| p.into_inner()).take();
    // The crate's frames of the first one's backtrace.
    let mut lines = first.iter().flat_map(|t| t.lines());
    let mut ours = lines.next().unwrap_or_default().to_string();
    while let Some(l) = lines.next() {
        if l.contains("na_regcache::") {
            ours += &format!("\n{l}\n{}", lines.next().unwrap_or_default());
        }
    }
    assert_eq!(
        (allocs, frees),
        (0, 0),
        "allocations and frees under a cache lock; the first: {ours}"
    );
}
