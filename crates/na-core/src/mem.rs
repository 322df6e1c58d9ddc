//! Memory handles: local memory exposed for RMA, and descriptors of remote
//! memory received from peers.
//!
//! A [`MemHandle`] owns one or more segments of local memory (scatter/gather)
//! with an [`Access`] mode. Plugins that need registration (verbs) attach
//! their registration to the handle with [`MemHandle::attach_registration`];
//! plugins that do not (shared memory) attach nothing. A plugin turns a
//! handle into a [`RemoteMem`] (addresses, lengths and remote keys), which is
//! what travels to the peer as bytes ([`RemoteMem::to_bytes`]). Decoding those
//! bytes checks everything: a peer's descriptor is never trusted.

use std::any::Any;
use std::sync::{Arc, Mutex};

use crate::addr::PluginId;
use crate::error::{NaError, Result};
use crate::sys::segment::RawSegment;

/// What remote peers (and RMA operations) may do with a memory handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// Peers may read (get from it); local ops may use it as a put source.
    ReadOnly,
    /// Peers may write (put into it); local ops may use it as a get target.
    WriteOnly,
    /// Both.
    ReadWrite,
}

impl Access {
    /// True if reading is allowed.
    pub fn can_read(self) -> bool {
        matches!(self, Access::ReadOnly | Access::ReadWrite)
    }

    /// True if writing is allowed.
    pub fn can_write(self) -> bool {
        matches!(self, Access::WriteOnly | Access::ReadWrite)
    }

    fn to_u8(self) -> u8 {
        match self {
            Access::ReadOnly => 1,
            Access::WriteOnly => 2,
            Access::ReadWrite => 3,
        }
    }

    fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Access::ReadOnly),
            2 => Some(Access::WriteOnly),
            3 => Some(Access::ReadWrite),
            _ => None,
        }
    }
}

type Registration = Arc<dyn Any + Send + Sync>;

struct MemInner {
    /// Declared (so dropped) before `segments`, and see the `Drop` impl: a
    /// registration may let a device or peer write the memory, so it must
    /// be gone before the memory is freed.
    registrations: Mutex<Vec<(PluginId, Registration)>>,
    segments: Vec<RawSegment>,
    /// Prefix sums: `starts[i]` is the handle offset of segment `i`.
    starts: Vec<u64>,
    size: u64,
    access: Access,
}

impl MemInner {
    /// Drops the handle's own references to its registrations; true if
    /// none lives on elsewhere (then no device or peer can reach the
    /// memory through them any more).
    fn drop_registrations(&mut self) -> bool {
        let regs = std::mem::take(self.registrations.get_mut().unwrap_or_else(|e| e.into_inner()));
        let unshared = regs.iter().all(|(_, r)| Arc::strong_count(r) == 1);
        drop(regs);
        unshared
    }
}

impl Drop for MemInner {
    fn drop(&mut self) {
        if !self.drop_registrations() {
            // Someone kept a registration ([`MemHandle::registration`])
            // past the handle: freeing the memory could let a peer write
            // into whatever reuses it. Leak it instead.
            tracing::warn!(
                bytes = self.size,
                "memory handle dropped while a registration of it is still held elsewhere: its memory is leaked, not freed"
            );
            for s in self.segments.drain(..) {
                std::mem::forget(s);
            }
        }
    }
}

/// Local memory exposed for RMA: one or many owned segments.
///
/// Cloning is cheap (reference counted); the memory stays alive while any
/// clone, or any operation in flight on it, exists. Local code reads and
/// writes the contents by copying ([`read_at`](Self::read_at),
/// [`write_at`](Self::write_at)) because a peer may write the memory at any
/// time; [`into_buffers`](Self::into_buffers) gives the vectors back once the
/// last clone is gone.
///
/// What "no peer can reach the memory" below means depends on the plugin.
/// A plugin that registers memory (na-verbs) gives peers keys that die
/// with the registrations, so a peer's transfer after that fails. na-sm
/// registers nothing: its peers run as the same user and copy with
/// `process_vm_readv/writev`, which reach any address of this process,
/// exposed or not, for as long as it lives; over sm the guarantee is the
/// operating system's (same user), not the handle's.
#[derive(Clone)]
pub struct MemHandle {
    inner: Arc<MemInner>,
}

