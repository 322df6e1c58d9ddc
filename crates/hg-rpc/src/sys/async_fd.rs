//! Registers an endpoint's epoll fd with the tokio reactor.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use tokio::io::unix::AsyncFd;

/// An fd number together with the owner that keeps it open.
pub struct OwnedByArc<O> {
    fd: RawFd,
    _owner: Arc<O>,
}

impl<O> AsRawFd for OwnedByArc<O> {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

/// Registers `fd` with tokio for as long as the returned `AsyncFd` lives.
///
/// The caller promises that `owner` owns `fd` and closes it only when
/// dropped, and never replaces it while any clone of the `Arc` exists.
pub fn register<O: Send + Sync>(fd: RawFd, owner: Arc<O>) -> io::Result<AsyncFd<OwnedByArc<O>>> {
    let inner = OwnedByArc { fd, _owner: owner };
    // SAFETY: `inner` holds an `Arc` to the owner of `fd`, so the owner (and
    // with it the open fd) lives at least as long as the `AsyncFd`; the
    // caller guarantees the owner never closes or swaps the fd while alive,
    // and `as_raw_fd` always returns the same number.
    #[allow(unsafe_code)]
    unsafe {
        AsyncFd::register(inner).map_err(|e| e.into_parts().1)
    }
}
