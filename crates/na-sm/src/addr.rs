//! `sm://<pid>-<instance>` addresses and the table of known peers.
//!
//! `<pid>` is the owner's process id; `<instance>` is either the name given
//! in [`SmConfig::name`](crate::SmConfig::name) or a per-process counter
//! (`0`, `1`, ...). A listening instance's socket is
//! `<dir>/<pid>-<instance>.sock`, next to `<pid>-<instance>.owner`, whose
//! lock tells [`crate::cleanup_stale`] that its owner is alive.
//!
//! Within one process each name belongs to one instance at a time (see
//! `NameClaim`), listening or not: a peer knows its peers by name, so two
//! of our instances under one name would look like one peer to a server.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, PoisonError, TryLockError};
use std::time::{Duration, Instant};

use na_core::{Addr, PluginId, TokenSlab};

use crate::config::check_name;
use crate::conn::Conn;
use crate::error::SmError;
use crate::sys::proc;

/// The parsed form of an `sm://` address.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SmName {
    /// Owner's pid.
    pub pid: u32,
    /// Instance part.
    pub instance: String,
}

impl SmName {
    /// Parses `sm://<pid>-<instance>`.
    pub fn parse(uri: &str) -> Result<Self, SmError> {
        let bad = |reason: &str| SmError::InvalidAddress {
            uri: uri.to_owned(),
            reason: reason.into(),
        };
        let rest = uri
            .strip_prefix("sm://")
            .ok_or_else(|| bad("expected sm://<pid>-<instance>"))?;
        Self::parse_key(rest).map_err(|r| bad(&r))
    }

    /// Parses the `<pid>-<instance>` part.
    pub fn parse_key(key: &str) -> Result<Self, String> {
        let (pid, instance) = key
            .split_once('-')
            .ok_or_else(|| "expected <pid>-<instance>".to_string())?;
        let pid: u32 = pid
            .parse()
            .ok()
            // Digits only, and no leading zero: one spelling per name
            // (`uri` gives it back), never "sm://010-a" for "sm://10-a".
            .filter(|p| *p > 0 && !pid.starts_with('0') && pid.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| format!("{pid:?} is not a process id"))?;
        check_name(instance)?;
        Ok(SmName {
            pid,
            instance: instance.to_owned(),
        })
    }

    /// `<pid>-<instance>`.
    pub fn key(&self) -> String {
        format!("{}-{}", self.pid, self.instance)
    }

    /// `sm://<pid>-<instance>`.
    pub fn uri(&self) -> String {
        format!("sm://{}", self.key())
    }

    /// The listening socket file in `dir`.
    pub fn socket_path(&self, dir: &Path) -> PathBuf {
        dir.join(format!("{}.sock", self.key()))
    }

    /// The owner file in `dir`.
    pub fn owner_path(&self, dir: &Path) -> PathBuf {
        dir.join(format!("{}.owner", self.key()))
    }
}

/// Keys (`<pid>-<instance>`) of this process's live instances.
static NAMES_IN_USE: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// The pid of the process whose thread holds [`NAMES_IN_USE`] (0: none
/// recorded yet). In a forked child the lock may be held by a parent
/// thread that does not exist there: the pid then differs from ours.
static NAMES_HOLDER: AtomicU32 = AtomicU32::new(0);

/// How long a claim waits for the registry before it takes a lock it
/// cannot get for a parent's thread gone with a fork (the registry is held
/// for microseconds by a live thread).
const NAMES_WAIT: Duration = Duration::from_secs(1);

/// A name held by one instance of this process for its whole life (the
/// entry goes when this is dropped).
///
/// A forked child gets a copy of the registry, in which its parent's
/// entries stay: they carry the parent's pid, which none of the child's
/// names has. A child forked while a parent thread held the registry
/// cannot take its lock: after [`NAMES_WAIT`] its instance goes without a
/// registry entry (a warning says so) instead of waiting for ever.
#[derive(Debug)]
pub(crate) struct NameClaim {
    key: String,
    pid: u32,
    /// False for a claim made without the registry (see above).
    registered: bool,
}

