//! Plugin-provided message buffers ([`na_core::msgbuf`]): heap buffers
//! registered once with the protection domain and reused. A message built
//! in one is sent without a copy: the send gathers two entries, the 16-byte
//! header from the connection's send slot and the payload from the buffer,
//! which arrive contiguous in the peer's receive slot. The plugin holds the
//! buffer until the send's work completion, then puts it back in its pool.

use std::any::Any;
use std::sync::Arc;

use na_core::msgbuf::check_buf_size;
use na_core::{MsgBuf, MsgMemory, Result};

use crate::plugin::VerbsPlugin;
use crate::sys::{SendBuffer, Sge};

/// Free buffers kept at most; more are deregistered.
const POOL_KEEP: usize = 256;

/// The memory of a registered message buffer.
struct Registered(SendBuffer);

impl MsgMemory for Registered {
    fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.bytes_mut()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Registered buffers not in use.
#[derive(Default)]
pub(crate) struct BufPool {
    free: Vec<MsgBuf>,
}

impl VerbsPlugin {
    /// A registered buffer of the plugin's message size (recycled when one
    /// is free). If registration fails (locked-memory limit), a heap buffer:
    /// its sends are copied, as with a slice.
    pub(crate) fn alloc_buf(&mut self, size: usize) -> Result<MsgBuf> {
        let max = self.cfg.max_msg_size;
        check_buf_size(size, max)?;
        if let Some(b) = self.bufs.free.pop() {
            return Ok(b);
        }
        match SendBuffer::new(&self.pd, max) {
            Ok(sb) => Ok(MsgBuf::from_memory(Box::new(Registered(sb)))),
            Err(e) => {
                tracing::debug!(error = %na_core::ErrorChain(&e), "registering a message buffer failed: heap buffer (copied on send)");
                Ok(MsgBuf::heap(max))
            }
        }
    }

    /// The gather entry for the message in `buf`, if the buffer is one of
    /// ours (same protection domain) and the device gathers two entries.
    pub(crate) fn registered_sge(&self, buf: &MsgBuf) -> Option<Sge> {
        let r = buf.memory().as_any().downcast_ref::<Registered>()?;
        if !Arc::ptr_eq(r.0.pd(), &self.pd) || self.max_sge_write < 2 || buf.is_empty() {
            return None;
        }
        r.0.sge(buf.len()).ok()
    }

    /// Takes a buffer back once no send uses it.
    pub(crate) fn recycle_buf(&mut self, mut buf: MsgBuf) {
        let ours = buf
            .memory()
            .as_any()
            .downcast_ref::<Registered>()
            .is_some_and(|r| Arc::ptr_eq(r.0.pd(), &self.pd));
        if ours && self.bufs.free.len() < POOL_KEEP {
            buf.clear();
            self.bufs.free.push(buf);
        }
    }
}
