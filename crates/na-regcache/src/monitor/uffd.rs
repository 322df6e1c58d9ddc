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
//! # Shared mappings are refused
//!
//! userfaultfd reports changes made *through the registered mapping*
//! (`munmap`, `madvise`, `mremap` of it). A shared mapping (`MAP_SHARED`
//! of a memfd, shmem, hugetlbfs or other file, or shared anonymous memory)
//! also loses its pages when its file does: `ftruncate` shrinking it,
//! `fallocate(PUNCH_HOLE)`, `MADV_REMOVE` through another mapping (in this
//! process or another). The kernel unmaps the pages from every mapping
//! and sends no event, and a cached registration would go on pinning the
//! old pages for every later lookup (`tests/corruption.rs`, the `file_*`
//! scenarios). So [`Monitor::subscribe`] refuses (`Unsupported`) a range
//! any of whose mappings is shared, and the cache hands it out uncached:
//! a registration of the current pages for the operation at hand. It asks
//! the kernel after its `UFFDIO_REGISTER` (a mapping that replaces the
//! ones it saw then sends an UNMAP event), with the `PROCMAP_QUERY` ioctl
//! on `/proc/self/maps` (Linux 6.11+, ~0.6 µs per mapping) or, on older
//! kernels, by reading that file (tens of µs, more with many mappings);
//! only misses of ranges not registered already pay it. Without
//! `/proc/self/maps` every range is refused.
//!
//! A range of hugetlbfs pages is registered whole huge pages at a time:
//! `UFFDIO_REGISTER` refuses (`EINVAL`) a range not aligned to them, and
//! the monitor then rounds the range out to the mapping's page size
//! (which only `PROCMAP_QUERY` tells: on older kernels such a range stays
//! refused, and uncached).
//!
//! # Why lookups can never see a stale registration
//!
//! The kernel queues an UNMAP/REMOVE/REMAP event and blocks the thread that
//! called `munmap` (`madvise`, `mremap`, `brk`, `mmap(MAP_FIXED)`) until a
//! `read(2)` of the userfaultfd *dequeues* the event; it then lets that
//! thread return, which can happen before the reader has looked at the
//! message. To close that window the reader thread
//!
//! 1. sleeps in `poll` until the descriptor is readable,
//! 2. bumps `started` (SeqCst) **before** calling `read`,
//! 3. reads every pending message and invalidates the matching entries in
//!    every attached cache (under each cache's lock),
//! 4. stores `finished = started`.
//!
//! A change can also be observed *before* the call that makes it returns,
//! and even before its event is queued: `munmap` and `mremap` remove the
//! old mapping, release the mmap lock and only then queue the event, and
//! the reader may not run for milliseconds after that. In between, the
//! range is free: another thread's `mmap` (or `malloc`) can return the same
//! address with new pages, and a lookup of it would find the old entry and
//! hand out a registration of the old pages. (This is how the multithreaded
//! stress test saw 1-2 stale transfers in 1,000 on a loaded machine: one
//! buffer's address was reused by another while the first buffer's unmap
//! was still in flight.) The kernel counts such changes per userfaultfd in
//! `mmap_changing`: raised when the event is *prepared*, under the mmap
//! lock and before the old mapping disappears, and lowered only after a
//! `read` dequeued the event and the changing thread woke up.
//!
//! [`Monitor::sync_in_flight`], which every cache lookup calls before
//! taking its lock (with the default [`crate::Consistency::InFlight`]),
//! (a) probes `mmap_changing` (a zero-length `UFFDIO_ZEROPAGE`, which
//! fails with `EAGAIN` while it is non-zero and takes no lock) until it is
//! zero, yielding meanwhile, unless the map watch shows that nothing was
//! mapped since a quiet probe (below), then (b) loads `started` and waits
//! until `finished` reaches it.
//!
//! Suppose a lookup in thread B observes anything of a change C of a
//! watched range (C's call returned, or B maps or touches memory that C
//! freed: anything that happens after C's mmap-lock section). C's count was
//! raised in that section, so B's probe in (a) sees it until it is
//! lowered, and it is lowered only after the `read` that dequeued C's event
//! released C's thread. That `read` began after step 2 of its round (the
//! kernel's wait-queue spinlock orders the reader's `started` store before
//! C's wake-up, and C's decrement after it), so B observes in (b)
//! `started` at least that round and waits for its step 4: the entry is gone
//! before B searches the index. Changes C that B observes nothing of are
//! concurrent with B. Step (a) only waits while some change of a watched
//! range is between its preparation and its thread's wake-up; the count is
//! per userfaultfd, so other userfaultfd users do not delay it
//! ([`UffdCounters::inflight_waits`] counts the waits). With
//! [`crate::Consistency::Returned`] lookups call [`Monitor::sync`], which
//! skips (a): it sees every change whose call returned, since the call
//! returns only after the read. [`UffdMonitor::new`]
//! checks the probe against a real in-flight unmap and refuses to start if
//! the kernel does not report it.
//!
//! # Skipping the probe: the map watch (opt-in, not sound with `mremap`)
//!
//! **Off by default.** The argument below assumed that every way of
//! getting new memory at a freed address makes the kernel write a perf
//! side-band record; a moving or growing `mremap` writes none (checked on
//! Linux 6.18: the ring head does not move), and glibc's `realloc` of a
//! large block is such an `mremap`. A lookup that skipped its probe could
//! then hit the entry of an unmap still in flight
//! (`tests/inflight.rs`, `an_address_freed_in_flight_and_mremapped_is_never_served_stale`).
//! [`crate::CacheConfig::map_watch`] turns it on for processes that never
//! `mremap`.
//!
//! The probe in (a) is a system call on every lookup (~0.45 µs on the dev
//! VM, where a hit otherwise costs ~0.06 µs). It is only needed when B can
//! observe a change C *before* C's call returned, and the only way to do
//! that without racing C on the same memory is to be handed new memory at
//! an address C freed: by `mmap`, `brk`, `mremap` or `mprotect` of a
//! reserved range, in some thread. Each of those but `mremap` makes the kernel write a
//! perf side-band record (`PERF_RECORD_MMAP`) into a ring mapped in this
//! process and advance the ring's head *before the call returns*
//! (`sys::perf::MapWatch`, one ring per CPU, every thread
//! attached). So a lookup loads the sum of the heads (the stamp; one load
//! per CPU, no system call) and skips the probe if a quiet probe already
//! followed a load of the same stamp (`clean_stamp`, raised with
//! `fetch_max` after every probe that found nothing in flight).
//!
//! Why that is enough: say B got new memory at an address C freed. The
//! call that gave it wrote a record R after C's mmap-lock section (the
//! address was free only then) and before B's lookup loads the stamp, so
//! every ring load of that lookup comes after R. If the stamp B loads
//! equals the stamp some lookup W loaded before a quiet probe, then W's
//! loads cannot all precede R (the heads only grow: a W load before R on
//! R's ring must be offset by a W load on another ring made after one of
//! B's, which are after R), so W's quiet probe came after R, hence after
//! C raised its count: the count was lowered again, C's event had been
//! read and `started` bumped, and B's step (b) waits for that round (B's
//! SeqCst load of `clean_stamp` reads W's store). Otherwise B probes.
//!
//! What the map watch does not see: memory that changes under B without a
//! new mapping. That is `madvise` (its event is queued *before* the pages
//! go, see below: B's lookup returns a registration of pages still
//! present, and the reader clears its validity flag when it reads the
//! event, as in any lookup that races a change) and a `mremap`/`mmap` with
//! `MREMAP_FIXED`/`MAP_FIXED` over an address the caller already owns
//! (`MAP_FIXED` is recorded; `MREMAP_FIXED` onto a mapped target is not,
//! but its target's own UNMAP event is read before the call returns). CPUs
//! brought online after the watch opened have no ring. Without perf side-band
//! events (`kernel.perf_event_paranoid` 3, seccomp) or with
//! [`crate::CacheConfig::map_watch`] off, every in-flight lookup probes.
//! [`UffdCounters::probes`] counts the probes.
//!
//! # `madvise`: the event comes before the change
//!
//! UNMAP and REMAP are queued after the old pages are gone. REMOVE
//! (`MADV_DONTNEED`, `MADV_REMOVE`, `MADV_FREE`) is queued *before*: the
//! advising thread raises `mmap_changing`, queues REMOVE, sleeps until it is
//! read, lowers the count, and only then retakes the mmap lock and drops the
//! pages. While it sleeps, (a) above holds every lookup back. Between its
//! wake-up and the zap, though, a lookup could register (pin) pages that are
//! about to be dropped, and a cached entry would hand them to every later
//! lookup. So the reader marks each REMOVE range as *settling* (before it
//! invalidates the caches; in a fixed table of 32 ranges, where a burst of
//! more merges the closest two into one covering both, never widening to
//! the whole address space), until [`REMOVE_SETTLE`] after the first `sync`
//! whose probe found the count lowered (the advising thread awake). The
//! advising thread is running in the kernel by the time the count is
//! lowered and drops the pages right after taking the mmap lock; the
//! settle time is a bound on that, the one timing assumption of this
//! monitor. Userspace cannot observe the end of the zap.
//!
//! A miss (or `get_unshared`) whose span overlaps a settling range waits,
//! before it pins, for the settle time to end ([`Monitor::wait_settled`]:
//! it sleeps, or starts a settle time not started yet with a probe;
//! [`UffdCounters::settle_waits`] counts the waits), so it pins the pages
//! that stay and its registration stays valid until the memory changes
//! again. Only misses of a range discarded moments ago wait (up to
//! `REMOVE_SETTLE`); hits never look. After the pin the cache checks again
//! under the lock the reader's invalidation takes ([`Monitor::settling`]),
//! so a miss either inserts before the invalidation (which then drops it)
//! or sees the mark of a discard read since its wait: it then registers
//! again after waiting (a settle retry), and past its retries or its wait
//! budget hands the registration out uncached, its validity flag clearing
//! when the settle time ends ([`UffdCounters::settling_after_pin`] counts
//! the checks that found the range settling). After a wait the miss looks
//! its request up again (another thread may have registered it: a hit)
//! and waits again if its span grew over another settling range. All the
//! waits of one miss share [`crate::SETTLE_BUDGET`] (four settle times),
//! so a range discarded again and again delays it that long at most
//! (`docs/REGCACHE.md` gives the worst case of a miss, and the
//! multithreaded tests: `tests/settle_race.rs`).
//! **Before 2026-11-29** a miss of a settling range pinned at once
//! and was handed out uncached with that deadline: a registration made
//! within the settle time of a discard that had long been done (glibc
//! trims thread arenas with `MADV_DONTNEED`; a buffer allocated there and
//! registered soon after) went stale when the settle time ended though
//! nothing had changed since, and na-verbs failed a described handle's
//! transfers (`tests/settle.rs`).
//!
//! The reader never allocates, frees or logs in its loop: freeing memory
//! could itself unmap a registered page and block the reader on its own
//! event. Caches never allocate or free memory or call the registrar while
//! holding the lock the reader takes, so the reader cannot deadlock with
//! them (the libfabric deadlocks #5554, #5687, #9594 were of that kind;
//! allocating counts because an allocator may purge, so `madvise` or
//! unmap, memory inside `malloc`).
//!
//! A range is `UFFDIO_UNREGISTER`ed when the last watch covering it goes
//! (`ranges.rs` counts watches per page range, so pages shared with a
//! neighbouring entry stay registered): a registration splits its VMA,
//! and registrations kept for good would creep towards
//! `vm.max_map_count` in a process that registers many scattered buffers.
//!
//! While registrations persist, the monitor remembers (in a fixed,
//! direct-mapped table) page ranges it registered and skips the
//! `UFFDIO_REGISTER` ioctl when the same range is subscribed again. The
//! reader forgets every remembered range an UNMAP or REMAP overlaps
//! *before* it invalidates the caches, so a lookup that observes the
//! invalidation (or waits for it in `sync`) can no longer skip the ioctl
//! for the new mapping; REMOVE (`madvise`) keeps the VMA registered and
//! forgets nothing. A range is remembered only if no forget ran between
//! the lookup that found it unknown and the end of its `UFFDIO_REGISTER`:
//! otherwise an unmap racing the registration could be forgotten before it
//! is remembered, and the table would claim a later mapping at the same
//! address is registered when it is not (no event would ever report it).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::ranges::RangeCounts;
use super::{InvalidationSink, Monitor, SinkId, SinkSet, Watch};
use crate::sys::mem::page_size;
use crate::sys::perf::MapWatch;
use crate::sys::uffd::{self, EventFd, Uffd};
use crate::sys::vma::Vmas;
use known::{Known, SETS, WAYS};
use reader::reader_loop;
use settling::{Settling, SETTLING_SLOTS};
use sync::check_in_flight_probe;

