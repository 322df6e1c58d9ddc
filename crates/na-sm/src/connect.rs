//! Lookup, connection set-up and the accept side of the handshake (see
//! [`crate::conn`] for the protocol).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use na_core::{Addr, NaError, Result, SendBacklog};

use crate::addr::SmName;
use crate::channel::{check_region, init_region, RxCursor, TxCursor, REGION_LEN};
use crate::closer::recv_screened;
use crate::conn::{
    check_ack, decode_hello, encode_ack, encode_hello, encode_refusal, hello_version, refusal_reason, Conn,
    Role, ACK_LEN, MAX_HELLO, MAX_REFUSAL, PROTO_VERSION, REFUSAL_MAGIC,
};
use crate::error::{SmError, SmResult};
use crate::identity::{self, PeerStart};
use crate::peer_failure::{wake_failure, Failure};
use crate::plugin::{PendingAccept, SmPlugin, LISTENER_TOKEN, PIDFD_BIT, WAKE_BIT};
use crate::sys::proc;
use crate::sys::shm::SharedRegion;
use crate::sys::socket::{
    connect_unix, peer_cred, queue_full_timeout, refuse_passed_fds, send_with_fds, try_connect_unix,
};
use crate::sys::wake::{OwnWake, PeerWake};

/// Accepted connections that may wait for their hello at once (each holds
/// a descriptor until its hello or the handshake timeout); with this many
/// waiting, the listener stops accepting until one is done.
pub const MAX_PENDING_HANDSHAKES: usize = 128;

/// Of those, how many one process (by kernel-reported pid) may have
/// waiting at once: its connections past it are refused as they are
/// accepted (with the reason), so that one process that connects and
/// stays silent cannot fill [`MAX_PENDING_HANDSHAKES`] and pause the
/// listener for everyone. An honest connector sends its hello right
/// after connecting, so its handshakes hardly ever wait.
pub const MAX_PENDING_PER_PROCESS: usize = 16;

/// Most connections one pass over the listener accepts (or refuses); a
/// progress call makes a few such passes at most. A pass that reaches the
/// bound leaves the rest queued in the kernel and owes the next call an
/// event poll (the plugin will not sleep until then: a caller that waits
/// on its fd edge-triggered, as tokio does, would get no new edge for a
/// listener that stayed readable). Without a bound, processes that keep
/// connecting at least as fast as we accept could hold one progress call
/// (and every peer's messages behind it) for as long as they go on.
pub const MAX_ACCEPTS_PER_CALL: usize = 32;

/// How long accepting pauses after it failed for want of descriptors or
/// memory.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// Why the listener is out of the epoll set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AcceptPause {
    /// [`MAX_PENDING_HANDSHAKES`] are waiting for their hello.
    Handshakes,
    /// Accepting failed (no descriptors, no memory): retry then.
    Until(Instant),
    /// [`SmConfig::max_queued_total`](crate::SmConfig::max_queued_total)
    /// messages of departed peers are queued: until the application takes
    /// some.
    Queued,
}

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
/// How a lookup that connects waits for a listener whose accept queue is
/// full (a peer that is hung, overloaded or hostile and does not accept).
#[derive(Clone, Copy, Debug)]
pub(crate) enum ConnectWait {
    /// In connect(2), at most `SmConfig::handshake_timeout` (`lookup`).
    Bounded,
    /// Not at all (`try_lookup`): [`SmError::WouldBlock`] at once, or,
    /// once `handshake_timeout` has passed since `since` (the caller's
    /// first attempt), the error the bounded wait gives when it runs out.
    Never {
        /// When the caller's first attempt was made.
        since: Instant,
    },
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
            .map(|f| f.as_raw_fd())
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
        self.poll_add(sock.as_raw_fd(), serial)?;
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

