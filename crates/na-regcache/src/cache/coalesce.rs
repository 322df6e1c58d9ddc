//! Concurrent misses of one range, coalesced: the spans misses are
//! registering right now, published so that a later miss whose request
//! one of them covers waits for that registration instead of making its
//! own (a second `ibv_reg_mr` of the same pages, which would supersede
//! the first).
//!
//! A miss publishes its span just before it registers (after any settle
//! wait: step 7 of the module docs) and takes it back when its call ends,
//! however it ends: cached, handed out uncached, failed; or as soon as the
//! monitor refuses the span (shared memory: never cached, so misses of it
//! do not wait for each other). A miss that finds
//! its request covered by another's published span (same or wider rights)
//! waits on a condition variable until that span is taken back, for
//! [`COALESCE_WAIT`] at most, then looks its request up again like any
//! lookup (syncing the monitor first): a hit if the other registration was
//! cached and nothing invalidated it since, else a miss of its own, as if
//! it had not waited. A call waits once at most.
//!
//! What waiting costs where it does not pay: a waiter whose registration
//! ends up made anyway (the first failed, or was handed out uncached
//! because the cache is full of entries in use) has waited for one other
//! registration first, once. The published span is the one noted when it
//! was published; a miss that retries with another span keeps it (its
//! waiters then find a miss when they look again, and register).
//!
//! Only misses take the mutex here; hits never look. Nothing here is
//! done under the table's lock, and nothing allocates: the spans are a
//! fixed array (a miss that finds it full registers unpublished, as before).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::registrar::Access;
use crate::stats::Stats;

/// The longest a miss waits for another thread's registration of a span
/// covering its request; past it, it registers on its own (counted in
/// [`CacheStats::coalesce_timeouts`](crate::CacheStats::coalesce_timeouts)).
/// Generous: a registration of a large buffer takes long, and waiting for
/// it costs less than pinning the same pages again.
pub const COALESCE_WAIT: Duration = Duration::from_secs(5);

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

#[derive(Default)]
struct State {
    spans: [Span; SPANS],
    /// The last id given out.
    last: u64,
}

/// The spans being registered, and the condition waiters wait on.
#[derive(Default)]
pub(crate) struct Pending {
    state: Mutex<State>,
    done: Condvar,
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
        (addr, end, access): (usize, usize, Access),
        span: (usize, usize, Access),
        may_wait: bool,
    ) -> Enter<'_> {
        let mut st = self.lock();
        let covering = st
            .spans
            .iter()
            .find(|s| s.id != 0 && s.start <= addr && end <= s.end && s.access.contains(access));
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

    /// Waits until span `id` is taken back, for [`COALESCE_WAIT`] at most
    /// (counted in `stats`: the wait, and a wait that ran out).
    pub fn wait(&self, id: u64, stats: &Stats) {
        let deadline = Instant::now() + COALESCE_WAIT;
        let mut st = self.lock();
        // Counted under the lock: once the count shows the wait, the
        // waiter is parked or sees the span gone (tests order on it).
        Stats::bump(&stats.coalesce_waits);
        while st.spans.iter().any(|s| s.id == id) {
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
