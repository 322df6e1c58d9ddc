//! Draining before a shutdown: the engine stops taking requests, answers
//! the ones it has, and says when nothing is left in its hands, so that a
//! server can leave without failing calls it already accepted.
//!
//! # Call order
//! 1. [`Engine::begin_drain`] (or [`AsyncEngine::begin_drain`]): from now
//!    on every request is refused with a "busy" answer that says why
//!    (the origin sees [`RpcError::Busy`] and may go to another server).
//! 2. Keep driving the engine (progress and trigger, or the async driver
//!    does it) until [`Engine::drained`] is true, or for as long as you
//!    grant ([`AsyncEngine::drained`] waits with a grace period).
//! 3. Drop the engine.
//!
//! An engine dropped with such work still in its hands loses it: answers
//! its transport still queues (a peer's ring full, or no send credit) or
//! has handed to the device and not seen sent, requests taken and not
//! answered, spilled outputs still exposed for their origins to pull (the
//! drop ends their exposure, so those pulls fail), release notices and
//! acknowledgements waiting to go again. Their peers see the engine go
//! (their calls fail with `PeerGone`), and the drop logs one warning with
//! the counts ([`Engine`]'s `Drop`), so such a loss is never silent.
//!
//! Sends handed to the device and not yet seen sent (na-verbs) are
//! counted in that warning, but alone they do not make one: a client
//! dropped right after its call was answered may not have polled its
//! request's send completion, though the message was delivered (its
//! answer came). With nothing else owed, they are logged at debug level
//! as sends that *may* be lost.
//!
//! [`AsyncEngine::begin_drain`]: crate::AsyncEngine::begin_drain
//! [`AsyncEngine::drained`]: crate::AsyncEngine::drained
//! [`RpcError::Busy`]: crate::RpcError::Busy

use na_core::Addr;

use super::{response_header, Engine};
use crate::codec::Codec;
use crate::header::{Header, Status, FLAG_SPILL};

/// What a request refused while draining is answered.
const DRAINING: &str = "the server is draining before it shuts down: it takes no new requests";

impl<C: Codec> Engine<C> {
    /// Stops taking requests: from now on each one is answered "busy"
    /// ([`Status::Busy`], which the origin sees as
    /// [`RpcError::Busy`](crate::RpcError::Busy)), before any spilled input
    /// is pulled; a one-way request with no spilled input gets no answer
    /// (it never does) and is dropped. Both are counted in
    /// [`RpcStats::refused_draining`](super::RpcStats::refused_draining).
    /// Requests taken before go on: handlers run, spilled inputs are
    /// pulled, answers go out. Responses to this engine's own calls are
    /// still taken, so it may go on calling others. There is no way back.
    pub fn begin_drain(&mut self) {
        if !self.draining {
            tracing::info!("rpc engine draining: new requests are refused");
        }
        self.draining = true;
    }

    /// True once [`begin_drain`](Self::begin_drain) was called.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// True when draining and nothing a peer is owed is left in the
    /// engine's hands: no message or completion waits for
    /// [`trigger`](Self::trigger) (a request that came before the drain
    /// began is still answered "busy"), no request waits for or runs in an
    /// asynchronous handler, no spilled input or output is being pulled,
    /// no spilled output waits for its origin to pull it, no release
    /// notice or acknowledgement waits to be sent again, and the
    /// transport has sent every answer (none in its send backlog, none
    /// posted to a device and not yet completed,
    /// [`PluginStats::sends_posted`](na_core::PluginStats::sends_posted)).
    /// False before [`begin_drain`](Self::begin_drain). A request that
    /// arrives after it said true is lost with the engine: its origin sees
    /// the server go.
    pub fn drained(&self) -> bool {
        let transport_idle = self.ep.plugin(self.plugin).is_ok_and(|p| {
            let s = p.stats();
            s.backlog_bytes == 0 && s.sends_posted == 0 && !p.unexpected_ready()
        });
        self.draining
            && self.deferred.is_empty()
            && self.ep.pending_completions() == 0
            && self.deferred_requests.is_empty()
            && self.deferred_ledger.total() == 0
            && self.pulls.is_empty()
            && self.exposed.is_empty()
            && self.unsent_notices.is_empty()
            && transport_idle
    }

    /// Refuses request `h` from `src` because the engine is draining.
    pub(super) fn refuse_draining(&mut self, src: &Addr, h: &Header) {
        self.stats.refused_draining += 1;
        // A one-way request is answered only when its origin keeps a
        // spilled input for it: the answer lets it go.
        if !h.is_one_way() || h.flags & FLAG_SPILL != 0 {
            self.respond(
                src,
                response_header(h, Status::Busy),
                DRAINING.as_bytes().to_vec(),
            );
        }
    }
}

