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

/// A node in pull mode (progressing as `mode` says) and `senders` peer
/// processes flooding it with `count` messages each; `None` if the
/// transport has no pull mode (its refusal checked).
fn flooded_pull_node(
    t: &Transport,
    mode: ProgressMode,
    senders: usize,
    count: u32,
) -> Option<(Node, Vec<PeerProc>)> {
    let mut n = Node::new(t, mode, true);
    if !enter_pull_mode(t, &mut n, None) {
        return None;
    }
    let me = n.ep.self_addr(n.id).expect("self addr");
    let floods = (0..senders)
        .map(|_| PeerProc::spawn(t, &["flood", me.uri(), &count.to_string()]))
        .collect();
    Some((n, floods))
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
    const N: u32 = 40;
    let Some((mut n, mut floods)) = flooded_pull_node(t, ProgressMode::Busy, 1, N) else {
        return;
    };
    let flood = &mut floods[0];
    let me = n.ep.self_addr(n.id).expect("self addr");
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

/// Two peers flood a busy node in pull mode at once: peers take turns and
/// the transport may skip scans it knows are empty (na-sm keeps a count of
/// waiting heads), yet every message must come, from the right sender, in
/// that sender's order, and the senders must interleave.
pub fn pull_mode_two_senders_interleave_and_lose_nothing(t: &Transport) {
    const N: u32 = 200;
    let Some((mut n, floods)) = flooded_pull_node(t, ProgressMode::Busy, 2, N) else {
        return;
    };
    // Both connected, then a moment without taking: each fills its ring,
    // so the takes below must take turns between two waiting senders.
    let end = Instant::now() + n.timeout;
    while n.stats().peers < 2 {
        assert!(
            Instant::now() < end,
            "the flooding peers did not connect: {:?}",
            n.stats()
        );
        n.pump(Duration::from_millis(10));
    }
    let settle = Instant::now() + Duration::from_millis(200);
    while Instant::now() < settle {
        n.pump(Duration::from_millis(10));
    }
    let mut buf = Vec::new();
    let mut by_source: Vec<(String, Vec<Tag>)> = Vec::new();
    let (mut switches, mut last) = (0, None::<String>);
    let end = Instant::now() + n.timeout * 4;
    while by_source.iter().map(|(_, v)| v.len()).sum::<usize>() < 2 * N as usize {
        let Some((src, tag)) = n.ep.take_unexpected(n.id, &mut buf).expect("take") else {
            assert!(Instant::now() < end, "only {by_source:?} taken");
            n.pump(Duration::from_millis(10));
            continue;
        };
        let from = src.uri().to_owned();
        assert_eq!(buf, flood_payload(tag), "message {tag} from {from}");
        if last.as_ref() != Some(&from) {
            switches += 1;
            last = Some(from.clone());
        }
        match by_source.iter_mut().find(|(u, _)| *u == from) {
            Some((_, tags)) => tags.push(tag),
            None => by_source.push((from, vec![tag])),
        }
    }
    assert_eq!(by_source.len(), 2, "two senders: {by_source:?}");
    for (uri, tags) in &by_source {
        assert!(
            tags.iter().copied().eq(0..N),
            "{uri}: tags out of order or missing: {tags:?}"
        );
    }
    assert!(
        switches > 2,
        "the senders never interleaved ({switches} switches)"
    );
    eprintln!(
        "{}: 2 x {N} messages, the sender changed {switches} times",
        t.name
    );
    drop(floods);
}

/// A busy node in pull mode with more peers than na-sm's spin loop lists
/// on the stack (it watches every ring head while it waits): each peer in
/// turn, out of order, answers a request a few milliseconds late, so the
/// reply arrives while the node spins on every head. The progress call
/// that reports the reply must leave it ready to take at once (the spin
/// loop names the ring it saw change), from the right peer, intact.
pub fn pull_mode_spin_over_many_peers_finds_each_reply(t: &Transport) {
    const PEERS: usize = 6;
    let servers: Vec<PeerProc> = (0..PEERS).map(|_| PeerProc::spawn(t, &["server"])).collect();
    let mut n = Node::new(t, ProgressMode::Busy, false);
    let addrs: Vec<Addr> = servers
        .iter()
        .map(|s| n.ep.lookup(&s.uri).expect("lookup"))
        .collect();
    if !enter_pull_mode(t, &mut n, Some(&addrs[0])) {
        return;
    }
    let mut buf = Vec::new();
    for round in 0..4 * PEERS {
        // 5 is coprime with 6: every peer, in a scrambled order.
        let k = (round * 5 + 3) % PEERS;
        let tag = 1000 + round as u32;
        let mut late = vec![b'z'];
        late.extend_from_slice(&3u32.to_le_bytes());
        let mut echo = vec![b'u'];
        echo.extend_from_slice(&tag.to_le_bytes());
        echo.resize(40 + round * 7, round as u8);
        for m in [&late, &echo] {
            let op = n.op();
            n.ep.send_unexpected(&addrs[k], tag, m, op).expect("send");
            n.wait(op);
        }
        let end = Instant::now() + n.timeout;
        let (src, got) = loop {
            assert!(
                Instant::now() < end,
                "round {round}: no reply from peer {k} within {:?}",
                n.timeout
            );
            if n.ep.progress(Some(Duration::from_millis(100))).expect("progress") == 0 {
                continue;
            }
            while let Some(c) = n.ep.pop_completion() {
                n.stash.insert(c.op, c);
            }
            // Reported: it must be there to take now.
            break n
                .ep
                .take_unexpected(n.id, &mut buf)
                .expect("take")
                .unwrap_or_else(|| panic!("round {round}: progress reported work, but nothing to take"));
        };
        assert_eq!(
            src.uri(),
            servers[k].uri,
            "round {round}: reply from the wrong peer"
        );
        assert_eq!((got, &buf), (tag, &echo), "round {round}");
    }
    assert!(n.ep.take_unexpected(n.id, &mut buf).expect("take").is_none());
}

/// A node driven the way an async runtime drives it in pull mode: progress,
/// take everything waiting, then `try_wait` and sleep on the endpoint's fd
/// (no progress call between the takes and the sleep). A peer floods far
/// more messages than a ring holds, and the node dawdles after each
/// wake-up, so the sender fills the ring and runs out of room again and
/// again: the node must hand back what it read before it sleeps, or the
/// sender waits for room while the node waits for messages.
pub fn pull_mode_sleeping_after_takes_returns_room(t: &Transport) {
    use std::os::fd::AsFd;
    const N: u32 = 1000;
    let Some((mut n, floods)) = flooded_pull_node(t, ProgressMode::Blocking, 1, N) else {
        return;
    };
    let poll = na_core::sys::epoll::Epoll::new().expect("epoll");
    // Edge-triggered, as tokio waits: readiness left over from earlier
    // events does not wake it again.
    poll.add_edge_triggered(n.ep.as_fd(), 0)
        .expect("watch the endpoint fd");
    let (mut buf, mut tokens, mut next) = (Vec::new(), Vec::new(), 0u32);
    while next < N {
        n.ep.progress_now().expect("progress_now");
        while let Some((_, tag)) = n.ep.take_unexpected(n.id, &mut buf).expect("take") {
            assert_eq!(tag, next, "in order");
            assert_eq!(buf, flood_payload(tag));
            next += 1;
        }
        if next < N && n.ep.try_wait().expect("try_wait") {
            tokens.clear();
            let woke = poll.wait(&mut tokens, Some(n.timeout)).expect("epoll_wait");
            assert!(
                woke > 0,
                "stalled after {next} of {N} messages: the sender waits for room ({:?})",
                n.stats()
            );
            // A runtime thread busy elsewhere: the sender fills the ring.
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    drop(floods);
}
