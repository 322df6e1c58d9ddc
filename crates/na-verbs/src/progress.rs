//! Progress: completions from the CQ, RDMA CM events, and the "may I
//! block?" check (see the call order in `plugin.rs`).

use std::io;

use na_core::{NaError, Result, RmaDir};

use crate::conn::{split_wr_id, ConnRef, ConnState, WrKind};
use crate::plugin::{VerbsPlugin, CM_POLL_EVERY};
use crate::sys::{WcOpcode, WorkCompletion};
use crate::wire::Header;

/// `IBV_WC_WR_FLUSH_ERR`: the QP went to ERROR before the work request ran.
const WC_FLUSH: u32 = 5;
/// `IBV_WC_REM_ACCESS_ERR`: bad rkey or range at the peer.
const WC_REM_ACCESS: u32 = 10;
/// `IBV_WC_RETRY_EXC_ERR`: the peer stopped acknowledging.
const WC_RETRY_EXC: u32 = 12;
/// `IBV_WC_RNR_RETRY_EXC_ERR`: the peer had no receive posted.
const WC_RNR: u32 = 13;

impl VerbsPlugin {
    pub(crate) fn progress_inner(&mut self) -> Result<usize> {
        self.armed = false;
        let before = self.completions.len();
        self.calls = self.calls.wrapping_add(1);
        self.poll_cq()?;
        if self.calls.is_multiple_of(CM_POLL_EVERY) {
            self.poll_cm()?;
            self.reap_dead();
            self.sweep_deadlines();
        }
        Ok(self.completions.len().saturating_sub(before))
    }

    pub(crate) fn try_wait_inner(&mut self) -> Result<bool> {
        if !self.completions.is_empty() {
            return Ok(false);
        }
        self.comp.consume_events()?;
        let mut wcs = std::mem::take(&mut self.wcs);
        wcs.clear();
        let armed = self.cq.arm_and_drain(&mut wcs);
        self.handle_wcs(&wcs);
        self.wcs = wcs;
        let n = armed?;
        let cm = self.poll_cm()?;
        self.reap_dead();
        self.sweep_deadlines();
        let idle = n == 0 && cm == 0 && self.completions.is_empty();
        self.armed = idle;
        Ok(idle)
    }

    /// Polls the CQ until it is empty (bounded per call). Completions a
    /// failing poll took off the CQ before it failed are handled before
    /// the error is returned: they are gone from the CQ, and dropping them
    /// would leave their receive slots unposted and their sends and
    /// transfers never completed.
    pub(crate) fn poll_cq(&mut self) -> Result<()> {
        let mut wcs = std::mem::take(&mut self.wcs);
        let mut res = Ok(());
        for _ in 0..16 {
            wcs.clear();
            let polled = self.cq.poll(&mut wcs, 64);
            self.handle_wcs(&wcs);
            match polled {
                Ok(64) => {}
                Ok(_) => break,
                Err(e) => {
                    res = Err(e.into());
                    break;
                }
            }
        }
        self.wcs = wcs;
        res
    }

    /// Reads and handles every pending RDMA CM event; returns how many.
    fn poll_cm(&mut self) -> Result<usize> {
        let mut n = 0;
        // Those a test hook read ahead come first (their order kept).
        while let Some(ev) = self.cm_read_ahead.pop() {
            n += 1;
            self.on_cm_event(ev);
        }
        while let Some(ev) = self.events.get_event()? {
            n += 1;
            self.on_cm_event(ev);
        }
        Ok(n)
    }

