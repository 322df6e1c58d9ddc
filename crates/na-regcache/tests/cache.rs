//! Cache behaviour with a real pinning registrar (io_uring fixed buffers):
//! hits, access compatibility, LRU eviction, limits, uncached fallback,
//! retry after eviction, validity flags, disabled mode, lock discipline.

mod common;

use std::io;
use std::sync::{mpsc, Mutex};
use std::time::Duration;

use common::sys::{self, PAGE};
use na_regcache::{Access, Cache, CacheConfig, Error, MonitorChoice, Registrar, UringRegistrar};

const LEN: usize = 4 * PAGE;
const W: Access = Access::LOCAL_WRITE;

fn cache(monitor: MonitorChoice, max_count: usize, max_bytes: usize, slots: u16) -> Cache<UringRegistrar> {
    common::require_io_uring();
    let reg = UringRegistrar::new(slots, false).unwrap();
    Cache::new(
        reg,
        CacheConfig {
            max_count,
            max_bytes,
            monitor,
            fork_guard: true,
            consistency: Default::default(),
            map_watch: true,
        },
    )
    .unwrap()
}

fn buffers(n: usize) -> Vec<usize> {
    (0..n)
        .map(|_| {
            let a = sys::map_anon(None, LEN).unwrap();
            sys::touch(a, LEN, 1);
            a
        })
        .collect()
}

#[test]
fn hit_inside_cached_range_and_access_compatibility() {
    let c = cache(MonitorChoice::None, 16, 1 << 30, 16);
    let a = buffers(1)[0];
    let h1 = c.get(a, LEN, W).unwrap();
    let h2 = c.get(a + PAGE, PAGE, W).unwrap();
    assert_eq!(h2.region().slot, h1.region().slot, "sub-range is a hit");
    assert_eq!(c.stats().hits, 1);
    // Stronger access: a miss that registers the union of rights.
    let h3 = c.get(a, LEN, W | Access::REMOTE_READ).unwrap();
    assert_ne!(h3.region().slot, h1.region().slot);
    assert!(h3.access().contains(W | Access::REMOTE_READ));
    assert!(!h1.is_cached(), "superseded entry left the cache");
    assert!(h1.is_valid(), "superseded but still correct");
    let h4 = c.get(a, PAGE, W).unwrap();
    assert_eq!(h4.region().slot, h3.region().slot, "weaker access is a hit");
    let s = c.stats();
    assert_eq!((s.hits, s.misses, s.entries, s.in_use), (2, 2, 1, 2));
}

#[test]
fn overlapping_requests_merge() {
    let c = cache(MonitorChoice::None, 16, 1 << 30, 16);
    let a = sys::map_anon(None, 2 * LEN).unwrap();
    sys::touch(a, 2 * LEN, 1);
    drop(c.get(a, LEN, W).unwrap());
    let h = c.get(a + PAGE, LEN, W).unwrap();
    assert_eq!((h.addr(), h.len()), (a, LEN + PAGE), "union of both ranges");
    assert_eq!(c.stats().entries, 1);
}

#[test]
fn lazy_deregistration_and_lru_eviction() {
    let c = cache(MonitorChoice::None, 2, 1 << 30, 16);
    let b = buffers(3);
    drop(c.get(b[0], LEN, W).unwrap());
    drop(c.get(b[1], LEN, W).unwrap());
    assert_eq!(c.stats().entries, 2, "released entries stay cached");
    drop(c.get(b[0], LEN, W).unwrap()); // b0 most recently used
    drop(c.get(b[2], LEN, W).unwrap()); // evicts b1
    let s = c.stats();
    assert_eq!((s.hits, s.misses, s.evictions, s.entries), (1, 3, 1, 2));
    drop(c.get(b[0], LEN, W).unwrap());
    assert_eq!(c.stats().hits, 2, "b0 survived");
    drop(c.get(b[1], LEN, W).unwrap());
    assert_eq!(c.stats().misses, 4, "b1 was evicted");
}

