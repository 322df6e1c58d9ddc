//! RMA: put and get by cross-memory attach, completed inside the call and
//! reported through the completion queue.

use std::io;

use na_core::{Access, Addr, Completion, MemHandle, NaError, OpId, OpKind, RemoteMem, Result};

use crate::plugin::SmPlugin;
use crate::sys::cma::{transfer, Direction};

/// What to change when the kernel refuses cross-memory attach.
pub const EPERM_HINT: &str = "the kernel refused process_vm_readv/writev (EPERM): both processes must run \
     as the same uid, and with Yama's kernel.yama.ptrace_scope >= 1 the target must allow it \
     (na-sm does so unless SmConfig::allow_any_ptracer is false) or the caller needs CAP_SYS_PTRACE; \
     ptrace_scope 3 forbids it entirely (set it to 0 or 1 with sysctl)";

fn denied(what: &'static str, has: Access, needs: &'static str) -> NaError {
    NaError::AccessDenied { what, has, needs }
}

impl SmPlugin {
    /// Checks access and bounds, then moves the bytes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rma(
        &mut self,
        dir: Direction,
        local: &MemHandle,
        local_offset: u64,
        remote: &RemoteMem,
        remote_offset: u64,
        len: u64,
        dest: &Addr,
        op: OpId,
    ) -> Result<()> {
        let (name, kind) = match dir {
            Direction::Write => ("put", OpKind::Put),
            Direction::Read => ("get", OpKind::Get),
        };
        match dir {
            Direction::Write => {
                if !local.access().can_read() {
                    return Err(denied("local", local.access(), "read"));
                }
                if !remote.access().can_write() {
                    return Err(denied("remote", remote.access(), "write"));
                }
            }
            Direction::Read => {
                if !local.access().can_write() {
                    return Err(denied("local", local.access(), "write"));
                }
                if !remote.access().can_read() {
                    return Err(denied("remote", remote.access(), "read"));
                }
            }
        }
        local.check_range(local_offset, len)?;
        remote.check_range(remote_offset, len)?;
        let pid = self
            .peers
            .get(dest.token())
            .map(|p| p.pid)
            .ok_or_else(|| self.gone(dest, "not connected (it disconnected earlier)"))?;
        let c = match transfer(dir, pid, local, local_offset, remote, remote_offset, len) {
            Ok(_) => {
                match dir {
                    Direction::Write => self.stats.put_bytes += len,
                    Direction::Read => self.stats.get_bytes += len,
                }
                Completion::done(op, kind)
            }
            Err(e) => {
                let err = match e.raw_os_error() {
                    Some(libc::ESRCH) => {
                        self.gone(dest, &format!("process {pid} no longer exists ({name} failed)"))
                    }
                    Some(libc::EPERM) => NaError::Rma {
                        op: name,
                        len,
                        peer: dest.uri().into(),
                        source: io::Error::new(e.kind(), EPERM_HINT),
                    },
                    Some(libc::EFAULT) => NaError::Rma {
                        op: name,
                        len,
                        peer: dest.uri().into(),
                        source: io::Error::new(
                            e.kind(),
                            "EFAULT: an address of the remote handle is not mapped in the peer \
                             (stale or forged memory handle)",
                        ),
                    },
                    _ => NaError::Rma {
                        op: name,
                        len,
                        peer: dest.uri().into(),
                        source: e,
                    },
                };
                tracing::debug!(peer = %dest, error = %err, "sm {name} failed");
                Completion::failed(op, kind, err, None)
            }
        };
        self.completions.push_back(c);
        Ok(())
    }
}
