//! Pull mode (`Plugin::pull_unexpected`): an unexpected message is not
//! matched with a posted receive but waits at the head of its ring, where
//! `poll_rings` stops (or where the spin loop sees it arrive), until
//! `take_pulled` copies it out, retires it, and hands it to the caller
//! with no completion. A peer's messages keep their
//! order across kinds: an expected message behind a waiting unexpected one
//! is delivered once that one is taken. Messages of a peer that goes away
//! are copied out before its ring is dropped (`pulled_late`) and taken
//! first; its expected messages are delivered (as completions) at that
//! moment, so across kinds a departed peer's last messages may be seen
//! out of order (the RPC layer uses expected messages only to watch for
//! a peer's death, so it is not affected).

use na_core::hint::cold_path;
use na_core::{Addr, Tag};

use crate::channel::{Channel, MsgKind, Slot};
use crate::conn::Role;
use crate::peer_failure::Failure;
use crate::plugin::SmPlugin;
use crate::progress::publish_read;

impl SmPlugin {
    /// Copies the unexpected message at the head of some peer's ring into
    /// `buf` (peers take turns, from `pull_next`) and retires it; `None`
    /// once no head holds one (known from `pull_heads` and the ring taken
    /// from last, or from a scan, which then zeroes the count). How far
    /// a ring was read is published by the next poll (or a scan that
    /// passes it), not per message: the fenced store stays off the path
    /// from a request to its reply.
    #[inline]
    pub(crate) fn take_pulled(&mut self, buf: &mut Vec<u8>) -> Option<(Addr, Tag)> {
        // A take answers what the spin loop saw, whether or not it finds a
        // message (a peer may withdraw one it published): the next
        // progress call settles and polls every changed ring.
        let seen = self.spin_found.take();
        // `pulled_late` is taken from first (in `take_slow`).
        if self.pull_heads != 1 || !self.pulled_late.is_empty() {
            return self.take_slow(buf);
        }
        // The ring taken from last (or the one the spin loop saw a message
        // arrive at), when it is the only one counted: its head either is
        // the next message to take (taking turns needs no one else) or
        // holds none, and then nothing does, known without a scan of every
        // ring (the usual case when each peer has one request or response
        // in flight). This is the path of every busy round trip: no scan,
        // and the message taken right where it was seen (by `take_at`, as
        // the scan takes it).
        let Some((idx, ci)) = self.pull_last else {
            return self.take_slow(buf);
        };
        // A peer or connection gone since the ring was seen: the scan
        // finds whatever else waits.
        let Some(peer) = self.peers.slot(idx) else {
            cold_path();
            return self.take_slow(buf);
        };
        let Some(conn) = peer.conns.get(ci) else {
            cold_path();
            return self.take_slow(buf);
        };
        // What the spin loop saw and validated, still at the head.
        if let Some(seen) = seen {
            if seen.conn == conn.serial && seen.pos == conn.rx_cur.pos {
                return self.take_at(idx, ci, seen.slot, buf);
            }
        }
        let rx = if conn.role == Role::Connector { 1 } else { 0 };
        match Channel::new(&conn.region, rx).peek(conn.rx_cur.pos) {
            Ok(Some(s)) if s.kind == MsgKind::Unexpected => self.take_at(idx, ci, s, buf),
            // A violation is for the scan (it reports it).
            Err(_) => {
                cold_path();
                self.take_slow(buf)
            }
            _ => {
                self.pull_last = None;
                self.pull_heads = 0;
                None
            }
        }
    }

    /// [`take_pulled`](Self::take_pulled) when its single ring is not the
    /// answer: a departed peer's message, or a scan of every ring.
    #[inline(never)]
    fn take_slow(&mut self, buf: &mut Vec<u8>) -> Option<(Addr, Tag)> {
        // A loop, not a call to itself: each violating peer found costs a
        // turn (peers can be many), never a stack frame.
        loop {
            if let Some((src, tag, data)) = self.pulled_late.pop_front() {
                *buf = data;
                self.resume_if_queued_taken();
                return Some((src, tag));
            }
            self.pull_last = None;
            if self.pull_heads == 0 {
                return None;
            }
            let n = self.peers.slot_count();
            let mut violation = None;
            let mut found = None;
            'peers: for k in 0..n {
                let idx = (self.pull_next + k) % n;
                let Some(peer) = self.peers.slot_mut(idx) else {
                    continue;
                };
                let tok = peer.addr.token();
                for (ci, conn) in peer.conns.iter_mut().enumerate() {
                    let rx = if conn.role == Role::Connector { 1 } else { 0 };
                    let ch = Channel::new(&conn.region, rx);
                    match ch.peek(conn.rx_cur.pos) {
                        Ok(Some(s)) if s.kind == MsgKind::Unexpected => {
                            found = Some((idx, ci, s));
                            break 'peers;
                        }
                        // Empty, or an expected message for the next poll.
                        Ok(_) => {
                            let failed = publish_read(
                                &ch,
                                &mut conn.rx_cur,
                                conn.peer_wake.as_ref(),
                                &mut conn.wake_owed,
                                &mut self.stats,
                            );
                            if let Some((f, reason)) = failed {
                                violation = Some((tok, f, reason));
                                break 'peers;
                            }
                        }
                        Err(e) => {
                            violation = Some((tok, Failure::Protocol, e.to_string()));
                            break 'peers;
                        }
                    }
                }
            }
            if let Some((tok, f, reason)) = violation {
                self.fail_peer(tok, f, &reason);
                // The scan stopped at that peer. Its failure took what it had
                // sent (into `pulled_late`) and counted the heads again: look
                // again rather than say none waits. Each turn removes a peer,
                // so this ends.
                continue;
            }
            return match found {
                Some((idx, ci, s)) => self.take_at(idx, ci, s, buf),
                None => {
                    self.pull_heads = 0;
                    None
                }
            };
        }
    }

    /// Copies out and retires the unexpected message `s` at the head of
    /// connection `ci` of peer slot `idx` (just peeked there), and makes
    /// that ring the one the next take looks at first.
    #[inline(always)]
    fn take_at(&mut self, idx: usize, ci: usize, s: Slot, buf: &mut Vec<u8>) -> Option<(Addr, Tag)> {
        let peer = self.peers.slot_mut(idx)?;
        let conn = peer.conns.get_mut(ci)?;
        let rx = if conn.role == Role::Connector { 1 } else { 0 };
        let ch = Channel::new(&conn.region, rx);
        ch.read_payload(conn.rx_cur.pos, &s, buf);
        let freed = ch.release(&mut conn.rx_cur, &s);
        self.heads.mark_taken(conn.head);
        self.stats.msgs_received += 1;
        self.stats.msg_bytes_received += s.len as u64;
        if let Err(reason) = freed {
            cold_path();
            // The sender broke the protocol: the message is not delivered.
            let tok = peer.addr.token();
            self.fail_peer(tok, Failure::Protocol, &reason);
            self.pull_last = None;
            self.pull_heads = 0;
            return None;
        }
        self.pull_next = idx + 1;
        self.pull_last = Some((idx, ci));
        Some((peer.addr.clone(), s.tag))
    }
}
