//! Expected messages of a peer that went away stay takeable for
//! `SmConfig::departed_hold`, then are dropped (a peer that comes and goes
//! cannot pile them up in a receiver that never asks for them). In pull
//! mode its unexpected messages count against `max_queued_total`.

use std::time::{Duration, Instant};

use na_core::{Endpoint, NaError, OpId, Plugin, PluginId, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

fn node(dir: &std::path::Path, listen: bool) -> (Endpoint, PluginId) {
    let cfg = SmConfig {
        listen,
        departed_hold: Duration::from_millis(300),
        ..SmConfig::default()
    }
    .with_dir(dir);
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    (ep, id)
}

/// A new, empty 0700 directory `<tmp>/<tag>-<pid>`.
fn fresh_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    dir
}

#[test]
fn expected_messages_of_a_departed_peer_are_kept_for_a_while_then_dropped() {
    let dir = fresh_dir("qs-sm-departed");
    let (mut rx, rid) = node(&dir, true);
    let (mut tx, _) = node(&dir, false);
    let to = tx.lookup(rx.self_addr(rid).unwrap().uri()).unwrap();
    rx.post_recv_unexpected(rid, Vec::new(), OpId(1)).unwrap();
    tx.send_unexpected(&to, 1, b"hi", OpId(100)).unwrap();
    for i in 0..5u32 {
        tx.send_expected(&to, 9, &i.to_le_bytes(), OpId(200 + u64::from(i)))
            .unwrap();
    }
    let end = Instant::now() + Duration::from_secs(10);
    let mut src = None;
    while src.is_none() || rx.plugin(rid).unwrap().stats().queued_arrivals < 5 {
        assert!(Instant::now() < end, "the messages never arrived");
        tx.progress(Some(Duration::ZERO)).unwrap();
        rx.progress(Some(Duration::from_millis(1))).unwrap();
        while let Some(c) = rx.pop_completion() {
            if c.op == OpId(1) {
                src = c.source;
            }
        }
    }
    let src = src.unwrap();
    drop(tx);
    while rx.plugin(rid).unwrap().stats().peers > 0 {
        assert!(Instant::now() < end, "the sender's end was not seen");
        rx.progress(Some(Duration::from_millis(1))).unwrap();
    }
    // Within the hold: a receive naming the departed peer gets its message.
    rx.post_recv_expected(&src, 9, Vec::new(), OpId(2)).unwrap();
    let got = loop {
        if let Some(c) = std::iter::from_fn(|| rx.pop_completion()).find(|c| c.op == OpId(2)) {
            break c;
        }
        assert!(Instant::now() < end, "the queued message was not delivered");
        rx.progress(Some(Duration::ZERO)).unwrap();
    };
    assert_eq!(got.buf.as_deref(), Some(&0u32.to_le_bytes()[..]));
    assert_eq!(rx.plugin(rid).unwrap().stats().queued_arrivals, 4);
    // After it, the rest go.
    let end = Instant::now() + Duration::from_secs(10);
    while rx.plugin(rid).unwrap().stats().queued_arrivals > 0 {
        assert!(
            Instant::now() < end,
            "expected messages of a departed peer are kept forever"
        );
        rx.progress(Some(Duration::from_millis(5))).unwrap();
    }
    let e = rx
        .post_recv_expected(&src, 9, Vec::new(), OpId(3))
        .expect_err("nothing queued, and the peer is gone");
    assert!(matches!(e, NaError::PeerGone { .. }), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Pull mode: the unexpected messages of a peer that left are copied out
/// of its ring before the ring goes, and they count against
/// `max_queued_total` like any held message (`queued_arrivals` shows
/// them), so a peer that sends and leaves, again and again, cannot pile
/// them up: at the bound the listener stops accepting until the
/// application takes some; then the next client is served.
#[test]
fn a_departed_peers_unexpected_messages_count_against_the_total_bound() {
    const TOTAL: usize = 8;
    const SENT: u32 = 12;
    let dir = fresh_dir("qs-sm-departed-pull");
    let cfg = SmConfig {
        listen: true,
        max_queued_total: TOTAL,
        ..SmConfig::default()
    }
    .with_dir(&dir);
    let mut rx = Endpoint::new(ProgressMode::Busy).unwrap();
    let rid = rx
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    assert!(rx.pull_unexpected(rid).unwrap());
    let uri = rx.self_addr(rid).unwrap().uri().to_owned();
    let held = |rx: &Endpoint| rx.plugin(rid).unwrap().stats().queued_arrivals;
    {
        let (mut tx, _) = node(&dir, false);
        let to = tx.lookup(&uri).unwrap();
        for i in 0..SENT {
            tx.send_unexpected(&to, i, b"bye", OpId(u64::from(i))).unwrap();
        }
        // Connected and read up to the ring (nothing taken yet).
        let end = Instant::now() + Duration::from_secs(10);
        while rx.plugin(rid).unwrap().stats().peers == 0 {
            assert!(Instant::now() < end);
            rx.progress(Some(Duration::from_millis(1))).unwrap();
            tx.progress(Some(Duration::ZERO)).unwrap();
        }
    }
    let end = Instant::now() + Duration::from_secs(10);
    while held(&rx) < u64::from(SENT) {
        assert!(Instant::now() < end, "held {}", held(&rx));
        rx.progress(Some(Duration::from_millis(1))).unwrap();
    }
    // Over the bound: a new client is not accepted.
    let (mut tx2, _) = node(&dir, false);
    let to2 = tx2.lookup(&uri).unwrap();
    tx2.send_unexpected(&to2, 100, b"hello", OpId(1)).unwrap();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        rx.progress(Some(Duration::from_millis(1))).unwrap();
        tx2.progress(Some(Duration::ZERO)).unwrap();
    }
    assert_eq!(
        rx.plugin(rid).unwrap().stats().peers,
        0,
        "accepted over the bound"
    );
    // The application takes them, in order; then the new client is served.
    let mut buf = Vec::new();
    for i in 0..SENT {
        let (_, tag) = rx
            .take_unexpected(rid, &mut buf)
            .unwrap()
            .expect("a departed message");
        assert_eq!((tag, buf.as_slice()), (i, &b"bye"[..]));
    }
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(Instant::now() < end, "the new client was never served");
        rx.progress(Some(Duration::from_millis(1))).unwrap();
        tx2.progress(Some(Duration::ZERO)).unwrap();
        if let Some((_, tag)) = rx.take_unexpected(rid, &mut buf).unwrap() {
            assert_eq!((tag, buf.as_slice()), (100, &b"hello"[..]));
            break;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
