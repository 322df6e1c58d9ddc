//! Concurrent misses of one range, coalesced: the spans misses are
//! registering right now, published so that a later miss whose request
//! one of them covers waits for that registration instead of making its
//! own (a second `ibv_reg_mr` of the same pages, which would supersede
//! the first).
//!
//! A miss publishes its span just before it registers (after any settle
//! wait: step 7 of the module docs) and takes it back as soon as its
//! outcome is known: right after the write lock that cached it or
//! decided to hand it out uncached (before the deregistrations of the
//! entries it took out), when it fails, and, since waiting for it would
//! then gain nothing, when the monitor refuses the span (shared memory:
//! never cached), when the table is full of entries in use as it claims
//! its tracking slot (its registration would be handed out uncached),
//! and before it falls back on registering the request alone after a
//! merged span failed. A miss that registers again (its span changed,
//! or settled, meanwhile) makes the span it registers next the published
//! one ([`Published::update`]). A miss that finds its request covered by
//! another's published span (same or wider rights) waits on a condition
//! variable while that span is published and covers it, for
//! [`COALESCE_WAIT`] at most, then looks its request up again like any
//! lookup (syncing the monitor first): a hit if the other registration
//! was cached and nothing invalidated it since, else a miss of its own,
//! as if it had not waited. A call waits once at most.
//!
//! What waiting costs where it does not pay: a waiter whose first ends up
//! uncached though the table had room when it claimed its slot (room
//! taken meanwhile), or fails (after its registrar's retry), has waited
//! for that registration first, once.
//!
//! Only requests a published span *covers* wait. One that only overlaps
//! it registers at once, as before: the span does not cover it, so it
//! registers anyway (the union, once the other is cached), and waiting
//! would only put its registration after the other's instead of beside it.
//!
//! Only misses take the mutex here; hits never look. Nothing here is
//! done under the table's lock, and nothing allocates: the spans are a
//! fixed array (a miss that finds it full registers unpublished, as before).

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Cache;
use crate::registrar::{Access, Registrar};
use crate::stats::Stats;

/// The longest a miss waits for another thread's registration of a span
/// covering its request, by default ([`Cache::set_coalesce_wait`] changes
/// it per cache); past it, it registers on its own (counted in
/// [`CacheStats::coalesce_timeouts`](crate::CacheStats::coalesce_timeouts)).
/// Generous: a registration of a large buffer takes long, and waiting for
/// it costs less than pinning the same pages again.
pub const COALESCE_WAIT: Duration = Duration::from_secs(5);

impl<R: Registrar> Cache<R> {
    /// Sets the longest a miss of this cache waits for another thread's
    /// registration of a span covering its request (from the next wait
    /// on; [`COALESCE_WAIT`] until then); past it, the miss registers on
    /// its own. Longer for registrations that may take longer than the
    /// default (an `ibv_reg_mr` of many gigabytes), or for tests on a
    /// loaded machine, where a wait that must end when another thread
    /// acts may outlast the default only because that thread was not
    /// scheduled; `Duration::ZERO` makes a miss that would wait register
    /// at once (counted as a wait that ran out). A bound over a day is a
    /// day.
    pub fn set_coalesce_wait(&self, bound: Duration) {
        self.shared.pending.set_bound(bound);
    }
}

/// The longest bound [`Cache::set_coalesce_wait`] sets.
const LONGEST_WAIT: Duration = Duration::from_secs(24 * 60 * 60);

/// Spans published at most at once (more concurrent misses register
/// unpublished).
const SPANS: usize = 32;

/// One published span: `[start, end)` with `access`, by miss `id` (0: free).
#[derive(Clone, Copy, Default)]
struct Span {
    id: u64,
    start: usize,
    end: usize,
    access: Access,
}

impl Span {
    /// Whether this span, published, covers `[addr, end)` with `access`.
    fn covers(&self, (addr, end, access): (usize, usize, Access)) -> bool {
        self.id != 0 && self.start <= addr && end <= self.end && self.access.contains(access)
    }
}

#[derive(Default)]
struct State {
    spans: [Span; SPANS],
    /// The last id given out.
    last: u64,
}

