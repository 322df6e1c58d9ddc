//! What an origin keeps for its calls, and what that costs: the inputs of
//! calls it gave up on, kept for the abandoned-input TTL (their sweep
//! reads them in the order they were given up on, not the call table),
//! and the call table's slots after a burst. Real sm plugins.

use std::time::{Duration, Instant};

use hg_rpc::{Engine, RpcError, ABANDONED_INPUT_TTL};
use na_core::{Addr, Endpoint, PluginId};
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{client, dir, endpoint, take_request, Server, TestDir};

const T: Duration = Duration::from_secs(10);
/// The deadline of a call whose input or output is megabytes: long, as
/// its (de)serialization is CPU work a loaded box may be slow to give.
const BIG_T: Duration = Duration::from_secs(120);

/// Drives `c` for `d`.
fn pump(c: &mut Engine, d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        c.progress(Some(Duration::from_millis(10))).unwrap();
        c.trigger().unwrap();
    }
}

/// A client `c` and a target `s` that takes the connection, never
/// answers, and takes (reads) only what a test makes it take (`x`).
fn silent_target(d: &TestDir) -> (Endpoint, PluginId, Engine, Addr) {
    let (x, xid) = endpoint(d, true);
    let x_uri = x.plugin(xid).unwrap().self_addr().uri().to_owned();
    let mut c = client(d);
    let s = c.endpoint().lookup(&x_uri).unwrap();
    (x, xid, c, s)
}

/// With one abandoned input kept for its TTL and 2,000 calls in flight,
/// the TTL's sweeps (once a second) look at the kept input only, not at
/// every call: their cost follows what they keep and drop. (With the
/// call table scanned, each sweep looked at all 2,001 calls.)
#[test]
fn the_ttl_sweep_looks_at_the_inputs_kept_not_at_the_calls_in_flight() {
    let d = dir("ttl-cost");
    let (mut x, xid, mut c, s) = silent_target(&d);
    let ttl = Duration::from_secs(4);
    c.set_abandoned_input_ttl(ttl);
    let kept = c
        .forward::<Echo>(&s, &ByteBuf::from(vec![5u8; 64 << 10]))
        .unwrap();
    take_request(&mut x, xid, &mut c, 1);
    let before = Instant::now();
    c.abandon(kept);
    let kept_at = Instant::now();
    for i in 0..2000u64 {
        c.forward::<Add>(&s, &(i, 1)).unwrap();
    }
    // Two sweeps at least, within the TTL.
    pump(&mut c, Duration::from_millis(2300));
    let st = c.stats();
    if kept_at.elapsed() < ttl {
        assert_eq!((st.abandoned_inputs, st.in_flight), (1, 2000), "{st:?}");
    }
    assert!(
        c.abandoned_visits() <= 4,
        "the sweeps looked at {} entries for one input kept",
        c.abandoned_visits()
    );
    let next = c.next_expiry().expect("an input is kept");
    assert!(
        next >= before + ttl && next <= kept_at + ttl + Duration::from_secs(2),
        "the next expiry is not the kept input's"
    );
}

/// `next_expiry`, asked at every wait (`progress`) and before every
/// driver sleep, reads the oldest abandonment only: with one input kept
/// and 2,000 calls in flight, one entry per ask, not every call. (With
/// the call table scanned, each ask looked at all 2,001 calls.)
#[test]
fn next_expiry_looks_at_the_oldest_input_kept_not_at_the_calls_in_flight() {
    let d = dir("expiry-cost");
    let (mut x, xid, mut c, s) = silent_target(&d);
    let kept = c
        .forward::<Echo>(&s, &ByteBuf::from(vec![5u8; 64 << 10]))
        .unwrap();
    take_request(&mut x, xid, &mut c, 1);
    let before = Instant::now();
    c.abandon(kept);
    for i in 0..2000u64 {
        c.forward::<Add>(&s, &(i, 1)).unwrap();
    }
    let looked = c.expiry_visits();
    let mut asks = 0u64;
    for _ in 0..200 {
        // `progress` asks once, unless work is waiting; and once here.
        c.progress(Some(Duration::from_millis(1))).unwrap();
        c.trigger().unwrap();
        let next = c.next_expiry().expect("an input is kept");
        assert!(next >= before + ABANDONED_INPUT_TTL, "not the kept input's TTL");
        asks += 2;
    }
    let looked = c.expiry_visits() - looked;
    assert!(
        looked <= asks,
        "next_expiry looked at {looked} entries in {asks} asks with 2,000 calls in flight"
    );
    let st = c.stats();
    assert_eq!((st.abandoned_inputs, st.in_flight), (1, 2000), "{st:?}");
}

