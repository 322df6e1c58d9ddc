//! The registration cache.
//!
//! # Call order of [`Cache::get`]
//!
//! 1. refuse in a forked child (one load of a `MADV_WIPEONFORK` page);
//! 2. `monitor.sync_in_flight()` (or `sync()` with
//!    [`Consistency::Returned`](crate::Consistency::Returned)): wait for
//!    in-flight monitor events, including (with userfaultfd) changes whose
//!    event the kernel has not delivered yet (no lock held);
//! 3. reap invalidated entries (deregistered outside the lock);
//! 4. read-lock, look up; a hit takes a reference, sets the entry's CLOCK
//!    bit and returns (releasing a handle takes no lock) (`lookup`);
//! 5. miss, still read-locked: compute the span (request ∪ overlapping
//!    entries), widen the monitor pre-filter, note the invalidation
//!    generation and the room the insertion may need, unlock; make that
//!    room (a vector for the entries it takes out, tracking slots for
//!    those in use and for the new span); steps 6 to 9 are `miss`;
//! 6. if the monitor says a change of the span is still settling
//!    (`madvise` drops pages after its event), wait for it to end
//!    (`Monitor::wait_settled`, no lock held; only misses of a range
//!    discarded moments ago wait), sync the monitor and look the request
//!    up again (another thread missing the same range may have registered
//!    it meanwhile: then it is a hit), else redo step 5's notes, and wait
//!    again if the new span covers a settling range (all of a miss's
//!    waits share one budget, `SETTLE_BUDGET`: see `settle`);
//! 7. coalesce (see `coalesce`): if another thread's miss is registering
//!    a span that covers the request (same or wider rights), wait for it
//!    to end (a condition variable, `COALESCE_WAIT` at most, once per
//!    call, no lock held), sync the monitor and look the request up again
//!    like step 4: a hit if that registration was cached and nothing
//!    invalidated it since (an invalidation meanwhile took it out of the
//!    index), else go on from step 6 with what the lookup noted; if none
//!    covers it, publish the span (checked and published in one hold of
//!    the coalescing mutex; taken back, waking the waiters, as soon as
//!    the outcome is known: see step 9, the monitor's refusal, the cache
//!    full of entries in use, a failed registration of a merged span);
//!    then write-lock briefly: claim a tracking slot for the span,
//!    from then on marked by every invalidation overlapping it, exactly,
//!    however many of other ranges come (claimed marked already if one
//!    since step 5 may have overlapped it, which the table's history of
//!    the last 64 invalidations tells); in the same hold, a published
//!    span is taken back if the table is full of entries in use (its
//!    registration would be handed out uncached);
//! 8. subscribe the span with the monitor, *then* register it (so an unmap
//!    between the two is seen), retrying once after evicting idle entries;
//! 9. write-lock; if the slot was marked (without a slot, which only a
//!    slot table that cannot grow leaves: if that history since step 5
//!    may overlap the span), discard, sync the monitor and look the
//!    request up again (a hit if another thread cached a range covering
//!    it meanwhile), else retry from step 6 with the span and generation
//!    that lookup noted (a published span becomes that span: waiters it
//!    still covers wait on, the others go; at most three registrations
//!    of a span that changed: `Unstable` after that); if the room made
//!    no longer suffices (the table changed), unlock, make more and look
//!    again; if the monitor says a change of the span is settling (one
//!    read since the wait of step 6, or one the budget ran out on), retry
//!    from step 6 too, after the same lookup (a settle retry: two at
//!    most, while the budget lasts, not counted as a change), else hand
//!    the registration out uncached, stale once the settle time ends;
//!    else, if an entry cached meanwhile by another thread covers the
//!    request with its rights and the span does not cover it, take it as
//!    a hit and throw this registration away (`Miss::raced_hit`: before
//!    2026-11-29 the narrower registration superseded it), else insert,
//!    superseding the entries the span contains or that contain it
//!    (those that only overlap it stay: `Table::superseded`), and
//!    evicting idle entries with the CLOCK (second-chance)
//!    approximation of LRU (a sweep that looked at `table::SWEEP_STEP`
//!    slots lets the lock go, takes it again and goes on, checking the
//!    span again first; no sweep at all while the count of entries in
//!    use says none is idle: see `entry::Refs`); unlock, take the
//!    published span back, and deregister superseded/evicted entries. The
//!    slot goes to the new entry if it is handed out uncached (it tracks
//!    it from then on), else it is released.
//!
//! A slow registration (an `ibv_reg_mr` of a large buffer takes hundreds
//! of milliseconds) thus survives any number of invalidations of other
//! ranges meanwhile. (Until 2026-11-28, step 9 consulted only the history:
//! past 64 invalidations of anything it had to assume the span changed,
//! and a miss that saw that happen three times failed with `Unstable`.)
//!
//! No registrar call, no allocation, no memory free and no tracing happens
//! under the lock: the vectors that carry entries out of the table are
//! reserved before it is taken (see `table`).

mod build;
mod coalesce;
mod entry;
mod lookup;
mod miss;
mod outside;
#[cfg(test)]
mod overlap_tests;
#[cfg(test)]
mod refs_tests;
mod settle;
mod shared;
#[cfg(test)]
mod sweep_tests;
mod table;
#[cfg(test)]
mod test_rig;
mod upkeep;

pub use coalesce::COALESCE_WAIT;
pub use entry::{Registration, MAX_HANDLES};
pub use settle::SETTLE_BUDGET;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use shared::Shared;

use crate::error::{Error, Result};
use crate::monitor::{Monitor, SinkId};
use crate::registrar::Registrar;

/// A memory registration cache over registrar `R`. See the module docs for
/// the call order of [`Cache::get`]; share it between threads by reference
/// or in an `Arc`.
pub struct Cache<R: Registrar> {
    shared: Arc<Shared<R>>,
    sink: Option<SinkId>,
    monitor_name: &'static str,
}

impl<R: Registrar> Cache<R> {
    /// The registrar.
    pub fn registrar(&self) -> &R {
        &self.shared.backend.registrar
    }

    /// Which monitor watches this cache (`uffd`, `alloc`, `none`, `disabled`).
    pub fn monitor_name(&self) -> &'static str {
        self.monitor_name
    }

    /// `[addr, addr+len)` checked (non-empty, no overflow) and the caller
    /// checked to be the process that made the cache; returns the end.
    fn checked_end(&self, addr: usize, len: usize) -> Result<usize> {
        let end = addr
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or_else(|| Error::InvalidRange { addr, len })?;
        if !self.shared.backend.in_owner() {
            return Err(Error::ForkedChild);
        }
        Ok(end)
    }

    /// Applies the monitor's changes that completed before this call (and,
    /// with `Consistency::InFlight`, those still in flight).
    fn sync_monitor(&self, m: &dyn Monitor) {
        if self.shared.in_flight {
            m.sync_in_flight();
        } else {
            m.sync();
        }
    }

    /// Counts `evicted` idle entries evicted by a miss.
    fn count_evictions(&self, evicted: usize) {
        if evicted > 0 {
            let stats = &self.shared.backend.stats;
            stats.evictions.fetch_add(evicted as u64, Ordering::Relaxed);
            tracing::debug!(evicted, "registration cache evicted idle entries");
        }
    }
}
