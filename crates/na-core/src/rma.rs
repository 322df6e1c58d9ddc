//! One-sided transfers: the request a plugin's [`rma`](crate::Plugin::rma)
//! takes, and the checks every plugin makes before it moves a byte.
//!
//! A caller hands a plugin a *batch* of transfers to one peer. Posting many
//! at once lets a plugin merge them: na-sm moves a batch of gets (or puts)
//! with one `process_vm_readv` (`writev`), na-verbs posts all their work
//! requests in one pass. Each transfer still has its own [`OpId`] and its
//! own completion.

use crate::error::{NaError, Result};
use crate::mem::{MemHandle, RemoteMem};
use crate::op::{OpId, OpKind};

/// Which way an RMA transfer moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RmaDir {
    /// Local memory to the peer's (a put, RDMA write).
    Put,
    /// The peer's memory to local memory (a get, RDMA read).
    Get,
}

impl RmaDir {
    /// The completion kind of a transfer in this direction.
    pub fn kind(self) -> OpKind {
        match self {
            RmaDir::Put => OpKind::Put,
            RmaDir::Get => OpKind::Get,
        }
    }

    /// `"put"` or `"get"`, for messages.
    pub fn name(self) -> &'static str {
        match self {
            RmaDir::Put => "put",
            RmaDir::Get => "get",
        }
    }
}

/// One transfer of `len` bytes between `local` at `local_offset` and the
/// peer's `remote` at `remote_offset`, completed under id `op`.
#[derive(Clone, Copy, Debug)]
pub struct Rma<'a> {
    /// Direction.
    pub dir: RmaDir,
    /// The local side (read by a put, written by a get).
    pub local: &'a MemHandle,
    /// Byte offset into `local`.
    pub local_offset: u64,
    /// The peer's side, as it described it.
    pub remote: &'a RemoteMem,
    /// Byte offset into `remote`.
    pub remote_offset: u64,
    /// Bytes to move (0 is allowed and completes at once).
    pub len: u64,
    /// Completion id.
    pub op: OpId,
}

impl<'a> Rma<'a> {
    /// A put of `len` bytes from `local` at `local_offset` to `remote` at
    /// `remote_offset`.
    pub fn put(
        local: &'a MemHandle,
        local_offset: u64,
        remote: &'a RemoteMem,
        remote_offset: u64,
        len: u64,
        op: OpId,
    ) -> Self {
        Rma {
            dir: RmaDir::Put,
            local,
            local_offset,
            remote,
            remote_offset,
            len,
            op,
        }
    }

    /// A get of `len` bytes from `remote` at `remote_offset` into `local`
    /// at `local_offset`.
    pub fn get(
        local: &'a MemHandle,
        local_offset: u64,
        remote: &'a RemoteMem,
        remote_offset: u64,
        len: u64,
        op: OpId,
    ) -> Self {
        Rma {
            dir: RmaDir::Get,
            ..Self::put(local, local_offset, remote, remote_offset, len, op)
        }
    }

    /// Checks what a plugin must check before it starts the transfer: the
    /// local handle allows the local side's access, the remote handle the
    /// remote side's (as the peer declared it), and both ranges are in
    /// bounds. A plugin still relies on the kernel or the NIC for whether
    /// the remote addresses are really mapped.
    pub fn check(&self) -> Result<()> {
        let (l, r) = (self.local.access(), self.remote.access());
        let (local_ok, local_needs, remote_ok, remote_needs) = match self.dir {
            RmaDir::Put => (l.can_read(), "read", r.can_write(), "write"),
            RmaDir::Get => (l.can_write(), "write", r.can_read(), "read"),
        };
        if !local_ok {
            return Err(NaError::AccessDenied {
                what: "local",
                has: l,
                needs: local_needs,
            });
        }
        if !remote_ok {
            return Err(NaError::AccessDenied {
                what: "remote",
                has: r,
                needs: remote_needs,
            });
        }
        self.local.check_range(self.local_offset, self.len)?;
        self.remote.check_range(self.remote_offset, self.len)
    }
}

