//! A miss of [`Cache::get`]: steps 6 to 9 of the module docs (settle
//! waits, coalescing, the registration and its placement), with the
//! state one call carries across its waits and attempts ([`Miss`]).

use std::sync::Arc;
use std::time::Instant;

use super::coalesce::{Enter, Published};
use super::entry::{Entry, Registration};
use super::lookup::{Looked, Noted};
use super::settle::Settle;
use super::shared::{Claimed, Reserved};
use super::table::{Insert, Sweep, Table};
use super::Cache;
use crate::error::{Error, Result};
use crate::registrar::{Access, Registrar};
use crate::stats::Stats;

/// Registrations a miss makes, at most, of a span that changed while
/// each was being made ([`Error::Unstable`] after them). Registrations
/// thrown away because a discard of the span settled do not count (see
/// `settle`: they have their own bound).
pub(super) const ATTEMPTS: usize = 3;

/// Why a miss threw its registration away and registers again.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// The mapping changed while it was registered (counted against
    /// [`ATTEMPTS`]).
    Changed,
    /// A discard of the span settles (a settle retry, see `settle`).
    Settling,
}

/// How step 9 ended under the write lock, unless the registration was
/// thrown away to register again ([`Retry`]).
enum Placed<R: Registrar> {
    /// Inserted (`cached`) or to hand out uncached; `settling`: the time a
    /// discard of the span still settles, if that is why it is uncached;
    /// `evicted`: the idle entries the call evicted.
    Put {
        settling: Option<std::time::Duration>,
        cached: bool,
        evicted: usize,
    },
    /// An entry cached by another thread meanwhile covers the request
    /// with its rights (and is not covered by this miss's span): taken
    /// as a hit, with a user for the call ([`Miss::raced_hit`]); this
    /// miss's registration is thrown away.
    Raced(Arc<Entry<R>>),
}

/// What one step of a miss came to.
enum Step<R: Registrar> {
    /// The call's handle (a hit after a wait, or its own registration).
    Done(Registration<R>),
    /// Go on from step 6 (settle waits) with the span noted last.
    Again,
    /// Go on with the next step.
    On,
}

/// One miss in progress: the request, the span it registers next, and
/// what it made ready for it (before the write lock: nothing is
/// allocated under it, see `table`).
struct Miss<'c, R: Registrar> {
    cache: &'c Cache<R>,
    /// The request: `[addr, end)` with `access`.
    req: (usize, usize, Access),
    /// The span to register (the request merged with the entries it
    /// overlaps), and the table's generation noted with it.
    span: (usize, usize, Access),
    gen0: u64,
    /// The table's count of insertions noted with the span.
    ins0: u64,
    /// The span as published for concurrent misses of the range to wait
    /// for (`coalesce`); taken back as soon as the outcome is known
    /// (declared before `doomed`: fields drop in order, so a miss that
    /// ends in an error lets its waiters go before it deregisters what a
    /// paused sweep evicted).
    published: Option<Published<'c>>,
    /// Room for the entries the insertion takes out.
    doomed: Vec<Arc<Entry<R>>>,
    /// Tracking slots for the superseded entries in use and for the
    /// span being registered (the new entry's if it is handed out
    /// uncached).
    slots: Reserved<'c>,
    /// The span's tracking slot, while it is registered.
    mine: Claimed<'c>,
    /// Idle entries evicted by sweeps that paused (or whose attempt was
    /// retried): they are in `doomed`, counted when the miss ends.
    evicted_before: usize,
    /// Waits for settling ranges and settle retries left (`settle`).
    settle: Settle,
    /// Registrations thrown away because the span changed meanwhile.
    changes: usize,
    /// Counted as a miss already (a lookup that registers, not one a
    /// wait turned into a hit).
    counted: bool,
    /// Waited for another's registration already (once at most).
    waited: bool,
}

impl<R: Registrar> Cache<R> {
    /// Steps 6 to 9 of the module docs for `req` (`[addr, end)` with
    /// `access`), which missed, with what its lookup `noted`. Kept out of
    /// [`Cache::get`], whose hit path stays small.
    #[inline(never)]
    pub(super) fn miss(&self, req: (usize, usize, Access), noted: Noted) -> Result<Registration<R>> {
        let mut m = Miss::new(self, req, noted);
        loop {
            if let Some(r) = m.wait_settled()? {
                return Ok(r);
            }
            match m.coalesce()? {
                Step::Done(r) => return Ok(r),
                Step::Again => continue,
                Step::On => {}
            }
            if let Some(r) = m.attempt()? {
                return Ok(r);
            }
        }
    }
}

