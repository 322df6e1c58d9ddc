//! Shared rig of the corruption suite: a cache over the io_uring registrar
//! (real long-term pins) with PFN tracking, and a transfer that writes
//! through the registration and checks what arrived.
#![allow(dead_code)]

pub mod cache_rig;
pub mod forward;
pub mod gated;
pub mod scenarios;
pub mod sys;

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

use na_regcache::{Access, Cache, CacheConfig, Consistency, MonitorChoice, UringRegistrar};

/// A registrar that registers nothing: for tests of the cache and its
/// monitors themselves.
pub struct NoopRegistrar;

impl na_regcache::Registrar for NoopRegistrar {
    type Region = ();
    type Error = io::Error;
    fn register(&self, _: usize, _: usize, _: Access) -> io::Result<()> {
        Ok(())
    }
    fn deregister(&self, _: ()) -> io::Result<()> {
        Ok(())
    }
}

/// What a transfer through the cache observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The bytes did not arrive at the virtual address (they went to the old pages).
    pub stale_data: bool,
    /// Pages whose current frame differs from the registered one.
    pub stale_pfns: usize,
}

impl Outcome {
    pub const CLEAN: Outcome = Outcome {
        stale_data: false,
        stale_pfns: 0,
    };

    pub fn corrupt(&self) -> bool {
        self.stale_data || self.stale_pfns > 0
    }
}

/// A cache with a real pinning registrar plus a data source.
pub struct Rig {
    pub cache: Cache<UringRegistrar>,
    src: std::fs::File,
    next: AtomicU8,
    /// Serializes use of the shared source file between transfer threads.
    io: Mutex<()>,
}

impl Rig {
    pub fn new(monitor: MonitorChoice) -> Rig {
        Rig::with_guard(monitor, true)
    }

    pub fn with_guard(monitor: MonitorChoice, fork_guard: bool) -> Rig {
        Rig::build(monitor, fork_guard, Consistency::InFlight)
    }

    pub fn with_consistency(monitor: MonitorChoice, consistency: Consistency) -> Rig {
        Rig::build(monitor, true, consistency)
    }

    fn build(monitor: MonitorChoice, fork_guard: bool, consistency: Consistency) -> Rig {
        let reg = UringRegistrar::new(64, true).expect("io_uring fixed buffers (kernel.io_uring_disabled?)");
        let cfg = CacheConfig {
            max_count: 32,
            max_bytes: 256 << 20,
            monitor,
            fork_guard,
            consistency,
            // The suite runs once more with QS_MR_CACHE_MAP_WATCH=off.
            map_watch: CacheConfig::from_env()
                .expect("QS_MR_CACHE_* variables")
                .map_watch,
        };
        let cache = Cache::new(reg, cfg).expect("cache");
        let src: OwnedFd = sys::memfd(8 << 20).expect("memfd");
        Rig {
            cache,
            src: std::fs::File::from(src),
            next: AtomicU8::new(0x40),
            io: Mutex::new(()),
        }
    }

    fn pattern(&self) -> u8 {
        let b = self.next.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        if b == 0 || b == 0xEE {
            return self.pattern();
        }
        b
    }

    /// get + READ_FIXED of a fresh pattern into `[addr, addr+len)` + checks.
    pub fn transfer(&self, addr: usize, len: usize) -> io::Result<Outcome> {
        let h = self
            .cache
            .get(addr, len, Access::LOCAL_WRITE)
            .map_err(|e| io::Error::other(e.to_string()))?;
        let reg = self.cache.registrar();
        let stale_pfns = reg.stale_pages(h.region(), addr, len)?;
        let _io = self.io.lock().unwrap_or_else(|p| p.into_inner());
        let byte = self.pattern();
        self.src.write_all_at(&vec![byte; len], 0)?;
        let n = sys::read_fixed(reg, h.region(), self.src.as_fd(), 0, addr, len)?;
        if n != len {
            return Err(io::Error::other(format!("short READ_FIXED: {n} of {len}")));
        }
        Ok(Outcome {
            stale_data: !sys::all_equal(addr, len, byte),
            stale_pfns,
        })
    }

    /// A first transfer that must be clean (the rig itself works).
    pub fn prime(&self, addr: usize, len: usize) {
        let o = self.transfer(addr, len).expect("priming transfer");
        assert_eq!(o, Outcome::CLEAN, "priming transfer at {addr:#x} must be clean");
    }
}

/// io_uring must be usable; if not, say so loudly (the suite cannot run).
pub fn require_io_uring() {
    if let Err(e) = UringRegistrar::new(1, false) {
        let sysctl = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled").unwrap_or_default();
        panic!(
            "io_uring unavailable ({e}); kernel.io_uring_disabled={}",
            sysctl.trim()
        );
    }
}
