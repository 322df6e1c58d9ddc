//! The target side of a response that could not be sent: at the send
//! call, or at its completion (na-verbs gives the message and its
//! destination back in the failed completion, see
//! [`Completion::buf`](na_core::Completion::buf)). Unless its caller is
//! gone, something goes to the same call in its place, so that the caller
//! learns now, not at its deadline (nor never, without one): an answer
//! from no handler (busy, unknown RPC, decode error: small, and telling
//! the caller that nothing ran) goes again as it was, its reason cut to
//! [`RESENT_REASON_MAX`]; any other (a handler's output or error) is
//! replaced by the short [`Status::ResponseNotSent`] error ("the handler
//! may have run"). If that send fails too, it is counted and logged, and
//! nothing else is sent (no loop: its id carries [`RESENT_OP`]). A
//! spilled output the lost response described is let go.
//!
//! Nothing here costs the busy path: a response's send keeps a counted id
//! and no record. What goes in its place (the destination, the cookie,
//! the RPC id, the status, an answer's reason) is read back from the
//! failed message itself, on the failure: [`returned`] tells what a
//! message given back was, decoding its header once.

use na_core::{Addr, NaError, OpId, Report};

use super::serve_spill_ops::truncate_message;
use super::{logged_at, response_header, Engine, RESENT_OP, RESPONSE_TAG};
use crate::codec::Codec;
use crate::header::{Header, Status, FLAG_SPILL, HEADER_LEN};
use crate::rpc::rpc_id;
use crate::spill::RELEASE_RPC;

/// Most bytes of the reason a [`Status::ResponseNotSent`] error carries:
/// the error must fit where its response did not (a peer's buffer
/// smaller than an engine's, say), so it stays far under any message
/// limit.
pub(super) const NOT_SENT_REASON_MAX: usize = 192;

/// Most bytes of the reason an answer from no handler keeps when it goes
/// again (see [`Status::ran_no_handler`]): under the reasons the engine
/// gives for most of them (a busy answer names its bound in 70 to 170
/// bytes), so that the second try is a shorter message than the first,
/// as the error in an output's place is; the status, which the caller
/// acts on, is kept whole.
pub(super) const RESENT_REASON_MAX: usize = 96;

/// What a message the transport gave back (a send that failed at its
/// completion) was, told from its header, decoded once.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Returned<'a> {
    /// A target's acknowledgement of a pulled spilled one-way request (a
    /// response header with the one-way flag and no payload, see
    /// [`acknowledge_one_way`](Engine::acknowledge_one_way)): a notice,
    /// sent again as one. Told apart first: it is a response header too.
    Ack(Header),
    /// A response of ours (a response's flags never carry the one-way
    /// bit), with its payload (an output, a reason, or a spilled output's
    /// descriptor).
    Response(Header, &'a [u8]),
    /// A release notice of ours, with the cookie it releases.
    Release(u64),
    /// Anything else: a request, or bytes that are not a message of this
    /// version.
    Other,
}

/// Tells what `msg`, a message the transport gave back, was: one decode
/// of its header, then the flags.
pub(super) fn returned(msg: &[u8]) -> Returned<'_> {
    let Ok((h, payload)) = Header::decode(msg) else {
        return Returned::Other;
    };
    let one_way = h.is_one_way();
    if h.is_response() {
        if one_way && payload.is_empty() {
            Returned::Ack(h)
        } else {
            Returned::Response(h, payload)
        }
    } else if one_way && h.rpc_id == rpc_id(RELEASE_RPC) {
        Returned::Release(h.cookie)
    } else {
        Returned::Other
    }
}

