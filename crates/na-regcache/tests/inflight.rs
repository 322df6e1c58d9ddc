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
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::sys::{self, PAGE};
use common::{Outcome, Rig};
use na_regcache::{Access, MonitorChoice, UffdMonitor, REMOVE_SETTLE};

const LEN: usize = 4 * PAGE;
const FILL: u8 = 0xEE;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A fresh filled buffer of `LEN` bytes with a registration cached by `rig`.
fn primed_buffer(rig: &Rig) -> usize {
    let a = sys::map_anon(None, LEN).unwrap();
    sys::touch(a, LEN, FILL);
    rig.prime(a, LEN);
    a
}

/// Free room kept on each side of a [`secluded_buffer`].
const SECLUSION: usize = 1 << 30;

/// Like [`primed_buffer`], with [`SECLUSION`] bytes left unmapped on each
/// side. Once the buffer is unmapped, its address lies more than 1 GiB
/// inside a free gap, and the kernel places a mapping at an end of the
/// gap it picks (its top, or its bottom in the legacy layout): no other
/// thread's mapping takes the address while the test waits to map it
/// again. (Before 2026-11-29 the buffer was where the kernel put it, at
/// the top of a gap: when the change freed it, the next small mapping of
/// any thread went there, and the test's own mapping at that address
/// then failed with `EEXIST` until "range never freed within 8 s": 3
/// runs of 38 of this binary with the map watch on, two looping at once
/// at a load of 10 to 20, and 4 of 100 once these tests stopped waiting
/// out the stall; what had taken the address each time was a signal
/// stack, a guard page and 12 KiB, of a thread the harness started for
/// the next test.)
fn secluded_buffer(rig: &Rig) -> usize {
    let r = sys::map_anon(None, 2 * SECLUSION + LEN).unwrap();
    sys::unmap(r, SECLUSION).unwrap();
    sys::unmap(r + SECLUSION + LEN, SECLUSION).unwrap();
    let a = r + SECLUSION;
    sys::touch(a, LEN, FILL);
    rig.prime(a, LEN);
    a
}

/// Caches a registration of a fresh buffer, stalls the reader, lets another
/// thread `change` the buffer's mapping (which then waits for the stalled
/// reader), maps new pages at the same address and transfers through the
/// cache there. The transfer must be clean.
fn reuse_while_change_in_flight(change: fn(usize, usize) -> io::Result<()>) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    common::require_io_uring();
    let rig = Rig::new(MonitorChoice::Uffd);
    // Where no other thread's mapping lands once the change freed it.
    let a = secluded_buffer(&rig);
    let waits_before = UffdMonitor::global().unwrap().counters().inflight_waits;
    // Another thread (the old buffer's owner) will change the mapping; its
    // call returns only once the reader reads the event. It is made now,
    // before the reader stalls: making a thread maps its stack and may
    // unmap cached ones, and with the map watch on it is watched too,
    // none of which may wait behind the stalled reader (CI saw the range
    // not freed within 8 s in the map-watch pass, intermittently).
    let (go, gate) = std::sync::mpsc::channel::<()>();
    let owner = std::thread::spawn(move || {
        gate.recv().expect("the test went away");
        change(a, LEN)
    });
    // The lookup below waits for the change, which waits for the stalled
    // reader: this thread (made now for the same reason) lets the reader
    // go once the lookup is seen waiting, instead of the stall running out
    // its 12 s (each of these tests took that long before 2026-11-29). A
    // lookup that does not wait fails the asserts below; the stall then
    // runs out.
    let (look, looking) = std::sync::mpsc::channel::<()>();
    let releaser = std::thread::spawn(move || {
        if looking.recv().is_err() {
            return sys::stall_release();
        }
        let monitor = UffdMonitor::global().expect("the monitor");
        let t0 = Instant::now();
        while monitor.counters().inflight_waits == waits_before && t0.elapsed() < Duration::from_secs(12) {
            std::thread::sleep(Duration::from_millis(1));
        }
        sys::stall_release();
    });
    // The reader thread is spawned with the monitor, now idle in poll(2).
    let reader = sys::thread_named("qs-uffd-monitor").expect("uffd reader thread");
    // Stalled longer than the wait below may take, so that the window
    // stays open on a loaded machine (the stall ends at its release).
    assert!(
        sys::stall_thread(reader, Duration::from_secs(12)),
        "reader stalled"
    );
    go.send(()).expect("the owner thread ended early");
    // As soon as the range is free, map new pages there (what mmap or
    // malloc in any thread may do), then look it up and transfer.
    let t0 = Instant::now();
    let b = loop {
        match sys::try_map_anon_at(a, LEN) {
            Ok(b) => break b,
            // Bounded well past what it takes (microseconds): the owner
            // thread may wait for a core under load (CI once saw more than
            // a second, with other test processes running).
            Err(_) if t0.elapsed() < Duration::from_secs(8) => std::thread::yield_now(),
            // Say whether the change is still running (held up before it
            // freed the range) or returned without freeing it (failed).
            Err(e) => {
                let waited = t0.elapsed();
                let change = owner.is_finished().then(|| owner.join());
                sys::dump_maps_near(a);
                panic!(
                    "range never freed within {waited:?}: {e}; the change: {change:?} (None: still running); \
                     the mappings near it are on stderr"
                )
            }
        }
    };
    sys::touch(b, LEN, FILL);
    let change_returned = owner.is_finished();
    look.send(()).expect("the releaser thread ended early");
    let outcome = rig.transfer(b, LEN).unwrap();
    sys::stall_release();
    releaser.join().unwrap();
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

