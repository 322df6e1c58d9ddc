//! [mmap(2)], [munmap(2)], [mremap(2)], [madvise(2)] and [mincore(2)]
//! of the scenarios' own ranges.
//!
//! [mmap(2)]: https://man7.org/linux/man-pages/man2/mmap.2.html
//! [munmap(2)]: https://man7.org/linux/man-pages/man2/munmap.2.html
//! [mremap(2)]: https://man7.org/linux/man-pages/man2/mremap.2.html
//! [madvise(2)]: https://man7.org/linux/man-pages/man2/madvise.2.html
//! [mincore(2)]: https://man7.org/linux/man-pages/man2/mincore.2.html

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use super::{check, PAGE};

/// Anonymous private mapping of `len` bytes, at `at` if given
/// (`MAP_FIXED_NOREPLACE`: fails instead of clobbering).
pub fn map_anon(at: Option<usize>, len: usize) -> io::Result<usize> {
    let (hint, extra) = match at {
        Some(a) => (a as *mut libc::c_void, libc::MAP_FIXED_NOREPLACE),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; a null
    // hint lets the kernel choose. No Rust object is affected.
    let p = unsafe {
        libc::mmap(
            hint,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra,
            -1,
            0,
        )
    };
    let got = check(p).inspect_err(|_| {
        if let Some(a) = at {
            dump_maps_near(a);
        }
    })?;
    if at.is_some_and(|a| a != got) {
        unmap(got, len)?;
        return Err(io::Error::from(io::ErrorKind::AddrInUse));
    }
    Ok(got)
}

/// Prints the /proc/self/maps lines around `addr` (diagnostics for EEXIST).
pub fn dump_maps_near(addr: usize) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    for line in maps.lines() {
        let range = line.split_whitespace().next().unwrap_or("");
        let mut it = range
            .split('-')
            .map(|h| usize::from_str_radix(h, 16).unwrap_or(0));
        let (s, e) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
        if s < addr + (1 << 20) && e + (1 << 20) > addr {
            eprintln!("maps near {addr:#x}: {line}");
        }
    }
}

/// Anonymous 2 MiB hugetlbfs mapping, at `at` if given (`MAP_FIXED_NOREPLACE`).
pub fn map_hugetlb(at: Option<usize>, len: usize) -> io::Result<usize> {
    let (hint, extra) = match at {
        Some(a) => (a as *mut libc::c_void, libc::MAP_FIXED_NOREPLACE),
        None => (std::ptr::null_mut(), 0),
    };
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_HUGE_2MB | extra;
    // SAFETY: as map_anon; huge pages come from the reserved pool.
    let p = unsafe { libc::mmap(hint, len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
    let got = check(p)?;
    if at.is_some_and(|a| a != got) {
        unmap(got, len)?;
        return Err(io::Error::from(io::ErrorKind::AddrInUse));
    }
    Ok(got)
}

/// `MAP_FIXED` anonymous mapping over whatever is at `at` (the overlay scenario).
pub fn map_anon_overlay(at: usize, len: usize) -> io::Result<usize> {
    // SAFETY: `at` is a mapping the scenario owns; no Rust reference points into it.
    let p = unsafe {
        libc::mmap(
            at as *mut _,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    check(p)
}

/// Shared mapping of `fd` (a memfd), at `at` if given (`MAP_FIXED_NOREPLACE`).
pub fn map_shared_fd(at: Option<usize>, len: usize, fd: &OwnedFd) -> io::Result<usize> {
    let (hint, extra) = match at {
        Some(a) => (a as *mut libc::c_void, libc::MAP_FIXED_NOREPLACE),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: as map_anon; the descriptor is valid for the call.
    let p = unsafe {
        libc::mmap(
            hint,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | extra,
            fd.as_raw_fd(),
            0,
        )
    };
    let got = check(p)?;
    if at.is_some_and(|a| a != got) {
        unmap(got, len)?;
        return Err(io::Error::from(io::ErrorKind::AddrInUse));
    }
    Ok(got)
}

/// Private (copy-on-write) mapping of `fd` (a memfd) from offset 0.
pub fn map_private_fd(len: usize, fd: &OwnedFd) -> io::Result<usize> {
    // SAFETY: a fresh mapping chosen by the kernel; the descriptor is
    // valid for the call.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE,
            fd.as_raw_fd(),
            0,
        )
    };
    check(p)
}

/// Shared mapping of `fd` (from offset 0) over whatever is at `at`
/// (`MAP_FIXED`).
pub fn map_shared_fd_fixed(at: usize, len: usize, fd: &OwnedFd) -> io::Result<usize> {
    // SAFETY: `at` is a mapping the caller owns and replaces on purpose;
    // no Rust reference points into it.
    let p = unsafe {
        libc::mmap(
            at as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
            0,
        )
    };
    check(p)
}

/// munmap(2) of a range the scenario owns.
pub fn unmap(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the scenario owns the range and holds no Rust reference into it.
    if unsafe { libc::munmap(addr as *mut _, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// mremap(2) moving `[from, from+len)` to `to` (MREMAP_MAYMOVE|MREMAP_FIXED).
pub fn remap_to(from: usize, len: usize, to: usize) -> io::Result<usize> {
    // SAFETY: both ranges belong to the scenario; `to` is replaced on purpose.
    let p = unsafe {
        libc::mremap(
            from as *mut _,
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            to as *mut libc::c_void,
        )
    };
    check(p)
}

/// madvise(2) on a range the scenario owns.
pub fn advise(addr: usize, len: usize, advice: libc::c_int) -> io::Result<()> {
    // SAFETY: the scenario owns the range; the advice may drop its contents,
    // which no Rust reference observes.
    if unsafe { libc::madvise(addr as *mut _, len, advice) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Like [`map_anon`] at `at` (`MAP_FIXED_NOREPLACE`), without the
/// diagnostics: for callers that poll until the range is free.
pub fn try_map_anon_at(at: usize, len: usize) -> io::Result<usize> {
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping.
    let p = unsafe {
        libc::mmap(
            at as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    let got = check(p)?;
    if got != at {
        unmap(got, len)?;
        return Err(io::Error::from(io::ErrorKind::AddrInUse));
    }
    Ok(got)
}

/// [`mincore(2)`](https://man7.org/linux/man-pages/man2/mincore.2.html) of
/// the page at `addr`: true while it is mapped (the call fails with
/// `ENOMEM` on an unmapped address).
pub fn page_mapped(addr: usize) -> bool {
    let mut v = [0u8; 1];
    // SAFETY: mincore writes one byte per page of the range, here one page
    // into a one-byte buffer; it reads no memory of the range.
    unsafe { libc::mincore(addr as *mut libc::c_void, PAGE, v.as_mut_ptr()) == 0 }
}

/// [`mremap(2)`](https://man7.org/linux/man-pages/man2/mremap.2.html)
/// like [`remap_to`], returning the raw result (`to`, or `MAP_FAILED`).
pub fn mremap_fixed(from: usize, len: usize, to: usize) -> *mut libc::c_void {
    // SAFETY: both ranges belong to the test (`to` freed or its own);
    // what is mapped at `to` is replaced on purpose, and no Rust reference
    // points into either range.
    unsafe {
        libc::mremap(
            from as *mut libc::c_void,
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            to as *mut libc::c_void,
        )
    }
}
