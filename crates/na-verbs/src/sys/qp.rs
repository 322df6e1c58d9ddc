//! Reliable-connected queue pairs: `ibv_create_qp(3)`, `ibv_modify_qp(3)`,
//! `ibv_query_qp(3)`, `ibv_post_send(3)`, `ibv_post_recv(3)`.
//!
//! A QP is created either directly ([`QueuePair::new_rc`]; the caller drives
//! the state machine RESET → INIT → RTR → RTS with the `to_*` methods and an
//! out-of-band exchange of QP numbers and GIDs) or through RDMA CM
//! ([`super::CmId::create_qp`]; librdmacm drives the transitions on connect
//! and accept). Posting work requests is in `wr.rs`.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::*;

use super::{
    errno_rc, null_error, AccessFlags, CmId, CompletionQueue, Gid, ProtectionDomain, SharedReceiveQueue,
};
use crate::error::{Result, VerbsError};

/// Queue sizes of a QP (`struct ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send work requests.
    pub max_send_wr: u32,
    /// Outstanding receive work requests (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// SGEs per send work request.
    pub max_send_sge: u32,
    /// SGEs per receive work request.
    pub max_recv_sge: u32,
    /// Largest inline send.
    pub max_inline_data: u32,
}

/// What a new QP is attached to.
#[derive(Clone, Copy)]
pub struct QpInitAttr<'a> {
    /// CQ for send completions.
    pub send_cq: &'a Arc<CompletionQueue>,
    /// CQ for receive completions.
    pub recv_cq: &'a Arc<CompletionQueue>,
    /// Receive from this SRQ instead of a private receive queue.
    pub srq: Option<&'a Arc<SharedReceiveQueue>>,
    /// Requested sizes (the device may round them up).
    pub caps: QpCaps,
}

impl QpInitAttr<'_> {
    pub(crate) fn to_raw(self) -> ibv_qp_init_attr {
        ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: self.send_cq.as_ptr(),
            recv_cq: self.recv_cq.as_ptr(),
            srq: self.srq.map_or(std::ptr::null_mut(), |s| s.as_ptr()),
            cap: ibv_qp_cap {
                max_send_wr: self.caps.max_send_wr,
                max_recv_wr: self.caps.max_recv_wr,
                max_send_sge: self.caps.max_send_sge,
                max_recv_sge: self.caps.max_recv_sge,
                max_inline_data: self.caps.max_inline_data,
            },
            qp_type: ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        }
    }
}

/// QP states (`enum ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Just created.
    Reset,
    /// Initialised: receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained.
    Sqd,
    /// Send queue error.
    Sqe,
    /// Error: all outstanding work requests complete with a flush error.
    Error,
    /// A value this crate does not know.
    Unknown(u32),
}

impl QpState {
    fn from_raw(s: u32) -> QpState {
        use ibv_qp_state::*;
        match s {
            IBV_QPS_RESET => QpState::Reset,
            IBV_QPS_INIT => QpState::Init,
            IBV_QPS_RTR => QpState::Rtr,
            IBV_QPS_RTS => QpState::Rts,
            IBV_QPS_SQD => QpState::Sqd,
            IBV_QPS_SQE => QpState::Sqe,
            IBV_QPS_ERR => QpState::Error,
            o => QpState::Unknown(o),
        }
    }
}

/// Parameters of the INIT → RTR transition (connect to a remote QP).
#[derive(Debug, Clone, Copy)]
pub struct RtrAttr {
    /// Remote QP number.
    pub dest_qp_num: u32,
    /// Remote's initial send PSN.
    pub rq_psn: u32,
    /// Path MTU in bytes (256, 512, 1024, 2048 or 4096).
    pub path_mtu: u32,
    /// Remote GID (RoCE: the peer's IPv4-mapped GID).
    pub dgid: Gid,
    /// Local GID index to send from.
    pub sgid_index: u8,
    /// Local port.
    pub port: u8,
    /// Outstanding RDMA READs the remote may issue to us.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
}

/// Parameters of the RTR → RTS transition.
#[derive(Debug, Clone, Copy)]
pub struct RtsAttr {
    /// Initial send PSN (must equal the remote's `rq_psn`).
    pub sq_psn: u32,
    /// Local ACK timeout code (4.096 µs × 2^timeout).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// Outstanding RDMA READs we may issue.
    pub max_rd_atomic: u8,
}

/// How many RDMA reads (and atomics) a QP has in flight at most, each
/// way (`max_rd_atomic` and `max_dest_rd_atomic` of `struct ibv_qp_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadDepths {
    /// Reads we may have outstanding at the peer (`max_rd_atomic`).
    pub initiator: u8,
    /// Reads of the peer we serve at once (`max_dest_rd_atomic`).
    pub responder: u8,
}

