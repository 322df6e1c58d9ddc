//! Cross-memory attach: [process_vm_readv(2)] and [process_vm_writev(2)]
//! between a local [`na_core::MemHandle`] and a peer's [`na_core::RemoteMem`].
//!
//! A batch of transfers in one direction is one system call per `IOV_MAX`
//! (1024) pieces on either side, whatever the handles' segmentations: the
//! pieces of all transfers are listed in order on both sides (pieces that
//! touch in memory are merged), so the two byte streams line up transfer
//! by transfer. A partial transfer (the kernel stops at a page it cannot
//! access, or at `IOV_MAX`) is continued from where it stopped; a
//! transfer the kernel refuses (an unmapped remote page) is stepped over
//! in the lists and fails alone, and the caller learns which transfers
//! failed and why.
//!
//! [process_vm_readv(2)]: https://man7.org/linux/man-pages/man2/process_vm_readv.2.html
//! [process_vm_writev(2)]: https://man7.org/linux/man-pages/man2/process_vm_writev.2.html

use std::io;

use na_core::{Rma, RmaDir};

/// Most iovecs the kernel accepts per call (`UIO_MAXIOV`).
pub const IOV_MAX: usize = 1024;

/// What a batch did. Transfers `..ended` ended: each completed, unless it
/// is in `failed`; the ones from `ended` on did not run, because `stop`
/// (the process is gone, or we may not access it) fails them all.
#[derive(Debug)]
pub struct Moved {
    /// System calls made.
    pub calls: usize,
    /// How many transfers, from the start of the batch, ended.
    pub ended: usize,
    /// The transfers (by index, ascending) among those that ended which
    /// failed, and why: `InvalidInput` if a range is out of bounds, the
    /// local handle does not allow the access (a get writes local memory)
    /// or the transfer goes the other way than the first; `UnexpectedEof`
    /// if the kernel made no progress on it; the kernel's error otherwise
    /// (`EFAULT`: a remote address is not mapped). The others moved on.
    pub failed: Vec<(usize, io::Error)>,
    /// `ESRCH` (the process is gone) or `EPERM` (not allowed to access
    /// it): nothing from transfer `ended` on can succeed.
    pub stop: Option<io::Error>,
}