#[test]
fn byte_limit_and_uncached_fallback() {
    let c = cache(MonitorChoice::None, 16, 2 * LEN, 16);
    let b = buffers(3);
    let h0 = c.get(b[0], LEN, W).unwrap();
    let h1 = c.get(b[1], LEN, W).unwrap();
    // Both in use: no room, but still a working registration.
    let h2 = c.get(b[2], LEN, W).unwrap();
    assert!(!h2.is_cached());
    assert!(h0.is_cached() && h1.is_cached());
    let s = c.stats();
    assert_eq!((s.uncached, s.entries, s.in_use), (1, 2, 3));
    assert_eq!(s.bytes_registered, 3 * LEN as u64);
    drop(h2);
    assert_eq!(
        c.stats().bytes_registered,
        2 * LEN as u64,
        "uncached registration released"
    );
    let big = sys::map_anon(None, 4 * LEN).unwrap();
    sys::touch(big, 4 * LEN, 1);
    assert!(
        !c.get(big, 4 * LEN, W).unwrap().is_cached(),
        "larger than max_bytes"
    );
    drop((h0, h1));
    assert_eq!(c.stats().in_use, 0);
}

/// `get_unshared` (memory exposed to peers): never served from the cache,
/// never put in it, never shared, deregistered with its last handle, and
/// watched like a cached registration.
#[test]
fn unshared_registrations_are_never_cached_and_end_with_their_handle() {
    // Two device slots: a third live registration has no room.
    let c = cache(MonitorChoice::Uffd, 16, 1 << 30, 2);
    let b = buffers(2);
    let cached = c.get(b[0], LEN, W).unwrap();
    let u1 = c.get_unshared(b[0], LEN, W).unwrap();
    assert_ne!(
        u1.region().slot,
        cached.region().slot,
        "not served from the cache"
    );
    assert!(!u1.is_cached());
    assert_eq!((u1.addr(), u1.len()), (b[0], LEN), "exactly the range asked for");
    let s = c.stats();
    assert_eq!(
        (s.hits, s.misses, s.unshared, s.entries, s.in_use),
        (0, 1, 1, 1, 2)
    );
    drop(cached);
    // Both slots held (one by an idle cached entry, which a failed
    // registration evicts): the second unshared one takes the idle slot.
    let u2 = c.get_unshared(b[0], LEN, W).unwrap();
    assert_ne!(u2.region().slot, u1.region().slot, "not shared with u1");
    assert_eq!(c.stats().evictions, 1);
    let err = c.get_unshared(b[1], LEN, W).unwrap_err();
    assert!(matches!(err, Error::Register { .. }), "both slots in use: {err}");
    drop(u1);
    // u1 was deregistered at once, not kept idle: its slot is free.
    let u3 = c
        .get_unshared(b[1], LEN, W)
        .expect("the slot of the dropped registration is free again");
    assert_eq!(
        c.stats().entries,
        0,
        "unshared registrations never enter the index"
    );
    // A cached lookup of the same range misses: nothing unshared serves it.
    drop(u2);
    let again = c.get(b[1], LEN, W).unwrap();
    assert_ne!(again.region().slot, u3.region().slot);
    assert_eq!(c.stats().hits, 0);
    // The monitor watches unshared registrations too.
    assert!(u3.is_valid_now());
    sys::unmap(b[1], LEN).unwrap();
    assert!(!u3.is_valid_now(), "still valid after munmap returned");
    let before = c.stats().bytes_registered;
    drop(u3);
    assert_eq!(
        c.stats().bytes_registered,
        before - LEN as u64,
        "deregistered with its handle"
    );
    drop(again);
    // Without a monitor it is a plain registration, still counted as unshared.
    let plain = cache(MonitorChoice::None, 16, 1 << 30, 2);
    let b = buffers(1);
    let u = plain.get_unshared(b[0], LEN, W).unwrap();
    let s = plain.stats();
    assert_eq!((s.unshared, s.uncached, s.entries, s.in_use), (1, 0, 0, 1));
    drop(u);
    assert_eq!(plain.stats().bytes_registered, 0, "deregistered with its handle");
}

