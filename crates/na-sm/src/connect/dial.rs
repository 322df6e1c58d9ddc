//! The connector's side: lookup, connecting and sending the hello, and
//! the listener's acknowledgement (or refusal).

use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use na_core::{Addr, NaError, Result, SendBacklog};

use crate::addr::SmName;
use crate::channel::{init_region, RxCursor, TxCursor, REGION_LEN};
use crate::closer::recv_screened;
use crate::conn::{
    check_ack, encode_hello, refusal_reason, Conn, Role, MAX_REFUSAL, PROTO_VERSION, REFUSAL_MAGIC,
};
use crate::error::{SmError, SmResult};
use crate::identity::PeerStart;
use crate::peer_failure::{wake_failure, Failure};
use crate::plugin::{SmPlugin, WAKE_BIT};
use crate::sys::proc;
use crate::sys::shm::SharedRegion;
use crate::sys::socket::{
    connect_unix, peer_cred, queue_full_timeout, refuse_passed_fds, send_with_fds, try_connect_unix,
};
use crate::sys::wake::{OwnWake, PeerWake};

use super::ConnectWait;

/// Why a listener whose socket credentials say pid `seen` is refused
/// when its address names pid `named`. A process in another PID namespace
/// (a container) is named by its own pid there: sm cannot reach it, as
/// its RMA (`process_vm_readv`/`writev`) names each peer by a pid that
/// both sides must see.
fn pid_mismatch(seen: u32, named: u32) -> String {
    const SHARE: &str = "na-sm needs both processes in one PID namespace (its RMA names \
                         processes by pid): run them in one (e.g. the host's or the pod's), \
                         or use another transport";
    if seen == 0 {
        return format!(
            "the address says pid {named}, but the listener's process is not visible from \
             this PID namespace (it runs in an outer one); {SHARE}"
        );
    }
    match proc::innermost_pid(seen) {
        Some(own) if own == named => {
            format!("the listener is pid {seen} here and pid {named} in its own PID namespace; {SHARE}")
        }
        _ => format!("listener is pid {seen}, the address says {named}"),
    }
}

fn hint(e: io::Error, path: &std::path::Path) -> io::Error {
    let why = match e.raw_os_error() {
        Some(libc::ENOENT) => format!(
            "no socket {}: is the peer running and listening, with the same socket directory ({})?",
            path.display(),
            crate::config::SOCKET_DIR_ENV
        ),
        Some(libc::ECONNREFUSED) => {
            format!(
                "{} exists but nobody listens (stale file; run qs-sm-cleanup)",
                path.display()
            )
        }
        _ => format!("connecting to {}: {e}", path.display()),
    };
    io::Error::new(e.kind(), why)
}

impl SmPlugin {
    /// Resolves `uri`, connecting if it names a peer we have no connection
    /// to (waiting for a full accept queue as `wait` says). Returns as soon
    /// as the hello is sent: the acknowledgement is processed by
    /// `progress`, and sends may start at once.
    pub(crate) fn lookup_uri(&mut self, uri: &str, wait: ConnectWait) -> SmResult<Addr> {
        let name = SmName::parse(uri)?;
        if let Some(tok) = self.peers.by_name(&name.key()) {
            if let Some(p) = self.peers.get(tok) {
                if tok != self.self_tok || !p.conns.is_empty() || self.listener.is_none() {
                    return Ok(p.addr.clone());
                }
            }
        }
        self.connect(&name, wait)
    }

    /// Connects to the self address on first use (a listening instance
    /// talks to itself through a connection to its own socket).
    /// (Inline: it runs on every send; the connection is made out of line.)
    #[inline(always)]
    pub(crate) fn ensure_connected(&mut self, dest: &Addr) -> Result<()> {
        if dest.token() == self.self_tok {
            return self.connect_self();
        }
        Ok(())
    }

    /// A message to self: connects to our own socket the first time (once
    /// per instance). Out of line: NA messages to self are not the RPC
    /// layer's busy path (it runs a call to self without the network).
    #[cold]
    #[inline(never)]
    fn connect_self(&mut self) -> Result<()> {
        if !self.peers.get(self.self_tok).is_some_and(|p| p.conns.is_empty()) {
            return Ok(());
        }
        if self.listener.is_none() {
            return Err(NaError::Unsupported {
                plugin: "sm",
                op: "messages to self on a non-listening instance",
            });
        }
        let name = self.name.clone();
        self.connect(&name, ConnectWait::Bounded)?;
        Ok(())
    }

