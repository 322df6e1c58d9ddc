//! Tests of `unsent_response_ops`: a response that could not be sent,
//! and what goes in its place.

use std::time::{Duration, Instant};

use na_core::NaError;

use super::{returned, Returned, NOT_SENT_REASON_MAX, RESENT_REASON_MAX};
use crate::engine::test_support::sm_pair;
use crate::engine::{header, response_header, DeferredRequest, Engine};
use crate::header::{Status, FLAG_RESPONSE, FLAG_SPILL, HEADER_LEN};
use crate::{Rpc, RpcError};

struct Held;
impl Rpc for Held {
    const NAME: &'static str = "test.held";
    type Input = u64;
    type Output = Vec<u8>;
}

/// Drives both engines until `done` gives something (or 30 s pass).
fn drive<X>(
    a: &mut Engine,
    b: &mut Engine,
    mut done: impl FnMut(&mut Engine, &mut Engine) -> Option<X>,
) -> X {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        for e in [&mut *a, &mut *b] {
            e.progress(Some(Duration::from_millis(1))).unwrap();
            e.trigger().unwrap();
        }
        if let Some(x) = done(a, b) {
            return x;
        }
        assert!(Instant::now() < end, "nothing within 30 s");
    }
}

/// A deferred call from `c` to `srv` (at `s`) and its request, taken
/// at the target: a call whose answer the test fails by hand.
fn held_call(c: &mut Engine, srv: &mut Engine, s: &na_core::Addr) -> (crate::CallId, DeferredRequest) {
    let call = c.forward::<Held>(s, &1).unwrap();
    let req = drive(c, srv, |_, srv| srv.take_deferred());
    (call, req)
}

fn too_large() -> NaError {
    NaError::MessageTooLarge {
        len: 5000,
        max: 256,
        kind: "peer's buffer",
    }
}

/// A response the transport could not send (a failure of its own, the
/// caller still there) is answered with the short error in its place:
/// the caller's call ends with `ResponseNotSent`, naming the failure.
/// A lost response that was itself that error, or was sent in a lost
/// one's place (`resent`), or one whose caller is gone, gets nothing
/// more: counted as dropped, nothing sent (no loop).
#[test]
fn a_lost_response_is_replaced_by_an_error_once() {
    let (dir, mut srv, mut c, s) = sm_pair("lost-response");
    srv.register_deferred::<Held>().unwrap();
    let (call, req) = held_call(&mut c, &mut srv, &s);
    let h = response_header(&req.header, Status::Ok);
    srv.response_not_sent(req.source(), &h, &[7; 5000 - HEADER_LEN], too_large(), false);
    let outcome = drive(&mut c, &mut srv, |c, _| c.take_response::<Held>(call));
    match outcome {
        Err(RpcError::ResponseNotSent { rpc, reason }) => {
            assert_eq!(rpc, Held::NAME);
            assert!(
                reason.contains("5000 bytes") && reason.contains("256"),
                "{reason}"
            );
            assert!(reason.len() <= NOT_SENT_REASON_MAX, "{reason}");
        }
        other => panic!("expected ResponseNotSent, got {other:?}"),
    }
    let st = srv.stats();
    assert_eq!((st.responses_replaced, st.responses_dropped), (1, 0), "{st:?}");
    // The error in its place lost too, an answer sent again lost too,
    // or a caller gone: nothing sent.
    let sent = srv.stats().bytes_sent;
    let not_sent = response_header(&req.header, Status::ResponseNotSent);
    let post = || NaError::Plugin {
        plugin: "verbs",
        message: "post failed".into(),
    };
    srv.response_not_sent(req.source(), &not_sent, &[1; 68], post(), false);
    let busy = response_header(&req.header, Status::Busy);
    srv.response_not_sent(req.source(), &busy, b"target busy", post(), true);
    let gone = NaError::PeerGone {
        peer: "x".into(),
        reason: "exited".into(),
    };
    srv.response_not_sent(req.source(), &h, &[1; 68], gone, false);
    let st = srv.stats();
    assert_eq!((st.responses_replaced, st.responses_dropped), (1, 3), "{st:?}");
    assert_eq!(st.bytes_sent, sent, "something was sent for them");
    drop(req);
    drop((srv, c));
    let _ = std::fs::remove_dir_all(dir);
}

