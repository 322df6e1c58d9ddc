//! Work requests on an RC queue pair: `ibv_post_send(3)`, `ibv_post_recv(3)`.
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
    SendWithImm(u32),
    /// RDMA WRITE of the SGEs into the remote region.
    RdmaWrite(RemoteRegion),
    /// RDMA WRITE with immediate (consumes a receive at the peer).
    RdmaWriteWithImm(RemoteRegion, u32),
    /// RDMA READ of the remote region into the SGEs.
    RdmaRead(RemoteRegion),
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
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is live; `wr` and the SGE array outlive the call (the
        // provider copies them); SGEs name registered memory (see the module
        // docs of `sys` for why device access to it is sound).
        errno_rc(unsafe { ibv_post_send(self.as_ptr(), &mut wr, &mut bad) }).map_err(|source| {
            VerbsError::Post {
                op: "ibv_post_send",
                qpn: self.qp_num(),
                wr_id,
                source,
            }
        })
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
