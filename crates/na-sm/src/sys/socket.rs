//! UNIX-socket extras that `std` lacks: descriptor passing with
//! `SCM_RIGHTS` ([unix(7)], [sendmsg(2)], [recvmsg(2)]), peer credentials
//! with `SO_PEERCRED` ([getsockopt(2)]), and a connect whose wait for a
//! full listen queue is bounded ([connect(2)], `SO_SNDTIMEO`) or, with a
//! non-blocking socket, does not happen at all (`EAGAIN`).
//!
//! [connect(2)]: https://man7.org/linux/man-pages/man2/connect.2.html
//! [unix(7)]: https://man7.org/linux/man-pages/man7/unix.7.html
//! [sendmsg(2)]: https://man7.org/linux/man-pages/man2/sendmsg.2.html
//! [recvmsg(2)]: https://man7.org/linux/man-pages/man2/recvmsg.2.html
//! [getsockopt(2)]: https://man7.org/linux/man-pages/man2/getsockopt.2.html

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Most descriptors one message may carry.
pub const MAX_FDS: usize = 4;

/// Credentials of the process at the other end of a socket, as the kernel
/// recorded them at `connect`/`listen` time (nothing the peer says).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id.
    pub pid: u32,
    /// User id.
    pub uid: u32,
}

/// `getsockopt(SOL_SOCKET, SO_PEERCRED)`.
pub fn peer_cred(sock: BorrowedFd<'_>) -> io::Result<PeerCred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes and `len` holds the size
    // of `cred`, as getsockopt requires.
    unsafe {
        super::syscall!(getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len
        ))?;
    }
    let pid = u32::try_from(cred.pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    Ok(PeerCred { pid, uid: cred.uid })
}

/// True where `asm-generic/socket.h` numbers the socket options (the
/// values below); elsewhere the newer options read as unknown.
const GENERIC_SOCKET_H: bool = cfg!(any(
    target_arch = "x86_64",
    target_arch = "x86",
    target_arch = "aarch64",
    target_arch = "arm",
    target_arch = "riscv64"
));

/// `SO_PEERPIDFD` (Linux 6.5), as `asm-generic/socket.h` numbers it.
const SO_PEERPIDFD: libc::c_int = 77;

/// `SO_PASSRIGHTS` (Linux 6.16), as `asm-generic/socket.h` numbers it.
const SO_PASSRIGHTS: libc::c_int = 83;

/// `getsockopt(SOL_SOCKET, opt)` of an `int` option whose number is
/// hard-coded above for the generic `socket.h` (refused elsewhere).
fn get_int_opt(sock: BorrowedFd<'_>, opt: libc::c_int) -> io::Result<libc::c_int> {
    if !GENERIC_SOCKET_H {
        return Err(io::Error::from_raw_os_error(libc::ENOPROTOOPT));
    }
    sock_int_opt(sock, opt)
}

/// `getsockopt(SOL_SOCKET, opt)` of an `int` option ([getsockopt(2)]),
/// `opt` being libc's constant for this target.
fn sock_int_opt(sock: BorrowedFd<'_>, opt: libc::c_int) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are valid for writes and `len` holds the size
    // of `v`, as getsockopt requires.
    unsafe {
        super::syscall!(getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&mut v as *mut libc::c_int).cast(),
            &mut len
        ))?;
    }
    Ok(v)
}

/// `setsockopt(SOL_SOCKET, opt, v)` of an `int` option.
fn set_int_opt(sock: BorrowedFd<'_>, opt: libc::c_int, v: libc::c_int) -> io::Result<()> {
    if !GENERIC_SOCKET_H {
        return Err(io::Error::from_raw_os_error(libc::ENOPROTOOPT));
    }
    // SAFETY: `v` is live and its size is passed, as setsockopt requires.
    unsafe {
        super::syscall!(setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t
        ))?;
    }
    Ok(())
}

