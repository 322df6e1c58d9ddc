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

/// True if `fd` is readable within `timeout_ms` (0: now), by
/// [`poll(2)`](https://man7.org/linux/man-pages/man2/poll.2.html) on it
/// alone; `EINTR` counts as not readable.
pub fn readable(fd: std::os::fd::BorrowedFd<'_>, timeout_ms: i32) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, and we pass 1 as the count.
    let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    n == 1 && p.revents & libc::POLLIN != 0
}
