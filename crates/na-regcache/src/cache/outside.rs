//! Registrations outside the index: [`Cache::get_unshared`] (memory
//! exposed to peers), the uncached fallbacks of [`Cache::get`], watched
//! and tracked (their validity flag clears when their range changes) or,
//! where nothing watches, plain.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use super::entry::{Entry, Registration};
use super::settle::Settle;
use super::Cache;
use crate::error::Result;
use crate::registrar::{Access, Registrar};
use crate::stats::Stats;

impl<R: Registrar> Cache<R> {
    /// A registration of exactly `[addr, addr+len)` that is neither kept in
    /// the cache nor shared with any other caller: it is deregistered when
    /// its last handle drops, never left idle. For memory exposed to peers
    /// with remote access rights, whose exposure must end with its user: a
    /// cached registration outlives it, and a peer that kept its key could
    /// go on reading and writing whatever the memory holds next (a freed
    /// heap buffer's next owner, say). Watched like the uncached fallback
    /// of [`get`](Self::get): its validity flag clears when the monitor
    /// sees its mapping change (where the monitor accepts the range).
    pub fn get_unshared(&self, addr: usize, len: usize, access: Access) -> Result<Registration<R>> {
        let end = self.checked_end(addr, len)?;
        let sh = &self.shared;
        let Some(m) = sh.backend.monitor.as_ref().filter(|_| sh.caching) else {
            // Nothing watches mappings: a plain registration, as `get` gives.
            return self.plain(addr, end, access, &sh.backend.stats.unshared);
        };
        self.watched_outside(
            m.as_ref(),
            addr,
            end,
            access,
            &sh.backend.stats.unshared,
            &mut Settle::new(),
        )
    }

    /// A registration of exactly `[addr, end)` outside the index, watched
    /// and tracked like a cached entry: its validity flag clears when the
    /// monitor sees its mapping change (unwatched only where the monitor
    /// refuses the range). Counted in `counter`. Waits for the range to
    /// settle, and registers again when a discard raced the pin, within
    /// `settle` (the caller's allowance).
    pub(super) fn watched_outside(
        &self,
        m: &dyn crate::monitor::Monitor,
        addr: usize,
        end: usize,
        access: Access,
        counter: &AtomicU64,
        settle: &mut Settle,
    ) -> Result<Registration<R>> {
        let sh = &self.shared;
        let len = end - addr;
        loop {
            // As in `get`: changes that completed before this call are
            // applied first (so they cannot count against the new
            // registration); a range discarded moments ago is pinned only
            // once the discard is done (and what the monitor read
            // meanwhile is applied; waited for again while it settles and
            // the budget lasts); then the pre-filter is widened and the
            // generation noted before the subscription and the pin, so a
            // change after them is seen.
            self.sync_monitor(m);
            while settle.wait(m, addr, end) {
                self.sync_monitor(m);
            }
            sh.widen(addr, end);
            // The tracking slot is claimed with the generation, before the
            // subscription and the pin: an invalidation while they are made
            // marks it, however many of other ranges come meanwhile. It is
            // reserved before the lock (the slot table may grow).
            let mut reserved = sh.tracked.reserve(1);
            let (gen, slot) = {
                let t = sh.lock();
                (t.generation(), sh.claim_live(&t, &mut reserved, addr, end))
            };
            drop(reserved);
            let give_back = || {
                if let Some(i) = slot {
                    sh.tracked.release(i);
                }
            };
            let watch = match m.subscribe(addr, len, addr as u64) {
                Ok(w) => Some(w),
                Err(err) => {
                    tracing::debug!(addr, len, error = %crate::error::Chain(&err), "monitor refused range: unwatched");
                    None
                }
            };
            let region = match self.register(addr, len, access) {
                Ok(r) => r,
                Err(e) => {
                    if let Some(w) = &watch {
                        m.unsubscribe(w);
                    }
                    give_back();
                    return Err(e);
                }
            };
            let entry = Arc::new(Entry::new(&sh.backend, (addr, end, access), region, watch));
            let settling = m.settling(addr, end);
            if settling.is_some() && settle.retry() {
                // A discard of the range read since the wait (or one the
                // wait budget ran out on): the pages may be dropped right
                // after we pinned them. Register again once it is done
                // (dropping the entry deregisters it and ends its watch).
                give_back();
                drop(entry);
                continue;
            }
            // Past the settle retries (or the budget), a registration
            // made while its range settles is stale once the settle time
            // ends.
            let stale_at = settling.map(|left| Instant::now() + left);
            if slot.is_none() {
                tracing::debug!(
                    addr,
                    len,
                    "regcache: the tracking slots cannot grow; tracked by history"
                );
            }
            entry.track_with(Arc::clone(sh), gen, stale_at, slot);
            return Ok(self.hand_out(entry, counter));
        }
    }

    /// The first user handle of an entry outside the index, counted in
    /// `counter`.
    fn hand_out(&self, entry: Arc<Entry<R>>, counter: &AtomicU64) -> Registration<R> {
        entry.acquire_outside();
        Stats::bump(counter);
        Registration { entry }
    }

    pub(super) fn uncached(&self, addr: usize, end: usize, access: Access) -> Result<Registration<R>> {
        self.plain(addr, end, access, &self.shared.backend.stats.uncached)
    }

    /// An unwatched registration outside the index, counted in `counter`.
    fn plain(&self, addr: usize, end: usize, access: Access, counter: &AtomicU64) -> Result<Registration<R>> {
        let region = self.register(addr, end - addr, access)?;
        let sh = &self.shared;
        let entry = Arc::new(Entry::new(&sh.backend, (addr, end, access), region, None));
        Ok(self.hand_out(entry, counter))
    }
}
