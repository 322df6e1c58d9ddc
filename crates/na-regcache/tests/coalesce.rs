//! Concurrent misses of one range, coalesced (`cache::coalesce`): the
//! first miss registers, the others wait for it and take it as a hit;
//! when it fails, is handed out uncached or is invalidated before they
//! look again, they register on their own. Ordered deterministically: a
//! registrar that holds the thread named `first` inside its registration
//! until the test lets it go, the cache's counters (a wait is counted
//! before the waiter parks), and a monitor gate that holds the `waiter`
//! threads' monitor sync after they woke. Everything else is real: the
//! process's userfaultfd monitor, io_uring pins, real mappings.

mod common;

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::sys::{self, PAGE};
use na_regcache::{
    Access, Cache, CacheConfig, Consistency, FixedBuffer, InvalidationSink, Monitor, MonitorChoice,
    Registrar, Registration, SinkId, UffdMonitor, UringRegistrar, Watch,
};

const LEN: usize = 4 * PAGE;
const W: Access = Access::LOCAL_WRITE;
/// How long the test waits for a thread to reach a gate: generous, it
/// takes microseconds when nothing is wrong.
const PATIENCE: Duration = Duration::from_secs(30);

fn me() -> String {
    std::thread::current().name().unwrap_or("").to_owned()
}

/// Test-controlled flags behind a mutex, with a condition to wait on.
#[derive(Default)]
struct Switch {
    /// Hold the gated thread.
    hold: bool,
    /// The gated thread is parked.
    parked: bool,
    /// Threads whose registrations fail.
    failing: Vec<&'static str>,
}

#[derive(Default)]
struct Gate {
    state: Mutex<Switch>,
    changed: Condvar,
}

impl Gate {
    fn state(&self) -> MutexGuard<'_, Switch> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_hold(&self, hold: bool) {
        self.state().hold = hold;
        self.changed.notify_all();
    }

    /// Parks the calling thread while the hold lasts.
    fn pass(&self) {
        let mut st = self.state();
        if !st.hold {
            return;
        }
        st.parked = true;
        self.changed.notify_all();
        let deadline = Instant::now() + PATIENCE;
        while st.hold {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "{} never let go", me());
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        st.parked = false;
        self.changed.notify_all();
    }

    /// Waits until the gated thread is parked.
    fn until_parked(&self, what: &str) {
        let deadline = Instant::now() + PATIENCE;
        let mut st = self.state();
        while !st.parked {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "{what} never parked");
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// io_uring fixed buffers (real pins), counted; the registration of the
/// thread named `first` parks at `gate` while it holds, and those of the
/// threads `gate` lists as failing fail (after it).
struct Gated {
    inner: UringRegistrar,
    made: AtomicUsize,
    gate: Gate,
}

impl Registrar for Gated {
    type Region = FixedBuffer;
    type Error = io::Error;
    fn register(&self, addr: usize, len: usize, access: Access) -> io::Result<FixedBuffer> {
        self.made.fetch_add(1, Ordering::SeqCst);
        let me = me();
        if me == "first" {
            self.gate.pass();
        }
        if self.gate.state().failing.iter().any(|f| *f == me) {
            return Err(io::Error::other("refused by the test"));
        }
        self.inner.register(addr, len, access)
    }
    fn deregister(&self, region: FixedBuffer) -> io::Result<()> {
        self.inner.deregister(region)
    }
}

/// The process's userfaultfd monitor; the monitor syncs of the threads
/// named `waiter` park at `gate` while it holds.
struct SyncGate {
    inner: Arc<UffdMonitor>,
    gate: Gate,
}

impl SyncGate {
    fn pass(&self) {
        if me() == "waiter" {
            self.gate.pass();
        }
    }
}

impl Monitor for SyncGate {
    fn name(&self) -> &'static str {
        "sync-gated-uffd"
    }
    fn attach(&self, sink: Arc<dyn InvalidationSink>) -> io::Result<SinkId> {
        self.inner.attach(sink)
    }
    fn detach(&self, id: SinkId) -> Option<Arc<dyn InvalidationSink>> {
        self.inner.detach(id)
    }
    fn subscribe(&self, start: usize, len: usize, cookie: u64) -> io::Result<Watch> {
        self.inner.subscribe(start, len, cookie)
    }
    fn unsubscribe(&self, watch: &Watch) {
        self.inner.unsubscribe(watch)
    }
    fn sync(&self) {
        self.pass();
        self.inner.sync()
    }
    fn sync_in_flight(&self) {
        self.pass();
        self.inner.sync_in_flight()
    }
    fn settling(&self, start: usize, end: usize) -> Option<Duration> {
        self.inner.settling(start, end)
    }
    fn wait_settled(&self, start: usize, end: usize, limit: Duration) -> Option<Duration> {
        self.inner.wait_settled(start, end, limit)
    }
    fn changed(&self, watch: &Watch) -> bool {
        self.inner.changed(watch)
    }
}

