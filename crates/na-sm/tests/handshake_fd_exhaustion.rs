//! A listener that runs out of descriptors in the middle of a handshake
//! (after `accept`): receiving the hello's two descriptors, or creating its
//! own wake-up eventfd, fails. That is our failure, not the client's: it is
//! counted in `accept_errors`, never in `protocol_errors` (which operators
//! watch for hostile peers), the client's connection is closed with an
//! error it can see, and the client connects again once descriptors are
//! back.
//!
//! The client is a second process (this test binary again, told its role by
//! an environment variable), so its descriptors do not count against the
//! lowered limit. The only test in its binary: it lowers the process's
//! descriptor limit.

mod common;
mod fd_limit;
use common::{sys, KillOnDrop};
use std::os::fd::{AsFd, AsRawFd};

use std::io::BufRead;
use std::time::{Duration, Instant};

use na_core::{Endpoint, NaError, OpId, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

use fd_limit::{listener, serve_request_until_exit, set_fd_limit};

const ROLE_ENV: &str = "QS_SM_HSFDX_CLIENT";
const TEST: &str = "running_out_of_descriptors_mid_handshake_is_not_the_peers_fault";

/// The three lowest free descriptor numbers, in order.
fn lowest_free() -> [libc::c_int; 3] {
    let err = std::io::stderr();
    let fds = [
        sys::dup(err.as_fd()),
        sys::dup(err.as_fd()),
        sys::dup(err.as_fd()),
    ];
    fds.map(|fd| {
        assert!(fd.is_ok());
        fd.unwrap().as_raw_fd()
    })
}

fn endpoint(cfg: SmConfig) -> (Endpoint, na_core::PluginId) {
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    (ep, id)
}

/// The client: connects (the connection waits in the server's accept
/// queue), sends a request, and waits for the answer. A connection the
/// server closes instead of acknowledging fails the request with
/// `PeerGone`: it says so, waits for a line on stdin (the server's go
/// ahead), and connects again, up to three times.
fn client(server: &str, dir: &str) {
    let (mut ep, _) = endpoint(SmConfig::default().with_dir(dir));
    let mut stdin = std::io::stdin().lock();
    for attempt in 0..3 {
        if attempt > 0 {
            let mut go = String::new();
            stdin.read_line(&mut go).expect("the server's go-ahead");
        }
        let srv = ep.lookup(server).expect("lookup: the connection is queued");
        let (r, s) = (OpId(10 * attempt + 1), OpId(10 * attempt + 2));
        ep.post_recv_expected(&srv, 7, Vec::new(), r).unwrap();
        ep.send_unexpected(&srv, 7, b"request", s).unwrap();
        println!("CONNECTED {attempt}");
        let end = Instant::now() + Duration::from_secs(20);
        let answer = loop {
            assert!(Instant::now() < end, "client: no answer and no error");
            ep.progress(Some(Duration::from_millis(100))).unwrap();
            if let Some(c) = std::iter::from_fn(|| ep.pop_completion()).find(|c| c.op == r) {
                break c.status;
            }
        };
        match answer {
            Ok(()) => {
                println!("CLIENT OK");
                return;
            }
            Err(NaError::PeerGone { reason, .. }) => println!("REFUSED {reason}"),
            Err(e) => panic!("client: unexpected error {}", na_core::ErrorChain(&e)),
        }
    }
    panic!("client: refused three times");
}

/// Reads the client's lines until one starts with `want`; returns it.
fn line_starting(out: &mut impl BufRead, want: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let n = out.read_line(&mut line).unwrap();
        assert!(n > 0, "the client exited before printing {want:?}");
        // (libtest may print "test <name> ... " before it on the same line.)
        if let Some(i) = line.find(want) {
            return line[i..].trim().to_owned();
        }
    }
}

#[test]
fn running_out_of_descriptors_mid_handshake_is_not_the_peers_fault() {
    if let Ok(role) = std::env::var(ROLE_ENV) {
        let (uri, dir) = role.split_once('|').expect("uri|dir");
        return client(uri, dir);
    }
    let (mut srv, sid, uri, dir) = listener("hsfdx");
    srv.post_recv_unexpected(sid, Vec::new(), OpId(1)).unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", TEST, "--nocapture", "--test-threads", "1"])
        .env(ROLE_ENV, format!("{uri}|{}", dir.display()))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let _kill = KillOnDrop::new(child.id() as libc::pid_t);
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut go = child.stdin.take().unwrap();
    // Two short handshakes: with room for the accepted socket and the
    // hello's two descriptors but not our eventfd; then with room for the
    // socket and one descriptor only (the kernel drops the other).
    for (attempt, room) in [(0, 2), (1, 1)] {
        line_starting(&mut out, &format!("CONNECTED {attempt}"));
        let free = lowest_free();
        let old = set_fd_limit(free[room] as libc::rlim_t + 1);
        let before = srv.plugin(sid).unwrap().stats();
        let end = Instant::now() + Duration::from_secs(10);
        while srv.plugin(sid).unwrap().stats().accept_errors == before.accept_errors {
            assert!(
                Instant::now() < end,
                "attempt {attempt}: the handshake did not fail for lack of descriptors: {:?}",
                srv.plugin(sid).unwrap().stats()
            );
            srv.progress(Some(Duration::from_millis(50))).unwrap();
        }
        set_fd_limit(old.rlim_cur);
        let after = srv.plugin(sid).unwrap().stats();
        assert_eq!(
            after.protocol_errors, before.protocol_errors,
            "attempt {attempt}: our own lack of descriptors was counted as the peer's protocol error"
        );
        assert_eq!(after.handshakes_refused, before.handshakes_refused + 1);
        assert_eq!(after.peers, before.peers, "attempt {attempt}: no peer was added");
        let refused = line_starting(&mut out, "REFUSED");
        assert!(refused.contains("REFUSED"), "{refused}");
        std::io::Write::write_all(&mut go, b"go\n").unwrap();
    }
    // Descriptors are back: the third connection is served.
    line_starting(&mut out, "CONNECTED 2");
    serve_request_until_exit(&mut srv, &mut child, &mut out, b"request");
    assert_eq!(srv.plugin(sid).unwrap().stats().protocol_errors, 0);
    let _ = std::fs::remove_dir_all(&dir);
}
