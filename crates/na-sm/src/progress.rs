//! Progress: socket and eventfd events, ring polling and sleeping
//! (`try_wait`). Sends and their backlogs are in `send_ops`, cancel and
//! peer failure in `peer_failure`.
//!
//! The fast path of `progress` makes no system call: it polls the rings and
//! retries backlogs. The internal epoll set (listener, connection sockets,
//! eventfds) is polled by `try_wait` before it arms the wake-ups, while a
//! handshake is in flight, every [`EVENT_POLL_INTERVAL`] calls or
//! [`EVENT_POLL_MAX_GAP`] (looked at every [`EVENT_CLOCK_INTERVAL`]
//! calls), whichever comes first, and after a wake-up that brought no
//! message (one that brought a message leaves the
//! events to the next `try_wait`).

use std::time::Duration;

use na_core::hint::cold_path;
use na_core::{NaError, PluginStats, Result};

use crate::channel::{Channel, MsgKind, RxCursor, RING_SLOTS};
use crate::conn::Role;
use crate::connect::AcceptPause;
use crate::peer_failure::{wake_failure, Failure};
use crate::plugin::{
    SmPlugin, SpinFound, LISTENER_TOKEN, PIDFD_BIT, POOL_TOKEN, SIDE_BACKLOG, SIDE_RMA_POOL, TIMER_TOKEN,
    WAKE_BIT,
};
use crate::sys::wake::PeerWake;

/// Harvests [`SmPlugin::harvest_primed`] makes at most before it sleeps
/// or declares the plugin idle.
const MAX_PRIMED_HARVESTS: usize = 4;

/// Full batches of events one call handles at most (see `wait_events`).
pub(crate) const MAX_EVENT_ROUNDS: usize = 4;

/// Progress calls between two non-blocking polls of the socket events when
/// nothing asked for one (busy mode).
pub const EVENT_POLL_INTERVAL: u32 = 1024;

/// Progress calls between two looks at the clock for
/// [`EVENT_POLL_MAX_GAP`] (a power of two, dividing
/// [`EVENT_POLL_INTERVAL`]).
const EVENT_CLOCK_INTERVAL: u32 = 64;

/// The longest time the socket events (a peer's hang-up, a new
/// connection) wait for a poll while progress calls keep coming, whatever
/// their rate: checked every 64 calls. A count of
/// calls alone is a time only while calls are quick: a caller that calls
/// now and then, or one whose every call gives up the core (transfers
/// with the RMA threads, on a loaded box), left a departed peer's
/// transfers unfailed, and a listener's connections unaccepted, for
/// [`EVENT_POLL_INTERVAL`] calls: ten seconds and more. (While transfers
/// are with the RMA threads, whose spin may give up the core once per
/// call, every call looks.)
pub const EVENT_POLL_MAX_GAP: Duration = Duration::from_millis(10);

impl SmPlugin {
    pub(crate) fn make_progress(&mut self) -> Result<usize> {
        let before = self.completions.len();
        self.tick = self.tick.wrapping_add(1);
        let found = self.spin_found.take().is_some();
        let woken = self.armed;
        self.disarm();
        let events_due = std::mem::take(&mut self.events_owed)
            || self.awaiting_ack > 0
            || !self.pending.is_empty()
            || (self.tick.is_multiple_of(EVENT_CLOCK_INTERVAL) && events_overdue(self.tick, self.events_at));
        if self.accept_pause.is_some() {
            self.maybe_resume_accepts();
        }
        if events_due {
            self.handle_due_events()?;
        }
        // The spin loop just saw an unexpected message arrive: it waits for
        // `take_pulled`, and the other rings are polled by the caller's
        // next progress call (before it spins again). Not scanning them
        // here keeps that scan off the path from request to reply.
        // Otherwise the rings whose head changed are polled (all of them
        // when the socket events were due: a full poll now and then,
        // whatever the heads say), after the rings takes read from were
        // published (see `heads`).
        if !found || events_due {
            self.settle_taken();
            if events_due {
                self.poll_rings();
            } else {
                self.poll_changed_rings();
            }
        }
        // Woken from a sleep: a message is the usual reason, and then the
        // fd events (the wake-up's own edge, or a connection or hang-up
        // that came meanwhile) can wait for the next `try_wait`, which
        // harvests them before it arms. That keeps a system call off the
        // path of the reply. Only a wake-up with no message (none
        // completed, none waiting to be taken in pull mode) polls them now.
        // (With transfer threads the wake-up may be their results'; taken
        // first, they are what it brought.)
        if woken && !events_due && self.completions.len() == before && !self.pull_ready() {
            if self.rma_results_wait() {
                self.take_rma_results();
            }
            if self.completions.len() == before {
                self.poll_events()?;
                self.poll_rings();
            }
        }
        if self.side_work != 0 {
            self.side_turn();
        }
        Ok(self.completions.len() - before)
    }