mod known;
mod reader;
mod settling;
mod sync;

/// How long a REMOVE range stays settling once its advising thread is known
/// to be awake (the first quiet probe after the event was read; see the
/// module docs): a miss overlapping it waits for it to end before pinning.
pub const REMOVE_SETTLE: Duration = Duration::from_millis(100);

const REQUIRED: u64 = uffd::FEATURE_EVENT_UNMAP | uffd::FEATURE_EVENT_REMOVE | uffd::FEATURE_EVENT_REMAP;

/// Counters of the userfaultfd reader and of [`Monitor::sync`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
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
    /// `sync` calls that found a change of a watched range in flight (its
    /// event not read yet) and waited for it.
    pub inflight_waits: u64,
    /// Failed in-flight probes in `sync` (should stay zero).
    pub probe_errors: u64,
    /// [`Monitor::settling`] calls that found the range settling after a
    /// REMOVE (`madvise`) event. The cache makes that check after the pin,
    /// under its lock (every miss and `get_unshared` call): each count is
    /// a registration made while its range settled (a discard read since
    /// the miss's wait, or one its wait budget ran out on). The cache then
    /// throws the registration away and registers again after waiting
    /// (a settle retry), or, once its retries or its wait budget are spent,
    /// hands it out uncached, valid only until the settle time ends.
    /// (Named `settling_uncached` before 2026-11-29, when every such check
    /// still handed the registration out uncached.)
    pub settling_after_pin: u64,
    /// In-flight probes made (one system call each). With the map watch,
    /// lookups probe only after something was mapped since the last quiet
    /// probe; without it, every in-flight lookup probes.
    pub probes: u64,
    /// Waits of misses (and `get_unshared` calls) that found their span
    /// settling after a REMOVE (`madvise`) event, for its settle time to
    /// end before pinning it ([`Monitor::wait_settled`] calls that
    /// waited). One miss may wait more than once: again when its span,
    /// looked at after a wait, grew over another settling range, and
    /// before a settle retry.
    pub settle_waits: u64,
}

