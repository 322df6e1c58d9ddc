//! Memory-map monitors: they tell caches that the pages behind an address
//! range changed, so registrations of the old pages are never reused.
//!
//! A monitor serves several caches ([`InvalidationSink`]s) because a page
//! range can belong to one userfaultfd context only and the allocator hook
//! is process-global. The [`Monitor`] trait is shaped so that a kdreg2
//! backend fits without change:
//!
//! * [`Monitor::subscribe`] is `KDREG2_IOCTL_MONITOR` (the cookie is the
//!   cache's, the returned [`Watch`] keeps kdreg2's `monitoring_params`);
//! * [`Monitor::changed`] is `kdreg2_mapping_changed()`: one load of a
//!   generation counter in the kernel-shared page;
//! * [`Monitor::sync`] reads `pending_events` and drains the kdreg2
//!   descriptor, calling the sinks in the caller's thread (kdreg2 is
//!   synchronous, so no reader thread is needed);
//! * [`Monitor::unsubscribe`] is `KDREG2_IOCTL_UNMONITOR`.
//!
//! No kdreg2 backend ships: it could not be tested here (no module).

pub mod alloc;
mod ranges;
pub mod uffd;

use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// Receives invalidations. Implemented by the cache.
///
/// Called from a monitor's reader thread or from inside the global
/// allocator, so an implementation must not allocate, free or block on
/// anything but a lock whose holders never allocate or free memory or
/// unmap pages.
pub trait InvalidationSink: Send + Sync {
    /// The pages of `[start, end)` changed: drop every registration overlapping it.
    fn invalidate(&self, start: usize, end: usize);

    /// Cheap lock-free pre-filter: false when no registration can overlap.
    fn may_overlap(&self, start: usize, end: usize) -> bool {
        let _ = (start, end);
        true
    }
}

/// What a monitor keeps per subscribed range (kdreg2: cookie + location +
/// generation). Opaque to the cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Watch {
    /// The cookie the cache passed to `subscribe`.
    pub cookie: u64,
    /// Monitor-private data.
    pub token: [u64; 2],
}

/// Identifies a sink attached to a monitor: what [`Monitor::attach`]
/// returns and [`Monitor::detach`] takes back. Unique in the process
/// (never reused, whatever the monitor), so a monitor can key its sinks
/// by it, and an id of another monitor's sink detaches nothing. A
/// [`Monitor`] implementation outside this crate makes one per attached
/// sink with [`SinkId::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SinkId(u64);

impl SinkId {
    /// A new id, distinct from every other made in this process (a
    /// global counter: one atomic addition, no allocation, so a monitor
    /// may make one under its own lock).
    #[allow(clippy::new_without_default)] // a "default" id would read as a fixed value
    pub fn new() -> SinkId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        SinkId(NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// The id as a number (distinct for distinct ids; never 0).
    pub fn get(self) -> u64 {
        self.0
    }
}

/// A memory-map monitor.
pub trait Monitor: Send + Sync + 'static {
    /// Short name (`uffd`, `alloc`).
    fn name(&self) -> &'static str;

    /// Starts delivering invalidations to `sink`, under a new id
    /// ([`SinkId::new`]) that [`Monitor::detach`] will get back.
    fn attach(&self, sink: Arc<dyn InvalidationSink>) -> io::Result<SinkId>;

    /// Stops delivering to `id`; returns the sink so the caller drops it
    /// outside any monitor lock (`None` if no sink of this monitor has
    /// that id).
    fn detach(&self, id: SinkId) -> Option<Arc<dyn InvalidationSink>>;

    /// Starts watching `[start, start+len)` before it is registered.
    fn subscribe(&self, start: usize, len: usize, cookie: u64) -> io::Result<Watch>;

    /// Stops watching a range whose entry left the cache for another reason.
    fn unsubscribe(&self, watch: &Watch);

    /// Returns once every change that completed (its `munmap`, `madvise`,
    /// `mremap`, `free` returned) before this call has reached the sinks.
    fn sync(&self);

    /// Like [`Monitor::sync`], and also waits for changes still in flight
    /// (their call has not returned) that may already have freed the old
    /// pages ([`crate::Consistency::InFlight`]). Defaults to `sync`.
    fn sync_in_flight(&self) {
        self.sync();
    }

    /// `Some(left)` while a change of `[start, end)` that already reached
    /// the sinks may still be replacing its pages (for at most `left` more),
    /// so a registration made now may pin pages that are about to be
    /// dropped. (userfaultfd delivers `madvise`'s REMOVE *before* the
    /// kernel drops the pages.) A miss waits that out before it pins
    /// ([`Monitor::wait_settled`]) and asks again after the pin, under the
    /// cache's lock: if a change came meanwhile it registers again (after
    /// waiting), and once its settle retries or its wait budget are spent
    /// hands the registration out uncached, its validity flag clearing
    /// once `left` has passed. Must not block, allocate or take a lock the
    /// monitor holds while it calls sinks.
    fn settling(&self, start: usize, end: usize) -> Option<Duration> {
        let _ = (start, end);
        None
    }

