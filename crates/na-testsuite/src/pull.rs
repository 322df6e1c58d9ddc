//! Pull mode (`Plugin::pull_unexpected`): unexpected messages wait in the
//! transport until taken, with no posted receive and no completion. A
//! transport without pull mode must refuse it cleanly and keep working.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use na_core::{Addr, ProgressMode, Tag};

use crate::{flood_payload, Node, PeerProc, Transport};

/// Switches `n` to pull mode; false (after checking that the refusal
/// changed nothing) if the transport has none.
fn enter_pull_mode(t: &Transport, n: &mut Node, server: Option<&Addr>) -> bool {
    if n.ep.pull_unexpected(n.id).expect("pull_unexpected") {
        return true;
    }
    eprintln!(
        "{}: no pull mode; checking only that it is refused and posted receives still work",
        t.name
    );
    if let Some(addr) = server {
        let r = n.op();
        n.ep.post_recv_unexpected(n.id, Vec::new(), r).expect("post");
        let s = n.op();
        n.ep.send_unexpected(addr, 3, b"u-after-refusal", s)
            .expect("send");
        assert_eq!(n.wait(r).buf.expect("buf"), b"u-after-refusal");
    }
    false
}

/// Takes one message, progressing (as the node's mode says: a blocking
/// node sleeps and must be woken) until one waits.
fn take(n: &mut Node, buf: &mut Vec<u8>) -> (Addr, Tag) {
    let end = Instant::now() + n.timeout;
    loop {
        if let Some(m) = n.ep.take_unexpected(n.id, buf).expect("take") {
            return m;
        }
        assert!(
            Instant::now() < end,
            "no unexpected message within {:?}",
            n.timeout
        );
        n.pump(Duration::from_millis(100));
    }
}

