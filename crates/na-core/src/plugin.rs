//! The trait every transport plugin implements.

use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use crate::addr::{Addr, PluginId};
use crate::error::{NaError, Result};
use crate::mem::{MemHandle, RemoteMem};
use crate::msgbuf::{check_buf_size, MsgBuf};
use crate::op::{Completion, OpId, Report, Tag};
use crate::rma::Rma;

/// Counters every plugin keeps; read them with [`Plugin::stats`].
///
/// Non-exhaustive (a later version adds counters): a plugin outside this
/// crate starts from `PluginStats::default()` and sets the fields it keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PluginStats {
    /// Messages sent (both kinds).
    pub msgs_sent: u64,
    /// Messages received (both kinds).
    pub msgs_received: u64,
    /// Payload bytes sent in messages.
    pub msg_bytes_sent: u64,
    /// Payload bytes received in messages.
    pub msg_bytes_received: u64,
    /// Bytes of puts that completed (a transfer that failed midway counts
    /// none of what it moved).
    pub put_bytes: u64,
    /// Bytes of gets that completed (as `put_bytes`).
    pub get_bytes: u64,
    /// System calls (na-sm) or work-request posts (na-verbs) made for RMA,
    /// failed ones included: fewer than the transfers when a plugin merged
    /// a batch.
    pub rma_calls: u64,
    /// Operations posted and not yet completed.
    pub in_flight: u64,
    /// Sends that had to wait for buffer space (backpressure).
    pub sends_queued: u64,
    /// Sends refused because the peer's send backlog was full
    /// ([`NaError::SendBacklogFull`]).
    pub sends_refused: u64,
    /// Bytes charged for the sends queued now, over all peers (see
    /// [`SendBacklog`](crate::SendBacklog)).
    pub backlog_bytes: u64,
    /// Messages sent straight from a plugin-provided buffer, without a
    /// copy ([`Plugin::send_unexpected_buf`] with registered buffers).
    pub sends_zero_copy: u64,
    /// Wake-up signals sent to peers (eventfd writes and the like).
    pub signals_sent: u64,
    /// Peers currently connected.
    pub peers: u64,
    /// Peers the plugin keeps state for: connected, looked up, or gone but
    /// still referenced (a connection being torn down, messages held for
    /// it). A peer that went is forgotten once nothing refers to it, so
    /// this does not grow with every client that ever came and went.
    pub peer_entries: u64,
    /// Protocol violations detected (invalid data from peers), refused
    /// handshakes of that kind included.
    pub protocol_errors: u64,
    /// Connected peers cut off for breaking the protocol (also counted in
    /// [`protocol_errors`](Self::protocol_errors)).
    pub violations: u64,
    /// Messages received and held until a matching receive is posted (or,
    /// in pull mode, a departed peer's messages copied out of its ring and
    /// not yet taken).
    pub queued_arrivals: u64,
    /// Times a peer's messages were left in the transport because its
    /// held messages reached the per-peer bound (flow control).
    pub flow_blocked: u64,
    /// Incoming connections refused at the handshake (a broken hello, a
    /// claimed identity that does not match, a bound reached, or our own
    /// lack of resources: see `accept_errors`).
    pub handshakes_refused: u64,
    /// Incoming connections the plugin could not accept or set up for lack
    /// of its own resources (`EMFILE` and the like), never counted as the
    /// peer's protocol error: an `accept` that failed (accepting pauses and
    /// is retried), or a handshake it could not finish (that connection is
    /// closed, and the peer may connect again).
    pub accept_errors: u64,
    /// Connections torn down because an operation canceled on them did not
    /// end within the transport's bound (the device never completed a work
    /// request it had been handed; verbs: `VerbsConfig::cancel_timeout`).
    pub cancels_forced: u64,
    /// Messages handed to the device and not yet reported sent (verbs:
    /// send work requests posted and not completed). Zero for a transport
    /// whose send is done when the call returns (na-sm writes the peer's
    /// ring; what cannot go yet is in `backlog_bytes`). Dropping the
    /// plugin may lose these.
    pub sends_posted: u64,
    /// Transfers refused because their remote handle names this very
    /// process but no memory it exposes under that key with that access
    /// (a forged or stale handle, e.g. a hostile server's); nothing moved.
    /// Counted by na-verbs and na-sm alike. See
    /// [`refuse_self_rma`](Self::refuse_self_rma).
    pub self_rma_refused: u64,
    /// RMA batches handed to transfer threads instead of moved on the
    /// caller's thread (na-sm with `SmConfig::rma_threads` > 0; zero
    /// elsewhere).
    pub rma_offloaded: u64,
    /// Transfer jobs (na-sm: a window of up to 1024 transfers of one
    /// batch) queued for transfer threads and not started. Jobs that
    /// stay here while [`rma_jobs_running`](Self::rma_jobs_running) does
    /// not move wait behind a peer whose memory stalls.
    pub rma_jobs_waiting: u64,
    /// Transfer jobs a transfer thread is running now (na-sm: at most one
    /// per peer; one that stays for long is a peer whose memory stalls
    /// the kernel: see na-sm's `SmConfig::rma_threads`).
    pub rma_jobs_running: u64,
}

