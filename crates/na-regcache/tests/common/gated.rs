//! The rig of the coalescing tests (`tests/coalesce.rs`, `tests/raced.rs`):
//! a cache over a registrar that holds the thread named `first` inside
//! its registrations until the test lets it go (real io_uring pins), and
//! the process's userfaultfd monitor whose `waiter` threads' syncs park
//! at a gate while it holds.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::forward::{Forwarding, Hooks};
use super::sys::{self, PAGE};
use na_regcache::{
    Access, Cache, CacheConfig, Consistency, FixedBuffer, Monitor, MonitorChoice, Registrar, Registration,
    UffdMonitor, UringRegistrar, Watch, REMOVE_SETTLE,
};

pub const LEN: usize = 4 * PAGE;
pub const W: Access = Access::LOCAL_WRITE;
/// How long the test waits for a thread to reach a gate: generous, it
/// takes microseconds when nothing is wrong.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// The rig's caches' bound on a miss's wait for another's registration
/// (`Cache::set_coalesce_wait`): longer than [`PATIENCE`], so that a
/// wait the test ends (by letting a held thread go) never runs out first
/// however loaded the machine is (the default, `COALESCE_WAIT`, is 5 s:
/// a waiter parked while a test thread was not scheduled for that long
/// registered on its own and failed the test's counts). A miss that
/// waits for something the test holds until the miss returns (the bug
/// class the tests check) then fails the test by `PATIENCE` instead of
/// running out this bound.
pub const WAIT_BOUND: Duration = Duration::from_secs(120);

pub fn me() -> String {
    std::thread::current().name().unwrap_or("").to_owned()
}

/// Test-controlled flags behind a mutex, with a condition to wait on.
#[derive(Default)]
pub struct Switch {
    /// Hold the gated threads.
    pub hold: bool,
    /// Arrivals at the gate while it held (each is a ticket).
    pub arrived: usize,
    /// Tickets let go one by one ([`Gate::let_one`]).
    pub let_go: usize,
    /// Registrations that fail: by the thread making them, of more than
    /// the bytes given.
    pub failing: Vec<(&'static str, usize)>,
}

#[derive(Default)]
pub struct Gate {
    pub state: Mutex<Switch>,
    pub changed: Condvar,
}

impl Gate {
    pub fn state(&self) -> MutexGuard<'_, Switch> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holds gated threads from now on (`true`), or lets them all go.
    pub fn set_hold(&self, hold: bool) {
        self.state().hold = hold;
        self.changed.notify_all();
    }

    /// Lets the earliest thread parked at the gate go.
    pub fn let_one(&self) {
        self.state().let_go += 1;
        self.changed.notify_all();
    }

    /// Parks the calling thread while the hold lasts and its ticket is
    /// not let go.
    pub fn pass(&self) {
        let mut st = self.state();
        if !st.hold {
            return;
        }
        st.arrived += 1;
        let ticket = st.arrived;
        self.changed.notify_all();
        let deadline = Instant::now() + PATIENCE;
        while st.hold && st.let_go < ticket {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "{} never let go", me());
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        self.changed.notify_all();
    }

