//! What an origin holds for calls it gave up on: their spilled inputs
//! (until the target answers, goes away, or the abandoned-input TTL
//! passes), within a bound that refuses, or makes a blocking call wait
//! for room; spilled outputs nobody will pull are released. Real sm
//! plugins, and a raw endpoint that plays a silent target.

use std::time::{Duration, Instant};

use hg_rpc::{Engine, Rpc, RpcError};
use na_core::{Addr, Endpoint, OpId, PluginId};
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{client, dir, endpoint, send_raw, take_request, Server};
mod routing_helpers;
use routing_helpers::{postcard_echo_response, pump, pump_both, response, T};
/// A raw endpoint playing a target that takes requests and never answers
/// (driven only by `take_request`), a client engine, and the target's
/// address as the client knows it. The directory lives as long as needed.
struct Silent {
    x: Endpoint,
    xid: PluginId,
    c: Engine,
    s: Addr,
    _dir: common::TestDir,
}

fn silent_target(tag: &str) -> Silent {
    let d = dir(tag);
    let (x, xid) = endpoint(&d, true);
    let x_uri = x.plugin(xid).unwrap().self_addr().uri().to_owned();
    let mut c = client(&d);
    let s = c.endpoint().lookup(&x_uri).unwrap();
    Silent {
        x,
        xid,
        c,
        s,
        _dir: d,
    }
}

/// Small input, large output: only the response spills.
struct Big;
impl Rpc for Big {
    const NAME: &'static str = "test.routing.big";
    type Input = u32;
    type Output = ByteBuf;
}

