//! The global allocator: a block freed by hand in a forked child, and
//! an allocator that tells an observer of every call.

use super::process::exit_now;

/// Frees, in a forked child, the heap block of `len` bytes at `addr`: the
/// child's copy of a `Vec<u8>` (or boxed slice) whose capacity is `len`,
/// which the child never touches again (it leaves with [`exit_now`]).
/// Through the global allocator, so its hooks run
/// ([`dealloc`](https://doc.rust-lang.org/std/alloc/fn.dealloc.html)).
pub fn free_block_in_child(addr: usize, len: usize) {
    let Ok(layout) = std::alloc::Layout::from_size_align(len, 1) else {
        exit_now(102)
    };
    // SAFETY: `addr` was allocated by the global allocator for a byte
    // buffer of `len` bytes (alignment 1) and, in this child, is freed once
    // and never used again (the child's copy of its owner is never dropped).
    unsafe { std::alloc::dealloc(addr as *mut u8, layout) }
}

/// Which call an [`Observed`] allocator reports to its observer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocCall {
    /// `alloc`.
    Alloc,
    /// `alloc_zeroed`.
    AllocZeroed,
    /// `dealloc`.
    Dealloc,
    /// `realloc`.
    Realloc,
}

/// Told of every call of an [`Observed`] allocator, before and after it is
/// forwarded. Runs inside the global allocator: it must not allocate,
/// except behind a re-entrancy guard of its own.
pub trait AllocObserver: Sync {
    /// Before `call` is forwarded; the value is handed to [`after`](Self::after).
    fn before(&self, call: AllocCall) -> bool;
    /// After `call` returned, with what [`before`](Self::before) returned.
    fn after(&self, call: AllocCall, state: bool);
}

/// A global allocator forwarding every call unchanged to `inner` and
/// telling `observer` about it (see
/// [`GlobalAlloc`](https://doc.rust-lang.org/std/alloc/trait.GlobalAlloc.html);
/// the system allocator is glibc's
/// [`malloc(3)`](https://man7.org/linux/man-pages/man3/malloc.3.html)).
pub struct Observed<A, O> {
    /// The allocator doing the work.
    pub inner: A,
    /// Told of each call.
    pub observer: O,
}

// SAFETY: every method forwards its arguments unchanged to `inner` and
// returns its result; the observer's calls touch no memory of the call.
unsafe impl<A: std::alloc::GlobalAlloc, O: AllocObserver> std::alloc::GlobalAlloc for Observed<A, O> {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let s = self.observer.before(AllocCall::Alloc);
        // SAFETY: forwarded contract.
        let p = unsafe { self.inner.alloc(layout) };
        self.observer.after(AllocCall::Alloc, s);
        p
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let s = self.observer.before(AllocCall::AllocZeroed);
        // SAFETY: forwarded contract.
        let p = unsafe { self.inner.alloc_zeroed(layout) };
        self.observer.after(AllocCall::AllocZeroed, s);
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        let s = self.observer.before(AllocCall::Dealloc);
        // SAFETY: forwarded contract.
        unsafe { self.inner.dealloc(ptr, layout) };
        self.observer.after(AllocCall::Dealloc, s);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        let s = self.observer.before(AllocCall::Realloc);
        // SAFETY: forwarded contract.
        let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
        self.observer.after(AllocCall::Realloc, s);
        p
    }
}
