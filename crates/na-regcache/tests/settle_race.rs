//! Misses of ranges still settling after a discard, raced by other
//! threads, ordered deterministically: the userfaultfd monitor wrapped in
//! a gate (`Gate`, through `common::forward`) that holds a named thread's settle wait until the test
//! lets it go, and can report a range settling for that thread only (as
//! a monitor's merged settling range covers memory nobody discarded).
//! Everything else is real: the process's userfaultfd monitor, io_uring
//! pins, real discards and mappings.

mod common;

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::forward::{Forwarding, Hooks};
use common::sys::{self, PAGE};
use na_regcache::{
    Access, Cache, CacheConfig, Consistency, FixedBuffer, Monitor, MonitorChoice, Registrar, Registration,
    UffdMonitor, UringRegistrar, REMOVE_SETTLE, SETTLE_BUDGET,
};

const LEN: usize = 4 * PAGE;
const W: Access = Access::LOCAL_WRITE;
/// How long the test waits for a thread to reach the gate: generous, it
/// takes microseconds when nothing is wrong.
const PATIENCE: Duration = Duration::from_secs(30);

/// The tests share the process's monitor: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// How a hold keeps its thread's range settling.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Until the test releases it (its wait reports 1 ms: the test, not
    /// the clock, decides when it ends).
    Gated,
    /// Always: each wait sleeps the whole limit the cache gives (a range
    /// discarded again and again).
    Endless,
    /// For the next check after a pin only, which it ends; waits pass (a
    /// discard read between the wait and the pin).
    AtPin,
}

struct Hold {
    thread: &'static str,
    start: usize,
    end: usize,
    kind: Kind,
}

