//! Sealed anonymous shared memory: [memfd_create(2)] + [ftruncate(2)] +
//! `F_ADD_SEALS` ([fcntl(2)]) + [mmap(2)].
//!
//! The region of a connection is a sealed memfd: it has no name, so a crash
//! leaves nothing behind, and its size is sealed (`F_SEAL_SHRINK |
//! F_SEAL_GROW`), so the peer that created it cannot truncate it under our
//! mapping and kill us with `SIGBUS`.
//!
//! A peer writes the mapping concurrently, so this type never hands out a
//! `&[u8]` into it: bytes move by volatile copies, words by atomics.
//!
//! [memfd_create(2)]: https://man7.org/linux/man-pages/man2/memfd_create.2.html
//! [ftruncate(2)]: https://man7.org/linux/man-pages/man2/ftruncate.2.html
//! [fcntl(2)]: https://man7.org/linux/man-pages/man2/fcntl.2.html
//! [mmap(2)]: https://man7.org/linux/man-pages/man2/mmap.2.html

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A shared mapping of a sealed memfd.
#[derive(Debug)]
pub struct SharedRegion {
    /// The mapping's address and size, copied from `mapping` so that an
    /// access costs no extra indirection.
    ptr: NonNull<u8>,
    len: usize,
    /// The memfd, until it was sent to the peer (the mapping does not need
    /// it: closing it saves a descriptor per connection).
    fd: Option<OwnedFd>,
    /// Unmaps the region once neither it nor any [`SharedWord`] of it is left.
    mapping: Arc<Mapping>,
}

// SAFETY: the mapping is plain memory owned by this value; every access goes
// through atomics or volatile copies, which are valid from any thread.
unsafe impl Send for SharedRegion {}

/// Ownership of a mapping: unmaps it when dropped. It offers no access.
#[derive(Debug)]
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a Mapping only remembers an address range, to unmap it once in
// `drop`; it gives no access to the memory, so sharing or sending it
// between threads cannot race on anything.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly the mapping made in `SharedRegion::map`,
        // and this is its only owner: every region and word of it is gone.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// One 64-bit word of a region that keeps the mapping alive on its own:
/// what a watcher of many rings holds to load their heads directly,
/// without going through each connection to find its region.
#[derive(Debug)]
pub struct SharedWord {
    word: NonNull<AtomicU64>,
    mapping: Arc<Mapping>,
}

// SAFETY: the word is only ever loaded atomically, which is valid from any
// thread, and the mapping it points into lives as long as `mapping`.
unsafe impl Send for SharedWord {}

impl SharedWord {
    /// Loads the word.
    #[inline]
    pub fn load(&self, order: Ordering) -> u64 {
        // SAFETY: `word` was checked to be in bounds and 8-aligned when it
        // was set (`SharedRegion::word`, `point_at`), and `mapping` keeps
        // the memory mapped.
        unsafe { self.word.as_ref() }.load(order)
    }

    /// Points this handle at the word at `offset` of `region` instead.
    ///
    /// # Panics
    /// As [`SharedRegion::atomic`].
    pub fn point_at(&mut self, region: &SharedRegion, offset: usize) {
        self.word = NonNull::from(region.atomic(offset));
        if !Arc::ptr_eq(&self.mapping, &region.mapping) {
            self.mapping = region.mapping.clone();
        }
    }
}

