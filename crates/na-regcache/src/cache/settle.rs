//! How long a miss (or [`Cache::get_unshared`](super::Cache::get_unshared))
//! waits for a range discarded moments ago to settle, and how often it
//! registers again when a discard raced its pin (see the module docs of
//! [`crate::monitor::uffd`], "`madvise`: the event comes before the
//! change").
//!
//! Both are bounded per call, apart from the retries for a mapping that
//! changed while it was registered ([`super::miss::ATTEMPTS`], then
//! [`Error::Unstable`](crate::Error::Unstable)): settling never uses up
//! those attempts, and a miss never waits more than [`SETTLE_BUDGET`] in
//! all. Worst case of one call: [`SETTLE_BUDGET`] of waiting (plus the
//! oversleep of its last sleep) and `ATTEMPTS + SETTLE_RETRIES`
//! registrations (three thrown away because the mapping changed during
//! them end in `Unstable`).

use std::time::Duration;

use crate::monitor::uffd::REMOVE_SETTLE;
use crate::monitor::Monitor;

/// The longest one miss (or one [`Cache::get_unshared`](crate::Cache::get_unshared)
/// call) waits, in all, for ranges still settling after a discard
/// ([`Monitor::wait_settled`]): four settle times of the userfaultfd
/// monitor ([`REMOVE_SETTLE`]). Every wait of the call counts against it:
/// those before its first pin, a wait again when its span, looked at
/// after a wait, grew over another settling range, and those before a
/// settle retry. A range discarded again and again is waited for no
/// longer; the check after the pin then hands the registration out
/// uncached, stale once the settle time ends. (Before 2026-11-29, each of
/// the three attempts of a miss could wait four settle times: about
/// 1.2 s.)
pub const SETTLE_BUDGET: Duration = REMOVE_SETTLE.saturating_mul(4);

/// Registrations a call throws away, at most, because their range was
/// found settling after the pin (a discard read since the wait: its pages
/// may go right after the pin). The next time it is handed out uncached.
pub(super) const SETTLE_RETRIES: usize = 2;

/// What one wait is charged at least: a monitor that reports a wait of
/// (nearly) no time cannot make a call loop for long on its budget.
const LEAST_WAIT: Duration = Duration::from_millis(1);

/// The settle waits and retries left to one call.
pub(super) struct Settle {
    /// Time left to wait.
    left: Duration,
    /// Settle retries made.
    retries: usize,
}

impl Settle {
    /// A call's allowance: [`SETTLE_BUDGET`], [`SETTLE_RETRIES`].
    pub fn new() -> Settle {
        Settle {
            left: SETTLE_BUDGET,
            retries: 0,
        }
    }

    /// Waits, while the budget lasts, until `[start, end)` no longer
    /// overlaps a settling range ([`Monitor::wait_settled`]); true if it
    /// found the range settling and waited (the caller then looks at its
    /// span again, and calls this again for the span it finds).
    pub fn wait(&mut self, m: &dyn Monitor, start: usize, end: usize) -> bool {
        if self.left.is_zero() {
            return false;
        }
        let Some(waited) = m.wait_settled(start, end, self.left) else {
            return false;
        };
        self.left = self.left.saturating_sub(waited.max(LEAST_WAIT));
        true
    }

    /// After the pin found the range settling: true if the call throws the
    /// registration away and registers again (after waiting; counted),
    /// false if it hands it out uncached (its retries or its budget spent).
    pub fn retry(&mut self) -> bool {
        if self.retries >= SETTLE_RETRIES || self.left.is_zero() {
            return false;
        }
        self.retries += 1;
        true
    }
}