/// `getsockopt(SOL_SOCKET, SO_PEERPIDFD)` ([socket(7)], Linux 6.5): a
/// pidfd ([pidfd_open(2)]) of the process that made the other end of the
/// connection, taken by the kernel at connect time, so it names that
/// process even if it has exited since (then it is readable at once).
/// `ENOPROTOOPT` on older kernels and other architectures.
///
/// [socket(7)]: https://man7.org/linux/man-pages/man7/socket.7.html
/// [pidfd_open(2)]: https://man7.org/linux/man-pages/man2/pidfd_open.2.html
pub fn peer_pidfd(sock: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let fd = get_int_opt(sock, SO_PEERPIDFD)?;
    if fd < 0 {
        return Err(io::Error::from(io::ErrorKind::InvalidData));
    }
    // SAFETY: a successful SO_PEERPIDFD stores a new descriptor that
    // nobody else owns, so OwnedFd may take it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the other end of connected stream socket `sock` is closed
/// (released by every process that had it, or shut down both ways): it
/// reports `POLLHUP` ([poll(2)] with a zero timeout; [unix(7)]). Bytes
/// it sent before do not hide it.
///
/// [poll(2)]: https://man7.org/linux/man-pages/man2/poll.2.html
/// [unix(7)]: https://man7.org/linux/man-pages/man7/unix.7.html
pub fn peer_closed(sock: BorrowedFd<'_>) -> io::Result<bool> {
    Ok(super::poll::revents_now(sock, 0)? & libc::POLLHUP != 0)
}

/// `setsockopt(SOL_SOCKET, SO_PASSRIGHTS, 0)` ([socket(7)], Linux 6.16):
/// the kernel refuses (`EPERM`, to the sender) any message carrying
/// descriptors to this socket. False where the kernel does not know the
/// option.
///
/// [socket(7)]: https://man7.org/linux/man-pages/man7/socket.7.html
pub fn refuse_passed_fds(sock: BorrowedFd<'_>) -> bool {
    set_int_opt(sock, SO_PASSRIGHTS, 0).is_ok()
}

/// `shutdown(SHUT_RD)` ([shutdown(2)]): nothing more is queued to the
/// socket. A stream peer's sends fail with `EPIPE` from then on, and a
/// listening UNIX socket refuses connections (`ECONNREFUSED`); what was
/// queued before stays readable. Takes any socket (std's `UnixListener`
/// has no `shutdown`). It acts on the socket, not the descriptor: every
/// process sharing the socket sees it.
///
/// [shutdown(2)]: https://man7.org/linux/man-pages/man2/shutdown.2.html
pub fn shutdown_read(sock: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: shutdown takes a descriptor, open for the call (`sock`
    // borrows it), and a constant; it touches no memory of ours.
    unsafe {
        super::syscall!(shutdown(sock.as_raw_fd(), libc::SHUT_RD))?;
    }
    Ok(())
}

/// For a descriptor a peer passed us and we are about to close: if it is
/// a socket ([fstat(2)] `S_ISSOCK`), `setsockopt(SOL_SOCKET, SO_LINGER,
/// {on, 0})` ([socket(7)]), so that its last close aborts the connection
/// (a TCP reset, unsent data dropped) instead of waiting up to the linger
/// time the peer set for that data to go. True if the option was set.
/// Never for a socket of ours: it throws away what we sent.
///
/// It acts on the socket, not the descriptor: a peer that kept a copy
/// sees it too (and may set its own linger back before our close). A
/// socket queued *inside* this one (in flight on a UNIX socket) is not
/// reached: the closing threads read those out first (`closer::nested`).
///
/// [fstat(2)]: https://man7.org/linux/man-pages/man2/fstat.2.html
/// [socket(7)]: https://man7.org/linux/man-pages/man7/socket.7.html
pub fn abort_at_close(fd: BorrowedFd<'_>) -> bool {
    // SAFETY: stat is plain data (all-zero is a valid value); fstat writes
    // one into `st`, which lives across the call.
    let mode = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
            return false;
        }
        st.st_mode & libc::S_IFMT
    };
    if mode != libc::S_IFSOCK {
        return false;
    }
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: `linger` is live and its size is passed, as setsockopt
    // requires; setsockopt only reads it.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        ) == 0
    }
}