impl PluginStats {
    /// Counts a refused incoming connection in
    /// [`handshakes_refused`](Self::handshakes_refused); true if this one
    /// should be logged (at 1, 2, 4... of them, see [`crate::logged_at`]:
    /// a peer retrying cannot flood the log).
    pub fn refuse_handshake(&mut self) -> bool {
        self.handshakes_refused += 1;
        crate::logged_at(self.handshakes_refused)
    }

    /// Counts a refused transfer to our own process in
    /// [`self_rma_refused`](Self::self_rma_refused); true if this one
    /// should be logged as a warning (at 1, 2, 4... of them, see
    /// [`crate::logged_at`]: a peer that hands out forged handles again
    /// and again cannot flood the log).
    pub fn refuse_self_rma(&mut self) -> bool {
        self.self_rma_refused += 1;
        crate::logged_at(self.self_rma_refused)
    }

    /// Counts a connected peer's protocol violation in
    /// [`violations`](Self::violations) and
    /// [`protocol_errors`](Self::protocol_errors); true if this one should
    /// be logged as a warning (at 1, 2, 4... violations, see
    /// [`crate::logged_at`]: a peer that reconnects to break the protocol
    /// again cannot flood the log). Refused handshakes have their own
    /// count ([`refuse_handshake`](Self::refuse_handshake)).
    pub fn count_violation(&mut self) -> bool {
        self.protocol_errors += 1;
        self.violations += 1;
        crate::logged_at(self.violations)
    }
}

/// The process behind a peer address, as the operating system vouches for
/// it (see [`Plugin::peer_process`]): a pid and that process's start
/// time, which together name one process on the host for all time (a pid
/// alone may be reused by a later process).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PeerProcess {
    /// Its process id (na-sm: the kernel's `SO_PEERCRED` pid).
    pub pid: u32,
    /// When it started, in the plugin's unit (na-sm: clock ticks since
    /// boot, field 22 of `/proc/<pid>/stat`, read by us, never said by
    /// the peer). Only compared, within one plugin.
    pub started: u64,
}

/// A network-abstraction plugin instance: one transport endpoint (listening
/// or client-only) that sends messages and moves memory.
///
/// # Call order
/// 1. Create the plugin (its constructor takes the [`PluginId`] the
///    [`Endpoint`](crate::Endpoint) gives it) and add it to an endpoint.
/// 2. [`lookup`](Self::lookup) peers; post receives; send; put/get. A post
///    that returns `Ok` completes exactly once later; one that returns `Err`
///    started nothing.
/// 3. Drive it: [`progress`](Self::progress) does all work that is ready
///    without blocking and queues completions, which
///    [`pop_completion`](Self::pop_completion) hands out in order.
/// 4. To sleep, call [`try_wait`](Self::try_wait): if it returns `true` the
///    plugin has armed its wake-up and the caller may block on
///    [`poll_fd`](Self::poll_fd) until it is readable (then call `progress`
///    again); if it returns `false` there is work to do now.
///
/// Plugins never block inside any of these calls (connection set-up in
/// `lookup` may wait for a local handshake, bounded by a timeout; see
/// [`try_lookup`](Self::try_lookup) for the attempt that never waits) and
/// start no threads.
pub trait Plugin: Send {
    /// The address scheme this plugin serves (`"sm"`, `"verbs"`).
    fn scheme(&self) -> &'static str;