fn wait_for(what: &str, max: Duration, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < max, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A lookup of a range whose `madvise(MADV_DONTNEED)` was read by the
/// monitor but whose advising thread has not run since (so the pages are
/// not dropped yet) waits for it, then for the settle time (the pages may
/// be dropped only after the advising thread ran), and only then pins and
/// caches the pages that stay: its transfer is clean, and so is a lookup
/// after `madvise` returned. (Before 2026-11-29 it pinned at once and
/// handed the registration out uncached, stale when the settle time ended.)
///
/// The advising thread is held off its CPU by a `SCHED_FIFO` thread pinned
/// to the same CPU (needs CAP_SYS_NICE and two CPUs).
#[test]
fn lookup_racing_madvise_dontneed_waits_for_the_discard_then_caches() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    common::require_io_uring();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        cpus >= 2,
        "this test needs two CPUs to starve one thread (found {cpus})"
    );
    let rig = Arc::new(Rig::new(MonitorChoice::Uffd));
    let monitor = UffdMonitor::global().unwrap();
    let a = primed_buffer(&rig);
    // Everything but the advising thread and the CPU hog runs on CPU 0.
    let reader = sys::thread_named("qs-uffd-monitor").expect("uffd reader thread");
    sys::pin_thread(reader, Some(0)).unwrap();
    sys::pin_thread(0, Some(0)).unwrap();
    let before = monitor.counters();
    assert!(
        sys::stall_thread(reader, Duration::from_secs(3)),
        "reader stalled"
    );

    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let adviser = std::thread::spawn(move || {
        sys::pin_thread(0, Some(1))?;
        tid_tx.send(sys::gettid()).ok();
        sys::advise(a, LEN, libc::MADV_DONTNEED)
    });
    let adviser_tid = tid_rx.recv().unwrap();
    // Asleep in the kernel until its REMOVE event is read (TASK_KILLABLE: 'D').
    wait_for(
        "the adviser to sleep on its event",
        Duration::from_secs(2),
        || sys::thread_state(adviser_tid) == Some('D'),
    );

    let hold = Arc::new(AtomicBool::new(true));
    let hogging = Arc::new(AtomicBool::new(false));
    let hog = {
        let (hold, hogging) = (Arc::clone(&hold), Arc::clone(&hogging));
        std::thread::spawn(move || -> io::Result<()> {
            sys::pin_thread(0, Some(1))?;
            sys::make_current_fifo()?;
            hogging.store(true, SeqCst);
            let t0 = Instant::now();
            while hold.load(SeqCst) && t0.elapsed() < Duration::from_secs(3) {
                std::hint::spin_loop();
            }
            Ok(())
        })
    };
    wait_for("the CPU hog", Duration::from_secs(2), || {
        hogging.load(SeqCst) || hog.is_finished()
    });
    if hog.is_finished() {
        sys::stall_release();
        let err = hog.join().unwrap().unwrap_err();
        panic!("cannot run a SCHED_FIFO thread ({err}): this test needs root or CAP_SYS_NICE");
    }
    // The reader reads REMOVE and wakes the adviser, which cannot run.
    sys::stall_release();
    wait_for("the REMOVE event to be read", Duration::from_secs(2), || {
        monitor.counters().remove > before.remove
    });
    let uncached_before = rig.cache.stats().uncached;
    let looked_up = Arc::new(AtomicBool::new(false));
    let looker = {
        let (rig, looked_up) = (Arc::clone(&rig), Arc::clone(&looked_up));
        std::thread::spawn(move || {
            // Racing a discard: it pins only once the discard is done.
            let r = rig.transfer(a, LEN);
            looked_up.store(true, SeqCst);
            r
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let waited = !looked_up.load(SeqCst);
    let adviser_ran = adviser.is_finished();
    hold.store(false, SeqCst);
    hog.join().unwrap().unwrap();
    adviser.join().unwrap().unwrap();
    let raced = looker.join().unwrap().unwrap();
    sys::pin_thread(0, None).unwrap();
    sys::pin_thread(reader, None).unwrap();

    let after_counters = monitor.counters();
    let stats = rig.cache.stats();
    eprintln!("madvise race: waited={waited} {raced:?} {stats} {after_counters:?}");
    assert!(!adviser_ran, "the adviser was held off its CPU");
    assert!(waited, "the lookup waited while the adviser had not run");
    assert!(after_counters.inflight_waits > before.inflight_waits);
    assert!(
        after_counters.settle_waits > before.settle_waits,
        "the lookup then waited for the settle time"
    );
    assert_eq!(
        stats.uncached, uncached_before,
        "the registration made once the discard was done is cached"
    );
    assert_eq!(raced, Outcome::CLEAN, "and pins the pages that stay");
    // madvise returned: new pages (the racing transfer may have filled
    // them); fill them and transfer.
    sys::touch(a, LEN, FILL);
    let outcome = rig.transfer(a, LEN).unwrap();
    assert_eq!(
        outcome,
        Outcome::CLEAN,
        "stale registration after madvise returned"
    );
    sys::unmap(a, LEN).unwrap();
}

/// A range stays settling for `REMOVE_SETTLE` after its REMOVE event: a
/// miss inside it waits for the settle time to end, then pins the pages
/// that stay and caches them; the registration stays valid after the
/// settle time, and later lookups hit it. The settle time starts at the
/// miss's own probe (the first after the event was read), after `madvise`
/// returned, so the miss returns at least `REMOVE_SETTLE` after it.
/// (Before 2026-11-29 the miss was handed out uncached at once and went
/// stale when the settle time ended: `tests/settle.rs`.)
#[test]
fn range_settles_after_madvise() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    common::require_io_uring();
    let rig = Rig::new(MonitorChoice::Uffd);
    let monitor = UffdMonitor::global().unwrap();
    let a = primed_buffer(&rig);
    sys::advise(a, LEN, libc::MADV_DONTNEED).unwrap();
    let advised = Instant::now();
    sys::touch(a, LEN, FILL);
    let s0 = rig.cache.stats();
    let waits = monitor.counters().settle_waits;
    assert_eq!(rig.transfer(a, LEN).unwrap(), Outcome::CLEAN);
    let returned_after = advised.elapsed();
    let s1 = rig.cache.stats();
    let kept = rig.cache.get(a, LEN, Access::LOCAL_WRITE).unwrap();
    std::thread::sleep(REMOVE_SETTLE);
    assert_eq!(rig.transfer(a, LEN).unwrap(), Outcome::CLEAN);
    let s2 = rig.cache.stats();
    eprintln!("settle: {s0} -> {s1} -> {s2}, the miss returned after {returned_after:?}");
    assert!(
        returned_after >= REMOVE_SETTLE,
        "the miss right after madvise waited for the settle time"
    );
    assert_eq!(monitor.counters().settle_waits, waits + 1, "one wait");
    assert_eq!(
        (s1.misses, s1.uncached),
        (s0.misses + 1, s0.uncached),
        "the miss was cached"
    );
    assert!(kept.is_cached() && kept.is_valid(), "valid after the settle time");
    assert_eq!((s2.hits, s2.misses), (s1.hits + 2, s1.misses), "and then hit");
    drop(kept);
    sys::unmap(a, LEN).unwrap();
}

/// With the map watch (perf side-band records), an in-flight lookup makes
/// its system call only when something was mapped since the last quiet
/// probe: hits of a steady working set make none, and the first lookup
/// after a new mapping probes again.
#[test]
fn hits_probe_only_after_something_was_mapped() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    common::require_io_uring();
    let rig = Rig::new(MonitorChoice::Uffd);
    let monitor = UffdMonitor::global().unwrap();
    let a = primed_buffer(&rig);
    let lookups = || {
        for _ in 0..1000 {
            drop(rig.cache.get(a, LEN, Access::LOCAL_WRITE).expect("hit"));
        }
    };
    if !na_regcache::CacheConfig::from_env().unwrap().map_watch {
        // Turned off: every lookup makes its system call.
        let before = monitor.counters().probes;
        lookups();
        assert!(monitor.counters().probes - before >= 1000);
        assert!(monitor.map_watch_rings().is_none());
        return;
    }
    if monitor.map_watch_rings().is_none() {
        let paranoid = std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid").unwrap_or_default();
        panic!(
            "perf side-band events refused (kernel.perf_event_paranoid={}; needs <= 2): \
             every in-flight lookup probes, nothing to test here",
            paranoid.trim()
        );
    }
    lookups();
    let before = monitor.counters().probes;
    lookups();
    let steady = monitor.counters().probes - before;
    // Other threads of this process (the harness) may map a little meanwhile.
    assert!(
        steady <= 5,
        "{steady} probes for 1000 hits of an unchanged address space"
    );
    let fresh = sys::map_anon(None, PAGE).unwrap();
    let before = monitor.counters().probes;
    drop(rig.cache.get(a, LEN, Access::LOCAL_WRITE).expect("hit"));
    assert!(
        monitor.counters().probes > before,
        "the first lookup after an mmap probed"
    );
    sys::unmap(fresh, PAGE).unwrap();
    sys::unmap(a, LEN).unwrap();
}

