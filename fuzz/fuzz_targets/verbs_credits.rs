//! Fuzzes na-verbs' flow control (`credits.rs`, `held.rs`) as the plugin
//! drives it (`progress.rs`, `msg.rs`, `conn.rs`), with no device: a
//! process A with two connections, to processes B0 and B1, each end with
//! its own depth (`DEPTH_RANGE`) and each process with its own held
//! bounds. An arbitrary sequence of operations: queue a message, deliver
//! the next one in flight (held or matched at once; or several before the
//! sends they allow, as one batch of completions), take a held message,
//! drop a dead connection's, a send that could not be posted (`spend`
//! then `unspend`), a late establishment (`peer_ready`), a connection
//! killed, and a message of a peer that ignores its credits, with any
//! credit field.
//!
//! After every operation, for each live end: no more credits than the
//! peer's depth; what the peer may send, what we owe and what we withhold
//! add up to our depth; between two honest ends, what one counts the
//! other may send is what the other has plus what is in flight; an
//! honest peer is never a protocol violation; the held total is the sum
//! of the held messages. At the end, once every held message is taken
//! and every message delivered, no credit is withheld and nothing stays
//! queued (no deadlock, no credit lost for good), and both ends of each
//! honest connection can send data.
#![no_main]

use std::collections::VecDeque;

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use na_verbs::fuzzing::{release_for_total, Credits, HeldBounds, HeldTotal};
use na_verbs::wire::DEPTH_RANGE;

/// Ends: A's to B0, A's to B1, B0's, B1's.
const ENDS: usize = 4;
/// Each end's peer end.
const PEER: [usize; ENDS] = [2, 3, 0, 1];
/// Each end's process: A, A, B0, B1.
const PROC: [usize; ENDS] = [0, 0, 1, 2];
/// How many steps the final settling may take before it is a livelock.
const SETTLE_STEPS: usize = 200_000;

/// A message in flight: the credits it carries, and whether it is data
/// (held, possibly) or a credit update (never held).
#[derive(Clone, Copy, Debug)]
struct Msg {
    credits: u16,
    data: bool,
}

#[derive(Debug)]
struct End {
    c: Credits,
    own_depth: u32,
    peer_depth: u32,
    /// Messages of this connection held now.
    held: u32,
    /// Data messages queued (sent once credits allow).
    backlog: u32,
    /// `peer_ready` still to come (the active side of a connection
    /// before its established event).
    pending_ready: bool,
    dead: bool,
}

#[derive(Debug)]
struct Proc {
    total: HeldTotal,
    b: HeldBounds,
    /// Held messages of connections that are gone.
    dead_held: usize,
}

#[derive(Debug)]
struct World {
    ends: Vec<End>,
    procs: Vec<Proc>,
    /// Messages in flight to each end, oldest first.
    inbox: Vec<VecDeque<Msg>>,
    /// The pair of end `e` took a message that ignored its credits: the
    /// two ends' counts need not agree any more, and the honest one may
    /// find the other in violation.
    tainted: [bool; 2],
}

fn pair(e: usize) -> usize {
    e % 2
}

fn depth(u: &mut Unstructured<'_>) -> Result<u32> {
    Ok(u32::from(if u.ratio(7, 8)? {
        u.int_in_range(DEPTH_RANGE.0..=DEPTH_RANGE.0 + 8)?
    } else {
        u.int_in_range(DEPTH_RANGE.0..=DEPTH_RANGE.1)?
    }))
}

impl World {
    fn new(u: &mut Unstructured<'_>) -> Result<World> {
        let own = [depth(u)?, depth(u)?, depth(u)?];
        let mut procs = Vec::new();
        for &d in &own {
            // As `VerbsConfig::validate` allows: `max_held` at least 1,
            // `max_held_total` at least the receive depth.
            let per_conn = if u.ratio(7, 8)? {
                u.int_in_range(1..=6)?
            } else {
                u.int_in_range(1..=u32::MAX)?
            };
            let total = d as usize + usize::from(u.int_in_range(0u8..=8)?);
            procs.push(Proc {
                total: HeldTotal::default(),
                b: HeldBounds { per_conn, total },
                dead_held: 0,
            });
        }
        let mut ends = Vec::new();
        let own_of = |e: usize| own[PROC[e]];
        let mut active = [false; ENDS];
        for (p, &peer) in PEER.iter().enumerate().take(2) {
            // Which end connected (and learns its peer's depth late).
            let a = if u.arbitrary()? { p } else { peer };
            active[a] = true;
        }
        for e in 0..ENDS {
            let (own_depth, peer_depth) = (own_of(e), own_of(PEER[e]));
            // The active side starts with no credits (`Conn::new`); the
            // passive one with the depth its peer's hello gave (`accept`).
            let c = if active[e] {
                Credits::new(0, own_depth)
            } else {
                Credits::new(peer_depth, own_depth)
            };
            ends.push(End {
                c,
                own_depth,
                peer_depth,
                held: 0,
                backlog: 0,
                pending_ready: active[e],
                dead: false,
            });
        }
        Ok(World {
            ends,
            procs,
            inbox: (0..ENDS).map(|_| VecDeque::new()).collect(),
            tainted: [false; 2],
        })
    }

