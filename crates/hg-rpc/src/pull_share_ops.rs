//! Each origin's share of the target's pull budget: the spilled inputs
//! one origin has this target pull and hold at once are bounded apart from
//! the budget itself ([`Engine::set_max_pull_bytes_per_peer`]), so that one
//! greedy origin (many large-input calls to slow async handlers, whose
//! pulled inputs count until they are answered) cannot take the whole
//! budget and have every other origin's spilled request answered busy.
//! An origin is a process where the transport names it (see
//! [`Origin`]): one process's many connections share one share.
//!
//! Our own calls' outputs are pulled within the same budget, and others'
//! inputs may fill it (several processes, or a share set to the whole
//! budget); so those outputs also have a floor
//! ([`Engine::set_output_pull_floor`]): while the outputs being pulled
//! hold less than it, one more is pulled however much inputs hold. A
//! floor rather than a reserve cut out of the inputs' budget: every bound
//! on inputs stays as set (a target sized for N inputs still takes N, and
//! the largest input it takes is still the budget), and what it costs,
//! pulls over the budget by at most the floor, is paid only while our own
//! calls, which this engine chose to make, have outputs to pull.

use na_core::Addr;

use super::Engine;
use crate::codec::Codec;
use crate::origin::Origin;

impl<C: Codec> Engine<C> {
    /// Who `src`'s per-origin bounds count (its share here, its deferred
    /// requests, its exposed outputs): its process where the transport
    /// names it, else the address (see [`Origin`]). A virtual call and a
    /// table lookup, on the spill and deferred paths only.
    #[inline(never)]
    pub(super) fn origin_of(&self, src: &Addr) -> Origin {
        Origin::of(self.ep.plugin(self.plugin).ok(), src)
    }

    /// The floor of our own calls' output pulls (see
    /// [`Engine::set_output_pull_floor`]): as set, else a quarter of the
    /// pull budget; never above the budget.
    pub(super) fn output_pull_floor(&self) -> u64 {
        self.output_pull_floor
            .unwrap_or(self.max_pull_bytes / 4)
            .min(self.max_pull_bytes)
    }

    /// Whether an output of `len` bytes may be pulled although the budget
    /// has no room: the outputs being pulled stay within the floor.
    pub(super) fn output_within_floor(&self, len: u64) -> bool {
        self.output_pull_bytes.saturating_add(len) <= self.output_pull_floor()
    }

    /// The most bytes of spilled inputs one origin may hold (see
    /// [`Engine::set_max_pull_bytes_per_peer`]): as set, else half the
    /// pull budget.
    pub(super) fn pull_share(&self) -> u64 {
        self.max_pull_per_peer.unwrap_or(self.max_pull_bytes / 2)
    }

    /// Bytes of spilled inputs origin `peer` holds now: pulls in flight
    /// and the inputs its requests for async handlers hold.
    fn input_bytes_of(&self, peer: Origin) -> u64 {
        let pulling = self.input_pulls_by_peer.get(&peer).copied().unwrap_or(0);
        pulling.saturating_add(self.deferred_ledger.bytes_of(peer))
    }

    /// Checks that origin `peer` may hold `len` more bytes of spilled
    /// inputs: within its share, or it holds none (one input that fits the
    /// budget is never refused for the share, so a share below the largest
    /// input refuses none forever). Why not, for a busy answer.
    pub(super) fn admit_input_pull(&self, peer: Origin, len: u64) -> Result<(), String> {
        let held = self.input_bytes_of(peer);
        let share = self.pull_share();
        if held == 0 || held.saturating_add(len) <= share {
            return Ok(());
        }
        Err(format!(
            "input: {len} more bytes would exceed this caller's share of the spilled data this engine \
             pulls and holds at once ({held} held, at most {share} per caller, {} in all); try again later",
            self.max_pull_bytes
        ))
    }

    /// Counts a pull of `len` bytes of origin `peer`'s input in its share.
    pub(super) fn charge_input_pull(&mut self, peer: Origin, len: u64) {
        *self.input_pulls_by_peer.entry(peer).or_insert(0) += len;
    }

