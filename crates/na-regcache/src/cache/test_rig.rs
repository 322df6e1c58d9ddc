//! What the cache's unit tests share: a registrar that pins nothing (the
//! table and the entries never touch memory themselves) and a backend
//! over it.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use super::entry::Backend;
use crate::registrar::{Access, Registrar};
use crate::stats::Stats;

/// A registrar that registers nothing and never fails.
pub(super) struct Noop;

impl Registrar for Noop {
    type Region = ();
    type Error = std::io::Error;
    fn register(&self, _: usize, _: usize, _: Access) -> std::io::Result<()> {
        Ok(())
    }
    fn deregister(&self, _: ()) -> std::io::Result<()> {
        Ok(())
    }
}

/// The page size the tests' ranges are aligned to.
pub(super) const PAGE: usize = 0x1000;

/// A backend over [`Noop`], with no monitor and fresh counters.
pub(super) fn backend() -> Arc<Backend<Noop>> {
    Arc::new(Backend {
        registrar: Noop,
        stats: Stats::default(),
        monitor: None,
        fork_guard: None,
        closed: AtomicBool::new(false),
    })
}