/// The iovec lists [`transfer_batch`] builds, kept between calls so that
/// their capacity stays: a steady stream of transfers allocates nothing
/// (growing two lists per transfer cost more than the rest of a 16-segment
/// transfer's bookkeeping).
#[derive(Default)]
pub struct IovLists {
    local: Vec<libc::iovec>,
    remote: Vec<libc::iovec>,
    /// Bytes listed for each transfer (0 for one that failed its checks).
    listed: Vec<u64>,
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
    #[cfg(test)]
    tests::PUSHED.with(|p| p.set(p.get() + 1));
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

/// Where an iovec list ends (its length and its last entry's length), to
/// take back what one transfer listed.
fn mark(iov: &[libc::iovec]) -> (usize, usize) {
    (iov.len(), iov.last().map_or(0, |v| v.iov_len))
}

fn rewind(iov: &mut Vec<libc::iovec>, (len, last_len): (usize, usize)) {
    iov.truncate(len);
    if let Some(last) = iov.last_mut() {
        last.iov_len = last_len;
    }
}

/// Moves the transfers of `batch`, in order, between this process and
/// process `pid`, with as few system calls as `IOV_MAX` allows. They all go
/// the way the first one does; one that goes the other way fails, as one
/// out of bounds does, and the others go on.
///
/// Everything is listed once: a transfer that fails in the kernel (an
/// unmapped remote page) is stepped over in the lists and the next call
/// starts at the transfer after it, so a batch of failing transfers costs
/// a call each, not a new listing of everything after each failure.
pub fn transfer_batch(pid: u32, batch: &[Rma<'_>], lists: &mut IovLists) -> Moved {
    let moved = transfer_listed(pid, batch, lists);
    lists.local.clear();
    lists.remote.clear();
    lists.listed.clear();
    // A batch over a peer's handle of many small segments may have listed
    // far more than a steady stream needs: do not keep that memory.
    lists.local.shrink_to(KEPT_ENTRIES);
    lists.remote.shrink_to(KEPT_ENTRIES);
    lists.listed.shrink_to(KEPT_ENTRIES);
    moved
}

/// Entries each list keeps between batches (64 KiB of iovecs).
const KEPT_ENTRIES: usize = 4 * IOV_MAX;

/// Lists every transfer's pieces on both sides; the ones that fail their
/// checks are listed as nothing and recorded in `failed`.
fn list(batch: &[Rma<'_>], lists: &mut IovLists, failed: &mut Vec<(usize, io::Error)>) -> u64 {
    let IovLists {
        local,
        remote,
        listed,
    } = lists;
    local.clear();
    remote.clear();
    listed.clear();
    let Some(dir) = batch.first().map(|p| p.dir) else {
        return 0;
    };
    let mut total = 0u64;
    for (i, p) in batch.iter().enumerate() {
        let refused = if p.dir != dir {
            Some("a batch goes one way only".to_string())
        } else if dir == RmaDir::Get && !p.local.access().can_write() {
            Some("local handle is read-only".to_string())
        } else {
            None
        };
        let (lmark, rmark) = (mark(local), mark(remote));
        let listed_ok = match refused {
            Some(why) => Err(why),
            None => p
                .local
                .for_each_piece(p.local_offset, p.len, |a, n| push(local, a, n))
                .and_then(|()| {
                    p.remote.for_each_piece(p.remote_offset, p.len, |_, a, n| {
                        push(remote, a as usize, n as usize)
                    })
                })
                .map_err(|e| na_core::ErrorChain(&e).to_string()),
        };
        match listed_ok {
            Ok(()) => {
                listed.push(p.len);
                total += p.len;
            }
            Err(why) => {
                // Listed on one side only, or partly: take it all back.
                rewind(local, lmark);
                rewind(remote, rmark);
                listed.push(0);
                failed.push((i, io::Error::new(io::ErrorKind::InvalidInput, why)));
            }
        }
    }
    total
}

fn transfer_listed(pid: u32, batch: &[Rma<'_>], lists: &mut IovLists) -> Moved {
    let mut moved = Moved {
        calls: 0,
        ended: 0,
        failed: Vec::new(),
        stop: None,
    };
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        moved.stop = Some(io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"));
        return moved;
    };
    let Some(dir) = batch.first().map(|p| p.dir) else {
        return moved;
    };
    let total = list(batch, lists, &mut moved.failed);
    let IovLists {
        local: liov,
        remote: riov,
        listed,
    } = lists;
    // `pos`: bytes of the lists consumed (moved, or stepped over with a
    // failed transfer); transfer `at` is the one `pos` is in, and ends at
    // byte `at_end` of the lists.
    let (mut li, mut ri, mut pos) = (0usize, 0usize, 0u64);
    let (mut at, mut at_end) = (0usize, listed.first().copied().unwrap_or(0));
    let mut kernel_failed = Vec::new();
    while pos < total {
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
        let step = if n > 0 {
            (n as u64).min(total - pos)
        } else {
            let e = if n < 0 {
                io::Error::last_os_error()
            } else {
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("kernel transferred 0 of the remaining {} bytes", total - pos),
                )
            };
            // The transfer `pos` is in failed (skip those that end at or
            // before it: empty, or refused in the listing).
            while at_end <= pos {
                at += 1;
                at_end += listed[at];
            }
            if matches!(e.raw_os_error(), Some(libc::ESRCH | libc::EPERM)) {
                moved.stop = Some(e);
                moved.ended = at;
                merge(&mut moved.failed, kernel_failed);
                return moved;
            }
            kernel_failed.push((at, e));
            at_end - pos
        };
        pos += step;
        advance(liov, &mut li, step as usize);
        advance(riov, &mut ri, step as usize);
    }
    moved.ended = batch.len();
    merge(&mut moved.failed, kernel_failed);
    moved
}

/// Adds the kernel's failures to the listing's, in transfer order.
fn merge(failed: &mut Vec<(usize, io::Error)>, kernel: Vec<(usize, io::Error)>) {
    if !kernel.is_empty() {
        failed.extend(kernel);
        failed.sort_by_key(|&(i, _)| i);
    }
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
        RemoteMem::of_handle(h, 0).unwrap()
    }

    thread_local! {
        /// Pieces listed by this thread (see `push`).
        pub(super) static PUSHED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// The indexes and error kinds of a batch's failed transfers.
    fn failures(m: &Moved) -> Vec<(usize, Option<i32>, io::ErrorKind)> {
        m.failed
            .iter()
            .map(|(i, e)| (*i, e.raw_os_error(), e.kind()))
            .collect()
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
        assert!(m.failed.is_empty() && m.stop.is_none(), "{m:?}");
        assert_eq!(m.ended, 1);
        assert!(m.calls >= 3, "{m:?}");
        let v = dst.to_vec();
        assert!((0..3000).all(|i| v[50 + i] == i as u8));
        let ro = MemHandle::zeroed(8, Access::ReadOnly);
        let m = transfer_batch(
            ME(),
            &[Rma::get(&ro, 0, &remote, 0, 8, OpId(1))],
            &mut IovLists::default(),
        );
        assert_eq!(failures(&m), [(0, None, io::ErrorKind::InvalidInput)]);
        let m = transfer_batch(
            ME(),
            &[Rma::put(&dst, 0, &remote, 2999, 2, OpId(1))],
            &mut IovLists::default(),
        );
        assert_eq!(
            (m.calls, failures(&m)),
            (0, vec![(0, None, io::ErrorKind::InvalidInput)])
        );
    }

    #[test]
    fn batch_is_one_call_and_a_failing_transfer_fails_alone() {
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
        assert!(m.failed.is_empty() && m.stop.is_none(), "{m:?}");
        assert_eq!((m.ended, m.calls), (16, 1));
        let (s, d) = (src.to_vec(), dst.to_vec());
        for i in 0..16 {
            assert_eq!(
                d[i * 4096..][..4096],
                s[(15 - i) * 4096..][..4096],
                "transfer {i}"
            );
        }
        // A remote range that is not mapped (address 4096 is below
        // vm.mmap_min_addr, so never mapped) fails its transfer alone.
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
        assert_eq!(
            failures(&m),
            [(
                5,
                Some(libc::EFAULT),
                io::Error::from_raw_os_error(libc::EFAULT).kind()
            )]
        );
        assert!(m.stop.is_none() && m.ended == 16, "{m:?}");
        // A transfer that fails its own checks fails alone too.
        let mut oob = batch.clone();
        oob[3].len = 1 << 20;
        let m = transfer_batch(ME(), &oob, &mut IovLists::default());
        assert_eq!(failures(&m), [(3, None, io::ErrorKind::InvalidInput)]);
        assert_eq!((m.ended, m.calls), (16, 1), "the others still go in one call");
        // So does one that goes the other way.
        let mut mixed = batch.clone();
        mixed[7].dir = RmaDir::Put;
        let m = transfer_batch(ME(), &mixed, &mut IovLists::default());
        assert_eq!(failures(&m), [(7, None, io::ErrorKind::InvalidInput)]);
        // A process that does not exist stops the batch at its start.
        let m = transfer_batch(i32::MAX as u32, &batch, &mut IovLists::default());
        assert_eq!(
            (m.ended, m.stop.and_then(|e| e.raw_os_error())),
            (0, Some(libc::ESRCH))
        );
    }

    /// Every other transfer of a batch names unmapped memory: each fails
    /// alone, every other one moves its bytes, the whole batch is listed
    /// once (not again after each failure: quadratic in the failures) and
    /// costs at most two calls per failure.
    #[test]
    fn many_failing_transfers_are_stepped_over_not_relisted() {
        const N: u64 = 400;
        let src = MemHandle::new(
            vec![(0..N * 64).map(|i| (i % 251) as u8).collect()],
            Access::ReadOnly,
        );
        let dst = MemHandle::zeroed((N * 64) as usize, Access::ReadWrite);
        let remote = describe(&src);
        let hole = RemoteMem::new(
            vec![RemoteSegment {
                addr: 4096,
                len: N * 64,
                key: 0,
            }],
            Access::ReadOnly,
        )
        .unwrap();
        let batch: Vec<Rma> = (0..N)
            .map(|i| {
                let from = if i % 2 == 1 { &hole } else { &remote };
                Rma::get(&dst, i * 64, from, i * 64, 64, OpId(i))
            })
            .collect();
        PUSHED.with(|p| p.set(0));
        let m = transfer_batch(ME(), &batch, &mut IovLists::default());
        let pushed = PUSHED.with(|p| p.get());
        assert_eq!(pushed, 2 * N as usize, "each transfer's two pieces listed once");
        assert!(m.stop.is_none() && m.ended == N as usize, "{m:?}");
        let failed: Vec<usize> = m.failed.iter().map(|(i, _)| *i).collect();
        assert_eq!(failed, (1..N as usize).step_by(2).collect::<Vec<_>>());
        assert!(m.calls <= N as usize + 1, "{} calls", m.calls);
        let mut lists = IovLists::default();
        let _ = transfer_batch(ME(), &batch, &mut lists);
        let many = MemHandle::new(
            (0..3 * KEPT_ENTRIES).map(|_| vec![0u8; 1]).collect(),
            Access::ReadOnly,
        );
        let n = many.size();
        let scratch = MemHandle::zeroed(n as usize, Access::ReadWrite);
        let m = transfer_batch(
            ME(),
            &[Rma::get(&scratch, 0, &describe(&many), 0, n, OpId(1))],
            &mut lists,
        );
        assert!(m.failed.is_empty() && m.calls > 3, "{m:?}");
        assert!(
            lists.local.capacity() <= KEPT_ENTRIES && lists.remote.capacity() <= KEPT_ENTRIES,
            "a large batch's lists were kept: {} and {} entries",
            lists.local.capacity(),
            lists.remote.capacity()
        );
        let (s, d) = (src.to_vec(), dst.to_vec());
        for i in 0..N as usize {
            let want: &[u8] = if i % 2 == 0 { &s[i * 64..][..64] } else { &[0; 64] };
            assert_eq!(&d[i * 64..][..64], want, "transfer {i}");
        }
    }
}
