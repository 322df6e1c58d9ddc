//! How an origin files responses (since protocol version 2): responses arrive as
//! unexpected messages and count only for a call in flight to the peer
//! they come from; a late one is discarded; one watch per peer fails the
//! peer's calls when it goes away. Real processes and real sm plugins.

use std::time::{Duration, Instant};

use hg_rpc::header::{Header, Status, FLAG_CHECKSUM, FLAG_RESPONSE, FLAG_SPILL};
use hg_rpc::{Engine, Rpc, RpcError};
use na_core::{Addr, Endpoint, OpId, PluginId};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{
    client, dir, endpoint, posted_ops, raw_target_and_client, send_raw, take_request, wait, wire_message,
    Server,
};

const T: Duration = Duration::from_secs(10);

/// A response header for `cookie` with an empty payload (the encoding of `()`).
fn response(rpc: &str, cookie: u64) -> Vec<u8> {
    wire_message(FLAG_RESPONSE | FLAG_CHECKSUM, rpc, cookie, &[])
}

/// Drives `c` for `d`.
fn pump(c: &mut Engine, d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        c.progress(Some(Duration::from_millis(10))).unwrap();
        c.trigger().unwrap();
    }
}

#[test]
fn a_late_response_is_discarded_and_counted_and_the_call_forgotten_at_once() {
    let d = dir("late");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let r = c.call::<Sleep>(&s, &300, Duration::from_millis(30));
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    assert_eq!(c.stats().in_flight, 0, "a timed-out call is forgotten at once");
    let end = Instant::now() + T;
    while c.stats().stray_responses == 0 {
        assert!(Instant::now() < end, "the late response never came");
        pump(&mut c, Duration::from_millis(20));
    }
    assert_eq!((c.stats().stray_responses, c.stats().malformed), (1, 0));
    assert_eq!(c.call::<Add>(&s, &(4, 5), T).unwrap(), 9);
    // The discarded response's buffer, and the answered one's, were posted again.
    assert_eq!(posted_ops(&mut c), c.posted_receives() as u64 + 1);
}

#[test]
fn responses_from_another_peer_are_dropped_and_the_real_one_counts() {
    let d = dir("forged-resp");
    // The client listens, so that a third party can reach it.
    let (mut x, xid, mut c, s) = raw_target_and_client(&d, true);
    let id = c.forward::<Sleep>(&s, &0).unwrap();
    let (origin, cookie) = take_request(&mut x, xid, &mut c, 1);
    // A third plugin forges the response (right cookie, wrong peer), and
    // one for a cookie of no call.
    let (mut y, _) = endpoint(&d, false);
    let to_c = y.lookup(c.self_addr().uri()).unwrap();
    send_raw(&mut y, &to_c, None, &response(Sleep::NAME, cookie), OpId(1));
    send_raw(
        &mut y,
        &to_c,
        None,
        &response(Sleep::NAME, cookie ^ 1 << 40),
        OpId(2),
    );
    pump(&mut c, Duration::from_millis(100));
    assert!(!c.is_finished(id), "a forged response was filed");
    let st = c.stats();
    assert_eq!(
        (st.malformed, st.stray_responses, st.in_flight),
        (1, 1, 1),
        "{st:?}"
    );
    send_raw(&mut x, &origin, None, &response(Sleep::NAME, cookie), OpId(2));
    wait::<Sleep>(&mut c, id).unwrap();
    assert_eq!(c.stats().in_flight, 0);
    // Dropped (forged, stray) and filed responses all gave their buffers back.
    assert_eq!(posted_ops(&mut c), c.posted_receives() as u64 + 1);
}

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

