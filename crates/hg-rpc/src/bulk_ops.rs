//! Bulk transfers driven by the engine: from the origin's code
//! ([`Engine::bulk_start`], [`Engine::bulk`], [`Engine::bulk_batch`]) and
//! from inside handlers ([`BulkCtx`]).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use hg_bulk::{Bulk, BulkOp, Span, Started};
use na_core::{Access, Addr, Completion, Endpoint, OpId, PluginId};

use super::{DebugSpan, Engine, OpRole};
use crate::codec::Codec;
use crate::error::{Result, RpcError};
use crate::lookup_backoff::LookupBackoff;

/// Identifies a transfer started with [`Engine::bulk_start`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BulkId(pub(crate) u64);

/// How long a handler's transfer may take before it fails, unless set
/// with [`Engine::set_handler_transfer_timeout`].
pub const DEFAULT_HANDLER_TRANSFER_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a handler waits for its canceled transfers before it warns
/// (it goes on waiting: see `BulkCtx::cancel_window`).
pub(crate) const CANCEL_WAIT_WARNING: Duration = Duration::from_secs(10);

/// Most spans [`BulkCtx::transfer_batch`] has in flight at once (na-sm's
/// `IOV_MAX`: a window of single-piece spans is one system call).
pub const BATCH_WINDOW: usize = 1024;

/// What a handler registered with [`Engine::register_with_bulk`] may do
/// while it runs: expose memory and move data to or from a client's handle.
///
/// A handle in a request names its owner's address, and the owner is whom
/// a transfer goes to. By default a handler moves data only with its
/// caller: a client cannot point the server's push or pull at a third
/// process by sending someone else's descriptor (Mercury's
/// `HG_Bulk_transfer` likewise takes the origin's address). A handler that
/// is meant to move data with other processes says so with
/// [`allow_any_owner`](Self::allow_any_owner).
pub struct BulkCtx<'a> {
    pub(super) ep: &'a mut Endpoint,
    pub(super) plugin: PluginId,
    pub(super) next_op: &'a mut u64,
    pub(super) deferred: &'a mut VecDeque<Completion>,
    /// Who sent the request being handled.
    pub(super) origin: &'a Addr,
    /// The handler lifted the caller-only rule.
    pub(super) any_owner: bool,
    /// How long one call of [`transfer_batch`](Self::transfer_batch) (or
    /// [`transfer`](Self::transfer)) may take.
    pub(super) transfer_timeout: Duration,
}

/// Why a window of a handler's transfer failed.
enum WindowFailure {
    /// A transfer failed (the others in the window finished first).
    Failed(String),
    /// The batch cannot go on: the deadline passed (the window's transfers
    /// were canceled and waited for), or the endpoint failed while they
    /// were in flight.
    Stopped(String),
}