    /// Work off the busy path (see `SmPlugin::side_work`): the transfer
    /// threads' results, queued sends. Out of line, behind one test of
    /// one byte: with neither (the default) the busy path pays that test
    /// only, as it did for the backlogs alone.
    #[inline(never)]
    fn side_turn(&mut self) {
        if self.side_work & SIDE_RMA_POOL != 0 {
            self.rma_side_turn();
        }
        if self.side_work & SIDE_BACKLOG != 0 {
            self.flush_backlogs();
        }
    }

    /// The transfer threads' turn of [`side_turn`](Self::side_turn): takes
    /// their results; and while transfers are still with them, lets the
    /// pool see the time (whether the spin yields, see
    /// [`rma_pool_turn`](Self::rma_pool_turn)) and owes the socket events
    /// to the next call once [`EVENT_POLL_MAX_GAP`] passed since they were
    /// last read: the clock is read at every call, not every
    /// [`EVENT_CLOCK_INTERVAL`].
    ///
    /// The busy loop's own poll of them comes every
    /// [`EVENT_POLL_INTERVAL`] spin checks or [`EVENT_POLL_MAX_GAP`] (the
    /// clock looked at every [`EVENT_CLOCK_INTERVAL`] checks), but while
    /// the pool is active the spin makes no check: it gives up the core
    /// and returns at once, one progress call per `yield_now`. On a
    /// loaded core each yield may wait a time slice: counted in calls, a
    /// peer that left while its job was stuck in a transfer thread (its
    /// hang-up is what fails its transfers as gone) was seen seconds late.
    #[cold]
    #[inline(never)]
    fn rma_side_turn(&mut self) {
        if self.rma_results_wait() {
            self.take_rma_results();
        }
        let Some(pool) = self.rma_pool.as_mut().filter(|p| !p.ops.is_empty()) else {
            return;
        };
        let now = std::time::Instant::now();
        pool.look(now);
        if now.saturating_duration_since(self.events_at) >= EVENT_POLL_MAX_GAP {
            self.events_owed = true;
        }
    }

    /// A listener paused for the queued-message bound goes on once the
    /// application took some (no event says so); the other pauses end
    /// with a handshake (its events are due) or at the timer.
    #[cold]
    #[inline(never)]
    pub(crate) fn maybe_resume_accepts(&mut self) {
        if self.accept_pause == Some(AcceptPause::Queued)
            && self.held_by_departed() < self.cfg.max_queued_total
        {
            self.resume_accepts();
        }
    }

    /// The socket events' turn (see `make_progress`): handles them and
    /// drops departed peers' messages held too long.
    #[inline(never)]
    fn handle_due_events(&mut self) -> Result<()> {
        self.poll_events()?;
        self.drop_departed_held();
        Ok(())
    }

    /// Drops the expected messages departed peers left that were held
    /// longer than `SmConfig::departed_hold` (also at the timer, so that
    /// an idle process drops them on time and a listener paused for them
    /// goes on).
    pub(crate) fn drop_departed_held(&mut self) {
        let dropped = self.matcher.drop_departed(self.cfg.departed_hold);
        if dropped > 0 {
            tracing::warn!(
                dropped,
                hold = ?self.cfg.departed_hold,
                "sm: dropped expected messages of departed peers that no receive took"
            );
        }
    }

