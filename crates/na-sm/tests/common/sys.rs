//! The tests' system calls that `std` lacks, each behind a safe function
//! (the test files themselves hold no `unsafe`). One function per call,
//! with its man page; every `unsafe` block says what makes it sound.

#![allow(dead_code)]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};

/// Most descriptors one `SCM_RIGHTS` message carries (`SCM_MAX_FD`).
pub const SCM_MAX_FD: usize = 253;

/// [sendmsg(2)] of `data` with `fds` attached (`SCM_RIGHTS`, [unix(7)];
/// at most [`SCM_MAX_FD`]) on UNIX socket `sock`, without blocking and
/// without `SIGPIPE`. Returns the bytes sent.
///
/// [sendmsg(2)]: https://man7.org/linux/man-pages/man2/sendmsg.2.html
/// [unix(7)]: https://man7.org/linux/man-pages/man7/unix.7.html
pub fn send_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    assert!(!fds.is_empty() && fds.len() <= SCM_MAX_FD);
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    // u64 words: aligned for cmsghdr.
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: msg_control points at `space` aligned, zeroed bytes, room
    // for one header and `fd_bytes` of data, so CMSG_FIRSTHDR is non-null
    // and CMSG_DATA has room for the descriptors.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as usize;
        std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(cmsg), fd_bytes);
    }
    // SAFETY: msg points at `iov` (valid for data.len() bytes) and at
    // `cbuf`, both alive across the call; the kernel only reads them.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}
