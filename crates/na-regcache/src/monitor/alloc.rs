//! The allocator-hook monitor: the Rust analogue of libfabric's memhooks
//! without patching code. A binary opts in with
//!
//! ```
//! #[global_allocator]
//! static A: na_regcache::InvalidatingAlloc<std::alloc::System> =
//!     na_regcache::InvalidatingAlloc::new(std::alloc::System);
//!
//! fn main() {
//!     drop(vec![0u8; 16]);
//!     assert!(na_regcache::AllocMonitor::installed());
//! }
//! ```
//!
//! Every `dealloc` and `realloc` of a block of at least
//! [`AllocMonitor::threshold`] bytes invalidates the registrations that
//! overlap the block *before* the block goes back to the inner allocator, so
//! the hook is synchronous: once `free` returned, no lookup can hit the old
//! registration. The hook is allocation-free: it takes a read lock on a
//! fixed array of sinks and each cache's lock, whose holders never allocate
//! or free memory.
//!
//! It sees only Rust heap blocks: not the stack, statics, `mmap`,
//! `madvise`, `mremap` or foreign (C) allocations, and not the allocator
//! trimming small freed blocks back to the kernel. Use `uffd` for those.
//!
//! Ranges with a shared mapping (a memfd, shmem or other file, shared
//! anonymous memory) are refused, so the cache registers them uncached,
//! as the `uffd` monitor does: their file can lose its pages
//! (`ftruncate`, `fallocate(PUNCH_HOLE)`, `MADV_REMOVE` elsewhere) with
//! no free to hook. Telling them costs a `PROCMAP_QUERY` (about 0.6 us)
//! per subscribed range, on a cache miss only.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use super::{InvalidationSink, Monitor, SinkId, SinkSet, Watch};
use crate::sys::mem::StaticForkGuard;
use crate::sys::vma::Vmas;

static SINKS: SinkSet = SinkSet::new();
/// Made at the first attach: in a forked child it reads as "not the
/// creator", and the hook then never takes the sink list's lock, which a
/// parent thread may have held (or queued for) at the fork: the child's
/// first large free would wait for it forever.
static SINKS_GUARD: StaticForkGuard = StaticForkGuard::new();
static THRESHOLD: AtomicUsize = AtomicUsize::new(4096);
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The process that opened it, and its mappings (`None`: `/proc/self/maps`
/// could not be opened, and every range is refused): see `subscribe`.
static VMAS: OnceLock<(u32, Option<Vmas>)> = OnceLock::new();

/// False in a forked child of a process whose hook had caches attached.
#[inline]
fn sinks_usable() -> bool {
    SINKS_GUARD.in_creator().unwrap_or(true)
}

/// Called by `InvalidatingAlloc` on every allocation (marks the hook installed).
#[inline]
pub(crate) fn on_alloc() {
    if !INSTALLED.load(Relaxed) {
        INSTALLED.store(true, Relaxed);
    }
}

/// Called by `InvalidatingAlloc` before a block is released or resized.
#[inline]
pub(crate) fn on_release(addr: usize, size: usize) {
    if size < THRESHOLD.load(Relaxed) || SINKS.is_empty() || !sinks_usable() {
        return;
    }
    SINKS.dispatch(addr, addr.saturating_add(size));
}

/// Handle on the process-global allocator hook.
#[derive(Debug, Default)]
pub struct AllocMonitor {
    _private: (),
}

impl AllocMonitor {
    /// The monitor (all handles share the process-global hook state).
    pub fn global() -> Arc<AllocMonitor> {
        Arc::new(AllocMonitor { _private: () })
    }

    /// True once the binary's `#[global_allocator]` is an `InvalidatingAlloc`
    /// (set by its first allocation).
    pub fn installed() -> bool {
        INSTALLED.load(Relaxed)
    }

    /// Blocks smaller than this are released without a look at the caches.
    pub fn threshold() -> usize {
        THRESHOLD.load(Relaxed)
    }

    /// Sets the size threshold (default 4096: one page).
    pub fn set_threshold(bytes: usize) {
        THRESHOLD.store(bytes, Relaxed);
    }
}

impl Monitor for AllocMonitor {
    fn name(&self) -> &'static str {
        "alloc"
    }

    fn attach(&self, sink: Arc<dyn InvalidationSink>) -> io::Result<SinkId> {
        SINKS_GUARD.init()?;
        if !sinks_usable() {
            return Err(io::Error::other(
                "the allocator monitor cannot be used in a forked child of a process that used it \
                 (its sink list may have been locked at the fork)",
            ));
        }
        // Opened here, where a cache is made, not in `subscribe`, and only
        // in the process that made the fork guard: a forked child never
        // waits on a `OnceLock` a parent thread was filling at the fork.
        VMAS.get_or_init(|| (std::process::id(), Vmas::open().ok()));
        SINKS.attach(sink)
    }

    fn detach(&self, id: SinkId) -> Option<Arc<dyn InvalidationSink>> {
        // In a forked child the list's lock may be held for good: the
        // parent's caches are dead weight there anyway.
        if !sinks_usable() {
            return None;
        }
        SINKS.detach(id)
    }

    fn subscribe(&self, start: usize, len: usize, cookie: u64) -> io::Result<Watch> {
        let end = start.saturating_add(len);
        match VMAS.get() {
            Some((pid, vmas)) if *pid == std::process::id() => {
                super::private_only(vmas.as_ref(), start, end, "allocator hook")?
            }
            // A forked child (the file would list the parent's mappings),
            // or not attached yet: ask afresh.
            _ => super::private_only(Vmas::open().ok().as_ref(), start, end, "allocator hook")?,
        }
        Ok(Watch {
            cookie,
            token: [0; 2],
        })
    }

    fn unsubscribe(&self, _watch: &Watch) {}

    fn sync(&self) {
        // The hook runs inside dealloc, before the memory is released.
    }
}
