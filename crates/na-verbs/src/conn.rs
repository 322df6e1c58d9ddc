//! One RC connection: its CM id, QP, registered message buffers, credits
//! and the sends waiting for credits or queue space.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use na_core::{BacklogTotal, MsgBuf, OpId, OpKind, SendBacklog, Tag};

use crate::credits::Credits;
use crate::error::Result;
use crate::reads::ReadWindow;
use crate::rma::WrPlan;
use crate::sys::{AccessFlags, CmId, MemoryRegion, ProtectionDomain, QueuePair, SendOp, Sge};
use crate::wire::{Header, MsgKind, HEADER_LEN};

/// Names a connection slot and its generation (so a completion of a retired
/// connection never reaches its successor in the same slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ConnRef {
    pub idx: u16,
    pub gen: u16,
}

/// What a work request was for, encoded in the top bits of its `wr_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WrKind {
    Recv = 0,
    Send = 1,
    Rma = 2,
}

const GEN_BITS: u32 = 14;
/// Generations wrap at this value.
pub(crate) const GEN_MASK: u16 = (1 << GEN_BITS) - 1;

/// `wr_id` = kind (2 bits) | generation (14) | connection slot (16) | index (32).
pub(crate) fn wr_id(kind: WrKind, conn: ConnRef, index: u32) -> u64 {
    (kind as u64) << 62 | u64::from(conn.gen & GEN_MASK) << 48 | u64::from(conn.idx) << 32 | u64::from(index)
}

/// Inverse of [`wr_id`].
pub(crate) fn split_wr_id(id: u64) -> (WrKind, ConnRef, u32) {
    let kind = match id >> 62 {
        0 => WrKind::Recv,
        1 => WrKind::Send,
        _ => WrKind::Rma,
    };
    let conn = ConnRef {
        idx: (id >> 32) as u16,
        gen: (id >> 48) as u16 & GEN_MASK,
    };
    (kind, conn, id as u32)
}

/// Connection life cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnState {
    /// Active side: resolving address, then route, then connecting.
    Connecting,
    /// Passive side: accepted, waiting for `Established`.
    Accepting,
    /// Sends may be posted.
    Established,
    /// Failed or disconnected: waiting for outstanding work requests to flush.
    Dead,
}

/// A message waiting for credits, a send buffer or queue space.
pub(crate) struct PendingSend {
    pub op: OpId,
    pub kind: OpKind,
    pub tag: Tag,
    /// Never [`Outgoing::Slice`]: a queued slice is copied into `Owned`.
    pub body: Outgoing<'static>,
}

/// What a send carries: the caller's bytes (copied into the send slot), or
/// a message buffer (sent from in place when it is registered, see
/// `msgbuf.rs`).
pub(crate) enum Outgoing<'a> {
    /// Borrowed from the caller (only until the send call returns).
    Slice(&'a [u8]),
    /// A copy of the caller's bytes, for the backlog.
    Owned(Vec<u8>),
    /// A plugin-provided message buffer.
    Buf(MsgBuf),
}

impl Outgoing<'_> {
    /// The payload.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Outgoing::Slice(d) => d,
            Outgoing::Owned(v) => v,
            Outgoing::Buf(b) => b.as_slice(),
        }
    }

    /// The same payload, owned (a slice is copied), for the backlog.
    pub fn into_owned(self) -> Outgoing<'static> {
        match self {
            Outgoing::Slice(d) => Outgoing::Owned(d.to_vec()),
            Outgoing::Owned(v) => Outgoing::Owned(v),
            Outgoing::Buf(b) => Outgoing::Buf(b),
        }
    }
}

/// A piece of an RMA operation waiting for send-queue space.
pub(crate) struct PendingWr {
    pub rma: u32,
    pub plan: WrPlan,
}

/// One connection.
pub(crate) struct Conn {
    pub id: Arc<CmId>,
    pub qp: Option<QueuePair>,
    /// `depth` receive slots, then `depth` send slots, `slot` bytes each.
    pub bufs: Option<MemoryRegion>,
    pub slot: usize,
    pub depth: u32,
    /// Peer index: the looked-up peer it was made for (active side), or
    /// the peer of its own made for it (passive side).
    pub peer: usize,
    pub active: bool,
    pub state: ConnState,
    pub dead_reason: String,
    pub dead_since: Option<Instant>,
    /// When it was started (active) or requested (passive): its set-up
    /// must end by `started + VerbsConfig::setup_timeout`.
    pub started: Instant,
    /// Unique per plugin for its lifetime: what outlives the connection
    /// (held messages) names it by this, since a slot's 14-bit generation
    /// can wrap.
    pub serial: u64,
    /// Killed for breaking the protocol: nothing more it sent is taken
    /// (after any other death, messages that completed are still
    /// delivered).
    pub violated: bool,
    pub credits: Credits,
    /// The peer's largest message payload, from its hello; `None` until
    /// the hello is known (the active side learns it at establishment).
    /// A hello's 0 is a size (the peer takes empty messages only), not
    /// "unknown".
    pub peer_max_msg: Option<usize>,
    pub free_send: Vec<u32>,
    /// Per send slot: the operation it carries (`None` for credit updates).
    pub send_ops: Vec<Option<(OpId, OpKind, usize)>>,
    /// Per send slot: the message buffer the device gathers the payload
    /// from, held until the send's work completion.
    pub send_bufs: Vec<Option<MsgBuf>>,
    pub sq_used: u32,
    pub sq_cap: u32,
    pub recvs_posted: u32,
    pub msg_backlog: SendBacklog<PendingSend>,
    pub rma_backlog: VecDeque<PendingWr>,
    /// Messages of this connection held for the application.
    pub held: u32,
    /// RMA work requests posted and not completed, per RMA operation.
    pub rma_posted: std::collections::HashMap<u32, u32>,
    /// The RDMA reads it may keep posted and those it has (see `reads.rs`).
    pub reads: ReadWindow,
    /// Send-queue work completions handled (sends and RMA): whether the
    /// device still moves this connection's work (see `cancel.rs`).
    pub sq_done: u64,
}

