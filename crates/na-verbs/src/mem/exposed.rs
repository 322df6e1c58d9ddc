//! The memory this plugin exposes, and transfers whose remote side is our
//! own: a descriptor naming this plugin's address.
//!
//! A remote handle is only a peer's word. A hostile server can answer
//! with a "bulk handle" whose owner is the client's own address; a
//! transfer with it used to go over a loopback connection to ourselves,
//! where the device checks only the rkey (guessable on rxe), so a push
//! could land in, or a pull read from, memory the client exposed to
//! another peer (a confused deputy). So a transfer to our own address is
//! served here, by a copy in memory and never over a connection, and only
//! if each piece lies inside one segment a live handle exposed through
//! this plugin ([`VerbsPlugin::describe`]) under the very key the piece
//! names, with the access the transfer needs (remote read for a get,
//! remote write for a put), and that registration is still valid.
//! Otherwise the whole batch fails with [`NaError::Rma`] (kind
//! `PermissionDenied`) and nothing moves, counted in
//! `PluginStats::self_rma_refused` and logged at the 1st, 2nd, 4th...
//! refusal (a hostile server answering every call with a forged handle
//! cannot flood the log).
//!
//! The key is the registration's rkey (low 32 bits, all a peer's device
//! uses) and a secret drawn for the exposure (high 32 bits, which peers
//! ignore). rkeys are guessable (rxe numbers them), so without the secret
//! a hostile server that guessed where, and under which rkey, a buffer
//! the client lent to another server lies could still aim the client's
//! own push at it; with it, it needs the descriptor the client gave that
//! server. Secrets are SipHash of a serial under the keys of a
//! [`RandomState`] (drawn from the operating system's random source).
//!
//! The set lives as long as the plugin; each exposed registration takes
//! its segments out when it is dropped (with its handle, or a new
//! `mem_register`), which happens before the handle frees its memory
//! (`MemHandle` drops registrations first). A copy holds the set's lock
//! from its check to its end, and the segments leave the set under that
//! lock, so memory cannot be freed under a copy, nor a copy begin once
//! its segments are out. The registrations they hold (the last holders
//! of the exposed ones) are dropped after the lock is released, so the
//! `ibv_dereg_mr` of a large registration stalls no copy or `describe`;
//! until it returns the memory is still registered, and the handle frees
//! it only afterwards.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use na_core::{Addr, Completion, NaError, Result, Rma, RmaDir};

use super::SegmentRegs;
use crate::addr::canonical_sock;
use crate::plugin::VerbsPlugin;

/// Bytes copied at a time (the bounce buffer's size).
const CHUNK: usize = 1 << 20;

/// One exposed segment.
struct Entry {
    /// The registration that exposed it (the exposure's serial).
    serial: u64,
    /// Its whole key, rkey and secret (see the module docs).
    key: u64,
    /// The segment's bytes: `[addr, end)`.
    addr: u64,
    end: u64,
    readable: bool,
    writable: bool,
    /// The exposed registrations of its handle, and which one is this.
    regs: Arc<SegmentRegs>,
    seg: usize,
}

/// Exposed segments by rkey (a live registration's rkey is unique on its
/// device).
#[derive(Default)]
pub(crate) struct ExposedSet {
    by_rkey: HashMap<u32, Entry>,
    next_serial: u64,
    /// Keys of the secrets' hash (random per set).
    secrets: RandomState,
}

/// The set shared by a plugin and the registrations it exposed.
pub(crate) type SharedSet = Arc<Mutex<ExposedSet>>;

fn lock(set: &SharedSet) -> MutexGuard<'_, ExposedSet> {
    set.lock().unwrap_or_else(|e| e.into_inner())
}

/// What an exposed registration holds: its segments leave the set with it.
pub(crate) struct Exposure {
    set: SharedSet,
    serial: u64,
    secret: u32,
    rkeys: Vec<u32>,
}

