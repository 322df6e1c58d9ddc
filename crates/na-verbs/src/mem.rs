//! Memory registration and descriptors with per-segment rkeys.
//!
//! A handle gets two kinds of registration, because they must live for
//! different times:
//!
//! * **Local** ones, for the RMA operations this process starts: through
//!   the registration cache (`na-regcache` with the `ibv_reg_mr`
//!   registrar), so a hit costs no verbs call, and with local rights only
//!   (no rkey grants a peer anything). The cache keeps them after the
//!   handle is gone, which is harmless: only our own work requests use
//!   their lkeys.
//! * **Exposed** ones, made when the handle is first described to a peer:
//!   with the remote rights of its access mode, never cached or shared
//!   ([`Cache::get_unshared`]), and deregistered when the handle (and
//!   every transfer of ours still using it) is gone. A cached registration
//!   with remote rights would outlive the handle: a peer that kept the
//!   descriptor could go on writing into the freed buffer's next owner.
//!   So memory is exposed exactly as long as its handle lives; a handle
//!   kept and described again costs nothing more.
//!
//! Describing a handle and every RMA check each registration's validity
//! flag (a few atomic loads): a registration the cache's monitor invalidated
//! (its pages were unmapped or remapped) is never used for a new
//! operation. A handle never described is then registered again (no peer
//! holds its keys); a described one is an error until the caller
//! registers and describes it again. Work requests that wait in the send
//! queue's backlog are checked again when they are posted: an operation
//! whose registration was invalidated meanwhile fails rather than move the
//! bytes of pages its handle no longer has.

use std::sync::{Arc, Mutex};

use na_core::{Access, MemHandle, NaError, RemoteMem, RemoteSegment, Result};
use na_regcache::{Access as RegAccess, Cache, CacheStats, Registration};

use crate::error::VerbsError;
use crate::plugin::VerbsPlugin;
use crate::sys::{IbvRegistrar, Sge};

mod exposed;

pub(crate) use exposed::SharedSet as ExposedSet;

/// One registration per segment of a handle (`None` for an empty one).
type SegmentRegs = Vec<Option<Registration<IbvRegistrar>>>;

/// The registrations of one memory handle.
pub(crate) struct MemReg {
    /// Local rights, through the cache: the lkeys of our own transfers.
    regs: SegmentRegs,
    /// Remote rights, made on the first describe (see the module docs).
    exposed: Mutex<Option<Arc<SegmentRegs>>>,
    /// The exposed segments' place in the plugin's set (see `exposed`):
    /// declared after `exposed`, so they leave the set as the handle's
    /// registrations go.
    exposure: Mutex<Option<exposed::Exposure>>,
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

