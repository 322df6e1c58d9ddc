//! The registration cache.
//!
//! # Call order of [`Cache::get`]
//!
//! 1. refuse in a forked child (one load of a `MADV_WIPEONFORK` page);
//! 2. `monitor.sync_in_flight()` (or `sync()` with
//!    [`Consistency::Returned`]): wait for in-flight monitor events,
//!    including (with userfaultfd) changes whose event the kernel has not
//!    delivered yet (no lock held);
//! 3. reap invalidated entries (deregistered outside the lock);
//! 4. read-lock, look up; a hit takes a reference, sets the entry's CLOCK
//!    bit and returns (releasing a handle takes no lock);
//! 5. miss, still read-locked: compute the span (request ∪ overlapping
//!    entries), widen the monitor pre-filter, note the invalidation
//!    generation and the room the insertion may need, unlock; make that
//!    room (a vector for the entries it takes out, tracking slots for
//!    those in use and for the new span);
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
//!    the coalescing mutex; taken back, waking the waiters, when the call
//!    ends however it ends, or as soon as the monitor refuses the span);
//!    then write-lock briefly: claim a tracking slot for the span,
//!    from then on marked by every invalidation overlapping it, exactly,
//!    however many of other ranges come (claimed marked already if one
//!    since step 5 may have overlapped it, which the table's history of
//!    the last 64 invalidations tells);
//! 8. subscribe the span with the monitor, *then* register it (so an unmap
//!    between the two is seen), retrying once after evicting idle entries;
//! 9. write-lock; if the slot was marked (without a slot, which only a
//!    slot table that cannot grow leaves: if that history since step 5
//!    may overlap the span), discard, sync the monitor and look the
//!    request up again (a hit if another thread cached a range covering
//!    it meanwhile), else retry from step 6 with the span and generation
//!    that lookup noted (at most three registrations of a span
//!    that changed: `Unstable` after that); if the room made no longer
//!    suffices (the table changed), unlock, make more and look again; if
//!    the monitor says a change of the span is settling (one read since
//!    the wait of step 6, or one the budget ran out on), retry from step
//!    6 too, after the same lookup (a settle retry: two at most, while
//!    the budget lasts, not counted as a change), else hand the registration out uncached,
//!    stale once the settle time ends;
//!    else insert, evicting idle entries with the CLOCK (second-chance)
//!    approximation of LRU (a sweep that looked at `table::SWEEP_STEP`
//!    slots lets the lock go, takes it again and goes on, checking the
//!    span again first; no sweep at all while the count of entries in
//!    use says none is idle: see `entry::Refs`); unlock and deregister superseded/evicted
//!    entries. The slot goes to the new entry if it is handed out
//!    uncached (it tracks it from then on), else it is released.
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
mod outside;
#[cfg(test)]
mod refs_tests;
mod settle;
mod shared;
#[cfg(test)]
mod sweep_tests;
mod table;
#[cfg(test)]
mod test_rig;

pub use coalesce::COALESCE_WAIT;
pub use entry::{Registration, MAX_HANDLES};
pub use settle::SETTLE_BUDGET;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use coalesce::{Enter, Published};
use entry::Entry;
use settle::Settle;
use shared::{Claimed, Shared};
use table::{Insert, Sweep, Table};

use crate::error::{Error, Result};
use crate::monitor::{InvalidationSink, Monitor, SinkId};
use crate::registrar::{Access, Registrar};
use crate::stats::{CacheStats, Stats};

/// Registrations a miss makes, at most, of a span that changed while
/// each was being made ([`Error::Unstable`] after them). Registrations
/// thrown away because a discard of the span settled do not count (see
/// `settle`: they have their own bound).
const ATTEMPTS: usize = 3;

/// What a miss notes of the table before it registers (see [`note_miss`]):
/// the span, the generation, the bound on entries taken out, the slots.
type Noted = ((usize, usize, Access), u64, usize, usize);