    /// Gives back what [`charge_input_pull`](Self::charge_input_pull)
    /// counted, once the pull ended (the input then counts in the share
    /// through its request's `PullCharge`, if an async handler holds it).
    pub(super) fn uncharge_input_pull(&mut self, peer: Origin, len: u64) {
        if let Some(n) = self.input_pulls_by_peer.get_mut(&peer) {
            *n = n.saturating_sub(len);
            if *n == 0 {
                self.input_pulls_by_peer.remove(&peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use na_core::PeerProcess;

    use crate::engine::test_support::sm_pair;
    use crate::origin::Origin;
    use crate::{Engine, Rpc, RpcError};

    /// This process's start time (field 22 of `/proc/self/stat`, counted
    /// from the last `)`: the command name may hold spaces), read here
    /// apart from na-sm's own reading.
    fn own_start_time() -> u64 {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
        let at = stat.rfind(')').unwrap();
        stat[at + 1..]
            .split_ascii_whitespace()
            .nth(19)
            .unwrap()
            .parse()
            .unwrap()
    }

    struct Slow;
    impl Rpc for Slow {
        const NAME: &'static str = "test.slow";
        type Input = u32;
        type Output = u32;
    }

    /// Two clients of one process (two sm instances, two connections, two
    /// addresses at the target) are one origin: the target keys both by
    /// the process the transport names (this one: our pid and start
    /// time), so one origin's bound of deferred requests (1 here) refuses
    /// the second client's request while the first's waits; per address,
    /// as before, it was let in. Without a plugin to ask, an address is
    /// its own origin.
    #[test]
    fn clients_of_one_process_are_one_origin() {
        let (dir, mut srv, mut c1, s1) = sm_pair("origin-process");
        let cfg = na_sm::SmConfig::default().with_dir(&dir);
        let mut c2 = Engine::shared_memory(cfg, na_core::ProgressMode::Busy).unwrap();
        let s2 = c2.endpoint().lookup(srv.self_addr().uri()).unwrap();
        srv.register_deferred::<Slow>().unwrap();
        srv.set_max_deferred(1, 10);
        let first = c1.forward::<Slow>(&s1, &1).unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        let req = loop {
            assert!(Instant::now() < end, "the first request never came");
            c1.progress_now().unwrap();
            srv.progress_now().unwrap();
            srv.trigger().unwrap();
            if let Some(r) = srv.take_deferred() {
                break r;
            }
        };
        let o1 = srv.origin_of(&req.src);
        assert_eq!(
            o1,
            Origin::Process(PeerProcess {
                pid: std::process::id(),
                started: own_start_time(),
            })
        );
        assert_eq!(Origin::of(None, &req.src), Origin::Addr(req.src.token()));
        let second = c2.forward::<Slow>(&s2, &2).unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        let answer = loop {
            assert!(Instant::now() < end, "the second request never answered");
            c2.progress_now().unwrap();
            srv.progress_now().unwrap();
            srv.trigger().unwrap();
            c2.trigger().unwrap();
            if let Some(r) = c2.take_response::<Slow>(second) {
                break r;
            }
        };
        match answer {
            Err(RpcError::Busy { reason, .. }) => assert!(reason.contains("from this caller"), "{reason}"),
            other => panic!("the second client of one process was let in: {other:?}"),
        }
        assert_eq!(srv.stats().deferred_refused, 1);
        srv.respond_deferred(req, Ok(postcard::to_allocvec(&7u32).unwrap()));
        let end = Instant::now() + Duration::from_secs(10);
        while c1.take_response::<Slow>(first).is_none() {
            assert!(Instant::now() < end, "the first request never answered");
            c1.progress_now().unwrap();
            c1.trigger().unwrap();
            srv.progress_now().unwrap();
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    struct Big;
    impl Rpc for Big {
        const NAME: &'static str = "test.big";
        type Input = Vec<u8>;
        type Output = u32;
    }

    /// A spilled input pulled for a deferred handler is charged, once
    /// pulled, to the origin its pull was charged to (the sender's
    /// process), even if the sender's connection is gone by the time the
    /// pull's end is handled (the transport then names no process for the
    /// address). Before, the charge asked the transport again at that
    /// point and went to the bare address: the process's share no longer
    /// counted the input its request holds (bytes_of(process) 0).
    #[test]
    fn a_deferred_input_stays_charged_to_its_process_when_its_connection_goes_first() {
        let (dir, mut srv, mut c, s) = sm_pair("origin-kept");
        srv.register_deferred::<Big>().unwrap();
        let input = vec![5u8; 1 << 20];
        c.forward::<Big>(&s, &input).unwrap();
        // Until the target started the pull (the transport moves the
        // bytes at once; the pull's end is handled on a later turn).
        let end = Instant::now() + Duration::from_secs(10);
        while srv.pulls.is_empty() {
            assert!(Instant::now() < end, "the pull never started: {:?}", srv.stats());
            c.progress_now().unwrap();
            srv.progress_now().unwrap();
            srv.trigger().unwrap();
        }
        let origin = srv
            .pulls
            .values()
            .next()
            .and_then(|p| p.origin)
            .expect("an input's pull");
        let own = Origin::Process(PeerProcess {
            pid: std::process::id(),
            started: own_start_time(),
        });
        assert_eq!(origin, own, "charged to this process");
        // The sender's connection goes; the target sees it go (its
        // harvest) before it handles the pull's end.
        drop(c);
        let end = Instant::now() + Duration::from_secs(10);
        let req = loop {
            assert!(Instant::now() < end, "the request never came: {:?}", srv.stats());
            let _ = srv.try_wait().unwrap();
            srv.progress_now().unwrap();
            srv.trigger().unwrap();
            if let Some(r) = srv.take_deferred() {
                break r;
            }
        };
        assert_eq!(
            srv.origin_of(&req.src),
            Origin::Addr(req.src.token()),
            "the connection is gone"
        );
        let len = srv.deferred_ledger.bytes_of(own);
        assert!(
            len >= input.len() as u64,
            "the process's share lost the input its request holds: {len} bytes counted"
        );
        drop(req);
        assert_eq!(
            srv.deferred_ledger.bytes_of(own),
            0,
            "given back with the request"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