impl BulkCtx<'_> {
    /// The address of the caller whose request is being handled.
    pub fn origin(&self) -> &Addr {
        self.origin
    }

    /// Lets this handler's transfers use handles owned by processes other
    /// than the caller (third-party transfers). A transfer with an owner
    /// not yet connected looks it up, which may wait to connect (until the
    /// handler transfer timeout, [`Engine::set_handler_transfer_timeout`],
    /// or the transport's bound, na-sm's `SmConfig::handshake_timeout`,
    /// whichever comes first, if the owner does not accept), and a plain
    /// handler waits with its engine locked: under an
    /// [`AsyncEngine`](crate::AsyncEngine), every other call of the engine
    /// waits too. A handler that moves data with processes that may not
    /// be connected yet belongs in
    /// [`register_async_with_bulk`](crate::AsyncEngine::register_async_with_bulk),
    /// whose context's lookups wait without the engine.
    pub fn allow_any_owner(&mut self) {
        self.any_owner = true;
    }

    /// Refuses a transfer with a handle the caller does not own (unless
    /// allowed); inline pulls move nothing over the network and pass.
    fn check_owner(&self, op: BulkOp, remote: &Bulk) -> std::result::Result<(), String> {
        check_owner(
            self.any_owner,
            self.origin,
            op,
            remote,
            "BulkCtx::allow_any_owner",
        )
    }

    /// Exposes buffers as a local bulk handle.
    pub fn expose(&mut self, buffers: Vec<Vec<u8>>, access: Access) -> std::result::Result<Bulk, String> {
        Bulk::expose(self.ep, self.plugin, buffers, access).map_err(|e| e.to_string())
    }

    /// Moves `len` bytes between `remote` and `local` and waits for it
    /// (other work that completes meanwhile is kept for the engine).
    pub fn transfer(
        &mut self,
        op: BulkOp,
        remote: &Bulk,
        remote_offset: u64,
        local: &Bulk,
        local_offset: u64,
        len: u64,
    ) -> std::result::Result<(), String> {
        let span = Span {
            remote_offset,
            local_offset,
            len,
        };
        self.transfer_batch(op, remote, local, &[span])
    }

    /// Moves every span between `remote` and `local` (all in direction
    /// `op`) and waits for all of them. Every span is checked first: if one
    /// is out of bounds, nothing moves. They are then started as NA batches
    /// ([`hg_bulk::start_batch`]) of at most [`BATCH_WINDOW`] spans, each
    /// waited for before the next starts, so memory stays bounded whatever
    /// the number of spans (na-sm still makes one system call per
    /// window). The first failure is returned, after every span finished
    /// (unless the call stops early, below).
    ///
    /// The whole call, the lookup of a third-party owner included (see
    /// [`allow_any_owner`](Self::allow_any_owner)), may take the engine's
    /// handler transfer timeout ([`Engine::set_handler_transfer_timeout`],
    /// default [`DEFAULT_HANDLER_TRANSFER_TIMEOUT`]). Past it, the call fails:
    /// the transfers in flight are canceled and waited for (so that, once
    /// the handler answers, nothing touches the caller's memory any more:
    /// an RDMA transfer on the wire cannot be recalled), and windows not
    /// started yet are not started. (Only a failure of the endpoint itself
    /// while transfers are in flight ends the wait early; it is logged as
    /// an error.) A transfer's failure before the stop comes first in the
    /// error. The deadline is also checked before each window after the
    /// first, even one that copies in memory (a handle of this process, or
    /// inline data).
    pub fn transfer_batch(
        &mut self,
        op: BulkOp,
        remote: &Bulk,
        local: &Bulk,
        spans: &[Span],
    ) -> std::result::Result<(), String> {
        self.check_owner(op, remote)?;
        hg_bulk::check_spans(remote, local, spans).map_err(|e| e.to_string())?;
        let deadline = na_core::deadline_after(self.transfer_timeout);
        let mut failure: Option<String> = None;
        for (i, window) in spans.chunks(BATCH_WINDOW).enumerate() {
            let before = i * BATCH_WINDOW;
            // Why the batch stops here, and how many spans it leaves
            // unstarted.
            let (why, skipped) = if i > 0 && Instant::now() >= deadline {
                let why = format!("the transfer did not finish within {:?}", self.transfer_timeout);
                (why, spans.len() - before)
            } else {
                match self.transfer_window(op, remote, local, window, deadline) {
                    Ok(()) => continue,
                    Err(WindowFailure::Failed(e)) => {
                        failure.get_or_insert(e);
                        continue;
                    }
                    Err(WindowFailure::Stopped(e)) => (e, spans.len() - before - window.len()),
                }
            };
            let why = match skipped {
                0 => why,
                n => format!("{why}; {n} later spans were not started"),
            };
            return Err(with_first(failure, why));
        }
        failure.map_or(Ok(()), Err)
    }

    /// Starts one window of spans and waits for every one of them.
    fn transfer_window(
        &mut self,
        op: BulkOp,
        remote: &Bulk,
        local: &Bulk,
        spans: &[Span],
        deadline: Instant,
    ) -> std::result::Result<(), WindowFailure> {
        let ids: Vec<(Span, OpId)> = spans
            .iter()
            .map(|s| {
                *self.next_op += 1;
                (*s, OpId(*self.next_op))
            })
            .collect();
        let via = match self.start_window(op, remote, local, &ids, deadline)? {
            Started::Done => return Ok(()),
            Started::Posted(via) => via,
        };
        let (first, last) = (
            ids.first().map_or(0, |i| i.1 .0),
            ids.last().map_or(0, |i| i.1 .0),
        );
        let mut left = ids.len();
        let mut failure = None;
        while left > 0 {
            while let Some(c) = self.ep.pop_completion() {
                if (first..=last).contains(&c.op.0) {
                    left -= 1;
                    if let (Err(e), None) = (c.status, &failure) {
                        failure = Some(e.to_string());
                    }
                } else {
                    self.deferred.push_back(c);
                }
            }
            if left == 0 {
                break;
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                let late = left;
                let why = format!(
                    "{late} of {} bulk transfers did not finish within {:?} (canceled)",
                    ids.len(),
                    self.transfer_timeout
                );
                let why = with_first(failure, why);
                return Err(match self.cancel_window(via, &ids, first..=last, left) {
                    Ok(()) => WindowFailure::Stopped(why),
                    Err(e) => WindowFailure::Stopped(format!("{why}; {e}")),
                });
            }
            if let Err(e) = self.ep.progress(Some(wait)) {
                return Err(WindowFailure::Stopped(with_first(failure, stopped_by(&e, left))));
            }
        }
        failure.map_or(Ok(()), |e| Err(WindowFailure::Failed(e)))
    }

    /// Starts one window. Through the request's own source when the
    /// caller owns the handle (a client that does not listen is reachable
    /// only there); otherwise (`allow_any_owner`) the owner is looked up,
    /// and where that would wait to connect, the endpoint is driven for a
    /// pause (doubling, as [`Engine::bulk`]'s lookup does; other work is
    /// kept for the engine) and the lookup tried again, until `deadline`:
    /// the handler's transfer timeout covers the lookup too, not only the
    /// transport's own bound for it.
    fn start_window(
        &mut self,
        op: BulkOp,
        remote: &Bulk,
        local: &Bulk,
        ids: &[(Span, OpId)],
        deadline: Instant,
    ) -> std::result::Result<Started, WindowFailure> {
        let since = Instant::now();
        let mut backoff = LookupBackoff::new();
        loop {
            let span = DebugSpan::enter(|| bulk_span(op, remote, ids.len()));
            let started =
                hg_bulk::start_batch_via(self.ep, op, remote, local, ids, Some(self.origin), Some(since));
            drop(span);
            match started {
                Ok(started) => return Ok(started),
                Err(hg_bulk::BulkError::Na(e)) if e.is_would_block() => {}
                Err(e) => return Err(WindowFailure::Failed(e.to_string())),
            }
            let (ep, deferred) = (&mut *self.ep, &mut *self.deferred);
            let paused = backoff.drive_pause(deadline, |wait| {
                ep.progress(Some(wait))?;
                deferred.extend(std::iter::from_fn(|| ep.pop_completion()));
                Ok::<(), na_core::NaError>(())
            });
            match paused {
                Ok(true) => {}
                // Nothing started: later windows are not started either.
                Ok(false) => {
                    return Err(WindowFailure::Stopped(format!(
                        "the lookup of the handle's owner {} did not finish within {:?}",
                        remote.owner(),
                        self.transfer_timeout
                    )))
                }
                Err(e) => {
                    tracing::error!(error = %e, "progress failed while a handler looked up a bulk handle's owner");
                    return Err(WindowFailure::Stopped(format!(
                        "progress failed while looking up the handle's owner: {e}"
                    )));
                }
            }
        }
    }

    /// Cancels the `left` transfers of `ids` (op ids `range`) still in
    /// flight and waits until the transport has ended every one. The
    /// answer to the request must not go out before: its origin may free
    /// or reuse its memory as soon as it has it, and a transfer on the wire
    /// cannot be recalled (RDMA), only waited for. The transport ends a
    /// canceled one promptly: one not started yet is dropped, one on the
    /// wire completes or fails (a dead peer's fails by the transport's own
    /// timeout, or when its connection goes; na-verbs tears down a
    /// connection whose device completes nothing for
    /// `VerbsConfig::cancel_timeout` after the cancel).
    fn cancel_window(
        &mut self,
        via: PluginId,
        ids: &[(Span, OpId)],
        range: std::ops::RangeInclusive<u64>,
        mut left: usize,
    ) -> std::result::Result<(), String> {
        for &(_, op) in ids {
            // Finished ones are unknown to the transport by now: no matter.
            let _ = self.ep.cancel(via, op);
        }
        let (started, mut warned) = (Instant::now(), false);
        loop {
            while let Some(c) = self.ep.pop_completion() {
                if range.contains(&c.op.0) {
                    left -= 1;
                } else {
                    self.deferred.push_back(c);
                }
            }
            if left == 0 {
                return Ok(());
            }
            if !warned && started.elapsed() > CANCEL_WAIT_WARNING {
                warned = true;
                tracing::warn!(
                    left,
                    waited = ?started.elapsed(),
                    "a handler's timed-out transfers are still in flight; its answer waits for them"
                );
            }
            self.ep
                .progress(Some(Duration::from_millis(100)))
                .map_err(|e| stopped_by(&e, left))?;
        }
    }
}

