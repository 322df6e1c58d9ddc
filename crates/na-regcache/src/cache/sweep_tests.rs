//! The eviction sweeps of [`Table`] look at a bounded stretch of slots
//! per hold of the write lock ([`SWEEP_STEP`]) and go on where they
//! stopped: a full cache whose entries are all in use no longer makes a
//! miss scan every slot twice under the lock, blocking every hit; and
//! while no entry is idle (by the count of entries in use) they look at
//! no slot at all. Real entries of a registrar that pins nothing (the
//! table never touches memory itself).

use std::sync::Arc;

use super::entry::{Backend, Entry};
use super::table::{Insert, Sweep, Table, SWEEP_STEP};
use super::test_rig::{backend, Noop, PAGE};
use crate::registrar::Access;

const N: usize = 8 * SWEEP_STEP;

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
fn a_full_table_in_use_refuses_without_a_sweep() {
    let b = backend();
    let (mut t, _held) = full(&b);
    let new = entry(&b, N + 10);
    let (outcome, calls, evicted) = insert_to_the_end(&mut t, &new);
    assert!(matches!(outcome, Insert::NoRoom { evicted: 0 }));
    assert_eq!(evicted, 0);
    // The count of entries in use says none is idle: no slot looked at
    // (before: two CLOCK turns, 2N slots, in 2N / SWEEP_STEP lock holds).
    assert_eq!(t.sweep_steps(), 0, "slots looked at");
    assert_eq!(calls, 1);
    assert_eq!(t.live(), N);
    // So does taking idle entries.
    let (mut out, mut cursor) = (Vec::with_capacity(N), 0);
    assert!(!t.take_idle(&mut out, &mut cursor, &b.stats.busy_cached));
    assert!(out.is_empty());
    assert_eq!(t.sweep_steps(), 0, "slots looked at by take_idle");
}

#[test]
fn a_paused_sweep_goes_on_to_the_idle_entry_it_finds() {
    let b = backend();
    let (mut t, held) = full(&b);
    // The last slot's entry is let go: the only victim, at the far end of
    // the first turn.
    held[N - 1].release();
    let new = entry(&b, N + 10);
    let (outcome, calls, evicted) = insert_to_the_end(&mut t, &new);
    assert!(matches!(outcome, Insert::Done { .. }));
    assert_eq!(evicted, 1);
    assert!(calls > N / SWEEP_STEP - 1, "paused on the way: {calls} calls");
    assert!(!held[N - 1].refs.indexed(), "the idle one went");
    assert!(new.refs.indexed());
    assert!(t.sweep_steps() >= (N - 1) as u64, "the sweep went round");
    assert_eq!(t.live(), N);
}

/// What a miss predicts before it registers (`Table::no_room`, which lets
/// the misses waiting for it go) agrees with what the insertion then does.
#[test]
fn no_room_predicts_the_insertion() {
    let b = backend();
    let busy = &b.stats.busy_cached;
    let (mut t, held) = full(&b);
    // Full, every entry in use: a disjoint span gets no room.
    let new = entry(&b, N + 10);
    assert!(t.no_room(new.start, new.end, busy));
    assert!(matches!(insert_to_the_end(&mut t, &new).0, Insert::NoRoom { .. }));
    // A span containing entries supersedes them: room.
    let over = held[3].start;
    assert!(!t.no_room(over, over + 2 * PAGE, busy));
    // Larger than the byte limit: never room.
    let small = Table::<Noop>::new(4, 4 * PAGE);
    assert!(small.no_room(PAGE, 6 * PAGE, busy));
    assert!(!small.no_room(PAGE, 5 * PAGE, busy));
    // One entry idle: room, by evicting it.
    held[N / 2].release();
    assert!(!t.no_room(new.start, new.end, busy));
    assert!(matches!(insert_to_the_end(&mut t, &new).0, Insert::Done { .. }));
}