struct Shared {
    uffd: Uffd,
    wake: EventFd,
    stop: AtomicBool,
    started: AtomicU64,
    finished: AtomicU64,
    sinks: SinkSet,
    counters: [AtomicU64; 10],
    /// Stamps of address-space growth, when available (see the module docs).
    map_watch: Option<MapWatch>,
    /// Queries of this process's mappings (shared? huge pages?); `None`
    /// when `/proc/self/maps` could not be opened (every range refused).
    vmas: Option<Vmas>,
    /// One more than the latest [`MapWatch::stamp`] that a quiet probe
    /// followed (0: none yet).
    clean_stamp: AtomicU64,
    known: Mutex<Known>,
    /// Watches per page range: a range is unregistered when none is left.
    /// Held across the register/unregister ioctls, so a subscribe and an
    /// unsubscribe of overlapping ranges never undo each other.
    subs: Mutex<RangeCounts>,
    epoch: Instant,
    /// The latest settling deadline (ns since `epoch`): a lock-free "nothing
    /// is settling" check.
    settle_until: AtomicU64,
    /// Some settling range's settle time has not started yet.
    settle_unarmed: AtomicBool,
    settling: Mutex<Settling>,
}

impl Shared {
    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }
}

/// `[start, start+len)` rounded out to multiples of `page`.
fn round_out(start: usize, len: usize, page: usize) -> io::Result<(usize, usize)> {
    let end = start
        .checked_add(len)
        .and_then(|e| e.checked_add(page - 1))
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?
        & !(page - 1);
    Ok((start & !(page - 1), end))
}

