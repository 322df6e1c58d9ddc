//! The memory this process exposes through na-sm: what a transfer to our
//! own process may touch.
//!
//! `process_vm_readv/writev` on our own pid reach every address of the
//! process, and the kernel checks nothing when a process targets itself
//! (no ptrace check, no Yama). A remote handle is only a peer's word: a
//! hostile server can answer with a "bulk handle" whose owner is the
//! client (or another sm instance of the client's process) and whose
//! segments point into the client's heap, and a push to it would write
//! there. So a transfer whose target process is our own is allowed only
//! inside a segment that a live handle registered with an sm plugin of
//! this process ([`Plugin::mem_register`](na_core::Plugin::mem_register))
//! exposes, with the access the transfer needs, and only through that
//! registration's own descriptor: each registration draws a secret token
//! that [`describe`] puts in every segment's key, and a piece is accepted
//! only inside a segment whose token it carries. Without the token, a
//! hostile server that knows (or guesses) where a buffer the client lent
//! to another, honest server lies could still aim the client's own push
//! at it; with it, it needs the descriptor the client gave that server.
//!
//! The set is process-wide (two engines of one process may move data
//! between each other's handles). The registration lives in the handle
//! ([`MemHandle::attach_registration`]) and takes its segments out when
//! the handle (or its deregistration) drops it, which happens before the
//! handle frees its memory; a transfer to ourselves holds the set's lock
//! from its check to its end ([`lock`]), so memory cannot be freed under
//! it.
//!
//! Tokens are drawn from the kernel's random source (a pool of them at a
//! time), never derived from anything a fork copies: a forked child draws
//! its own (its parent's pool is dropped), so the k-th registration of a
//! parent and of its child do not share a token. Registrations made
//! before a fork are dead in the child (their segments are of another
//! generation, see `sys::fork`): no descriptor from before the fork
//! reaches a child. The set's lock is held across a fork, so a child never
//! finds it locked by a thread it does not have.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use na_core::{MemHandle, NaError, PluginId, RemoteMem, Result};

use crate::sys::{fork, random};

/// One exposed segment: where it ends, what peers may do, the token of
/// the registration that exposed it, and the fork generation it was
/// registered in.
#[derive(Clone, Copy)]
struct Segment {
    end: u64,
    readable: bool,
    writable: bool,
    token: u64,
    generation: u64,
}

/// The set, and the tokens not handed out yet.
struct State {
    /// Exposed segments by (start address, registration number).
    segments: BTreeMap<(u64, u64), Segment>,
    /// Random tokens to hand out (emptied at every fork: see
    /// `hold_across_fork`).
    pool: Vec<u64>,
}

static STATE: Mutex<State> = Mutex::new(State {
    segments: BTreeMap::new(),
    pool: Vec::new(),
});
static NEXT: AtomicU64 = AtomicU64::new(0);

/// Tokens drawn from the kernel at a time.
const POOL: usize = 64;

/// What a registered handle holds: its segments leave the set with it.
struct Exposure {
    keys: Vec<(u64, u64)>,
    /// The secret every descriptor of this registration carries as key.
    token: u64,
    /// The fork generation it was made in.
    generation: u64,
}

impl Drop for Exposure {
    fn drop(&mut self) {
        let mut state = lock().0;
        for k in &self.keys {
            state.segments.remove(k);
        }
    }
}

