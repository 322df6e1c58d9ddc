//! The userfaultfd monitor, made synchronous.
//!
//! # Registration mode
//!
//! `UFFDIO_REGISTER` needs at least one mode. `MISSING` makes every fault on
//! a not-present page block until someone answers it (`UFFDIO_ZEROPAGE` /
//! `UFFDIO_COPY`), and with `UFFD_USER_MODE_ONLY` a fault raised by the
//! kernel itself (a `read(2)` into a buffer after `MADV_DONTNEED`) is not
//! delivered at all but fails with `EFAULT`. This monitor therefore registers
//! in write-protect (`WP`) mode and never write-protects a page: no fault is
//! ever routed to userfaultfd, while the non-cooperative events (UNMAP,
//! REMOVE, REMAP) are delivered for every registered range regardless of the
//! mode. With `UFFD_FEATURE_WP_ASYNC` (Linux 6.7+, present on this host's
//! 6.18) the kernel allows WP registration on any memory type (anonymous,
//! shmem, hugetlbfs and private file mappings) and resolves any WP fault
//! itself; without it, WP works on anonymous memory (and shmem/hugetlbfs
//! with `WP_HUGETLBFS_SHMEM`).
//!
//! # Why lookups can never see a stale registration
//!
//! The kernel queues an UNMAP/REMOVE/REMAP event and blocks the thread that
//! called `munmap` (`madvise`, `mremap`, `brk`) until a `read(2)` of the
//! userfaultfd *dequeues* the event; it then lets that thread return, which
//! can happen before the reader has looked at the message. To close that
//! window the reader thread
//!
//! 1. sleeps in `poll` until the descriptor is readable,
//! 2. bumps `started` (SeqCst) **before** calling `read`,
//! 3. reads every pending message and invalidates the matching entries in
//!    every attached cache (under each cache's lock),
//! 4. stores `finished = started`.
//!
//! [`Monitor::sync`], which every cache lookup calls before taking its lock,
//! loads `started` and waits until `finished` reaches it. If `munmap`
//! returned in thread A before a lookup starts in thread B (A's return
//! happens-before B's lookup), the `read` that released A began after step 2
//! of the same round (the kernel's wait-queue spinlock orders the reader's
//! store before A's wake-up), so B observes `started` at least that round
//! and waits for step 4: the entry is gone before B searches the index.
//! Events read in later rounds belong to unmaps that did not complete before
//! B started, i.e. that are concurrent with B.
//!
//! The reader never allocates, frees or logs in its loop: freeing memory
//! could itself unmap a registered page and block the reader on its own
//! event. Caches never free memory or call the registrar while holding the
//! lock the reader takes, so the reader cannot deadlock with them (the
//! libfabric deadlocks #5554, #5687, #9594 were of that kind).
//!
//! Ranges are never `UFFDIO_UNREGISTER`ed when an entry is evicted (a page
//! may be shared with a neighbouring entry); the kernel drops them on unmap.
//! The cost is one event round trip when formerly cached memory is unmapped.
//!
//! Because registrations persist, the monitor remembers (in a fixed,
//! direct-mapped table) page ranges it registered and skips the
//! `UFFDIO_REGISTER` ioctl when the same range is subscribed again. The
//! reader forgets every remembered range an UNMAP or REMAP overlaps
//! *before* it invalidates the caches, so a lookup that observes the
//! invalidation (or waits for it in `sync`) can no longer skip the ioctl
//! for the new mapping; REMOVE (`madvise`) keeps the VMA registered and
//! forgets nothing.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::{InvalidationSink, Monitor, SinkId, SinkSet, Watch};
use crate::sys::mem::page_size;
use crate::sys::uffd::{self, EventFd, Uffd, UffdEvent, UffdMsg};

/// Sets (of `WAYS` ranges each) of the table of ranges known to be registered.
const SETS: usize = 512;
const WAYS: usize = 4;

const REQUIRED: u64 = uffd::FEATURE_EVENT_UNMAP | uffd::FEATURE_EVENT_REMOVE | uffd::FEATURE_EVENT_REMAP;