impl Exposure {
    /// The key a descriptor gives for a segment of rkey `rkey`.
    pub(crate) fn key(&self, rkey: u32) -> u64 {
        u64::from(self.secret) << 32 | u64::from(rkey)
    }
}

impl Drop for Exposure {
    /// Takes the segments out of the set under its lock (a copy in
    /// progress holds it, so this waits for its end, and no later copy
    /// finds them), then drops them after unlocking: the last of them
    /// holds the exposed registrations, whose `ibv_dereg_mr` must not
    /// stall `rma_self` and `describe`. The memory stays registered until
    /// then, and allocated until this returns (see the module docs).
    fn drop(&mut self) {
        let mut set = lock(&self.set);
        let out: Vec<Entry> = self
            .rkeys
            .iter()
            .filter_map(|k| match set.by_rkey.get(k) {
                Some(e) if e.serial == self.serial => set.by_rkey.remove(k),
                _ => None,
            })
            .collect();
        drop(set);
        drop(out);
    }
}

/// Enters the segments `segs` (address and length of each, in order) of a
/// handle of access `readable`/`writable`, exposed as `regs`.
pub(crate) fn enter(
    set: &SharedSet,
    segs: impl Iterator<Item = (usize, usize)>,
    readable: bool,
    writable: bool,
    regs: &Arc<SegmentRegs>,
) -> Exposure {
    let mut s = lock(set);
    s.next_serial += 1;
    let serial = s.next_serial;
    let mut h = s.secrets.build_hasher();
    h.write_u64(serial);
    let secret = h.finish() as u32;
    let mut rkeys = Vec::new();
    for (seg, ((addr, len), r)) in segs.zip(regs.iter()).enumerate() {
        let Some(r) = r else { continue };
        let rkey = r.region().rkey();
        s.by_rkey.insert(
            rkey,
            Entry {
                serial,
                key: u64::from(secret) << 32 | u64::from(rkey),
                addr: addr as u64,
                end: addr as u64 + len as u64,
                readable,
                writable,
                regs: Arc::clone(regs),
                seg,
            },
        );
        rkeys.push(rkey);
    }
    Exposure {
        set: Arc::clone(set),
        serial,
        secret,
        rkeys,
    }
}

/// One checked piece of a transfer to ourselves.
struct Piece<'e> {
    entry: &'e Entry,
    addr: u64,
    len: u64,
}

impl ExposedSet {
    /// The entry exposing `[addr, addr + len)` under `key` with the
    /// access `dir` needs, if it is live and valid.
    fn covering(&self, key: u64, addr: u64, len: u64, dir: RmaDir) -> Option<&Entry> {
        let e = self.by_rkey.get(&(key as u32)).filter(|e| e.key == key)?;
        let allowed = match dir {
            RmaDir::Get => e.readable,
            RmaDir::Put => e.writable,
        };
        let inside = addr >= e.addr && addr.checked_add(len).is_some_and(|end| end <= e.end);
        let valid = e.regs[e.seg].as_ref().is_some_and(|r| r.is_valid_now());
        (allowed && inside && valid).then_some(e)
    }
}

/// The error for a transfer to ourselves outside what we expose, logged
/// as a warning when `warn` (the 1st, 2nd, 4th... refusal: see
/// `PluginStats::refuse_self_rma`; `refused` is their count), else at
/// debug level.
fn refused(dest: &Addr, o: &Rma<'_>, warn: bool, refused: u64) -> NaError {
    const WHAT: &str = "verbs: refused a transfer to this process outside the memory it exposes \
                        (forged or stale handle; warned at the 1st, 2nd, 4th... of them, all counted in \
                        PluginStats::self_rma_refused)";
    if warn {
        tracing::warn!(op = o.dir.name(), len = o.len, refused, "{WHAT}");
    } else {
        tracing::debug!(op = o.dir.name(), len = o.len, refused, "{WHAT}");
    }
    NaError::Rma {
        op: o.dir.name(),
        len: o.len,
        peer: dest.uri().into(),
        source: io::Error::new(
            io::ErrorKind::PermissionDenied,
            "the remote handle names this process but no live handle exposed that memory \
             under that key with that access (forged or stale handle); nothing moved",
        ),
    }
}

