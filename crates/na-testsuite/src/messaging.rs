//! Lookup, both message kinds, tags, sizes, backpressure, plugin-provided
//! message buffers, cancel, many clients.

use std::collections::HashSet;
use std::io::Write;
use std::time::Duration;

use na_core::{Access, MemHandle, NaError, OpId, OpKind, ProgressMode, Report, Rma};

use crate::{Node, PeerProc, Transport};

/// Lookup (idempotent, address bytes round trip, unreachable and malformed
/// addresses fail clearly) and unexpected messages both ways.
pub fn lookup_and_unexpected(t: &Transport) {
    let server = PeerProc::spawn(t, &["server"]);
    let mut n = Node::new(t, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).expect("lookup");
    assert_eq!(addr.uri(), server.uri);
    assert_eq!(
        n.ep.lookup(&server.uri).expect("lookup"),
        addr,
        "a second lookup names the same peer"
    );
    assert_eq!(n.ep.addr_from_bytes(&addr.to_bytes()).expect("from bytes"), addr);
    assert_ne!(addr, n.ep.self_addr(n.id).expect("self"));
    let e = n.ep.lookup(&t.malformed_uri).expect_err("malformed address");
    assert!(
        matches!(e, NaError::InvalidAddress { .. } | NaError::NoPlugin { .. }),
        "{e}"
    );
    // Nobody at this address: lookup fails, or the first operation does.
    match n.ep.lookup(&t.unreachable_uri) {
        Err(e) => assert!(!e.to_string().is_empty()),
        Ok(a) => {
            let op = n.op();
            match n.ep.send_unexpected(&a, 1, b"anyone?", op) {
                Err(e) => eprintln!("{}: send to nobody refused at once: {e}", t.name),
                Ok(()) => {
                    let e = n.wait(op).status.expect_err("a send to nobody must fail");
                    eprintln!("{}: send to nobody completed with: {e}", t.name);
                }
            }
        }
    }
    // Unexpected both ways: the server echoes `u` messages unexpected.
    for round in 0..20u32 {
        let r = n.op();
        n.ep.post_recv_unexpected(n.id, Vec::new(), r).expect("post");
        let s = n.op();
        let msg = [b'u', round as u8, 42];
        n.ep.send_unexpected(&addr, round, &msg, s).expect("send");
        let c = n.wait(r);
        assert_eq!(c.kind, OpKind::RecvUnexpected);
        c.status.expect("receive");
        assert_eq!(
            (c.buf.expect("buf"), c.source.expect("source"), c.tag),
            (msg.to_vec(), addr.clone(), round)
        );
        n.wait(s).status.expect("send");
    }
    assert_eq!(n.stats().peers, 1);
}

/// Expected messages matched on (source, tag): replies in another order
/// than the receives were posted, and one that arrives before its receive.
pub fn expected_and_tags(t: &Transport) {
    let server = PeerProc::spawn(t, &["server"]);
    let mut n = Node::new(t, ProgressMode::Blocking, false);
    let addr = n.ep.lookup(&server.uri).expect("lookup");
    for i in 0..50u32 {
        let msg = [b'e', i as u8, 7, 7];
        assert_eq!(n.request(&addr, i, &msg), msg);
    }
    let max_tag = n.ep.plugin(n.id).expect("plugin").max_tag();
    assert_eq!(n.request(&addr, max_tag, b"emax-tag"), b"emax-tag");
    let mut recvs = Vec::new();
    for tag in 1..=5u32 {
        let r = n.op();
        n.ep.post_recv_expected(&addr, tag, Vec::new(), r).expect("post");
        recvs.push((tag, r));
    }
    let mut cmd = vec![b'o'];
    for tag in (1..=5u32).rev() {
        cmd.extend_from_slice(&tag.to_le_bytes());
    }
    let s = n.op();
    n.ep.send_unexpected(&addr, 0, &cmd, s).expect("send");
    for (tag, r) in recvs {
        let c = n.wait(r);
        assert_eq!((c.tag, c.buf.expect("buf")), (tag, tag.to_le_bytes().to_vec()));
    }
    // An expected message that arrives before its receive is kept.
    let s = n.op();
    n.ep.send_unexpected(&addr, 900, b"eearly", s).expect("send");
    n.wait(s).status.expect("send");
    std::thread::sleep(Duration::from_millis(100));
    for _ in 0..20 {
        n.pump(Duration::from_millis(10));
    }
    let r = n.op();
    n.ep.post_recv_expected(&addr, 900, Vec::new(), r).expect("post");
    assert_eq!(n.wait(r).buf.expect("buf"), b"eearly");
}