/// Counters of the userfaultfd reader.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UffdCounters {
    /// UNMAP events read.
    pub unmap: u64,
    /// REMOVE events read.
    pub remove: u64,
    /// REMAP events read.
    pub remap: u64,
    /// Events of another kind (should stay zero).
    pub unexpected: u64,
    /// Failed reads.
    pub read_errors: u64,
}

struct Shared {
    uffd: Uffd,
    wake: EventFd,
    stop: AtomicBool,
    started: AtomicU64,
    finished: AtomicU64,
    sinks: SinkSet,
    counters: [AtomicU64; 5],
    /// Page ranges registered with the kernel and not unmapped since.
    known: Mutex<[[(usize, usize); WAYS]; SETS]>,
}

impl Shared {
    fn known_set(first: usize) -> usize {
        (first / page_size()).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (usize::BITS - SETS.trailing_zeros())
    }

    fn is_known(&self, range: (usize, usize)) -> bool {
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known[Self::known_set(range.0)].contains(&range)
    }

    /// Remembers `range` (most recent first in its set; the oldest way is dropped).
    fn remember(&self, range: (usize, usize)) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let set = &mut known[Self::known_set(range.0)];
        set.rotate_right(1);
        set[0] = range;
    }

    /// Forgets every remembered range overlapping `[start, end)` (allocation-free).
    fn forget(&self, start: usize, end: usize) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        for k in known.iter_mut().flatten() {
            if k.0 < end && k.1 > start {
                *k = (0, 0);
            }
        }
    }
}

/// The synchronous userfaultfd monitor (see the module docs for the argument).
pub struct UffdMonitor {
    shared: Arc<Shared>,
    features: u64,
    reader: Mutex<Option<JoinHandle<()>>>,
}

impl UffdMonitor {
    /// Opens a userfaultfd (`UFFD_USER_MODE_ONLY`), negotiates
    /// UNMAP|REMOVE|REMAP (+ WP_ASYNC when available) and starts the reader.
    pub fn new() -> io::Result<UffdMonitor> {
        let supported = Uffd::open(true)?.api(0)?;
        if supported & REQUIRED != REQUIRED {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("userfaultfd lacks UNMAP/REMOVE/REMAP events (features {supported:#x})"),
            ));
        }
        let optional = uffd::FEATURE_WP_ASYNC | uffd::FEATURE_WP_HUGETLBFS_SHMEM;
        let features = REQUIRED | (supported & optional);
        let fd = Uffd::open(true)?;
        let granted = fd.api(features)?;
        let shared = Arc::new(Shared {
            uffd: fd,
            wake: EventFd::new()?,
            stop: AtomicBool::new(false),
            started: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            sinks: SinkSet::new(),
            counters: Default::default(),
            known: Mutex::new([[(0, 0); WAYS]; SETS]),
        });
        let for_thread = Arc::clone(&shared);
        let started = Arc::new(std::sync::Barrier::new(2));
        let started_in_thread = Arc::clone(&started);
        let reader = std::thread::Builder::new()
            .name("qs-uffd-monitor".into())
            .spawn(move || {
                // Thread start-up (signal stack, thread-locals) allocates and maps
                // memory: finish it before `new` returns, then never again.
                started_in_thread.wait();
                reader_loop(&for_thread)
            })?;
        started.wait();
        tracing::debug!(features = granted, "userfaultfd monitor started");
        Ok(UffdMonitor {
            shared,
            features: granted,
            reader: Mutex::new(Some(reader)),
        })
    }

    /// The process-wide monitor shared by every cache (a range can belong
    /// to one userfaultfd only). Created on first use; a failure is retried
    /// on the next call.
    pub fn global() -> io::Result<Arc<UffdMonitor>> {
        static GLOBAL: Mutex<Option<Arc<UffdMonitor>>> = Mutex::new(None);
        let mut g = GLOBAL.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = g.as_ref() {
            return Ok(Arc::clone(m));
        }
        let m = Arc::new(UffdMonitor::new()?);
        *g = Some(Arc::clone(&m));
        Ok(m)
    }

    /// The features the kernel granted.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// True when `UFFD_FEATURE_WP_ASYNC` was granted (any memory type can be watched).
    pub fn any_memory_type(&self) -> bool {
        self.features & uffd::FEATURE_WP_ASYNC != 0
    }

    /// Reader counters.
    pub fn counters(&self) -> UffdCounters {
        let c = &self.shared.counters;
        UffdCounters {
            unmap: c[0].load(SeqCst),
            remove: c[1].load(SeqCst),
            remap: c[2].load(SeqCst),
            unexpected: c[3].load(SeqCst),
            read_errors: c[4].load(SeqCst),
        }
    }
}

