//! The plugin instance: construction, teardown and the [`Plugin`] trait.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};

use na_core::fasthash::FastMap;
use na_core::hint::cold_path;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use na_core::msgbuf::check_buf_size;
use na_core::sys::epoll::Epoll;
use na_core::{
    Addr, Completion, MsgBuf, MsgBufPool, NaError, OpId, Plugin, PluginId, PluginStats, Report, Result, Rma,
    Tag,
};

use crate::addr::{NameClaim, PeerTable, SmName};
use crate::channel::{MsgKind, Slot, BUF_SIZE};
use crate::config::{check_name, ensure_dir, SmConfig};
use crate::connect::ConnectWait;
use crate::error::{SmError, SmResult};
use crate::heads::HeadList;
use crate::matching::{Matcher, OpPlace};
use crate::send_ops::{dup, op_in_flight, Outgoing};
use crate::sys::cma::IovLists;
use crate::sys::proc;
use crate::sys::socket::PeerCred;
use crate::sys::wake::WakeKind;
use na_core::sys::timer::Timer;

/// Per-process counter for unnamed instances (a number some instance was
/// given as its name is skipped).
static NEXT_INSTANCE: AtomicU32 = AtomicU32::new(0);

/// Internal epoll token of the listening socket.
pub(crate) const LISTENER_TOKEN: u64 = 0;
/// Set in the internal epoll token of a connection's eventfd.
pub(crate) const WAKE_BIT: u64 = 1 << 62;
/// Internal epoll token of the deadline timer.
pub(crate) const TIMER_TOKEN: u64 = 1 << 61;
/// Set in the internal epoll token of a connection's peer pidfd.
pub(crate) const PIDFD_BIT: u64 = 1 << 60;

/// An accepted socket whose hello has not arrived yet.
pub(crate) struct PendingAccept {
    pub sock: crate::closer::PeerSocket,
    pub cred: PeerCred,
    /// The connector's start time, read as it was accepted.
    pub start: crate::identity::PeerStart,
    pub deadline: Instant,
}

/// An unexpected message the spin loop saw at the head of the ring in
/// `SmPlugin::pull_last`, validated there: the take right after uses this
/// slot instead of reading it again (it is the same message when the
/// connection and its read position are still these; a peer that rewrites
/// a slot it published gets the first version's validated length, never
/// an unchecked one).
#[derive(Clone, Copy)]
pub(crate) struct SpinFound {
    /// The connection's serial (never reused): the ring it was seen in.
    pub conn: u64,
    /// The ring's read position when the slot was seen.
    pub pos: u64,
    /// The slot, decoded and validated.
    pub slot: Slot,
}

