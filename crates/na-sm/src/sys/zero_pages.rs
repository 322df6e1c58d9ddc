//! Tests only: a huge read-only mapping of zero pages ([mmap(2)] with
//! `MAP_NORESERVE`), to build message parts whose lengths add up past
//! `usize::MAX` (many aliases of one huge region) without memory behind
//! them: no page is touched unless read.
//!
//! [mmap(2)]: https://man7.org/linux/man-pages/man2/mmap.2.html

use std::io;
use std::ptr::NonNull;

/// A private, anonymous, read-only mapping; unmapped on drop.
pub struct ZeroPages {
    ptr: NonNull<u8>,
    len: usize,
}

impl ZeroPages {
    /// Maps `len` bytes (address space only: `PROT_READ`, `MAP_NORESERVE`).
    pub fn map(len: usize) -> io::Result<Self> {
        // SAFETY: a fresh anonymous mapping chosen by the kernel (addr NULL);
        // no file, no pointer of ours is handed over.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::from(io::ErrorKind::Other))?;
        Ok(ZeroPages { ptr, len })
    }

    /// All its bytes (zeros, read from the kernel's zero page if read).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes from `ptr` are mapped readable for as long as
        // `self` lives (unmapped only in drop), never written, and `len` is
        // at most isize::MAX (mmap cannot map more).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for ZeroPages {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; no slice of it
        // outlives `self` (`bytes` borrows it).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
