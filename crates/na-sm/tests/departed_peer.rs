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

/// A listening endpoint in `mode` whose plugin holds at most `total`
/// queued messages over all peers and keeps departed peers' expected
/// messages for `hold` (default when `None`); with its plugin and URI.
fn bounded_listener(
    dir: &std::path::Path,
    mode: ProgressMode,
    total: usize,
    hold: Option<Duration>,
) -> (Endpoint, PluginId, String) {
    let defaults = SmConfig::default();
    let cfg = SmConfig {
        listen: true,
        max_queued_total: total,
        departed_hold: hold.unwrap_or(defaults.departed_hold),
        ..defaults
    }
    .with_dir(dir);
    let mut rx = Endpoint::new(mode).unwrap();
    let rid = rx
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let uri = rx.self_addr(rid).unwrap().uri().to_owned();
    (rx, rid, uri)
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
    assert!(
        matches!(e, NaError::PeerGone { .. }),
        "{}",
        na_core::ErrorChain(&e)
    );
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
    let (mut rx, rid, uri) = bounded_listener(&dir, ProgressMode::Busy, TOTAL, None);
    assert!(rx.pull_unexpected(rid).unwrap());
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
    // Over the bound: a new client is not accepted. Its connection waits
    // in the listener's queue once its lookup returns; the listener's
    // next look at it either pauses (counted in `flow_blocked`: nothing
    // else counts there now, with no peer connected) or accepts it (its
    // hello, sent with the connection, makes it a peer at once).
    let (mut tx2, _) = node(&dir, false);
    let blocked = rx.plugin(rid).unwrap().stats().flow_blocked;
    let to2 = tx2.lookup(&uri).unwrap();
    tx2.send_unexpected(&to2, 100, b"hello", OpId(1)).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let stats = rx.plugin(rid).unwrap().stats();
        if stats.flow_blocked > blocked || stats.peers > 0 {
            break;
        }
        assert!(
            Instant::now() < end,
            "the listener never looked at the new client"
        );
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

/// A listener paused because departed peers left too many expected
/// messages (`max_queued_total`) goes on when they are dropped at the end
/// of `departed_hold`, also while the process sleeps with nothing else to
/// do: the drop is on the plugin's timer. Before, it waited for a
/// periodic poll that an idle process never makes, and a new client's
/// handshake timed out.
#[test]
fn a_listener_paused_for_departed_peers_messages_goes_on_while_idle() {
    const TOTAL: usize = 4;
    let dir = fresh_dir("qs-sm-departed-idle");
    let (mut rx, rid, uri) = bounded_listener(
        &dir,
        ProgressMode::Blocking,
        TOTAL,
        Some(Duration::from_millis(300)),
    );
    let stats = |rx: &Endpoint| rx.plugin(rid).unwrap().stats();
    {
        let (mut tx, _) = node(&dir, false);
        let to = tx.lookup(&uri).unwrap();
        for i in 0..=TOTAL as u32 {
            tx.send_expected(&to, 9, &i.to_le_bytes(), OpId(u64::from(i)))
                .unwrap();
        }
        let end = Instant::now() + Duration::from_secs(10);
        // Flow control leaves the rest in its ring, taken whole when it goes.
        while stats(&rx).queued_arrivals < TOTAL as u64 {
            assert!(Instant::now() < end, "the messages never arrived");
            tx.progress(Some(Duration::ZERO)).unwrap();
            rx.progress(Some(Duration::from_millis(1))).unwrap();
        }
    }
    let end = Instant::now() + Duration::from_secs(10);
    while stats(&rx).peers > 0 {
        assert!(Instant::now() < end, "the sender's end was not seen");
        rx.progress(Some(Duration::from_millis(1))).unwrap();
    }
    assert!(stats(&rx).queued_arrivals > TOTAL as u64, "{:?}", stats(&rx));
    // A new client comes while the messages are still held: the listener
    // pauses (nothing refused: the client waits in the kernel's queue).
    let client = std::thread::spawn({
        let dir = dir.clone();
        let uri = uri.clone();
        move || {
            let (mut tx, _) = node(&dir, false);
            let to = tx.lookup(&uri).unwrap();
            tx.send_unexpected(&to, 5, b"let me in", OpId(1)).unwrap();
            let end = Instant::now() + Duration::from_secs(15);
            loop {
                if let Some(c) = std::iter::from_fn(|| tx.pop_completion()).find(|c| c.op == OpId(1)) {
                    // Kept until the server took it (the ring goes with us).
                    std::thread::sleep(Duration::from_millis(500));
                    return c.status;
                }
                if Instant::now() > end {
                    return Err(NaError::Canceled);
                }
                tx.progress(Some(Duration::from_millis(5))).unwrap();
            }
        }
    });
    rx.post_recv_unexpected(rid, Vec::new(), OpId(50)).unwrap();
    let since = Instant::now();
    // Idle: each progress call may sleep far past the hold.
    let got = loop {
        assert!(
            since.elapsed() < Duration::from_secs(8),
            "the new client was not served: {:?}",
            stats(&rx)
        );
        rx.progress(Some(Duration::from_secs(20))).unwrap();
        if let Some(c) = std::iter::from_fn(|| rx.pop_completion()).find(|c| c.op == OpId(50)) {
            break c;
        }
    };
    let took = since.elapsed();
    assert!(took < Duration::from_secs(8), "served only after {took:?}");
    assert_eq!(got.buf.as_deref(), Some(&b"let me in"[..]));
    assert_eq!(
        stats(&rx).queued_arrivals,
        0,
        "the departed peer's messages were not dropped"
    );
    client.join().unwrap().expect("the client's send");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Expected messages a departed peer left go at the end of
/// `departed_hold` while the process sleeps on its fd with nothing else
/// to do: the plugin's timer wakes it, and its firing alone is reason
/// enough for the deadline sweep (reading the timer disarms it).
#[test]
fn departed_peers_messages_go_at_the_hold_while_the_process_sleeps() {
    use std::os::fd::AsFd;
    let dir = fresh_dir("qs-sm-departed-sleep");
    let (mut rx, rid) = node(&dir, true);
    let uri = rx.self_addr(rid).unwrap().uri().to_owned();
    let queued = |rx: &Endpoint| rx.plugin(rid).unwrap().stats().queued_arrivals;
    {
        let (mut tx, _) = node(&dir, false);
        let to = tx.lookup(&uri).unwrap();
        for i in 0..3u32 {
            tx.send_expected(&to, 9, &i.to_le_bytes(), OpId(u64::from(i)))
                .unwrap();
        }
        let end = Instant::now() + Duration::from_secs(10);
        while queued(&rx) < 3 {
            assert!(Instant::now() < end, "the messages never arrived");
            tx.progress(Some(Duration::ZERO)).unwrap();
            rx.progress(Some(Duration::from_millis(1))).unwrap();
        }
    }
    let end = Instant::now() + Duration::from_secs(10);
    while rx.plugin(rid).unwrap().stats().peers > 0 {
        assert!(Instant::now() < end, "the sender's end was not seen");
        rx.progress(Some(Duration::from_millis(1))).unwrap();
    }
    assert_eq!(queued(&rx), 3);
    let sleeper = na_core::sys::epoll::Epoll::new().unwrap();
    sleeper.add(rx.as_fd(), 0).unwrap();
    let mut tokens = Vec::new();
    let since = Instant::now();
    while queued(&rx) > 0 {
        assert!(
            since.elapsed() < Duration::from_secs(5),
            "kept past the hold while asleep: {:?}",
            rx.plugin(rid).unwrap().stats()
        );
        // As an event loop sleeps: far longer than the hold each time.
        if rx.try_wait().expect("try_wait") {
            sleeper.wait(&mut tokens, Some(Duration::from_secs(20))).unwrap();
        }
        rx.progress(Some(Duration::ZERO)).unwrap();
    }
    let took = since.elapsed();
    assert!(took < Duration::from_secs(5), "dropped only after {took:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Messages a departed peer left have a share of `max_queued_total` of
/// their own (they pause the listener): they do not stop the draining of
/// a peer still connected, whose messages are read and queued as if they
/// were not there. Both with a blocking wait (the draining decision made
/// when arming) and with polls alone.
#[test]
fn departed_peers_messages_do_not_stop_a_connected_peers_draining() {
    const TOTAL: usize = 4;
    for blocking in [true, false] {
        let dir = fresh_dir(&format!("qs-sm-departed-share-{blocking}"));
        let (mut rx, rid, uri) =
            bounded_listener(&dir, ProgressMode::Blocking, TOTAL, Some(Duration::from_secs(60)));
        let stats = |rx: &Endpoint| rx.plugin(rid).unwrap().stats();
        let pump = |rx: &mut Endpoint| {
            let wait = if blocking {
                Duration::from_millis(2)
            } else {
                Duration::ZERO
            };
            rx.progress(Some(wait)).unwrap();
        };
        let end = Instant::now() + Duration::from_secs(10);
        // B connects first and stays.
        let (mut b, _) = node(&dir, false);
        let to_b = b.lookup(&uri).unwrap();
        b.send_expected(&to_b, 7, b"b0", OpId(1)).unwrap();
        while stats(&rx).queued_arrivals < 1 {
            assert!(Instant::now() < end, "B's first message never arrived");
            b.progress(Some(Duration::ZERO)).unwrap();
            pump(&mut rx);
        }
        // A sends past the bound and goes: its ring is taken whole.
        {
            let (mut a, _) = node(&dir, false);
            let to_a = a.lookup(&uri).unwrap();
            for i in 0..=TOTAL as u32 {
                a.send_expected(&to_a, 9, &i.to_le_bytes(), OpId(u64::from(i)))
                    .unwrap();
            }
            while stats(&rx).peers < 2 {
                assert!(Instant::now() < end, "A never connected");
                a.progress(Some(Duration::ZERO)).unwrap();
                pump(&mut rx);
            }
        }
        while stats(&rx).peers > 1 {
            assert!(Instant::now() < end, "A's end was not seen");
            pump(&mut rx);
        }
        let departed = stats(&rx).queued_arrivals - 1;
        assert!(departed > TOTAL as u64, "{:?}", stats(&rx));
        // B's next messages are read and queued although the total is
        // past the bound: its own share is 1 of TOTAL.
        for i in 1..3u64 {
            b.send_expected(&to_b, 7, format!("b{i}").as_bytes(), OpId(1 + i))
                .unwrap();
        }
        while stats(&rx).queued_arrivals < departed + 3 {
            assert!(
                Instant::now() < end,
                "B's messages were left in its ring (blocking wait: {blocking}): {:?}",
                stats(&rx)
            );
            b.progress(Some(Duration::ZERO)).unwrap();
            pump(&mut rx);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
