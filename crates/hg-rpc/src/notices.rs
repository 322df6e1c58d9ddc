//! Notices the transport refused (its send backlog to the peer full):
//! header-sized messages that must not be lost, because a peer holds
//! memory until it gets them. An origin's release of a pulled spilled
//! output (the target keeps the output exposed until then), and a
//! target's acknowledgement of a spilled one-way request it pulled (the
//! origin keeps the input exposed until then). Kept per peer, in order,
//! and sent again by the engine's `trigger`.
//!
//! Per peer, because the backlog is per peer: a peer that stopped
//! reading must not hold back the notices to any other. A notice waits at
//! most as long as the peer keeps the memory anyway (its TTL, after which
//! it has freed it), and a peer has at most [`MAX_WAITING_PER_PEER`] of
//! them. A retry is due [`RETRY_EVERY`] after the last one, or sooner
//! when the engine's last turn handled completions (the transport moved:
//! a flushed backlog completes its sends), but not sooner than a gap that
//! starts at [`RETRY_FIRST`] and doubles after each pass that sent
//! nothing, up to `RETRY_EVERY`. So a peer that stays stuck costs a few
//! refused sends, then one per peer ten times a second, however busy the
//! engine is with other peers; one that moves again gets its notices
//! within a millisecond. A notice that came back (failed at its
//! completion, see `push_returned`) is not delivered for being accepted
//! again: a pass that sends only such notices counts as one that sent
//! nothing, so one that keeps failing at completion is retried less and
//! less often too, not every millisecond until its TTL; the short gap
//! comes back with a pass that sends a notice that never came back, or
//! as soon as one that came back is delivered (its send completes
//! without error: see `delivered`).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use na_core::fasthash::FastMap;
use na_core::Addr;

use crate::header::Header;

/// Notices one peer may have waiting; past it the peer's TTL frees the
/// memory.
pub(crate) const MAX_WAITING_PER_PEER: usize = 4096;

/// The longest a retry waits (when nothing moves, and the longest gap
/// between retries while the transport moves but the targets stay stuck).
pub(crate) const RETRY_EVERY: Duration = Duration::from_millis(100);

/// The shortest gap between retries, after a pass that sent a notice.
pub(crate) const RETRY_FIRST: Duration = Duration::from_millis(1);

/// The fewest dates of returned notices kept before those past the TTL
/// are dropped (see `UnsentNotices::returned_prune_at`).
const MIN_RETURNED_PRUNE: usize = 1024;

/// A notice to a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Notice {
    /// The origin of call `cookie` pulled its spilled output: the target
    /// may release it.
    Release(u64),
    /// The target pulled a spilled one-way request: this response header
    /// (no payload) lets the origin release the input.
    Ack(Header),
}

/// How long each kind of notice is worth sending again: as long as its
/// peer keeps the memory it frees, after which the peer has freed it
/// anyway. That TTL is the peer's setting and is not on the wire; this
/// engine's own setting of the same TTL stands for it (the engines of a
/// deployment are set alike; both TTLs are 60 s by default).
///
/// Where they are not alike: a peer whose TTL is longer than ours keeps
/// the memory for the difference after we gave up on the notice (not
/// for ever: its TTL ends it, and its bound on such memory, at an
/// origin `set_max_abandoned_bytes`, still holds); one whose TTL is
/// shorter gets notices for memory it freed already, which it ignores.
/// An acknowledgement is dated from the target's first failure to send
/// it, after the pull, while the origin's TTL runs from its send (for a
/// one-way request) or from when its caller gave up: with equal
/// settings the origin's always ends first. (Before, acknowledgements
/// used the outputs' TTL: an origin whose abandoned-input TTL was
/// raised above the target's outputs' TTL held an input that long after
/// the target gave up on its acknowledgement.)
#[derive(Clone, Copy, Debug)]
pub(crate) struct NoticeTtls {
    /// For a release: the outputs' TTL (`Engine::set_spilled_output_ttl`),
    /// for which a target keeps a spilled output.
    pub release: Duration,
    /// For an acknowledgement: the abandoned-input TTL
    /// (`Engine::set_abandoned_input_ttl`), for which an origin keeps the
    /// spilled input of a one-way request.
    pub ack: Duration,
}

impl NoticeTtls {
    /// The TTL of `notice`'s kind.
    pub(crate) fn of(&self, notice: &Notice) -> Duration {
        match notice {
            Notice::Release(_) => self.release,
            Notice::Ack(_) => self.ack,
        }
    }
}