    /// See `Plugin::spin_wait`: watches the head slot of every connection's
    /// receive ring (one load each per check, from the head list) until
    /// one changes or the socket events are due; returns the checks made.
    /// Anything else that progress would do now (queued sends,
    /// completions, a handshake, socket events owed by an earlier call,
    /// taken messages, reads to publish) ends it at once or at the first
    /// check.
    pub(crate) fn spin_for_work(&mut self, max: u32) -> u32 {
        if self.armed
            || self.events_owed
            || self.pull_ready()
            || self.awaiting_ack > 0
            || !self.pending.is_empty()
            || !self.completions.is_empty()
            || (self.side_work != 0 && self.side_ends_spin())
        {
            return 0;
        }
        // No check before the first turn: a head that changed since the
        // progress call before this one (or a ring a take read from, whose
        // entry still watches the old slot) ends the first turn at once.
        let heads = self.heads.current(&mut self.peers);
        for i in 0..max {
            self.tick = self.tick.wrapping_add(1);
            if self.tick.is_multiple_of(EVENT_CLOCK_INTERVAL) && events_overdue(self.tick, self.events_at) {
                self.events_owed = true;
                return i;
            }
            if let Some(e) = heads.iter().find(|e| e.changed()) {
                // Pull mode: an unexpected message waits at that head for
                // `take_pulled`; say so now (see `make_progress`), and
                // name the ring, so that the take goes straight to it
                // instead of looking through every peer's.
                let ring = e.ring;
                if self.pull {
                    if let Some(found) = self.unexpected_at_head(ring) {
                        self.pull_heads = 1;
                        self.pull_last = Some(ring);
                        self.spin_found = Some(found);
                    }
                }
                return i;
            }
            std::hint::spin_loop();
        }
        max
    }

    /// [`spin_for_work`](Self::spin_for_work) with side work (see
    /// `SmPlugin::side_work`): true (spin not at all) if sends are queued
    /// or, with transfer threads, as [`rma_pool_turn`](Self::rma_pool_turn)
    /// says.
    #[cold]
    #[inline(never)]
    fn side_ends_spin(&self) -> bool {
        self.side_work & SIDE_BACKLOG != 0 || (self.side_work & SIDE_RMA_POOL != 0 && self.rma_pool_turn())
    }

    /// [`spin_for_work`](Self::spin_for_work) with transfer threads: true
    /// (spin no more) if their results wait, or if transfers are still
    /// with them and the pool is active, after giving up the core once
    /// (see `RmaPool::owner_yield`: a busy owner that spun on would keep a
    /// transfer thread placed on its core from running). A pool quiet for
    /// a second (its jobs stuck) is spun on as usual but for a yield per
    /// `RMA_QUIET_YIELD_EVERY`: its results wait at most the spin's checks.
    fn rma_pool_turn(&self) -> bool {
        let Some(pool) = &self.rma_pool else {
            return false;
        };
        if pool.has_done() {
            return true;
        }
        !pool.ops.is_empty() && pool.owner_yield()
    }

    /// The unexpected message at the head of ring `ring` (peer slot,
    /// connection), validated, if one waits there.
    #[inline(always)]
    fn unexpected_at_head(&self, ring: (usize, usize)) -> Option<SpinFound> {
        let peer = self.peers.slot(ring.0)?;
        let conn = peer.conns.get(ring.1)?;
        match conn.rx().peek(conn.rx_cur.pos) {
            Ok(Some(slot)) if slot.kind == MsgKind::Unexpected => Some(SpinFound {
                conn: conn.serial,
                pos: conn.rx_cur.pos,
                slot,
            }),
            _ => None,
        }
    }

    /// For each ring a take read from (and only those): moves its head
    /// list entry to the slot it reads next, and tells its sender how far
    /// it read (a poll of every ring does both for all of them).
    fn settle_taken(&mut self) {
        let mut violations = Vec::new();
        let Self {
            peers, heads, stats, ..
        } = self;
        for e in heads.current(peers).iter_mut().filter(|e| e.taken) {
            e.taken = false;
            let ring = e.ring;
            let Some(peer) = peers.slot_mut(ring.0) else {
                cold_path();
                continue;
            };
            let tok = peer.addr.token();
            let Some(conn) = peer.conns.get_mut(ring.1) else {
                cold_path();
                continue;
            };
            // Not `conn.rx()`: the channel borrows only the region, so that
            // the cursor can be updated through it.
            let rx = if conn.role == Role::Connector { 1 } else { 0 };
            let ch = Channel::new(&conn.region, rx);
            if let Some((f, reason)) = publish_read(
                &ch,
                &mut conn.rx_cur,
                conn.peer_wake.as_ref(),
                &mut conn.wake_owed,
                stats,
            ) {
                cold_path();
                violations.push((tok, f, reason));
            }
            e.watch(&ch, conn.rx_cur.pos);
        }
        if !violations.is_empty() {
            cold_path();
            for (tok, f, reason) in violations {
                self.fail_peer(tok, f, &reason);
            }
        }
    }