#[test]
fn registration_failure_evicts_and_retries_once() {
    // Two device slots: the third registration fails until idle entries go.
    let c = cache(MonitorChoice::None, 16, 1 << 30, 2);
    let b = buffers(3);
    drop(c.get(b[0], LEN, W).unwrap());
    drop(c.get(b[1], LEN, W).unwrap());
    let h = c.get(b[2], LEN, W).unwrap();
    assert!(h.is_cached());
    let s = c.stats();
    assert_eq!((s.register_failures, s.evictions, s.entries), (1, 2, 1));
    let h2 = c.get(b[0], LEN, W).unwrap();
    // All slots busy and nothing idle: a clear error.
    let err = c.get(b[1], LEN, W).unwrap_err();
    assert!(matches!(err, Error::Register { .. }), "{err}");
    assert!(err.to_string().contains("registration of"), "{err}");
    drop((h, h2));
}

#[test]
fn invalid_range_is_an_error() {
    let c = cache(MonitorChoice::None, 4, 1 << 30, 4);
    assert!(matches!(c.get(0x1000, 0, W), Err(Error::InvalidRange { .. })));
    assert!(matches!(
        c.get(usize::MAX - 10, 100, W),
        Err(Error::InvalidRange { .. })
    ));
}

#[test]
fn disabled_cache_registers_every_time() {
    let c = cache(MonitorChoice::Disabled, 4, 1 << 30, 4);
    let a = buffers(1)[0];
    for _ in 0..3 {
        assert!(!c.get(a, LEN, W).unwrap().is_cached());
    }
    let s = c.stats();
    assert_eq!((s.uncached, s.hits, s.entries, s.bytes_registered), (3, 0, 0, 0));
    assert_eq!(c.monitor_name(), "disabled");
}

#[test]
fn alloc_monitor_requires_the_global_allocator_hook() {
    common::require_io_uring();
    let reg = UringRegistrar::new(1, false).unwrap();
    let cfg = CacheConfig {
        monitor: MonitorChoice::Alloc,
        ..CacheConfig::default()
    };
    let err = Cache::new(reg, cfg)
        .err()
        .expect("no hook installed in this binary");
    assert!(matches!(err, Error::AllocHookNotInstalled), "{err}");
}

#[test]
fn validity_flag_cleared_by_unmap_and_manual_invalidation() {
    let c = cache(MonitorChoice::Uffd, 8, 1 << 30, 8);
    let b = buffers(2);
    let h = c.get(b[0], LEN, W).unwrap();
    assert!(h.is_valid() && h.is_valid_now());
    sys::unmap(b[0], LEN).unwrap();
    // munmap returned: the synchronous check must already see it.
    assert!(!h.is_valid_now(), "handle still valid after munmap returned");
    assert!(!h.is_valid());
    assert_eq!(c.stats().invalidations, 1);
    let h2 = c.get(b[1], LEN, W).unwrap();
    c.invalidate(b[1] + PAGE, 1);
    assert!(!h2.is_valid());
    drop(h);
    drop(h2);
    assert_eq!(
        c.stats().bytes_registered,
        0,
        "invalidated entries deregistered once released"
    );
}

/// Handles outside the index (an uncached fallback made because the cache
/// was full, and an entry superseded by a wider registration) still lose
/// their validity when their range changes, and only then.
#[test]
fn validity_of_uncached_and_superseded_handles() {
    let c = cache(MonitorChoice::Uffd, 1, 1 << 30, 8);
    let b = buffers(3);
    let h0 = c.get(b[0], LEN, W).unwrap();
    let h1 = c.get(b[1], LEN, W).unwrap();
    assert!(
        h0.is_cached() && !h1.is_cached(),
        "one entry allowed: second is uncached"
    );
    assert_eq!(c.stats().uncached, 1);
    assert!(h1.is_valid() && h1.is_valid_now());
    c.invalidate(b[0], LEN);
    assert!(!h0.is_valid());
    assert!(h1.is_valid(), "another range's invalidation leaves it valid");
    sys::unmap(b[1], LEN).unwrap();
    assert!(
        !h1.is_valid_now(),
        "uncached handle still valid after munmap returned"
    );
    assert!(!h1.is_valid());
    drop((h0, h1));

    let c = cache(MonitorChoice::Uffd, 16, 1 << 30, 8);
    let narrow = c.get(b[2], PAGE, W).unwrap();
    let wide = c.get(b[2], LEN, W | Access::REMOTE_READ).unwrap();
    assert!(!narrow.is_cached() && wide.is_cached(), "narrow entry superseded");
    assert!(narrow.is_valid_now());
    sys::unmap(b[2], LEN).unwrap();
    assert!(!wide.is_valid_now());
    assert!(
        !narrow.is_valid_now(),
        "superseded handle still valid after munmap returned"
    );
    drop((narrow, wide));

    // A cache that goes away marks every handle still alive invalid.
    let c = cache(MonitorChoice::Uffd, 1, 1 << 30, 8);
    let d = buffers(2);
    let keep = c.get(d[0], LEN, W).unwrap();
    let spare = c.get(d[1], LEN, W).unwrap();
    assert!(!spare.is_cached() && spare.is_valid());
    drop(c);
    assert!(
        !keep.is_valid() && !spare.is_valid(),
        "handles valid after their cache was dropped"
    );
}

