//! What a peer of handshake version 1 meets (before wake-ups were writes
//! of 0 to an eventfd made at 1, `conn::PROTO_VERSION` 2): its eventfd
//! starts at 0, so a version-2 side's wake-ups of it would never be
//! reported, and its own wake-ups (writes of 1) could be made to block.
//! A listener refuses its hello, saying which versions, and takes no
//! peer; the same hello at version 2 is acknowledged (the negative
//! control). A real listener; the old connector is played by hand over a
//! real socket, with a real region and eventfd. The other way round, a
//! version-1 listener closes the connection without a word: the
//! connector's error names the likely version mismatch.

use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use na_core::{NaError, OpId, Plugin, PluginId};
use na_sm::channel::{init_region, REGION_LEN};
use na_sm::conn::{check_ack, encode_hello, hello_version, refusal_reason, PROTO_VERSION};
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

/// What a connector of this version meets at a version-1 listener, which
/// reads the hello and closes the connection without a word (it had no
/// refusal for another version): the connector's error names the
/// version mismatch as the likely cause, not a bare close. The old
/// listener is played by hand over a real socket at a real address; the
/// connector is a real plugin.
#[test]
fn a_version_1_listeners_silent_close_is_reported_as_a_version_mismatch() {
    let dir = private_dir("old-listener");
    let uri = format!("sm://{}-oldlistener", std::process::id());
    let sock = dir.join(format!("{}.sock", uri.trim_start_matches("sm://")));
    let old = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let mut c = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(&dir)).unwrap();
    let to = c.lookup(&uri).unwrap();
    // The old listener: reads the hello (its descriptors go with the
    // socket), sees another version, closes.
    let (mut conn, _) = old.accept().unwrap();
    let mut hello = vec![0u8; 512];
    let n = conn.read(&mut hello).unwrap();
    assert_eq!(hello_version(&hello[..n]), Some(PROTO_VERSION), "not our hello");
    drop(conn);
    c.post_recv_expected(&to, 1, Vec::new(), OpId(1)).unwrap();
    let end = Instant::now() + T;
    let status = loop {
        assert!(Instant::now() < end, "the closed connection was never noticed");
        c.progress().unwrap();
        if let Some(k) = std::iter::from_fn(|| c.pop_completion()).find(|k| k.op == OpId(1)) {
            break k.status;
        }
    };
    match status {
        Err(NaError::PeerGone { reason, .. }) => assert!(
            reason.contains("instead of acknowledging") && reason.contains("older handshake version (1)"),
            "the error does not name the likely version mismatch: {reason}"
        ),
        other => panic!("expected PeerGone, got {other:?}"),
    }
    drop((c, old));
    let _ = std::fs::remove_dir_all(&dir);
}
