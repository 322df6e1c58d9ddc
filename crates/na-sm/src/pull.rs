//! Pull mode (`Plugin::pull_unexpected`): an unexpected message is not
//! matched with a posted receive but waits at the head of its ring, where
//! `poll_rings` stops, until `take_pulled` copies it out, retires it, and
//! hands it to the caller with no completion. A peer's messages keep their
//! order across kinds: an expected message behind a waiting unexpected one
//! is delivered once that one is taken. Messages of a peer that goes away
//! are copied out before its ring is dropped (`pulled_late`) and taken
//! first.

use na_core::{Addr, Tag};

use crate::channel::{Channel, MsgKind};
use crate::conn::Role;
use crate::plugin::SmPlugin;
use crate::progress::{publish_read, Failure};

impl SmPlugin {
    /// Copies the unexpected message at the head of some peer's ring into
    /// `buf` (peers take turns, from `pull_next`) and retires it; `None`,
    /// and `pull_ready` lowered, once no head holds one. How far a ring was
    /// read is published when its head no longer holds a message to take
    /// (or by the next poll), not per message.
    pub(crate) fn take_pulled(&mut self, buf: &mut Vec<u8>) -> Option<(Addr, Tag)> {
        if let Some((src, tag, data)) = self.pulled_late.pop_front() {
            *buf = data;
            return Some((src, tag));
        }
        if !self.pull_ready {
            return None;
        }
        let n = self.peers.slot_count();
        let (mut taken, mut violation) = (None, None);
        'peers: for k in 0..n {
            let idx = (self.pull_next + k) % n;
            let Some(peer) = self.peers.slot_mut(idx) else {
                continue;
            };
            let tok = peer.addr.token();
            for conn in peer.conns.iter_mut() {
                let rx = if conn.role == Role::Connector { 1 } else { 0 };
                let ch = Channel::new(&conn.region, rx);
                let s = match ch.peek(conn.rx_cur.pos) {
                    Ok(Some(s)) if s.kind == MsgKind::Unexpected => s,
                    // Empty, or an expected message for the next poll.
                    Ok(_) => {
                        let failed =
                            publish_read(&ch, &mut conn.rx_cur, conn.peer_wake.as_ref(), &mut self.stats);
                        if let Some((f, reason)) = failed {
                            violation = Some((tok, f, reason));
                            break 'peers;
                        }
                        continue;
                    }
                    Err(e) => {
                        violation = Some((tok, Failure::Protocol, e.to_string()));
                        break 'peers;
                    }
                };
                ch.read_payload(conn.rx_cur.pos, &s, buf);
                let freed = ch.release(&mut conn.rx_cur, &s);
                self.stats.msgs_received += 1;
                self.stats.msg_bytes_received += s.len as u64;
                if let Err(reason) = freed {
                    violation = Some((tok, Failure::Protocol, reason));
                    break 'peers;
                }
                self.pull_next = idx + 1;
                taken = Some((peer.addr.clone(), s.tag));
                break 'peers;
            }
        }
        if let Some((tok, f, reason)) = violation {
            self.fail_peer(tok, f, &reason);
        }
        if taken.is_none() {
            self.pull_ready = !self.pulled_late.is_empty();
        }
        taken
    }
}
