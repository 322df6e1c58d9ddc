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
//! drives the listener with `progress_now` only, so it knows which call
//! reads CM events.
//!
//! Without an RDMA device the RDMA part cannot run: the test says so
//! loudly (and checks the clear "no RDMA device" error).

mod common;

use std::time::{Duration, Instant};

use common::*;
use na_core::{Addr, Endpoint, OpId, OpKind, PluginId};
use na_verbs::CM_POLL_EVERY;

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

/// The listener, driven by `progress_now` only and counting its calls
/// (the plugin reads RDMA CM events at every `CM_POLL_EVERY`th).
struct Listener {
    ep: Endpoint,
    id: PluginId,
    calls: u32,
}

impl Listener {
    fn progress(&mut self) {
        self.ep.progress_now().unwrap();
        self.calls += 1;
    }

    fn stats(&self) -> na_core::PluginStats {
        self.ep.plugin(self.id).unwrap().stats()
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
            for c in std::iter::from_fn(|| srv.ep.pop_completion()) {
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
    let (ep, id) = plugin_with(&env, true, |cfg| {
        cfg.recv_depth = DEPTH;
        cfg.max_msg_size = 16;
        cfg.max_held = MAX_HELD;
        cfg.max_held_total = TOTAL;
        cfg.send_queue_depth = u32::from(DEPTH) + 8;
        // The steady client and the two flooders (the CQ is sized for them),
        // all incoming: this listener never calls out.
        cfg.max_conns = 3;
        cfg.outgoing_reserve = Some(0);
    });
    let mut srv = Listener { ep, id, calls: 0 };
    let uri = srv.ep.self_addr(id).unwrap().uri().to_owned();

    // The steady client: a first message tells the listener its address;
    // then MAX_HELD expected messages nobody waits for (held: its own
    // bound), then MATCHED expected messages the listener waits for
    // (taken at once, but withheld: the connection is at its bound).
    let (mut a, a_dest) = client(&env, &uri);
    srv.ep.post_recv_unexpected(id, Vec::new(), OpId(0)).unwrap();
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
        srv.ep
            .post_recv_expected(&a_src, tag, Vec::new(), OpId(1000 + u64::from(tag)))
            .unwrap();
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
        srv.ep.post_recv_unexpected(id, Vec::new(), OpId(10 + f)).unwrap();
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
    // Their disconnects reach the listener's CM at once; generous.
    std::thread::sleep(Duration::from_secs(2));
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
        srv.ep
            .post_recv_expected(&a_src, 10 + t, Vec::new(), OpId(100 + u64::from(t)))
            .unwrap();
    }
    drive(
        &mut srv,
        &mut a,
        (0, MAX_HELD as usize),
        true,
        "the steady client's held messages",
    );
    for i in 0..flood {
        srv.ep
            .post_recv_unexpected(id, Vec::new(), OpId(1_000_000 + i))
            .unwrap();
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
        srv.ep
            .post_recv_expected(&a_src, tag, Vec::new(), OpId(u64::from(tag)))
            .unwrap();
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
        while let Some(c) = srv.ep.pop_completion() {
            assert_eq!(c.kind, OpKind::RecvExpected);
            c.status.expect("receive");
            got += 1;
        }
    }
}