/// A handler's transfer with `remote` is allowed: the handle is its
/// caller's (`origin`), or needs no transfer with anyone (a handle of this
/// process is copied in memory; a pull of inline data reads the
/// descriptor), or the handler lifted the rule (`any_owner`, with
/// `lifted_by`, named in the refusal).
pub(crate) fn check_owner(
    any_owner: bool,
    origin: &Addr,
    op: BulkOp,
    remote: &Bulk,
    lifted_by: &str,
) -> std::result::Result<(), String> {
    let here_or_inline = remote.local().is_some() || (op == BulkOp::Pull && remote.desc().inline.is_some());
    if any_owner || here_or_inline || remote.owner() == origin.uri() {
        return Ok(());
    }
    Err(format!(
        "the bulk handle belongs to {}, not to the caller {}: a handler moves data only with its caller \
         ({lifted_by} lifts this)",
        remote.owner(),
        origin.uri()
    ))
}

/// The debug span of starting a batch of `spans` transfers with `remote`
/// (origins' and handlers' alike; the transports' own spans nest in it).
fn bulk_span(op: BulkOp, remote: &Bulk, spans: usize) -> tracing::Span {
    tracing::debug_span!("rpc bulk", ?op, spans, owner = remote.owner())
}

/// `why` a batch stopped, after the first failure before it, if any.
fn with_first(failure: Option<String>, why: String) -> String {
    match failure {
        Some(first) => format!("{first}; then {why}"),
        None => why,
    }
}

