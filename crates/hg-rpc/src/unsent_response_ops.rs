//! The target side of a response that could not be sent: at the send
//! call, or at its completion (na-verbs gives the message and its
//! destination back in the failed completion, see
//! [`Completion::buf`](na_core::Completion::buf)). Unless its caller is
//! gone, a short [`Status::ResponseNotSent`] error goes to the same call
//! in its place, so that the caller learns now, not at its deadline (nor
//! never, without one); if that one fails too, it is counted and logged,
//! and nothing else is sent (no loop). A spilled output the lost response
//! described is let go.
//!
//! Nothing here costs the busy path: a response's send keeps a counted id
//! and no record. What the error needs (the destination, the cookie, the
//! RPC id) is read back from the failed message itself, on the failure.

use na_core::{Addr, NaError, Report};

use super::serve_spill_ops::truncate_message;
use super::{logged_at, response_header, Engine, RESPONSE_TAG};
use crate::codec::Codec;
use crate::header::{Header, Status, FLAG_SPILL, HEADER_LEN};

/// Most bytes of the reason a [`Status::ResponseNotSent`] error carries:
/// the error must fit where its response did not (a peer's buffer
/// smaller than an engine's, say), so it stays far under any message
/// limit.
pub(super) const NOT_SENT_REASON_MAX: usize = 192;

/// The header of `msg` if it is a response of ours (a failed send given
/// back by the transport); `None` for anything else (a request, a
/// notice, or bytes that are not a message of this version).
pub(super) fn returned_response(msg: &[u8]) -> Option<Header> {
    let (h, _) = Header::decode(msg).ok()?;
    h.is_response().then_some(h)
}