/// Checks every transfer of a batch ([`Rma::check`]) and that no two of
/// them share an id ([`check_distinct_ids`]), so a plugin can refuse the
/// whole batch before it starts any. (The plugin checks the ids against
/// its own operations in flight.)
pub fn check_batch(ops: &[Rma<'_>]) -> Result<()> {
    ops.iter().try_for_each(Rma::check)?;
    check_distinct_ids(ops.iter().map(|o| o.op))
}

/// Refuses a batch in which two operations share an id, with
/// [`NaError::OpInFlight`] naming the first repeated one: two completions
/// under one id could not be told apart. The one rule for every batch,
/// whether a plugin moves it or its caller serves it without one (hg-bulk's
/// in-memory copies and inline data).
pub fn check_distinct_ids<I>(ids: I) -> Result<()>
where
    I: ExactSizeIterator<Item = OpId> + Clone,
{
    match first_repeated_id(ids) {
        Some(op) => Err(NaError::OpInFlight(op.0)),
        None => Ok(()),
    }
}

/// The first id that appears twice in `ids`, if any: pairwise for a small
/// batch (no allocation on the common path), sorted for a large one.
fn first_repeated_id<I>(ids: I) -> Option<OpId>
where
    I: ExactSizeIterator<Item = OpId> + Clone,
{
    if ids.len() <= 32 {
        return ids
            .clone()
            .enumerate()
            .find(|&(i, a)| ids.clone().take(i).any(|b| b == a))
            .map(|(_, a)| a);
    }
    let mut sorted: Vec<u64> = ids.map(|o| o.0).collect();
    sorted.sort_unstable();
    sorted.windows(2).find(|w| w[0] == w[1]).map(|w| OpId(w[0]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::{Access, RemoteSegment};

    fn remote(len: u64, access: Access) -> RemoteMem {
        RemoteMem::new(
            vec![RemoteSegment {
                addr: 4096,
                len,
                key: 0,
            }],
            access,
        )
        .unwrap()
    }

    #[test]
    fn checks_access_and_bounds() {
        let rw = MemHandle::zeroed(64, Access::ReadWrite);
        let ro = MemHandle::zeroed(64, Access::ReadOnly);
        let r_rw = remote(64, Access::ReadWrite);
        let r_ro = remote(64, Access::ReadOnly);
        assert!(Rma::put(&ro, 0, &r_rw, 0, 64, OpId(1)).check().is_ok());
        assert!(Rma::get(&rw, 0, &r_ro, 0, 64, OpId(1)).check().is_ok());
        assert!(matches!(
            Rma::get(&ro, 0, &r_rw, 0, 8, OpId(1)).check(),
            Err(NaError::AccessDenied { what: "local", .. })
        ));
        assert!(matches!(
            Rma::put(&rw, 0, &r_ro, 0, 8, OpId(1)).check(),
            Err(NaError::AccessDenied { what: "remote", .. })
        ));
        assert!(Rma::put(&rw, 60, &r_rw, 0, 8, OpId(1)).check().is_err());
        assert!(Rma::put(&rw, 0, &r_rw, 57, 8, OpId(1)).check().is_err());
        assert!(Rma::put(&rw, 0, &r_rw, u64::MAX, 2, OpId(1)).check().is_err());
        assert!(Rma::put(&rw, 64, &r_rw, 64, 0, OpId(1)).check().is_ok());
        let a = Rma::put(&rw, 0, &r_rw, 0, 8, OpId(1));
        let b = Rma::get(&rw, 8, &r_rw, 8, 8, OpId(2));
        assert!(check_batch(&[a, b]).is_ok());
        assert!(check_batch(&[a, b, Rma { len: 64, ..b }]).is_err());
        assert_eq!(b.dir.kind(), OpKind::Get);
    }

    #[test]
    fn a_batch_that_repeats_an_id_is_refused_whole() {
        let rw = MemHandle::zeroed(64, Access::ReadWrite);
        let r_rw = remote(64, Access::ReadWrite);
        let t = |op| Rma::put(&rw, 0, &r_rw, 0, 8, OpId(op));
        // Small batches are compared pairwise, large ones sorted.
        for n in [2u64, 5, 32, 33, 200] {
            let mut ops: Vec<Rma<'_>> = (0..n).map(|i| t(100 + i)).collect();
            assert!(check_batch(&ops).is_ok(), "{n} distinct ids");
            // The last takes the id of one in the middle (the first for 2).
            let twice = 100 + (n - 1) / 2;
            ops[n as usize - 1].op = OpId(twice);
            assert!(
                matches!(check_batch(&ops), Err(NaError::OpInFlight(id)) if id == twice),
                "{n} transfers, one id twice"
            );
        }
    }
}
