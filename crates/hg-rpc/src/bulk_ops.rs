//! Bulk transfers started from the origin's code: exposing memory,
//! starting transfers ([`Engine::bulk_start`], [`Engine::bulk_start_batch`]
//! and its variants), their outcomes, and canceling or forgetting them.
//! Waiting for transfers within a timeout ([`Engine::bulk`],
//! [`Engine::bulk_batch`]) is in `bulk_wait_ops.rs`; handlers' transfers
//! ([`BulkCtx`](super::BulkCtx)) in `bulk_ctx.rs`.

use std::time::{Duration, Instant};

use hg_bulk::{Bulk, BulkOp, Span, Started};
use na_core::{Access, Addr, OpId};

#[cfg(doc)]
use super::BATCH_WINDOW;
use super::{DebugSpan, Engine, OpRole};
use crate::codec::Codec;
use crate::error::{Result, RpcError};
/// Identifies a transfer started with [`Engine::bulk_start`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BulkId(pub(crate) u64);

/// The debug span of starting a batch of `spans` transfers with `remote`
/// (origins' and handlers' alike; the transports' own spans nest in it).
pub(super) fn bulk_span(op: BulkOp, remote: &Bulk, spans: usize) -> tracing::Span {
    tracing::debug_span!("rpc bulk", ?op, spans, owner = remote.owner())
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
        for &(s, id) in &ids {
            match posted {
                Some(via) => {
                    self.ops.insert(id, OpRole::Bulk(via, s.len));
                }
                None => {
                    self.stats.count_bulk(true, s.len);
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
        if let Some(&OpRole::Bulk(via, _)) = self.ops.get(&op) {
            // Best effort: one that finished meanwhile cannot be.
            let _ = self.ep.cancel(via, op);
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
        if let Some(role @ &mut OpRole::Bulk(via, len)) = self.ops.get_mut(&op) {
            // Kept until the transport reports its end (counted in
            // `bulk_in_flight` until then, in `bulk_done` or
            // `bulk_failed` then).
            *role = OpRole::ForgottenBulk(len);
            // Best effort: a transfer that already finished cannot be.
            let _ = self.ep.cancel(via, op);
        }
        self.bulk_done.remove(&id.0);
    }
}

/// An [`hg_bulk::BulkError`] as the engine answers it: the caller's own
/// mistakes (bounds, access, a local side that is not local, too many
/// buffers) are [`RpcError::BulkRefused`], which no retry gets past; the
/// transport's failures stay [`RpcError::Transport`] (a retry may succeed).
pub(crate) fn bulk_err(e: hg_bulk::BulkError) -> RpcError {
    use hg_bulk::BulkError;
    use na_core::NaError;
    match e {
        BulkError::Na(e @ (NaError::OutOfBounds { .. } | NaError::AccessDenied { .. })) => {
            RpcError::BulkRefused {
                reason: e.to_string(),
            }
        }
        BulkError::Na(e) => RpcError::Transport(e),
        e @ (BulkError::NotLocal | BulkError::TooManySegments { .. }) => RpcError::BulkRefused {
            reason: e.to_string(),
        },
        other => RpcError::Malformed {
            reason: na_core::ErrorChain(&other).to_string(),
        },
    }
}
