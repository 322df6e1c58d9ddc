//! # na-sm: the shared-memory NA plugin
//!
//! Moves messages between processes of one host through shared memory and
//! RMA data through cross-memory attach (`process_vm_readv`/`writev`),
//! sleeping on file descriptors so that one [`na_core::Endpoint`] poll set
//! drives it with other transports. Messages and (by default) RMA move on
//! the caller's thread; the plugin's own threads are only the background
//! closers of descriptors peers hand over (the `closer` module) and,
//! opt-in, the RMA transfer threads ([`SmConfig::rma_threads`], below).
//!
//! ## Addresses
//! `sm://<pid>-<instance>`: the owner's pid and an instance part, either a
//! per-process counter (`sm://4242-0`) or a name (`sm://4242-srv`, from
//! [`SmConfig::name`] or the factory spec `sm://srv`). A name parses only
//! in the spelling [`SmName::uri`] prints: a pid with a leading zero
//! (`sm://010-a`) is refused, so one process never has two spellings.
//! A listening instance
//! binds `<dir>/<pid>-<instance>.sock`, where `<dir>` is
//! [`SmConfig::dir`], else `$QS_SM_DIR`, else `/tmp/qs-sm-<uid>` (created
//! 0700; refused if others can enter it). Client-only instances have an
//! address too (peers see it as the source of messages) but no socket.
//!
//! ## Connections and the handshake
//! Each (connector, acceptor) pair has its **own** shared region, so a
//! hostile or buggy peer can only corrupt its own connection. The connector
//! creates the region as a **sealed memfd** (no name: a crash leaves nothing
//! to clean; size-sealed: the creator cannot truncate it under the
//! acceptor's mapping to raise `SIGBUS`; this replaces named
//! `shm_open` objects). It passes the memfd and its eventfd over the UNIX
//! socket with `SCM_RIGHTS`; the acceptor checks `SO_PEERCRED` (same uid,
//! and the kernel's pid is the one in the hello's address), the region's
//! seals, size and header, and that the fd is an eventfd, then answers with
//! its own eventfd. Lookup does not wait for the answer: sends may start at
//! once, so two instances in one thread (or a self-lookup) cannot deadlock.
//! Only its connect may wait, for a listener whose accept queue is full,
//! at most [`SmConfig::handshake_timeout`]; `try_lookup` connects without
//! waiting and answers `WouldBlock` instead (see
//! [`na_core::Plugin::try_lookup`]).
//! The socket stays open; end of file on it means the peer died, and so
//! does the peer's pidfd becoming readable (the only sign when a child it
//! forked holds the socket): the kernel's (`SO_PEERPIDFD`), else, before
//! Linux 6.5 or for a peer already reaped, `pidfd_open` of its pid, taken
//! only if the process there has the start time the peer had when its
//! connection was made (read by us from `/proc` as the connection came,
//! while the open socket proves the peer had not exited; see the
//! `identity` module). A pid that names another process by then means the
//! peer is gone ([`SmError::PidReused`]). See the (crate-private) `conn` module for the bytes. A process gets at most
//! [`SmConfig::max_conns_per_process`] connections to a listener (counted
//! by kernel-reported pid, whatever names it claims); past it its
//! handshakes are refused with the reason (its operations fail with
//! `PeerGone` saying why). Of the [`MAX_PENDING_HANDSHAKES`] accepted
//! connections that may wait for their hello at once (past that the
//! listener pauses), one process may hold [`MAX_PENDING_PER_PROCESS`];
//! its connections past it are refused as they are accepted (a refusal
//! that comes before the lookup is done fails the lookup, with the same
//! `PeerGone` and reason). One pass over
//! the listener accepts at most [`MAX_ACCEPTS_PER_CALL`] connections (a
//! progress call makes a few passes at most); the next calls take the
//! rest, and the plugin does not sleep while some may wait.
//!
//! ## Region layout
//! A header page, one control page and two ring pages per direction, then 32
//! buffers of 8 KiB per direction (see the `channel` module). A control page has,
//! each on its own cache line: the free-buffer mask (the low 32 bits of an
//! `AtomicU64`; the sender reserves with `fetch_and`, the receiver frees
//! with `fetch_or`),
//! the receiver's `rx_waiting` flag, the sender's `tx_waiting` flag and
//! the receiver's `consumed` count. A
//! ring has 64 slots of two cache lines each: a header word (sequence
//! marker, inline flag, kind, buffer index, length, tag) and up to 120
//! bytes of inline payload. Messages of up to 120 bytes travel inside their
//! slot, so one or two cache lines cross between the cores; larger ones
//! take a buffer.
//! The receiver polls the slot itself (no shared head or tail) and never
//! writes it: it publishes how many messages it consumed, which the
//! sender caches as credit (see the `channel` module).
//!
//! ## Signaling without missed wake-ups, and without a syscall per message
//! Senders write the receiver's eventfd only when it sleeps. The receiver,
//! in `try_wait`, stores `rx_waiting = 1` (SeqCst) in every inbound channel
//! and re-checks each ring slot (SeqCst load); the sender publishes the slot
//! with a SeqCst store and then reads `rx_waiting` (SeqCst); if set, it swaps
//! it to 0 and writes the eventfd (one write per sleep, not per message).
//! With all four accesses SeqCst (no separate fences: on x86 the store is an
//! `xchg`, the loads plain moves), either the receiver sees the message or
//! the sender sees the flag. The same
//! protocol runs the other way for backpressure: a sender with a backlog
//! raises `tx_waiting`, and the receiver wakes it after freeing buffers.
//! Each connection has its own eventfd per direction, created by the side
//! that sleeps on it, so a peer can only steal or spoil its own wake-ups:
//! whatever it writes to (or reads from) the eventfd it wakes us on
//! (bringing the counter to its maximum, reading it to 0, a storm of
//! writes) touches only its connection's wake-ups, and the fd is polled
//! edge-triggered and never read, so a huge counter keeps nothing ready.
//! A storm of writes makes one wake-up per harvest of our epoll set: it
//! costs us about what it costs the peer, and its messages and every
//! other peer's are served meanwhile (`tests/hostile_wake.rs`). The
//! eventfd starts at 1 and a wake-up is a write of **0**, which wakes
//! the poller yet can neither block nor fail whatever the peer did to
//! the description it shares with us (cleared `O_NONBLOCK`, counter at
//! its maximum): a write of 1 could be made to block by a peer that
//! cleared the flag between our check of it and the write
//! (`sys::eventfd::EventFd::signal`).
//! Where the kernel has no eventfd, or with `QS_SM_WAKE=pipe` /
//! [`SmConfig::wake`], a side is woken through a pipe instead: it keeps
//! both ends, polls and drains the read end and hands the peer the write
//! end (checked to be a write-only pipe end). Pipe writes are made with
//! `SIGPIPE` blocked, so a dead reader is an error (`EPIPE`: peer gone),
//! never a killed process. The two sides may use different kinds.
//! The plugin's [`poll_fd`](na_core::Plugin::poll_fd) is an internal epoll
//! set holding the listener, every connection socket and every eventfd.
//! `progress` makes no system call on its fast path: it polls the internal
//! epoll in `try_wait` (before arming), after a wake-up that brought no
//! message, while a handshake is in flight, or every
//! [`EVENT_POLL_INTERVAL`] calls or [`EVENT_POLL_MAX_GAP`], whichever
//! comes first (while RMA transfers are with the transfer threads,
//! below, every call looks at the clock for [`EVENT_POLL_MAX_GAP`]). A
//! wake-up that brought a
//! message leaves the events to the next `try_wait`, keeping that system
//! call off the reply's path.
//!
//! ## Messages
//! Sends complete once the data is in shared memory. A send that finds no
//! free buffer is copied into the peer's FIFO backlog and retried, in order,
//! by `progress` (never dropped once accepted). The backlogs are bounded
//! ([`SmConfig::max_backlog_bytes`], 64 MiB per peer, and
//! [`SmConfig::max_backlog_total`], 256 MiB for all peers, by default):
//! past either a send fails at once with `NaError::SendBacklogFull` and is
//! not queued, so a peer that stops reading (a client that sends requests
//! and never takes the responses), or one process posing as many peers,
//! cannot grow our memory. Messages
//! that arrive before their receive is posted are copied out and kept, up
//! to [`SmConfig::max_queued_per_peer`] per peer; past that the peer's ring
//! is left undrained until a receive is posted, so a flooding peer backs up
//! in its own shared memory instead of growing ours. A gathered send
//! (`send_unexpected_parts`) writes each part straight into the slot; with
//! `Report::FailuresOnly` one that goes out at once queues no completion.
//! In pull mode (`pull_unexpected`) an unexpected message is not copied
//! into a posted receive: a poll stops at it, and `take_unexpected` copies
//! it out of the slot (the message stays in the sender's ring meanwhile, so
//! it counts against the sender's credit, not our memory).
//!
//! ## RMA
//! One `process_vm_readv`/`writev` per run of same-direction transfers of
//! a batch ([`Plugin::rma`](na_core::Plugin::rma)), with iovecs built from
//! all their handles' pieces (split only at `IOV_MAX`), continued after
//! partial transfers; a transfer that fails fails alone. Access and bounds are checked first (errors returned); kernel
//! failures complete the operation with an error (EPERM with advice, ESRCH
//! as peer gone). The pid comes from `SO_PEERCRED`, never from the peer.
//! By default RMA completes inside the `rma` call (its completions are
//! still queued), on the caller's thread, where a peer whose exposed
//! memory stalls the kernel (a hung FUSE or network file system behind
//! it, a userfaultfd nobody answers) holds the caller for as long as the
//! stall lasts. With [`SmConfig::rma_threads`] (or [`RMA_THREADS_ENV`])
//! above 0 (at most [`MAX_RMA_THREADS`]), `rma` checks the batch and
//! hands it to a pool of that many transfer threads at most (started as
//! peers' jobs need them), at most one job per peer at a time, each
//! peer's queue bounded by [`RMA_QUEUE_PER_PEER`] (a batch past it is
//! refused whole and leaves nothing queued); completions come
//! through progress, which the threads wake. A busy owner whose
//! transfers are with the threads gives up its core once per
//! [`spin_wait`](na_core::Plugin::spin_wait) instead of spinning, so a
//! transfer thread placed on that core runs; once no job has started or
//! ended for a second (stuck jobs: a yield does nothing for them), only
//! once per [`RMA_QUIET_YIELD_EVERY`]. Each job checks the peer's pidfd
//! before it moves anything. Cancel completes a handed-over transfer at
//! once, even a running one (its local memory may still be written until
//! the kernel lets go; the job holds a clone of the handle until then,
//! so the memory is never freed under it). Transfers to this process stay
//! on the caller's thread. [`PluginStats`](na_core::PluginStats)'s
//! `rma_offloaded`, `rma_jobs_waiting` and `rma_jobs_running` count them.
//!
//! ## Trust
//! Everything a peer can write is validated: ring slots (marker, kind,
//! index, length), buffer ownership, handshake bytes and descriptors. A
//! violation counts in [`PluginStats::protocol_errors`](na_core::PluginStats),
//! fails that peer's operations with `NaError::Protocol` and drops the
//! connection; other peers are unaffected. Shared memory is only touched by
//! atomics and volatile copies into private memory.
//!
//! What CMA cannot do is revoke: `process_vm_readv`/`writev` need the
//! same permission as `ptrace` attach (`PTRACE_MODE_ATTACH_REALCREDS`), so
//! a peer that may do RMA here may read and write all of this process's
//! memory, handle or no handle. A memory handle's descriptor is therefore
//! a promise between well-behaved peers: a peer that goes on using one
//! after the handle is dropped writes wherever the address now points.
//! The verbs plugin, whose rkeys the NIC checks, does revoke (see
//! `na-verbs`'s `mem` module); over sm, only run peers you would let
//! attach a debugger.
//!
//! ## Cleanup
//! See the `cleanup` module: files removed on drop; a live owner holds an
//! [flock(2)](https://man7.org/linux/man-pages/man2/flock.2.html) lock on
//! its owner file, so liveness does not go by pid (processes in other PID
//! namespaces may share the directory). Stale files (lock free; for
//! version-1 files of older builds, pid and start time) are removed by
//! [`cleanup_stale`], at listener start and by the `qs-sm-cleanup`
//! command; live owners' files are kept. A listener takes its name only if
//! no live owner holds it (else `AddrInUse`), and never rewrites, removes
//! or connects to a live owner's files. Within one process an instance
//! name belongs to one instance at a time, listening or not
//! ([`SmError::NameInUse`]).
#![deny(unsafe_code)]
#![warn(missing_docs)]

