//! A transfer job of the RMA thread pool (see `pool`): one window (up to
//! `IOV_MAX` transfers) of a same-direction run of a batch, owning all it
//! needs, so that it can run on another thread, later, and outlive the
//! caller's borrows.
//!
//! A job holds clones of the local [`MemHandle`]s (Arc-backed: the memory
//! stays alive while a job that is stuck in the kernel holds it, so it
//! never writes into freed memory; `MemHandle::into_buffers` fails until
//! the job is dropped), clones of the [`RemoteMem`]s, the offsets,
//! lengths and op ids, the peer's pid, and a handle to its pidfd.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use na_core::{MemHandle, OpId, RemoteMem, Rma, RmaDir};

use crate::sys::cma::{transfer_batch, IovLists};
use crate::sys::proc;

/// One transfer of a job; `local` and `remote` index the job's handles.
#[derive(Debug)]
pub(crate) struct JobOp {
    pub op: OpId,
    local: usize,
    local_offset: u64,
    remote: usize,
    remote_offset: u64,
    pub len: u64,
}

/// Transfers to run in one go for one peer (see the module docs).
pub(crate) struct Job {
    /// The job's serial in its pool (never reused): a result is taken
    /// only for ops still recorded under it.
    pub id: u64,
    /// The peer's token.
    pub peer: u64,
    pub pid: u32,
    pub dir: RmaDir,
    locals: Vec<MemHandle>,
    remotes: Vec<RemoteMem>,
    pub ops: Vec<JobOp>,
    /// The peer's pidfd (a duplicate of its connection's), checked just
    /// before the system call; `None` where the kernel gave none.
    pidfd: Option<Arc<OwnedFd>>,
}

/// What a job did: each transfer's outcome (`None`: it moved), and the
/// system calls it made.
pub(crate) struct JobResult {
    pub id: u64,
    pub peer: u64,
    pub pid: u32,
    pub dir: RmaDir,
    pub calls: usize,
    pub outcomes: Vec<(OpId, u64, Option<io::Error>)>,
}

