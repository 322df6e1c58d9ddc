//! Bulk transfers from inside handlers ([`BulkCtx`]): the caller-only
//! rule, windows of spans, and their timeout (canceled windows are waited
//! for before the handler answers).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use hg_bulk::{Bulk, BulkOp, Span, Started};
use na_core::{Access, Addr, Completion, Endpoint, OpId, PluginId};

use super::bulk_ops::{bulk_err, bulk_span};
use super::DebugSpan;
#[cfg(doc)]
use super::Engine;
use crate::error::{Result, RpcError};
use crate::lookup_backoff::LookupBackoff;
use crate::stats::{CountedStats, RpcStats};
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
    /// The engine's counters (`bulk_done`, `bulk_failed`, `bulk_bytes`).
    pub(super) stats: &'a mut RpcStats,
}

/// Why a window of a handler's transfer failed.
enum WindowFailure {
    /// A transfer failed (the others in the window finished first), or
    /// the window was refused at its start.
    Failed(RpcError),
    /// The batch cannot go on: the deadline passed (the window's transfers
    /// were canceled and waited for), or the endpoint failed while they
    /// were in flight.
    Stopped(RpcError),
}

impl BulkCtx<'_> {
    /// The address of the caller whose request is being handled.
    pub fn origin(&self) -> &Addr {
        self.origin
    }

    /// The engine's counters as they stand while this handler runs (this
    /// request already counted in `handled`, this handler's finished
    /// transfers in `bulk_done`, `bulk_failed`, `bulk_bytes`): the fields
    /// of [`Engine::stats`] that the engine counts as it works. The gauges
    /// `Engine::stats` reads off the engine's tables, which a handler's
    /// context does not reach, are not in [`CountedStats`] (see there).
    pub fn stats(&self) -> CountedStats {
        CountedStats::from(&*self.stats)
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
    fn check_owner(&self, op: BulkOp, remote: &Bulk) -> Result<()> {
        check_owner(
            self.any_owner,
            self.origin,
            op,
            remote,
            "BulkCtx::allow_any_owner",
        )
        .map_err(|reason| RpcError::BulkRefused { reason })
    }

    /// Exposes buffers as a local bulk handle (more buffers than a handle
    /// can name are [`RpcError::BulkRefused`]).
    pub fn expose(&mut self, buffers: Vec<Vec<u8>>, access: Access) -> Result<Bulk> {
        Bulk::expose(self.ep, self.plugin, buffers, access).map_err(bulk_err)
    }

    /// The error of a handler's transfer past its timeout.
    fn timed_out(&self) -> RpcError {
        RpcError::Timeout {
            rpc: "bulk transfer".into(),
            millis: self.transfer_timeout.as_millis(),
        }
    }

    /// Moves `len` bytes between `remote` and `local` and waits for it
    /// (other work that completes meanwhile is kept for the engine). The
    /// errors are [`transfer_batch`](Self::transfer_batch)'s.
    pub fn transfer(
        &mut self,
        op: BulkOp,
        remote: &Bulk,
        remote_offset: u64,
        local: &Bulk,
        local_offset: u64,
        len: u64,
    ) -> Result<()> {
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
    /// The errors are those of [`AsyncBulkCtx`](crate::AsyncBulkCtx) and
    /// [`Engine::bulk`]: [`RpcError::BulkRefused`] for a transfer refused
    /// before anything moved (a handle the caller does not own, a span
    /// out of bounds, an access mode that forbids the direction),
    /// [`RpcError::Transport`] for a transfer the transport failed,
    /// [`RpcError::Timeout`] past the timeout below. A handler returns
    /// them with `?` (its caller gets the message, see
    /// [`RpcError`]'s `From` for `String`).
    ///
    /// The whole call, the lookup of a third-party owner included (see
    /// [`allow_any_owner`](Self::allow_any_owner)), may take the engine's
    /// handler transfer timeout ([`Engine::set_handler_transfer_timeout`],
    /// default [`DEFAULT_HANDLER_TRANSFER_TIMEOUT`]). Past it, the call fails:
    /// the transfers in flight are canceled and waited for (so that, once
    /// the handler answers, nothing touches the caller's memory any more:
    /// an RDMA transfer on the wire cannot be recalled), and windows not
    /// started yet are not started (how many is logged, at debug level).
    /// (Only a failure of the endpoint itself while transfers are in
    /// flight ends the wait early, with its [`RpcError::Transport`]; it is
    /// logged as an error.) A transfer's failure before the stop is the
    /// error, rather than the stop. The deadline is also checked before each window after the
    /// first, even one that copies in memory (a handle of this process, or
    /// inline data).
    pub fn transfer_batch(&mut self, op: BulkOp, remote: &Bulk, local: &Bulk, spans: &[Span]) -> Result<()> {
        self.check_owner(op, remote)?;
        hg_bulk::check_spans(remote, local, spans).map_err(bulk_err)?;
        let deadline = na_core::deadline_after(self.transfer_timeout);
        let mut failure: Option<RpcError> = None;
        for (i, window) in spans.chunks(BATCH_WINDOW).enumerate() {
            let before = i * BATCH_WINDOW;
            // Why the batch stops here, and how many spans it leaves
            // unstarted.
            let (why, skipped) = if i > 0 && Instant::now() >= deadline {
                (self.timed_out(), spans.len() - before)
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
            tracing::debug!(
                error = %na_core::ErrorChain(&why),
                not_started = skipped,
                spans = spans.len(),
                "a handler's bulk transfer stopped"
            );
            return Err(failure.unwrap_or(why));
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
            Started::Done => {
                for (s, _) in &ids {
                    self.stats.count_bulk(true, s.len);
                }
                return Ok(());
            }
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
                    self.stats
                        .count_bulk(c.status.is_ok(), span_len(&ids, first, c.op));
                    if let (Err(e), None) = (c.status, &failure) {
                        failure = Some(RpcError::Transport(e));
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
                tracing::debug!(
                    late = left,
                    window = ids.len(),
                    "a handler's bulk transfers did not finish within its timeout: canceled"
                );
                let why = match self.cancel_window(via, &ids, first..=last, left) {
                    Ok(()) => self.timed_out(),
                    Err(e) => e,
                };
                return Err(WindowFailure::Stopped(failure.unwrap_or(why)));
            }
            if let Err(e) = self.ep.progress(Some(wait)) {
                // The transport failed: the window's transfers still in
                // flight are canceled (best effort; their completions may
                // never come) and counted as failed here, so that every
                // transfer started counts once in `bulk_done` or
                // `bulk_failed` (a late completion of one of them is not
                // this window's any more: the engine drops it unknown).
                for &(_, op) in &ids {
                    let _ = self.ep.cancel(via, op);
                }
                for _ in 0..left {
                    self.stats.count_bulk(false, 0);
                }
                return Err(WindowFailure::Stopped(failure.unwrap_or(stopped_by(e, left))));
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
                Err(e) => return Err(WindowFailure::Failed(bulk_err(e))),
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
                    tracing::debug!(
                        owner = remote.owner(),
                        "the lookup of a handler's bulk handle's owner did not finish within its timeout"
                    );
                    return Err(WindowFailure::Stopped(self.timed_out()));
                }
                Err(e) => {
                    tracing::error!(error = %na_core::ErrorChain(&e), "progress failed while a handler looked up a bulk handle's owner");
                    return Err(WindowFailure::Stopped(RpcError::Transport(e)));
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
    ) -> Result<()> {
        for &(_, op) in ids {
            // Finished ones are unknown to the transport by now: no matter.
            let _ = self.ep.cancel(via, op);
        }
        let (started, mut warned) = (Instant::now(), false);
        loop {
            while let Some(c) = self.ep.pop_completion() {
                if range.contains(&c.op.0) {
                    left -= 1;
                    self.stats
                        .count_bulk(c.status.is_ok(), span_len(ids, *range.start(), c.op));
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
            if let Err(e) = self.ep.progress(Some(Duration::from_millis(100))) {
                // As in `transfer_window`: the rest count as failed.
                for _ in 0..left {
                    self.stats.count_bulk(false, 0);
                }
                return Err(stopped_by(e, left));
            }
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

/// The length of the span of `ids` (whose op ids count up from `first`)
/// under op id `op`.
fn span_len(ids: &[(Span, OpId)], first: u64, op: OpId) -> u64 {
    let at = op.0.wrapping_sub(first) as usize;
    ids.get(at).map_or(0, |(s, _)| s.len)
}

/// The endpoint failed while `left` transfers of a window were in flight:
/// they cannot be waited for (so the answer may come before they end),
/// and nothing more is started. Logged as an error; returns the error.
fn stopped_by(e: na_core::NaError, left: usize) -> RpcError {
    tracing::error!(
        error = %na_core::ErrorChain(&e),
        left,
        "progress failed while a handler's transfers were in flight; answering without them"
    );
    RpcError::Transport(e)
}