/// If `fd` is a UNIX-domain socket ([unix(7)]; `SO_DOMAIN` is
/// `AF_UNIX`, by [getsockopt(2)]), its type (`SO_TYPE`: `SOCK_STREAM`,
/// `SOCK_DGRAM` or `SOCK_SEQPACKET`) and whether it is listening
/// (`SO_ACCEPTCONN`); `None` for anything else (not a socket: `ENOTSOCK`).
/// Messages queued on such a socket may hold descriptors in flight
/// (`SCM_RIGHTS`), released by its last close.
///
/// [unix(7)]: https://man7.org/linux/man-pages/man7/unix.7.html
/// [getsockopt(2)]: https://man7.org/linux/man-pages/man2/getsockopt.2.html
pub fn unix_socket_kind(fd: BorrowedFd<'_>) -> Option<(libc::c_int, bool)> {
    if sock_int_opt(fd, libc::SO_DOMAIN).ok()? != libc::AF_UNIX {
        return None;
    }
    let ty = sock_int_opt(fd, libc::SO_TYPE).ok()?;
    let listening = sock_int_opt(fd, libc::SO_ACCEPTCONN).ok()? != 0;
    Some((ty, listening))
}

/// A new stream socket (close-on-exec; non-blocking if `nonblocking`)
/// and the address of `path` for connect(2), with its length.
fn unix_socket_for(
    path: &Path,
    nonblocking: bool,
) -> io::Result<(OwnedFd, libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: an all-zero sockaddr_un is valid (AF_UNSPEC, empty path).
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long or has a NUL byte",
        ));
    }
    for (d, &b) in addr.sun_path.iter_mut().zip(bytes) {
        *d = b as libc::c_char;
    }
    let len = (std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1) as libc::socklen_t;
    let flags = libc::SOCK_STREAM | libc::SOCK_CLOEXEC | if nonblocking { libc::SOCK_NONBLOCK } else { 0 };
    // SAFETY: plain socket(2) call; the result is checked and owned at once.
    let fd = unsafe { super::syscall!(socket(libc::AF_UNIX, flags, 0))? };
    // SAFETY: `fd` was just returned by socket(2) and nothing else owns it.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok((sock, addr, len))
}

/// The socket at `path`, opened without following a symbolic link there
/// (`O_PATH | O_NOFOLLOW`, [open(2)]) and checked to be a socket by
/// [fstat(2)] of what was opened (the directory's own entry, never a
/// file elsewhere): the descriptor, to keep until the connect returns,
/// and its `/proc/self/fd` name, by which connect(2) reaches that very
/// socket. Any process of our uid may put a file in the socket
/// directory: a link planted under a socket's name would make connect(2)
/// follow it, into a FUSE mount whose daemon never answers, say, and wait
/// (killable only) for as long as that daemon lives.
///
/// [open(2)]: https://man7.org/linux/man-pages/man2/open.2.html
/// [fstat(2)]: https://man7.org/linux/man-pages/man2/fstat.2.html
fn pinned_socket(path: &Path) -> io::Result<(OwnedFd, std::path::PathBuf)> {
    let cpath = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "socket path has a NUL byte"))?;
    // SAFETY: a NUL-terminated path that lives across the call; a
    // descriptor open returns is fresh and ours.
    let fd = unsafe {
        let fd = super::syscall!(open(
            cpath.as_ptr(),
            libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC
        ))?;
        OwnedFd::from_raw_fd(fd)
    };
    // SAFETY: stat is plain data (all-zero is a valid value); fstat
    // writes one into `st`, which lives across the call.
    let mode = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        super::syscall!(fstat(fd.as_raw_fd(), &mut st))?;
        st.st_mode & libc::S_IFMT
    };
    if mode != libc::S_IFSOCK {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is not a socket (a symbolic link or another file under a socket's name)",
                path.display()
            ),
        ));
    }
    let name = std::path::PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    Ok((fd, name))
}