impl<C: Codec> Engine<C> {
    /// Response `h` with `payload` to `dest` was not sent: `e` refused it
    /// at the send call, or failed it at its completion. Its spilled
    /// output, if it had one, is let go (its seal broken: nobody learned
    /// of it). A caller that is gone (`PeerGone`: its engine's watch on us
    /// fails its calls) or a send that was itself in a lost response's
    /// place (`resent`, or a `ResponseNotSent` error) gets nothing more:
    /// the response counts as dropped ([`RpcStats::responses_dropped`]).
    /// Any other gets a send in its place (see the module's doc;
    /// [`RpcStats::responses_replaced`]).
    ///
    /// [`RpcStats::responses_dropped`]: crate::RpcStats::responses_dropped
    /// [`RpcStats::responses_replaced`]: crate::RpcStats::responses_replaced
    #[cold]
    #[inline(never)]
    pub(super) fn response_not_sent(
        &mut self,
        dest: &Addr,
        h: &Header,
        payload: &[u8],
        e: NaError,
        resent: bool,
    ) {
        if h.flags & FLAG_SPILL != 0 {
            // Should a transport ever publish before it fails, a pull
            // still to come is refused, as on every other way out.
            if let Some(mem) = self.exposed.remove((dest.token(), h.cookie)) {
                crate::spill::break_seal(&mem);
            }
        }
        let gone = matches!(e, NaError::PeerGone { .. });
        let resent = resent || h.status == Status::ResponseNotSent;
        let len = HEADER_LEN + payload.len();
        let replaced = !gone && !resent && self.send_in_place(dest, h, payload, &e);
        if replaced {
            self.stats.responses_replaced += 1;
            let n = self.stats.responses_replaced;
            if logged_at(n) {
                tracing::warn!(peer = %dest, error = %e, len, cookie = h.cookie, status = ?h.status, replaced = n,
                    "cannot send RPC response; told its caller instead");
            }
            return;
        }
        self.stats.responses_dropped += 1;
        // A caller that stopped reading makes every response fail: warn
        // at 1, 2, 4, 8... of them, not once per request.
        let dropped = self.stats.responses_dropped;
        if logged_at(dropped) {
            tracing::warn!(peer = %dest, error = %e, dropped, status = ?h.status, "cannot send RPC response");
        } else {
            tracing::debug!(peer = %dest, error = %e, dropped, status = ?h.status, "cannot send RPC response");
        }
    }

    /// Sends `dest` what goes in place of response `h` with `payload`,
    /// which failed with `e`: the same answer, its reason cut to
    /// [`RESENT_REASON_MAX`], if no handler ran; else the
    /// [`Status::ResponseNotSent`] error. False if the transport refused
    /// it too (its failure at completion comes back to
    /// [`response_not_sent`](Self::response_not_sent) with the
    /// [`RESENT_OP`] bit in its id, which sends nothing for it).
    fn send_in_place(&mut self, dest: &Addr, h: &Header, payload: &[u8], e: &NaError) -> bool {
        let (status, reason) = if h.status.ran_no_handler() {
            let mut reason = payload.to_vec();
            if reason.len() > RESENT_REASON_MAX {
                truncate_message(&mut reason, RESENT_REASON_MAX);
            }
            (h.status, reason)
        } else {
            let len = HEADER_LEN + payload.len();
            let mut reason = format!("its response ({:?}, {len} bytes) failed: {e}", h.status).into_bytes();
            if reason.len() > NOT_SENT_REASON_MAX {
                truncate_message(&mut reason, NOT_SENT_REASON_MAX);
            }
            (Status::ResponseNotSent, reason)
        };
        // `response_header` keeps the checksum flag of the header it is
        // given, as the lost response had it from its request.
        let head = response_header(h, status).encode_head(&reason);
        let op = OpId(self.send_op().0 | RESENT_OP);
        let sent =
            self.ep
                .send_unexpected_parts(dest, RESPONSE_TAG, &[&head, &reason], op, Report::FailuresOnly);
        match sent {
            Ok(()) => {
                self.stats.bytes_sent += (HEADER_LEN + reason.len()) as u64;
                true
            }
            Err(e2) => {
                tracing::debug!(peer = %dest, error = %e2, ?status,
                    "cannot send what goes in place of a lost response either");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
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
}
