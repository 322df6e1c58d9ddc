//! Cache behaviour with a real pinning registrar (io_uring fixed buffers):
//! hits, access compatibility, LRU eviction, limits, uncached fallback,
//! retry after eviction, disabled mode. (Validity flags and lock
//! discipline: `cache_validity.rs`; watched mappings:
//! `cache_mappings.rs`; registrations outside the index:
//! `cache_tracked.rs`.)

mod common;

use common::cache_rig::{buffers, cache, LEN, W};
use common::sys::{self, PAGE};
use na_regcache::{Access, Cache, CacheConfig, Error, MonitorChoice, UringRegistrar};
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