    /// The peer entry a new connection to or from process `pid`, named
    /// `name` and started at `start`, joins: the entry of that name if it
    /// may be the same process. An entry whose process started at another
    /// time is a process that exited, and whose pid (so name) a new one
    /// has now, before its departure was seen here: it is failed as gone
    /// first (its calls, its outputs), and the new process gets an entry
    /// of its own (a new token), never the dead one's.
    fn peer_entry(&mut self, name: &SmName, pid: u32, start: &PeerStart) -> u64 {
        let start = match start {
            PeerStart::Known(t) => Some(*t),
            PeerStart::Unknown(_) | PeerStart::Unreadable(_) => None,
        };
        if let Some(old) = self.peers.by_name(&name.key()) {
            if self.peers.same_process(old, start) {
                return old;
            }
            self.fail_peer(
                old,
                Failure::Gone,
                "exited: its pid and name are now another process's",
            );
        }
        self.peers.insert(self.id, name.clone(), pid, start, false)
    }

    /// A pidfd of process `pid` (`peer` in errors), at the other end of
    /// `sock` and started at `start`, in our epoll set under `serial |
    /// PIDFD_BIT` (edge-triggered: it becomes readable once, when the
    /// process exits). `None` for our own process, and where pidfds are
    /// missing (a debug event says why): then the socket's end-of-file is
    /// the only sign of an exit. An error if the peer is gone, or its pid
    /// names another process now (see `identity`): never that process's.
    fn watch_process(
        &self,
        sock: BorrowedFd<'_>,
        pid: u32,
        start: &PeerStart,
        peer: &str,
        serial: u64,
    ) -> SmResult<Option<OwnedFd>> {
        if pid == self.name.pid {
            return Ok(None);
        }
        let Some(fd) = identity::peer_pidfd(sock, pid, start, self.exit_watch, peer)? else {
            return Ok(None);
        };
        match self.poll.add_edge_triggered(fd.as_raw_fd(), serial | PIDFD_BIT) {
            Ok(()) => Ok(Some(fd)),
            Err(e) => {
                tracing::debug!(pid, error = %e, "sm: cannot watch a peer's pidfd");
                Ok(None)
            }
        }
    }

    fn poll_add(&self, fd: i32, token: u64) -> SmResult<()> {
        self.poll
            .add(fd, token)
            .map_err(|e| SmError::sys("epoll_ctl add", e))
    }