/// A raw endpoint plays the server: it sends a message on the watch's tag
/// (a protocol violation), then answers properly; then it goes away with
/// a call in flight, which must fail: the watch was posted again.
#[test]
fn a_message_on_the_watch_tag_is_malformed_and_the_peer_stays_watched() {
    let d = dir("watch");
    let (mut x, xid, mut c, s) = raw_target_and_client(&d, false);
    // Call `b` is in flight throughout: it must fail when `x` goes, which
    // takes a watch posted again after the violation.
    let a = c.forward::<Sleep>(&s, &0).unwrap();
    let b = c.forward::<Sleep>(&s, &0).unwrap();
    let (origin, cookie) = take_request(&mut x, xid, &mut c, 1);
    send_raw(&mut x, &origin, Some(0), b"not for you", OpId(2));
    pump(&mut c, Duration::from_millis(50));
    assert_eq!(c.stats().malformed, 1);
    assert!(!c.is_finished(a));
    send_raw(&mut x, &origin, None, &response(Sleep::NAME, cookie), OpId(3));
    wait::<Sleep>(&mut c, a).unwrap();
    drop(x);
    let r = wait::<Sleep>(&mut c, b);
    assert!(matches!(r, Err(RpcError::Transport(_))), "{r:?}");
}

/// Small input, large output: only the response spills.
struct Big;
impl Rpc for Big {
    const NAME: &'static str = "test.routing.big";
    type Input = u32;
    type Output = Vec<u8>;
}

