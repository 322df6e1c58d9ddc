//! Owned memory that the kernel (or a NIC, or a peer through CMA) may read or
//! write behind Rust's back.
//!
//! A [`RawSegment`] takes a `Vec<u8>` apart into pointer, length and
//! capacity and never hands out a reference into it: local access is by
//! copying, so a concurrent write by a peer can never alias a live
//! `&[u8]`/`&mut [u8]`. The vector is rebuilt on drop or by
//! [`RawSegment::into_vec`].
//!
//! Clones of a memory handle may be used from several threads at once, so
//! the copies are atomic (relaxed) accesses, never plain ones: two threads
//! writing the same bytes race, as they would on any shared memory, but
//! that is not undefined behaviour. Each byte is always accessed with the
//! same width (the language forbids racing accesses of different sizes):
//! as part of its aligned 8-byte word when that word lies wholly inside
//! the segment, on its own otherwise. Copies of partial words read the
//! word, or update it with a compare-exchange loop.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};

/// A heap buffer whose contents may change at any time through RMA.
pub struct RawSegment {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: a RawSegment uniquely owns its allocation (it came from a Vec that
// was consumed), and every access from this process is atomic (see the
// module docs), so threads sharing it cannot make a data race; writes by
// RMA (kernel or device) are outside the language, as with DMA.
#[allow(unsafe_code)]
unsafe impl Send for RawSegment {}
// SAFETY: as above; shared access only reads or writes through atomics.
#[allow(unsafe_code)]
unsafe impl Sync for RawSegment {}

impl RawSegment {
    /// Takes ownership of `v`.
    pub fn from_vec(v: Vec<u8>) -> Self {
        let mut v = std::mem::ManuallyDrop::new(v);
        let len = v.len();
        let cap = v.capacity();
        // `Vec::as_mut_ptr` is never null (dangling but aligned when cap == 0).
        let ptr = NonNull::new(v.as_mut_ptr()).unwrap_or(NonNull::dangling());
        RawSegment { ptr, len, cap }
    }

    /// Start address, as the kernel or a NIC sees it.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if the segment holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The segment's bytes as a [`SharedBytes`] view.
    fn bytes(&self) -> SharedBytes {
        SharedBytes {
            ptr: self.ptr,
            len: self.len,
        }
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the segment.
    ///
    /// # Panics
    /// If the range is out of bounds (callers check bounds first).
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        self.bytes().read(offset, dst);
    }

    /// Copies `src` into the segment at `offset`.
    ///
    /// # Panics
    /// If the range is out of bounds (callers check bounds first).
    pub fn write(&self, offset: usize, src: &[u8]) {
        self.bytes().write(offset, src);
    }

    /// Gives the vector back.
    pub fn into_vec(self) -> Vec<u8> {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: ptr, len and cap came from a Vec<u8> that we consumed in
        // `from_vec`, and `me` will not be dropped, so the allocation is
        // rebuilt exactly once.
        #[allow(unsafe_code)]
        unsafe {
            Vec::from_raw_parts(me.ptr.as_ptr(), me.len, me.cap)
        }
    }
}

/// Memory that others (the kernel, a NIC, a peer through CMA, other
/// threads) may read or write while we do, copied in and out the way the
/// module docs say: every access atomic, each byte always with the same
/// width. [`RawSegment`] uses it for its buffer; other owners of such
/// memory (a registered RDMA region) make one with [`SharedBytes::new`].
#[derive(Clone, Copy, Debug)]
pub struct SharedBytes {
    ptr: NonNull<u8>,
    len: usize,
}

impl SharedBytes {
    /// A view of `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be allocated, initialized and live for as
    /// long as the view is used, and every access to it from this
    /// process must go through such views (never a Rust reference), so
    /// that all of them are atomic and of the same width per byte. Views
    /// that overlap must agree on which bytes are whole words: each must
    /// start and end on an 8-byte boundary, or all of them must have the
    /// same `ptr` and `len`. (A view's bytes outside its whole 8-aligned
    /// words are copied one by one, so a byte at the ragged end of one
    /// view and inside a whole word of another would be accessed with two
    /// widths.)
    #[allow(unsafe_code)]
    pub unsafe fn new(ptr: NonNull<u8>, len: usize) -> Self {
        SharedBytes { ptr, len }
    }

    /// Splits `offset..offset + len` of the bytes into the pieces the
    /// copies make, in order, each with its position in the caller's
    /// buffer: lone bytes outside whole words, runs of whole words, and
    /// parts of a word (see the module docs).
    fn pieces(&self, offset: usize, len: usize) -> impl Iterator<Item = Piece> {
        let (wf, we) = word_span(self.ptr.as_ptr() as usize, self.len);
        let (mut at, mut i) = (offset, 0usize);
        std::iter::from_fn(move || {
            if i >= len {
                return None;
            }
            let left = len - i;
            let piece = if at < wf || at >= we {
                Piece::Byte { at, i }
            } else {
                let word = at - (at - wf) % 8;
                let within = at - word;
                if within == 0 && left >= 8 {
                    let words = left.min(we - at) / 8;
                    Piece::Words { at, i, words }
                } else {
                    let n = (8 - within).min(left);
                    Piece::Part { word, within, i, n }
                }
            };
            let n = piece.len();
            at += n;
            i += n;
            Some(piece)
        })
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the bytes.
    ///
    /// # Panics
    /// If the range is out of bounds (callers check bounds first).
    #[allow(unsafe_code)]
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        assert!(offset <= self.len && dst.len() <= self.len - offset);
        let base = self.ptr.as_ptr();
        for p in self.pieces(offset, dst.len()) {
            match p {
                Piece::Byte { at, i } => {
                    // SAFETY: `at` < len (checked above), inside the live,
                    // initialized memory `new`'s contract names; bytes outside whole words are
                    // only ever accessed as `AtomicU8` (see the module docs).
                    dst[i] = unsafe { AtomicU8::from_ptr(base.add(at)) }.load(Relaxed);
                }
                Piece::Words { at, i, words } => {
                    for (k, out) in dst[i..i + words * 8].chunks_exact_mut(8).enumerate() {
                        // SAFETY: each word of the run is 8-aligned (offsets
                        // from an 8-aligned address, see `word_span`) and
                        // ends before the last whole word's end <= len, in
                        // the live, initialized memory of `new`'s contract; bytes of whole
                        // words are only ever accessed as `AtomicU64`.
                        let v =
                            unsafe { AtomicU64::from_ptr(base.add(at + k * 8).cast::<u64>()) }.load(Relaxed);
                        out.copy_from_slice(&v.to_ne_bytes());
                    }
                }
                Piece::Part { word, within, i, n } => {
                    // SAFETY: as for a run of words, for this one word.
                    let v = unsafe { AtomicU64::from_ptr(base.add(word).cast::<u64>()) }.load(Relaxed);
                    dst[i..i + n].copy_from_slice(&v.to_ne_bytes()[within..within + n]);
                }
            }
        }
    }

    /// Copies `src` into the bytes at `offset`.
    ///
    /// # Panics
    /// If the range is out of bounds (callers check bounds first).
    #[allow(unsafe_code)]
    pub fn write(&self, offset: usize, src: &[u8]) {
        assert!(offset <= self.len && src.len() <= self.len - offset);
        let base = self.ptr.as_ptr();
        for p in self.pieces(offset, src.len()) {
            match p {
                Piece::Byte { at, i } => {
                    // SAFETY: as in `read`.
                    unsafe { AtomicU8::from_ptr(base.add(at)) }.store(src[i], Relaxed);
                }
                Piece::Words { at, i, words } => {
                    for (k, b) in src[i..i + words * 8].chunks_exact(8).enumerate() {
                        let mut w = [0u8; 8];
                        w.copy_from_slice(b);
                        // SAFETY: as in `read`.
                        unsafe { AtomicU64::from_ptr(base.add(at + k * 8).cast::<u64>()) }
                            .store(u64::from_ne_bytes(w), Relaxed);
                    }
                }
                Piece::Part { word, within, i, n } => {
                    // SAFETY: as in `read`.
                    let cell = unsafe { AtomicU64::from_ptr(base.add(word).cast::<u64>()) };
                    // The other bytes of the word stay as they are, whoever
                    // writes them meanwhile.
                    let mut cur = cell.load(Relaxed);
                    loop {
                        let mut b = cur.to_ne_bytes();
                        b[within..within + n].copy_from_slice(&src[i..i + n]);
                        match cell.compare_exchange_weak(cur, u64::from_ne_bytes(b), Relaxed, Relaxed) {
                            Ok(_) => break,
                            Err(now) => cur = now,
                        }
                    }
                }
            }
        }
    }
}

/// One piece of a copy (see [`SharedBytes::pieces`]): `at`/`word` are
/// segment offsets, `i` the position in the caller's buffer.
enum Piece {
    /// One byte outside whole words.
    Byte { at: usize, i: usize },
    /// `words` whole aligned words from `at`.
    Words { at: usize, i: usize, words: usize },
    /// `n` bytes from byte `within` of the word at `word`.
    Part {
        word: usize,
        within: usize,
        i: usize,
        n: usize,
    },
}

impl Piece {
    /// Bytes it covers.
    fn len(&self) -> usize {
        match *self {
            Piece::Byte { .. } => 1,
            Piece::Words { words, .. } => words * 8,
            Piece::Part { n, .. } => n,
        }
    }
}

/// The whole aligned 8-byte words of `len` bytes at address `start`, as
/// offsets `[first, end)` from `start` (`(0, 0)` when there is none).
fn word_span(start: usize, len: usize) -> (usize, usize) {
    let first = start.next_multiple_of(8);
    let end = (start + len) / 8 * 8;
    if end <= first {
        (0, 0)
    } else {
        (first - start, end - start)
    }
}

impl Drop for RawSegment {
    fn drop(&mut self) {
        // SAFETY: same provenance argument as `into_vec`; Drop runs once.
        #[allow(unsafe_code)]
        unsafe {
            drop(Vec::from_raw_parts(self.ptr.as_ptr(), self.len, self.cap));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_copies() {
        let s = RawSegment::from_vec(vec![1, 2, 3, 4]);
        let mut out = [0u8; 2];
        s.read(1, &mut out);
        assert_eq!(out, [2, 3]);
        s.write(2, &[9, 9]);
        assert_eq!(s.into_vec(), vec![1, 2, 9, 9]);
        let empty = RawSegment::from_vec(Vec::new());
        assert!(empty.is_empty());
        assert_eq!(empty.into_vec(), Vec::<u8>::new());
    }

    /// Every range of segments of every length 0..40, read and written,
    /// against a plain vector.
    #[test]
    fn every_range_matches_a_plain_copy() {
        for len in 0..40usize {
            let mut model: Vec<u8> = (0..len as u8).collect();
            let seg = RawSegment::from_vec(model.clone());
            for off in 0..=len {
                for n in 0..=len - off {
                    let mut got = vec![0xeeu8; n];
                    seg.read(off, &mut got);
                    assert_eq!(got, model[off..off + n], "read {off}+{n} of {len}");
                    let new: Vec<u8> = (0..n).map(|k| (k * 31 + off + n) as u8).collect();
                    seg.write(off, &new);
                    model[off..off + n].copy_from_slice(&new);
                }
            }
            assert_eq!(seg.into_vec(), model, "len {len}");
        }
    }

    /// Allocations need not start on a word: the bytes before the first
    /// and after the last whole word go one by one.
    #[test]
    fn whole_words_of_any_start_and_length() {
        assert_eq!(word_span(16, 16), (0, 16));
        assert_eq!(word_span(13, 2), (0, 0));
        assert_eq!(word_span(13, 11), (3, 11));
        assert_eq!(word_span(13, 10), (0, 0), "no whole word in 13..23");
        assert_eq!(word_span(8, 7), (0, 0));
        assert_eq!(word_span(9, 40), (7, 39));
        assert_eq!(word_span(0, 0), (0, 0));
    }

    /// Threads writing disjoint byte ranges that share words never lose
    /// each other's bytes (partial words are updated atomically).
    #[test]
    fn threads_writing_neighbouring_bytes_keep_each_others_writes() {
        let seg = std::sync::Arc::new(RawSegment::from_vec(vec![0u8; 64]));
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let seg = seg.clone();
                std::thread::spawn(move || {
                    for round in 0..2000u32 {
                        // Thread t owns bytes t, t+4, t+8, ...: every word
                        // is shared by all four threads.
                        for i in (t as usize..64).step_by(4) {
                            seg.write(i, &[(round as u8).wrapping_add(t)]);
                        }
                    }
                })
            })
            .collect();
        for th in threads {
            th.join().unwrap();
        }
        let mut out = [0u8; 64];
        seg.read(0, &mut out);
        for (i, b) in out.iter().enumerate() {
            let t = (i % 4) as u8;
            assert_eq!(*b, 1999u32.wrapping_add(u32::from(t)) as u8, "byte {i}");
        }
    }
}
