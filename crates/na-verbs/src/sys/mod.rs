//! Safe RAII wrappers over libibverbs and librdmacm (through `rdma-sys`).
//!
//! This is the only module of the crate that contains `unsafe` code. One file
//! per verbs facility, in the style of rust-ibverbs: every verbs object is an
//! owning type whose `Drop` releases it, and children hold an `Arc` to their
//! parent so a parent can never be destroyed under a live child:
//!
//! ```text
//! Context ──< ProtectionDomain ──< MemoryRegion
//!    │               └──────────────< QueuePair >── CompletionQueue ── CompletionChannel
//!    └─< CompletionChannel           SharedReceiveQueue ─┘
//! EventChannel ──< CmId (the QP of a connection is created on its CmId)
//! ```
//!
//! # Memory model
//! Memory inside a [`MemoryRegion`] belongs to the device as much as to the
//! process: a local RECV or RDMA READ, or a remote RDMA WRITE (if the region
//! grants it), can change it at any time. So an owned region hands out no
//! references, only copies ([`MemoryRegion::write_at`],
//! [`MemoryRegion::read_at`]); registering foreign memory is `unsafe` and
//! states that contract. With that, posting work requests is safe: an
//! [`Sge`] is built only from a region (bounds-checked), and the device
//! checks `lkey`/`rkey` against live registrations, failing a work request
//! with a completion error rather than touching other memory.
//!
//! Man pages: `ibv_open_device(3)`, `ibv_alloc_pd(3)`, `ibv_reg_mr(3)`,
//! `ibv_create_comp_channel(3)`, `ibv_create_cq(3)`, `ibv_poll_cq(3)`,
//! `ibv_req_notify_cq(3)`, `ibv_get_cq_event(3)`, `ibv_create_qp(3)`,
//! `ibv_modify_qp(3)`, `ibv_post_send(3)`, `ibv_post_recv(3)`,
//! `ibv_create_srq(3)`, `rdma_cm(7)`, `rdma_create_id(3)`, `rdma_get_cm_event(3)`.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::time::Duration;

mod cm;
mod cm_id;
mod cq;
mod device;
mod mr;
mod qp;
mod registrar;
mod send_buf;
mod srq;
mod wr;

pub use cm::{CmEvent, CmEventKind, CmIdKey, EventChannel};
pub use cm_id::{CmId, ConnParam, PortSpace};
pub use cq::{CompletionChannel, CompletionQueue, WcOpcode, WorkCompletion};
pub use device::{devices, Context, DeviceAttr, DeviceInfo, Gid};
pub use mr::{AccessFlags, MemoryRegion, ProtectionDomain, RemoteRegion, Sge};
pub use qp::{QpCaps, QpInitAttr, QpState, QueuePair};
pub use registrar::IbvRegistrar;
pub use send_buf::SendBuffer;
pub use srq::SharedReceiveQueue;
pub use wr::{SendOp, SendWr};
// Named by the tests only (the plugin uses the values, not the names).
#[cfg_attr(not(feature = "test-hooks"), allow(unused_imports))]
pub use {
    device::PortAttr,
    qp::{ReadDepths, RtrAttr, RtsAttr},
};

/// Turns a libibverbs/librdmacm "-1 and errno" return value into `io::Result`.
macro_rules! syscall {
    ($e:expr) => {{
        let rc = $e;
        if rc == -1 {
            Err(::std::io::Error::last_os_error())
        } else {
            Ok(rc)
        }
    }};
}
pub(crate) use syscall;

/// Converts a verbs call that returns `0` or a positive errno value (the
/// convention of `ibv_post_send`, `ibv_modify_qp`, `ibv_req_notify_cq`, ...).
/// Some providers return -1 and set errno instead; both are handled.
pub(crate) fn errno_rc(rc: libc::c_int) -> io::Result<()> {
    match rc {
        0 => Ok(()),
        -1 => Err(io::Error::last_os_error()),
        e if e > 0 => Err(io::Error::from_raw_os_error(e)),
        e => Err(io::Error::from_raw_os_error(-e)),
    }
}

/// Returns the OS error for a NULL returned by a constructor, with a fallback
/// when the library did not set errno.
pub(crate) fn null_error() -> io::Error {
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(0) | None => io::Error::other("returned NULL without setting errno"),
        _ => e,
    }
}

/// Puts `fd` in nonblocking mode (`fcntl(2)` with `O_NONBLOCK`).
pub(crate) fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL only read and set flags of a descriptor; an
    // invalid fd yields EBADF, no memory is touched.
    let flags = syscall!(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    // SAFETY: as above.
    syscall!(unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
    Ok(())
}

/// Waits until `fd` is readable or `timeout` passes (`poll(2)`); returns
/// whether it is readable. `None` waits forever. `EINTR` is retried.
///
/// For tests and simple loops; the NA plugin registers the completion and CM
/// channel fds with the unified poll set instead.
#[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
pub fn poll_readable(fd: BorrowedFd<'_>, timeout: Option<Duration>) -> io::Result<bool> {
    let ms = timeout.map_or(-1, |t| {
        libc::c_int::try_from(t.as_millis()).unwrap_or(libc::c_int::MAX)
    });
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: `pfd` is one valid pollfd for the duration of the call; the
        // fd is kept open by the `BorrowedFd` lifetime.
        match syscall!(unsafe { libc::poll(&mut pfd, 1, ms) }) {
            Ok(n) => return Ok(n > 0 && pfd.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Copies a NUL-terminated C string out of a fixed-size array.
pub(crate) fn c_array_to_string(raw: &[libc::c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Copies a C string returned by a library (`*_str()` functions).
pub(crate) fn c_ptr_to_string(p: *const libc::c_char) -> String {
    if p.is_null() {
        return String::from("(null)");
    }
    // SAFETY: `p` is non-null and points to a NUL-terminated static string
    // owned by the library (ibv_wc_status_str, rdma_event_str, ...).
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}
