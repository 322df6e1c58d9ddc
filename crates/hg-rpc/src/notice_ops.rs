//! Sending notices (see `notices`): an origin's releases of pulled
//! spilled outputs and a target's acknowledgements of pulled spilled
//! one-way requests. One the transport refuses for a full backlog waits
//! behind that peer's others and goes again from `trigger`.

use na_core::{Addr, NaError, OpId};

use super::{header, Engine, NOTICE_AGAIN_OP, RESPONSE_TAG};
use crate::codec::Codec;
use crate::header::{Header, Status, FLAG_ONE_WAY, HEADER_LEN};
use crate::notices::{Notice, NoticeTtls};
use crate::rpc::rpc_id;
use crate::spill::RELEASE_RPC;

impl<C: Codec> Engine<C> {
    /// Tells a target it may release the spilled output of call `cookie`.
    pub(super) fn release_output(&mut self, target: &Addr, cookie: u64) {
        self.send_notice(target, Notice::Release(cookie));
    }

    /// Tells an origin that its spilled one-way request (header `h`) was
    /// pulled, so it may release the input: a response header with
    /// `status` and no payload. It carries the one-way flag as well (a
    /// response's own flags say nothing else of it), so that one the
    /// transport gives back is told from a response (see
    /// [`returned`](super::unsent_response_ops::returned)); the origin reads only the response flag.
    pub(super) fn acknowledge_one_way(&mut self, origin: &Addr, mut h: Header) {
        h.flags |= FLAG_ONE_WAY;
        self.send_notice(origin, Notice::Ack(h));
    }

    /// Sends `notice` to `peer`, behind any of its notices that wait; one
    /// the transport cannot take now (its send backlog to the peer full)
    /// waits too, and is sent again by [`trigger`](Self::trigger).
    fn send_notice(&mut self, peer: &Addr, notice: Notice) {
        if self.unsent_notices.waits_for(peer) {
            self.queue_notice(peer, notice);
            return;
        }
        match self.send_notice_now(peer, notice, false) {
            Ok(()) => {}
            Err(e) if keeps_notice(&e) => self.queue_notice(peer, notice),
            Err(e) => self.notice_lost(peer, notice, &e),
        }
    }

    /// Sends `notice` to `peer` now; `again`: it came back before (its
    /// send's id says so, so that its successful completion, its
    /// delivery, brings the short retry gap back: see [`NOTICE_AGAIN_OP`]).
    fn send_notice_now(&mut self, peer: &Addr, notice: Notice, again: bool) -> Result<(), NaError> {
        let op = self.send_op();
        let op = if again { OpId(op.0 | NOTICE_AGAIN_OP) } else { op };
        let len = match notice {
            Notice::Release(cookie) => {
                let mut msg = Vec::with_capacity(HEADER_LEN + 8);
                let h = header(
                    self.checksum_flag | FLAG_ONE_WAY,
                    Status::Ok,
                    rpc_id(RELEASE_RPC),
                    cookie,
                );
                h.encode_with(&cookie.to_le_bytes(), &mut msg);
                self.ep.send_unexpected(peer, 0, &msg, op)?;
                msg.len()
            }
            Notice::Ack(h) => {
                let head = h.encode_head(&[]);
                self.ep.send_unexpected(peer, RESPONSE_TAG, &head, op)?;
                head.len()
            }
        };
        self.stats.bytes_sent += len as u64;
        Ok(())
    }

    fn queue_notice(&mut self, peer: &Addr, notice: Notice) {
        if !self.unsent_notices.push(peer, notice) {
            self.notice_given_up(&notice);
            tracing::debug!(peer = %peer, ?notice, "too many notices wait for this peer; its TTL frees the memory");
        }
    }

    /// A notice that cannot be sent at all (the peer is gone, or its
    /// address is no longer valid).
    fn notice_lost(&mut self, peer: &Addr, notice: Notice, e: &NaError) {
        self.notice_given_up(&notice);
        tracing::debug!(peer = %peer, ?notice, error = %na_core::ErrorChain(&e), "cannot send a notice (peer gone?)");
    }

    /// `notice` is given up, for whatever reason (lost, past its TTL, past
    /// the cap of those waiting): an acknowledgement counts as a response
    /// dropped ([`RpcStats::responses_dropped`]), once, wherever it is
    /// given up. (Before, only those lost were counted.)
    ///
    /// [`RpcStats::responses_dropped`]: crate::RpcStats::responses_dropped
    fn notice_given_up(&mut self, notice: &Notice) {
        if matches!(notice, Notice::Ack(_)) {
            self.stats.responses_dropped += 1;
        }
    }