impl std::fmt::Debug for MemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemHandle")
            .field("segments", &self.inner.segments.len())
            .field("size", &self.inner.size)
            .field("access", &self.inner.access)
            .finish()
    }
}

impl MemHandle {
    /// Exposes the given buffers, in order, as one handle.
    pub fn new(buffers: Vec<Vec<u8>>, access: Access) -> Self {
        let mut starts = Vec::with_capacity(buffers.len());
        let mut size = 0u64;
        let segments = buffers
            .into_iter()
            .map(|b| {
                starts.push(size);
                size += b.len() as u64;
                RawSegment::from_vec(b)
            })
            .collect();
        MemHandle {
            inner: Arc::new(MemInner {
                registrations: Mutex::new(Vec::new()),
                segments,
                starts,
                size,
                access,
            }),
        }
    }

    /// A single zero-filled segment of `len` bytes.
    pub fn zeroed(len: usize, access: Access) -> Self {
        Self::new(vec![vec![0; len]], access)
    }

    /// Total size in bytes.
    pub fn size(&self) -> u64 {
        self.inner.size
    }

    /// Access mode.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    /// Number of segments.
    pub fn segment_count(&self) -> usize {
        self.inner.segments.len()
    }

    /// `(address, length)` of every segment, for plugins that register or
    /// describe memory.
    pub fn segments_raw(&self) -> impl ExactSizeIterator<Item = (usize, usize)> + '_ {
        self.inner.segments.iter().map(|s| (s.addr(), s.len()))
    }

    /// Checks that `offset..offset+len` lies inside the handle.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        check_range("local", offset, len, self.inner.size)
    }

    /// Calls `f(address, length)` for each contiguous piece of
    /// `offset..offset+len`, in order. Checks bounds first.
    pub fn for_each_piece(&self, offset: u64, len: u64, mut f: impl FnMut(usize, usize)) -> Result<()> {
        self.check_range(offset, len)?;
        walk(&self.inner.starts, self.inner.size, offset, len, |i, off, n| {
            f(self.inner.segments[i].addr() + off as usize, n as usize)
        });
        Ok(())
    }

    /// Copies bytes out of the handle into `dst`, starting at `offset`.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len() as u64)?;
        let mut done = 0usize;
        walk(
            &self.inner.starts,
            self.inner.size,
            offset,
            dst.len() as u64,
            |i, off, n| {
                let n = n as usize;
                self.inner.segments[i].read(off as usize, &mut dst[done..done + n]);
                done += n;
            },
        );
        Ok(())
    }

    /// Copies `src` into the handle at `offset`.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len() as u64)?;
        let mut done = 0usize;
        walk(
            &self.inner.starts,
            self.inner.size,
            offset,
            src.len() as u64,
            |i, off, n| {
                let n = n as usize;
                self.inner.segments[i].write(off as usize, &src[done..done + n]);
                done += n;
            },
        );
        Ok(())
    }

    /// Copies the whole contents into one vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.inner.size as usize];
        // The range is the whole handle, so it cannot be out of bounds.
        let _ = self.read_at(0, &mut v);
        v
    }

    /// Gives the buffers back if this is the last clone of the handle (no
    /// operation in flight, no other owner, no registration of it held
    /// elsewhere); otherwise returns the handle. The handle's registrations
    /// are dropped first, so no device or peer can reach the memory through
    /// them once the caller has it (see the type's notes on na-sm).
    pub fn into_buffers(self) -> std::result::Result<Vec<Vec<u8>>, MemHandle> {
        let mut inner = match Arc::try_unwrap(self.inner) {
            Ok(inner) => inner,
            Err(inner) => return Err(MemHandle { inner }),
        };
        // Checked only now: while another clone existed, it could take a
        // new reference to a registration (`registration`) after a check.
        // With the last clone here, a count can only fall.
        let regs = inner.registrations.get_mut().unwrap_or_else(|e| e.into_inner());
        if regs.iter().any(|(_, r)| Arc::strong_count(r) > 1) {
            return Err(MemHandle {
                inner: Arc::new(inner),
            });
        }
        let unshared = inner.drop_registrations();
        debug_assert!(unshared, "no registration was shared a moment ago");
        let segments = std::mem::take(&mut inner.segments);
        Ok(segments.into_iter().map(RawSegment::into_vec).collect())
    }

    /// Attaches a plugin's registration of this memory (replacing an earlier
    /// one of the same plugin). It lives as long as the handle.
    pub fn attach_registration(&self, plugin: PluginId, reg: Registration) {
        let mut regs = self.inner.registrations.lock().unwrap_or_else(|e| e.into_inner());
        regs.retain(|(p, _)| *p != plugin);
        regs.push((plugin, reg));
    }

    /// The registration a plugin attached, if any. Hold the returned `Arc`
    /// only together with a clone of the handle: a registration that
    /// outlives its handle makes the handle's memory leak rather than be
    /// freed (a peer could still reach it), and blocks
    /// [`into_buffers`](Self::into_buffers).
    pub fn registration(&self, plugin: PluginId) -> Option<Registration> {
        let regs = self.inner.registrations.lock().unwrap_or_else(|e| e.into_inner());
        regs.iter().find(|(p, _)| *p == plugin).map(|(_, r)| r.clone())
    }

    /// Drops a plugin's registration.
    pub fn detach_registration(&self, plugin: PluginId) {
        let mut regs = self.inner.registrations.lock().unwrap_or_else(|e| e.into_inner());
        regs.retain(|(p, _)| *p != plugin);
    }

    /// How many other clones of this handle live now (operations in
    /// flight on it hold one each): what keeps
    /// [`into_buffers`](Self::into_buffers) from giving the buffers back.
    /// A snapshot: another thread's clone may come or go meanwhile.
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.inner) - 1
    }

    /// True if both values are clones of the same handle.
    pub fn same_as(&self, other: &MemHandle) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// One segment of remote memory as described by its owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteSegment {
    /// Virtual address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key (verbs rkey); 0 where the plugin needs none.
    pub key: u64,
}

