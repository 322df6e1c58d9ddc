//! Messages of a connection that died before its receive completions
//! were read are still delivered (held, if nobody waits for them), but
//! nothing is reposted for them. When such messages bring the held total
//! to `VerbsConfig::max_held_total`, the connections that withheld
//! credits for their own `max_held` meanwhile must get them back once
//! the total falls under its bound again; before, only a repost at the
//! bound noted that connections withheld for the total, the credits
//! stayed withheld for good, and the connection stalled.
//!
//! How the listener comes to read completions of a dead connection: it
//! reads at most 1024 completions per progress call and its RDMA CM
//! events every `CM_POLL_EVERY` calls; a disconnect event reads another
//! 1024 before it kills the connection. Two flooders that each fill the
//! listener's CQ with 4095 messages and go before the listener looks
//! leave it, at the call that reads their disconnects, more completions
//! than those reads take: the rest come from dead connections. The test
//! drives the listener with `progress` only, so it knows which call
//! reads CM events, and waits for both disconnects to reach the
//! listener before that call (`VerbsPlugin::debug_cm_disconnects_waiting`,
//! a test hook that reads CM events without acting on them).
//!
//! Without an RDMA device the RDMA part cannot run: the test says so
//! loudly (and checks the clear "no RDMA device" error).

mod common;

use std::time::{Duration, Instant};

use common::*;
use na_core::{Addr, Completion, Endpoint, OpId, OpKind, Plugin, PluginId};
use na_verbs::{VerbsConfig, VerbsPlugin, CM_POLL_EVERY};

/// Receive depth of every side: each flooder's credits.
const DEPTH: u16 = 4096;
/// The listener's `max_held`.
const MAX_HELD: u32 = 8;
/// The listener's `max_held_total` (the least the configuration allows).
const TOTAL: u32 = DEPTH as u32;
/// Messages the steady client sends while at its own bound (matched at
/// once; their credits are withheld all the same).
const MATCHED: u32 = 4000;
/// Messages the steady client sends at the end.
const AFTER: u32 = 200;

/// The listener, a plugin of its own (not in an endpoint: the test uses
/// its CM hook), driven by `progress` only and counting its calls (the
/// plugin reads RDMA CM events at every `CM_POLL_EVERY`th).
struct Listener {
    plugin: VerbsPlugin,
    calls: u32,
}

impl Listener {
    fn progress(&mut self) {
        self.plugin.progress().unwrap();
        self.calls += 1;
    }

    fn pop(&mut self) -> Option<Completion> {
        self.plugin.pop_completion()
    }

    fn stats(&self) -> na_core::PluginStats {
        self.plugin.stats()
    }

    fn recv_unexpected(&mut self, op: u64) {
        self.plugin.post_recv_unexpected(Vec::new(), OpId(op)).unwrap();
    }

    fn recv_expected(&mut self, source: &Addr, tag: u32, op: u64) {
        self.plugin
            .post_recv_expected(source, tag, Vec::new(), OpId(op))
            .unwrap();
    }
}

/// A client plugin sending to the listener at `uri`.
fn client(env: &RdmaEnv, uri: &str) -> (Endpoint, Addr) {
    let (mut ep, _) = plugin_with(env, false, |cfg| {
        cfg.recv_depth = DEPTH;
        cfg.send_queue_depth = u32::from(DEPTH) + 8;
        cfg.max_msg_size = 16;
        cfg.max_conns = 1;
    });
    let dest = ep.lookup(uri).unwrap();
    (ep, dest)
}

/// Drives `cli`, and the listener if `listening`, until `sends` sends of
/// `cli` and `recvs` operations of the listener completed, each
/// successfully; returns the listener's completions.
fn drive(
    srv: &mut Listener,
    cli: &mut Endpoint,
    (sends, recvs): (u32, usize),
    listening: bool,
    what: &str,
) -> Vec<na_core::Completion> {
    let (mut done, mut got) = (0, Vec::new());
    let end = Instant::now() + 2 * WAIT;
    while done < sends || got.len() < recvs {
        assert!(
            Instant::now() < end,
            "{what}: {done} of {sends} sends and {} of {recvs} listener operations completed",
            got.len()
        );
        cli.progress_now().unwrap();
        while let Some(c) = cli.pop_completion() {
            c.status
                .unwrap_or_else(|e| panic!("{what}: send {:?} failed: {}", c.op, na_core::ErrorChain(&e)));
            done += 1;
        }
        if listening {
            srv.progress();
            for c in std::iter::from_fn(|| srv.pop()) {
                if let Err(e) = &c.status {
                    panic!(
                        "{what}: the listener's {:?} {:?} failed: {}",
                        c.kind,
                        c.op,
                        na_core::ErrorChain(e)
                    );
                }
                got.push(c);
            }
        }
    }
    got
}

