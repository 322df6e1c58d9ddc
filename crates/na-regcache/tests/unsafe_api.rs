//! `UringRegistrar::read_fixed` has the kernel write a file's bytes into
//! this process's memory, checked only against a registration that
//! `Registrar::register` makes of any mapped range and a `FixedBuffer`
//! that is plain data: from safe code it could overwrite memory that Rust
//! references cover. It is an `unsafe fn`; this test builds a probe crate
//! that calls it the way a user's crate would, with `cargo check` in a
//! build of its own: without an `unsafe` block the call must be refused
//! (E0133), and with one (the positive control) the same probe must
//! compile, so the refusal is the function's and not a broken probe.

use std::path::{Path, PathBuf};
use std::process::Command;

const PROBE_LIB: &str = r#"
use na_regcache::{FixedBuffer, UringRegistrar};

#[cfg(not(feature = "wrapped"))]
pub fn forged(reg: &UringRegistrar, buf: &FixedBuffer) -> std::io::Result<usize> {
    reg.read_fixed(buf, 0, 0, buf.addr, buf.len)
}

#[cfg(feature = "wrapped")]
pub fn forged(reg: &UringRegistrar, buf: &FixedBuffer) -> std::io::Result<usize> {
    // SAFETY: (probe) never called.
    unsafe { reg.read_fixed(buf, 0, 0, buf.addr, buf.len) }
}
"#;

fn write_probe(dir: &Path) {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::create_dir_all(dir.join("src")).unwrap();
    let manifest = format!(
        "[package]\nname = \"na-regcache-unsafe-probe\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n\
         [workspace]\n\n\
         [dependencies]\nna-regcache = {{ path = {:?} }}\n\n\
         [features]\nwrapped = []\n",
        crate_dir.display().to_string(),
    );
    std::fs::write(dir.join("Cargo.toml"), manifest).unwrap();
    std::fs::write(dir.join("src/lib.rs"), PROBE_LIB).unwrap();
    // The workspace's lock file pins the versions it built with, so the
    // probe resolves offline to what is already in the local registry.
    std::fs::copy(crate_dir.join("../../Cargo.lock"), dir.join("Cargo.lock")).unwrap();
}

/// `cargo check` of the probe, with or without its `wrapped` feature:
/// (success, stderr).
fn check(dir: &Path, wrapped: bool) -> (bool, String) {
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
    if wrapped {
        cmd.arg("--features").arg("wrapped");
    }
    let out = cmd.output().expect("run cargo");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn read_fixed_cannot_be_called_from_safe_code() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("na-regcache-unsafe-probe");
    write_probe(&dir);

    let (ok, err) = check(&dir, false);
    assert!(!ok, "read_fixed was callable from safe code");
    assert!(
        err.lines()
            .any(|l| l.contains("E0133") && l.contains("read_fixed")),
        "the safe call was refused, but not as a call of an unsafe function:\n{err}"
    );

    let (ok, err) = check(&dir, true);
    assert!(ok, "the probe does not compile even with an unsafe block:\n{err}");
}
