//! The REMOVE ranges still settling (see the module docs of
//! [`super`], "`madvise`: the event comes before the change"): a fixed
//! table, written by the reader, read by misses under the cache's lock.
//! A burst of more ranges than it holds merges the closest ones.

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use super::{Shared, REMOVE_SETTLE};

/// Ranges remembered as settling. More at once are merged, the two
/// closest into the range covering both (see [`Settling::add`]).
pub(super) const SETTLING_SLOTS: usize = 32;

/// Ranges whose REMOVE event was read recently (`madvise` drops the pages
/// after the event): `(start, end, deadline)`, deadlines in ns since `epoch`.
pub(super) struct Settling {
    /// Start, end, settle deadline (`u64::MAX` until armed) and the serial
    /// of the mark that made it; a slot whose deadline passed is free.
    pub(super) ranges: [SettlingRange; SETTLING_SLOTS],
    /// Marks made so far: a `sync` arms only the ranges marked before its
    /// probe.
    pub(super) marks: u64,
}

/// `(start, end, deadline, mark)` of one settling range (see [`Settling`]).
type SettlingRange = (usize, usize, u64, u64);

/// One range covering `a` and `b`, settling as long as either would: the
/// later deadline (`u64::MAX`, unarmed, if either is) and the later mark
/// (armed only by a probe that proves both advising threads awake).
fn merged(a: SettlingRange, b: SettlingRange) -> SettlingRange {
    (a.0.min(b.0), a.1.max(b.1), a.2.max(b.2), a.3.max(b.3))
}

/// The bytes that merging `a` and `b` adds to what they cover: the gap
/// between them (0 when they touch or overlap).
fn merge_cost(a: &SettlingRange, b: &SettlingRange) -> usize {
    let hull = a.1.max(b.1) - a.0.min(b.0);
    hull.saturating_sub(a.1 - a.0).saturating_sub(b.1 - b.0)
}

impl Settling {
    /// Remembers `range`: in a free slot, else by merging the two closest
    /// of the ranges held and `range` into one (so a burst of REMOVE
    /// events makes settling only the span of ranges near each other, never
    /// the whole address space). Allocation-free, bounded work (the reader
    /// calls it).
    fn add(&mut self, range: SettlingRange, now: u64) {
        if let Some(slot) = self.ranges.iter_mut().find(|r| r.2 <= now) {
            *slot = range;
            return;
        }
        // Candidates: the slots, then `range` (index SETTLING_SLOTS).
        let at = |i: usize| {
            if i == SETTLING_SLOTS {
                range
            } else {
                self.ranges[i]
            }
        };
        let mut best = (usize::MAX, 0, SETTLING_SLOTS);
        for i in 0..SETTLING_SLOTS {
            for j in i + 1..=SETTLING_SLOTS {
                let cost = merge_cost(&at(i), &at(j));
                if cost < best.0 {
                    best = (cost, i, j);
                }
            }
        }
        let (_, i, j) = best;
        self.ranges[i] = merged(at(i), at(j));
        if j < SETTLING_SLOTS {
            // Two held ranges merged: `range` takes the slot freed.
            self.ranges[j] = range;
        }
    }
}

impl Shared {
    /// Marks `[start, end)` settling (allocation-free; called by the reader
    /// before it invalidates). The settle time starts at the first `sync`
    /// that finds no change in flight after this: only then is the advising
    /// thread known to be awake (it lowers the count when it wakes).
    pub(super) fn mark_settling(&self, start: usize, end: usize) {
        let mut st = self.settling.lock().unwrap_or_else(|p| p.into_inner());
        let now = self.now_ns();
        st.marks += 1;
        let mark = st.marks;
        st.add((start, end, u64::MAX, mark), now);
        self.settle_until.store(u64::MAX, SeqCst);
        self.settle_unarmed.store(true, SeqCst);
    }

    /// The serial of the latest mark: read before a probe, it bounds what
    /// a quiet probe proves (see [`arm_settling`](Self::arm_settling)).
    pub(super) fn marks(&self) -> u64 {
        self.settling.lock().unwrap_or_else(|p| p.into_inner()).marks
    }

    /// Starts the settle time of the ranges marked up to serial `upto`
    /// (read before a probe that then found no change in flight: their
    /// advising threads are awake). A range marked after that read stays
    /// unarmed: its advising thread may still be asleep, and its settle
    /// time must not start before a later probe shows it awake.
    pub(super) fn arm_settling(&self, upto: u64) {
        let mut guard = self.settling.lock().unwrap_or_else(|p| p.into_inner());
        let st = &mut *guard;
        let deadline = self.now_ns() + REMOVE_SETTLE.as_nanos() as u64;
        let mut latest = 0;
        let mut unarmed = false;
        for (d, mark) in st.ranges.iter_mut().map(|r| (&mut r.2, r.3)) {
            if *d == u64::MAX {
                if mark <= upto {
                    *d = deadline;
                } else {
                    unarmed = true;
                }
            }
            latest = latest.max(*d);
        }
        self.settle_unarmed.store(unarmed, SeqCst);
        self.settle_until.store(latest, SeqCst);
    }