struct Rig {
    c: Arc<Cache<Gated>>,
    monitor: Arc<SyncGate>,
    /// A touched buffer of `LEN` bytes.
    a: usize,
}

impl Rig {
    fn new(max_count: usize) -> Rig {
        common::require_io_uring();
        let a = sys::map_anon(None, LEN).expect("mmap");
        Rig::over(max_count, a)
    }

    /// A rig whose buffer is `[a, a + LEN)` (touched, unmapped on drop).
    fn over(max_count: usize, a: usize) -> Rig {
        common::require_io_uring();
        let monitor = Arc::new(SyncGate {
            inner: UffdMonitor::global().expect("userfaultfd monitor"),
            gate: Gate::default(),
        });
        let registrar = Gated {
            inner: UringRegistrar::new(16, true).expect("io_uring fixed buffers"),
            made: AtomicUsize::new(0),
            gate: Gate::default(),
        };
        let config = CacheConfig {
            max_count,
            max_bytes: 1 << 30,
            monitor: MonitorChoice::Uffd,
            fork_guard: true,
            consistency: Consistency::InFlight,
            map_watch: false,
        };
        let m = Arc::clone(&monitor) as Arc<dyn Monitor>;
        let c = Arc::new(Cache::with_monitor(registrar, config, m).expect("cache"));
        sys::touch(a, LEN, 0x11);
        Rig { c, monitor, a }
    }

    fn made(&self) -> usize {
        self.c.registrar().made.load(Ordering::SeqCst)
    }

    fn registrar_gate(&self) -> &Gate {
        &self.c.registrar().gate
    }

    /// `get(a, LEN, access)` on a thread named `name`.
    fn get_on(&self, name: &str, access: Access) -> JoinHandle<na_regcache::Result<Registration<Gated>>> {
        let (c, a) = (Arc::clone(&self.c), self.a);
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || c.get(a, LEN, access))
            .expect("thread")
    }

    /// Starts `first`'s miss of the buffer and holds it in its registration.
    fn first_held(&self) -> JoinHandle<na_regcache::Result<Registration<Gated>>> {
        self.registrar_gate().set_hold(true);
        let first = self.get_on("first", W);
        self.registrar_gate().until_parked("the first registration");
        first
    }

    /// Waits until `n` misses wait for another's registration (or, where
    /// misses do not coalesce, one registered on its own: more than the
    /// `made` registrations made while the first is held).
    fn until_waiting(&self, n: u64) {
        let made = self.made();
        let deadline = Instant::now() + PATIENCE;
        while self.c.stats().coalesce_waits < n && self.made() == made {
            assert!(Instant::now() < deadline, "{n} misses never waited");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The pages `reg` pinned that are not the buffer's now.
    fn stale(&self, reg: &Registration<Gated>) -> usize {
        self.c
            .registrar()
            .inner
            .stale_pages(reg.region(), self.a, LEN)
            .expect("frames")
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = sys::unmap(self.a, LEN);
    }
}

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

/// The first miss fails: the waiter, woken at once, registers on its own
/// and gets what its own registration gives, a handle or its error.
#[test]
fn a_waiter_registers_on_its_own_when_the_first_fails() {
    for waiter_fails in [false, true] {
        let rig = Rig::new(16);
        {
            let mut st = rig.registrar_gate().state();
            st.failing.push("first");
            if waiter_fails {
                st.failing.push("waiter");
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

/// The first miss's registration is handed out uncached (the cache is
/// full of an entry in use): the waiter registers on its own too.
#[test]
fn a_waiter_registers_on_its_own_when_the_first_is_uncached() {
    let rig = Rig::new(1);
    let other = sys::map_anon(None, LEN).expect("mmap");
    sys::touch(other, LEN, 0x33);
    let held = rig.c.get(other, LEN, W).expect("fills the cache");
    let made0 = rig.made();
    let first = rig.first_held();
    let waiter = rig.get_on("waiter", W);
    rig.until_waiting(1);
    rig.registrar_gate().set_hold(false);
    let one = first.join().expect("first").expect("first get");
    let two = waiter.join().expect("waiter").expect("waiter get");
    let s = rig.c.stats();
    assert_eq!(rig.made() - made0, 2, "the waiter registered on its own");
    assert_eq!((s.coalesce_waits, s.coalesced, s.coalesce_timeouts), (1, 0, 0));
    for reg in [&one, &two] {
        assert!(!reg.is_cached() && reg.is_valid_now());
        assert_eq!(rig.stale(reg), 0);
    }
    drop((one, two, held));
    sys::unmap(other, LEN).expect("munmap");
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
    let rig = Rig::over(16, sys::map_shared_fd(None, LEN, &fd).expect("mmap"));
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
