//! Work requests on an RC queue pair: `ibv_post_send(3)` (one or a linked
//! list, one doorbell), `ibv_post_recv(3)`.
//!
//! SGEs are passed to the provider as they are: [`Sge`] has the layout of
//! `struct ibv_sge`, and providers only read the array during the call.

use rdma_sys::*;

use super::{errno_rc, QueuePair, RemoteRegion, Sge};
use crate::error::{Result, VerbsError};

// `Sge` is passed to the provider as an `ibv_sge` array: same layout.
const _: () = assert!(std::mem::size_of::<Sge>() == std::mem::size_of::<ibv_sge>());
const _: () = assert!(std::mem::align_of::<Sge>() == std::mem::align_of::<ibv_sge>());

/// The operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided SEND (consumes a receive at the peer).
    Send,
    /// SEND with 32-bit immediate data.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    SendWithImm(u32),
    /// RDMA WRITE of the SGEs into the remote region.
    RdmaWrite(RemoteRegion),
    /// RDMA WRITE with immediate (consumes a receive at the peer).
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    RdmaWriteWithImm(RemoteRegion, u32),
    /// RDMA READ of the remote region into the SGEs.
    RdmaRead(RemoteRegion),
}

/// One send work request of [`QueuePair::post_send_chain`].
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    /// Returned in the work completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local memory (registered), gathered or scattered in order.
    pub sges: &'a [Sge],
    /// Ask for a completion on success (errors always complete).
    pub signaled: bool,
}

impl QueuePair {
    fn check_sges(&self, op: &'static str, sges: &[Sge], max: u32) -> Result<()> {
        if sges.len() > max as usize {
            return Err(VerbsError::InvalidArgument {
                op,
                reason: format!("{} SGEs, the QP allows {max}", sges.len()),
            });
        }
        Ok(())
    }

    /// Posts one send work request (`ibv_post_send`); `signaled` asks for a
    /// completion on success (errors always complete).
    pub fn post_send(&self, wr_id: u64, op: SendOp, sges: &[Sge], signaled: bool) -> Result<()> {
        let wr = SendWr {
            wr_id,
            op,
            sges,
            signaled,
        };
        self.post_send_chain(&[wr]).map_err(|(_, e)| e)
    }

