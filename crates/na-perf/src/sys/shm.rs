//! A shared mapping of a memfd ([memfd_create(2)], [mmap(2)]), used for the
//! shared-memory floors. The parent creates it inheritable; the peer process
//! maps the inherited descriptor.
//!
//! [memfd_create(2)]: https://man7.org/linux/man-pages/man2/memfd_create.2.html
//! [mmap(2)]: https://man7.org/linux/man-pages/man2/mmap.2.html

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

/// Size of one flag slot: a cache line, so that flags never share one.
pub const SLOT: usize = 64;

/// A `MAP_SHARED` mapping of a whole memfd.
#[derive(Debug)]
pub struct SharedMap {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; every access goes
// through atomics or bounds-checked raw copies, so moving it to another
// thread is sound.
unsafe impl Send for SharedMap {}

impl SharedMap {
    /// Creates a memfd of `len` bytes and maps it. With `inheritable` the
    /// descriptor is not close-on-exec.
    pub fn create(len: usize, inheritable: bool) -> io::Result<Self> {
        let flags = if inheritable { 0 } else { libc::MFD_CLOEXEC };
        // SAFETY: the name is a valid NUL-terminated string; on success the
        // returned descriptor is new and owned by nobody else.
        let fd =
            unsafe { OwnedFd::from_raw_fd(na_core::syscall!(memfd_create(c"na-perf".as_ptr(), flags))?) };
        let size = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "mapping too large"))?;
        // SAFETY: ftruncate takes no pointers; fd is our open memfd.
        unsafe { na_core::syscall!(ftruncate(fd.as_raw_fd(), size))? };
        Self::map(fd, len)
    }

    /// Maps an existing memfd (e.g. one inherited from the parent) whole.
    pub fn from_owned(fd: OwnedFd) -> io::Result<Self> {
        // SAFETY: libc::stat is plain data; all-zero is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a writable stat struct for the duration of the call.
        unsafe { na_core::syscall!(fstat(fd.as_raw_fd(), &mut st))? };
        let len = usize::try_from(st.st_size)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "negative memfd size"))?;
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> io::Result<Self> {
        if len < SLOT {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "mapping smaller than one slot",
            ));
        }
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: a fresh mapping chosen by the kernel (addr = NULL) aliases
        // no Rust object; fd is an open memfd of at least `len` bytes.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        Ok(SharedMap { fd, ptr, len })
    }

    /// The memfd, to be inherited by a child.
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The 64-bit atomic at the start of cache-line slot `slot`.
    ///
    /// # Panics
    /// If the slot lies outside the mapping (a programming error: slots are
    /// constants of the floor protocol).
    pub fn flag(&self, slot: usize) -> &AtomicU64 {
        let off = slot * SLOT;
        assert!(off + SLOT <= self.len, "flag slot {slot} outside the mapping");
        // SAFETY: the offset is in bounds (asserted) and 64-byte aligned in a
        // page-aligned mapping, so suitably aligned for AtomicU64; the memory
        // lives as long as `self`, and both processes only touch it atomically.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU64>() }
    }

    /// Copies `src` into the mapping at `offset`.
    pub fn write_bytes(&self, offset: usize, src: &[u8]) -> io::Result<()> {
        self.check(offset, src.len())?;
        // SAFETY: the range is inside the mapping (checked); `src` is a
        // separate Rust slice, so the ranges do not overlap. The floor
        // protocol hands each data area to one process at a time through a
        // release/acquire flag, so nobody writes it concurrently.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` out of the mapping into `dst`.
    pub fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> io::Result<()> {
        self.check(offset, dst.len())?;
        // SAFETY: as in `write_bytes`, with the roles of the ranges swapped.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn check(&self, offset: usize, len: usize) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "range {offset}+{len} outside a shared mapping of {} bytes",
                    self.len
                ),
            )),
        }
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly the mapping created in `map`, and no
        // reference into it outlives `self` (flag borrows are tied to it).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
