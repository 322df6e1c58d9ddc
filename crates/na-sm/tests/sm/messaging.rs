//! Lookup, messages, matching, backpressure, cancel, many clients, two
//! instances on one poll set.

use std::time::Duration;

use na_core::{NaError, OpId, OpKind, PluginRegistry, ProgressMode};
use na_sm::SmFactory;

use crate::common::{test_dir, Node, PeerProc};

const T: Duration = Duration::from_secs(10);

#[test]
fn lookup_and_unexpected_ping_pong() {
    let dir = test_dir("lookup");
    let server = PeerProc::spawn(&dir, &["server"]);
    let mut n = Node::new(&dir, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).unwrap();
    assert_eq!(addr.uri(), server.uri);
    assert_eq!(
        n.ep.lookup(&server.uri).unwrap(),
        addr,
        "second lookup gives the same peer"
    );
    assert_eq!(n.ep.addr_from_bytes(&addr.to_bytes()).unwrap(), addr);
    // Unknown and malformed addresses are clear errors.
    let e = n.ep.lookup("sm://999999-nope").unwrap_err();
    assert!(
        matches!(e, NaError::Lookup { .. }) && e.to_string().contains("no socket"),
        "{e}"
    );
    assert!(matches!(
        n.ep.lookup("sm://abc").unwrap_err(),
        NaError::InvalidAddress { .. }
    ));
    for round in 0..20u32 {
        let r = n.op();
        n.ep.post_recv_unexpected(n.id, Vec::new(), r).unwrap();
        let s = n.op();
        let msg = [b'u', round as u8, 42];
        n.ep.send_unexpected(&addr, round, &msg, s).unwrap();
        let c = n.wait(r, T);
        assert_eq!(c.kind, OpKind::RecvUnexpected);
        c.status.unwrap();
        assert_eq!(
            (c.buf.unwrap(), c.source.unwrap(), c.tag),
            (msg.to_vec(), addr.clone(), round)
        );
        n.wait(s, T).status.unwrap();
    }
    assert_eq!(n.stats().peers, 1);
}

#[test]
fn expected_ping_pong_early_arrival_and_out_of_order_tags() {
    let dir = test_dir("expected");
    let server = PeerProc::spawn(&dir, &["server"]);
    let mut n = Node::new(&dir, ProgressMode::Blocking, false);
    let addr = n.ep.lookup(&server.uri).unwrap();
    for i in 0..50u32 {
        let msg = [b'e', i as u8, 7, 7];
        assert_eq!(n.request(&addr, i, &msg), msg);
    }
    // Replies come for tags 5,4,3,2,1 while receives were posted 1..5.
    let mut recvs = Vec::new();
    for t in 1..=5u32 {
        let r = n.op();
        n.ep.post_recv_expected(&addr, t, Vec::new(), r).unwrap();
        recvs.push((t, r));
    }
    let mut cmd = vec![b'o'];
    for t in (1..=5u32).rev() {
        cmd.extend_from_slice(&t.to_le_bytes());
    }
    let s = n.op();
    n.ep.send_unexpected(&addr, 0, &cmd, s).unwrap();
    for (t, r) in recvs {
        let c = n.wait(r, T);
        assert_eq!((c.tag, c.buf.unwrap()), (t, t.to_le_bytes().to_vec()));
    }
    // An expected message that arrives before its receive is kept.
    let s = n.op();
    n.ep.send_unexpected(&addr, 900, b"early", s).unwrap();
    n.wait(s, T).status.unwrap();
    std::thread::sleep(Duration::from_millis(100));
    for _ in 0..20 {
        n.pump(Duration::from_millis(10));
    }
    let r = n.op();
    n.ep.post_recv_expected(&addr, 900, Vec::new(), r).unwrap();
    assert_eq!(n.wait(r, T).buf.unwrap(), b"early");
}

#[test]
fn zero_byte_max_size_and_oversize_messages() {
    let dir = test_dir("sizes");
    let server = PeerProc::spawn(&dir, &["server"]);
    let mut n = Node::new(&dir, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).unwrap();
    let max = n.ep.plugin(n.id).unwrap().max_unexpected_size();
    assert_eq!(max, 4096);
    assert_eq!(n.ep.plugin(n.id).unwrap().max_expected_size(), 4096);
    assert_eq!(n.request(&addr, 1, &[]), Vec::<u8>::new(), "zero-byte both ways");
    let big: Vec<u8> = std::iter::once(b'e')
        .chain((1..max).map(|i| (i * 31) as u8))
        .collect();
    assert_eq!(n.request(&addr, 2, &big), big, "max-size both ways");
    let mut too_big = big.clone();
    too_big.push(0);
    let op = n.op();
    let e = n.ep.send_unexpected(&addr, 3, &too_big, op).unwrap_err();
    assert!(
        matches!(
            e,
            NaError::MessageTooLarge {
                len: 4097,
                max: 4096,
                ..
            }
        ),
        "{e}"
    );
    let e = n.ep.send_expected(&addr, 3, &too_big, op).unwrap_err();
    assert!(e.to_string().contains("4097"), "{e}");
    // Nothing was started: no completion for op.
    n.pump(Duration::from_millis(50));
    assert!(!n.stash.contains_key(&op));
}

