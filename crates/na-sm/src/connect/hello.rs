//! The listener's handling of a connector's hello: checks, the bounds
//! per process, the connection's set-up and the acknowledgement.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use na_core::{NaError, SendBacklog};

use crate::addr::SmName;
use crate::channel::{check_region, RxCursor, TxCursor, REGION_LEN};
use crate::closer::recv_screened;
use crate::conn::{
    check_hello_parts, decode_hello, encode_ack, encode_refusal, hello_version, Conn, HelloParts, Role,
    ACK_LEN, MAX_HELLO, PROTO_VERSION,
};
use crate::error::SmError;
use crate::peer_failure::Failure;
use crate::plugin::{PendingAccept, SmPlugin, WAKE_BIT};
use crate::sys::shm::SharedRegion;
use crate::sys::socket::{refuse_passed_fds, send_with_fds};
use crate::sys::wake::{OwnWake, PeerWake};

use super::MAX_PENDING_PER_PROCESS;

/// Why an accepted connection's handshake failed.
#[derive(Debug)]
enum HelloFailure {
    /// The peer broke the handshake (a protocol error).
    Peer(String),
    /// We could not set the connection up (our descriptors or memory ran
    /// out): not the peer's doing.
    Local(String),
    /// The connector closed its end before it said anything (it exited,
    /// or gave up on its lookup): a departure, not a protocol error.
    Departed,
}

impl HelloFailure {
    /// A failure to take in what the peer passed (`what`): ours if the
    /// kernel ran out of descriptors or memory for us, else the peer's.
    fn of_io(what: &str, e: &io::Error) -> Self {
        let reason = format!("{what}: {e}");
        match e.raw_os_error() {
            Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM) => HelloFailure::Local(reason),
            _ => HelloFailure::Peer(reason),
        }
    }
}

impl From<String> for HelloFailure {
    fn from(reason: String) -> Self {
        HelloFailure::Peer(reason)
    }
}

impl From<&str> for HelloFailure {
    fn from(reason: &str) -> Self {
        HelloFailure::Peer(reason.to_owned())
    }
}

impl SmPlugin {
    /// An accepted socket is readable: take the hello, or drop the socket.
    pub(crate) fn handle_hello(&mut self, serial: u64) {
        let Some(p) = self.pending.get(&serial) else {
            return;
        };
        if crate::closer::congested() {
            // Refused unread: its descriptors stay the kernel's (in flight
            // on the socket, which a closing thread closes), not ours.
            if let Some(p) = self.pending.remove(&serial) {
                let _ = self.poll.delete(p.sock.as_fd());
                self.stats.accept_errors += 1;
                if self.stats.refuse_handshake() {
                    tracing::warn!(
                        pid = p.cred.pid,
                        "sm: handshake refused: too many peer descriptors wait to be closed"
                    );
                }
            }
            return;
        }
        let mut buf = [0u8; MAX_HELLO];
        let r = match recv_screened(p.sock.as_fd(), &mut buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            r => r,
        };
        let Some(p) = self.pending.remove(&serial) else {
            return;
        };
        let _ = self.poll.delete(p.sock.as_fd());
        if let Some(reason) = self.over_process_bound(p.cred.pid) {
            self.refuse_over_bound(p.sock.as_fd(), p.cred.pid, &reason);
            return;
        }
        let peer = format!("pid {}", p.cred.pid);
        match self.accept_hello(serial, p, r, &buf) {
            Ok(uri) => tracing::info!(peer = %uri, serial, "sm accept"),
            Err(HelloFailure::Peer(reason)) => {
                self.stats.protocol_errors += 1;
                if self.stats.refuse_handshake() {
                    tracing::warn!(peer = %peer, %reason, "sm handshake refused");
                }
            }
            Err(HelloFailure::Departed) => {
                tracing::debug!(peer = %peer, serial, "sm: connector closed before its hello");
            }
            // Not the peer's doing: no protocol error. The connection is
            // closed (the connector's error says so); it may connect again.
            Err(HelloFailure::Local(reason)) => {
                self.stats.accept_errors += 1;
                if self.stats.refuse_handshake() {
                    tracing::warn!(peer = %peer, %reason, "sm: could not accept a connection (out of our own resources)");
                }
            }
        }
    }

    /// Refuses the handshake on `sock` of process `pid` past one of its
    /// bounds: the connector is told why (best effort; no `SIGPIPE` if it
    /// is gone already), so that its error says so; the close follows
    /// when the caller drops the socket.
    pub(super) fn refuse_over_bound(&mut self, sock: BorrowedFd<'_>, pid: u32, reason: &str) {
        let _ = send_with_fds(sock, &encode_refusal(reason), &[]);
        if self.stats.refuse_handshake() {
            tracing::warn!(pid, %reason, "sm handshake refused");
        }
    }

    /// Why process `pid` may not have another handshake waiting for its
    /// hello ([`MAX_PENDING_PER_PROCESS`]), if it may not.
    pub(super) fn over_pending_bound(&self, pid: u32) -> Option<String> {
        let waiting = self.pending.values().filter(|p| p.cred.pid == pid).count();
        (waiting >= MAX_PENDING_PER_PROCESS).then(|| {
            format!(
                "process {pid} already has {waiting} connections waiting for their hello \
                 (at most {MAX_PENDING_PER_PROCESS})"
            )
        })
    }

