//! Memory registration through the registration cache (`na-regcache` with
//! the `ibv_reg_mr` registrar), and descriptors with per-segment rkeys.
//!
//! `mem_register` registers every segment of a handle through the cache
//! (a hit costs no verbs call) and attaches the registrations to the
//! handle. Describing a handle and every RMA check each registration's
//! validity flag (one atomic load): a registration the cache's monitor
//! invalidated (its pages were unmapped or remapped) is never used.

use std::sync::Arc;

use na_core::{Access, MemHandle, NaError, RemoteMem, RemoteSegment, Result};
use na_regcache::{Access as RegAccess, Cache, CacheStats, Registration};

use crate::error::VerbsError;
use crate::plugin::VerbsPlugin;
use crate::sys::{IbvRegistrar, Sge};

/// The registrations of one memory handle, one per non-empty segment.
pub(crate) struct MemReg {
    regs: Vec<Option<Registration<IbvRegistrar>>>,
}

impl MemReg {
    /// Index of the registration that covers `[addr, addr+len)`.
    pub fn find(&self, addr: usize, len: usize) -> Option<usize> {
        self.regs.iter().position(|r| {
            r.as_ref()
                .is_some_and(|r| r.addr() <= addr && addr + len <= r.addr() + r.len())
        })
    }

    /// A scatter/gather entry for a piece inside registration `i`.
    pub fn sge(&self, i: usize, addr: u64, len: u64) -> std::result::Result<Sge, VerbsError> {
        let mr = self.regs[i]
            .as_ref()
            .expect("pieces only name present registrations")
            .region();
        mr.sge((addr - mr.addr()) as usize, len as usize)
    }

    fn check_valid(&self) -> Result<()> {
        // `is_valid_now`: an unmap that returned before this call may still
        // be being applied by the monitor's reader; wait for it (no system
        // call: a fence and two loads when nothing is in flight).
        match self.regs.iter().flatten().find(|r| !r.is_valid_now()) {
            None => Ok(()),
            Some(r) => Err(NaError::Plugin {
                plugin: "verbs",
                message: format!(
                    "the registration of {:#x}+{} was invalidated (its memory was unmapped or \
                     remapped since it was registered); register the handle again",
                    r.addr(),
                    r.len()
                ),
            }),
        }
    }
}

/// Registration access rights for a handle's access mode.
fn reg_access(a: Access) -> RegAccess {
    match a {
        Access::ReadOnly => RegAccess::REMOTE_READ,
        Access::WriteOnly => RegAccess::LOCAL_WRITE | RegAccess::REMOTE_WRITE,
        Access::ReadWrite => RegAccess::LOCAL_WRITE | RegAccess::REMOTE_WRITE | RegAccess::REMOTE_READ,
    }
}

/// A handle on a plugin's registration cache, for reading its counters
/// after the plugin moved into an endpoint.
#[derive(Clone)]
pub struct CacheStatsHandle(pub(crate) Arc<Cache<IbvRegistrar>>);

impl CacheStatsHandle {
    /// Hits, misses, evictions, invalidations, entries, bytes registered...
    pub fn stats(&self) -> CacheStats {
        self.0.stats()
    }

    /// The monitor keeping the cache coherent (`uffd`, `alloc`, `none`, `disabled`).
    pub fn monitor(&self) -> &'static str {
        self.0.monitor_name()
    }
}

impl VerbsPlugin {
    /// Registers every segment of `mem` through the cache and attaches the result.
    pub(crate) fn register_mem(&self, mem: &MemHandle) -> Result<Arc<MemReg>> {
        let access = reg_access(mem.access());
        let mut regs = Vec::with_capacity(mem.segment_count());
        for (addr, len) in mem.segments_raw() {
            if len == 0 {
                regs.push(None);
                continue;
            }
            let r = self.cache.get(addr, len, access).map_err(|e| NaError::Plugin {
                plugin: "verbs",
                message: format!("registering {len} bytes at {addr:#x}: {e}: {}", error_chain(&e)),
            })?;
            regs.push(Some(r));
        }
        let reg = Arc::new(MemReg { regs });
        reg.check_valid()?;
        mem.attach_registration(self.id, Arc::clone(&reg) as Arc<dyn std::any::Any + Send + Sync>);
        Ok(reg)
    }

    /// The handle's registration with this plugin (registering it now if
    /// it has none), after checking every validity flag.
    pub(crate) fn registration(&self, mem: &MemHandle) -> Result<Arc<MemReg>> {
        match mem
            .registration(self.id)
            .and_then(|r| r.downcast::<MemReg>().ok())
        {
            Some(r) => {
                r.check_valid()?;
                Ok(r)
            }
            None => self.register_mem(mem),
        }
    }

    /// The descriptor of `mem`: each segment with the rkey of its registration.
    pub(crate) fn describe(&self, mem: &MemHandle) -> Result<RemoteMem> {
        let reg = self.registration(mem)?;
        let segs = mem
            .segments_raw()
            .zip(&reg.regs)
            .map(|((addr, len), r)| RemoteSegment {
                addr: addr as u64,
                len: len as u64,
                key: r.as_ref().map_or(0, |r| u64::from(r.region().rkey())),
            })
            .collect();
        RemoteMem::new(segs, mem.access())
    }

    /// A handle for reading the registration cache's counters.
    pub fn cache_stats_handle(&self) -> CacheStatsHandle {
        CacheStatsHandle(Arc::clone(&self.cache))
    }

    /// The registration cache's counters.
    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = Vec::new();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push(s.to_string());
        cur = s.source();
    }
    out.join(": ")
}
