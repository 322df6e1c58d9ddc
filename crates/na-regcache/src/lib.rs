//! `na-regcache`: a memory registration cache with memory-map monitors.
//!
//! RDMA needs memory registered (pinned, translated) before a NIC may touch
//! it, and registering is expensive, so registrations are cached. A cached
//! registration is only correct while the virtual range still maps the
//! pages that were pinned; a monitor tells the cache when that stops being
//! true, *before* any later lookup can return the stale registration.
//!
//! * [`Cache`] is generic over a [`Registrar`] (the verbs plugin plugs in
//!   `ibv_reg_mr`; [`UringRegistrar`] pins pages with io_uring fixed buffers);
//!   [`Cache::get`] returns a reference-counted [`Registration`] carrying a
//!   validity flag ([`Registration::is_valid`], three atomic loads for a
//!   cached one: the flag, the fork guard and whether it is tracked
//!   outside the cache; one held outside it, uncached or for peers, also
//!   reads its tracking slot).
//! * Monitors implement [`Monitor`]: [`UffdMonitor`] (userfaultfd, made
//!   synchronous; see [`monitor::uffd`] for the argument) and [`AllocMonitor`]
//!   fed by the opt-in [`InvalidatingAlloc`] global allocator.
//! * Configuration: [`CacheConfig`] by API or `QS_MR_CACHE_MAX_COUNT`,
//!   `QS_MR_CACHE_MAX_SIZE`, `QS_MR_CACHE_MONITOR=uffd|alloc|none|disabled`,
//!   `QS_MR_CACHE_CONSISTENCY=in-flight|returned` and
//!   `QS_MR_CACHE_MAP_WATCH=off|on` (values and defaults: [`config`]).
//!
//! # What each monitor catches
//!
//! Filled from `tests/corruption.rs` (io_uring pins + pagemap frames, run as
//! root on Linux 6.18). ✔ = zero stale data and frames; ✘ = the scenario
//! corrupts data; "n/a" = nothing to catch (the kernel keeps pinned pages).
//! The `none` column proves every other scenario really corrupts without a
//! monitor.
//!
#![doc = include_str!("coverage.md")]
//!
//! # userfaultfd on this kernel (6.18), as found
//!
//! * `vm.unprivileged_userfaultfd=0` only restricts non-root callers
//!   (without `CAP_SYS_PTRACE`); as root the syscall works. Root or the
//!   sysctl at 1 (or `/dev/userfaultfd` access) is needed in production.
//! * Features granted: `EVENT_UNMAP|EVENT_REMOVE|EVENT_REMAP` and `WP_ASYNC`.
//! * Registration uses write-protect mode without ever write-protecting a
//!   page, so no fault ever blocks on the monitor (`MISSING` mode would
//!   block faults, and with `UFFD_USER_MODE_ONLY` kernel-mode faults such as
//!   `read(2)` into a dropped page would fail with `EFAULT`); with
//!   `WP_ASYNC` the kernel accepts this on anonymous, shmem/memfd, THP and
//!   brk memory alike (but see below for shared mappings).
//! * While an UNMAP/REMOVE/REMAP event is prepared but not yet read, a
//!   zero-length `UFFDIO_ZEROPAGE` fails with `EAGAIN` (`EINVAL` otherwise);
//!   lookups wait on that, because the old mapping is gone (its address
//!   reusable) before the event is even queued. [`UffdMonitor::new`]
//!   checks it against a real in-flight unmap.
//! * A range belongs to one userfaultfd only, so all caches share
//!   [`UffdMonitor::global`]; memory registered by another userfaultfd user
//!   is refused (`EBUSY`) and handed out uncached.
//! * No event reports a *shared* mapping (memfd, shmem, hugetlbfs or other
//!   file `MAP_SHARED`, shared anonymous memory) losing its pages through
//!   its file: `ftruncate`, `fallocate(PUNCH_HOLE)`, `MADV_REMOVE` through
//!   another mapping. So the userfaultfd monitor refuses any range with a
//!   shared mapping, and it is handed out uncached (registered for each
//!   `get`; hold such a registration only as long as the file cannot lose
//!   those pages). The allocator monitor sees none of these changes either
//!   (the `file_*` rows above); with it or a monitor of your own, call
//!   [`Cache::invalidate`] after changing such a file. Ranges of hugetlbfs
//!   pages are registered whole huge pages at a time (Linux 6.11+: older
//!   kernels do not tell the page size, and such a range not aligned to
//!   its huge pages is handed out uncached).
//! * **Not reported, not refused:** a file mapped `MAP_PRIVATE` whose file
//!   is truncated below the registered range. The kernel zaps the private
//!   copies too and sends no event, so a cached registration (and any
//!   handle, whose flag stays set) pins pages the mapping no longer shows
//!   (the `file_private_truncate` row). After truncating such a file, call
//!   [`Cache::invalidate`] for the mapping (which clears its handles'
//!   flags too), or register such data from anonymous memory; see
//!   `docs/REGCACHE.md`.
//! * **Not reported, not refused:** a SysV segment attached over
//!   registered memory with `shmat(..., SHM_REMAP)`: the kernel replaces
//!   the mapping without an event (the `shmat_remap` row). Call
//!   [`Cache::invalidate`] for the range after such an attach.
//!
//! See [`monitor::uffd`] for why a lookup can never return a registration
//! of pages unmapped before it started (including by an unmap whose call
//! has not returned yet but whose address was already reused), and
//! `docs/REGCACHE.md` for the benchmark figures.
//!
//! # Locking rules
//!
//! The cache lock is never held across a registrar call, an allocation, a
//! memory free or a tracing event; monitor threads and the allocator hook
//! only take that lock, and never allocate or free memory themselves. This
//! is what rules out the deadlocks libfabric hit (#5554, #5687, #9594).
//! Allocating counts too: an allocator that purges memory inside `malloc`
//! (jemalloc's decay, mimalloc's collect) may `madvise` or unmap a watched
//! range there, and userfaultfd then holds the allocating thread until the
//! reader, waiting for that thread's lock, reads the event.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod cache;
pub mod config;
mod error;
pub mod monitor;
mod registrar;
mod stats;
#[allow(unsafe_code)]
mod sys;
mod uring;

pub use cache::{Cache, Registration, COALESCE_WAIT, MAX_HANDLES, SETTLE_BUDGET};
pub use config::{CacheConfig, Consistency, MonitorChoice};
pub use error::{Error, Result};
pub use monitor::alloc::AllocMonitor;
pub use monitor::uffd::{UffdCounters, UffdMonitor, REMOVE_SETTLE};
pub use monitor::{InvalidationSink, Monitor, SinkId, Watch};
pub use registrar::{Access, Registrar};
pub use stats::CacheStats;
pub use sys::alloc::InvalidatingAlloc;
pub use uring::{FixedBuffer, UringRegistrar};

/// How many cache locks the calling thread holds, or `None` when they are
/// not counted (feature `lock-audit` without debug assertions). For tests:
/// a global allocator that sees a thread allocate or free while this is
/// above zero has found a broken locking rule (see "Locking rules").
/// Allocation-free, so callable from inside a global allocator.
#[cfg(feature = "lock-audit")]
pub fn cache_locks_held() -> Option<usize> {
    sys::brlock::held()
}
