//! Registrations made right after `madvise(MADV_DONTNEED)` of their range.
//!
//! userfaultfd delivers REMOVE *before* the kernel drops the pages, so the
//! monitor keeps the range "settling" for `REMOVE_SETTLE` (its bound on
//! when the discard is done). A miss overlapping a settling range waits
//! for the settle time to end before it pins, so the registration it
//! returns pins the pages that stay, and stays valid until the memory
//! really changes again. Before 2026-11-29 such a miss was handed out at
//! once, uncached, with a deadline: its validity flag cleared when the
//! settle time ended, though nothing had changed since (glibc trims thread
//! arenas with `MADV_DONTNEED`, so a buffer allocated there and registered
//! soon after could hit it; in na-verbs a described handle then failed
//! its transfers with "register the handle again").

mod common;

use std::sync::Mutex;
use std::time::Instant;

use common::sys::{self, PAGE};
use common::Rig;
use na_regcache::{Access, MonitorChoice, UffdMonitor, REMOVE_SETTLE};

const LEN: usize = 4 * PAGE;

/// The tests share the process's monitor and its settling ranges (and
/// count its `settle_waits`): one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A fresh mapping of `LEN` bytes, filled, with a registration cached by
/// `rig` (so the range is watched), then discarded: `madvise` returned,
/// its REMOVE event was read and the range is settling. Returns the
/// address and when `madvise` returned.
fn discarded_buffer(rig: &Rig) -> (usize, Instant) {
    let a = sys::map_anon(None, LEN).expect("mmap");
    sys::touch(a, LEN, 0x11);
    rig.prime(a, LEN);
    sys::advise(a, LEN, libc::MADV_DONTNEED).expect("madvise");
    let advised = Instant::now();
    // New pages, as a new owner of the memory would write.
    sys::touch(a, LEN, 0x22);
    (a, advised)
}

/// Checks that `reg` (of `[a, a+LEN)`) pins the pages mapped there now,
/// through the registrar's page frames, and is valid.
fn assert_pins_current_pages(
    rig: &Rig,
    reg: &na_regcache::Registration<na_regcache::UringRegistrar>,
    a: usize,
    what: &str,
) {
    assert!(reg.is_valid_now(), "{what}: invalid");
    let stale = rig
        .cache
        .registrar()
        .stale_pages(reg.region(), a, LEN)
        .expect("page frames");
    assert_eq!(stale, 0, "{what}: pins {stale} pages no longer mapped");
}

/// A buffer discarded (`MADV_DONTNEED`) just now, registered by `make`
/// (`what` in messages): the registration pins the current pages right
/// away and still after the settle time, `make` returned only after the
/// settle time, and it waited once. Returns the buffer and registration.
fn registered_right_after_a_discard(
    rig: &Rig,
    what: &str,
    make: impl FnOnce(usize) -> na_regcache::Registration<na_regcache::UringRegistrar>,
) -> (usize, na_regcache::Registration<na_regcache::UringRegistrar>) {
    let monitor = UffdMonitor::global().expect("userfaultfd monitor");
    let (a, advised) = discarded_buffer(rig);
    let waits = monitor.counters().settle_waits;
    let reg = make(a);
    let returned_after = advised.elapsed();
    assert_pins_current_pages(rig, &reg, a, "right away");
    std::thread::sleep(2 * REMOVE_SETTLE);
    assert_pins_current_pages(rig, &reg, a, "after the settle time");
    assert!(
        returned_after >= REMOVE_SETTLE,
        "{what} returned {returned_after:?} after the discard, within the settle time"
    );
    assert_eq!(monitor.counters().settle_waits, waits + 1, "{what} waited once");
    (a, reg)
}

/// The cached path (`get`), as a local registration of na-verbs makes it.
#[test]
fn a_registration_made_right_after_a_discard_stays_valid_after_the_settle_time() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    common::require_io_uring();
    let rig = Rig::new(MonitorChoice::Uffd);
    // Its settle time starts in this `get` (its first probe after the
    // event was read), after `madvise` returned: the miss waits it out.
    let (a, reg) = registered_right_after_a_discard(&rig, "the miss", |a| {
        rig.cache.get(a, LEN, Access::LOCAL_WRITE).expect("get")
    });
    assert!(reg.is_cached(), "made after the settle time: cached");
    let hits = rig.cache.stats().hits;
    drop(rig.cache.get(a, LEN, Access::LOCAL_WRITE).expect("get again"));
    assert_eq!(rig.cache.stats().hits, hits + 1, "and later lookups hit it");
    drop(reg);
    sys::unmap(a, LEN).expect("munmap");
}

/// The path of memory exposed to peers (`get_unshared`), as na-verbs
/// makes a described handle's registration: the one a peer holds the
/// key of, which the caller cannot simply make again.
#[test]
fn an_unshared_registration_made_right_after_a_discard_stays_valid_after_the_settle_time() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    common::require_io_uring();
    let rig = Rig::new(MonitorChoice::Uffd);
    let (a, reg) = registered_right_after_a_discard(&rig, "get_unshared", |a| {
        rig.cache
            .get_unshared(a, LEN, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .expect("get_unshared")
    });
    // Still watched: a real change of its range clears it.
    sys::advise(a, LEN, libc::MADV_DONTNEED).expect("madvise");
    assert!(!reg.is_valid_now(), "a discard after it invalidates it");
    drop(reg);
    sys::unmap(a, LEN).expect("munmap");
}

/// Only misses of a settling range wait: one elsewhere is made at once
/// (no wait counted) and cached.
#[test]
fn a_miss_away_from_a_settling_range_does_not_wait() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    common::require_io_uring();
    let rig = Rig::new(MonitorChoice::Uffd);
    let monitor = UffdMonitor::global().expect("userfaultfd monitor");
    // Mapped before the discard, so it cannot take the discarded pages'
    // addresses; one page apart from them.
    let other = sys::map_anon(None, LEN).expect("mmap");
    sys::touch(other, LEN, 0x33);
    let (a, _) = discarded_buffer(&rig);
    assert!(other + LEN <= a || a + LEN <= other);
    let waits = monitor.counters().settle_waits;
    let reg = rig.cache.get(other, LEN, Access::LOCAL_WRITE).expect("get");
    assert_eq!(
        monitor.counters().settle_waits,
        waits,
        "no wait for another range"
    );
    assert!(reg.is_cached());
    assert_pins_current_pages(&rig, &reg, other, "the other range");
    drop(reg);
    sys::unmap(other, LEN).expect("munmap");
    sys::unmap(a, LEN).expect("munmap");
}
