//! Pull mode (`Plugin::pull_unexpected`) finds a peer's protocol violation
//! at the moment it takes the message: the message is not delivered, the
//! violation is counted, the peer is cut off, and the taker goes on.
//! Two real plugins over real shared memory in one process.

use std::time::{Duration, Instant};

use na_core::{Addr, OpId, Plugin, PluginId, Tag};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::private_dir;

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
    let dir = private_dir("pull-violation");
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
    let received = taker.stats().msgs_received;

    // A forged one: seen, not delivered, counted; the sender is cut off.
    sender.debug_forge_unreserved(&to, 9).unwrap();
    assert!(
        take(&mut taker, &mut sender).is_none(),
        "a violation was delivered"
    );
    assert_eq!(taker.stats().protocol_errors, 1);
    assert_eq!(
        taker.stats().msgs_received,
        received + 1,
        "counted as received, as the scan and the poll count it"
    );
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
    assert!(
        matches!(err, na_core::NaError::PeerGone { .. }),
        "{}",
        na_core::ErrorChain(&err)
    );
    // Nothing it sent after its violation is taken.
    let mut buf = Vec::new();
    for _ in 0..100 {
        taker.progress().unwrap();
        assert!(taker.take_unexpected(&mut buf).unwrap().is_none());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same when two peers' messages wait (the take scans the rings rather
/// than going straight to the one seen last): the violation is not
/// delivered, and the honest peer's message still is.
#[test]
fn a_violation_found_by_a_scan_is_not_delivered_and_the_other_peer_is_served() {
    let dir = private_dir("pull-violation-scan");
    let mut taker = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(&dir)).unwrap();
    assert!(taker.pull_unexpected().unwrap());
    let mut bad = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(&dir)).unwrap();
    let mut good = SmPlugin::new(PluginId(3), SmConfig::default().with_dir(&dir)).unwrap();
    let (to_bad, to_good) = (
        bad.lookup(taker.self_addr().uri()).unwrap(),
        good.lookup(taker.self_addr().uri()).unwrap(),
    );
    // Both connected (a first honest message each, taken).
    bad.send_unexpected(&to_bad, 1, b"hi", OpId(1)).unwrap();
    good.send_unexpected(&to_good, 2, b"hi", OpId(1)).unwrap();
    let mut tags = Vec::new();
    let end = Instant::now() + T;
    while tags.len() < 2 {
        assert!(Instant::now() < end, "the first messages never arrived");
        bad.progress().unwrap();
        good.progress().unwrap();
        taker.progress().unwrap();
        let mut buf = Vec::new();
        while let Some((_, tag)) = taker.take_unexpected(&mut buf).unwrap() {
            tags.push(tag);
        }
    }
    tags.sort_unstable();
    assert_eq!(tags, [1, 2]);
    // Both rings hold a message when the taker polls: the take scans.
    bad.debug_forge_unreserved(&to_bad, 9).unwrap();
    good.send_unexpected(&to_good, 8, b"honest", OpId(2)).unwrap();
    let end = Instant::now() + T;
    let mut got = None;
    while got.is_none() || taker.stats().protocol_errors == 0 {
        assert!(Instant::now() < end, "got {got:?}, {:?}", taker.stats());
        good.progress().unwrap();
        taker.progress().unwrap();
        let mut buf = Vec::new();
        while let Some((_, tag)) = taker.take_unexpected(&mut buf).unwrap() {
            assert_eq!(tag, 8, "a violation was delivered");
            assert_eq!(buf, b"honest");
            got = Some(tag);
        }
    }
    assert_eq!(taker.stats().protocol_errors, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without pull mode (posted unexpected receives), a message naming a
/// buffer its sender had not reserved is not delivered either: its buffer
/// is checked before the posted receive is completed. The violation is
/// counted and the sender cut off.
#[test]
fn a_violation_is_not_delivered_to_a_posted_receive() {
    let dir = private_dir("push-violation");
    let mut taker = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(&dir)).unwrap();
    let mut sender = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(&dir)).unwrap();
    let to = sender.lookup(taker.self_addr().uri()).unwrap();
    // Connected: an honest message arrives in a posted receive.
    taker.post_recv_unexpected(Vec::new(), OpId(1)).unwrap();
    sender.send_unexpected(&to, 7, b"one", OpId(1)).unwrap();
    let end = Instant::now() + T;
    loop {
        assert!(Instant::now() < end, "the honest message never arrived");
        sender.progress().unwrap();
        taker.progress().unwrap();
        if let Some(c) = taker.pop_completion() {
            assert_eq!(c.tag, 7);
            break;
        }
    }
    taker.post_recv_unexpected(Vec::new(), OpId(2)).unwrap();
    sender.debug_forge_unreserved(&to, 9).unwrap();
    let end = Instant::now() + T;
    while taker.stats().protocol_errors == 0 {
        assert!(
            Instant::now() < end,
            "the violation was never seen: {:?}",
            taker.stats()
        );
        sender.progress().unwrap();
        taker.progress().unwrap();
        if let Some(c) = taker.pop_completion() {
            assert_ne!(c.tag, 9, "a violation was delivered to a posted receive");
        }
    }
    for _ in 0..100 {
        taker.progress().unwrap();
        if let Some(c) = taker.pop_completion() {
            assert_ne!(c.tag, 9, "a violation was delivered to a posted receive");
        }
    }
    assert_eq!(taker.stats().protocol_errors, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A forger that leaves at once: its ring is drained as it departs (pull
/// mode keeps a departed peer's messages for the application), and the
/// forged message is not among them.
#[test]
fn a_departing_forger_s_violation_is_not_kept_for_the_application() {
    let dir = private_dir("departing-violation");
    let mut taker = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(&dir)).unwrap();
    assert!(taker.pull_unexpected().unwrap());
    let mut sender = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(&dir)).unwrap();
    let to = sender.lookup(taker.self_addr().uri()).unwrap();
    sender.send_unexpected(&to, 7, b"one", OpId(1)).unwrap();
    let (_, tag, _) = take(&mut taker, &mut sender).expect("an honest message");
    assert_eq!(tag, 7);
    sender
        .send_unexpected(&to, 8, b"honest, before", OpId(2))
        .unwrap();
    sender.debug_forge_unreserved(&to, 9).unwrap();
    drop(sender);
    // The hang-up is handled (the ring drained, the violation found
    // there) before anything is taken: waited for, not for a fixed time.
    let end = Instant::now() + Duration::from_secs(10);
    while taker.stats().protocol_errors == 0 && Instant::now() < end {
        taker.progress().unwrap();
    }
    let mut tags = Vec::new();
    let mut buf = Vec::new();
    let end = Instant::now() + Duration::from_secs(1);
    while Instant::now() < end {
        taker.progress().unwrap();
        while let Some((_, tag)) = taker.take_unexpected(&mut buf).unwrap() {
            tags.push(tag);
        }
    }
    assert!(
        !tags.contains(&9),
        "the forged message was kept for the application: {tags:?}"
    );
    assert_eq!(tags, [8], "the honest message before it was lost");
    assert_eq!(
        taker.stats().protocol_errors,
        1,
        "a violation found while the departing ring drained went uncounted"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
