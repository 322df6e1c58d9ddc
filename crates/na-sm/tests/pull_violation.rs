//! Pull mode (`Plugin::pull_unexpected`) finds a peer's protocol violation
//! at the moment it takes the message: the message is not delivered, the
//! violation is counted, the peer is cut off, and the taker goes on.
//! Two real plugins over real shared memory in one process.

use std::time::{Duration, Instant};

use na_core::{Addr, OpId, Plugin, PluginId, Tag};
use na_sm::{SmConfig, SmPlugin};

const T: Duration = Duration::from_secs(10);

/// Drives `p` (and `other`, so handshakes finish) until `p` has an
/// unexpected message for `take_unexpected`, then takes it.
fn take(p: &mut SmPlugin, other: &mut SmPlugin) -> Option<(Addr, Tag, Vec<u8>)> {
    let end = Instant::now() + T;
    let mut buf = Vec::new();
    loop {
        assert!(Instant::now() < end, "no message to take");
        other.progress().unwrap();
        p.progress().unwrap();
        if p.unexpected_ready() {
            return p.take_unexpected(&mut buf).unwrap().map(|(a, t)| (a, t, buf));
        }
    }
}

#[test]
fn a_message_naming_an_unreserved_buffer_is_not_delivered_and_cuts_its_sender_off() {
    let dir = std::env::temp_dir().join(format!("qs-sm-pull-violation-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let mut taker = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(&dir)).unwrap();
    assert!(taker.pull_unexpected().unwrap(), "sm has a pull mode");
    let mut sender = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(&dir)).unwrap();
    let to = sender.lookup(taker.self_addr().uri()).unwrap();

    // Honest messages are taken, one per take, from the ring they wait in.
    for (i, msg) in [&b"one"[..], b"two"].into_iter().enumerate() {
        sender
            .send_unexpected(&to, 7 + i as Tag, msg, OpId(1 + i as u64))
            .unwrap();
        let (_, tag, got) = take(&mut taker, &mut sender).expect("an honest message");
        assert_eq!((tag, got.as_slice()), (7 + i as Tag, msg));
    }
    assert_eq!(taker.stats().protocol_errors, 0);

    // A forged one: seen, not delivered, counted; the sender is cut off.
    sender.debug_forge_unreserved(&to, 9).unwrap();
    assert!(
        take(&mut taker, &mut sender).is_none(),
        "a violation was delivered"
    );
    assert_eq!(taker.stats().protocol_errors, 1);
    let (end, mut op) = (Instant::now() + T, 100);
    let err = loop {
        assert!(Instant::now() < end, "the sender was never cut off");
        taker.progress().unwrap();
        sender.progress().unwrap();
        while sender.pop_completion().is_some() {}
        op += 1;
        if let Err(e) = sender.send_unexpected(&to, 10, b"after", OpId(op)) {
            break e;
        }
    };
    assert!(matches!(err, na_core::NaError::PeerGone { .. }), "{err}");
    // Nothing it sent after its violation is taken.
    let mut buf = Vec::new();
    for _ in 0..100 {
        taker.progress().unwrap();
        assert!(taker.take_unexpected(&mut buf).unwrap().is_none());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