/// The endpoint failed while `left` transfers of a window were in flight:
/// they cannot be waited for (so the answer may come before they end),
/// and nothing more is started. Logged as an error; returns why.
fn stopped_by(e: &na_core::NaError, left: usize) -> String {
    tracing::error!(
        error = %e,
        left,
        "progress failed while a handler's transfers were in flight; answering without them"
    );
    format!("progress failed with {left} transfers in flight: {e}")
}

impl<C: Codec> Engine<C> {
    /// Exposes buffers (in order, one handle) for peers to push into or
    /// pull from; put the handle in RPC arguments to hand it over.
    pub fn expose(&mut self, buffers: Vec<Vec<u8>>, access: Access) -> Result<Bulk> {
        Bulk::expose(&mut self.ep, self.plugin, buffers, access).map_err(bulk_err)
    }

    /// Starts a transfer; see [`take_bulk`](Self::take_bulk). The lookup
    /// of the handle's owner waits as
    /// [`bulk_start_batch`](Self::bulk_start_batch)'s does (up to the
    /// transport's bound); to bound it by a timeout, use
    /// [`bulk_start_batch_within`](Self::bulk_start_batch_within) with one
    /// span, or [`bulk`](Self::bulk).
    #[allow(clippy::too_many_arguments)]
    pub fn bulk_start(
        &mut self,
        op: BulkOp,
        remote: &Bulk,
        remote_offset: u64,
        local: &Bulk,
        local_offset: u64,
        len: u64,
    ) -> Result<BulkId> {
        let span = Span {
            remote_offset,
            local_offset,
            len,
        };
        let ids = self.bulk_start_batch(op, remote, local, &[span])?;
        Ok(ids[0])
    }