#[test]
fn ten_thousand_messages_with_a_thousand_in_flight() {
    let dir = test_dir("many");
    let server = PeerProc::spawn(&dir, &["server"]);
    let mut n = Node::new(&dir, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).unwrap();
    const TOTAL: u32 = 10_000;
    const WINDOW: u32 = 1_000;
    let msg = |i: u32| {
        let mut m = vec![b'e'];
        m.extend_from_slice(&i.to_le_bytes());
        m.resize(8 + (i as usize % 120), i as u8);
        m
    };
    // The server stalls for 300 ms first: the first 64 messages fill the
    // ring, and the rest must wait in the backlog (and all arrive, in order).
    let mut stall = vec![b'z'];
    stall.extend_from_slice(&300u32.to_le_bytes());
    n.ep.send_unexpected(&addr, u32::MAX, &stall, OpId(1 << 35))
        .unwrap();
    n.wait(OpId(1 << 35), T).status.unwrap();
    let (mut sent, mut done) = (0u32, 0u32);
    let mut max_in_flight = 0;
    while done < TOTAL {
        while sent < TOTAL && sent - done < WINDOW {
            n.ep.post_recv_expected(&addr, sent, Vec::new(), OpId(1 << 33 | u64::from(sent)))
                .unwrap();
            n.ep.send_unexpected(&addr, sent, &msg(sent), OpId(1 << 34 | u64::from(sent)))
                .unwrap();
            sent += 1;
        }
        max_in_flight = max_in_flight.max(n.stats().in_flight);
        let c = n.wait(OpId(1 << 33 | u64::from(done)), Duration::from_secs(30));
        assert_eq!(c.buf.unwrap(), msg(done), "message {done}");
        n.wait(OpId(1 << 34 | u64::from(done)), T).status.unwrap();
        done += 1;
    }
    let st = n.stats();
    assert!(
        st.sends_queued > 0,
        "1000 in flight must exceed the 64 buffers: {st:?}"
    );
    assert!(max_in_flight >= u64::from(WINDOW), "{max_in_flight}");
    assert_eq!(st.msgs_sent, u64::from(TOTAL) + 1);
    assert_eq!(st.msgs_received, u64::from(TOTAL));
    assert_eq!(st.in_flight, 0);
}

#[test]
fn cancel_posted_receives() {
    let dir = test_dir("cancel");
    let server = PeerProc::spawn(&dir, &["server"]);
    let mut n = Node::new(&dir, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).unwrap();
    let r = n.op();
    n.ep.post_recv_expected(&addr, 77, vec![1, 2, 3], r).unwrap();
    let u = n.op();
    n.ep.post_recv_unexpected(n.id, vec![9], u).unwrap();
    n.ep.cancel(n.id, r).unwrap();
    n.ep.cancel(n.id, u).unwrap();
    let c = n.wait(r, T);
    assert!(c.is_canceled());
    assert_eq!(c.buf.unwrap(), vec![1, 2, 3], "buffer given back");
    assert!(n.wait(u, T).is_canceled());
    assert!(matches!(n.ep.cancel(n.id, r), Err(NaError::UnknownOp(_))));
    // A reply for the canceled tag no longer matches it; a new receive gets it.
    assert_eq!(n.request(&addr, 77, b"eafter"), b"eafter");
}

#[test]
fn sixteen_client_processes_against_one_server() {
    let dir = test_dir("sixteen");
    let mut server = PeerProc::spawn(&dir, &["server"]);
    let uri = server.uri.clone();
    let mut clients: Vec<PeerProc> = (0..16)
        .map(|_| PeerProc::spawn(&dir, &["client", &uri, "300"]))
        .collect();
    for c in &mut clients {
        assert!(c.wait(Duration::from_secs(60)), "a client failed");
        assert_eq!(c.line(T), "CLIENT OK 300");
    }
    let mut n = Node::new(&dir, ProgressMode::default(), false);
    let addr = n.ep.lookup(&uri).unwrap();
    n.request(&addr, 0, b"q");
    assert_eq!(server.line(T), format!("SERVED {}", 16 * 300 + 1));
    assert!(server.wait(T));
}

