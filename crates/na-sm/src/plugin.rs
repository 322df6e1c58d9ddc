//! The plugin instance: its state, the helpers the other modules share,
//! and teardown. Construction is in `setup`, the [`Plugin`](na_core::Plugin) trait in
//! `api`, the hostile-peer test hooks in `debug_hooks` (feature `test-hooks`).

mod api;
#[cfg(feature = "test-hooks")]
mod debug_hooks;
mod setup;

use std::collections::{HashMap, VecDeque};

use na_core::fasthash::FastMap;
use na_core::hint::cold_path;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::AtomicU32;
use std::time::Instant;

use na_core::sys::epoll::Epoll;
use na_core::{Addr, Completion, MsgBufPool, NaError, OpId, PluginId, PluginStats, Result, Tag};

use crate::addr::{NameClaim, PeerTable, SmName};
use crate::channel::Slot;
use crate::config::SmConfig;
use crate::heads::HeadList;
use crate::matching::{Matcher, OpPlace};
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
/// Internal epoll token of the RMA transfer threads' wake-up eventfd.
pub(crate) const POOL_TOKEN: u64 = 1 << 59;

/// [`SmPlugin::side_work`]: some connection may have queued sends.
pub(crate) const SIDE_BACKLOG: u8 = 1;
/// [`SmPlugin::side_work`]: the RMA transfer threads exist (made on the
/// first batch handed to them; never unset).
pub(crate) const SIDE_RMA_POOL: u8 = 2;

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
/// [`Plugin`](na_core::Plugin) for the call order.
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
    /// Test hook: mirrors `accept_pause` for the `ListenerProbe` handed
    /// out, if one was (a no-op without the `test-hooks` feature).
    pub(crate) listener_hooks: crate::connect::ListenerHooks,
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
    /// A wake-up eventfd joined the epoll set after its last wait: the
    /// set reports it once, at its next wait, though nobody wrote it (see
    /// `connect::poll_add_wake`). `sleep` harvests that report before it
    /// blocks, so it cannot end the sleep at once for nothing.
    pub(crate) wake_primed: bool,
    /// Blocking waits of the epoll set (`Plugin::sleep`) that a wake-up
    /// descriptor's event ended (for tests: each should be a peer's
    /// signal).
    pub(crate) wakeups: u64,
    /// Work off the busy path that progress must look at, a bit each:
    /// [`SIDE_BACKLOG`], some connection may have queued sends (set when
    /// one is queued, cleared by a flush that finds every backlog empty),
    /// so the busy loop skips the walk over all peers when nothing is
    /// queued; [`SIDE_RMA_POOL`], transfer threads exist, whose results
    /// may wait. One byte tested once per progress and spin turn: with
    /// neither (no queued sends, inline RMA: the default) the transfer
    /// threads cost the busy path nothing (`progress.rs`, `side_turn`).
    pub(crate) side_work: u8,
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
    /// `SmConfig::rma_threads`, resolved: 0 moves RMA on the caller's
    /// thread.
    pub(crate) rma_threads: usize,
    /// The RMA transfer threads (made on the first batch handed to them;
    /// boxed: the inline mode's instance stays as small as it was).
    pub(crate) rma_pool: Option<Box<crate::rma::RmaPool>>,
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
            Err(e) => {
                tracing::warn!(error = %na_core::ErrorChain(&e), "sm: waking the owner through the timer failed")
            }
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

    /// RMA transfer threads' results wait to be taken (see
    /// `take_rma_results`): one load when there is no pool.
    #[inline]
    pub(crate) fn rma_results_wait(&self) -> bool {
        self.rma_pool.as_ref().is_some_and(|p| p.has_done())
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

/// Messages in `matcher` from peers no longer in `peers`.
pub(crate) fn queued_by_departed(matcher: &Matcher, peers: &PeerTable) -> usize {
    matcher
        .queued_by_peer()
        .filter(|&(tok, _)| peers.get(tok).is_none())
        .map(|(_, n)| n)
        .sum()
}