/// connect(2) of `sock` to `addr` (`len` bytes of it).
fn connect_to(sock: &OwnedFd, addr: &libc::sockaddr_un, len: libc::socklen_t) -> io::Result<()> {
    // SAFETY: `addr` is a valid sockaddr_un of at least `len` bytes.
    unsafe {
        super::syscall!(connect(
            sock.as_raw_fd(),
            (addr as *const libc::sockaddr_un).cast(),
            len
        ))?;
    }
    Ok(())
}

/// The error of a connect that waited `timeout` for a listener whose
/// queue stayed full: what [`connect_unix`] gives, and what a caller of
/// [`try_connect_unix`] gives once it has retried for as long.
pub fn queue_full_timeout(timeout: Duration) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("the listener's queue stayed full for {timeout:?} (it is not accepting)"),
    )
}

/// Connects a stream socket to `path`, waiting at most `timeout` while the
/// listener's queue is full (a listener that never accepts would otherwise
/// hold `connect` forever). The socket keeps no send timeout afterwards.
/// A symbolic link (or anything but a socket) at `path` is refused, not
/// followed (see `pinned_socket`).
pub fn connect_unix(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    let (_pinned, path) = pinned_socket(path)?;
    let (sock, addr, len) = unix_socket_for(&path, false)?;
    set_send_timeout(sock.as_raw_fd(), timeout)?;
    match connect_to(&sock, &addr, len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(queue_full_timeout(timeout)),
        Err(e) => return Err(e),
    }
    set_send_timeout(sock.as_raw_fd(), Duration::ZERO)?;
    Ok(UnixStream::from(sock))
}

/// Connects a non-blocking stream socket to `path` without waiting: a
/// listener whose queue is full makes it fail at once with
/// [`io::ErrorKind::WouldBlock`] (`EAGAIN`). On a UNIX socket a connect
/// is either done or refused when connect(2) returns: unlike TCP it never
/// answers `EINPROGRESS` ([unix(7)]), so the socket returned is connected.
/// It stays non-blocking. A symbolic link (or anything but a socket) at
/// `path` is refused, not followed (see `pinned_socket`).
///
/// [unix(7)]: https://man7.org/linux/man-pages/man7/unix.7.html
pub fn try_connect_unix(path: &Path) -> io::Result<UnixStream> {
    let (_pinned, path) = pinned_socket(path)?;
    let (sock, addr, len) = unix_socket_for(&path, true)?;
    match connect_to(&sock, &addr, len) {
        Ok(()) => Ok(UnixStream::from(sock)),
        // Not documented for AF_UNIX, and never seen: were it to come, the
        // connection would still be in progress, which the handshake
        // cannot use. Reported as a plain failure, not as "retry".
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Err(io::Error::other(format!(
            "non-blocking connect answered EINPROGRESS, which a UNIX socket should not: {e}"
        ))),
        Err(e) => Err(e),
    }
}

/// `setsockopt(SO_SNDTIMEO)`; zero means none.
fn set_send_timeout(fd: RawFd, t: Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: t.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_usec: libc::suseconds_t::from(t.subsec_micros()),
    };
    // A non-zero timeout shorter than a microsecond would mean "none".
    let tv = if !t.is_zero() && tv.tv_sec == 0 && tv.tv_usec == 0 {
        libc::timeval {
            tv_sec: 0,
            tv_usec: 1,
        }
    } else {
        tv
    };
    // SAFETY: `tv` is a valid timeval and its size is passed.
    unsafe {
        super::syscall!(setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t
        ))?;
    }
    Ok(())
}

