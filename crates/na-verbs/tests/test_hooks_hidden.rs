//! na-verbs' internals (`sys`, the RAII verbs wrappers, some of which
//! hand memory to the device; `wire`, the message header and hello) are
//! public only with the `test-hooks` feature, which this crate's tests
//! and the fuzz targets turn on; `credits` is private even then. A user's
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
//! refused with it too.

use std::path::{Path, PathBuf};
use std::process::Command;

const PROBE_LIB: &str = r#"
pub fn internals() -> usize {
    let poll = na_verbs::sys::poll_readable;
    na_verbs::wire::HEADER_LEN + std::mem::size_of_val(&poll)
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
"#;

/// What a build without the feature must refuse, each by name.
const HIDDEN: &[&str] = &["sys", "wire"];

fn write_probe(dir: &Path) {
    let na_verbs = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::create_dir_all(dir.join("src")).unwrap();
    let manifest = format!(
        "[package]\nname = \"na-verbs-hooks-probe\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n\
         [workspace]\n\n\
         [dependencies]\nna-verbs = {{ path = {:?} }}\n\n\
         [features]\nhooks = [\"na-verbs/test-hooks\"]\ncredits = [\"hooks\"]\n",
        na_verbs.display().to_string(),
    );
    std::fs::write(dir.join("Cargo.toml"), manifest).unwrap();
    std::fs::write(dir.join("src/lib.rs"), PROBE_LIB).unwrap();
    // The workspace's lock file pins the versions it built with, so the
    // probe resolves offline to what is already in the local registry.
    std::fs::copy(na_verbs.join("../../Cargo.lock"), dir.join("Cargo.lock")).unwrap();
}

/// `cargo check` of the probe with the probe's `features`: (success,
/// stderr).
fn check(dir: &Path, features: &str) -> (bool, String) {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let mut cmd = Command::new(cargo);
    cmd.arg("check")
        .arg("--offline")
        .arg("--quiet")
        .arg("--message-format=short")
        .arg("--manifest-path")
        .arg(dir.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(dir.join("target"))
        // The caller's target directory and flags are not the probe's.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS");
    if !features.is_empty() {
        cmd.arg("--features").arg(features);
    }
    let out = cmd.output().expect("run cargo");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn refused(err: &str, name: &str) -> bool {
    let quoted = format!("`{name}`");
    err.lines().any(|l| l.contains("error") && l.contains(&quoted))
}

#[test]
fn a_build_without_the_test_hooks_feature_cannot_reach_the_internals() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("na-verbs-hooks-probe");
    write_probe(&dir);

    let (ok, err) = check(&dir, "");
    assert!(!ok, "the probe compiled without the test-hooks feature");
    for name in HIDDEN {
        assert!(
            refused(&err, name),
            "a build without test-hooks did not refuse `{name}`:\n{err}"
        );
    }
    let errors = err.lines().filter(|l| l.contains("error[")).collect::<Vec<_>>();
    assert!(
        errors
            .iter()
            .all(|l| HIDDEN.iter().any(|n| l.contains(&format!("`{n}`")))),
        "a build without test-hooks refused something else (the API must stay reachable):\n{err}"
    );

    let (ok, err) = check(&dir, "hooks");
    assert!(ok, "the probe does not compile even with test-hooks:\n{err}");

    let (ok, err) = check(&dir, "credits");
    assert!(!ok, "`credits` is reachable with test-hooks");
    assert!(
        refused(&err, "credits"),
        "`credits` was not refused by name:\n{err}"
    );
}