    /// A notice `peer` never got: its send failed at its completion
    /// (na-verbs gives the message back, told apart by
    /// [`returned`](super::unsent_response_ops::returned)). Queued to go
    /// again, as one the transport refused at the call, unless the peer is
    /// gone; the peer's TTL (as [`notice_ttls`](Self::notice_ttls) reckons
    /// it: the outputs' one for a release, the abandoned-input one for an
    /// acknowledgement, both 60 s by default) counts from its first
    /// failure, so one that keeps failing is given up when the peer frees
    /// the memory anyway (no endless loop). (Before: only logged, and the peer kept the output
    /// or input exposed, and a drain waited, until that TTL; a returned
    /// acknowledgement was even taken for a response and answered with a
    /// `ResponseNotSent` error no call waited for.)
    #[cold]
    #[inline(never)]
    pub(super) fn notice_returned(&mut self, peer: &Addr, notice: Notice, e: &NaError) {
        if matches!(e, NaError::PeerGone { .. } | NaError::InvalidAddress { .. }) {
            return self.notice_lost(peer, notice, e);
        }
        tracing::debug!(peer = %peer, ?notice, error = %na_core::ErrorChain(&e), "a notice failed at completion; sending it again");
        if !self
            .unsent_notices
            .push_returned(peer, notice, self.notice_ttls())
        {
            self.notice_given_up(&notice);
            tracing::debug!(peer = %peer, ?notice, "a notice kept failing (or too many wait); the peer's TTL frees the memory");
        }
    }

    /// Sends the notices that waited: each peer's in order, until the
    /// transport refuses one of them again. Those older than their kind's
    /// TTL ([`notice_ttls`](Self::notice_ttls)) are dropped: the peer has
    /// freed the memory by then. Called by `trigger` when a retry is due.
    /// A notice that came back before does not count as sent when the
    /// transport accepts it again (it may come back again): a pass that
    /// sends only such notices lets the gap before the next one grow, so
    /// one that keeps failing at its completion is not sent every
    /// millisecond until its TTL. Its send carries [`NOTICE_AGAIN_OP`]:
    /// once it completes without error (the peer got it), the short gap
    /// comes back (before, it stayed long, up to `RETRY_EVERY`, until a
    /// pass sent a notice that never came back, though the peer took
    /// notices again).
    #[cold]
    #[inline(never)]
    pub(super) fn retry_notices(&mut self) {
        let ttls = self.notice_ttls();
        let mut sent = false;
        for mut w in self.unsent_notices.take_all() {
            while let Some(&(notice, since)) = w.notices.front() {
                if since.elapsed() > ttls.of(&notice) {
                    w.notices.pop_front();
                    self.notice_given_up(&notice);
                    continue;
                }
                let again = self.unsent_notices.came_back(&w.addr, &notice);
                match self.send_notice_now(&w.addr, notice, again) {
                    Ok(()) => {
                        w.notices.pop_front();
                        sent |= !again;
                    }
                    Err(e) if keeps_notice(&e) => break,
                    Err(e) => {
                        for (notice, _) in std::mem::take(&mut w.notices) {
                            self.notice_lost(&w.addr, notice, &e);
                        }
                    }
                }
            }
            self.unsent_notices.put_back(w);
        }
        self.unsent_notices.pass_done(sent);
    }

    /// How long each kind of notice is retried: this engine's own TTL of
    /// the memory it frees at the peer, which stands for the peer's (see
    /// [`NoticeTtls`]): the outputs' TTL for a release (a target keeps a
    /// spilled output that long), the abandoned-input TTL for an
    /// acknowledgement (an origin keeps a one-way request's spilled input
    /// that long).
    fn notice_ttls(&self) -> NoticeTtls {
        NoticeTtls {
            release: self.output_ttl,
            ack: self.abandoned_ttl,
        }
    }

    /// Notices the transport refused that wait to be sent again (for
    /// tests; not a stable API).
    #[doc(hidden)]
    pub fn notices_waiting(&self) -> usize {
        self.unsent_notices.len()
    }
}

/// True for a send error that passes (a full backlog): the notice is
/// worth sending again; not for a peer that is gone or an address that
/// is no longer valid.
fn keeps_notice(e: &NaError) -> bool {
    matches!(e, NaError::SendBacklogFull { .. })
}

