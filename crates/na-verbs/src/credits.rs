//! Credit-based flow control of one connection (no I/O).
//!
//! Each side posts `depth` receive buffers and tells the other side in its
//! hello: those are the other side's initial credits. Sending a message
//! costs one credit; a receiver that reposts a buffer owes one credit back
//! and returns owed credits in the header of its next message, or in a
//! credit-update message once half its depth is owed. So a sender never
//! has more messages in flight than the receiver has buffers posted, and
//! RNR (receiver not ready) never happens: the QPs run with
//! `rnr_retry_count = 0`, which turns a flow-control bug into an error
//! instead of hiding it behind retries.
//!
//! # Why it cannot deadlock
//! Data messages need two credits and leave one: the last credit is only
//! spent on a credit update. A side sends an update whenever it owes at
//! least `threshold = depth / 2` credits. If both sides were stuck, each
//! would owe the other more than the threshold (all its buffers' worth
//! minus what is in flight, and nothing is in flight at quiescence), so
//! each would have a credit update to send, and each keeps one credit for
//! exactly that.
//!
//! # End-to-end backpressure
//! A message nobody has posted a receive for is copied out of its buffer
//! and held. Once `max_held` messages of a connection are held, or
//! `max_held_total` over all connections, the credits for further
//! reposted buffers are *withheld* until the application takes held
//! messages: the sender then queues instead of flooding this process's
//! memory. Every repost is withheld in that state, also those of
//! messages matched at once (and of credit updates), so one release per
//! held message taken would not give them all back: once the held
//! messages are under `max_held` (and the total under `max_held_total`)
//! again, every withheld credit is owed at once, or the difference would
//! be lost for good and the connection would stall in both directions.
//! When the total falls under its bound, every connection that withheld
//! for it gets its credits back, not only the one whose message was
//! taken: the others' peers may have no credit left to send with (which
//! connections those are, and when, is kept by `held.rs`, the held
//! messages' bookkeeping).
//!
//! # A peer that ignores its credits
//! The receiver keeps its own count of the credits the peer holds (our
//! depth at first, one less per message that arrives, plus those we
//! return). A message that arrives when that count is zero is a protocol
//! violation and ends the connection: a peer that sets its own RNR retries
//! and sends regardless could otherwise make us hold without limit, since
//! buffers are reposted even while their credits are withheld.

/// Flow-control state of one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credits {
    /// Messages we may still send.
    avail: u32,
    /// The peer's receive depth (upper bound of `avail`).
    peer_depth: u32,
    /// Credits we owe the peer (reposted buffers not yet announced).
    owed: u32,
    /// Credits held back because too many messages are held.
    withheld: u32,
    /// Owed credits that trigger an explicit update.
    threshold: u32,
    /// Messages the peer may still send us, as we count them.
    peer_avail: u32,
}

impl Credits {
    /// A connection whose peer posted `peer_depth` buffers, while we posted `own_depth`.
    pub fn new(peer_depth: u32, own_depth: u32) -> Credits {
        Credits {
            avail: peer_depth,
            peer_depth,
            owed: 0,
            withheld: 0,
            threshold: (own_depth / 2).max(1),
            peer_avail: own_depth,
        }
    }

    /// The peer's depth became known (its hello arrived in the accept):
    /// our credits are now `peer_depth`. What we owe or withhold, and the
    /// peer's credits, are kept: messages may have arrived before the
    /// connection's established event was read.
    pub fn peer_ready(&mut self, peer_depth: u32) {
        self.avail = peer_depth;
        self.peer_depth = peer_depth;
    }

    #[cfg(any(test, feature = "fuzzing"))]
    /// Messages we may send now.
    pub fn available(&self) -> u32 {
        self.avail
    }

    /// True if a data message may be sent (one credit stays in reserve).
    pub fn can_send_data(&self) -> bool {
        self.avail >= 2
    }

    /// True if a credit update may be sent.
    pub fn can_send_update(&self) -> bool {
        self.avail >= 1
    }