/// The notices waiting, by peer (its address token).
pub(crate) struct UnsentNotices {
    targets: FastMap<u64, Waiting>,
    /// When each notice the transport gave back (failed at its
    /// completion) first failed, by peer token, cookie and whether it is
    /// an acknowledgement: its TTL counts from then, however often it is
    /// sent again (see `push_returned`).
    returned: FastMap<(u64, u64, bool), Instant>,
    /// The size of `returned` at which its dates past the TTL are next
    /// dropped (twice what the last drop left, at least
    /// [`MIN_RETURNED_PRUNE`]): a pass over them per returned notice made
    /// a peer whose notices keep failing cost a scan of every date per
    /// failure.
    returned_prune_at: usize,
    last_try: Instant,
    /// How long after `last_try` a turn that moved may retry.
    gap: Duration,
}

/// One peer's waiting notices, and when each was refused.
pub(crate) struct Waiting {
    pub addr: Addr,
    pub notices: VecDeque<(Notice, Instant)>,
}

impl Default for UnsentNotices {
    fn default() -> Self {
        UnsentNotices {
            targets: FastMap::default(),
            returned: FastMap::default(),
            returned_prune_at: MIN_RETURNED_PRUNE,
            last_try: Instant::now(),
            gap: RETRY_FIRST,
        }
    }
}

impl UnsentNotices {
    /// True if none waits (the check on every `trigger`).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// True if notices to `target` wait: a new one goes behind them.
    pub(crate) fn waits_for(&self, target: &Addr) -> bool {
        self.targets.contains_key(&target.token())
    }

    /// Queues a notice behind `target`'s others; false if it already has
    /// [`MAX_WAITING_PER_PEER`].
    pub(crate) fn push(&mut self, target: &Addr, notice: Notice) -> bool {
        let w = self.targets.entry(target.token()).or_insert_with(|| Waiting {
            addr: target.clone(),
            notices: VecDeque::new(),
        });
        if w.notices.len() >= MAX_WAITING_PER_PEER {
            return false;
        }
        w.notices.push_back((notice, Instant::now()));
        true
    }

    /// Queues a notice the transport gave back (it failed at its
    /// completion, after its send was accepted), dated from its first
    /// failure so that the retries' TTL cut-off ends one that keeps
    /// failing; false (not queued) once its kind's TTL (`ttls`) has
    /// passed since then, or past the cap (then no date is kept for it).
    /// Dates older than their kind's TTL are forgotten, in a pass over
    /// them whenever they have doubled since the last one.
    pub(crate) fn push_returned(&mut self, target: &Addr, notice: Notice, ttls: NoticeTtls) -> bool {
        // Past the cap first: a peer whose queue is full has no date
        // kept for a notice that is not queued either.
        if self
            .targets
            .get(&target.token())
            .is_some_and(|w| w.notices.len() >= MAX_WAITING_PER_PEER)
        {
            return false;
        }
        let now = Instant::now();
        let key = returned_key(target, &notice);
        if self.returned.len() >= self.returned_prune_at {
            self.returned.retain(|&(_, _, ack), first| {
                now.duration_since(*first) <= if ack { ttls.ack } else { ttls.release }
            });
            self.returned_prune_at = (2 * self.returned.len()).max(MIN_RETURNED_PRUNE);
        }
        let first = *self.returned.entry(key).or_insert(now);
        if now.duration_since(first) > ttls.of(&notice) {
            self.returned.remove(&key);
            return false;
        }
        let w = self.targets.entry(target.token()).or_insert_with(|| Waiting {
            addr: target.clone(),
            notices: VecDeque::new(),
        });
        w.notices.push_back((notice, first));
        true
    }

    /// True if `notice` to `target` came back before (failed at its
    /// completion within its TTL): its send being accepted again says
    /// nothing of its delivery, so it does not bring the short gap back.
    pub(crate) fn came_back(&self, target: &Addr, notice: &Notice) -> bool {
        self.returned.contains_key(&returned_key(target, notice))
    }

    /// True if a retry is due after a turn that handled `handled`
    /// completions.
    #[inline]
    pub(crate) fn due(&self, handled: usize) -> bool {
        if self.is_empty() {
            return false;
        }
        let wait = if handled > 0 { self.gap } else { RETRY_EVERY };
        self.last_try.elapsed() >= wait
    }

    /// A retry pass ended; `sent` says whether it sent any notice that
    /// never came back (see [`came_back`](Self::came_back)). One that
    /// sent none doubles the gap before a retry on a turn that moved.
    pub(crate) fn pass_done(&mut self, sent: bool) {
        self.gap = if sent {
            RETRY_FIRST
        } else {
            (self.gap * 2).min(RETRY_EVERY)
        };
    }

    /// A notice that came back before was delivered this time (its send
    /// completed without error): its peer takes notices again, so the
    /// gap before a retry on a turn that moved is the short one again.
    pub(crate) fn delivered(&mut self) {
        self.gap = RETRY_FIRST;
    }