    /// Posts a list of send work requests with one `ibv_post_send` (one
    /// doorbell). On failure the chain stopped at work request `i` of the
    /// error: those before it were posted (and will complete), `i` and those
    /// after it were not. That holds for both kinds of failure: the provider
    /// refusing work request `i`, and our own check of `i`'s arguments (the
    /// valid ones before it are still posted, so the caller's count of what
    /// will complete is right either way). Except with
    /// [`VerbsError::PostUnsure`] (the provider did not say which one
    /// failed): then `i` is the number of work requests handed to the
    /// provider, any of which may have been posted.
    pub fn post_send_chain(&self, list: &[SendWr<'_>]) -> std::result::Result<(), (usize, VerbsError)> {
        let mut wrs = Vec::with_capacity(list.len());
        let mut invalid = None;
        for (i, w) in list.iter().enumerate() {
            match self.send_wr(w) {
                Ok(wr) => wrs.push(wr),
                Err(e) => {
                    invalid = Some((i, e));
                    break;
                }
            }
        }
        if !wrs.is_empty() {
            self.post_linked(&mut wrs, list)?;
        }
        invalid.map_or(Ok(()), Err)
    }

    /// Links `wrs` (built from the first `wrs.len()` entries of `list`) and
    /// posts them; on failure, the index of the first one not posted.
    fn post_linked(
        &self,
        wrs: &mut [ibv_send_wr],
        list: &[SendWr<'_>],
    ) -> std::result::Result<(), (usize, VerbsError)> {
        let base = wrs.as_mut_ptr();
        for i in 1..wrs.len() {
            // SAFETY: `i - 1` and `i` are in bounds of `wrs`, which is not
            // resized while `base` is in use; only raw pointers touch it here.
            unsafe { (*base.add(i - 1)).next = base.add(i) };
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is live; the linked work requests and their SGE
        // arrays outlive the call (the provider copies them); SGEs name
        // registered memory (see the module docs of `sys` for why device
        // access to it is sound).
        let rc = unsafe { ibv_post_send(self.as_ptr(), base, &mut bad) };
        errno_rc(rc).map_err(|source| {
            let Some(at) = chain_index(bad as usize, base as usize, wrs.len()) else {
                // Taking it for the first (none posted) would post the
                // others again, and complete operations whose work the
                // device may still do.
                let e = VerbsError::PostUnsure {
                    op: "ibv_post_send",
                    qpn: self.qp_num(),
                    count: wrs.len(),
                    source,
                };
                return (wrs.len(), e);
            };
            let e = VerbsError::Post {
                op: "ibv_post_send",
                qpn: self.qp_num(),
                wr_id: list[at].wr_id,
                source,
            };
            (at, e)
        })
    }

    /// Builds the `ibv_send_wr` of one work request (unlinked).
    fn send_wr(&self, w: &SendWr<'_>) -> Result<ibv_send_wr> {
        let (wr_id, op, sges, signaled) = (w.wr_id, w.op, w.sges, w.signaled);
        self.check_sges("post_send", sges, self.caps().max_send_sge)?;
        let total: u64 = sges.iter().map(|s| u64::from(s.length)).sum();
        // SAFETY: ibv_send_wr is plain old data (pointers and integers); zero is valid.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        // The provider only reads the SGE array; `Sge` has the layout of `ibv_sge`.
        wr.sg_list = sges.as_ptr().cast_mut().cast();
        wr.num_sge = sges.len() as libc::c_int;
        wr.send_flags = if signaled {
            ibv_send_flags::IBV_SEND_SIGNALED.0
        } else {
            0
        };
        let remote = |r: RemoteRegion| -> Result<rdma_t> {
            if total > r.len {
                return Err(VerbsError::InvalidArgument {
                    op: "post_send",
                    reason: format!(
                        "{total} bytes of SGEs exceed the remote region of {} bytes",
                        r.len
                    ),
                });
            }
            Ok(rdma_t {
                remote_addr: r.addr,
                rkey: r.rkey,
            })
        };
        use ibv_wr_opcode::*;
        match op {
            SendOp::Send => wr.opcode = IBV_WR_SEND,
            SendOp::SendWithImm(imm) => {
                wr.opcode = IBV_WR_SEND_WITH_IMM;
                wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            }
            SendOp::RdmaWrite(r) => {
                wr.opcode = IBV_WR_RDMA_WRITE;
                wr.wr.rdma = remote(r)?;
            }
            SendOp::RdmaWriteWithImm(r, imm) => {
                wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
                wr.wr.rdma = remote(r)?;
                wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            }
            SendOp::RdmaRead(r) => {
                wr.opcode = IBV_WR_RDMA_READ;
                wr.wr.rdma = remote(r)?;
            }
        }
        Ok(wr)
    }

    /// Posts one receive work request (`ibv_post_recv`).
    pub fn post_recv(&self, wr_id: u64, sges: &[Sge]) -> Result<()> {
        self.check_sges("post_recv", sges, self.caps().max_recv_sge)?;
        let mut wr = ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: sges.as_ptr().cast_mut().cast(),
            num_sge: sges.len() as libc::c_int,
        };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: as in `post_send`; receive buffers are registered memory.
        errno_rc(unsafe { ibv_post_recv(self.as_ptr(), &mut wr, &mut bad) }).map_err(|source| {
            VerbsError::Post {
                op: "ibv_post_recv",
                qpn: self.qp_num(),
                wr_id,
                source,
            }
        })
    }
}

/// The index of the work request at address `bad` in a chain of `len`
/// starting at `base`; `None` if `bad` is none of them (null, outside the
/// chain, or inside one).
fn chain_index(bad: usize, base: usize, len: usize) -> Option<usize> {
    let size = std::mem::size_of::<ibv_send_wr>();
    let d = bad.checked_sub(base)?;
    (d % size == 0 && d / size < len).then_some(d / size)
}

#[cfg(test)]
mod tests {
    use super::chain_index;

    #[test]
    fn only_a_work_request_of_the_chain_names_where_it_stopped() {
        let size = std::mem::size_of::<rdma_sys::ibv_send_wr>();
        let base = 0x1000;
        assert_eq!(chain_index(base, base, 3), Some(0));
        assert_eq!(chain_index(base + 2 * size, base, 3), Some(2));
        assert_eq!(chain_index(0, base, 3), None, "no bad_wr");
        assert_eq!(chain_index(base + 3 * size, base, 3), None, "past the chain");
        assert_eq!(chain_index(base - size, base, 3), None, "before the chain");
        assert_eq!(chain_index(base + size + 8, base, 3), None, "inside one");
    }
}
