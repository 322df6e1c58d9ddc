//! The peers that addresses name, by generational token, and the release
//! of a dead peer's entry once nothing refers to it any more.
//!
//! An address handed out carries a [`TokenSlab`] token (slot index and
//! generation). A slot is reused only after its peer
//! died and every connection and held message naming it is gone, with the
//! next generation, so an old address never reaches the slot's successor:
//! it gets [`TokenState::Released`] instead. Without this, every client that
//! ever connected (and every reconnect after a death) would leave an entry
//! behind for the plugin's lifetime.
//!
//! Inside the plugin peers are named by slot index. An index is valid
//! exactly as long as something holds a reference ([`PeerTable::acquire`]):
//! each connection and each held message does; a live peer is never
//! released (addresses of it may still be in use).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::{Index, IndexMut};
use std::time::Instant;

use na_core::{Addr, PluginId, TokenSlab, TokenState};

use crate::addr::canonical;
use crate::conn::ConnRef;

/// A peer as named by addresses handed out.
pub(crate) struct Peer {
    pub uri: String,
    pub key: SocketAddr,
    pub addr: Addr,
    /// The connection sends go through.
    pub conn: Option<ConnRef>,
    /// Why the peer is unusable, once it is.
    pub dead: Option<String>,
    /// When it became unusable.
    pub dead_since: Option<Instant>,
    /// The peer of one incoming connection (see
    /// [`PeerTable::insert_incoming`]): never found by a lookup, and never
    /// connected to actively.
    pub incoming: bool,
    /// Connections and held messages naming this peer.
    refs: u32,
}

/// Peers in a [`TokenSlab`] (slots and generations, shared with na-sm),
/// with the index by socket address.
#[derive(Default)]
pub(crate) struct PeerTable {
    slab: TokenSlab<Peer>,
    /// Live looked-up peers by their listen address (dead ones are not
    /// found: a lookup after a death starts afresh). Peers of incoming
    /// connections are never here.
    by_key: HashMap<SocketAddr, usize>,
}

impl PeerTable {
    /// The live peer of `key`, or a new one; `true` when it is new.
    pub fn find_or_insert(
        &mut self,
        plugin: PluginId,
        key: SocketAddr,
        device: Option<&str>,
    ) -> (usize, bool) {
        if let Some(&i) = self.by_key.get(&key) {
            return (i, false);
        }
        let idx = self.insert(plugin, key, device, false);
        self.by_key.insert(key, idx);
        (idx, true)
    }

    /// A new peer for one incoming connection whose hello names `key`.
    ///
    /// A hello's address is a claim the plugin can check only up to the
    /// IP (see `on_connect_request`), so the peer is the connection's
    /// own: it is not entered in the index by address (a lookup of `key`
    /// never finds it, and connects to the listener there instead), and
    /// it dies with its connection. Its address shows `key` (for logs and
    /// for comparing with a descriptor's owner), but only the connection
    /// it came on reaches it.
    pub fn insert_incoming(&mut self, plugin: PluginId, key: SocketAddr, device: Option<&str>) -> usize {
        self.insert(plugin, key, device, true)
    }

    fn insert(&mut self, plugin: PluginId, key: SocketAddr, device: Option<&str>, incoming: bool) -> usize {
        let uri = canonical(device, key);
        let (idx, _) = self.slab.insert_with(|tok| Peer {
            addr: Addr::new(uri.clone(), plugin, tok, false),
            uri,
            key,
            conn: None,
            dead: None,
            dead_since: None,
            incoming,
            refs: 0,
        });
        idx
    }

    /// What the token of an address of this plugin names.
    pub fn resolve(&self, tok: u64) -> TokenState {
        self.slab.resolve(tok)
    }

    /// Marks a peer dead: it is no longer found by its address, and its
    /// entry goes once nothing refers to it.
    pub fn mark_dead(&mut self, idx: usize, reason: &str) {
        let p = &mut self[idx];
        if p.dead.is_some() {
            return;
        }
        p.dead = Some(reason.to_owned());
        p.dead_since = Some(Instant::now());
        let key = p.key;
        if self.by_key.get(&key) == Some(&idx) {
            self.by_key.remove(&key);
        }
        self.release_if_unused(idx);
    }

    /// A connection or held message now names peer `idx`.
    pub fn acquire(&mut self, idx: usize) {
        self[idx].refs += 1;
    }

    /// A connection or held message naming peer `idx` is gone; the peer's
    /// entry goes too if it was the last and the peer is dead.
    pub fn release(&mut self, idx: usize) {
        let p = &mut self[idx];
        p.refs = p.refs.saturating_sub(1);
        self.release_if_unused(idx);
    }

    /// Removes a peer made just now whose first connection was refused (no
    /// address of it was handed out).
    pub fn remove_new(&mut self, idx: usize) {
        let reason = "refused before it was used";
        self.mark_dead(idx, reason);
    }

    fn release_if_unused(&mut self, idx: usize) {
        let unused = self.slab.at(idx).is_some_and(|p| p.refs == 0 && p.dead.is_some());
        if !unused {
            return;
        }
        if let Some(p) = self.slab.remove_at(idx) {
            tracing::trace!(peer = %p.uri, "verbs: released a dead peer's entry");
        }
    }

    /// Peer entries held (live, or dead and still referenced).
    pub fn len(&self) -> usize {
        self.slab.len()
    }