    #[inline]
    fn disarm(&mut self) {
        if self.armed {
            self.disarm_all();
        }
    }

    /// Lowers every connection's wake-up flags (after a sleep).
    #[inline(never)]
    fn disarm_all(&mut self) {
        self.armed = false;
        for peer in self.peers.iter_mut() {
            for c in peer.conns.iter_mut().filter(|c| c.armed) {
                c.armed = false;
                c.rx().rx_waiting().store(0, std::sync::atomic::Ordering::Relaxed);
                c.tx().tx_waiting().store(0, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    /// Hands back every slot read so far (takes in pull mode leave that to
    /// the next poll), raises the wake-up flags of every connection and
    /// re-checks for work. A sender waiting for room must not wait on a
    /// receiver that sleeps without having said how far it read.
    pub(crate) fn arm(&mut self) -> bool {
        if !self.completions.is_empty() || self.pull_ready() || self.events_owed || self.rma_results_wait() {
            return false;
        }
        let mut violations = Vec::new();
        for peer in self.peers.iter_mut() {
            for c in peer.conns.iter_mut() {
                let rx = if c.role == Role::Connector { 1 } else { 0 };
                let ch = Channel::new(&c.region, rx);
                if let Some((f, reason)) = publish_read(
                    &ch,
                    &mut c.rx_cur,
                    c.peer_wake.as_ref(),
                    &mut c.wake_owed,
                    &mut self.stats,
                ) {
                    cold_path();
                    violations.push((peer.addr.token(), f, reason));
                }
            }
        }
        if !violations.is_empty() {
            for (tok, f, reason) in violations {
                self.fail_peer(tok, f, &reason);
            }
            // Failing a peer is work to report: no sleep now.
            return false;
        }
        self.armed = true;
        self.rings_held = false;
        let max_queued = self.cfg.max_queued_per_peer;
        let over_total = self.connected_over_total();
        for peer in self.peers.iter_mut() {
            let tok = peer.addr.token();
            for c in peer.conns.iter_mut() {
                c.armed = true;
                let rx_pos = c.rx_cur.pos;
                if !c.rx().arm_receiver(rx_pos) {
                    // A message waits; it is work unless the flood bound
                    // holds it back (then only posting a receive, in this
                    // thread, can release it: nothing to wait for).
                    let held = matches!(c.rx().peek(rx_pos), Ok(Some(s))
                        if !(self.pull && s.kind == MsgKind::Unexpected)
                            && (over_total || self.matcher.queued_from(tok) >= max_queued)
                            && self.matcher.would_queue(tok, s.kind == MsgKind::Expected, s.tag));
                    if !held {
                        return false;
                    }
                    self.rings_held = true;
                }
                if !c.arm_backlog() {
                    return false;
                }
            }
        }
        true
    }

    pub(crate) fn poll_events(&mut self) -> Result<()> {
        self.wait_events(Some(Duration::ZERO))
    }

    /// Takes the report epoll makes of a wake-up eventfd added since the
    /// set's last wait (`wake_primed`, see `connect::poll_add_wake`), so
    /// that it neither ends a sleep nor makes our descriptor readable for
    /// nothing. Each harvest may handle a hello that adds another: a few
    /// rounds at most (hellos that keep coming are real events anyway).
    pub(crate) fn harvest_primed(&mut self) -> Result<()> {
        for _ in 0..MAX_PRIMED_HARVESTS {
            if !self.wake_primed {
                break;
            }
            self.poll_events()?;
        }
        Ok(())
    }

    /// Handles the internal epoll set's events, waiting up to `timeout` for
    /// the first (`None`: no limit). At most [`MAX_EVENT_ROUNDS`] full
    /// batches: events that keep coming (peers writing to their wake-up
    /// descriptors in a loop, say) cannot keep one call from returning;
    /// what is left is owed to the next progress call (and [`arm`](Self::arm)
    /// refuses to sleep on it).
    pub(crate) fn wait_events(&mut self, mut timeout: Option<Duration>) -> Result<()> {
        self.events_at = std::time::Instant::now();
        for round in 1.. {
            self.tokens.clear();
            // This wait reports every wake-up eventfd added before it (a
            // full batch leaves the rest to the next round or to the next
            // call: `events_owed`, and `arm` refuses to sleep on that).
            self.wake_primed = false;
            let n = self
                .poll
                .wait(&mut self.tokens, timeout)
                .map_err(|e| NaError::sys("epoll_wait (sm)", e))?;
            if timeout != Some(Duration::ZERO)
                && self
                    .tokens
                    .iter()
                    .any(|t| t & WAKE_BIT != 0 && t & PIDFD_BIT == 0)
            {
                self.wakeups += 1;
            }
            timeout = Some(Duration::ZERO);
            let tokens = std::mem::take(&mut self.tokens);
            for &t in &tokens {
                self.handle_event(t);
            }
            self.tokens = tokens;
            if n < na_core::sys::epoll::WAIT_BATCH {
                break;
            }
            if round == MAX_EVENT_ROUNDS {
                self.events_owed = true;
                break;
            }
        }
        let deadlines = !self.pending.is_empty() || self.awaiting_ack > 0 || self.accept_pause.is_some();
        let fired = std::mem::take(&mut self.timer_fired);
        if deadlines || fired || self.timer.armed().is_some() {
            // (A timer still armed with nothing due is disarmed here, so
            // it does not wake an idle process for nothing.)
            self.sweep_deadlines();
        }
        Ok(())
    }

    fn handle_event(&mut self, token: u64) {
        if token == LISTENER_TOKEN {
            self.accept_ready();
            return;
        }
        if token == POOL_TOKEN {
            // RMA results: taken by the progress call that follows.
            return;
        }
        if token == TIMER_TOKEN {
            // What is due runs in `sweep_deadlines`, after the events
            // (clearing disarms it: remember that it fired).
            self.timer.clear();
            self.timer_fired = true;
            self.owner_woken = false;
            return;
        }
        let serial = token & !(WAKE_BIT | PIDFD_BIT);
        if token & PIDFD_BIT != 0 {
            self.peer_process_exited(serial);
            return;
        }
        if self.pending.contains_key(&serial) {
            self.handle_hello(serial);
            return;
        }
        let Some(tok) = self.peers.by_serial(serial) else {
            return;
        };
        let Some(peer) = self.peers.get_mut(tok) else {
            return;
        };
        let Some(ci) = peer.conns.iter().position(|c| c.serial == serial) else {
            return;
        };
        let conn = &mut peer.conns[ci];
        if token & WAKE_BIT != 0 {
            // Edge-triggered: the event itself was the wake-up; the rings
            // are polled next. An eventfd is not read; a pipe is emptied
            // so that it never fills up.
            if let Err(e) = conn.my_wake.drain() {
                tracing::warn!(error = %na_core::ErrorChain(&e), "draining the sm wake-up pipe");
            }
            return;
        }
        let failure = if conn.role == Role::Connector && conn.peer_wake.is_none() {
            self.handle_ack(tok, ci).err()
        } else {
            let mut b = [0u8; 64];
            // With the descriptors a peer may attach taken in (a plain
            // read would make the kernel close them here: see `closer`).
            match crate::closer::recv_screened(std::os::fd::AsFd::as_fd(&*conn.sock), &mut b) {
                Ok((r, refused)) if r.len == 0 && refused == 0 && r.fds.is_empty() => Some((
                    Failure::Gone,
                    "connection closed (process exited or was killed)".into(),
                )),
                Ok((r, refused)) => Some((
                    Failure::Protocol,
                    format!(
                        "{} unexpected bytes and {} descriptors on its socket",
                        r.len,
                        r.fds.len() + refused
                    ),
                )),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
                Err(e) => Some((Failure::Gone, format!("socket error: {e}"))),
            }
        };
        if let Some((f, reason)) = failure {
            self.fail_peer(tok, f, &reason);
        }
    }

    /// The process at the other end of connection `serial` exited (its
    /// pidfd became readable). Its socket's end-of-file would say so too,
    /// unless another process (a child it forked) holds the socket: then
    /// this is the only sign, and without it the peer's pid, once reused,
    /// would be the target of transfers meant for the peer.
    fn peer_process_exited(&mut self, serial: u64) {
        let Some(tok) = self.peers.by_serial(serial) else {
            return;
        };
        let pid = self.peers.get(tok).map_or(0, |p| p.pid);
        self.fail_peer(tok, Failure::Gone, &format!("process {pid} exited"));
    }

    /// Takes every published message (at most one ring's worth per
    /// connection per call, so a flooding peer cannot starve the caller).
    /// In pull mode a connection's poll stops at an unexpected message: it
    /// waits in the ring for `take_pulled`.
    pub(crate) fn poll_rings(&mut self) {
        self.poll_all_rings_as(None);
    }

    /// [`poll_rings_as`](Self::poll_rings_as) of every ring.
    pub(crate) fn poll_all_rings_as(&mut self, departing: Option<u64>) {
        let mut rings = std::mem::take(&mut self.ring_scratch);
        rings.clear();
        for (idx, peer) in self.peers.iter_slots_mut() {
            rings.extend((0..peer.conns.len()).map(|ci| (idx, ci)));
        }
        self.poll_rings_as(departing, &rings);
        self.ring_scratch = rings;
    }

    /// [`poll_rings`](Self::poll_rings) of the rings whose head changed,
    /// as the head list tells; the others hold nothing new (see `heads`).
    fn poll_changed_rings(&mut self) {
        let heads = self.heads.current(&mut self.peers);
        if !heads.iter().any(|e| e.changed()) {
            // The busy caller's usual case (its peer has not answered yet):
            // what a poll of no ring does, without its set-up. No head
            // holds a message, so none waits to be taken.
            self.forget_pull_heads();
            return;
        }
        let mut rings = std::mem::take(&mut self.ring_scratch);
        rings.clear();
        rings.extend(heads.iter().filter(|e| e.changed()).map(|e| e.ring));
        self.poll_rings_as(None, &rings);
        self.ring_scratch = rings;
    }

    /// Pull mode: no unexpected message is known to wait at any head, and
    /// what the spin loop saw is no longer where the next take looks
    /// first (a poll counts them afresh).
    #[inline]
    fn forget_pull_heads(&mut self) {
        self.pull_heads = 0;
        self.pull_last = None;
        self.spin_found = None;
    }

    /// Polls `rings` ((peer slot, connection) pairs; the unexpected
    /// messages waiting at their heads are counted afresh, so they must
    /// include every ring that may hold one). With `departing` (the token
    /// of a peer going away, and its rings with it), that peer's
    /// unexpected messages of pull mode are copied out to `pulled_late`
    /// instead of waiting in its ring. Other peers' messages stay where
    /// they are.
    fn poll_rings_as(&mut self, departing: Option<u64>, rings: &[(usize, usize)]) {
        // Counted afresh below.
        self.forget_pull_heads();
        let mut violations = Vec::new();
        let Self {
            peers,
            matcher,
            completions,
            ops,
            stats,
            cfg,
            pull,
            pull_heads,
            pull_last,
            pulled_late,
            heads,
            ..
        } = self;
        let (max_queued, max_total) = (cfg.max_queued_per_peer, cfg.max_queued_total);
        // Departed peers' queued messages have a share of their own (see
        // SmPlugin::connected_over_total): counted once, and only if this
        // poll could reach the bound at all (it queues at most a ring per
        // ring polled).
        let departed_queued = if matcher.queued_arrivals + rings.len() * RING_SLOTS >= max_total {
            cold_path();
            crate::plugin::queued_by_departed(matcher, peers)
        } else {
            0
        };
        let connected_bound = max_total.saturating_add(departed_queued);
        let mut head_at = None;
        for &(idx, ci) in rings {
            let Some(peer) = peers.slot_mut(idx) else {
                continue;
            };
            if let Some(conn) = peer.conns.get_mut(ci) {
                let rx = if conn.role == Role::Connector { 1 } else { 0 };
                let ch = Channel::new(&conn.region, rx);
                for _ in 0..RING_SLOTS {
                    let s = match ch.peek(conn.rx_cur.pos) {
                        Ok(None) => break,
                        Ok(Some(s)) => s,
                        Err(e) => {
                            cold_path();
                            violations.push((peer.addr.token(), Failure::Protocol, e.to_string()));
                            break;
                        }
                    };
                    let expected = s.kind == MsgKind::Expected;
                    let tok = peer.addr.token();
                    // Pull mode keeps a departing peer's unexpected messages
                    // for `take_unexpected`; everything else is delivered.
                    let kept_late = *pull && !expected;
                    if kept_late && departing != Some(tok) {
                        // It waits here for `take_pulled` (and holds
                        // back what follows it).
                        *pull_heads += 1;
                        head_at = Some((idx, ci));
                        break;
                    }
                    // A departing peer's ring goes away with it: what it
                    // holds (at most a ring's worth) is taken out whole, or
                    // sends that completed would be lost.
                    if !kept_late
                        && departing != Some(tok)
                        && (matcher.queued_arrivals >= connected_bound
                            || matcher.queued_from(tok) >= max_queued)
                        && matcher.would_queue(tok, expected, s.tag)
                    {
                        // Flood bound (this peer's, or all peers'): leave it
                        // in shared memory until the user posts receives;
                        // the sender backs up.
                        stats.flow_blocked += 1;
                        break;
                    }
                    // A message in a buffer is read out, and its buffer
                    // released (which checks that the sender had reserved
                    // it), before anything of it is delivered or kept. An
                    // inline one is read in place after the release (the
                    // sender reuses the slot only once `publish_read` below
                    // says it may).
                    let copied = (kept_late || !s.inline).then(|| {
                        let mut data = Vec::new();
                        ch.read_payload(conn.rx_cur.pos, &s, &mut data);
                        data
                    });
                    let pos = conn.rx_cur.pos;
                    let freed = ch.release(&mut conn.rx_cur, &s);
                    stats.msgs_received += 1;
                    stats.msg_bytes_received += s.len as u64;
                    if let Err(reason) = freed {
                        cold_path();
                        violations.push((tok, Failure::Protocol, reason));
                        break;
                    }
                    if kept_late {
                        pulled_late.push_back((peer.addr.clone(), s.tag, copied.unwrap_or_default()));
                        continue;
                    }
                    let fill = |b: &mut Vec<u8>| match &copied {
                        Some(data) => {
                            b.clear();
                            b.extend_from_slice(data);
                        }
                        None => ch.read_payload(pos, &s, b),
                    };
                    if let Some(op) = matcher.deliver(&peer.addr, expected, s.tag, fill, completions) {
                        ops.remove(&op);
                    }
                }
                // Hands the read slots back (and, with the buffer releases
                // above, may unblock a sender waiting for room).
                if let Some((f, reason)) = publish_read(
                    &ch,
                    &mut conn.rx_cur,
                    conn.peer_wake.as_ref(),
                    &mut conn.wake_owed,
                    stats,
                ) {
                    cold_path();
                    violations.push((peer.addr.token(), f, reason));
                }
                heads.refresh(conn.head, (idx, ci), &ch, conn.rx_cur.pos);
            }
        }
        // A lone head is where the next take goes, without a scan.
        if *pull_heads == 1 {
            *pull_last = head_at;
        }
        for (tok, f, reason) in violations {
            self.fail_peer(tok, f, &reason);
        }
    }
}

/// Receiver: tells the sender of channel `ch` how far `rx` has read (if
/// that moved) and wakes it if it waits for room; the peer's failure if
/// the wake-up fails.
pub(crate) fn publish_read(
    ch: &Channel<'_>,
    rx: &mut RxCursor,
    peer_wake: Option<&PeerWake>,
    wake_owed: &mut bool,
    stats: &mut PluginStats,
) -> Option<(Failure, String)> {
    if !(ch.publish(rx) && ch.sender_needs_wake()) {
        return None;
    }
    match peer_wake.map(|w| w.signal()) {
        Some(Err(e)) => {
            cold_path();
            Some(wake_failure(&e))
        }
        Some(Ok(())) => {
            stats.signals_sent += 1;
            None
        }
        // The acknowledgement (with the peer's wake-up fd) has not come
        // yet; `sender_needs_wake` consumed the peer's flag, so the wake
        // is owed and sent when it comes (as `Conn::wake_peer` does).
        None => {
            *wake_owed = true;
            None
        }
    }
}

/// Whether the socket events are due at call `tick` by count
/// ([`EVENT_POLL_INTERVAL`] calls) or by time ([`EVENT_POLL_MAX_GAP`]
/// since they were last read, at `events_at`); asked every
/// [`EVENT_CLOCK_INTERVAL`] calls.
#[cold]
#[inline(never)]
fn events_overdue(tick: u32, events_at: std::time::Instant) -> bool {
    tick.is_multiple_of(EVENT_POLL_INTERVAL) || events_at.elapsed() >= EVENT_POLL_MAX_GAP
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::{init_region, TxCursor, REGION_LEN};
    use crate::sys::shm::SharedRegion;
    use std::os::fd::AsFd;

    /// Events that stay ready (level-triggered descriptors nobody reads
    /// here; peers that write to their wake-up descriptors as fast as we
    /// handle them, elsewhere) cannot keep a progress call from returning:
    /// it handles at most `MAX_EVENT_ROUNDS` full batches, owes the rest
    /// to the next call, and does not arm for a sleep meanwhile.
    #[test]
    fn events_that_keep_coming_do_not_hold_a_progress_call() {
        use crate::sys::eventfd::EventFd;
        let dir = std::env::temp_dir().join(format!("qs-sm-event-rounds-{}", std::process::id()));
        let cfg = crate::SmConfig::default().with_dir(&dir);
        let mut p = SmPlugin::new(na_core::PluginId(1), cfg).unwrap();
        let fds: Vec<EventFd> = (0..40).map(|_| EventFd::new().unwrap()).collect();
        for (i, fd) in fds.iter().enumerate() {
            // Tokens no connection has: handled as nothing to do.
            p.poll.add(fd.as_fd(), (1 << 40) + i as u64).unwrap();
            fd.signal().unwrap();
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let r = p.poll_events();
            let owed = p.events_owed;
            let armed = p.arm();
            tx.send((r.is_ok(), owed, armed)).unwrap();
            drop(fds);
        });
        let (ok, owed, armed) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("poll_events never returned while events stayed ready");
        t.join().unwrap();
        assert!(ok);
        assert!(owed, "the events left were not owed to the next call");
        assert!(!armed, "armed for a sleep with events owed");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Socket events an earlier call owes (more connections than one call
    /// accepts) come before any message the spin could report: it ends at
    /// once, for the progress call that handles them.
    #[test]
    fn the_spin_ends_at_once_when_events_are_owed() {
        let dir = std::env::temp_dir().join(format!("qs-sm-spin-owed-{}", std::process::id()));
        let cfg = crate::SmConfig::default().with_dir(&dir);
        let mut p = SmPlugin::new(na_core::PluginId(1), cfg).unwrap();
        assert_eq!(p.spin_for_work(100), 100, "nothing due: the spin runs its checks");
        p.events_owed = true;
        assert_eq!(p.spin_for_work(100), 0, "spun with socket events owed");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A receiver that hands slots back to a waiting sender before the
    /// sender's wake-up fd arrived (handshake not acknowledged yet) owes it
    /// the wake-up: the sender's flag was consumed, so nothing else will.
    #[test]
    fn a_wake_up_for_a_sender_without_a_wake_fd_yet_is_owed() {
        let r = SharedRegion::create("qs-publish-test", REGION_LEN).unwrap();
        init_region(&r, 1);
        let ch = Channel::new(&r, 0);
        let (mut tx, mut rx) = (TxCursor::default(), RxCursor::default());
        while ch.try_send(&mut tx, MsgKind::Unexpected, 0, &[b"x"]).unwrap() {}
        assert!(ch.arm_sender(&mut tx, 1), "the ring is full: the sender waits");
        let s = ch.peek(rx.pos).unwrap().unwrap();
        ch.release(&mut rx, &s).unwrap();
        let (mut owed, mut stats) = (false, PluginStats::default());
        assert!(publish_read(&ch, &mut rx, None, &mut owed, &mut stats).is_none());
        assert!(owed, "the consumed wake-up was dropped");
        assert_eq!(stats.signals_sent, 0);
    }
}
