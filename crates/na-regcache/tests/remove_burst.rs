//! Bursts of changes of many watched ranges at once, seen through real
//! userfaultfd events: only the ranges changed are affected.
//!
//! `madvise(MADV_DONTNEED)` sends REMOVE before the kernel drops the pages,
//! so the monitor keeps each REMOVE range "settling" for a while, and a
//! miss overlapping one waits for that to end before it pins (before
//! 2026-11-29 it was handed out uncached, stale once the settle time
//! ended). It keeps 32 such ranges; the 33rd of a burst used to make the
//! *whole address space* settle, so every miss of every cache was
//! uncached until the settle time ended (and now would wait). Now the
//! closest ranges merge instead. An UNMAP burst never widened (each event
//! invalidates exactly its range): checked here as a guard.

mod common;

use common::sys::{self, PAGE};
use common::NoopRegistrar;
use na_regcache::{Access, Cache, CacheConfig, MonitorChoice, UffdMonitor, REMOVE_SETTLE};

const LEN: usize = 4 * PAGE;
const BURST: usize = 40;
const W: Access = Access::LOCAL_WRITE;

/// The tests share the process's userfaultfd monitor, whose settling
/// ranges (merged, so wider than the advised ones) would make the other
/// test's fresh buffers, often at the advised test's freed addresses,
/// wait for their settle time, and whose `settle_waits` the advising test
/// counts: one test at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A userfaultfd cache, or `None` (said loudly) where there is none.
fn uffd_cache(test: &str) -> Option<Cache<NoopRegistrar>> {
    let cfg = CacheConfig {
        monitor: MonitorChoice::Uffd,
        max_count: 256,
        ..CacheConfig::default()
    };
    match Cache::new(NoopRegistrar, cfg) {
        Ok(c) => Some(c),
        Err(e) => {
            na_core::testing::report_not_run(&format!("na-regcache {test}: no userfaultfd monitor ({e})"));
            None
        }
    }
}

/// `n` separate mappings, touched, each cached (and so watched) by `c`.
fn cached_buffers(c: &Cache<NoopRegistrar>, n: usize) -> Vec<usize> {
    (0..n)
        .map(|_| {
            let a = sys::map_anon(None, LEN).expect("mmap");
            sys::touch(a, LEN, 1);
            let h = c.get(a, LEN, W).expect("get");
            assert!(h.is_cached(), "nothing is settling yet");
            a
        })
        .collect()
}

/// A mapping outside `[lo, hi)`, touched.
fn outside(lo: usize, hi: usize) -> usize {
    let mut tried = Vec::new();
    loop {
        let a = sys::map_anon(None, LEN).expect("mmap");
        if a + LEN <= lo || a >= hi {
            tried
                .into_iter()
                .for_each(|t| sys::unmap(t, LEN).expect("munmap"));
            sys::touch(a, LEN, 1);
            return a;
        }
        tried.push(a);
    }
}

#[test]
fn a_burst_of_madvise_dontneed_leaves_other_misses_cached() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let Some(c) = uffd_cache("a_burst_of_madvise_dontneed_leaves_other_misses_cached") else {
        return;
    };
    let burst = cached_buffers(&c, BURST);
    let (lo, hi) = (
        burst.iter().min().copied().unwrap_or(0),
        burst.iter().max().map_or(0, |m| m + LEN),
    );
    let other = outside(lo, hi);
    // Each returns only once the reader read its REMOVE event.
    for &a in &burst {
        sys::advise(a, LEN, libc::MADV_DONTNEED).expect("madvise");
    }
    let before = c.stats();
    assert_eq!(before.uncached, 0);
    let monitor = UffdMonitor::global().expect("the cache's monitor");
    let waits = monitor.counters().settle_waits;
    let h = c.get(other, LEN, W).expect("get of a range no madvise touched");
    assert!(
        h.is_cached(),
        "a miss far from all {BURST} advised ranges was handed out uncached: {}",
        c.stats()
    );
    assert_eq!(
        monitor.counters().settle_waits,
        waits,
        "a miss far from all {BURST} advised ranges waited for their settle time"
    );
    assert!(h.is_valid_now());
    drop(h);
    assert_eq!(c.stats().uncached, 0, "{}", c.stats());
    // An advised range itself waits (the settle time runs from the
    // probe of the `get` above), then is cached and stays valid past it.
    let h = c.get(burst[0], LEN, W).expect("get of an advised range");
    assert_eq!(monitor.counters().settle_waits, waits + 1, "it waited");
    std::thread::sleep(REMOVE_SETTLE * 2);
    assert!(h.is_cached() && h.is_valid_now(), "{}", c.stats());
    drop(h);
    for a in burst.into_iter().chain([other]) {
        sys::unmap(a, LEN).expect("munmap");
    }
}

#[test]
fn a_burst_of_unmaps_leaves_other_entries_cached() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let Some(c) = uffd_cache("a_burst_of_unmaps_leaves_other_entries_cached") else {
        return;
    };
    let keep = cached_buffers(&c, 8);
    let burst = cached_buffers(&c, 100);
    for &a in &burst {
        sys::unmap(a, LEN).expect("munmap");
    }
    let hits = c.stats().hits;
    // Each lookup first waits for the events of the unmaps before it.
    for &a in &keep {
        let h = c.get(a, LEN, W).expect("get");
        assert!(h.is_cached() && h.is_valid_now());
    }
    let s = c.stats();
    assert_eq!(s.hits, hits + 8, "{s}");
    assert_eq!(s.entries, 8, "exactly the unmapped ranges left: {s}");
    for a in keep {
        sys::unmap(a, LEN).expect("munmap");
    }
}
