//! The verbs plugin inside one process: a listening and a client plugin on
//! the same soft-RoCE device, each in its own endpoint, driven in turn.
//! Messages both ways, backpressure beyond the credits, put/get across
//! segments, and the error paths that need no second process. The
//! multi-process suite is in `tests/suite.rs`; memory registration in one
//! process is in `tests/registrations.rs` (both use `common/pair.rs`).
//!
//! Without an RDMA device: asserts the clear "no RDMA device found" error
//! of plugin creation and says loudly that the RDMA part did not run.

mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use na_core::{Access, Addr, Endpoint, MemHandle, NaError, OpId, Plugin, PluginId, ProgressMode};
use na_verbs::{VerbsConfig, VerbsPlugin};

use common::pair::{drive, drive_two, node, node_with, pair, Pair, T};

#[test]
fn verbs_plugin_in_one_process() {
    let Some(env) = common::rdma_env("verbs_plugin_in_one_process") else {
        let err = VerbsPlugin::new(PluginId(0), VerbsConfig::default())
            .err()
            .expect("no device");
        let msg = err.to_string();
        assert!(
            msg.contains("no RDMA device found") && msg.contains("rdma_rxe"),
            "{msg}"
        );
        return;
    };
    let mut p = pair(&env);
    // Unexpected to the server, expected reply back.
    p.srv.post_recv_unexpected(p.srv_id, Vec::new(), OpId(1)).unwrap();
    p.cli
        .post_recv_expected(&p.srv_addr, 7, Vec::new(), OpId(2))
        .unwrap();
    p.cli.send_unexpected(&p.srv_addr, 7, b"hello", OpId(3)).unwrap();
    let (_, s) = drive(&mut p, |_, s| !s.is_empty());
    let req = &s[0];
    req.status.as_ref().unwrap();
    assert_eq!(req.buf.as_deref(), Some(&b"hello"[..]));
    let src = req.source.clone().unwrap();
    p.srv.send_expected(&src, req.tag, b"world", OpId(4)).unwrap();
    // Posted to the device and not reported sent: nothing polled the CQ.
    let st = p.srv.plugin(p.srv_id).unwrap().stats();
    assert_eq!((st.sends_posted, st.backlog_bytes), (1, 0), "{st:?}");
    let (c, _) = drive(&mut p, |c, s| c.len() == 2 && s.len() == 1);
    let reply = c.iter().find(|c| c.op == OpId(2)).unwrap();
    assert_eq!(reply.buf.as_deref(), Some(&b"world"[..]));
    // Completed once the server polls its CQ.
    let end = Instant::now() + T;
    while p.srv.plugin(p.srv_id).unwrap().stats().sends_posted > 0 {
        assert!(Instant::now() < end, "the reply's send never completed");
        p.srv.progress(Some(Duration::from_millis(1))).unwrap();
    }
    eprintln!(
        "ping-pong ok; client stats {:?}",
        p.cli.plugin(p.cli_id).unwrap().stats()
    );

    // 1,000 unexpected messages with 1,000 receives posted: beyond the credits.
    for i in 0..1000u64 {
        p.srv
            .post_recv_unexpected(p.srv_id, Vec::new(), OpId(100 + i))
            .unwrap();
    }
    for i in 0..1000u32 {
        let msg = i.to_le_bytes().repeat(8);
        p.cli
            .send_unexpected(&p.srv_addr, i, &msg, OpId(5000 + u64::from(i)))
            .unwrap();
    }
    let (c, s) = drive(&mut p, |c, s| c.len() == 1000 && s.len() == 1000);
    assert!(c.iter().all(|c| c.status.is_ok()));
    for (i, r) in s.iter().enumerate() {
        assert_eq!(r.tag, i as u32, "in order");
        assert_eq!(r.buf.as_deref().unwrap(), &(i as u32).to_le_bytes().repeat(8)[..]);
    }
    let st = p.cli.plugin(p.cli_id).unwrap().stats();
    assert!(st.sends_queued > 0, "1,000 sends must exceed the credits: {st:?}");

    // Put and get across segments.
    let remote_mem = MemHandle::new(
        vec![vec![0u8; 3000], vec![0u8; 5000], vec![0; 100]],
        Access::ReadWrite,
    );
    p.srv
        .plugin_mut(p.srv_id)
        .unwrap()
        .mem_register(&remote_mem)
        .unwrap();
    let desc = p.srv.plugin(p.srv_id).unwrap().mem_describe(&remote_mem).unwrap();
    assert!(desc.segments().iter().all(|s| s.key != 0), "{desc:?}");
    let data: Vec<u8> = (0..6000u32).map(|i| (i * 7 % 251) as u8).collect();
    let local = MemHandle::new(
        vec![data[..1000].to_vec(), data[1000..].to_vec()],
        Access::ReadWrite,
    );
    p.cli.plugin_mut(p.cli_id).unwrap().mem_register(&local).unwrap();
    p.cli
        .put(&local, 0, &desc, 1500, 6000, &p.srv_addr, OpId(9001))
        .unwrap();
    let (c, _) = drive(&mut p, |c, _| !c.is_empty());
    c[0].status.as_ref().unwrap();
    let mut got = vec![0u8; 6000];
    remote_mem.read_at(1500, &mut got).unwrap();
    assert!(got == data, "put data differs");
    let back = MemHandle::zeroed(6000, Access::ReadWrite);
    p.cli
        .get(&back, 0, &desc, 1500, 6000, &p.srv_addr, OpId(9002))
        .unwrap();
    let (c, _) = drive(&mut p, |c, _| !c.is_empty());
    c[0].status.as_ref().unwrap();
    assert!(back.to_vec() == data, "get data differs");
    let e = p
        .cli
        .put(&local, 0, &desc, 2101, 6000, &p.srv_addr, OpId(9003))
        .unwrap_err();
    assert!(
        matches!(e, NaError::OutOfBounds { .. }),
        "{}",
        na_core::ErrorChain(&e)
    );
    eprintln!("put/get ok");
}

