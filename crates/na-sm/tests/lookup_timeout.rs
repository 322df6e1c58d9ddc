//! `lookup` of a listener that never accepts (its queue full) fails within
//! the handshake timeout instead of blocking in `connect` forever.

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use na_core::{Endpoint, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

#[test]
fn lookup_of_a_listener_that_never_accepts_fails_within_its_timeout() {
    let dir = std::env::temp_dir().join(format!("qs-sm-stuck-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let pid = std::process::id();
    let path = dir.join(format!("{pid}-stuck.sock"));
    let listener = UnixListener::bind(&path).unwrap();
    // SAFETY: listen(2) on a socket we own; backlog 0 makes one pending
    // connection fill the queue.
    assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
    let _queued = UnixStream::connect(&path).expect("the first connection is queued");
    let (tx, rx) = mpsc::channel();
    let d = dir.clone();
    std::thread::spawn(move || {
        let cfg = SmConfig {
            handshake_timeout: Duration::from_millis(300),
            ..SmConfig::default()
        }
        .with_dir(&*d);
        let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
        ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
            .unwrap();
        let t0 = Instant::now();
        let r = ep.lookup(&format!("sm://{pid}-stuck")).map(|_| ());
        let _ = tx.send((r, t0.elapsed()));
    });
    let (r, took) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("lookup still blocked after 20 s");
    let e = r.expect_err("nobody accepts, so lookup cannot succeed");
    assert!(e.to_string().contains("not accepting"), "{e}");
    assert!(
        took >= Duration::from_millis(250),
        "gave up after {took:?}, before its timeout"
    );
    drop(listener);
    let _ = std::fs::remove_dir_all(&dir);
}