/// A forked child that builds its own cache gets its own monitor (the
/// parent's has no reader thread in the child and its perf rings are not
/// copied), which sees the child's unmaps: an address reused in the child
/// is never served from a stale registration.
#[test]
fn forked_child_gets_its_own_monitor() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    common::require_io_uring();
    let rig = Rig::new(MonitorChoice::Uffd);
    let a = primed_buffer(&rig);
    let parent_monitor = Arc::as_ptr(&UffdMonitor::global().unwrap()) as usize;
    let code = sys::fork_run(|| {
        let child = Rig::new(MonitorChoice::Uffd);
        let m = UffdMonitor::global().unwrap();
        if Arc::as_ptr(&m) as usize == parent_monitor {
            return 3;
        }
        // Its monitor's reader thread may map its signal stack any time.
        let b = secluded_buffer(&child);
        if sys::unmap(b, LEN).is_err() || sys::map_anon(Some(b), LEN).is_err() {
            return 4;
        }
        sys::touch(b, LEN, FILL);
        match child.transfer(b, LEN) {
            Ok(o) if o == Outcome::CLEAN && m.counters().unmap >= 1 => 0,
            Ok(_) => 1,
            Err(_) => 2,
        }
    })
    .unwrap();
    assert_eq!(
        code, 0,
        "child: 1 = stale registration, 2 = transfer failed, 3 = parent's monitor reused, 4 = remap failed"
    );
    assert_eq!(
        rig.transfer(a, LEN).unwrap(),
        Outcome::CLEAN,
        "the parent's cache still works"
    );
    sys::unmap(a, LEN).unwrap();
}