/// Given an IP and no device, a plugin binds on the device and port the
/// IP belongs to, not on the first device (which a host with several NICs
/// may not have the IP on: that used to fail with "belongs to RDMA device
/// X, not the requested Y"); a port the IP is not on is a clear error. The
/// soft-RoCE VM has a second device (rxe1, `RXE_VM_DEV2`/`RXE_VM_ADDR2`)
/// for the case that matters.
#[test]
fn an_address_without_a_device_binds_on_the_device_it_belongs_to() {
    let test = "an_address_without_a_device_binds_on_the_device_it_belongs_to";
    let Some(env) = common::rdma_env(test) else {
        return;
    };
    let plugin_at = |spec: &str, edit: fn(&mut VerbsConfig)| {
        let mut cfg = VerbsConfig::from_spec(spec, true).unwrap();
        edit(&mut cfg);
        VerbsPlugin::new(PluginId(0), cfg)
    };
    let p = plugin_at(&format!("verbs://{}:0", env.ip), |_| {}).expect("the address's own device");
    let uri = p.self_addr().uri().to_owned();
    assert!(
        uri.starts_with(&format!("verbs://{}/{}:", env.device, env.ip)),
        "{uri}"
    );
    drop(p);
    let e = plugin_at(&format!("verbs://{}:0", env.ip), |c| c.ib_port = Some(2))
        .err()
        .expect("the address is on port 1")
        .to_string();
    assert!(e.contains("port 1") && e.contains("requested port 2"), "{e}");
    let (Ok(dev2), Ok(ip2)) = (std::env::var("RXE_VM_DEV2"), std::env::var("RXE_VM_ADDR2")) else {
        assert!(
            std::env::var_os("RXE_VM").is_none(),
            "{test}: the soft-RoCE VM makes a second device (rxe1): RXE_VM_DEV2/RXE_VM_ADDR2 missing"
        );
        na_core::testing::report_not_run(&format!(
            "{test}: the second-device part (one RDMA device here; the soft-RoCE VM has two)"
        ));
        return;
    };
    let p = plugin_at(&format!("verbs://{ip2}:0"), |_| {}).expect("the second device, by its address");
    let uri = p.self_addr().uri().to_owned();
    assert!(uri.starts_with(&format!("verbs://{dev2}/{ip2}:")), "{uri}");
    // It works there: a client on the same device sends it a message.
    let mut srv = Endpoint::new(ProgressMode::Blocking).unwrap();
    let sid = srv
        .add_plugin(|id| {
            let cfg = VerbsConfig::from_spec(&format!("verbs://{ip2}:0"), true)?;
            Ok(Box::new(VerbsPlugin::new(id, cfg)?) as Box<dyn Plugin>)
        })
        .unwrap();
    drop(p);
    let mut cli = Endpoint::new(ProgressMode::Blocking).unwrap();
    cli.add_plugin(|id| {
        let cfg = VerbsConfig::from_spec(&format!("verbs://{ip2}:0"), false)?;
        Ok(Box::new(VerbsPlugin::new(id, cfg)?) as Box<dyn Plugin>)
    })
    .unwrap();
    let to = cli.lookup(srv.self_addr(sid).unwrap().uri()).unwrap();
    srv.post_recv_unexpected(sid, Vec::new(), OpId(1)).unwrap();
    cli.send_unexpected(&to, 5, b"on rxe1", OpId(2)).unwrap();
    let (_, got) = drive_two(&mut cli, &mut srv, |_, s| !s.is_empty());
    assert_eq!(got[0].buf.as_deref(), Some(&b"on rxe1"[..]), "{got:?}");
    // Asking for the first device with the second's address is refused.
    let e = plugin_at(&format!("verbs://{}/{ip2}:0", env.device), |_| {})
        .err()
        .expect("the address is not the first device's")
        .to_string();
    assert!(e.contains(&dev2) && e.contains(&env.device), "{e}");
}

