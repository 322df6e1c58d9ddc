//! The cache every `cache*.rs` test binary builds on: a real pinning
//! registrar (io_uring fixed buffers) and touched anonymous buffers.

use std::sync::Mutex;

use na_regcache::{Access, Cache, CacheConfig, MonitorChoice, UringRegistrar};

use super::sys::{self, PAGE};

pub const LEN: usize = 4 * PAGE;
pub const W: Access = Access::LOCAL_WRITE;

pub fn cache(
    monitor: MonitorChoice,
    max_count: usize,
    max_bytes: usize,
    slots: u16,
) -> Cache<UringRegistrar> {
    super::require_io_uring();
    let reg = UringRegistrar::new(slots, false).unwrap();
    Cache::new(
        reg,
        CacheConfig {
            max_count,
            max_bytes,
            monitor,
            fork_guard: true,
            consistency: Default::default(),
            map_watch: true,
        },
    )
    .unwrap()
}

pub fn buffers(n: usize) -> Vec<usize> {
    (0..n)
        .map(|_| {
            let a = sys::map_anon(None, LEN).unwrap();
            sys::touch(a, LEN, 1);
            a
        })
        .collect()
}

/// Held by the tests that count this process's mappings and by those
/// that map and split many (tests run in parallel threads).
pub static MAPPINGS: Mutex<()> = Mutex::new(());
