//! Cancel and peer failure: an operation canceled, or a peer dropped
//! with every operation that involves it.

use std::os::fd::AsFd;

use na_core::hint::cold_path;
use na_core::{Completion, NaError, OpId, OpKind, Result};

use crate::conn::Role;
use crate::matching::OpPlace;
use crate::plugin::SmPlugin;
use crate::send_ops::kind_of;

/// Why a peer is being dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// It closed its socket, exited or was killed.
    Gone,
    /// It broke the protocol.
    Protocol,
}

/// How a failed wake-up write fails the peer: a closed pipe means it is
/// gone; anything else (a descriptor it tampered with) is a violation.
pub(crate) fn wake_failure(e: &std::io::Error) -> (Failure, String) {
    if e.raw_os_error() == Some(libc::EPIPE) {
        (
            Failure::Gone,
            "its wake-up pipe is closed (process exited or was killed)".into(),
        )
    } else {
        (Failure::Protocol, format!("waking it: {e}"))
    }
}

impl SmPlugin {
    pub(crate) fn cancel_op(&mut self, op: OpId) -> Result<()> {
        // Posted unexpected receives are not in `ops` (see
        // `post_recv_unexpected`): an id not there may be one of them.
        let place = self.ops.remove(&op).unwrap_or(OpPlace::RecvUnexpected);
        let c = match place {
            OpPlace::Send(tok) => {
                let q = self.peers.get_mut(tok).and_then(|p| {
                    let conn = p.conns.first_mut()?;
                    conn.backlog.remove_first(|q| q.op == op)
                });
                let kind = q.map_or(OpKind::SendUnexpected, |q| kind_of(q.kind));
                Completion::failed(op, kind, NaError::Canceled, None)
            }
            OpPlace::Rma(_) => self.cancel_rma(op)?,
            OpPlace::RecvUnexpected | OpPlace::RecvExpected(..) => {
                let kind = if place == OpPlace::RecvUnexpected {
                    OpKind::RecvUnexpected
                } else {
                    OpKind::RecvExpected
                };
                let buf = self.matcher.take_posted(op, place);
                if place == OpPlace::RecvUnexpected && buf.is_none() {
                    return Err(NaError::UnknownOp(op.0));
                }
                Completion::failed(op, kind, NaError::Canceled, buf)
            }
        };
        self.completions.push_back(c);
        Ok(())
    }

    /// Drops a peer: delivers what it already published (if it merely
    /// left), then fails every operation involving it.
    ///
    /// Never recursive: the drain of a departing peer publishes what it
    /// read and may find failures (its own wake-up failing again, as a
    /// peer that closed its pipe but keeps writing arranges, or another
    /// peer's violation). Those wait in `failures_queued` and are handled
    /// after it, each peer at most once, so the stack stays flat and a
    /// departing peer's drain (which passes the queued-message bound)
    /// happens once, not once per message it manages to add.
    pub(crate) fn fail_peer(&mut self, tok: u64, failure: Failure, reason: &str) {
        self.failures_queued.push_back((tok, failure, reason.to_owned()));
        if self.failing {
            return;
        }
        self.failing = true;
        while let Some((tok, failure, reason)) = self.failures_queued.pop_front() {
            self.fail_peer_now(tok, failure, &reason);
        }
        self.failing = false;
        // Failed from a send or RMA of another thread while the owner
        // sleeps: its completions need a wake-up (the peer's socket left
        // the epoll set with it).
        self.wake_owner_if_work();
    }

    /// One peer's failure (see `fail_peer`).
    fn fail_peer_now(&mut self, tok: u64, failure: Failure, reason: &str) {
        if tok != self.self_tok && self.peers.get(tok).is_none() {
            // Failed already (queued twice). A violation found while its
            // departure drained its ring (queued behind that departure)
            // still counts.
            if failure == Failure::Protocol {
                cold_path();
                let warn = self.stats.count_violation();
                let n = self.stats.violations;
                if warn {
                    tracing::warn!(%reason, violations = n, "sm protocol violation by a departed peer");
                }
            }
            return;
        }
        if failure == Failure::Gone {
            // What the peer sent before it went still counts.
            self.poll_all_rings_as(Some(tok));
        }
        let (uri, conns) = if tok == self.self_tok {
            match self.peers.take_conns(tok) {
                Some(c) => (self.name.uri(), c),
                None => return,
            }
        } else {
            match self.peers.remove(tok) {
                Some(mut p) => (p.addr.uri().to_owned(), std::mem::take(&mut p.conns)),
                None => return,
            }
        };
        let err = || match failure {
            Failure::Gone => NaError::PeerGone {
                peer: uri.clone(),
                reason: reason.to_owned(),
            },
            Failure::Protocol => NaError::Protocol {
                peer: uri.clone(),
                reason: reason.to_owned(),
            },
        };
        match failure {
            Failure::Gone => tracing::info!(peer = %uri, %reason, "sm disconnect"),
            Failure::Protocol => {
                let warn = self.stats.count_violation();
                let n = self.stats.violations;
                if warn {
                    tracing::warn!(peer = %uri, %reason, violations = n, "sm protocol violation; disconnecting")
                } else {
                    tracing::debug!(peer = %uri, %reason, violations = n, "sm protocol violation; disconnecting")
                }
            }
        }
        for conn in conns {
            let _ = self.poll.delete(conn.sock.as_fd());
            let _ = self.poll.delete(conn.my_wake.poll_fd());
            if let Some(fd) = &conn.pidfd {
                let _ = self.poll.delete(fd.as_fd());
            }
            if conn.role == Role::Connector && conn.peer_wake.is_none() {
                self.awaiting_ack = self.awaiting_ack.saturating_sub(1);
            }
            let _ = conn.sock.shutdown(std::net::Shutdown::Both);
            for q in conn.backlog {
                self.ops.remove(&q.op);
                self.completions
                    .push_back(Completion::failed(q.op, kind_of(q.kind), err(), None));
            }
        }
        self.fail_peer_rma(tok, &err);
        let stays = tok == self.self_tok;
        for op in self.matcher.fail_peer(tok, stays, err, &mut self.completions) {
            self.ops.remove(&op);
        }
        // Its held messages (if any) go at the timer, idle or not.
        self.update_timer();
    }
}
