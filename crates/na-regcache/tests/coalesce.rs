//! Concurrent misses of one range, coalesced (`cache::coalesce`): the
//! first miss registers, the others wait for it and take it as a hit;
//! when it fails, is handed out uncached or is invalidated before they
//! look again, they register on their own, and when it knows before its
//! registration ends that it will not be cached, they do not wait for
//! it; when it registers again with another span, that span is the one
//! waited for. Ordered deterministically: a registrar that holds the
//! thread named `first` inside each of its registrations until the test
//! lets it go, the cache's counters (a wait is counted before the waiter
//! parks), and a monitor gate that holds the `waiter` threads' monitor
//! sync after they woke. Everything else is real: the process's
//! userfaultfd monitor, io_uring pins, real mappings. The rig's caches
//! bound a wait by `gated::WAIT_BOUND` (longer than the test's own
//! patience), so that no wait the test ends runs out first on a loaded
//! machine; a miss that waits for what it must not (a deregistration, a
//! registration that will not be cached) fails its test by that patience
//! (30 s: "never returned") instead.

mod common;

use std::sync::mpsc::TryRecvError;
use std::time::Duration;

use common::gated::{returned, Rig, LEN, W};
use common::sys::{self, PAGE};
use na_regcache::{Access, Monitor, COALESCE_WAIT};

/// Four threads miss one range at once: the first registers it, the
/// three others wait and take it as a hit. (Before 2026-11-29 each
/// registered it: four registrations, each superseding the last.)
#[test]
fn concurrent_misses_of_one_range_register_it_once() {
    let rig = Rig::new(16);
    let first = rig.first_held();
    let waiters: Vec<_> = (0..3).map(|_| rig.get_on("waiter", W)).collect();
    rig.until_waiting(3);
    rig.registrar_gate().set_hold(false);
    let mut all = vec![first.join().expect("first").expect("first get")];
    for w in waiters {
        all.push(w.join().expect("waiter").expect("waiter get"));
    }
    let s = rig.c.stats();
    assert_eq!(rig.made(), 1, "four misses of one range registered it once");
    assert_eq!((s.misses, s.hits, s.coalesced, s.coalesce_timeouts), (1, 3, 3, 0));
    for reg in &all {
        assert!(reg.is_cached() && reg.is_valid_now());
        assert_eq!((reg.addr(), reg.len()), (rig.a, LEN));
        assert_eq!(rig.stale(reg), 0, "pins the current pages");
    }
    assert_eq!(s.entries, 1);
}

/// The first miss's registration is cached and supersedes an idle
/// neighbour: its waiter takes it as a hit once it is in the index, not
/// after the first deregistered the neighbour (held here). (Before
/// 2026-11-29 the first took its span back only when its call ended:
/// here the waiter waited out `COALESCE_WAIT`.)
#[test]
fn a_waiter_does_not_wait_for_the_deregistrations_of_the_first() {
    let rig = Rig::sized(16, 2 * LEN);
    let (a, n) = (rig.a, rig.a + LEN - PAGE);
    let union = n + LEN - a;
    drop(rig.c.get(n, LEN, W).expect("the neighbour, idle"));
    rig.c.registrar().dereg.set_hold(true);
    let first = rig.first_held();
    let waiter = rig.get_sent("waiter", a, LEN);
    rig.until_waiting(1);
    rig.registrar_gate().set_hold(false);
    let two = returned(&waiter, "the waiter").expect("waiter get");
    let s = rig.c.stats();
    assert_eq!((s.coalesce_waits, s.coalesced, s.coalesce_timeouts), (1, 1, 0));
    rig.c.registrar().dereg.set_hold(false);
    let one = first.join().expect("first").expect("first get");
    assert_eq!(rig.made(), 2, "the neighbour, the union");
    for reg in [&one, &two] {
        assert!(reg.is_cached() && reg.is_valid_now());
        assert_eq!((reg.addr(), reg.len()), (a, union));
        assert_eq!(rig.stale(reg), 0, "pins the current pages");
    }
}

