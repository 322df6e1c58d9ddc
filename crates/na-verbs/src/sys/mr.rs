//! Protection domains and memory regions: `ibv_alloc_pd(3)`, `ibv_reg_mr(3)`.

use std::ops::BitOr;
use std::ptr::NonNull;
use std::sync::Arc;

use na_core::sys::segment::SharedBytes;
use rdma_sys::*;

use super::{null_error, Context};
use crate::error::{Result, VerbsError};

/// A protection domain (`struct ibv_pd`); holds its [`Context`] alive.
pub struct ProtectionDomain {
    raw: NonNull<ibv_pd>,
    ctx: Arc<Context>,
}

// SAFETY: verbs on a PD are thread-safe in libibverbs; the pointer is only
// used through libibverbs calls.
unsafe impl Send for ProtectionDomain {}
// SAFETY: see `Send`.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    /// Allocates a protection domain on `ctx` (`ibv_alloc_pd`).
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<ProtectionDomain>> {
        // SAFETY: the context is live (we hold an Arc to it).
        let raw = unsafe { ibv_alloc_pd(ctx.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::Create {
            op: "ibv_alloc_pd",
            context: ctx.name().to_owned(),
            source: null_error(),
        })?;
        Ok(Arc::new(ProtectionDomain {
            raw,
            ctx: Arc::clone(ctx),
        }))
    }

    /// The device context this PD belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(crate) fn as_ptr(&self) -> *mut ibv_pd {
        self.raw.as_ptr()
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: every MR/QP/SRQ holds an Arc to this PD, so none is left;
        // deallocated exactly once.
        let rc = unsafe { ibv_dealloc_pd(self.raw.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_dealloc_pd failed");
        }
    }
}

/// Access rights of a memory region (`enum ibv_access_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AccessFlags(u32);

impl AccessFlags {
    /// The local device may write (needed for RECV and RDMA READ targets).
    pub const LOCAL_WRITE: AccessFlags = AccessFlags(ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0);
    /// Peers may RDMA WRITE into the region (requires `LOCAL_WRITE`).
    pub const REMOTE_WRITE: AccessFlags = AccessFlags(ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0);
    /// Peers may RDMA READ from the region.
    pub const REMOTE_READ: AccessFlags = AccessFlags(ibv_access_flags::IBV_ACCESS_REMOTE_READ.0);
    /// Local write plus remote read and write: the usual flags of an RMA buffer.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub const ALL_RMA: AccessFlags =
        AccessFlags(Self::LOCAL_WRITE.0 | Self::REMOTE_WRITE.0 | Self::REMOTE_READ.0);

    /// The raw bits.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// Flags from raw `ibv_access_flags` bits (bits the device does not know
    /// make `ibv_reg_mr` fail with `EINVAL`, not misbehave).
    pub fn from_bits(bits: u32) -> AccessFlags {
        AccessFlags(bits)
    }
}

impl BitOr for AccessFlags {
    type Output = AccessFlags;
    fn bitor(self, rhs: AccessFlags) -> AccessFlags {
        AccessFlags(self.0 | rhs.0)
    }
}

/// One scatter/gather entry (`struct ibv_sge`) inside a registered region.
///
/// Only built from a [`MemoryRegion`] (bounds-checked); same layout as `ibv_sge`.
///
/// An `Sge` is a plain value (address, length, `lkey`): it borrows
/// nothing, so it can outlive its region, copied or not (`Copy` adds no
/// way to). That is sound: the device checks `lkey` and range against
/// the registrations live when it runs the work request, so a stale
/// entry fails with a completion error, or, where its `lkey` now names a
/// new registration covering the range, reaches memory that registration
/// gave the device (its contract, [`MemoryRegion::register`]). What must
/// outlive a *posted* work request is the region itself, until its
/// completion, which no borrow of the entry could express: the plugin
/// keeps it (a connection's buffers until its flush, a message buffer
/// until its send completes, a transfer's registrations until its work
/// requests do).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    pub(crate) addr: u64,
    pub(crate) length: u32,
    pub(crate) lkey: u32,
}

