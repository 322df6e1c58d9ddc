//! All OS-facing code of `na-perf`: every `unsafe` block of the crate lives
//! under this module, one file per facility. Each wrapper is thin and safe to
//! call; system calls go through [`na_core::syscall!`], which turns `-1` into
//! `io::Error`.

pub use na_core::sys::affinity;
pub mod cma;
pub mod eventfd;
pub mod fd;
pub mod shm;