const _: () = assert!(std::mem::size_of::<BorrowedFd<'static>>() == std::mem::size_of::<RawFd>());

/// Control-message buffer big enough for MAX_FDS descriptors, aligned for
/// `cmsghdr`.
#[repr(C, align(8))]
struct CmsgBuf([u8; 64]);

/// Sends `data` with `fds` attached, without blocking and without SIGPIPE.
/// Returns the bytes sent. The descriptors are borrowed (I/O safety: a
/// raw number could name whatever another part of the process opened
/// under it by now, which the peer would then get).
pub fn send_with_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    assert!(fds.len() <= MAX_FDS);
    let mut cbuf = CmsgBuf([0; 64]);
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: msghdr is plain data; all-zero is a valid empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
        assert!(space <= cbuf.0.len());
        msg.msg_control = cbuf.0.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: msg_control points at `space` aligned bytes, enough for one
        // header plus `fd_bytes` of data, so CMSG_FIRSTHDR is non-null and
        // CMSG_DATA has room for the descriptors; `BorrowedFd` is
        // `repr(transparent)` over a `RawFd` (its size asserted above `CmsgBuf`), so the slice's
        // bytes are the descriptor numbers.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as usize;
            std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(cmsg), fd_bytes);
        }
    }
    // SAFETY: msg points at `iov` (valid for data.len() bytes) and at `cbuf`,
    // both alive across the call; the kernel only reads them.
    let n = unsafe {
        super::syscall!(sendmsg(
            sock.as_raw_fd(),
            &msg,
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT
        ))?
    };
    Ok(n as usize)
}

/// What [`recv_with_fds`] got.
#[derive(Debug)]
pub struct Received {
    /// Bytes written into the buffer (0 means end of stream).
    pub len: usize,
    /// Descriptors that came with them (close-on-exec).
    pub fds: Vec<OwnedFd>,
    /// The kernel dropped descriptors that did not fit (`MSG_CTRUNC`).
    pub fds_truncated: bool,
}

/// Room for the most descriptors one message can carry (`SCM_MAX_FD`,
/// 253): every descriptor a peer attaches is ours to close where we
/// choose. (Past the buffer, the kernel would close the rest itself,
/// inside `recvmsg`, on the caller's thread: see `closer`.)
#[repr(C, align(8))]
struct RecvCmsgBuf([u8; 1040]);