    /// Starts one transfer per span, all as one batch (see
    /// [`hg_bulk::start_batch`]); each has its own id for
    /// [`take_bulk`](Self::take_bulk). If any span is refused, none starts.
    /// Everything is in flight at once: memory is proportional to the
    /// number of spans (a few hundred bytes each), so split very large
    /// batches (for example into [`BATCH_WINDOW`] spans).
    ///
    /// Looking up the handle's owner may connect to it, and wait for that,
    /// as long as the transport's bound for a lookup (see
    /// [`na_core::Endpoint::lookup`]; na-sm: 5 s, na-verbs: 15 s);
    /// [`bulk_start_batch_within`](Self::bulk_start_batch_within) waits at
    /// most the caller's timeout, and
    /// [`bulk_try_start_batch`](Self::bulk_try_start_batch) never waits.
    pub fn bulk_start_batch(
        &mut self,
        op: BulkOp,
        remote: &Bulk,
        local: &Bulk,
        spans: &[Span],
    ) -> Result<Vec<BulkId>> {
        self.bulk_start_batch_with(op, remote, local, spans, None, None)
    }

    /// [`bulk_start_batch`](Self::bulk_start_batch) whose lookup of the
    /// handle's owner waits at most `timeout`, not the transport's bound:
    /// where it would wait to connect (na-sm: the owner's accept queue is
    /// full), the engine is driven for a pause (handlers run, responses
    /// are filed; 1 ms, doubling to 20 ms) and the lookup is tried again,
    /// until `timeout` has passed. Then the answer is
    /// [`RpcError::Timeout`] and nothing has started (or the lookup's own
    /// error, if the transport's bound passes first). A zero timeout tries
    /// once and never waits. `timeout` bounds the start only: the
    /// transfers then run as [`bulk_start_batch`](Self::bulk_start_batch)'s
    /// do, until [`take_bulk`](Self::take_bulk) has their outcomes
    /// ([`bulk`](Self::bulk) waits for one transfer and
    /// [`bulk_batch`](Self::bulk_batch) for a batch, their timeout
    /// covering both).
    pub fn bulk_start_batch_within(
        &mut self,
        op: BulkOp,
        remote: &Bulk,
        local: &Bulk,
        spans: &[Span],
        timeout: Duration,
    ) -> Result<Vec<BulkId>> {
        self.bulk_start_batch_until(
            op,
            remote,
            local,
            spans,
            na_core::deadline_after(timeout),
            timeout,
        )
    }

    /// [`bulk_start_batch`](Self::bulk_start_batch) whose lookup of the
    /// handle's owner never waits (see [`hg_bulk::try_start_batch`]):
    /// where it would wait to connect, this fails at once with
    /// [`NaError::WouldBlock`](na_core::NaError::WouldBlock) (as
    /// [`RpcError::Transport`]) and starts
    /// nothing; try again later with the same `since`, the first attempt's
    /// time. Once the transport's bound for a lookup has passed since
    /// `since`, the error is the blocking lookup's (a timeout naming the
    /// owner). [`AsyncEngine`](crate::AsyncEngine) transfers start this
    /// way, pausing between attempts without the engine lock.
    pub fn bulk_try_start_batch(
        &mut self,
        op: BulkOp,
        remote: &Bulk,
        local: &Bulk,
        spans: &[Span],
        since: Instant,
    ) -> Result<Vec<BulkId>> {
        self.bulk_start_batch_with(op, remote, local, spans, Some(since), None)
    }

