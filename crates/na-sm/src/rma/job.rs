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

    /// Takes transfer `op` out of a job that has not started (canceled):
    /// true if it was there.
    pub fn remove(&mut self, op: OpId) -> bool {
        match self.ops.iter().position(|o| o.op == op) {
            Some(i) => {
                self.ops.remove(i);
                true
            }
            None => false,
        }
    }
}
