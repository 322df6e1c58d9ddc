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
//! exposes, with the access the transfer needs.
//!
//! The set is process-wide (two engines of one process may move data
//! between each other's handles). The registration lives in the handle
//! ([`MemHandle::attach_registration`]) and takes its segments out when
//! the handle (or its deregistration) drops it, which happens before the
//! handle frees its memory; a transfer to ourselves holds the set's lock
//! from its check to its end ([`lock`]), so memory cannot be freed under
//! it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use na_core::{MemHandle, PluginId};

/// Exposed segments by (start address, registration number): end address
/// and whether peers may read and write the segment.
type Segments = BTreeMap<(u64, u64), (u64, bool, bool)>;

static SEGMENTS: Mutex<Segments> = Mutex::new(BTreeMap::new());
static NEXT: AtomicU64 = AtomicU64::new(0);

/// What a registered handle holds: its segments leave the set with it.
struct Exposure {
    keys: Vec<(u64, u64)>,
}

impl Drop for Exposure {
    fn drop(&mut self) {
        let mut map = lock().0;
        for k in &self.keys {
            map.remove(k);
        }
    }
}

/// The exposed segments, locked: hold it across a transfer to ourselves.
pub(crate) struct Exposed(MutexGuard<'static, Segments>);

/// Locks the process's exposed segments.
pub(crate) fn lock() -> Exposed {
    // The map is consistent between statements (each insert or remove is
    // whole): a panic elsewhere while it was held leaves nothing half done.
    Exposed(SEGMENTS.lock().unwrap_or_else(PoisonError::into_inner))
}

/// Adds `mem`'s segments and attaches the registration that removes them
/// to the handle (replacing an earlier one of `plugin`).
pub(crate) fn register(plugin: PluginId, mem: &MemHandle) {
    let (readable, writable) = (mem.access().can_read(), mem.access().can_write());
    let mut keys = Vec::with_capacity(mem.segment_count());
    {
        let mut map = lock().0;
        for (addr, len) in mem.segments_raw().filter(|&(_, len)| len > 0) {
            let key = (addr as u64, NEXT.fetch_add(1, Ordering::Relaxed));
            map.insert(key, (addr as u64 + len as u64, readable, writable));
            keys.push(key);
        }
    }
    mem.attach_registration(plugin, Arc::new(Exposure { keys }));
}

impl Exposed {
    /// True if `addr..addr+len` lies inside one exposed segment that peers
    /// may write (`write`) or read. Empty ranges touch nothing.
    pub(crate) fn covers(&self, addr: u64, len: u64, write: bool) -> bool {
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
        let mut before = self.0.range(..=(addr, u64::MAX)).rev().peekable();
        let Some(&(&(last_start, _), _)) = before.peek() else {
            return false;
        };
        before
            .take_while(|(&(start, _), _)| start == last_start)
            .inspect(|_| visited())
            .any(|(_, &(seg_end, readable, writable))| {
                end <= seg_end && if write { writable } else { readable }
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

    #[test]
    fn segments_are_covered_while_their_handle_lives() {
        let mem = MemHandle::new(vec![vec![0; 100], vec![], vec![0; 50]], Access::ReadWrite);
        register(PluginId(1), &mem);
        let (a, b) = (start(&mem, 0), start(&mem, 2));
        assert!(lock().covers(a, 100, true) && lock().covers(a + 99, 1, false) && lock().covers(b, 50, true));
        assert!(!lock().covers(a, 101, false), "runs past the end");
        assert!(!lock().covers(u64::MAX, 2, false), "wraps");
        assert!(lock().covers(12345, 0, true), "an empty range touches nothing");
        // Registered again (the descriptor handed out stays valid): the
        // old registration's removal leaves the new one's segments.
        register(PluginId(1), &mem);
        assert!(lock().covers(a, 100, true));
        let clone = mem.clone();
        drop(mem);
        assert!(lock().covers(a, 100, true), "a clone keeps the handle alive");
        // Registered with a second plugin (another sm instance): covered
        // until both registrations are gone.
        register(PluginId(2), &clone);
        clone.detach_registration(PluginId(1));
        assert!(lock().covers(a, 100, true));
        clone.detach_registration(PluginId(2));
        assert!(!lock().covers(a, 1, false));
    }

    #[test]
    fn access_is_the_handles() {
        let ro = MemHandle::zeroed(16, Access::ReadOnly);
        let wo = MemHandle::zeroed(16, Access::WriteOnly);
        register(PluginId(1), &ro);
        register(PluginId(1), &wo);
        assert!(lock().covers(start(&ro, 0), 16, false) && !lock().covers(start(&ro, 0), 16, true));
        assert!(lock().covers(start(&wo, 0), 16, true) && !lock().covers(start(&wo, 0), 16, false));
        // Deregistering drops the plugin's registration.
        wo.detach_registration(PluginId(1));
        assert!(!lock().covers(start(&wo, 0), 16, true));
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
            register(PluginId(1), m);
        }
        let top = mems.iter().map(|m| start(m, 0)).max().unwrap();
        VISITED.with(|v| v.set(0));
        assert!(!lock().covers(top + (1 << 40), 8, true));
        assert!(!lock().covers(top + 64, 8, false), "just past the last segment");
        let visited = VISITED.with(|v| v.get());
        assert!(
            visited <= 4,
            "looked at {visited} entries for two uncovered ranges"
        );
        assert!(mems.iter().all(|m| lock().covers(start(m, 0) + 8, 8, true)));
    }
}