/// Zero-byte and maximum-size messages both ways; one byte more is refused
/// at once and starts nothing.
pub fn sizes(t: &Transport) {
    let server = PeerProc::spawn(t, &["server"]);
    let mut n = Node::new(t, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).expect("lookup");
    let plugin = n.ep.plugin(n.id).expect("plugin");
    let max = plugin.max_unexpected_size();
    assert!(max >= 4096, "{max}");
    assert_eq!(plugin.max_expected_size(), max);
    assert_eq!(n.request(&addr, 1, &[]), Vec::<u8>::new(), "zero bytes both ways");
    let big: Vec<u8> = std::iter::once(b'e')
        .chain((1..max).map(|i| (i * 31) as u8))
        .collect();
    assert_eq!(n.request(&addr, 2, &big), big, "maximum size both ways");
    let mut too_big = big.clone();
    too_big.push(0);
    let op = n.op();
    let e =
        n.ep.send_unexpected(&addr, 3, &too_big, op)
            .expect_err("oversize");
    assert!(
        matches!(e, NaError::MessageTooLarge { len, max: m, .. } if len == max + 1 && m == max),
        "{e}"
    );
    let e = n.ep.send_expected(&addr, 3, &too_big, op).expect_err("oversize");
    assert!(e.to_string().contains(&(max + 1).to_string()), "{e}");
    n.pump(Duration::from_millis(50));
    assert!(!n.stash.contains_key(&op), "a refused send completes nothing");
}

/// 10,000 echo round trips with 1,000 in flight while the server first
/// stalls: sends beyond the transport's buffers or credits queue, then all
/// arrive, intact and in order.
pub fn backpressure(t: &Transport) {
    let server = PeerProc::spawn(t, &["server"]);
    let mut n = Node::new(t, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).expect("lookup");
    const TOTAL: u32 = 10_000;
    const WINDOW: u32 = 1_000;
    let msg = |i: u32| {
        let mut m = vec![b'e'];
        m.extend_from_slice(&i.to_le_bytes());
        m.resize(8 + (i as usize % 120), i as u8);
        m
    };
    let mut stall = vec![b'z'];
    stall.extend_from_slice(&300u32.to_le_bytes());
    n.ep.send_unexpected(&addr, u32::MAX, &stall, OpId(1 << 35))
        .expect("send");
    n.wait(OpId(1 << 35)).status.expect("stall");
    let (mut sent, mut done, mut max_in_flight) = (0u32, 0u32, 0);
    while done < TOTAL {
        while sent < TOTAL && sent - done < WINDOW {
            let i = u64::from(sent);
            n.ep.post_recv_expected(&addr, sent, Vec::new(), OpId(1 << 33 | i))
                .expect("post");
            n.ep.send_unexpected(&addr, sent, &msg(sent), OpId(1 << 34 | i))
                .expect("send");
            sent += 1;
        }
        max_in_flight = max_in_flight.max(n.stats().in_flight);
        let c = n.wait_for(OpId(1 << 33 | u64::from(done)), n.timeout * 3);
        assert_eq!(c.buf.expect("buf"), msg(done), "message {done}");
        n.wait(OpId(1 << 34 | u64::from(done))).status.expect("send");
        done += 1;
    }
    let st = n.stats();
    assert!(
        st.sends_queued > 0,
        "1,000 in flight must exceed the buffers: {st:?}"
    );
    assert!(max_in_flight >= u64::from(WINDOW), "{max_in_flight}");
    assert_eq!(st.msgs_sent, u64::from(TOTAL) + 1);
    assert_eq!(st.msgs_received, u64::from(TOTAL));
    assert_eq!(st.in_flight, 0);
}

