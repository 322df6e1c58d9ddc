//! Cross-memory attach: [process_vm_readv(2)] and [process_vm_writev(2)]
//! between a local [`na_core::MemHandle`] and a peer's [`na_core::RemoteMem`].
//!
//! A batch of transfers in one direction is one system call per `IOV_MAX`
//! (1024) pieces on either side, whatever the handles' segmentations: the
//! pieces of all transfers are listed in order on both sides (pieces that
//! touch in memory are merged), so the two byte streams line up transfer
//! by transfer. A partial transfer (the kernel stops at a page it cannot
//! access, or at `IOV_MAX`) is continued from where it stopped; the caller
//! learns how many bytes moved before an error, and so which transfer
//! failed.
//!
//! [process_vm_readv(2)]: https://man7.org/linux/man-pages/man2/process_vm_readv.2.html
//! [process_vm_writev(2)]: https://man7.org/linux/man-pages/man2/process_vm_writev.2.html

use std::io;

use na_core::{Rma, RmaDir};

/// Most iovecs the kernel accepts per call (`UIO_MAXIOV`).
pub const IOV_MAX: usize = 1024;

/// What a batch did: bytes moved (from the start of the batch, in order)
/// and the system calls made, then the error that stopped it, if any.
#[derive(Debug)]
pub struct Moved {
    /// Bytes moved before the batch finished or failed.
    pub bytes: u64,
    /// System calls made.
    pub calls: usize,
    /// Why the batch stopped short: `InvalidInput` if a range is out of
    /// bounds or the local handle does not allow the access (a `Read`
    /// writes local memory), `UnexpectedEof` if the kernel makes no
    /// progress, the kernel's error otherwise (`ESRCH`: the process is
    /// gone, `EPERM`: not allowed to access it, `EFAULT`: a remote address
    /// is not mapped).
    pub error: Option<io::Error>,
}

/// The iovec lists [`transfer_batch`] builds, kept between calls so that
/// their capacity stays: a steady stream of transfers allocates nothing
/// (growing two lists per transfer cost more than the rest of a 16-segment
/// transfer's bookkeeping).
#[derive(Default)]
pub struct IovLists {
    local: Vec<libc::iovec>,
    remote: Vec<libc::iovec>,
}

// SAFETY: the lists hold addresses only while `transfer_batch` runs (it
// clears them before it returns); between calls they are empty vectors of
// plain data, and the addresses they held were never dereferenced by us,
// only passed to the kernel. Moving them to another thread moves nothing
// that anyone can reach through.
unsafe impl Send for IovLists {}

/// Appends a piece to an iovec list, merging it into the last one when they
/// touch.
fn push(iov: &mut Vec<libc::iovec>, addr: usize, len: usize) {
    if len == 0 {
        return;
    }
    if let Some(last) = iov.last_mut() {
        if last.iov_base as usize + last.iov_len == addr {
            last.iov_len += len;
            return;
        }
    }
    iov.push(libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    });
}

/// Moves the transfers of `batch`, in order, between this process and
/// process `pid`, with as few system calls as `IOV_MAX` allows. They all go
/// the way the first one does; one that goes the other way stops the batch
/// (`InvalidInput`), as a range out of bounds does.
pub fn transfer_batch(pid: u32, batch: &[Rma<'_>], lists: &mut IovLists) -> Moved {
    let moved = transfer_listed(pid, batch, &mut lists.local, &mut lists.remote);
    lists.local.clear();
    lists.remote.clear();
    moved
}

fn transfer_listed(
    pid: u32,
    batch: &[Rma<'_>],
    liov: &mut Vec<libc::iovec>,
    riov: &mut Vec<libc::iovec>,
) -> Moved {
    let mut moved = Moved {
        bytes: 0,
        calls: 0,
        error: None,
    };
    let invalid = |e: na_core::NaError| io::Error::new(io::ErrorKind::InvalidInput, e.to_string());
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        moved.error = Some(io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"));
        return moved;
    };
    let Some(dir) = batch.first().map(|p| p.dir) else {
        return moved;
    };
    liov.clear();
    riov.clear();
    let mut total = 0u64;
    for p in batch {
        let refused = if p.dir != dir {
            Some("a batch goes one way only")
        } else if dir == RmaDir::Get && !p.local.access().can_write() {
            Some("local handle is read-only")
        } else {
            None
        };
        if let Some(why) = refused {
            moved.error = Some(io::Error::new(io::ErrorKind::InvalidInput, why));
            break;
        }
        let listed = p
            .local
            .for_each_piece(p.local_offset, p.len, |a, n| push(liov, a, n))
            .and_then(|()| {
                p.remote.for_each_piece(p.remote_offset, p.len, |_, a, n| {
                    push(riov, a as usize, n as usize)
                })
            });
        if let Err(e) = listed {
            moved.error = Some(invalid(e));
            break;
        }
        total += p.len;
    }
    // Pieces of a transfer that failed its checks were listed on one side
    // only: move what came before it, then report the error.
    let stop = moved.error.take();
    if stop.is_some() {
        truncate(liov, total);
        truncate(riov, total);
    }
    let (mut li, mut ri) = (0usize, 0usize);
    while moved.bytes < total {
        let l = &liov[li..(li + IOV_MAX).min(liov.len())];
        let r = &riov[ri..(ri + IOV_MAX).min(riov.len())];
        // SAFETY: every local iovec describes a piece of a handle in
        // `batch`, borrowed (so alive) for the whole call; handle memory is
        // only ever accessed through raw copies (never a Rust reference
        // while writable), and we checked each handle is writable before
        // letting the kernel write it. Remote iovecs name another
        // process's memory and are validated by the kernel. Both arrays
        // stay alive across the call.
        let n = unsafe {
            match dir {
                RmaDir::Get => {
                    libc::process_vm_readv(pid, l.as_ptr(), l.len() as _, r.as_ptr(), r.len() as _, 0)
                }
                RmaDir::Put => {
                    libc::process_vm_writev(pid, l.as_ptr(), l.len() as _, r.as_ptr(), r.len() as _, 0)
                }
            }
        };
        moved.calls += 1;
        if n < 0 {
            moved.error = Some(io::Error::last_os_error());
            return moved;
        }
        let n = n as usize;
        if n == 0 {
            moved.error = Some(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "kernel transferred 0 of the remaining {} bytes",
                    total - moved.bytes
                ),
            ));
            return moved;
        }
        moved.bytes += (n as u64).min(total - moved.bytes);
        advance(liov, &mut li, n);
        advance(riov, &mut ri, n);
    }
    moved.error = stop;
    moved
}

