//! Plugin-provided message buffers.
//!
//! [`Plugin::send_unexpected`](crate::Plugin::send_unexpected) copies the
//! caller's bytes into the transport. A caller that builds each message
//! anyway (an RPC layer serializing a request) can instead build it in a
//! [`MsgBuf`] from [`Plugin::alloc_msg_buf`](crate::Plugin::alloc_msg_buf)
//! and hand the buffer over with
//! [`Plugin::send_unexpected_buf`](crate::Plugin::send_unexpected_buf):
//! a plugin whose buffers are registered with its device (verbs) sends
//! straight from it, without the copy; others copy as usual and recycle the
//! buffer. The buffer belongs to the plugin from the send until the send
//! completes; [`Plugin::alloc_msg_buf`](crate::Plugin::alloc_msg_buf) hands
//! it out again afterwards, so a steady stream of messages allocates nothing.
//!
//! A [`MsgBuf`] has a fixed capacity (memory registered with a device must
//! not move), and a length: the message is its first `len()` bytes.

use std::any::Any;
use std::io;

use crate::error::{NaError, Result};

/// For plugins: `Ok` if a message buffer of `size` bytes is allowed where
/// messages hold at most `max`, else the [`NaError::MessageTooLarge`] that
/// `alloc_msg_buf` returns.
pub fn check_buf_size(size: usize, max: usize) -> Result<()> {
    if size > max {
        return Err(NaError::MessageTooLarge {
            len: size,
            max,
            kind: "message buffer",
        });
    }
    Ok(())
}

/// The total length of a message given as `parts`, and
/// [`NaError::LengthOverflow`] if it does not fit in a `usize` (parts that
/// alias one huge region could add up past it; a wrapped sum would pass
/// for a small message).
pub fn parts_len(parts: &[&[u8]]) -> Result<usize> {
    end_of_parts(0, parts.iter().map(|p| p.len())).ok_or(NaError::LengthOverflow {
        parts: parts.len(),
        kind: "message",
    })
}

/// `start` plus every length of `lens`, or `None` past `usize::MAX`.
fn end_of_parts(start: usize, lens: impl IntoIterator<Item = usize>) -> Option<usize> {
    lens.into_iter().try_fold(start, usize::checked_add)
}

/// The memory behind a [`MsgBuf`]: plain heap bytes, or memory a plugin
/// prepared (registered) for sending. Implemented by plugins.
pub trait MsgMemory: Send + 'static {
    /// All bytes of the buffer (its capacity).
    fn bytes(&self) -> &[u8];

    /// All bytes of the buffer, writable.
    fn bytes_mut(&mut self) -> &mut [u8];

    /// For the plugin that made it: recognize its own memory.
    fn as_any(&self) -> &dyn Any;
}

/// Heap memory: what plugins without registered buffers hand out.
struct HeapMemory(Box<[u8]>);

impl MsgMemory for HeapMemory {
    fn bytes(&self) -> &[u8] {
        &self.0
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A message buffer of fixed capacity; the message is its first
/// [`len`](Self::len) bytes. Fill it through [`std::io::Write`],
/// [`extend_from_slice`](Self::extend_from_slice), or
/// [`spare_mut`](Self::spare_mut) plus [`set_len`](Self::set_len).
pub struct MsgBuf {
    mem: Memory,
    len: usize,
}

/// Heap memory is kept inline (no virtual call per access on the common
/// path of plugins that copy); plugin memory behind the trait.
enum Memory {
    Heap(HeapMemory),
    Plugin(Box<dyn MsgMemory>),
}

impl Memory {
    #[inline]
    fn bytes(&self) -> &[u8] {
        match self {
            Memory::Heap(h) => &h.0,
            Memory::Plugin(m) => m.bytes(),
        }
    }

    #[inline]
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Memory::Heap(h) => &mut h.0,
            Memory::Plugin(m) => m.bytes_mut(),
        }
    }
}

impl MsgBuf {
    /// An empty heap buffer of `capacity` bytes.
    pub fn heap(capacity: usize) -> MsgBuf {
        MsgBuf {
            mem: Memory::Heap(HeapMemory(vec![0u8; capacity].into_boxed_slice())),
            len: 0,
        }
    }

    /// An empty buffer over plugin-prepared memory.
    pub fn from_memory(mem: Box<dyn MsgMemory>) -> MsgBuf {
        MsgBuf {
            mem: Memory::Plugin(mem),
            len: 0,
        }
    }

    /// The memory (for the plugin that made it).
    pub fn memory(&self) -> &dyn MsgMemory {
        match &self.mem {
            Memory::Heap(h) => h,
            Memory::Plugin(m) => m.as_ref(),
        }
    }

    /// Bytes the buffer can hold.
    pub fn capacity(&self) -> usize {
        self.mem.bytes().len()
    }

    /// Length of the message in it.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the message is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The message.
    pub fn as_slice(&self) -> &[u8] {
        &self.mem.bytes()[..self.len]
    }