    /// This instance's id inside its endpoint.
    fn id(&self) -> PluginId;

    /// Our own address (what peers look up to reach us).
    fn self_addr(&self) -> Addr;

    /// Resolves a peer address string of this plugin's scheme. Setting up
    /// a connection may wait (na-sm: for a listener whose accept queue is
    /// full), at most a bound of the plugin's (na-sm:
    /// `SmConfig::handshake_timeout`); a caller that must not block (an
    /// event loop, a lock others wait for) uses
    /// [`try_lookup`](Self::try_lookup).
    fn lookup(&mut self, uri: &str) -> Result<Addr>;

    /// [`lookup`](Self::lookup) without waiting: what `lookup` would have
    /// waited for makes it fail at once with [`NaError::WouldBlock`]
    /// (nothing set up), and the caller tries again later, typically
    /// after a short pause taken without holding whatever it must not
    /// block, passing the same `since`: when its first attempt was made.
    /// Once the bound `lookup` would have waited has passed since
    /// `since`, the attempt gives `lookup`'s own error for a wait that
    /// ran out (a timeout naming the peer) instead of `WouldBlock`, so
    /// that a retry loop ends, with the same error, about when a blocking
    /// lookup would have. Every other outcome is `lookup`'s.
    ///
    /// The default calls `lookup`: right for a plugin whose lookup never
    /// waits (na-verbs connects on first use, from `progress`).
    fn try_lookup(&mut self, uri: &str, since: Instant) -> Result<Addr> {
        let _ = since;
        self.lookup(uri)
    }

    /// Largest unexpected message, in bytes.
    fn max_unexpected_size(&self) -> usize;

    /// Largest expected message, in bytes.
    fn max_expected_size(&self) -> usize;

    /// Largest unexpected message that `dest` is known to accept, in
    /// bytes: at most [`max_unexpected_size`](Self::max_unexpected_size),
    /// and less where the peer told its own, smaller limit (na-verbs: the
    /// hello of its connection). A message past it would fail with
    /// [`NaError::MessageTooLarge`]; a caller that can send the data
    /// another way (hg-rpc spills it into bulk memory) checks this first.
    /// While the peer's limit is not known yet (no connection yet), the
    /// answer is the smaller of the two sizes every peer accepts,
    /// [`min_peer_unexpected_size`](Self::min_peer_unexpected_size) and
    /// our own. Not a busy-path call: a message no larger than both of
    /// those never needs it.
    ///
    /// The default is `max_unexpected_size`: right for a plugin whose
    /// peers all have the same limit (na-sm: a fixed buffer size).
    fn max_unexpected_size_to(&self, dest: &Addr) -> usize {
        let _ = dest;
        self.max_unexpected_size()
    }

    /// An unexpected message size every peer of this plugin is sure to
    /// accept, whatever it told (or has yet to tell) about its own limit:
    /// a message no larger than this and than
    /// [`max_unexpected_size`](Self::max_unexpected_size) needs no
    /// [`max_unexpected_size_to`](Self::max_unexpected_size_to). The
    /// default is `max_unexpected_size` (every peer has the same limit);
    /// na-verbs answers 0 (each process picks its own limit, down to 0).
    fn min_peer_unexpected_size(&self) -> usize {
        self.max_unexpected_size()
    }

    /// Largest tag value.
    fn max_tag(&self) -> Tag;

    /// The process behind peer address `dest`, where the kernel vouches
    /// for it: several addresses (one process may open many connections,
    /// under many names) then have one answer, so that bounds meant to
    /// keep one greedy peer from starving others (hg-rpc's pull shares,
    /// deferred requests and exposed outputs) can count processes, not
    /// connections. Cheap (a table lookup), for the rare paths that keep
    /// such bounds; never on the busy path.
    ///
    /// `None` (the default) when the plugin cannot vouch for it: each
    /// address then counts as a process of its own. na-sm answers from
    /// the kernel's `SO_PEERCRED` pid (checked against the name the peer's
    /// hello gave) and the start time it read for that pid when the
    /// connection was made (so a reused pid is another process); `None`
    /// for a peer whose start time it could not read, until a later
    /// connection of it reads one. So the answer for one address may go
    /// from `None` to `Some` (never the other way, nor from one `Some` to
    /// another): state keyed by it keeps the key it was counted under. na-verbs keeps the
    /// default: nothing vouches for a remote process's identity (its
    /// hello says what it likes, and RDMA CM names only an IP address and
    /// port, which many processes, or one process many times, may hold).
    fn peer_process(&self, dest: &Addr) -> Option<PeerProcess> {
        let _ = dest;
        None
    }

