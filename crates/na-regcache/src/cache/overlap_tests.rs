//! Entries that only overlap (neither contains the other) both stay in
//! the index ([`Table::superseded`]); an entry containing, or contained
//! in, a new one is superseded. Lookups still find a covering entry, and
//! invalidations every overlapping one; the union of a pair supersedes
//! both; the byte limit counts each entry of a pair in full; a miss
//! reserves tracking slots only for what it would supersede. Real
//! entries of a registrar that pins nothing (the table never touches
//! memory itself).

use std::sync::Arc;

use super::entry::{Backend, Entry};
use super::lookup::note_miss;
use super::table::{Insert, Sweep, Table};
use super::test_rig::{backend, Noop, PAGE};
use super::Cache;
use crate::config::{CacheConfig, MonitorChoice};
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

/// The span a miss of `[s, e)` pages registers (no entry covers it).
fn span(t: &Table<Noop>, (s, e): (usize, usize), access: Access) -> (usize, usize, Access) {
    match t.span_or_cover(s * PAGE, e * PAGE, access) {
        Ok(span) => span,
        Err(en) => panic!("covered by {:#x}..{:#x}", en.start, en.end),
    }
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
    let (s, e, _) = span(&t, (2, 6), W);
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

/// A request covered by a pair but by neither alone registers the union
/// (its span), which supersedes both: it contains them. A neighbour that
/// only overlaps the union (here one overlapping the later entry of the
/// pair, not the request) stays.
#[test]
fn the_union_of_a_pair_supersedes_both() {
    let b = backend();
    let mut t = Table::new(16, usize::MAX);
    let a = entry(&b, (1, 5), W);
    let c = entry(&b, (3, 8), W);
    let d = entry(&b, (7, 12), W);
    for e in [&a, &c, &d] {
        assert!(insert(&mut t, e).is_empty());
    }
    assert_eq!(found(&t, (2, 6), W), None);
    let (s, e, acc) = span(&t, (2, 6), W);
    assert_eq!(
        (s / PAGE, e / PAGE),
        (1, 8),
        "the request merged with the pair, not with `d`"
    );
    assert_eq!(t.supersedes(s, e), 2);
    let union = Arc::new(Entry::new(&b, (s, e, acc), (), None));
    let gone = insert(&mut t, &union);
    assert_eq!(gone.len(), 2);
    assert!(gone.iter().any(|g| Arc::ptr_eq(g, &a)) && gone.iter().any(|g| Arc::ptr_eq(g, &c)));
    assert!(d.refs.indexed(), "`d` only overlaps the union: it stays");
    assert_eq!(t.live(), 2);
    assert_eq!(found(&t, (2, 6), W), Some((1, 8)));
    assert_eq!(found(&t, (9, 12), W), Some((7, 12)));
}

/// The byte limit bounds the bytes the cached entries registered, each
/// entry counting its whole range: the pages a pair shares count once per
/// entry, as each registration pins them and the kernel charges each to
/// the locked-memory limit (`ibv_reg_mr`). Here a pair of 4 and 5 pages
/// sharing 2 counts 9 of a 10-page limit, so a 2-page insertion evicts
/// an idle entry, though the distinct pages (7 + 2) would fit.
#[test]
fn the_byte_limit_counts_each_entry_of_a_pair_in_full() {
    let b = backend();
    let mut t = Table::new(16, 10 * PAGE);
    let a = entry(&b, (1, 5), W);
    let c = entry(&b, (3, 8), W);
    for e in [&a, &c] {
        assert!(insert(&mut t, e).is_empty(), "9 pages of 10: room");
    }
    a.release();
    c.release();
    let d = entry(&b, (20, 22), W);
    let mut doomed = Vec::with_capacity(t.doom_bound(d.start, d.end));
    let mut sweep = Sweep::default();
    let evicted = loop {
        match t.insert(&d, &mut doomed, &mut sweep) {
            Insert::Done { evicted } => break evicted,
            Insert::Paused { .. } => {}
            Insert::Short { need } => doomed.reserve(need),
            Insert::NoRoom { .. } => panic!("no room though both entries are idle"),
        }
    };
    assert_eq!(evicted, 1, "11 pages registered of a 10-page limit: one goes");
    assert_eq!(t.live(), 2);
    assert!(d.refs.indexed());
}

/// A miss reserves a tracking slot for each entry its span would
/// supersede (one in use then is tracked outside the index) and one for
/// the span, not one for each entry that only overlaps the span, which
/// stays cached: here the span of a request covered by a pair is the
/// pair's union, overlapped at each end by a neighbour that stays
/// (before, the miss reserved 5 slots for 3 it could need).
#[test]
fn a_miss_reserves_slots_only_for_the_entries_it_supersedes() {
    let cfg = CacheConfig {
        monitor: MonitorChoice::None,
        fork_guard: false,
        ..CacheConfig::default()
    };
    let cache = Cache::new(Noop, cfg).expect("a cache without a monitor");
    let sh = &cache.shared;
    let mut t = sh.lock();
    let pieces = [(0, 2), (1, 5), (3, 8), (7, 12)];
    let held: Vec<_> = pieces.iter().map(|&r| entry(&sh.backend, r, W)).collect();
    for e in &held {
        assert!(insert(&mut t, e).is_empty());
    }
    let ((s, e, _), _, _, want, _) = note_miss(sh, &t, span(&t, (2, 6), W));
    assert_eq!((s / PAGE, e / PAGE), (1, 8));
    assert_eq!(want, 3, "the pair and the span; not the neighbours at each end");
    drop(t);
    for e in &held {
        e.release();
    }
}

/// Of a pair that only overlaps, the later entry (the one a lookup finds
/// first) may lack rights the earlier one has: a request both cover, and
/// only the earlier with its rights, is a hit on the earlier (it used to
/// miss and register the union). One neither grants still misses, and
/// one the later does not cover at its start is not looked for further.
#[test]
fn a_lookup_finds_the_earlier_entry_of_a_pair_when_the_later_lacks_the_rights() {
    let b = backend();
    let mut t = Table::new(16, usize::MAX);
    let rw = Access::LOCAL_WRITE | Access::REMOTE_READ;
    let earlier = entry(&b, (1, 6), rw);
    let later = entry(&b, (3, 9), W);
    assert!(insert(&mut t, &earlier).is_empty());
    assert!(insert(&mut t, &later).is_empty());
    assert_eq!(t.live(), 2);
    // Covered by both: the later has the rights of a plain write.
    assert_eq!(found(&t, (4, 5), W), Some((3, 9)));
    // Only the earlier grants remote reads.
    assert_eq!(found(&t, (4, 5), rw), Some((1, 6)));
    assert_eq!(found(&t, (3, 6), rw), Some((1, 6)));
    // Past the earlier's end: neither covers it with the rights.
    assert_eq!(found(&t, (4, 7), rw), None);
    // Rights neither has.
    assert_eq!(found(&t, (4, 5), Access::REMOTE_WRITE), None);
}

/// The same pair through the cache: a `get` that the later entry covers
/// without the rights is a hit on the earlier one, found by the miss
/// path's walk of the overlapping entries (`Table::span_or_cover`; the
/// hit path looks only at the later one). Since 2026-11-29 the walk
/// replaces a second look of its own that every hit's code carried.
#[test]
fn a_get_the_later_entry_of_a_pair_lacks_the_rights_for_hits_the_earlier() {
    let cfg = CacheConfig {
        monitor: MonitorChoice::None,
        fork_guard: false,
        ..CacheConfig::default()
    };
    let cache = Cache::new(Noop, cfg).expect("a cache without a monitor");
    let rw = Access::LOCAL_WRITE | Access::REMOTE_READ;
    let (earlier, later) = {
        let sh = &cache.shared;
        let mut t = sh.lock();
        let earlier = entry(&sh.backend, (1, 6), rw);
        let later = entry(&sh.backend, (3, 9), W);
        assert!(insert(&mut t, &earlier).is_empty());
        assert!(insert(&mut t, &later).is_empty());
        (earlier, later)
    };
    // Idle, as after their misses returned and their handles dropped.
    earlier.release();
    later.release();
    let reg = cache.get(4 * PAGE, PAGE, rw).expect("get");
    assert_eq!((reg.addr(), reg.len(), reg.access()), (PAGE, 5 * PAGE, rw));
    let s = cache.stats();
    assert_eq!((s.hits, s.misses), (1, 0), "a hit on the earlier entry");
    let plain = cache.get(4 * PAGE, PAGE, W).expect("get");
    assert_eq!((plain.addr(), plain.len()), (3 * PAGE, 6 * PAGE), "the later one");
    assert_eq!(cache.stats().hits, 2);
}
