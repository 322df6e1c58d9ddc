//! Entries that only overlap (neither contains the other) both stay in
//! the index ([`Table::superseded`]); an entry containing, or contained
//! in, a new one is superseded. Lookups still find a covering entry, and
//! invalidations every overlapping one. Real entries of a registrar that
//! pins nothing (the table never touches memory itself).

use std::sync::Arc;

use super::entry::{Backend, Entry};
use super::table::{Insert, Sweep, Table};
use super::test_rig::{backend, Noop, PAGE};
use crate::registrar::Access;

const W: Access = Access::LOCAL_WRITE;

fn entry(b: &Arc<Backend<Noop>>, (start, end): (usize, usize), access: Access) -> Arc<Entry<Noop>> {
    Arc::new(Entry::new(b, (start * PAGE, end * PAGE, access), (), None))
}

/// Inserts `e` (room made as a miss makes it); the entries it took out.
fn insert(t: &mut Table<Noop>, e: &Arc<Entry<Noop>>) -> Vec<Arc<Entry<Noop>>> {
    let mut doomed = Vec::with_capacity(t.doom_bound(e.start, e.end));
    match t.insert(e, &mut doomed, &mut Sweep::default()) {
        Insert::Done { evicted: 0 } => doomed,
        _ => panic!("inserted without eviction"),
    }
}

/// The range (in pages) of the entry a lookup of `[s, e)` pages finds.
fn found(t: &Table<Noop>, (s, e): (usize, usize), access: Access) -> Option<(usize, usize)> {
    t.lookup(s * PAGE, e * PAGE, access)
        .map(|en| (en.start / PAGE, en.end / PAGE))
}

/// Two entries that only overlap both stay cached: each range is a hit on
/// its own entry, the shared pages on the later one (it ends last), and
/// a range covered by neither alone misses. (Before, the later insertion
/// superseded the earlier: the first lookup missed.)
#[test]
fn entries_that_only_overlap_both_stay_and_are_found() {
    let b = backend();
    let mut t = Table::new(16, usize::MAX);
    let a = entry(&b, (1, 5), W);
    let c = entry(&b, (3, 8), W);
    assert!(insert(&mut t, &a).is_empty());
    assert!(
        insert(&mut t, &c).is_empty(),
        "only overlapping: nothing superseded"
    );
    assert_eq!(t.live(), 2);
    assert!(a.refs.indexed() && c.refs.indexed());
    assert_eq!(found(&t, (1, 2), W), Some((1, 5)));
    assert_eq!(found(&t, (1, 5), W), Some((1, 5)));
    assert_eq!(found(&t, (3, 5), W), Some((3, 8)));
    assert_eq!(found(&t, (5, 8), W), Some((3, 8)));
    assert_eq!(
        found(&t, (2, 6), W),
        None,
        "covered by the pair, by neither alone"
    );
    // The span of a request covered by neither merges both.
    let (s, e, _) = t.span(2 * PAGE, 6 * PAGE, W);
    assert_eq!((s / PAGE, e / PAGE), (1, 8));
}

/// An insertion supersedes the entries it contains and keeps those it
/// only overlaps; one contained in an entry (which lacks its rights)
/// supersedes that entry. No entry ever contains another.
#[test]
fn an_insertion_supersedes_only_what_it_contains_or_what_contains_it() {
    let b = backend();
    let mut t = Table::new(16, usize::MAX);
    let left = entry(&b, (1, 5), W);
    let mid = entry(&b, (4, 7), W);
    let right = entry(&b, (6, 10), W);
    for e in [&left, &mid, &right] {
        assert!(insert(&mut t, e).is_empty());
    }
    assert_eq!(t.live(), 3);
    // Contains `mid`, only overlaps `left` and `right`.
    let wide = entry(&b, (3, 8), W);
    let gone = insert(&mut t, &wide);
    assert_eq!(gone.len(), 1);
    assert!(Arc::ptr_eq(&gone[0], &mid));
    assert!(left.refs.indexed() && right.refs.indexed() && !mid.refs.indexed());
    assert_eq!(t.live(), 3);
    // Inside `wide`, with rights `wide` lacks: `wide` goes, the
    // neighbours it only overlapped stay.
    let rw = Access::LOCAL_WRITE | Access::REMOTE_READ;
    let inner = entry(&b, (4, 6), rw);
    let gone = insert(&mut t, &inner);
    assert_eq!(gone.len(), 1);
    assert!(Arc::ptr_eq(&gone[0], &wide));
    assert_eq!(found(&t, (4, 6), rw), Some((4, 6)));
    assert_eq!(found(&t, (1, 5), W), Some((1, 5)));
    assert_eq!(found(&t, (6, 10), W), Some((6, 10)));
    // Equal starts: a longer entry from the same start contains it.
    let same = entry(&b, (1, 6), W);
    let gone = insert(&mut t, &same);
    assert_eq!(gone.len(), 2, "`left` and `inner`, inside it");
    assert_eq!(t.live(), 2);
    assert_eq!(found(&t, (1, 6), W), Some((1, 6)));
    assert_eq!(found(&t, (7, 9), W), Some((6, 10)));
}

/// An invalidation takes out every entry overlapping its range: both of
/// a pair for the shared pages, only the one concerned elsewhere.
#[test]
fn an_invalidation_takes_out_every_overlapping_entry_of_a_pair() {
    let b = backend();
    let mut t = Table::new(16, usize::MAX);
    let a = entry(&b, (1, 5), W);
    let c = entry(&b, (3, 8), W);
    let d = entry(&b, (7, 12), W);
    for e in [&a, &c, &d] {
        assert!(insert(&mut t, e).is_empty());
    }
    assert_eq!(t.live(), 3);
    assert_eq!(t.invalidate(PAGE, PAGE + 1), 1, "pages only `a` has");
    assert!(!a.refs.indexed() && c.refs.indexed() && d.refs.indexed());
    assert_eq!(
        t.invalidate(7 * PAGE, 7 * PAGE + 1),
        2,
        "a page `c` and `d` share"
    );
    assert!(!c.refs.indexed() && !d.refs.indexed());
    assert_eq!(t.live(), 0);
}