// The crate's API is what the root re-exports below. The modules are
// private: they hold the crate's own discipline (raw OS wrappers, shared
// memory layouts, handshake bytes), which no outside caller should reach.
// The `test-hooks` feature (off in a user's build; this crate's tests,
// the fuzz targets and other crates' tests turn it on) makes the few that
// tests and fuzz targets drive directly public; `tests/test_hooks_hidden.rs`
// checks that a build without it cannot name them.
mod addr;
#[cfg(feature = "test-hooks")]
pub mod channel;
#[cfg(not(feature = "test-hooks"))]
mod channel;
#[cfg(feature = "test-hooks")]
pub mod cleanup;
#[cfg(not(feature = "test-hooks"))]
mod cleanup;
mod closer;
mod config;
#[cfg(feature = "test-hooks")]
pub mod conn;
#[cfg(not(feature = "test-hooks"))]
mod conn;
mod connect;
mod error;
mod exposed;
mod factory;

mod heads;
mod id_filter;
mod identity;
mod matching;
mod peer_failure;
mod plugin;
mod progress;
mod pull;
mod rma;
mod send_ops;
#[allow(unsafe_code)]
#[cfg(feature = "test-hooks")]
pub mod sys;
#[allow(unsafe_code)]
#[cfg(not(feature = "test-hooks"))]
mod sys;

