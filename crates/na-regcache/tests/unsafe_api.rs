//! `UringRegistrar::read_fixed` has the kernel write a file's bytes into
//! this process's memory, checked only against a registration that
//! `Registrar::register` makes of any mapped range and a `FixedBuffer`
//! that is plain data: from safe code it could overwrite memory that Rust
//! references cover. It is an `unsafe fn`; this test builds a probe crate
//! that calls it the way a user's crate would, with `cargo check` in a
//! build of its own: without an `unsafe` block the call must be refused
//! (E0133), and with one (the positive control) the same probe must
//! compile, so the refusal is the function's and not a broken probe.

use std::path::Path;

use na_testsuite::probe::Probe;

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

#[test]
fn read_fixed_cannot_be_called_from_safe_code() {
    let probe = Probe::write(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "na-regcache-unsafe-probe",
        &[("na-regcache", Path::new(env!("CARGO_MANIFEST_DIR")))],
        "wrapped = []",
        PROBE_LIB,
    );

    let (ok, err) = probe.check("");
    assert!(!ok, "read_fixed was callable from safe code");
    assert!(
        err.lines()
            .any(|l| l.contains("E0133") && l.contains("read_fixed")),
        "the safe call was refused, but not as a call of an unsafe function:\n{err}"
    );

    let (ok, err) = probe.check("wrapped");
    assert!(ok, "the probe does not compile even with an unsafe block:\n{err}");
}