    fn connect(&mut self, name: &SmName, wait: ConnectWait) -> SmResult<Addr> {
        let uri = name.uri();
        let path = name.socket_path(&self.dir);
        let lookup_err = |source| SmError::Lookup {
            uri: uri.clone(),
            source,
        };
        let timeout = self.cfg.handshake_timeout;
        let sock = match wait {
            ConnectWait::Bounded => connect_unix(&path, timeout).map_err(|e| lookup_err(hint(e, &path)))?,
            ConnectWait::Never { since } => match try_connect_unix(&path) {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Err(if since.elapsed() >= timeout {
                        lookup_err(hint(queue_full_timeout(timeout), &path))
                    } else {
                        SmError::WouldBlock {
                            uri: uri.clone(),
                            reason: format!(
                                "the accept queue of {} is full (the peer is not accepting)",
                                path.display()
                            ),
                        }
                    });
                }
                Err(e) => return Err(lookup_err(hint(e, &path))),
            },
        };
        // Shut, read out and screened before it is closed on every path
        // from here, or closed whole on a closing thread (the listener
        // may have queued descriptors on it: see `closer::PeerSocket`).
        let sock = crate::closer::PeerSocket::new(sock);
        let handshake = |reason: String| SmError::Handshake {
            peer: uri.clone(),
            reason,
        };
        let cred = peer_cred(sock.as_fd()).map_err(|e| SmError::sys("getsockopt(SO_PEERCRED)", e))?;
        if cred.uid != self.uid {
            return Err(handshake(format!(
                "listener runs as uid {}, we are uid {}",
                cred.uid, self.uid
            )));
        }
        if cred.pid != name.pid {
            return Err(handshake(pid_mismatch(cred.pid, name.pid)));
        }
        let start = PeerStart::read(sock.as_fd(), cred.pid);
        // A listener that refused us as it accepted (and closed at once)
        // is not gone, nor unidentified: its reason is the lookup's.
        let refused = |reason: String| SmError::PeerGone {
            peer: uri.clone(),
            reason: format!("refused the connection: {reason}"),
        };
        if matches!(start, PeerStart::Unknown(_)) {
            if let Some(reason) = queued_refusal(sock.as_fd()) {
                return Err(refused(reason));
            }
        }
        let serial = self.next_serial;
        self.next_serial += 1;
        // Before anything else is set up: a listener that is gone (or
        // cannot be told from the process that has its pid now) fails the
        // lookup.
        let pidfd = self.watch_process(sock.as_fd(), cred.pid, &start, &uri, serial)?;
        let mut region = SharedRegion::create(&format!("qs-sm-{}-{serial}", self.name.key()), REGION_LEN)
            .map_err(|e| SmError::sys("memfd_create/mmap of the connection region", e))?;
        init_region(&region, self.name.pid);
        let my_wake = OwnWake::new(self.wake_kind).map_err(|e| SmError::sys(self.wake_kind.name(), e))?;
        let hello = encode_hello(&self.name.key());
        let region_fd = region
            .fd()
            .ok_or_else(|| handshake("region has no descriptor".into()))?;
        let fds = [region_fd, my_wake.fd_for_peer()];
        let n =
            send_with_fds(sock.as_fd(), &hello, &fds).map_err(|e| match queued_refusal(sock.as_fd()) {
                Some(reason) => refused(reason),
                None => handshake(format!("sending hello: {e}")),
            })?;
        region.close_fd();
        if n != hello.len() {
            return Err(handshake(format!(
                "hello cut short ({n} of {} bytes)",
                hello.len()
            )));
        }
        sock.set_nonblocking(true)
            .map_err(|e| SmError::sys("fcntl(O_NONBLOCK)", e))?;
        self.poll_add(sock.as_fd(), serial)?;
        self.poll_add_wake(&my_wake, serial | WAKE_BIT)?;
        let conn = Conn {
            serial,
            sock,
            region,
            head: 0,
            role: Role::Connector,
            tx_cur: TxCursor::default(),
            rx_cur: RxCursor::default(),
            my_wake,
            peer_wake: None,
            wake_owed: false,
            ack_deadline: Some(na_core::deadline_after(
                self.cfg.handshake_timeout.saturating_mul(2),
            )),
            armed: false,
            backlog: SendBacklog::new(&self.backlog_total),
            pidfd,
        };
        let tok = self.peer_entry(name, cred.pid, &start);
        self.peers.attach(tok, conn);
        self.awaiting_ack += 1;
        self.update_timer();
        tracing::info!(peer = %uri, pid = cred.pid, serial, "sm connect");
        self.peers
            .get(tok)
            .map(|p| p.addr.clone())
            .ok_or_else(|| handshake("peer entry vanished during connect".into()))
    }

    /// A connector-side socket is readable before the acknowledgement.
    /// Returns why the handshake failed, if it did: the peer dying (its
    /// socket closed or reset, its wake-up pipe closed) is `Gone`, bytes or
    /// descriptors that break the handshake are a protocol violation.
    pub(crate) fn handle_ack(&mut self, tok: u64, ci: usize) -> std::result::Result<(), (Failure, String)> {
        let bad = |reason: String| (Failure::Protocol, reason);
        let Some(conn) = self.peers.get_mut(tok).and_then(|p| p.conns.get_mut(ci)) else {
            return Ok(());
        };
        let mut buf = [0u8; REFUSAL_MAGIC.len() + MAX_REFUSAL];
        let (mut r, refused) = match recv_screened(conn.sock.as_fd(), &mut buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) => return Err((Failure::Gone, format!("reading acknowledgement: {e}"))),
            Ok(r) => r,
        };
        if refused > 0 {
            return Err(bad(format!(
                "acknowledgement carries {refused} descriptors that are neither an eventfd nor a pipe"
            )));
        }
        if r.len == 0 {
            return Err((Failure::Gone, closed_before_ack()));
        }
        if let Some(reason) = refusal_reason(&buf[..r.len]) {
            return Err((Failure::Gone, format!("refused the connection: {reason}")));
        }
        check_ack(&buf[..r.len]).map_err(bad)?;
        if r.fds_truncated || r.fds.len() != 1 {
            return Err(bad(format!(
                "acknowledgement carries {} descriptors, expected 1",
                r.fds.len()
            )));
        }
        let fd = r.fds.pop().ok_or_else(|| bad("missing eventfd".into()))?;
        // The last descriptor this connection carries (see `accept_hello`).
        refuse_passed_fds(conn.sock.as_fd());
        let wake = PeerWake::from_peer(fd).map_err(|e| bad(format!("wake-up fd: {e}")))?;
        conn.peer_wake = Some(wake);
        conn.ack_deadline = None;
        // Only here: a failed handshake is counted off by `fail_peer`
        // (the connection still has no wake-up fd), not twice.
        self.awaiting_ack = self.awaiting_ack.saturating_sub(1);
        if std::mem::take(&mut conn.wake_owed) {
            // It may have died since it acknowledged: a closed pipe is
            // that, not a violation.
            conn.wake_peer().map_err(|e| wake_failure(&e))?;
            self.stats.signals_sent += 1;
        }
        Ok(())
    }
}