/// A spilled output nobody will pull (its call was abandoned) is released
/// when the response comes, instead of staying exposed on the target for
/// SPILLED_OUTPUT_TTL; and an abandoned call with a spilled input does
/// not pull the output of its late response.
#[test]
fn spilled_outputs_of_abandoned_calls_are_released_not_kept() {
    let d = dir("abandoned-spill");
    let (ep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    srv.register::<Big>(|n| Ok(ByteBuf::from(vec![7u8; n as usize])))
        .unwrap();
    srv.register::<Echo>(Ok).unwrap();
    let (ep, cid) = endpoint(&d, false);
    let mut c = Engine::new(ep, cid).unwrap();
    let s = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    // Warm up both ways (connection set up, a spilled output pulled and released).
    let id = c.forward::<Big>(&s, &(1 << 20)).unwrap();
    pump_both(&mut c, &mut srv, "first call", |c, _| c.is_finished(id));
    assert_eq!(c.take_response::<Big>(id).unwrap().unwrap().len(), 1 << 20);
    pump_both(&mut c, &mut srv, "release after a pull", |_, s| {
        s.stats().exposed_outputs == 0
    });

    // Small input: the call is forgotten at once; its spilled output is
    // released when the stray response comes.
    let id = c.forward::<Big>(&s, &(1 << 20)).unwrap();
    c.abandon(id);
    pump_both(&mut c, &mut srv, "stray response", |c, _| {
        c.stats().stray_responses == 1
    });
    pump_both(&mut c, &mut srv, "release of a stray output", |_, s| {
        s.stats().exposed_outputs == 0
    });

    // Spilled input: the call stays until the response; the output is
    // released, not pulled.
    let got_before = c.endpoint().plugin(cid).unwrap().stats().get_bytes;
    let id = c.forward::<Echo>(&s, &ByteBuf::from(vec![3u8; 1 << 20])).unwrap();
    c.abandon(id);
    pump_both(&mut c, &mut srv, "late response", |c, _| {
        c.stats().abandoned_inputs == 0
    });
    pump_both(
        &mut c,
        &mut srv,
        "release of an abandoned call's output",
        |_, s| s.stats().exposed_outputs == 0,
    );
    let got = c.endpoint().plugin(cid).unwrap().stats().get_bytes - got_before;
    assert!(got < 1 << 20, "pulled {got} bytes of an output nobody wanted");
}

/// A target that takes spilled requests and never answers nor goes away:
/// the origin keeps the inputs of the calls it gave up on (and of one-way
/// calls) exposed only for the abandoned-input TTL, then drops them.
#[test]
fn a_silent_target_does_not_keep_abandoned_inputs_forever() {
    let Silent {
        mut x,
        xid,
        mut c,
        s,
        _dir,
    } = silent_target("silent");
    c.set_abandoned_input_ttl(Duration::from_millis(300));
    let big = ByteBuf::from(vec![5u8; 64 << 10]);
    let id = c.forward::<Echo>(&s, &big).unwrap();
    take_request(&mut x, xid, &mut c, 1);
    c.abandon(id);
    c.forward_one_way::<Echo>(&s, &big).unwrap();
    take_request(&mut x, xid, &mut c, 2);
    assert_eq!(c.stats().abandoned_inputs, 2, "{:?}", c.stats());
    // Half the TTL: still kept (the target may be pulling).
    pump(&mut c, Duration::from_millis(100));
    assert_eq!(c.stats().abandoned_inputs, 2);
    let end = Instant::now() + T;
    while c.stats().abandoned_inputs > 0 {
        assert!(Instant::now() < end, "abandoned inputs kept: {:?}", c.stats());
        pump(&mut c, Duration::from_millis(50));
    }
    assert_eq!(c.stats().in_flight, 0);
    assert_eq!(c.stats().abandoned_bytes, 0, "{:?}", c.stats());
}

/// A target that takes spilled requests and does not answer (yet): the
/// inputs its origin holds for calls it gave up on and for one-way calls
/// stay within `set_max_abandoned_bytes`. A call whose spilled input would
/// pass the bound is refused with `InputsHeld` before anything is sent; a
/// call that fits a message still goes; once the target answers, the bytes
/// come back and large calls go again.
#[test]
fn inputs_held_for_abandoned_calls_are_bounded() {
    let Silent {
        mut x,
        xid,
        mut c,
        s,
        _dir,
    } = silent_target("held");
    let cid = c.endpoint().plugin_ids().next().unwrap();
    let big = ByteBuf::from(vec![5u8; 64 << 10]);
    let len = postcard::to_allocvec(&big).unwrap().len() as u64;
    c.set_max_abandoned_bytes(3 * len + 1024);
    let mut cookies = Vec::new();
    for op in 1..=2 {
        let id = c.forward::<Echo>(&s, &big).unwrap();
        cookies.push(take_request(&mut x, xid, &mut c, op).1);
        c.abandon(id);
        // Giving up twice holds the input once.
        c.abandon(id);
    }
    c.forward_one_way::<Echo>(&s, &big).unwrap();
    cookies.push(take_request(&mut x, xid, &mut c, 3).1);
    let st = c.stats();
    assert_eq!((st.abandoned_inputs, st.abandoned_bytes), (3, 3 * len), "{st:?}");

    let sent = c.endpoint().plugin(cid).unwrap().stats().msgs_sent;
    match c.forward::<Echo>(&s, &big) {
        Err(RpcError::InputsHeld {
            len: l, held, max, ..
        }) => {
            assert_eq!((l, held, max), (len, 3 * len, 3 * len + 1024));
        }
        other => panic!("expected InputsHeld, got {other:?}"),
    }
    match c.forward_one_way::<Echo>(&s, &big) {
        Err(RpcError::InputsHeld { .. }) => {}
        other => panic!("expected InputsHeld, got {other:?}"),
    }
    let st = c.stats();
    assert_eq!(
        (st.inputs_refused, st.in_flight, st.abandoned_inputs),
        (2, 0, 3),
        "{st:?}"
    );
    assert_eq!(
        c.endpoint().plugin(cid).unwrap().stats().msgs_sent,
        sent,
        "a refused call sent something"
    );

    // A call that fits a message is not refused.
    let small = c.forward::<Echo>(&s, &ByteBuf::from(vec![1u8; 16])).unwrap();
    let (origin, cookie) = take_request(&mut x, xid, &mut c, 4);
    send_raw(
        &mut x,
        &origin,
        None,
        &postcard_echo_response(cookie, &[1u8; 16]),
        OpId(5),
    );
    let end = Instant::now() + T;
    while !c.is_finished(small) {
        assert!(Instant::now() < end, "the small call got no response");
        pump(&mut c, Duration::from_millis(5));
    }
    assert_eq!(c.take_response::<Echo>(small).unwrap().unwrap(), vec![1u8; 16]);

    // The target answers the abandoned calls (and acknowledges the one-way
    // one): their inputs are let go, and a large call goes again.
    for (i, &cookie) in cookies.iter().enumerate() {
        send_raw(
            &mut x,
            &origin,
            None,
            &response(Echo::NAME, cookie),
            OpId(10 + i as u64),
        );
    }
    let end = Instant::now() + T;
    while c.stats().abandoned_bytes > 0 {
        assert!(Instant::now() < end, "inputs still held: {:?}", c.stats());
        pump(&mut c, Duration::from_millis(5));
    }
    assert_eq!(c.stats().abandoned_inputs, 0);
    c.forward::<Echo>(&s, &big).unwrap();
    take_request(&mut x, xid, &mut c, 20);
}

/// A spilled input larger than the whole bound of inputs held for
/// abandoned calls can never be sent: a blocking `call` says so at once,
/// not after waiting its whole timeout for room that cannot come.
#[test]
fn an_input_larger_than_the_whole_held_bound_is_refused_at_once() {
    let Silent { mut c, s, _dir, .. } = silent_target("held-never");
    c.set_max_abandoned_bytes(32 << 10);
    let started = Instant::now();
    match c.call::<Echo>(&s, &ByteBuf::from(vec![5u8; 64 << 10]), T) {
        Err(RpcError::TooLarge { what, len, max, .. }) => {
            assert!(what.contains("set_max_abandoned_bytes"), "{what}");
            assert!(len > 64 << 10 && max == 32 << 10, "{len} {max}");
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < T / 2, "waited {:?}", started.elapsed());
    let st = c.stats();
    assert_eq!((st.inputs_refused, st.errors, st.in_flight), (1, 1, 0), "{st:?}");
}

/// A silent target (`tag`) and an origin that holds one spilled input
/// for it (a one-way call the target took and never acknowledges) and
/// may hold no other of its size: its next such input is refused with
/// `InputsHeld` until the held one's TTL (300 ms) ends. Returns them and
/// that input.
fn one_input_held(tag: &str) -> (Silent, ByteBuf) {
    let mut t = silent_target(tag);
    t.c.set_abandoned_input_ttl(Duration::from_millis(300));
    let big = ByteBuf::from(vec![5u8; 64 << 10]);
    let len = postcard::to_allocvec(&big).unwrap().len() as u64;
    t.c.set_max_abandoned_bytes(len + 1024);
    t.c.forward_one_way::<Echo>(&t.s, &big).unwrap();
    take_request(&mut t.x, t.xid, &mut t.c, 1);
    assert_eq!(t.c.stats().abandoned_bytes, len);
    (t, big)
}

/// A blocking `call` whose spilled input is refused for the inputs held
/// for abandoned calls waits for room within its timeout: it drives the
/// engine, so the held input's TTL can end, then it sends. (Refused at
/// once, a caller retrying `call` would never drive the engine, and never
/// get room.)
#[test]
fn a_blocking_call_waits_for_room_for_its_spilled_input() {
    let (t, big) = one_input_held("held-wait");
    let (mut x, xid, mut c, s, _dir) = (t.x, t.xid, t.c, t.s, t._dir);
    match c.forward::<Echo>(&s, &big) {
        Err(RpcError::InputsHeld { .. }) => {}
        other => panic!("expected InputsHeld, got {other:?}"),
    }
    // The silent target never answers: the call goes out once the first
    // input's TTL ends, then times out.
    let r = c.call::<Echo>(&s, &big, Duration::from_secs(4));
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    let (_, cookie) = take_request(&mut x, xid, &mut c, 2);
    assert_ne!(cookie, 0, "the call's request reached the target");
    assert!(c.stats().inputs_refused >= 2, "{:?}", c.stats());
}

/// A blocking call that waits for room for its spilled input sleeps
/// until the room comes back (here the held input's TTL, 2 s, ends in
/// `trigger`; `progress` sleeps until `next_expiry` says so), not in
/// 10 ms turns: a handful of attempts are refused, where a 10 ms retry
/// made about 200.
#[test]
fn a_blocking_call_waiting_for_room_sleeps_until_the_room_comes_back() {
    let (t, big) = one_input_held("held-wait-idle");
    let (mut x, xid, mut c, s, _dir) = (t.x, t.xid, t.c, t.s, t._dir);
    c.set_abandoned_input_ttl(Duration::from_secs(2));
    let refused = c.stats().inputs_refused;
    let t0 = Instant::now();
    c.call_one_way_within::<Echo>(&s, &big, T)
        .expect("sent once the held input's TTL ended");
    let waited = t0.elapsed();
    let tries = c.stats().inputs_refused - refused;
    // At least one: it waited (refused at first, as `one_input_held` says).
    assert!(
        (1..=10).contains(&tries),
        "{tries} attempts refused in {waited:?} of waiting for room: {:?}",
        c.stats()
    );
    let (_, cookie) = take_request(&mut x, xid, &mut c, 2);
    assert_ne!(cookie, 0, "the spilled one-way request reached the target");
}

/// `call_one_way_within` (blocking) waits for room for its spilled input
/// as `call` does: it drives the engine until the held input's TTL ends,
/// then sends; with no room within its timeout it fails with
/// `InputsHeld`, counted once in `errors`.
#[test]
fn a_blocking_one_way_call_within_a_timeout_waits_for_room() {
    let (t, big) = one_input_held("held-wait-one-way");
    let (mut x, xid, mut c, s, _dir) = (t.x, t.xid, t.c, t.s, t._dir);
    // Too short for the TTL: refused, once.
    let errors = c.stats().errors;
    match c.call_one_way_within::<Echo>(&s, &big, Duration::from_millis(50)) {
        Err(RpcError::InputsHeld { .. }) => {}
        other => panic!("expected InputsHeld, got {other:?}"),
    }
    assert_eq!(c.stats().errors, errors + 1, "{:?}", c.stats());
    // Long enough: sent once the first input's TTL ends.
    let t0 = Instant::now();
    c.call_one_way_within::<Echo>(&s, &big, Duration::from_secs(4))
        .expect("sent once there was room");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    let (_, cookie) = take_request(&mut x, xid, &mut c, 2);
    assert_ne!(cookie, 0, "the spilled one-way request reached the target");
    assert_eq!(c.stats().errors, errors + 1, "{:?}", c.stats());
}

/// Abandoned inputs expire in the order they were abandoned even when an
/// earlier one ends first: a call whose target answered leaves its place
/// in that order, and the wait for the next expiry neither stops at it
/// nor skips the later one (the sweep reads the order, not the call
/// table: a guard for that change, it passes with the table scan too).
#[test]
fn an_abandoned_input_behind_one_that_was_answered_still_expires_on_time() {
    let Silent {
        mut x,
        xid,
        mut c,
        s,
        _dir,
    } = silent_target("order");
    let srv = Server::start(&_dir);
    let live = c.endpoint().lookup(&srv.uri).unwrap();
    let ttl = Duration::from_millis(400);
    c.set_abandoned_input_ttl(ttl);
    let big = ByteBuf::from(vec![5u8; 64 << 10]);
    // First: answered by a real server after it is given up on.
    let answered = c.forward::<Echo>(&live, &big).unwrap();
    c.abandon(answered);
    // Second: the silent target takes it and never answers.
    let silent = c.forward::<Echo>(&s, &big).unwrap();
    take_request(&mut x, xid, &mut c, 1);
    c.abandon(silent);
    let silent_at = Instant::now();
    let end = Instant::now() + T;
    while c.stats().abandoned_inputs > 1 {
        assert!(Instant::now() < end, "the server never answered: {:?}", c.stats());
        pump(&mut c, Duration::from_millis(5));
    }
    assert_eq!(c.stats().abandoned_inputs, 1, "{:?}", c.stats());
    let next = c.next_expiry().expect("an input is still kept");
    assert!(
        next <= silent_at + ttl + Duration::from_secs(2),
        "{next:?} too late"
    );
    // Not before its TTL…
    pump(&mut c, ttl / 4);
    if silent_at.elapsed() < ttl {
        assert_eq!(c.stats().abandoned_inputs, 1, "dropped before its TTL");
    }
    // …and within a few sweeps after it, with nothing left to wake for.
    while c.stats().abandoned_inputs > 0 {
        assert!(Instant::now() < end, "kept past its TTL: {:?}", c.stats());
        pump(&mut c, Duration::from_millis(20));
    }
    assert!(silent_at.elapsed() >= ttl, "dropped before its TTL");
    assert_eq!(
        (c.stats().abandoned_bytes, c.stats().in_flight),
        (0, 0),
        "{:?}",
        c.stats()
    );
    assert_eq!(c.next_expiry(), None, "nothing kept, nothing to wake for");
}

/// While a silent target's abandoned input waits out its TTL at the front
/// of the abandonment order, the entries of spilled one-way calls that a
/// live server took behind it do not pile up: a sweep drops them once
/// they pass twice the calls kept at the last such drop (at least
/// `MIN_COMPACT`, 1,024).
#[test]
fn answered_abandonments_behind_a_kept_one_do_not_pile_up() {
    let Silent {
        mut x,
        xid,
        mut c,
        s,
        _dir,
    } = silent_target("pileup");
    let (ep, sid) = endpoint(&_dir, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    srv.register::<RecordBlob>(|_| Ok(())).unwrap();
    let live = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    // Past the largest message (8 KiB over na-sm): every input spills.
    let big = ByteBuf::from(vec![5u8; 9 << 10]);
    // The kept input must outlive the test: 3,600 spilled calls take
    // seconds in a debug build, and took over 40 s on a loaded 2-core box
    // while `RecordBlob`'s input was a `Vec<u8>`, encoded byte by byte
    // (the default TTL, 60 s, was within reach of it, and so was a 60 s
    // bound).
    c.set_abandoned_input_ttl(Duration::from_secs(3600));
    let kept = c.forward::<Echo>(&s, &big).unwrap();
    take_request(&mut x, xid, &mut c, 1);
    c.abandon(kept);
    let end = Instant::now() + 24 * T;
    let turn = |c: &mut Engine, srv: &mut Engine| {
        for e in [c, srv] {
            e.progress(Some(Duration::ZERO)).unwrap();
            e.trigger().unwrap();
        }
    };
    // Waves of 300 one-way calls, each taken before the next: never more
    // than 301 kept at once, 3,600 abandoned in all.
    for _ in 0..12 {
        for _ in 0..300 {
            while let Err(e) = c.forward_one_way::<RecordBlob>(&live, &big) {
                assert!(
                    matches!(e, RpcError::InputsHeld { .. }),
                    "{}",
                    na_core::ErrorChain(&e)
                );

                assert!(Instant::now() < end, "no room: {:?}", c.stats());
                turn(&mut c, &mut srv);
            }
        }
        while c.stats().abandoned_inputs > 1 {
            assert!(
                Instant::now() < end,
                "the server never took them: {:?}",
                c.stats()
            );
            turn(&mut c, &mut srv);
        }
    }
    // A sweep (once a second) drops the entries of the ended calls; the
    // kept one stays.
    let sweep = Instant::now() + Duration::from_millis(1100);
    while Instant::now() < sweep {
        turn(&mut c, &mut srv);
    }
    assert_eq!(c.stats().abandoned_inputs, 1, "{:?}", c.stats());
    assert!(
        c.abandoned_entries() <= 1024,
        "{} entries kept",
        c.abandoned_entries()
    );
}