impl<C: Codec> Engine<C> {
    /// Response `h` (`len` bytes with its header) to `dest` was not sent:
    /// `e` refused it at the send call, or failed it at its completion.
    /// Its spilled output, if it had one, is let go (its seal broken:
    /// nobody learned of it). A caller that is gone (`PeerGone`: its
    /// engine's watch on us fails its calls) or a response that was
    /// itself such an error is not answered again: the response counts
    /// as dropped ([`RpcStats::responses_dropped`]). Any other gets the
    /// short error in its place ([`RpcStats::responses_replaced`]).
    ///
    /// [`RpcStats::responses_dropped`]: crate::RpcStats::responses_dropped
    /// [`RpcStats::responses_replaced`]: crate::RpcStats::responses_replaced
    #[cold]
    #[inline(never)]
    pub(super) fn response_not_sent(&mut self, dest: &Addr, h: &Header, len: usize, e: NaError) {
        if h.flags & FLAG_SPILL != 0 {
            // Should a transport ever publish before it fails, a pull
            // still to come is refused, as on every other way out.
            if let Some(mem) = self.exposed.remove((dest.token(), h.cookie)) {
                crate::spill::break_seal(&mem);
            }
        }
        let gone = matches!(e, NaError::PeerGone { .. });
        let replaced = !gone && h.status != Status::ResponseNotSent && self.send_not_sent(dest, h, len, &e);
        if replaced {
            self.stats.responses_replaced += 1;
            let n = self.stats.responses_replaced;
            if logged_at(n) {
                tracing::warn!(peer = %dest, error = %e, len, cookie = h.cookie, replaced = n,
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

    /// Sends `dest` the [`Status::ResponseNotSent`] error in place of
    /// response `h` (`len` bytes), which failed with `e`; false if the
    /// transport refused it too (its failure at completion comes back to
    /// [`response_not_sent`](Self::response_not_sent), which sends
    /// nothing for it).
    fn send_not_sent(&mut self, dest: &Addr, h: &Header, len: usize, e: &NaError) -> bool {
        let mut reason = format!("its response ({:?}, {len} bytes) failed: {e}", h.status).into_bytes();
        if reason.len() > NOT_SENT_REASON_MAX {
            truncate_message(&mut reason, NOT_SENT_REASON_MAX);
        }
        // `response_header` keeps the checksum flag of the header it is
        // given, as the lost response had it from its request.
        let head = response_header(h, Status::ResponseNotSent).encode_head(&reason);
        let op = self.send_op();
        let sent =
            self.ep
                .send_unexpected_parts(dest, RESPONSE_TAG, &[&head, &reason], op, Report::FailuresOnly);
        match sent {
            Ok(()) => {
                self.stats.bytes_sent += (HEADER_LEN + reason.len()) as u64;
                true
            }
            Err(e2) => {
                tracing::debug!(peer = %dest, error = %e2, "cannot send the error in place of a lost response either");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use na_core::NaError;

    use super::{returned_response, NOT_SENT_REASON_MAX};
    use crate::engine::test_support::sm_pair;
    use crate::engine::{header, response_header, DeferredRequest, Engine};
    use crate::header::{Status, FLAG_RESPONSE, FLAG_SPILL};
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

    /// A response the transport could not send (a failure of its own, the
    /// caller still there) is answered with the short error in its place:
    /// the caller's call ends with `ResponseNotSent`, naming the failure.
    /// A lost response that was itself that error, or one whose caller is
    /// gone, gets nothing more: counted as dropped, nothing sent (no loop).
    #[test]
    fn a_lost_response_is_replaced_by_an_error_once() {
        let (dir, mut srv, mut c, s) = sm_pair("lost-response");
        srv.register_deferred::<Held>().unwrap();
        let call = c.forward::<Held>(&s, &1).unwrap();
        let req: DeferredRequest = drive(&mut c, &mut srv, |_, srv| srv.take_deferred());
        let h = response_header(&req.header, Status::Ok);
        let too_large = NaError::MessageTooLarge {
            len: 5000,
            max: 256,
            kind: "peer's buffer",
        };
        srv.response_not_sent(req.source(), &h, 5000, too_large);
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
        // The error in its place lost too, or a caller gone: nothing sent.
        let sent = srv.stats().bytes_sent;
        let not_sent = response_header(&req.header, Status::ResponseNotSent);
        let post = NaError::Plugin {
            plugin: "verbs",
            message: "post failed".into(),
        };
        srv.response_not_sent(req.source(), &not_sent, 100, post);
        let gone = NaError::PeerGone {
            peer: "x".into(),
            reason: "exited".into(),
        };
        srv.response_not_sent(req.source(), &h, 100, gone);
        let st = srv.stats();
        assert_eq!((st.responses_replaced, st.responses_dropped), (1, 2), "{st:?}");
        assert_eq!(st.bytes_sent, sent, "something was sent for them");
        drop(req);
        drop((srv, c));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A response given back by the transport is read back (its cookie,
    /// RPC id, status and spill flag: what the error in its place needs);
    /// a request, a truncated message or garbage is not one.
    #[test]
    fn a_returned_response_is_read_back_and_nothing_else_is() {
        let mut msg = Vec::new();
        let h = header(FLAG_RESPONSE | FLAG_SPILL, Status::Ok, 0x1234, 0xdead_0000_0007);
        h.encode_with(&[9; 40], &mut msg);
        let back = returned_response(&msg).expect("a response");
        assert_eq!(
            (back.cookie, back.rpc_id, back.status, back.flags & FLAG_SPILL),
            (0xdead_0000_0007, 0x1234, Status::Ok, FLAG_SPILL)
        );
        let mut req = Vec::new();
        header(0, Status::Ok, 0x1234, 7).encode_with(&[1, 2, 3], &mut req);
        assert!(
            returned_response(&req).is_none(),
            "a request taken for a response"
        );
        assert!(returned_response(&msg[..20]).is_none(), "a cut message");
        assert!(returned_response(&[0xff; 64]).is_none(), "garbage");
        // The error that goes in its place keeps the call and the RPC.
        let e = response_header(&back, Status::ResponseNotSent);
        assert_eq!(
            (e.cookie, e.rpc_id, e.flags),
            (back.cookie, back.rpc_id, FLAG_RESPONSE)
        );
    }
}