/// Calls from another thread that complete something at once while the
/// owner sleeps on the endpoint's fd (after `try_wait`) make the fd
/// readable: a receive that takes a message the plugin held, a cancel of
/// a posted receive. Each used to leave the completion unseen until an
/// unrelated event woke the owner.
#[test]
fn completions_queued_while_the_owner_sleeps_wake_it() {
    let Some(env) = common::rdma_env("completions_queued_while_the_owner_sleeps_wake_it") else {
        return;
    };
    let mut p = pair(&env);
    // Readable within `wait`: the deadline timer set to now fires a
    // moment later (at least 1 ns on, and later still under emulation).
    let readable_within = |ep: &Endpoint, wait: Duration| {
        use std::os::fd::AsFd;
        na_verbs::sys::poll_readable(ep.as_fd(), Some(wait)).expect("poll")
    };
    let readable = |ep: &Endpoint| readable_within(ep, T);
    let sleep_srv = |p: &mut Pair, what: &str| {
        let end = Instant::now() + T;
        while !p.srv.try_wait().unwrap() {
            assert!(Instant::now() < end, "{what}: the server never became idle");
            p.srv.progress(Some(Duration::ZERO)).unwrap();
            p.cli.progress(Some(Duration::ZERO)).unwrap();
            while p.srv.pop_completion().is_some() {}
        }
        assert!(
            !readable_within(&p.srv, Duration::ZERO),
            "{what}: readable while idle"
        );
    };
    for round in 0..3u64 {
        // A message the server holds: no receive is posted for it.
        p.cli
            .send_unexpected(&p.srv_addr, 4, b"held", OpId(10 + round))
            .unwrap();
        drive(&mut p, |c, _| c.iter().any(|c| c.op == OpId(10 + round)));
        sleep_srv(&mut p, "receive");
        p.srv
            .post_recv_unexpected(p.srv_id, Vec::new(), OpId(100 + round))
            .unwrap();
        assert!(
            readable(&p.srv),
            "round {round}: a receive that took a held message left the fd quiet"
        );
        p.srv.progress(Some(Duration::ZERO)).unwrap();
        let got: Vec<_> = std::iter::from_fn(|| p.srv.pop_completion()).collect();
        assert!(got.iter().any(|c| c.op == OpId(100 + round)), "{got:?}");
        // A receive canceled while the owner sleeps.
        p.srv
            .post_recv_unexpected(p.srv_id, Vec::new(), OpId(200 + round))
            .unwrap();
        sleep_srv(&mut p, "cancel");
        p.srv.cancel(p.srv_id, OpId(200 + round)).unwrap();
        assert!(readable(&p.srv), "round {round}: a cancel left the fd quiet");
        p.srv.progress(Some(Duration::ZERO)).unwrap();
        while p.srv.pop_completion().is_some() {}
    }
}