/// The exposed segments, locked: hold it across a transfer to ourselves.
pub(crate) struct Exposed(MutexGuard<'static, State>);

/// Locks the process's exposed segments.
pub(crate) fn lock() -> Exposed {
    // The set is consistent between statements (each insert or remove is
    // whole): a panic elsewhere while it was held leaves nothing half done.
    Exposed(STATE.lock().unwrap_or_else(PoisonError::into_inner))
}

thread_local! {
    /// The lock, held by the thread that forks from just before to just
    /// after (see `sys::fork`).
    static HELD_FOR_FORK: RefCell<Option<MutexGuard<'static, State>>> = const { RefCell::new(None) };
}

/// Takes the lock before a fork (`pthread_atfork`'s prepare handler),
/// and drops the token pool: neither the parent nor the child hands out a
/// token the other has a copy of.
pub(crate) fn hold_across_fork() {
    let mut guard = lock().0;
    guard.pool.clear();
    // (A thread being torn down has no locals left: it cannot fork.)
    let _ = HELD_FOR_FORK.try_with(|h| *h.borrow_mut() = Some(guard));
}

/// Lets the lock go after a fork, in the parent and in the child.
pub(crate) fn release_after_fork() {
    let _ = HELD_FOR_FORK.try_with(|h| h.borrow_mut().take());
}

/// A fresh token: random, never 0 (the key of a descriptor made without
/// a registration), and never one drawn before a fork of this process
/// (the fork handlers empty the pool, and are installed before any
/// instance, so before any registration).
fn draw_token(state: &mut State) -> io::Result<u64> {
    loop {
        match state.pool.pop() {
            Some(0) => {}
            Some(token) => return Ok(token),
            None => {
                let mut bytes = [0u8; 8 * POOL];
                random::fill(&mut bytes)?;
                let words = bytes.chunks_exact(8).map(|c| {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(c);
                    u64::from_le_bytes(w)
                });
                state.pool.extend(words);
            }
        }
    }
}

/// The token of `plugin`'s registration of `mem`, if it has one made in
/// this process (not inherited through a fork).
fn token_of(plugin: PluginId, mem: &MemHandle) -> Option<u64> {
    let reg = mem.registration(plugin)?;
    let e = reg.downcast_ref::<Exposure>()?;
    (e.generation == fork::generation()).then_some(e.token)
}

/// Adds `mem`'s segments and attaches the registration that removes them
/// to the handle (replacing an earlier one of `plugin`, whose token it
/// keeps: a descriptor handed out before stays valid).
pub(crate) fn register(plugin: PluginId, mem: &MemHandle) -> Result<()> {
    let (readable, writable) = (mem.access().can_read(), mem.access().can_write());
    let generation = fork::generation();
    let mut keys = Vec::with_capacity(mem.segment_count());
    // Looked up before the set's lock is taken: the handle's registration
    // lock is taken before the set's where a registration is dropped
    // (`Exposure::drop` under `attach_registration`), so never after it.
    let earlier = token_of(plugin, mem);
    let token;
    {
        let mut state = lock().0;
        token = match earlier {
            Some(token) => token,
            None => draw_token(&mut state).map_err(|e| NaError::sys("drawing a registration token", e))?,
        };
        for (addr, len) in mem.segments_raw().filter(|&(_, len)| len > 0) {
            let key = (addr as u64, NEXT.fetch_add(1, Ordering::Relaxed));
            let seg = Segment {
                end: addr as u64 + len as u64,
                readable,
                writable,
                token,
                generation,
            };
            state.segments.insert(key, seg);
            keys.push(key);
        }
    }
    let exposure = Exposure {
        keys,
        token,
        generation,
    };
    mem.attach_registration(plugin, Arc::new(exposure));
    Ok(())
}

/// Describes `mem` for a peer: each segment's address and length, keyed
/// with the token of `plugin`'s registration (0 if it has none: such a
/// descriptor reaches other processes, never this one).
pub(crate) fn describe(plugin: PluginId, mem: &MemHandle) -> Result<RemoteMem> {
    RemoteMem::of_handle(mem, token_of(plugin, mem).unwrap_or(0))
}

impl Exposed {
    /// True if `addr..addr+len` lies inside one exposed segment that peers
    /// may write (`write`) or read, exposed by the registration whose
    /// token is `key`. Empty ranges touch nothing.
    pub(crate) fn covers(&self, addr: u64, len: u64, write: bool, key: u64) -> bool {
        if len == 0 {
            return true;
        }
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        // Segments of distinct handles do not overlap (each handle owns
        // its buffers), so only the segment starting last at or before
        // `addr` can hold it; a handle registered again is briefly there
        // twice, under the same start. Those entries only: a forged
        // address past every segment costs one step, not a walk of the
        // whole (process-wide, locked) set.
        let generation = fork::generation();
        let mut before = self.0.segments.range(..=(addr, u64::MAX)).rev().peekable();
        let Some(&(&(last_start, _), _)) = before.peek() else {
            return false;
        };
        before
            .take_while(|(&(start, _), _)| start == last_start)
            .inspect(|_| visited())
            .any(|(_, s)| {
                end <= s.end
                    && s.token == key
                    && s.generation == generation
                    && if write { s.writable } else { s.readable }
            })
    }
}

/// Counts the entries `covers` looked at (tests only).
#[cfg(test)]
fn visited() {
    VISITED.with(|v| v.set(v.get() + 1));
}

#[cfg(not(test))]
#[inline(always)]
fn visited() {}

#[cfg(test)]
thread_local! {
    static VISITED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
mod tests {
    use na_core::Access;

    use super::*;

    fn start(mem: &MemHandle, seg: usize) -> u64 {
        mem.segments_raw().nth(seg).unwrap().0 as u64
    }

    // The set is process-wide and tests run in parallel: each looks only
    // at its own handles' addresses.

    /// The token of plugin 1's registration of `mem`.
    fn key(mem: &MemHandle) -> u64 {
        token_of(PluginId(1), mem).unwrap()
    }

    #[test]
    fn segments_are_covered_while_their_handle_lives() {
        let mem = MemHandle::new(vec![vec![0; 100], vec![], vec![0; 50]], Access::ReadWrite);
        register(PluginId(1), &mem).unwrap();
        let (a, b, k) = (start(&mem, 0), start(&mem, 2), key(&mem));
        assert!(
            lock().covers(a, 100, true, k)
                && lock().covers(a + 99, 1, false, k)
                && lock().covers(b, 50, true, k)
        );
        assert!(!lock().covers(a, 101, false, k), "runs past the end");
        assert!(!lock().covers(u64::MAX, 2, false, k), "wraps");
        assert!(lock().covers(12345, 0, true, 0), "an empty range touches nothing");
        // Registered again: the descriptor handed out stays valid (same
        // token), and the old registration's removal leaves the new one's
        // segments.
        register(PluginId(1), &mem).unwrap();
        assert_eq!(key(&mem), k);
        assert!(lock().covers(a, 100, true, k));
        let clone = mem.clone();
        drop(mem);
        assert!(lock().covers(a, 100, true, k), "a clone keeps the handle alive");
        // Registered with a second plugin (another sm instance): its own
        // token; each covers while its registration lives.
        register(PluginId(2), &clone).unwrap();
        let k2 = token_of(PluginId(2), &clone).unwrap();
        assert_ne!(k2, k);
        clone.detach_registration(PluginId(1));
        assert!(lock().covers(a, 100, true, k2));
        assert!(!lock().covers(a, 100, true, k), "plugin 1's registration is gone");
        clone.detach_registration(PluginId(2));
        assert!(!lock().covers(a, 1, false, k2));
    }

    /// A piece must carry the token of the registration that exposes its
    /// memory: the right address with no key, a guessed key, or another
    /// handle's token is refused.
    #[test]
    fn the_key_must_be_the_registrations() {
        let lent = MemHandle::zeroed(32, Access::ReadWrite);
        let other = MemHandle::zeroed(32, Access::ReadWrite);
        register(PluginId(1), &lent).unwrap();
        register(PluginId(1), &other).unwrap();
        let (a, k, k_other) = (start(&lent, 0), key(&lent), key(&other));
        assert!(k != 0 && k_other != 0 && k != k_other);
        assert!(lock().covers(a, 32, true, k));
        for wrong in [0, 1, k_other, k ^ 1] {
            assert!(!lock().covers(a, 32, true, wrong), "key {wrong:#x} accepted");
            assert!(
                !lock().covers(a, 8, false, wrong),
                "key {wrong:#x} accepted for reading"
            );
        }
        // The descriptor carries the token; one of a handle never
        // registered carries 0.
        let d = describe(PluginId(1), &lent).unwrap();
        assert!(d.segments().iter().all(|s| s.key == k));
        let unregistered = MemHandle::zeroed(8, Access::ReadWrite);
        assert_eq!(describe(PluginId(1), &unregistered).unwrap().segments()[0].key, 0);
    }

    #[test]
    fn access_is_the_handles() {
        let ro = MemHandle::zeroed(16, Access::ReadOnly);
        let wo = MemHandle::zeroed(16, Access::WriteOnly);
        register(PluginId(1), &ro).unwrap();
        register(PluginId(1), &wo).unwrap();
        let (r, w) = (key(&ro), key(&wo));
        assert!(lock().covers(start(&ro, 0), 16, false, r) && !lock().covers(start(&ro, 0), 16, true, r));
        assert!(lock().covers(start(&wo, 0), 16, true, w) && !lock().covers(start(&wo, 0), 16, false, w));
        // Deregistering drops the plugin's registration.
        wo.detach_registration(PluginId(1));
        assert!(!lock().covers(start(&wo, 0), 16, true, w));
    }

    /// An address no segment holds costs a look at one entry (or the few
    /// of one start), however many segments are exposed: not a walk of
    /// every segment before it under the process-wide lock.
    #[test]
    fn an_uncovered_address_is_judged_by_one_entry() {
        let mems: Vec<MemHandle> = (0..2000)
            .map(|_| MemHandle::zeroed(64, Access::ReadWrite))
            .collect();
        for m in &mems {
            register(PluginId(1), m).unwrap();
        }
        let top = mems.iter().map(|m| start(m, 0)).max().unwrap();
        let k = key(&mems[0]);
        VISITED.with(|v| v.set(0));
        assert!(!lock().covers(top + (1 << 40), 8, true, k));
        assert!(
            !lock().covers(top + 64, 8, false, k),
            "just past the last segment"
        );
        // Each range costs the entries of one start: ours hold one, but
        // the set is process-wide and tests running beside this one
        // register their own handles, some under two plugins at once
        // (briefly four entries of one start): it read 5 in one run of
        // the whole binary. A walk would look at 2,000 or more.
        let visited = VISITED.with(|v| v.get());
        assert!(
            visited <= 16,
            "looked at {visited} entries for two uncovered ranges"
        );
        assert!(mems
            .iter()
            .all(|m| lock().covers(start(m, 0) + 8, 8, true, key(m))));
    }

    /// Two instances registering one handle at once (each replacing its
    /// own earlier registration, whose drop takes the set's lock under
    /// the handle's registration lock) do not deadlock.
    #[test]
    fn registering_one_handle_from_two_threads_does_not_deadlock() {
        let mem = MemHandle::zeroed(64, Access::ReadWrite);
        let (done, finished) = std::sync::mpsc::channel();
        for plugin in [PluginId(1), PluginId(2)] {
            let (mem, done) = (mem.clone(), done.clone());
            std::thread::spawn(move || {
                for _ in 0..20_000 {
                    register(plugin, &mem).unwrap();
                }
                done.send(()).unwrap();
            });
        }
        for _ in 0..2 {
            finished
                .recv_timeout(std::time::Duration::from_secs(20))
                .expect("registering from two threads deadlocked");
        }
    }
}