/// Drives two engines in turn until `done` says so.
fn pump_both(a: &mut Engine, b: &mut Engine, what: &str, mut done: impl FnMut(&Engine, &Engine) -> bool) {
    let end = Instant::now() + T;
    while !done(a, b) {
        assert!(Instant::now() < end, "{what}: not within {T:?}");
        for e in [&mut *a, &mut *b] {
            e.progress(Some(Duration::from_millis(1))).unwrap();
            e.trigger().unwrap();
        }
    }
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
    srv.register::<Big>(|n| Ok(vec![7u8; n as usize])).unwrap();
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
    let id = c.forward::<Echo>(&s, &vec![3u8; 1 << 20]).unwrap();
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
    let big = vec![5u8; 64 << 10];
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
    let big = vec![5u8; 64 << 10];
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
    let small = c.forward::<Echo>(&s, &vec![1u8; 16]).unwrap();
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
    match c.call::<Echo>(&s, &vec![5u8; 64 << 10], T) {
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

/// An `Echo` response to `cookie` carrying `data`.
fn postcard_echo_response(cookie: u64, data: &[u8]) -> Vec<u8> {
    wire_message(
        FLAG_RESPONSE | FLAG_CHECKSUM,
        Echo::NAME,
        cookie,
        &postcard::to_allocvec(data).unwrap(),
    )
}

/// A raw target in `d` that took an `Echo` call of the client's (`id`,
/// from `origin`, its `cookie`), and the spilled response carrying
/// `output` it is to send (keep its memory). A second call, never
/// answered, stays in flight, so that the origin takes the messages after
/// that response in the same turn, while the pull is in flight (with one
/// call in flight it stops after that call's response, and handles the
/// pull's end first).
#[allow(clippy::type_complexity)]
fn spilled_answer_due(
    d: &std::path::Path,
    output: Vec<u8>,
) -> (
    Endpoint,
    Engine,
    hg_rpc::CallId,
    Addr,
    u64,
    na_core::MemHandle,
    Vec<u8>,
) {
    let (mut x, xid, mut c, s) = raw_target_and_client(d, true);
    let id = c.forward::<Echo>(&s, &vec![1u8; 16]).unwrap();
    let (origin, cookie) = take_request(&mut x, xid, &mut c, 1);
    let _unanswered = c.forward::<Echo>(&s, &vec![2u8; 16]).unwrap();
    let crc = hg_rpc::header::crc32c(&output);
    let (mem, msg) = spilled_echo_response(&mut x, xid, cookie, output, crc);
    (x, c, id, origin, cookie, mem, msg)
}

/// A target that sends a spilled response twice for one call: the second
/// arrives while the first's output is being pulled, and must be dropped
/// as malformed, not start a second pull (or overwrite the outcome); see
/// [`spilled_answer_due`] for why a second call stays in flight.
#[test]
fn a_second_spilled_response_during_the_pull_is_malformed() {
    let d = dir("dup-spill");
    let output = postcard::to_allocvec(&vec![9u8; 64 << 10]).unwrap();
    let (mut x, mut c, id, origin, _cookie, _mem, msg) = spilled_answer_due(&d, output.clone());
    // Both are in the origin's queue before it looks.
    send_raw(&mut x, &origin, None, &msg, OpId(2));
    send_raw(&mut x, &origin, None, &msg, OpId(3));
    let cid = c.endpoint().plugin_ids().next().unwrap();
    let before = c.endpoint().plugin(cid).unwrap().stats().get_bytes;
    let out = wait::<Echo>(&mut c, id).unwrap();
    assert_eq!(out, vec![9u8; 64 << 10]);
    pump(&mut c, Duration::from_millis(50));
    let pulled = c.endpoint().plugin(cid).unwrap().stats().get_bytes - before;
    // (The data and the 8-byte seal after it.)
    assert_eq!(
        pulled,
        output.len() as u64 + 8,
        "the output was pulled more than once"
    );
    assert_eq!(c.stats().malformed, 1, "{:?}", c.stats());
}

/// As above, with the second response of another protocol version: it
/// must not end the call (with `VersionMismatch`) while the first
/// response's output is being pulled; the call gets that output.
#[test]
fn a_response_of_another_version_during_the_pull_is_dropped() {
    let d = dir("foreign-spill");
    let output = postcard::to_allocvec(&vec![7u8; 64 << 10]).unwrap();
    let (mut x, mut c, id, origin, cookie, _mem, msg) = spilled_answer_due(&d, output);
    let mut foreign = postcard_echo_response(cookie, &[1]);
    foreign[4] = hg_rpc::header::VERSION.wrapping_add(1);
    // Both are in the origin's queue before it looks.
    send_raw(&mut x, &origin, None, &msg, OpId(2));
    send_raw(&mut x, &origin, None, &foreign, OpId(3));
    let out = wait::<Echo>(&mut c, id).expect("the pulled output, not a version mismatch");
    assert_eq!(out, vec![7u8; 64 << 10]);
    let st = c.stats();
    assert_eq!(
        (st.version_mismatches, st.errors, st.in_flight),
        (1, 0, 1),
        "{st:?}"
    );
}

/// Large input, large output, sent one-way.
struct OneWayBig;
impl Rpc for OneWayBig {
    const NAME: &'static str = "test.routing.one_way_big";
    type Input = Vec<u8>;
    type Output = Vec<u8>;
}

/// A spilled one-way request is acknowledged as soon as its input is
/// pulled, with an empty acknowledgement: the handler's output is neither
/// exposed nor pulled (Mercury #542 without the waste).
#[test]
fn a_spilled_one_way_ack_is_empty_and_precedes_the_handler() {
    let d = dir("one-way-ack");
    let (ep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    srv.register::<OneWayBig>(|v| Ok(vec![1u8; v.len() * 16]))
        .unwrap();
    let (ep, cid) = endpoint(&d, false);
    let mut c = Engine::new(ep, cid).unwrap();
    let s = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    let cid = c.endpoint().plugin_ids().next().unwrap();
    let before = c.endpoint().plugin(cid).unwrap().stats().get_bytes;
    c.forward_one_way::<OneWayBig>(&s, &vec![2u8; 64 << 10]).unwrap();
    assert_eq!(c.stats().abandoned_inputs, 1, "kept until acknowledged");
    pump_both(&mut c, &mut srv, "acknowledgement", |c, s| {
        c.stats().abandoned_inputs == 0 && s.stats().handled == 1
    });
    pump_both(&mut c, &mut srv, "settle", |_, _| true);
    let pulled = c.endpoint().plugin(cid).unwrap().stats().get_bytes - before;
    assert_eq!(pulled, 0, "the origin pulled an output of a one-way call");
    let st = srv.stats();
    assert_eq!((st.exposed_outputs, st.malformed), (0, 0), "{st:?}");
    assert_eq!(
        st.bytes_sent,
        hg_rpc::header::HEADER_LEN as u64,
        "the target sent more than an empty acknowledgement"
    );
    assert_eq!(
        (c.stats().stray_responses, c.stats().malformed),
        (0, 0),
        "{:?}",
        c.stats()
    );
}

/// A transfer given up on (`forget_bulk`, or `bulk` timing out) leaves no
/// outcome behind; the engine's next transfers work.
#[test]
fn a_forgotten_transfer_leaves_no_outcome() {
    use hg_rpc::{Bulk, BulkOp};
    use na_core::Access;
    let d = dir("forget-bulk");
    let (ep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    let (ep, cid) = endpoint(&d, false);
    let mut c = Engine::new(ep, cid).unwrap();
    let data: Vec<u8> = (0..50_000u32).map(|i| i as u8).collect();
    let remote: Bulk = srv.expose(vec![data.clone()], Access::ReadOnly).unwrap();
    let remote: Bulk = postcard::from_bytes(&postcard::to_allocvec(&remote).unwrap()).unwrap();
    c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    let dst = c.expose(vec![vec![0; 50_000]], Access::ReadWrite).unwrap();
    let id = c.bulk_start(BulkOp::Pull, &remote, 0, &dst, 0, 50_000).unwrap();
    c.forget_bulk(id);
    // Given up, but not ended until the transport says so.
    assert_eq!(c.stats().bulk_in_flight, 1);
    pump_both(&mut c, &mut srv, "settle", |_, _| true);
    pump(&mut c, Duration::from_millis(20));
    assert!(
        c.take_bulk(id).is_none(),
        "a forgotten transfer's outcome was kept"
    );
    assert_eq!(c.stats().bulk_in_flight, 0);
    let r = c.bulk(BulkOp::Pull, &remote, 0, &dst, 0, 50_000, Duration::ZERO);
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    c.bulk(BulkOp::Pull, &remote, 100, &dst, 0, 1000, T).unwrap();
    let mut got = vec![0; 1000];
    dst.local().unwrap().read_at(0, &mut got).unwrap();
    assert_eq!(got, data[100..1100]);
}

/// `bulk` past its timeout cancels the transfer and waits for the
/// transport to end it before it returns: then nothing touches either
/// handle's memory any more, and the owner of the remote handle may free
/// it. Over sm a transfer's end is reported at the next progress call, so
/// a timeout of zero always leaves one to wait for: once `bulk` returned,
/// the transport has nothing in flight and nothing left to report. (Over
/// RDMA, where a READ stays on the wire, see
/// `a_timed_out_bulk_has_ended_when_it_returns_over_verbs`.)
#[test]
fn a_timed_out_bulk_has_ended_when_it_returns() {
    use hg_rpc::{Bulk, BulkOp};
    use na_core::Access;
    let d = dir("timed-out-bulk");
    let (ep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    let (ep, cid) = endpoint(&d, false);
    let mut c = Engine::new(ep, cid).unwrap();
    let data: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
    let remote: Bulk = srv.expose(vec![data.clone()], Access::ReadOnly).unwrap();
    let remote: Bulk = postcard::from_bytes(&postcard::to_allocvec(&remote).unwrap()).unwrap();
    c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    let dst = c.expose(vec![vec![0; 50_000]], Access::ReadWrite).unwrap();
    // What the transport still has to do or say about transfers.
    let left = |c: &mut Engine| {
        let ep = c.endpoint();
        ep.progress_now().unwrap();
        (
            ep.plugin(cid).unwrap().stats().in_flight,
            ep.pending_completions(),
        )
    };
    // The engine's own posted receives (QS_RPC_RECV=posted) stay in flight.
    c.progress_now().unwrap();
    let (receives, _) = left(&mut c);
    for round in 0..3 {
        let r = c.bulk(BulkOp::Pull, &remote, 0, &dst, 0, 50_000, Duration::ZERO);
        assert!(matches!(r, Err(RpcError::Timeout { .. })), "round {round}: {r:?}");
        assert_eq!(
            left(&mut c),
            (receives, 0),
            "round {round}: bulk returned before its canceled transfer ended"
        );
        assert_eq!(c.stats().bulk_in_flight, 0, "round {round}");
    }
    c.bulk(BulkOp::Pull, &remote, 100, &dst, 0, 1000, T).unwrap();
    let mut got = vec![0; 1000];
    dst.local().unwrap().read_at(0, &mut got).unwrap();
    assert_eq!(got, data[100..1100]);
    assert_eq!(left(&mut c), (receives, 0));
}

/// A silent target (`tag`) and an origin that holds one spilled input
/// for it (a one-way call the target took and never acknowledges) and
/// may hold no other of its size: its next such input is refused with
/// `InputsHeld` until the held one's TTL (300 ms) ends. Returns them and
/// that input.
fn one_input_held(tag: &str) -> (Silent, Vec<u8>) {
    let mut t = silent_target(tag);
    t.c.set_abandoned_input_ttl(Duration::from_millis(300));
    let big = vec![5u8; 64 << 10];
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

/// An origin with one call in flight stops taking messages once that
/// call's response is filed (the take that would find nothing comes after
/// its next send). A request queued behind the response is not lost and
/// does not wait for traffic: the transport still reports it as work, so
/// a blocking progress call returns at once, and the next trigger serves it.
#[test]
fn a_request_behind_the_only_calls_response_is_served_without_a_sleep() {
    let d = dir("behind-response");
    let engine = |mode, listen| {
        let (mut ep, id) = endpoint(&d, listen);
        ep.set_mode(mode);
        let mut e = Engine::new(ep, id).unwrap();
        e.register::<Echo>(Ok).unwrap();
        e
    };
    let mut a = engine(na_core::ProgressMode::Blocking, true);
    let mut b = engine(na_core::ProgressMode::Blocking, true);
    let to_b = a.endpoint().lookup(b.self_addr().uri()).unwrap();
    let to_a = b.endpoint().lookup(a.self_addr().uri()).unwrap();
    // Warm up both ways: every connection is set up before the test.
    for _ in 0..2 {
        let (x, y) = (
            a.forward::<Echo>(&to_b, &vec![1]).unwrap(),
            b.forward::<Echo>(&to_a, &vec![2]).unwrap(),
        );
        pump_both(&mut a, &mut b, "warm-up", |a, b| {
            a.is_finished(x) && b.is_finished(y)
        });
        assert_eq!(a.take_response::<Echo>(x).unwrap().unwrap(), vec![1]);
        assert_eq!(b.take_response::<Echo>(y).unwrap().unwrap(), vec![2]);
    }
    let served = a.stats().handled;

    let call = a.forward::<Echo>(&to_b, &vec![7]).unwrap();
    let before = b.stats().handled;
    let end = Instant::now() + T;
    while b.stats().handled == before {
        assert!(Instant::now() < end, "b never served the call");
        b.progress(Some(Duration::from_millis(10))).unwrap();
        b.trigger().unwrap();
    }
    // b's request goes out after its response: it waits behind it.
    let back = b.forward::<Echo>(&to_a, &vec![8]).unwrap();
    let end = Instant::now() + T;
    while !a.is_finished(call) {
        assert!(Instant::now() < end, "a never got its response");
        a.progress(Some(Duration::from_millis(10))).unwrap();
        a.trigger().unwrap();
    }
    assert_eq!(a.take_response::<Echo>(call).unwrap().unwrap(), vec![7]);
    // Only in pull mode: posted receives (QS_RPC_RECV=posted, a pass of
    // its own in scripts/test-all.sh) deliver both as completions, and
    // the request is served in the same trigger.
    if a.posted_receives() == 0 {
        assert_eq!(
            a.stats().handled,
            served,
            "the take stopped after the only call's response"
        );
        let t = Instant::now();
        let n = a.progress(Some(Duration::from_secs(5))).unwrap();
        assert!(n > 0, "the waiting request is reported as work");
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "progress slept {:?} on a waiting request",
            t.elapsed()
        );
        a.trigger().unwrap();
        assert_eq!(a.stats().handled, served + 1, "the next trigger serves it");
    } else {
        let end = Instant::now() + T;
        while a.stats().handled == served {
            assert!(
                Instant::now() < end,
                "the request behind the response was never served"
            );
            a.progress(Some(Duration::from_millis(10))).unwrap();
            a.trigger().unwrap();
        }
    }
    assert_eq!(a.stats().handled, served + 1, "served once");
    assert_eq!(wait::<Echo>(&mut b, back).unwrap(), vec![8]);
}

/// Error responses are cut to fit one message, never spilled: a spilled
/// one with an error status (a broken target) ends its call as malformed,
/// counted in `malformed`, and its output is not pulled.
#[test]
fn a_spilled_response_with_an_error_status_ends_the_call_as_malformed() {
    let d = dir("spilled-error");
    let (mut x, xid, mut c, s) = raw_target_and_client(&d, false);
    let id = c.forward::<Sleep>(&s, &0).unwrap();
    let (origin, cookie) = take_request(&mut x, xid, &mut c, 1);
    let mut msg = Vec::new();
    Header {
        flags: FLAG_RESPONSE | FLAG_SPILL,
        status: Status::HandlerError,
        rpc_id: hg_rpc::rpc_id(Sleep::NAME),
        cookie,
        payload_len: 0,
        checksum: 0,
    }
    .encode_with(&[0u8; 40], &mut msg);
    send_raw(&mut x, &origin, None, &msg, OpId(2));
    match wait::<Sleep>(&mut c, id) {
        Err(RpcError::Malformed { reason }) => assert!(reason.contains("spilled"), "{reason}"),
        other => panic!("{other:?}"),
    }
    let st = c.stats();
    assert_eq!(
        (st.malformed, st.in_flight, st.bulk_in_flight),
        (1, 0, 0),
        "{st:?}"
    );
}

/// With checksums, a spilled output carries the CRC-32C of the data: an
/// origin that pulls bytes that do not match ends the call with a decode
/// error of the output that says so, counted as malformed.
#[test]
fn a_spilled_output_that_fails_its_checksum_ends_the_call() {
    let d = dir("spill-crc-out");
    let (mut x, xid, mut c, s) = raw_target_and_client(&d, true);
    c.set_checksums(true);
    let id = c.forward::<Echo>(&s, &vec![1u8; 16]).unwrap();
    let (origin, cookie) = take_request(&mut x, xid, &mut c, 1);
    let output = postcard::to_allocvec(&vec![9u8; 64 << 10]).unwrap();
    let bad_crc = hg_rpc::header::crc32c(&output) ^ 1;
    let (_mem, msg) = spilled_echo_response(&mut x, xid, cookie, output, bad_crc);
    send_raw(&mut x, &origin, None, &msg, OpId(2));
    match wait::<Echo>(&mut c, id) {
        Err(RpcError::Decode { what, reason, .. }) => {
            assert_eq!(what, "output");
            assert!(reason.contains("CRC-32C"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let st = c.stats();
    assert_eq!((st.malformed, st.in_flight), (1, 0), "{st:?}");
}

/// A spilled `Echo` response with a checksum, written by hand: `output`
/// exposed by `x` (keep the handle until it was pulled), described, with
/// `crc` as the data's CRC-32C.
fn spilled_echo_response(
    x: &mut Endpoint,
    xid: PluginId,
    cookie: u64,
    output: Vec<u8>,
    crc: u32,
) -> (na_core::MemHandle, Vec<u8>) {
    let len = output.len() as u64;
    let mem = common::sealed(output);
    x.plugin_mut(xid).unwrap().mem_register(&mem).unwrap();
    let desc = x.plugin(xid).unwrap().mem_describe(&mem).unwrap().to_bytes();
    let payload = common::spilled_payload(len, &desc, Some(crc));
    let msg = wire_message(
        FLAG_RESPONSE | FLAG_CHECKSUM | FLAG_SPILL,
        Echo::NAME,
        cookie,
        &payload,
    );
    (mem, msg)
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
    let big = vec![5u8; 64 << 10];
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
    let big = vec![5u8; 9 << 10];
    let kept = c.forward::<Echo>(&s, &big).unwrap();
    take_request(&mut x, xid, &mut c, 1);
    c.abandon(kept);
    // 3,600 spilled calls take seconds in a debug build.
    let end = Instant::now() + 6 * T;
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
                assert!(matches!(e, RpcError::InputsHeld { .. }), "{e}");
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
    let big = vec![3u8; 4 << 20];
    let me = e.self_addr().clone();
    let out = e.call::<Echo>(&me, &big, T).unwrap();
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