    /// [`bulk_start_batch`](Self::bulk_start_batch), or with `since`
    /// [`bulk_try_start_batch`](Self::bulk_try_start_batch); with `via`
    /// (the source of the request a handler serves) a handle its source
    /// owns is reached through that address, without a lookup (see
    /// [`hg_bulk::start_batch_via`]).
    pub(crate) fn bulk_start_batch_with(
        &mut self,
        op: BulkOp,
        remote: &Bulk,
        local: &Bulk,
        spans: &[Span],
        since: Option<Instant>,
        via: Option<&Addr>,
    ) -> Result<Vec<BulkId>> {
        let ids: Vec<(Span, OpId)> = spans.iter().map(|s| (*s, self.op())).collect();
        let _span = DebugSpan::enter(|| bulk_span(op, remote, spans.len()));
        let started = hg_bulk::start_batch_via(&mut self.ep, op, remote, local, &ids, via, since);
        let posted = match started {
            Err(e) => return Err(bulk_err(e)),
            Ok(Started::Posted(via)) => Some(via),
            Ok(Started::Done) => None,
        };
        for &(_, id) in &ids {
            match posted {
                Some(via) => {
                    self.ops.insert(id, OpRole::Bulk(via));
                }
                None => {
                    self.bulk_done.insert(id.0, Ok(()));
                }
            }
        }
        Ok(ids.into_iter().map(|(_, id)| BulkId(id.0)).collect())
    }

    /// The outcome of transfer `id` once it finished.
    pub fn take_bulk(&mut self, id: BulkId) -> Option<Result<()>> {
        self.bulk_done.remove(&id.0)
    }

    /// From now on, keeps the id of every transfer started with
    /// [`bulk_start`](Self::bulk_start) whose outcome is filed, for
    /// [`take_finished_bulks`](Self::take_finished_bulks) (as
    /// [`log_finished`](Self::log_finished) does for calls). Whoever turns
    /// it on must drain it, or it grows with every transfer.
    pub fn log_finished_bulks(&mut self) {
        self.finished_bulks.get_or_insert_with(Vec::new);
    }

    /// Moves the transfers that ended since the last call into `out`
    /// (oldest first), when [`log_finished_bulks`](Self::log_finished_bulks) is on. An
    /// id may name a transfer whose outcome was taken or forgotten
    /// meanwhile: [`take_bulk`](Self::take_bulk) then says `None`.
    /// (Transfers that end as they start, in memory or inline, are not
    /// logged: their outcome is there when `bulk_start` returns.)
    pub fn take_finished_bulks(&mut self, out: &mut Vec<BulkId>) {
        if let Some(log) = &mut self.finished_bulks {
            out.append(log);
        }
    }

    /// Asks the transport to cancel transfer `id`. Its outcome still comes
    /// for [`take_bulk`](Self::take_bulk), once the transport has ended
    /// it: canceled (`NaError::Canceled`), or whatever it ended with if it
    /// was too late to cancel. Until then the transfer may still read or
    /// write both handles' memory (an RDMA operation on the wire cannot be
    /// recalled, only waited for).
    pub fn cancel_bulk(&mut self, id: BulkId) {
        let op = OpId(id.0);
        if let Some(&OpRole::Bulk(via)) = self.ops.get(&op) {
            // Best effort: one that finished meanwhile cannot be.
            let _ = self.ep.cancel(via, op);
        }
    }

    /// Moves `len` bytes and waits (driving progress) at most `timeout`
    /// for the transfer to finish.
    ///
    /// Past the timeout the transfer is canceled and **waited for** before
    /// the [`RpcError::Timeout`] returns: when `bulk` returns, nothing
    /// touches `remote`'s or `local`'s memory any more, so a deferred
    /// handler may answer its caller (who may then free that memory) right
    /// after. A transfer on the wire (RDMA) cannot be recalled, only
    /// waited for; the transport ends a canceled one promptly (one not
    /// started is dropped, one to a dead peer fails by the transport's
    /// own timeout or when its connection goes, and na-verbs bounds the
    /// wait for a device that completes nothing by tearing the connection
    /// down, see `VerbsConfig::cancel_timeout`). The wait drives the
    /// engine as the transfer did (handlers run, responses are filed) and
    /// warns if it lasts over 10 s. The answer is the timeout even if the
    /// transfer finished meanwhile: the destination's contents in the
    /// range are then unspecified. A zero timeout does not wait for the
    /// transfer to finish (unless it ended as it started: served from this
    /// process's own memory, or from inline data; a transfer the transport
    /// carried out in the starting call, as na-sm does, has not had its
    /// completion taken yet, so it is canceled and answered with the
    /// timeout). If progress itself fails meanwhile, that error
    /// returns and the transfer is given up as by
    /// [`forget_bulk`](Self::forget_bulk), which never waits.
    ///
    /// The timeout covers the whole call: where looking up the handle's
    /// owner would wait to connect (na-sm: the owner's accept queue is
    /// full), the engine is driven meanwhile and tries again, and the
    /// answer is the timeout if it passes first (or the lookup's error if
    /// the transport's bound for a lookup does). A zero timeout looks the
    /// owner up as [`bulk_start`](Self::bulk_start) does (a wait the
    /// transport bounds).
    ///
    /// [`bulk_batch`](Self::bulk_batch) moves many spans this way, with
    /// one wait.
    #[allow(clippy::too_many_arguments)]
    pub fn bulk(
        &mut self,
        op: BulkOp,
        remote: &Bulk,
        remote_offset: u64,
        local: &Bulk,
        local_offset: u64,
        len: u64,
        timeout: Duration,
    ) -> Result<()> {
        let span = Span {
            remote_offset,
            local_offset,
            len,
        };
        self.bulk_batch(op, remote, local, &[span], timeout)
    }

