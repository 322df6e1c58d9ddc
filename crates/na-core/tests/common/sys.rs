//! The unsafe code na-core's tests need (all of it lives here): a global
//! allocator that watches one allocation.
#![allow(unsafe_code, dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Address of the allocation being watched (0: none).
pub static WATCHED: AtomicUsize = AtomicUsize::new(0);
/// Set when the watched allocation is freed.
pub static FREED: AtomicBool = AtomicBool::new(false);

/// The system allocator, recording whether the allocation at [`WATCHED`]
/// was freed (in [`FREED`]): install it with `#[global_allocator]`. See
/// [`GlobalAlloc`](https://doc.rust-lang.org/std/alloc/trait.GlobalAlloc.html)
/// and, for what it forwards to,
/// [`malloc(3)`](https://man7.org/linux/man-pages/man3/malloc.3.html).
pub struct Watching;

// SAFETY: forwards every call to the system allocator unchanged; only
// records (with atomics, no allocation) whether one address was freed.
unsafe impl GlobalAlloc for Watching {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if ptr as usize == WATCHED.load(Ordering::SeqCst) {
            FREED.store(true, Ordering::SeqCst);
        }
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}
