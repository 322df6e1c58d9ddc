//! The passive side of a connection's set-up: a peer's connect request
//! (its hello checked: version, then fields, then that it names the
//! address it comes from; the bounds on held messages and incoming
//! connections), the accept, and the reasons our rejects carry in their
//! private data, which the connecting side shows (`wire::reject_reason`).
//! `connect` holds the rest of a connection's life.

use std::sync::Arc;

use crate::plugin::VerbsPlugin;
use crate::reads::ReadWindow;
use crate::sys::CmEvent;
use crate::wire::{version_mismatch, Hello, HELLO_VERSION};

/// The reject's reason when `rdma_accept` failed after the QP was set up.
const REJECT_ACCEPT_FAILED: &[u8] = b"the listener could not accept the connection";
/// The reject's reason when the QP or buffers could not be set up.
const REJECT_SETUP_FAILED: &[u8] = b"the listener could not set up the connection";
/// The reject's reason at the connection limit.
const REJECT_TOO_MANY: &[u8] = b"too many connections";
/// The reject's reason when incoming connections fill their share of the
/// limit (the rest is kept for our outgoing ones).
const REJECT_INCOMING_FULL: &[u8] =
    b"too many incoming connections (the rest are kept for the listener's own outgoing ones)";

/// The reject's reason for a hello that does not decode (also what a
/// listener of hello version 1 says to a hello of another version).
pub(crate) const REJECT_BAD_HELLO: &str = "bad hello";

/// The reject's reason for a hello of another version `theirs`: names
/// both, as printable text the peer shows (see
/// [`reject_reason`](crate::wire::reject_reason)).
fn version_reject_reason(theirs: u8) -> String {
    format!(
        "verbs hello version {theirs} refused: this listener speaks version {HELLO_VERSION} \
         (another build of Quicksilver)"
    )
}