/// A remote (or exported local) region: what a peer needs for RDMA READ/WRITE.
///
/// It usually comes from the wire: nothing in it is trusted; the device checks
/// `rkey` and bounds against the peer's registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// Remote virtual address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteRegion {
    /// The sub-range `[offset, offset + len)`, bounds-checked.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn slice(&self, offset: u64, len: u64) -> Result<RemoteRegion> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(RemoteRegion {
                addr: self.addr + offset,
                len,
                rkey: self.rkey,
            }),
            _ => Err(VerbsError::InvalidArgument {
                op: "RemoteRegion::slice",
                reason: format!(
                    "range {offset}+{len} outside a remote region of {} bytes",
                    self.len
                ),
            }),
        }
    }
}

/// A registered memory region (`struct ibv_mr`); deregistered on drop.
///
/// The memory may be written by the device at any time (RECV, RDMA READ, or a
/// peer's RDMA WRITE when granted), so it is only accessed by copying.
pub struct MemoryRegion {
    raw: NonNull<ibv_mr>,
    /// Start and length of the memory, and whether we mmap'ed it ourselves.
    addr: NonNull<u8>,
    len: usize,
    owned: bool,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the region is only touched through copies and libibverbs calls;
// ibv_dereg_mr may run on any thread.
unsafe impl Send for MemoryRegion {}
// SAFETY: `&MemoryRegion` only allows copying in and out through
// `SharedBytes` (atomic accesses, one width per byte), never a Rust
// reference to the (device-shared) memory: threads copying at once race
// on the bytes as they would on any shared memory, without undefined
// behaviour.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Allocates `len` bytes of zeroed, page-aligned memory (anonymous `mmap`)
    /// and registers it with `access`.
    pub fn allocate(pd: &Arc<ProtectionDomain>, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        if len == 0 {
            return Err(VerbsError::InvalidArgument {
                op: "MemoryRegion::allocate",
                reason: "length 0".into(),
            });
        }
        // SAFETY: an anonymous private mapping of `len` bytes at a kernel-chosen
        // address; it aliases nothing. Unmapped in Drop, after deregistration.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(VerbsError::AllocateMemory {
                len,
                source: std::io::Error::last_os_error(),
            });
        }
        let addr = NonNull::new(p.cast::<u8>()).expect("mmap never returns NULL on success");
        // SAFETY: the mapping is ours, `len` bytes long, and only reached
        // through this region from now on.
        match unsafe { Self::register_inner(pd, addr, len, access, true) } {
            Ok(mr) => Ok(mr),
            Err(e) => {
                // SAFETY: registration failed, nothing else references the mapping.
                unsafe { libc::munmap(p, len) };
                Err(e)
            }
        }
    }

    /// Registers foreign memory `[addr, addr + len)` (`ibv_reg_mr`).
    ///
    /// # Safety
    /// The memory must stay mapped while the region lives, and the caller must
    /// not hold Rust references (`&`/`&mut`) into it while the device may
    /// access it: work requests using this region may read or write it until
    /// they complete, and peers may at any time if `access` grants them.
    /// Regions whose copies (`write_at`/`read_at`) are used and that
    /// overlap another region so used must start and end on 8-byte
    /// boundaries or cover the same range (see `SharedBytes::new`).
    pub unsafe fn register(
        pd: &Arc<ProtectionDomain>,
        addr: NonNull<u8>,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        // SAFETY: forwarded to the caller's contract above.
        unsafe { Self::register_inner(pd, addr, len, access, false) }
    }

    /// # Safety
    /// As [`MemoryRegion::register`]; if `owned`, `addr`/`len` is an mmap we own.
    unsafe fn register_inner(
        pd: &Arc<ProtectionDomain>,
        addr: NonNull<u8>,
        len: usize,
        access: AccessFlags,
        owned: bool,
    ) -> Result<MemoryRegion> {
        // SAFETY: the PD is live; the memory contract is the caller's.
        let raw = unsafe { ibv_reg_mr(pd.as_ptr(), addr.as_ptr().cast(), len, access.0 as libc::c_int) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::RegisterMemory {
            addr: addr.as_ptr() as usize,
            len,
            source: null_error(),
        })?;
        Ok(MemoryRegion {
            raw,
            addr,
            len,
            owned,
            pd: Arc::clone(pd),
        })
    }

    /// Start address of the region.
    pub fn addr(&self) -> u64 {
        self.addr.as_ptr() as u64
    }
    /// Length in bytes.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn len(&self) -> usize {
        self.len
    }
    /// True if the region is empty (never, for a successful registration).
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: `raw` is a live registration; lkey is immutable after ibv_reg_mr.
        unsafe { (*self.raw.as_ptr()).lkey }
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as for `lkey`.
        unsafe { (*self.raw.as_ptr()).rkey }
    }
    /// The protection domain of the region.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    fn check(&self, op: &'static str, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(VerbsError::InvalidArgument {
                op,
                reason: format!("range {offset}+{len} outside a region of {} bytes", self.len),
            }),
        }
    }

    /// A scatter/gather entry for `[offset, offset + len)` of this region.
    pub fn sge(&self, offset: usize, len: usize) -> Result<Sge> {
        self.check("MemoryRegion::sge", offset, len)?;
        let length = u32::try_from(len).map_err(|_| VerbsError::InvalidArgument {
            op: "MemoryRegion::sge",
            reason: format!("SGE length {len} exceeds u32"),
        })?;
        Ok(Sge {
            addr: self.addr() + offset as u64,
            length,
            lkey: self.lkey(),
        })
    }

    /// The remote descriptor of `[offset, offset + len)` to send to a peer.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn remote(&self, offset: usize, len: usize) -> Result<RemoteRegion> {
        self.check("MemoryRegion::remote", offset, len)?;
        Ok(RemoteRegion {
            addr: self.addr() + offset as u64,
            len: len as u64,
            rkey: self.rkey(),
        })
    }

    /// The region's memory, for copies (see [`SharedBytes`]).
    fn bytes(&self) -> SharedBytes {
        // SAFETY: the region's `len` bytes at `addr` are mapped (ours, or
        // the caller's under `register`'s contract) while `self` lives, and
        // this process reaches them only through `write_at`/`read_at`,
        // never a Rust reference; overlapping regions agree on whole words
        // (ours are page-aligned; `register`'s contract for the caller's).
        unsafe { SharedBytes::new(self.addr, self.len) }
    }

    /// Copies `data` into the region at `offset`. Threads may copy at
    /// once (the copies are atomic accesses: racing writes race, as on any
    /// shared memory, but are no undefined behaviour).
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check("MemoryRegion::write_at", offset, data.len())?;
        self.bytes().write(offset, data);
        Ok(())
    }

    /// Copies `out.len()` bytes from the region at `offset` into `out`
    /// (atomic accesses, as [`write_at`](Self::write_at)).
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check("MemoryRegion::read_at", offset, out.len())?;
        self.bytes().read(offset, out);
        Ok(())
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: `raw` is a live registration, deregistered exactly once.
        let rc = unsafe { ibv_dereg_mr(self.raw.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_dereg_mr failed");
        }
        if self.owned {
            // SAFETY: we mmap'ed exactly this range in `allocate`; after
            // deregistration the device no longer accesses it.
            unsafe { libc::munmap(self.addr.as_ptr().cast(), self.len) };
        }
    }
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_slice_is_bounds_checked() {
        let r = RemoteRegion {
            addr: 0x1000,
            len: 100,
            rkey: 7,
        };
        assert_eq!(
            r.slice(10, 90).unwrap(),
            RemoteRegion {
                addr: 0x100a,
                len: 90,
                rkey: 7
            }
        );
        assert!(r.slice(10, 91).is_err());
        assert!(
            r.slice(u64::MAX, 2).is_err(),
            "offset + len overflow is an error, not a wrap"
        );
        assert_eq!(r.slice(100, 0).unwrap().len, 0);
    }

    #[test]
    fn access_flags_combine() {
        let f = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
        assert_eq!(f.bits(), 1 | 4);
        assert_eq!(AccessFlags::ALL_RMA.bits(), 1 | 2 | 4);
        assert_eq!(AccessFlags::default().bits(), 0);
    }
}