impl SharedRegion {
    /// Creates a zero-filled, sealed region of `len` bytes (a multiple of the
    /// page size) and maps it read-write.
    pub fn create(name: &str, len: usize) -> io::Result<Self> {
        let cname = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: `cname` is a valid NUL-terminated string for the call; a
        // successful return is a fresh descriptor that OwnedFd may own.
        let fd = unsafe {
            let fd = super::syscall!(memfd_create(
                cname.as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING
            ))?;
            OwnedFd::from_raw_fd(fd)
        };
        let size = libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: integer arguments only; the kernel checks the descriptor.
        unsafe {
            super::syscall!(ftruncate(fd.as_raw_fd(), size))?;
            super::syscall!(fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS))?;
        }
        Self::map(fd, len)
    }

    /// Maps a region received from a peer, after checking that its size is
    /// sealed and is exactly `len` bytes.
    pub fn from_peer(fd: OwnedFd, len: usize) -> io::Result<Self> {
        // SAFETY: F_GET_SEALS takes no pointer argument.
        let seals = unsafe { super::syscall!(fcntl(fd.as_raw_fd(), libc::F_GET_SEALS))? };
        let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals & need != need {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("shared region is not size-sealed (seals {seals:#x})"),
            ));
        }
        let size = std::fs::File::from(fd.try_clone()?).metadata()?.len();
        if size != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("shared region has {size} bytes, expected {len}"),
            ));
        }
        let mut region = Self::map(fd, len)?;
        region.fd = None;
        Ok(region)
    }

    fn map(fd: OwnedFd, len: usize) -> io::Result<Self> {
        // At least one word: `atomic`'s bound check (`offset <= len - 8`)
        // relies on it.
        if len < 8 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("shared region of {len} bytes: at least 8 needed"),
            ));
        }
        // SAFETY: a fresh shared mapping chosen by the kernel (addr NULL) of
        // `len` bytes of a file at least that long (sized or checked above).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::from(io::ErrorKind::Other))?;
        Ok(SharedRegion {
            ptr,
            len,
            fd: Some(fd),
            mapping: Arc::new(Mapping { ptr, len }),
        })
    }

    #[cfg(any(test, feature = "test-hooks"))]
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    #[cfg(any(test, feature = "test-hooks"))]
    /// True if the region is empty (never, for a mapped region).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A handle on the 64-bit word at `offset` that keeps the mapping
    /// alive by itself (see [`SharedWord`]).
    ///
    /// # Panics
    /// As [`atomic`](Self::atomic).
    pub fn word(&self, offset: usize) -> SharedWord {
        SharedWord {
            word: NonNull::from(self.atomic(offset)),
            mapping: self.mapping.clone(),
        }
    }

    /// The 64-bit atomic at `offset`.
    ///
    /// # Panics
    /// If `offset` is not 8-aligned or out of bounds (offsets are layout
    /// constants, never peer data).
    pub fn atomic(&self, offset: usize) -> &AtomicU64 {
        // Compared without adding to `offset`: one near `usize::MAX` must
        // not wrap to a small end and pass (in a release build, where `+`
        // wraps); `len - 8` cannot wrap (`map` refuses a region under 8
        // bytes). (`checked_add` here cost ~25 instructions per busy
        // round trip: scripts/busy-path-cost.sh.)
        assert!(
            offset.is_multiple_of(8) && offset <= self.len - 8,
            "bad atomic offset {offset}"
        );
        // SAFETY: in bounds and 8-aligned (the mapping is page-aligned); the
        // memory lives as long as &self, and AtomicU64 permits concurrent
        // access from the peer process.
        unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU64>() }
    }

    /// Replaces the contents of `dst` with `len` bytes of the region at
    /// `offset` (8-aligned), without first zero-filling `dst` as
    /// `resize` and a copy would.
    ///
    /// # Panics
    /// If the range is out of bounds (callers validate peer lengths first).
    #[inline]
    pub fn read_to_vec(&self, offset: usize, len: usize, dst: &mut Vec<u8>) {
        assert!(offset.is_multiple_of(8) && offset <= self.len && len <= self.len - offset);
        dst.clear();
        dst.reserve(len);
        let words = len / 8;
        // SAFETY: the source range is inside the mapping (checked above) and
        // 8-aligned, and volatile reads tolerate concurrent writes by the
        // peer. `reserve` made room for `len` bytes, every one of which is
        // written below before `set_len` exposes them.
        unsafe {
            let src = self.ptr.as_ptr().add(offset);
            let out = dst.as_mut_ptr();
            for i in 0..words {
                let w = std::ptr::read_volatile(src.cast::<u64>().add(i));
                std::ptr::write_unaligned(out.cast::<u64>().add(i), w);
            }
            for i in words * 8..len {
                *out.add(i) = std::ptr::read_volatile(src.add(i));
            }
            dst.set_len(len);
        }
    }

    /// Copies `src` into the region at `offset` (any alignment: bytes up
    /// to the first 8-aligned offset go one by one, then whole words).
    ///
    /// # Panics
    /// If the range is out of bounds.
    #[inline(always)]
    pub fn write(&self, offset: usize, src: &[u8]) {
        assert!(offset <= self.len && src.len() <= self.len - offset);
        // Ring slots and buffers start 8-aligned, and so does an RPC's
        // payload after its 32-byte header: the unaligned start is out of
        // line.
        if !offset.is_multiple_of(8) {
            na_core::hint::cold_path();
            // SAFETY: the range is inside the mapping (checked above).
            return unsafe { self.write_unaligned_start(offset, src) };
        }
        // SAFETY: the destination range is inside the mapping (checked
        // above), and `offset` is 8-aligned (the mapping is page-aligned).
        unsafe { self.write_aligned(offset, src) }
    }

    /// [`write`](Self::write) from an offset that is not 8-aligned: the
    /// bytes up to the first 8-aligned offset one by one, then the rest.
    ///
    /// # Safety
    /// `offset + src.len()` is within the mapping.
    #[inline(never)]
    unsafe fn write_unaligned_start(&self, offset: usize, src: &[u8]) {
        debug_assert!(offset <= self.len && src.len() <= self.len - offset);
        let head = offset.next_multiple_of(8).saturating_sub(offset).min(src.len());
        // SAFETY: the destination range is inside the mapping (the
        // caller's contract), and so are its first `head` bytes; volatile
        // writes never create references into memory the peer writes.
        unsafe {
            let dst = self.ptr.as_ptr().add(offset);
            for (i, b) in src[..head].iter().enumerate() {
                std::ptr::write_volatile(dst.add(i), *b);
            }
        }
        if head < src.len() {
            // SAFETY: `offset + head` is 8-aligned here (`head` reached
            // the next multiple of 8, since bytes remain), and in range.
            unsafe { self.write_aligned(offset + head, &src[head..]) }
        }
    }

    /// Copies `src` to the 8-aligned `offset`: whole words, then the tail
    /// bytes.
    ///
    /// # Safety
    /// `offset` is 8-aligned and `offset + src.len()` is within the
    /// mapping.
    #[inline(always)]
    unsafe fn write_aligned(&self, offset: usize, src: &[u8]) {
        let words = src.len() / 8;
        // SAFETY: the caller's contract: the range is inside the mapping
        // and starts 8-aligned, so the word writes are aligned; volatile
        // writes never create references into memory the peer writes.
        // The word reads stay in `src`: word `i < words` ends at
        // `8 * (i + 1) <= src.len()`.
        unsafe {
            let dst = self.ptr.as_ptr().add(offset);
            for i in 0..words {
                let w = std::ptr::read_unaligned(src.as_ptr().cast::<u64>().add(i));
                std::ptr::write_volatile(dst.cast::<u64>().add(i), w);
            }
            let tail = words * 8;
            for (i, b) in src[tail..].iter().enumerate() {
                std::ptr::write_volatile(dst.add(tail + i), *b);
            }
        }
    }
}