    /// Reads the RDMA CM events waiting on the channel without acting on
    /// them, and says how many disconnects (`Disconnected` events) read so
    /// far wait: a test can wait for a peer's disconnect to reach the
    /// plugin and still choose the call that acts on it (the next that
    /// reads CM events, `progress` every [`CM_POLL_EVERY`]th call or
    /// `try_wait`, acts on these first, in order). Reads no completion.
    /// Only with the `test-hooks` feature.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn debug_cm_disconnects_waiting(&mut self) -> Result<usize> {
        while let Some(ev) = self.events.get_event()? {
            self.cm_read_ahead.push(ev);
        }
        Ok(self.cm_read_ahead.disconnects())
    }

    fn handle_wcs(&mut self, wcs: &[WorkCompletion]) {
        let mut touched: Vec<ConnRef> = Vec::new();
        for wc in wcs {
            let (kind, cref, index) = split_wr_id(wc.wr_id);
            let Some(conn) = self.conn_mut(cref) else {
                continue; // a retired connection's late completion
            };
            if kind != WrKind::Recv {
                conn.sq_done = conn.sq_done.wrapping_add(1);
            }
            match kind {
                WrKind::Recv => self.on_recv_wc(cref, index, wc),
                WrKind::Send => self.on_send_wc(cref, index, wc),
                WrKind::Rma => self.on_rma_wc(cref, index, wc),
            }
            if !touched.contains(&cref) {
                touched.push(cref);
            }
        }
        for c in touched {
            if self.conn(c).is_some_and(|c| c.state == ConnState::Dead) {
                self.retire_if_flushed(c);
            } else {
                self.drain_msgs(c);
                self.drain_rma(c);
            }
        }
    }

    /// The error a failed send means, `len` payload bytes by its own
    /// record (`byte_len` is undefined for send completions): whatever
    /// the status, the QP is in ERROR and the connection goes, so the
    /// peer is gone for this send as for everything else on it (as
    /// na-sm reports a send it could not deliver). The status says why.
    fn send_error(&self, cref: ConnRef, wc: &WorkCompletion, len: Option<usize>) -> NaError {
        let peer = self.peer_uri_of(cref);
        let dead = self.conn(cref).filter(|c| c.state == ConnState::Dead);
        let reason = match (wc.status, dead) {
            (WC_FLUSH, Some(c)) => c.dead_reason.clone(),
            _ => {
                let what = match len {
                    Some(n) => format!("send of {n} bytes"),
                    None => "credit update".to_owned(),
                };
                format!(
                    "{what} failed: {} (vendor error {:#x})",
                    wc.status_str(),
                    wc.vendor_err
                )
            }
        };
        NaError::PeerGone { peer, reason }
    }

    /// The error a failed RMA work request means.
    fn wc_error(&self, cref: ConnRef, wc: &WorkCompletion, what: &'static str, len: u64) -> NaError {
        let peer = self.peer_uri_of(cref);
        let dead = self.conn(cref).filter(|c| c.state == ConnState::Dead);
        match (wc.status, dead) {
            (WC_FLUSH, Some(c)) => NaError::PeerGone {
                peer,
                reason: c.dead_reason.clone(),
            },
            (WC_RETRY_EXC | WC_FLUSH | WC_RNR, _) => NaError::PeerGone {
                peer,
                reason: format!("{what} failed: {}", wc.status_str()),
            },
            (WC_REM_ACCESS, _) => NaError::Rma {
                op: what,
                len,
                peer,
                source: io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "{} (wrong rkey, or outside the peer's registration)",
                        wc.status_str()
                    ),
                ),
            },
            _ => NaError::Rma {
                op: what,
                len,
                peer,
                source: io::Error::other(format!("{} (vendor error {:#x})", wc.status_str(), wc.vendor_err)),
            },
        }
    }

    /// A receive completed. Messages that arrived whole are delivered even
    /// when the connection died meanwhile (the peer sent them before it
    /// went: a disconnect seen in the same progress call must not lose
    /// them), unless it died for breaking the protocol; only a live
    /// connection reposts the receive.
    fn on_recv_wc(&mut self, cref: ConnRef, slot: u32, wc: &WorkCompletion) {
        let max = self.cfg.max_msg_size;
        let conn = self.conn_mut(cref).expect("caller checked");
        conn.recvs_posted = conn.recvs_posted.saturating_sub(1);
        let dead = conn.state == ConnState::Dead;
        if !wc.is_ok() {
            if !dead {
                let reason = format!("receive failed: {}", wc.status_str());
                self.kill_conn(cref, reason);
            }
            return;
        }
        if conn.violated {
            return;
        }
        if wc.opcode != WcOpcode::Recv || slot >= conn.depth {
            // An RDMA WRITE with immediate (we never send one) used up a
            // receive: a protocol violation, and the buffer would be lost.
            let reason = format!("a {:?} consumed a receive", wc.opcode);
            self.violation(cref, reason);
            return;
        }
        let header = conn
            .read_header(slot)
            .map_err(|e| na_core::ErrorChain(&e).to_string())
            .and_then(|b| Header::decode(&b, wc.byte_len as usize, max));
        let header = header.and_then(|h| {
            conn.credits.arrived()?;
            conn.credits.grant(h.credits).map(|()| h)
        });
        let header = match header {
            Ok(h) => h,
            Err(e) => return self.violation(cref, e),
        };
        if conn.state == ConnState::Accepting {
            self.establish_by_message(cref);
        }
        self.on_message(cref, slot, header.kind, header.tag, header.len as usize);
        if dead {
            return;
        }
        let b = self.held_bounds();
        let (conn, total) = self.conn_and_held(cref);
        let Some(conn) = conn else { return };
        match conn.post_recv(cref, slot) {
            // Withheld at either bound: this connection's held messages,
            // or all connections' together.
            Ok(()) => {
                if !total.reposted(conn.held, &mut conn.credits, b) {
                    self.stats.flow_blocked += 1;
                }
            }
            Err(e) => self.kill_conn(
                cref,
                format!("reposting a receive failed: {}", na_core::ErrorChain(&e)),
            ),
        }
    }

    /// The peer broke the protocol on `cref`: counted, logged, and the
    /// connection is killed without taking anything more from it.
    pub(crate) fn violation(&mut self, cref: ConnRef, what: String) {
        let warn = self.stats.count_violation();
        let n = self.stats.violations;
        let peer = self.peer_uri_of(cref);
        if warn {
            tracing::warn!(%peer, violation = %what, violations = n, "verbs: protocol violation");
        } else {
            tracing::debug!(%peer, violation = %what, violations = n, "verbs: protocol violation");
        }
        if let Some(conn) = self.conn_mut(cref) {
            conn.violated = true;
        }
        self.kill_conn(cref, format!("protocol violation: {what}"));
    }

    fn on_send_wc(&mut self, cref: ConnRef, slot: u32, wc: &WorkCompletion) {
        let conn = self.conn_mut(cref).expect("caller checked");
        conn.sq_used = conn.sq_used.saturating_sub(1);
        let Some(entry) = conn.send_ops.get_mut(slot as usize) else {
            return;
        };
        let op = entry.take();
        let buf = conn.send_bufs.get_mut(slot as usize).and_then(Option::take);
        conn.free_send.push(slot);
        let err = (!wc.is_ok()).then(|| self.send_error(cref, wc, op.map(|(_, _, len)| len)));
        if let Some(b) = buf {
            self.recycle_buf(b);
        }
        if let Some((op, kind, _len)) = op {
            let status = match &err {
                None => Ok(()),
                Some(e) => Err(clone_err(e)),
            };
            self.finish_send(op, kind, status);
        }
        if let Some(e) = err {
            if self.conn(cref).is_some_and(|c| c.state != ConnState::Dead) {
                self.kill_conn(cref, na_core::ErrorChain(&e).to_string());
            }
        }
    }

    fn on_rma_wc(&mut self, cref: ConnRef, idx: u32, wc: &WorkCompletion) {
        let what = if wc.opcode == WcOpcode::RdmaRead {
            "get"
        } else {
            "put"
        };
        let (kind_name, len) = match self.rma.get(idx as usize).and_then(|r| r.as_ref()) {
            Some(r) if r.dir == RmaDir::Get => ("get", r.len),
            Some(r) => ("put", r.len),
            None => (what, 0),
        };
        let err = (!wc.is_ok()).then(|| self.wc_error(cref, wc, kind_name, len));
        let conn = self.conn_mut(cref).expect("caller checked");
        conn.sq_used = conn.sq_used.saturating_sub(1);
        if kind_name == "get" {
            conn.reads.completed_one();
        }
        if let Some(n) = conn.rma_posted.get_mut(&idx) {
            *n -= 1;
            if *n == 0 {
                conn.rma_posted.remove(&idx);
            }
        }
        let fatal = err.is_some();
        self.rma_piece_done(idx, err.as_ref().map(clone_err));
        if fatal && self.conn(cref).is_some_and(|c| c.state != ConnState::Dead) {
            // The QP is in ERROR after any failed work request.
            let e = err
                .map(|e| na_core::ErrorChain(&e).to_string())
                .unwrap_or_default();
            self.kill_conn(cref, e);
        }
    }
}

/// `NaError` is not `Clone`; rebuild the variants completions carry.
fn clone_err(e: &NaError) -> NaError {
    match e {
        NaError::PeerGone { peer, reason } => NaError::PeerGone {
            peer: peer.clone(),
            reason: reason.clone(),
        },
        NaError::Rma {
            op,
            len,
            peer,
            source,
        } => NaError::Rma {
            op,
            len: *len,
            peer: peer.clone(),
            source: io::Error::new(source.kind(), na_core::ErrorChain(source).to_string()),
        },
        other => NaError::Plugin {
            plugin: "verbs",
            message: na_core::ErrorChain(other).to_string(),
        },
    }
}