/// A monitor that refuses every range (as userfaultfd refuses one another
/// userfaultfd registered), so it never reports a change and keeps no sink.
struct Refusing;

impl na_regcache::Monitor for Refusing {
    fn name(&self) -> &'static str {
        "refusing"
    }
    fn attach(
        &self,
        _: std::sync::Arc<dyn na_regcache::InvalidationSink>,
    ) -> io::Result<na_regcache::SinkId> {
        Ok(na_regcache::SinkId::new())
    }
    fn detach(&self, _: na_regcache::SinkId) -> Option<std::sync::Arc<dyn na_regcache::InvalidationSink>> {
        None
    }
    fn subscribe(&self, _: usize, _: usize, _: u64) -> io::Result<na_regcache::Watch> {
        Err(io::Error::from_raw_os_error(libc::EBUSY))
    }
    fn unsubscribe(&self, _: &na_regcache::Watch) {}
    fn sync(&self) {}
}

/// Unwatched handles (caching disabled, a range the monitor refused,
/// `get_unshared` without a monitor) stay valid while their cache lives
/// (nothing watches them) and turn invalid when it is dropped, like every
/// other handle; their registrations live on until their last handle goes.
#[test]
fn unwatched_handles_turn_invalid_when_their_cache_is_dropped() {
    let config = |monitor| CacheConfig {
        monitor,
        ..CacheConfig::default()
    };
    let a = buffers(1)[0];
    let disabled = cache(MonitorChoice::Disabled, 4, 1 << 30, 8);
    let none = cache(MonitorChoice::None, 4, 1 << 30, 8);
    let refusing = Cache::with_monitor(
        UringRegistrar::new(8, false).unwrap(),
        config(MonitorChoice::None),
        std::sync::Arc::new(Refusing),
    )
    .unwrap();
    let handles = [
        ("disabled get", disabled.get(a, LEN, W).unwrap()),
        ("disabled get_unshared", disabled.get_unshared(a, LEN, W).unwrap()),
        ("none get_unshared", none.get_unshared(a, LEN, W).unwrap()),
        ("refused get", refusing.get(a, LEN, W).unwrap()),
        ("refused get_unshared", refusing.get_unshared(a, LEN, W).unwrap()),
    ];
    for (what, h) in &handles {
        assert!(!h.is_cached() && h.is_valid() && h.is_valid_now(), "{what}");
    }
    assert_eq!(
        refusing.stats().uncached,
        1,
        "the refused range was handed out uncached"
    );
    // Another cache's drop leaves them alone.
    drop(cache(MonitorChoice::None, 4, 1 << 30, 1));
    assert!(handles.iter().all(|(_, h)| h.is_valid()));
    drop((disabled, none, refusing));
    for (what, h) in &handles {
        assert!(
            !h.is_valid() && !h.is_valid_now(),
            "{what}: valid after its cache was dropped"
        );
        // Still registered: the region is usable until the handle goes.
        assert_eq!((h.addr(), h.len()), (a, LEN), "{what}");
    }
}

/// A registrar whose deregistration unmaps memory the uffd monitor watches
/// (as a driver freeing its own buffers might). If the cache deregistered
/// under its lock, the munmap would wait for the monitor thread, which would
/// wait for the lock: deadlock.
struct UnmapOnDeregister {
    inner: UringRegistrar,
    victim: Mutex<Option<(usize, usize)>>,
}

