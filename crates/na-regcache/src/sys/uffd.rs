//! Thin safe wrappers over [userfaultfd(2)] and the `UFFDIO_*` ioctls
//! ([ioctl_userfaultfd(2)]), plus the eventfd/poll pair the reader thread
//! sleeps on.
//!
//! [userfaultfd(2)]: https://man7.org/linux/man-pages/man2/userfaultfd.2.html
//! [ioctl_userfaultfd(2)]: https://man7.org/linux/man-pages/man2/ioctl_userfaultfd.2.html

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use super::syscall;

/// `UFFD_API`: the only API version the kernel knows.
const UFFD_API: u64 = 0xAA;
/// `userfaultfd` flag: only faults raised in user mode are delivered.
pub const UFFD_USER_MODE_ONLY: libc::c_int = 1;

/// `_IOWR(0xAA, 0x3F, struct uffdio_api)`.
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
/// `_IOWR(0xAA, 0x00, struct uffdio_register)`.
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
/// `_IOWR(0xAA, 0x04, struct uffdio_zeropage)`.
const UFFDIO_ZEROPAGE: libc::c_ulong = 0xc020_aa04;
/// `_IOR(0xAA, 0x01, struct uffdio_range)`.
const UFFDIO_UNREGISTER: libc::c_ulong = 0x8010_aa01;

/// Registration mode: write-protect tracking (faults only on protected pages).
pub const MODE_WP: u64 = 2;

/// Feature: `mremap` events.
pub const FEATURE_EVENT_REMAP: u64 = 1 << 2;
/// Feature: `madvise(MADV_DONTNEED/FREE/REMOVE)` events.
pub const FEATURE_EVENT_REMOVE: u64 = 1 << 3;
/// Feature: `munmap` (and `MAP_FIXED`, `brk` shrink) events.
pub const FEATURE_EVENT_UNMAP: u64 = 1 << 6;
/// Feature: write-protect mode on shmem and hugetlbfs.
pub const FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
/// Feature: the kernel resolves write-protect faults itself; allows WP
/// registration on any memory type.
pub const FEATURE_WP_ASYNC: u64 = 1 << 15;

const EVENT_PAGEFAULT: u8 = 0x12;
const EVENT_FORK: u8 = 0x13;
const EVENT_REMAP: u8 = 0x14;
const EVENT_REMOVE: u8 = 0x15;
const EVENT_UNMAP: u8 = 0x16;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}

const _: () = assert!(std::mem::size_of::<UffdioZeropage>() == 32);

/// One `struct uffd_msg` as read from the descriptor (32 bytes).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct UffdMsg {
    event: u8,
    _reserved1: u8,
    _reserved2: u16,
    _reserved3: u32,
    arg: [u64; 3],
}

const _: () = assert!(std::mem::size_of::<UffdMsg>() == 32);

/// A decoded userfaultfd event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UffdEvent {
    /// `[start, end)` was unmapped (munmap, MAP_FIXED overlay, brk shrink, mremap shrink).
    Unmap { start: u64, end: u64 },
    /// `[start, end)` lost its pages (madvise DONTNEED/FREE/REMOVE).
    Remove { start: u64, end: u64 },
    /// `len` bytes moved from `from` to `to` (mremap).
    Remap { from: u64, to: u64, len: u64 },
    /// A page fault at `address` (only with a faulting registration mode).
    Pagefault { address: u64, flags: u64 },
    /// A fork (only with `FEATURE_EVENT_FORK`).
    Fork,
    /// An event this crate does not know.
    Unknown(u8),
}

impl UffdMsg {
    /// Decodes the message.
    pub fn decode(&self) -> UffdEvent {
        let [a, b, c] = self.arg;
        match self.event {
            EVENT_UNMAP => UffdEvent::Unmap { start: a, end: b },
            EVENT_REMOVE => UffdEvent::Remove { start: a, end: b },
            EVENT_REMAP => UffdEvent::Remap {
                from: a,
                to: b,
                len: c,
            },
            EVENT_PAGEFAULT => UffdEvent::Pagefault { flags: a, address: b },
            EVENT_FORK => UffdEvent::Fork,
            other => UffdEvent::Unknown(other),
        }
    }
}

/// An owned userfaultfd descriptor (non-blocking, close-on-exec).
#[derive(Debug)]
pub struct Uffd {
    fd: OwnedFd,
}

impl Uffd {
    /// Opens a descriptor with [userfaultfd(2)]; `user_mode_only` adds
    /// `UFFD_USER_MODE_ONLY`.
    ///
    /// [userfaultfd(2)]: https://man7.org/linux/man-pages/man2/userfaultfd.2.html
    pub fn open(user_mode_only: bool) -> io::Result<Uffd> {
        let mut flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        if user_mode_only {
            flags |= UFFD_USER_MODE_ONLY;
        }
        // SAFETY: userfaultfd takes one integer flag argument and returns a
        // new descriptor or -1; no memory is passed.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags as libc::c_long) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this descriptor to us; nobody else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        Ok(Uffd { fd })
    }

