//! The plugin's side of the RMA thread pool (`SmConfig::rma_threads` >
//! 0): batches turned into jobs and handed over, results taken into the
//! completion queue by progress, cancels and departed peers.
//!
//! # Pid safety
//! CMA names the peer by pid, and a queued job may run well after the
//! `rma` call (which harvested socket events, so a peer that died before
//! it was failed then). Just before its system call a job polls the
//! peer's pidfd (a duplicate of its connection's, see `identity`): exited
//! means it fails as gone and nothing moves. Where the kernel gave no
//! pidfd (kernels before 5.3, `ExitWatch::EofOnly`, our descriptors ran
//! out) there is a window: a peer that exits after the `rma` call, and
//! whose pid a new process of our uid takes before the job runs, gets the
//! transfer (the inline path has the same window, at most 1 ms wide, see
//! `RMA_EVENTS_FRESH`; here it is as long as the job waits).
//!
//! # Cancel
//! A queued transfer is taken out of its job and completes `Canceled` at
//! once, and the job lets its local handle go unless another of its
//! transfers names it; so does a running one, whose result is dropped
//! when it comes.
//! The local memory of a running transfer may still be written until its
//! system call ends, and `MemHandle::into_buffers` fails until then (the
//! job holds a clone). A peer that departs fails its transfers in the pool
//! (queued or running) as gone, the same way.

use std::os::fd::AsFd;
use std::sync::Arc;

use na_core::hint::cold_path;
use na_core::{Addr, Completion, NaError, OpId, Result, Rma, RmaDir};

use super::job::Job;
use super::pool::{PoolOp, RmaPool};
use crate::matching::OpPlace;
use crate::plugin::{SmPlugin, POOL_TOKEN, SIDE_RMA_POOL};
use crate::sys::cma::IOV_MAX;
use crate::sys::eventfd::EventFd;

