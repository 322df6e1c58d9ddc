//! A heap buffer registered for sends only (`ibv_reg_mr(3)` with no access
//! flags: the device may read it, and only while a send work request that
//! names it is outstanding; no peer can reach it).

use std::ptr::NonNull;
use std::sync::Arc;

use super::mr::{AccessFlags, MemoryRegion, ProtectionDomain, Sge};
use crate::error::Result;

/// Heap memory plus its registration; what the plugin's message buffers
/// ([`na_core::MsgBuf`]) are made of.
pub struct SendBuffer {
    // Field order matters: the registration is dropped before the memory.
    mr: MemoryRegion,
    mem: Box<[u8]>,
}

impl SendBuffer {
    /// Allocates and registers `len` bytes (at least one) in `pd`.
    pub fn new(pd: &Arc<ProtectionDomain>, len: usize) -> Result<SendBuffer> {
        let mut mem = vec![0u8; len.max(1)].into_boxed_slice();
        let addr = NonNull::from(&mut mem[0]);
        // SAFETY: `mem` moves into the returned value, which drops it after
        // `mr` (field order), so it stays allocated while it is registered
        // (moving a Box does not move its heap bytes). Without access flags
        // the device only reads it, while a send naming it is outstanding;
        // the plugin owns the buffer for that whole time and writes nothing,
        // so no `&mut` to it exists while the device reads.
        let mr = unsafe { MemoryRegion::register(pd, addr, mem.len(), AccessFlags::from_bits(0)) }?;
        Ok(SendBuffer { mr, mem })
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.mem
    }

    /// The bytes, writable (only while no send of them is outstanding,
    /// which the plugin's ownership of posted buffers guarantees).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.mem
    }

    /// The scatter/gather entry of the first `len` bytes.
    pub fn sge(&self, len: usize) -> Result<Sge> {
        self.mr.sge(0, len)
    }

    /// The protection domain it is registered in.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        self.mr.pd()
    }
}
