//! The spilled outputs a target keeps exposed until their origin pulled
//! them, bounded in bytes per origin and in all.
//!
//! An output too large for a message is exposed read-only and its
//! descriptor sent instead; the origin pulls it and says so, and only then
//! is it dropped (or after [`SPILLED_OUTPUT_TTL`](crate::SPILLED_OUTPUT_TTL)).
//! An origin that asks for large outputs and never pulls them would make
//! the target hold every one of them for that long, and a flood of such
//! calls would exhaust the target's memory. So exposing is admitted only
//! under two bounds ([`Engine::set_max_exposed_bytes`](crate::Engine::set_max_exposed_bytes)):
//! what one origin has not yet pulled, and what all have not; a call past
//! either is answered with a handler error that says so. An origin is a
//! process where the transport names it ([`Origin`]): one process's many
//! connections share one bound.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use na_core::fasthash::FastMap;
use na_core::MemHandle;

use crate::origin::Origin;

/// Default bound of the outputs one origin has not pulled yet: what one
/// origin pulls at once by default (`DEFAULT_MAX_PULL_BYTES`), so an
/// origin within its own budget never meets it.
pub const DEFAULT_MAX_EXPOSED_PER_PEER: u64 = crate::engine::DEFAULT_MAX_PULL_BYTES;

/// Default bound of the outputs all origins have not pulled yet.
pub const DEFAULT_MAX_EXPOSED_TOTAL: u64 = 4 * DEFAULT_MAX_EXPOSED_PER_PEER;

/// Places of outputs gone since that the order of exposure keeps beyond
/// twice those kept, before a sweep drops them.
const MIN_COMPACT: usize = 1024;

/// One exposed output.
struct Entry {
    mem: MemHandle,
    since: Instant,
    bytes: u64,
    /// Whose bound it counts in.
    origin: Origin,
}

/// Exposed outputs by (peer address token, cookie), with their byte counts
/// (per [`Origin`], the peer's process where known, for the bound).
pub(crate) struct ExposedOutputs {
    /// The outputs, by peer address token, then cookie: a peer that goes
    /// away has its own released without a visit to any other's (a peer
    /// with none exposed has no map here).
    entries: FastMap<u64, FastMap<u64, Entry>>,
    /// Outputs in `entries`, over all peers.
    count: usize,
    /// Keys in the order their outputs were exposed (one TTL for all, so
    /// also the order they expire), with when: an entry whose output was
    /// pulled or replaced since stays until the sweep reaches it (or the
    /// order holds twice the outputs kept). The front is the earliest an
    /// output can expire, never later, so finding it costs no scan.
    order: VecDeque<(Instant, (u64, u64))>,
    by_peer: FastMap<Origin, u64>,
    total: u64,
    max_per_peer: u64,
    max_total: u64,
    /// Outputs `remove_peer` has looked at (for tests of its cost).
    #[cfg(test)]
    peer_visits: usize,
}

impl Default for ExposedOutputs {
    fn default() -> Self {
        ExposedOutputs {
            entries: FastMap::default(),
            count: 0,
            order: VecDeque::new(),
            by_peer: FastMap::default(),
            total: 0,
            max_per_peer: DEFAULT_MAX_EXPOSED_PER_PEER,
            max_total: DEFAULT_MAX_EXPOSED_TOTAL,
            #[cfg(test)]
            peer_visits: 0,
        }
    }
}

/// Outputs still exposed when the engine goes (or the set is dropped)
/// have their seals broken: a pull still to come fails its check instead
/// of taking what the memory holds next.
impl Drop for ExposedOutputs {
    fn drop(&mut self) {
        for e in self.entries.values().flat_map(FastMap::values) {
            crate::spill::break_seal(&e.mem);
        }
    }
}

impl ExposedOutputs {
    /// Sets both bounds.
    pub fn set_limits(&mut self, per_peer: u64, total: u64) {
        self.max_per_peer = per_peer;
        self.max_total = total;
    }

    /// Checks that `bytes` more for origin `peer` stay within both bounds;
    /// the error says which bound and by how much.
    pub fn admit(&self, peer: Origin, bytes: u64) -> Result<(), String> {
        let held = self.by_peer.get(&peer).copied().unwrap_or(0);
        if held.saturating_add(bytes) > self.max_per_peer {
            return Err(format!(
                "output of {bytes} bytes not sent: this caller has not pulled {held} bytes of earlier \
                 outputs and the target holds at most {} per caller",
                self.max_per_peer
            ));
        }
        if self.total.saturating_add(bytes) > self.max_total {
            return Err(format!(
                "output of {bytes} bytes not sent: the target holds {} bytes of outputs not yet \
                 pulled, at most {} in all",
                self.total, self.max_total
            ));
        }
        Ok(())
    }