impl<'c, R: Registrar> Miss<'c, R> {
    fn new(cache: &'c Cache<R>, req: (usize, usize, Access), (span, gen0, bound, want, ins0): Noted) -> Self {
        let tracked = &cache.shared.tracked;
        Miss {
            cache,
            req,
            span,
            gen0,
            ins0,
            doomed: Vec::with_capacity(bound),
            slots: tracked.reserve(want),
            mine: Claimed::new(tracked),
            evicted_before: 0,
            settle: Settle::new(),
            changes: 0,
            counted: false,
            published: None,
            waited: false,
        }
    }

    /// Looks the request up again after a wait or a registration thrown
    /// away ([`Cache::look_again`]): a hit's handle, or `None` on a miss,
    /// whose notes become the span and generation to register next (with
    /// room made for them, unlocked). A published span becomes the new
    /// span too: waiters it still covers wait on for this miss's next
    /// registration, the others are woken and go their own way, and
    /// misses the new span covers wait for it.
    fn look_again(&mut self) -> Result<Option<Registration<R>>> {
        let (addr, end, access) = self.req;
        let (bound, want);
        (self.span, self.gen0, bound, want, self.ins0) =
            match self.cache.look_again(addr, end, access, self.evicted_before)? {
                Looked::Hit(r) => return Ok(Some(r)),
                Looked::Miss(noted) => noted,
            };
        self.doomed.reserve(bound);
        self.slots.add(want.saturating_sub(self.slots.left()));
        if let Some(p) = &self.published {
            p.update(self.span);
        }
        Ok(None)
    }

    /// Step 6: a span discarded moments ago (`madvise`: its pages may
    /// still be on their way out) is pinned only once the discard is
    /// done, so the registration stays valid until the memory changes
    /// again. Only such misses wait. After a wait the request is looked
    /// up again (another thread missing the same range may have
    /// registered it meanwhile: the hit's handle), and the span it notes
    /// waited for again if it grew over another settling range.
    fn wait_settled(&mut self) -> Result<Option<Registration<R>>> {
        let cache = self.cache;
        let Some(m) = cache.shared.backend.monitor.as_deref() else {
            return Ok(None);
        };
        while self.settle.wait(m, self.span.0, self.span.1) {
            if let Some(r) = self.look_again()? {
                return Ok(Some(r));
            }
        }
        Ok(None)
    }

    /// Step 7, coalescing: another thread registering a span covering the
    /// request is waited for, and the request looked up again (a hit,
    /// unless it failed, was handed out uncached, or an invalidation took
    /// it since); else this miss publishes its span for the next ones.
    fn coalesce(&mut self) -> Result<Step<R>> {
        if self.published.is_some() {
            return Ok(Step::On);
        }
        let sh = &*self.cache.shared;
        match sh.pending.enter(self.req, self.span, !self.waited) {
            Enter::Published(p) => self.published = Some(p),
            Enter::Alone => {}
            Enter::Wait(id) => {
                self.waited = true;
                sh.pending.wait(id, self.req, &sh.backend.stats);
                if let Some(r) = self.look_again()? {
                    Stats::bump(&sh.backend.stats.coalesced);
                    return Ok(Step::Done(r));
                }
                // Settling again, maybe: from the top.
                return Ok(Step::Again);
            }
        }
        Ok(Step::On)
    }