impl SharedRegion {
    /// The memfd of a region we created, until [`close_fd`](Self::close_fd).
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// Closes the memfd (once it was sent to the peer); the mapping stays.
    pub fn close_fd(&mut self) {
        self.fd = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_share_and_reject_bad_size() {
        let a = SharedRegion::create("qs-test", 8192).unwrap();
        a.atomic(8).store(42, Ordering::Relaxed);
        a.write(4096, b"hello world");
        let b = SharedRegion::from_peer(a.fd.as_ref().unwrap().try_clone().unwrap(), 8192).unwrap();
        assert_eq!(b.atomic(8).load(Ordering::Relaxed), 42);
        let mut out = vec![7u8; 100];
        b.read_to_vec(4096, 11, &mut out);
        assert_eq!(out, b"hello world");
        for len in 0..=11 {
            b.read_to_vec(4096, len, &mut out);
            assert_eq!(out, b"hello world"[..len]);
        }
        assert!(SharedRegion::from_peer(a.fd.as_ref().unwrap().try_clone().unwrap(), 4096).is_err());
        // An unsealed memfd is refused.
        // SAFETY (test): valid NUL-terminated name.
        let raw = unsafe { libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY (test): fresh descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        assert!(SharedRegion::from_peer(fd, 0).is_err());
    }

    #[test]
    fn writes_land_whole_at_every_alignment_and_length() {
        // Aligned starts take the word path, the others the byte-by-byte
        // head first (out of line): every byte must land, and none beside.
        let a = SharedRegion::create("qs-test-write", 4096).unwrap();
        let src: Vec<u8> = (1..=40).collect();
        let mut out = Vec::new();
        for start in 1024..1024 + 9 {
            for len in 0..=src.len() {
                a.write(1000, &[0xAA; 96]);
                a.write(start, &src[..len]);
                a.read_to_vec(1000, 96, &mut out);
                let at = start - 1000;
                assert!(
                    out[..at].iter().all(|&b| b == 0xAA),
                    "before, start {start} len {len}"
                );
                assert_eq!(&out[at..at + len], &src[..len], "start {start} len {len}");
                assert!(
                    out[at + len..].iter().all(|&b| b == 0xAA),
                    "after, start {start} len {len}"
                );
            }
        }
    }

    #[test]
    fn a_word_keeps_its_mapping_alive_and_can_move() {
        let a = SharedRegion::create("qs-test-word-a", 4096).unwrap();
        let b = SharedRegion::create("qs-test-word-b", 4096).unwrap();
        a.atomic(64).store(7, Ordering::Relaxed);
        b.atomic(128).store(9, Ordering::Relaxed);
        let mut w = a.word(64);
        assert_eq!(w.load(Ordering::Acquire), 7);
        a.atomic(64).store(8, Ordering::Release);
        assert_eq!(
            w.load(Ordering::Acquire),
            8,
            "the word is the region's, not a copy"
        );
        drop(a);
        // Still mapped: the word holds the mapping.
        assert_eq!(w.load(Ordering::Acquire), 8);
        w.point_at(&b, 128);
        assert_eq!(w.load(Ordering::Acquire), 9);
        // Out of bounds or unaligned offsets are refused, as for `atomic`.
        for bad in [4096, 4090, 12] {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| b.word(bad)));
            assert!(r.is_err(), "offset {bad}");
        }
    }

