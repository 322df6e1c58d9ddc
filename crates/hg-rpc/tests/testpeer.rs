//! The test server (`hg-rpc-testpeer`) goes away with the test that
//! started it, even when that test never gets to kill it.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

mod common;

#[test]
fn the_test_server_exits_when_its_test_is_gone() {
    let d = common::dir("testpeer-stdin");
    let mut child = common::testpeer()
        .env("QS_SM_DIR", &d)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn hg-rpc-testpeer");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read its address");
    assert!(line.starts_with("ADDR "), "{line:?}");
    // Serving, and it stays up while the pipe is open.
    std::thread::sleep(Duration::from_millis(300));
    assert!(child.try_wait().expect("try_wait").is_none(), "exited on its own");
    // What the kernel does when the test process dies: our end closes.
    drop(child.stdin.take());
    let end = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        if Instant::now() > end {
            let _ = child.kill();
            panic!("hg-rpc-testpeer still running 10 s after its standard input closed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(4), "{status:?}");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err).expect("stderr");
    assert!(err.contains("standard input closed"), "{err}");
}