/// Receives into `buf` without blocking, with every descriptor attached.
pub fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Received> {
    let mut cbuf = RecvCmsgBuf([0; 1040]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.0.as_mut_ptr().cast();
    msg.msg_controllen = cbuf.0.len();
    // SAFETY: msg points at `iov` (valid for buf.len() writable bytes) and at
    // `cbuf`, both alive across the call.
    let n = unsafe {
        super::syscall!(recvmsg(
            sock.as_raw_fd(),
            &mut msg,
            libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC
        ))?
    };
    let mut fds = Vec::new();
    // SAFETY: after recvmsg, msg_control/msg_controllen describe the control
    // messages the kernel wrote into `cbuf`; the CMSG_* walkers stay inside
    // it, and each SCM_RIGHTS payload holds whole descriptors that are now
    // ours to own.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let bytes = (*cmsg).cmsg_len - (data as usize - cmsg as usize);
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok(Received {
        len: n as usize,
        fds,
        fds_truncated: msg.msg_flags & libc::MSG_CTRUNC != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    /// A non-blocking connect to a listener whose queue is full fails at
    /// once with `EAGAIN` (never `EINPROGRESS`), and connects once the
    /// listener took the queued connection.
    #[test]
    fn try_connect_does_not_wait_for_a_full_queue() {
        use std::os::unix::net::UnixListener;
        let dir = std::env::temp_dir().join(format!("qs-sm-tryconn-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("l.sock");
        let listener = UnixListener::bind(&path).unwrap();
        // SAFETY: listen(2) on a socket we own; backlog 0 makes one queued
        // connection fill the queue.
        assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
        let first = try_connect_unix(&path).expect("an empty queue takes a connection");
        let t0 = std::time::Instant::now();
        let e = try_connect_unix(&path).expect_err("the queue is full");
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "{e}");
        assert!(t0.elapsed() < Duration::from_secs(1), "waited {:?}", t0.elapsed());
        let (_accepted, _) = listener.accept().unwrap();
        let second = try_connect_unix(&path).expect("room in the queue again");
        assert_eq!(peer_cred(second.as_fd()).unwrap().pid, std::process::id());
        drop((first, second, listener));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn pass_fds_and_creds() {
        let (a, b) = UnixStream::pair().unwrap();
        let c = peer_cred(a.as_fd()).unwrap();
        assert_eq!(c.pid, std::process::id());
        let e = super::super::eventfd::EventFd::new().unwrap();
        send_with_fds(a.as_fd(), b"hi", &[e.as_fd(), e.as_fd()]).unwrap();
        let mut buf = [0u8; 16];
        let r = recv_with_fds(b.as_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..r.len], b"hi");
        assert_eq!(r.fds.len(), 2);
        assert!(!r.fds_truncated);
        assert!(recv_with_fds(b.as_fd(), &mut buf).is_err()); // EAGAIN
        drop(a);
        assert_eq!(recv_with_fds(b.as_fd(), &mut buf).unwrap().len, 0);
    }

    /// The other end counts as closed once no descriptor of it is left
    /// (bytes it sent still unread), not while a copy lives; a connection
    /// the listener never accepted is closed when the listener is.
    #[test]
    fn peer_closed_once_every_copy_of_the_other_end_is() {
        let (a, b) = UnixStream::pair().unwrap();
        assert!(!peer_closed(a.as_fd()).unwrap());
        send_with_fds(b.as_fd(), b"unread", &[]).unwrap();
        let copy = b.try_clone().unwrap();
        drop(b);
        assert!(!peer_closed(a.as_fd()).unwrap(), "a copy still holds it");
        drop(copy);
        assert!(peer_closed(a.as_fd()).unwrap(), "closed, bytes unread");

        let path = std::env::temp_dir().join(format!("qs-sm-peer-closed-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let queued = UnixStream::connect(&path).unwrap();
        assert!(!peer_closed(queued.as_fd()).unwrap(), "queued, listener open");
        drop(listener);
        let _ = std::fs::remove_file(&path);
        assert!(peer_closed(queued.as_fd()).unwrap(), "its listener closed");
    }

    /// Only a socket is set to abort at its close, with linger {on, 0}.
    #[test]
    fn abort_at_close_sets_sockets_only() {
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(abort_at_close(tcp.as_fd()), "a TCP socket");
        let mut l: libc::linger = libc::linger {
            l_onoff: 0,
            l_linger: 7,
        };
        let mut len = std::mem::size_of::<libc::linger>() as libc::socklen_t;
        // SAFETY (test): `l` and `len` are live and `len` holds l's size.
        let r = unsafe {
            libc::getsockopt(
                tcp.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&mut l as *mut libc::linger).cast(),
                &mut len,
            )
        };
        assert_eq!(r, 0);
        assert_eq!((l.l_onoff, l.l_linger), (1, 0));
        let null = std::fs::File::open("/dev/null").unwrap();
        assert!(!abort_at_close(null.as_fd()), "a device node");
        let ev = crate::sys::eventfd::EventFd::new().unwrap();
        assert!(!abort_at_close(ev.as_fd()), "an eventfd");
    }

    /// Where the kernel has them: the peer's pidfd names a live process
    /// (ours, for a socket pair), and a socket that refuses passed
    /// descriptors makes the sender's `sendmsg` fail while plain bytes
    /// still go. Says so, and checks nothing more, on an older kernel.
    #[test]
    fn peer_pidfd_and_refused_descriptors_where_the_kernel_has_them() {
        let (a, b) = UnixStream::pair().unwrap();
        match peer_pidfd(a.as_fd()) {
            Ok(fd) => {
                let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).unwrap();
                let pid = format!("Pid:\t{}", std::process::id());
                assert!(info.lines().any(|l| l == pid), "not our pidfd: {info}");
            }
            Err(e) => na_core::testing::report_not_run(&format!(
                "na-sm socket test: SO_PEERPIDFD unavailable here ({e}); peers' exits are seen by pidfd_open"
            )),
        }
        if !refuse_passed_fds(a.as_fd()) {
            na_core::testing::report_not_run(
                "na-sm socket test: SO_PASSRIGHTS unavailable (kernel older than 6.16); passed descriptors are screened instead",
            );
            return;
        }
        let ev = crate::sys::eventfd::EventFd::new().unwrap();
        let e = send_with_fds(b.as_fd(), b"x", &[ev.as_fd()]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        assert_eq!(send_with_fds(b.as_fd(), b"y", &[]).unwrap(), 1);
    }
}