/// Moves one checked piece between `o.local` at `local_offset` and our own
/// exposed memory.
fn copy_piece(o: &Rma<'_>, local_offset: u64, p: &Piece<'_>, buf: &mut [u8]) -> Result<()> {
    let reg = p.entry.regs[p.entry.seg]
        .as_ref()
        .expect("entries name present registrations");
    let region = reg.region();
    let base = (p.addr - region.addr()) as usize;
    let mut done = 0usize;
    while (done as u64) < p.len {
        let n = (p.len as usize - done).min(buf.len());
        let chunk = &mut buf[..n];
        let local_at = local_offset + done as u64;
        let mapped = |e: crate::error::VerbsError| NaError::from(e);
        match o.dir {
            RmaDir::Get => {
                region.read_at(base + done, chunk).map_err(mapped)?;
                o.local.write_at(local_at, chunk)?;
            }
            RmaDir::Put => {
                o.local.read_at(local_at, chunk)?;
                region.write_at(base + done, chunk).map_err(mapped)?;
            }
        }
        done += n;
    }
    Ok(())
}

impl VerbsPlugin {
    /// Whether `dest` names this plugin itself: its own address, or a
    /// peer whose address is ours (a lookup of our own URI).
    ///
    /// Compared in canonical form (`addr::canonical_sock`, on both sides
    /// although parsing and `self_key` canonicalise already): our address
    /// spelt as an IPv4-mapped IPv6 one (`[::ffff:10.77.0.1]:45123`) is
    /// ours too, and must never be taken for a peer's, whose transfers go
    /// by RDMA where only the rkey is checked. Other spellings reach
    /// another listener or none: RDMA CM routes by IP, and the plugin
    /// binds one device IP, never a wildcard (a loopback IP does not
    /// reach it).
    pub(crate) fn is_own(&self, dest: &Addr) -> bool {
        if dest.plugin() != self.id {
            return false;
        }
        if dest.is_self() {
            return true;
        }
        let own = canonical_sock(self.self_key);
        self.peer_of(dest)
            .is_ok_and(|p| canonical_sock(self.peers[p].key) == own)
    }

    /// Serves a checked batch whose remote side is our own (see the
    /// module docs): every piece of every transfer is checked before any
    /// byte moves; then each is copied and completes at once.
    pub(crate) fn rma_self(&mut self, dest: &Addr, ops: &[Rma<'_>]) -> Result<()> {
        let set = Arc::clone(&self.exposed);
        let guard = lock(&set);
        let mut plans: Vec<Vec<Piece<'_>>> = Vec::with_capacity(ops.len());
        for o in ops {
            let mut pieces = Vec::new();
            let mut ok = true;
            o.remote
                .for_each_piece(o.remote_offset, o.len, |seg, addr, len| {
                    match guard.covering(seg.key, addr, len, o.dir) {
                        Some(entry) if ok => pieces.push(Piece { entry, addr, len }),
                        _ => ok = false,
                    }
                })?;
            if !ok {
                let log = self.stats.refuse_self_rma();
                return Err(refused(dest, o, log, self.stats.self_rma_refused));
            }
            plans.push(pieces);
        }
        let mut buf = vec![0u8; CHUNK.min(ops.iter().map(|o| o.len as usize).max().unwrap_or(0))];
        for (o, pieces) in ops.iter().zip(&plans) {
            let mut at = o.local_offset;
            for p in pieces {
                copy_piece(o, at, p, &mut buf)?;
                at += p.len;
            }
        }
        drop(plans);
        drop(guard);
        for o in ops {
            match o.dir {
                RmaDir::Put => self.stats.put_bytes += o.len,
                RmaDir::Get => self.stats.get_bytes += o.len,
            }
            self.completions.push_back(Completion::done(o.op, o.dir.kind()));
        }
        Ok(())
    }
}
