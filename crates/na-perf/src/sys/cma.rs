//! Cross-memory attach: [process_vm_readv(2)] and `process_vm_writev`, the
//! raw bandwidth floors of the shared-memory plugin's RMA (get and put).
//!
//! [process_vm_readv(2)]: https://man7.org/linux/man-pages/man2/process_vm_readv.2.html

use std::io;
use std::marker::PhantomData;

/// A range of another process's address space. It is never dereferenced
/// here; the kernel checks it against that process's mappings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteRange {
    /// Start address in the other process.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
}

/// Which way a [`CmaCopy`] moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmaDir {
    /// `process_vm_readv`: the remote ranges into the local buffers.
    Read,
    /// `process_vm_writev`: the local buffers into the remote ranges.
    Write,
}

impl CmaDir {
    /// The system call's name, for errors.
    pub fn syscall(self) -> &'static str {
        match self {
            CmaDir::Read => "process_vm_readv",
            CmaDir::Write => "process_vm_writev",
        }
    }
}

/// A prepared cross-memory transfer between the `local` buffers, which it
/// borrows mutably, and the `remote` ranges of one process, in direction
/// `dir`. Building it once keeps allocation out of the timed loop.
pub struct CmaCopy<'a> {
    dir: CmaDir,
    liov: Vec<libc::iovec>,
    riov: Vec<libc::iovec>,
    lwork: Vec<libc::iovec>,
    rwork: Vec<libc::iovec>,
    total: usize,
    _local: PhantomData<&'a mut [u8]>,
}

impl<'a> CmaCopy<'a> {
    /// Prepares the transfer. Both lists must have the same total length and
    /// at most `IOV_MAX` (1024) entries.
    pub fn new(dir: CmaDir, local: &'a mut [&mut [u8]], remote: &[RemoteRange]) -> io::Result<Self> {
        let total: usize = local.iter().map(|b| b.len()).sum();
        let rtotal: usize = remote.iter().map(|r| r.len).sum();
        if total != rtotal || local.len() > 1024 || remote.len() > 1024 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "iovec lists of {} and {} entries, {total} and {rtotal} bytes",
                    local.len(),
                    remote.len()
                ),
            ));
        }
        let liov: Vec<libc::iovec> = local
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        let riov: Vec<libc::iovec> = remote
            .iter()
            .map(|r| libc::iovec {
                iov_base: r.addr as *mut libc::c_void,
                iov_len: r.len,
            })
            .collect();
        let (lwork, rwork) = (liov.clone(), riov.clone());
        Ok(CmaCopy {
            dir,
            liov,
            riov,
            lwork,
            rwork,
            total,
            _local: PhantomData,
        })
    }

    /// Moves everything from or to process `pid`, one system call per round,
    /// continuing after partial transfers. Returns the number of system
    /// calls made.
    pub fn run(&mut self, pid: libc::pid_t) -> io::Result<usize> {
        self.lwork.copy_from_slice(&self.liov);
        self.rwork.copy_from_slice(&self.riov);
        let (mut li, mut ri, mut done, mut calls) = (0usize, 0usize, 0usize, 0usize);
        while done < self.total {
            let (local, local_n) = (
                self.lwork[li..].as_ptr(),
                (self.lwork.len() - li) as libc::c_ulong,
            );
            let (remote, remote_n) = (
                self.rwork[ri..].as_ptr(),
                (self.rwork.len() - ri) as libc::c_ulong,
            );
            let n = match self.dir {
                // SAFETY: lwork[li..] describes memory inside the local
                // buffers, borrowed mutably for 'a by this value, so nothing
                // else accesses them while the kernel writes them; rwork only
                // names the other process's memory, which the kernel
                // validates (EFAULT). Both counts match the slices passed.
                CmaDir::Read => unsafe {
                    na_core::syscall!(process_vm_readv(pid, local, local_n, remote, remote_n, 0))?
                },
                // SAFETY: lwork[li..] describes memory inside the local
                // buffers, borrowed for 'a by this value, which the kernel
                // only reads; rwork only names the other process's memory,
                // which the kernel validates (EFAULT). Both counts match the
                // slices passed.
                CmaDir::Write => unsafe {
                    na_core::syscall!(process_vm_writev(pid, local, local_n, remote, remote_n, 0))?
                },
            } as usize;
            calls += 1;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("{} moved 0 bytes", self.dir.syscall()),
                ));
            }
            done += n;
            advance(&mut self.lwork, &mut li, n);
            advance(&mut self.rwork, &mut ri, n);
        }
        Ok(calls)
    }
}

/// Skips `n` transferred bytes at the front of `iov[*at..]`.
fn advance(iov: &mut [libc::iovec], at: &mut usize, mut n: usize) {
    while n > 0 && *at < iov.len() {
        let v = &mut iov[*at];
        if n >= v.iov_len {
            n -= v.iov_len;
            *at += 1;
        } else {
            v.iov_base = (v.iov_base as usize + n) as *mut libc::c_void;
            v.iov_len -= n;
            n = 0;
        }
    }
    while *at < iov.len() && iov[*at].iov_len == 0 {
        *at += 1;
    }
}