impl SmPlugin {
    /// Hands a checked batch for `dest` (process `pid`, not ours) to the
    /// transfer threads: one job per `IOV_MAX` window of each
    /// same-direction run. Returns at once; refused whole (nothing
    /// started) if the peer's queue is full.
    #[cold]
    #[inline(never)]
    pub(crate) fn rma_offload(&mut self, dest: &Addr, pid: u32, ops: &[Rma<'_>]) -> Result<()> {
        if ops.is_empty() {
            // Nothing to move (as inline): no pool, no job, no count.
            return Ok(());
        }
        let tok = dest.token();
        let pidfd = self.peer_pidfd_for_jobs(tok);
        let pool = self.rma_pool()?;
        // Built in the pool's kept list (no allocation of a list per batch).
        let mut jobs = pool.take_scratch();
        let mut rest = ops;
        while let Some(first) = rest.first() {
            let run = rest.iter().take_while(|o| o.dir == first.dir).count();
            for window in rest[..run].chunks(IOV_MAX) {
                let id = pool.next_job_id();
                jobs.push(Job::new(id, tok, pid, window, pidfd.clone()));
            }
            rest = &rest[run..];
        }
        // Recorded before any job can run (a result is taken only for ops
        // recorded under its job), taken back if the pool refuses them.
        for j in &jobs {
            for o in &j.ops {
                let place = PoolOp {
                    job: j.id,
                    dir: j.dir,
                    peer: tok,
                };
                pool.ops.insert(o.op, place);
            }
        }
        let submitted = pool.submit(tok, &mut jobs);
        // A refused batch's jobs (and their handles) go here, out of the
        // pool's lock.
        pool.put_scratch(jobs);
        if let Err(e) = submitted {
            for o in ops {
                pool.ops.remove(&o.op);
            }
            return Err(e);
        }
        for o in ops {
            self.ops.insert(o.op, OpPlace::Rma(tok));
        }
        self.stats.rma_offloaded += 1;
        Ok(())
    }

    /// The pool, made on first use: its wake-up eventfd joins our epoll
    /// set.
    pub(crate) fn rma_pool(&mut self) -> Result<&mut RmaPool> {
        let pool = match self.rma_pool.take() {
            Some(p) => p,
            None => {
                let wake = EventFd::new().map_err(|e| NaError::sys("eventfd (sm RMA threads)", e))?;
                self.poll
                    .add_edge_triggered(wake.as_fd(), POOL_TOKEN)
                    .map_err(|e| NaError::sys("epoll_ctl add (sm RMA threads)", e))?;
                // It starts readable (see `EventFd::new`): the set reports
                // it once, for nothing (see `wake_primed`).
                self.wake_primed = true;
                // From now on progress looks for results (`side_turn`).
                self.side_work |= SIDE_RMA_POOL;
                Box::new(RmaPool::new(self.rma_threads, wake))
            }
        };
        Ok(&mut **self.rma_pool.insert(pool))
    }

    /// A handle to peer `tok`'s pidfd for its jobs (duplicated once, from
    /// the first of its connections that has one). Only a pidfd is kept:
    /// a peer with none yet (its connections had none, or the duplicate
    /// failed) is looked at again for its next batch, so one that gains a
    /// pidfd through a later connection has its later jobs checked.
    fn peer_pidfd_for_jobs(&mut self, tok: u64) -> Option<Arc<std::os::fd::OwnedFd>> {
        if let Some(fd) = self.rma_pool.as_ref().and_then(|p| p.pidfds.get(&tok)) {
            return Some(fd.clone());
        }
        let pool = self.rma_pool.as_ref();
        let fd = self
            .peers
            .get(tok)
            .and_then(|p| p.conns.iter().find_map(|c| c.pidfd.as_ref()))
            .and_then(|fd| match pool.map_or_else(|| fd.try_clone(), |pool| pool.dup_pidfd(fd)) {
                Ok(fd) => Some(Arc::new(fd)),
                Err(e) => {
                    tracing::debug!(error = %na_core::ErrorChain(&e), "sm: no pidfd duplicate for RMA jobs; their pid is not checked");
                    None
                }
            })?;
        if let Some(pool) = self.rma_pool.as_mut() {
            pool.pidfds.insert(tok, fd.clone());
        }
        Some(fd)
    }

    /// Takes the transfer threads' results into the completion queue (each
    /// transfer still recorded under its job; canceled ones are dropped),
    /// with their bytes, calls and errors counted as the inline path does.
    #[cold]
    #[inline(never)]
    pub(crate) fn take_rma_results(&mut self) {
        let Some(pool) = self.rma_pool.as_mut() else {
            return;
        };
        let mut results = pool.take_done();
        for r in results.drain(..) {
            self.stats.rma_calls += r.calls as u64;
            let dest = self.peers.get(r.peer).map(|p| p.addr.clone());
            let mut bytes = 0u64;
            for (op, len, e) in r.outcomes {
                let Some(pool) = self.rma_pool.as_mut() else {
                    return;
                };
                match pool.ops.get(&op) {
                    Some(p) if p.job == r.id => {
                        pool.ops.remove(&op);
                        self.ops.remove(&op);
                    }
                    // Canceled, or failed with its peer: completed already.
                    _ => continue,
                }
                let c = match (e, &dest) {
                    (None, _) => {
                        bytes += len;
                        Completion::done(op, r.dir.kind())
                    }
                    (Some(e), Some(dest)) => {
                        let err = self.rma_error(e, r.dir, len, r.pid, dest);
                        tracing::debug!(peer = %dest, error = %na_core::ErrorChain(&err), "sm {} failed", r.dir.name());
                        Completion::failed(op, r.dir.kind(), err, None)
                    }
                    (Some(e), None) => {
                        cold_path();
                        let err = NaError::PeerGone {
                            peer: format!("sm peer of process {}", r.pid),
                            reason: format!("disconnected ({} failed: {e})", r.dir.name()),
                        };
                        Completion::failed(op, r.dir.kind(), err, None)
                    }
                };
                self.completions.push_back(c);
            }
            match r.dir {
                RmaDir::Put => self.stats.put_bytes += bytes,
                RmaDir::Get => self.stats.get_bytes += bytes,
            }
        }
        // The emptied list goes back for the next results.
        if let Some(pool) = self.rma_pool.as_mut() {
            pool.put_done(results);
        }
    }

    /// Cancels a transfer handed to the pool (see the module docs): its
    /// completion.
    pub(crate) fn cancel_rma(&mut self, op: OpId) -> Result<Completion> {
        let dir = self.rma_pool.as_mut().and_then(|p| p.cancel(op));
        match dir {
            Some(dir) => Ok(Completion::failed(op, dir.kind(), NaError::Canceled, None)),
            None => Err(NaError::UnknownOp(op.0)),
        }
    }

    /// Peer `tok` went: fails its transfers in the pool with `err()`.
    pub(crate) fn fail_peer_rma(&mut self, tok: u64, err: &dyn Fn() -> NaError) {
        let Some(pool) = self.rma_pool.as_mut() else {
            return;
        };
        for (op, dir) in pool.peer_gone(tok) {
            self.ops.remove(&op);
            self.completions
                .push_back(Completion::failed(op, dir.kind(), err(), None));
        }
    }
}