    /// Spends one credit and takes all owed credits to piggyback.
    /// Call only after `can_send_data`/`can_send_update` said yes.
    pub fn spend(&mut self) -> u16 {
        debug_assert!(self.avail > 0);
        self.avail -= 1;
        let n = self.owed.min(u32::from(u16::MAX));
        self.owed -= n;
        self.peer_avail += n;
        n as u16
    }

    /// Gives back credits `spend` took when the send could not be posted.
    pub fn unspend(&mut self, returned: u16) {
        self.avail += 1;
        self.owed += u32::from(returned);
        self.peer_avail = self.peer_avail.saturating_sub(u32::from(returned));
    }

    /// A message from the peer arrived: it spent one of its credits. None
    /// left is a protocol violation (see the module docs).
    pub fn arrived(&mut self) -> Result<(), String> {
        match self.peer_avail.checked_sub(1) {
            Some(n) => {
                self.peer_avail = n;
                Ok(())
            }
            None => Err(format!(
                "peer sent a message without a credit ({} owed, {} withheld)",
                self.owed, self.withheld
            )),
        }
    }

    /// Adds credits the peer returned; more than its depth is a protocol violation.
    pub fn grant(&mut self, n: u16) -> Result<(), String> {
        let total = self.avail + u32::from(n);
        if total > self.peer_depth {
            return Err(format!(
                "peer returned {n} credits while {} were available of its depth {}",
                self.avail, self.peer_depth
            ));
        }
        self.avail = total;
        Ok(())
    }

    /// A receive buffer was reposted. `holding_ok` is false when the
    /// connection has too many held messages: the credit is withheld.
    pub fn reposted(&mut self, holding_ok: bool) {
        if holding_ok {
            self.owed += 1;
        } else {
            self.withheld += 1;
        }
    }

    /// A held message was taken by the application: release one withheld credit.
    pub fn release_withheld(&mut self) {
        if self.withheld > 0 {
            self.withheld -= 1;
            self.owed += 1;
        }
    }

    /// Held messages are under the bound again: every withheld credit is
    /// owed now.
    pub fn release_all_withheld(&mut self) {
        self.owed += std::mem::take(&mut self.withheld);
    }

    /// Credits held back now.
    pub fn withheld(&self) -> u32 {
        self.withheld
    }

    /// True if enough credits are owed to send an explicit update.
    pub fn wants_update(&self) -> bool {
        self.owed >= self.threshold
    }

    #[cfg(any(test, feature = "fuzzing"))]
    /// Credits currently owed to the peer.
    pub fn owed(&self) -> u32 {
        self.owed
    }

