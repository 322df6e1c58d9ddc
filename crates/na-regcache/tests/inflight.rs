//! Lookups racing a change whose userfaultfd event is still in flight.
//!
//! `munmap` and `mremap` remove the old mapping, release the mmap lock and
//! only *then* queue their event and wait for the monitor to read it.
//! Meanwhile another thread may map new memory at the same address and look
//! it up: the cache must not hand out the registration of the old pages.
//! The monitor's reader is stalled (a signal handler) to hold that window
//! open deterministically; the tests of this binary take turns (one stall
//! at a time per process).

mod common;

use std::io;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::sys::{self, PAGE};
use common::{Outcome, Rig};
use na_regcache::{MonitorChoice, UffdMonitor};

const LEN: usize = 4 * PAGE;
const FILL: u8 = 0xEE;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Caches a registration of a fresh buffer, stalls the reader, lets another
/// thread `change` the buffer's mapping (which then waits for the stalled
/// reader), maps new pages at the same address and transfers through the
/// cache there. The transfer must be clean.
fn reuse_while_change_in_flight(change: fn(usize, usize) -> io::Result<()>) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    common::require_io_uring();
    let rig = Rig::new(MonitorChoice::Uffd);
    let a = sys::map_anon(None, LEN).unwrap();
    sys::touch(a, LEN, FILL);
    rig.prime(a, LEN);
    let waits_before = UffdMonitor::global().unwrap().counters().inflight_waits;
    // The reader thread is spawned with the monitor, now idle in poll(2).
    let reader = sys::thread_named("qs-uffd-monitor").expect("uffd reader thread");
    assert!(
        sys::stall_thread(reader, Duration::from_millis(500)),
        "reader stalled"
    );
    // Another thread (the old buffer's owner) changes the mapping; its call
    // returns only once the stalled reader reads the event.
    let owner = std::thread::spawn(move || change(a, LEN));
    // As soon as the range is free, map new pages there (what mmap or
    // malloc in any thread may do), then look it up and transfer.
    let t0 = Instant::now();
    let b = loop {
        match sys::try_map_anon_at(a, LEN) {
            Ok(b) => break b,
            Err(_) if t0.elapsed() < Duration::from_secs(1) => std::thread::yield_now(),
            Err(e) => panic!("range never freed: {e}"),
        }
    };
    sys::touch(b, LEN, FILL);
    let change_returned = owner.is_finished();
    let outcome = rig.transfer(b, LEN).unwrap();
    sys::stall_release();
    owner.join().unwrap().unwrap();
    let counters = UffdMonitor::global().unwrap().counters();
    eprintln!(
        "inflight: {outcome:?} change_returned_before_lookup={change_returned} {} {counters:?}",
        rig.cache.stats()
    );
    assert!(!change_returned, "the window was open (the reader was stalled)");
    assert_eq!(
        outcome,
        Outcome::CLEAN,
        "stale registration of an address reused while a change was in flight"
    );
    assert!(
        counters.inflight_waits > waits_before,
        "the lookup waited for the change in flight"
    );
    assert_eq!(counters.probe_errors, 0);
    sys::unmap(b, LEN).unwrap();
}

#[test]
fn lookup_of_address_reused_during_inflight_munmap() {
    reuse_while_change_in_flight(sys::unmap);
}

#[test]
fn lookup_of_address_reused_during_inflight_mremap() {
    reuse_while_change_in_flight(|a, len| {
        let to = sys::map_anon(None, len)?;
        sys::remap_to(a, len, to)?;
        sys::unmap(to, len)
    });
}