/// Maximum number of segments accepted in a decoded [`RemoteMem`].
pub const MAX_REMOTE_SEGMENTS: usize = 1 << 16;

const REMOTE_MAGIC: [u8; 2] = *b"QM";
const REMOTE_VERSION: u8 = 1;
const REMOTE_HEADER: usize = 8;
const REMOTE_SEGMENT: usize = 24;

/// A peer's memory handle, as received: where the memory is, how long, with
/// which keys and access. Built by a plugin from a [`MemHandle`], encoded
/// with [`to_bytes`](Self::to_bytes), decoded (and validated) with
/// [`from_bytes`](Self::from_bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteMem {
    segments: Vec<RemoteSegment>,
    starts: Vec<u64>,
    size: u64,
    access: Access,
}

impl RemoteMem {
    /// Builds a descriptor, checking that the total size does not overflow.
    pub fn new(segments: Vec<RemoteSegment>, access: Access) -> Result<Self> {
        if segments.len() > MAX_REMOTE_SEGMENTS {
            return Err(malformed(format!(
                "{} segments (max {MAX_REMOTE_SEGMENTS})",
                segments.len()
            )));
        }
        let mut starts = Vec::with_capacity(segments.len());
        let mut size = 0u64;
        for s in &segments {
            starts.push(size);
            size = size
                .checked_add(s.len)
                .ok_or_else(|| malformed("total size overflows".into()))?;
            s.addr
                .checked_add(s.len)
                .ok_or_else(|| malformed(format!("segment {:#x}+{} wraps", s.addr, s.len)))?;
        }
        Ok(RemoteMem {
            segments,
            starts,
            size,
            access,
        })
    }