    /// Why process `pid` may not have another connection, if it may not:
    /// whatever names it claims, it gets `max_conns_per_process` of the
    /// connections it made to us (ours to it are not counted).
    fn over_process_bound(&self, pid: u32) -> Option<String> {
        let held = self
            .peers
            .iter()
            .filter(|q| q.pid == pid)
            .flat_map(|q| &q.conns)
            .filter(|c| c.role == Role::Acceptor)
            .count();
        let max = self.cfg.max_conns_per_process;
        (held >= max).then(|| {
            format!("process {pid} already holds {held} connections (at most {max}: SmConfig::max_conns_per_process)")
        })
    }

    fn accept_hello(
        &mut self,
        serial: u64,
        p: PendingAccept,
        r: io::Result<(crate::sys::socket::Received, usize)>,
        buf: &[u8],
    ) -> std::result::Result<String, HelloFailure> {
        let (mut r, refused) = r.map_err(|e| format!("reading hello: {e}"))?;
        match check_hello_parts(r.len, r.fds.len(), refused, r.fds_truncated) {
            HelloParts::Complete => {}
            HelloParts::Departed => return Err(HelloFailure::Departed),
            HelloParts::Broken(reason) => return Err(HelloFailure::Peer(reason)),
            HelloParts::Dropped(reason) => return Err(HelloFailure::Local(reason)),
        }
        let said = &buf[..r.len.min(buf.len())];
        let hello = match decode_hello(said) {
            Ok(h) => h,
            Err(reason) => {
                // A connector of another handshake version is told why
                // (best effort, as past a bound): its error then names
                // both versions instead of a connection closed unexplained.
                if hello_version(said).is_some_and(|v| v != PROTO_VERSION) {
                    let _ = send_with_fds(p.sock.as_fd(), &encode_refusal(&reason), &[]);
                }
                return Err(reason.into());
            }
        };
        let name = SmName::parse_key(&hello.name)?;
        if name.pid != p.cred.pid {
            return Err(format!("hello claims pid {}, kernel says {}", name.pid, p.cred.pid).into());
        }
        let wake_fd = r.fds.pop().ok_or("missing eventfd")?;
        let region_fd = r.fds.pop().ok_or("missing region")?;
        let region =
            SharedRegion::from_peer(region_fd, REGION_LEN).map_err(|e| HelloFailure::of_io("region", &e))?;
        check_region(&region)?;
        let peer_wake = PeerWake::from_peer(wake_fd).map_err(|e| HelloFailure::of_io("wake-up fd", &e))?;
        let my_wake = OwnWake::new(self.wake_kind)
            .map_err(|e| HelloFailure::Local(format!("creating our {}: {e}", self.wake_kind.name())))?;
        let ack = encode_ack();
        // A peer may send into the region it made and exit before we get
        // here (its sends complete without the acknowledgement): then the
        // connection is set up all the same, only to be failed as gone at
        // once, which takes what it sent first.
        let exited = match send_with_fds(p.sock.as_fd(), &ack, &[my_wake.fd_for_peer()]) {
            Ok(n) if n == ACK_LEN => false,
            Ok(n) => return Err(format!("acknowledgement cut short ({n} bytes)").into()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET)) => true,
            Err(e) => return Err(format!("sending acknowledgement: {e}").into()),
        };
        // Nothing more comes with descriptors on this connection: the
        // kernel refuses them to the sender where it can (Linux 6.16).
        refuse_passed_fds(p.sock.as_fd());
        let local = |e: SmError| HelloFailure::Local(na_core::ErrorChain(&e).to_string());
        let mut gone = exited.then(|| "exited during the handshake".to_owned());
        let mut pidfd = None;
        if !exited {
            match self.watch_process(p.sock.as_fd(), p.cred.pid, &p.start, &name.uri(), serial) {
                Ok(fd) => pidfd = fd,
                Err(e @ SmError::Sys { .. }) => return Err(local(e)),
                // Its process is gone (maybe its pid taken by another):
                // set up all the same and failed at once, as above.
                Err(e) => {
                    gone = Some(match NaError::from(e) {
                        NaError::PeerGone { reason, .. } => reason,
                        e => na_core::ErrorChain(&e).to_string(),
                    })
                }
            }
        }
        if gone.is_none() {
            self.poll_add(p.sock.as_fd(), serial).map_err(local)?;
            self.poll_add_wake(&my_wake, serial | WAKE_BIT).map_err(local)?;
        }
        let conn = Conn {
            serial,
            sock: p.sock,
            region,
            head: 0,
            role: Role::Acceptor,
            tx_cur: TxCursor::default(),
            rx_cur: RxCursor::default(),
            my_wake,
            peer_wake: Some(peer_wake),
            wake_owed: false,
            ack_deadline: None,
            armed: false,
            backlog: SendBacklog::new(&self.backlog_total),
            pidfd,
        };
        let tok = self.peer_entry(&name, p.cred.pid, &p.start);
        self.peers.attach(tok, conn);
        if let Some(reason) = gone {
            self.fail_peer(tok, Failure::Gone, &reason);
        }
        Ok(name.uri())
    }
}
