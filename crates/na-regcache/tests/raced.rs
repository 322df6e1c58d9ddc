//! A miss that, about to insert its registration, finds an entry another
//! thread cached meanwhile covering its request (`Miss::raced_hit` in
//! `cache/miss.rs`): it takes that entry as a hit and throws its own
//! registration away, rather than superseding a wider entry with a
//! narrower one; an entry lacking the request's rights, invalidated
//! meanwhile, reported changed by the monitor, or inside the miss's own
//! span (the mirror case) is not taken (the miss inserts its own). Ordered like
//! `tests/coalesce.rs` (the same rig: a registrar holding the thread
//! named `first` inside its registrations, the cache's counters), with
//! the process's userfaultfd monitor, io_uring pins and real mappings.

mod common;

use std::thread::JoinHandle;

use common::gated::{returned, Gated, Rig, LEN, W};
use common::sys::{self, PAGE};
use na_regcache::{Access, Monitor, Registration, Result};

/// The first miss, held in its second registration.
type First = JoinHandle<Result<Registration<Gated>>>;

/// The scenario two tests share: a buffer of `2 * LEN` bytes, an idle
/// neighbour entry `[n, n + LEN)` (`n = a + LEN - PAGE`), the first miss
/// (of `[a, a + LEN)`) held in the registration of its span merged with
/// the neighbour, and a waiter for the whole span `[a, n + LEN)`, which
/// that span covers. The neighbour's pages past the first's request are
/// then replaced: the first registers again, its request alone, held
/// again, and the waiter, no longer covered, registers the whole span on
/// its own and caches it. Returns the first (still held), the waiter's
/// handle and `n`.
fn wider_cached_meanwhile(rig: &Rig) -> (First, Registration<Gated>, usize) {
    let (a, n) = (rig.a, rig.a + LEN - PAGE);
    drop(rig.c.get(n, LEN, W).expect("the neighbour, idle"));
    let first = rig.first_held();
    let second = rig.get_sent("waiter", a, n + LEN - a);
    rig.until_waiting(1);
    sys::map_anon_overlay(a + LEN, n - a).expect("MAP_FIXED");
    sys::touch(a + LEN, n - a, 0x22);
    rig.monitor.inner.sync();
    rig.registrar_gate().let_one();
    let two = returned(&second, "the waiter").expect("waiter get");
    assert!(two.is_cached() && two.is_valid_now());
    assert_eq!((two.addr(), two.len()), (a, n + LEN - a));
    let s = rig.c.stats();
    assert_eq!((s.coalesce_waits, s.coalesced, s.raced_hits), (1, 0, 0));
    (first, two, n)
}

/// The first miss's request is covered by the wider entry the waiter
/// cached while the first registered its request again: the first takes
/// that entry as a hit and drops its own registration, so a later lookup
/// of the wider range hits. (Before, the first's narrow entry superseded
/// the wider one: that lookup missed and registered a fifth time.)
#[test]
fn a_miss_takes_a_wider_entry_cached_while_it_registered() {
    let rig = Rig::sized(16, 2 * LEN);
    let (first, two, n) = wider_cached_meanwhile(&rig);
    let a = rig.a;
    rig.registrar_gate().set_hold(false);
    let one = first.join().expect("first").expect("first get");
    assert_eq!(
        (one.addr(), one.len()),
        (a, n + LEN - a),
        "the waiter's wider entry, not the first's own registration"
    );
    assert!(one.is_cached() && one.is_valid_now() && two.is_cached());
    assert_eq!(rig.made(), 4, "the neighbour, the first's two, the waiter's one");
    let s = rig.c.stats();
    assert_eq!((s.raced_hits, s.hits, s.entries), (1, 1, 1));
    assert_eq!(s.in_use, 1, "one entry, held by both handles");
    drop((one, two));
    let again = rig.c.get(a, n + LEN - a, W).expect("the wider range again");
    assert!(again.is_cached());
    assert_eq!(rig.made(), 4, "a hit: no fifth registration");
    assert_eq!(rig.c.stats().hits, 2);
    assert_eq!(rig.stale(&again), 0, "pins the current pages");
    drop(again);
    assert_eq!(rig.c.stats().in_use, 0, "every handle released");
}

/// The wider entry is invalidated (pages replaced past the first's
/// request) before the first inserts: it is out of the index, and the
/// first caches its own registration, which pins the current pages.
#[test]
fn a_miss_does_not_take_an_entry_invalidated_meanwhile() {
    let rig = Rig::sized(16, 2 * LEN);
    let (first, two, n) = wider_cached_meanwhile(&rig);
    let a = rig.a;
    sys::map_anon_overlay(a + LEN, n - a).expect("MAP_FIXED");
    sys::touch(a + LEN, n - a, 0x33);
    rig.monitor.inner.sync();
    assert!(!two.is_valid_now(), "the monitor applied the unmap");
    rig.registrar_gate().set_hold(false);
    let one = first.join().expect("first").expect("first get");
    assert_eq!((one.addr(), one.len()), (a, LEN), "its own registration");
    assert!(one.is_cached() && one.is_valid_now());
    assert_eq!(rig.made(), 4);
    assert_eq!(rig.c.stats().raced_hits, 0);
    assert_eq!(rig.stale(&one), 0, "pins the current pages");
}

