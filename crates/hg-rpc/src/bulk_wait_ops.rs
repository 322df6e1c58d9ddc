//! Bulk transfers the origin waits for within a timeout
//! ([`Engine::bulk`], [`Engine::bulk_batch`]): the start whose lookup of
//! the owner the timeout bounds, the wait, and the cancel-and-wait past
//! the timeout.

use std::time::{Duration, Instant};

use hg_bulk::{Bulk, BulkOp, Span};
use na_core::OpId;

#[cfg(doc)]
use super::BATCH_WINDOW;
use super::{BulkId, Engine, CANCEL_WAIT_WARNING};
use crate::codec::Codec;
use crate::error::{keep_first_failure, Result, RpcError};
use crate::lookup_backoff::LookupBackoff;
impl<C: Codec> Engine<C> {
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
    ///
    /// Owners are not checked, unlike a handler's ([`BulkCtx`](crate::BulkCtx)
    /// moves data only with its caller by default). `local` may be any
    /// handle exposed in this process, by another engine too (even one
    /// dropped since): a handle holds its memory, and the transfer goes
    /// through this engine's endpoint; a handle of another process as
    /// `local` is [`RpcError::BulkRefused`]. The transfer goes to the
    /// owner `remote` names ([`Bulk::owner`]), whom the origin picks: a
    /// handle a peer sent (in a response, say) names whatever that peer
    /// wrote in it, so an origin that does not trust the peer to name
    /// itself compares `remote.owner()` with the peer's
    /// [`Addr::uri`](na_core::Addr::uri) before the transfer.
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
        // The spans not ended yet, by their index in `spans`, and the
        // first failure in that order (the answer).
        let mut pending: Vec<(usize, BulkId)> = ids.into_iter().enumerate().collect();
        let mut failure = None;
        loop {
            pending.retain(|&(i, id)| match self.take_bulk(id) {
                Some(r) => {
                    keep_first_failure(&mut failure, i, r);
                    false
                }
                None => true,
            });
            if pending.is_empty() {
                return failure.map_or(Ok(()), |(_, e)| Err(e));
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
    pub(super) fn bulk_start_batch_until(
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
    pub(super) fn cancel_and_wait(&mut self, ids: &[BulkId]) -> Result<()> {
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
                tracing::error!(error = %na_core::ErrorChain(&e), "progress failed while timed-out bulk transfers were in flight");
                for &id in &left {
                    self.forget_bulk(id);
                }
                return Err(e);
            }
        }
    }
}
