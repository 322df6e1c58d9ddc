//! Steps 1 to 5 of [`Cache::get`] (see the module docs): the checks, the
//! monitor sync, the lookup under the read lock, and what a miss notes of
//! the table before it goes on in `miss`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::entry::{self, Registration};
use super::shared::Shared;
use super::table::Table;
use super::Cache;
use crate::error::{Error, Result};
use crate::registrar::{Access, Registrar};

/// What a miss notes of the table before it registers (see [`note_miss`]):
/// the span, the generation, the bound on entries taken out, the slots,
/// the count of insertions.
pub(super) type Noted = ((usize, usize, Access), u64, usize, usize, u64);

/// What [`Cache::look_up`] found.
pub(super) enum Looked<R: Registrar> {
    /// A hit: the handle.
    Hit(Registration<R>),
    /// A miss: what it notes of the table.
    Miss(Noted),
}

/// What a miss notes of table `t` before it registers (step 5 of the
/// module docs, and again after each wait and before each later attempt):
/// the span to register (`[addr, end)` with `access`, merged with the
/// entries it overlaps), the table's generation, a bound on the entries
/// the insertion may take out, and the tracking slots it may need (one
/// per entry the span would supersede, which may be in use by then, and
/// one for the span; none for an entry that only overlaps the span,
/// which stays cached), and the count of
/// insertions into the index (an entry covering the request can only
/// appear after it moves: see `Miss::raced_hit`). The pre-filter is
/// widened to the span before the generation is noted: an invalidation
/// that skips us saw the old bounds, so its unmap happened before our pin.
pub(super) fn note_miss<R: Registrar>(
    sh: &Shared<R>,
    t: &Table<R>,
    addr: usize,
    end: usize,
    access: Access,
) -> Noted {
    let span = t.span(addr, end, access);
    sh.widen(span.0, span.1);
    let want = t.supersedes(span.0, span.1) + 1;
    (
        span,
        t.generation(),
        t.doom_bound(span.0, span.1),
        want,
        t.inserts(),
    )
}

impl<R: Registrar> Cache<R> {
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
        match self.look_up(addr, end, access)? {
            Looked::Hit(r) => Ok(r),
            Looked::Miss(noted) => self.miss((addr, end, access), noted),
        }
    }

    /// Looks `[addr, end)` with `access` up under the read lock: a hit's
    /// handle (counted), or what a miss notes of the table in the same
    /// hold ([`note_miss`]). An entry the monitor reports changed is
    /// invalidated first. Errs only at the handle limit.
    #[inline(always)]
    pub(super) fn look_up(&self, addr: usize, end: usize, access: Access) -> Result<Looked<R>> {
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
    pub(super) fn look_again(
        &self,
        addr: usize,
        end: usize,
        access: Access,
        evicted: usize,
    ) -> Result<Looked<R>> {
        if let Some(m) = self.shared.backend.monitor.as_deref() {
            self.sync_monitor(m);
        }
        let looked = self.look_up(addr, end, access);
        if !matches!(looked, Ok(Looked::Miss(_))) {
            self.count_evictions(evicted);
        }
        looked
    }
}