    /// The exposed registrations, if the handle was described.
    fn exposed(&self) -> Option<Arc<SegmentRegs>> {
        self.exposed.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// `Ok` if every registration of the handle (local and exposed) is
    /// still valid; else the error naming the first one invalidated.
    pub(crate) fn check_valid(&self) -> Result<()> {
        let exposed = self.exposed();
        let all = self.regs.iter().chain(exposed.iter().flat_map(|e| e.iter()));
        check_valid(all.flatten())
    }
}

/// An error naming the first registration the monitor invalidated.
fn check_valid<'a>(mut regs: impl Iterator<Item = &'a Registration<IbvRegistrar>>) -> Result<()> {
    // `is_valid_now`: an unmap that returned before this call may still
    // be being applied by the monitor's reader; wait for it (no system
    // call: a fence and two loads when nothing is in flight).
    match regs.find(|r| !r.is_valid_now()) {
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

/// Rights of a handle's local registration: the device writes into it for
/// a get (RDMA READ) unless the handle is read-only.
fn local_access(a: Access) -> RegAccess {
    match a {
        Access::ReadOnly => RegAccess::LOCAL_READ,
        Access::WriteOnly | Access::ReadWrite => RegAccess::LOCAL_WRITE,
    }
}

/// Rights of a handle's exposed registration: what its access mode grants
/// a peer (remote write needs local write too).
fn remote_access(a: Access) -> RegAccess {
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
    /// Registers every segment of `mem` through the cache (local rights)
    /// and attaches the result.
    pub(crate) fn register_mem(&self, mem: &MemHandle) -> Result<Arc<MemReg>> {
        let regs = self.register_segments(mem, local_access(mem.access()), |addr, len, a| {
            self.cache.get(addr, len, a)
        })?;
        let reg = Arc::new(MemReg {
            regs,
            exposed: Mutex::new(None),
            exposure: Mutex::new(None),
        });
        reg.check_valid()?;
        mem.attach_registration(self.id, Arc::clone(&reg) as Arc<dyn std::any::Any + Send + Sync>);
        Ok(reg)
    }

    /// One registration per non-empty segment of `mem`, made by `get`.
    fn register_segments(
        &self,
        mem: &MemHandle,
        access: RegAccess,
        get: impl Fn(usize, usize, RegAccess) -> na_regcache::Result<Registration<IbvRegistrar>>,
    ) -> Result<SegmentRegs> {
        mem.segments_raw()
            .map(|(addr, len)| {
                if len == 0 {
                    return Ok(None);
                }
                get(addr, len, access).map(Some).map_err(|e| NaError::Plugin {
                    plugin: "verbs",
                    message: format!(
                        "registering {len} bytes at {addr:#x}: {}",
                        na_core::ErrorChain(&e)
                    ),
                })
            })
            .collect()
    }

    /// The exposed registrations of `mem` (registration `reg`), made now
    /// if it was never described.
    fn exposed_regs(&self, mem: &MemHandle, reg: &MemReg) -> Result<Arc<SegmentRegs>> {
        let mut slot = reg.exposed.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = slot.as_ref() {
            return Ok(Arc::clone(e));
        }
        let regs = self.register_segments(mem, remote_access(mem.access()), |addr, len, a| {
            self.cache.get_unshared(addr, len, a)
        })?;
        check_valid(regs.iter().flatten())?;
        let regs = Arc::new(regs);
        let access = mem.access();
        let entered = exposed::enter(
            &self.exposed,
            mem.segments_raw(),
            access.can_read(),
            access.can_write(),
            &regs,
        );
        *reg.exposure.lock().unwrap_or_else(|e| e.into_inner()) = Some(entered);
        *slot = Some(Arc::clone(&regs));
        Ok(regs)
    }

    /// The registration this plugin attached to the handle, if any.
    fn attached(&self, mem: &MemHandle) -> Option<Arc<MemReg>> {
        mem.registration(self.id)
            .and_then(|r| r.downcast::<MemReg>().ok())
    }

    /// The handle's registration with this plugin, if it has one that is
    /// still valid.
    pub(crate) fn valid_registration(&self, mem: &MemHandle) -> Option<Arc<MemReg>> {
        self.attached(mem).filter(|r| r.check_valid().is_ok())
    }

    /// The handle's registration with this plugin (registering it now if
    /// it has none), after checking every validity flag.
    ///
    /// One the monitor invalidated (the handle's pages were discarded or
    /// remapped, or it was made while its range was settling after a
    /// `madvise` and that time ended) is replaced by a fresh one of the
    /// pages mapped now, if the handle was never described: then no peer
    /// holds its keys, and the old one would move the bytes of pages the
    /// handle no longer has. A described one stays an error, since
    /// replacing it would revoke the keys peers hold; the caller registers
    /// it again (`mem_register`) and describes it anew.
    pub(crate) fn registration(&self, mem: &MemHandle) -> Result<Arc<MemReg>> {
        match self.attached(mem) {
            Some(r) => match r.check_valid() {
                Ok(()) => Ok(r),
                Err(e) if r.exposed().is_some() => Err(e),
                Err(e) => {
                    tracing::debug!(reason = %na_core::ErrorChain(&e), "verbs: registering a never-described handle again");
                    self.register_mem(mem)
                }
            },
            None => self.register_mem(mem),
        }
    }

    /// The descriptor of `mem`: each segment with the rkey of its exposed
    /// registration (see the module docs), and in the key's high 32 bits
    /// the exposure's secret (peers ignore it; see `exposed`).
    pub(crate) fn describe(&self, mem: &MemHandle) -> Result<RemoteMem> {
        let reg = self.registration(mem)?;
        let exposed = self.exposed_regs(mem, &reg)?;
        let exposure = reg.exposure.lock().unwrap_or_else(|e| e.into_inner());
        let exposure = exposure.as_ref().expect("exposed_regs entered the exposure");
        let segs = mem
            .segments_raw()
            .zip(exposed.iter())
            .map(|((addr, len), r)| RemoteSegment {
                addr: addr as u64,
                len: len as u64,
                key: r.as_ref().map_or(0, |r| exposure.key(r.region().rkey())),
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