/// Peers that stop reading cannot grow our memory: while two servers
/// sleep, sends fill the transport, then queue until the first server's
/// backlog reaches the per-peer bound (1 MiB here; 64 MiB by default) and
/// the second's reaches what is left of the bound of all backlogs together
/// (1.5 MiB here; 256 MiB by default); each next send fails at once with
/// `SendBacklogFull` (naming the peer and the bound, completing nothing,
/// counted). Once the servers read again, every send that was accepted
/// arrives intact and in order, the backlogs empty, and sends go again.
pub fn send_backlog_bound(t: &Transport) {
    let servers = [PeerProc::spawn(t, &["server"]), PeerProc::spawn(t, &["server"])];
    let (max, max_total) = (1 << 20, 3 << 19);
    let mut n = Node::bounded(t, ProgressMode::default(), max, max_total);
    let addrs: Vec<_> = servers
        .iter()
        .map(|s| n.ep.lookup(&s.uri).expect("lookup"))
        .collect();
    let size = n.ep.plugin(n.id).expect("plugin").max_unexpected_size().min(4096);
    let msg = |i: u32| {
        let mut m = vec![b'e'];
        m.extend_from_slice(&i.to_le_bytes());
        m.resize(size, i as u8);
        m
    };
    // Ids: sends to server k are 1 << (34 + 2k) | i, receives 1 << (35 + 2k) | i.
    let send_op = |k: usize, i: u32| OpId(1 << (34 + 2 * k) | u64::from(i));
    let recv_op = |k: usize, i: u32| OpId(1 << (35 + 2 * k) | u64::from(i));
    // Long enough to queue 1.5 MiB on a slow VM: a loaded soft-RoCE VM
    // once took 3.85 s (2 s was the stall then). The servers sleep it
    // out whatever the fill took, so it is what the test costs.
    let stall_ms = 6000u32;
    let mut stall = vec![b'z'];
    stall.extend_from_slice(&stall_ms.to_le_bytes());
    let stalled_at = std::time::Instant::now();
    for (k, a) in addrs.iter().enumerate() {
        n.ep.send_unexpected(a, u32::MAX, &stall, OpId(1 << 42 | k as u64))
            .expect("send");
        n.wait(OpId(1 << 42 | k as u64)).status.expect("stall");
    }
    let charge = size + na_core::backlog::QUEUED_SEND_OVERHEAD;
    let limit = 2 * (max_total / charge) as u32 + 10_000;
    let mut accepted = [0u32; 2];
    let mut refusals = Vec::new();
    for (k, a) in addrs.iter().enumerate() {
        let refusal = loop {
            let i = accepted[k];
            assert!(i < limit, "{i} sends to server {k}, no SendBacklogFull");
            match n.ep.send_unexpected(a, i, &msg(i), send_op(k, i)) {
                Ok(()) => accepted[k] += 1,
                Err(e) => break e,
            }
        };
        refusals.push(refusal);
    }
    let filled_in = stalled_at.elapsed();
    assert!(
        filled_in < Duration::from_millis(u64::from(stall_ms)),
        "the backlogs took {filled_in:?} to fill, longer than the servers' stall: the bounds were not tested"
    );
    let mut queued_bytes = 0;
    for (k, (e, (srv, bound, scope))) in refusals
        .into_iter()
        .zip([(0, max, "to this peer"), (1, max_total, "to all peers")])
        .enumerate()
    {
        let NaError::SendBacklogFull {
            peer,
            queued,
            bytes,
            max: b,
            scope: sc,
        } = e
        else {
            panic!("server {k}: {e}");
        };
        assert_eq!((peer.as_str(), b, sc), (servers[srv].uri.as_str(), bound, scope));
        assert!(bytes <= bound && bytes + charge > bound, "{bytes} of {bound}");
        assert!(
            queued < accepted[k] as usize,
            "some went straight to the transport"
        );
        queued_bytes += queued * charge;
        if k == 0 {
            assert_eq!(
                bytes,
                queued * charge,
                "each queued send is charged payload + overhead"
            );
        } else {
            assert_eq!(bytes, queued_bytes, "the total counts both backlogs");
        }
    }
    let st = n.stats();
    assert_eq!(st.sends_refused, 2, "{st:?}");
    assert_eq!(st.backlog_bytes, queued_bytes as u64, "{st:?}");
    n.pump(Duration::from_millis(20));
    for (k, &count) in accepted.iter().enumerate() {
        assert!(
            !n.stash.contains_key(&send_op(k, count)),
            "a refused send completes nothing"
        );
    }
    // The servers read again: everything accepted is echoed, in order.
    for (k, a) in addrs.iter().enumerate() {
        for i in 0..accepted[k] {
            n.ep.post_recv_expected(a, i, Vec::new(), recv_op(k, i))
                .expect("post");
        }
    }
    for (k, &count) in accepted.iter().enumerate() {
        for i in 0..count {
            let c = n.wait_for(recv_op(k, i), n.timeout * 3);
            assert_eq!(c.buf.expect("buf"), msg(i), "server {k} message {i}");
            n.wait(send_op(k, i)).status.expect("send");
        }
    }
    let st = n.stats();
    assert_eq!(st.backlog_bytes, 0, "{st:?}");
    // Sending goes on (the refused messages were never sent: new ones are).
    for (k, a) in addrs.iter().enumerate() {
        let i = accepted[k];
        n.ep.post_recv_expected(a, i, Vec::new(), recv_op(k, i))
            .expect("post");
        n.ep.send_unexpected(a, i, &msg(i), send_op(k, i))
            .expect("send after the backlog drained");
        assert_eq!(n.wait(recv_op(k, i)).buf.expect("buf"), msg(i));
    }
    let total: u32 = accepted.iter().sum();
    assert_eq!(n.stats().msgs_received, u64::from(total) + 2);
}

