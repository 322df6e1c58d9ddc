//! Screening the descriptors a peer passes (`SCM_RIGHTS`): which may be
//! kept and closed in place, and which go to a closing thread
//! (`closer`), by what they are.
//!
//! The screen must not ask a descriptor's file system anything:
//! [fstatfs(2)] and [fstat(2)] of a file on a FUSE mount are requests to
//! its daemon, which a peer may be (`fusermount`, or a user namespace,
//! needs no privileges), and which wait, killable only, for an answer
//! that need never come: the screening thread (a listener reading a
//! hello, the engine's) would wait with them (`tests/fuse_fds.rs`). So a
//! descriptor is judged by [statx(2)] with `AT_STATX_DONT_SYNC` (the
//! attributes the kernel has, never a request: FUSE honours it) and by
//! the name `/proc/self/fd` gives it (made by the kernel from what it
//! holds): its file system is told by its device number, compared with
//! those of the kernel's own pipes, anonymous inodes and memfds
//! (`internal_devices`, learned once per process from descriptors of
//! each kind it makes itself).
//!
//! [fstatfs(2)]: https://man7.org/linux/man-pages/man2/fstatfs.2.html
//! [fstat(2)]: https://man7.org/linux/man-pages/man2/fstat.2.html
//! [statx(2)]: https://man7.org/linux/man-pages/man2/statx.2.html

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

/// A file system's device (major, minor) and a file's mode (type and
/// permission bits).
type DevMode = ((u32, u32), u32);

/// The device numbers of the kernel's internal file systems that hold
/// what a hello may carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InternalDevices {
    /// pipefs: every pipe.
    pub pipe: (u32, u32),
    /// anon_inodefs: every eventfd (and other anonymous inodes).
    pub anon: (u32, u32),
    /// The internal tmpfs of `memfd_create` (not hugetlbfs, nor any
    /// mounted tmpfs such as `/dev/shm`).
    pub memfd: (u32, u32),
}

impl InternalDevices {
    /// The screen's judgement of a descriptor that [statx(2)] says is of
    /// type `mode` (`stx_mode`, type and permission bits) on the file
    /// system of device `fs`: a regular file of the memfd file system, a
    /// FIFO of pipefs, or an anonymous inode that `eventfd` (asked only
    /// then: it reads `/proc/self/fd`) says is an eventfd.
    ///
    /// [statx(2)]: https://man7.org/linux/man-pages/man2/statx.2.html
    pub fn harmless(&self, fs: (u32, u32), mode: u32, eventfd: impl FnOnce() -> bool) -> bool {
        let mode = mode & libc::S_IFMT;
        if fs == self.memfd {
            return mode == libc::S_IFREG;
        }
        if fs == self.pipe {
            return mode == libc::S_IFIFO;
        }
        fs == self.anon && eventfd()
    }
}