impl Registrar for UnmapOnDeregister {
    type Region = na_regcache::FixedBuffer;
    type Error = io::Error;
    fn register(&self, addr: usize, len: usize, access: Access) -> io::Result<Self::Region> {
        self.inner.register(addr, len, access)
    }
    fn deregister(&self, region: Self::Region) -> io::Result<()> {
        if let Some((a, l)) = self.victim.lock().unwrap().take() {
            sys::unmap(a, l)?;
        }
        self.inner.deregister(region)
    }
}

#[test]
fn deregistration_never_runs_under_the_monitor_lock() {
    common::require_io_uring();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let reg = UnmapOnDeregister {
            inner: UringRegistrar::new(8, false).unwrap(),
            victim: Mutex::new(None),
        };
        let cfg = CacheConfig {
            max_count: 2,
            max_bytes: 1 << 30,
            monitor: MonitorChoice::Uffd,
            fork_guard: true,
            consistency: Default::default(),
            map_watch: true,
        };
        let c = Cache::new(reg, cfg).unwrap();
        let b = buffers(3);
        drop(c.get(b[0], LEN, W).unwrap());
        let keep = c.get(b[1], LEN, W).unwrap();
        *c.registrar().victim.lock().unwrap() = Some((b[1], LEN));
        // Evicts b0; its deregistration unmaps b1, which is cached and watched.
        drop(c.get(b[2], LEN, W).unwrap());
        tx.send((keep.is_valid_now(), c.stats())).unwrap();
    });
    let (valid, stats) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("deadlock: eviction under the lock");
    assert!(!valid, "unmapped during deregistration: invalid");
    assert_eq!(stats.evictions, 1, "{stats}");
}

/// A registrar that refuses registrations longer than `max`.
struct RefusesLong {
    inner: UringRegistrar,
    max: usize,
}

impl Registrar for RefusesLong {
    type Region = na_regcache::FixedBuffer;
    type Error = io::Error;
    fn register(&self, addr: usize, len: usize, access: Access) -> io::Result<Self::Region> {
        if len > self.max {
            return Err(io::Error::other("too long for this registrar"));
        }
        self.inner.register(addr, len, access)
    }
    fn deregister(&self, r: Self::Region) -> io::Result<()> {
        self.inner.deregister(r)
    }
}

/// When the span merged with a cached neighbour cannot be registered, the
/// request alone is, outside the cache, and it is watched like any entry:
/// once its memory is unmapped its validity flag says so (it was an
/// unwatched registration whose flag stayed true forever).
#[test]
fn the_fallback_for_an_unregistrable_merged_span_is_watched() {
    common::require_io_uring();
    let reg = RefusesLong {
        inner: UringRegistrar::new(8, false).unwrap(),
        max: LEN,
    };
    let cfg = CacheConfig {
        max_count: 8,
        monitor: MonitorChoice::Uffd,
        ..CacheConfig::default()
    };
    let c = Cache::new(reg, cfg).unwrap();
    let a = sys::map_anon(None, 2 * LEN).unwrap();
    sys::touch(a, 2 * LEN, 1);
    let h1 = c.get(a, LEN, W).unwrap();
    // Overlaps h1's entry: the merged span (5 pages) is refused.
    let h2 = c.get(a + PAGE, LEN, W).unwrap();
    assert!(h1.is_cached() && !h2.is_cached());
    assert!(h2.is_valid_now());
    sys::unmap(a, 2 * LEN).unwrap();
    assert!(!h1.is_valid_now());
    assert!(
        !h2.is_valid_now(),
        "the fallback registration still claims its unmapped pages"
    );
}

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

/// Held by the tests that count this process's mappings and by those
/// that map and split many (tests run in parallel threads).
static MAPPINGS: Mutex<()> = Mutex::new(());

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