/// The first miss fails: the waiter, woken at once, registers on its own
/// and gets what its own registration gives, a handle or its error.
#[test]
fn a_waiter_registers_on_its_own_when_the_first_fails() {
    for waiter_fails in [false, true] {
        let rig = Rig::new(16);
        {
            let mut st = rig.registrar_gate().state();
            st.failing.push(("first", 0));
            if waiter_fails {
                st.failing.push(("waiter", 0));
            }
        }
        let first = rig.first_held();
        let waiter = rig.get_on("waiter", W);
        rig.until_waiting(1);
        rig.registrar_gate().set_hold(false);
        let one = first.join().expect("first");
        assert!(
            matches!(one, Err(na_regcache::Error::Register { .. })),
            "the first failed"
        );
        let two = waiter.join().expect("waiter");
        let s = rig.c.stats();
        assert_eq!(rig.made(), 2, "the waiter registered on its own");
        assert_eq!((s.coalesce_waits, s.coalesced), (1, 0));
        assert_eq!(s.coalesce_timeouts, 0, "woken by the failure, not by the bound");
        match two {
            Ok(reg) => {
                assert!(!waiter_fails);
                assert!(reg.is_cached() && reg.is_valid_now());
                assert_eq!(rig.stale(&reg), 0);
            }
            Err(e) => assert!(
                waiter_fails && matches!(e, na_regcache::Error::Register { .. }),
                "{e}"
            ),
        }
    }
}

/// The first miss's registration is handed out uncached: the cache had
/// room when it claimed its tracking slot, but an entry in use filled it
/// while it registered. Its waiter, which waited for it, registers on
/// its own (the price of a wait that does not pay).
#[test]
fn a_waiter_registers_on_its_own_when_the_first_is_uncached() {
    let rig = Rig::new(1);
    let other = sys::map_anon(None, LEN).expect("mmap");
    sys::touch(other, LEN, 0x33);
    let first = rig.first_held();
    let held = rig.c.get(other, LEN, W).expect("fills the cache");
    assert!(held.is_cached());
    let waiter = rig.get_on("waiter", W);
    rig.until_waiting(1);
    rig.registrar_gate().set_hold(false);
    let one = first.join().expect("first").expect("first get");
    let two = waiter.join().expect("waiter").expect("waiter get");
    let s = rig.c.stats();
    assert_eq!(rig.made(), 3, "the waiter registered on its own");
    assert_eq!((s.coalesce_waits, s.coalesced, s.coalesce_timeouts), (1, 0, 0));
    for reg in [&one, &two] {
        assert!(!reg.is_cached() && reg.is_valid_now());
        assert_eq!(rig.stale(reg), 0);
    }
    drop((one, two, held));
    sys::unmap(other, LEN).expect("munmap");
}

/// The cache is full of an entry in use when the first miss claims its
/// tracking slot: its registration will be handed out uncached, so it
/// takes its span back before it registers, and a second miss of the
/// range registers at once, while the first is still registering.
/// (Before 2026-11-29 the second waited for the first's registration,
/// then made its own: here it waited out `COALESCE_WAIT`.)
#[test]
fn a_miss_does_not_wait_for_a_first_that_will_not_be_cached() {
    let rig = Rig::new(1);
    let other = sys::map_anon(None, LEN).expect("mmap");
    sys::touch(other, LEN, 0x33);
    let held = rig.c.get(other, LEN, W).expect("fills the cache");
    assert!(held.is_cached());
    let first = rig.first_held();
    let second = rig.get_sent("waiter", rig.a, LEN);
    let two = returned(&second, "the second miss").expect("second get");
    let s = rig.c.stats();
    assert_eq!(
        (s.coalesce_waits, s.coalesce_timeouts),
        (0, 0),
        "the second did not wait for the first"
    );
    assert_eq!(rig.made(), 3, "the second registered while the first was held");
    rig.registrar_gate().set_hold(false);
    let one = first.join().expect("first").expect("first get");
    for reg in [&one, &two] {
        assert!(!reg.is_cached() && reg.is_valid_now());
        assert_eq!(rig.stale(reg), 0);
    }
    drop((one, two, held));
    sys::unmap(other, LEN).expect("munmap");
}