/// Plugin-provided message buffers: 2,000 requests of up to the maximum
/// size built in them and sent with `send_unexpected_buf`, 200 in flight
/// (beyond the transport's buffers or credits, so some wait queued), each
/// echoed intact from a buffer of the server's; an expected message sent
/// from one; buffers are reused (the stream touches a bounded set); an
/// oversize buffer is refused; a plugin with registered buffers sends every
/// one of them without a copy, the others copy; the buffer of a refused
/// send goes back to the pool.
pub fn msg_bufs(t: &Transport) {
    let server = PeerProc::spawn(t, &["server"]);
    let mut n = Node::new(t, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).expect("lookup");
    let max = n.ep.plugin(n.id).expect("plugin").max_unexpected_size();
    let e = n.ep.alloc_msg_buf(&addr, max + 1).expect_err("oversize buffer");
    assert!(
        matches!(e, NaError::MessageTooLarge { len, .. } if len == max + 1),
        "{e}"
    );
    let msg = |i: u32| {
        let len = match i % 4 {
            0 => max,
            1 => 5,
            2 => 200,
            _ => 1000 + (i as usize * 37) % 3000,
        };
        let mut m = vec![b'b'];
        m.extend_from_slice(&i.to_le_bytes());
        m.resize(len.min(max), (i * 7) as u8);
        m
    };
    const TOTAL: u32 = 2_000;
    const WINDOW: u32 = 200;
    let mut seen = HashSet::new();
    let (mut sent, mut done) = (0u32, 0u32);
    while done < TOTAL {
        while sent < TOTAL && sent - done < WINDOW {
            let i = u64::from(sent);
            n.ep.post_recv_expected(&addr, sent, Vec::new(), OpId(1 << 33 | i))
                .expect("post");
            let mut b = n.ep.alloc_msg_buf(&addr, max).expect("alloc");
            assert!(b.is_empty() && b.capacity() >= max, "{b:?}");
            seen.insert(b.memory().bytes().as_ptr() as usize);
            b.write_all(&msg(sent)).expect("a message fits its buffer");
            n.ep.send_unexpected_buf(&addr, sent, b, OpId(1 << 34 | i))
                .expect("send");
            sent += 1;
        }
        let c = n.wait_for(OpId(1 << 33 | u64::from(done)), n.timeout * 3);
        assert_eq!(c.buf.expect("buf"), msg(done), "message {done}");
        n.wait(OpId(1 << 34 | u64::from(done))).status.expect("send");
        done += 1;
    }
    assert!(
        seen.len() <= 2 * WINDOW as usize,
        "{} distinct buffers for {TOTAL} messages: buffers are not reused",
        seen.len()
    );
    let st = n.stats();
    let want = if t.zero_copy_msg_bufs { u64::from(TOTAL) } else { 0 };
    assert_eq!(st.sends_zero_copy, want, "sends without a copy: {st:?}");
    assert_eq!(st.in_flight, 0);
    // An expected message from a buffer: the server posts the receive,
    // then echoes what arrives in it as an unexpected message.
    let tag: u32 = 0x5eed;
    let mut p = vec![b'p'];
    p.extend_from_slice(&tag.to_le_bytes());
    assert_eq!(n.request(&addr, 1, &p), b"p");
    let r = n.op();
    n.ep.post_recv_unexpected(n.id, Vec::new(), r).expect("post");
    let mut b = n.ep.alloc_msg_buf(&addr, 64).expect("alloc");
    b.extend_from_slice(b"expected, from a buffer").expect("fits");
    let s = n.op();
    n.ep.send_expected_buf(&addr, tag, b, s).expect("send expected");
    n.wait(s).status.expect("expected send");
    let c = n.wait(r);
    assert_eq!(
        (c.tag, c.buf.expect("buf")),
        (tag, b"expected, from a buffer".to_vec())
    );
    // A refused send (here: under an id in flight) gives its buffer back
    // to the plugin's pool, not away with the error: the next one
    // allocated is that buffer.
    let held = n.op();
    n.ep.post_recv_unexpected(n.id, Vec::new(), held).expect("post");
    let mut b = n.ep.alloc_msg_buf(&addr, max).expect("alloc");
    b.extend_from_slice(b"refused").expect("fits");
    let at = b.memory().bytes().as_ptr() as usize;
    let e =
        n.ep.send_unexpected_buf(&addr, 1, b, held)
            .expect_err("an id in flight");
    assert!(matches!(e, NaError::OpInFlight(_)), "{e}");
    let again = n.ep.alloc_msg_buf(&addr, max).expect("alloc");
    assert_eq!(
        again.memory().bytes().as_ptr() as usize,
        at,
        "the refused send's buffer did not go back to the pool"
    );
    assert!(again.is_empty(), "a recycled buffer comes back empty");
    n.ep.cancel(n.id, held).expect("cancel");
    n.wait(held);
}

