//! An event counter ([eventfd(2)]): the one wrapper of its system calls
//! (create, 8-byte write, 8-byte read) for the whole workspace.
//!
//! Each user keeps its own rules as a thin layer on top: na-core's
//! [`Waker`](crate::Waker) creates it at 0, adds 1 to wake and reads it
//! back to 0; na-sm's peer wake-ups create it at 1, wake with a write of
//! 0 (which no peer can make block) and check one received from a peer
//! ([`EventFd::from_checked`]); na-perf's wake-up floor passes it to a
//! child and writes and reads counts.
//!
//! [eventfd(2)]: https://man7.org/linux/man-pages/man2/eventfd.2.html

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// What `/proc/self/fd/N` (the target of the link, [proc(5)]) names an
/// eventfd: how a descriptor received from elsewhere is told to be one.
///
/// [proc(5)]: https://man7.org/linux/man-pages/man5/proc.5.html
pub const PROC_LINK: &str = "anon_inode:[eventfd]";

/// An eventfd: a 64-bit counter behind a descriptor, readable while the
/// counter is not 0. Its flags and first value are the creator's
/// ([`EventFd::with_counter`]); the calls here add no rules of their own.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// [eventfd(2)] with a counter of `initval` and `flags`
    /// (`libc::EFD_NONBLOCK`, `libc::EFD_CLOEXEC`, `libc::EFD_SEMAPHORE`).
    ///
    /// [eventfd(2)]: https://man7.org/linux/man-pages/man2/eventfd.2.html
    pub fn with_counter(initval: u32, flags: libc::c_int) -> io::Result<Self> {
        // SAFETY: eventfd takes no pointers; a successful return is a fresh
        // descriptor owned by nobody else, so OwnedFd may take it.
        #[allow(unsafe_code)]
        let fd = unsafe { OwnedFd::from_raw_fd(crate::syscall!(eventfd(initval, flags))?) };
        Ok(EventFd { fd })
    }

    /// Wraps a descriptor the caller knows is an eventfd (one it created,
    /// or checked as na-perf checks an inherited one). Were it something
    /// else, [`write`](Self::write) and [`read`](Self::read) would move 8
    /// bytes through it (safe, but no counter).
    pub fn from_owned(fd: OwnedFd) -> Self {
        EventFd { fd }
    }

    /// Wraps a descriptor after checking that it really is an eventfd
    /// (`/proc/self/fd/N` names `anon_inode:[eventfd]`), e.g. one a peer
    /// passed, so it cannot make us write into a file or a pipe. Anything
    /// else is an `InvalidData` error, `descriptor is <what> (expected an
    /// eventfd)`, and the descriptor is closed.
    pub fn from_checked(fd: OwnedFd) -> io::Result<Self> {
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
        if link.as_os_str() != PROC_LINK {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("descriptor is {} (expected an eventfd)", link.display()),
            ));
        }
        Ok(EventFd { fd })
    }

    /// Adds `value` to the counter: [write(2)] of 8 bytes, which wakes the
    /// descriptor's pollers (even for 0). Where the sum would pass the
    /// maximum, 0xfffffffffffffffe, it blocks, or on a non-blocking
    /// descriptor fails with `EAGAIN` (`ErrorKind::WouldBlock`); whether
    /// that is an error is the caller's rule. Any failure is returned.
    ///
    /// [write(2)]: https://man7.org/linux/man-pages/man2/write.2.html
    #[inline]
    pub fn write(&self, value: u64) -> io::Result<()> {
        // SAFETY: a pointer to an 8-byte u64 that lives across the call,
        // and its exact size, as eventfd requires.
        #[allow(unsafe_code)]
        let r = unsafe { crate::syscall!(write(self.fd.as_raw_fd(), (&value as *const u64).cast(), 8)) };
        match r {
            Ok(8) => Ok(()),
            Ok(n) => Err(short("write", n)),
            Err(e) => {
                // Marked so that the success test comes first: na-sm's
                // wake-up (a write of 0) is on its busy path.
                crate::hint::cold_path();
                Err(e)
            }
        }
    }

    /// Reads the counter and resets it to 0 ([read(2)] of 8 bytes, or to
    /// `counter - 1` with `EFD_SEMAPHORE`): `Some(counter)`. An empty
    /// counter on a non-blocking descriptor (`EAGAIN`) is `Ok(None)`, no
    /// error; a blocking one waits for a write.
    ///
    /// [read(2)]: https://man7.org/linux/man-pages/man2/read.2.html
    pub fn read(&self) -> io::Result<Option<u64>> {
        let mut value: u64 = 0;
        // SAFETY: reads at most 8 bytes into the 8-byte u64, which lives
        // across the call.
        #[allow(unsafe_code)]
        let r = unsafe { crate::syscall!(read(self.fd.as_raw_fd(), (&mut value as *mut u64).cast(), 8)) };
        match r {
            Ok(8) => Ok(Some(value)),
            Ok(n) => Err(short("read", n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// A transfer of other than 8 bytes (the kernel moves all 8 or fails, so
/// this is only a guard).
#[cold]
fn short(op: &str, n: isize) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("eventfd {op} moved {n} of 8 bytes"),
    )
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLAGS: libc::c_int = libc::EFD_NONBLOCK | libc::EFD_CLOEXEC;

    /// The flags of the descriptor (`F_GETFD`) and of its description
    /// (`F_GETFL`), read through std (no unsafe here).
    fn cloexec_and_nonblock(e: &EventFd) -> (bool, bool) {
        let fdinfo = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", e.as_raw_fd())).unwrap();
        let flags = fdinfo
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .map(|v| i32::from_str_radix(v.trim(), 8).unwrap())
            .unwrap();
        (flags & libc::O_CLOEXEC != 0, flags & libc::O_NONBLOCK != 0)
    }

    #[test]
    fn a_counter_made_at_0_reads_empty_and_writes_add_up() {
        let e = EventFd::with_counter(0, FLAGS).unwrap();
        assert_eq!(
            e.read().unwrap(),
            None,
            "a new counter at 0 is EAGAIN: empty, no error"
        );
        e.write(1).unwrap();
        e.write(2).unwrap();
        e.write(0).unwrap();
        assert_eq!(e.read().unwrap(), Some(3), "writes add up, 0 adds nothing");
        assert_eq!(e.read().unwrap(), None, "a read empties it");
    }

    #[test]
    fn a_counter_made_at_1_is_readable_at_once() {
        let e = EventFd::with_counter(1, FLAGS).unwrap();
        assert_eq!(e.read().unwrap(), Some(1));
        assert_eq!(e.read().unwrap(), None);
    }

    #[test]
    fn the_creators_flags_are_kept() {
        let e = EventFd::with_counter(0, FLAGS).unwrap();
        assert_eq!(cloexec_and_nonblock(&e), (true, true));
        let inheritable = EventFd::with_counter(0, libc::EFD_NONBLOCK).unwrap();
        assert_eq!(cloexec_and_nonblock(&inheritable), (false, true));
    }

    #[test]
    fn a_write_past_the_maximum_is_eagain_on_a_non_blocking_counter() {
        let e = EventFd::with_counter(0, FLAGS).unwrap();
        e.write(u64::MAX - 1).unwrap();
        let err = e.write(1).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock, "{err}");
        e.write(0).unwrap();
        assert_eq!(e.read().unwrap(), Some(u64::MAX - 1));
    }

    #[test]
    fn a_write_of_u64_max_is_refused() {
        let e = EventFd::with_counter(0, FLAGS).unwrap();
        let err = e.write(u64::MAX).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL), "{err}");
    }

    #[test]
    fn from_checked_takes_an_eventfd_and_refuses_anything_else() {
        let e = EventFd::with_counter(0, FLAGS).unwrap();
        let copy = EventFd::from_checked(e.as_fd().try_clone_to_owned().unwrap()).unwrap();
        copy.write(5).unwrap();
        assert_eq!(e.read().unwrap(), Some(5), "one counter behind both descriptors");

        let file = OwnedFd::from(std::fs::File::open("/proc/self/stat").unwrap());
        let err = EventFd::from_checked(file).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("(expected an eventfd)"), "{err}");

        let (read_end, _write_end) = std::io::pipe().unwrap();
        let err = EventFd::from_checked(OwnedFd::from(read_end)).unwrap_err();
        assert!(err.to_string().starts_with("descriptor is pipe:["), "{err}");
    }

    #[test]
    fn from_owned_wraps_without_a_check() {
        let e = EventFd::with_counter(7, FLAGS).unwrap();
        let copy = EventFd::from_owned(e.as_fd().try_clone_to_owned().unwrap());
        assert_eq!(copy.read().unwrap(), Some(7));
    }
}
