//! Validity flags of cached, uncached, superseded and unwatched handles,
//! and lock discipline (deregistration outside the monitor's lock), with a
//! real pinning registrar (io_uring fixed buffers).

mod common;

use std::io;
use std::sync::{mpsc, Mutex};
use std::time::Duration;

use common::cache_rig::{buffers, cache, LEN, W};
use common::sys::{self, PAGE};
use na_regcache::{Access, Cache, CacheConfig, MonitorChoice, Registrar, UringRegistrar};
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