/// The shared-memory plugin. See the [crate docs](crate) for the design and
/// [`Plugin`] for the call order.
pub struct SmPlugin {
    pub(crate) id: PluginId,
    pub(crate) cfg: SmConfig,
    pub(crate) dir: PathBuf,
    pub(crate) name: SmName,
    /// Our hold on `name` in this process (released on drop).
    _name_claim: NameClaim,
    /// A listening instance's owner file, open and locked for its whole
    /// life: the lock is what tells others it is alive (see
    /// [`crate::cleanup`]). Dropped after the files are removed.
    owner_file: Option<std::fs::File>,
    pub(crate) self_tok: u64,
    pub(crate) uid: u32,
    /// Peer failures found while one is being handled (see `fail_peer`).
    pub(crate) failures_queued: VecDeque<(u64, crate::peer_failure::Failure, String)>,
    /// A peer failure is being handled.
    pub(crate) failing: bool,
    pub(crate) listener: Option<UnixListener>,
    pub(crate) poll: Epoll,
    pub(crate) peers: PeerTable,
    pub(crate) pending: HashMap<u64, PendingAccept>,
    /// Why the listener is out of the epoll set, while it is.
    pub(crate) accept_pause: Option<crate::connect::AcceptPause>,
    /// Fires at the earliest handshake deadline or end of an accept pause.
    pub(crate) timer: Timer,
    /// The timer fired since the last deadline sweep (its expiry was read,
    /// which disarms it): the sweep runs even with no other deadline.
    pub(crate) timer_fired: bool,
    /// When socket events were last read (see `rma_batch`).
    pub(crate) events_at: Instant,
    /// Connector-side connections still waiting for the acknowledgement.
    pub(crate) awaiting_ack: usize,
    pub(crate) next_serial: u64,
    pub(crate) matcher: Matcher,
    pub(crate) ops: FastMap<OpId, OpPlace>,
    pub(crate) completions: VecDeque<Completion>,
    pub(crate) stats: PluginStats,
    /// try_wait raised flags that progress must lower (and drain events).
    pub(crate) armed: bool,
    /// The last `arm` let the owner sleep with a ring whose next message
    /// the flow bound holds back: only a receive posted for it releases
    /// it, and one posted from another thread must wake the owner.
    pub(crate) rings_held: bool,
    /// [`wake_owner`](Self::wake_owner) set the timer to fire now and its
    /// expiry was not read yet: a timer update must not put it later.
    pub(crate) owner_woken: bool,
    pub(crate) tick: u32,
    /// `spin_wait` passed the tick at which socket events are due.
    pub(crate) events_owed: bool,
    /// Some connection may have queued sends (set when one is queued,
    /// cleared by a flush that finds every backlog empty), so the busy
    /// loop skips the walk over all peers when nothing is queued.
    pub(crate) maybe_backlog: bool,
    /// Bytes queued in all connections' send backlogs (their shared total).
    pub(crate) backlog_total: na_core::BacklogTotal,
    pub(crate) tokens: Vec<u64>,
    /// What we create to be woken on.
    pub(crate) wake_kind: WakeKind,
    /// How peers' exits are watched (see `identity`).
    pub(crate) exit_watch: crate::identity::ExitWatch,
    /// Message buffers handed back by sends (they are copied into the ring).
    pub(crate) msg_bufs: MsgBufPool,
    /// Scratch iovec lists of RMA transfers (kept for their capacity).
    pub(crate) iov_lists: IovLists,
    /// Pull mode (`Plugin::pull_unexpected`): unexpected messages wait in
    /// their ring until `take_unexpected` copies them out.
    pub(crate) pull: bool,
    /// Pull mode: how many connections' heads hold an unexpected message,
    /// as the last poll (or the spin loop) counted them, less those
    /// `take_pulled` has since seen emptied (see [`SmPlugin::pull_ready`]).
    /// It lets the take after the last such message answer "none" without
    /// a scan of every ring. A hint: too high costs one empty scan (which
    /// resets it), too low only leaves a message to the next poll (which
    /// recounts).
    pub(crate) pull_heads: u32,
    /// Pull mode: the (peer slot, connection) the last message was taken
    /// from, or the spin loop saw one arrive at; the next take looks at its
    /// head first.
    pub(crate) pull_last: Option<(usize, usize)>,
    /// Pull mode: the spin loop saw an unexpected message arrive at a head
    /// (and counted it), so the progress call right after it need not scan
    /// every ring to find it, and the take need not read and validate its
    /// slot again. Cleared by the next take, progress call or ring poll.
    pub(crate) spin_found: Option<SpinFound>,
    /// Pull mode: the peer slot `take_unexpected` looks at first (peers
    /// take turns).
    pub(crate) pull_next: usize,
    /// Pull mode: unexpected messages of peers that went away, copied out
    /// of their rings before the rings were dropped; taken first.
    pub(crate) pulled_late: VecDeque<(Addr, Tag, Vec<u8>)>,
    /// Every receive ring's head, for cheap "anything new?" checks (see
    /// [`crate::heads`]).
    pub(crate) heads: HeadList,
    /// The rings a poll visits (kept for its capacity).
    pub(crate) ring_scratch: Vec<(usize, usize)>,
    /// The fork generation (`sys::fork`) this instance was created in.
    generation: u64,
}

impl SmPlugin {
    /// Pull mode: some head holds an unexpected message not taken yet (as
    /// counted), or a departed peer's message waits in `pulled_late`.
    pub(crate) fn pull_ready(&self) -> bool {
        self.pull_heads > 0 || !self.pulled_late.is_empty()
    }

    /// Messages received and held for the application: those waiting for
    /// a receive, and a departed peer's unexpected messages of pull mode
    /// not yet taken. At most about twice `SmConfig::max_queued_total`
    /// (connected peers' share by flow control, departed peers' by
    /// pausing the listener: see [`held_by_departed`](Self::held_by_departed)).
    pub(crate) fn held_total(&self) -> usize {
        self.matcher.queued_arrivals + self.pulled_late.len()
    }

    /// After a receive or take that may have taken a departed peer's
    /// queued message: a listener paused for them goes on as soon as there
    /// is room, here, not at the next progress call. (The owner may sleep
    /// meanwhile, a tokio driver say, while another thread takes them; the
    /// listener is out of the epoll set, so no event would come.)
    #[inline]
    pub(crate) fn resume_if_queued_taken(&mut self) {
        if self.accept_pause == Some(crate::connect::AcceptPause::Queued) {
            let owner_sleeps = self.armed;
            self.maybe_resume_accepts();
            // Connections accepted here (unarmed) and listener events
            // taken: the owner asleep on our fd must look again.
            if owner_sleeps {
                self.wake_owner();
            }
        }
    }

    /// [`wake_owner`](Self::wake_owner) if the owner sleeps on our fd and
    /// completions wait that nothing else would wake it for (a receive
    /// that matched a queued message at once, a peer failed by a send):
    /// one load when it does not sleep.
    #[inline]
    pub(crate) fn wake_owner_if_work(&mut self) {
        if self.armed && !self.completions.is_empty() {
            self.wake_owner();
        }
    }

