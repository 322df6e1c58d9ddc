//! The memory this process exposes through the plugin: what a transfer to
//! our own address may touch.
//!
//! `process_vm_readv/writev` on our own pid reach every address of the
//! process, and the kernel checks nothing when a process targets itself
//! (no ptrace check, no Yama). A remote handle that names our own address
//! is only a peer's word: a hostile server can answer with a "bulk handle"
//! whose owner is the client and whose segments point into the client's
//! heap, and a push to it would write there. So a transfer to ourselves is
//! allowed only inside a segment that a live handle registered with this
//! plugin ([`Plugin::mem_register`](na_core::Plugin::mem_register))
//! exposes, with the access the transfer needs. The registration lives in
//! the handle ([`MemHandle::attach_registration`]) and takes its segments
//! out of the set when the handle (or its deregistration) drops it, so
//! memory freed and reused is never reachable through a stale descriptor.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use na_core::{MemHandle, PluginId};

/// Exposed segments by (start address, registration number): end address
/// and whether peers may read and write the segment.
type Segments = BTreeMap<(u64, u64), (u64, bool, bool)>;

/// The segments of every live handle registered with one plugin.
#[derive(Debug, Default)]
pub(crate) struct ExposedSegments {
    map: Arc<Mutex<Segments>>,
    next: u64,
}

/// What a registered handle holds: its segments leave the set with it.
struct Exposure {
    map: Weak<Mutex<Segments>>,
    keys: Vec<(u64, u64)>,
}

impl Drop for Exposure {
    fn drop(&mut self) {
        if let Some(map) = self.map.upgrade() {
            let mut map = lock(&map);
            for k in &self.keys {
                map.remove(k);
            }
        }
    }
}

fn lock(map: &Mutex<Segments>) -> MutexGuard<'_, Segments> {
    // The map is consistent between statements (each insert or remove is
    // whole): a panic elsewhere while it was held leaves nothing half done.
    map.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ExposedSegments {
    /// Adds `mem`'s segments and attaches the registration that removes
    /// them to the handle (replacing an earlier one of this plugin).
    pub(crate) fn register(&mut self, plugin: PluginId, mem: &MemHandle) {
        let (readable, writable) = (mem.access().can_read(), mem.access().can_write());
        let mut keys = Vec::with_capacity(mem.segment_count());
        {
            let mut map = lock(&self.map);
            for (addr, len) in mem.segments_raw().filter(|&(_, len)| len > 0) {
                let key = (addr as u64, self.next);
                self.next += 1;
                map.insert(key, (addr as u64 + len as u64, readable, writable));
                keys.push(key);
            }
        }
        let exposure = Exposure {
            map: Arc::downgrade(&self.map),
            keys,
        };
        mem.attach_registration(plugin, Arc::new(exposure));
    }

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
        // its buffers), but a handle registered again is briefly there
        // twice: look at every segment starting at or before `addr`.
        lock(&self.map).range(..=(addr, u64::MAX)).rev().any(
            |(&(start, _), &(seg_end, readable, writable))| {
                start <= addr && end <= seg_end && if write { writable } else { readable }
            },
        )
    }

    /// Number of exposed segments.
    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.map).len()
    }
}

#[cfg(test)]
mod tests {
    use na_core::Access;

    use super::*;

    fn start(mem: &MemHandle, seg: usize) -> u64 {
        mem.segments_raw().nth(seg).unwrap().0 as u64
    }

    #[test]
    fn segments_are_covered_while_their_handle_lives() {
        let mut set = ExposedSegments::default();
        let mem = MemHandle::new(vec![vec![0; 100], vec![], vec![0; 50]], Access::ReadWrite);
        set.register(PluginId(1), &mem);
        assert_eq!(set.len(), 2, "empty segments are left out");
        let (a, b) = (start(&mem, 0), start(&mem, 2));
        assert!(set.covers(a, 100, true) && set.covers(a + 99, 1, false) && set.covers(b, 50, true));
        assert!(!set.covers(a, 101, false), "runs past the end");
        assert!(!set.covers(a.wrapping_sub(1), 2, false), "starts before");
        assert!(!set.covers(u64::MAX, 2, false), "wraps");
        assert!(set.covers(12345, 0, true), "an empty range touches nothing");
        // Registered again (the descriptor handed out stays valid): the
        // old registration's removal leaves the new one's segments.
        set.register(PluginId(1), &mem);
        assert!(set.covers(a, 100, true));
        assert_eq!(set.len(), 2);
        let clone = mem.clone();
        drop(mem);
        assert!(set.covers(a, 100, true), "a clone keeps the handle alive");
        drop(clone);
        assert_eq!(set.len(), 0);
        assert!(!set.covers(a, 1, false));
    }

    #[test]
    fn access_is_the_handles() {
        let mut set = ExposedSegments::default();
        let ro = MemHandle::zeroed(16, Access::ReadOnly);
        let wo = MemHandle::zeroed(16, Access::WriteOnly);
        set.register(PluginId(1), &ro);
        set.register(PluginId(1), &wo);
        assert!(set.covers(start(&ro, 0), 16, false) && !set.covers(start(&ro, 0), 16, true));
        assert!(set.covers(start(&wo, 0), 16, true) && !set.covers(start(&wo, 0), 16, false));
        // Deregistering drops the plugin's registration.
        wo.detach_registration(PluginId(1));
        assert!(!set.covers(start(&wo, 0), 16, true));
        assert_eq!(set.len(), 1);
    }
}