/// Cuts an iovec list down to its first `len` bytes.
fn truncate(iov: &mut Vec<libc::iovec>, len: u64) {
    let mut left = len as usize;
    let mut keep = 0;
    for v in iov.iter_mut() {
        if left == 0 {
            break;
        }
        v.iov_len = v.iov_len.min(left);
        left -= v.iov_len;
        keep += 1;
    }
    iov.truncate(keep);
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
    use na_core::{Access, MemHandle, OpId, RemoteMem, RemoteSegment};

    const ME: fn() -> u32 = std::process::id;

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
        let m = transfer_batch(
            ME(),
            &[Rma::get(&dst, 50, &remote, 0, 3000, OpId(1))],
            &mut IovLists::default(),
        );
        assert!(m.error.is_none(), "{m:?}");
        assert_eq!(m.bytes, 3000);
        assert!(m.calls >= 3, "{m:?}");
        let v = dst.to_vec();
        assert!((0..3000).all(|i| v[50 + i] == i as u8));
        let ro = MemHandle::zeroed(8, Access::ReadOnly);
        let m = transfer_batch(
            ME(),
            &[Rma::get(&ro, 0, &remote, 0, 8, OpId(1))],
            &mut IovLists::default(),
        );
        assert!(m.error.is_some());
        let m = transfer_batch(
            ME(),
            &[Rma::put(&dst, 0, &remote, 2999, 2, OpId(1))],
            &mut IovLists::default(),
        );
        assert_eq!(
            (m.bytes, m.error.map(|e| e.kind())),
            (0, Some(io::ErrorKind::InvalidInput))
        );
    }

    #[test]
    fn batch_is_one_call_and_stops_at_the_failing_transfer() {
        let src = MemHandle::new(
            vec![(0..=255u8).cycle().take(64 * 1024).collect()],
            Access::ReadOnly,
        );
        let dst = MemHandle::zeroed(64 * 1024, Access::ReadWrite);
        let remote = describe(&src);
        // 16 transfers of 4 KiB, written in reverse order of their sources.
        let batch: Vec<Rma> = (0..16u64)
            .map(|i| Rma::get(&dst, i * 4096, &remote, (15 - i) * 4096, 4096, OpId(i)))
            .collect();
        let m = transfer_batch(ME(), &batch, &mut IovLists::default());
        assert!(m.error.is_none(), "{m:?}");
        assert_eq!((m.bytes, m.calls), (16 * 4096, 1));
        let (s, d) = (src.to_vec(), dst.to_vec());
        for i in 0..16 {
            assert_eq!(
                d[i * 4096..][..4096],
                s[(15 - i) * 4096..][..4096],
                "transfer {i}"
            );
        }
        // A remote range that is not mapped (address 4096 is below
        // vm.mmap_min_addr, so never mapped) stops the batch at its transfer.
        let hole = RemoteMem::new(
            vec![RemoteSegment {
                addr: 4096,
                len: 4096,
                key: 0,
            }],
            Access::ReadOnly,
        )
        .unwrap();
        let mut bad = batch.clone();
        bad[5].remote = &hole;
        bad[5].remote_offset = 0;
        let m = transfer_batch(ME(), &bad, &mut IovLists::default());
        assert_eq!(m.bytes, 5 * 4096, "{m:?}");
        assert_eq!(m.error.and_then(|e| e.raw_os_error()), Some(libc::EFAULT));
        // A transfer that fails its own checks moves the ones before it.
        let mut oob = batch.clone();
        oob[3].len = 1 << 20;
        let m = transfer_batch(ME(), &oob, &mut IovLists::default());
        assert_eq!(m.bytes, 3 * 4096, "{m:?}");
        assert_eq!(m.error.map(|e| e.kind()), Some(io::ErrorKind::InvalidInput));
        // So does one that goes the other way.
        let mut mixed = batch.clone();
        mixed[7].dir = RmaDir::Put;
        let m = transfer_batch(ME(), &mixed, &mut IovLists::default());
        assert_eq!(m.bytes, 7 * 4096, "{m:?}");
        assert_eq!(m.error.map(|e| e.kind()), Some(io::ErrorKind::InvalidInput));
    }
}