/// Expected messages of a peer that died stay takeable for a while (what
/// it sent before it went is not lost), then go: a peer that sends and
/// dies again and again cannot make the listener hold them forever.
#[test]
fn expected_messages_of_a_dead_peer_are_kept_for_a_grace_then_dropped() {
    let Some(env) = common::rdma_env("expected_messages_of_a_dead_peer_are_kept_for_a_grace_then_dropped")
    else {
        return;
    };
    let mut p = pair(&env);
    // An unexpected message gives the server the client's address.
    p.srv.post_recv_unexpected(p.srv_id, Vec::new(), OpId(1)).unwrap();
    p.cli.send_unexpected(&p.srv_addr, 1, b"hi", OpId(2)).unwrap();
    for i in 0..5u32 {
        p.cli
            .send_expected(&p.srv_addr, 9, &i.to_le_bytes(), OpId(10 + u64::from(i)))
            .unwrap();
    }
    let (_, s) = drive(&mut p, |c, s| c.len() == 6 && s.len() == 1);
    let client = s[0].source.clone().expect("source of the unexpected message");
    let held = |p: &Pair| p.srv.plugin(p.srv_id).unwrap().stats().queued_arrivals;
    let end = Instant::now() + T;
    while held(&p) < 5 {
        assert!(Instant::now() < end, "the expected messages never arrived");
        p.srv.progress(Some(Duration::ZERO)).unwrap();
    }
    // The client goes away; a receive posted for it fails when the server
    // sees that.
    let Pair {
        mut srv, cli, srv_id, ..
    } = p;
    srv.post_recv_expected(&client, 77, Vec::new(), OpId(50)).unwrap();
    drop(cli);
    let end = Instant::now() + T;
    let gone = loop {
        srv.progress(Some(Duration::from_millis(1))).unwrap();
        if let Some(c) = std::iter::from_fn(|| srv.pop_completion()).find(|c| c.op == OpId(50)) {
            break c;
        }
        assert!(Instant::now() < end, "the server never saw the client go");
    };
    // The server marked the client dead at most this long ago.
    let seen_dead = Instant::now();
    assert!(matches!(gone.status, Err(NaError::PeerGone { .. })), "{gone:?}");
    // Within the grace, a receive naming the dead peer still gets its message.
    srv.post_recv_expected(&client, 9, Vec::new(), OpId(60)).unwrap();
    let end = Instant::now() + T;
    let got = loop {
        if let Some(c) = std::iter::from_fn(|| srv.pop_completion()).find(|c| c.op == OpId(60)) {
            break c;
        }
        assert!(Instant::now() < end, "the held message was not delivered");
        srv.progress(Some(Duration::ZERO)).unwrap();
    };
    got.status
        .as_ref()
        .expect("a held message of a dead peer is still delivered");
    assert_eq!(got.buf.as_deref(), Some(&0u32.to_le_bytes()[..]));
    assert_eq!(srv.plugin(srv_id).unwrap().stats().queued_arrivals, 4);
    // After it, the rest go, on time even in a process that sleeps on its
    // fd meanwhile (as a tokio driver does): the deadline timer wakes it.
    let waiter = na_core::sys::epoll::Epoll::new().unwrap();
    waiter.add(srv.as_fd(), 1).unwrap();
    let mut tokens = Vec::new();
    let end = seen_dead + na_verbs::DEAD_HELD_GRACE + Duration::from_secs(1);
    while srv.plugin(srv_id).unwrap().stats().queued_arrivals > 0 {
        let left = end.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "held messages of a dead peer were still kept 1 s after their grace, in a process that slept"
        );
        if srv.try_wait().unwrap() {
            waiter.wait(&mut tokens, Some(left)).unwrap();
        }
        srv.progress_now().unwrap();
    }
    let e = srv
        .post_recv_expected(&client, 9, Vec::new(), OpId(61))
        .expect_err("nothing held, and the peer is gone");
    assert!(
        matches!(e, NaError::PeerGone { .. }),
        "{}",
        na_core::ErrorChain(&e)
    );
    assert_eq!(
        srv.plugin(srv_id).unwrap().stats().peer_entries,
        0,
        "nothing refers to the dead peer any more: its entry goes"
    );
}

/// Every client that comes and goes is forgotten once nothing refers to it:
/// the listener's peer table does not grow with the clients it ever had,
/// an old address of a client that went is a clear "gone" error, and a
/// message the client left behind keeps its entry only until it is taken.
#[test]
fn clients_that_come_and_go_leave_no_peer_entries_behind() {
    let Some(env) = common::rdma_env("clients_that_come_and_go_leave_no_peer_entries_behind") else {
        return;
    };
    let (mut srv, srv_id) = node(&env, true);
    let uri = srv.self_addr(srv_id).unwrap().uri().to_owned();
    let entries = |srv: &Endpoint| srv.plugin(srv_id).unwrap().stats().peer_entries;
    let wait_entries = |srv: &mut Endpoint, want: u64, what: &str| {
        let end = Instant::now() + T;
        while entries(srv) != want {
            assert!(
                Instant::now() < end,
                "{what}: {} peer entries, want {want}",
                entries(srv)
            );
            srv.progress(Some(Duration::from_millis(1))).unwrap();
        }
    };
    let mut first_client = None;
    const CLIENTS: u64 = 12;
    for i in 0..CLIENTS {
        let (mut cli, _) = node(&env, false);
        let srv_addr = cli.lookup(&uri).unwrap();
        srv.post_recv_unexpected(srv_id, Vec::new(), OpId(i)).unwrap();
        cli.send_unexpected(&srv_addr, 1, b"hi", OpId(1000 + i)).unwrap();
        let end = Instant::now() + T;
        let (mut sent, mut got) = (false, None);
        while !sent || got.is_none() {
            assert!(Instant::now() < end, "client {i}: no exchange");
            cli.progress(Some(Duration::ZERO)).unwrap();
            srv.progress(Some(Duration::ZERO)).unwrap();
            sent |= cli.pop_completion().is_some();
            if let Some(c) = srv.pop_completion() {
                got = Some(c);
            }
        }
        let got = got.unwrap();
        got.status.as_ref().unwrap();
        assert_eq!(entries(&srv), 1, "client {i} is the one peer");
        first_client.get_or_insert(got.source.clone().unwrap());
        drop(cli);
        wait_entries(&mut srv, 0, &format!("after client {i} went"));
    }
    // An address of a client long gone names nothing: a clear error, and
    // it does not reach whichever peer uses its slot now.
    let old = first_client.unwrap();
    let e = srv.send_expected(&old, 1, b"late", OpId(5000)).unwrap_err();
    assert!(
        matches!(e, NaError::PeerGone { .. }),
        "{}",
        na_core::ErrorChain(&e)
    );
    assert!(e.to_string().contains("went earlier"), "{e}");

    // A client that leaves an unexpected message nobody took yet: its
    // entry stays (the message names it) until the message is taken.
    let (mut cli, _) = node(&env, false);
    let srv_addr = cli.lookup(&uri).unwrap();
    cli.send_unexpected(&srv_addr, 2, b"left behind", OpId(6000))
        .unwrap();
    let end = Instant::now() + T;
    while srv.plugin(srv_id).unwrap().stats().queued_arrivals == 0 {
        assert!(Instant::now() < end, "the message never arrived");
        cli.progress(Some(Duration::ZERO)).unwrap();
        srv.progress(Some(Duration::ZERO)).unwrap();
    }
    drop(cli);
    let end = Instant::now() + Duration::from_secs(2);
    while Instant::now() < end {
        srv.progress(Some(Duration::from_millis(1))).unwrap();
    }
    assert_eq!(entries(&srv), 1, "the held message still names its sender");
    srv.post_recv_unexpected(srv_id, Vec::new(), OpId(6001)).unwrap();
    let end = Instant::now() + T;
    let got = loop {
        srv.progress(Some(Duration::ZERO)).unwrap();
        if let Some(c) = srv.pop_completion() {
            break c;
        }
        assert!(Instant::now() < end, "the held message was not delivered");
    };
    assert_eq!(got.buf.as_deref(), Some(&b"left behind"[..]));
    assert_eq!(entries(&srv), 0, "taken: nothing names the client any more");
    let e = srv
        .send_expected(got.source.as_ref().unwrap(), 1, b"x", OpId(6002))
        .unwrap_err();
    assert!(
        matches!(e, NaError::PeerGone { .. }),
        "{}",
        na_core::ErrorChain(&e)
    );
}

