//! The tests' system calls that `std` lacks, each behind a safe function
//! (the test files themselves hold no `unsafe`). One function per call,
//! with its man page; every `unsafe` block says what makes it sound.

#![allow(dead_code)]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

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

/// [fork(2)]: a new process, a copy of this one with only the calling
/// thread. Returns the child's pid in the parent, 0 in the child, -1 on
/// failure (as fork does).
///
/// What the child may do: it is a copy of a multi-threaded process (the
/// test harness's threads, na-sm's closing threads), so a lock another
/// thread held at the fork stays held in it for good. POSIX allows it
/// only async-signal-safe calls ([signal-safety(7)]: `write`, `read`,
/// `_exit`, ...) until it execs. The tests' children go further only
/// where the locks they take are covered: na-sm's own (its
/// `pthread_atfork` handlers take and release them around the fork) and
/// glibc's allocator (reset in the child by glibc). Every child must end
/// with [`exit_now`], never by returning into the test harness, whose
/// threads it does not have.
///
/// [fork(2)]: https://man7.org/linux/man-pages/man2/fork.2.html
/// [signal-safety(7)]: https://man7.org/linux/man-pages/man7/signal-safety.7.html
pub fn fork() -> libc::pid_t {
    // SAFETY: fork touches no memory of ours; what the child may do after
    // it is the caller's part (see above), and every caller in these tests
    // ends its child with `exit_now`.
    unsafe { libc::fork() }
}

/// [_exit(2)]: ends this process at once with `code`, running no exit
/// handlers and flushing nothing (async-signal-safe: how a forked child
/// ends).
///
/// [_exit(2)]: https://man7.org/linux/man-pages/man2/_exit.2.html
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit takes no pointer and does not return; nothing of ours
    // is left half-done that another process could see.
    unsafe { libc::_exit(code) }
}

/// [waitpid(2)] for `pid` (a child of ours) with `flags` (0 or
/// `WNOHANG`), its status written into `status`. Returns what waitpid
/// does: the pid, 0 (`WNOHANG`, still running) or -1.
///
/// [waitpid(2)]: https://man7.org/linux/man-pages/man2/waitpid.2.html
pub fn waitpid(pid: libc::pid_t, status: &mut libc::c_int, flags: libc::c_int) -> libc::pid_t {
    // SAFETY: `status` is a live, writable int for the call.
    unsafe { libc::waitpid(pid, status, flags) }
}

/// [kill(2)]: sends `sig` to `pid` (0: only checks that it exists).
/// Returns 0 or -1, as kill does.
///
/// [kill(2)]: https://man7.org/linux/man-pages/man2/kill.2.html
pub fn kill(pid: libc::pid_t, sig: libc::c_int) -> libc::c_int {
    // SAFETY: kill takes no pointer; which process it signals is the
    // caller's (the tests signal only processes they made).
    unsafe { libc::kill(pid, sig) }
}

/// [pidfd_open(2)]: a descriptor (close-on-exec) of process `pid`, for
/// [`pidfd_send_signal`] and [`waitid_pidfd`], and readable ([poll(2)])
/// once the process has ended. It names that process for good: once the
/// process is reaped its pid may be reused, but not the pidfd. An error
/// (`ESRCH`) for a pid that names no process (or a reaped one), `ENOSYS`
/// on a kernel without pidfds (before 5.3).
///
/// [pidfd_open(2)]: https://man7.org/linux/man-pages/man2/pidfd_open.2.html
/// [poll(2)]: https://man7.org/linux/man-pages/man2/poll.2.html
pub fn pidfd_open(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes integers only; a descriptor it returns is
    // fresh and ours to own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above: new, and nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// [pidfd_send_signal(2)]: sends `sig` to the process of pidfd `fd`
/// (never to another that took its pid since). 0, or -1 (`ESRCH` once
/// the process has ended).
///
/// [pidfd_send_signal(2)]: https://man7.org/linux/man-pages/man2/pidfd_send_signal.2.html
pub fn pidfd_send_signal(fd: BorrowedFd<'_>, sig: libc::c_int) -> libc::c_int {
    // SAFETY: a descriptor open for the call, a signal number, a null
    // siginfo (the kernel makes one, as kill does) and no flags.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        ) as libc::c_int
    }
}

