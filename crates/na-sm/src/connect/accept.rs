//! The listener's side: accepting connections (within the per-call and
//! pending-handshake bounds), and pausing and resuming accepts.

use std::io;
use std::os::fd::AsFd;
use std::time::Instant;

use crate::identity::PeerStart;
use crate::plugin::{PendingAccept, SmPlugin, LISTENER_TOKEN};
use crate::sys::socket::peer_cred;

use super::{AcceptPause, ACCEPT_RETRY, MAX_ACCEPTS_PER_CALL, MAX_PENDING_HANDSHAKES};

impl SmPlugin {
    /// Accepts every waiting connection (listener readable) and reads its
    /// hello at once if it is there (an honest connector sends it right
    /// after connecting). With [`MAX_PENDING_HANDSHAKES`] still waiting
    /// for theirs, or out of descriptors, it stops: the listener leaves the
    /// epoll set and the rest wait in the kernel's queue (nothing is
    /// refused) until a handshake ends or, for descriptors, a short pause
    /// is over (see `sweep_deadlines`). At most [`MAX_ACCEPTS_PER_CALL`]
    /// connections a pass; past them the next progress call polls events
    /// again (`events_owed`), and the listener, level-triggered, reports
    /// the rest.
    pub(crate) fn accept_ready(&mut self) {
        for _ in 0..MAX_ACCEPTS_PER_CALL {
            if self.accept_pause.is_some() {
                return;
            }
            if crate::closer::congested() {
                // Peer-passed descriptors wait to be closed (a close that
                // never ends holds every closing thread): take no more in.
                self.stats.flow_blocked += 1;
                tracing::warn!(pause = ?ACCEPT_RETRY, "sm: pausing accepts: too many peer descriptors wait to be closed");
                self.pause_accepts(AcceptPause::Until(Instant::now() + ACCEPT_RETRY));
                return;
            }
            if self.held_by_departed() >= self.cfg.max_queued_total {
                self.stats.flow_blocked += 1;
                tracing::warn!(
                    queued = self.held_by_departed(),
                    limit = self.cfg.max_queued_total,
                    "sm: pausing accepts: too many messages of departed peers queued (SmConfig::max_queued_total)"
                );
                self.pause_accepts(AcceptPause::Queued);
                return;
            }
            if self.pending.len() >= MAX_PENDING_HANDSHAKES {
                self.stats.flow_blocked += 1;
                tracing::warn!(
                    limit = MAX_PENDING_HANDSHAKES,
                    "sm: pausing accepts: too many handshakes in progress"
                );
                self.pause_accepts(AcceptPause::Handshakes);
                return;
            }
            let Some(listener) = &self.listener else { return };
            // Read out before it is closed, whenever it goes (see
            // `closer::PeerSocket`).
            let sock = match listener.accept() {
                Ok((s, _)) => crate::closer::PeerSocket::new(s),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if matches!(e.raw_os_error(), Some(libc::ECONNABORTED | libc::EINTR)) => continue,
                Err(e) => {
                    // EMFILE, ENFILE, ENOBUFS, ENOMEM: the connection stays
                    // queued and the listener readable; retrying at once
                    // would spin.
                    self.stats.accept_errors += 1;
                    tracing::warn!(error = %na_core::ErrorChain(&e), pause = ?ACCEPT_RETRY, "sm: accept failed; pausing accepts");
                    self.pause_accepts(AcceptPause::Until(Instant::now() + ACCEPT_RETRY));
                    return;
                }
            };
            let cred = match peer_cred(sock.as_fd()) {
                Ok(c) => c,
                Err(e) => {
                    if self.stats.refuse_handshake() {
                        tracing::warn!(error = %na_core::ErrorChain(&e), "SO_PEERCRED failed; dropping connection");
                    }
                    continue;
                }
            };
            if cred.uid != self.uid {
                self.stats.protocol_errors += 1;
                if self.stats.refuse_handshake() {
                    tracing::warn!(
                        uid = cred.uid,
                        pid = cred.pid,
                        "refusing sm connection from another uid"
                    );
                }
                continue;
            }
            if let Some(reason) = self.over_pending_bound(cred.pid) {
                self.refuse_over_bound(sock.as_fd(), cred.pid, &reason);
                continue;
            }
            let serial = self.next_serial;
            self.next_serial += 1;
            if sock.set_nonblocking(true).is_err() || self.poll_add(sock.as_fd(), serial).is_err() {
                continue;
            }
            // Now, while the connection proves the connector has not
            // exited (see `identity`); its hello may come much later.
            let start = PeerStart::read(sock.as_fd(), cred.pid);
            let deadline = na_core::deadline_after(self.cfg.handshake_timeout);
            self.pending.insert(
                serial,
                PendingAccept {
                    sock,
                    cred,
                    start,
                    deadline,
                },
            );
            self.handle_hello(serial);
        }
        // The bound was reached (every other way out returns): more may
        // be queued, and no new edge would say so.
        self.events_owed = true;
    }

    /// Takes the listener out of the epoll set until `sweep_deadlines`
    /// resumes it.
    fn pause_accepts(&mut self, why: AcceptPause) {
        if let Some(l) = &self.listener {
            let _ = self.poll.delete(l.as_fd());
        }
        self.set_accept_pause(Some(why));
        self.update_timer();
    }

    /// Puts the listener back and accepts what waited meanwhile.
    pub(crate) fn resume_accepts(&mut self) {
        self.set_accept_pause(None);
        if let Some(l) = &self.listener {
            if let Err(e) = self.poll.add(l.as_fd(), LISTENER_TOKEN) {
                tracing::warn!(error = %na_core::ErrorChain(&e), "sm: re-adding the listener failed; retrying later");
                self.set_accept_pause(Some(AcceptPause::Until(Instant::now() + ACCEPT_RETRY)));
                return;
            }
        }
        self.accept_ready();
    }

    /// Sets [`accept_pause`](SmPlugin::accept_pause) (its only writer after
    /// set-up), and tells a test's `ListenerProbe` if one was handed out
    /// (see `ListenerHooks`).
    fn set_accept_pause(&mut self, pause: Option<AcceptPause>) {
        self.accept_pause = pause;
        self.listener_hooks.pause_set(pause);
    }
}