#[derive(Default)]
struct GateState {
    holds: Vec<Hold>,
    /// Threads parked at the gate, with the span each waits for.
    parked: Vec<(&'static str, usize, usize)>,
    /// Every limit a wait was given, per thread.
    limits: Vec<(&'static str, Duration)>,
}

/// The process's userfaultfd monitor behind a gate (see the module docs).
type Gate = Forwarding<Settles>;

/// The gate's part: the holds, and the condition the test waits on.
#[derive(Default)]
struct Settles {
    state: Mutex<GateState>,
    changed: Condvar,
}

fn me() -> &'static str {
    match std::thread::current().name() {
        Some("first") => "first",
        Some("second") => "second",
        Some("miss") => "miss",
        _ => "other",
    }
}

impl Settles {
    fn state(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `[start, end)` settle for `thread`.
    fn hold(&self, thread: &'static str, start: usize, end: usize, kind: Kind) {
        self.state().holds.push(Hold {
            thread,
            start,
            end,
            kind,
        });
        self.changed.notify_all();
    }

    /// Ends `thread`'s holds overlapping `[start, end)`.
    fn release(&self, thread: &'static str, start: usize, end: usize) {
        self.state()
            .holds
            .retain(|h| !(h.thread == thread && h.start < end && h.end > start));
        self.changed.notify_all();
    }

    /// Waits until `thread` is parked at the gate with a span overlapping
    /// `[start, end)`.
    fn until_parked(&self, thread: &'static str, start: usize, end: usize) {
        let deadline = Instant::now() + PATIENCE;
        let mut st = self.state();
        while !st
            .parked
            .iter()
            .any(|&(t, s, e)| t == thread && s < end && e > start)
        {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "{thread} never waited for [{start:#x}, {end:#x})"
            );
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn limits(&self, thread: &'static str) -> Vec<Duration> {
        self.state()
            .limits
            .iter()
            .filter(|l| l.0 == thread)
            .map(|l| l.1)
            .collect()
    }

    /// Where this thread's first hold overlapping `[start, end)` is, and
    /// its kind (those of `kinds` only).
    fn held(st: &GateState, start: usize, end: usize, kinds: &[Kind]) -> Option<(usize, Kind)> {
        let me = me();
        st.holds
            .iter()
            .position(|h| h.thread == me && h.start < end && h.end > start && kinds.contains(&h.kind))
            .map(|i| (i, st.holds[i].kind))
    }
}

impl Hooks for Settles {
    fn name(&self) -> &'static str {
        "gated-uffd"
    }
    fn settling(&self, inner: &UffdMonitor, start: usize, end: usize) -> Option<Duration> {
        let mut st = self.state();
        match Settles::held(&st, start, end, &[Kind::Gated, Kind::Endless, Kind::AtPin]) {
            Some((i, Kind::AtPin)) => {
                st.holds.remove(i);
                Some(REMOVE_SETTLE)
            }
            Some(_) => Some(REMOVE_SETTLE),
            None => inner.settling(start, end),
        }
    }
    fn wait_settled(
        &self,
        inner: &UffdMonitor,
        start: usize,
        end: usize,
        limit: Duration,
    ) -> Option<Duration> {
        let real = inner.wait_settled(start, end, limit);
        let mut st = self.state();
        st.limits.push((me(), limit));
        const WAITING: [Kind; 2] = [Kind::Gated, Kind::Endless];
        match Settles::held(&st, start, end, &WAITING) {
            None => return real,
            Some((_, Kind::Endless)) => {
                drop(st);
                std::thread::sleep(limit);
                return Some(limit);
            }
            Some(_) => {}
        }
        st.parked.push((me(), start, end));
        self.changed.notify_all();
        let deadline = Instant::now() + PATIENCE;
        while Settles::held(&st, start, end, &WAITING).is_some() {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "{} never let go", me());
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        st.parked.retain(|&(t, s, e)| (t, s, e) != (me(), start, end));
        Some(real.unwrap_or_default() + Duration::from_millis(1))
    }
}

/// io_uring fixed buffers (real pins), counted; `on_register` runs
/// before each registration (with its number, from 1).
struct Counted {
    inner: UringRegistrar,
    made: AtomicUsize,
    on_register: Box<dyn Fn(usize) + Send + Sync>,
}

impl Registrar for Counted {
    type Region = FixedBuffer;
    type Error = io::Error;
    fn register(&self, addr: usize, len: usize, access: Access) -> io::Result<FixedBuffer> {
        let n = self.made.fetch_add(1, Ordering::SeqCst) + 1;
        (self.on_register)(n);
        self.inner.register(addr, len, access)
    }
    fn deregister(&self, region: FixedBuffer) -> io::Result<()> {
        self.inner.deregister(region)
    }
}

fn cache(gate: &Arc<Gate>, on_register: impl Fn(usize) + Send + Sync + 'static) -> Arc<Cache<Counted>> {
    common::require_io_uring();
    let registrar = Counted {
        inner: UringRegistrar::new(16, true).expect("io_uring fixed buffers"),
        made: AtomicUsize::new(0),
        on_register: Box::new(on_register),
    };
    let config = CacheConfig {
        max_count: 16,
        max_bytes: 1 << 30,
        monitor: MonitorChoice::Uffd,
        fork_guard: true,
        consistency: Consistency::InFlight,
        map_watch: false,
    };
    let monitor = Arc::clone(gate) as Arc<dyn Monitor>;
    Arc::new(Cache::with_monitor(registrar, config, monitor).expect("cache"))
}

fn made(c: &Cache<Counted>) -> usize {
    c.registrar().made.load(Ordering::SeqCst)
}

/// `c.get(addr, len)` on a thread named `name`.
fn get_on(
    name: &'static str,
    c: &Arc<Cache<Counted>>,
    addr: usize,
    len: usize,
) -> std::thread::JoinHandle<Registration<Counted>> {
    let c = Arc::clone(c);
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || c.get(addr, len, W).expect("get"))
        .expect("thread")
}

/// Two threads miss one range discarded moments ago; both wait for it to
/// settle. The first registers it; the second, after its wait, finds it
/// registered and takes it as a hit. (Before 2026-11-29 both registered:
/// the second registration superseded the first.)
#[test]
fn two_misses_of_one_settling_range_register_it_once() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let gate = Gate::new(Settles::default());
    let c = cache(&gate, |_| {});
    let a = sys::map_anon(None, LEN).expect("mmap");
    sys::touch(a, LEN, 0x11);
    // Watched (cached, then idle), then discarded: the range settles.
    drop(c.get(a, LEN, W).expect("prime"));
    sys::advise(a, LEN, libc::MADV_DONTNEED).expect("madvise");
    sys::touch(a, LEN, 0x22);
    gate.hold("first", a, a + PAGE, Kind::Gated);
    gate.hold("second", a, a + PAGE, Kind::Gated);
    let (made0, before) = (made(&c), c.stats());
    let first = get_on("first", &c, a, LEN);
    let second = get_on("second", &c, a, LEN);
    gate.until_parked("first", a, a + LEN);
    gate.until_parked("second", a, a + LEN);
    // The discard's own settle time over (so the first miss's check after
    // its pin finds nothing settling however loaded the machine is).
    gate.inner.wait_settled(a, a + LEN, PATIENCE);
    gate.release("first", a, a + LEN);
    let one = first.join().expect("first");
    assert!(one.is_cached());
    gate.release("second", a, a + LEN);
    let two = second.join().expect("second");
    let after = c.stats();
    assert_eq!(made(&c) - made0, 1, "two misses of one range registered it once");
    assert!(
        one.is_cached() && two.is_cached(),
        "the first registration was not superseded"
    );
    assert_eq!((two.addr(), two.len()), (a, LEN));
    assert_eq!(after.misses - before.misses, 1, "the second is no miss");
    assert_eq!(after.hits - before.hits, 1, "but a hit");
    for reg in [&one, &two] {
        assert!(reg.is_valid_now());
        let stale = c
            .registrar()
            .inner
            .stale_pages(reg.region(), a, LEN)
            .expect("frames");
        assert_eq!(stale, 0, "pins the current pages");
    }
    drop((one, two));
    sys::unmap(a, LEN).expect("munmap");
}

