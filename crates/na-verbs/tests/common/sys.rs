//! The raw system calls, memory copies and unsafe constructors the verbs
//! tests make on purpose: all their `unsafe` lives here, one small safe
//! wrapper each. The tests pass these functions only ranges they mapped
//! (or heap buffers they own) and access those only through them, by raw
//! copies, never through Rust references.
#![allow(unsafe_code, dead_code)]

use std::sync::Arc;

use na_verbs::sys::{IbvRegistrar, ProtectionDomain};

/// [`mmap(2)`](https://man7.org/linux/man-pages/man2/mmap.2.html): an
/// anonymous private read-write mapping of `len` bytes at `at`
/// (`MAP_FIXED_NOREPLACE`) or where the kernel chooses; the raw result
/// (`MAP_FAILED` on error, then see `errno`).
pub fn mmap_anon(at: Option<usize>, len: usize) -> *mut libc::c_void {
    let (addr, flags) = match at {
        Some(a) => (a as *mut libc::c_void, libc::MAP_FIXED_NOREPLACE),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: an anonymous private mapping; with MAP_FIXED_NOREPLACE the
    // kernel refuses (EEXIST) rather than replace anything mapped, so no
    // memory in use changes.
    unsafe {
        libc::mmap(
            addr,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
            -1,
            0,
        )
    }
}

/// [`munmap(2)`](https://man7.org/linux/man-pages/man2/munmap.2.html) of
/// `[addr, addr+len)`; the raw result (0, or -1 and `errno`).
pub fn munmap(addr: usize, len: usize) -> libc::c_int {
    // SAFETY: the tests unmap only mappings they made with `mmap_anon`,
    // into which no Rust reference points (see the module docs).
    unsafe { libc::munmap(addr as *mut libc::c_void, len) }
}

/// [`mremap(2)`](https://man7.org/linux/man-pages/man2/mremap.2.html)
/// with `MREMAP_MAYMOVE | MREMAP_FIXED`: moves the `len` bytes of pages at
/// `from` to `to`, replacing what is mapped there; the raw result (`to`,
/// or `MAP_FAILED`).
pub fn mremap_fixed(from: usize, len: usize, to: usize) -> *mut libc::c_void {
    // SAFETY: both ranges are the test's own mappings (see the module
    // docs); MREMAP_FIXED replaces only `to`, which the test mapped for it.
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

/// [`madvise(2)`](https://man7.org/linux/man-pages/man2/madvise.2.html)
/// `MADV_DONTNEED` of `[addr, addr+len)`: its private pages are dropped and
/// read as zeros afterwards; the raw result (0, or -1 and `errno`).
pub fn madvise_dontneed(addr: usize, len: usize) -> libc::c_int {
    // SAFETY: the range is the test's own memory (a mapping, or a heap
    // buffer of a handle), accessed only by raw copies: no Rust value
    // relies on its contents surviving.
    unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_DONTNEED) }
}

/// Sets the `len` bytes at `addr` to `byte` (a raw
/// [`memset(3)`](https://man7.org/linux/man-pages/man3/memset.3.html)).
pub fn fill(addr: usize, len: usize, byte: u8) {
    // SAFETY: [addr, addr+len) is mapped read-write by the test and only
    // accessed by raw copies (the `IbvRegistrar` contract).
    unsafe { std::ptr::write_bytes(addr as *mut u8, byte, len) }
}

/// Copies `bytes` to `addr` (a raw
/// [`memcpy(3)`](https://man7.org/linux/man-pages/man3/memcpy.3.html)).
pub fn write(addr: usize, bytes: &[u8]) {
    // SAFETY: as for `fill`; `bytes` is a Rust buffer, so it does not
    // overlap the test's mapping.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len()) }
}

/// The `len` bytes at `addr` (a raw
/// [`memcpy(3)`](https://man7.org/linux/man-pages/man3/memcpy.3.html)).
pub fn read(addr: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    // SAFETY: as for `fill`; `v` does not overlap the mapping.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, v.as_mut_ptr(), len) }
    v
}

/// An `ibv_reg_mr` registrar
/// ([`ibv_reg_mr(3)`](https://man7.org/linux/man-pages/man3/ibv_reg_mr.3.html))
/// on `pd`, for a cache that registers only the tests' own mappings.
pub fn ibv_registrar(pd: &Arc<ProtectionDomain>) -> IbvRegistrar {
    // SAFETY: `IbvRegistrar::new`'s contract: the tests give the cache
    // only ranges they mapped themselves and access them only by raw
    // copies (`fill`, `write`, `read`) while registered.
    unsafe { IbvRegistrar::new(pd) }
}
