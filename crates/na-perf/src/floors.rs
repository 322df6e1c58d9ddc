//! The raw floors of this machine, measured between the same two processes
//! as the plugin figures:
//!
//! * `floor_shm_flag_lat`: the payload is copied into a shared mapping and a
//!   sequence number stored in a flag that the other side busy-polls
//!   (release/acquire); the other side copies it out, answers the same way.
//! * `floor_eventfd_lat`: the same copies, but each side sleeps in
//!   `epoll_wait` on an eventfd that the other side writes.
//! * `floor_cma_read_bw`: `process_vm_readv` from the peer's buffers into
//!   ours, with as many iovecs on each side as the handles have segments.
//! * `floor_cma_write_bw`: the same with `process_vm_writev`, ours into the
//!   peer's (the floor of a put).
//!
//! Each function here has a parent half (`measure_*`) and a peer half
//! (`serve_*`, run by `na-perf serve`).

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use na_core::sys::epoll::Epoll;

use crate::error::{PerfError, Result};
use crate::peer::{
    FloorLinks, Peer, DATA_FROM_PEER, DATA_TO_PEER, FLAG_FROM_PEER, FLAG_TO_PEER, FLOOR_MAX_MSG,
};
use crate::stats::{measure, Plan, Summary};
use crate::sys::cma::{CmaCopy, CmaDir, RemoteRange};

/// Eventfd value that tells the peer's echo loop to stop.
const STOP: u64 = 1 << 32;
/// How long either side waits for the other before giving up.
const PATIENCE: Duration = Duration::from_secs(10);

fn links(peer: &Peer) -> Result<&FloorLinks> {
    peer.links.as_ref().ok_or(PerfError::Arg {
        name: "--floors",
        reason: "the peer process was started without floor channels".into(),
    })
}

fn check_size(size: usize) -> Result<()> {
    if size > FLOOR_MAX_MSG {
        return Err(PerfError::Arg {
            name: "--sizes",
            reason: format!("latency floors go up to {FLOOR_MAX_MSG} bytes, not {size}"),
        });
    }
    Ok(())
}

/// One-way latency of the shared-memory flag ping-pong with `size`-byte payloads.
pub fn measure_shm_flag(peer: &mut Peer, plan: &Plan, size: usize) -> Result<Summary> {
    check_size(size)?;
    let shm = &links(peer)?.shm;
    shm.flag(FLAG_TO_PEER).store(0, Ordering::SeqCst);
    shm.flag(FLAG_FROM_PEER).store(0, Ordering::SeqCst);
    peer.request(&format!("flag {size}"))?;
    let l = links(peer)?;
    let (to, from) = (l.shm.flag(FLAG_TO_PEER), l.shm.flag(FLAG_FROM_PEER));
    let mut buf = vec![0x11u8; size];
    let mut seq = 0u64;
    let res = measure(plan, || {
        seq += 1;
        l.shm
            .write_bytes(DATA_TO_PEER, &buf)
            .map_err(PerfError::sys("shm copy"))?;
        to.store(seq, Ordering::Release);
        spin_until(|| from.load(Ordering::Acquire) == seq)?;
        l.shm
            .read_bytes(DATA_FROM_PEER, &mut buf)
            .map_err(PerfError::sys("shm copy"))
    });
    to.store(u64::MAX, Ordering::Release);
    peer.reply("flag <stop>")?;
    Ok(res?.scaled(2.0))
}

/// Spins until `done()`, failing after [`PATIENCE`].
fn spin_until(mut done: impl FnMut() -> bool) -> Result<()> {
    let mut spins = 0u32;
    let mut start = None;
    while !done() {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1 << 16) && start.get_or_insert_with(Instant::now).elapsed() > PATIENCE {
            return Err(PerfError::Timeout {
                what: "the peer's shared-memory flag",
                secs: PATIENCE.as_secs(),
            });
        }
    }
    Ok(())
}

/// Peer half of [`measure_shm_flag`]: echo until the flag reads `u64::MAX`.
pub fn serve_shm_flag(l: &FloorLinks, size: usize) -> Result<()> {
    check_size(size)?;
    let (to, from) = (l.shm.flag(FLAG_TO_PEER), l.shm.flag(FLAG_FROM_PEER));
    let mut buf = vec![0u8; size];
    let mut last = 0u64;
    loop {
        // The parent may pause for a long time between figures; no patience limit here.
        let mut v;
        loop {
            v = to.load(Ordering::Acquire);
            if v != last {
                break;
            }
            std::hint::spin_loop();
        }
        if v == u64::MAX {
            return Ok(());
        }
        l.shm
            .read_bytes(DATA_TO_PEER, &mut buf)
            .map_err(PerfError::sys("shm copy"))?;
        l.shm
            .write_bytes(DATA_FROM_PEER, &buf)
            .map_err(PerfError::sys("shm copy"))?;
        from.store(v, Ordering::Release);
        last = v;
    }
}