/// A registration kept outside the index (memory exposed to peers, an
/// uncached fallback) stays valid however many invalidations of other
/// ranges happen meanwhile, and still loses its validity when its own
/// range changes.
#[test]
fn registrations_outside_the_index_survive_unrelated_invalidations() {
    let c = cache(MonitorChoice::Uffd, 16, 1 << 30, 8);
    let b = buffers(2);
    let exposed = c.get_unshared(b[0], LEN, W).unwrap();
    assert!(exposed.is_valid_now());
    // Other memory coming and going (each a real unmap the monitor sees),
    // and invalidations of other ranges by hand: many more than any
    // history the cache keeps.
    for i in 0..40 {
        let other = buffers(1)[0];
        drop(c.get(other, LEN, W).unwrap());
        sys::unmap(other, LEN).unwrap();
        assert!(exposed.is_valid_now(), "invalid after {i} unrelated unmaps");
    }
    for i in 0..2000 {
        c.invalidate(b[1], PAGE);
        assert!(exposed.is_valid(), "invalid after {i} unrelated invalidations");
    }
    assert!(exposed.is_valid_now());
    // Its own range changing still invalidates it.
    sys::unmap(b[0], LEN).unwrap();
    assert!(
        !exposed.is_valid_now(),
        "still valid after its memory was unmapped"
    );
}

/// `UringRegistrar::stale_pages` on an empty range, a range below the
/// buffer, or one whose end overflows: an answer or an error, never an
/// arithmetic panic.
#[test]
fn stale_pages_checks_its_range() {
    let c = cache(MonitorChoice::Uffd, 8, 1 << 30, 8);
    let b = buffers(1);
    let h = c.get(b[0], LEN, W).unwrap();
    let reg = c.registrar();
    assert_eq!(reg.stale_pages(h.region(), b[0], LEN).unwrap(), 0);
    assert_eq!(reg.stale_pages(h.region(), b[0], 0).unwrap(), 0);
    for (addr, len) in [(b[0] - 2 * PAGE, PAGE), (b[0], usize::MAX)] {
        let e = reg.stale_pages(h.region(), addr, len).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    }
}

/// A registration for peers (`get_unshared`) whose `register` is slow
/// while many other ranges are invalidated meanwhile still comes out
/// valid: its tracking slot is claimed before the pin, not after (after,
/// only the history of 64 invalidations could tell, and it had wrapped).
#[test]
fn an_unshared_registration_made_during_many_unrelated_invalidations_is_valid() {
    use std::sync::mpsc::{Receiver, Sender};
    use std::sync::Arc;
    /// Registers nothing, but tells the test when a registration starts
    /// and waits for its go.
    struct Slow {
        started: Mutex<Sender<()>>,
        go: Mutex<Receiver<()>>,
    }
    impl Registrar for Slow {
        type Region = ();
        type Error = io::Error;
        fn register(&self, _: usize, _: usize, _: Access) -> io::Result<()> {
            let _ = self.started.lock().unwrap().send(());
            let _ = self.go.lock().unwrap().recv_timeout(Duration::from_secs(10));
            Ok(())
        }
        fn deregister(&self, _: ()) -> io::Result<()> {
            Ok(())
        }
    }
    let (started_tx, started) = mpsc::channel();
    let (go, go_rx) = mpsc::channel();
    let c = Arc::new(
        Cache::new(
            Slow {
                started: Mutex::new(started_tx),
                go: Mutex::new(go_rx),
            },
            CacheConfig {
                max_count: 16,
                monitor: MonitorChoice::Uffd,
                ..CacheConfig::default()
            },
        )
        .unwrap(),
    );
    let b = buffers(2);
    let c2 = c.clone();
    let b0 = b[0];
    let maker = std::thread::spawn(move || c2.get_unshared(b0, LEN, W).unwrap());
    started
        .recv_timeout(Duration::from_secs(10))
        .expect("register called");
    for _ in 0..500 {
        c.invalidate(b[1], PAGE);
    }
    go.send(()).unwrap();
    let exposed = maker.join().unwrap();
    assert!(
        exposed.is_valid_now(),
        "invalid although nothing touched its range"
    );
    // An invalidation of its own range still counts.
    c.invalidate(b[0], PAGE);
    assert!(!exposed.is_valid());
}