#[test]
fn two_instances_driven_by_one_poll_set() {
    let dir = test_dir("two");
    let mut reg = PluginRegistry::new();
    reg.register(Box::new(SmFactory::new(
        na_sm::SmConfig::default().with_dir(dir.to_path_buf()),
    )));
    let mut ep = na_core::Endpoint::new(ProgressMode::Blocking).unwrap();
    let a = ep.add_from_spec(&reg, "sm://alpha", true).unwrap();
    let b = ep.add_from_spec(&reg, "sm://beta", true).unwrap();
    let b_uri = ep.self_addr(b).unwrap().uri().to_owned();
    assert_eq!(b_uri, format!("sm://{}-beta", std::process::id()));
    let b_from_a = ep.plugin_mut(a).unwrap().lookup(&b_uri).unwrap();
    let mut stash = std::collections::HashMap::new();
    let mut wait = |ep: &mut na_core::Endpoint, op: OpId| {
        let end = std::time::Instant::now() + T;
        loop {
            if let Some(c) = stash.remove(&op) {
                return c;
            }
            assert!(std::time::Instant::now() < end, "timed out on {op:?}");
            ep.progress(Some(Duration::from_millis(100))).unwrap();
            while let Some(c) = ep.pop_completion() {
                stash.insert(c.op, c);
            }
        }
    };
    for i in 0..100u64 {
        ep.post_recv_unexpected(b, Vec::new(), OpId(10 * i)).unwrap();
        ep.post_recv_expected(&b_from_a, i as u32, Vec::new(), OpId(10 * i + 1))
            .unwrap();
        ep.send_unexpected(&b_from_a, i as u32, &i.to_le_bytes(), OpId(10 * i + 2))
            .unwrap();
        let c = wait(&mut ep, OpId(10 * i));
        let a_from_b = c.source.unwrap();
        assert_eq!(a_from_b.plugin(), b);
        assert_eq!(c.buf.unwrap(), i.to_le_bytes());
        ep.send_expected(&a_from_b, i as u32, b"pong", OpId(10 * i + 3))
            .unwrap();
        assert_eq!(wait(&mut ep, OpId(10 * i + 1)).buf.unwrap(), b"pong");
        wait(&mut ep, OpId(10 * i + 2)).status.unwrap();
        wait(&mut ep, OpId(10 * i + 3)).status.unwrap();
    }
    // Each instance also talks to its own server process: in blocking mode
    // the replies arrive while the endpoint sleeps in its one epoll set, so
    // only the plugins' poll fds (woken by the servers' eventfd writes) can
    // end the wait.
    let s1 = PeerProc::spawn(&dir, &["server"]);
    let s2 = PeerProc::spawn(&dir, &["server"]);
    let s1a = ep.plugin_mut(a).unwrap().lookup(&s1.uri).unwrap();
    let s2b = ep.plugin_mut(b).unwrap().lookup(&s2.uri).unwrap();
    for i in 0..50u64 {
        for (k, srv) in [&s1a, &s2b].into_iter().enumerate() {
            let base = 10_000 + 10 * i + 5 * k as u64;
            ep.post_recv_expected(srv, i as u32, Vec::new(), OpId(base))
                .unwrap();
            ep.send_unexpected(srv, i as u32, &[b'e', i as u8], OpId(base + 1))
                .unwrap();
            assert_eq!(wait(&mut ep, OpId(base)).buf.unwrap(), [b'e', i as u8]);
            wait(&mut ep, OpId(base + 1)).status.unwrap();
        }
    }
    let (sa, sb) = (ep.plugin(a).unwrap().stats(), ep.plugin(b).unwrap().stats());
    assert_eq!((sa.msgs_sent, sa.msgs_received), (150, 150), "{sa:?}");
    assert_eq!((sb.msgs_sent, sb.msgs_received), (150, 150), "{sb:?}");
}

#[test]
fn invalid_socket_dir_env_is_a_clear_error() {
    let out = std::process::Command::new(crate::common::TESTPEER)
        .arg("envcheck")
        .env("QS_SM_DIR", "relative/dir")
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.starts_with("ERR") && s.contains("QS_SM_DIR") && s.contains("absolute"),
        "{s}"
    );
    use std::os::unix::ffi::OsStrExt;
    let out = std::process::Command::new(crate::common::TESTPEER)
        .arg("envcheck")
        .env("QS_SM_DIR", std::ffi::OsStr::from_bytes(b"/tmp/\xff\xfe"))
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.starts_with("ERR") && s.contains("QS_SM_DIR") && s.contains("UTF-8"),
        "{s}"
    );
}