    /// Waits until `n` threads arrived at the gate while it held (parked
    /// or let go since).
    pub fn until_arrived(&self, n: usize, what: &str) {
        let deadline = Instant::now() + PATIENCE;
        let mut st = self.state();
        while st.arrived < n {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "{what} never arrived");
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Waits until a gated thread is parked (one not let go).
    pub fn until_parked(&self, what: &str) {
        let deadline = Instant::now() + PATIENCE;
        let mut st = self.state();
        while st.arrived <= st.let_go {
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

/// io_uring fixed buffers (real pins), counted; each registration of the
/// threads named `first` and `second` parks at `gate` while it holds
/// (tickets in arrival order), and those `gate` lists as failing fail
/// (after it); the deregistrations of `first` park at `dereg`.
pub struct Gated {
    pub inner: UringRegistrar,
    pub made: AtomicUsize,
    pub gate: Gate,
    pub dereg: Gate,
}

impl Registrar for Gated {
    type Region = FixedBuffer;
    type Error = io::Error;
    fn register(&self, addr: usize, len: usize, access: Access) -> io::Result<FixedBuffer> {
        self.made.fetch_add(1, Ordering::SeqCst);
        let me = me();
        if me == "first" || me == "second" {
            self.gate.pass();
        }
        let failing = self.gate.state().failing.clone();
        if failing.iter().any(|&(f, over)| f == me && len > over) {
            return Err(io::Error::other("refused by the test"));
        }
        self.inner.register(addr, len, access)
    }
    fn deregister(&self, region: FixedBuffer) -> io::Result<()> {
        if me() == "first" {
            self.dereg.pass();
        }
        self.inner.deregister(region)
    }
}

/// The process's userfaultfd monitor (`common::forward`); the monitor
/// syncs of the threads named `waiter` park at `gate` while it holds. On
/// the test's word it also reports one range's mapping changed, as a
/// kdreg2-style monitor does while the events saying so are not applied
/// yet ([`SyncGate::report_changed`]), and the next settling check of the
/// thread named `first` settling ([`SyncGate::settle_first_once`]).
#[derive(Default)]
pub struct SyncGate {
    pub gate: Gate,
    /// Every subscription made: its watch and its range.
    subscribed: Mutex<Vec<(Watch, usize, usize)>>,
    /// The range whose subscriptions `changed` reports changed.
    changed: Mutex<Option<(usize, usize)>>,
    /// The next settling check of `first` reports its span settling.
    settle_first: AtomicBool,
}

impl SyncGate {
    /// From now on `Monitor::changed` answers true for the watches of
    /// the subscriptions of exactly `[start, end)` (`None`: for none).
    pub fn report_changed(&self, range: Option<(usize, usize)>) {
        *self.changed.lock().unwrap_or_else(|p| p.into_inner()) = range;
    }

    /// The next `Monitor::settling` check made by the thread named
    /// `first` (one): its span settles, as if a discard of it had just
    /// been read.
    pub fn settle_first_once(&self) {
        self.settle_first.store(true, Ordering::SeqCst);
    }
}

impl Hooks for SyncGate {
    fn name(&self) -> &'static str {
        "sync-gated-uffd"
    }
    fn before_sync(&self) {
        if me() == "waiter" {
            self.gate.pass();
        }
    }
    fn settling(&self, inner: &UffdMonitor, start: usize, end: usize) -> Option<Duration> {
        if me() == "first" && self.settle_first.swap(false, Ordering::SeqCst) {
            return Some(REMOVE_SETTLE);
        }
        inner.settling(start, end)
    }
    fn subscribe(&self, inner: &UffdMonitor, start: usize, len: usize, cookie: u64) -> io::Result<Watch> {
        let w = inner.subscribe(start, len, cookie)?;
        self.subscribed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((w, start, start + len));
        Ok(w)
    }
    fn changed(&self, inner: &UffdMonitor, watch: &Watch) -> bool {
        let reported = *self.changed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((s, e)) = reported {
            let subs = self.subscribed.lock().unwrap_or_else(|p| p.into_inner());
            if subs.iter().any(|&(w, ws, we)| w == *watch && (ws, we) == (s, e)) {
                return true;
            }
        }
        inner.changed(watch)
    }
}

pub type Result<T> = na_regcache::Result<T>;

pub struct Rig {
    pub c: Arc<Cache<Gated>>,
    pub monitor: Arc<Forwarding<SyncGate>>,
    /// A touched buffer of `len` bytes.
    pub a: usize,
    pub len: usize,
}

impl Rig {
    pub fn new(max_count: usize) -> Rig {
        Rig::sized(max_count, LEN)
    }

    /// A rig whose buffer is `len` bytes.
    pub fn sized(max_count: usize, len: usize) -> Rig {
        super::require_io_uring();
        let a = sys::map_anon(None, len).expect("mmap");
        Rig::over(max_count, a, len)
    }

    /// A rig whose buffer is `[a, a + len)` (touched, unmapped on drop).
    pub fn over(max_count: usize, a: usize, len: usize) -> Rig {
        super::require_io_uring();
        let monitor = Forwarding::new(SyncGate::default());
        let registrar = Gated {
            inner: UringRegistrar::new(16, true).expect("io_uring fixed buffers"),
            made: AtomicUsize::new(0),
            gate: Gate::default(),
            dereg: Gate::default(),
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
        c.set_coalesce_wait(WAIT_BOUND);
        sys::touch(a, len, 0x11);
        Rig { c, monitor, a, len }
    }

    pub fn made(&self) -> usize {
        self.c.registrar().made.load(Ordering::SeqCst)
    }

    pub fn registrar_gate(&self) -> &Gate {
        &self.c.registrar().gate
    }

    /// `get(a, LEN, access)` on a thread named `name`.
    pub fn get_on(&self, name: &str, access: Access) -> JoinHandle<Result<Registration<Gated>>> {
        self.get_range_on(name, self.a, LEN, access)
    }

    /// `get(addr, len, access)` on a thread named `name`.
    pub fn get_range_on(
        &self,
        name: &str,
        addr: usize,
        len: usize,
        access: Access,
    ) -> JoinHandle<Result<Registration<Gated>>> {
        let c = Arc::clone(&self.c);
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || c.get(addr, len, access))
            .expect("thread")
    }

    /// `get(addr, len, W)` on a thread named `name`, whose result comes
    /// on the channel (see [`returned`]).
    pub fn get_sent(&self, name: &str, addr: usize, len: usize) -> Receiver<Result<Registration<Gated>>> {
        let (tx, rx) = mpsc::channel();
        let c = Arc::clone(&self.c);
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || tx.send(c.get(addr, len, W)).expect("the test listens"))
            .expect("thread");
        rx
    }

    /// Starts `first`'s miss of the buffer's first `LEN` bytes and holds it
    /// in its registration.
    pub fn first_held(&self) -> JoinHandle<Result<Registration<Gated>>> {
        self.registrar_gate().set_hold(true);
        let first = self.get_on("first", W);
        self.registrar_gate().until_parked("the first registration");
        first
    }

    /// Waits until `n` misses wait for another's registration (or, where
    /// misses do not coalesce, one registered on its own: more than the
    /// `made` registrations made while the first is held).
    pub fn until_waiting(&self, n: u64) {
        let made = self.made();
        let deadline = Instant::now() + PATIENCE;
        while self.c.stats().coalesce_waits < n && self.made() == made {
            assert!(Instant::now() < deadline, "{n} misses never waited");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The pages `reg` pinned that are not its range's now.
    pub fn stale(&self, reg: &Registration<Gated>) -> usize {
        self.c
            .registrar()
            .inner
            .stale_pages(reg.region(), reg.addr(), reg.len())
            .expect("frames")
    }
}

/// The result a thread of [`Rig::get_sent`] sent, within `PATIENCE`.
pub fn returned(rx: &Receiver<Result<Registration<Gated>>>, what: &str) -> Result<Registration<Gated>> {
    rx.recv_timeout(PATIENCE)
        .unwrap_or_else(|e| panic!("{what} never returned: {e}"))
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = sys::unmap(self.a, self.len);
    }
}