impl Conn {
    pub fn new(
        id: Arc<CmId>,
        peer: usize,
        active: bool,
        depth: u32,
        slot: usize,
        total: &BacklogTotal,
    ) -> Conn {
        Conn {
            id,
            qp: None,
            bufs: None,
            slot,
            depth,
            peer,
            active,
            state: if active {
                ConnState::Connecting
            } else {
                ConnState::Accepting
            },
            dead_reason: String::new(),
            dead_since: None,
            started: Instant::now(),
            serial: 0,
            violated: false,
            credits: Credits::new(0, depth),
            peer_max_msg: None,
            free_send: (0..depth).rev().collect(),
            send_ops: (0..depth).map(|_| None).collect(),
            send_bufs: (0..depth).map(|_| None).collect(),
            sq_used: 0,
            sq_cap: 0,
            recvs_posted: 0,
            msg_backlog: SendBacklog::new(total),
            rma_backlog: VecDeque::new(),
            held: 0,
            rma_posted: std::collections::HashMap::new(),
            reads: ReadWindow::default(),
            sq_done: 0,
        }
    }

    /// Registers the message buffers: `depth` receive and `depth` send slots.
    pub fn alloc_buffers(&mut self, pd: &Arc<ProtectionDomain>) -> Result<()> {
        let len = self.slot * self.depth as usize * 2;
        self.bufs = Some(MemoryRegion::allocate(pd, len, AccessFlags::LOCAL_WRITE)?);
        Ok(())
    }

    /// Work requests posted and not yet completed.
    pub fn outstanding(&self) -> u32 {
        self.recvs_posted + self.sq_used
    }

    /// Posts receive slot `i`.
    pub fn post_recv(&mut self, me: ConnRef, i: u32) -> Result<()> {
        let (Some(qp), Some(bufs)) = (&self.qp, &self.bufs) else {
            return Ok(());
        };
        let sge = bufs.sge(i as usize * self.slot, self.slot)?;
        qp.post_recv(wr_id(WrKind::Recv, me, i), &[sge])?;
        self.recvs_posted += 1;
        Ok(())
    }

    /// True if a message can be posted now.
    pub fn can_post_msg(&self, update: bool) -> bool {
        self.state == ConnState::Established
            && !self.free_send.is_empty()
            && self.sq_used < self.sq_cap
            && if update {
                self.credits.can_send_update()
            } else {
                self.credits.can_send_data()
            }
    }

    /// Posts a message from a send slot: the header and `data` copied into
    /// it, or, with `gather` (the registered bytes of `data`), only the
    /// header, the payload gathered from `gather`. Returns the slot. The
    /// caller checked [`can_post_msg`](Self::can_post_msg).
    pub fn post_msg(
        &mut self,
        me: ConnRef,
        kind: MsgKind,
        tag: Tag,
        data: &[u8],
        gather: Option<Sge>,
        op: Option<(OpId, OpKind)>,
    ) -> Result<u32> {
        let slot = self.free_send.pop().expect("caller checked a free send slot");
        let credits = self.credits.spend();
        let header = Header {
            kind,
            credits,
            tag,
            len: data.len() as u32,
        };
        let off = (self.depth + slot) as usize * self.slot;
        let res = (|| {
            let (Some(qp), Some(bufs)) = (&self.qp, &self.bufs) else {
                unreachable!("established connections have a QP and buffers")
            };
            bufs.write_at(off, &header.encode())?;
            let id = wr_id(WrKind::Send, me, slot);
            match gather {
                Some(payload) => {
                    let head = bufs.sge(off, HEADER_LEN)?;
                    qp.post_send(id, SendOp::Send, &[head, payload], true)
                }
                None => {
                    bufs.write_at(off + HEADER_LEN, data)?;
                    let sge = bufs.sge(off, HEADER_LEN + data.len())?;
                    qp.post_send(id, SendOp::Send, &[sge], true)
                }
            }
        })();
        match res {
            Ok(()) => {
                self.sq_used += 1;
                self.send_ops[slot as usize] = op.map(|(o, k)| (o, k, data.len()));
                Ok(slot)
            }
            Err(e) => {
                self.free_send.push(slot);
                self.credits.unspend(credits);
                Err(e)
            }
        }
    }

    /// Copies `len` payload bytes of receive slot `i` into `out` (replacing its contents).
    pub fn read_payload(&self, i: u32, len: usize, out: &mut Vec<u8>) -> Result<()> {
        out.clear();
        out.resize(len, 0);
        match &self.bufs {
            Some(b) => b.read_at(i as usize * self.slot + HEADER_LEN, out),
            None => Ok(()),
        }
    }

    /// The header bytes of receive slot `i`.
    pub fn read_header(&self, i: u32) -> Result<[u8; HEADER_LEN]> {
        let mut h = [0u8; HEADER_LEN];
        if let Some(b) = &self.bufs {
            b.read_at(i as usize * self.slot, &mut h)?;
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_ids_roundtrip() {
        for (kind, idx, gen, i) in [
            (WrKind::Recv, 0u16, 0u16, 0u32),
            (WrKind::Send, 65535, GEN_MASK, u32::MAX),
            (WrKind::Rma, 7, 1234, 99),
        ] {
            let c = ConnRef { idx, gen };
            assert_eq!(split_wr_id(wr_id(kind, c, i)), (kind, c, i));
        }
    }
}
