//! The RDMA read depth of a connection: how many of its gets' reads may
//! be outstanding at the peer at once.
//!
//! The depth is negotiated at connect. The active side asks for its
//! initiator depth (`VerbsPlugin::rd_initiator`); the passive side grants
//! it at most the responder resources the peer offers and its own device
//! and configuration allow, and RDMA CM programs both QPs with the
//! grant. Each side learns the depth once the connection is established
//! ([`VerbsPlugin::learn_read_depth`]): the least of what it asked for or
//! granted itself, what the accept said (active side), and what the
//! device reports for the QP (`ibv_query_qp`, `max_rd_atomic`).
//!
//! The device keeps no more reads outstanding than the QP's
//! `max_rd_atomic`: reads posted beyond it wait in the send queue until
//! earlier ones complete. Where that is at most the negotiated depth
//! (the usual case), every read is posted at once and the device bounds
//! them, so a batch of gets still goes out in linked lists of 64. Where
//! the device set the QP above the depth (soft-RoCE rounds a depth up to
//! a power of two: 3 becomes 4), or the query failed, the plugin bounds
//! them itself: it keeps no more than the depth posted, and the rest
//! wait in the connection's RMA backlog, in order, posted as reads
//! complete (they never fail for it). A peer that grants no reads at all
//! fails a get with `NaError::Unsupported` (the device would hold it for
//! ever).

use na_core::{NaError, RmaDir};

use crate::conn::{Conn, ConnRef};
use crate::plugin::VerbsPlugin;

/// The RDMA reads of one connection: how many may be outstanding at the
/// peer, whether the device bounds them, how many are posted and the
/// most that ever were at once. For tests (`VerbsPlugin::debug_reads`,
/// only with the `test-hooks` feature).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadWindow {
    /// Reads that may be outstanding at once: what the connection asked
    /// for (active side) or granted itself (passive side) until it is
    /// established, then what was negotiated.
    pub depth: u32,
    /// The QP's `max_rd_atomic` as the device reported it once the
    /// connection was established (`None` before, or if the query failed).
    pub qp_depth: Option<u32>,
    /// Reads posted and not completed.
    pub posted: u32,
    /// The most reads that were posted at once (more than `depth` only
    /// where the device bounds them, see [`device_bounds`](Self::device_bounds)).
    pub peak: u32,
}

impl ReadWindow {
    /// A connection that may post `depth` reads at once.
    pub(crate) fn new(depth: u8) -> ReadWindow {
        ReadWindow {
            depth: u32::from(depth),
            ..ReadWindow::default()
        }
    }

    /// Whether the device keeps the reads outstanding within the depth by
    /// itself (the QP's `max_rd_atomic` is at most the depth), so all may
    /// be posted at once. Never with a depth of 0: those reads could
    /// never be issued.
    pub fn device_bounds(&self) -> bool {
        self.depth > 0 && self.qp_depth.is_some_and(|q| q <= self.depth)
    }

    /// Reads that may be posted now.
    pub(crate) fn room(&self) -> u32 {
        if self.device_bounds() {
            u32::MAX
        } else {
            self.depth.saturating_sub(self.posted)
        }
    }

    /// A read was posted.
    pub(crate) fn posted_one(&mut self) {
        self.posted += 1;
        self.peak = self.peak.max(self.posted);
    }

    /// A posted read completed (successfully or not).
    pub(crate) fn completed_one(&mut self) {
        self.posted = self.posted.saturating_sub(1);
    }
}

impl VerbsPlugin {
    /// Connection `cref` is established: its read depth becomes the least
    /// of what it asked for or granted, `granted` (the active side: the
    /// peer's responder resources from its accept, peer-controlled, so it
    /// can only lower the depth) and the QP's `max_rd_atomic` as the
    /// device reports it, which is kept to tell whether the device bounds
    /// the reads ([`ReadWindow::device_bounds`]).
    pub(crate) fn learn_read_depth(&mut self, cref: ConnRef, granted: Option<u8>) {
        let peer = self.peer_uri_of(cref);
        let Some(conn) = self.conn_mut(cref) else { return };
        let asked = conn.reads.depth;
        let mut depth = granted.map_or(asked, |g| asked.min(u32::from(g)));
        let qp = match conn.qp.as_ref().map(|qp| qp.read_depths()) {
            Some(Ok(d)) => Some(u32::from(d.initiator)),
            Some(Err(e)) => {
                tracing::warn!(%peer, error = %na_core::ErrorChain(&e), "verbs: reading the QP's read depth failed; the plugin bounds reads itself");
                None
            }
            None => None,
        };
        if let Some(q) = qp {
            depth = depth.min(q);
        }
        conn.reads.depth = depth;
        conn.reads.qp_depth = qp;
        let device_bounds = conn.reads.device_bounds();
        tracing::debug!(%peer, asked, ?granted, ?qp, depth, device_bounds, "verbs: read depth");
    }

    /// How many work requests at the head of `conn`'s RMA backlog may be
    /// posted now, at most `max`: the reads among them fit the
    /// connection's read window (any number where the device bounds them).
    pub(crate) fn rma_takeable(&self, conn: &Conn, max: usize) -> usize {
        let mut reads = conn.reads.room();
        let mut n = 0;
        for w in conn.rma_backlog.iter().take(max) {
            let is_get = self
                .rma
                .get(w.rma as usize)
                .and_then(Option::as_ref)
                .is_some_and(|r| r.dir == RmaDir::Get);
            if is_get {
                if reads == 0 {
                    break;
                }
                reads -= 1;
            }
            n += 1;
        }
        n
    }

    /// The error of a get on a connection whose peer grants no reads.
    pub(crate) fn no_reads_error(&self, cref: ConnRef) -> NaError {
        tracing::debug!(peer = %self.peer_uri_of(cref), "verbs: a get to a peer that grants no RDMA reads");
        NaError::Unsupported {
            plugin: "verbs",
            op: "get from this peer (it grants no RDMA reads: its responder resources are 0)",
        }
    }

    /// The read window of the connection operations on `peer` go
    /// through, if it has one. For tests: the depth a connection
    /// negotiated and how many reads it kept posted. Only with the
    /// `test-hooks` feature.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn debug_reads(&self, peer: &na_core::Addr) -> Option<ReadWindow> {
        let p = self.peer_of(peer).ok()?;
        let c = self.peers.get(p)?.conn?;
        Some(self.conn(c)?.reads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_counts_posted_reads_and_their_peak() {
        let mut w = ReadWindow::new(2);
        assert_eq!(w.room(), 2);
        w.posted_one();
        w.posted_one();
        assert_eq!((w.room(), w.posted, w.peak), (0, 2, 2));
        w.completed_one();
        assert_eq!((w.room(), w.posted, w.peak), (1, 1, 2));
        w.completed_one();
        w.completed_one();
        assert_eq!(w.posted, 0, "a stray completion does not wrap");
        assert_eq!(ReadWindow::new(0).room(), 0);
    }

    #[test]
    fn only_a_qp_within_the_depth_lets_the_device_bound_reads() {
        let with = |depth, qp_depth| ReadWindow {
            depth,
            qp_depth,
            posted: 2,
            peak: 2,
        };
        assert_eq!(with(2, Some(2)).room(), u32::MAX, "the device keeps 2");
        assert_eq!(with(2, Some(1)).room(), u32::MAX, "the device keeps 1");
        assert_eq!(with(3, Some(4)).room(), 1, "rounded up: the plugin keeps 3");
        assert_eq!(with(3, None).room(), 1, "not known: the plugin keeps 3");
        assert_eq!(with(0, Some(0)).room(), 0, "no reads at all");
    }
}