/// The first miss's span is merged with a cached neighbour, and its
/// registration fails (the test's registrar refuses the first's
/// registrations larger than the request): it takes its span back before
/// it registers the request alone, so a second miss of the request
/// registers at once (the merged span, which it may register), while the
/// first is still registering. (Before 2026-11-29 the second waited for
/// the first's second registration as well: here it waited out
/// `COALESCE_WAIT`.)
#[test]
fn a_miss_does_not_wait_for_a_first_whose_merged_span_failed() {
    let rig = Rig::sized(16, 2 * LEN);
    let (a, n) = (rig.a, rig.a + LEN - PAGE);
    // In use, so the first's failed registration evicts nothing and is
    // not retried (the registrar's retry after an eviction).
    let neighbour = rig.c.get(n, LEN, W).expect("the neighbour");
    rig.registrar_gate().state().failing.push(("first", LEN));
    let first = rig.first_held();
    // Past the merged span's registration (it fails) to the request's.
    rig.registrar_gate().let_one();
    rig.registrar_gate()
        .until_parked("the first's registration of the request alone");
    let second = rig.get_sent("waiter", a, LEN);
    let two = returned(&second, "the second miss").expect("second get");
    let s = rig.c.stats();
    assert_eq!(
        (s.coalesce_waits, s.coalesce_timeouts),
        (0, 0),
        "the second did not wait for the first"
    );
    assert!(two.is_cached() && two.is_valid_now());
    assert_eq!((two.addr(), two.len()), (a, n + LEN - a), "the merged span");
    rig.registrar_gate().set_hold(false);
    let one = first.join().expect("first").expect("first get");
    assert!(!one.is_cached() && one.is_valid_now());
    assert_eq!((one.addr(), one.len()), (a, LEN), "the request alone");
    assert_eq!(rig.made(), 4, "the neighbour, the first's two, the second's one");
    for reg in [&one, &two] {
        assert_eq!(rig.stale(reg), 0);
    }
    drop((one, two, neighbour));
}

/// The first miss registers again after its pages were replaced, and by
/// then a neighbour was cached: it registers the union now, and a miss
/// of that union, which the first's original span does not cover, waits
/// for it and takes it as a hit. (Before 2026-11-29 the published span
/// stayed the original one: the second registered the union too.)
#[test]
fn a_miss_waits_for_the_span_a_retried_first_registers() {
    let rig = Rig::sized(16, 2 * LEN);
    let (a, n) = (rig.a, rig.a + LEN - PAGE);
    let union = n + LEN - a;
    let first = rig.first_held();
    // Pinned by the first's registration, then replaced: it registers again.
    sys::map_anon_overlay(a, LEN).expect("MAP_FIXED");
    sys::touch(a, LEN, 0x22);
    rig.monitor.inner.sync();
    let neighbour = rig.c.get(n, LEN, W).expect("the neighbour");
    assert!(neighbour.is_cached());
    rig.registrar_gate().let_one();
    rig.registrar_gate()
        .until_parked("the first's second registration");
    let waiter = rig.get_range_on("waiter", a, union, W);
    rig.until_waiting(1);
    rig.registrar_gate().set_hold(false);
    let one = first.join().expect("first").expect("first get");
    let two = waiter.join().expect("waiter").expect("waiter get");
    let s = rig.c.stats();
    assert_eq!(rig.made(), 3, "the first's two registrations and the neighbour's");
    assert_eq!((s.coalesce_waits, s.coalesced, s.coalesce_timeouts), (1, 1, 0));
    for reg in [&one, &two] {
        assert!(reg.is_cached() && reg.is_valid_now());
        assert_eq!((reg.addr(), reg.len()), (a, union), "the union");
        assert_eq!(rig.stale(reg), 0, "pins the current pages");
    }
    drop((one, two, neighbour));
}