/// What a peer is owed that an engine still holds (see
/// [`Engine::drained`]): what dropping it now would lose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Owed {
    /// Bytes of sends the engine's transport queues (its send backlog).
    pub(crate) backlog_bytes: u64,
    /// Sends handed to the device and not yet reported sent (na-verbs).
    pub(crate) sends_posted: u64,
    /// Requests taken and not answered: queued for or running in an
    /// asynchronous handler, or with their spilled input being pulled.
    pub(crate) requests: u64,
    /// Spilled outputs still exposed for their origins to pull: dropping
    /// the engine ends their exposure, so those pulls fail.
    pub(crate) exposed: u64,
    /// Release notices and acknowledgements waiting to be sent again.
    pub(crate) notices: u64,
}

impl Owed {
    /// True if nothing is owed (for tests: the drop looks at
    /// [`is_certain_loss`](Self::is_certain_loss)).
    #[cfg(test)]
    pub(crate) fn is_nothing(&self) -> bool {
        *self == Owed::default()
    }

    /// True if something is owed for certain: anything but sends posted
    /// to a device and not yet seen complete, which alone may well have
    /// been delivered already (see the module docs). Dropping the engine
    /// then warns.
    pub(crate) fn is_certain_loss(&self) -> bool {
        Owed {
            sends_posted: 0,
            ..*self
        } != Owed::default()
    }
}

impl<C: Codec> Engine<C> {
    /// What the engine holds that a peer is owed (see [`Owed`]).
    pub(crate) fn owed(&self) -> Owed {
        let (backlog_bytes, sends_posted) = self.ep.plugin(self.plugin).map_or((0, 0), |p| {
            let s = p.stats();
            (s.backlog_bytes, s.sends_posted)
        });
        // A pulled request for an asynchronous handler holds a ticket,
        // counted in the ledger already.
        let pulled = self
            .pulls
            .values()
            .filter(|p| p.origin.is_some() && p.ticket.is_none())
            .count();
        Owed {
            backlog_bytes,
            sends_posted,
            requests: (self.deferred_ledger.total() + pulled) as u64,
            exposed: self.exposed.len() as u64,
            notices: self.unsent_notices.len() as u64,
        }
    }
}

/// Dropping an engine loses what its peers are still owed (see the
/// module docs): logged as one warning with the counts, unless nothing is
/// (a drained engine, [`Engine::drained`], owes nothing) or only sends
/// posted and not yet seen complete are (logged at debug level: they may
/// have been delivered).
impl<C: Codec> Drop for Engine<C> {
    fn drop(&mut self) {
        let owed = self.owed();
        if owed.is_certain_loss() {
            tracing::warn!(
                addr = %self.me,
                backlog_bytes = owed.backlog_bytes,
                sends_posted = owed.sends_posted,
                requests = owed.requests,
                exposed = owed.exposed,
                notices = owed.notices,
                "rpc engine dropped with work its peers are owed: queued answers, unanswered requests, \
                 spilled outputs not yet pulled and notices are lost (drain it first: \
                 Engine::begin_drain, Engine::drained)"
            );
        } else if owed.sends_posted > 0 {
            tracing::debug!(
                addr = %self.me,
                sends_posted = owed.sends_posted,
                "rpc engine dropped with sends posted and not yet seen complete: they may be lost \
                 (or delivered already; drain it first to know: Engine::begin_drain, Engine::drained)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Owed;

    /// Sends posted and not yet seen complete alone are no certain loss
    /// (a client dropped right after its answer came may not have polled
    /// its request's send completion); with anything else owed, or
    /// anything else alone, the drop warns.
    #[test]
    fn only_posted_sends_are_no_certain_loss() {
        let posted = Owed {
            sends_posted: 3,
            ..Owed::default()
        };
        assert!(!posted.is_nothing());
        assert!(!posted.is_certain_loss());
        assert!(!Owed::default().is_certain_loss());
        let others = [
            Owed {
                backlog_bytes: 1,
                ..Owed::default()
            },
            Owed {
                requests: 1,
                ..Owed::default()
            },
            Owed {
                exposed: 1,
                ..Owed::default()
            },
            Owed {
                notices: 1,
                ..Owed::default()
            },
        ];
        for o in others {
            assert!(o.is_certain_loss(), "{o:?}");
            assert!(Owed { sends_posted: 2, ..o }.is_certain_loss(), "{o:?}");
        }
    }
}
