//! Cross-memory attach: [process_vm_readv(2)] and [process_vm_writev(2)]
//! between a local [`MemHandle`] and a peer's [`RemoteMem`].
//!
//! One transfer is one system call per `IOV_MAX` (1024) pieces on either
//! side, whatever the two handles' segmentations; a partial transfer (the
//! kernel stops at a page it cannot access, or at `IOV_MAX`) is continued
//! from where it stopped, and one that makes no progress is an error.
//!
//! [process_vm_readv(2)]: https://man7.org/linux/man-pages/man2/process_vm_readv.2.html
//! [process_vm_writev(2)]: https://man7.org/linux/man-pages/man2/process_vm_writev.2.html

use std::io;

use na_core::{MemHandle, RemoteMem};

/// Most iovecs the kernel accepts per call (`UIO_MAXIOV`).
pub const IOV_MAX: usize = 1024;

/// Which way the bytes go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Remote to local (`get`), with `process_vm_readv`.
    Read,
    /// Local to remote (`put`), with `process_vm_writev`.
    Write,
}

/// Moves `len` bytes between `local` at `local_offset` and `remote` at
/// `remote_offset` in process `pid`. Returns the number of system calls made.
///
/// Fails with `InvalidInput` if a range is out of bounds or the local handle
/// does not allow the access (a `Read` writes local memory), with
/// `UnexpectedEof` if the kernel makes no progress, and with the kernel's
/// error otherwise (`ESRCH`: the process is gone, `EPERM`: not allowed to
/// access it, `EFAULT`: a remote address is not mapped).
pub fn transfer(
    dir: Direction,
    pid: u32,
    local: &MemHandle,
    local_offset: u64,
    remote: &RemoteMem,
    remote_offset: u64,
    len: u64,
) -> io::Result<usize> {
    let invalid = |e: na_core::NaError| io::Error::new(io::ErrorKind::InvalidInput, e.to_string());
    if dir == Direction::Read && !local.access().can_write() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "local handle is read-only",
        ));
    }
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    if len == 0 {
        return Ok(0);
    }
    let mut liov = Vec::new();
    local
        .for_each_piece(local_offset, len, |addr, n| {
            liov.push(libc::iovec {
                iov_base: addr as *mut libc::c_void,
                iov_len: n,
            })
        })
        .map_err(invalid)?;
    let mut riov = Vec::new();
    remote
        .for_each_piece(remote_offset, len, |_, addr, n| {
            riov.push(libc::iovec {
                iov_base: addr as usize as *mut libc::c_void,
                iov_len: n as usize,
            })
        })
        .map_err(invalid)?;
    let (mut li, mut ri) = (0usize, 0usize);
    let mut left = len as usize;
    let mut calls = 0;
    while left > 0 {
        let l = &liov[li..(li + IOV_MAX).min(liov.len())];
        let r = &riov[ri..(ri + IOV_MAX).min(riov.len())];
        // SAFETY: every local iovec describes a piece of `local`, which is
        // borrowed (so alive) for the whole call; its memory is only ever
        // accessed through raw copies (never a Rust reference while writable,
        // and we checked it is writable before letting the kernel write it).
        // Remote iovecs name another process's memory and are validated by
        // the kernel. Both arrays stay alive across the call.
        let n = unsafe {
            match dir {
                Direction::Read => {
                    libc::process_vm_readv(pid, l.as_ptr(), l.len() as _, r.as_ptr(), r.len() as _, 0)
                }
                Direction::Write => {
                    libc::process_vm_writev(pid, l.as_ptr(), l.len() as _, r.as_ptr(), r.len() as _, 0)
                }
            }
        };
        calls += 1;
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("kernel transferred 0 of the remaining {left} bytes"),
            ));
        }
        left -= n.min(left);
        advance(&mut liov, &mut li, n);
        advance(&mut riov, &mut ri, n);
    }
    Ok(calls)
}

/// Consumes `n` bytes from the iovec list starting at `*at`.
fn advance(iov: &mut [libc::iovec], at: &mut usize, mut n: usize) {
    while n > 0 && *at < iov.len() {
        let v = &mut iov[*at];
        if n < v.iov_len {
            v.iov_base = (v.iov_base as usize + n) as *mut libc::c_void;
            v.iov_len -= n;
            return;
        }
        n -= v.iov_len;
        *at += 1;
    }
    while *at < iov.len() && iov[*at].iov_len == 0 {
        *at += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use na_core::{Access, RemoteSegment};

    fn describe(h: &MemHandle) -> RemoteMem {
        let segs = h
            .segments_raw()
            .map(|(a, l)| RemoteSegment {
                addr: a as u64,
                len: l as u64,
                key: 0,
            })
            .collect();
        RemoteMem::new(segs, h.access()).unwrap()
    }

    #[test]
    fn self_transfer_across_many_segments() {
        // 3000 one-byte pieces on one side force splits at IOV_MAX.
        let src = MemHandle::new((0..3000).map(|i| vec![i as u8]).collect(), Access::ReadOnly);
        let dst = MemHandle::zeroed(3100, Access::ReadWrite);
        let remote = describe(&src);
        let calls = transfer(Direction::Read, std::process::id(), &dst, 50, &remote, 0, 3000).unwrap();
        assert!(calls >= 3, "{calls}");
        let v = dst.to_vec();
        assert!((0..3000).all(|i| v[50 + i] == i as u8));
        let ro = MemHandle::zeroed(8, Access::ReadOnly);
        assert!(transfer(Direction::Read, std::process::id(), &ro, 0, &remote, 0, 8).is_err());
        assert!(transfer(Direction::Write, std::process::id(), &dst, 0, &remote, 2999, 2).is_err());
    }
}