    /// Describes local handle `mem` for a peer: each segment's address and
    /// length with the same `key` (0 where the plugin needs none), and the
    /// handle's access.
    pub fn of_handle(mem: &MemHandle, key: u64) -> Result<Self> {
        let segs = mem
            .segments_raw()
            .map(|(addr, len)| RemoteSegment {
                addr: addr as u64,
                len: len as u64,
                key,
            })
            .collect();
        RemoteMem::new(segs, mem.access())
    }

    /// Total size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Access mode granted by the owner.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The segments.
    pub fn segments(&self) -> &[RemoteSegment] {
        &self.segments
    }

    /// Checks that `offset..offset+len` lies inside the remote handle.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        check_range("remote", offset, len, self.size)
    }

    /// Calls `f(segment, address, length)` for each contiguous piece of
    /// `offset..offset+len`. Checks bounds first.
    pub fn for_each_piece(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&RemoteSegment, u64, u64),
    ) -> Result<()> {
        self.check_range(offset, len)?;
        walk(&self.starts, self.size, offset, len, |i, off, n| {
            let s = &self.segments[i];
            f(s, s.addr + off, n)
        });
        Ok(())
    }

    /// Encoded length in bytes.
    pub fn encoded_len(&self) -> usize {
        REMOTE_HEADER + REMOTE_SEGMENT * self.segments.len()
    }

    /// Appends the encoding to `out`: `"QM"`, version, access, segment count
    /// (u32 LE), then `addr, len, key` (u64 LE each) per segment.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.reserve(self.encoded_len());
        out.extend_from_slice(&REMOTE_MAGIC);
        out.push(REMOTE_VERSION);
        out.push(self.access.to_u8());
        out.extend_from_slice(&(self.segments.len() as u32).to_le_bytes());
        for s in &self.segments {
            out.extend_from_slice(&s.addr.to_le_bytes());
            out.extend_from_slice(&s.len.to_le_bytes());
            out.extend_from_slice(&s.key.to_le_bytes());
        }
    }

    /// The encoding as a new vector.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut v);
        v
    }

    /// Decodes and validates bytes from a peer. Trailing bytes are an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let (mem, used) = Self::decode_prefix(bytes)?;
        if used != bytes.len() {
            return Err(malformed(format!("{} trailing bytes", bytes.len() - used)));
        }
        Ok(mem)
    }

    /// Decodes a descriptor at the start of `bytes`, returning it and the
    /// number of bytes it used.
    pub fn decode_prefix(bytes: &[u8]) -> Result<(Self, usize)> {
        if bytes.len() < REMOTE_HEADER {
            return Err(malformed(format!(
                "{} bytes is shorter than the header",
                bytes.len()
            )));
        }
        if bytes[0..2] != REMOTE_MAGIC {
            return Err(malformed("bad magic".into()));
        }
        if bytes[2] != REMOTE_VERSION {
            return Err(malformed(format!("unsupported version {}", bytes[2])));
        }
        let access =
            Access::from_u8(bytes[3]).ok_or_else(|| malformed(format!("bad access {}", bytes[3])))?;
        let count = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]) as usize;
        if count > MAX_REMOTE_SEGMENTS {
            return Err(malformed(format!("{count} segments (max {MAX_REMOTE_SEGMENTS})")));
        }
        let need = REMOTE_HEADER + count * REMOTE_SEGMENT;
        if bytes.len() < need {
            return Err(malformed(format!(
                "{count} segments need {need} bytes, got {}",
                bytes.len()
            )));
        }
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(w)
        };
        let segments = (0..count)
            .map(|i| {
                let at = REMOTE_HEADER + i * REMOTE_SEGMENT;
                RemoteSegment {
                    addr: word(at),
                    len: word(at + 8),
                    key: word(at + 16),
                }
            })
            .collect();
        Ok((RemoteMem::new(segments, access)?, need))
    }
}

fn malformed(reason: String) -> NaError {
    NaError::Malformed {
        what: "memory handle",
        reason,
    }
}

fn check_range(what: &'static str, offset: u64, len: u64, size: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(NaError::OutOfBounds {
            what,
            offset,
            len,
            size,
        }),
    }
}