/// More registrations for peers (`get_unshared`) live at once than the
/// 4,096 tracking slots the cache used to have, then more unrelated
/// unmaps than the 64 invalidations its history keeps: every one stays
/// valid (before, those beyond the 4,096th were checked against that
/// history and turned invalid), and each still loses its validity when
/// its own range changes.
#[test]
fn thousands_of_registrations_for_peers_stay_exactly_tracked() {
    // Maps, splits (watches) and unmaps a lot.
    let _maps = MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = CacheConfig {
        max_count: 16,
        monitor: MonitorChoice::Uffd,
        ..CacheConfig::default()
    };
    let c = Cache::new(common::NoopRegistrar, cfg).unwrap();
    let pages = 64;
    let arena = sys::map_anon(None, pages * PAGE).unwrap();
    sys::touch(arena, pages * PAGE, 1);
    let n = 5000;
    let exposed: Vec<_> = (0..n)
        .map(|i| c.get_unshared(arena + (i % pages) * PAGE, PAGE, W).unwrap())
        .collect();
    assert!(exposed.iter().all(|h| h.is_valid()));
    // Other registered memory unmapped, each seen by the monitor.
    for _ in 0..70 {
        let other = sys::map_anon(None, LEN).unwrap();
        sys::touch(other, LEN, 1);
        drop(c.get(other, LEN, W).unwrap());
        sys::unmap(other, LEN).unwrap();
    }
    let invalid: Vec<_> = (0..n).filter(|&i| !exposed[i].is_valid_now()).collect();
    assert!(
        invalid.is_empty(),
        "{} of {n} invalid after 70 unrelated unmaps, the first: #{:?}",
        invalid.len(),
        invalid.first()
    );
    // Exact still: unmapping one page of the arena invalidates its handles only.
    sys::unmap(arena + 7 * PAGE, PAGE).unwrap();
    for (i, h) in exposed.iter().enumerate() {
        assert_eq!(h.is_valid_now(), i % pages != 7, "handle #{i}");
    }
    drop(exposed);
    drop(c);
    sys::unmap(arena, pages * PAGE).unwrap();
}

/// What the registrar of a gated miss tells the test.
enum Ev {
    /// The registration of the gated address pinned its pages and waits
    /// for the test's go.
    Started,
    /// The `get` returned.
    Done,
}

/// Pins like `UringRegistrar`; a registration of `gated` then tells the
/// test and waits for its go, so that the test can change memory while
/// the registration is being made (an `ibv_reg_mr` of a large buffer
/// takes that long).
struct Gated {
    inner: UringRegistrar,
    gated: usize,
    events: Mutex<mpsc::Sender<Ev>>,
    go: Mutex<mpsc::Receiver<()>>,
}

impl Registrar for Gated {
    type Region = na_regcache::FixedBuffer;
    type Error = io::Error;
    fn register(&self, addr: usize, len: usize, access: Access) -> io::Result<Self::Region> {
        let r = self.inner.register(addr, len, access)?;
        if addr == self.gated {
            let _ = self.events.lock().unwrap().send(Ev::Started);
            let _ = self.go.lock().unwrap().recv_timeout(Duration::from_secs(30));
        }
        Ok(r)
    }
    fn deregister(&self, r: Self::Region) -> io::Result<()> {
        self.inner.deregister(r)
    }
}

/// A cache over [`Gated`] (for `gated`, `LEN` bytes), `others` cached
/// one-page entries two pages apart in an arena (returned), and a held
/// handle on one more (whose `is_valid_now` waits for the monitor's
/// reader). Runs `get(gated)` in a thread and `during(attempt)` while each
/// of its registrations of `gated` waits; returns what the `get` returned
/// and how many registrations it made.
#[allow(clippy::type_complexity)]
fn gated_miss(
    gated: usize,
    others: usize,
    mut during: impl FnMut(&Cache<Gated>, usize, usize),
) -> (
    std::sync::Arc<Cache<Gated>>,
    na_regcache::Result<na_regcache::Registration<Gated>>,
    usize,
) {
    common::require_io_uring();
    let (ev_tx, events) = mpsc::channel();
    let (go, go_rx) = mpsc::channel();
    let c = std::sync::Arc::new(
        Cache::new(
            Gated {
                inner: UringRegistrar::new(512, true).unwrap(),
                gated,
                events: Mutex::new(ev_tx.clone()),
                go: Mutex::new(go_rx),
            },
            CacheConfig {
                max_count: 512,
                max_bytes: 1 << 30,
                monitor: MonitorChoice::Uffd,
                ..CacheConfig::default()
            },
        )
        .unwrap(),
    );
    let arena = sys::map_anon(None, 2 * others * PAGE).unwrap();
    sys::touch(arena, 2 * others * PAGE, 1);
    for i in 0..others {
        drop(c.get(arena + 2 * i * PAGE, PAGE, W).unwrap());
    }
    assert_eq!(c.stats().entries, others as u64);
    let c2 = c.clone();
    let maker = std::thread::spawn(move || {
        let r = c2.get(gated, LEN, W);
        let _ = ev_tx.send(Ev::Done);
        r
    });
    let mut attempts = 0;
    // Until `Ev::Done`.
    while let Ev::Started = events
        .recv_timeout(Duration::from_secs(30))
        .expect("the get went on")
    {
        during(&c, arena, attempts);
        attempts += 1;
        go.send(()).unwrap();
    }
    let r = maker.join().unwrap();
    (c, r, attempts)
}