impl Job {
    /// A job of `ops` (one direction, at most `IOV_MAX`), with clones of
    /// their handles (one per run of transfers naming the same handle).
    pub fn new(id: u64, peer: u64, pid: u32, ops: &[Rma<'_>], pidfd: Option<Arc<OwnedFd>>) -> Job {
        let dir = ops.first().map_or(RmaDir::Get, |o| o.dir);
        let mut locals: Vec<MemHandle> = Vec::new();
        let mut remotes: Vec<RemoteMem> = Vec::new();
        let mut last: Option<(*const MemHandle, *const RemoteMem)> = None;
        let mut job_ops = Vec::with_capacity(ops.len());
        for o in ops {
            // Pointers compared only, never dereferenced: the usual batch
            // names one pair of handles throughout, cloned once.
            let (lp, rp) = (o.local as *const MemHandle, o.remote as *const RemoteMem);
            if last.map(|(l, _)| l) != Some(lp) {
                locals.push(o.local.clone());
            }
            if last.map(|(_, r)| r) != Some(rp) {
                remotes.push(o.remote.clone());
            }
            last = Some((lp, rp));
            job_ops.push(JobOp {
                op: o.op,
                local: locals.len() - 1,
                local_offset: o.local_offset,
                remote: remotes.len() - 1,
                remote_offset: o.remote_offset,
                len: o.len,
            });
        }
        Job {
            id,
            peer,
            pid,
            dir,
            locals,
            remotes,
            ops: job_ops,
            pidfd,
        }
    }

    /// Runs the job on this (a transfer) thread: first checks, through its
    /// pidfd, that the peer has not exited (then every transfer fails with
    /// `ESRCH`, as gone, and nothing moves: its pid may name another
    /// process by now), then moves the transfers as the inline path does.
    pub fn run(&self, lists: &mut IovLists) -> JobResult {
        let mut result = JobResult {
            id: self.id,
            peer: self.peer,
            pid: self.pid,
            dir: self.dir,
            calls: 0,
            outcomes: Vec::with_capacity(self.ops.len()),
        };
        let exited = match &self.pidfd {
            Some(fd) => proc::pidfd_exited(fd.as_fd()),
            None => Ok(false),
        };
        let stop = match exited {
            Ok(false) => None,
            Ok(true) => Some(libc::ESRCH),
            // A pidfd that cannot be polled: its process is not known to be
            // the peer's any more; nothing is moved.
            Err(e) => Some(e.raw_os_error().unwrap_or(libc::ESRCH)),
        };
        if let Some(code) = stop {
            for o in &self.ops {
                result
                    .outcomes
                    .push((o.op, o.len, Some(io::Error::from_raw_os_error(code))));
            }
            return result;
        }
        let rmas: Vec<Rma<'_>> = self
            .ops
            .iter()
            .map(|o| Rma {
                dir: self.dir,
                local: &self.locals[o.local],
                local_offset: o.local_offset,
                remote: &self.remotes[o.remote],
                remote_offset: o.remote_offset,
                len: o.len,
                op: o.op,
            })
            .collect();
        let moved = transfer_batch(self.pid, &rmas, lists);
        result.calls = moved.calls;
        let mut failed = moved.failed.into_iter().peekable();
        for (i, o) in self.ops[..moved.ended].iter().enumerate() {
            let e = failed.next_if(|(at, _)| *at == i).map(|(_, e)| e);
            result.outcomes.push((o.op, o.len, e));
        }
        // The process is gone, or we may not access it: the rest fail too.
        if let Some(e) = moved.stop {
            let code = e.raw_os_error();
            let mut first = Some(e);
            for o in &self.ops[moved.ended..] {
                let e = first.take().or_else(|| code.map(io::Error::from_raw_os_error));
                let e = e.unwrap_or_else(|| io::Error::other("transfer failed"));
                result.outcomes.push((o.op, o.len, Some(e)));
            }
        }
        result
    }

    /// Whether the job checks its peer's pidfd before it moves anything
    /// (a test probe counts those: `RmaPoolProbe::pidfd_checked_jobs`).
    pub fn checks_pidfd(&self) -> bool {
        self.pidfd.is_some()
    }

    /// Takes transfer `op` out of a job that has not started (canceled):
    /// true if it was there. Its local handle, if no other transfer of
    /// the job names it, goes to `freed` (for the caller to drop out of
    /// its lock): nothing will write that memory, and
    /// `MemHandle::into_buffers` must not fail for this job's sake.
    pub fn remove(&mut self, op: OpId, freed: &mut Vec<MemHandle>) -> bool {
        let Some(i) = self.ops.iter().position(|o| o.op == op) else {
            return false;
        };
        let gone = self.ops.remove(i);
        if !self.ops.iter().any(|o| o.local == gone.local) && gone.local < self.locals.len() {
            freed.push(self.locals.remove(gone.local));
            for o in &mut self.ops {
                if o.local > gone.local {
                    o.local -= 1;
                }
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use na_core::{Access, RemoteSegment};

    use super::*;

    /// A canceled transfer's handle leaves the job when no other transfer
    /// names it, and the others still name their own handles.
    #[test]
    fn remove_frees_a_handle_no_other_transfer_names() {
        let [a, b, c] = [1, 2, 3].map(|n| MemHandle::zeroed(n * 8, Access::ReadWrite));
        let seg = RemoteSegment {
            addr: 4096,
            len: 64,
            key: 0,
        };
        let remote = RemoteMem::new(vec![seg], Access::ReadWrite).unwrap();
        let get = |m, op| Rma::get(m, 0, &remote, 0, 8, OpId(op));
        let ops = [get(&a, 1), get(&b, 2), get(&c, 3), get(&a, 4)];
        let mut job = Job::new(7, 1, 1, &ops, None);
        let mut freed = Vec::new();
        assert!(!job.remove(OpId(9), &mut freed));
        assert!(job.remove(OpId(2), &mut freed));
        assert_eq!(freed.len(), 1);
        assert!(freed[0].same_as(&b));
        // `a` twice (op 1 and op 4): op 1 gone, op 4 keeps it.
        assert!(job.remove(OpId(1), &mut freed));
        assert_eq!(freed.len(), 2, "op 1's clone of a was only op 1's");
        let named: Vec<(u64, u64)> = job
            .ops
            .iter()
            .map(|o| (o.op.0, job.locals[o.local].size()))
            .collect();
        assert_eq!(named, [(3, 24), (4, 8)]);
        drop((job, freed));
        assert!(b.into_buffers().is_ok());
    }
}
