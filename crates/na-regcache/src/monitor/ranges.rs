//! How many watches cover each page of the registered address space, as
//! disjoint intervals with counts: what lets the userfaultfd monitor
//! unregister a range once no watch needs it, without unregistering pages
//! a neighbouring watch still covers.
//!
//! Without it, every `UFFDIO_REGISTER` of part of a mapping splits the
//! mapping's VMA for good, and a long-running process that registers many
//! scattered buffers creeps towards `vm.max_map_count` (at which `munmap`
//! and `mprotect` start failing with `ENOMEM` for the whole process).

use std::collections::BTreeMap;

/// Disjoint `[start, end)` intervals, each covered by `count >= 1` watches.
#[derive(Debug, Default)]
pub(crate) struct RangeCounts {
    /// start → (end, count).
    map: BTreeMap<usize, (usize, u32)>,
}

impl RangeCounts {
    /// Splits the interval containing `at` (if any) so that one starts at `at`.
    fn split_at(&mut self, at: usize) {
        let Some((&s, &(e, c))) = self.map.range(..at).next_back() else {
            return;
        };
        if s < at && at < e {
            self.map.insert(s, (at, c));
            self.map.insert(at, (e, c));
        }
    }

    /// Adds one watch over `[start, end)`.
    pub fn add(&mut self, start: usize, end: usize) {
        if start >= end {
            return;
        }
        self.split_at(start);
        self.split_at(end);
        let mut at = start;
        let covered: Vec<(usize, usize)> = self.map.range(start..end).map(|(&s, &(e, _))| (s, e)).collect();
        for (s, e) in covered {
            if at < s {
                self.map.insert(at, (s, 1));
            }
            if let Some(v) = self.map.get_mut(&s) {
                v.1 += 1;
            }
            at = e;
        }
        if at < end {
            self.map.insert(at, (end, 1));
        }
    }

    /// Removes one watch over `[start, end)` (added before); returns the
    /// intervals no watch covers any more, merged where they touch.
    pub fn remove(&mut self, start: usize, end: usize) -> Vec<(usize, usize)> {
        if start >= end {
            return Vec::new();
        }
        self.split_at(start);
        self.split_at(end);
        let covered: Vec<usize> = self.map.range(start..end).map(|(&s, _)| s).collect();
        let mut freed: Vec<(usize, usize)> = Vec::new();
        for s in covered {
            let Some(v) = self.map.get_mut(&s) else { continue };
            v.1 = v.1.saturating_sub(1);
            if v.1 == 0 {
                let e = v.0;
                self.map.remove(&s);
                match freed.last_mut() {
                    Some(last) if last.1 == s => last.1 = e,
                    _ => freed.push((s, e)),
                }
            }
        }
        freed
    }

    /// Intervals held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_watches_free_only_what_nobody_covers() {
        let mut r = RangeCounts::default();
        r.add(0, 40);
        r.add(20, 60);
        assert_eq!(r.remove(0, 40), vec![(0, 20)], "20..40 is still covered");
        assert_eq!(r.remove(20, 60), vec![(20, 60)], "merged where they touch");
        assert_eq!(r.len(), 0);
    }

    #[test]
    fn identical_and_nested_watches() {
        let mut r = RangeCounts::default();
        r.add(10, 20);
        r.add(10, 20);
        r.add(12, 14);
        assert!(r.remove(10, 20).is_empty());
        assert_eq!(r.remove(10, 20), vec![(10, 12), (14, 20)]);
        assert_eq!(r.remove(12, 14), vec![(12, 14)]);
        assert_eq!(r.len(), 0);
        assert!(r.remove(5, 5).is_empty());
    }

    #[test]
    fn many_scattered_watches_leave_nothing_behind() {
        let mut r = RangeCounts::default();
        for i in 0..1000usize {
            r.add(i * 3, i * 3 + 2);
            r.add(i * 3 + 1, i * 3 + 3);
        }
        for i in 0..1000usize {
            r.remove(i * 3, i * 3 + 2);
            r.remove(i * 3 + 1, i * 3 + 3);
        }
        assert_eq!(r.len(), 0);
    }
}