/// Gathered sends (`send_unexpected_parts`): messages whose parts have odd
/// lengths (so a transport that writes each part in place writes at
/// unaligned offsets), around the sizes where a transport changes how it
/// carries a message, up to the maximum, arrive as the exact
/// concatenation. With `Report::All` each send completes once; with
/// `Report::FailuresOnly` a success may go unreported, and whatever is
/// reported is a success. 600 quiet sends, 150 in flight (beyond the
/// transport's buffers, so some queue), all arrive intact and in order.
/// Parts over the maximum are refused at once and start nothing.
pub fn gathered_sends(t: &Transport) {
    let server = PeerProc::spawn(t, &["server"]);
    let mut n = Node::new(t, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).expect("lookup");
    let max = n.ep.plugin(n.id).expect("plugin").max_unexpected_size();
    // The first part starts with 'e': the server echoes the whole message
    // as an expected message under the same tag.
    let layout = |i: u32| -> Vec<usize> {
        match i % 8 {
            0 => vec![1, 0],
            1 => vec![3, 5, 17],
            2 => vec![32, 1],
            3 => vec![7, 113],
            4 => vec![7, 114],
            5 => vec![1, 0, 55, 0, 9],
            6 => vec![1000, 3000, max - 4000],
            _ => vec![13, 200 + i as usize % 900],
        }
    };
    let parts_of = |i: u32| -> Vec<Vec<u8>> {
        let sizes = layout(i);
        let total: usize = sizes.iter().sum();
        let whole: Vec<u8> = std::iter::once(b'e')
            .chain((1..total as u64).map(|k| crate::pattern2(i as u8, k)))
            .collect();
        let mut at = 0;
        sizes
            .into_iter()
            .map(|len| {
                at += len;
                whole[at - len..at].to_vec()
            })
            .collect()
    };
    let send = |n: &mut Node, i: u32, report: Report, op: OpId| {
        let parts = parts_of(i);
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        n.ep.send_unexpected_parts(&addr, i, &refs, op, report)
            .expect("send parts");
        parts.concat()
    };
    for i in 0..16u32 {
        let r = n.op();
        n.ep.post_recv_expected(&addr, i, Vec::new(), r).expect("post");
        let s = n.op();
        let report = if i % 2 == 0 {
            Report::All
        } else {
            Report::FailuresOnly
        };
        let whole = send(&mut n, i, report, s);
        assert_eq!(whole.len(), layout(i).iter().sum::<usize>());
        assert_eq!(
            n.wait(r).buf.expect("buf"),
            whole,
            "message {i} ({:?})",
            layout(i)
        );
        if report == Report::All {
            n.wait(s).status.expect("send");
        }
    }
    const TOTAL: u32 = 600;
    const WINDOW: u32 = 150;
    let (mut sent, mut done) = (0u32, 0u32);
    let mut wanted = std::collections::VecDeque::new();
    while done < TOTAL {
        while sent < TOTAL && sent - done < WINDOW {
            let tag = 1000 + sent;
            n.ep.post_recv_expected(&addr, tag, Vec::new(), OpId(1 << 33 | u64::from(sent)))
                .expect("post");
            let parts = parts_of(sent);
            let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            n.ep.send_unexpected_parts(
                &addr,
                tag,
                &refs,
                OpId(1 << 34 | u64::from(sent)),
                Report::FailuresOnly,
            )
            .expect("send parts");
            wanted.push_back(parts.concat());
            sent += 1;
        }
        let c = n.wait_for(OpId(1 << 33 | u64::from(done)), n.timeout * 3);
        assert_eq!(Some(c.buf.expect("buf")), wanted.pop_front(), "message {done}");
        done += 1;
    }
    n.pump(Duration::from_millis(50));
    for (op, c) in &n.stash {
        if op.0 & 1 << 34 != 0 {
            assert!(c.status.is_ok(), "a quiet send reported {:?}", c.status);
        }
    }
    let st = n.stats();
    assert_eq!(st.in_flight, 0, "{st:?}");
    let op = n.op();
    let e =
        n.ep.send_unexpected_parts(&addr, 1, &[&vec![b'e'; max], &[0]], op, Report::All)
            .expect_err("oversize");
    assert!(
        matches!(e, NaError::MessageTooLarge { len, .. } if len == max + 1),
        "{e}"
    );
    n.pump(Duration::from_millis(50));
    assert!(!n.stash.contains_key(&op), "a refused send completes nothing");
}

