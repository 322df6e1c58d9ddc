//! Connections through RDMA CM: started lazily by the first operation on a
//! peer (active side) or by a peer's connect request (passive side), and
//! torn down when the peer disconnects, dies, or a work request fails.
//!
//! Active: `resolve_addr` → `AddrResolved` → `resolve_route` →
//! `RouteResolved` → create QP, post receives, `connect(hello)` →
//! `Established` (the accept carries the peer's hello: its credits).
//! Passive (module `accept`): `ConnectRequest(hello)` → a new peer of the connection's own
//! (its address shows what the hello names, but no lookup finds it) →
//! create QP, post receives, `accept(hello)` → `Established`, or the first
//! message from the peer, whichever comes first (`establish_by_message`).
//!
//! So every connection is its peer's only one: a looked-up peer's is the
//! active one we made to the listener at its address, an incoming
//! connection's peer is that connection. A hello's address is a claim
//! checked only up to its IP (RDMA CM connects from an ephemeral port), and
//! a claim never routes anyone else's traffic: a process on the same IP
//! that names another's listen address gets a peer of its own, which
//! replies reach and nothing else.
//! A dead connection moves its QP to ERROR so every outstanding work
//! request flushes, and is released once none is left.

use std::sync::Arc;
use std::time::{Duration, Instant};

use na_core::{NaError, Result};

use crate::accept::REJECT_BAD_HELLO;
use crate::conn::{Conn, ConnRef, ConnState, GEN_MASK};
use crate::plugin::{ConnSlot, VerbsPlugin};
use crate::reads::ReadWindow;
use crate::sys::{CmEvent, CmEventKind, CmId, ConnParam, PortSpace, QpCaps, QpInitAttr};
use crate::wire::reject_reason;
use crate::wire::{Hello, HELLO_VERSION};
use crate::VerbsError;

/// How long a dead connection may wait for its flushed work requests.
const FLUSH_GRACE: Duration = Duration::from_secs(5);

/// When dead connection `c` is released whether or not its flushed work
/// requests completed (see `retire_if_flushed`): its flush grace's end.
fn flush_deadline(c: &Conn) -> Option<Instant> {
    c.dead_since?.checked_add(FLUSH_GRACE)
}

impl VerbsPlugin {
    fn hello(&self) -> Hello {
        Hello {
            addr: self.self_key,
            depth: self.cfg.recv_depth,
            max_payload: self.cfg.max_msg_size as u32,
            device: self.device.clone(),
        }
    }

    pub(crate) fn conn_param(&self, initiator: u8, responder: u8) -> ConnParam {
        ConnParam {
            private_data: self.hello().encode(),
            responder_resources: responder,
            initiator_depth: initiator,
            retry_count: 7,
            // Credits make receiver-not-ready impossible; an RNR NAK is a bug
            // and must fail loudly, not be retried.
            rnr_retry_count: 0,
            qp_num: 0,
        }
    }

    /// Connections in the table: live ones and dead ones still flushing.
    pub(crate) fn conns_held(&self) -> usize {
        self.conns.iter().filter(|s| s.conn.is_some()).count()
    }

    /// Adds a connection to the table.
    pub(crate) fn insert_conn(&mut self, id: Arc<CmId>, peer: usize, active: bool) -> Result<ConnRef> {
        let live = self.conns_held();
        if live >= self.conn_limit {
            return Err(NaError::Plugin {
                plugin: "verbs",
                message: format!(
                    "connection limit of {} reached (VerbsConfig::max_conns, or what the device's CQ holds)",
                    self.conn_limit
                ),
            });
        }
        let idx = match self.conns.iter().position(|s| s.conn.is_none()) {
            Some(i) => i,
            None => {
                self.conns.push(ConnSlot { gen: 0, conn: None });
                self.conns.len() - 1
            }
        };
        let slot = &mut self.conns[idx];
        slot.gen = (slot.gen + 1) & GEN_MASK;
        let cref = ConnRef {
            idx: idx as u16,
            gen: slot.gen,
        };
        self.conn_by_cm.insert(id.key(), cref);
        self.peers.acquire(peer);
        self.next_conn_serial += 1;
        let mut conn = Conn::new(
            id,
            peer,
            active,
            u32::from(self.cfg.recv_depth),
            self.slot_size,
            &self.backlog_total,
        );
        conn.serial = self.next_conn_serial;
        // What the active side asks for; the passive side grants at most
        // this (`on_connect_request`); both learn the outcome on
        // establishment (`learn_read_depth`).
        conn.reads = ReadWindow::new(self.rd_initiator);
        // A timeout beyond the clock's range is no deadline.
        let due = conn.started.checked_add(self.cfg.setup_timeout);
        slot.conn = Some(conn);
        if let Some(due) = due {
            self.arm_deadline(due);
        }
        Ok(cref)
    }

