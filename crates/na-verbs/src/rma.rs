//! RMA: put as RDMA WRITE, get as RDMA READ, between a local memory handle
//! (lkeys from the registration cache) and a peer's handle (addresses and
//! rkeys from its descriptor), any number of segments on either side.
//!
//! An operation becomes a list of work requests ([`plan`]): each one
//! targets one contiguous remote range (one rkey) and gathers or scatters
//! up to the device's SGE limit of local pieces; longer lists and remote
//! segment boundaries start a new work request, and no work request moves
//! more than the port's largest message.

use std::sync::Arc;

use na_core::rma::check_batch;
use na_core::{Completion, MemHandle, NaError, OpId, Result, Rma, RmaDir};

use crate::conn::{wr_id, ConnRef, ConnState, PendingWr, WrKind};
use crate::mem::MemReg;
use crate::plugin::VerbsPlugin;
use crate::sys::{RemoteRegion, SendOp, SendWr, Sge};
use crate::VerbsError;

/// A contiguous local piece inside registration `reg` of the handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LocalPiece {
    pub reg: usize,
    pub addr: u64,
    pub len: u64,
}

/// One work request: a remote range and the local pieces it moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WrPlan {
    pub remote: RemoteRegion,
    pub local: Vec<LocalPiece>,
}

/// Splits a transfer into work requests (see the module docs). Both lists
/// cover the same number of bytes; `max_sge` >= 1.
pub(crate) fn plan(
    local: &[LocalPiece],
    remote: &[RemoteRegion],
    max_sge: usize,
    max_bytes: u64,
) -> Vec<WrPlan> {
    let mut out = Vec::new();
    let (mut li, mut loff) = (0usize, 0u64);
    for r in remote {
        let mut roff = 0u64;
        while roff < r.len {
            let mut wr = WrPlan {
                remote: RemoteRegion {
                    addr: r.addr + roff,
                    len: 0,
                    rkey: r.rkey,
                },
                local: Vec::new(),
            };
            while roff < r.len && wr.local.len() < max_sge && wr.remote.len < max_bytes {
                let Some(l) = local.get(li) else { break };
                let n = (l.len - loff).min(r.len - roff).min(max_bytes - wr.remote.len);
                wr.local.push(LocalPiece {
                    reg: l.reg,
                    addr: l.addr + loff,
                    len: n,
                });
                loff += n;
                roff += n;
                wr.remote.len += n;
                if loff == l.len {
                    li += 1;
                    loff = 0;
                }
            }
            if wr.local.is_empty() {
                return out; // local side shorter than remote: caller bug, checked before
            }
            out.push(wr);
        }
    }
    out
}

/// An RMA operation in flight.
pub(crate) struct RmaOp {
    pub op: OpId,
    /// Which way the data goes (an exhaustive match: no other kind of
    /// operation can reach the work requests).
    pub dir: RmaDir,
    pub len: u64,
    pub remaining: u32,
    pub error: Option<NaError>,
    /// When it was canceled (it then ends as `Canceled`, whatever else
    /// happened to it).
    pub canceled: Option<std::time::Instant>,
    /// Declared (so dropped) before `_local`: the registration goes before
    /// the memory it covers can be freed.
    pub reg: Arc<MemReg>,
    /// Keeps the memory and its registrations alive until the device is done.
    pub _local: MemHandle,
}

/// Most work requests linked into one `ibv_post_send`.
const CHAIN_MAX: usize = 64;

/// Largest transfer of one work request (below every port's
/// max_msg_sz). Small enough that a connection moving data completes
/// work requests often: a cancel's deadline (`cancel.rs`) reads a
/// connection with no completion for `VerbsConfig::cancel_timeout` as
/// stuck, and 16 MiB take 5 s only below about 3 MB/s.
const MAX_WR_BYTES: u64 = 16 << 20;

/// A checked transfer of a batch, ready to queue.
struct Planned {
    op: OpId,
    dir: RmaDir,
    len: u64,
    /// Before `local`, as in [`RmaOp`].
    reg: Option<Arc<MemReg>>,
    local: MemHandle,
    plans: Vec<WrPlan>,
}

