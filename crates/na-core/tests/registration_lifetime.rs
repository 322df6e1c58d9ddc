//! A memory handle's registrations go before its memory: a registration may
//! let a device or a peer write the memory (verbs remote rights), so the
//! memory must never be freed while one lives. A counting allocator watches
//! the segment's allocation; the "registration" records, when it is
//! dropped, whether that allocation was already freed.

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use common::sys::{Watching, FREED, WATCHED};
use na_core::{Access, MemHandle, PluginId};

#[global_allocator]
static ALLOC: Watching = Watching;

/// Stands in for a plugin registration: says at drop whether the memory it
/// covers was already freed.
struct Reg {
    freed_before_me: Arc<Mutex<Option<bool>>>,
}

impl Drop for Reg {
    fn drop(&mut self) {
        *self.freed_before_me.lock().unwrap() = Some(FREED.load(Ordering::SeqCst));
    }
}

/// A handle over one 4 KiB segment of `fill` whose allocation is watched,
/// with a registration attached under `PluginId(0)`; the registration's
/// report of whether the memory was freed before it.
fn watched_registered_handle(fill: u8) -> (MemHandle, Arc<Mutex<Option<bool>>>) {
    let seen = Arc::new(Mutex::new(None));
    let h = MemHandle::new(vec![vec![fill; 4096]], Access::ReadWrite);
    let (addr, _) = h.segments_raw().next().unwrap();
    WATCHED.store(addr, Ordering::SeqCst);
    FREED.store(false, Ordering::SeqCst);
    h.attach_registration(
        PluginId(0),
        Arc::new(Reg {
            freed_before_me: seen.clone(),
        }),
    );
    (h, seen)
}

/// The tests share the watch statics: one test function, in order.
#[test]
fn registrations_never_outlive_the_memory_they_cover() {
    // 1. The last clone dropped: registration first, then the memory.
    let (h, seen) = watched_registered_handle(7);
    let clone = h.clone();
    drop(h);
    assert_eq!(*seen.lock().unwrap(), None, "a clone still holds it");
    drop(clone);
    assert_eq!(
        *seen.lock().unwrap(),
        Some(false),
        "the registration must be dropped while its memory is still allocated"
    );
    assert!(FREED.load(Ordering::SeqCst), "then the memory is freed");

    // 2. A registration kept past its handle: into_buffers refuses, and the
    // last drop leaks the memory rather than free it under the registration.
    let (h, seen) = watched_registered_handle(9);
    let kept = h.registration(PluginId(0)).expect("attached");
    let h = h
        .into_buffers()
        .expect_err("a registration held elsewhere: the buffers cannot be given back");
    drop(h);
    assert!(
        !FREED.load(Ordering::SeqCst),
        "memory freed while a registration of it lives"
    );
    drop(kept);
    assert_eq!(*seen.lock().unwrap(), Some(false));

    // 3. into_buffers without outside holders: the registration goes first.
    let seen = Arc::new(Mutex::new(None));
    let h = MemHandle::new(vec![vec![1u8; 16], vec![2u8; 8]], Access::ReadOnly);
    h.attach_registration(
        PluginId(3),
        Arc::new(Reg {
            freed_before_me: seen.clone(),
        }),
    );
    let bufs = h
        .into_buffers()
        .expect("last clone, no outside registration holder");
    assert_eq!(bufs, vec![vec![1u8; 16], vec![2u8; 8]]);
    assert_eq!(
        *seen.lock().unwrap(),
        Some(false),
        "dropped when the buffers were given back"
    );
    WATCHED.store(0, Ordering::SeqCst);
}
