//! All OS-facing code of `na-sm`: every `unsafe` block of the crate lives
//! under this module, one file per facility. Each wrapper is safe to call and
//! links to the man page of the system call it wraps.
//!
//! Crate-private: with the `test-hooks` feature the modules the tests
//! drive directly are public, but never `cma` (its batch moves memory at
//! the addresses a `RemoteMem` names, which is sound only for the
//! transfers the plugin has checked: one aimed at this very process must
//! stay inside a handle it exposes), nor `fork` and `random`.

// Not `pub` under any feature: see the module doc.
pub(crate) mod cma;
pub mod eventfd;
pub(crate) mod fork;
pub mod lock;
pub mod poll;
pub mod proc;
pub(crate) mod random;
pub mod screen;
pub mod shm;
pub mod socket;
pub mod wake;
#[cfg(test)]
pub mod zero_pages;

pub use na_core::syscall;
