//! Caches configured `Auto` (the default) created at the same time, from
//! several threads, around the userfaultfd monitor's last place: each
//! either gets a place or comes up disabled, none fails, and exactly as
//! many as there were places are watched. (Before, the room was checked
//! before the cache was built and taken only at the end: two caches could
//! both see the last place free, and the loser failed with
//! `MonitorInit` instead of falling back.) Alone in its binary: no other
//! test's caches share the monitor meanwhile.

mod common;

use std::sync::Barrier;

use na_regcache::{Cache, CacheConfig, MonitorChoice};

fn auto() -> na_regcache::Result<Cache<common::NoopRegistrar>> {
    Cache::new(
        common::NoopRegistrar,
        CacheConfig {
            monitor: MonitorChoice::Auto,
            max_count: 16,
            ..CacheConfig::default()
        },
    )
}

#[test]
fn caches_created_concurrently_at_the_last_places_fall_back_instead_of_failing() {
    const THREADS: usize = 6;
    const FREE: usize = 2;
    let first = auto().expect("Auto never fails for want of a monitor");
    if first.monitor_name() != "uffd" {
        na_core::testing::report_not_run(&format!(
            "caches_created_concurrently_at_the_last_places_fall_back_instead_of_failing: \
             userfaultfd is unavailable here (the first cache came up `{}`)",
            first.monitor_name()
        ));
        return;
    }
    let mut held = vec![first];
    while held.len() < na_regcache::monitor::MAX_SINKS - FREE {
        let c = auto().expect("a place left");
        assert_eq!(c.monitor_name(), "uffd");
        held.push(c);
    }
    let barrier = Barrier::new(THREADS);
    for round in 0..200 {
        let made: Vec<_> = std::thread::scope(|s| {
            let spawned: Vec<_> = (0..THREADS)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        auto()
                    })
                })
                .collect();
            spawned
                .into_iter()
                .map(|h| h.join().expect("creating thread"))
                .collect()
        });
        let mut watched = 0;
        for c in &made {
            match c {
                Ok(c) if c.monitor_name() == "uffd" => watched += 1,
                Ok(c) => assert_eq!(c.monitor_name(), "disabled", "round {round}"),
                Err(e) => panic!("round {round}: an Auto cache failed instead of falling back: {e}"),
            }
        }
        assert_eq!(
            watched, FREE,
            "round {round}: the free places, all taken, no more"
        );
        // Dropped here: the places are free again for the next round.
    }
}
