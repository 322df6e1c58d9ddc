//! What the userfaultfd monitor leaves in the address space: shared
//! mappings are never cached (no watch left behind), huge pages are cached
//! where available, and watched ranges are released with their last
//! entry.

mod common;

use common::cache_rig::{LEN, MAPPINGS, W};
use common::sys::{self, PAGE};
use na_regcache::{Cache, CacheConfig, MonitorChoice};
/// userfaultfd never sees a shared file (memfd, shmem, hugetlbfs, shared
/// anonymous memory) lose pages through the file or another mapping
/// (`tests/corruption.rs`, the `file_*` scenarios), so the uffd monitor
/// refuses any range with a shared mapping: it is registered for the
/// operation at hand only, every time, and leaves no watch (no VMA split)
/// behind. Private memory next to it is cached as before.
#[test]
fn shared_mappings_are_never_cached_with_userfaultfd() {
    let _maps = MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = CacheConfig {
        max_count: 16,
        monitor: MonitorChoice::Uffd,
        ..CacheConfig::default()
    };
    let c = Cache::new(common::NoopRegistrar, cfg).unwrap();
    let fd = sys::memfd(LEN).unwrap();
    let file = sys::map_shared_fd(None, LEN, &fd).unwrap();
    // Private pages followed by a shared one (a MAP_FIXED overlay).
    let mixed = sys::map_anon(None, LEN).unwrap();
    let overlay = sys::map_shared_fd_fixed(mixed + 3 * PAGE, PAGE, &fd).unwrap();
    assert_eq!(overlay, mixed + 3 * PAGE);
    let private = sys::map_anon(None, LEN).unwrap();
    // Only the mappings of these ranges: other tests' threads map and
    // unmap meanwhile (their stacks, their buffers).
    let ours = [(file, LEN), (mixed, LEN), (private, LEN)];
    let before = mappings_in(&ours);
    for (what, a, len) in [
        ("memfd", file, LEN),
        ("memfd, part", file + PAGE, 100),
        ("private then shared", mixed, LEN),
    ] {
        for _ in 0..3 {
            let h = c.get(a, len, W).unwrap();
            assert!(!h.is_cached() && h.is_valid(), "{what}");
            let u = c.get_unshared(a, len, W).unwrap();
            assert!(u.is_valid_now(), "{what}");
        }
    }
    assert_eq!(
        mappings_in(&ours),
        before,
        "refused ranges left watches (VMA splits) behind"
    );
    let s = c.stats();
    assert_eq!((s.hits, s.uncached, s.entries), (0, 9, 0), "{s}");
    // Private memory, including the private part of the mixed range.
    for a in [private, mixed] {
        drop(c.get(a, 2 * PAGE, W).unwrap());
        assert!(c.get(a, 2 * PAGE, W).unwrap().is_cached());
    }
    assert_eq!(c.stats().hits, 2);
    drop(c);
    for (a, len) in ours {
        sys::unmap(a, len).unwrap();
    }
}

/// A range inside hugetlbfs pages is watched with its huge pages
/// (`UFFDIO_REGISTER` refuses a range not aligned to them), so it is
/// cached like any other. Needs reserved huge pages.
#[test]
fn an_unaligned_range_of_huge_pages_is_cached_where_available() {
    const HUGE: usize = 2 << 20;
    let a = match sys::map_hugetlb(None, 2 * HUGE) {
        Ok(a) => a,
        Err(e) => {
            na_core::testing::report_not_run(&format!(
                "na-regcache an_unaligned_range_of_huge_pages_is_cached_where_available: \
                 no hugetlbfs pages ({e}; reserve some with `sysctl vm.nr_hugepages=4`)"
            ));
            return;
        }
    };
    sys::touch(a, 2 * HUGE, 1);
    let cfg = CacheConfig {
        max_count: 16,
        monitor: MonitorChoice::Uffd,
        ..CacheConfig::default()
    };
    let c = Cache::new(common::NoopRegistrar, cfg).unwrap();
    // Inside the first huge page, and across the two.
    for (s, len) in [(a + PAGE, 3 * PAGE), (a + HUGE - PAGE, 2 * PAGE)] {
        let h = c.get(s, len, W).unwrap();
        assert!(h.is_cached(), "{:#x}+{len:#x} not cached", s - a);
        drop(h);
        assert!(c.get(s, len, W).unwrap().is_cached());
    }
    let h = c.get(a + PAGE, PAGE, W).unwrap();
    assert!(h.is_valid_now());
    sys::unmap(a, 2 * HUGE).unwrap();
    assert!(!h.is_valid_now(), "valid after its huge pages were unmapped");
}

fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count()
}

/// How many of this process's mappings overlap one of `ranges` (address,
/// length).
fn mappings_in(ranges: &[(usize, usize)]) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|l| {
            let (s, e) = l.split_whitespace().next()?.split_once('-')?;
            Some((
                usize::from_str_radix(s, 16).ok()?,
                usize::from_str_radix(e, 16).ok()?,
            ))
        })
        .filter(|&(s, e)| ranges.iter().any(|&(a, len)| s < a + len && e > a))
        .count()
}

/// Every watched range splits its mapping (a userfaultfd registration is a
/// VMA flag); a range no entry needs any more is unregistered, so a cache
/// that saw 20,000 scattered buffers holds only its entries' splits (it
/// held all 40,000: a process heads for `vm.max_map_count`, where `munmap`
/// starts failing).
#[test]
fn watched_ranges_are_released_with_their_last_entry() {
    let _maps = MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = CacheConfig {
        max_count: 16,
        monitor: MonitorChoice::Uffd,
        ..CacheConfig::default()
    };
    let c = Cache::new(common::NoopRegistrar, cfg).unwrap();
    let n = 20_000;
    let p = sys::map_anon(None, 2 * n * PAGE).unwrap();
    sys::touch(p, 2 * n * PAGE, 1);
    let before = mappings();
    for i in 0..n {
        drop(c.get(p + 2 * i * PAGE, PAGE, W).unwrap());
    }
    let after = mappings();
    assert!(
        after < before + 200,
        "{before} mappings before, {after} after 20,000 scattered buffers with 16 cached"
    );
    drop(c);
    sys::unmap(p, 2 * n * PAGE).unwrap();
}