/// A blocking node in pull mode: 300 unexpected echoes of every size class
/// (inline, buffered, the maximum), up to 50 in flight, taken in order and
/// intact, with expected replies between them as completions; the node
/// sleeps between messages and is woken for them. A peer's messages stay
/// in order across kinds (an expected message waits behind an unexpected
/// one not yet taken). Posting an unexpected receive is refused; choosing
/// pull mode once receives are posted is refused; an idle node sleeps its
/// full timeout.
pub fn pull_mode_messages(t: &Transport) {
    let server = PeerProc::spawn(t, &["server"]);
    // Refused once a receive is posted.
    let mut late = Node::new(t, ProgressMode::Blocking, false);
    let r = late.op();
    late.ep
        .post_recv_unexpected(late.id, Vec::new(), r)
        .expect("post");
    assert!(
        !matches!(late.ep.pull_unexpected(late.id), Ok(true)),
        "pull mode chosen after a receive was posted"
    );
    drop(late);

    let mut n = Node::new(t, ProgressMode::Blocking, false);
    let addr = n.ep.lookup(&server.uri).expect("lookup");
    if !enter_pull_mode(t, &mut n, Some(&addr)) {
        return;
    }
    let op = n.op();
    assert!(
        n.ep.post_recv_unexpected(n.id, Vec::new(), op).is_err(),
        "posting an unexpected receive in pull mode"
    );
    let max = n.ep.plugin(n.id).expect("plugin").max_unexpected_size();
    let msg = |i: u32| {
        let len = match i % 5 {
            0 => 3,
            1 => 64,
            2 => 300,
            3 => max,
            _ => 9 + (i as usize * 53) % 2000,
        };
        let mut m = vec![b'u'];
        m.extend_from_slice(&i.to_le_bytes());
        m.resize(len, i as u8 ^ 0x5a);
        m
    };
    const TOTAL: u32 = 300;
    const WINDOW: u32 = 50;
    let mut buf = Vec::new();
    let (mut sent, mut done) = (0u32, 0u32);
    let mut wanted = VecDeque::new();
    while done < TOTAL {
        // Every 50 messages the window drains, and an expected request
        // goes out alone: expected replies still come as completions.
        let stop = (done / 50 + 1) * 50;
        while sent < TOTAL.min(stop) && sent - done < WINDOW {
            let s = n.op();
            n.ep.send_unexpected(&addr, sent, &msg(sent), s).expect("send");
            wanted.push_back(sent);
            sent += 1;
        }
        let (src, tag) = take(&mut n, &mut buf);
        let i = wanted.pop_front().expect("a message was sent");
        assert_eq!((src, tag), (addr.clone(), i), "message {i}: source and tag");
        assert!(buf == msg(i), "message {i} corrupted ({} bytes)", buf.len());
        done += 1;
        if done % 50 == 0 {
            let e = [b'e', done as u8, 1, 2, 3];
            assert_eq!(n.request(&addr, 900_000 + done, &e), e);
        }
    }
    // A peer's messages stay in order across both kinds: an expected reply
    // sent after an unexpected message waits until that one is taken.
    let r = n.op();
    n.ep.post_recv_expected(&addr, 77, Vec::new(), r).expect("post");
    for (i, m) in [&b"u-first"[..], &b"e-second"[..]].into_iter().enumerate() {
        let s = n.op();
        n.ep.send_unexpected(&addr, 77, m, s).expect("send");
        if i == 0 {
            // The echo is in our ring before the request goes out.
            while !n.ep.plugin(n.id).expect("plugin").unexpected_ready() {
                n.pump(Duration::from_millis(10));
            }
        }
    }
    let end = Instant::now() + Duration::from_millis(300);
    while Instant::now() < end {
        n.pump(Duration::from_millis(10));
    }
    assert!(
        !n.stash.contains_key(&r),
        "an expected reply overtook an unexpected message"
    );
    assert_eq!(take(&mut n, &mut buf).1, 77);
    assert_eq!(buf, b"u-first");
    assert_eq!(n.wait(r).buf.expect("buf"), b"e-second");
    assert!(n.ep.take_unexpected(n.id, &mut buf).expect("take").is_none());
    let t0 = Instant::now();
    let ready = n.ep.progress(Some(Duration::from_millis(150))).expect("progress");
    assert_eq!(ready, 0, "nothing waits");
    assert!(t0.elapsed() >= Duration::from_millis(140), "an idle node sleeps");
    let st = n.stats();
    assert_eq!(st.msgs_received, u64::from(TOTAL + TOTAL / 50 + 2), "{st:?}");
}

/// Messages that a peer sent before it exited are still taken, in order,
/// after the transport noticed it is gone (they must not go down with its
/// connection).
pub fn pull_mode_keeps_messages_of_an_exited_peer(t: &Transport) {
    let mut n = Node::new(t, ProgressMode::Busy, true);
    if !enter_pull_mode(t, &mut n, None) {
        return;
    }
    let me = n.ep.self_addr(n.id).expect("self addr");
    const N: u32 = 40;
    let mut flood = PeerProc::spawn(t, &["flood", me.uri(), &N.to_string()]);
    // Progress (accepting the peer, perhaps after it exited) without
    // taking, until it exited, its connection is gone, and its messages
    // wait to be taken.
    let end = Instant::now() + n.timeout;
    loop {
        let ready = n.ep.plugin(n.id).expect("plugin").unexpected_ready();
        if flood.exited() && n.stats().peers == 0 && ready {
            break;
        }
        assert!(
            Instant::now() < end,
            "the flooding peer did not finish and go: {:?}",
            n.stats()
        );
        n.pump(Duration::from_millis(10));
    }
    let mut buf = Vec::new();
    for i in 0..N {
        let (src, tag) =
            n.ep.take_unexpected(n.id, &mut buf)
                .expect("take")
                .unwrap_or_else(|| panic!("message {i} of the exited peer was lost ({:?})", n.stats()));
        assert_eq!(tag, i);
        assert_eq!(buf, flood_payload(i), "message {i}");
        assert_eq!(src.scheme(), me.scheme(), "{src}");
    }
    assert!(n.ep.take_unexpected(n.id, &mut buf).expect("take").is_none());
}