    /// Makes our fd readable at once (the deadline timer fires now), for
    /// an owner asleep on it: called where a call from another thread took
    /// events or queued work that the owner's sleep would otherwise not
    /// see. Its progress then handles them (and sets the timer back).
    #[cold]
    pub(crate) fn wake_owner(&mut self) {
        match self.timer.set(Some(std::time::Instant::now())) {
            Ok(()) => self.owner_woken = true,
            Err(e) => tracing::warn!(error = %e, "sm: waking the owner through the timer failed"),
        }
    }

    /// [`wake_owner`](Self::wake_owner) after a receive was posted from
    /// another thread while the owner sleeps past a held ring (see
    /// `rings_held`): the receive may be what releases its message.
    #[inline]
    fn wake_owner_if_held(&mut self) {
        if self.armed && self.rings_held {
            self.wake_owner();
        }
    }

    /// The part of [`held_total`](Self::held_total) that peers no longer
    /// connected left (their rings were taken whole, past the flow bound):
    /// what pauses the listener (see `SmConfig::max_queued_total`).
    /// Walks the peers holding messages: called per accept, and on each
    /// progress call only while the listener is paused for it.
    pub(crate) fn held_by_departed(&self) -> usize {
        queued_by_departed(&self.matcher, &self.peers) + self.pulled_late.len()
    }

    /// True when connected peers' messages waiting for a receive reach
    /// `SmConfig::max_queued_total`: rings whose next message would be
    /// queued are not drained. Departed peers' messages have a share of
    /// their own (they pause the listener), so they do not count here.
    #[inline]
    pub(crate) fn connected_over_total(&self) -> bool {
        let (queued, max) = (self.matcher.queued_arrivals, self.cfg.max_queued_total);
        // The walk over departed peers only when the total alone reaches
        // the bound, which is rare.
        queued >= max && {
            cold_path();
            queued - queued_by_departed(&self.matcher, &self.peers) >= max
        }
    }