    /// The peer in slot `idx`, if any.
    pub fn get(&self, idx: usize) -> Option<&Peer> {
        self.slab.at(idx)
    }
}

impl Index<usize> for PeerTable {
    type Output = Peer;

    /// The peer in slot `idx`; the caller holds a reference to it (see the
    /// module docs), so it is there.
    fn index(&self, idx: usize) -> &Peer {
        self.get(idx).expect("a peer index is used only while referenced")
    }
}

impl IndexMut<usize> for PeerTable {
    fn index_mut(&mut self, idx: usize) -> &mut Peer {
        self.slab
            .at_mut(idx)
            .expect("a peer index is used only while referenced")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], port))
    }

    #[test]
    fn a_dead_peer_goes_when_its_last_reference_does_and_its_slot_is_reused() {
        let mut t = PeerTable::default();
        let (a, new) = t.find_or_insert(PluginId(1), key(1), None);
        assert!(new);
        assert_eq!(t.find_or_insert(PluginId(1), key(1), None), (a, false));
        let old_tok = t[a].addr.token();
        t.acquire(a); // its connection
        t.acquire(a); // a held message
        t.mark_dead(a, "gone");
        assert_eq!(t.len(), 1, "still referenced");
        assert_eq!(t.resolve(old_tok), TokenState::Live(a));
        t.release(a);
        assert_eq!(t.len(), 1);
        t.release(a);
        assert_eq!(t.len(), 0, "dead and unreferenced: released");
        assert_eq!(t.resolve(old_tok), TokenState::Released);
        // The same address starts afresh in the freed slot, new generation.
        let (b, new) = t.find_or_insert(PluginId(1), key(1), None);
        assert!(new);
        assert_eq!(b, a);
        assert_ne!(t[b].addr.token(), old_tok);
        assert_eq!(t.resolve(old_tok), TokenState::Released);
        assert_eq!(t.resolve(t[b].addr.token()), TokenState::Live(b));
        assert_eq!(t.resolve(7), TokenState::Unknown);
        assert_eq!(t.resolve(5 << 32 | b as u64), TokenState::Unknown);
    }

    #[test]
    fn an_incoming_peer_is_never_found_by_its_address_nor_disturbs_the_looked_up_one() {
        let mut t = PeerTable::default();
        let (looked_up, _) = t.find_or_insert(PluginId(1), key(3), None);
        let a = t.insert_incoming(PluginId(1), key(3), None);
        let b = t.insert_incoming(PluginId(1), key(3), None);
        assert!(
            a != looked_up && b != looked_up && a != b,
            "one peer per connection"
        );
        assert!(t[a].incoming && !t[looked_up].incoming);
        assert_eq!(t[a].uri, t[looked_up].uri, "shown as the address it claims");
        assert_ne!(t[a].addr, t[looked_up].addr);
        assert_eq!(t.find_or_insert(PluginId(1), key(3), None), (looked_up, false));
        // Its death leaves the looked-up peer findable, and it goes with
        // its last reference.
        t.acquire(a);
        t.mark_dead(a, "its connection went");
        assert_eq!(t.find_or_insert(PluginId(1), key(3), None), (looked_up, false));
        t.release(a);
        assert!(t.get(a).is_none());
        // Nothing looked up: a lookup still makes a peer of its own.
        let (c, new) = t.find_or_insert(PluginId(1), key(4), None);
        let d = t.insert_incoming(PluginId(1), key(4), None);
        assert!(new && c != d);
        assert_eq!(t.find_or_insert(PluginId(1), key(4), None), (c, false));
    }

    /// A link-local address names a listener only with its scope id (the
    /// interface): the same IP and port on two interfaces are two peers,
    /// and each peer's URI parses back to its own key (with the scope, so
    /// a lookup of it reaches the same interface). A flow label names no
    /// listener: it is dropped.
    #[test]
    fn link_local_addresses_on_two_interfaces_are_two_peers() {
        let parse = |uri: &str| crate::addr::VerbsUri::parse_peer(uri).unwrap().0;
        let (eth1, eth2) = (
            parse("verbs://rxe0/[fe80::1%1]:9"),
            parse("verbs://rxe0/[fe80::1%2]:9"),
        );
        assert_ne!(eth1, eth2, "the scope id was lost in parsing");
        let mut t = PeerTable::default();
        let (a, _) = t.find_or_insert(PluginId(1), eth1, Some("rxe0"));
        let (b, new) = t.find_or_insert(PluginId(1), eth2, Some("rxe0"));
        assert!(new && a != b, "two interfaces, one peer");
        assert_ne!(t[a].uri, t[b].uri);
        assert_eq!((parse(&t[a].uri), parse(&t[b].uri)), (eth1, eth2));
        let flow = std::net::SocketAddrV6::new("fe80::1".parse().unwrap(), 9, 7, 1);
        let flow = crate::addr::canonical_sock(flow.into());
        assert_eq!(t.find_or_insert(PluginId(1), flow, None), (a, false));
    }

    #[test]
    fn a_live_peer_is_never_released() {
        let mut t = PeerTable::default();
        let (a, _) = t.find_or_insert(PluginId(1), key(2), None);
        t.acquire(a);
        t.release(a);
        assert_eq!(t.len(), 1);
        assert!(t.get(a).is_some());
        t.remove_new(a);
        assert_eq!(t.len(), 0);
    }
}
