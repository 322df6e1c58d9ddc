//! What a peer of handshake version 1 meets (before wake-ups were writes
//! of 0 to an eventfd made at 1, `conn::PROTO_VERSION` 2): its eventfd
//! starts at 0, so a version-2 side's wake-ups of it would never be
//! reported, and its own wake-ups (writes of 1) could be made to block.
//! A listener refuses its hello, saying which versions, and takes no
//! peer; the same hello at version 2 is acknowledged (the negative
//! control). A real listener; the old connector is played by hand over a
//! real socket, with a real region and eventfd.

use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use na_core::{Plugin, PluginId};
use na_sm::channel::{init_region, REGION_LEN};
use na_sm::conn::{check_ack, encode_hello, refusal_reason, PROTO_VERSION};
use na_sm::sys::shm::SharedRegion;
use na_sm::sys::socket::send_with_fds;
use na_sm::sys::wake::{OwnWake, WakeKind};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::private_dir;

/// Far above any honest handshake, even on a loaded box.
const T: Duration = Duration::from_secs(30);

/// Sends a hello of `version` (with a region and an eventfd, as a real
/// connector does) to `srv`'s socket and returns the listener's answer.
fn answer_to_hello(srv: &mut SmPlugin, sock: &std::path::Path, version: u32, instance: &str) -> Vec<u8> {
    let region = SharedRegion::create("old-version", REGION_LEN).unwrap();
    init_region(&region, 0);
    let wake = OwnWake::new(WakeKind::EventFd).unwrap();
    let mut hello = encode_hello(&format!("{}-{instance}", std::process::id()));
    hello[8..12].copy_from_slice(&version.to_le_bytes());
    let mut conn = UnixStream::connect(sock).unwrap();
    let region_fd = region.fd().expect("a memfd region");
    send_with_fds(conn.as_fd(), &hello, &[region_fd, wake.fd_for_peer()]).unwrap();
    conn.set_nonblocking(true).unwrap();
    let end = Instant::now() + T;
    let mut b = vec![0u8; 512];
    loop {
        assert!(Instant::now() < end, "the listener never answered the hello");
        srv.progress().unwrap();
        match conn.read(&mut b) {
            Ok(n) => {
                b.truncate(n);
                return b;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => panic!("reading the listener's answer: {e}"),
        }
    }
}

#[test]
fn a_version_1_hello_is_refused_naming_both_versions() {
    assert_eq!(PROTO_VERSION, 2, "update this test with the version");
    let dir = private_dir("old-version");
    let cfg = SmConfig {
        wake: Some(WakeKind::EventFd),
        ..SmConfig::listening().with_dir(&dir)
    };
    let mut srv = SmPlugin::new(PluginId(1), cfg).unwrap();
    let sock = dir.join(format!(
        "{}.sock",
        srv.self_addr().uri().trim_start_matches("sm://")
    ));

    let answer = answer_to_hello(&mut srv, &sock, 1, "old");
    let reason =
        refusal_reason(&answer).unwrap_or_else(|| panic!("a version-1 hello was not refused: {answer:?}"));
    assert!(
        reason.contains("protocol version 1, we speak 2"),
        "the refusal does not say which versions: {reason}"
    );
    assert_eq!(srv.stats().peers, 0, "a version-1 peer was taken");

    // Negative control: the same hello at our version is acknowledged.
    let answer = answer_to_hello(&mut srv, &sock, PROTO_VERSION, "new");
    check_ack(&answer).unwrap_or_else(|e| panic!("{e}: {:?}", refusal_reason(&answer)));
    let end = Instant::now() + T;
    while srv.stats().peers != 1 {
        assert!(Instant::now() < end, "the version-2 peer was never taken");
        srv.progress().unwrap();
    }
    drop(srv);
    let _ = std::fs::remove_dir_all(&dir);
}
