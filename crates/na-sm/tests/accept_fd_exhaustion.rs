//! A listener out of file descriptors: `accept` fails with `EMFILE` while
//! the connection stays queued, so the listening socket stays readable. The
//! plugin must pause accepting (not spin on it, burning a core in blocking
//! mode) and serve the client once descriptors are back.
//!
//! The client is a second process (this test binary again, told its role
//! by an environment variable), so its descriptors do not count against
//! the lowered limit. The only test in its binary: it lowers the process's
//! descriptor limit.

mod common;
mod fd_limit;
use common::{sys, KillOnDrop};
use std::os::fd::{AsFd, AsRawFd};

use std::time::{Duration, Instant};

use na_core::{Endpoint, OpId, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

use fd_limit::{listener, serve_request_until_exit, set_fd_limit};

const ROLE_ENV: &str = "QS_SM_FDX_SERVER";
const TEST: &str = "accepting_without_descriptors_neither_spins_nor_loses_the_client";

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    assert_eq!(sys::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts), 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The client: connects (queued at the server), sends, waits for a reply.
fn client(server: &str, dir: &str) {
    let cfg = SmConfig::default().with_dir(dir);
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let _ = id;
    let srv = ep.lookup(server).expect("lookup: the connection is queued");
    ep.post_recv_expected(&srv, 7, Vec::new(), OpId(1)).unwrap();
    ep.send_unexpected(&srv, 7, b"queued while you had no fds", OpId(2))
        .unwrap();
    // The connection waits in the server's accept queue now.
    println!("CONNECTED");
    let end = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while got.len() < 2 {
        assert!(Instant::now() < end, "client: no reply (got {got:?})");
        ep.progress(Some(Duration::from_millis(100))).unwrap();
        while let Some(c) = ep.pop_completion() {
            c.status.as_ref().expect("client operation");
            got.push(c.op);
        }
    }
    println!("CLIENT OK");
}

#[test]
fn accepting_without_descriptors_neither_spins_nor_loses_the_client() {
    if let Ok(role) = std::env::var(ROLE_ENV) {
        let (uri, dir) = role.split_once('|').expect("uri|dir");
        return client(uri, dir);
    }
    let (mut srv, sid, uri, dir) = listener("fdx");
    srv.post_recv_unexpected(sid, Vec::new(), OpId(1)).unwrap();
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", TEST, "--nocapture", "--test-threads", "1"])
        .env(ROLE_ENV, format!("{uri}|{}", dir.display()))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // (Its pidfd is taken before the limit is lowered.)
    let _kill = KillOnDrop::new(child.id() as libc::pid_t);
    // No descriptor left: the lowest free number becomes the limit.
    let lowest_free = {
        let fd = sys::dup(std::io::stderr().as_fd());
        assert!(fd.is_ok());
        fd.unwrap().as_raw_fd()
    };
    let old = set_fd_limit(lowest_free as libc::rlim_t);
    // Wait until the client is connected into the listener's queue (its
    // stdout pipe was opened before the limit was lowered).
    let mut child = child;
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    // (libtest may print "test <name> ... " before it on the same line.)
    while !line.contains("CONNECTED") {
        line.clear();
        let n = std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert!(n > 0, "the client exited before connecting");
    }
    let (cpu0, t0) = (thread_cpu(), Instant::now());
    while t0.elapsed() < Duration::from_secs(1) {
        srv.progress(Some(Duration::from_millis(200))).unwrap();
    }
    let cpu = thread_cpu() - cpu0;
    let accept_errors = srv.plugin(sid).unwrap().stats().accept_errors;
    set_fd_limit(old.rlim_cur);
    assert!(
        accept_errors >= 1,
        "accept never failed: the test did not exhaust descriptors"
    );
    assert!(
        cpu < Duration::from_millis(300),
        "blocking progress used {cpu:?} of CPU in 1 s while accept failed: it spins"
    );
    // Descriptors are back: the queued client is served.
    serve_request_until_exit(&mut srv, &mut child, &mut out, b"queued while you had no fds");
    let _ = std::fs::remove_dir_all(&dir);
}