/// The TTL is one value for every abandoned input, read when the sweep
/// looks: set while inputs are kept, it applies to them, longer or
/// shorter (their order, the order they were given up on, stays the
/// order they expire in).
#[test]
fn a_ttl_set_while_inputs_are_kept_applies_to_them() {
    let d = dir("ttl-set");
    let (mut x, xid, mut c, s) = silent_target(&d);
    c.set_abandoned_input_ttl(Duration::from_millis(300));
    let kept = c
        .forward::<Echo>(&s, &ByteBuf::from(vec![5u8; 64 << 10]))
        .unwrap();
    take_request(&mut x, xid, &mut c, 1);
    let before = Instant::now();
    c.abandon(kept);
    // Longer: not dropped at the TTL it was given up under.
    c.set_abandoned_input_ttl(Duration::from_secs(60));
    pump(&mut c, Duration::from_millis(1300));
    assert_eq!(c.stats().abandoned_inputs, 1, "dropped at the old TTL");
    let next = c.next_expiry().expect("an input is kept");
    assert!(next >= before + Duration::from_secs(60), "woken for the old TTL");
    // Shorter: dropped at the next sweep.
    c.set_abandoned_input_ttl(Duration::from_millis(100));
    let next = c.next_expiry().expect("an input is kept");
    assert!(
        next <= Instant::now() + Duration::from_millis(1100),
        "not woken for the new TTL"
    );
    let end = Instant::now() + T;
    while c.stats().abandoned_inputs > 0 {
        assert!(Instant::now() < end, "kept past the new TTL");
        pump(&mut c, Duration::from_millis(20));
    }
    assert_eq!(c.next_expiry(), None, "nothing kept, nothing to wake for");
}

