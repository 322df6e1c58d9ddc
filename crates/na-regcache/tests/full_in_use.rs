//! A full cache whose entries are all in use takes a miss without an
//! eviction sweep: the cache counts its entries in use, so it knows no
//! entry is idle without looking at each (`CacheStats::sweep_steps`).
//! Real memory, real io_uring pins, the userfaultfd monitor.

mod common;

use common::sys::{self, PAGE};
use na_regcache::{Access, Cache, CacheConfig, MonitorChoice, UringRegistrar};

const W: Access = Access::LOCAL_WRITE;
/// Entries: a few sweep stretches (`SWEEP_STEP` is 256).
const N: usize = 600;

fn cache() -> Cache<UringRegistrar> {
    common::require_io_uring();
    let reg = UringRegistrar::new((N + 16) as u16, false).expect("io_uring fixed buffers");
    Cache::new(
        reg,
        CacheConfig {
            max_count: N,
            max_bytes: 1 << 30,
            monitor: MonitorChoice::Uffd,
            fork_guard: true,
            consistency: Default::default(),
            map_watch: false,
        },
    )
    .expect("cache")
}

#[test]
fn a_full_cache_in_use_takes_a_miss_without_a_sweep() {
    let c = cache();
    // One mapping, N + 2 pages: one page per entry, two for the misses.
    let base = sys::map_anon(None, (N + 2) * PAGE).expect("mmap");
    sys::touch(base, (N + 2) * PAGE, 1);
    // Adjacent one-page entries do not overlap, so none merge.
    let page = |i: usize| base + i * PAGE;
    let mut held: Vec<_> = (0..N).map(|i| c.get(page(i), PAGE, W).expect("fill")).collect();
    let s = c.stats();
    assert_eq!((s.entries, s.in_use, s.sweep_steps), (N as u64, N as u64, 0));

    // Full, all in use: the miss is handed out uncached at once (before:
    // a sweep of every slot twice, 2N slots, in lock holds of 256).
    let h = c.get(page(N), PAGE, W).expect("miss");
    assert!(!h.is_cached() && h.is_valid());
    let s = c.stats();
    assert_eq!(s.uncached, 1);
    assert_eq!(s.sweep_steps, 0, "slots looked at for a full cache in use");
    assert_eq!(c.evict_idle(), 0);
    assert_eq!(c.stats().sweep_steps, 0, "evict_idle looked too");
    drop(h);

    // One entry let go: the next miss sweeps to it and evicts it.
    drop(held.remove(N / 2));
    let h = c.get(page(N + 1), PAGE, W).expect("miss");
    assert!(h.is_cached(), "the idle entry made room");
    let s = c.stats();
    assert_eq!((s.evictions, s.entries, s.uncached), (1, N as u64, 1));
    let swept = s.sweep_steps;
    assert!(swept > 0 && swept <= 2 * N as u64, "{swept} slots looked at");

    // Entries invalidated while in use leave the index, and their last
    // handles are dropped outside it; the places they left are filled
    // with entries in use: full and all in use again, so no sweep.
    held.push(h);
    c.invalidate(page(0), 4 * PAGE);
    assert_eq!(c.stats().entries, N as u64 - 4);
    let gone: Vec<_> = held.drain(..4).collect();
    assert!(gone.iter().all(|h| !h.is_valid() && !h.is_cached()));
    drop(gone);
    // The same four pages again, one entry each, held.
    held.extend((0..4).map(|i| c.get(page(i), PAGE, W).expect("refill")));
    assert!(held.iter().all(|h| h.is_cached()));
    let s = c.stats();
    assert_eq!((s.entries, s.in_use), (N as u64, N as u64));
    let h = c.get(page(N), PAGE, W).expect("miss");
    assert!(!h.is_cached());
    assert_eq!(c.stats().sweep_steps, swept, "no sweep of a full cache in use");
    drop(h);
    drop(held);
    let s = c.stats();
    assert_eq!(s.in_use, 0);
    sys::unmap(base, (N + 2) * PAGE).expect("munmap");
}