/// An answer from no handler that the transport could not send goes
/// again with its status (the caller's policy acts on it: busy means
/// nothing ran, try later), not as `ResponseNotSent`; its reason is
/// cut short, a short one kept whole. A handler's error is replaced
/// as an output is (the handler ran).
#[test]
fn a_lost_answer_from_no_handler_goes_again_with_its_status() {
    let (dir, mut srv, mut c, s) = sm_pair("lost-busy");
    srv.register_deferred::<Held>().unwrap();
    let long = "target busy: a bound of this target that takes many words to name ".repeat(3);
    let cases: [(Status, &str); 4] = [
        (Status::Busy, &long),
        (Status::DecodeError, "input of test.held: bad varint"),
        (Status::UnknownRpc, ""),
        (Status::HandlerError, "the handler failed"),
    ];
    for (i, (status, why)) in cases.into_iter().enumerate() {
        let (call, req) = held_call(&mut c, &mut srv, &s);
        let h = response_header(&req.header, status);
        srv.response_not_sent(req.source(), &h, why.as_bytes(), too_large(), false);
        let outcome = drive(&mut c, &mut srv, |c, _| c.take_response::<Held>(call));
        match (status, outcome) {
            (Status::Busy, Err(RpcError::Busy { reason, .. })) => {
                assert!(reason.len() <= RESENT_REASON_MAX, "{reason}");
                assert!(reason.starts_with("target busy: a bound"), "{reason}");
                assert!(
                    reason.contains(&format!("cut from {} bytes", long.len())),
                    "{reason}"
                );
            }
            (Status::DecodeError, Err(RpcError::Decode { reason, .. })) => assert_eq!(reason, why),
            (Status::UnknownRpc, Err(RpcError::UnknownRpc { rpc, .. })) => assert_eq!(rpc, Held::NAME),
            (Status::HandlerError, Err(RpcError::ResponseNotSent { reason, .. })) => {
                assert!(reason.contains("HandlerError"), "{reason}")
            }
            (status, other) => panic!("{status:?} lost: the caller got {other:?}"),
        }
        let st = srv.stats();
        assert_eq!(
            (st.responses_replaced, st.responses_dropped),
            (i as u64 + 1, 0),
            "{st:?}"
        );
        drop(req);
    }
    drop((srv, c));
    let _ = std::fs::remove_dir_all(dir);
}

/// A busy answer the transport gives back at its completion (na-verbs
/// does) goes again, once: given back again, its send id marks it as
/// sent in a lost answer's place, and nothing more is sent (no loop,
/// though its status is not `ResponseNotSent`).
#[test]
fn a_busy_answer_given_back_goes_again_once() {
    use super::super::{RESENT_OP, SEND_OP};
    let (dir, mut srv, mut c, s) = sm_pair("returned-busy");
    srv.register_deferred::<Held>().unwrap();
    let (call, req) = held_call(&mut c, &mut srv, &s);
    let mut msg = Vec::new();
    response_header(&req.header, Status::Busy).encode_with(b"target busy: try later", &mut msg);
    let post = || NaError::Plugin {
        plugin: "verbs",
        message: "post failed".into(),
    };
    let src = req.source().clone();
    srv.send_failed(
        na_core::OpId(SEND_OP | 7),
        post(),
        Some(msg.clone()),
        Some(src.clone()),
    );
    let st = srv.stats();
    assert_eq!((st.responses_replaced, st.responses_dropped), (1, 0), "{st:?}");
    let sent = st.bytes_sent;
    srv.send_failed(
        na_core::OpId(SEND_OP | RESENT_OP | 8),
        post(),
        Some(msg),
        Some(src),
    );
    let st = srv.stats();
    assert_eq!((st.responses_replaced, st.responses_dropped), (1, 1), "{st:?}");
    assert_eq!(st.bytes_sent, sent, "sent again in a loop");
    match drive(&mut c, &mut srv, |c, _| c.take_response::<Held>(call)) {
        Err(RpcError::Busy { reason, .. }) => assert_eq!(reason, "target busy: try later"),
        other => panic!("expected Busy, got {other:?}"),
    }
    drop(req);
    drop((srv, c));
    let _ = std::fs::remove_dir_all(dir);
}