    /// Arms the deadline timer for `due` unless an earlier deadline is due.
    pub(crate) fn arm_deadline(&mut self, due: Instant) {
        if self.next_deadline.is_none_or(|t| due < t) {
            self.set_deadline_timer(Some(due));
        }
    }

    /// Records `at` as the next deadline and arms the timer for it.
    fn set_deadline_timer(&mut self, at: Option<Instant>) {
        self.next_deadline = at;
        if let Err(e) = self.deadline_timer.set(at) {
            // `next_deadline` is still checked whenever the plugin is
            // driven; only a sleeper is not woken for it.
            tracing::warn!(error = %na_core::ErrorChain(&e), "verbs: setting the deadline timer failed");
        }
    }

    /// Acts on the deadlines that have come (set-ups, see `sweep_setups`;
    /// cancels, see `sweep_cancels`), then arms the timer for the next one
    /// of those, of the dead connections' flush grace and of the dead
    /// peers' held messages, so that a sleeping process acts on each in
    /// time. Called right after [`reap_dead`](Self::reap_dead), which acts
    /// on the last two. Costs a clock read until the timer's time has come.
    pub(crate) fn sweep_deadlines(&mut self) {
        let now = Instant::now();
        if self.next_deadline.is_none_or(|t| t > now) {
            return;
        }
        self.deadline_timer.clear();
        let setup = self.sweep_setups(now);
        let cancel = self.sweep_cancels(now);
        let next = [
            setup,
            cancel,
            self.next_flush_deadline(),
            self.matching.held_sweep_at,
        ]
        .into_iter()
        .flatten()
        .min();
        self.set_deadline_timer(next);
    }

    /// When the earliest dead connection still waiting for its flush
    /// completions is released anyway (see `retire_if_flushed`).
    fn next_flush_deadline(&self) -> Option<Instant> {
        self.conns_with_refs()
            .filter_map(|(_, c)| flush_deadline(c))
            .min()
    }

    /// Tears down the connections whose set-up outlived
    /// `VerbsConfig::setup_timeout` (a peer that stopped answering the
    /// handshake); returns the next set-up deadline.
    fn sweep_setups(&mut self, now: Instant) -> Option<Instant> {
        let limit = self.cfg.setup_timeout;
        let mut next: Option<Instant> = None;
        let mut late = Vec::new();
        for (cref, c) in self.conns_with_refs() {
            if !matches!(c.state, ConnState::Connecting | ConnState::Accepting) {
                continue;
            }
            let Some(due) = c.started.checked_add(limit) else {
                continue;
            };
            if due <= now {
                late.push((cref, c.active));
            } else {
                next = Some(next.map_or(due, |n| n.min(due)));
            }
        }
        for (cref, active) in late {
            let peer = self.peer_uri_of(cref);
            if active {
                tracing::warn!(%peer, timeout = ?limit, "verbs: connection set-up timed out");
            } else if self.stats.refuse_handshake() {
                tracing::warn!(%peer, timeout = ?limit, "verbs: an incoming connection's set-up timed out");
            }
            self.kill_conn(
                cref,
                format!("the connection's set-up did not finish within {limit:?} (the peer stopped answering the handshake)"),
            );
        }
        next
    }