    /// Sends an unexpected message. `data` is copied before the call returns
    /// (into the transport, or into a backlog if the transport is full).
    fn send_unexpected(&mut self, dest: &Addr, tag: Tag, data: &[u8], op: OpId) -> Result<()>;

    /// Sends an expected message (the peer matches it on our address and `tag`).
    fn send_expected(&mut self, dest: &Addr, tag: Tag, data: &[u8], op: OpId) -> Result<()>;

    /// A buffer of at least `size` bytes to build a message in, for
    /// [`send_unexpected_buf`](Self::send_unexpected_buf) and
    /// [`send_expected_buf`](Self::send_expected_buf) (see
    /// [`crate::msgbuf`]). Plugins with device-registered buffers hand those
    /// out, so the send needs no copy. The default is a heap buffer; an
    /// error if `size` exceeds the larger message limit.
    fn alloc_msg_buf(&mut self, size: usize) -> Result<MsgBuf> {
        check_buf_size(size, self.max_unexpected_size().max(self.max_expected_size()))?;
        Ok(MsgBuf::heap(size))
    }

    /// Sends the message in `buf` (its first `len()` bytes) as an
    /// unexpected message. The plugin keeps the buffer until the send
    /// completes and then reuses it; on `Err` nothing was sent and the
    /// buffer is dropped. The default copies, like
    /// [`send_unexpected`](Self::send_unexpected).
    fn send_unexpected_buf(&mut self, dest: &Addr, tag: Tag, buf: MsgBuf, op: OpId) -> Result<()> {
        self.send_unexpected(dest, tag, buf.as_slice(), op)
    }

    /// Sends the concatenation of `parts` (a header and a payload, say) as
    /// one unexpected message, completing like
    /// [`send_unexpected`](Self::send_unexpected) but as `report` says (a
    /// plugin may leave out a success with [`Report::FailuresOnly`]). A
    /// plugin that copies into shared memory writes each part straight
    /// into place (na-sm); the default builds the message in a buffer from
    /// [`alloc_msg_buf`](Self::alloc_msg_buf) and sends it with
    /// [`send_unexpected_buf`](Self::send_unexpected_buf), which is the
    /// zero-copy path of plugins with registered buffers, and reports
    /// every outcome.
    fn send_unexpected_parts(
        &mut self,
        dest: &Addr,
        tag: Tag,
        parts: &[&[u8]],
        op: OpId,
        report: Report,
    ) -> Result<()> {
        let _ = report;
        let len = crate::msgbuf::parts_len(parts)?;
        let mut buf = self.alloc_msg_buf(len)?;
        buf.extend_from_slices(parts)?;
        self.send_unexpected_buf(dest, tag, buf, op)
    }

    /// Like [`send_unexpected_buf`](Self::send_unexpected_buf), as an expected message.
    fn send_expected_buf(&mut self, dest: &Addr, tag: Tag, buf: MsgBuf, op: OpId) -> Result<()> {
        self.send_expected(dest, tag, buf.as_slice(), op)
    }

    /// Posts a buffer for the next unexpected message from any peer. The
    /// message replaces the buffer's contents (its capacity is reused, and
    /// grown if needed).
    fn post_recv_unexpected(&mut self, buf: Vec<u8>, op: OpId) -> Result<()>;

    /// Posts a buffer for the message from `source` with `tag`.
    fn post_recv_expected(&mut self, source: &Addr, tag: Tag, buf: Vec<u8>, op: OpId) -> Result<()>;

    /// Registers memory for RMA with this plugin. The default does nothing
    /// (plugins that can address any memory, like shared memory).
    fn mem_register(&mut self, mem: &MemHandle) -> Result<()> {
        let _ = mem;
        Ok(())
    }

    /// Undoes [`mem_register`](Self::mem_register).
    fn mem_deregister(&mut self, mem: &MemHandle) -> Result<()> {
        mem.detach_registration(self.id());
        Ok(())
    }