/// A miss waits for its request's range to settle; meanwhile another
/// thread caches a neighbour overlapping the request, part of which is
/// settling too (for the miss: as a monitor's merged settling range
/// covers memory nobody discarded). After the wait the miss's span has
/// grown over that part: it waits for it as well, before it pins, and
/// registers once. (Before 2026-11-29 it pinned at once, found the span
/// settling after the pin, threw the registration away and waited then.)
#[test]
fn a_span_grown_over_another_settling_range_is_waited_for_before_the_pin() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let gate = Gate::new(Settles::default());
    let c = cache(&gate, |_| {});
    let a = sys::map_anon(None, 2 * LEN).expect("mmap");
    sys::touch(a, 2 * LEN, 0x33);
    gate.hold("miss", a, a + PAGE, Kind::Gated);
    let miss = get_on("miss", &c, a, LEN);
    gate.until_parked("miss", a, a + PAGE);
    // The neighbour: the request's last page and the next LEN - PAGE bytes.
    let n = a + LEN - PAGE;
    let neighbour = c.get(n, LEN, W).expect("neighbour");
    assert!(neighbour.is_cached());
    let tail = (a + LEN, n + LEN);
    gate.hold("miss", tail.0, tail.1, Kind::Gated);
    let made0 = made(&c);
    gate.release("miss", a, a + PAGE);
    gate.until_parked("miss", tail.0, tail.1);
    assert_eq!(made(&c), made0, "pinned before waiting for the grown span");
    gate.release("miss", tail.0, tail.1);
    let reg = miss.join().expect("miss");
    assert_eq!(made(&c), made0 + 1, "one registration of the grown span");
    assert!(reg.is_cached() && reg.is_valid_now());
    assert_eq!(
        (reg.addr(), reg.len()),
        (a, n + LEN - a),
        "the span merged with the neighbour"
    );
    drop((reg, neighbour));
    sys::unmap(a, 2 * LEN).expect("munmap");
}