    /// The `UFFDIO_API` handshake: asks for `features`, returns the features
    /// the kernel supports. May be called once per descriptor.
    pub fn api(&self, features: u64) -> io::Result<u64> {
        let mut api = UffdioApi {
            api: UFFD_API,
            features,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads and writes one `struct uffdio_api`, which
        // `api` is (repr(C), same layout), alive for the call.
        unsafe { syscall!(ioctl(self.fd.as_raw_fd(), UFFDIO_API, &mut api as *mut UffdioApi))? };
        Ok(api.features)
    }

    /// `UFFDIO_REGISTER` of `[start, start+len)` (page-aligned) with `mode`.
    pub fn register(&self, start: usize, len: usize, mode: u64) -> io::Result<()> {
        let mut reg = UffdioRegister {
            range: UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes one `struct
        // uffdio_register`; `reg` has that layout and outlives the call. The
        // range itself is only inspected by the kernel, never dereferenced here.
        unsafe {
            syscall!(ioctl(
                self.fd.as_raw_fd(),
                UFFDIO_REGISTER,
                &mut reg as *mut UffdioRegister
            ))?
        };
        Ok(())
    }

    /// `UFFDIO_UNREGISTER` of `[start, start+len)` (page-aligned): the
    /// kernel stops reporting its events and merges its VMAs back with
    /// their neighbours. Parts not registered with this descriptor are
    /// left as they are.
    pub fn unregister(&self, start: usize, len: usize) -> io::Result<()> {
        let mut range = UffdioRange {
            start: start as u64,
            len: len as u64,
        };
        // SAFETY: UFFDIO_UNREGISTER reads one `struct uffdio_range`; `range`
        // has that layout and outlives the call. The range is only
        // inspected by the kernel.
        unsafe {
            syscall!(ioctl(
                self.fd.as_raw_fd(),
                UFFDIO_UNREGISTER,
                &mut range as *mut UffdioRange
            ))?
        };
        Ok(())
    }

    /// True while a change of a range registered with this descriptor is
    /// in flight: the kernel counts such changes in the context's
    /// `mmap_changing` from the moment it prepares the event (under the
    /// mmap lock, *before* the old mapping disappears) until the changing
    /// thread saw its event read. The count is probed with a zero-length
    /// `UFFDIO_ZEROPAGE`, which fails with `EAGAIN` while it is non-zero
    /// (the kernel checks that before it even reads the arguments) and with
    /// `EINVAL` (empty range) otherwise; it never maps anything and takes no
    /// lock. `UffdMonitor::new` verifies this on the running kernel.
    /// Allocation-free.
    pub fn changes_in_flight(&self) -> io::Result<bool> {
        let mut zp = UffdioZeropage {
            range: UffdioRange { start: 0, len: 0 },
            mode: 0,
            zeropage: 0,
        };
        // SAFETY: UFFDIO_ZEROPAGE reads one `struct uffdio_zeropage` and may
        // write its last field; `zp` has that layout (size asserted) and
        // outlives the call. A zero-length range is rejected before any
        // memory is touched.
        match unsafe {
            syscall!(ioctl(
                self.fd.as_raw_fd(),
                UFFDIO_ZEROPAGE,
                &mut zp as *mut UffdioZeropage
            ))
        } {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
            Err(e) => Err(e),
            Ok(_) => Err(io::Error::other("zero-length UFFDIO_ZEROPAGE succeeded")),
        }
    }

    /// Reads as many pending messages as fit into `buf` without blocking;
    /// `Ok(0)` when none is pending. Allocation-free.
    pub fn read_events(&self, buf: &mut [UffdMsg]) -> io::Result<usize> {
        let bytes = std::mem::size_of_val(buf);
        // SAFETY: `buf` is a valid, writable slice of `bytes` bytes of plain
        // old data (any bit pattern is a valid UffdMsg).
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), bytes) };
        if n < 0 {
            let err = io::Error::last_os_error();
            return match err.kind() {
                io::ErrorKind::WouldBlock => Ok(0),
                _ => Err(err),
            };
        }
        Ok(n as usize / std::mem::size_of::<UffdMsg>())
    }

    /// The raw descriptor, for polling.
    pub fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// An [eventfd(2)] used to wake a thread sleeping in [`poll_readable`].
///
/// [eventfd(2)]: https://man7.org/linux/man-pages/man2/eventfd.2.html
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// Creates a non-blocking, close-on-exec eventfd.
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd takes two integers and returns a new descriptor or -1.
        let fd = unsafe { syscall!(eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK))? };
        // SAFETY: freshly returned descriptor, owned by nobody else.
        Ok(EventFd {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Adds one to the counter, waking pollers.
    pub fn signal(&self) -> io::Result<()> {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64, as eventfd requires.
        unsafe { syscall!(write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8))? };
        Ok(())
    }

    /// The raw descriptor, for polling.
    pub fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Blocks in [poll(2)] until `a` or `b` is readable, at most `timeout_ms`
/// milliseconds (-1: no limit); returns `(a_ready, b_ready)`. `EINTR` and
/// the timeout are reported as `(false, false)`.
///
/// [poll(2)]: https://man7.org/linux/man-pages/man2/poll.2.html
pub fn poll_readable(a: RawFd, b: RawFd, timeout_ms: libc::c_int) -> io::Result<(bool, bool)> {
    let mut fds = [
        libc::pollfd {
            fd: a,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: b,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: `fds` is a live array of two pollfd structs, its length is passed.
    match unsafe { syscall!(poll(fds.as_mut_ptr(), 2, timeout_ms)) } {
        Ok(_) => Ok((fds[0].revents != 0, fds[1].revents != 0)),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok((false, false)),
        Err(e) => Err(e),
    }
}
