//! The handle count of an entry shares its word with the bit that says
//! the entry is in the index: acquiring a handle is refused at
//! [`MAX_HANDLES`], before the count can reach that bit (on 32-bit
//! targets 2^31 leaked handles of an entry outside the index would have
//! set it). Counts start near the limit through test-only constructors.

use std::sync::Arc;

use super::entry::{Entry, Registration, MAX_HANDLES};
use super::test_rig::{backend, Noop, PAGE};
use super::Cache;
use crate::config::{CacheConfig, Consistency, MonitorChoice};
use crate::registrar::Access;
use crate::Error;

const W: Access = Access::LOCAL_WRITE;

/// A handle on an entry outside the index whose count says `users`.
fn handle_with(users: usize) -> Registration<Noop> {
    let e = Entry::with_users(&backend(), (PAGE, 2 * PAGE, W), (), users);
    Registration { entry: Arc::new(e) }
}

#[test]
fn the_limit_leaves_room_below_the_indexed_bit() {
    assert!(MAX_HANDLES.is_power_of_two());
    assert_eq!(MAX_HANDLES, 1 << (usize::BITS - 2));
}

/// Up to the limit a clone is taken; at it, refused with the error,
/// the count unchanged and the entry still outside the index.
#[test]
fn a_clone_at_the_limit_is_refused() {
    let h = handle_with(MAX_HANDLES - 1);
    let last = h.try_clone().expect("the last handle allowed");
    assert_eq!(h.entry.refs.users(), MAX_HANDLES);
    match h.try_clone() {
        Err(Error::TooManyHandles { addr, len, max }) => {
            assert_eq!((addr, len, max), (PAGE, PAGE, MAX_HANDLES));
        }
        other => panic!("expected TooManyHandles, got {other:?}"),
    }
    assert_eq!(
        h.entry.refs.users(),
        MAX_HANDLES,
        "the refused clone took nothing"
    );
    assert!(!h.entry.refs.indexed(), "the count never reached the indexed bit");
    assert!(!h.entry.acquire_cached(), "a hit's acquisition is refused too");
    assert_eq!(h.entry.refs.users(), MAX_HANDLES);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.clone()));
    assert!(panicked.is_err(), "Clone panics at the limit (documented)");
    assert_eq!(h.entry.refs.users(), MAX_HANDLES);
    drop(last);
    assert_eq!(h.entry.refs.users(), MAX_HANDLES - 1);
    drop(h.try_clone().expect("below the limit again"));
}

/// Past the limit (as threads acquiring at once may leave it for a
/// moment) every acquisition is still refused and takes its one back:
/// the count does not creep on towards the indexed bit.
#[test]
fn a_count_past_the_limit_creeps_no_further() {
    let h = handle_with(MAX_HANDLES + 64);
    for _ in 0..1000 {
        assert!(h.try_clone().is_err());
        assert!(!h.entry.acquire_cached());
    }
    assert_eq!(h.entry.refs.users(), MAX_HANDLES + 64);
    assert!(!h.entry.refs.indexed(), "the count ran into the indexed bit");
    assert!(!h.is_cached());
}

/// A hit on a cached entry at the limit: `get` returns the error, the
/// entry stays cached with its count, and hits resume below the limit.
#[test]
fn a_hit_at_the_limit_is_refused() {
    let c = Cache::new(
        Noop,
        CacheConfig {
            max_count: 4,
            max_bytes: 1 << 30,
            monitor: MonitorChoice::None,
            fork_guard: false,
            consistency: Consistency::InFlight,
            map_watch: false,
        },
    )
    .expect("cache");
    let h = c.get(PAGE, PAGE, W).expect("miss");
    assert!(h.is_cached());
    // Stand-ins for MAX_HANDLES - 2 leaked handles.
    h.entry.add_users(MAX_HANDLES - 2);
    let last = c.get(PAGE, PAGE, W).expect("the last hit allowed");
    assert_eq!(h.entry.refs.users(), MAX_HANDLES);
    let hits = c.stats().hits;
    match c.get(PAGE, PAGE, W) {
        Err(Error::TooManyHandles { max, .. }) => assert_eq!(max, MAX_HANDLES),
        other => panic!("expected TooManyHandles, got {other:?}"),
    }
    assert_eq!(c.stats().hits, hits, "not counted a hit");
    assert_eq!(h.entry.refs.users(), MAX_HANDLES);
    assert!(h.is_cached(), "still in the index");
    drop(last);
    drop(c.get(PAGE, PAGE, W).expect("a hit below the limit"));
    h.entry.add_users((MAX_HANDLES - 2).wrapping_neg());
    assert_eq!(h.entry.refs.users(), 1);
    drop(h);
    assert_eq!(c.stats().in_use, 0);
}
