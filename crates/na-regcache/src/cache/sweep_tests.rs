//! The eviction sweeps of [`Table`] look at a bounded stretch of slots
//! per hold of the write lock ([`SWEEP_STEP`]) and go on where they
//! stopped: a full cache whose entries are all in use no longer makes a
//! miss scan every slot twice under the lock, blocking every hit. Real
//! entries of a registrar that pins nothing (the table never touches
//! memory itself).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::entry::{Backend, Entry};
use super::table::{Insert, Sweep, Table, SWEEP_STEP};
use crate::registrar::{Access, Registrar};
use crate::stats::Stats;

struct Noop;

impl Registrar for Noop {
    type Region = ();
    type Error = std::io::Error;
    fn register(&self, _: usize, _: usize, _: Access) -> std::io::Result<()> {
        Ok(())
    }
    fn deregister(&self, _: ()) -> std::io::Result<()> {
        Ok(())
    }
}

const PAGE: usize = 0x1000;
const N: usize = 8 * SWEEP_STEP;

fn backend() -> Arc<Backend<Noop>> {
    Arc::new(Backend {
        registrar: Noop,
        stats: Stats::default(),
        monitor: None,
        fork_guard: None,
        closed: AtomicBool::new(false),
    })
}

fn entry(b: &Arc<Backend<Noop>>, i: usize) -> Arc<Entry<Noop>> {
    let start = PAGE * (i + 1);
    Arc::new(Entry::new(
        b,
        (start, start + PAGE, Access::LOCAL_WRITE),
        (),
        None,
    ))
}

/// A table of `N` entries, full, each in use (one user: the insertion's).
fn full(b: &Arc<Backend<Noop>>) -> (Table<Noop>, Vec<Arc<Entry<Noop>>>) {
    let mut t = Table::new(N, usize::MAX);
    let mut doomed = Vec::new();
    let entries: Vec<_> = (0..N).map(|i| entry(b, i)).collect();
    for e in &entries {
        assert!(matches!(
            t.insert(e, &mut doomed, &mut Sweep::default()),
            Insert::Done { evicted: 0 }
        ));
    }
    (t, entries)
}

/// Calls `insert` like a miss does (room made before each call, same
/// sweep) until it stops pausing; the outcome, the calls made and the
/// entries evicted.
fn insert_to_the_end(t: &mut Table<Noop>, e: &Arc<Entry<Noop>>) -> (Insert, usize, usize) {
    let mut sweep = Sweep::default();
    let mut doomed = Vec::with_capacity(t.doom_bound(e.start, e.end));
    let (mut calls, mut evicted) = (0, 0);
    loop {
        calls += 1;
        match t.insert(e, &mut doomed, &mut sweep) {
            Insert::Paused { evicted: n } => evicted += n,
            Insert::Short { need } => doomed.reserve(need),
            done => return (done, calls, evicted + doomed.len()),
        }
        assert!(calls <= 4 * N, "the sweep never ends");
    }
}

#[test]
fn a_sweep_of_a_full_table_in_use_pauses_every_stretch() {
    let b = backend();
    let (mut t, _held) = full(&b);
    let new = entry(&b, N + 10);
    let (outcome, calls, evicted) = insert_to_the_end(&mut t, &new);
    assert!(matches!(outcome, Insert::NoRoom { evicted: 0 }));
    assert_eq!(evicted, 0);
    // Two CLOCK turns, at most SWEEP_STEP slots per call (before: one
    // call looked at all 2N).
    assert!(
        calls >= 2 * N / SWEEP_STEP,
        "{calls} calls for {} slots: more than {SWEEP_STEP} per lock hold",
        2 * N
    );
    assert_eq!(t.live(), N);
}

#[test]
fn a_paused_sweep_goes_on_to_the_idle_entry_it_finds() {
    let b = backend();
    let (mut t, held) = full(&b);
    // The last slot's entry is let go: the only victim, at the far end of
    // the first turn.
    held[N - 1].users.fetch_sub(1, Ordering::AcqRel);
    let new = entry(&b, N + 10);
    let (outcome, calls, evicted) = insert_to_the_end(&mut t, &new);
    assert!(matches!(outcome, Insert::Done { .. }));
    assert_eq!(evicted, 1);
    assert!(calls > N / SWEEP_STEP - 1, "paused on the way: {calls} calls");
    assert!(!held[N - 1].cached.load(Ordering::Acquire), "the idle one went");
    assert!(new.cached.load(Ordering::Acquire));
    assert_eq!(t.live(), N);
}

#[test]
fn taking_idle_entries_pauses_every_stretch() {
    let b = backend();
    let (mut t, held) = full(&b);
    for e in &held {
        e.users.fetch_sub(1, Ordering::AcqRel);
    }
    let mut out = Vec::with_capacity(N);
    let mut cursor = 0;
    let mut calls = 0;
    while t.take_idle(&mut out, &mut cursor) {
        calls += 1;
        assert!(calls <= N, "the sweep never ends");
    }
    assert_eq!(out.len(), N);
    assert_eq!(t.live(), 0);
    assert!(
        calls + 1 >= N / SWEEP_STEP,
        "{} calls for {N} slots: more than {SWEEP_STEP} per lock hold",
        calls + 1
    );
}