/// [waitid(2)] of the process of pidfd `fd` (`P_PIDFD`, Linux 5.4) with
/// `WEXITED | WNOHANG`: reaps it if it is a child of ours that has ended.
/// `Ok(true)`: reaped; `Ok(false)`: still running; an error as waitid's
/// (`ECHILD`: not our child, or reaped already; `EINTR`).
///
/// [waitid(2)]: https://man7.org/linux/man-pages/man2/waitid.2.html
pub fn waitid_pidfd(fd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: siginfo_t is plain data: all-zero is a valid value (and
    // what WNOHANG leaves of it when no child has ended).
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a live, writable siginfo_t for the call; the
    // descriptor is open for it (`fd` borrows it).
    let r = unsafe {
        libc::waitid(
            libc::P_PIDFD,
            fd.as_raw_fd() as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: waitid filled `info` in (or left it zeroed): si_pid reads
    // a field of the union that it sets for every child state.
    Ok(unsafe { info.si_pid() } != 0)
}

/// [pipe(2)]: (read end, write end), inherited across exec.
///
/// [pipe(2)]: https://man7.org/linux/man-pages/man2/pipe.2.html
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe writes two descriptors into `fds`, live and of the
    // size it expects.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors are new and nobody else owns them.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// [dup(2)]: a copy of `fd` under the lowest free descriptor number.
///
/// [dup(2)]: https://man7.org/linux/man-pages/man2/dup.2.html
pub fn dup(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    // SAFETY: dup takes a descriptor, open for the call (`fd` borrows it).
    let new = unsafe { libc::dup(fd.as_raw_fd()) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `new` was just made by dup and nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// `fcntl(fd, F_DUPFD_CLOEXEC, 3)` ([fcntl(2)]): a copy of whatever
/// descriptor number `fd` names now, if it is open (`EBADF` if it was
/// closed meanwhile). For numbers read from `/proc/self/fd`, which no
/// `BorrowedFd` can vouch for.
///
/// [fcntl(2)]: https://man7.org/linux/man-pages/man2/fcntl.2.html
pub fn dup_number(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: fcntl with F_DUPFD_CLOEXEC takes an int argument, no
    // pointer; on a number that is not open it fails with EBADF.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `new` was just made by fcntl and nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// [poll(2)] of one descriptor for `events`, waiting at most
/// `timeout_ms`: (what poll returns, the revents).
///
/// [poll(2)]: https://man7.org/linux/man-pages/man2/poll.2.html
pub fn poll_one(fd: RawFd, events: libc::c_short, timeout_ms: libc::c_int) -> (libc::c_int, libc::c_short) {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one live pollfd, and a count of 1.
    let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    (n, p.revents)
}

/// [clock_gettime(2)] of `clock` into `ts`; 0 or -1.
///
/// [clock_gettime(2)]: https://man7.org/linux/man-pages/man2/clock_gettime.2.html
pub fn clock_gettime(clock: libc::clockid_t, ts: &mut libc::timespec) -> libc::c_int {
    // SAFETY: `ts` is a live, writable timespec.
    unsafe { libc::clock_gettime(clock, ts) }
}

/// [getrusage(2)] of `who`: (0 or -1, the usage).
///
/// [getrusage(2)]: https://man7.org/linux/man-pages/man2/getrusage.2.html
pub fn getrusage(who: libc::c_int) -> (libc::c_int, libc::rusage) {
    // SAFETY: rusage is plain data: all-zero is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a live, writable rusage.
    let r = unsafe { libc::getrusage(who, &mut ru) };
    (r, ru)
}

/// [getrlimit(2)] of `resource` into `lim`; 0 or -1.
///
/// [getrlimit(2)]: https://man7.org/linux/man-pages/man2/getrlimit.2.html
pub fn getrlimit(resource: libc::__rlimit_resource_t, lim: &mut libc::rlimit) -> libc::c_int {
    // SAFETY: `lim` is a live, writable rlimit.
    unsafe { libc::getrlimit(resource, lim) }
}

/// [setrlimit(2)] of `resource` to `lim`; 0 or -1.
///
/// [setrlimit(2)]: https://man7.org/linux/man-pages/man2/getrlimit.2.html
pub fn setrlimit(resource: libc::__rlimit_resource_t, lim: &libc::rlimit) -> libc::c_int {
    // SAFETY: `lim` is a live rlimit, only read.
    unsafe { libc::setrlimit(resource, lim) }
}

/// [listen(2)] on socket `sock` with `backlog`; 0 or -1.
///
/// [listen(2)]: https://man7.org/linux/man-pages/man2/listen.2.html
pub fn listen(sock: BorrowedFd<'_>, backlog: libc::c_int) -> libc::c_int {
    // SAFETY: listen takes a descriptor, open for the call, and an int.
    unsafe { libc::listen(sock.as_raw_fd(), backlog) }
}

/// `setsockopt(SOL_SOCKET, SO_LINGER, linger)` ([socket(7)],
/// [setsockopt(2)]) on `sock`; 0 or -1.
///
/// [socket(7)]: https://man7.org/linux/man-pages/man7/socket.7.html
/// [setsockopt(2)]: https://man7.org/linux/man-pages/man2/setsockopt.2.html
pub fn set_linger(sock: BorrowedFd<'_>, linger: &libc::linger) -> libc::c_int {
    // SAFETY: `linger` is live and its size is passed; setsockopt only
    // reads it.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    }
}

/// [write(2)] of `buf` to `fd` (async-signal-safe: for a forked child);
/// what write returns.
///
/// [write(2)]: https://man7.org/linux/man-pages/man2/write.2.html
pub fn write(fd: BorrowedFd<'_>, buf: &[u8]) -> isize {
    // SAFETY: `buf` is live and readable for its length.
    unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) }
}

/// [read(2)] from `fd` into `buf` (async-signal-safe: for a forked
/// child); what read returns.
///
/// [read(2)]: https://man7.org/linux/man-pages/man2/read.2.html
pub fn read(fd: BorrowedFd<'_>, buf: &mut [u8]) -> isize {
    // SAFETY: `buf` is live and writable for its length.
    unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) }
}

/// `struct uffdio_api` of `<linux/userfaultfd.h>`.
#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// `struct uffdio_register` of `<linux/userfaultfd.h>`.
#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

/// `UFFD_API`, `UFFDIO_API` and `UFFDIO_REGISTER` (`_IOWR(0xAA, 0x3F, 24
/// bytes)`, `_IOWR(0xAA, 0x00, 32 bytes)`) and the missing-page mode.
const UFFD_API: u64 = 0xaa;
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;

/// `len` bytes (a multiple of the page size) of fresh anonymous memory
/// registered for missing-page faults with a new [userfaultfd(2)] that
/// nobody reads: every access to them, ours or the kernel's on another
/// process's behalf (`process_vm_readv`), waits for an answer that never
/// comes, until the descriptor is closed (this process ends). Returns the
/// descriptor (keep it) and the memory's address. An error where the
/// kernel refuses a userfaultfd that handles the kernel's own faults
/// (`vm.unprivileged_userfaultfd` 0 without `CAP_SYS_PTRACE`): what a
/// hostile peer does with a mapping of a file on a FUSE mount it serves
/// instead. The memory is never freed (the test process, a forked child,
/// ends with it).
///
/// [userfaultfd(2)]: https://man7.org/linux/man-pages/man2/userfaultfd.2.html
pub fn stalling_memory(len: usize) -> io::Result<(OwnedFd, usize)> {
    // SAFETY: userfaultfd takes flags only; a descriptor it returns is
    // fresh and ours to own.
    let fd = unsafe {
        let fd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        OwnedFd::from_raw_fd(fd as RawFd)
    };
    let mut api = UffdioApi {
        api: UFFD_API,
        features: 0,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes the live struct we pass.
    if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh private anonymous mapping chosen by the kernel; no
    // memory of ours is touched.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let mut reg = UffdioRegister {
        start: addr as u64,
        len: len as u64,
        mode: UFFDIO_REGISTER_MODE_MISSING,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_REGISTER reads and writes the live struct we pass;
    // the range is the mapping made above, which nothing else uses.
    if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_REGISTER, &mut reg) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((fd, addr as usize))
}

/// A FUSE file system whose daemon never answers, mounted at `dir` (an
/// empty directory) in a mount namespace of this process's own (so it
/// goes with the process): [unshare(2)] `CLONE_NEWNS`, the mounts made
/// private, `/dev/fuse` opened and [mount(2)]ed with it. Returns that
/// device descriptor (the daemon's end: keep it open, never read it) and
/// an `O_PATH` descriptor of the file system's root, whose `fstatfs` or
/// `fstat` asks the daemon and so waits (killable only) until the device
/// descriptor is closed. An error where this process may not mount
/// (no `CAP_SYS_ADMIN` and no user namespace): what an unprivileged
/// peer does with `fusermount` instead. For a forked child, which ends
/// with it.
///
/// [unshare(2)]: https://man7.org/linux/man-pages/man2/unshare.2.html
/// [mount(2)]: https://man7.org/linux/man-pages/man2/mount.2.html
pub fn unanswered_fuse(dir: &std::path::Path) -> io::Result<(OwnedFd, OwnedFd)> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let cpath =
        CString::new(dir.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: flags only.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: NUL-terminated strings (or null where mount allows it) that
    // live across the call.
    if unsafe {
        libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")?;
    let dev = OwnedFd::from(dev);
    let opts = CString::new(format!(
        "fd={},rootmode=40000,user_id={},group_id={}",
        dev.as_raw_fd(),
        // SAFETY: getuid and getgid cannot fail.
        unsafe { libc::getuid() },
        // SAFETY: as above.
        unsafe { libc::getgid() }
    ))
    .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: NUL-terminated strings that live across the call.
    if unsafe {
        libc::mount(
            c"qs-unanswered".as_ptr(),
            cpath.as_ptr(),
            c"fuse.qs-unanswered".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            opts.as_ptr().cast(),
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a NUL-terminated path; a descriptor open returns is ours.
    let root = unsafe { libc::open(cpath.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    if root < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh descriptor from open.
    Ok((dev, unsafe { OwnedFd::from_raw_fd(root) }))
}
