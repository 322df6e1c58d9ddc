//! Each origin's share of the target's pull budget: the spilled inputs
//! one origin has this target pull and hold at once are bounded apart from
//! the budget itself ([`Engine::set_max_pull_bytes_per_peer`]), so that one
//! greedy origin (many large-input calls to slow async handlers, whose
//! pulled inputs count until they are answered) cannot take the whole
//! budget and have every other origin's spilled request answered busy.

use super::Engine;
use crate::codec::Codec;

impl<C: Codec> Engine<C> {
    /// The most bytes of spilled inputs one origin may hold (see
    /// [`Engine::set_max_pull_bytes_per_peer`]): as set, else half the
    /// pull budget.
    pub(super) fn pull_share(&self) -> u64 {
        self.max_pull_per_peer.unwrap_or(self.max_pull_bytes / 2)
    }

    /// Bytes of spilled inputs origin `peer` holds now: pulls in flight
    /// and the inputs its requests for async handlers hold.
    fn input_bytes_of(&self, peer: u64) -> u64 {
        let pulling = self.input_pulls_by_peer.get(&peer).copied().unwrap_or(0);
        pulling.saturating_add(self.deferred_ledger.bytes_of(peer))
    }

    /// Checks that origin `peer` may hold `len` more bytes of spilled
    /// inputs: within its share, or it holds none (one input that fits the
    /// budget is never refused for the share, so a share below the largest
    /// input refuses none forever). Why not, for a busy answer.
    pub(super) fn admit_input_pull(&self, peer: u64, len: u64) -> Result<(), String> {
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
    pub(super) fn charge_input_pull(&mut self, peer: u64, len: u64) {
        *self.input_pulls_by_peer.entry(peer).or_insert(0) += len;
    }

    /// Gives back what [`charge_input_pull`](Self::charge_input_pull)
    /// counted, once the pull ended (the input then counts in the share
    /// through its request's `PullCharge`, if an async handler holds it).
    pub(super) fn uncharge_input_pull(&mut self, peer: u64, len: u64) {
        if let Some(n) = self.input_pulls_by_peer.get_mut(&peer) {
            *n = n.saturating_sub(len);
            if *n == 0 {
                self.input_pulls_by_peer.remove(&peer);
            }
        }
    }
}