/// The spans being registered, and the condition waiters wait on.
pub(crate) struct Pending {
    state: Mutex<State>,
    done: Condvar,
    /// The longest wait, in nanoseconds ([`Cache::set_coalesce_wait`]).
    bound_ns: AtomicU64,
}

impl Default for Pending {
    fn default() -> Self {
        Pending {
            state: Mutex::default(),
            done: Condvar::new(),
            bound_ns: AtomicU64::new(COALESCE_WAIT.as_nanos() as u64),
        }
    }
}

/// What [`Pending::enter`] decided.
pub(crate) enum Enter<'a> {
    /// The span is published until this is dropped.
    Published(Published<'a>),
    /// Another miss registers a span covering the request: wait for it
    /// ([`Pending::wait`]).
    Wait(u64),
    /// Not published (no free record, or covered and no wait allowed).
    Alone,
}

/// A published span; dropping it takes it back and wakes the waiters.
pub(crate) struct Published<'a> {
    pending: &'a Pending,
    id: u64,
}

impl Published<'_> {
    /// The miss registers `span` now (it registers again, with the span
    /// its lookup noted): waiters it covers wait on, the others are woken
    /// (they register on their own), and later misses it covers wait.
    pub fn update(&self, (start, end, access): (usize, usize, Access)) {
        let mut st = self.pending.lock();
        let Some(s) = st.spans.iter_mut().find(|s| s.id == self.id) else {
            return;
        };
        if (s.start, s.end, s.access) == (start, end, access) {
            return;
        }
        (s.start, s.end, s.access) = (start, end, access);
        drop(st);
        self.pending.done.notify_all();
    }
}

impl Drop for Published<'_> {
    fn drop(&mut self) {
        let mut st = self.pending.lock();
        if let Some(s) = st.spans.iter_mut().find(|s| s.id == self.id) {
            *s = Span::default();
        }
        drop(st);
        self.pending.done.notify_all();
    }
}

impl Pending {
    /// Sets the longest wait (a day at most).
    pub fn set_bound(&self, bound: Duration) {
        let ns = bound.min(LONGEST_WAIT).as_nanos() as u64;
        self.bound_ns.store(ns, Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics under this lock; a poisoned one is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A miss of `[addr, end)` with `access` about to register `span`:
    /// if another miss's published span covers the request, and
    /// `may_wait`, [`Enter::Wait`] for it; else publishes `span` (checked
    /// and published in one hold: of two misses of one range, one
    /// publishes and the other waits).
    pub fn enter(
        &self,
        req: (usize, usize, Access),
        span: (usize, usize, Access),
        may_wait: bool,
    ) -> Enter<'_> {
        let mut st = self.lock();
        let covering = st.spans.iter().find(|s| s.covers(req));
        if let Some(s) = covering {
            return if may_wait { Enter::Wait(s.id) } else { Enter::Alone };
        }
        st.last += 1;
        let id = st.last;
        match st.spans.iter_mut().find(|s| s.id == 0) {
            Some(s) => {
                *s = Span {
                    id,
                    start: span.0,
                    end: span.1,
                    access: span.2,
                };
                Enter::Published(Published { pending: self, id })
            }
            None => Enter::Alone,
        }
    }

    /// Waits until span `id` is taken back or no longer covers `req`
    /// (its miss registers another span now), for the cache's bound at
    /// most ([`COALESCE_WAIT`] unless [`Cache::set_coalesce_wait`] changed
    /// it; counted in `stats`: the wait, and a wait that ran out).
    pub fn wait(&self, id: u64, req: (usize, usize, Access), stats: &Stats) {
        let deadline = Instant::now() + Duration::from_nanos(self.bound_ns.load(Relaxed));
        let mut st = self.lock();
        // Counted under the lock: once the count shows the wait, the
        // waiter is parked or sees the span gone (tests order on it).
        Stats::bump(&stats.coalesce_waits);
        while st.spans.iter().any(|s| s.id == id && s.covers(req)) {
            let left = deadline.saturating_duration_since(Instant::now());
            let (guard, res) = self
                .done
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner());
            st = guard;
            if res.timed_out() {
                // Ran out its bound (not woken by the span's end).
                stats.coalesce_timeouts.fetch_add(1, Relaxed);
                return;
            }
        }
    }
}