    /// `drain_msgs`: queued data while credits last (one kept for
    /// updates), then an update if one is due.
    fn drain(&mut self, e: usize) {
        let end = &mut self.ends[e];
        if end.dead {
            return;
        }
        while end.backlog > 0 && end.c.can_send_data() {
            let credits = end.c.spend();
            end.backlog -= 1;
            self.inbox[PEER[e]].push_back(Msg { credits, data: true });
        }
        if end.c.wants_update() && end.c.can_send_update() {
            let credits = end.c.spend();
            self.inbox[PEER[e]].push_back(Msg { credits, data: false });
        }
    }

    /// `release_total_withheld`.
    fn release_total(&mut self, p: usize) {
        let b = self.procs[p].b;
        if !self.procs[p].total.release_due(b) {
            return;
        }
        let mut released = Vec::new();
        for e in (0..ENDS).filter(|&e| PROC[e] == p) {
            let end = &mut self.ends[e];
            if !end.dead && release_for_total(end.held, &mut end.c, b) {
                released.push(e);
            }
        }
        for e in released {
            self.drain(e);
        }
    }

    /// The connection of end `e` is gone: both ends; their held
    /// messages stay held (as a dead connection's), what is in flight
    /// may still arrive at a dead end.
    fn kill(&mut self, e: usize) {
        for x in [e, PEER[e]] {
            let end = &mut self.ends[x];
            if !end.dead {
                end.dead = true;
                self.procs[PROC[x]].dead_held += end.held as usize;
                end.held = 0;
            }
        }
    }

    /// `on_recv_wc`, then `drain_msgs`: the next message in flight to
    /// `e` arrives; `hold`: no receive was posted for it (data only).
    fn deliver(&mut self, e: usize, hold: bool) {
        self.receive(e, hold);
        self.drain(e);
    }

    /// `handle_wcs` with several completions of `e`: the next `n`
    /// messages arrive (the `hold` bit of each from `holds`), and only
    /// then do queued messages and an update go out.
    fn deliver_batch(&mut self, e: usize, n: u8, holds: u8) {
        for i in 0..n {
            self.receive(e, holds >> i & 1 == 1);
        }
        self.drain(e);
    }

    /// `on_recv_wc`: the next message in flight to `e` arrives.
    fn receive(&mut self, e: usize, hold: bool) {
        let Some(m) = self.inbox[e].pop_front() else {
            return;
        };
        let p = PROC[e];
        let b = self.procs[p].b;
        if self.ends[e].dead {
            // Delivered after the death: held without a repost, or gone.
            if m.data && hold {
                self.procs[p].total.held(b);
                self.procs[p].dead_held += 1;
            }
            return;
        }
        let honest = !self.tainted[pair(e)];
        let end = &mut self.ends[e];
        let checked = end.c.arrived().and_then(|()| end.c.grant(m.credits));
        if let Err(why) = checked {
            assert!(!honest, "an honest peer in violation: {why}\n{self:?}");
            return self.kill(e);
        }
        if m.data && hold {
            self.procs[p].total.held(b);
            end.held += 1;
        }
        self.procs[p].total.reposted(end.held, &mut end.c, b);
    }

    /// `deliver_held`: one held message of `e`'s connection (or, with
    /// `e` dead, one of a dead connection of its process) is taken.
    fn take(&mut self, e: usize) {
        let p = PROC[e];
        let b = self.procs[p].b;
        let end = &mut self.ends[e];
        if !end.dead && end.held > 0 {
            self.procs[p].total.taken(Some((&mut end.held, &mut end.c)), b);
            self.drain(e);
        } else if self.procs[p].dead_held > 0 {
            self.procs[p].dead_held -= 1;
            self.procs[p].total.taken(None, b);
        } else {
            return;
        }
        self.release_total(p);
    }

    /// `sweep_dead_held`: up to `n` held messages of dead connections
    /// are dropped.
    fn drop_dead(&mut self, p: usize, n: usize) {
        let n = n.min(self.procs[p].dead_held);
        self.procs[p].dead_held -= n;
        self.procs[p].total.dropped(n);
        self.release_total(p);
    }

    /// `post_msg` whose post failed: the credits spent come back as they were.
    fn failed_post(&mut self, e: usize, update: bool) {
        let end = &mut self.ends[e];
        let can = if update {
            end.c.can_send_update()
        } else {
            end.c.can_send_data()
        };
        if end.dead || !can {
            return;
        }
        let before = end.c.clone();
        let n = end.c.spend();
        assert!(
            u32::from(n) <= before.owed(),
            "spent more owed credits than were owed"
        );
        end.c.unspend(n);
        assert_eq!(end.c, before, "unspend did not undo spend");
    }