    /// Moves every span between `remote` and `local` as one batch (see
    /// [`bulk_start_batch`](Self::bulk_start_batch): if any span is
    /// refused, none starts) and waits (driving progress: handlers run,
    /// responses are filed) at most `timeout` for all of them: the
    /// blocking twin of [`AsyncEngine::bulk_batch`](crate::AsyncEngine::bulk_batch),
    /// and [`bulk`](Self::bulk) for many spans.
    ///
    /// The answer is the failure of the first failed span in `spans`'
    /// order (the transport's error, [`RpcError::Transport`]), once every
    /// span has ended; an empty batch does nothing. The timeout covers the
    /// whole call, the lookup of the handle's owner included (as in
    /// [`bulk_start_batch_within`](Self::bulk_start_batch_within); a zero
    /// timeout leaves that wait to the transport's bound). Past it, the
    /// spans still in flight are canceled and **waited for**, as in
    /// `bulk`, and the answer is [`RpcError::Timeout`], even if a span
    /// failed before: once this returns, no span touches either handle's
    /// memory any more, and no transfer is left in flight
    /// ([`RpcStats::bulk_in_flight`](crate::RpcStats::bulk_in_flight)). A
    /// zero timeout does not wait for the spans (unless they ended as they
    /// started, in memory or from inline data): those in flight are
    /// canceled, waited for, and answered with the timeout. If progress
    /// itself fails meanwhile, that error returns and the spans in flight
    /// are given up as by [`forget_bulk`](Self::forget_bulk).
    ///
    /// Everything is in flight at once: split very large batches (for
    /// example into [`BATCH_WINDOW`] spans).
    pub fn bulk_batch(
        &mut self,
        op: BulkOp,
        remote: &Bulk,
        local: &Bulk,
        spans: &[Span],
        timeout: Duration,
    ) -> Result<()> {
        if spans.is_empty() {
            return Ok(());
        }
        let deadline = na_core::deadline_after(timeout);
        let ids = if timeout.is_zero() {
            self.bulk_start_batch(op, remote, local, spans)?
        } else {
            self.bulk_start_batch_until(op, remote, local, spans, deadline, timeout)?
        };
        // The spans not ended yet, in `spans`' order, and the outcomes of
        // those that did (by index: the first failure in that order is
        // the answer).
        let mut pending: Vec<(usize, BulkId)> = ids.into_iter().enumerate().collect();
        let mut outcomes: Vec<Option<Result<()>>> =
            std::iter::repeat_with(|| None).take(spans.len()).collect();
        loop {
            pending.retain(|&(i, id)| match self.take_bulk(id) {
                Some(r) => {
                    outcomes[i] = Some(r);
                    false
                }
                None => true,
            });
            if pending.is_empty() {
                return outcomes
                    .into_iter()
                    .flatten()
                    .find(Result::is_err)
                    .unwrap_or(Ok(()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let rest: Vec<BulkId> = pending.iter().map(|&(_, id)| id).collect();
                self.cancel_and_wait(&rest)?;
                return Err(RpcError::Timeout {
                    rpc: "bulk transfer".into(),
                    millis: timeout.as_millis(),
                });
            }
            if let Err(e) = self.progress(Some(left)).and_then(|_| self.trigger()) {
                for &(_, id) in &pending {
                    self.forget_bulk(id);
                }
                return Err(e);
            }
        }
    }

    /// Starts one transfer per span; where the lookup of the owner would
    /// wait to connect, drives the engine for a pause (doubling, as an
    /// [`AsyncEngine`](crate::AsyncEngine)'s lookup does) and tries again,
    /// until `deadline` (then [`RpcError::Timeout`] for `timeout`).
    fn bulk_start_batch_until(
        &mut self,
        op: BulkOp,
        remote: &Bulk,
        local: &Bulk,
        spans: &[Span],
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Vec<BulkId>> {
        let since = Instant::now();
        let mut backoff = LookupBackoff::new();
        loop {
            match self.bulk_start_batch_with(op, remote, local, spans, Some(since), None) {
                Ok(ids) => return Ok(ids),
                Err(RpcError::Transport(e)) if e.is_would_block() => {}
                Err(e) => return Err(e),
            }
            // The engine's work goes on meanwhile; the lookup is tried
            // again once the pause has passed, however busy it is.
            let paused = backoff.drive_pause(deadline, |wait| {
                self.progress(Some(wait))?;
                self.trigger().map(drop)
            })?;
            if !paused {
                return Err(RpcError::Timeout {
                    rpc: "bulk transfer".into(),
                    millis: timeout.as_millis(),
                });
            }
        }
    }

    /// Cancels transfers `ids` and drives the engine until the transport
    /// has ended every one (their outcomes are dropped). On a progress
    /// failure those not ended are forgotten instead, and that error
    /// returns.
    fn cancel_and_wait(&mut self, ids: &[BulkId]) -> Result<()> {
        for &id in ids {
            self.cancel_bulk(id);
        }
        let mut left: Vec<BulkId> = ids.to_vec();
        let (started, mut warned) = (Instant::now(), false);
        loop {
            // A completion files an outcome (and leaves `ops`).
            left.retain(|&id| self.take_bulk(id).is_none() && self.ops.contains_key(&OpId(id.0)));
            if left.is_empty() {
                return Ok(());
            }
            if !warned && started.elapsed() > CANCEL_WAIT_WARNING {
                warned = true;
                tracing::warn!(
                    left = left.len(),
                    waited = ?started.elapsed(),
                    "timed-out bulk transfers are still in flight; Engine::bulk waits for them"
                );
            }
            if let Err(e) = self
                .progress(Some(Duration::from_millis(100)))
                .and_then(|_| self.trigger())
            {
                tracing::error!(error = %e, "progress failed while timed-out bulk transfers were in flight");
                for &id in &left {
                    self.forget_bulk(id);
                }
                return Err(e);
            }
        }
    }

    /// Gives up on transfer `id`: it is canceled if the transport can, and
    /// its outcome, whenever it comes, is dropped instead of kept for
    /// [`take_bulk`](Self::take_bulk). The local memory stays valid until
    /// then (the transfer holds its handles), but this does not wait: a
    /// transfer already on the wire (RDMA) may still read or write the
    /// remote handle's memory after it returns, and its owner must not
    /// free it yet. [`bulk`](Self::bulk) waits for a canceled transfer.
    pub fn forget_bulk(&mut self, id: BulkId) {
        let op = OpId(id.0);
        if let Some(role @ &mut OpRole::Bulk(via)) = self.ops.get_mut(&op) {
            // Kept until the transport reports its end (counted in
            // `bulk_in_flight` until then).
            *role = OpRole::ForgottenBulk;
            // Best effort: a transfer that already finished cannot be.
            let _ = self.ep.cancel(via, op);
        }
        self.bulk_done.remove(&id.0);
    }
}

fn bulk_err(e: hg_bulk::BulkError) -> RpcError {
    match e {
        hg_bulk::BulkError::Na(e) => RpcError::Transport(e),
        hg_bulk::BulkError::NotLocal => RpcError::BulkRefused {
            reason: hg_bulk::BulkError::NotLocal.to_string(),
        },
        other => RpcError::Malformed {
            reason: other.to_string(),
        },
    }
}