    /// Our wake-up eventfd goes in edge-triggered: each peer write is one
    /// event and the fd is never read (no syscall beyond the wait). It
    /// was made with a counter of 1 and a wake-up is a write of 0, so the
    /// counter stays 1 (unless the peer that holds the other copy changes
    /// it: see `EventFd::signal`). A pipe is edge-triggered too and
    /// drained on each event.
    ///
    /// An eventfd is readable from the start (its counter is 1: a write of
    /// 0 is reported only while it is above 0), and epoll reports a ready
    /// descriptor once when it is added, edge-triggered or not: the set's
    /// next wait returns it though no peer wrote. That report cannot be
    /// avoided (the counter must be above 0 before the peer's first write,
    /// and raising it after the add is itself an edge), only taken where
    /// it costs nothing: `wake_primed` makes `sleep` harvest it before it
    /// blocks, as `try_wait` always does, instead of being woken by it.
    fn poll_add_wake(&mut self, wake: &OwnWake, token: u64) -> SmResult<()> {
        self.poll
            .add_edge_triggered(wake.poll_fd(), token)
            .map_err(|e| SmError::sys("epoll_ctl add (eventfd)", e))?;
        if wake.starts_ready() {
            self.wake_primed = true;
        }
        Ok(())
    }

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
                    tracing::warn!(error = %e, pause = ?ACCEPT_RETRY, "sm: accept failed; pausing accepts");
                    self.pause_accepts(AcceptPause::Until(Instant::now() + ACCEPT_RETRY));
                    return;
                }
            };
            let cred = match peer_cred(sock.as_fd()) {
                Ok(c) => c,
                Err(e) => {
                    if self.stats.refuse_handshake() {
                        tracing::warn!(error = %e, "SO_PEERCRED failed; dropping connection");
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
            if sock.set_nonblocking(true).is_err() || self.poll_add(sock.as_raw_fd(), serial).is_err() {
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
            let _ = self.poll.delete(l.as_raw_fd());
        }
        self.accept_pause = Some(why);
        self.update_timer();
    }

    /// Puts the listener back and accepts what waited meanwhile.
    pub(crate) fn resume_accepts(&mut self) {
        self.accept_pause = None;
        if let Some(l) = &self.listener {
            if let Err(e) = self.poll.add(l.as_raw_fd(), LISTENER_TOKEN) {
                tracing::warn!(error = %e, "sm: re-adding the listener failed; retrying later");
                self.accept_pause = Some(AcceptPause::Until(Instant::now() + ACCEPT_RETRY));
                return;
            }
        }
        self.accept_ready();
    }

    /// Ends handshakes past their deadline (both sides) and resumes a
    /// paused listener when it may go on; then sets the timer to the next
    /// deadline, so all of this happens on time while the plugin sleeps.
    pub(crate) fn sweep_deadlines(&mut self) {
        // First: what departed peers left may make room for the listener.
        self.drop_departed_held();
        let now = Instant::now();
        if !self.pending.is_empty() {
            let late: Vec<u64> = self
                .pending
                .iter()
                .filter(|(_, p)| p.deadline <= now)
                .map(|(s, _)| *s)
                .collect();
            for s in late {
                if let Some(p) = self.pending.remove(&s) {
                    let _ = self.poll.delete(p.sock.as_raw_fd());
                    if self.stats.refuse_handshake() {
                        tracing::warn!(pid = p.cred.pid, "sm handshake timed out");
                    }
                }
            }
        }
        if self.awaiting_ack > 0 {
            let late: Vec<u64> = self
                .peers
                .iter()
                .filter(|p| p.conns.iter().any(|c| c.ack_deadline.is_some_and(|d| d <= now)))
                .map(|p| p.addr.token())
                .collect();
            for tok in late {
                if let Some((failure, reason)) = self.ack_overdue(tok, now) {
                    self.fail_peer(tok, failure, &reason);
                }
            }
        }
        let resume = match self.accept_pause {
            Some(AcceptPause::Handshakes) => self.pending.len() < MAX_PENDING_HANDSHAKES,
            Some(AcceptPause::Queued) => self.held_by_departed() < self.cfg.max_queued_total,
            Some(AcceptPause::Until(t)) => t <= now,
            None => false,
        };
        if resume {
            self.resume_accepts();
        }
        self.update_timer();
    }

    /// Why peer `tok`, with a connection past its acknowledgement deadline,
    /// fails; `None` if the acknowledgement was there after all. It is read
    /// first: it may wait unread (for a connection to ourselves it is made
    /// in the same batch of events whose end runs this sweep).
    fn ack_overdue(&mut self, tok: u64, now: Instant) -> Option<(Failure, String)> {
        let overdue = |c: &Conn| c.ack_deadline.is_some_and(|d| d <= now);
        let late: Vec<usize> = self
            .peers
            .get(tok)?
            .conns
            .iter()
            .enumerate()
            .filter(|(_, c)| overdue(c))
            .map(|(i, _)| i)
            .collect();
        for ci in late {
            if let Err(failure) = self.handle_ack(tok, ci) {
                return Some(failure);
            }
        }
        self.peers.get(tok)?.conns.iter().any(overdue).then(|| {
            let reason = format!(
                "no acknowledgement of the connection within {:?} (the listener is not serving)",
                self.cfg.handshake_timeout.saturating_mul(2)
            );
            (Failure::Gone, reason)
        })
    }

    /// Arms the timer for the earliest deadline: a pending handshake, an
    /// acknowledgement we wait for, the end of an accept pause, the drop
    /// of messages a departed peer left.
    pub(crate) fn update_timer(&mut self) {
        let mut next = self.pending.values().map(|p| p.deadline).min();
        let mut earliest = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        if let Some(AcceptPause::Until(t)) = self.accept_pause {
            earliest(t);
        }
        if let Some(t) = self.matcher.next_departure(self.cfg.departed_hold) {
            earliest(t);
        }
        if self.awaiting_ack > 0 {
            for p in self.peers.iter() {
                for d in p.conns.iter().filter_map(|c| c.ack_deadline) {
                    earliest(d);
                }
            }
        }
        // A wake-up of the owner not seen yet stays due now.
        if self.owner_woken {
            earliest(Instant::now());
        }
        if let Err(e) = self.timer.set(next) {
            tracing::warn!(error = %e, "sm: setting the deadline timer failed");
        }
    }

    /// An accepted socket is readable: take the hello, or drop the socket.
    pub(crate) fn handle_hello(&mut self, serial: u64) {
        let Some(p) = self.pending.get(&serial) else {
            return;
        };
        if crate::closer::congested() {
            // Refused unread: its descriptors stay the kernel's (in flight
            // on the socket, which a closing thread closes), not ours.
            if let Some(p) = self.pending.remove(&serial) {
                let _ = self.poll.delete(p.sock.as_raw_fd());
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
        let _ = self.poll.delete(p.sock.as_raw_fd());
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
    fn refuse_over_bound(&mut self, sock: BorrowedFd<'_>, pid: u32, reason: &str) {
        let _ = send_with_fds(sock, &encode_refusal(reason), &[]);
        if self.stats.refuse_handshake() {
            tracing::warn!(pid, %reason, "sm handshake refused");
        }
    }

    /// Why process `pid` may not have another handshake waiting for its
    /// hello ([`MAX_PENDING_PER_PROCESS`]), if it may not.
    fn over_pending_bound(&self, pid: u32) -> Option<String> {
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
        if r.len == 0 && r.fds.is_empty() && refused == 0 && !r.fds_truncated {
            return Err(HelloFailure::Departed);
        }
        if r.len == 0 {
            return Err("closed before its hello, with descriptors passed".into());
        }
        if refused > 0 {
            // Closed on a closing thread already (see `closer`).
            return Err(format!(
                "hello carries {refused} descriptors that are neither a memfd, an eventfd nor a pipe"
            )
            .into());
        }
        if r.fds_truncated && r.fds.len() < 2 {
            // Fewer than the two a hello carries, and the kernel says it
            // dropped some: it could not give them to us (our descriptor
            // limit; the buffer holds the most one message can carry).
            return Err(HelloFailure::Local(format!(
                "the kernel passed {} of the hello's descriptors and dropped the rest (out of descriptors?)",
                r.fds.len()
            )));
        }
        if r.fds_truncated || r.fds.len() != 2 {
            return Err(format!("hello carries {} descriptors, expected 2", r.fds.len()).into());
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
        let local = |e: SmError| HelloFailure::Local(e.to_string());
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
                        e => e.to_string(),
                    })
                }
            }
        }
        if gone.is_none() {
            self.poll_add(p.sock.as_raw_fd(), serial).map_err(local)?;
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
            return Err((
                Failure::Gone,
                "closed the connection instead of acknowledging".into(),
            ));
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

/// The reason of the refusal a listener queued on `sock` (our end of a
/// connection it closed) before closing it, if that is what comes first
/// there. Read, not peeked: the caller fails the lookup, and the socket's
/// drop reads out the rest. Does not wait.
fn queued_refusal(sock: BorrowedFd<'_>) -> Option<String> {
    let mut buf = [0u8; REFUSAL_MAGIC.len() + MAX_REFUSAL];
    let (r, _) = recv_screened(sock, &mut buf).ok()?;
    refusal_reason(&buf[..r.len])
}