impl NameClaim {
    /// Takes `name` for one instance; `None` if another instance of this
    /// process holds it.
    pub fn take(name: &SmName) -> Option<NameClaim> {
        let key = name.key();
        let me = proc::pid();
        let started = Instant::now();
        let mut names = loop {
            match NAMES_IN_USE.try_lock() {
                Ok(g) => break g,
                Err(TryLockError::Poisoned(p)) => break p.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    if started.elapsed() >= NAMES_WAIT && NAMES_HOLDER.load(Ordering::Relaxed) != me {
                        tracing::warn!(name = %name.uri(), "sm: the instance-name registry stayed locked (a fork while \
                            another thread held it?): this instance is not registered");
                        return Some(NameClaim {
                            key,
                            pid: name.pid,
                            registered: false,
                        });
                    }
                    std::thread::yield_now();
                }
            }
        };
        NAMES_HOLDER.store(me, Ordering::Relaxed);
        // (Not `then_some`: a claim built and dropped here would remove
        // the holder's entry, under the lock its drop takes.)
        let claim = names.insert(key.clone()).then(|| NameClaim {
            key,
            pid: name.pid,
            registered: true,
        });
        drop(names);
        claim
    }
}

impl Drop for NameClaim {
    fn drop(&mut self) {
        // In a forked child, the entry is the parent's (see above).
        if self.registered && proc::pid() == self.pid {
            let mut names = NAMES_IN_USE.lock().unwrap_or_else(PoisonError::into_inner);
            NAMES_HOLDER.store(self.pid, Ordering::Relaxed);
            names.remove(&self.key);
        }
    }
}

/// A connected (or connecting) peer.
pub(crate) struct Peer {
    pub name: SmName,
    pub addr: Addr,
    /// Kernel-reported pid (SO_PEERCRED), used for CMA.
    pub pid: u32,
    /// Its process's start time (clock ticks since boot), where known:
    /// tells it from a later process that got the same pid, and so the
    /// same name (see [`PeerTable::may_join`]). `None` while no
    /// connection's reading of it succeeded (the first one's failed on
    /// our side: out of descriptors, `/proc` unreadable); the first that
    /// succeeds sets it.
    pub start: Option<u64>,
    /// Connections to this peer: sends use the first, receives poll all
    /// (two exist when both sides looked each other up at once, or for self).
    pub conns: Vec<Conn>,
}

/// Peers in a [`TokenSlab`] (slot index plus generation, shared with
/// na-verbs), so an address of a departed peer never reaches its successor.
#[derive(Default)]
pub(crate) struct PeerTable {
    slab: TokenSlab<Peer>,
    /// Moves whenever a connection is attached or removed (see `epoch`).
    epoch: u64,
    by_name: HashMap<String, u64>,
    /// Connection serial (epoll token) to peer token.
    by_serial: HashMap<u64, u64>,
}

impl PeerTable {
    /// Inserts a peer with no connection yet and returns its token.
    pub fn insert(
        &mut self,
        plugin: PluginId,
        name: SmName,
        pid: u32,
        start: Option<u64>,
        is_self: bool,
    ) -> u64 {
        let key = name.key();
        let (_, tok) = self.slab.insert_with(|tok| Peer {
            addr: Addr::new(name.uri(), plugin, tok, is_self),
            name,
            pid,
            start,
            conns: Vec::new(),
        });
        self.by_name.insert(key, tok);
        tok
    }

    /// A number that moves whenever the set of connections changes
    /// (lists built from the table compare it to know they are current).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Adds a connection to peer `tok`.
    pub fn attach(&mut self, tok: u64, conn: Conn) {
        let serial = conn.serial;
        self.epoch += 1;
        if let Some(p) = self.get_mut(tok) {
            p.conns.push(conn);
            self.by_serial.insert(serial, tok);
        }
    }

    /// The peer with token `tok`, if still present.
    pub fn get(&self, tok: u64) -> Option<&Peer> {
        self.slab.get(tok)
    }

    /// Mutable [`get`](Self::get).
    pub fn get_mut(&mut self, tok: u64) -> Option<&mut Peer> {
        self.slab.get_mut(tok)
    }

    /// Token of the peer named `key` (`<pid>-<instance>`).
    pub fn by_name(&self, key: &str) -> Option<u64> {
        self.by_name.get(key).copied()
    }

    /// Whether a connection of the process that started at `start` may
    /// join peer `tok` (may be its process): not if both start times are
    /// known and differ (its process exited, and a new one got its pid
    /// and so its name). A peer whose start time was not known yet learns
    /// it from the first connection that knows it: else it could never
    /// be told from a later process with its pid, for as long as it
    /// lives.
    pub fn may_join(&mut self, tok: u64, start: Option<u64>) -> bool {
        let Some(peer) = self.get_mut(tok) else {
            return true;
        };
        match (peer.start, start) {
            (Some(a), Some(b)) => a == b,
            (None, Some(b)) => {
                peer.start = Some(b);
                true
            }
            (_, None) => true,
        }
    }

    /// Token of the peer owning connection `serial`.
    pub fn by_serial(&self, serial: u64) -> Option<u64> {
        self.by_serial.get(&serial).copied()
    }

