//! A transfer job stuck for over a second (a peer whose memory stalls
//! the kernel) is logged at debug level when the pool is next used, and
//! throttled: once for a stuck job that goes on, however many calls see
//! it. A binary of its own: the log capture is the process's global
//! subscriber.

use std::time::{Duration, Instant};

use na_core::{Access, MemHandle, OpId, RemoteMem};

mod common;
use common::{private_dir, rma_endpoint, sys, KillOnDrop};

const WHAT: &str = "RMA transfer jobs running for over";

#[test]
fn a_stuck_transfer_job_is_logged_once_at_debug_level() {
    let log = na_testsuite::log::CapturedLog::install_global();
    let dir = private_dir("stuck-rma-log");
    let (mut ep, id) = rma_endpoint(&dir, true, 1);
    let uri = ep.self_addr(id).unwrap().uri().to_owned();
    let (mut status_r, status_w) = common::pipe();
    let child = sys::fork();
    assert!(child >= 0, "fork");
    if child == 0 {
        drop(status_r);
        sys::exit_now(common::stalling_peer(&dir, &uri, status_w));
    }
    let kill = KillOnDrop::new(child);
    drop(status_w);
    let mut said = [0u8; 1];
    std::io::Read::read_exact(&mut status_r, &mut said).expect("the peer said nothing");
    if said[0] == b'U' {
        na_core::testing::report_not_run(
            "na-sm stuck_rma_log: the kernel refuses a userfaultfd that handles the kernel's own faults here",
        );
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    ep.post_recv_unexpected(id, Vec::with_capacity(4096), OpId(1))
        .unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    let (src, desc) = loop {
        assert!(Instant::now() < end, "the peer's descriptor never arrived");
        ep.progress(Some(Duration::from_millis(5))).unwrap();
        if let Some(c) = std::iter::from_fn(|| ep.pop_completion()).find(|c| c.op == OpId(1)) {
            break (c.source.unwrap(), c.buf.unwrap());
        }
    };
    let remote = RemoteMem::from_bytes(&desc).unwrap();
    let local = MemHandle::zeroed(4096, Access::ReadWrite);
    ep.get(&local, 0, &remote, 0, 4096, &src, OpId(10)).unwrap();
    // The thread has taken the job (it starts on the first batch, which on
    // a loaded box may take a while): the second is counted from then.
    let end = Instant::now() + Duration::from_secs(10);
    while ep.plugin_mut(id).unwrap().stats().rma_jobs_running == 0 {
        assert!(Instant::now() < end, "the stalling get never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Not stuck long yet: nothing said.
    ep.get(&local, 0, &remote, 0, 64, &src, OpId(11)).unwrap();
    ep.cancel(id, OpId(11)).unwrap();
    assert!(log.lines_at("DEBUG", WHAT).is_empty(), "{}", log.text());
    // Past the second (with room on a loaded box), the next calls see it.
    std::thread::sleep(Duration::from_millis(1500));
    for k in 0..5 {
        ep.get(&local, 0, &remote, 0, 64, &src, OpId(20 + k)).unwrap();
        ep.cancel(id, OpId(20 + k)).unwrap();
    }
    let lines = log.lines_at("DEBUG", WHAT);
    assert_eq!(lines.len(), 1, "{}", log.text());
    assert!(lines[0].contains("stuck=1"), "{}", lines[0]);
    drop(kill);
    drop(ep);
    let _ = std::fs::remove_dir_all(&dir);
}
