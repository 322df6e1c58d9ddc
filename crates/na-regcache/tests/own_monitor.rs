//! A `Monitor` implemented outside the crate makes its own `SinkId`s
//! (`SinkId::new`) and keeps its own sinks: caches attach to it, its
//! reports invalidate their registrations, and a cache's drop detaches
//! it by the id it was given.

mod common;

use std::io;
use std::sync::{Arc, Mutex};

use common::NoopRegistrar;
use na_regcache::{
    Access, Cache, CacheConfig, Consistency, InvalidationSink, Monitor, MonitorChoice, SinkId, Watch,
};

const PAGE: usize = 4096;
const W: Access = Access::LOCAL_WRITE;

/// Accepts every range; reports changes only when told to
/// ([`HandMonitor::report`]).
#[derive(Default)]
struct HandMonitor {
    sinks: Mutex<Vec<(SinkId, Arc<dyn InvalidationSink>)>>,
}

impl HandMonitor {
    /// Tells every attached sink that `[start, end)` changed.
    fn report(&self, start: usize, end: usize) {
        let sinks: Vec<_> = self
            .sinks
            .lock()
            .expect("sinks")
            .iter()
            .map(|(_, s)| Arc::clone(s))
            .collect();
        for s in sinks {
            if s.may_overlap(start, end) {
                s.invalidate(start, end);
            }
        }
    }

    fn ids(&self) -> Vec<SinkId> {
        self.sinks
            .lock()
            .expect("sinks")
            .iter()
            .map(|(id, _)| *id)
            .collect()
    }
}

impl Monitor for HandMonitor {
    fn name(&self) -> &'static str {
        "hand"
    }
    fn attach(&self, sink: Arc<dyn InvalidationSink>) -> io::Result<SinkId> {
        let id = SinkId::new();
        self.sinks.lock().expect("sinks").push((id, sink));
        Ok(id)
    }
    fn detach(&self, id: SinkId) -> Option<Arc<dyn InvalidationSink>> {
        let mut sinks = self.sinks.lock().expect("sinks");
        let at = sinks.iter().position(|(i, _)| *i == id)?;
        Some(sinks.remove(at).1)
    }
    fn subscribe(&self, _: usize, _: usize, cookie: u64) -> io::Result<Watch> {
        Ok(Watch {
            cookie,
            token: [0; 2],
        })
    }
    fn unsubscribe(&self, _: &Watch) {}
    fn sync(&self) {}
}

fn config() -> CacheConfig {
    CacheConfig {
        max_count: 16,
        max_bytes: 1 << 30,
        monitor: MonitorChoice::None,
        fork_guard: false,
        consistency: Consistency::Returned,
        map_watch: false,
    }
}

#[test]
fn an_outside_monitor_attaches_and_invalidates_through_its_own_ids() {
    let m = Arc::new(HandMonitor::default());
    let a =
        Cache::with_monitor(NoopRegistrar, config(), Arc::clone(&m) as Arc<dyn Monitor>).expect("cache a");
    let b =
        Cache::with_monitor(NoopRegistrar, config(), Arc::clone(&m) as Arc<dyn Monitor>).expect("cache b");
    assert_eq!(a.monitor_name(), "hand");
    let ids = m.ids();
    assert_eq!(ids.len(), 2, "both caches attached");
    assert_ne!(ids[0], ids[1], "each under its own id");
    assert_ne!(SinkId::new(), SinkId::new(), "ids are never reused");

    let ha = a.get(PAGE, PAGE, W).expect("a");
    let hb = b.get(8 * PAGE, PAGE, W).expect("b");
    assert!(ha.is_cached() && hb.is_cached());
    m.report(PAGE, 2 * PAGE);
    assert!(!ha.is_valid(), "the report reached cache a");
    assert!(!ha.is_cached());
    assert!(hb.is_valid() && hb.is_cached(), "cache b's range did not change");
    assert_eq!(a.stats().invalidations, 1);
    assert_eq!(b.stats().invalidations, 0);

    // Dropping a cache detaches exactly its own sink.
    drop((ha, a));
    assert_eq!(m.ids(), vec![ids[1]]);
    m.report(8 * PAGE, 9 * PAGE);
    assert!(!hb.is_valid(), "the report reached cache b");
    drop((hb, b));
    assert!(m.ids().is_empty());
}