    /// Creates an instance: with `config.listen`, binds
    /// `<dir>/<pid>-<instance>.sock` (dir created 0700, socket 0600).
    pub fn new(id: PluginId, config: SmConfig) -> SmResult<SmPlugin> {
        if config.handshake_timeout.is_zero() {
            // The socket layer reads zero as "no limit": a connect to a
            // listener whose queue is full would block for good.
            return Err(SmError::Config {
                name: "SmConfig::handshake_timeout".into(),
                value: "0".into(),
                reason: "must be above zero (zero would mean no limit on connect and handshake)".into(),
            });
        }
        let dir = config.resolve_dir()?;
        let wake_kind = config.resolve_wake()?;
        let exit_watch = config.resolve_exit_watch()?;
        let named = |instance| SmName {
            pid: proc::pid(),
            instance,
        };
        let (name, name_claim) = match &config.name {
            Some(n) => {
                check_name(n).map_err(|reason| SmError::Config {
                    name: "sm instance name".into(),
                    value: n.clone(),
                    reason,
                })?;
                let name = named(n.clone());
                let Some(claim) = NameClaim::take(&name) else {
                    tracing::warn!(name = %name.uri(), "sm instance name already used in this process: refused");
                    return Err(SmError::NameInUse { uri: name.uri() });
                };
                (name, claim)
            }
            None => loop {
                let name = named(NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed).to_string());
                if let Some(claim) = NameClaim::take(&name) {
                    break (name, claim);
                }
            },
        };
        if config.allow_any_ptracer {
            proc::allow_any_ptracer().map_err(|e| SmError::sys("prctl(PR_SET_PTRACER)", e))?;
        }
        crate::sys::fork::install().map_err(|e| SmError::sys("pthread_atfork", e))?;
        let generation = crate::sys::fork::generation();
        let poll = Epoll::new().map_err(|e| SmError::sys("epoll_create1", e))?;
        let timer = Timer::new().map_err(|e| SmError::sys("timerfd_create", e))?;
        poll.add(timer.as_fd().as_raw_fd(), TIMER_TOKEN)
            .map_err(|e| SmError::sys("epoll_ctl add timer", e))?;
        let mut peers = PeerTable::default();
        let self_tok = peers.insert(id, name.clone(), proc::pid(), None, true);
        let mut plugin = SmPlugin {
            id,
            cfg: config,
            dir,
            name,
            _name_claim: name_claim,
            owner_file: None,
            self_tok,
            uid: proc::uid(),
            failures_queued: VecDeque::new(),
            failing: false,
            listener: None,
            poll,
            peers,
            pending: HashMap::new(),
            accept_pause: None,
            timer,
            timer_fired: false,
            events_at: Instant::now(),
            awaiting_ack: 0,
            next_serial: 16,
            matcher: Matcher::default(),
            ops: FastMap::default(),
            completions: VecDeque::new(),
            stats: PluginStats::default(),
            armed: false,
            rings_held: false,
            owner_woken: false,
            tick: 0,
            events_owed: false,
            maybe_backlog: false,
            backlog_total: na_core::BacklogTotal::default(),
            tokens: Vec::with_capacity(32),
            wake_kind,
            exit_watch,
            msg_bufs: MsgBufPool::default(),
            iov_lists: IovLists::default(),
            pull: false,
            pull_heads: 0,
            pull_last: None,
            spin_found: None,
            pull_next: 0,
            pulled_late: VecDeque::new(),
            heads: HeadList::default(),
            ring_scratch: Vec::new(),
            generation,
        };
        if plugin.cfg.listen {
            plugin.listen()?;
        }
        tracing::info!(addr = %plugin.name.uri(), listen = plugin.cfg.listen, wake = wake_kind.name(), "sm plugin created");
        Ok(plugin)
    }

    fn listen(&mut self) -> SmResult<()> {
        ensure_dir(&self.dir)?;
        // On NFS, flock is emulated with POSIX locks, which belong to the
        // process: our own cleanup would take a sibling instance's lock for
        // free and remove its files. Other processes' locks still hold.
        let per_process_locks = std::fs::File::open(&self.dir)
            .and_then(|d| crate::sys::lock::lock_is_per_process(&d))
            .unwrap_or(false);
        if per_process_locks && self.cfg.cleanup_on_start {
            tracing::warn!(dir = %self.dir.display(), "sm: the socket directory is on NFS, whose locks are per process: \
                stale-file cleanup at start skipped (run qs-sm-cleanup from another process)");
        }
        if self.cfg.cleanup_on_start && !per_process_locks {
            match crate::cleanup::cleanup_stale(&self.dir) {
                Ok(r) if !r.removed.is_empty() => {
                    tracing::info!(removed = r.removed.len(), dir = %self.dir.display(), "removed stale sm files")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "stale-file cleanup failed"),
            }
        }
        // The name is ours once our locked owner file is in place (never
        // over a live owner's: see `cleanup::claim_name`); only then are
        // files under it ours to replace.
        let owner = crate::cleanup::claim_name(&self.dir, &self.name)?;
        let path = self.name.socket_path(&self.dir);
        match self.bind_claimed(&path) {
            Ok(listener) => {
                self.listener = Some(listener);
                self.owner_file = Some(owner);
                Ok(())
            }
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                let _ = std::fs::remove_file(self.name.owner_path(&self.dir));
                Err(e)
            }
        }
    }

    /// Binds the socket of a name we hold: a socket file already there was
    /// left by a dead owner of the name.
    fn bind_claimed(&self, path: &std::path::Path) -> SmResult<UnixListener> {
        let err = |source| SmError::Listen {
            path: path.to_owned(),
            source,
        };
        match std::fs::remove_file(path) {
            Ok(()) => tracing::info!(path = %path.display(), "removed a dead owner's socket file"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e)),
        }
        let listener = UnixListener::bind(path).map_err(err)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
        listener.set_nonblocking(true).map_err(err)?;
        self.poll
            .add(listener.as_raw_fd(), LISTENER_TOKEN)
            .map_err(|e| SmError::sys("epoll_ctl add listener", e))?;
        Ok(listener)
    }

    /// The socket directory in use.
    pub fn socket_dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Test hook for hostile-peer tests: overwrites the control pages, rings
    /// and buffers of our connection to `peer` (the real shared mapping the
    /// peer reads) with pseudo-random bytes from `seed`, then wakes the peer.
    /// Never use outside tests: it destroys the connection.
    #[doc(hidden)]
    pub fn debug_scribble(&mut self, peer: &Addr, seed: u64) -> Result<()> {
        let conn = self.debug_conn(peer)?;
        crate::channel::scribble(&conn.region, seed);
        conn.wake_peer().map_err(|e| NaError::sys("eventfd write", e))?;
        Ok(())
    }

    /// Test hook for hostile-peer tests: publishes to `peer` an unexpected
    /// message with tag `tag` that names buffer 0 without reserving it (a
    /// protocol violation the receiver finds when it frees the buffer),
    /// then wakes the peer. Never use outside tests.
    #[doc(hidden)]
    pub fn debug_forge_unreserved(&mut self, peer: &Addr, tag: Tag) -> Result<()> {
        let conn = self.debug_conn(peer)?;
        assert!(
            conn.backlog.is_empty(),
            "debug_forge_unreserved: sends are queued"
        );
        let mut tx_cur = conn.tx_cur;
        conn.tx().forge_unreserved(&mut tx_cur, tag);
        conn.tx_cur = tx_cur;
        conn.wake_peer().map_err(|e| NaError::sys("eventfd write", e))?;
        Ok(())
    }

    /// Test hook for hostile-peer tests: closes the read end of our own
    /// wake-up pipe for `peer`, so that its wake-up writes fail with
    /// `EPIPE`, as if we had exited. Pipe wake-ups only (eventfd: an
    /// error). Never use outside tests.
    #[doc(hidden)]
    pub fn debug_deafen(&mut self, peer: &Addr) -> Result<()> {
        let conn = self.debug_conn(peer)?;
        let crate::sys::wake::OwnWake::Pipe { read, .. } = &mut conn.my_wake else {
            return Err(NaError::sys(
                "debug_deafen",
                std::io::Error::other("needs pipe wake-ups (SmConfig::wake)"),
            ));
        };
        let null = std::fs::File::open("/dev/null").map_err(|e| NaError::sys("open /dev/null", e))?;
        *read = std::os::fd::OwnedFd::from(null);
        Ok(())
    }

    /// Test hook for hostile-peer tests: tells `peer` we wait for room
    /// (without arming anything), so that it tries to wake us when it next
    /// hands slots back. Never use outside tests.
    #[doc(hidden)]
    pub fn debug_want_wake(&mut self, peer: &Addr) -> Result<()> {
        let conn = self.debug_conn(peer)?;
        conn.tx()
            .tx_waiting()
            .store(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// Test hook for hostile-peer tests: does `t` to the eventfd we wake
    /// `peer` on (the peer's: what a hostile peer may do to its victim's
    /// eventfd). An error before the peer's eventfd came (a connector's
    /// before the acknowledgement) or with pipe wake-ups. Never use
    /// outside tests.
    #[doc(hidden)]
    pub fn debug_tamper_peer_wake(&mut self, peer: &Addr, t: crate::sys::eventfd::WakeTamper) -> Result<()> {
        let conn = self.debug_conn(peer)?;
        let Some(wake) = &conn.peer_wake else {
            return Err(NaError::sys(
                "debug_tamper_peer_wake",
                std::io::Error::other("no wake-up descriptor of the peer yet"),
            ));
        };
        wake.tamper(t)
            .map_err(|e| NaError::sys("debug_tamper_peer_wake", e))
    }

    /// Test hook for hostile-peer tests: does `t` to the eventfd `peer`
    /// wakes us on (ours, whose description the peer shares: what a
    /// hostile peer may do to the eventfd its victim writes). Never use
    /// outside tests.
    #[doc(hidden)]
    pub fn debug_tamper_own_wake(&mut self, peer: &Addr, t: crate::sys::eventfd::WakeTamper) -> Result<()> {
        let conn = self.debug_conn(peer)?;
        conn.my_wake
            .tamper(t)
            .map_err(|e| NaError::sys("debug_tamper_own_wake", e))
    }

    /// Test hook: whether `peer` has raised its sleep flag on the channel
    /// we send it on (it armed for a sleep, and a message from us will
    /// write its wake-up descriptor). Never use outside tests.
    #[doc(hidden)]
    pub fn debug_peer_sleeps(&mut self, peer: &Addr) -> Result<bool> {
        let conn = self.debug_conn(peer)?;
        Ok(conn.tx().rx_waiting().load(std::sync::atomic::Ordering::SeqCst) != 0)
    }

    fn debug_conn(&mut self, peer: &Addr) -> Result<&mut crate::conn::Conn> {
        let p = self
            .peers
            .get_mut(peer.token())
            .ok_or_else(|| NaError::PeerGone {
                peer: peer.uri().into(),
                reason: "not connected".into(),
            })?;
        p.conns.first_mut().ok_or_else(|| NaError::PeerGone {
            peer: peer.uri().into(),
            reason: "no connection".into(),
        })
    }

    pub(crate) fn gone(&self, dest: &Addr, reason: &str) -> NaError {
        NaError::PeerGone {
            peer: dest.uri().to_owned(),
            reason: reason.into(),
        }
    }

    /// The address must be ours (its token is then checked against the
    /// peer table by every use: a forged one finds no peer).
    #[inline]
    fn check_dest(&self, dest: &Addr) -> Result<()> {
        if dest.plugin() != self.id {
            return Err(foreign_addr(dest, self.id));
        }
        self.check_not_inherited()
    }

    /// Refuses to work in a process forked from the one that created this
    /// instance: its rings, peers and address are the parent's (a child
    /// that polled them would take its parent's messages, and its peers'
    /// transfers would reach the parent). Dropping it is fine.
    #[inline]
    pub(crate) fn check_not_inherited(&self) -> Result<()> {
        if crate::sys::fork::generation() == self.generation {
            return Ok(());
        }
        Err(inherited(&self.name))
    }

    /// Sends a message buffer's bytes (copied into the ring or backlog)
    /// and keeps the buffer for the next `alloc_msg_buf`.
    fn send_from_buf(&mut self, dest: &Addr, kind: MsgKind, tag: Tag, buf: MsgBuf, op: OpId) -> Result<()> {
        let r = self.send(dest, kind, tag, &[buf.as_slice()], op, Report::All);
        self.msg_bufs.recycle(buf);
        r
    }

    /// Sends the concatenation of `parts`, written straight into the ring
    /// slot (or reserved buffer): no message buffer, no joining copy.
    #[inline(always)]
    fn send(
        &mut self,
        dest: &Addr,
        kind: MsgKind,
        tag: Tag,
        parts: &[&[u8]],
        op: OpId,
        report: Report,
    ) -> Result<()> {
        // Two parts (an RPC's header and payload) and one (an NA message)
        // are the usual cases: a plain add, not the vectorized sum's set-up.
        // (Two slices, each at most isize::MAX bytes, cannot overflow a
        // usize; more can, and are summed checked.)
        let len = match parts {
            [a, b] => a.len() + b.len(),
            [a] => a.len(),
            _ => sum_lens(parts)?,
        };
        if len > BUF_SIZE {
            cold_path();
            return Err(NaError::MessageTooLarge {
                len,
                max: BUF_SIZE,
                kind: if kind == MsgKind::Unexpected {
                    "unexpected"
                } else {
                    "expected"
                },
            });
        }
        self.check_dest(dest)?;
        self.ensure_connected(dest)?;
        match self.send_on(
            dest.token(),
            Outgoing {
                kind,
                tag,
                parts,
                len,
            },
            op,
            report,
        ) {
            Some(sent) => sent,
            None => {
                cold_path();
                Err(self.gone(dest, "not connected (it disconnected earlier)"))
            }
        }
    }
}

/// The total length of `parts`, checked (out of line: a send of more than
/// two parts is neither the RPC layer's nor na-perf's).
#[inline(never)]
fn sum_lens(parts: &[&[u8]]) -> Result<usize> {
    na_core::msgbuf::parts_len(parts)
}

/// The error for an instance used in a forked child.
#[cold]
fn inherited(name: &SmName) -> NaError {
    NaError::Plugin {
        plugin: "sm",
        message: format!(
            "instance {} was created by process {} and this process is a fork of it: \
             its rings, peers and address are the parent's; create a new instance in the child \
             (dropping the inherited one is fine)",
            name.uri(),
            name.pid
        ),
    }
}

/// The error for an address of another plugin (out of line: the check
/// itself is on every operation's path).
#[cold]
fn foreign_addr(dest: &Addr, id: PluginId) -> NaError {
    NaError::InvalidAddress {
        uri: dest.uri().into(),
        reason: format!("belongs to plugin {:?}, not to sm plugin {:?}", dest.plugin(), id),
    }
}

/// `take_completions`' move, out of line so that the empty check stays a
/// few instructions on every turn of a busy loop.
#[inline(never)]
fn move_all(from: &mut VecDeque<Completion>, to: &mut VecDeque<Completion>) {
    to.append(from);
}

impl Drop for SmPlugin {
    fn drop(&mut self) {
        // A forked child that drops its copy must not take the parent's
        // live listener's files with it. (Its copy of the owner file's
        // descriptor shares the parent's lock, which closing it keeps.)
        if let Some(listener) = self.listener.take() {
            if proc::pid() == self.name.pid {
                let _ = std::fs::remove_file(self.name.socket_path(&self.dir));
                let _ = std::fs::remove_file(self.name.owner_path(&self.dir));
                // Connections not accepted yet go with it, and what they
                // queued (descriptors included: see `closer`).
                crate::closer::close_listener(listener);
            } else {
                // The parent's: closing our copy must not touch the socket.
                crate::closer::close_later(listener);
            }
        }
        // The lock goes only after the files (a cleanup elsewhere would
        // otherwise find our owner file unlocked and remove it).
        self.owner_file.take();
        tracing::info!(addr = %self.name.uri(), "sm plugin closed");
    }
}

impl Plugin for SmPlugin {
    fn scheme(&self) -> &'static str {
        "sm"
    }

    fn id(&self) -> PluginId {
        self.id
    }

    fn self_addr(&self) -> Addr {
        self.peers
            .get(self.self_tok)
            .map(|p| p.addr.clone())
            .unwrap_or_else(|| Addr::new(self.name.uri(), self.id, self.self_tok, true))
    }

    fn lookup(&mut self, uri: &str) -> Result<Addr> {
        self.check_not_inherited()?;
        Ok(self.lookup_uri(uri, ConnectWait::Bounded)?)
    }

    fn try_lookup(&mut self, uri: &str, since: std::time::Instant) -> Result<Addr> {
        self.check_not_inherited()?;
        Ok(self.lookup_uri(uri, ConnectWait::Never { since })?)
    }

    fn max_unexpected_size(&self) -> usize {
        BUF_SIZE
    }

    fn max_expected_size(&self) -> usize {
        BUF_SIZE
    }

    fn max_tag(&self) -> Tag {
        Tag::MAX
    }

    fn send_unexpected(&mut self, dest: &Addr, tag: Tag, data: &[u8], op: OpId) -> Result<()> {
        self.send(dest, MsgKind::Unexpected, tag, &[data], op, Report::All)
    }

    fn send_unexpected_parts(
        &mut self,
        dest: &Addr,
        tag: Tag,
        parts: &[&[u8]],
        op: OpId,
        report: Report,
    ) -> Result<()> {
        self.send(dest, MsgKind::Unexpected, tag, parts, op, report)
    }

    fn send_expected(&mut self, dest: &Addr, tag: Tag, data: &[u8], op: OpId) -> Result<()> {
        self.send(dest, MsgKind::Expected, tag, &[data], op, Report::All)
    }

    /// Heap buffers from a free list: the ring lives in memory the peer
    /// can write, so a message is built privately and copied in either way.
    fn alloc_msg_buf(&mut self, size: usize) -> Result<MsgBuf> {
        check_buf_size(size, BUF_SIZE)?;
        Ok(self.msg_bufs.alloc(BUF_SIZE))
    }

    fn send_unexpected_buf(&mut self, dest: &Addr, tag: Tag, buf: MsgBuf, op: OpId) -> Result<()> {
        self.send_from_buf(dest, MsgKind::Unexpected, tag, buf, op)
    }

    fn send_expected_buf(&mut self, dest: &Addr, tag: Tag, buf: MsgBuf, op: OpId) -> Result<()> {
        self.send_from_buf(dest, MsgKind::Expected, tag, buf, op)
    }

    fn post_recv_unexpected(&mut self, buf: Vec<u8>, op: OpId) -> Result<()> {
        self.check_not_inherited()?;
        if self.pull {
            return Err(NaError::Unsupported {
                plugin: "sm",
                op: "posting unexpected receives in pull mode",
            });
        }
        // Posted unexpected receives are kept out of `ops` (the matcher
        // tracks their ids): one lookup here instead of an insert here and
        // a removal on delivery.
        if op_in_flight(&self.ops, &self.matcher, op) {
            return Err(dup(op));
        }
        self.matcher.post_unexpected(op, buf, &mut self.completions);
        self.resume_if_queued_taken();
        self.wake_owner_if_work();
        self.wake_owner_if_held();
        Ok(())
    }

    fn post_recv_expected(&mut self, source: &Addr, tag: Tag, buf: Vec<u8>, op: OpId) -> Result<()> {
        self.check_dest(source)?;
        let tok = source.token();
        if self.peers.get(tok).is_none() && !self.matcher.has_arrived_expected(tok, tag) {
            return Err(self.gone(source, "not connected (it disconnected earlier)"));
        }
        // The entry refuses an id in `ops`; the matcher one of a posted
        // unexpected receive (what `op_in_flight` checks, in one lookup).
        let Entry::Vacant(slot) = self.ops.entry(op) else {
            return Err(dup(op));
        };
        if self.matcher.has_posted_unexpected(op) {
            return Err(dup(op));
        }
        if self
            .matcher
            .post_expected(source, tag, op, buf, &mut self.completions)
        {
            slot.insert(OpPlace::RecvExpected(tok, tag));
        }
        self.resume_if_queued_taken();
        self.wake_owner_if_work();
        self.wake_owner_if_held();
        Ok(())
    }

    fn rma(&mut self, dest: &Addr, ops: &[Rma<'_>]) -> Result<()> {
        self.check_dest(dest)?;
        let r = self.rma_batch(dest, ops);
        // Its completions are queued already (see `wake_owner_if_work`).
        self.wake_owner_if_work();
        r
    }

    /// Records the handle's segments as exposed (see `exposed`): a
    /// transfer to this process's own address may touch only those. Peers
    /// need no registration (`process_vm_readv/writev` reach any address).
    fn mem_register(&mut self, mem: &na_core::MemHandle) -> Result<()> {
        crate::exposed::register(self.id, mem)
    }

    /// Addresses and lengths, keyed with the registration's token (see
    /// `exposed`): the key is what a transfer to this process's own
    /// address must show; other processes ignore it.
    fn mem_describe(&self, mem: &na_core::MemHandle) -> Result<na_core::RemoteMem> {
        crate::exposed::describe(self.id, mem)
    }

    fn spin_wait(&mut self, max: u32) -> u32 {
        if self.check_not_inherited().is_err() {
            return 0;
        }
        self.spin_for_work(max)
    }

    fn pull_unexpected(&mut self) -> Result<bool> {
        if self.matcher.posted_unexpected() > 0 || self.matcher.has_arrived_unexpected() {
            return Err(NaError::Plugin {
                plugin: "sm",
                message: "pull mode must be chosen before unexpected receives are posted or messages arrive"
                    .into(),
            });
        }
        self.pull = true;
        Ok(true)
    }

    fn take_unexpected(&mut self, buf: &mut Vec<u8>) -> Result<Option<(Addr, Tag)>> {
        self.check_not_inherited()?;
        Ok(self.take_pulled(buf))
    }

    fn unexpected_ready(&self) -> bool {
        self.pull_ready()
    }

    fn cancel(&mut self, op: OpId) -> Result<()> {
        let r = self.cancel_op(op);
        self.wake_owner_if_work();
        r
    }

    fn poll_fd(&self) -> Option<RawFd> {
        Some(self.poll.as_raw_fd())
    }

    fn try_wait(&mut self) -> Result<bool> {
        // Harvest fd events first (connections, hang-ups, handshake bytes):
        // a caller that waits on our fd edge-triggered (tokio's AsyncFd)
        // would not be told about them again. One epoll_wait(0) per sleep.
        self.check_not_inherited()?;
        self.poll_events()?;
        Ok(self.arm())
    }

    /// Arms without the harvest `try_wait` makes (the wait below returns
    /// pending events at once) and waits on the internal epoll set itself.
    fn sleep(&mut self, timeout: Option<Duration>) -> Result<bool> {
        self.check_not_inherited()?;
        if self.arm() {
            self.wait_events(timeout)?;
        }
        Ok(true)
    }

    fn progress(&mut self) -> Result<usize> {
        self.check_not_inherited()?;
        self.make_progress()
    }

    fn pop_completion(&mut self) -> Option<Completion> {
        self.completions.pop_front()
    }

    fn take_completions(&mut self, out: &mut VecDeque<Completion>) {
        // Called on every turn of a busy loop: skip append's reserve and
        // copy calls when there is nothing to move.
        if !self.completions.is_empty() {
            move_all(&mut self.completions, out);
        }
    }

    fn stats(&self) -> PluginStats {
        let peers = self
            .peers
            .iter()
            .filter(|p| p.addr.token() != self.self_tok)
            .count() as u64;
        PluginStats {
            in_flight: (self.ops.len() + self.matcher.posted_unexpected()) as u64,
            queued_arrivals: self.held_total() as u64,
            peers,
            peer_entries: peers,
            backlog_bytes: self.backlog_total.bytes() as u64,
            ..self.stats
        }
    }
}

/// Messages in `matcher` from peers no longer in `peers`.
pub(crate) fn queued_by_departed(matcher: &Matcher, peers: &PeerTable) -> usize {
    matcher
        .queued_by_peer()
        .filter(|&(tok, _)| peers.get(tok).is_none())
        .map(|(_, n)| n)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// A listen under a name a live instance holds (one of this process
    /// here; in practice one in another PID namespace with our pid) is
    /// refused with `AddrInUse`: the live instance's owner file and socket
    /// are neither rewritten nor removed, and nothing connects to it.
    #[test]
    fn listen_under_a_live_instances_name_refuses_and_leaves_it_alone() {
        let dir = std::env::temp_dir().join(format!("qs-sm-plugin-taken-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = |listen, name: &str| {
            SmConfig {
                listen,
                ..SmConfig::default()
            }
            .with_dir(&dir)
            .with_name(name)
        };
        let live = SmPlugin::new(PluginId(1), cfg(true, "taken")).unwrap();
        let (owner, sock) = (live.name.owner_path(&dir), live.name.socket_path(&dir));
        let state = || {
            let (o, s) = (
                std::fs::metadata(&owner).unwrap(),
                std::fs::metadata(&sock).unwrap(),
            );
            (std::fs::read(&owner).unwrap(), o.ino(), o.mtime_nsec(), s.ino())
        };
        let before = state();
        let mut other = SmPlugin::new(PluginId(2), cfg(false, "other")).unwrap();
        // The same name, as a process with our pid in another PID
        // namespace would have it (this process's registry would refuse
        // it before any file is looked at).
        other.name = live.name.clone();
        let e = other.listen().unwrap_err();
        let SmError::Listen { source, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!(source.kind(), std::io::ErrorKind::AddrInUse, "{e}");
        assert!(e.to_string().contains("by a live process"), "{e}");
        assert!(other.listener.is_none());
        drop(other);
        assert_eq!(state(), before, "the live instance's files changed");
        let accepted = live.listener.as_ref().unwrap().accept();
        assert!(
            matches!(&accepted, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "the refused listen connected to the live instance: {accepted:?}"
        );
        drop(live);
        assert!(!owner.exists() && !sock.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
