//! Handles lent to a peer: which local handles an encoder serialized, so
//! that the RPC layer can keep their memory alive for as long as the
//! target may still transfer to or from it, even after the caller gave
//! up on the call (a timeout, a dropped future). Without that, a caller
//! that took its buffers back after a timeout could have a slow but
//! honest target write into memory it had since freed and reused.

use std::cell::{Cell, RefCell};

use na_core::MemHandle;

/// Collection state of this thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Not collecting: serializing a handle records nothing.
    Off,
    /// Collecting, nothing recorded yet.
    On,
    /// Collecting, and `LENT` holds what was recorded.
    Recorded,
}

thread_local! {
    static STATE: Cell<State> = const { Cell::new(State::Off) };
    static LENT: RefCell<Vec<MemHandle>> = const { RefCell::new(Vec::new()) };
}

/// Runs `encode` and returns its result with a clone of every local
/// handle serialized during it (on this thread), in order, or `None` if
/// there was none. A clone keeps the handle's memory alive and exposed
/// until it is dropped, and makes
/// [`Bulk::into_buffers`](crate::Bulk::into_buffers) refuse meanwhile.
/// Costs two thread-local stores and a load when no handle is serialized.
/// Calls nest: an inner call collects what it sees, the outer one the
/// rest. If `encode` unwinds, what it recorded is let go.
#[inline]
pub fn collect_lent<R>(encode: impl FnOnce() -> R) -> (R, Option<Box<[MemHandle]>>) {
    /// Ends the collection even if `encode` unwinds: restores the outer
    /// state, and drops what an unwinding `encode` recorded.
    struct Off {
        outer: State,
        mark: usize,
    }
    impl Drop for Off {
        fn drop(&mut self) {
            if STATE.replace(self.outer) == State::Recorded {
                // Only when `encode` unwound after recording: the normal
                // end took the records and left the state `On`.
                forget_recorded(self.mark);
            }
        }
    }
    let outer = STATE.replace(State::On);
    // Inside a collection that recorded already, ours start past its own.
    let mark = if outer == State::Recorded {
        recorded_len()
    } else {
        0
    };
    let guard = Off { outer, mark };
    let r = encode();
    let lent = if STATE.get() == State::Recorded {
        Some(take_recorded(mark))
    } else {
        None
    };
    drop(guard);
    (r, lent)
}

/// How many handles this thread holds recorded (the rare nested case).
#[cold]
#[inline(never)]
fn recorded_len() -> usize {
    LENT.with_borrow(Vec::len)
}

/// What this thread recorded past `mark` (out of line: the rare case).
#[cold]
#[inline(never)]
fn take_recorded(mark: usize) -> Box<[MemHandle]> {
    STATE.set(State::On);
    LENT.with_borrow_mut(|l| l.split_off(mark)).into_boxed_slice()
}

/// Drops what this thread recorded past `mark` (an encoder unwound).
#[cold]
#[inline(never)]
fn forget_recorded(mark: usize) {
    let dropped = LENT.with_borrow_mut(|l| l.split_off(mark));
    drop(dropped);
}

/// Records `mem` if this thread is collecting (see [`collect_lent`]).
pub(crate) fn record(mem: &MemHandle) {
    if STATE.get() != State::Off {
        STATE.set(State::Recorded);
        LENT.with_borrow_mut(|l| l.push(mem.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use na_core::Access;

    #[test]
    fn only_handles_serialized_inside_are_collected() {
        let a = MemHandle::new(vec![vec![1u8; 8]], Access::ReadWrite);
        let b = MemHandle::new(vec![vec![2u8; 8]], Access::ReadOnly);
        record(&a);
        let ((), lent) = collect_lent(|| {
            record(&a);
            record(&b);
        });
        let lent = lent.expect("two recorded");
        assert_eq!(lent.len(), 2);
        assert_eq!((lent[0].size(), lent[1].access()), (8, Access::ReadOnly));
        let ((), none) = collect_lent(|| ());
        assert!(none.is_none());
        record(&b);
        let ((), none) = collect_lent(|| ());
        assert!(none.is_none(), "recorded outside a collection");
        // A panic inside ends the collection.
        let r = std::panic::catch_unwind(|| collect_lent(|| panic!("encoder bug")));
        assert!(r.is_err());
        record(&a);
        assert_eq!(STATE.get(), State::Off);
        let ((), none) = collect_lent(|| ());
        assert!(none.is_none());
    }

    /// An encoder that panics after recording lets go of what it
    /// recorded: the handle's memory is the caller's again, and the next
    /// collection does not take it.
    #[test]
    fn a_panicking_encoder_keeps_nothing() {
        let a = MemHandle::new(vec![vec![1u8; 8]], Access::ReadWrite);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            collect_lent(|| {
                record(&a);
                panic!("encoder bug");
            })
        }));
        assert!(r.is_err());
        assert_eq!(STATE.get(), State::Off);
        let ((), none) = collect_lent(|| ());
        assert!(
            none.is_none(),
            "a later collection took the panicked one's records"
        );
        assert!(a.into_buffers().is_ok(), "the memory stayed lent");
    }

    /// An inner collection takes what it saw, the outer one the rest,
    /// before and after it.
    #[test]
    fn nested_collections_split_what_they_saw() {
        let h = |n| MemHandle::new(vec![vec![n; 8]], Access::ReadOnly);
        let (a, b, c) = (h(1), h(2), h(3));
        let (inner, outer) = collect_lent(|| {
            record(&a);
            let ((), inner) = collect_lent(|| record(&b));
            record(&c);
            inner
        });
        let inner = inner.expect("the inner one recorded");
        let outer = outer.expect("the outer one recorded");
        assert_eq!(inner.len(), 1);
        assert_eq!(outer.len(), 2);
        assert!(inner[0].same_as(&b), "the inner took another handle");
        assert!(outer[0].same_as(&a) && outer[1].same_as(&c));
    }
}
