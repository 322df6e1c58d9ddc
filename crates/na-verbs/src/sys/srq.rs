//! Shared receive queues: `ibv_create_srq(3)`, `ibv_post_srq_recv(3)`.
//!
//! One SRQ can feed the receives of many QPs, so a plugin with many
//! connections pre-posts one pool of buffers instead of one per connection.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::*;

use super::{errno_rc, null_error, ProtectionDomain, Sge};
use crate::error::{Result, VerbsError};

/// A shared receive queue (`struct ibv_srq`); holds its PD alive.
pub struct SharedReceiveQueue {
    raw: NonNull<ibv_srq>,
    max_wr: u32,
    max_sge: u32,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: ibv_post_srq_recv is thread-safe in libibverbs providers; the
// pointer is only used through libibverbs.
unsafe impl Send for SharedReceiveQueue {}
// SAFETY: see `Send`.
unsafe impl Sync for SharedReceiveQueue {}

impl SharedReceiveQueue {
    /// Creates an SRQ with room for `max_wr` receives of up to `max_sge` SGEs.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn new(pd: &Arc<ProtectionDomain>, max_wr: u32, max_sge: u32) -> Result<Arc<SharedReceiveQueue>> {
        let mut attr = ibv_srq_init_attr {
            srq_context: std::ptr::null_mut(),
            attr: ibv_srq_attr {
                max_wr,
                max_sge,
                srq_limit: 0,
            },
        };
        // SAFETY: the PD is live; `attr` is a valid in/out pointer.
        let raw = unsafe { ibv_create_srq(pd.as_ptr(), &mut attr) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::Create {
            op: "ibv_create_srq",
            context: format!("max_wr {max_wr}, max_sge {max_sge}"),
            source: null_error(),
        })?;
        Ok(Arc::new(SharedReceiveQueue {
            raw,
            max_wr: attr.attr.max_wr,
            max_sge: attr.attr.max_sge,
            _pd: Arc::clone(pd),
        }))
    }

    pub(crate) fn as_ptr(&self) -> *mut ibv_srq {
        self.raw.as_ptr()
    }

    /// Receives the SRQ can hold (as granted by the device).
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn max_wr(&self) -> u32 {
        self.max_wr
    }

    /// Posts one receive (`ibv_post_srq_recv`).
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn post_recv(&self, wr_id: u64, sges: &[Sge]) -> Result<()> {
        if sges.len() > self.max_sge as usize {
            return Err(VerbsError::InvalidArgument {
                op: "SharedReceiveQueue::post_recv",
                reason: format!("{} SGEs, the SRQ allows {}", sges.len(), self.max_sge),
            });
        }
        let mut wr = ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: sges.as_ptr().cast_mut().cast(),
            num_sge: sges.len() as libc::c_int,
        };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the SRQ is live; the provider only reads `wr` and the SGE
        // array (same layout as ibv_sge) during the call; SGEs name registered memory.
        errno_rc(unsafe { ibv_post_srq_recv(self.raw.as_ptr(), &mut wr, &mut bad) }).map_err(|source| {
            VerbsError::Post {
                op: "ibv_post_srq_recv",
                qpn: 0,
                wr_id,
                source,
            }
        })
    }
}

impl Drop for SharedReceiveQueue {
    fn drop(&mut self) {
        // SAFETY: every QP using the SRQ holds an Arc to it, so none is left;
        // destroyed exactly once.
        let rc = unsafe { ibv_destroy_srq(self.raw.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_srq failed");
        }
    }
}