    #[cfg(any(test, feature = "fuzzing"))]
    /// Messages the peer may still send us, as we count them.
    pub fn peer_available(&self) -> u32 {
        self.peer_avail
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_keeps_one_credit_for_updates() {
        let mut c = Credits::new(4, 4);
        let mut sent = 0;
        while c.can_send_data() {
            c.spend();
            sent += 1;
        }
        assert_eq!(sent, 3);
        assert!(c.can_send_update());
        c.spend();
        assert!(!c.can_send_update());
        c.grant(4).unwrap();
        assert!(c.grant(1).is_err(), "more than the peer's depth is a violation");
    }

    #[test]
    fn all_withheld_credits_come_back_at_once() {
        let mut c = Credits::new(8, 8);
        for _ in 0..5 {
            c.reposted(false);
        }
        assert_eq!((c.withheld(), c.owed()), (5, 0));
        c.release_withheld();
        assert_eq!((c.withheld(), c.owed()), (4, 1));
        c.release_all_withheld();
        assert_eq!((c.withheld(), c.owed()), (0, 5));
    }

    #[test]
    fn owed_credits_piggyback_and_trigger_updates() {
        let mut c = Credits::new(8, 8);
        for _ in 0..3 {
            c.reposted(true);
        }
        assert!(!c.wants_update());
        c.reposted(true);
        assert!(c.wants_update(), "threshold is half the depth");
        assert_eq!(c.spend(), 4);
        assert_eq!(c.owed(), 0);
        c.unspend(4);
        assert_eq!((c.available(), c.owed()), (8, 4));
    }

    #[test]
    fn withheld_credits_are_released_one_by_one() {
        let mut c = Credits::new(8, 8);
        c.reposted(false);
        c.reposted(false);
        assert_eq!(c.owed(), 0);
        c.release_withheld();
        assert_eq!(c.owed(), 1);
        c.release_withheld();
        c.release_withheld();
        assert_eq!(c.owed(), 2);
    }

    #[test]
    fn a_message_beyond_the_credits_given_is_a_violation() {
        let mut c = Credits::new(4, 4);
        for _ in 0..4 {
            c.arrived().unwrap();
            c.reposted(true);
        }
        assert!(c.arrived().is_err(), "the peer had no credit left");
        assert_eq!((c.peer_available(), c.owed()), (0, 4));
        // Returning credits gives the peer room again, exactly that much.
        assert_eq!(c.spend(), 4);
        assert_eq!((c.peer_available(), c.owed()), (4, 0));
        for _ in 0..4 {
            c.arrived().unwrap();
        }
        assert!(c.arrived().is_err());
        // Withheld credits are not the peer's to spend.
        let mut w = Credits::new(4, 4);
        for _ in 0..4 {
            w.arrived().unwrap();
            w.reposted(false);
        }
        w.spend();
        assert!(w.arrived().is_err(), "withheld credits were never given");
        w.release_withheld();
        w.spend();
        w.arrived().expect("a released credit was returned");
        // A send that could not be posted returns nothing.
        let mut u = Credits::new(4, 4);
        u.arrived().unwrap();
        u.reposted(true);
        let n = u.spend();
        u.unspend(n);
        for _ in 0..3 {
            u.arrived().unwrap();
        }
        assert!(u.arrived().is_err(), "the unposted send's credit never left");
    }

    #[test]
    fn the_peers_depth_arriving_late_keeps_what_is_owed() {
        // Active side: its peer's depth is known only at establishment.
        let mut c = Credits::new(0, 8);
        assert!(!c.can_send_update());
        // Two messages arrived before the established event was read.
        for _ in 0..2 {
            c.arrived().unwrap();
            c.reposted(true);
        }
        c.peer_ready(8);
        assert_eq!((c.available(), c.owed()), (8, 2), "owed credits survive");
        assert_eq!(c.spend(), 2);
        for _ in 0..8 {
            c.arrived().unwrap();
        }
        assert!(c.arrived().is_err());
    }

    /// Two sides exchanging messages in lock-step with random patterns never
    /// end up both unable to send while credits are owed.
    #[test]
    fn no_deadlock_in_a_simulated_exchange() {
        let depth = 6;
        let (mut a, mut b) = (Credits::new(depth, depth), Credits::new(depth, depth));
        // In flight: (credits carried) per direction.
        let (mut a_to_b, mut b_to_a): (Vec<u16>, Vec<u16>) = (Vec::new(), Vec::new());
        let mut seed = 12345u64;
        for _ in 0..10_000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            match seed >> 62 {
                0 if a.can_send_data() => a_to_b.push(a.spend()),
                1 if b.can_send_data() => b_to_a.push(b.spend()),
                2 if !a_to_b.is_empty() => {
                    let n = a_to_b.remove(0);
                    b.arrived().unwrap();
                    b.grant(n).unwrap();
                    b.reposted(true);
                    if b.wants_update() && b.can_send_update() {
                        b_to_a.push(b.spend());
                    }
                }
                _ if !b_to_a.is_empty() => {
                    let n = b_to_a.remove(0);
                    a.arrived().unwrap();
                    a.grant(n).unwrap();
                    a.reposted(true);
                    if a.wants_update() && a.can_send_update() {
                        a_to_b.push(a.spend());
                    }
                }
                _ => {}
            }
            let quiet = a_to_b.is_empty() && b_to_a.is_empty();
            assert!(
                !quiet || a.can_send_data() || b.can_send_data() || a.wants_update() || b.wants_update(),
                "deadlock: a={a:?} b={b:?}"
            );
        }
    }
}