/// Two listeners that look each other up and send at once hold a
/// connection each way: each side's lookup is its own connection to the
/// other's listener, and the incoming one is a peer of its own (its
/// messages' source is not the lookup's address). When the connection one
/// of them sends on dies (here: a remote access error of a forged get),
/// that looked-up peer is gone and the incoming connection does not take
/// over (a hello's address is only a claim); the other way still works,
/// and a new lookup connects afresh.
#[test]
fn listeners_that_call_each_other_hold_a_connection_each_way() {
    let Some(env) = common::rdma_env("listeners_that_call_each_other_hold_a_connection_each_way") else {
        return;
    };
    let (mut a, aid) = node(&env, true);
    let (mut b, bid) = node(&env, true);
    let (a_uri, b_uri) = (
        a.self_addr(aid).unwrap().uri().to_owned(),
        b.self_addr(bid).unwrap().uri().to_owned(),
    );
    let to_b = a.lookup(&b_uri).unwrap();
    let to_a = b.lookup(&a_uri).unwrap();
    a.post_recv_unexpected(aid, Vec::new(), OpId(1)).unwrap();
    b.post_recv_unexpected(bid, Vec::new(), OpId(1)).unwrap();
    // Both start connecting before either side progresses.
    a.send_unexpected(&to_b, 1, b"from a", OpId(2)).unwrap();
    b.send_unexpected(&to_a, 1, b"from b", OpId(2)).unwrap();
    let (ca, cb) = drive_two(&mut a, &mut b, |ca, cb| ca.len() == 2 && cb.len() == 2);
    assert!(ca.iter().chain(&cb).all(|c| c.status.is_ok()), "{ca:?} {cb:?}");
    let from_a = cb.iter().find(|c| c.op == OpId(1)).unwrap();
    let src = from_a.source.as_ref().expect("a message has a source");
    assert_ne!(src, &to_a, "an incoming connection is not the looked-up peer");
    assert_eq!(src.uri(), to_a.uri(), "shown as the address its hello names");
    let stats = |ep: &Endpoint, id| {
        let s = ep.plugin(id).unwrap().stats();
        (s.peer_entries, s.peers)
    };
    assert_eq!(
        (stats(&a, aid), stats(&b, bid)),
        ((2, 2), (2, 2)),
        "a connection each way"
    );
    // A forged get kills the connection a sends on.
    let forged = na_core::RemoteMem::new(
        vec![na_core::RemoteSegment {
            addr: 4096,
            len: 64,
            key: 0x1234,
        }],
        Access::ReadWrite,
    )
    .unwrap();
    let local = MemHandle::zeroed(64, Access::ReadWrite);
    a.plugin_mut(aid).unwrap().mem_register(&local).unwrap();
    a.get(&local, 0, &forged, 0, 64, &to_b, OpId(3)).unwrap();
    let (ca, _) = drive_two(&mut a, &mut b, |ca, _| ca.iter().any(|c| c.op == OpId(3)));
    let got = ca.iter().find(|c| c.op == OpId(3)).unwrap();
    assert!(got.status.is_err(), "a forged rkey must fail: {got:?}");
    // Until both sides have seen that connection go (each holds one
    // connection fewer).
    let end = Instant::now() + T;
    while stats(&a, aid).1 > 1 || stats(&b, bid).1 > 1 {
        assert!(
            Instant::now() < end,
            "the killed connection never went: {:?}",
            (stats(&a, aid), stats(&b, bid))
        );
        a.progress(Some(Duration::ZERO)).unwrap();
        b.progress(Some(Duration::ZERO)).unwrap();
    }
    let e = a
        .send_unexpected(&to_b, 2, b"gone", OpId(4))
        .expect_err("the peer whose only connection died is gone");
    assert!(
        matches!(e, NaError::PeerGone { .. }),
        "{}",
        na_core::ErrorChain(&e)
    );
    // b's own connection to a still carries b's sends; a new lookup of b
    // connects afresh.
    let to_b = a.lookup(&b_uri).unwrap();
    a.post_recv_unexpected(aid, Vec::new(), OpId(10)).unwrap();
    b.post_recv_unexpected(bid, Vec::new(), OpId(10)).unwrap();
    a.send_unexpected(&to_b, 2, b"again", OpId(11))
        .expect("a new lookup connects afresh");
    b.send_unexpected(&to_a, 2, b"me too", OpId(11)).unwrap();
    let (ca, cb) = drive_two(&mut a, &mut b, |ca, cb| {
        ca.iter().filter(|c| c.op.0 >= 10).count() == 2 && cb.iter().filter(|c| c.op.0 >= 10).count() == 2
    });
    for c in ca.iter().chain(&cb).filter(|c| c.op.0 >= 10) {
        c.status.as_ref().expect("over the live connections");
    }
    assert!(cb.iter().any(|c| c.buf.as_deref() == Some(&b"again"[..])));
    assert!(ca.iter().any(|c| c.buf.as_deref() == Some(&b"me too"[..])));
}

