//! The opt-in global allocator wrapper ([`GlobalAlloc`]) that feeds the
//! allocator-hook monitor (`crate::monitor::alloc`).

use std::alloc::{GlobalAlloc, Layout};

use crate::monitor::alloc::{on_alloc, on_release};

/// A `GlobalAlloc` that tells the registration caches about every released
/// or resized block before handing it to the inner allocator.
#[derive(Debug, Default)]
pub struct InvalidatingAlloc<A> {
    inner: A,
}

impl<A> InvalidatingAlloc<A> {
    /// Wraps `inner` (usually `std::alloc::System`).
    pub const fn new(inner: A) -> Self {
        InvalidatingAlloc { inner }
    }
}

// SAFETY: every method forwards to `inner` with the caller's arguments
// unchanged, so `inner`'s guarantees carry over; the hooks only read the
// pointer value and never touch the memory or allocate.
unsafe impl<A: GlobalAlloc> GlobalAlloc for InvalidatingAlloc<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        on_alloc();
        // SAFETY: forwarded contract of GlobalAlloc::alloc.
        unsafe { self.inner.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        on_alloc();
        // SAFETY: forwarded contract of GlobalAlloc::alloc_zeroed.
        unsafe { self.inner.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        on_release(ptr as usize, layout.size());
        // SAFETY: forwarded contract of GlobalAlloc::dealloc.
        unsafe { self.inner.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        on_release(ptr as usize, layout.size());
        // SAFETY: forwarded contract of GlobalAlloc::realloc.
        unsafe { self.inner.realloc(ptr, layout, new_size) }
    }
}
