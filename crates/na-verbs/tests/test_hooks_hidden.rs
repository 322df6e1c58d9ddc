//! na-verbs' internals (`sys`, the RAII verbs wrappers, some of which
//! hand memory to the device; `wire`, the message header and hello) are
//! public only with the `test-hooks` feature, which this crate's tests,
//! hg-rpc's verbs tests and the fuzz targets turn on, and so are the
//! configuration's test hooks (`VerbsConfigHooks`, the type of
//! `VerbsConfig::debug`, with its switches `ignore_established`,
//! `accept_responder_resources`, `fail_msgs_over` and `fail_msgs_count`,
//! which make the plugin fail messages or ignore handshake events on
//! purpose: the `debug` field is in every build, an empty value without
//! the feature, so that `VerbsConfig::default` needs no `cfg`) and
//! `VerbsPlugin::debug_reads` (a connection's `ReadWindow`) and
//! `VerbsPlugin::debug_cm_disconnects_waiting` (reads CM events ahead);
//! `credits` is private even then (the fuzz targets reach it through
//! `fuzzing`, a feature of its own). A user's
//! normal build reaches only the API: the root re-exports (`devices`
//! included) and the `addr`, `config`, `config_env` and `error` modules.
//!
//! This crate's own tests always have the feature (the crate is its own
//! dev-dependency with it, and cargo unifies features across one build),
//! so a `compile_fail` doc-test would prove nothing. This test builds a
//! small probe crate that depends on na-verbs the way a user's crate
//! does, with `cargo check` in a build of its own: without the feature
//! each internal path must be refused by name, and nothing else; with it
//! (the positive control) the probe must compile; `credits` must be
//! refused with it too, and so must `fuzzing` without its feature.

use std::path::Path;

use na_testsuite::probe::Probe;

const PROBE_LIB: &str = r#"
pub fn internals() -> usize {
    let poll = na_verbs::sys::poll_readable;
    na_verbs::wire::HEADER_LEN + std::mem::size_of_val(&poll)
}

// The configuration's test hooks (what the hooks provoke must never
// happen in a user's build). `VerbsConfig::debug` is a field of every
// build (so that no function carries a `cfg`), but without the feature
// its type is an empty struct nothing exports: no switch to set, no name
// to build one with.
pub fn config_hooks(cfg: &mut na_verbs::VerbsConfig) {
    cfg.debug.ignore_established = true;
    cfg.debug.accept_responder_resources = Some(254);
    cfg.debug.fail_msgs_over = Some(0);
    cfg.debug.fail_msgs_count = Some(1);
}

pub fn config_hooks_type() -> na_verbs::VerbsConfig {
    use na_verbs::VerbsConfigHooks;
    na_verbs::VerbsConfig { debug: VerbsConfigHooks::default(), ..na_verbs::VerbsConfig::default() }
}

// (`config` does not re-export it even with the feature: the root does.)
#[cfg(not(feature = "hooks"))]
pub fn config_hooks_module_path() {
    use na_verbs::config::VerbsConfigHooks as _;
}

// A connection's read window, for the tests of the read depth.
pub fn reads() -> Option<na_verbs::ReadWindow> {
    let _ = na_verbs::VerbsPlugin::debug_reads;
    None
}

// CM events read ahead, for a test that waits for a peer's disconnect.
pub fn cm_read_ahead() {
    let _ = na_verbs::VerbsPlugin::debug_cm_disconnects_waiting;
}

// What users need, reachable in every build.
pub fn api() -> Option<Vec<na_verbs::DeviceInfo>> {
    let _ = (na_verbs::config_env::ENV_VARS, na_verbs::config::DEFAULT_MAX_RD_ATOMIC);
    let _ = (na_verbs::VerbsFactory::default(), na_verbs::addr::SCHEME, na_verbs::SCHEME);
    let _: Option<na_verbs::error::Result<na_verbs::VerbsConfig>> = None;
    na_verbs::devices().ok()
}

// Private in every build (the probe's `credits` feature, on top of the hooks).
#[cfg(feature = "credits")]
pub fn credits() {
    let _ = na_verbs::credits::Credits::new(4, 4);
}

// The fuzz targets' view of it (the probe's `fuzz_path` feature names it;
// its `fuzzing` feature adds na-verbs' `fuzzing`).
#[cfg(feature = "fuzz_path")]
pub fn fuzzing() {
    let _ = na_verbs::fuzzing::Credits::new(4, 4);
}
"#;

/// What a build without the feature must refuse, each by name.
const HIDDEN: &[&str] = &[
    "sys",
    "wire",
    // `VerbsConfig::debug`'s switches, and the type that holds them by
    // its full paths (the switches' own errors name the type too, by its
    // shortest visible path: `VerbsConfigHooks` alone if the root
    // exported it, so only the failed imports' full paths prove that
    // neither the root nor `config` does).
    "ignore_established",
    "accept_responder_resources",
    "fail_msgs_over",
    "fail_msgs_count",
    "na_verbs::VerbsConfigHooks",
    "na_verbs::config::VerbsConfigHooks",
    "debug_reads",
    "ReadWindow",
    "debug_cm_disconnects_waiting",
];

#[test]
fn a_build_without_the_test_hooks_feature_cannot_reach_the_internals() {
    let probe = Probe::write(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "na-verbs-hooks-probe",
        &[("na-verbs", Path::new(env!("CARGO_MANIFEST_DIR")))],
        "hooks = [\"na-verbs/test-hooks\"]\ncredits = [\"hooks\"]\n\
         fuzz_path = [\"hooks\"]\nfuzzing = [\"fuzz_path\", \"na-verbs/fuzzing\"]",
        PROBE_LIB,
    );

    probe.assert_refuses_only("", HIDDEN);
    probe.assert_compiles("hooks");
    probe.assert_refuses_only("credits", &["credits"]);
    // The fuzz targets' module is there only with its own feature, not
    // with the test hooks.
    probe.assert_refuses_only("fuzz_path", &["fuzzing"]);
    probe.assert_compiles("fuzzing");
}