    /// Describes a local handle for a peer. The default gives each segment's
    /// address and length with key 0.
    fn mem_describe(&self, mem: &MemHandle) -> Result<RemoteMem> {
        RemoteMem::of_handle(mem, 0)
    }

    /// Starts a batch of one-sided transfers with peer `dest`.
    ///
    /// Every transfer is checked first ([`Rma::check`](crate::Rma::check):
    /// access, bounds) and so is the peer: if anything is wrong the call
    /// returns the error and starts none of them. Otherwise each transfer
    /// completes exactly once under its own id, whatever happens to the
    /// others; the order of their completions is unspecified. Plugins may
    /// merge the transfers of a batch (na-sm makes one system call for a
    /// run of gets or of puts), so a batch of many small transfers costs
    /// far less than as many single posts.
    fn rma(&mut self, dest: &Addr, ops: &[Rma<'_>]) -> Result<()>;

    /// Switches unexpected messages to pull mode, for a consumer that
    /// handles each message as it takes it (an RPC layer): a message is
    /// then not copied into a posted receive and reported by a completion,
    /// but waits in the transport until
    /// [`take_unexpected`](Self::take_unexpected) copies it out; meanwhile
    /// [`unexpected_ready`](Self::unexpected_ready) is true, and the
    /// endpoint counts it as work (its progress returns, it does not
    /// sleep). That spares, per message, the posted receive, the
    /// completion and its trip through the queues. Choose it before posting
    /// any unexpected receive (an error otherwise); posting one afterwards
    /// is an error too. Returns `Ok(false)`, changing nothing, if the plugin
    /// has no pull mode (the default).
    ///
    /// For a plugin inside an [`Endpoint`](crate::Endpoint), switch through
    /// [`Endpoint::pull_unexpected`](crate::Endpoint::pull_unexpected),
    /// never on the plugin itself (through `plugin_mut`): the endpoint
    /// keeps the list of plugins whose waiting messages count as work, and
    /// one missing from it refuses to sleep while a message waits, so the
    /// endpoint's progress spins without reporting it.
    fn pull_unexpected(&mut self) -> Result<bool> {
        Ok(false)
    }

    /// Pull mode: copies the oldest waiting unexpected message of some peer
    /// into `buf` (replacing its contents) and returns its source and tag;
    /// `None` once none waits. A peer's messages come in order, and peers
    /// take turns.
    fn take_unexpected(&mut self, buf: &mut Vec<u8>) -> Result<Option<(Addr, Tag)>> {
        let _ = buf;
        Ok(None)
    }

    /// Pull mode: true if progress saw an unexpected message that
    /// [`take_unexpected`](Self::take_unexpected) has not taken yet.
    fn unexpected_ready(&self) -> bool {
        false
    }

    /// Cancels a posted operation. It then completes with
    /// [`NaError::Canceled`] (unless it completed first, in which case its
    /// real completion stands). Ids the plugin does not hold give
    /// [`NaError::UnknownOp`]: never posted, or already completed (its
    /// completion queued or delivered), so that error after a post that
    /// returned `Ok` means "too late", and the completion tells the rest.
    fn cancel(&mut self, op: OpId) -> Result<()>;

    /// The file descriptor that becomes readable when the plugin has work.
    /// Borrowed from the plugin, which keeps it open for its lifetime
    /// (take `as_raw_fd()` to register it in a set that outlives the
    /// borrow); `None` if the plugin cannot sleep (then callers must poll
    /// it).
    fn poll_fd(&self) -> Option<BorrowedFd<'_>>;

    /// Asks whether the caller may block on [`poll_fd`](Self::poll_fd) now.
    /// `Ok(true)` means the plugin armed its wake-up (peers will signal
    /// the fd) and found nothing pending after arming; `Ok(false)` that
    /// work is pending. An error means it could not find out (its own
    /// event set failed, say): the caller must not sleep on the fd, which
    /// might never become readable, and should report the error rather
    /// than retry in a loop.
    ///
    /// While the owner sleeps, other threads (holding whatever lock the
    /// owner shares the plugin under) may post, send, transfer and cancel:
    /// a call that queues a completion, or takes events the owner's fd
    /// announced, makes the fd readable again. They must not call
    /// `progress`: a progress call lowers the wake-up flags `try_wait`
    /// raised, and peers then stop signalling the sleeper. A thread that
    /// progresses anyway must see that the sleeper looks again, for example
    /// by having it sleep with a timeout.
    fn try_wait(&mut self) -> Result<bool>;

    /// Sleeps on the plugin's own wait primitive, for an endpoint that has
    /// no other plugin: arms as [`try_wait`](Self::try_wait) does and, if
    /// nothing is pending, blocks until work may be ready or `timeout`
    /// passes (`None`: no limit). That spares the endpoint's poll set, one
    /// level of epoll nesting on every wake-up and the harvesting call
    /// before every sleep (on the dev VM: 0.25–0.5 µs per one-way trip,
    /// about 3 % of a blocking round trip).
    ///
    /// Returns `Ok(true)` once it slept or found work pending, and
    /// `Ok(false)` if the plugin does not implement it (the default): the
    /// endpoint then uses [`try_wait`](Self::try_wait) and its poll set.
    fn sleep(&mut self, timeout: Option<Duration>) -> Result<bool> {
        let _ = timeout;
        Ok(false)
    }

    /// Busy waiting, for an endpoint whose only plugin this is: checks up
    /// to `max` times, as cheaply as it can (a load per connection, say),
    /// whether new work may have arrived, and returns how many checks it
    /// made: fewer than `max` once something may be ready for
    /// [`progress`](Self::progress) (a false alarm is allowed, a missed
    /// message is not, and periodic work such as polling sockets counts as
    /// ready when due). The default makes no check and returns 0: the
    /// endpoint then calls `progress` every turn.
    ///
    /// In pull mode, if the spin ended early and
    /// [`unexpected_ready`](Self::unexpected_ready) is then true, the
    /// endpoint reports that message as work at once, without a `progress`
    /// call between it and [`take_unexpected`](Self::take_unexpected) (it
    /// is the usual reason a busy server wakes, and the take is on the
    /// path to the reply). So a plugin may say a message is ready there
    /// only if nothing else is due that a `progress` call would do first.
    fn spin_wait(&mut self, max: u32) -> u32 {
        let _ = max;
        0
    }

    /// Does all work that is ready without blocking; returns the number of
    /// completions it queued.
    fn progress(&mut self) -> Result<usize>;

    /// Takes the oldest queued completion.
    fn pop_completion(&mut self) -> Option<Completion>;

    /// Moves every queued completion, oldest first, to the back of `out`.
    /// The default pops them one by one; a plugin that queues them in a
    /// `VecDeque` can hand them over in one move (`VecDeque::append`).
    fn take_completions(&mut self, out: &mut VecDeque<Completion>) {
        while let Some(c) = self.pop_completion() {
            out.push_back(c);
        }
    }

    /// Counters.
    fn stats(&self) -> PluginStats;
}

/// Builds a plugin instance from a listen specification (e.g. `"sm://"` or
/// `"verbs://rxe0/10.77.0.1:0"`). Registered in a [`crate::PluginRegistry`]
/// so that endpoints can be created from strings.
pub trait PluginFactory: Send + Sync {
    /// The scheme served.
    fn scheme(&self) -> &'static str;

    /// Creates an instance. `listen` says whether peers may connect to it.
    fn create(&self, id: PluginId, spec: &str, listen: bool) -> Result<Box<dyn Plugin>>;
}

/// A set of plugin factories, looked up by scheme.
#[derive(Default)]
pub struct PluginRegistry {
    factories: Vec<Box<dyn PluginFactory>>,
}

impl PluginRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a factory (replacing one of the same scheme).
    pub fn register(&mut self, factory: Box<dyn PluginFactory>) {
        self.factories.retain(|f| f.scheme() != factory.scheme());
        self.factories.push(factory);
    }

    /// The factory for `scheme`.
    pub fn get(&self, scheme: &str) -> Result<&dyn PluginFactory> {
        self.factories
            .iter()
            .find(|f| f.scheme() == scheme)
            .map(|f| f.as_ref())
            .ok_or_else(|| NaError::NoPlugin {
                scheme: scheme.to_owned(),
                available: self.schemes().join(", "),
            })
    }

    /// Every registered scheme.
    pub fn schemes(&self) -> Vec<&'static str> {
        self.factories.iter().map(|f| f.scheme()).collect()
    }
}