/// Walks `offset..offset+len` (already bounds-checked against `size`) over
/// segments starting at `starts`, calling `f(segment, offset_in_segment, n)`
/// for each non-empty piece.
fn walk(starts: &[u64], size: u64, offset: u64, len: u64, mut f: impl FnMut(usize, u64, u64)) {
    if len == 0 {
        return;
    }
    // First segment whose range contains `offset` (skipping empty segments).
    let mut i = starts.partition_point(|&s| s <= offset) - 1;
    let mut pos = offset;
    let end = offset + len;
    while pos < end {
        let seg_end = starts.get(i + 1).copied().unwrap_or(size);
        let n = seg_end.min(end) - pos;
        if n > 0 {
            f(i, pos - starts[i], n);
        }
        pos += n;
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multi_segment_read_write() {
        let h = MemHandle::new(
            vec![vec![0; 3], vec![], vec![0; 5], vec![0; 2]],
            Access::ReadWrite,
        );
        assert_eq!(h.size(), 10);
        h.write_at(2, &[1, 2, 3, 4, 5, 6, 7]).unwrap();
        let mut out = [0u8; 10];
        h.read_at(0, &mut out).unwrap();
        assert_eq!(out, [0, 0, 1, 2, 3, 4, 5, 6, 7, 0]);
        let mut pieces = Vec::new();
        h.for_each_piece(2, 7, |_, n| pieces.push(n)).unwrap();
        assert_eq!(pieces, vec![1, 5, 1]);
        assert!(h.write_at(9, &[1, 2]).is_err());
        assert!(h.read_at(u64::MAX, &mut [0]).is_err());
        let bufs = h.into_buffers().unwrap();
        assert_eq!(bufs, vec![vec![0, 0, 1], vec![], vec![2, 3, 4, 5, 6], vec![7, 0]]);
    }

    #[test]
    fn into_buffers_fails_while_shared() {
        let h = MemHandle::zeroed(4, Access::ReadOnly);
        let c = h.clone();
        let h = h.into_buffers().unwrap_err();
        drop(c);
        assert_eq!(h.into_buffers().unwrap(), vec![vec![0; 4]]);
    }

    #[test]
    fn remote_roundtrip_and_validation() {
        let segs = vec![
            RemoteSegment {
                addr: 0x1000,
                len: 10,
                key: 1,
            },
            RemoteSegment {
                addr: 0x9000,
                len: 6,
                key: 2,
            },
        ];
        let r = RemoteMem::new(segs, Access::ReadWrite).unwrap();
        let b = r.to_bytes();
        assert_eq!(RemoteMem::from_bytes(&b).unwrap(), r);
        let mut pieces = Vec::new();
        r.for_each_piece(8, 4, |s, a, n| pieces.push((s.key, a, n)))
            .unwrap();
        assert_eq!(pieces, vec![(1, 0x1008, 2), (2, 0x9000, 2)]);
        assert!(r.check_range(10, 7).is_err());
        // Every truncation is an error, never a panic.
        for cut in 0..b.len() {
            assert!(RemoteMem::from_bytes(&b[..cut]).is_err());
        }
        let mut huge = b.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(RemoteMem::from_bytes(&huge).is_err());
        let wrap = RemoteMem::new(
            vec![RemoteSegment {
                addr: u64::MAX,
                len: 2,
                key: 0,
            }],
            Access::ReadOnly,
        );
        assert!(wrap.is_err());
        let over = RemoteMem::new(
            vec![
                RemoteSegment {
                    addr: 0,
                    len: u64::MAX,
                    key: 0,
                },
                RemoteSegment {
                    addr: 0,
                    len: 1,
                    key: 0,
                },
            ],
            Access::ReadOnly,
        );
        assert!(over.is_err());
    }

    #[test]
    fn access_modes() {
        assert!(Access::ReadOnly.can_read() && !Access::ReadOnly.can_write());
        assert!(!Access::WriteOnly.can_read() && Access::WriteOnly.can_write());
    }
}
