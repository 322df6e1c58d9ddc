//! Memory facilities: the page size, a fork-detecting page
//! ([madvise(2)] `MADV_WIPEONFORK`) and `/proc/self/pagemap` reads
//! ([proc_pid_pagemap(5)]).
//!
//! [madvise(2)]: https://man7.org/linux/man-pages/man2/madvise.2.html
//! [proc_pid_pagemap(5)]: https://man7.org/linux/man-pages/man5/proc_pid_pagemap.5.html

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::OnceLock;

use super::syscall;

/// The system page size ([sysconf(3)] `_SC_PAGESIZE`), cached.
///
/// [sysconf(3)]: https://man7.org/linux/man-pages/man3/sysconf.3.html
pub fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no memory arguments.
        let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if v > 0 {
            v as usize
        } else {
            4096
        }
    })
}

/// [mmap(2)] of `len` fresh private anonymous bytes with protection `prot`.
///
/// [mmap(2)]: https://man7.org/linux/man-pages/man2/mmap.2.html
pub(crate) fn map_private_anon(len: usize, prot: libc::c_int) -> io::Result<*mut libc::c_void> {
    // SAFETY: a fresh anonymous private mapping; no existing memory is touched.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(ptr)
}

/// A private anonymous mapping owned by this value (unmapped on drop or by
/// [`Scratch::unmap`]); used by self-tests that need a range to change.
#[derive(Debug)]
pub struct Scratch {
    addr: usize,
    len: usize,
}

impl Scratch {
    /// Maps `len` bytes (rounded up to pages by the kernel) of fresh memory.
    pub fn new(len: usize) -> io::Result<Scratch> {
        let ptr = map_private_anon(len, libc::PROT_READ | libc::PROT_WRITE)?;
        Ok(Scratch {
            addr: ptr as usize,
            len,
        })
    }

    /// Start address of the mapping.
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Unmaps the range now, reporting failure.
    pub fn unmap(self) -> io::Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: the mapping was created in `new` and is owned by `self`,
        // which is consumed (no drop runs afterwards); nothing else refers to it.
        unsafe { syscall!(munmap(this.addr as *mut libc::c_void, this.len)) }.map(drop)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping created in `new`, owned by `self`.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

/// Value written into the guard page; a forked child sees zero instead.
const ALIVE: u64 = 0x5153_5f52_4547_4341; // "QS_REGCA"

/// One anonymous page marked `MADV_WIPEONFORK`: it reads as zero in any child
/// created by `fork()`, so one atomic load tells the creating process from a
/// forked child without a `getpid()` system call.
#[derive(Debug)]
pub struct ForkGuard {
    page: NonNull<AtomicU64>,
}

// SAFETY: the page is only accessed through an AtomicU64, which is Sync.
unsafe impl Send for ForkGuard {}
// SAFETY: as above.
unsafe impl Sync for ForkGuard {}

/// Maps a guard page, marked `MADV_WIPEONFORK` and holding [`ALIVE`]. The
/// caller owns the mapping (one page).
fn map_guard_page() -> io::Result<NonNull<AtomicU64>> {
    let len = page_size();
    let ptr = map_private_anon(len, libc::PROT_READ | libc::PROT_WRITE)?;
    // SAFETY: `ptr` is the page-aligned, writable mapping created above.
    if let Err(e) = unsafe { syscall!(madvise(ptr, len, libc::MADV_WIPEONFORK)) } {
        // SAFETY: unmapping the mapping we just created and nobody else uses.
        unsafe { libc::munmap(ptr, len) };
        return Err(e);
    }
    let page = NonNull::new(ptr.cast::<AtomicU64>()).ok_or_else(io::Error::last_os_error)?;
    // SAFETY: the page is mapped, writable and aligned for u64; the caller
    // owns it from here.
    unsafe { page.as_ref() }.store(ALIVE, Ordering::Release);
    Ok(page)
}

/// A process-wide [`ForkGuard`] made on first need and never unmapped,
/// published through an atomic pointer: no lock or `Once` that a forked
/// child could inherit in the middle of its initialization (and wait on).
pub struct StaticForkGuard {
    page: AtomicPtr<AtomicU64>,
}

impl StaticForkGuard {
    /// No guard yet.
    pub const fn new() -> StaticForkGuard {
        StaticForkGuard {
            page: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// Makes the guard unless it exists (the loser of a race unmaps its
    /// page).
    pub fn init(&self) -> io::Result<()> {
        if !self.page.load(Ordering::Acquire).is_null() {
            return Ok(());
        }
        let page = map_guard_page()?;
        if self
            .page
            .compare_exchange(
                std::ptr::null_mut(),
                page.as_ptr(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            // SAFETY: our own page, never published: nothing refers to it.
            unsafe { libc::munmap(page.as_ptr().cast(), page_size()) };
        }
        Ok(())
    }

    /// `None` before [`init`](Self::init); then true in the process that
    /// made it, false in a forked child.
    #[inline]
    pub fn in_creator(&self) -> Option<bool> {
        let p = self.page.load(Ordering::Acquire);
        // SAFETY: a published page is never unmapped (a child inherits the
        // mapping, zeroed), and it holds an AtomicU64 at its start.
        (!p.is_null()).then(|| unsafe { &*p }.load(Ordering::Relaxed) == ALIVE)
    }
}

impl ForkGuard {
    /// Maps the guard page.
    pub fn new() -> io::Result<ForkGuard> {
        Ok(ForkGuard {
            page: map_guard_page()?,
        })
    }

    /// True in the process that created the guard, false in a forked child.
    #[inline]
    pub fn in_creator(&self) -> bool {
        // SAFETY: the page stays mapped for the guard's lifetime (in a child
        // too: WIPEONFORK zeroes it, it does not unmap it).
        unsafe { self.page.as_ref() }.load(Ordering::Relaxed) == ALIVE
    }
}

impl Drop for ForkGuard {
    fn drop(&mut self) {
        // SAFETY: unmapping the page mapped in `new`; no reference outlives self.
        unsafe { libc::munmap(self.page.as_ptr().cast(), page_size()) };
    }
}

/// A reader of `/proc/self/pagemap`: page frame numbers need CAP_SYS_ADMIN.
#[derive(Debug)]
pub struct Pagemap {
    file: File,
}

impl Pagemap {
    /// Opens `/proc/self/pagemap`.
    pub fn open() -> io::Result<Pagemap> {
        Ok(Pagemap {
            file: File::open("/proc/self/pagemap")?,
        })
    }

    /// The page frame number behind `addr`, `None` when the page is not
    /// present or the kernel hides frame numbers (not root).
    pub fn pfn(&self, addr: usize) -> io::Result<Option<u64>> {
        let mut word = [0u8; 8];
        let offset = (addr / page_size()) as u64 * 8;
        self.file.read_exact_at(&mut word, offset)?;
        let entry = u64::from_ne_bytes(word);
        let present = entry & (1 << 63) != 0;
        let pfn = entry & ((1 << 55) - 1);
        Ok((present && pfn != 0).then_some(pfn))
    }
}