#[test]
fn taking_idle_entries_pauses_every_stretch() {
    let b = backend();
    let (mut t, held) = full(&b);
    for e in &held {
        e.release();
    }
    let mut out = Vec::with_capacity(N);
    let mut cursor = 0;
    let mut calls = 0;
    while t.take_idle(&mut out, &mut cursor, &b.stats.busy_cached) {
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

/// Threads hitting, missing (merging with and superseding entries in
/// use), invalidating entries in use and evicting, through a real cache:
/// the counts of entries in use inside and outside the index, which tell
/// a miss that no entry is idle, stay exact.
#[test]
fn the_counts_of_entries_in_use_stay_exact_under_threads() {
    use super::Cache;
    use crate::config::{CacheConfig, Consistency, MonitorChoice};
    use crate::registrar::Access;

    let c = Cache::new(
        Noop,
        CacheConfig {
            max_count: 48,
            max_bytes: 1 << 30,
            monitor: MonitorChoice::None,
            fork_guard: false,
            consistency: Consistency::InFlight,
            map_watch: false,
        },
    )
    .expect("cache");
    let held: Vec<_> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let c = &c;
                s.spawn(move || {
                    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (t + 1);
                    let mut next = move |n: u64| {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        (rng % n) as usize
                    };
                    let mut held = std::collections::VecDeque::new();
                    for _ in 0..20_000 {
                        let addr = PAGE * (1 + next(120));
                        let len = PAGE * (1 + next(3));
                        match next(20) {
                            0 | 1 => c.invalidate(addr, len),
                            2 => {
                                c.evict_idle();
                            }
                            3 => held
                                .push_back(c.get_unshared(addr, len, Access::LOCAL_WRITE).expect("unshared")),
                            _ => match c.get(addr, len, Access::LOCAL_WRITE) {
                                Ok(h) => held.push_back(h),
                                // Three registrations in a row whose span
                                // another thread invalidated meanwhile: the
                                // documented outcome of this much contention.
                                Err(crate::Error::Unstable { .. }) => {}
                                Err(e) => panic!("get: {e}"),
                            },
                        }
                        if held.len() > 4 {
                            held.pop_front();
                        }
                    }
                    held
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|h| h.join().expect("thread"))
            .collect()
    });
    let stats = &c.shared.backend.stats;
    let mut distinct: Vec<_> = held.iter().map(|h| Arc::as_ptr(&h.entry)).collect();
    distinct.sort();
    distinct.dedup();
    let t = c.shared.table.read();
    assert_eq!(
        stats.busy_cached.sum() as usize,
        t.count_in_use(),
        "in use in the index"
    );
    assert_eq!(
        (stats.busy_cached.sum() + stats.busy_outside.sum()) as usize,
        distinct.len(),
        "in use anywhere"
    );
    drop(t);
    drop(held);
    assert_eq!((stats.busy_cached.sum(), stats.busy_outside.sum()), (0, 0));
    let t = c.shared.table.read();
    assert_eq!(t.count_in_use(), 0);
    assert!(t.live() > 0, "entries stayed cached");
    assert!(t.sweep_steps() > 0, "the workload evicted");
}

/// The last handle's release never leaves an entry whose user count
/// reads zero counted in use (which made a miss of a full cache answer
/// "no room", and `evict_idle` evict nothing, for as long as the
/// releasing thread sat between its two steps): looked at from the
/// window between them, the count of entries in use is at most what a
/// slot-by-slot count finds, and an entry whose count reads zero is
/// found by `evict_idle`'s sweep.
#[test]
fn a_release_never_leaves_an_idle_entry_counted_in_use() {
    use super::entry::tests::IN_RELEASE;
    use super::Cache;
    use crate::config::{CacheConfig, Consistency, MonitorChoice};
    use std::sync::atomic::{AtomicUsize, Ordering};

    let c = Cache::new(
        Noop,
        CacheConfig {
            max_count: 2,
            max_bytes: 1 << 30,
            monitor: MonitorChoice::None,
            fork_guard: false,
            consistency: Consistency::InFlight,
            map_watch: false,
        },
    )
    .expect("cache");
    let a = c.get(PAGE, PAGE, Access::LOCAL_WRITE).expect("miss");
    let b = c.get(3 * PAGE, PAGE, Access::LOCAL_WRITE).expect("miss");
    assert!(a.is_cached() && b.is_cached());
    let looks = Arc::new(AtomicUsize::new(0));
    let (sh, seen) = (Arc::clone(&c.shared), Arc::clone(&looks));
    let entry_a = Arc::clone(&a.entry);
    IN_RELEASE.with(|h| {
        *h.borrow_mut() = Some(Box::new(move || {
            seen.fetch_add(1, Ordering::Relaxed);
            let mut t = sh.table.write();
            let busy = &sh.backend.stats.busy_cached;
            let (counted, in_use) = (busy.sum() as usize, t.count_in_use());
            assert!(
                counted <= in_use,
                "{counted} entries counted in use, {in_use} are"
            );
            if entry_a.refs.users() == 0 && entry_a.refs.indexed() {
                // Idle by its own count: the sweep of `evict_idle` takes it.
                let (mut out, mut cursor) = (Vec::with_capacity(2), 0);
                while t.take_idle(&mut out, &mut cursor, busy) {}
                drop(t);
                assert_eq!(out.len(), 1, "the idle entry is evicted");
            }
        }))
    });
    drop(a);
    assert!(looks.load(Ordering::Relaxed) >= 1, "the window was looked at");
    drop(b);
    IN_RELEASE.with(|h| h.borrow_mut().take());
    let t = c.shared.table.read();
    assert_eq!(
        (c.shared.backend.stats.busy_cached.sum(), t.count_in_use()),
        (0, 0)
    );
}