    /// When the next retry is due if nothing moves (for a driver's sleep).
    pub(crate) fn next_try(&self) -> Option<Instant> {
        (!self.is_empty()).then(|| self.last_try + RETRY_EVERY)
    }

    /// Takes every peer's notices for a retry pass (the ones still
    /// refused go back with [`put_back`](Self::put_back)).
    pub(crate) fn take_all(&mut self) -> Vec<Waiting> {
        self.last_try = Instant::now();
        self.targets.drain().map(|(_, w)| w).collect()
    }

    /// Returns a peer's notices that are still refused.
    pub(crate) fn put_back(&mut self, w: Waiting) {
        if !w.notices.is_empty() {
            self.targets.insert(w.addr.token(), w);
        }
    }

    /// Notices waiting, over all peers.
    pub(crate) fn len(&self) -> usize {
        self.targets.values().map(|w| w.notices.len()).sum()
    }

    /// The gap before a retry on a turn that moved (for tests).
    #[cfg(test)]
    pub(crate) fn gap(&self) -> Duration {
        self.gap
    }
}

/// The key of `notice` to `target` among the dates of returned notices:
/// the peer's token, the cookie, and whether it is an acknowledgement.
fn returned_key(target: &Addr, notice: &Notice) -> (u64, u64, bool) {
    match notice {
        Notice::Release(cookie) => (target.token(), *cookie, false),
        Notice::Ack(h) => (target.token(), h.cookie, true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use na_core::PluginId;

    #[test]
    fn per_target_order_cap_and_when_a_retry_is_due() {
        let (a, b) = (
            Addr::new("sm://1-a", PluginId(1), 1, false),
            Addr::new("sm://1-b", PluginId(1), 2, false),
        );
        let mut u = UnsentNotices::default();
        assert!(u.is_empty() && u.next_try().is_none() && !u.due(1));
        for cookie in 0..MAX_WAITING_PER_PEER as u64 {
            assert!(u.push(&a, Notice::Release(cookie)));
        }
        assert!(!u.push(&a, Notice::Release(99_999)), "past the cap");
        assert!(u.push(&b, Notice::Release(7)), "another target has its own cap");
        assert!(u.waits_for(&a) && u.waits_for(&b));
        assert_eq!(u.len(), MAX_WAITING_PER_PEER + 1);
        // Due after a turn that moved something, or RETRY_EVERY after the
        // last try; not right after a try that moved nothing.
        std::thread::sleep(RETRY_FIRST);
        assert!(u.due(1));
        let taken = u.take_all();
        assert!(u.is_empty() && !u.waits_for(&a));
        for w in taken {
            if w.addr.token() == 1 {
                let order: Vec<Notice> = w.notices.iter().map(|c| c.0).take(3).collect();
                assert_eq!(order, [0, 1, 2].map(Notice::Release), "in order");
            }
            u.put_back(w);
        }
        assert!(!u.due(0), "due again at once with nothing moved");
        std::thread::sleep(RETRY_FIRST);
        assert!(u.due(1), "due a millisecond later after a turn that moved");
        let next = u.next_try().unwrap();
        assert!(next > Instant::now() && next <= Instant::now() + RETRY_EVERY);
        // An emptied target is not put back.
        u.take_all();
        u.put_back(Waiting {
            addr: a.clone(),
            notices: VecDeque::new(),
        });
        assert!(u.is_empty());
    }

    /// A returned release is queued dated from its first failure, so a
    /// notice that keeps failing is refused once the TTL has passed since
    /// then (the retries end), however often it came back.
    #[test]
    fn a_returned_release_is_dated_from_its_first_failure() {
        let a = Addr::new("sm://1-a", PluginId(1), 1, false);
        let mut u = UnsentNotices::default();
        // Within the TTL: one no scheduler stall outlasts. Past it: one
        // shorter than a sleep (the TTL is read at each push), so no
        // stall of a loaded box decides either way.
        let ttl = NoticeTtls {
            release: Duration::from_secs(3600),
            ack: Duration::from_secs(3600),
        };
        let short = NoticeTtls {
            release: Duration::from_millis(1),
            ..ttl
        };
        assert!(u.push_returned(&a, Notice::Release(7), ttl));
        let first = u.take_all()[0].notices[0].1;
        assert!(u.push_returned(&a, Notice::Release(7), ttl), "within the TTL");
        assert_eq!(
            u.take_all()[0].notices[0].1,
            first,
            "dated from the first failure"
        );
        assert!(
            u.push_returned(&a, Notice::Release(8), ttl),
            "another call's release"
        );
        u.take_all();
        std::thread::sleep(short.release + Duration::from_millis(5));
        assert!(
            !u.push_returned(&a, Notice::Release(7), short),
            "past the TTL since the first failure"
        );
        assert!(u.is_empty());
    }

    /// A peer whose queue is full gets no date kept for a returned notice
    /// that is not queued either (each took an entry, and every push
    /// scanned them all), and the dates past the TTL go once they have
    /// doubled, not at every push.
    #[test]
    fn returned_notices_past_the_cap_keep_no_date() {
        let a = Addr::new("sm://1-a", PluginId(1), 1, false);
        let mut u = UnsentNotices::default();
        // Long while the dates must stay (the pushes pass the pruning
        // thresholds: a short TTL would let a scheduler stall prune them
        // there), then shorter than a sleep (the TTL is read at each push).
        let long = Duration::from_secs(3600);
        let ttls = NoticeTtls {
            release: long,
            ack: long,
        };
        let short = Duration::from_millis(1);
        for cookie in 0..MAX_WAITING_PER_PEER as u64 {
            assert!(u.push_returned(&a, Notice::Release(cookie), ttls));
        }
        let dates = u.returned.len();
        assert_eq!(dates, MAX_WAITING_PER_PEER);
        for cookie in 0..10_000u64 {
            let cookie = MAX_WAITING_PER_PEER as u64 + cookie;
            assert!(
                !u.push_returned(&a, Notice::Release(cookie), ttls),
                "past the cap"
            );
        }
        assert_eq!(u.returned.len(), dates, "dates kept for notices not queued");
        // Their queue drained (sent), the dates stay until the TTL, then
        // go at the next pass.
        u.take_all();
        std::thread::sleep(short + Duration::from_millis(5));
        let b = Addr::new("sm://1-b", PluginId(1), 2, false);
        let ttls = NoticeTtls {
            release: short,
            ack: short,
        };
        assert!(u.push_returned(&b, Notice::Release(1), ttls));
        assert_eq!(u.returned.len(), 1, "the dates past the TTL stayed");
    }

    /// An acknowledgement's retries end at the acknowledgements' TTL, a
    /// release's at the releases': one kind's TTL does not cut the other
    /// short, nor keep it going.
    #[test]
    fn each_kind_of_returned_notice_has_its_own_ttl() {
        let a = Addr::new("sm://1-a", PluginId(1), 1, false);
        let ack = Notice::Ack(crate::header::Header {
            flags: crate::header::FLAG_RESPONSE | crate::header::FLAG_ONE_WAY,
            status: crate::header::Status::Ok,
            rpc_id: 1,
            cookie: 7,
            payload_len: 0,
            checksum: 0,
        });
        let short = Duration::from_millis(30);
        let long = Duration::from_secs(3600);
        let mut u = UnsentNotices::default();
        let acks_long = NoticeTtls {
            release: short,
            ack: long,
        };
        assert!(u.push_returned(&a, ack, acks_long));
        assert!(u.push_returned(&a, Notice::Release(7), acks_long));
        u.take_all();
        std::thread::sleep(short + Duration::from_millis(5));
        assert!(
            !u.push_returned(&a, Notice::Release(7), acks_long),
            "the release is past its TTL"
        );
        assert!(
            u.push_returned(&a, ack, acks_long),
            "the ack is past the releases' TTL only"
        );
        u.take_all();
        let acks_short = NoticeTtls {
            release: long,
            ack: short,
        };
        assert!(!u.push_returned(&a, ack, acks_short), "the ack is past its TTL");
    }

    /// A stuck target is retried less and less often while other traffic
    /// moves (not on every busy turn), and a pass that sends brings the
    /// short gap back.
    #[test]
    fn the_gap_between_retries_doubles_while_nothing_is_sent() {
        let a = Addr::new("sm://1-a", PluginId(1), 1, false);
        let mut u = UnsentNotices::default();
        assert!(u.push(&a, Notice::Release(1)));
        let mut gaps = Vec::new();
        for _ in 0..9 {
            gaps.push(u.gap);
            u.pass_done(false);
        }
        let ms: Vec<u128> = gaps.iter().map(|g| g.as_millis()).collect();
        assert_eq!(ms, [1, 2, 4, 8, 16, 32, 64, 100, 100]);
        // Just past a try, with the gap at its longest: a turn that moved
        // is not enough.
        u.take_all().into_iter().for_each(|w| u.put_back(w));
        std::thread::sleep(RETRY_FIRST * 5);
        assert!(!u.due(1), "retried 5 ms after a refused pass, gap 100 ms");
        u.pass_done(true);
        assert!(u.due(1), "a pass that sent: the short gap again");
    }
}
