//! Probe crates: what a user's crate can and cannot reach of ours.
//!
//! A crate's own tests cannot show that a normal build hides something
//! (a test-only cargo feature is on for every test of the workspace, and
//! a `compile_fail` doc-test builds with it too). A probe is a small crate
//! written under a test's `CARGO_TARGET_TMPDIR` that depends on ours the
//! way a user's crate does; [`Probe::check`] runs `cargo check` on it in a
//! build of its own (offline, its own target directory, the workspace's
//! lock file so that it resolves to what is already in the local
//! registry), with the probe's features chosen per run. Used by na-sm's
//! and na-verbs' `test_hooks_hidden.rs`, na-regcache's `unsafe_api.rs`, and
//! na-core's and na-regcache's `non_exhaustive.rs`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A probe crate written to disk (see the module docs).
pub struct Probe {
    dir: PathBuf,
}

impl Probe {
    /// Writes probe crate `name` under `parent`: its dependencies are the
    /// workspace crates `deps` (crate name, manifest directory), its
    /// `[features]` section is `features` (lines such as
    /// `hooks = ["na-sm/test-hooks"]`), its `src/lib.rs` is `lib`.
    pub fn write(parent: &Path, name: &str, deps: &[(&str, &Path)], features: &str, lib: &str) -> Probe {
        let dir = parent.join(name);
        std::fs::create_dir_all(dir.join("src")).expect("create the probe's directory");
        let mut manifest = format!(
            "[package]\nname = {name:?}\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n\
             [workspace]\n\n[dependencies]\n"
        );
        for (dep, path) in deps {
            manifest += &format!("{dep} = {{ path = {:?} }}\n", path.display().to_string());
        }
        manifest += &format!("\n[features]\n{features}\n");
        std::fs::write(dir.join("Cargo.toml"), manifest).expect("write the probe's manifest");
        std::fs::write(dir.join("src/lib.rs"), lib).expect("write the probe's lib.rs");
        // The workspace's lock file pins the versions it built with, so the
        // probe resolves offline to what is already in the local registry.
        let lock = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock");
        std::fs::copy(lock, dir.join("Cargo.lock")).expect("copy the workspace's Cargo.lock");
        Probe { dir }
    }

    /// `cargo check` of the probe with its `features` (comma-separated,
    /// or empty): whether it compiled, and cargo's stderr (short
    /// messages, one error a line).
    pub fn check(&self, features: &str) -> (bool, String) {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["check", "--offline", "--quiet", "--message-format=short"])
            .arg("--manifest-path")
            .arg(self.dir.join("Cargo.toml"))
            .arg("--target-dir")
            .arg(self.dir.join("target"))
            // The caller's target directory and flags are not the probe's.
            .env_remove("CARGO_TARGET_DIR")
            .env_remove("CARGO_BUILD_TARGET_DIR")
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS");
        if !features.is_empty() {
            cmd.arg("--features").arg(features);
        }
        let out = cmd.output().expect("run cargo check on the probe");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Panics unless the probe, built with `features`, fails with an error
    /// naming each of `hidden` and no error naming anything else (what
    /// the probe also uses must stay reachable).
    pub fn assert_refuses_only(&self, features: &str, hidden: &[&str]) {
        let (ok, err) = self.check(features);
        assert!(!ok, "the probe compiled with features {features:?}");
        for name in hidden {
            assert!(
                refused_by_name(&err, name),
                "features {features:?}: `{name}` was not refused:\n{err}"
            );
        }
        assert!(
            err.lines()
                .filter(|l| l.contains("error["))
                .all(|l| hidden.iter().any(|n| l.contains(&format!("`{n}`")))),
            "features {features:?}: something else was refused (the API must stay reachable):\n{err}"
        );
    }

    /// Panics unless the probe, built with `features`, fails with an error
    /// `code` (`E0639`, say) whose line holds `because` (the words that
    /// tie the refusal to its cause, e.g. `non-exhaustive`); `what` says
    /// what compiled where it should not.
    #[track_caller]
    pub fn assert_refused_as(&self, features: &str, code: &str, because: &str, what: &str) {
        let (ok, err) = self.check(features);
        assert!(!ok, "{what}");
        assert!(
            err.lines().any(|l| l.contains(code) && l.contains(because)),
            "features {features:?} were refused, but not with {code} and {because:?}:\n{err}"
        );
    }

    /// Panics unless the probe compiles with `features` (the positive
    /// control of [`assert_refuses_only`](Self::assert_refuses_only)).
    pub fn assert_compiles(&self, features: &str) {
        let (ok, err) = self.check(features);
        assert!(
            ok,
            "the probe does not compile with features {features:?}:\n{err}"
        );
    }
}

/// Whether cargo's short messages `err` hold an error naming `name` (in
/// backquotes, as rustc quotes paths and items).
pub fn refused_by_name(err: &str, name: &str) -> bool {
    let quoted = format!("`{name}`");
    err.lines().any(|l| l.contains("error") && l.contains(&quoted))
}