    /// Keeps `mem` (`bytes` long) exposed for peer `key.0`'s call
    /// `key.1`, counted in `origin`'s bound (the process of peer `key.0`,
    /// where known), replacing (and releasing) any output under the same
    /// key.
    /// A replaced output has its seal broken first: its descriptor went to
    /// the origin (which sent the same cookie twice), and a pull of it
    /// may be under way.
    pub fn insert(&mut self, key: (u64, u64), origin: Origin, mem: MemHandle, bytes: u64) {
        if let Some(old) = self.remove(key) {
            crate::spill::break_seal(&old);
        }
        *self.by_peer.entry(origin).or_insert(0) += bytes;
        self.total += bytes;
        let since = Instant::now();
        self.entries.entry(key.0).or_default().insert(
            key.1,
            Entry {
                mem,
                since,
                bytes,
                origin,
            },
        );
        self.count += 1;
        self.order.push_back((since, key));
    }

    /// The output under `key`, if any.
    fn get(&self, key: (u64, u64)) -> Option<&Entry> {
        self.entries.get(&key.0)?.get(&key.1)
    }

    /// True if `key`'s output is the one exposed at `since`.
    fn is_current(&self, since: Instant, key: (u64, u64)) -> bool {
        self.get(key).is_some_and(|e| e.since == since)
    }

    /// Releases the output under `key`, if any.
    pub fn remove(&mut self, key: (u64, u64)) -> Option<MemHandle> {
        let peer = self.entries.get_mut(&key.0)?;
        let e = peer.remove(&key.1)?;
        if peer.is_empty() {
            self.entries.remove(&key.0);
        }
        self.count -= 1;
        self.uncount(e.origin, e.bytes);
        Some(e.mem)
    }

    /// Releases every output exposed for peer `peer` (an address token:
    /// it went away, nobody will pull them), seals broken first; returns
    /// how many and their bytes. Their places in the order stay until the
    /// sweep reaches them, as those of pulled outputs do. Costs the peer's
    /// own outputs, not every one kept (it runs once per departed peer that
    /// had a watch: many clients gone at once, each with a few outputs
    /// among many others', each cost a pass over all of them before).
    pub fn remove_peer(&mut self, peer: u64) -> (usize, u64) {
        let Some(gone) = self.entries.remove(&peer) else {
            return (0, 0);
        };
        let n = gone.len();
        self.count -= n;
        let mut bytes = 0;
        for e in gone.into_values() {
            #[cfg(test)]
            {
                self.peer_visits += 1;
            }
            crate::spill::break_seal(&e.mem);
            self.uncount(e.origin, e.bytes);
            bytes += e.bytes;
        }
        (n, bytes)
    }

    fn uncount(&mut self, peer: Origin, bytes: u64) {
        self.total -= bytes;
        if let Some(held) = self.by_peer.get_mut(&peer) {
            *held -= bytes;
            if *held == 0 {
                self.by_peer.remove(&peer);
            }
        }
    }

    /// Releases every output exposed for `ttl` or longer; returns how many.
    /// In the order they were exposed: it stops at the first output still
    /// within its TTL, so a sweep costs what it drops, not what is kept.
    pub fn sweep(&mut self, ttl: Duration) -> usize {
        let mut expired = 0;
        while let Some(&(since, key)) = self.order.front() {
            let current = self.is_current(since, key);
            if current && since.elapsed() < ttl {
                break;
            }
            self.order.pop_front();
            // A pull still to come must not take what the memory holds
            // next for the output.
            if current {
                if let Some(mem) = self.remove(key) {
                    crate::spill::break_seal(&mem);
                }
                expired += 1;
            }
        }
        // Pulled outputs behind one kept for its whole TTL: dropped once
        // they pass twice those kept (one visit per entry, amortized).
        if self.order.len() > 2 * self.count + MIN_COMPACT {
            let entries = &self.entries;
            self.order.retain(|&(since, (peer, cookie))| {
                entries
                    .get(&peer)
                    .and_then(|m| m.get(&cookie))
                    .is_some_and(|e| e.since == since)
            });
        }
        expired
    }