    /// The connection sends to `peer` go through, starting one if needed
    /// (a looked-up peer only: an incoming connection's peer has no other
    /// connection than the one it came on).
    pub(crate) fn ensure_conn(&mut self, peer: usize) -> Result<ConnRef> {
        if let Some(c) = self.peers[peer].conn {
            if self.conn(c).is_some_and(|c| c.state != ConnState::Dead) {
                return Ok(c);
            }
        }
        if self.peers[peer].incoming {
            // Its connection's death marks it dead (`kill_conn`), so this
            // is only a safeguard: never dial the address a hello claimed.
            return Err(NaError::PeerGone {
                peer: self.peers[peer].uri.clone(),
                reason: "the connection it came on is gone (look its address up to connect to it)".into(),
            });
        }
        let id = CmId::new(&self.events, PortSpace::Tcp)?;
        let dst = self.peers[peer].key;
        let src = std::net::SocketAddr::new(self.self_key.ip(), 0);
        id.resolve_addr(Some(src), dst, self.cfg.resolve_timeout_ms)?;
        let cref = self.insert_conn(id, peer, true)?;
        self.peers[peer].conn = Some(cref);
        tracing::debug!(peer = %self.peers[peer].uri, "verbs: connecting");
        Ok(cref)
    }

    /// Creates the QP and buffers of a connection and posts all receives.
    pub(crate) fn setup_qp(&mut self, cref: ConnRef) -> std::result::Result<(), VerbsError> {
        let caps = QpCaps {
            max_send_wr: self.cfg.send_queue_depth.min(self.dev_attr.max_qp_wr),
            max_recv_wr: u32::from(self.cfg.recv_depth),
            max_send_sge: self.max_sge_write.max(self.max_sge_read) as u32,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let (pd, cq) = (Arc::clone(&self.pd), Arc::clone(&self.cq));
        let conn = self.conn_mut(cref).expect("caller checked");
        let attr = QpInitAttr {
            send_cq: &cq,
            recv_cq: &cq,
            srq: None,
            caps,
        };
        let qp = conn.id.create_qp(&pd, attr)?;
        // The provider may round the queue up; the CQ was sized for the
        // configured depth, so never use more.
        conn.sq_cap = qp.caps().max_send_wr.min(caps.max_send_wr);
        conn.qp = Some(qp);
        conn.alloc_buffers(&pd)?;
        for i in 0..conn.depth {
            conn.post_recv(cref, i)?;
        }
        Ok(())
    }

    /// Handles one RDMA CM event.
    pub(crate) fn on_cm_event(&mut self, ev: CmEvent) {
        if ev.kind == CmEventKind::ConnectRequest {
            self.on_connect_request(ev);
            return;
        }
        let Some(&cref) = self.conn_by_cm.get(&ev.id) else {
            tracing::debug!(event = %ev.kind.name(), "verbs: CM event for no connection");
            return;
        };
        let step = match ev.kind {
            CmEventKind::AddrResolved => self
                .conn(cref)
                .map_or(Ok(()), |c| c.id.resolve_route(self.cfg.resolve_timeout_ms)),
            CmEventKind::RouteResolved => self.setup_qp(cref).and_then(|()| {
                let param = self.conn_param(self.rd_initiator, self.rd_responder);
                self.conn(cref).map_or(Ok(()), |c| c.id.connect(&param))
            }),
            CmEventKind::Established => {
                // Test hook (`VerbsConfig::debug`, `ignore_established`).
                let ignored = self
                    .cfg
                    .debug
                    .ignores_established(|| self.conn(cref).is_some_and(|c| !c.active));
                if !ignored {
                    // On the active side the event carries the accept:
                    // the reads the peer grants us (its responder
                    // resources; the kernel's CM reports them from our
                    // side, as our initiator depth).
                    self.on_established(cref, &ev.private_data, Some(ev.initiator_depth));
                }
                Ok(())
            }
            CmEventKind::Disconnected => {
                // What the peer sent before it went may sit in the CQ still:
                // take it while the connection is live (its receives are
                // matched as usual), then kill it.
                if let Err(e) = self.poll_cq() {
                    tracing::warn!(error = %na_core::ErrorChain(&e), "verbs: polling the CQ before a disconnect failed");
                }
                self.kill_conn(cref, "the peer disconnected".into());
                Ok(())
            }
            CmEventKind::TimewaitExit | CmEventKind::ConnectResponse => Ok(()),
            kind => {
                let what = match (kind, ev.status) {
                    (CmEventKind::Rejected, _) => match reject_reason(&ev.private_data) {
                        // What a listener of hello version 1 says to ours.
                        Some(why @ REJECT_BAD_HELLO) => format!(
                            "connection rejected (status {}): the listener says: {why} (a listener of another \
                             build: this one speaks verbs hello version {HELLO_VERSION}, which version 1 refuses)",
                            ev.status
                        ),
                        Some(why) => format!("connection rejected (status {}): the listener says: {why}", ev.status),
                        None => format!(
                            "connection rejected (status {}): nobody listens at this address, or it refused us",
                            ev.status
                        ),
                    },
                    (CmEventKind::Unreachable, _) => "peer unreachable (connection timed out)".into(),
                    _ => format!("{} (status {})", kind.name(), ev.status),
                };
                self.kill_conn(cref, what);
                Ok(())
            }
        };
        if let Err(e) = step {
            self.kill_conn(
                cref,
                format!("connection set-up failed: {}", na_core::ErrorChain(&e)),
            );
        }
    }

    /// Connection `cref` is established: `private` is the accept's private
    /// data and `granted` its grant of reads (both for the active side).
    fn on_established(&mut self, cref: ConnRef, private: &[u8], granted: Option<u8>) {
        let Some(conn) = self.conn_mut(cref) else { return };
        if conn.state == ConnState::Dead {
            // Killed while connecting (a violation, a failed receive): an
            // establishment arriving after that must not revive it.
            return;
        }
        if conn.state == ConnState::Established {
            // The event of a passive connection its first message
            // established already (`establish_by_message`).
            return;
        }
        if conn.active {
            match Hello::decode(private) {
                Ok(h) => {
                    conn.credits.peer_ready(u32::from(h.depth));
                    conn.peer_max_msg = Some(h.max_payload as usize);
                }
                Err(e) => return self.violation(cref, format!("bad hello in the accept: {e}")),
            }
        }
        let active = conn.active;
        self.learn_read_depth(cref, granted.filter(|_| active));
        let conn = self.conn_mut(cref).expect("checked above");
        conn.state = ConnState::Established;
        tracing::debug!(peer = %self.peer_uri_of(cref), "verbs: connection established");
        self.drain_msgs(cref);
        self.drain_rma(cref);
    }

    /// Passive side: a message arrived on `cref` while it waits for
    /// `Established`. The QP has been ready since `rdma_accept` and the
    /// peer sends only once its side is established, so the connection is
    /// in use: it is established now, and RDMA CM is told so
    /// (`rdma_notify`). Without this, a lost or late ready-to-use message
    /// (RTU) would hold every reply until the CM's retries brought the
    /// event (seconds each), or the set-up deadline tore a working
    /// connection down.
    pub(crate) fn establish_by_message(&mut self, cref: ConnRef) {
        let Some(conn) = self.conn(cref) else { return };
        if conn.active || conn.state != ConnState::Accepting {
            return;
        }
        // CM events are read every few progress calls, receives on every
        // one: usually the CM has the RTU and only its event is unread.
        match conn.id.notify_established() {
            Ok(true) => tracing::debug!(
                peer = %self.peer_uri_of(cref),
                "verbs: a message came before the RTU: established by it, RDMA CM told"
            ),
            Ok(false) => {}
            // Our side stands (the QP works: a message came through); the
            // CM may still report the set-up failed later.
            Err(e) => tracing::warn!(
                peer = %self.peer_uri_of(cref),
                error = %na_core::ErrorChain(&e),
                "verbs: telling RDMA CM that a connection is in use failed"
            ),
        }
        self.on_established(cref, &[], None);
    }

    /// Marks a connection dead: fails what waits on it, flushes its QP;
    /// its peer is gone too (a peer has this one connection, which
    /// carries its sends).
    pub(crate) fn kill_conn(&mut self, cref: ConnRef, reason: String) {
        let Some(conn) = self.conn_mut(cref) else { return };
        if conn.state == ConnState::Dead {
            return;
        }
        conn.state = ConnState::Dead;
        conn.dead_since = Some(Instant::now());
        conn.dead_reason = reason.clone();
        if let Some(qp) = &conn.qp {
            let _ = qp.to_error();
        }
        // A passive connection accepted and not yet established (RDMA CM
        // cannot disconnect it) ends with the reject the kernel's CM sends
        // as its id is destroyed, which carries no reason. Rejecting it
        // here with ours (`rdma_reject` after `rdma_accept`) would tell
        // the peer why, but the kernel then leaves its reply (REP) MAD
        // outstanding, and destroying either side's id blocks until that
        // times out: 75 s in the soft-RoCE VM (2026-11-29), in the
        // middle of `progress`.
        let _ = conn.id.disconnect();
        let backlog: Vec<_> = conn.msg_backlog.drain().collect();
        let peer = conn.peer;
        let uri = self.peers[peer].uri.clone();
        tracing::debug!(peer = %uri, %reason, "verbs: connection dead");
        for m in backlog {
            // Canceled queued messages left the backlog (`cancel_op`).
            debug_assert!(!self.canceled_sends.contains_key(&m.op));
            let e = NaError::PeerGone {
                peer: uri.clone(),
                reason: reason.clone(),
            };
            self.finish_send(m.op, m.kind, Err(e));
            self.drop_outgoing(m.body);
        }
        self.fail_rma_backlog(cref, &reason);
        if self.peers[peer].dead.is_none() {
            // A peer has no connection but this one (an incoming one's
            // peer is its own; a looked-up peer's is the one we made): the
            // peer is gone with it, and a later lookup connects afresh.
            self.peers.mark_dead(peer, &reason);
            self.schedule_held_sweep();
            self.fail_peer_recvs(peer, &reason);
        }
        self.retire_if_flushed(cref);
        // Still here: it waits for its flush completions, at most the
        // grace, which the timer keeps while the process sleeps.
        if let Some(due) = self.conn(cref).and_then(flush_deadline) {
            self.arm_deadline(due);
        }
    }

    /// Releases a dead connection once its work requests have all
    /// completed (or the grace period is over).
    pub(crate) fn retire_if_flushed(&mut self, cref: ConnRef) {
        let Some(conn) = self.conn(cref) else { return };
        let expired = flush_deadline(conn).is_some_and(|t| Instant::now() >= t);
        if conn.state != ConnState::Dead || (conn.outstanding() > 0 && !expired) {
            return;
        }
        let mut conn = self.conns[cref.idx as usize].conn.take().expect("checked above");
        self.conn_by_cm.remove(&conn.id.key());
        // The QP goes before anything completes: an operation completed
        // here hands its memory back to the application, and a device
        // still working on a QP whose grace ran out must not reach it.
        drop(conn.qp.take());
        // Sends that never completed (grace expired) complete now.
        for (op, kind, _) in conn.send_ops.iter().flatten() {
            let e = NaError::PeerGone {
                peer: self.peers[conn.peer].uri.clone(),
                reason: conn.dead_reason.clone(),
            };
            self.finish_send(*op, *kind, Err(e));
        }
        let uri = self.peers[conn.peer].uri.clone();
        for (&idx, &n) in &conn.rma_posted {
            for _ in 0..n {
                let e = NaError::PeerGone {
                    peer: uri.clone(),
                    reason: conn.dead_reason.clone(),
                };
                self.rma_piece_done(idx, Some(e));
            }
        }
        self.peers.release(conn.peer);
        drop(conn);
    }

    /// Retires dead connections whose grace period is over.
    pub(crate) fn reap_dead(&mut self) {
        self.sweep_dead_held();
        let dead: Vec<ConnRef> = self
            .conns_with_refs()
            .filter_map(|(r, c)| (c.state == ConnState::Dead).then_some(r))
            .collect();
        for c in dead {
            self.retire_if_flushed(c);
        }
    }
}