/// An entry cached meanwhile covers the first's range but only for local
/// reads: the first, which asked for local writes, does not take it; its
/// own registration supersedes it, and a later write request hits.
#[test]
fn a_miss_does_not_take_an_entry_lacking_its_rights() {
    let rig = Rig::sized(16, 2 * LEN);
    let first = rig.first_held();
    // Not covered by the first's span (wider), so it does not wait.
    let read = rig
        .c
        .get(rig.a, 2 * LEN, Access::LOCAL_READ)
        .expect("a read-only entry");
    assert!(read.is_cached());
    assert!(!read.access().contains(W));
    rig.registrar_gate().set_hold(false);
    let one = first.join().expect("first").expect("first get");
    assert!(one.access().contains(W), "write access, as asked");
    assert_eq!((one.addr(), one.len()), (rig.a, LEN), "its own registration");
    assert!(one.is_cached() && !read.is_cached(), "superseded, as before");
    let s = rig.c.stats();
    assert_eq!((s.raced_hits, s.hits, s.misses), (0, 0, 2));
    let again = rig.c.get(rig.a, LEN, W).expect("a write request again");
    assert!(again.is_cached() && again.access().contains(W));
    assert_eq!(rig.made(), 2, "a hit");
}

/// The wider entry the waiter cached is reported changed by the monitor
/// when the first, held in its second registration, is about to insert
/// (as a kdreg2-style monitor reports a mapping changed while the events
/// saying so are not applied: the entry is still in the index). The
/// first does not take it, whose pages may be gone: it caches its own
/// registration, which supersedes it (`Monitor::changed` in
/// `Miss::raced_hit`; a lookup makes the same check before a hit).
#[test]
fn a_miss_does_not_take_an_entry_its_monitor_reports_changed() {
    let rig = Rig::sized(16, 2 * LEN);
    let (first, two, n) = wider_cached_meanwhile(&rig);
    let a = rig.a;
    rig.monitor.report_changed(Some((a, n + LEN)));
    rig.registrar_gate().set_hold(false);
    let one = first.join().expect("first").expect("first get");
    rig.monitor.report_changed(None);
    assert_eq!(
        (one.addr(), one.len()),
        (a, LEN),
        "its own registration, not the entry reported changed"
    );
    assert!(one.is_cached() && one.is_valid_now());
    assert!(!two.is_cached(), "superseded by the first's entry");
    let s = rig.c.stats();
    assert_eq!((s.raced_hits, s.hits, s.entries), (0, 0, 1));
    assert_eq!(rig.made(), 4, "the neighbour, the first's two, the waiter's one");
    assert_eq!(rig.stale(&one), 0, "pins the current pages");
}

/// The mirror case: the entry another thread cached while the first
/// registered covers the first's request but lies inside the first's
/// span (its request merged with an entry it overlaps), with no rights
/// the span lacks. The first does not take it: its own wider
/// registration supersedes it, losing nothing, and a lookup of the
/// merged neighbour's range hits. (Taken, the narrower entry would stay
/// cached and that lookup would register again.)
///
/// Order: the first misses `[a, a + LEN)` with nothing cached (its span
/// is its request) and is held in its registration; `second` misses
/// `[a, a + LEN + PAGE)`, which that span does not cover (no wait), and
/// is held in its registration too; a neighbour `[a + LEN - PAGE,
/// a + 2 LEN)` is cached; the first's pin is found settling, so it looks
/// again and registers its request merged with the neighbour,
/// `[a, a + 2 LEN)`, held again; `second` inserts its entry (superseding
/// the neighbour), which covers the first's request; then the first
/// inserts.
#[test]
fn a_miss_does_not_take_an_entry_its_span_covers() {
    let rig = Rig::sized(16, 2 * LEN);
    let a = rig.a;
    let gate = rig.registrar_gate();
    let first = rig.first_held();
    let second = rig.get_sent("second", a, LEN + PAGE);
    gate.until_arrived(2, "the second's registration");
    let nb = a + LEN - PAGE;
    drop(rig.c.get(nb, LEN + PAGE, W).expect("the neighbour, idle"));
    rig.monitor.settle_first_once();
    gate.let_one();
    gate.until_arrived(3, "the first's registration of its merged span");
    gate.let_one();
    let two = returned(&second, "the second").expect("second get");
    assert_eq!((two.addr(), two.len()), (a, LEN + PAGE));
    assert!(two.is_cached());
    gate.set_hold(false);
    let one = first.join().expect("first").expect("first get");
    assert_eq!(
        (one.addr(), one.len()),
        (a, 2 * LEN),
        "its own merged span, not the narrower entry inside it"
    );
    assert!(one.is_cached() && one.is_valid_now());
    assert!(!two.is_cached(), "superseded by the first's entry");
    assert!(two.is_valid_now(), "superseded, not invalidated");
    let s = rig.c.stats();
    assert_eq!((s.raced_hits, s.hits, s.entries), (0, 0, 1));
    assert_eq!(rig.made(), 4, "the first's two, the second's, the neighbour's");
    drop((one, two));
    let again = rig.c.get(nb, LEN + PAGE, W).expect("the neighbour's range again");
    assert_eq!((again.addr(), again.len()), (a, 2 * LEN), "the first's entry");
    assert_eq!(rig.made(), 4, "a hit: no fifth registration");
    assert_eq!(rig.stale(&again), 0, "pins the current pages");
}