#[cfg(test)]
mod tests {
    use super::super::response_header;
    use super::super::unsent_response_ops::{returned, Returned};
    use super::*;
    use crate::header::FLAG_SPILL;
    use std::time::Duration;

    /// An acknowledgement given back is told from a response (an empty
    /// one included, which never carries the one-way flag) and from a
    /// release.
    #[test]
    fn a_returned_acknowledgement_is_told_from_a_response() {
        let req = header(FLAG_ONE_WAY | FLAG_SPILL, Status::Ok, 42, 7);
        let mut ack = response_header(&req, Status::Ok);
        ack.flags |= FLAG_ONE_WAY;
        let ack = ack.encode_head(&[]);
        assert!(matches!(returned(&ack), Returned::Ack(h) if h.cookie == 7));
        let empty = response_header(&req, Status::Ok).encode_head(&[]);
        assert!(
            matches!(returned(&empty), Returned::Response(h, p) if h.cookie == 7 && p.is_empty()),
            "an empty response is no acknowledgement"
        );
        let rel = header(FLAG_ONE_WAY, Status::Ok, rpc_id(RELEASE_RPC), 7);
        let mut msg = Vec::new();
        rel.encode_with(&7u64.to_le_bytes(), &mut msg);
        assert_eq!(returned(&msg), Returned::Release(7));
    }

    /// A failure at completion, as na-verbs reports one (not the peer
    /// gone: the notice goes again).
    fn post_failed() -> NaError {
        NaError::Plugin {
            plugin: "verbs",
            message: "post failed".into(),
        }
    }

    fn ack(cookie: u64) -> Notice {
        let req = header(FLAG_ONE_WAY | FLAG_SPILL, Status::Ok, 42, cookie);
        let mut h = response_header(&req, Status::Ok);
        h.flags |= FLAG_ONE_WAY;
        Notice::Ack(h)
    }