/// A message given back is told apart with one decode of its header:
/// a response (its cookie, RPC id, status, spill flag and payload:
/// what goes in its place needs them) from a request, a truncated
/// message or garbage.
#[test]
fn a_returned_response_is_read_back_and_nothing_else_is() {
    let mut msg = Vec::new();
    let h = header(FLAG_RESPONSE | FLAG_SPILL, Status::Ok, 0x1234, 0xdead_0000_0007);
    h.encode_with(&[9; 40], &mut msg);
    let Returned::Response(back, payload) = returned(&msg) else {
        panic!("not read back as a response: {:?}", returned(&msg));
    };
    assert_eq!(
        (back.cookie, back.rpc_id, back.status, back.flags & FLAG_SPILL),
        (0xdead_0000_0007, 0x1234, Status::Ok, FLAG_SPILL)
    );
    assert_eq!(payload, &[9; 40]);
    let mut req = Vec::new();
    header(0, Status::Ok, 0x1234, 7).encode_with(&[1, 2, 3], &mut req);
    assert_eq!(returned(&req), Returned::Other, "a request taken for a response");
    assert_eq!(returned(&msg[..20]), Returned::Other, "a cut message");
    assert_eq!(returned(&[0xff; 64]), Returned::Other, "garbage");
    // The error that goes in its place keeps the call and the RPC.
    let e = response_header(&back, Status::ResponseNotSent);
    assert_eq!(
        (e.cookie, e.rpc_id, e.flags),
        (back.cookie, back.rpc_id, FLAG_RESPONSE)
    );
}

fn backlog_full() -> NaError {
    NaError::SendBacklogFull {
        peer: "x".into(),
        queued: 3,
        bytes: 1000,
        max: 1000,
        scope: "to this peer",
    }
}

/// An answer from no handler refused at the send call for a full backlog
/// is not sent again when it would go unchanged (its reason short
/// already: the same message, refused again for certain): dropped,
/// nothing sent. One whose reason is cut goes again (a shorter message
/// may fit), as does a short one lost for another reason.
#[test]
fn an_unchanged_answer_refused_for_a_full_backlog_is_not_tried_again() {
    let (dir, mut srv, mut c, s) = sm_pair("backlog-full-busy");
    srv.register_deferred::<Held>().unwrap();
    let (_call, req) = held_call(&mut c, &mut srv, &s);
    let busy = response_header(&req.header, Status::Busy);
    let sent = srv.stats().bytes_sent;
    let short = b"target busy: try later";
    srv.response_not_sent(req.source(), &busy, short, backlog_full(), false);
    let st = srv.stats();
    assert_eq!((st.responses_replaced, st.responses_dropped), (0, 1), "{st:?}");
    assert_eq!(st.bytes_sent, sent, "the same message was tried again");
    let long = vec![b'x'; RESENT_REASON_MAX + 1];
    srv.response_not_sent(req.source(), &busy, &long, backlog_full(), false);
    let st = srv.stats();
    assert_eq!((st.responses_replaced, st.responses_dropped), (1, 1), "{st:?}");
    srv.response_not_sent(req.source(), &busy, short, too_large(), false);
    let st = srv.stats();
    assert_eq!((st.responses_replaced, st.responses_dropped), (2, 1), "{st:?}");
    drop(req);
    drop((srv, c));
    let _ = std::fs::remove_dir_all(dir);
}
