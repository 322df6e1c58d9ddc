//! RMA: batches of puts and gets by cross-memory attach, completed inside
//! the call and reported through the completion queue; or, with
//! `SmConfig::rma_threads` > 0, handed to transfer threads (`pool`, `job`)
//! whose results progress takes (`offload`).

mod hooks;
mod job;
mod offload;
mod pool;

pub(crate) use pool::RmaPool;
#[cfg(feature = "test-hooks")]
pub use pool::{RmaPoolHold, RmaPoolProbe};

use std::io;

use na_core::rma::check_batch;
use na_core::{Addr, Completion, NaError, PluginStats, Result, Rma, RmaDir};

use crate::exposed;
use crate::plugin::SmPlugin;
use crate::send_ops::{dup, op_in_flight};
use crate::sys::cma::{transfer_batch, IOV_MAX};

/// What to change when the kernel refuses cross-memory attach.
pub const EPERM_HINT: &str = "the kernel refused process_vm_readv/writev (EPERM): both processes must run \
     as the same uid, and with Yama's kernel.yama.ptrace_scope >= 1 the target must allow it \
     (na-sm does so unless SmConfig::allow_any_ptracer is false) or the caller needs CAP_SYS_PTRACE; \
     ptrace_scope 3 forbids it entirely (set it to 0 or 1 with sysctl)";

/// How recently socket events must have been read before an RMA trusts
/// that the peer's pid is still its own.
const RMA_EVENTS_FRESH: std::time::Duration = std::time::Duration::from_millis(1);