/// The first miss's span is merged with a cached neighbour, and a second
/// miss its span covers (but not its request) waits for it. The
/// neighbour's pages are replaced: the first registers its request alone
/// now, which does not cover the second's, so the second stops waiting
/// and registers at once, while the first is still registering. (Before
/// 2026-11-29 it waited for the first's new registration, then made its
/// own: here it waited out `COALESCE_WAIT`.) The two entries only
/// overlap, and both stay cached.
#[test]
fn a_waiter_the_retried_span_no_longer_covers_registers_at_once() {
    let rig = Rig::sized(16, 2 * LEN);
    let (a, n) = (rig.a, rig.a + LEN - PAGE);
    drop(rig.c.get(n, LEN, W).expect("the neighbour, idle"));
    let first = rig.first_held();
    // Covered by the first's span (its request and the neighbour), by
    // neither of them alone.
    let second = rig.get_sent("waiter", a + PAGE, n + LEN - a - PAGE);
    rig.until_waiting(1);
    // The neighbour's pages past the first's request, replaced.
    sys::map_anon_overlay(a + LEN, n - a).expect("MAP_FIXED");
    sys::touch(a + LEN, n - a, 0x22);
    rig.monitor.inner.sync();
    rig.registrar_gate().let_one();
    let two = returned(&second, "the second miss").expect("second get");
    let s = rig.c.stats();
    assert_eq!(
        (s.coalesce_waits, s.coalesced, s.coalesce_timeouts),
        (1, 0, 0),
        "woken by the first's new span, not by the bound"
    );
    assert!(two.is_valid_now());
    assert_eq!((two.addr(), two.len()), (a + PAGE, n + LEN - a - PAGE));
    rig.registrar_gate().set_hold(false);
    let one = first.join().expect("first").expect("first get");
    assert!(one.is_cached() && one.is_valid_now());
    assert_eq!((one.addr(), one.len()), (a, LEN), "the request alone");
    assert_eq!(rig.made(), 4, "the neighbour, the first's two, the second's one");
    for reg in [&one, &two] {
        assert_eq!(rig.stale(reg), 0, "pins the current pages");
    }
    // The two entries only overlap: both stay cached, and each range is
    // a hit. (Before 2026-11-29, later the same day, the first's
    // insertion superseded the second's entry, and a lookup of its range
    // registered a fifth time.)
    assert!(two.is_cached(), "only overlapped by the first's entry: kept");
    assert_eq!(rig.c.stats().entries, 2);
    drop((one, two));
    for (addr, len) in [(a, LEN), (a + PAGE, n + LEN - a - PAGE)] {
        let again = rig.c.get(addr, len, W).expect("each range again");
        assert_eq!((again.addr(), again.len()), (addr, len), "its own entry");
    }
    assert_eq!(rig.made(), 4, "two hits: no fifth registration");
}

/// The first miss's registration is cached, but the buffer's pages are
/// replaced after the waiter woke and before it looked again (its
/// monitor sync held): the waiter does not get the stale entry, it
/// registers the current pages.
#[test]
fn a_waiter_never_gets_an_entry_invalidated_before_it_looks() {
    let rig = Rig::new(16);
    let first = rig.first_held();
    let waiter = rig.get_on("waiter", W);
    rig.until_waiting(1);
    // The waiter's next monitor sync (when it looks again) parks.
    rig.monitor.gate.set_hold(true);
    rig.registrar_gate().set_hold(false);
    let one = first.join().expect("first").expect("first get");
    assert!(one.is_cached());
    rig.monitor.gate.until_parked("the waiter's sync");
    // New pages at the same address: the cached entry is invalidated.
    sys::map_anon_overlay(rig.a, LEN).expect("MAP_FIXED");
    sys::touch(rig.a, LEN, 0x22);
    assert!(!one.is_valid_now(), "the monitor applied the unmap");
    rig.monitor.gate.set_hold(false);
    let two = waiter.join().expect("waiter").expect("waiter get");
    let s = rig.c.stats();
    assert_eq!(rig.made(), 2, "the waiter registered the new pages");
    assert_eq!((s.coalesce_waits, s.coalesced), (1, 0));
    assert!(two.is_valid_now(), "not the invalidated entry");
    assert_eq!(rig.stale(&two), 0, "pins the current pages");
}

