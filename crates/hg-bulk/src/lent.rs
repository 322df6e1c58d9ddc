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
/// Calls do not nest: an inner call collects what it sees, the outer one
/// the rest.
#[inline]
pub fn collect_lent<R>(encode: impl FnOnce() -> R) -> (R, Option<Box<[MemHandle]>>) {
    /// Ends the collection even if `encode` unwinds.
    struct Off(State);
    impl Drop for Off {
        fn drop(&mut self) {
            STATE.set(self.0);
        }
    }
    let outer = STATE.replace(State::On);
    let guard = Off(outer);
    let r = encode();
    let lent = if STATE.get() == State::Recorded {
        Some(take_recorded())
    } else {
        None
    };
    drop(guard);
    (r, lent)
}

/// What this thread recorded (out of line: the rare case).
#[cold]
#[inline(never)]
fn take_recorded() -> Box<[MemHandle]> {
    LENT.with_borrow_mut(std::mem::take).into_boxed_slice()
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
}