    /// The message, writable in place.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.mem.bytes_mut()[..len]
    }

    /// The bytes after the message, to write into before [`set_len`](Self::set_len)
    /// (for encoders that fill a slice, like `postcard::to_slice`).
    pub fn spare_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.mem.bytes_mut()[len..]
    }

    /// Sets the message length; an error if it exceeds the capacity.
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        let max = self.capacity();
        if len > max {
            return Err(NaError::MessageTooLarge {
                len,
                max,
                kind: "message buffer",
            });
        }
        self.len = len;
        Ok(())
    }

    /// Empties the message (the capacity stays).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Appends `data`; an error (and nothing appended) if it does not fit.
    pub fn extend_from_slice(&mut self, data: &[u8]) -> Result<()> {
        self.extend_from_slices(&[data])
    }

    /// Appends each of `parts` in order (a header and a payload, say) with
    /// one capacity check; an error (and nothing appended) if they do not
    /// all fit.
    pub fn extend_from_slices(&mut self, parts: &[&[u8]]) -> Result<()> {
        let start = self.len;
        let end = end_of_parts(start, parts.iter().map(|p| p.len())).ok_or(NaError::LengthOverflow {
            parts: parts.len(),
            kind: "message buffer",
        })?;
        self.set_len(end)?;
        let mut at = start;
        let bytes = self.mem.bytes_mut();
        for p in parts {
            bytes[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        Ok(())
    }
}

impl io::Write for MsgBuf {
    /// Appends what fits; `Ok(0)` once full, so `write_all` of a message
    /// larger than the buffer fails with [`io::ErrorKind::WriteZero`].
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = data.len().min(self.capacity() - self.len);
        let start = self.len;
        self.mem.bytes_mut()[start..start + n].copy_from_slice(&data[..n]);
        self.len += n;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl std::fmt::Debug for MsgBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MsgBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .finish()
    }
}

/// A small free list of buffers for plugins that copy: sends give their
/// buffer back here, `alloc` takes one, so a stream allocates nothing.
#[derive(Debug, Default)]
pub struct MsgBufPool {
    free: Vec<MsgBuf>,
}

impl MsgBufPool {
    /// Buffers kept at most (more are dropped).
    pub const KEEP: usize = 64;

    /// An empty buffer of at least `capacity` bytes (recycled if one is free).
    pub fn alloc(&mut self, capacity: usize) -> MsgBuf {
        match self.free.iter().rposition(|b| b.capacity() >= capacity) {
            Some(i) => self.free.swap_remove(i),
            None => MsgBuf::heap(capacity),
        }
    }

    /// Takes a buffer back for reuse.
    pub fn recycle(&mut self, mut buf: MsgBuf) {
        if self.free.len() < Self::KEEP {
            buf.clear();
            self.free.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn fills_up_to_capacity_and_no_further() {
        let mut b = MsgBuf::heap(8);
        assert_eq!((b.len(), b.capacity()), (0, 8));
        b.extend_from_slice(b"abc").unwrap();
        b.write_all(b"defgh").unwrap();
        assert_eq!(b.as_slice(), b"abcdefgh");
        let err = b.write_all(b"i").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WriteZero);
        assert!(b.extend_from_slice(b"i").is_err());
        assert!(matches!(
            b.set_len(9),
            Err(NaError::MessageTooLarge { len: 9, max: 8, .. })
        ));
        assert_eq!(b.len(), 8, "failed appends leave the message alone");
        b.clear();
        b.spare_mut()[..2].copy_from_slice(b"xy");
        b.set_len(2).unwrap();
        b.as_mut_slice()[1] = b'z';
        assert_eq!(b.as_slice(), b"xz");
        b.extend_from_slices(&[b"12", b"", b"345"]).unwrap();
        assert_eq!(b.as_slice(), b"xz12345");
        assert!(b.extend_from_slices(&[b"6", b"78"]).is_err());
        assert_eq!(
            b.as_slice(),
            b"xz12345",
            "parts that do not all fit append nothing"
        );
    }

    /// Lengths that add up past `usize::MAX` (parts aliasing one huge
    /// region: real slices that long cannot be made in a test, so the sum
    /// is checked on the lengths themselves) are refused with a clear
    /// error, never wrapped to a small length or a panic.
    #[test]
    fn part_lengths_that_overflow_are_refused() {
        assert_eq!(end_of_parts(3, [4, 5]), Some(12));
        assert_eq!(end_of_parts(0, [usize::MAX]), Some(usize::MAX));
        assert_eq!(end_of_parts(1, [usize::MAX]), None);
        assert_eq!(end_of_parts(0, [usize::MAX / 2 + 1, usize::MAX / 2 + 1, 4]), None);
        assert_eq!(end_of_parts(0, [usize::MAX, 0, 1]), None);
        assert_eq!(parts_len(&[b"ab", b"", b"cde"]).unwrap(), 5);
        let err = NaError::LengthOverflow {
            parts: 3,
            kind: "message buffer",
        };
        assert!(err.to_string().contains("3 parts of a message buffer"), "{err}");
        // A buffer's append goes through the same sum.
        let mut b = MsgBuf::heap(8);
        b.extend_from_slices(&[b"12345"]).unwrap();
        assert!(b.extend_from_slices(&[b"678", b"9"]).is_err());
        assert_eq!(b.as_slice(), b"12345");
    }

    #[test]
    fn pool_recycles_big_enough_buffers() {
        let mut p = MsgBufPool::default();
        let mut b = p.alloc(16);
        b.extend_from_slice(b"data").unwrap();
        let ptr = b.memory().bytes().as_ptr();
        p.recycle(b);
        let again = p.alloc(10);
        assert_eq!(again.memory().bytes().as_ptr(), ptr, "reused");
        assert!(again.is_empty(), "recycled buffers come back empty");
        assert_eq!(p.alloc(32).capacity(), 32, "too small ones are not handed out");
    }
}
