//! The test server (`hg-rpc-testpeer`) goes away with the test that
//! started it, even when that test never gets to kill it.

use std::time::{Duration, Instant};

mod common;
use common::{dir, Server};

#[test]
fn the_test_server_exits_when_its_test_is_gone() {
    let d = dir("testpeer-stdin");
    let mut srv = Server::with_env("QS_SM_DIR", &*d);
    assert!(srv.uri.starts_with("sm://"), "{}", srv.uri);
    // Serving, and it stays up while the pipe is open.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        srv.child.try_wait().expect("try_wait").is_none(),
        "exited on its own"
    );
    // What the kernel does when the test process dies: our end closes.
    drop(srv.child.stdin.take());
    let end = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = srv.child.try_wait().expect("try_wait") {
            break s;
        }
        assert!(
            Instant::now() < end,
            "hg-rpc-testpeer still running 10 s after its standard input closed"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // 4: the exit of the standard-input watch, no other path's.
    assert_eq!(status.code(), Some(4), "{status:?}");
}

/// A test server that cannot start says why, cause and all: its error
/// (the RPC layer's "transport error") leaves its cause to `source()`, so
/// `main` returning it would print the `Debug` form, and its `Display`
/// alone would say only "transport error"; `exit::run` prints the message
/// and a "caused by" line per source, in words.
#[test]
fn the_test_server_that_cannot_start_prints_its_error_chain() {
    let d = dir("testpeer-unsafe-dir");
    // A file where the socket directory should be: na-sm refuses it.
    let not_a_dir = d.join("not-a-dir");
    std::fs::write(&not_a_dir, b"").expect("write the file");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hg-rpc-testpeer"))
        .env("QS_SM_DIR", &not_a_dir)
        .env_remove("HG_TESTPEER_SPEC")
        .env_remove("HG_TESTPEER_STALLED_CALL")
        .env_remove("HG_TESTPEER_CONTEXTS")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run hg-rpc-testpeer");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("hg-rpc-testpeer: error: transport error\n"),
        "{err}"
    );
    assert!(
        err.lines()
            .any(|l| l.starts_with("  caused by: ") && l.contains("not a directory")),
        "the cause is not printed: {err}"
    );
    assert!(!err.contains("Transport("), "the Debug form, not words: {err}");
}
