//! Bulk transfers driven by the engine: from the origin's code
//! ([`Engine::bulk_start`], [`Engine::bulk`]) and from inside handlers
//! ([`BulkCtx`]).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use hg_bulk::{Bulk, BulkOp, Started};
use na_core::{Access, Completion, Endpoint, OpId, PluginId};

use super::{Engine, OpRole};
use crate::codec::Codec;
use crate::error::{Result, RpcError};

/// Identifies a transfer started with [`Engine::bulk_start`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BulkId(u64);

/// How long a handler's transfer may take before it fails.
const HANDLER_TRANSFER_TIMEOUT: Duration = Duration::from_secs(30);

/// What a handler registered with [`Engine::register_with_bulk`] may do
/// while it runs: expose memory and move data to or from a client's handle.
pub struct BulkCtx<'a> {
    pub(super) ep: &'a mut Endpoint,
    pub(super) plugin: PluginId,
    pub(super) next_op: &'a mut u64,
    pub(super) deferred: &'a mut VecDeque<Completion>,
}

impl BulkCtx<'_> {
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
        *self.next_op += 1;
        let id = OpId(*self.next_op);
        match hg_bulk::start(self.ep, op, remote, remote_offset, local, local_offset, len, id) {
            Err(e) => return Err(e.to_string()),
            Ok(Started::Done) => return Ok(()),
            Ok(Started::Posted) => {}
        }
        let deadline = Instant::now() + HANDLER_TRANSFER_TIMEOUT;
        loop {
            while let Some(c) = self.ep.pop_completion() {
                if c.op == id {
                    return c.status.map_err(|e| e.to_string());
                }
                self.deferred.push_back(c);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // The operation stays posted; its late completion is ignored.
                return Err(format!(
                    "bulk transfer did not finish within {HANDLER_TRANSFER_TIMEOUT:?}"
                ));
            }
            self.ep.progress(Some(left)).map_err(|e| e.to_string())?;
        }
    }
}

impl<C: Codec> Engine<C> {
    /// Exposes buffers (in order, one handle) for peers to push into or
    /// pull from; put the handle in RPC arguments to hand it over.
    pub fn expose(&mut self, buffers: Vec<Vec<u8>>, access: Access) -> Result<Bulk> {
        Bulk::expose(&mut self.ep, self.plugin, buffers, access).map_err(bulk_err)
    }

    /// Starts a transfer; see [`take_bulk`](Self::take_bulk).
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
        let id = self.op();
        match hg_bulk::start(
            &mut self.ep,
            op,
            remote,
            remote_offset,
            local,
            local_offset,
            len,
            id,
        ) {
            Err(e) => Err(bulk_err(e)),
            Ok(Started::Done) => {
                self.bulk_done.insert(id.0, Ok(()));
                Ok(BulkId(id.0))
            }
            Ok(Started::Posted) => {
                self.ops.insert(id, OpRole::Bulk(id.0));
                Ok(BulkId(id.0))
            }
        }
    }

    /// The outcome of transfer `id` once it finished.
    pub fn take_bulk(&mut self, id: BulkId) -> Option<Result<()>> {
        self.bulk_done.remove(&id.0)
    }

    /// Moves `len` bytes and waits (driving progress) at most `timeout`.
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
        let id = self.bulk_start(op, remote, remote_offset, local, local_offset, len)?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(r) = self.take_bulk(id) {
                return r;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RpcError::Timeout {
                    rpc: "bulk transfer".into(),
                    millis: timeout.as_millis(),
                });
            }
            self.progress(Some(left))?;
            self.trigger()?;
        }
    }
}

fn bulk_err(e: hg_bulk::BulkError) -> RpcError {
    match e {
        hg_bulk::BulkError::Na(e) => RpcError::Transport(e),
        other => RpcError::Malformed {
            reason: other.to_string(),
        },
    }
}
