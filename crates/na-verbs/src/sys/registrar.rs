//! The `ibv_reg_mr` registrar of the registration cache (`na-regcache`):
//! every cache miss becomes an `ibv_reg_mr(3)`, every eviction or
//! invalidation an `ibv_dereg_mr(3)`.

use std::ptr::NonNull;
use std::sync::Arc;

use na_regcache::{Access, Registrar};

use super::{AccessFlags, MemoryRegion, ProtectionDomain};
use crate::error::VerbsError;

/// Registers memory with `ibv_reg_mr` on one protection domain.
///
/// `na_regcache::Access` uses the bit values of `ibv_access_flags`
/// (`LOCAL_WRITE` 1, `REMOTE_WRITE` 2, `REMOTE_READ` 4, `REMOTE_ATOMIC` 8),
/// so access rights pass through unchanged.
pub struct IbvRegistrar {
    pd: Arc<ProtectionDomain>,
}

impl IbvRegistrar {
    /// A registrar for arbitrary memory ranges.
    ///
    /// # Safety
    /// Every range later passed to [`Registrar::register`] (directly or
    /// through a cache) must be memory that the process accesses only by
    /// raw copies (never through `&`/`&mut` references) while a registration
    /// of it lives, because the device and, with remote access rights,
    /// peers may read and write it at any time. Unmapping or remapping the
    /// range is allowed: the registration keeps the old pages pinned, and
    /// the cache's monitor is what notices that they are no longer the
    /// ones mapped there.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub unsafe fn new(pd: &Arc<ProtectionDomain>) -> IbvRegistrar {
        IbvRegistrar { pd: Arc::clone(pd) }
    }

    /// A registrar used only for the segments of `na_core::MemHandle`s:
    /// owned heap buffers that are only ever accessed by copies
    /// (`MemHandle::read_at`/`write_at`), which is the contract of [`new`](Self::new).
    pub(crate) fn for_mem_handles(pd: &Arc<ProtectionDomain>) -> IbvRegistrar {
        IbvRegistrar { pd: Arc::clone(pd) }
    }
}

impl Registrar for IbvRegistrar {
    type Region = MemoryRegion;
    type Error = VerbsError;

    fn register(&self, addr: usize, len: usize, access: Access) -> Result<MemoryRegion, VerbsError> {
        let start = NonNull::new(addr as *mut u8).ok_or_else(|| VerbsError::InvalidArgument {
            op: "ibv_reg_mr",
            reason: "NULL address".into(),
        })?;
        // SAFETY: the contract of `IbvRegistrar::new` (or, for
        // `for_mem_handles`, MemHandle's copy-only access) is exactly the
        // one `MemoryRegion::register` states; `ibv_reg_mr` itself checks
        // that the range is mapped and fails with EFAULT otherwise.
        unsafe { MemoryRegion::register(&self.pd, start, len, AccessFlags::from_bits(access.bits())) }
    }

    fn deregister(&self, region: MemoryRegion) -> Result<(), VerbsError> {
        // ibv_dereg_mr runs in MemoryRegion's Drop (and logs a failure).
        drop(region);
        Ok(())
    }
}