/// Cancel of posted receives of both kinds: each completes once, canceled,
/// with its buffer given back; a second cancel is an error; the canceled
/// tag matches a new receive.
pub fn cancel(t: &Transport) {
    let server = PeerProc::spawn(t, &["server"]);
    let mut n = Node::new(t, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).expect("lookup");
    assert_eq!(n.request(&addr, 1, b"econnect"), b"econnect");
    let r = n.op();
    n.ep.post_recv_expected(&addr, 77, vec![1, 2, 3], r)
        .expect("post");
    let u = n.op();
    n.ep.post_recv_unexpected(n.id, vec![9], u).expect("post");
    n.ep.cancel(n.id, r).expect("cancel expected");
    n.ep.cancel(n.id, u).expect("cancel unexpected");
    let c = n.wait(r);
    assert!(c.is_canceled(), "{:?}", c.status);
    assert_eq!(c.buf.expect("buf"), vec![1, 2, 3], "buffer given back");
    assert!(n.wait(u).is_canceled());
    assert!(matches!(n.ep.cancel(n.id, r), Err(NaError::UnknownOp(_))));
    n.pump(Duration::from_millis(50));
    assert!(
        !n.stash.contains_key(&r) && !n.stash.contains_key(&u),
        "completed exactly once"
    );
    assert_eq!(n.request(&addr, 77, b"eafter"), b"eafter");
    assert_eq!(n.stats().in_flight, 0);
}