pub use addr::SmName;
pub use cleanup::{cleanup_stale, CleanupReport};
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub use closer::{debug_closing_threads, ClosingThreads};
#[cfg(any(test, feature = "test-hooks"))]
mod test_support;
pub use closer::{
    CLOSE_STALL, MAX_CLOSING_THREADS, MAX_NESTED_DEPTH, MAX_NESTED_FDS, MAX_NESTED_READS, MAX_PENDING_FDS,
};
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub use config::SmConfigHooks;
pub use config::{
    default_dir, SmConfig, WakeKind, DEFAULT_MAX_CONNS_PER_PROCESS, DEFAULT_MAX_QUEUED_PER_PEER,
    MAX_NAME_LEN, MAX_RMA_THREADS, PIDFD_ENV, RMA_QUEUE_PER_PEER, RMA_QUIET_YIELD_EVERY, RMA_THREADS_ENV,
    SOCKET_DIR_ENV, WAKE_ENV,
};
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub use connect::ListenerProbe;
pub use connect::{MAX_ACCEPTS_PER_CALL, MAX_PENDING_HANDSHAKES, MAX_PENDING_PER_PROCESS};
pub use error::{SmError, SmResult};
pub use factory::SmFactory;
pub use plugin::SmPlugin;
pub use progress::{EVENT_POLL_INTERVAL, EVENT_POLL_MAX_GAP};
pub use rma::EPERM_HINT;
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub use rma::{RmaPoolHold, RmaPoolProbe};
#[cfg(any(test, feature = "test-hooks"))]
#[doc(hidden)]
pub use test_support::debug_run_alone;