enum Owner {
    /// Created with ibv_create_qp; destroyed with ibv_destroy_qp.
    Verbs,
    /// Created with rdma_create_qp on this id; destroyed with rdma_destroy_qp.
    Cm(Arc<CmId>),
}

/// An RC queue pair (`struct ibv_qp`); holds its PD, CQs and SRQ alive.
pub struct QueuePair {
    raw: NonNull<ibv_qp>,
    caps: QpCaps,
    owner: Owner,
    _pd: Arc<ProtectionDomain>,
    _send_cq: Arc<CompletionQueue>,
    _recv_cq: Arc<CompletionQueue>,
    _srq: Option<Arc<SharedReceiveQueue>>,
}

// SAFETY: posting and modifying a QP are thread-safe in libibverbs (providers
// lock per queue); the pointer is only used through libibverbs.
unsafe impl Send for QueuePair {}
// SAFETY: see `Send`.
unsafe impl Sync for QueuePair {}

fn caps_from_raw(c: &ibv_qp_cap) -> QpCaps {
    QpCaps {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

fn mtu_code(bytes: u32) -> Result<u32> {
    use ibv_mtu::*;
    Ok(match bytes {
        256 => IBV_MTU_256,
        512 => IBV_MTU_512,
        1024 => IBV_MTU_1024,
        2048 => IBV_MTU_2048,
        4096 => IBV_MTU_4096,
        _ => {
            return Err(VerbsError::InvalidArgument {
                op: "QueuePair::to_rtr",
                reason: format!("path MTU {bytes} is not one of 256, 512, 1024, 2048, 4096"),
            })
        }
    })
}

impl QueuePair {
    /// Creates an RC QP on `pd` (`ibv_create_qp`), in state RESET.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn new_rc(pd: &Arc<ProtectionDomain>, attr: QpInitAttr<'_>) -> Result<QueuePair> {
        let mut raw_attr = attr.to_raw();
        // SAFETY: PD and CQs (and SRQ) are live; `raw_attr` is a valid in/out pointer.
        let raw = unsafe { ibv_create_qp(pd.as_ptr(), &mut raw_attr) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::Create {
            op: "ibv_create_qp",
            context: format!("RC {:?}", attr.caps),
            source: null_error(),
        })?;
        Ok(Self::wrap(
            raw,
            caps_from_raw(&raw_attr.cap),
            Owner::Verbs,
            pd,
            attr,
        ))
    }

    /// Wraps a QP that `rdma_create_qp` created on `id`.
    pub(crate) fn from_cm(
        raw: NonNull<ibv_qp>,
        caps: &ibv_qp_cap,
        id: Arc<CmId>,
        pd: &Arc<ProtectionDomain>,
        attr: QpInitAttr<'_>,
    ) -> QueuePair {
        Self::wrap(raw, caps_from_raw(caps), Owner::Cm(id), pd, attr)
    }

    fn wrap(
        raw: NonNull<ibv_qp>,
        caps: QpCaps,
        owner: Owner,
        pd: &Arc<ProtectionDomain>,
        attr: QpInitAttr<'_>,
    ) -> QueuePair {
        QueuePair {
            raw,
            caps,
            owner,
            _pd: Arc::clone(pd),
            _send_cq: Arc::clone(attr.send_cq),
            _recv_cq: Arc::clone(attr.recv_cq),
            _srq: attr.srq.cloned(),
        }
    }

    pub(crate) fn as_ptr(&self) -> *mut ibv_qp {
        self.raw.as_ptr()
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: `raw` is live; qp_num is immutable after creation.
        unsafe { (*self.raw.as_ptr()).qp_num }
    }

    /// The actual queue sizes granted by the device.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// The attributes `mask` selects, from the device (`ibv_query_qp`);
    /// the others are zero.
    fn query(&self, mask: ibv_qp_attr_mask) -> Result<ibv_qp_attr> {
        // SAFETY: both structs are plain old data; all-zero is valid.
        let (mut a, mut init): (ibv_qp_attr, ibv_qp_init_attr) = unsafe { std::mem::zeroed() };
        // SAFETY: the QP is live and both out-pointers are valid for the
        // call; the provider writes only inside them.
        errno_rc(unsafe { ibv_query_qp(self.raw.as_ptr(), &mut a, mask.0 as libc::c_int, &mut init) })
            .map_err(|source| VerbsError::Query {
                op: "ibv_query_qp",
                context: format!("qpn {}", self.qp_num()),
                source,
            })?;
        Ok(a)
    }

    /// Current state, from the device (`ibv_query_qp`).
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn state(&self) -> Result<QpState> {
        Ok(QpState::from_raw(
            self.query(ibv_qp_attr_mask::IBV_QP_STATE)?.qp_state,
        ))
    }

    /// The read depths the QP runs with, from the device (`ibv_query_qp`
    /// of `IBV_QP_MAX_QP_RD_ATOMIC` and `IBV_QP_MAX_DEST_RD_ATOMIC`): on a
    /// connection RDMA CM set up, the values negotiated at connect, as
    /// the device applied them (some round them to a power of two).
    pub fn read_depths(&self) -> Result<ReadDepths> {
        use ibv_qp_attr_mask as M;
        let a = self.query(M::IBV_QP_MAX_QP_RD_ATOMIC | M::IBV_QP_MAX_DEST_RD_ATOMIC)?;
        Ok(ReadDepths {
            initiator: a.max_rd_atomic,
            responder: a.max_dest_rd_atomic,
        })
    }

    pub(crate) fn modify(&self, to: &'static str, a: &mut ibv_qp_attr, mask: ibv_qp_attr_mask) -> Result<()> {
        // SAFETY: the QP is live and `a` is a valid attribute block for `mask`.
        errno_rc(unsafe { ibv_modify_qp(self.raw.as_ptr(), a, mask.0 as libc::c_int) }).map_err(|source| {
            VerbsError::ModifyQp {
                qpn: self.qp_num(),
                to,
                source,
            }
        })
    }

    /// RESET → INIT on `port`, granting peers `access` (remote read/write).
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn to_init(&self, port: u8, access: AccessFlags) -> Result<()> {
        // SAFETY: plain old data; all-zero is valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = port;
        a.qp_access_flags = access.bits();
        use ibv_qp_attr_mask as M;
        self.modify(
            "INIT",
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
        )
    }

    /// INIT → RTR: connect the receive side to the remote QP.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn to_rtr(&self, r: &RtrAttr) -> Result<()> {
        // SAFETY: plain old data; all-zero is valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = mtu_code(r.path_mtu)?;
        a.dest_qp_num = r.dest_qp_num;
        a.rq_psn = r.rq_psn;
        a.max_dest_rd_atomic = r.max_dest_rd_atomic;
        a.min_rnr_timer = r.min_rnr_timer;
        a.ah_attr.is_global = 1;
        a.ah_attr.port_num = r.port;
        a.ah_attr.grh.dgid = ibv_gid { raw: r.dgid.0 };
        a.ah_attr.grh.sgid_index = r.sgid_index;
        a.ah_attr.grh.hop_limit = 64;
        use ibv_qp_attr_mask as M;
        let mask = M::IBV_QP_STATE
            | M::IBV_QP_AV
            | M::IBV_QP_PATH_MTU
            | M::IBV_QP_DEST_QPN
            | M::IBV_QP_RQ_PSN
            | M::IBV_QP_MAX_DEST_RD_ATOMIC
            | M::IBV_QP_MIN_RNR_TIMER;
        self.modify("RTR", &mut a, mask)
    }

    /// RTR → RTS: enable the send side.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn to_rts(&self, r: &RtsAttr) -> Result<()> {
        // SAFETY: plain old data; all-zero is valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = r.sq_psn;
        a.timeout = r.timeout;
        a.retry_cnt = r.retry_cnt;
        a.rnr_retry = r.rnr_retry;
        a.max_rd_atomic = r.max_rd_atomic;
        use ibv_qp_attr_mask as M;
        let mask = M::IBV_QP_STATE
            | M::IBV_QP_SQ_PSN
            | M::IBV_QP_TIMEOUT
            | M::IBV_QP_RETRY_CNT
            | M::IBV_QP_RNR_RETRY
            | M::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify("RTS", &mut a, mask)
    }

    /// Any state → ERROR: outstanding work requests complete with a flush error.
    pub fn to_error(&self) -> Result<()> {
        // SAFETY: plain old data; all-zero is valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        self.modify("ERROR", &mut a, ibv_qp_attr_mask::IBV_QP_STATE)
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        match &self.owner {
            Owner::Verbs => {
                // SAFETY: we created the QP with ibv_create_qp; destroyed once.
                let rc = unsafe { ibv_destroy_qp(self.raw.as_ptr()) };
                if rc != 0 {
                    tracing::warn!(rc, qpn = self.qp_num(), "ibv_destroy_qp failed");
                }
            }
            // SAFETY: the QP was created by rdma_create_qp on this id, which
            // is still alive (we hold an Arc); rdma_destroy_qp frees it once.
            Owner::Cm(id) => unsafe { rdma_destroy_qp(id.as_ptr()) },
        }
    }
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.qp_num())
            .field("caps", &self.caps)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_codes() {
        assert_eq!(mtu_code(256).unwrap(), ibv_mtu::IBV_MTU_256);
        assert_eq!(mtu_code(4096).unwrap(), ibv_mtu::IBV_MTU_4096);
        for bad in [0, 255, 1000, 8192] {
            assert!(
                matches!(mtu_code(bad), Err(VerbsError::InvalidArgument { .. })),
                "{bad}"
            );
        }
    }
}