/// `t.clients` client processes at once against one server process; the
/// server counts every message.
pub fn many_clients(t: &Transport) {
    let mut server = PeerProc::spawn(t, &["server"]);
    let uri = server.uri.clone();
    let mut clients: Vec<PeerProc> = (0..t.clients)
        .map(|_| PeerProc::spawn(t, &["client", &uri, "300"]))
        .collect();
    for c in &mut clients {
        assert!(c.wait(t.timeout * 6), "a client failed");
        assert_eq!(c.line(t.timeout), "CLIENT OK 300");
    }
    let mut n = Node::new(t, ProgressMode::default(), false);
    let addr = n.ep.lookup(&uri).expect("lookup");
    n.request(&addr, 0, b"q");
    assert_eq!(server.line(t.timeout), format!("SERVED {}", t.clients * 300 + 1));
    assert!(server.wait(t.timeout));
}

/// Starting any operation under an id still in flight (a posted receive
/// of either kind) is [`NaError::OpInFlight`] and starts nothing: no
/// receive is posted, no message is sent, no transfer moves; so is a batch
/// of transfers that uses one id twice. The operations in flight are
/// untouched and complete once, as posted. (A send that reports failures
/// only is not checked when it goes out at once: it is never tracked, and
/// completes with no report.)
pub fn duplicate_op_ids(t: &Transport) {
    let server = PeerProc::spawn(t, &["server"]);
    let mut n = Node::new(t, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).unwrap();
    assert_eq!(n.request(&addr, 1, b"econnect"), b"econnect");
    let remote = crate::rma::expose(&mut n, &addr, &[64]);
    let local = MemHandle::zeroed(64, Access::ReadWrite);
    let (r, u) = (n.op(), n.op());
    n.ep.post_recv_expected(&addr, 77, vec![1, 2, 3], r).unwrap();
    n.ep.post_recv_unexpected(n.id, vec![9], u).unwrap();
    let before = n.stats();
    for dup in [r, u] {
        let refused = |what: &str, r: na_core::Result<()>| match r {
            Err(NaError::OpInFlight(id)) if id == dup.0 => {}
            other => panic!("{what} under id {} in flight: {other:?}", dup.0),
        };
        refused("unexpected receive", n.ep.post_recv_unexpected(n.id, vec![], dup));
        refused(
            "expected receive",
            n.ep.post_recv_expected(&addr, 78, vec![], dup),
        );
        refused("unexpected send", n.ep.send_unexpected(&addr, 79, b"edup", dup));
        refused("expected send", n.ep.send_expected(&addr, 79, b"edup", dup));
        refused(
            "gathered send",
            n.ep.send_unexpected_parts(&addr, 79, &[b"e", b"dup"], dup, Report::All),
        );
        refused("put", n.ep.put(&local, 0, &remote, 0, 8, &addr, dup));
        refused("get", n.ep.get(&local, 0, &remote, 0, 8, &addr, dup));
    }
    let twice = n.op();
    let batch = [
        Rma::put(&local, 0, &remote, 0, 8, twice),
        Rma::get(&local, 8, &remote, 8, 8, twice),
    ];
    match n.ep.rma(&addr, &batch) {
        Err(NaError::OpInFlight(id)) if id == twice.0 => {}
        other => panic!("a batch with one id twice: {other:?}"),
    }
    let after = n.stats();
    assert_eq!(after.msgs_sent, before.msgs_sent, "a refused send sent nothing");
    assert_eq!(
        (after.put_bytes, after.get_bytes, after.rma_calls),
        (before.put_bytes, before.get_bytes, before.rma_calls),
        "a refused transfer moved nothing"
    );
    // The originals are untouched: canceling gives their own buffers back.
    n.ep.cancel(n.id, r).unwrap();
    n.ep.cancel(n.id, u).unwrap();
    assert_eq!(n.wait(r).buf.expect("buf"), vec![1, 2, 3]);
    assert_eq!(n.wait(u).buf.expect("buf"), vec![9]);
    n.pump(Duration::from_millis(50));
    assert!(
        n.stash.is_empty(),
        "each completed once, and nothing refused completed: {:?}",
        n.stash.keys()
    );
    assert_eq!(n.stats().in_flight, 0);
    assert_eq!(n.request(&addr, 78, b"eafter"), b"eafter");
}
