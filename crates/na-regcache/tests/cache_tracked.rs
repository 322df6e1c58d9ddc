//! Registrations outside the index (for peers, uncached fallbacks) and
//! misses being registered are tracked exactly: unrelated invalidations
//! leave them valid, a change of their own range does not.

mod common;

use std::io;
use std::sync::{mpsc, Mutex};
use std::time::Duration;

use common::cache_rig::{buffers, cache, LEN, MAPPINGS, W};
use common::sys::{self, PAGE};
use na_regcache::{Access, Cache, CacheConfig, MonitorChoice, Registrar, UringRegistrar};
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