fn mapped(a: usize) -> bool {
    sys::page_mapped(a)
}

/// An address freed by an `munmap` still in flight (its event unread) gets
/// new pages through `mremap`, which the kernel records in no perf
/// side-band record (glibc's `realloc` of a large block does this): a
/// lookup of it must not find the old registration. With the map watch on
/// (opt-in), the lookup would skip its probe and hand out the old pages.
#[test]
fn an_address_freed_in_flight_and_mremapped_is_never_served_stale() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    common::require_io_uring();
    assert!(
        !na_regcache::CacheConfig::from_env().unwrap().map_watch,
        "QS_MR_CACHE_MAP_WATCH=on opts into skipping the probe, which cannot see mremap \
         (documented): this test checks the default; run it without the variable \
         (scripts/test-all.sh skips it by name in its map-watch pass)"
    );
    let rig = Rig::new(MonitorChoice::Uffd);
    // Where no other thread's mapping lands once the unmap freed it (the
    // `mremap` below replaces whatever is there).
    let a = secluded_buffer(&rig);
    let y = sys::map_anon(None, LEN).unwrap();
    sys::touch(y, LEN, 0x11);
    let reader = sys::thread_named("qs-uffd-monitor").expect("the monitor's reader thread");
    let go = Arc::new(std::sync::Barrier::new(2));
    let g2 = Arc::clone(&go);
    let owner = std::thread::spawn(move || {
        g2.wait();
        g2.wait();
        sys::unmap(a, LEN)
    });
    go.wait(); // the owner thread is up (its start-up mapped what it maps)
               // Lookups that probe quietly at the current state.
    drop(rig.cache.get(a, LEN, Access::LOCAL_WRITE).unwrap());
    drop(rig.cache.get(a, LEN, Access::LOCAL_WRITE).unwrap());
    assert!(sys::stall_thread(reader, Duration::from_secs(3)));
    go.wait();
    let t0 = Instant::now();
    while mapped(a) {
        assert!(t0.elapsed() < Duration::from_secs(1), "the unmap never happened");
        std::hint::spin_loop();
    }
    // Moves our own mapping y onto the freed range a.
    let p = sys::mremap_fixed(y, LEN, a);
    assert_eq!(p as usize, a);
    let h = rig.cache.get(a, LEN, Access::LOCAL_WRITE).unwrap();
    let stale = rig.cache.registrar().stale_pages(h.region(), a, LEN).unwrap();
    drop(h);
    sys::stall_release();
    owner.join().unwrap().unwrap();
    assert_eq!(
        stale, 0,
        "a registration of the unmapped pages was handed out for mremapped memory"
    );
    sys::unmap(a, LEN).unwrap();
}
