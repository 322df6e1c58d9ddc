//! Steps 1 to 5 of [`Cache::get`] (see the module docs): the checks, the
//! monitor sync, the lookup under the read lock, and what a miss notes of
//! the table before it goes on in `miss`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::entry::{self, Entry, Registration};
use super::shared::Shared;
use super::table::Table;
use super::Cache;
use crate::error::{Error, Result};
use crate::registrar::{Access, Registrar};
use crate::sys::brlock::ReadGuard;

/// What a miss notes of the table before it registers (see [`note_miss`]):
/// the span, the generation, the bound on entries taken out, the slots,
/// the count of insertions.
pub(super) type Noted = ((usize, usize, Access), u64, usize, usize, u64);

/// What a lookup made of the cached entry it found ([`Cache::take`]).
enum Take<R: Registrar> {
    /// A hit: the entry, with one more user.
    Hit(Arc<Entry<R>>),
    /// The entry (start, length) has `MAX_HANDLES` users.
    Full(usize, usize),
    /// The monitor reports the mapping of the entry `[start, end)` changed.
    Changed(usize, usize),
}

/// The error of a hit on an entry (start, length) at the handle limit.
#[cold]
fn too_many(addr: usize, len: usize) -> Error {
    Error::TooManyHandles {
        addr,
        len,
        max: entry::MAX_HANDLES,
    }
}

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
///
/// `span` is what [`Table::span_or_cover`] found for the request.
pub(super) fn note_miss<R: Registrar>(sh: &Shared<R>, t: &Table<R>, span: (usize, usize, Access)) -> Noted {
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
        if let Some(e) = t.lookup_last(addr, end, access) {
            match self.take(e) {
                Take::Hit(e) => {
                    drop(t);
                    sh.backend.stats.hits.add(1);
                    return Ok(Looked::Hit(Registration { entry: e }));
                }
                Take::Full(start, len) => {
                    drop(t);
                    return Err(too_many(start, len));
                }
                Take::Changed(s, en) => {
                    drop(t);
                    sh.invalidate_range(s, en);
                    t = sh.table.read();
                }
            }
        }
        self.walk_on(t, addr, end, access)
    }

    /// The miss path of [`Cache::look_up`], read lock `t` held: walks
    /// the entries the request overlaps ([`Table::span_or_cover`]), which
    /// finds an earlier entry of a pair that covers the request with the
    /// rights the last one lacks (taken as a hit, as in `look_up`), else
    /// notes the span ([`note_miss`]). Inlined: out of line (with or
    /// without `#[cold]`) its result, returned through memory, made `get`
    /// build a hit's `Looked` too (callgrind, `regcache_counts hits 1000
    /// 20000`: a hit and its release 322.3 and 319.2 instructions, 313.1
    /// inlined).
    #[inline(always)]
    fn walk_on<'a>(
        &'a self,
        mut t: ReadGuard<'a, Table<R>>,
        addr: usize,
        end: usize,
        access: Access,
    ) -> Result<Looked<R>> {
        let sh = &self.shared;
        loop {
            let span = match t.span_or_cover(addr, end, access) {
                Ok(span) => span,
                Err(e) => match self.take(e) {
                    Take::Hit(e) => {
                        drop(t);
                        sh.backend.stats.hits.add(1);
                        return Ok(Looked::Hit(Registration { entry: e }));
                    }
                    Take::Full(start, len) => {
                        drop(t);
                        return Err(too_many(start, len));
                    }
                    Take::Changed(s, en) => {
                        // Out of the index now: the walk does not find it again.
                        drop(t);
                        sh.invalidate_range(s, en);
                        t = sh.table.read();
                        continue;
                    }
                },
            };
            return Ok(Looked::Miss(note_miss(sh, &t, span)));
        }
    }

    /// A hit on cached entry `e` (its table's read lock held): a user
    /// taken under the lock so that eviction (write lock) never sees the
    /// entry idle, and counted busy under it, so a sweep never counts it
    /// idle; unless the entry has the most handles it may have or its
    /// monitor reports its mapping changed.
    #[inline(always)]
    fn take(&self, e: &Arc<Entry<R>>) -> Take<R> {
        let stale = match (&self.shared.backend.monitor, &e.watch) {
            (Some(m), Some(w)) => m.changed(w),
            _ => false,
        };
        if stale {
            Take::Changed(e.start, e.end)
        } else if !Table::acquire(e) {
            Take::Full(e.start, e.end - e.start)
        } else {
            Take::Hit(Arc::clone(e))
        }
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