    /// A notice that keeps coming back at its completion, though the
    /// transport accepts each send, is retried less and less often (the
    /// gap doubles), not every millisecond until its TTL; a notice that
    /// never came back brings the short gap again once sent.
    #[test]
    fn a_notice_that_keeps_coming_back_is_retried_less_and_less_often() {
        use crate::notices::RETRY_FIRST;
        let (dir, srv, mut c, s) = crate::engine::test_support::sm_pair("notice-back");
        let mut gaps = Vec::new();
        for _ in 0..4 {
            // Given back (failed at completion), then sent again: sm
            // accepts it, as verbs would before failing it once more.
            c.notice_returned(&s, Notice::Release(7), &post_failed());
            assert_eq!(c.notices_waiting(), 1);
            c.retry_notices();
            assert_eq!(c.notices_waiting(), 0, "not sent again");
            gaps.push(c.unsent_notices.gap().as_millis());
        }
        assert_eq!(gaps, [2, 4, 8, 16], "the gap was reset by sends that came back");
        // A notice refused at the call, never given back: once sent, the
        // short gap again.
        c.queue_notice(&s, Notice::Release(8));
        c.retry_notices();
        assert_eq!(c.unsent_notices.gap(), RETRY_FIRST);
        drop((srv, c));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A notice that came back, once sent again and delivered (its send
    /// completes without error: na-sm completes every send it accepted
    /// so, as na-verbs does once the peer got the message), brings the
    /// short gap back: its peer takes notices again. (Before, the gap
    /// stayed long, up to 100 ms, until a pass sent a notice that never
    /// came back: a later backlog to any peer waited that long for its
    /// first retry.)
    #[test]
    fn a_notice_that_came_back_brings_the_short_gap_back_once_delivered() {
        use crate::notices::RETRY_FIRST;
        use std::time::Instant;
        let (dir, mut srv, mut c, s) = crate::engine::test_support::sm_pair("notice-delivered");
        for _ in 0..4 {
            c.notice_returned(&s, Notice::Release(7), &post_failed());
            c.retry_notices();
        }
        // The sends were accepted, their completions not handled yet.
        assert_eq!(c.unsent_notices.gap().as_millis(), 16, "the gap grew");
        let end = Instant::now() + Duration::from_secs(30);
        while c.unsent_notices.gap() != RETRY_FIRST {
            assert!(
                Instant::now() < end,
                "delivered, and the gap is still {:?}: {:?}",
                c.unsent_notices.gap(),
                c.stats()
            );
            c.progress_now().unwrap();
            c.trigger().unwrap();
            srv.progress_now().unwrap();
            srv.trigger().unwrap();
        }
        assert_eq!(c.stats().sends_failed, 0, "delivered, not failed");
        assert_eq!(c.notices_waiting(), 0);
        drop((srv, c));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Every acknowledgement given up counts as a response dropped, once:
    /// one dropped by a retry past its TTL, one given back past its TTL
    /// (refused for the queue), one past the cap of those waiting, as one
    /// lost (the peer gone) always did. Releases are not counted.
    #[test]
    fn every_acknowledgement_given_up_counts_as_a_response_dropped() {
        use crate::notices::MAX_WAITING_PER_PEER;
        let (dir, srv, mut c, s) = crate::engine::test_support::sm_pair("ack-dropped");
        // The TTLs are read where they are checked: long while a notice
        // must be within them (no scheduler stall outlasts them), then
        // shorter than a sleep once it must be past them.
        let ttls = |c: &mut Engine<_>, ttl| {
            c.set_abandoned_input_ttl(ttl);
            c.set_spilled_output_ttl(ttl);
        };
        let (long, short) = (Duration::from_secs(3600), Duration::from_millis(1));
        let past = || std::thread::sleep(short + Duration::from_millis(5));
        let dropped = |c: &Engine<_>| c.stats().responses_dropped;
        // Waiting past its TTL: dropped by the retry.
        ttls(&mut c, long);
        c.notice_returned(&s, ack(1), &post_failed());
        c.notice_returned(&s, Notice::Release(1), &post_failed());
        past();
        ttls(&mut c, short);
        c.retry_notices();
        assert_eq!(c.notices_waiting(), 0);
        assert_eq!(dropped(&c), 1, "an ack dropped at its TTL by a retry");
        // Sent again, given back again past its TTL: not queued.
        ttls(&mut c, long);
        c.notice_returned(&s, ack(2), &post_failed());
        c.retry_notices();
        assert_eq!(c.notices_waiting(), 0);
        past();
        ttls(&mut c, short);
        c.notice_returned(&s, ack(2), &post_failed());
        assert_eq!(c.notices_waiting(), 0);
        assert_eq!(dropped(&c), 2, "an ack given back past its TTL");
        // Past the cap of those waiting for a peer.
        c.set_abandoned_input_ttl(Duration::from_secs(3600));
        for cookie in 0..MAX_WAITING_PER_PEER as u64 {
            c.queue_notice(&s, Notice::Release(100 + cookie));
        }
        c.queue_notice(&s, ack(3));
        c.notice_returned(&s, ack(4), &post_failed());
        assert_eq!(dropped(&c), 4, "acks past the cap");
        // Lost: the peer gone.
        let gone = NaError::PeerGone {
            peer: "x".into(),
            reason: "exited".into(),
        };
        c.notice_returned(&s, ack(5), &gone);
        c.notice_returned(&s, Notice::Release(5), &gone);
        assert_eq!(dropped(&c), 5, "a lost ack");
        drop((srv, c));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A notice that waits to be sent again is owed to its peer (an
    /// acknowledgement lets it release a spilled input, a release lets it
    /// free an output): an engine is not drained while one waits, and
    /// once driven until drained it has sent it and owes nothing (so its
    /// drop does not warn). (Before, `drained` said true with notices
    /// waiting: a server dropped then lost them, and its drop warned.)
    #[test]
    fn an_engine_with_notices_waiting_is_not_drained() {
        use std::time::Instant;
        let (dir, mut srv, mut c, s) = crate::engine::test_support::sm_pair("notice-drain");
        c.begin_drain();
        assert!(c.drained(), "an idle engine draining owes nothing");
        c.queue_notice(&s, ack(9));
        c.queue_notice(&s, Notice::Release(10));
        assert_eq!(c.notices_waiting(), 2);
        assert!(!c.owed().is_nothing());
        assert!(!c.drained(), "drained with notices waiting to be sent");
        let end = Instant::now() + Duration::from_secs(30);
        while !c.drained() {
            assert!(Instant::now() < end, "never drained: {:?}", c.stats());
            c.progress_now().unwrap();
            c.trigger().unwrap();
            srv.progress_now().unwrap();
            srv.trigger().unwrap();
        }
        assert_eq!(c.notices_waiting(), 0, "drained, and notices still wait");
        assert!(c.owed().is_nothing(), "{:?}", c.owed());
        drop((srv, c));
        let _ = std::fs::remove_dir_all(dir);
    }
}