    /// `on_established` of the active side: the peer's depth is known.
    fn establish(&mut self, e: usize) {
        let end = &mut self.ends[e];
        if end.pending_ready && !end.dead {
            end.pending_ready = false;
            end.c.peer_ready(end.peer_depth);
            self.drain(e);
        }
    }

    /// A message arrives at `e` from a peer that ignores its credits,
    /// carrying any credit field.
    fn forge(&mut self, e: usize, credits: u16, data: bool) {
        if self.ends[e].dead {
            return;
        }
        self.tainted[pair(e)] = true;
        self.inbox[e].push_front(Msg { credits, data });
        self.deliver(e, data);
    }

    fn check(&self) {
        for (e, end) in self.ends.iter().enumerate() {
            if end.dead {
                continue;
            }
            let c = &end.c;
            assert!(
                c.available() <= end.peer_depth,
                "end {e}: over the peer's depth: {end:?}"
            );
            assert_eq!(
                u64::from(c.peer_available()) + u64::from(c.owed()) + u64::from(c.withheld()),
                u64::from(end.own_depth),
                "end {e}: the peer's credits, owed and withheld are not our depth: {end:?}"
            );
            let peer = &self.ends[PEER[e]];
            if self.tainted[pair(e)] || peer.dead || peer.pending_ready {
                continue;
            }
            // What `e` counts its peer may send: what the peer has, its
            // messages in flight to `e`, and the credits in flight to it.
            let to_e = self.inbox[e].len() as u64;
            let to_peer: u64 = self.inbox[PEER[e]].iter().map(|m| u64::from(m.credits)).sum();
            assert_eq!(
                u64::from(c.peer_available()),
                u64::from(peer.c.available()) + to_e + to_peer,
                "end {e}: its count of the peer's credits is off\n{self:?}"
            );
        }
        for (p, proc) in self.procs.iter().enumerate() {
            let live: usize = (0..ENDS)
                .filter(|&e| PROC[e] == p && !self.ends[e].dead)
                .map(|e| self.ends[e].held as usize)
                .sum();
            assert_eq!(
                proc.total.count(),
                live + proc.dead_held,
                "process {p}: held total"
            );
        }
    }

    /// Everything held is taken and everything in flight delivered (as
    /// matched at once), until nothing moves.
    fn settle(&mut self) {
        for e in 0..ENDS {
            self.establish(e);
        }
        let mut steps = 0;
        loop {
            let mut moved = false;
            for (e, &p) in PROC.iter().enumerate() {
                while self.ends[e].held > 0 || self.procs[p].dead_held > 0 {
                    self.take(e);
                    moved = true;
                    steps += 1;
                }
                if !self.inbox[e].is_empty() {
                    self.deliver(e, false);
                    moved = true;
                    steps += 1;
                }
                self.check();
            }
            assert!(
                steps < SETTLE_STEPS,
                "no quiescence after {steps} steps\n{self:?}"
            );
            if !moved {
                break;
            }
        }
        for (e, end) in self.ends.iter().enumerate() {
            if end.dead {
                continue;
            }
            assert_eq!(
                end.c.withheld(),
                0,
                "end {e}: credits withheld for good\n{self:?}"
            );
            assert_eq!(
                end.backlog, 0,
                "end {e}: messages queued for good (deadlock)\n{self:?}"
            );
            if !self.tainted[pair(e)] {
                assert!(
                    end.c.can_send_data(),
                    "end {e}: cannot send data at rest\n{self:?}"
                );
            }
        }
    }
}

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let mut w = World::new(u)?;
    let r = (|| -> Result<()> {
        for _ in 0..512 {
            if u.is_empty() {
                break;
            }
            let op: u8 = u.arbitrary()?;
            let e = usize::from(op >> 5) % ENDS;
            match op & 7 {
                0 | 1 => {
                    w.ends[e].backlog += u32::from(u.int_in_range(1u8..=4)?);
                    w.drain(e);
                }
                4 => w.take(e),
                5 => match op >> 3 & 3 {
                    0 => w.drop_dead(PROC[e], usize::from(u.int_in_range(1u8..=4)?)),
                    1 => w.failed_post(e, u.arbitrary()?),
                    2 => w.establish(e),
                    _ => w.kill(e),
                },
                6 if op >> 3 & 3 == 0 => w.forge(e, u.arbitrary()?, u.arbitrary()?),
                6 => w.deliver_batch(e, u.int_in_range(2..=8)?, u.arbitrary()?),
                _ => w.deliver(e, u.arbitrary()?),
            }
            w.check();
        }
        Ok(())
    })();
    // Out of input ends the operations, not the run.
    let _ = r;
    w.settle();
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
