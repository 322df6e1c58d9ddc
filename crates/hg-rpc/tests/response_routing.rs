//! How an origin files responses (since protocol version 2): responses arrive as
//! unexpected messages and count only for a call in flight to the peer
//! they come from; a late one is discarded; one watch per peer fails the
//! peer's calls when it goes away. Real processes and real sm plugins.
//! (What it holds for calls it gave up on: `abandoned_inputs.rs`.)

use std::time::{Duration, Instant};

use hg_rpc::header::{Header, Status, FLAG_RESPONSE, FLAG_SPILL};
use hg_rpc::{Engine, Rpc, RpcError};
use na_core::{Addr, Endpoint, OpId};
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{
    client, dir, endpoint, posted_ops, raw_target_and_client, send_raw, take_request, wait, Server,
};
mod routing_helpers;
use routing_helpers::{postcard_echo_response, pump, pump_both, response, spilled_echo_response, T};
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
    let id = c.forward::<Echo>(&s, &ByteBuf::from(vec![1u8; 16])).unwrap();
    let (origin, cookie) = take_request(&mut x, xid, &mut c, 1);
    let _unanswered = c.forward::<Echo>(&s, &ByteBuf::from(vec![2u8; 16])).unwrap();
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
    type Input = ByteBuf;
    type Output = ByteBuf;
}

/// A spilled one-way request is acknowledged as soon as its input is
/// pulled, with an empty acknowledgement: the handler's output is neither
/// exposed nor pulled (Mercury #542 without the waste).
#[test]
fn a_spilled_one_way_ack_is_empty_and_precedes_the_handler() {
    let d = dir("one-way-ack");
    let (ep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    srv.register::<OneWayBig>(|v| Ok(ByteBuf::from(vec![1u8; v.len() * 16])))
        .unwrap();
    let (ep, cid) = endpoint(&d, false);
    let mut c = Engine::new(ep, cid).unwrap();
    let s = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    let cid = c.endpoint().plugin_ids().next().unwrap();
    let before = c.endpoint().plugin(cid).unwrap().stats().get_bytes;
    c.forward_one_way::<OneWayBig>(&s, &ByteBuf::from(vec![2u8; 64 << 10]))
        .unwrap();
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
            a.forward::<Echo>(&to_b, &ByteBuf::from(vec![1])).unwrap(),
            b.forward::<Echo>(&to_a, &ByteBuf::from(vec![2])).unwrap(),
        );
        pump_both(&mut a, &mut b, "warm-up", |a, b| {
            a.is_finished(x) && b.is_finished(y)
        });
        assert_eq!(a.take_response::<Echo>(x).unwrap().unwrap(), vec![1]);
        assert_eq!(b.take_response::<Echo>(y).unwrap().unwrap(), vec![2]);
    }
    let served = a.stats().handled;

    let call = a.forward::<Echo>(&to_b, &ByteBuf::from(vec![7])).unwrap();
    let before = b.stats().handled;
    let end = Instant::now() + T;
    while b.stats().handled == before {
        assert!(Instant::now() < end, "b never served the call");
        b.progress(Some(Duration::from_millis(10))).unwrap();
        b.trigger().unwrap();
    }
    // b's request goes out after its response: it waits behind it.
    let back = b.forward::<Echo>(&to_a, &ByteBuf::from(vec![8])).unwrap();
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
    let id = c.forward::<Echo>(&s, &ByteBuf::from(vec![1u8; 16])).unwrap();
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

/// A target whose exposed output is gone when the origin pulls it (its
/// memory freed and unmapped after the response went: a broken target)
/// fails the call with a transport error: the transport could not move
/// the bytes, and none were decoded. (na-sm refuses such a pull as it
/// starts; a transport that fails it at completion, na-verbs with a bad
/// key, gets the same answer in `progress_ops`.)
#[test]
fn a_spilled_output_whose_pull_fails_ends_the_call_with_a_transport_error() {
    let d = dir("spill-pull-fails");
    let (mut x, xid, mut c, s) = raw_target_and_client(&d, true);
    let id = c.forward::<Echo>(&s, &ByteBuf::from(vec![1u8; 16])).unwrap();
    let (origin, cookie) = take_request(&mut x, xid, &mut c, 1);
    // 4 MiB: far above the allocator's mmap threshold, so freeing it
    // unmaps it.
    let output = postcard::to_allocvec(&vec![9u8; 4 << 20]).unwrap();
    let crc = hg_rpc::header::crc32c(&output);
    let (mem, msg) = spilled_echo_response(&mut x, xid, cookie, output, crc);
    send_raw(&mut x, &origin, None, &msg, OpId(2));
    x.plugin_mut(xid).unwrap().mem_deregister(&mem).unwrap();
    drop(mem);
    match wait::<Echo>(&mut c, id) {
        Err(RpcError::Transport(e)) => {
            assert!(
                !matches!(e, na_core::NaError::PeerGone { .. }),
                "{}",
                na_core::ErrorChain(&e)
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.stats().in_flight, 0, "{:?}", c.stats());
}

/// A spilled output's descriptor must let the origin read it: one whose
/// access is write-only fails the descriptor's checks (PROTOCOL.md: the
/// call ends with `RpcError::Malformed`, counted as malformed, and the
/// output is released unpulled), not a transport error the pull's start
/// gave it.
#[test]
fn a_spilled_output_described_write_only_is_malformed() {
    let d = dir("spill-write-only");
    let (mut x, xid, mut c, s) = raw_target_and_client(&d, false);
    let id = c.forward::<Echo>(&s, &ByteBuf::from(vec![1u8; 16])).unwrap();
    let (origin, cookie) = take_request(&mut x, xid, &mut c, 1);
    let output = postcard::to_allocvec(&vec![9u8; 64 << 10]).unwrap();
    let len = output.len() as u64;
    let mem = na_core::MemHandle::new(
        vec![output, common::TEST_SEAL.to_le_bytes().to_vec()],
        na_core::Access::WriteOnly,
    );
    x.plugin_mut(xid).unwrap().mem_register(&mem).unwrap();
    let desc = x.plugin(xid).unwrap().mem_describe(&mem).unwrap().to_bytes();
    let payload = common::spilled_payload(len, &desc, None);
    let msg = common::wire_message(FLAG_RESPONSE | FLAG_SPILL, Echo::NAME, cookie, &payload);
    send_raw(&mut x, &origin, None, &msg, OpId(2));
    match wait::<Echo>(&mut c, id) {
        Err(RpcError::Malformed { reason }) => assert!(reason.contains("read"), "{reason}"),
        other => panic!("{other:?}"),
    }
    let st = c.stats();
    assert_eq!((st.malformed, st.in_flight), (1, 0), "{st:?}");
    let ep = c.endpoint();
    let cid = ep.plugin_ids().next().unwrap();
    let pulled = ep.plugin(cid).unwrap().stats().get_bytes;
    assert_eq!(pulled, 0, "pulled from a write-only descriptor");
}