/// [statx(2)] of `fd` itself with `AT_STATX_DONT_SYNC`: its file
/// system's device and its mode, from what the kernel holds (no request
/// to a FUSE daemon or a network server). `ENOSYS` on a kernel before
/// 4.11, which has no statx; `EPERM` where a seccomp filter refuses it.
///
/// [statx(2)]: https://man7.org/linux/man-pages/man2/statx.2.html
fn dev_and_type(fd: BorrowedFd<'_>) -> std::io::Result<DevMode> {
    // SAFETY: statx is plain data (all-zero is a valid value).
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: an empty NUL-terminated path with AT_EMPTY_PATH names `fd`
    // itself; statx writes one struct into `st`, which lives across the
    // call.
    let r = unsafe {
        libc::statx(
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_STATX_DONT_SYNC,
            libc::STATX_TYPE,
            &mut st,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if st.stx_mask & libc::STATX_TYPE == 0 {
        return Err(std::io::Error::other("statx gave no file type"));
    }
    Ok(((st.stx_dev_major, st.stx_dev_minor), u32::from(st.stx_mode)))
}

/// The [`InternalDevices`] of this kernel, learned from a pipe, an
/// eventfd and a memfd made (and closed) here: once per process, when it
/// first succeeds (each plugin asks as it is made, so that a handshake
/// never needs the four descriptors this takes: our descriptors may have
/// run out then). `None` while they cannot be made or examined: then a
/// descriptor a peer passes is judged by [`harmless_by_statfs`] if this
/// kernel has no `statx`, or not kept at all.
pub(crate) fn internal_devices() -> Option<InternalDevices> {
    static DEVICES: OnceLock<InternalDevices> = OnceLock::new();
    if let Some(d) = DEVICES.get() {
        return Some(*d);
    }
    let d = probe_devices()?;
    Some(*DEVICES.get_or_init(|| d))
}

/// [`internal_devices`], made afresh.
fn probe_devices() -> Option<InternalDevices> {
    let mut fds = [-1 as libc::c_int; 2];
    // SAFETY: pipe2 writes two descriptors into the array; on success
    // both are fresh and ours.
    let (r, _w) = unsafe {
        if libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return None;
        }
        (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
    };
    let ev = super::eventfd::EventFd::new().ok()?;
    // SAFETY: a NUL-terminated name and flags; a descriptor it returns is
    // fresh and ours.
    let memfd = unsafe {
        let fd = libc::memfd_create(c"qs-sm-screen".as_ptr(), libc::MFD_CLOEXEC);
        if fd < 0 {
            return None;
        }
        OwnedFd::from_raw_fd(fd)
    };
    Some(InternalDevices {
        pipe: dev_and_type(r.as_fd()).ok()?.0,
        anon: dev_and_type(ev.as_fd()).ok()?.0,
        memfd: dev_and_type(memfd.as_fd()).ok()?.0,
    })
}

/// True if closing `fd` cannot wait on anyone, and it may be what a
/// hello or an acknowledgement carries: a memfd (a regular file of the
/// kernel's memfd file system), a pipe, or an eventfd (by its name in
/// `/proc/self/fd`). Anything else a peer passed us (a socket, a device
/// node, a file on a FUSE or network mount, a hugetlbfs memfd, another
/// anonymous inode) may run code of its own, and wait, at its last
/// close. Judged without a request to the descriptor's file system (see
/// the module docs), except where `statx` is missing (before 4.11) or
/// refused (`EPERM`: a seccomp filter of an older container runtime):
/// there `harmless_by_statfs` judges it.
pub fn harmless_to_close(fd: BorrowedFd<'_>) -> bool {
    let (fs, mode) = match dev_and_type(fd) {
        Ok(dm) => dm,
        // No statx (before 4.11), or one a seccomp filter refuses (older
        // container runtimes answer EPERM).
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) => {
            return harmless_by_statfs(fd)
        }
        Err(_) => return false,
    };
    let Some(dev) = internal_devices() else {
        return false;
    };
    dev.harmless(fs, mode, || is_eventfd(fd))
}

/// True if `/proc/self/fd` names `fd` an eventfd (the kernel's name of
/// an anonymous inode, no file system asked).
fn is_eventfd(fd: BorrowedFd<'_>) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|l| is_eventfd_link(l.as_os_str()))
}

/// True if `link`, a descriptor's name in `/proc/self/fd`, is an
/// eventfd's.
pub fn is_eventfd_link(link: &std::ffi::OsStr) -> bool {
    link == na_core::sys::eventfd::PROC_LINK
}

/// [`harmless_to_close`] where `statx` is missing or refused: by
/// [fstatfs(2)] and [fstat(2)] (which ask a FUSE daemon, and wait for
/// it: the screen can be held so there).
///
/// [fstatfs(2)]: https://man7.org/linux/man-pages/man2/fstatfs.2.html
/// [fstat(2)]: https://man7.org/linux/man-pages/man2/fstat.2.html
fn harmless_by_statfs(fd: BorrowedFd<'_>) -> bool {
    let raw = fd.as_raw_fd();
    // SAFETY: statfs and stat are plain data (all-zero is a valid value);
    // fstatfs and fstat write one into `fs` and `st`, which live across
    // the calls.
    let (f_type, mode) = unsafe {
        let mut fs: libc::statfs = std::mem::zeroed();
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstatfs(raw, &mut fs) != 0 || libc::fstat(raw, &mut st) != 0 {
            return false;
        }
        // The magic numbers are 32-bit (f_type is wider on 64-bit targets).
        (fs.f_type as u32, st.st_mode)
    };
    harmless_by_magic(
        f_type,
        mode,
        // SAFETY: F_GET_SEALS takes no pointer argument.
        || unsafe { libc::fcntl(raw, libc::F_GET_SEALS) } >= 0,
        || is_eventfd(fd),
    )
}

/// `harmless_by_statfs`'s judgement of a descriptor of type `mode`
/// (`st_mode`) on a file system of magic number `f_type`: a regular file
/// of tmpfs that `sealable` says takes seals (a memfd, not a file of a
/// mounted tmpfs), a FIFO of pipefs, or an anonymous inode that
/// `eventfd` says is an eventfd. `sealable` and `eventfd` (system calls)
/// are asked only where they decide.
pub fn harmless_by_magic(
    f_type: u32,
    mode: u32,
    sealable: impl FnOnce() -> bool,
    eventfd: impl FnOnce() -> bool,
) -> bool {
    const TMPFS_MAGIC: u32 = 0x0102_1994;
    const ANON_INODE_FS_MAGIC: u32 = 0x0904_1934;
    const PIPEFS_MAGIC: u32 = 0x5049_5045;
    let mode = mode & libc::S_IFMT;
    match f_type {
        TMPFS_MAGIC => mode == libc::S_IFREG && sealable(),
        PIPEFS_MAGIC => mode == libc::S_IFIFO,
        ANON_INODE_FS_MAGIC => eventfd(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    /// What a hello may carry passes the screen; what may block or run
    /// driver code at its last close does not.
    #[test]
    fn only_memfds_pipes_and_eventfds_are_harmless_to_close() {
        let memfd = crate::sys::shm::SharedRegion::create("screen-test", 4096).unwrap();
        let memfd = memfd.fd().expect("a fresh region has its memfd");
        assert!(harmless_to_close(memfd), "memfd");
        let ev = crate::sys::eventfd::EventFd::new().unwrap();
        assert!(harmless_to_close(ev.as_fd()), "eventfd");
        let mut fds = [0; 2];
        // SAFETY (test): pipe writes two fresh descriptors into `fds`.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY (test): both are ours alone.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        assert!(
            harmless_to_close(r.as_fd()) && harmless_to_close(w.as_fd()),
            "pipe"
        );
        let null = std::fs::File::open("/dev/null").unwrap();
        assert!(!harmless_to_close(null.as_fd()), "a device node");
        let (a, _b) = UnixStream::pair().unwrap();
        assert!(!harmless_to_close(a.as_fd()), "a socket");
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(!harmless_to_close(tcp.as_fd()), "a TCP socket");
        let timer = na_core::sys::timer::Timer::new().unwrap();
        assert!(!harmless_to_close(timer.as_fd()), "another anonymous inode");
        let exe = std::fs::File::open(std::env::current_exe().unwrap()).unwrap();
        assert!(!harmless_to_close(exe.as_fd()), "a file of a mounted file system");
        let dir = std::fs::File::open("/").unwrap();
        assert!(!harmless_to_close(dir.as_fd()), "a directory");
    }

    /// The judgement statx's answer gets: by the device's file system
    /// and the file's type, whatever its permission bits, and
    /// `/proc/self/fd` read only for an anonymous inode.
    #[test]
    fn the_judgement_goes_by_device_and_type_alone() {
        let d = InternalDevices {
            pipe: (0, 1),
            anon: (0, 2),
            memfd: (0, 3),
        };
        let never = || -> bool { panic!("/proc/self/fd read for a file that is no anonymous inode") };
        assert!(d.harmless((0, 3), libc::S_IFREG | 0o644, never));
        assert!(d.harmless((0, 1), libc::S_IFIFO | 0o600, never));
        assert!(
            !d.harmless((0, 3), libc::S_IFDIR | 0o755, never),
            "a directory of the memfd fs"
        );
        assert!(
            !d.harmless((0, 1), libc::S_IFSOCK | 0o777, never),
            "a socket on pipefs's device"
        );
        assert!(
            !d.harmless((8, 1), libc::S_IFREG | 0o644, never),
            "a file of a mounted fs"
        );
        assert!(d.harmless((0, 2), 0o600, || true));
        assert!(!d.harmless((0, 2), 0o600, || false), "another anonymous inode");
        assert!(is_eventfd_link("anon_inode:[eventfd]".as_ref()));
        assert!(!is_eventfd_link("anon_inode:[timerfd]".as_ref()));
        // Without statx: by the file system's magic number.
        let tmpfs = 0x0102_1994;
        assert!(harmless_by_magic(tmpfs, libc::S_IFREG | 0o600, || true, never));
        assert!(
            !harmless_by_magic(tmpfs, libc::S_IFREG | 0o600, || false, never),
            "no seals: no memfd"
        );
        assert!(!harmless_by_magic(0x6969, libc::S_IFREG, never, never), "NFS");
    }

    /// The kernel's internal file systems are told apart: a pipe, an
    /// eventfd and a memfd each have a device of their own.
    #[test]
    fn the_internal_file_systems_have_devices_of_their_own() {
        let d = internal_devices().expect("pipes, eventfds and memfds can be examined");
        assert_eq!(probe_devices(), Some(d), "learned once, the same every time");
        assert!(
            d.pipe != d.anon && d.anon != d.memfd && d.pipe != d.memfd,
            "{d:?}"
        );
    }
}