    #[test]
    fn a_region_under_one_word_is_refused() {
        // `atomic`'s check (`offset <= len - 8`) relies on it.
        for len in [1, 7] {
            let Err(e) = SharedRegion::create("qs-test-tiny", len) else {
                panic!("a region of {len} bytes was mapped");
            };
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        }
        assert!(SharedRegion::create("qs-test-word", 8).is_ok());
    }

    #[test]
    fn an_offset_whose_end_wraps_is_refused_by_the_bounds_check() {
        // `usize::MAX - 7` is 8-aligned and its end wraps to 0: the check
        // itself must refuse it (before, a release build's `offset + 8`
        // wrapped and passed, and a debug build panicked on the overflow
        // instead of the bounds message).
        let r = SharedRegion::create("qs-test-wrap", 4096).unwrap();
        for bad in [usize::MAX - 7, usize::MAX - 15, usize::MAX - 4095] {
            let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                r.atomic(bad);
            }))
            .expect_err("a wrapping offset was accepted");
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            assert!(msg.contains("bad atomic offset"), "offset {bad}: {msg}");
        }
        // The last word is still in bounds.
        r.atomic(4088).store(1, Ordering::Relaxed);
    }

    #[test]
    fn writes_at_any_offset_touch_exactly_their_bytes() {
        let r = SharedRegion::create("qs-test-write", 4096).unwrap();
        let src: Vec<u8> = (0..40u8).map(|i| i.wrapping_mul(37) | 1).collect();
        let mut out = Vec::new();
        for start in 0..8 {
            for len in 0..=src.len() {
                // Clear a window around the write, write, and read it all back.
                r.write(64, &[0; 64]);
                r.write(64 + start, &src[..len]);
                r.read_to_vec(64, 64, &mut out);
                let mut want = vec![0u8; 64];
                want[start..start + len].copy_from_slice(&src[..len]);
                assert_eq!(out, want, "write of {len} bytes at offset 64+{start}");
            }
        }
        r.write(4096 - 3, b"end");
        r.read_to_vec(4088, 8, &mut out);
        assert_eq!(&out[5..], b"end");
    }
}