    /// Waits until `[start, end)` overlaps no settling range (see
    /// [`Monitor::wait_settled`](crate::Monitor::wait_settled)), for
    /// `limit` at most: sleeps out each settle time it finds, and starts
    /// one that has not started (a sync probes for the advising thread).
    /// Returns how long it waited, `None` if nothing was settling. Takes
    /// no lock but the settling table's, briefly.
    pub(super) fn wait_settled(&self, start: usize, end: usize, limit: Duration) -> Option<Duration> {
        let mut left = self.is_settling(start, end)?;
        self.counters[9].fetch_add(1, SeqCst);
        let began = self.now_ns();
        let give_up = began.saturating_add(u64::try_from(limit.as_nanos()).unwrap_or(u64::MAX));
        loop {
            let now = self.now_ns();
            let Some(remaining) = give_up.checked_sub(now).filter(|&r| r > 0) else {
                return Some(Duration::from_nanos(now - began));
            };
            let remaining = Duration::from_nanos(remaining);
            if left.is_zero() {
                // Its settle time has not started: the advising thread
                // may still be asleep. A sync probes and starts it; if a
                // newer mark keeps it unstarted, do not spin on probes.
                self.sync(false);
                if self.is_settling(start, end) == Some(Duration::ZERO) {
                    std::thread::sleep(remaining.min(Duration::from_millis(1)));
                }
            } else {
                std::thread::sleep(left.min(remaining));
            }
            match self.is_settling(start, end) {
                None => return Some(Duration::from_nanos(self.now_ns() - began)),
                Some(l) => left = l,
            }
        }
    }

    /// How long `[start, end)` stays settling, if it is: the latest settle
    /// deadline among the ranges it overlaps. A range whose settle time has
    /// not started (its advising thread may still be asleep, the zap still
    /// to come) gives zero: a registration made now is stale at once.
    pub(super) fn is_settling(&self, start: usize, end: usize) -> Option<Duration> {
        let now = self.now_ns();
        if self.settle_until.load(SeqCst) <= now {
            return None;
        }
        let st = self.settling.lock().unwrap_or_else(|p| p.into_inner());
        let latest = st
            .ranges
            .iter()
            .filter(|&&(s, e, _, _)| s < end && e > start)
            .map(|r| r.2)
            .filter(|&d| d > now)
            .max()?;
        Some(match latest {
            u64::MAX => Duration::ZERO,
            d => Duration::from_nanos(d - now),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::UffdMonitor;
    use super::*;

    fn monitor() -> UffdMonitor {
        UffdMonitor::new()
            .expect("userfaultfd with UNMAP/REMOVE/REMAP events (root, or vm.unprivileged_userfaultfd=1)")
    }

    fn armed(s: &Shared, start: usize) -> bool {
        s.is_settling(start, start + 0x1000)
            .is_some_and(|d| d > Duration::ZERO && d <= REMOVE_SETTLE)
    }

    #[test]
    fn a_remove_read_after_a_sync_loaded_its_marks_is_not_armed_by_that_sync() {
        let m = monitor();
        let s = &*m.shared;
        s.mark_settling(0x10000, 0x11000);
        let upto = s.marks();
        // The reader reads another REMOVE between the sync's load and its
        // quiet probe: that probe says nothing about the new advising thread.
        s.mark_settling(0x50000, 0x51000);
        s.arm_settling(upto);
        assert!(armed(s, 0x10000));
        assert_eq!(
            s.is_settling(0x50000, 0x51000),
            Some(Duration::ZERO),
            "armed too early"
        );
        assert!(s.settle_unarmed.load(SeqCst), "the next sync must arm it");
        s.sync(false);
        assert!(armed(s, 0x50000));
        assert!(!s.settle_unarmed.load(SeqCst));
    }

    #[test]
    fn an_overflowing_mark_after_the_load_stays_unarmed_with_what_it_merged_into() {
        let m = monitor();
        let s = &*m.shared;
        for i in 0..SETTLING_SLOTS {
            s.mark_settling(0x100000 * (i + 1), 0x100000 * (i + 1) + 0x1000);
        }
        let upto = s.marks();
        // No slot left: the first two merge, the far one takes a slot.
        s.mark_settling(0x7000_0000, 0x7000_1000);
        // Touches the fifth range: merged into it (no gap).
        s.mark_settling(0x501000, 0x502000);
        s.arm_settling(upto);
        assert_eq!(s.is_settling(0x7000_0000, 0x7000_1000), Some(Duration::ZERO));
        assert_eq!(s.is_settling(0x500000, 0x501000), Some(Duration::ZERO));
        assert_eq!(s.is_settling(0x501000, 0x502000), Some(Duration::ZERO));
        assert!(
            armed(s, 0x100000),
            "marked before the load, merged with the second"
        );
        assert!(armed(s, 0x200000));
        assert_eq!(s.is_settling(0x9000_0000, 0x9000_1000), None, "unrelated");
        s.sync(false);
        assert!(armed(s, 0x7000_0000));
        assert!(armed(s, 0x500000));
        assert!(armed(s, 0x100000));
    }

    /// Far more REMOVE ranges than slots: each stays settling (unarmed
    /// until a sync), ranges away from all of them do not (before, the 33rd
    /// made the whole address space settle: every miss of every cache was
    /// handed out uncached).
    #[test]
    fn a_burst_of_removes_settles_only_around_its_ranges() {
        let m = monitor();
        let s = &*m.shared;
        let at = |i: usize| 0x1000_0000 + i * 0x10000;
        for i in 0..200 {
            s.mark_settling(at(i), at(i) + 0x1000);
        }
        for i in 0..200 {
            assert_eq!(
                s.is_settling(at(i), at(i) + 0x1000),
                Some(Duration::ZERO),
                "range {i}"
            );
        }
        assert_eq!(s.is_settling(0x100000, 0x200000), None, "below the burst");
        assert_eq!(s.is_settling(at(200), at(300)), None, "above the burst");
        s.sync(false);
        for i in 0..200 {
            assert!(armed(s, at(i)), "range {i}");
        }
        assert_eq!(s.is_settling(0x100000, 0x200000), None, "below the burst");
    }
}