    /// The exposed handles (for tests).
    #[cfg(test)]
    pub fn handles(&self) -> impl Iterator<Item = &MemHandle> + '_ {
        self.entries.values().flat_map(FastMap::values).map(|e| &e.mem)
    }

    /// When the oldest output still in the order was exposed: the
    /// earliest any can expire (early if that one was pulled since, and
    /// the sweep then drops its place).
    pub fn oldest_since(&self) -> Option<Instant> {
        self.order.front().map(|&(since, _)| since)
    }

    /// Places in the order of exposure, those of outputs gone since
    /// included (for tests of its bound).
    #[cfg(test)]
    pub fn order_len(&self) -> usize {
        self.order.len()
    }

    /// True if none is kept.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Outputs kept.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Bytes kept, over all origins.
    pub fn bytes(&self) -> u64 {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use na_core::{Access, PeerProcess};

    /// Origin `n` (an address token).
    fn o(n: u64) -> Origin {
        Origin::Addr(n)
    }

    fn mem(n: usize) -> MemHandle {
        MemHandle::new(vec![vec![0u8; n]], Access::ReadOnly)
    }

    /// `data` then its seal, as `spill::expose` lays an output out.
    fn sealed(data: &[u8], seal: u64) -> MemHandle {
        MemHandle::new(vec![data.to_vec(), seal.to_le_bytes().to_vec()], Access::ReadOnly)
    }

    /// The last 8 bytes of `mem`: its seal.
    fn seal_of(mem: &MemHandle) -> u64 {
        let mut b = [0u8; 8];
        mem.read_at(mem.size() - crate::spill::SEAL_LEN, &mut b).unwrap();
        u64::from_le_bytes(b)
    }

    /// An output replaced by another under the same key (an origin that
    /// sent the same cookie twice) had its descriptor sent: a pull of it
    /// may be under way, so its seal is broken before it is let go, as on
    /// every other path that lets an unpulled output go.
    #[test]
    fn a_replaced_output_has_its_seal_broken() {
        let mut x = ExposedOutputs::default();
        let old = sealed(b"first output", 0x5ea1);
        x.insert((1, 10), o(1), old.clone(), 12);
        assert_eq!(seal_of(&old), 0x5ea1);
        let new = sealed(b"second output", 0x5ea2);
        x.insert((1, 10), o(1), new.clone(), 13);
        assert_eq!(seal_of(&old), 0, "the replaced output kept its seal");
        let mut b = [0u8; 12];
        old.read_at(0, &mut b).unwrap();
        assert_eq!(&b, b"first output", "the data itself untouched");
        assert_eq!(seal_of(&new), 0x5ea2, "the new output's seal broken");
        assert_eq!((x.len(), x.bytes()), (1, 13));
        // Another origin's output under the same cookie is not replaced.
        let other = sealed(b"other", 0x5ea3);
        x.insert((2, 10), o(2), other.clone(), 5);
        assert_eq!((seal_of(&new), seal_of(&other)), (0x5ea2, 0x5ea3));
    }

    #[test]
    fn bounds_per_origin_and_in_all_with_every_exit_refunded() {
        let mut x = ExposedOutputs::default();
        x.set_limits(100, 150);
        assert!(x.admit(o(1), 100).is_ok());
        assert!(x.admit(o(1), 101).unwrap_err().contains("per caller"));
        x.insert((1, 10), o(1), mem(60), 60);
        assert!(x.admit(o(1), 41).unwrap_err().contains("has not pulled 60 bytes"));
        assert!(x.admit(o(1), 40).is_ok());
        x.insert((2, 10), o(2), mem(80), 80);
        // Origin 3 is within its own bound but not the total (140 held).
        assert!(x.admit(o(3), 11).unwrap_err().contains("140 bytes"));
        assert!(x.admit(o(3), 10).is_ok());
        // The same key again replaces, and refunds, the old output.
        x.insert((1, 10), o(1), mem(20), 20);
        assert_eq!((x.len(), x.bytes()), (2, 100));
        x.remove((2, 10));
        x.remove((2, 10));
        assert_eq!((x.len(), x.bytes()), (1, 20));
        assert!(x.admit(o(1), 80).is_ok() && x.admit(o(1), 81).is_err());
        assert_eq!(x.sweep(Duration::from_secs(3600)), 0);
        assert_eq!(x.sweep(Duration::ZERO), 1);
        assert!(x.is_empty() && x.bytes() == 0 && x.by_peer.is_empty());
    }

    /// An origin that went away has all its outputs released at once,
    /// seals broken, and nothing of another origin's; the order's place
    /// of a released one goes when the sweep reaches it.
    #[test]
    fn an_origin_gone_releases_its_outputs_only() {
        let mut x = ExposedOutputs::default();
        let (a1, a2, b) = (sealed(b"a1", 0xa1), sealed(b"a2", 0xa2), sealed(b"b", 0xb));
        x.insert((1, 10), o(1), a1.clone(), 2);
        x.insert((2, 10), o(2), b.clone(), 1);
        x.insert((1, 11), o(1), a2.clone(), 2);
        assert_eq!(x.remove_peer(3), (0, 0), "an origin with nothing exposed");
        assert_eq!(x.remove_peer(1), (2, 4));
        assert_eq!((seal_of(&a1), seal_of(&a2), seal_of(&b)), (0, 0, 0xb));
        assert_eq!((x.len(), x.bytes()), (1, 1));
        assert!(x.admit(o(1), 100).is_ok() && !x.by_peer.contains_key(&o(1)));
        assert_eq!(x.remove_peer(1), (0, 0), "released once");
        assert_eq!(x.sweep(Duration::from_secs(3600)), 0);
        assert_eq!(x.order_len(), 2, "the released one's place in front went");
        assert!(x.remove((2, 10)).is_some());
    }

    /// The sweep and the next expiry read the order of exposure, not every
    /// output: a pulled output at the front makes the expiry early, never
    /// late, and goes at the next sweep; places of pulled outputs behind
    /// one kept do not pile up.
    #[test]
    fn outputs_expire_in_order_and_pulled_ones_leave_no_pile() {
        let mut x = ExposedOutputs::default();
        x.insert((1, 1), o(1), mem(10), 10);
        std::thread::sleep(Duration::from_millis(2));
        x.insert((1, 2), o(1), mem(10), 10);
        let second = x.get((1, 2)).unwrap().since;
        assert!(x.remove((1, 1)).is_some(), "pulled");
        assert!(
            x.oldest_since() < Some(second),
            "early, from the pulled one's place"
        );
        assert_eq!(x.sweep(Duration::from_secs(3600)), 0);
        assert_eq!(x.oldest_since(), Some(second), "the pulled one's place went");
        // 3,000 outputs pulled behind the kept one.
        for c in 10..3010 {
            x.insert((2, c), o(2), mem(1), 1);
            x.remove((2, c));
        }
        assert_eq!(x.order_len(), 3001);
        assert_eq!(x.sweep(Duration::from_secs(3600)), 0);
        assert!(x.order_len() <= 2 + MIN_COMPACT, "{} places kept", x.order_len());
        assert_eq!((x.len(), x.bytes()), (1, 10));
        // A replaced output keeps only its new place alive.
        x.insert((1, 2), o(1), mem(5), 5);
        assert_eq!(x.sweep(Duration::ZERO), 1);
        assert!(x.is_empty() && x.bytes() == 0 && x.oldest_since().is_none());
    }

    /// A peer that goes away costs its own outputs, not every one kept:
    /// 100 peers with 20 outputs each leave one by one, and each
    /// departure looks at its 20 only (a pass over all of them, 2,000 at
    /// first, before), with the counts and bounds of the others intact.
    #[test]
    fn a_peer_gone_costs_its_own_outputs_only() {
        let mut x = ExposedOutputs::default();
        x.set_limits(u64::MAX, u64::MAX);
        for peer in 0..100 {
            for cookie in 0..20 {
                x.insert((peer, cookie), o(peer), mem(1), 3);
            }
        }
        assert_eq!((x.len(), x.bytes()), (2000, 6000));
        for peer in 0..100 {
            let before = x.peer_visits;
            assert_eq!(x.remove_peer(peer), (20, 60), "peer {peer}");
            assert_eq!(
                x.peer_visits - before,
                20,
                "peer {peer}'s departure looked at others' outputs"
            );
            assert_eq!(x.remove_peer(peer), (0, 0), "released once");
            assert_eq!(x.peer_visits - before, 20);
            let left = (99 - peer) as usize;
            assert_eq!((x.len(), x.bytes()), (20 * left, 60 * left as u64));
            assert_eq!(x.by_peer.len(), left);
        }
        assert!(x.is_empty() && x.entries.is_empty() && x.by_peer.is_empty());
        // A peer's last output pulled leaves no map behind.
        x.insert((7, 1), o(7), mem(1), 1);
        assert!(x.remove((7, 1)).is_some());
        assert!(x.entries.is_empty() && x.is_empty());
    }

    /// Two peers (addresses) of one process share one bound, and a third
    /// process has its own; one of the two leaving releases its outputs
    /// only, and gives their bytes back to the process's bound.
    #[test]
    fn peers_of_one_process_share_its_bound() {
        let mut x = ExposedOutputs::default();
        x.set_limits(100, 1000);
        let p = Origin::Process(PeerProcess { pid: 7, started: 70 });
        let q = Origin::Process(PeerProcess { pid: 8, started: 80 });
        x.insert((1, 10), p, mem(60), 60);
        x.insert((2, 10), p, mem(30), 30);
        assert!(x.admit(p, 11).unwrap_err().contains("has not pulled 90 bytes"));
        assert!(x.admit(p, 10).is_ok());
        assert!(x.admit(q, 100).is_ok(), "another process");
        // The same pid started at another time: another process.
        let reused = Origin::Process(PeerProcess { pid: 7, started: 71 });
        assert!(x.admit(reused, 100).is_ok());
        assert_eq!(x.remove_peer(1), (1, 60));
        assert!(x.admit(p, 70).is_ok() && x.admit(p, 71).is_err());
        assert_eq!(x.remove_peer(2), (1, 30));
        assert!(x.is_empty() && x.bytes() == 0 && x.by_peer.is_empty());
    }
}
