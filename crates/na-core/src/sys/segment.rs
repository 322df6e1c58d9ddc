//! Owned memory that the kernel (or a NIC, or a peer through CMA) may read or
//! write behind Rust's back.
//!
//! A [`RawSegment`] takes a `Vec<u8>` apart into pointer, length and
//! capacity and never hands out a reference into it: local access is by
//! copying through raw pointers, so a concurrent write by a peer can never
//! alias a live `&[u8]`/`&mut [u8]`. The vector is rebuilt on drop or by
//! [`RawSegment::into_vec`].

use std::ptr::NonNull;

/// A heap buffer whose contents may change at any time through RMA.
pub struct RawSegment {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: a RawSegment uniquely owns its allocation (it came from a Vec that
// was consumed), and all access goes through raw-pointer copies whose races
// with RMA writers are benign byte copies, as with DMA.
#[allow(unsafe_code)]
unsafe impl Send for RawSegment {}
// SAFETY: as above; shared access only reads or writes through raw copies.
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

    /// Copies `dst.len()` bytes starting at `offset` out of the segment.
    ///
    /// # Panics
    /// If the range is out of bounds (callers check bounds first).
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        assert!(offset <= self.len && dst.len() <= self.len - offset);
        // SAFETY: the range was checked to lie inside the live allocation of
        // `len` bytes that we own; `dst` is a distinct Rust buffer, so the
        // regions do not overlap.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len());
        }
    }

    /// Copies `src` into the segment at `offset`.
    ///
    /// # Panics
    /// If the range is out of bounds (callers check bounds first).
    pub fn write(&self, offset: usize, src: &[u8]) {
        assert!(offset <= self.len && src.len() <= self.len - offset);
        // SAFETY: the range lies inside our allocation (checked above); no
        // Rust reference into the allocation exists (this type never creates
        // one), so writing through the pointer cannot invalidate a borrow.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len());
        }
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
}