    /// Steps 7 (the tracking slot) and 8, then 9 ([`Miss::place`]): the
    /// call's handle, or `None` to go on from step 6 (the registration was
    /// thrown away and the lookup after it missed).
    fn attempt(&mut self) -> Result<Option<Registration<R>>> {
        let cache = self.cache;
        let sh = &*cache.shared;
        let stats = &sh.backend.stats;
        if !self.counted {
            Stats::bump(&stats.misses);
            self.counted = true;
        }
        let (s, e, a) = self.span;
        let (addr, end, access) = self.req;
        // The span's tracking slot, claimed before the subscription
        // and the pin: an invalidation of the span while they are made
        // marks it, however many invalidations of other ranges come
        // (the table's history keeps 64). Already marked if one since
        // `gen0` may have covered the span.
        let full = {
            let t = sh.lock();
            self.mine.set(sh.track(&t, &mut self.slots, self.gen0, s, e));
            self.published.is_some() && t.no_room(s, e, &stats.busy_cached)
        };
        if full {
            // A table full of entries in use: the registration will be
            // handed out uncached (unless room is made meanwhile). Misses
            // waiting for it would only wait: they make their own now.
            self.published = None;
        }
        let watch = match &sh.backend.monitor {
            Some(m) => match m.subscribe(s, e - s, s as u64) {
                Ok(w) => Some(w),
                Err(err) => {
                    tracing::debug!(addr = s, len = e - s, error = %crate::error::Chain(&err), "monitor refused range: uncached");
                    // Never cached: misses of it waiting for this one
                    // would only wait. Wake them now (they make their own).
                    self.published = None;
                    return cache.uncached(addr, end, access).map(Some);
                }
            },
            None => None,
        };
        let region = match cache.register(s, e - s, a) {
            Ok(r) => r,
            Err(err) => {
                if let (Some(m), Some(w)) = (&sh.backend.monitor, &watch) {
                    m.unsubscribe(w);
                }
                // Nothing of this call is cached now: waiters make their own.
                self.published = None;
                if self.span != self.req {
                    // The merged span may be unregistrable where the
                    // request is not: the request alone, watched like
                    // any entry.
                    if let Some(m) = sh.backend.monitor.as_deref() {
                        return cache
                            .watched_outside(m, addr, end, access, &stats.uncached, &mut self.settle)
                            .map(Some);
                    }
                    return cache.uncached(addr, end, access).map(Some);
                }
                return Err(err);
            }
        };
        self.place(Arc::new(Entry::new(&sh.backend, (s, e, a), region, watch)))
    }

    /// An entry of table `t` (write-locked) that covers the request with
    /// its rights while this miss's span does not cover it (in range and
    /// rights): one another thread cached after the span was noted
    /// (entries in the index then are part of the span), say a wider
    /// range whose miss registered while this one did. Taken as a hit
    /// (a user for the call, counted busy under the lock like a lookup's)
    /// instead of being superseded by this narrower registration. Looked
    /// for only if the table's count of insertions moved since the span
    /// was noted. `None` if there is none (an invalidated entry is out of the index), if
    /// the monitor reports its mapping changed (the insertion then
    /// supersedes it), or if it has [`MAX_HANDLES`](super::MAX_HANDLES)
    /// handles (this miss's own registration serves the call then).
    fn raced_hit(&self, t: &Table<R>) -> Option<Arc<Entry<R>>> {
        if t.inserts() == self.ins0 {
            // Nothing inserted since the span was noted: whatever the
            // index holds that overlaps the request is in the span (the
            // common case, no look at the index).
            return None;
        }
        let (addr, end, access) = self.req;
        let (s, e, a) = self.span;
        let hit = t.lookup(addr, end, access)?;
        if hit.start >= s && hit.end <= e && a.contains(hit.access) {
            // Ours covers it: superseding it loses nothing.
            return None;
        }
        let sh = &self.cache.shared;
        if let (Some(m), Some(w)) = (&sh.backend.monitor, &hit.watch) {
            if m.changed(w) {
                return None;
            }
        }
        Table::acquire(hit).then(|| Arc::clone(hit))
    }