/// Unmaps the `n` one-page entries of the arena from the `k`-th and waits
/// until the monitor applied every unmap.
fn unmap_entries(
    c: &Cache<Gated>,
    sync: &na_regcache::Registration<Gated>,
    arena: usize,
    k: usize,
    n: usize,
) {
    let before = c.stats().invalidations;
    for i in k..k + n {
        sys::unmap(arena + 2 * i * PAGE, PAGE).unwrap();
    }
    assert!(sync.is_valid_now(), "the sync handle's range was not touched");
    assert_eq!(c.stats().invalidations, before + n as u64, "every unmap seen");
}

/// A miss whose registration is slow (the gated registrar) while more
/// registered ranges than the cache's history of 64 invalidations are
/// unmapped elsewhere still gets its registration, cached and valid: the
/// miss tracks its own span exactly. (Before, it consulted that history,
/// which had wrapped: it threw the good registration away and tried
/// again, and after three such tries `get` failed with `Unstable`.)
#[test]
fn a_miss_registering_during_many_unrelated_unmaps_succeeds() {
    let _maps = MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
    let b = buffers(2);
    let per_attempt = 70;
    let mut sync = None;
    let (c, r, attempts) = gated_miss(b[0], 3 * per_attempt, |c, arena, attempt| {
        let sync = sync.get_or_insert_with(|| c.get(b[1], LEN, W).unwrap());
        unmap_entries(c, sync, arena, attempt * per_attempt, per_attempt);
    });
    let h = r.unwrap_or_else(|e| panic!("{e} after {attempts} registrations"));
    assert_eq!(attempts, 1, "the registration was thrown away and made again");
    assert!(h.is_cached() && h.is_valid_now());
    assert_eq!((h.addr(), h.len()), (b[0], LEN));
    assert_eq!(c.registrar().inner.stale_pages(h.region(), b[0], LEN).unwrap(), 0);
    // Its own range changing still invalidates it.
    sys::unmap(b[0], LEN).unwrap();
    assert!(!h.is_valid_now());
}

/// A change of a miss's own range while it registers (the gated
/// registrar; the pages were pinned before the test replaces them, along
/// with more unrelated unmaps than the history of 64 holds) is still
/// caught: the registration is made again, and the one handed out holds
/// the current pages.
#[test]
fn a_miss_whose_range_changes_while_it_registers_registers_again() {
    let _maps = MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
    let b = buffers(2);
    let per_attempt = 70;
    let mut sync = None;
    let (c, r, attempts) = gated_miss(b[0], per_attempt, |c, arena, attempt| {
        let sync = sync.get_or_insert_with(|| c.get(b[1], LEN, W).unwrap());
        if attempt == 0 {
            // New pages at the same address (userfaultfd: an unmap).
            sys::map_anon_overlay(b[0], LEN).unwrap();
            sys::touch(b[0], LEN, 2);
            unmap_entries(c, sync, arena, 0, per_attempt);
        }
    });
    let h = r.unwrap_or_else(|e| panic!("{e} after {attempts} registrations"));
    assert_eq!(attempts, 2, "the registration of the old pages was handed out");
    assert!(h.is_valid_now());
    assert_eq!(
        c.registrar().inner.stale_pages(h.region(), b[0], LEN).unwrap(),
        0,
        "the registration holds the replaced pages"
    );
}
