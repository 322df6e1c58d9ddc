//! A global allocator that notes the largest single allocation, so that a
//! target checks a decoder allocates no more than its input justifies
//! (`rpc_codec`). It forwards every call to the system allocator
//! ([`GlobalAlloc`], glibc's
//! [`malloc(3)`](https://man7.org/linux/man-pages/man3/malloc.3.html),
//! under the fuzzer's sanitizer).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// The largest single allocation (or reallocation's new size) since the
/// last [`reset_largest`].
static LARGEST: AtomicUsize = AtomicUsize::new(0);

/// Forgets the allocations made so far: [`largest`] counts from here.
pub fn reset_largest() {
    LARGEST.store(0, Relaxed);
}

/// The size of the largest single allocation since [`reset_largest`].
pub fn largest() -> usize {
    LARGEST.load(Relaxed)
}

/// The system allocator, noting each size it is asked for.
struct Watch;

// SAFETY: every method forwards its arguments unchanged to `System` and
// returns its result; noting a size touches no memory of the call.
// `alloc_zeroed` and `realloc` are forwarded too (not left to the trait's
// defaults, which call `alloc`), each noting its size as `alloc` does.
unsafe impl GlobalAlloc for Watch {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Relaxed);
        // SAFETY: the caller's contract for `layout`, forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Relaxed);
        // SAFETY: the caller's contract for `layout`, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator with
        // `layout` (the caller's contract), forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Relaxed);
        // SAFETY: `ptr` came from `System` through this allocator with
        // `layout`, and `new_size` is valid for it (the caller's
        // contract), forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Watch = Watch;