    /// Removes the peer; its slot gets a new generation.
    pub fn remove(&mut self, tok: u64) -> Option<Peer> {
        let peer = self.slab.remove(tok)?;
        self.epoch += 1;
        let key = peer.name.key();
        // A newer peer of the same name may own the name by now.
        if self.by_name.get(&key) == Some(&tok) {
            self.by_name.remove(&key);
        }
        for c in &peer.conns {
            self.by_serial.remove(&c.serial);
        }
        Some(peer)
    }

    /// Takes the connections of a peer that stays (our self entry).
    pub fn take_conns(&mut self, tok: u64) -> Option<Vec<Conn>> {
        self.epoch += 1;
        let conns = std::mem::take(&mut self.get_mut(tok)?.conns);
        for c in &conns {
            self.by_serial.remove(&c.serial);
        }
        Some(conns)
    }

    /// Number of peer slots (some may be empty): the range of
    /// [`slot_mut`](Self::slot_mut).
    pub fn slot_count(&self) -> usize {
        self.slab.slot_count()
    }

    /// The peer in slot `idx`, if any.
    pub fn slot(&self, idx: usize) -> Option<&Peer> {
        self.slab.at(idx)
    }

    /// The peer in slot `idx`, if any, mutably.
    pub fn slot_mut(&mut self, idx: usize) -> Option<&mut Peer> {
        self.slab.at_mut(idx)
    }

    /// All peers, mutably.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Peer> {
        self.slab.iter_mut().map(|(_, p)| p)
    }

    /// All peers.
    pub fn iter(&self) -> impl Iterator<Item = &Peer> {
        self.slab.iter().map(|(_, p)| p)
    }

    /// All peers with their slot index, mutably.
    pub fn iter_slots_mut(&mut self) -> impl Iterator<Item = (usize, &mut Peer)> {
        self.slab.iter_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer entry is another process's only where both start times are
    /// known and differ: an unknown one never splits a peer in two.
    #[test]
    fn a_peer_entry_is_another_process_only_if_its_start_differs() {
        let mut t = PeerTable::default();
        let name = SmName::parse("sm://123-srv").unwrap();
        let known = t.insert(PluginId(1), name.clone(), 123, Some(500), false);
        assert!(t.may_join(known, Some(500)));
        assert!(!t.may_join(known, Some(501)), "pid and name reused");
        assert!(t.may_join(known, None));
        assert_eq!(t.get(known).unwrap().start, Some(500));
        let unknown = t.insert(PluginId(1), name, 123, None, false);
        assert!(t.may_join(unknown, None));
        assert!(t.may_join(unknown, Some(501)));
        assert_eq!(
            t.by_name("123-srv"),
            Some(unknown),
            "the newer entry has the name"
        );
    }

    /// A peer whose first connection could not read its start time learns
    /// it from a later connection that could: a process that takes its
    /// pid after that is told from it.
    #[test]
    fn a_peer_entry_learns_its_start_from_a_later_connection() {
        let mut t = PeerTable::default();
        let name = SmName::parse("sm://123-srv").unwrap();
        let tok = t.insert(PluginId(1), name, 123, None, false);
        assert!(t.may_join(tok, None), "still unknown: nothing to tell");
        assert_eq!(t.get(tok).unwrap().start, None);
        assert!(t.may_join(tok, Some(500)));
        assert_eq!(t.get(tok).unwrap().start, Some(500));
        assert!(t.may_join(tok, Some(500)));
        assert!(
            !t.may_join(tok, Some(501)),
            "a later process with the pid joined an entry whose start time it could have known"
        );
    }

    #[test]
    fn parse_addresses() {
        let n = SmName::parse("sm://123-srv-a").unwrap();
        assert_eq!((n.pid, n.instance.as_str()), (123, "srv-a"));
        assert_eq!(n.uri(), "sm://123-srv-a");
        for bad in [
            "sm://",
            "sm://x-1",
            "sm://12",
            "sm://0-1",
            "sm://+1-a",
            "tcp://1-a",
            "sm://1-a/b",
        ] {
            assert!(SmName::parse(bad).is_err(), "{bad}");
        }
    }

    /// One spelling per name: a pid with a leading zero is refused, so
    /// that what parses is what `uri` prints (fuzz target
    /// `sm_handshake`: "sm://010-01" parsed as "sm://10-01").
    #[test]
    fn a_name_parses_only_in_the_spelling_it_prints() {
        for bad in ["sm://010-01", "sm://00-a", "sm://0001-a"] {
            assert!(SmName::parse(bad).is_err(), "{bad}");
        }
        for good in ["sm://10-01", "sm://1-0", "sm://4294967295-a"] {
            assert_eq!(SmName::parse(good).unwrap().uri(), good);
        }
    }
}