/// The call table gives back most of the memory of a burst once the engine
/// goes idle, also while a call stays in flight (a call to a target that
/// never answers, made before the burst): the slots above the calls left
/// go, down to `KEEP_SLOTS` (1,024), and the call left and later calls
/// work, no old id naming one of them.
#[test]
fn the_call_table_of_a_burst_shrinks_while_a_call_stays_in_flight() {
    let d = dir("burst-left");
    let srv = Server::start(&d);
    let (_x, _xid, mut c, silent) = silent_target(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let left = c.forward::<Sleep>(&silent, &0).unwrap();
    let ids: Vec<_> = (0..3000u64)
        .map(|i| c.forward::<Add>(&s, &(i, 1)).unwrap())
        .collect();
    let end = Instant::now() + T;
    for (i, &id) in ids.iter().enumerate() {
        while !c.is_finished(id) {
            assert!(Instant::now() < end, "call {i} did not end");
            c.progress(Some(Duration::from_millis(10))).unwrap();
            c.trigger().unwrap();
        }
        assert_eq!(c.take_response::<Add>(id).unwrap().unwrap(), i as u64 + 1);
    }
    assert!(c.stats().call_slots > 3000, "{:?}", c.stats());
    // Idle, again and again: each time the engine may sleep, the table
    // gives back what it can.
    while c.stats().call_slots > 1024 {
        assert!(Instant::now() < end, "not given back: {:?}", c.stats());
        if !c.try_wait().unwrap() {
            c.trigger().unwrap();
        }
    }
    let st = c.stats();
    assert_eq!((st.call_slots, st.in_flight), (1024, 1), "{st:?}");
    assert!(!c.is_finished(left), "the call left ended");
    let id = c.forward::<Add>(&s, &(20, 22)).unwrap();
    assert!(!ids.contains(&id) && id != left, "an old call id given again");
    while !c.is_finished(id) {
        assert!(Instant::now() < end, "the call after the shrink did not end");
        c.progress(Some(Duration::from_millis(10))).unwrap();
        c.trigger().unwrap();
    }
    assert_eq!(c.take_response::<Add>(id).unwrap().unwrap(), 42);
    assert!(
        c.take_response::<Add>(ids[2999]).is_none(),
        "an old id names nothing"
    );
    assert_eq!(c.stats().in_flight, 1, "{:?}", c.stats());
}

/// The call table gives back the memory of a burst of calls in flight
/// once they have all ended and the engine goes idle, and cookies stay
/// unique across that: a response of a call before it does not match a
/// call after it.
#[test]
fn the_call_table_of_a_burst_is_given_back_when_the_engine_goes_idle() {
    let d = dir("burst");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let ids: Vec<_> = (0..3000u64)
        .map(|i| c.forward::<Add>(&s, &(i, 1)).unwrap())
        .collect();
    let end = Instant::now() + T;
    for (i, &id) in ids.iter().enumerate() {
        while !c.is_finished(id) {
            assert!(Instant::now() < end, "call {i} did not end");
            c.progress(Some(Duration::from_millis(10))).unwrap();
            c.trigger().unwrap();
        }
        assert_eq!(c.take_response::<Add>(id).unwrap().unwrap(), i as u64 + 1);
    }
    assert!(c.stats().call_slots >= 3000, "{:?}", c.stats());
    // Idle: the engine may sleep, and the table is given back.
    while !c.try_wait().unwrap() {
        assert!(Instant::now() < end, "never idle");
        c.trigger().unwrap();
    }
    assert_eq!(c.stats().call_slots, 0, "{:?}", c.stats());
    // Later calls work, and no old id names one of them.
    let id = c.forward::<Add>(&s, &(20, 22)).unwrap();
    assert!(!ids.contains(&id), "an old call id given again");
    while !c.is_finished(id) {
        assert!(Instant::now() < end, "the call after the shrink did not end");
        c.progress(Some(Duration::from_millis(10))).unwrap();
        c.trigger().unwrap();
    }
    assert_eq!(c.take_response::<Add>(id).unwrap().unwrap(), 42);
    assert!(
        c.take_response::<Add>(ids[0]).is_none(),
        "an old id names nothing"
    );
}

/// The engine's byte buffers do not stay at the size of the largest input
/// it ever encoded: a 4 MiB self-call and a 4 MiB input refused for the
/// held-input bound leave them within the spare-buffer bound.
#[test]
fn large_inputs_that_never_spilled_do_not_stay_in_the_engines_buffers() {
    let d = dir("scratch");
    let (ep, id) = endpoint(&d, true);
    let mut e = Engine::new(ep, id).unwrap();
    e.register::<Echo>(Ok).unwrap();
    e.set_spare_bytes(1 << 20);
    e.set_max_abandoned_bytes(1 << 20);
    let bound = (1 << 20) + 8 * 65536;
    let big = ByteBuf::from(vec![3u8; 4 << 20]);
    let me = e.self_addr().clone();
    // A deadline for a hang only: the echo of 4 MiB, encoded and decoded
    // twice, while `Echo` took a `Vec<u8>` (byte by byte in a debug build)
    // took about a second of CPU, and a loaded 2-core box gave it less
    // than a tenth of one (it timed out at 10 s); as a `ByteBuf` it takes
    // about a tenth of a second, and the bound stays generous.
    let out = e.call::<Echo>(&me, &big, BIG_T).unwrap();
    assert!(out == big, "the self-call's echo");
    drop(out);
    let st = e.stats();
    assert!(st.buffer_bytes <= bound, "after a self-call: {st:?}");
    let srv = Server::start(&d);
    let s = e.endpoint().lookup(&srv.uri).unwrap();
    let r = e.forward::<Echo>(&s, &big);
    assert!(matches!(r, Err(RpcError::TooLarge { .. })), "{r:?}");
    let st = e.stats();
    assert!(st.buffer_bytes <= bound, "after a refused input: {st:?}");
    assert_eq!(e.call::<Add>(&s, &(2, 3), T).unwrap(), 5);
}