impl VerbsPlugin {
    /// Passive side: a peer's connect request (see the module docs).
    pub(crate) fn on_connect_request(&mut self, ev: CmEvent) {
        let Some(id) = ev.new_id else { return };
        if let Some(theirs) = version_mismatch(&ev.private_data) {
            // A peer of another build (see `wire`'s "Versions"), not a
            // broken one: no protocol error, and the reject says which
            // versions met.
            if self.stats.refuse_handshake() {
                tracing::warn!(
                    theirs,
                    ours = HELLO_VERSION,
                    "verbs: rejecting a connection of another hello version (another build of Quicksilver)"
                );
            }
            return drop(id.reject(version_reject_reason(theirs).as_bytes()));
        }
        let hello = match Hello::decode(&ev.private_data) {
            Ok(h) if self.cfg.listen => h,
            Ok(_) => return drop(id.reject(b"not listening")),
            Err(e) => {
                self.stats.protocol_errors += 1;
                if self.stats.refuse_handshake() {
                    tracing::warn!(error = %e, "verbs: rejecting a connection with a bad hello");
                }
                return drop(id.reject(REJECT_BAD_HELLO.as_bytes()));
            }
        };
        // The hello names the peer's identity (its listen address); our
        // active side connects from that very IP, so a connection from
        // elsewhere claims someone else's identity: it would receive that
        // peer's replies, and its end would look like that peer's death.
        let from = id.peer_addr().map(|a| a.ip().to_canonical());
        if from != Some(hello.addr.ip().to_canonical()) {
            self.stats.protocol_errors += 1;
            if self.stats.refuse_handshake() {
                tracing::warn!(
                    claimed = %hello.addr,
                    from = ?from,
                    "verbs: rejecting a connection whose hello names another address"
                );
            }
            return drop(id.reject(b"hello address does not match the connection"));
        }
        let held = self.matching.held_count();
        if held >= self.cfg.max_held_total as usize {
            // Whoever it is, its messages would only pile up: the
            // application is not taking what it holds already.
            self.stats.flow_blocked += 1;
            if self.stats.refuse_handshake() {
                tracing::warn!(
                    held,
                    limit = self.cfg.max_held_total,
                    "verbs: refusing a connection: too many messages held (VerbsConfig::max_held_total)"
                );
            }
            return drop(id.reject(b"too many messages held"));
        }
        let live = self.conns_held();
        // At the whole limit `insert_conn` refuses it ("too many
        // connections"); short of it, only the reserve does.
        if live >= self.incoming_limit && live < self.conn_limit {
            // Idle incoming connections are never closed: without this,
            // peers that connect and stay could take every slot, and our
            // own operations on looked-up peers could not connect.
            if self.stats.refuse_handshake() {
                tracing::warn!(
                    live,
                    incoming_limit = self.incoming_limit,
                    conn_limit = self.conn_limit,
                    "verbs: refusing a connection: the rest of the connection slots are kept for our own \
                     outgoing connections (VerbsConfig::outgoing_reserve, max_conns)"
                );
            }
            return drop(id.reject(REJECT_INCOMING_FULL));
        }
        // The connection's own peer, whatever the hello names: a lookup of
        // that address (ours, or hg-bulk's of a descriptor's owner)
        // connects to the listener there, never reuses this connection.
        let device = Some(&hello.device).filter(|d| !d.is_empty());
        let peer = self
            .peers
            .insert_incoming(self.id, hello.addr, device.map(|d| d.as_str()));
        let cref = match self.insert_conn(Arc::clone(&id), peer, false) {
            Ok(c) => c,
            Err(e) => {
                // Its peer goes with it (no address of it was handed out).
                self.peers.remove_new(peer);
                if self.stats.refuse_handshake() {
                    tracing::warn!(error = %na_core::ErrorChain(&e), "verbs: rejecting a connection");
                }
                return drop(id.reject(REJECT_TOO_MANY));
            }
        };
        let conn = self.conn_mut(cref).expect("just inserted");
        conn.credits = crate::credits::Credits::new(u32::from(hello.depth), conn.depth);
        conn.peer_max_msg = Some(hello.max_payload as usize);
        self.peers[peer].conn = Some(cref);
        tracing::debug!(claimed = %hello.addr, "verbs: accepting a connection (a peer of its own)");
        // The reads the peer serves bound ours, and the reads it issues
        // bound what we serve; our device bounds both, each by its own
        // limit (`max_qp_init_rd_atom` and `max_qp_rd_atom`). The kernel's
        // CM reports the request from our side: `initiator_depth` is the
        // peer's responder resources, `responder_resources` its initiator
        // depth.
        let initiator = ev.initiator_depth.min(self.rd_initiator);
        let responder = ev.responder_resources.min(self.rd_responder);
        self.conn_mut(cref).expect("just inserted").reads = ReadWindow::new(initiator);
        // Test hook (`VerbsConfig::debug`, `accept_responder_resources`).
        let responder = self.cfg.debug.responder(responder);
        let param = self.conn_param(initiator, responder);
        let res = match self.setup_qp(cref) {
            Ok(()) => id.accept(&param).inspect_err(|_| {
                // Nothing was accepted: the peer waits for our reply, and
                // the disconnect `kill_conn` sends means nothing before
                // an accept. Tell it now, with the reason in the private
                // data, rather than leave it to the reasonless REJ the
                // kernel's CM sends once the id is destroyed (when the
                // dead connection is retired after its flush, or its
                // grace). Provoked in the VM through
                // `VerbsConfig::debug.accept_responder_resources`
                // (tests/accept_failure.rs).
                let _ = id.reject(REJECT_ACCEPT_FAILED);
            }),
            Err(e) => {
                // Nothing was accepted: tell the peer now rather than
                // leave it to its CM's retries.
                let _ = id.reject(REJECT_SETUP_FAILED);
                Err(e)
            }
        };
        if let Err(e) = res {
            // Our own resources (registering the buffers, creating the
            // QP) or our CM failed, not the peer: no protocol error.
            self.stats.accept_errors += 1;
            if self.stats.refuse_handshake() {
                tracing::warn!(
                    peer = %self.peer_uri_of(cref),
                    error = %na_core::ErrorChain(&e),
                    accept_errors = self.stats.accept_errors,
                    "verbs: could not accept a connection"
                );
            }
            self.kill_conn(cref, format!("accepting failed: {}", na_core::ErrorChain(&e)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::version_reject_reason;
    use crate::wire::reject_reason;

    #[test]
    fn a_rejects_reason_is_printable_text_or_nothing() {
        let mut padded = b"too many connections".to_vec();
        padded.resize(148, 0);
        assert_eq!(reject_reason(&padded), Some("too many connections"));
        assert_eq!(reject_reason(b"bad hello"), Some("bad hello"));
        assert_eq!(reject_reason(&[0; 148]), None, "padding only");
        assert_eq!(reject_reason(&[]), None);
        assert_eq!(reject_reason(b"esc\x1b[2J"), None, "control characters");
        assert_eq!(reject_reason(b"nul\0inside"), None);
        assert_eq!(reject_reason("caf\u{e9}".as_bytes()), None, "not ASCII");
        let v = version_reject_reason(255);
        assert_eq!(
            reject_reason(v.as_bytes()),
            Some(v.as_str()),
            "the peer shows it whole"
        );
        assert_eq!(
            reject_reason(&[b'a'; 129]),
            None,
            "longer than any reason we send"
        );
    }
}