impl VerbsPlugin {
    /// Starts a batch of puts and gets to `dest`: checks and plans every
    /// transfer (registering local memory through the cache) before it
    /// queues any, then posts their work requests in one pass.
    pub(crate) fn rma_batch(&mut self, dest: &na_core::Addr, ops: &[Rma<'_>]) -> Result<()> {
        check_batch(ops)?;
        ops.iter().try_for_each(|o| self.check_new_op(o.op))?;
        if self.is_own(dest) {
            // A descriptor naming our own address: a copy in memory, after
            // checking it names memory we expose (never a loopback
            // connection, where the device checks only a guessable rkey).
            return self.rma_self(dest, ops);
        }
        if self.rd_initiator == 0 && ops.iter().any(|o| o.dir == RmaDir::Get && o.len > 0) {
            // The device reports max_qp_init_rd_atom 0: a read posted on
            // its QPs could never be issued.
            return Err(NaError::Unsupported {
                plugin: "verbs",
                op: "get on this device (its max_qp_init_rd_atom is 0: it cannot issue RDMA reads)",
            });
        }
        let peer = self.live_peer(dest)?;
        let planned = ops.iter().map(|r| self.plan_rma(r)).collect::<Result<Vec<_>>>()?;
        let cref = if planned.iter().any(|p| p.len > 0) {
            Some(self.ensure_conn(peer)?)
        } else {
            None
        };
        for p in planned {
            let (Some(cref), Some(reg)) = (cref, p.reg) else {
                self.completions.push_back(Completion::done(p.op, p.dir.kind()));
                continue;
            };
            let idx = self.rma_insert(RmaOp {
                op: p.op,
                dir: p.dir,
                len: p.len,
                remaining: p.plans.len() as u32,
                error: None,
                canceled: None,
                _local: p.local,
                reg,
            });
            self.ops.insert(p.op, crate::plugin::OpLoc::Rma(idx));
            self.stats.in_flight += 1;
            let conn = self
                .conn_mut(cref)
                .expect("ensure_conn returned a live connection");
            for plan in p.plans {
                conn.rma_backlog.push_back(PendingWr { rma: idx, plan });
            }
        }
        if let Some(cref) = cref {
            self.drain_rma(cref);
        }
        Ok(())
    }

    /// Turns one checked transfer into work requests; a zero-length one
    /// needs none (and no registration).
    fn plan_rma(&mut self, r: &Rma<'_>) -> Result<Planned> {
        let mut planned = Planned {
            op: r.op,
            dir: r.dir,
            len: r.len,
            local: r.local.clone(),
            reg: None,
            plans: Vec::new(),
        };
        if r.len == 0 {
            return Ok(planned);
        }
        let reg = self.registration(r.local)?;
        let mut pieces = Vec::new();
        let mut unregistered = false;
        r.local
            .for_each_piece(r.local_offset, r.len, |a, n| match reg.find(a, n) {
                Some(i) => pieces.push(LocalPiece {
                    reg: i,
                    addr: a as u64,
                    len: n as u64,
                }),
                None => unregistered = true,
            })?;
        if unregistered {
            return Err(NaError::Plugin {
                plugin: "verbs",
                message: "a local piece is not covered by the handle's registration".into(),
            });
        }
        let mut rpieces = Vec::new();
        // The key's low 32 bits are the rkey; the high ones are the
        // owner's secret, which only it checks (see `mem::exposed`).
        r.remote.for_each_piece(r.remote_offset, r.len, |seg, a, n| {
            rpieces.push(RemoteRegion {
                addr: a,
                len: n,
                rkey: seg.key as u32,
            })
        })?;
        let max_sge = match r.dir {
            RmaDir::Put => self.max_sge_write,
            RmaDir::Get => self.max_sge_read,
        };
        planned.plans = plan(&pieces, &rpieces, max_sge, MAX_WR_BYTES);
        planned.reg = Some(reg);
        Ok(planned)
    }

    fn rma_insert(&mut self, op: RmaOp) -> u32 {
        match self.rma_free.pop() {
            Some(i) => {
                self.rma[i as usize] = Some(op);
                i
            }
            None => {
                self.rma.push(Some(op));
                (self.rma.len() - 1) as u32
            }
        }
    }

    /// Posts queued RMA work requests while the send queue has room, and
    /// reads while the connection's read window has (`reads.rs`; always,
    /// where the device bounds them), in order, up to [`CHAIN_MAX`] per
    /// `ibv_post_send` (one doorbell for a batch).
    pub(crate) fn drain_rma(&mut self, cref: ConnRef) {
        loop {
            let Some(conn) = self.conn(cref) else { return };
            let room = conn.sq_cap.saturating_sub(conn.sq_used) as usize;
            if conn.state != ConnState::Established || room == 0 || conn.rma_backlog.is_empty() {
                return;
            }
            let take = self.rma_takeable(conn, room.min(CHAIN_MAX));
            if take == 0 {
                // The head is a read and the window is full: a read's
                // completion drains on. A peer that grants no reads at
                // all fails it, or it would wait for ever.
                if conn.reads.depth > 0 {
                    return;
                }
                let e = self.no_reads_error(cref);
                let conn = self.conn_mut(cref).expect("checked above");
                let w = conn.rma_backlog.pop_front().expect("checked above");
                self.rma_piece_done(w.rma, Some(e));
                continue;
            }
            let conn = self.conn_mut(cref).expect("checked above");
            let taken: Vec<PendingWr> = conn.rma_backlog.drain(..take).collect();
            // Work requests of finished operations are dropped. SGEs come
            // from the registration the operation was planned with, checked
            // again here (once per operation and drain): a request that
            // waited in the backlog while its pages were discarded or
            // remapped fails its operation instead of moving stale bytes.
            let mut ready = Vec::with_capacity(taken.len());
            let mut checked = None;
            for w in taken {
                let Some(rop) = self.rma.get(w.rma as usize).and_then(|o| o.as_ref()) else {
                    continue;
                };
                if rop.canceled.is_some() || rop.error.is_some() {
                    self.rma_piece_done(w.rma, None);
                    continue;
                }
                if checked != Some(w.rma) {
                    if let Err(e) = rop.reg.check_valid() {
                        self.rma_piece_done(w.rma, Some(e));
                        continue;
                    }
                    checked = Some(w.rma);
                }
                let sges: std::result::Result<Vec<Sge>, _> = w
                    .plan
                    .local
                    .iter()
                    .map(|p| rop.reg.sge(p.reg, p.addr, p.len))
                    .collect();
                let op = match rop.dir {
                    RmaDir::Put => SendOp::RdmaWrite(w.plan.remote),
                    RmaDir::Get => SendOp::RdmaRead(w.plan.remote),
                };
                match sges {
                    Ok(sges) => ready.push((w, sges, op)),
                    Err(e) => self.rma_piece_done(w.rma, Some(e.into())),
                }
            }
            if ready.is_empty() {
                continue;
            }
            let chain: Vec<SendWr> = ready
                .iter()
                .map(|(w, sges, op)| SendWr {
                    wr_id: wr_id(WrKind::Rma, cref, w.rma),
                    op: *op,
                    sges,
                    signaled: true,
                })
                .collect();
            self.stats.rma_calls += 1;
            let conn = self.conn_mut(cref).expect("checked above");
            let qp = conn.qp.as_ref().expect("established connections have a QP");
            let (posted, failed) = match qp.post_send_chain(&chain) {
                Ok(()) => (ready.len(), None),
                Err((at, e)) => (at, Some(e)),
            };
            drop(chain);
            let mut ready = ready.into_iter();
            for (w, _, op) in ready.by_ref().take(posted) {
                conn.sq_used += 1;
                *conn.rma_posted.entry(w.rma).or_default() += 1;
                if matches!(op, SendOp::RdmaRead(_)) {
                    conn.reads.posted_one();
                }
            }
            let Some(e) = failed else { continue };
            if matches!(e, VerbsError::PostUnsure { .. }) {
                // The provider did not say which one failed: those handed
                // to it were counted as posted. The rest go back to the
                // backlog, which the connection's death fails; its QP's
                // error state flushes what the device has (their
                // operations fail), and the flush grace ends the others
                // (`retire_if_flushed`).
                for (w, ..) in ready.rev() {
                    conn.rma_backlog.push_front(w);
                }
                self.kill_conn(
                    cref,
                    format!("posting RMA work requests failed: {}", na_core::ErrorChain(&e)),
                );
                return;
            }
            // The failed work request fails its operation; the ones after
            // it were not posted and go back, in order, to the backlog.
            let (bad, ..) = ready.next().expect("the failed work request is in the chain");
            for (w, ..) in ready.rev() {
                conn.rma_backlog.push_front(w);
            }
            self.rma_piece_done(bad.rma, Some(e.into()));
        }
    }

    /// One work request of RMA op `idx` finished (or will never be posted).
    pub(crate) fn rma_piece_done(&mut self, idx: u32, err: Option<NaError>) {
        let Some(slot) = self.rma.get_mut(idx as usize) else {
            return;
        };
        let Some(rop) = slot.as_mut() else { return };
        if let Some(e) = err {
            rop.error.get_or_insert(e);
        }
        rop.remaining = rop.remaining.saturating_sub(1);
        if rop.remaining > 0 {
            return;
        }
        let rop = slot.take().expect("checked above");
        self.rma_free.push(idx);
        self.ops.remove(&rop.op);
        self.stats.in_flight = self.stats.in_flight.saturating_sub(1);
        let c = match (rop.error, rop.canceled) {
            (_, Some(_)) => Completion::failed(rop.op, rop.dir.kind(), NaError::Canceled, None),
            (Some(e), None) => Completion::failed(rop.op, rop.dir.kind(), e, None),
            (None, None) => {
                match rop.dir {
                    RmaDir::Put => self.stats.put_bytes += rop.len,
                    RmaDir::Get => self.stats.get_bytes += rop.len,
                }
                Completion::done(rop.op, rop.dir.kind())
            }
        };
        self.completions.push_back(c);
    }

    /// Fails every queued piece of RMA ops on a dead connection.
    pub(crate) fn fail_rma_backlog(&mut self, cref: ConnRef, reason: &str) {
        let Some(conn) = self.conn_mut(cref) else { return };
        let pending: Vec<u32> = conn.rma_backlog.drain(..).map(|w| w.rma).collect();
        let peer = self.peer_uri_of(cref);
        for idx in pending {
            self.rma_piece_done(
                idx,
                Some(NaError::PeerGone {
                    peer: peer.clone(),
                    reason: reason.to_owned(),
                }),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(reg: usize, addr: u64, len: u64) -> LocalPiece {
        LocalPiece { reg, addr, len }
    }
    fn r(addr: u64, len: u64, rkey: u32) -> RemoteRegion {
        RemoteRegion { addr, len, rkey }
    }

    #[test]
    fn contiguous_is_one_work_request() {
        let p = plan(&[l(0, 100, 50)], &[r(1000, 50, 7)], 4, 1 << 30);
        assert_eq!(
            p,
            vec![WrPlan {
                remote: r(1000, 50, 7),
                local: vec![l(0, 100, 50)]
            }]
        );
    }

    #[test]
    fn remote_boundaries_and_sge_limit_split() {
        // Local: 5 pieces of 10; remote: 20 + 30. max_sge 2.
        let local: Vec<_> = (0..5).map(|i| l(i, 100 * i as u64, 10)).collect();
        let p = plan(&local, &[r(1000, 20, 1), r(5000, 30, 2)], 2, 1 << 30);
        let shape: Vec<_> = p
            .iter()
            .map(|w| (w.remote.addr, w.remote.len, w.local.len()))
            .collect();
        assert_eq!(shape, vec![(1000, 20, 2), (5000, 20, 2), (5020, 10, 1)]);
        assert_eq!(p[2].local, vec![l(4, 400, 10)]);
        // Every byte once, in order.
        let total: u64 = p.iter().flat_map(|w| &w.local).map(|x| x.len).sum();
        assert_eq!(total, 50);
    }

    #[test]
    fn local_piece_spanning_remote_segments_is_cut() {
        let p = plan(&[l(0, 0, 100)], &[r(10, 30, 1), r(90, 70, 2)], 8, 1 << 30);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].local, vec![l(0, 0, 30)]);
        assert_eq!(p[1].local, vec![l(0, 30, 70)]);
        assert_eq!(p[1].remote, r(90, 70, 2));
    }

    #[test]
    fn max_bytes_caps_a_work_request() {
        let p = plan(&[l(0, 0, 10)], &[r(0, 10, 1)], 8, 4);
        let lens: Vec<_> = p.iter().map(|w| (w.remote.addr, w.remote.len)).collect();
        assert_eq!(lens, vec![(0, 4), (4, 4), (8, 2)]);
    }
}