impl SmPlugin {
    /// Checks the whole batch and the peer, then moves each run of
    /// same-direction transfers with one system call (per `IOV_MAX` pieces).
    pub(crate) fn rma_batch(&mut self, dest: &Addr, ops: &[Rma<'_>]) -> Result<()> {
        check_batch(ops)?;
        // Each transfer completes under its id: none may name one in flight.
        if let Some(o) = ops.iter().find(|o| op_in_flight(&self.ops, &self.matcher, o.op)) {
            return Err(dup(o.op));
        }
        // CMA names the peer by pid. A peer that died is noticed through
        // its socket's end-of-file; after a long gap without progress,
        // harvest that first, so a dead peer's pid (which the kernel may
        // since have given to another process of ours) is never used.
        if self.events_at.elapsed() > RMA_EVENTS_FRESH {
            let owner_sleeps = self.armed;
            self.poll_events()?;
            // The harvest took events (a peer's wake-up, a hang-up) that
            // the owner, asleep on our fd, will not be told of again.
            if owner_sleeps {
                self.wake_owner();
            }
        }
        let pid = self
            .peers
            .get(dest.token())
            .map(|p| p.pid)
            .ok_or_else(|| self.gone(dest, "not connected (it disconnected earlier)"))?;
        // Our own process (our address, or another sm instance of this
        // process): checked against what is exposed, and the check holds
        // until the transfers end (see `exposed`).
        // Those transfers stay on this thread: the check must hold until
        // they end, and the memory is our own.
        let _exposed = if pid == self.name.pid {
            Some(check_self_rma(&mut self.stats, dest, ops)?)
        } else {
            if self.rma_threads > 0 {
                return self.rma_offload(dest, pid, ops);
            }
            None
        };
        // Only for a subscriber that wants it: tracing's `log` feature would
        // otherwise format the disabled span on every batch.
        let _span = tracing::level_enabled!(tracing::Level::TRACE)
            .then(|| tracing::trace_span!("sm rma", peer = %dest, ops = ops.len()).entered());
        let mut rest = ops;
        while let Some(first) = rest.first() {
            let run = rest.iter().take_while(|o| o.dir == first.dir).count();
            // Windows of IOV_MAX transfers: what one listing holds (a
            // failure in it costs a call, never a new listing).
            for window in rest[..run].chunks(IOV_MAX) {
                self.rma_run(pid, dest, window);
            }
            rest = &rest[run..];
        }
        Ok(())
    }

    /// Moves a run of transfers in one direction; each completes, and one
    /// that fails does not hold back the others.
    fn rma_run(&mut self, pid: u32, dest: &Addr, ops: &[Rma<'_>]) {
        let dir = ops[0].dir;
        let moved = transfer_batch(pid, ops, &mut self.iov_lists);
        self.stats.rma_calls += moved.calls as u64;
        let mut failed = moved.failed.into_iter().peekable();
        let mut bytes = 0u64;
        for (i, o) in ops[..moved.ended].iter().enumerate() {
            match failed.next_if(|(at, _)| *at == i) {
                Some((_, e)) => self.fail_rma(e, o, pid, dest),
                None => {
                    bytes += o.len;
                    self.completions.push_back(Completion::done(o.op, dir.kind()));
                }
            }
        }
        match dir {
            RmaDir::Put => self.stats.put_bytes += bytes,
            RmaDir::Get => self.stats.get_bytes += bytes,
        }
        // The process is gone, or we may not access it: the rest fail too.
        if let Some(e) = moved.stop {
            let code = e.raw_os_error();
            let mut first = Some(e);
            for o in &ops[moved.ended..] {
                let e = first.take().or_else(|| code.map(io::Error::from_raw_os_error));
                let e = e.unwrap_or_else(|| io::Error::other("transfer failed"));
                self.fail_rma(e, o, pid, dest);
            }
        }
    }

    /// Completes `o` with the error `e` stands for.
    fn fail_rma(&mut self, e: io::Error, o: &Rma<'_>, pid: u32, dest: &Addr) {
        let err = self.rma_error(e, o.dir, o.len, pid, dest);
        tracing::debug!(peer = %dest, error = %na_core::ErrorChain(&err), "sm {} failed", o.dir.name());
        self.completions
            .push_back(Completion::failed(o.op, o.dir.kind(), err, None));
    }

    /// The error a failed transfer completes with.
    pub(crate) fn rma_error(&self, e: io::Error, dir: RmaDir, len: u64, pid: u32, dest: &Addr) -> NaError {
        let op = dir.name();
        let rma = |source| NaError::Rma {
            op,
            len,
            peer: dest.uri().into(),
            source,
        };
        match e.raw_os_error() {
            Some(libc::ESRCH) => self.gone(dest, &format!("process {pid} no longer exists ({op} failed)")),
            Some(libc::EPERM) => rma(io::Error::new(e.kind(), EPERM_HINT)),
            Some(libc::EFAULT) => rma(io::Error::new(
                e.kind(),
                "EFAULT: an address of the remote handle is not mapped in the peer \
                 (stale or forged memory handle)",
            )),
            _ => rma(e),
        }
    }
}

/// A transfer to our own process reaches any address of it (the kernel
/// checks nothing): each piece of the remote side must lie in a segment a
/// live handle registered with sm exposes, with the access the transfer
/// needs, through that registration's own descriptor (its token as the
/// segment's key; see `exposed`). A remote handle that names our process but not
/// such memory is forged or stale: refused, counted in `stats`
/// (`PluginStats::self_rma_refused`) and logged as a warning at the 1st,
/// 2nd, 4th... refusal, the others at debug level (a hostile server that
/// answers every call with a forged handle cannot flood the log). On
/// success the exposed set stays locked for the caller to hold across the
/// transfers.
#[cold]
#[inline(never)]
fn check_self_rma(stats: &mut PluginStats, dest: &Addr, ops: &[Rma<'_>]) -> Result<exposed::Exposed> {
    let set = exposed::lock();
    for o in ops {
        let write = o.dir == RmaDir::Put;
        let mut ok = true;
        o.remote
            .for_each_piece(o.remote_offset, o.len, |seg, addr, len| {
                // (Nothing looked up past the first piece refused.)
                ok = ok && set.covers(addr, len, write, seg.key);
            })?;
        if !ok {
            const WHAT: &str = "sm: refused a transfer to this process outside the memory it exposes \
                                (forged or stale handle; warned at the 1st, 2nd, 4th... of them, all counted \
                                in PluginStats::self_rma_refused)";
            let warn = stats.refuse_self_rma();
            let refused = stats.self_rma_refused;
            if warn {
                tracing::warn!(op = o.dir.name(), len = o.len, refused, "{WHAT}");
            } else {
                tracing::debug!(op = o.dir.name(), len = o.len, refused, "{WHAT}");
            }
            return Err(NaError::Rma {
                op: o.dir.name(),
                len: o.len,
                peer: dest.uri().into(),
                source: io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "the remote handle names this process but memory no live handle \
                     registered with sm exposes (forged or stale handle); nothing moved",
                ),
            });
        }
    }
    Ok(set)
}