/// What [`Cache::look_up`] found.
enum Looked<R: Registrar> {
    /// A hit: the handle.
    Hit(Registration<R>),
    /// A miss: what it notes of the table.
    Miss(Noted),
}

/// Why a miss threw its registration away and registers again.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// The mapping changed while it was registered (counted against
    /// [`ATTEMPTS`]).
    Changed,
    /// A discard of the span settles (a settle retry, see `settle`).
    Settling,
}

/// What a miss notes of table `t` before it registers (step 5 of the
/// module docs, and again after each wait and before each later attempt):
/// the span to register (`[addr, end)` with `access`, merged with the
/// entries it overlaps), the table's generation, a bound on the entries
/// the insertion may take out, and the tracking slots it may need (one
/// per overlapping entry in use, one for the span). The pre-filter is
/// widened to the span before the generation is noted: an invalidation
/// that skips us saw the old bounds, so its unmap happened before our pin.
fn note_miss<R: Registrar>(sh: &Shared<R>, t: &Table<R>, addr: usize, end: usize, access: Access) -> Noted {
    let span = t.span(addr, end, access);
    sh.widen(span.0, span.1);
    let want = t.overlaps(span.0, span.1) + 1;
    (span, t.generation(), t.doom_bound(span.0, span.1), want)
}

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

    /// A registration covering `[addr, addr+len)` with at least `access`.
    pub fn get(&self, addr: usize, len: usize, access: Access) -> Result<Registration<R>> {
        let end = self.checked_end(addr, len)?;
        let sh = &self.shared;
        if !sh.caching {
            return self.uncached(addr, end, access);
        }
        if let Some(m) = &sh.backend.monitor {
            self.sync_monitor(m.as_ref());
        }
        if sh.zombies.load(Ordering::SeqCst) > 0 {
            self.reap();
        }
        let (mut span, mut gen0, bound, want) = match self.look_up(addr, end, access)? {
            Looked::Hit(r) => return Ok(r),
            Looked::Miss(noted) => noted,
        };
        let stats = &sh.backend.stats;
        // Room for the entries the insertion takes out, and tracking slots
        // for those of them in use (superseded) and for the span being
        // registered (the new entry's if it is handed out uncached), made
        // before the write lock: nothing is allocated under it (see `table`).
        let mut doomed = Vec::with_capacity(bound);
        let mut slots = sh.tracked.reserve(want);
        let mut mine = Claimed::new(&sh.tracked);
        // Idle entries evicted by sweeps that paused (or whose attempt was
        // retried): they are in `doomed`, counted when the miss ends.
        let mut evicted_before = 0;
        // Waits for settling ranges and settle retries left (`settle`),
        // registrations thrown away because the span changed meanwhile.
        let mut settle = Settle::new();
        let mut changes = 0;
        let mut counted = false;
        // The span this miss registers, published for concurrent misses of
        // the range to wait for (taken back when the call ends), and
        // whether this call waited for another's already (once at most).
        let mut published: Option<Published<'_>> = None;
        let mut waited = false;
        loop {
            if let Some(m) = sh.backend.monitor.as_deref() {
                // A span discarded moments ago (`madvise`: its pages may
                // still be on their way out) is pinned only once the
                // discard is done, so the registration stays valid until
                // the memory changes again. Only such misses wait. After
                // a wait the span is looked at again, and waited for
                // again if it grew over another settling range.
                while settle.wait(m, span.0, span.1) {
                    // Apply what the monitor read meanwhile, then look
                    // again: another thread missing the same range may
                    // have registered it meanwhile (a hit then), and
                    // entries may have come or gone.
                    let (bound, want);
                    (span, gen0, bound, want) = match self.look_again(addr, end, access, evicted_before)? {
                        Looked::Hit(r) => return Ok(r),
                        Looked::Miss(noted) => noted,
                    };
                    doomed.reserve(bound);
                    slots.add(want.saturating_sub(slots.left()));
                }
            }
            if published.is_none() {
                // Another thread registering a span covering the request:
                // wait for it and look again (a hit, unless it failed, was
                // handed out uncached, or an invalidation took it since);
                // else publish ours for the next ones (`coalesce`).
                match sh.pending.enter((addr, end, access), span, !waited) {
                    Enter::Published(p) => published = Some(p),
                    Enter::Alone => {}
                    Enter::Wait(id) => {
                        waited = true;
                        sh.pending.wait(id, stats);
                        match self.look_again(addr, end, access, evicted_before)? {
                            Looked::Hit(r) => {
                                Stats::bump(&stats.coalesced);
                                return Ok(r);
                            }
                            Looked::Miss(noted) => {
                                let (bound, want);
                                (span, gen0, bound, want) = noted;
                                doomed.reserve(bound);
                                slots.add(want.saturating_sub(slots.left()));
                                // Settling again, maybe: from the top.
                                continue;
                            }
                        }
                    }
                }
            }
            if !counted {
                // A lookup that registers (not one a wait turned into a hit).
                Stats::bump(&stats.misses);
                counted = true;
            }
            let (s, e, a) = span;
            // The span's tracking slot, claimed before the subscription
            // and the pin: an invalidation of the span while they are made
            // marks it, however many invalidations of other ranges come
            // (the table's history keeps 64). Already marked if one since
            // `gen0` may have covered the span.
            {
                let t = sh.lock();
                mine.set(sh.track(&t, &mut slots, gen0, s, e));
            }
            let watch = match &sh.backend.monitor {
                Some(m) => match m.subscribe(s, e - s, s as u64) {
                    Ok(w) => Some(w),
                    Err(err) => {
                        tracing::debug!(addr = s, len = e - s, error = %err, "monitor refused range: uncached");
                        // Never cached: misses of it waiting for this one
                        // would only wait. Wake them now (they make their own).
                        drop(published);
                        return self.uncached(addr, end, access);
                    }
                },
                None => None,
            };
            let region = match self.register(s, e - s, a) {
                Ok(r) => r,
                Err(err) => {
                    if let (Some(m), Some(w)) = (&sh.backend.monitor, &watch) {
                        m.unsubscribe(w);
                    }
                    if span != (addr, end, access) {
                        // The merged span may be unregistrable where the
                        // request is not: the request alone, watched like
                        // any entry.
                        if let Some(m) = sh.backend.monitor.as_deref() {
                            return self.watched_outside(m, addr, end, access, &stats.uncached, &mut settle);
                        }
                        return self.uncached(addr, end, access);
                    }
                    return Err(err);
                }
            };
            let entry = Arc::new(Entry::new(&sh.backend, (s, e, a), region, watch));
            let mut t = sh.lock();
            // The eviction sweep, across the lock holds it is split into.
            let mut sweep = Sweep::default();
            // `Err`: registered again (why). Else whether the range is
            // settling, whether the entry is cached, and how many idle
            // entries were evicted.
            let placed = loop {
                if mine.hit().unwrap_or_else(|| t.changed_since(gen0, s, e)) {
                    break Err(Retry::Changed);
                }
                // Slots for the superseded entries in use, and for the
                // new one if it has none and ends up uncached.
                let want = t.overlaps(s, e) + usize::from(mine.hit().is_none());
                if slots.left() < want {
                    // More entries to supersede than when the slots were
                    // reserved: reserve more, unlocked, and look again.
                    drop(t);
                    slots.add(want - slots.left());
                    t = sh.lock();
                    continue;
                }
                if let Some(left) = sh.backend.monitor.as_ref().and_then(|m| m.settling(s, e)) {
                    // A discard of the span read since the wait above (its
                    // invalidation may be waiting for this lock), or one
                    // the wait budget ran out on: its pages may be dropped
                    // right after we pinned them. Wait and register again;
                    // past the settle retries or the budget, hand it out
                    // uncached, stale once the settle time ends.
                    if settle.retry() {
                        break Err(Retry::Settling);
                    }
                    break Ok((Some(left), false, 0));
                }
                match t.insert(&entry, &mut doomed, &mut sweep) {
                    Insert::Done { evicted } => break Ok((None, true, evicted_before + evicted)),
                    Insert::NoRoom { evicted } => break Ok((None, false, evicted_before + evicted)),
                    Insert::Paused { evicted } => {
                        // A bounded stretch of the sweep is done: let
                        // readers in, then go on (checking again whether
                        // the span changed meanwhile).
                        evicted_before += evicted;
                        drop(t);
                        t = sh.lock();
                    }
                    Insert::Short { need } => {
                        // The table changed since the room was made: make
                        // more, unlocked, and look again.
                        drop(t);
                        doomed.reserve(need);
                        t = sh.lock();
                    }
                }
            };
            let (settling, cached, evicted) = match placed {
                Ok(placed) => placed,
                Err(why) => {
                    // Retry with fresh state (and a fresh slot, for the new span).
                    drop(t);
                    mine.set(None);
                    drop(entry);
                    if why == Retry::Changed {
                        changes += 1;
                        if changes == ATTEMPTS {
                            drop(slots);
                            drop(doomed);
                            self.count_evictions(evicted_before);
                            return Err(Error::Unstable { addr });
                        }
                    }
                    // Look the request up again: another thread may have
                    // registered a range covering it meanwhile (a hit then;
                    // before 2026-11-29 the miss only noted its span again,
                    // merged with that entry, and registered the union).
                    let (bound, want);
                    (span, gen0, bound, want) = match self.look_again(addr, end, access, evicted_before)? {
                        Looked::Hit(r) => return Ok(r),
                        Looked::Miss(noted) => noted,
                    };
                    doomed.reserve(bound);
                    slots.add(want.saturating_sub(slots.left()));
                    continue;
                }
            };
            let gen_now = t.generation();
            // A watched entry in use outside the index (handed out uncached,
            // or superseded by the wider one just inserted) keeps an honest
            // validity flag: the absence of invalidations of its range since now.
            // Attached before the lock goes (setting it allocates nothing):
            // once out of the index an invalidation no longer clears its
            // flag, and a user checking it in between, after an unmap,
            // would have seen it valid.
            for d in doomed.iter().filter(|d| d.refs.users() > 0) {
                d.track_since(Arc::clone(sh), &t, &mut slots, gen_now, None);
            }
            if !cached {
                // One made while its range was settling (discards raced
                // every settle retry) may have pinned pages the discard
                // drops: stale once the settle time ends.
                let stale_at = settling.map(|left| Instant::now() + left);
                match mine.take() {
                    // Live since before the pin and not hit: exact from now on.
                    Some(i) => entry.track_with(Arc::clone(sh), gen0, stale_at, Some(i)),
                    None => entry.track_since(Arc::clone(sh), &t, &mut slots, gen_now, stale_at),
                }
            }
            drop(t);
            // Cached: the index tracks the entry now.
            mine.set(None);
            drop(slots);
            if !cached {
                // (Cached: the insertion gave it its user, counted busy.)
                entry.acquire_outside();
                Stats::bump(&stats.uncached);
            }
            self.count_evictions(evicted);
            drop(doomed);
            return Ok(Registration { entry });
        }
    }

    /// Looks `[addr, end)` with `access` up under the read lock: a hit's
    /// handle (counted), or what a miss notes of the table in the same
    /// hold ([`note_miss`]). An entry the monitor reports changed is
    /// invalidated first. Errs only at the handle limit.
    #[inline(always)]
    fn look_up(&self, addr: usize, end: usize, access: Access) -> Result<Looked<R>> {
        let sh = &self.shared;
        let mut t = sh.table.read();
        if let Some(e) = t.lookup(addr, end, access) {
            let stale = match (&sh.backend.monitor, &e.watch) {
                (Some(m), Some(w)) => m.changed(w),
                _ => false,
            };
            if !stale {
                // Take the user reference under the read lock so that
                // eviction (write lock) never sees this entry idle.
                // Counted busy under the lock: a sweep (write lock)
                // never counts this entry idle.
                if !Table::acquire(e) {
                    let (start, len) = (e.start, e.end - e.start);
                    drop(t);
                    return Err(Error::TooManyHandles {
                        addr: start,
                        len,
                        max: entry::MAX_HANDLES,
                    });
                }
                let e = Arc::clone(e);
                drop(t);
                sh.backend.stats.hits.add(1);
                return Ok(Looked::Hit(Registration { entry: e }));
            }
            // The monitor reported a changed mapping.
            let (s, en) = (e.start, e.end);
            drop(t);
            sh.invalidate_range(s, en);
            t = sh.table.read();
        }
        Ok(Looked::Miss(note_miss(sh, &t, addr, end, access)))
    }

    /// A miss's lookup after it waited or threw a registration away:
    /// applies what the monitor read meanwhile, then [`Cache::look_up`].
    /// Unless it is a miss again (the call goes on), counts the
    /// `evicted` idle entries the call evicted so far.
    fn look_again(&self, addr: usize, end: usize, access: Access, evicted: usize) -> Result<Looked<R>> {
        if let Some(m) = self.shared.backend.monitor.as_deref() {
            self.sync_monitor(m);
        }
        let looked = self.look_up(addr, end, access);
        if !matches!(looked, Ok(Looked::Miss(_))) {
            self.count_evictions(evicted);
        }
        looked
    }

    /// Counts `evicted` idle entries evicted by a miss.
    fn count_evictions(&self, evicted: usize) {
        if evicted > 0 {
            let stats = &self.shared.backend.stats;
            stats.evictions.fetch_add(evicted as u64, Ordering::Relaxed);
            tracing::debug!(evicted, "registration cache evicted idle entries");
        }
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

    /// Registers `[addr, addr+len)`; on failure evicts every idle entry and
    /// retries once.
    fn register(&self, addr: usize, len: usize, access: Access) -> Result<R::Region> {
        let b = &self.shared.backend;
        match b.registrar.register(addr, len, access) {
            Ok(r) => Ok(r),
            Err(first) => {
                Stats::bump(&b.stats.register_failures);
                let evicted = self.evict_idle();
                if evicted == 0 {
                    return Err(Error::Register {
                        addr,
                        len,
                        source: Box::new(first),
                    });
                }
                tracing::debug!(evicted, error = %first, "registration failed: evicted idle entries, retrying");
                b.registrar.register(addr, len, access).map_err(|e| {
                    Stats::bump(&b.stats.register_failures);
                    Error::Register {
                        addr,
                        len,
                        source: Box::new(e),
                    }
                })
            }
        }
    }

    /// Deregisters invalidated entries (whose handles, if any, keep their
    /// registration alive until they drop). The room to take them out is
    /// made before the lock, from the `zombies` hint; if more came
    /// meanwhile, again for those.
    fn reap(&self) {
        let sh = &self.shared;
        let mut zombies = Vec::new();
        let mut want = sh.zombies.load(Ordering::SeqCst);
        loop {
            zombies.reserve(want);
            let left = {
                let mut t = sh.lock();
                let left = t.take_zombies(&mut zombies);
                sh.zombies.store(left, Ordering::SeqCst);
                left
            };
            zombies.clear();
            if left == 0 {
                return;
            }
            want = left;
        }
    }

    /// Deregisters every idle entry; returns how many were evicted. In a
    /// forked child of the process that made the cache: 0, and nothing is
    /// touched (see [`Cache::invalidate`]).
    pub fn evict_idle(&self) -> usize {
        let sh = &self.shared;
        if !sh.backend.in_owner() {
            return 0;
        }
        let mut idle = Vec::new();
        let mut n = 0;
        // Where the sweep goes on: it looks at a bounded stretch of slots
        // per hold of the write lock (see `table::SWEEP_STEP`).
        let mut cursor = 0;
        loop {
            // Room for every live entry (at most a stretch's worth),
            // made before the write lock.
            let live = sh.table.read().live();
            idle.reserve(live.clamp(1, table::SWEEP_STEP));
            let more = sh
                .lock()
                .take_idle(&mut idle, &mut cursor, &sh.backend.stats.busy_cached);
            n += idle.len();
            idle.clear();
            if !more {
                break;
            }
        }
        sh.backend.stats.evictions.fetch_add(n as u64, Ordering::Relaxed);
        self.reap();
        n
    }

    /// Invalidates `[addr, addr+len)` by hand (an application that knows it
    /// is about to remap memory, or changed it in a way no monitor sees:
    /// see the crate docs on shared file mappings).
    ///
    /// Does nothing in a forked child of the process that made the cache:
    /// the cache is the parent's (the child cannot get registrations from
    /// it), and a parent thread may have held its lock at the fork, so a
    /// child never takes it. The same holds for every method: in a child
    /// [`evict_idle`](Self::evict_idle) returns 0, [`stats`](Self::stats)
    /// zeros, [`log_stats`](Self::log_stats) logs nothing, `get` and
    /// `get_unshared` return [`Error::ForkedChild`], and a handle's
    /// [`Registration::is_valid`] is false.
    pub fn invalidate(&self, addr: usize, len: usize) {
        if !self.shared.backend.in_owner() {
            return;
        }
        self.shared.invalidate(addr, addr.saturating_add(len));
        self.reap();
    }

    /// A snapshot of the counters. All zero in a forked child of the
    /// process that made the cache (the child has no use of it, and never
    /// takes its lock: see [`Cache::invalidate`]).
    pub fn stats(&self) -> CacheStats {
        if !self.shared.backend.in_owner() {
            return CacheStats::default();
        }
        let mut s = self.shared.backend.stats.snapshot();
        let t = self.shared.table.read();
        s.entries = t.live() as u64;
        s.sweep_steps = t.sweep_steps();
        s
    }

    /// Emits the counters as a tracing event (target `na_regcache`).
    /// Nothing in a forked child of the process that made the cache.
    pub fn log_stats(&self) {
        if !self.shared.backend.in_owner() {
            return;
        }
        let s = self.stats();
        tracing::info!(
            monitor = self.monitor_name,
            hits = s.hits,
            misses = s.misses,
            evictions = s.evictions,
            invalidations = s.invalidations,
            uncached = s.uncached,
            entries = s.entries,
            bytes_registered = s.bytes_registered,
            in_use = s.in_use,
            sweep_steps = s.sweep_steps,
            coalesce_waits = s.coalesce_waits,
            coalesced = s.coalesced,
            coalesce_timeouts = s.coalesce_timeouts,
            "registration cache stats"
        );
    }
}

impl<R: Registrar> Drop for Cache<R> {
    fn drop(&mut self) {
        let sh = &self.shared;
        if !sh.backend.in_owner() {
            // A forked child: the locks may have been held by parent
            // threads at the fork, and the registrations are the parent's
            // (entries skip deregistering in a child). Touch nothing.
            return;
        }
        let sink = match (&sh.backend.monitor, self.sink) {
            (Some(m), Some(id)) => m.detach(id),
            _ => None,
        };
        drop(sink);
        self.log_stats();
        // Handles still alive keep their registration but are no longer
        // monitored: they are marked invalid (those outside the index
        // through their tracking slots, or the generation, by one
        // invalidation of everything; unwatched ones through `closed`).
        sh.backend.closed.store(true, Ordering::Release);
        sh.invalidate_range(0, usize::MAX);
        // Everything is a zombie now (bar entries a racing miss inserted).
        let mut all = Vec::new();
        let mut want = sh.zombies.load(Ordering::SeqCst);
        loop {
            all.reserve(want.max(1));
            let left = sh.lock().take_all(&mut all);
            all.clear();
            if left == 0 {
                break;
            }
            want = left;
        }
    }
}