    /// Waits, before a miss (or [`crate::Cache::get_unshared`]) pins
    /// `[start, end)`, until no change of it that already reached the
    /// sinks may still be replacing its pages ([`Monitor::settling`]), so
    /// that the registration pins the pages that stay and stays valid
    /// until the memory changes again; but for `limit` at most (a range
    /// changed again and again keeps settling: the check under the
    /// cache's lock then decides). Returns how long it waited if it found
    /// the range settling (the caller then looks at its span again, and
    /// counts the time against its budget, [`crate::SETTLE_BUDGET`]), or
    /// `None` if there was nothing to wait for. Called with no lock held;
    /// only misses of a range changed moments ago wait. Defaults to
    /// nothing to wait for.
    fn wait_settled(&self, start: usize, end: usize, limit: Duration) -> Option<Duration> {
        let _ = (start, end, limit);
        None
    }

    /// True when the mapping under `watch` is known to have changed (kdreg2
    /// style generation check). Monitors that push to sinks return false.
    fn changed(&self, watch: &Watch) -> bool {
        let _ = watch;
        false
    }
}

/// Maximum number of caches attached to one monitor.
pub const MAX_SINKS: usize = 64;

/// A sink and the id it was attached under.
type Attached = (SinkId, Arc<dyn InvalidationSink>);

/// A fixed-capacity set of sinks: dispatch never allocates or frees.
pub(crate) struct SinkSet {
    slots: RwLock<[Option<Attached>; MAX_SINKS]>,
    count: AtomicUsize,
}

impl SinkSet {
    pub const fn new() -> SinkSet {
        SinkSet {
            slots: RwLock::new([const { None }; MAX_SINKS]),
            count: AtomicUsize::new(0),
        }
    }

    /// Adds `sink`. Neither allocates nor frees under the list's lock (the
    /// reader takes it to dispatch): a refused sink is dropped, and its
    /// error made, after unlocking.
    pub fn attach(&self, sink: Arc<dyn InvalidationSink>) -> io::Result<SinkId> {
        let mut slots = self.slots.write().unwrap_or_else(|p| p.into_inner());
        let Some(free) = slots.iter().position(Option::is_none) else {
            drop(slots);
            drop(sink);
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("more than {MAX_SINKS} caches on one monitor"),
            ));
        };
        let id = SinkId::new();
        slots[free] = Some((id, sink));
        self.count.fetch_add(1, Ordering::SeqCst);
        Ok(id)
    }

    /// Removes the sink attached as `id`, if any.
    pub fn detach(&self, id: SinkId) -> Option<Arc<dyn InvalidationSink>> {
        let mut slots = self.slots.write().unwrap_or_else(|p| p.into_inner());
        let slot = slots
            .iter_mut()
            .find(|s| s.as_ref().is_some_and(|(i, _)| *i == id))?;
        let (_, sink) = slot.take()?;
        self.count.fetch_sub(1, Ordering::SeqCst);
        Some(sink)
    }

    /// True while fewer than [`MAX_SINKS`] sinks are attached (a hint:
    /// another thread may take the last place before an `attach`).
    pub fn has_room(&self) -> bool {
        self.count.load(Ordering::SeqCst) < MAX_SINKS
    }

    /// True when no sink is attached (one load).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.count.load(Ordering::SeqCst) == 0
    }

    /// Calls every sink that may overlap `[start, end)`. Allocation-free.
    pub fn dispatch(&self, start: usize, end: usize) {
        let slots = self.slots.read().unwrap_or_else(|p| p.into_inner());
        for (_, sink) in slots.iter().flatten() {
            if sink.may_overlap(start, end) {
                sink.invalidate(start, end);
            }
        }
    }
}

/// `Ok` when no mapping of `[first, end)` is shared; an `Unsupported`
/// error otherwise, or when the mappings cannot be told (`vmas` is `None`
/// or the query fails). A shared mapping (a memfd, shmem, hugetlbfs or
/// other file, shared anonymous memory) loses its pages when its file does
/// (`ftruncate`, `fallocate(PUNCH_HOLE)`, `MADV_REMOVE` through another
/// mapping), which neither userfaultfd nor an allocator hook sees:
/// `monitor` names the one refusing, for the error.
pub(crate) fn private_only(
    vmas: Option<&crate::sys::vma::Vmas>,
    first: usize,
    end: usize,
    monitor: &str,
) -> io::Result<()> {
    let refuse = |why: String| Err(io::Error::new(io::ErrorKind::Unsupported, why));
    let Some(vmas) = vmas else {
        return refuse(format!(
            "{monitor}: /proc/self/maps unavailable: cannot tell shared mappings"
        ));
    };
    match vmas.backing(first, end) {
        Ok(b) if !b.shared => Ok(()),
        Ok(_) => refuse(format!(
            "{monitor}: shared mapping: no event tells when its file loses pages \
             (ftruncate, fallocate PUNCH_HOLE, MADV_REMOVE elsewhere)"
        )),
        Err(e) => refuse(format!("{monitor}: cannot tell shared mappings: {e}")),
    }
}
