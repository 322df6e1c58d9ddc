//! Raw memory operations the scenarios perform on purpose (all the test
//! suite's `unsafe` lives here), one file per facility.
#![allow(unsafe_code, dead_code)]

use std::io;

mod alloc;
mod heap;
mod mem;
mod memfd;
mod mmap;
mod process;
mod sched;
mod seccomp;
mod shm;
mod signal;
mod uring;

// Each test binary uses a part of the facilities.
#[allow(unused_imports)]
pub use self::{
    alloc::*, heap::*, mem::*, memfd::*, mmap::*, process::*, sched::*, seccomp::*, shm::*, signal::*,
    uring::*,
};

pub const PAGE: usize = 4096;

fn check(ptr: *mut libc::c_void) -> io::Result<usize> {
    if ptr == libc::MAP_FAILED {
        Err(io::Error::last_os_error())
    } else {
        Ok(ptr as usize)
    }
}
