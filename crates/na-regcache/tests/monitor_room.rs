//! The userfaultfd monitor watches for at most `MAX_SINKS` caches (one
//! per plugin instance, say). Past them a cache configured `Auto` (the
//! default) comes up disabled, with a warning, as it does where
//! userfaultfd is unavailable, instead of failing; an explicit `Uffd` is
//! a clear error; and a place freed is taken again. Alone in its binary:
//! no other test's caches share the monitor meanwhile.

mod common;

use na_regcache::{Cache, CacheConfig, MonitorChoice};

fn cache(monitor: MonitorChoice) -> na_regcache::Result<Cache<common::NoopRegistrar>> {
    Cache::new(
        common::NoopRegistrar,
        CacheConfig {
            monitor,
            ..CacheConfig::default()
        },
    )
}

#[test]
fn past_the_monitors_last_cache_auto_falls_back_to_disabled() {
    let first = cache(MonitorChoice::Auto).expect("Auto never fails for want of a monitor");
    if first.monitor_name() != "uffd" {
        na_core::testing::report_not_run(&format!(
            "past_the_monitors_last_cache_auto_falls_back_to_disabled: userfaultfd is unavailable here \
             (the first cache came up `{}`)",
            first.monitor_name()
        ));
        return;
    }
    let mut held = vec![first];
    let fallback = loop {
        let c = cache(MonitorChoice::Auto).expect("Auto never fails for want of room");
        if c.monitor_name() != "uffd" {
            break c;
        }
        held.push(c);
        assert!(
            held.len() <= 64,
            "more caches watched than the monitor has room for"
        );
    };
    assert_eq!(fallback.monitor_name(), "disabled");
    assert_eq!(held.len(), 64, "the monitor's room");
    let e = cache(MonitorChoice::Uffd)
        .err()
        .expect("an explicit uffd cache with the monitor full");
    let why = std::error::Error::source(&e)
        .map(ToString::to_string)
        .unwrap_or_default();
    assert!(why.contains("64 caches"), "{e}: {why}");
    held.pop();
    let again = cache(MonitorChoice::Auto).unwrap();
    assert_eq!(again.monitor_name(), "uffd", "a freed place is taken again");
}
