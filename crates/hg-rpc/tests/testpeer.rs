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