impl Shared {
    /// Removes one watch of `[first, end)` (under `subs`, the lock held)
    /// and unregisters what no watch covers any more.
    fn release(&self, subs: &mut RangeCounts, first: usize, end: usize) {
        for (s, e) in subs.remove(first, end) {
            // No watch covers it any more: the kernel may merge its VMAs
            // back. (Already unmapped or remapped parts are not ours and
            // are left alone by the kernel; an error changes nothing.)
            self.forget(s, e);
            if let Err(err) = self.uffd.unregister(s, e - s) {
                tracing::debug!(start = s, len = e - s, error = %crate::error::Chain(&err), "UFFDIO_UNREGISTER failed");
            }
        }
    }

    /// `Ok` when no mapping of `[first, end)` is shared; an `Unsupported`
    /// error otherwise, or when the mappings cannot be told.
    fn private_only(&self, first: usize, end: usize) -> io::Result<()> {
        super::private_only(self.vmas.as_ref(), first, end, "userfaultfd")
    }

    /// The huge page size of `[first, end)`'s mappings, if larger than the
    /// base page (hugetlbfs); `None` when not, or unknown.
    fn huge_page(&self, first: usize, end: usize) -> Option<usize> {
        let b = self.vmas.as_ref()?.backing(first, end).ok()?;
        (b.page > page_size() && b.page.is_power_of_two()).then_some(b.page)
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
    /// UNMAP|REMOVE|REMAP (+ WP_ASYNC when available) and starts the
    /// reader; no map watch (see [`with_map_watch`](Self::with_map_watch)).
    pub fn new() -> io::Result<UffdMonitor> {
        Self::with_map_watch(false)
    }

    /// Like [`UffdMonitor::new`]; `map_watch: false` never opens the map
    /// watch, so every in-flight lookup probes (one system call).
    pub fn with_map_watch(map_watch: bool) -> io::Result<UffdMonitor> {
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
        check_in_flight_probe(&fd)?;
        let map_watch = if map_watch {
            MapWatch::open()
                .inspect_err(|e| {
                    tracing::info!(error = %crate::error::Chain(e), "no perf map watch: every in-flight lookup makes a system call")
                })
                .ok()
        } else {
            None
        };
        let vmas = Vmas::open()
            .inspect_err(|e| {
                tracing::warn!(error = %crate::error::Chain(e), "/proc/self/maps unavailable: userfaultfd refuses every range (uncached)")
            })
            .ok();
        let shared = Arc::new(Shared {
            vmas,
            uffd: fd,
            wake: EventFd::new()?,
            stop: AtomicBool::new(false),
            started: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            sinks: SinkSet::new(),
            counters: Default::default(),
            map_watch,
            clean_stamp: AtomicU64::new(0),
            subs: Mutex::new(RangeCounts::default()),
            known: Mutex::new(Known {
                sets: [[(0, 0); WAYS]; SETS],
                forgets: 0,
            }),
            epoch: Instant::now(),
            settle_until: AtomicU64::new(0),
            settle_unarmed: AtomicBool::new(false),
            settling: Mutex::new(Settling {
                ranges: [(0, 0, 0, 0); SETTLING_SLOTS],
                marks: 0,
            }),
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
    /// to one userfaultfd only). Created on first use, without the map
    /// watch (see [`global_with`](Self::global_with)); a failure is retried
    /// on the next call.
    pub fn global() -> io::Result<Arc<UffdMonitor>> {
        Self::global_with(false)
    }

    /// [`UffdMonitor::global`]; the call that creates it decides whether it
    /// opens the map watch ([`crate::CacheConfig::map_watch`]).
    ///
    /// A process forked from one that had a monitor gets its own: the
    /// parent's has no reader thread in the child, its userfaultfd watches
    /// the parent's address space, and its perf rings are not copied by
    /// `fork` (`VM_DONTCOPY`). The parent's copy is leaked in the child
    /// (dropping it would join a thread that does not exist there).
    pub fn global_with(map_watch: bool) -> io::Result<Arc<UffdMonitor>> {
        Self::global_inner(map_watch)
    }

    /// True while another cache can be attached (fewer than
    /// [`MAX_SINKS`](super::MAX_SINKS); a hint, see `SinkSet::has_room`).
    pub fn has_room(&self) -> bool {
        self.shared.sinks.has_room()
    }

    fn global_inner(map_watch: bool) -> io::Result<Arc<UffdMonitor>> {
        static GLOBAL: Mutex<Option<(u32, Arc<UffdMonitor>)>> = Mutex::new(None);
        let mut g = GLOBAL.lock().unwrap_or_else(|p| p.into_inner());
        let pid = std::process::id();
        match g.take() {
            Some((owner, m)) if owner == pid => {
                *g = Some((owner, Arc::clone(&m)));
                return Ok(m);
            }
            Some((_, inherited)) => std::mem::forget(inherited),
            None => {}
        }
        let m = Arc::new(UffdMonitor::with_map_watch(map_watch)?);
        *g = Some((pid, Arc::clone(&m)));
        Ok(m)
    }

    /// The number of CPU rings of the map watch, `None` when it is not
    /// open (then every in-flight lookup probes with a system call).
    pub fn map_watch_rings(&self) -> Option<usize> {
        self.shared.map_watch.as_ref().map(MapWatch::rings)
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
            inflight_waits: c[5].load(SeqCst),
            probe_errors: c[6].load(SeqCst),
            settling_after_pin: c[7].load(SeqCst),
            probes: c[8].load(SeqCst),
            settle_waits: c[9].load(SeqCst),
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

    /// Refuses (`Unsupported`) a range any of whose mappings is shared
    /// (see the module docs, "Shared mappings"), and a range whose
    /// mappings cannot be told; rounds a range of hugetlbfs pages out to
    /// them.
    fn subscribe(&self, start: usize, len: usize, cookie: u64) -> io::Result<Watch> {
        let (mut first, mut end) = round_out(start, len, page_size())?;
        let sh = &*self.shared;
        let mut subs = sh.subs.lock().unwrap_or_else(|p| p.into_inner());
        subs.add(first, end);
        let mut known = sh.is_known((first, end));
        if known.is_err() {
            let mut registered = sh.uffd.register(first, end - first, uffd::MODE_WP);
            if let Some(huge) = registered
                .as_ref()
                .err()
                .filter(|e| e.raw_os_error() == Some(libc::EINVAL))
                .and_then(|_| sh.huge_page(first, end))
            {
                // hugetlbfs: UFFDIO_REGISTER wants whole huge pages.
                subs.remove(first, end);
                (first, end) = round_out(start, len, huge)?;
                subs.add(first, end);
                known = sh.is_known((first, end));
                registered = match known {
                    Ok(()) => Ok(()),
                    Err(_) => sh.uffd.register(first, end - first, uffd::MODE_WP),
                };
            }
            if let Err(e) = registered {
                subs.remove(first, end);
                return Err(e);
            }
            if let Err(forgets) = known {
                // Checked after the registration: a mapping that replaces
                // the ones seen here is reported by an UNMAP event.
                if let Err(e) = sh.private_only(first, end) {
                    sh.release(&mut subs, first, end);
                    return Err(e);
                }
                sh.remember((first, end), forgets);
            }
        }
        drop(subs);
        Ok(Watch {
            cookie,
            token: [first as u64, end as u64],
        })
    }

    fn unsubscribe(&self, watch: &Watch) {
        let (first, end) = (watch.token[0] as usize, watch.token[1] as usize);
        let mut subs = self.shared.subs.lock().unwrap_or_else(|p| p.into_inner());
        self.shared.release(&mut subs, first, end);
    }

    fn settling(&self, start: usize, end: usize) -> Option<Duration> {
        let settling = self.shared.is_settling(start, end);
        if settling.is_some() {
            self.shared.counters[7].fetch_add(1, SeqCst);
        }
        settling
    }

    fn wait_settled(&self, start: usize, end: usize, limit: Duration) -> Option<Duration> {
        self.shared.wait_settled(start, end, limit)
    }

    fn sync(&self) {
        self.shared.sync(false);
    }

    fn sync_in_flight(&self) {
        self.shared.sync(true);
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