/// Why a listener that closed our connection without a word, after our
/// hello and before its acknowledgement, did. A listener of handshake
/// version 1 (before wake-ups were writes of 0) does so on a hello of
/// another version: it has no refusal to say it with, and its version
/// cannot be changed now; a current one refuses such a hello naming both
/// versions, and closes unexplained only as it exits, when it runs out of
/// descriptors or memory, or while too many peer descriptors wait to be
/// closed (it refuses unread). The version is the likely cause, so the
/// error names it.
fn closed_before_ack() -> String {
    format!(
        "closed the connection instead of acknowledging our hello (handshake version {PROTO_VERSION}): \
         a listener of an older handshake version (1) does so on a hello of another version, \
         which it cannot refuse with a reason; a current one does so only as it exits or \
         when out of descriptors"
    )
}

/// The reason of the refusal a listener queued on `sock` (our end of a
/// connection it closed) before closing it, if that is what comes first
/// there. Read, not peeked: the caller fails the lookup, and the socket's
/// drop reads out the rest. Does not wait.
fn queued_refusal(sock: BorrowedFd<'_>) -> Option<String> {
    let mut buf = [0u8; REFUSAL_MAGIC.len() + MAX_REFUSAL];
    let (r, _) = recv_screened(sock, &mut buf).ok()?;
    refusal_reason(&buf[..r.len])
}