impl Monitor for UffdMonitor {
    fn name(&self) -> &'static str {
        "uffd"
    }

    fn attach(&self, sink: Arc<dyn InvalidationSink>) -> io::Result<SinkId> {
        self.shared.sinks.attach(sink)
    }

    fn detach(&self, id: SinkId) -> Option<Arc<dyn InvalidationSink>> {
        self.shared.sinks.detach(id)
    }

    fn subscribe(&self, start: usize, len: usize, cookie: u64) -> io::Result<Watch> {
        let page = page_size();
        let first = start & !(page - 1);
        let end = start
            .checked_add(len)
            .and_then(|e| e.checked_add(page - 1))
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?
            & !(page - 1);
        if !self.shared.is_known((first, end)) {
            self.shared.uffd.register(first, end - first, uffd::MODE_WP)?;
            self.shared.remember((first, end));
        }
        Ok(Watch {
            cookie,
            token: [first as u64, end as u64],
        })
    }

    fn unsubscribe(&self, _watch: &Watch) {
        // Deliberately a no-op: see the module docs.
    }

    fn sync(&self) {
        let s = &self.shared;
        let target = s.started.load(SeqCst);
        let mut spins = 0u32;
        while s.finished.load(SeqCst) < target {
            if spins < 64 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
    }
}

impl Drop for UffdMonitor {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        let _ = self.shared.wake.signal();
        let handle = self.reader.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

/// The reader thread: allocation-free after start.
fn reader_loop(s: &Shared) {
    let mut buf = [UffdMsg::default(); 64];
    while !s.stop.load(SeqCst) {
        let (ready, _woken) = match uffd::poll_readable(s.uffd.as_raw_fd(), s.wake.as_raw_fd()) {
            Ok(r) => r,
            Err(_) => {
                s.counters[4].fetch_add(1, SeqCst);
                continue;
            }
        };
        if !ready {
            continue;
        }
        let round = s.started.fetch_add(1, SeqCst) + 1;
        loop {
            match s.uffd.read_events(&mut buf) {
                Ok(0) => break,
                Ok(n) => buf[..n].iter().for_each(|m| handle(s, m.decode())),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    s.counters[4].fetch_add(1, SeqCst);
                    break;
                }
            }
        }
        s.finished.store(round, SeqCst);
    }
}

fn handle(s: &Shared, ev: UffdEvent) {
    match ev {
        UffdEvent::Unmap { start, end } => {
            s.counters[0].fetch_add(1, SeqCst);
            s.forget(start as usize, end as usize);
            s.sinks.dispatch(start as usize, end as usize);
        }
        UffdEvent::Remove { start, end } => {
            s.counters[1].fetch_add(1, SeqCst);
            s.sinks.dispatch(start as usize, end as usize);
        }
        UffdEvent::Remap { from, len, .. } => {
            s.counters[2].fetch_add(1, SeqCst);
            let (from, to) = (from as usize, from.saturating_add(len) as usize);
            s.forget(from, to);
            s.sinks.dispatch(from, to);
        }
        UffdEvent::Pagefault { .. } | UffdEvent::Fork | UffdEvent::Unknown(_) => {
            s.counters[3].fetch_add(1, SeqCst);
        }
    }
}
