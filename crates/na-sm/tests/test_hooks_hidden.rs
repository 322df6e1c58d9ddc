//! The test hooks (`SmPlugin::debug_*`, `sys::eventfd::WakeTamper`,
//! `RmaPoolProbe`, `ListenerProbe`, `debug_closing_threads`, and
//! `SmConfigHooks`, the type of `SmConfig::debug`, with its switches
//! `pidfd_by_pid` / `exits_by_eof_only`) are compiled only with the
//! `test-hooks` feature: a user's normal build cannot call them (the
//! `debug` field is in every build, an empty value without the feature,
//! so that `SmConfig::default` needs no `cfg`). The
//! internal modules the tests and fuzz targets drive directly (`sys`, the
//! raw OS wrappers, the descriptor screen among them; `channel`, the
//! shared-memory ring; `conn`, the handshake bytes; `cleanup`'s owner-line
//! parser) are public only with it too, and `sys::cma` (whose
//! batch moves memory at whatever addresses a `RemoteMem` names) is
//! private even then. The crate root's API stays reachable without it.
//!
//! This crate's own tests always see them (the crate is its own
//! dev-dependency with the feature, and cargo unifies features across one
//! build), so a `compile_fail` doc-test would compile *with* the feature
//! and prove nothing. Instead this test builds a small probe crate that
//! depends on na-sm the way a user's crate does, with `cargo check` in a
//! build of its own: without the feature each hook must be refused by
//! name; with it (the positive control) the same probe must compile, so
//! the refusals are the hooks' absence and not a broken probe.

use std::path::Path;

use na_testsuite::probe::Probe;

/// Uses every test hook once; each use is an error of its own without the
/// feature.
const PROBE_LIB: &str = r#"
use na_core::{Addr, Tag};
use na_sm::sys::eventfd::WakeTamper;
use na_sm::{SmConfig, SmPlugin};

pub fn hooks(p: &mut SmPlugin, a: &Addr, t: Tag) {
    let _ = p.debug_scribble(a, 1);
    let _ = p.debug_forge_unreserved(a, t);
    let _ = p.debug_deafen(a);
    let _ = p.debug_want_wake(a);
    let _ = p.debug_tamper_peer_wake(a, WakeTamper::Pulse);
    let _ = p.debug_tamper_own_wake(a, WakeTamper::Saturate);
    let _ = p.debug_peer_sleeps(a);
    let _ = p.debug_wakeups();
    let _ = p.debug_pending_handshakes();
    let _: na_sm::ListenerProbe = p.debug_listener_probe();
    let _: Option<na_sm::RmaPoolProbe> = p.debug_rma_pool().ok();
    let _: na_sm::ClosingThreads = na_sm::debug_closing_threads();
    na_sm::debug_run_alone("no such test", || ());
}

// `SmConfig::debug` is a field of every build (so that no function
// carries a `cfg`), but without the feature its type is an empty struct
// the root does not export: no switch to set, no name to build one with.
pub fn by_pid() -> SmConfig {
    let mut c = SmConfig::default();
    c.debug.pidfd_by_pid = true;
    c
}

pub fn eof_only() -> SmConfig {
    let mut c = SmConfig::default();
    c.debug.exits_by_eof_only = true;
    c
}

pub fn config_hooks() -> SmConfig {
    use na_sm::SmConfigHooks;
    SmConfig { debug: SmConfigHooks::default(), ..SmConfig::default() }
}

pub fn internals() -> usize {
    let region = na_sm::sys::shm::SharedRegion::create("probe", 4096).unwrap();
    na_sm::channel::init_region(&region, 0);
    let hello = na_sm::conn::encode_hello("probe");
    let owner = na_sm::cleanup::parse_owner("qs-sm-owner 2 1 1").map_or(0, |l| l.pid as usize);
    let eventfd = na_sm::sys::screen::is_eventfd_link("anon_inode:[eventfd]".as_ref());
    usize::from(region.fd().is_some()) + hello.len() + owner + usize::from(eventfd)
}

// What users need, reachable in every build.
pub fn api() -> std::io::Result<()> {
    let dir = na_sm::default_dir().map_err(std::io::Error::other)?;
    let report: na_sm::SmResult<na_sm::CleanupReport> = na_sm::cleanup_stale(&dir);
    let _ = (report, na_sm::SmFactory::default(), na_sm::SmName::parse("sm://1-0"));
    let _ = (na_sm::EVENT_POLL_INTERVAL, na_sm::MAX_NAME_LEN, na_sm::DEFAULT_MAX_QUEUED_PER_PEER);
    Ok(())
}

// Private in every build (the probe's `cma` feature, on top of the hooks).
#[cfg(feature = "cma")]
pub fn cma(b: &[na_core::Rma<'_>], l: &mut na_sm::sys::cma::IovLists) {
    let _ = na_sm::sys::cma::transfer_batch(std::process::id(), b, l);
}
"#;

/// What a build without the feature must refuse, each by name.
const HIDDEN: &[&str] = &[
    "debug_scribble",
    "debug_forge_unreserved",
    "debug_deafen",
    "debug_want_wake",
    "debug_tamper_peer_wake",
    "debug_tamper_own_wake",
    "debug_peer_sleeps",
    "debug_wakeups",
    "debug_pending_handshakes",
    "debug_listener_probe",
    "ListenerProbe",
    "debug_rma_pool",
    "RmaPoolProbe",
    "debug_closing_threads",
    "ClosingThreads",
    "debug_run_alone",
    "WakeTamper",
    // The internals: their modules are private (one refusal per path
    // through them).
    "sys",
    "channel",
    "conn",
    "cleanup",
    // Re-exported by `cleanup` only with the feature.
    "parse_owner",
    // `SmConfig::debug`'s switches, and the type that holds them by its
    // full path (the switches' own errors name the type too, by its
    // shortest visible path: `SmConfigHooks` alone if the root exported
    // it, so only the failed import's full path proves it is not).
    "pidfd_by_pid",
    "exits_by_eof_only",
    "na_sm::SmConfigHooks",
];

#[test]
fn a_build_without_the_test_hooks_feature_cannot_reach_them() {
    let na_sm = Path::new(env!("CARGO_MANIFEST_DIR"));
    let probe = Probe::write(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "na-sm-hooks-probe",
        &[("na-sm", na_sm), ("na-core", &na_sm.join("../na-core"))],
        "hooks = [\"na-sm/test-hooks\"]\ncma = [\"hooks\"]",
        PROBE_LIB,
    );

    // Only the hooks and internals are refused: the API the probe also
    // uses (`api`) is not.
    probe.assert_refuses_only("", HIDDEN);
    probe.assert_compiles("hooks");

    // `sys::cma` stays private with the hooks: its batch would write this
    // very process's memory at a forged `RemoteMem`'s addresses.
    probe.assert_refuses_only("cma", &["cma"]);
}
