//! The head list: every receive ring's head slot in one compact vector,
//! with the value it holds while its ring has nothing new, so that "did
//! any peer send anything?" costs one load per connection, not a walk
//! through every peer's connection state.
//!
//! A server with a hundred connected but quiet clients once paid a full
//! poll of every ring on each progress call (about 70 instructions a ring)
//! and built its spin loop's list on each wait. With this list a progress
//! call polls only the rings whose head changed, publishes only the rings
//! a take read from, and the spin loop watches the list as it is.
//!
//! # Keeping it true
//! * Built from the peer table, and built again whenever the table's
//!   membership epoch moves (a connection attached, a peer removed).
//! * Each entry watches the slot of the message its ring reads next. When
//!   a ring advances, its entry is moved along: at once by a poll
//!   ([`HeadList::refresh`]), or, after a take, by the next progress call
//!   ([`HeadList::mark_taken`], then `SmPlugin::settle_taken`). A poll and
//!   a take are the only places that retire messages.
//! * A stale entry (one not moved along) never hides a message: the slot
//!   it watches already held a message since it was read as idle, so it
//!   reads as changed, and only costs a poll of its ring (which moves it
//!   along).
//!
//! Nothing here is trusted more than the ring itself. A peer that writes
//! its ring's head back to the idle value withdraws its own message, as it
//! always could (the head word is the message's existence); any other value
//! reads as a change, and the poll of that ring judges it (a malformed one
//! fails the peer, as before). Every ring is polled every
//! [`EVENT_POLL_INTERVAL`] calls (or [`EVENT_POLL_MAX_GAP`], whichever
//! comes first) all the same.
//! An entry holds its head's word directly (a [`SharedWord`], which keeps
//! the region mapped even after the connection is gone), so a check is one
//! load, not a walk through the peer table to the connection.
//!
//! [`EVENT_POLL_INTERVAL`]: crate::progress::EVENT_POLL_INTERVAL
//! [`EVENT_POLL_MAX_GAP`]: crate::progress::EVENT_POLL_MAX_GAP

use std::sync::atomic::Ordering;

use crate::addr::PeerTable;
use crate::channel::Channel;
use crate::sys::shm::SharedWord;

/// One ring head.
pub(crate) struct HeadEntry {
    /// (peer slot, connection index) of the ring.
    pub ring: (usize, usize),
    /// The watched slot's header word (it keeps the region mapped).
    word: SharedWord,
    /// Its value while the ring holds nothing new (see [`Channel::head_word`]).
    idle: u64,
    /// A take retired messages of this ring since the entry was last set:
    /// the entry still watches the old slot (which reads as changed), and
    /// the ring has not told its sender how far it read.
    /// `SmPlugin::settle_taken` moves it along and publishes.
    pub taken: bool,
}

impl HeadEntry {
    /// True if the head holds something else than when it was idle.
    #[inline]
    pub fn changed(&self) -> bool {
        self.word.load(Ordering::Acquire) != self.idle
    }

    /// Watches the slot of message `pos` of its ring (read through `ch`).
    #[inline(always)]
    pub fn watch(&mut self, ch: &Channel<'_>, pos: u64) {
        let (off, idle) = ch.head_word(pos);
        self.word.point_at(ch.region(), off);
        self.idle = idle;
        self.taken = false;
    }
}

/// Every receive ring's head (see the module documentation).
#[derive(Default)]
pub(crate) struct HeadList {
    /// The peer table epoch it was built at; `None`: never built.
    epoch: Option<u64>,
    entries: Vec<HeadEntry>,
}

impl HeadList {
    /// The entries, built again first if the peer table changed since.
    #[inline]
    pub fn current(&mut self, peers: &mut PeerTable) -> &mut [HeadEntry] {
        if self.epoch != Some(peers.epoch()) {
            self.rebuild(peers);
        }
        &mut self.entries
    }

    #[cold]
    #[inline(never)]
    fn rebuild(&mut self, peers: &mut PeerTable) {
        self.entries.clear();
        self.epoch = Some(peers.epoch());
        for (idx, peer) in peers.iter_slots_mut() {
            for (ci, conn) in peer.conns.iter_mut().enumerate() {
                let (off, idle) = conn.rx().head_word(conn.rx_cur.pos);
                conn.head = self.entries.len();
                self.entries.push(HeadEntry {
                    ring: (idx, ci),
                    word: conn.region.word(off),
                    idle,
                    // Settling costs nothing when nothing is owed.
                    taken: true,
                });
            }
        }
    }

    /// Moves entry `i` (ring `ring`, read through `ch`) to the slot of
    /// message `pos`, the next its ring reads. An entry that is not the
    /// ring's (the list is about to be rebuilt) is left alone.
    pub fn refresh(&mut self, i: usize, ring: (usize, usize), ch: &Channel<'_>, pos: u64) {
        if let Some(e) = self.entries.get_mut(i).filter(|e| e.ring == ring) {
            e.watch(ch, pos);
        }
    }

    /// Notes that a take retired a message of the ring of entry `i`: the
    /// entry is moved along (and the ring published) by the next progress
    /// call, off the path from a request to its reply.
    #[inline]
    pub fn mark_taken(&mut self, i: usize) {
        if let Some(e) = self.entries.get_mut(i) {
            e.taken = true;
        }
    }
}
