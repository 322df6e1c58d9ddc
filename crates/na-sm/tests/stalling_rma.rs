//! A peer decides what its memory does when we read it: a transfer names
//! its addresses, and `process_vm_readv` faults its pages in on our
//! thread, waiting (killable only) for whatever serves the fault. Memory
//! of the peer's that is registered with a userfaultfd it never answers
//! (or a mapping of a file on a FUSE mount it serves) holds our thread in
//! the system call for as long as the peer lives: an RMA on a peer's
//! descriptor must not be able to hold the caller (and every other peer
//! it serves) for ever.
//!
//! KNOWN DEFECT (not fixed; ignored until it is): na-sm moves RMA data
//! inside the `rma` call, on the caller's thread (`rma.rs`,
//! `sys/cma.rs`), so the `get` below does not return until the peer
//! ends. Run with `--ignored` to see it.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use na_core::{Access, MemHandle, OpId, RemoteMem, RemoteSegment};

mod common;
use common::{private_dir, sys, KillOnDrop};

/// How long the target's thread may take to come back from the transfer
/// (generous: a loaded box; an honest transfer of a page takes
/// microseconds).
const BOUND: Duration = Duration::from_secs(10);

use common::busy_endpoint as endpoint;

/// The hostile peer (a forked child): a page of memory that stalls every
/// access, described to the listener at `uri` in an unexpected message;
/// says on `status` whether it could (`U`: no userfaultfd here, `S`:
/// sent), then drives its endpoint until it is killed.
fn hostile_peer(dir: &std::path::Path, uri: &str, status: std::fs::File) -> i32 {
    use std::os::fd::AsFd;
    let Ok((_uffd, addr)) = sys::stalling_memory(4096) else {
        sys::write(status.as_fd(), b"U");
        return 0;
    };
    let (mut ep, _) = endpoint(dir, false);
    let Ok(to) = ep.lookup(uri) else { return 2 };
    let seg = RemoteSegment {
        addr: addr as u64,
        len: 4096,
        key: 0,
    };
    let Ok(desc) = RemoteMem::new(vec![seg], Access::ReadOnly) else {
        return 3;
    };
    if ep.send_unexpected(&to, 0, &desc.to_bytes(), OpId(1)).is_err() {
        return 4;
    }
    sys::write(status.as_fd(), b"S");
    loop {
        let _ = ep.progress(Some(Duration::from_millis(10)));
        while ep.pop_completion().is_some() {}
    }
}

#[test]
#[ignore = "known defect: a peer's memory that stalls holds the RMA caller's thread (see the file's docs)"]
fn a_peer_whose_memory_stalls_does_not_hold_the_reader() {
    let dir = private_dir("stalling-rma");
    let (mut srv, sid) = endpoint(&dir, true);
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    let (mut status_r, status_w) = common::pipe();
    let child = sys::fork();
    assert!(child >= 0, "fork");
    if child == 0 {
        drop(status_r);
        let code = hostile_peer(&dir, &uri, status_w);
        sys::exit_now(code);
    }
    let kill = KillOnDrop(child);
    drop(status_w);
    let mut said = [0u8; 1];
    std::io::Read::read_exact(&mut status_r, &mut said).expect("the peer said nothing");
    if said[0] == b'U' {
        na_core::testing::report_not_run(
            "na-sm stalling_rma: the kernel refuses a userfaultfd that handles the kernel's \
             own faults here (vm.unprivileged_userfaultfd 0, no CAP_SYS_PTRACE)",
        );
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    // Its descriptor arrives.
    srv.post_recv_unexpected(sid, Vec::with_capacity(4096), OpId(1))
        .unwrap();
    let end = Instant::now() + BOUND;
    let (src, desc) = loop {
        assert!(Instant::now() < end, "the peer's descriptor never arrived");
        srv.progress(Some(Duration::from_millis(1))).unwrap();
        if let Some(k) = std::iter::from_fn(|| srv.pop_completion()).find(|k| k.op == OpId(1)) {
            let buf = k.buf.expect("a receive gives its buffer back");
            break (k.source.expect("a received message has a source"), buf);
        }
    };
    let remote = RemoteMem::from_bytes(&desc).unwrap();
    let local = MemHandle::zeroed(4096, Access::ReadWrite);
    srv.plugin_mut(sid).unwrap().mem_register(&local).unwrap();
    // The transfer, then a progress call: both must come back (the
    // transfer may fail, or complete later), on a thread of its own so
    // that this one can tell.
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let t0 = Instant::now();
        let got = srv.get(&local, 0, &remote, 0, 4096, &src, OpId(2));
        let progressed = srv.progress_now();
        let _ = tx.send((t0.elapsed(), got.is_ok(), progressed.is_ok()));
        drop(srv);
    });
    let answer = rx.recv_timeout(BOUND);
    // Ends the peer, which lets a held thread go, so the test ends.
    drop(kill);
    let _ = worker.join();
    let _ = std::fs::remove_dir_all(&dir);
    match answer {
        Ok((took, _, progressed)) => assert!(progressed, "progress failed after the transfer ({took:?})"),
        Err(_) => panic!(
            "the peer's stalling memory held the reader's thread in its transfer for {BOUND:?} \
             (and every other peer it serves with it)"
        ),
    }
}