    /// Step 9: inserts the registered `entry` under the write lock (or
    /// hands it out uncached), unless its span changed or settles
    /// meanwhile: then it is thrown away and the request looked up again
    /// (the hit's handle, or `None` to register again).
    fn place(&mut self, entry: Arc<Entry<R>>) -> Result<Option<Registration<R>>> {
        let cache = self.cache;
        let sh = &cache.shared;
        let (s, e, _) = self.span;
        let mut t = sh.lock();
        // The eviction sweep, across the lock holds it is split into.
        let mut sweep = Sweep::default();
        // `Err`: registered again (why).
        let placed = loop {
            if self
                .mine
                .hit()
                .unwrap_or_else(|| t.changed_since(self.gen0, s, e))
            {
                break Err(Retry::Changed);
            }
            // Slots for the superseded entries in use (none for those
            // that only overlap the span: they stay cached), and for
            // the new one if it has none and ends up uncached.
            let want = t.supersedes(s, e) + usize::from(self.mine.hit().is_none());
            if self.slots.left() < want {
                // More entries to supersede than when the slots were
                // reserved: reserve more, unlocked, and look again.
                drop(t);
                self.slots.add(want - self.slots.left());
                t = sh.lock();
                continue;
            }
            if let Some(left) = sh.backend.monitor.as_ref().and_then(|m| m.settling(s, e)) {
                // A discard of the span read since the wait of step 6 (its
                // invalidation may be waiting for this lock), or one
                // the wait budget ran out on: its pages may be dropped
                // right after we pinned them. Wait and register again;
                // past the settle retries or the budget, hand it out
                // uncached, stale once the settle time ends.
                if self.settle.retry() {
                    break Err(Retry::Settling);
                }
                break Ok(Placed::Put {
                    settling: Some(left),
                    cached: false,
                    evicted: 0,
                });
            }
            if let Some(hit) = self.raced_hit(&t) {
                break Ok(Placed::Raced(hit));
            }
            match t.insert(&entry, &mut self.doomed, &mut sweep) {
                Insert::Done { evicted } => {
                    break Ok(Placed::Put {
                        settling: None,
                        cached: true,
                        evicted: self.evicted_before + evicted,
                    })
                }
                Insert::NoRoom { evicted } => {
                    break Ok(Placed::Put {
                        settling: None,
                        cached: false,
                        evicted: self.evicted_before + evicted,
                    })
                }
                Insert::Paused { evicted } => {
                    // A bounded stretch of the sweep is done: let
                    // readers in, then go on (checking again whether
                    // the span changed meanwhile).
                    self.evicted_before += evicted;
                    drop(t);
                    t = sh.lock();
                }
                Insert::Short { need } => {
                    // The table changed since the room was made: make
                    // more, unlocked, and look again.
                    drop(t);
                    self.doomed.reserve(need);
                    t = sh.lock();
                }
            }
        };
        let (settling, cached, evicted) = match placed {
            Ok(Placed::Put {
                settling,
                cached,
                evicted,
            }) => (settling, cached, evicted),
            Ok(Placed::Raced(hit)) => {
                drop(t);
                // Waiters look again now: a hit on that entry too.
                self.published = None;
                self.mine.set(None);
                // Deregistered when the miss is dropped, with the idle
                // entries a paused sweep evicted (no lock held).
                self.doomed.push(entry);
                let stats = &sh.backend.stats;
                stats.hits.add(1);
                Stats::bump(&stats.raced_hits);
                cache.count_evictions(self.evicted_before);
                return Ok(Some(Registration { entry: hit }));
            }
            Err(why) => {
                // Retry with fresh state (and a fresh slot, for the new span).
                drop(t);
                self.mine.set(None);
                drop(entry);
                if why == Retry::Changed {
                    self.changes += 1;
                    if self.changes == ATTEMPTS {
                        cache.count_evictions(self.evicted_before);
                        return Err(Error::Unstable { addr: self.req.0 });
                    }
                }
                // Look the request up again: another thread may have
                // registered a range covering it meanwhile (a hit then;
                // before 2026-11-29 the miss only noted its span again,
                // merged with that entry, and registered the union).
                return self.look_again();
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
        for d in self.doomed.iter().filter(|d| d.refs.users() > 0) {
            d.track_since(Arc::clone(sh), &t, &mut self.slots, gen_now, None);
        }
        if !cached {
            // One made while its range was settling (discards raced
            // every settle retry) may have pinned pages the discard
            // drops: stale once the settle time ends.
            let stale_at = settling.map(|left| Instant::now() + left);
            match self.mine.take() {
                // Live since before the pin and not hit: exact from now on.
                Some(i) => entry.track_with(Arc::clone(sh), self.gen0, stale_at, Some(i)),
                None => entry.track_since(Arc::clone(sh), &t, &mut self.slots, gen_now, stale_at),
            }
        }
        drop(t);
        // The outcome is known: waiters look again now (a hit if it is
        // cached), not after the deregistrations below.
        self.published = None;
        // Cached: the index tracks the entry now.
        self.mine.set(None);
        if !cached {
            // (Cached: the insertion gave it its user, counted busy.)
            entry.acquire_outside();
            Stats::bump(&sh.backend.stats.uncached);
        }
        cache.count_evictions(evicted);
        // The entries taken out (`doomed`) are deregistered when the
        // miss is dropped, after this returns.
        Ok(Some(Registration { entry }))
    }
}