/// Waits in `epoll_wait` until `efd` has a nonzero count, and returns it.
fn wait_eventfd(poll: &Epoll, efd: &crate::sys::eventfd::EventFd, patience: Option<Duration>) -> Result<u64> {
    let start = Instant::now();
    let mut tokens = Vec::with_capacity(4);
    loop {
        if let Some(v) = efd.read().map_err(PerfError::sys("eventfd read"))? {
            return Ok(v);
        }
        if patience.is_some_and(|p| start.elapsed() > p) {
            return Err(PerfError::Timeout {
                what: "the peer's eventfd",
                secs: PATIENCE.as_secs(),
            });
        }
        tokens.clear();
        poll.wait(&mut tokens, patience)
            .map_err(PerfError::sys("epoll_wait"))?;
    }
}

/// One-way latency of the eventfd + epoll ping-pong with `size`-byte payloads.
pub fn measure_eventfd(peer: &mut Peer, plan: &Plan, size: usize) -> Result<Summary> {
    check_size(size)?;
    peer.request(&format!("eventfd {size}"))?;
    let l = links(peer)?;
    let poll = Epoll::new().map_err(PerfError::sys("epoll_create1"))?;
    poll.add(l.from_peer.as_fd(), 0)
        .map_err(PerfError::sys("epoll_ctl"))?;
    let mut buf = vec![0x22u8; size];
    let res = measure(plan, || {
        l.shm
            .write_bytes(DATA_TO_PEER, &buf)
            .map_err(PerfError::sys("shm copy"))?;
        l.to_peer.write(1).map_err(PerfError::sys("eventfd write"))?;
        wait_eventfd(&poll, &l.from_peer, Some(PATIENCE))?;
        l.shm
            .read_bytes(DATA_FROM_PEER, &mut buf)
            .map_err(PerfError::sys("shm copy"))
    });
    l.to_peer.write(STOP).map_err(PerfError::sys("eventfd write"))?;
    peer.reply("eventfd <stop>")?;
    Ok(res?.scaled(2.0))
}

/// Peer half of [`measure_eventfd`]: echo until the count reaches [`STOP`].
pub fn serve_eventfd(l: &FloorLinks, size: usize) -> Result<()> {
    check_size(size)?;
    let poll = Epoll::new().map_err(PerfError::sys("epoll_create1"))?;
    poll.add(l.to_peer.as_fd(), 0)
        .map_err(PerfError::sys("epoll_ctl"))?;
    let mut buf = vec![0u8; size];
    loop {
        if wait_eventfd(&poll, &l.to_peer, None)? >= STOP {
            return Ok(());
        }
        l.shm
            .read_bytes(DATA_TO_PEER, &mut buf)
            .map_err(PerfError::sys("shm copy"))?;
        l.shm
            .write_bytes(DATA_FROM_PEER, &buf)
            .map_err(PerfError::sys("shm copy"))?;
        l.from_peer.write(1).map_err(PerfError::sys("eventfd write"))?;
    }
}

/// Splits `size` into `segments` lengths (the last takes the remainder).
pub fn split(size: usize, segments: usize) -> Vec<usize> {
    let n = segments.max(1);
    let mut v = vec![size / n; n];
    v[n - 1] += size % n;
    v
}

/// Allocates `size` bytes as `segments` separately allocated, touched buffers.
pub fn alloc_segments(size: usize, segments: usize, fill: u8) -> Vec<Vec<u8>> {
    split(size, segments).into_iter().map(|n| vec![fill; n]).collect()
}

/// Time of one `process_vm_readv` (`dir` read) or `process_vm_writev`
/// (write) transfer of `size` bytes, `segments` iovecs on each side.
pub fn measure_cma(
    peer: &mut Peer,
    plan: &Plan,
    dir: CmaDir,
    size: usize,
    segments: usize,
) -> Result<Summary> {
    let cmd = format!("cma {size} {segments}");
    let answer = peer.request(&cmd)?;
    let remote = answer
        .split_whitespace()
        .map(|w| {
            let (a, n) = w.split_once(':')?;
            Some(RemoteRange {
                addr: a.parse().ok()?,
                len: n.parse().ok()?,
            })
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| PerfError::PeerReply {
            command: cmd.clone(),
            reply: answer.clone(),
        })?;
    let mut local = alloc_segments(size, segments, 0x33);
    let pid = peer.pid();
    let mut slices: Vec<&mut [u8]> = local.iter_mut().map(|b| &mut b[..]).collect();
    let mut copy = CmaCopy::new(dir, &mut slices, &remote).map_err(PerfError::sys(dir.syscall()))?;
    measure(plan, || {
        copy.run(pid).map(drop).map_err(PerfError::sys(dir.syscall()))
    })
}

/// Peer half of [`measure_cma`]: allocates the buffers (kept in `keep` until
/// the next command) and describes them as `addr:len` words.
pub fn serve_cma(keep: &mut Vec<Vec<u8>>, size: usize, segments: usize) -> String {
    *keep = alloc_segments(size, segments, 0x5a);
    keep.iter()
        .map(|b| format!("{}:{}", b.as_ptr() as usize, b.len()))
        .collect::<Vec<_>>()
        .join(" ")
}