/// The first send to a peer waits for the connection, before the peer's
/// buffer size is known: one too large for it fails alone with a clear
/// error once it is, and the connection goes on (it broke the peer's
/// receive and the connection). The failed completion gives the message
/// and its destination back (what hg-rpc answers a lost response by).
#[test]
fn a_first_send_larger_than_the_peer_takes_fails_alone() {
    let Some(env) = common::rdma_env("a_first_send_larger_than_the_peer_takes_fails_alone") else {
        return;
    };
    let (mut srv, sid) = node_with(&env, true, 4096);
    let (mut cli, _) = node_with(&env, false, 8192);
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    let to = cli.lookup(&uri).unwrap();
    srv.post_recv_unexpected(sid, Vec::new(), OpId(1)).unwrap();
    cli.send_unexpected(&to, 1, &[7u8; 6000], OpId(2)).unwrap();
    cli.send_unexpected(&to, 2, b"small", OpId(3)).unwrap();
    let (cc, cs) = drive_two(&mut cli, &mut srv, |cc, cs| cc.len() == 2 && cs.len() == 1);
    let big = cc.iter().find(|c| c.op == OpId(2)).unwrap();
    match &big.status {
        Err(NaError::MessageTooLarge {
            len: 6000, max: 4096, ..
        }) => {}
        other => panic!("expected MessageTooLarge for the peer's buffer, got {other:?}"),
    }
    assert!(
        big.buf.as_deref() == Some(&[7u8; 6000][..]),
        "the failed message was not given back"
    );
    assert_eq!(big.source.as_ref(), Some(&to), "the failed send's destination");
    cc.iter()
        .find(|c| c.op == OpId(3))
        .unwrap()
        .status
        .as_ref()
        .unwrap();
    assert_eq!(cs[0].buf.as_deref(), Some(&b"small"[..]));
}