/// A range that keeps settling (discarded again and again): the miss
/// waits once, for its whole budget, registers once and hands the
/// registration out uncached. (Before 2026-11-29 each of its three
/// attempts waited up to four settle times and registered: about 1.2 s
/// and three registrations.)
#[test]
fn a_range_that_keeps_settling_is_waited_for_within_one_budget() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let gate = Gate::new(Settles::default());
    let c = cache(&gate, |_| {});
    let a = sys::map_anon(None, LEN).expect("mmap");
    sys::touch(a, LEN, 0x44);
    gate.hold("miss", a, a + LEN, Kind::Endless);
    let reg = get_on("miss", &c, a, LEN).join().expect("miss");
    assert!(!reg.is_cached(), "made while its range settled: uncached");
    assert_eq!(made(&c), 1, "registered once");
    let limits = gate.limits("miss");
    assert_eq!(limits, vec![SETTLE_BUDGET], "one wait, given the whole budget");
    drop(reg);
    sys::unmap(a, LEN).expect("munmap");
}

/// The same for memory exposed to peers (`get_unshared`): one wait with
/// the whole budget, one registration, whose flag clears once the settle
/// time it was made in ends. (Before 2026-11-29: three of each.)
#[test]
fn an_unshared_registration_of_a_range_that_keeps_settling_waits_within_one_budget() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let gate = Gate::new(Settles::default());
    let c = cache(&gate, |_| {});
    let a = sys::map_anon(None, LEN).expect("mmap");
    sys::touch(a, LEN, 0x47);
    gate.hold("miss", a, a + LEN, Kind::Endless);
    let c2 = Arc::clone(&c);
    let reg = std::thread::Builder::new()
        .name("miss".into())
        .spawn(move || c2.get_unshared(a, LEN, W).expect("get_unshared"))
        .expect("thread")
        .join()
        .expect("miss");
    assert_eq!(made(&c), 1, "registered once");
    assert_eq!(
        gate.limits("miss"),
        vec![SETTLE_BUDGET],
        "one wait, given the whole budget"
    );
    // Made while its range settled: stale once that settle time is over.
    std::thread::sleep(2 * REMOVE_SETTLE);
    assert!(!reg.is_valid(), "valid after the settle time it was made in");
    drop(reg);
    sys::unmap(a, LEN).expect("munmap");
}

/// Registrations thrown away because a discard settled do not use up the
/// attempts for a mapping that changed: two of each, then the miss
/// succeeds. (Before 2026-11-29 they shared three attempts: `Unstable`
/// at the third registration.)
#[test]
fn settle_retries_leave_the_attempts_for_changes_alone() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let gate = Gate::new(Settles::default());
    let a = sys::map_anon(None, LEN).expect("mmap");
    sys::touch(a, LEN, 0x55);
    let g = Arc::clone(&gate);
    let c = cache(&gate, move |n| match n {
        // Pins that a discard settling after the wait races (the check
        // after the pin finds it).
        1 | 2 => g.hold("miss", a, a + LEN, Kind::AtPin),
        // Then the mapping replaced during the pin, twice: an UNMAP event,
        // read before the overlay returns and applied (to the miss's
        // tracking slot) once the reader's round is done.
        3 | 4 => {
            sys::map_anon_overlay(a, LEN).expect("overlay");
            g.sync();
            sys::touch(a, LEN, 0x66);
        }
        _ => {}
    });
    let reg = get_on("miss", &c, a, LEN).join().expect("the miss succeeds");
    assert_eq!(made(&c), 5, "two settle retries, two changes, one success");
    assert!(reg.is_cached() && reg.is_valid_now());
    let stale = c
        .registrar()
        .inner
        .stale_pages(reg.region(), a, LEN)
        .expect("frames");
    assert_eq!(stale, 0, "pins the current pages");
    drop(reg);
    sys::unmap(a, LEN).expect("munmap");
}
