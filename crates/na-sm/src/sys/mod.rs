//! All OS-facing code of `na-sm`: every `unsafe` block of the crate lives
//! under this module, one file per facility. Each wrapper is safe to call and
//! links to the man page of the system call it wraps.

pub mod cma;
pub mod eventfd;
pub mod fork;
pub mod lock;
pub mod poll;
pub mod proc;
pub mod random;
pub mod shm;
pub mod socket;
pub mod wake;
#[cfg(test)]
pub mod zero_pages;

pub use na_core::syscall;