/// Clients that connect, send their credits' worth of messages nobody
/// receives, and go, again and again: each connection is within its own
/// bound, so only a bound over all of them keeps the listener's memory in
/// check. Beyond `max_held_total` new connections are refused (they were
/// all accepted, and the held messages grew with every client).
#[test]
fn held_messages_stay_bounded_when_clients_keep_coming() {
    let Some(env) = common::rdma_env("held_messages_stay_bounded_when_clients_keep_coming") else {
        return;
    };
    const DEPTH: u16 = 16;
    const TOTAL: u32 = 64;
    let mut srv = Endpoint::new(ProgressMode::Busy).unwrap();
    let cfg = VerbsConfig {
        listen: true,
        recv_depth: DEPTH,
        max_held_total: TOTAL,
        ..VerbsConfig::from_spec(&format!("verbs://{}/{}:0", env.device, env.ip), true).unwrap()
    };
    let sid = srv
        .add_plugin(|id| Ok(Box::new(VerbsPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    let held = |srv: &Endpoint| srv.plugin(sid).unwrap().stats().queued_arrivals;
    let (mut refused, mut delivered) = (0, 0);
    for round in 0..12u64 {
        let (mut cli, _) = node(&env, false);
        let to = cli.lookup(&uri).unwrap();
        for i in 0..u64::from(DEPTH) {
            cli.send_unexpected(&to, 0, &round.to_le_bytes(), OpId(i))
                .unwrap();
        }
        let mut done = 0;
        let end = Instant::now() + T;
        while done < DEPTH {
            assert!(Instant::now() < end, "round {round}: sends never completed");
            cli.progress(Some(Duration::ZERO)).unwrap();
            srv.progress(Some(Duration::ZERO)).unwrap();
            while let Some(c) = cli.pop_completion() {
                done += 1;
                match c.status {
                    Ok(()) => delivered += 1,
                    Err(_) => refused += 1,
                }
            }
        }
        drop(cli);
        assert!(
            held(&srv) <= u64::from(TOTAL) + u64::from(DEPTH),
            "round {round}: {} messages held, bound {TOTAL} + one connection's {DEPTH}",
            held(&srv)
        );
    }
    assert!(refused > 0, "no client was ever refused ({delivered} delivered)");
    assert!(delivered >= u64::from(TOTAL), "{delivered} delivered");
    let st = srv.plugin(sid).unwrap().stats();
    assert!(st.flow_blocked > 0, "{st:?}");
    // The application takes them: new clients are welcome again.
    for i in 0..held(&srv) {
        srv.post_recv_unexpected(sid, Vec::new(), OpId(1000 + i)).unwrap();
    }
    while srv.pop_completion().is_some() {}
    let (mut cli, _) = node(&env, false);
    let to = cli.lookup(&uri).unwrap();
    srv.post_recv_unexpected(sid, Vec::new(), OpId(9999)).unwrap();
    cli.send_unexpected(&to, 5, b"welcome back", OpId(1)).unwrap();
    let end = Instant::now() + T;
    let got = loop {
        assert!(
            Instant::now() < end,
            "a client after the backlog cleared was not served"
        );
        cli.progress(Some(Duration::ZERO)).unwrap();
        srv.progress(Some(Duration::ZERO)).unwrap();
        if let Some(c) = std::iter::from_fn(|| srv.pop_completion()).find(|c| c.op == OpId(9999)) {
            break c;
        }
    };
    assert_eq!(got.buf.as_deref(), Some(&b"welcome back"[..]));
}

/// Credits withheld while too many messages are held come back once the
/// application takes them. While `MAX_HELD` messages wait unclaimed, the
/// credits of every reposted buffer are withheld, those of messages a
/// posted receive took at once included; giving back only one per held
/// message taken lost the rest, and the sender stalled for good.
#[test]
fn withheld_credits_all_come_back_when_held_messages_are_taken() {
    let Some(env) = common::rdma_env("withheld_credits_all_come_back_when_held_messages_are_taken") else {
        return;
    };
    const DEPTH: u16 = 16;
    // One held message is enough: every repost after it is withheld, and
    // taking it gave back one credit of the sender's whole window.
    const MAX_HELD: u32 = 1;
    const FLOW: u64 = 200;
    let mut srv = Endpoint::new(ProgressMode::Busy).unwrap();
    let cfg = VerbsConfig {
        listen: true,
        recv_depth: DEPTH,
        max_held: MAX_HELD,
        ..VerbsConfig::from_spec(&format!("verbs://{}/{}:0", env.device, env.ip), true).unwrap()
    };
    let sid = srv
        .add_plugin(|id| Ok(Box::new(VerbsPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    let (mut cli, _) = node(&env, false);
    let to = cli.lookup(&uri).unwrap();
    let from = srv_peer(&mut srv, &mut cli, sid);
    // MAX_HELD messages nobody waits for yet (tag 7), then a flow the
    // server takes as it comes (tag 8).
    for i in 0..u64::from(MAX_HELD) {
        cli.send_expected(&to, 7, &i.to_le_bytes(), OpId(i)).unwrap();
    }
    for i in 0..FLOW {
        cli.send_expected(&to, 8, &i.to_le_bytes(), OpId(100 + i))
            .unwrap();
    }
    for i in 0..FLOW {
        srv.post_recv_expected(&from, 8, Vec::new(), OpId(1000 + i))
            .unwrap();
    }
    // The flow stops once the sender's credits are withheld.
    let (mut got, mut quiet) = (0u64, Instant::now());
    let end = Instant::now() + T;
    // (Quiet for 300 ms, and the listener holds its bound: a stall of
    // this thread on a loaded machine is not taken for a settled flow.)
    while quiet.elapsed() < Duration::from_millis(300)
        || srv.plugin(sid).unwrap().stats().queued_arrivals < u64::from(MAX_HELD)
    {
        assert!(Instant::now() < end, "the flow never settled");
        cli.progress(Some(Duration::ZERO)).unwrap();
        srv.progress(Some(Duration::ZERO)).unwrap();
        while cli.pop_completion().is_some() {}
        while srv.pop_completion().is_some() {
            got += 1;
            quiet = Instant::now();
        }
    }
    let st = srv.plugin(sid).unwrap().stats();
    assert!(
        got < FLOW,
        "nothing was withheld ({got} of {FLOW} arrived): {st:?}"
    );
    assert_eq!(st.queued_arrivals, u64::from(MAX_HELD), "{st:?}");
    // The application takes the held messages: the rest of the flow comes.
    for i in 0..u64::from(MAX_HELD) {
        srv.post_recv_expected(&from, 7, Vec::new(), OpId(5000 + i))
            .unwrap();
    }
    let end = Instant::now() + T;
    let mut held_taken = 0;
    while got < FLOW || held_taken < MAX_HELD {
        assert!(
            Instant::now() < end,
            "the sender stalled: {got} of {FLOW} arrived, {held_taken} held taken; {:?}",
            srv.plugin(sid).unwrap().stats()
        );
        cli.progress(Some(Duration::ZERO)).unwrap();
        srv.progress(Some(Duration::ZERO)).unwrap();
        while cli.pop_completion().is_some() {}
        while let Some(c) = srv.pop_completion() {
            c.status.expect("receive");
            if c.op.0 >= 5000 {
                held_taken += 1;
            } else {
                got += 1;
            }
        }
    }
}

/// The server-side address of the client `cli` connected to `srv` (sid):
/// an unexpected ping from the client names it.
fn srv_peer(srv: &mut Endpoint, cli: &mut Endpoint, sid: PluginId) -> Addr {
    srv.post_recv_unexpected(sid, Vec::new(), OpId(u64::MAX - 1))
        .unwrap();
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    let to = cli.lookup(&uri).unwrap();
    cli.send_unexpected(&to, 0, b"who am I", OpId(u64::MAX - 2))
        .unwrap();
    let end = Instant::now() + T;
    loop {
        assert!(Instant::now() < end, "the ping never came");
        cli.progress(Some(Duration::ZERO)).unwrap();
        srv.progress(Some(Duration::ZERO)).unwrap();
        if let Some(c) = std::iter::from_fn(|| srv.pop_completion()).find(|c| c.op == OpId(u64::MAX - 1)) {
            return c.source.expect("a received message names its source");
        }
    }
}

/// A memory handle registered with a plugin may outlive it (the
/// application keeps its buffers). The registration keeps the device
/// context alive, but not the plugin's listening id: once the plugin is
/// dropped its port is free for the next plugin, and a client looking up
/// the old address is refused at once instead of waiting out its set-up
/// timeout against a listener nobody serves.
#[test]
fn a_handle_kept_after_its_plugin_does_not_keep_its_port() {
    let Some(env) = common::rdma_env("a_handle_kept_after_its_plugin_does_not_keep_its_port") else {
        return;
    };
    let cfg = VerbsConfig::from_spec(&format!("verbs://{}/{}:47123", env.device, env.ip), true).unwrap();
    let mut a = VerbsPlugin::new(PluginId(1), cfg.clone()).expect("plugin on port 47123");
    let uri = a.self_addr().uri().to_owned();
    let kept = MemHandle::new(vec![vec![5u8; 4096]], Access::ReadWrite);
    a.mem_register(&kept).unwrap();
    drop(a);
    let b = VerbsPlugin::new(PluginId(2), cfg).expect("the port is free once its plugin is gone");
    drop(b);
    // Nobody listens there now: a send to it fails with the peer gone,
    // well before the client's set-up timeout.
    let (mut cli, cli_id) = common::plugin_with(&env, false, |c| c.setup_timeout = Duration::from_secs(60));
    let to = cli.lookup(&uri).unwrap();
    let t0 = Instant::now();
    cli.send_unexpected(&to, 1, b"anyone?", OpId(1)).unwrap();
    let status = loop {
        assert!(t0.elapsed() < T, "the send to a dead address never failed");
        cli.progress(Some(Duration::from_millis(10))).unwrap();
        if let Some(c) = std::iter::from_fn(|| cli.pop_completion()).find(|c| c.op == OpId(1)) {
            break c.status;
        }
    };
    assert!(matches!(status, Err(NaError::PeerGone { .. })), "{status:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "refused only after {:?}: a listener answered nobody",
        t0.elapsed()
    );
    let _ = cli_id;
    // The kept registration still works as memory.
    let mut back = [0u8; 4];
    kept.read_at(0, &mut back).unwrap();
    assert_eq!(back, [5; 4]);
}