/// A miss whose range changed while it registered (its pages replaced)
/// looks up again before registering again: another thread cached the
/// range meanwhile (with wider rights, so it did not wait for the first),
/// and the first takes that entry as a hit. (Before 2026-11-29 it only
/// noted its span again and registered once more.)
#[test]
fn a_miss_retried_after_a_change_takes_an_entry_cached_meanwhile() {
    let rig = Rig::new(16);
    let first = rig.first_held();
    // Pinned by the first's registration, then replaced.
    sys::map_anon_overlay(rig.a, LEN).expect("MAP_FIXED");
    sys::touch(rig.a, LEN, 0x22);
    let wide = W | Access::REMOTE_READ;
    let other = rig.c.get(rig.a, LEN, wide).expect("another thread's get");
    assert!(other.is_cached());
    rig.registrar_gate().set_hold(false);
    let one = first.join().expect("first").expect("first get");
    assert_eq!(rig.made(), 2, "the retried miss took the entry cached meanwhile");
    assert!(one.is_cached() && one.is_valid_now());
    assert_eq!((one.addr(), one.len(), one.access()), (rig.a, LEN, wide));
    assert_eq!(rig.stale(&one), 0, "pins the current pages");
    assert_eq!(rig.c.stats().hits, 1);
}

/// A range the monitor refuses (shared memory: never cached) is not
/// waited for: the first miss withdraws its span once refused, so a
/// second miss registers at once, while the first is still registering.
#[test]
fn misses_of_a_range_never_cached_do_not_wait_for_each_other() {
    let fd = sys::memfd(LEN).expect("memfd");
    let rig = Rig::over(16, sys::map_shared_fd(None, LEN, &fd).expect("mmap"), LEN);
    let first = rig.first_held();
    let two = rig
        .get_on("waiter", W)
        .join()
        .expect("waiter")
        .expect("waiter get");
    assert!(!two.is_cached());
    let s = rig.c.stats();
    assert_eq!(
        (s.coalesce_waits, s.coalesce_timeouts),
        (0, 0),
        "did not wait for the first"
    );
    rig.registrar_gate().set_hold(false);
    let one = first.join().expect("first").expect("first get");
    assert!(!one.is_cached());
    assert_eq!(rig.made(), 2);
}

/// A wait's bound is the cache's (`Cache::set_coalesce_wait`). With the
/// rig's (`gated::WAIT_BOUND`), a waiter whose first is held past the
/// default `COALESCE_WAIT` is still waiting, and takes the first's entry
/// once it is let go: what keeps the other tests' waits from running out
/// on a loaded machine. (Negative control, the setting ignored: the
/// waiter ran out its 5 s and registered on its own while the first was
/// held.) With a bound of zero, a miss that would wait registers at
/// once, while the first is held (counted as a wait that ran out).
#[test]
fn a_wait_is_bounded_by_the_caches_setting() {
    let rig = Rig::new(16);
    let first = rig.first_held();
    let waiter = rig.get_sent("waiter", rig.a, LEN);
    rig.until_waiting(1);
    std::thread::sleep(COALESCE_WAIT + Duration::from_secs(1));
    assert!(
        matches!(waiter.try_recv(), Err(TryRecvError::Empty)),
        "still waiting past the default bound"
    );
    let s = rig.c.stats();
    assert_eq!((s.coalesce_waits, s.coalesce_timeouts), (1, 0));
    assert_eq!(rig.made(), 1, "only the first registered");
    rig.registrar_gate().set_hold(false);
    let two = returned(&waiter, "the waiter").expect("waiter get");
    let one = first.join().expect("first").expect("first get");
    let s = rig.c.stats();
    assert_eq!((s.coalesced, s.coalesce_timeouts), (1, 0));
    assert_eq!(rig.made(), 1, "the waiter took the first's entry");
    assert!(one.is_cached() && two.is_cached());
    drop((one, two));

    let rig = Rig::new(16);
    rig.c.set_coalesce_wait(Duration::ZERO);
    let first = rig.first_held();
    let second = rig.get_sent("waiter", rig.a, LEN);
    let two = returned(&second, "the second miss").expect("second get");
    let s = rig.c.stats();
    assert_eq!((s.coalesce_waits, s.coalesce_timeouts), (1, 1));
    assert_eq!(rig.made(), 2, "the second registered while the first was held");
    rig.registrar_gate().set_hold(false);
    let one = first.join().expect("first").expect("first get");
    assert!(one.is_valid_now() && two.is_valid_now());
}