#[test]
fn credits_withheld_before_dead_connections_filled_the_total_come_back() {
    let test = "credits_withheld_before_dead_connections_filled_the_total_come_back";
    let Some(env) = rdma_env(test) else {
        return;
    };
    let spec = format!("verbs://{}/{}:0", env.device, env.ip);
    let cfg = VerbsConfig {
        recv_depth: DEPTH,
        max_msg_size: 16,
        max_held: MAX_HELD,
        max_held_total: TOTAL,
        send_queue_depth: u32::from(DEPTH) + 8,
        // The steady client and the two flooders (the CQ is sized for them),
        // all incoming: this listener never calls out.
        max_conns: 3,
        outgoing_reserve: Some(0),
        ..VerbsConfig::from_spec(&spec, true).unwrap()
    };
    let mut srv = Listener {
        plugin: VerbsPlugin::new(PluginId(1), cfg).expect("the listener"),
        calls: 0,
    };
    let uri = srv.plugin.self_addr().uri().to_owned();

    // The steady client: a first message tells the listener its address;
    // then MAX_HELD expected messages nobody waits for (held: its own
    // bound), then MATCHED expected messages the listener waits for
    // (taken at once, but withheld: the connection is at its bound).
    let (mut a, a_dest) = client(&env, &uri);
    srv.recv_unexpected(0);
    a.send_unexpected(&a_dest, 1, b"a", OpId(0)).unwrap();
    let got = drive(
        &mut srv,
        &mut a,
        (1, 1),
        true,
        "the steady client's first message",
    );
    let a_src = got[0].source.clone().expect("a receive has a source");
    for t in 0..MAX_HELD {
        a.send_expected(&a_dest, 10 + t, b"held", OpId(1 + u64::from(t)))
            .unwrap();
    }
    for t in 0..MATCHED {
        let tag = 1000 + t;
        srv.recv_expected(&a_src, tag, 1000 + u64::from(tag));
        a.send_expected(&a_dest, tag, b"matched", OpId(1000 + u64::from(tag)))
            .unwrap();
    }
    drive(
        &mut srv,
        &mut a,
        (MAX_HELD + MATCHED, MATCHED as usize),
        true,
        "the steady client",
    );
    let st = srv.stats();
    assert_eq!(st.queued_arrivals, u64::from(MAX_HELD), "{st:?}");

    // Two flooders connect (one message each, taken), ...
    let mut flooders = Vec::new();
    for f in 0..2u64 {
        let (mut z, z_dest) = client(&env, &uri);
        srv.recv_unexpected(10 + f);
        z.send_unexpected(&z_dest, 2, b"z", OpId(0)).unwrap();
        drive(&mut srv, &mut z, (1, 1), true, "a flooder's first message");
        flooders.push((z, z_dest));
    }
    // ... the listener is brought to the call before one that reads CM
    // events (nothing is in its CQ now), ...
    while !(srv.calls + 1).is_multiple_of(CM_POLL_EVERY) {
        srv.progress();
    }
    let blocked_before = srv.stats().flow_blocked;
    // ... they fill its CQ with all their credits allow while it does
    // not look, and go.
    let per_flooder = u32::from(DEPTH) - 2;
    for (z, z_dest) in &mut flooders {
        for i in 0..per_flooder {
            z.send_unexpected(z_dest, 3, &i.to_le_bytes(), OpId(1 + u64::from(i)))
                .unwrap();
        }
        drive(&mut srv, z, (per_flooder, 0), false, "a flooder");
    }
    drop(flooders);
    // Their disconnects reach the listener's CM: read, not acted on, so
    // that the next call (which reads CM events) acts on both. Without
    // this wait that call may find them not there yet and read the
    // flooders' messages as a live connection's.
    let end = Instant::now() + WAIT;
    loop {
        let waiting = srv.plugin.debug_cm_disconnects_waiting().unwrap();
        if waiting >= 2 {
            break;
        }
        assert!(
            Instant::now() < end,
            "{test}: {waiting} of the flooders' 2 disconnects reached the listener within {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The call that reads the disconnects, and those that read the
    // rest of the CQ.
    let flood = 2 * u64::from(per_flooder);
    let end = Instant::now() + WAIT;
    while srv.stats().queued_arrivals < u64::from(MAX_HELD) + flood && Instant::now() < end {
        srv.progress();
    }
    let st = srv.stats();
    let reposted_withheld = st.flow_blocked - blocked_before;
    eprintln!(
        "{test}: {flood} flooded, held {}, withheld at a repost {reposted_withheld}",
        st.queued_arrivals
    );
    assert_eq!(
        st.queued_arrivals,
        u64::from(MAX_HELD) + flood,
        "every message arrived whole: {st:?}"
    );
    assert!(
        reposted_withheld + 2 * u64::from(MAX_HELD) < flood,
        "every flooded message was reposted (the disconnects came late): the test tested nothing"
    );

    // The application takes the steady client's held messages first
    // (the total stays at its bound meanwhile), then the flooders'.
    for t in 0..MAX_HELD {
        srv.recv_expected(&a_src, 10 + t, 100 + u64::from(t));
    }
    drive(
        &mut srv,
        &mut a,
        (0, MAX_HELD as usize),
        true,
        "the steady client's held messages",
    );
    for i in 0..flood {
        srv.recv_unexpected(1_000_000 + i);
    }
    drive(
        &mut srv,
        &mut a,
        (0, flood as usize),
        true,
        "the flooders' held messages",
    );
    assert_eq!(srv.stats().queued_arrivals, 0);

    // The steady client goes on: every message must get through (its
    // peer must have returned the credits it withheld).
    for t in 0..AFTER {
        let tag = 100_000 + t;
        srv.recv_expected(&a_src, tag, u64::from(tag));
        a.send_expected(&a_dest, tag, b"after", OpId(u64::from(tag)))
            .unwrap();
    }
    let end = Instant::now() + WAIT;
    let (mut sent, mut got) = (0, 0);
    while sent < AFTER || got < AFTER {
        assert!(
            Instant::now() < end,
            "stalled: {sent} of {AFTER} sends done, {got} received; listener {:?}",
            srv.stats()
        );
        a.progress_now().unwrap();
        while let Some(c) = a.pop_completion() {
            c.status.expect("send");
            sent += 1;
        }
        srv.progress();
        while let Some(c) = srv.pop() {
            assert_eq!(c.kind, OpKind::RecvExpected);
            if let Err(e) = c.status {
                panic!("a receive failed: {}", na_core::ErrorChain(&e));
            }
            got += 1;
        }
    }
}
