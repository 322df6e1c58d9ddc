//! hg-rpc's `engine::fuzzing` module (the fuzz targets' view of the
//! engine's private decoders of a message's body) exists only with the
//! `fuzzing` feature, which no user's build turns on. This crate's own
//! tests never have that feature, so a `compile_fail` doc-test could not
//! tell a hidden module from a misspelt one; this test builds a small
//! probe crate that depends on hg-rpc the way a user's crate does, with
//! `cargo check` in a build of its own: without the feature the module
//! must be refused by name, and nothing else; with it (the positive
//! control) the probe must compile.

use std::path::Path;

use na_testsuite::probe::Probe;

const PROBE_LIB: &str = r#"
// What users need, reachable in every build.
pub fn api() -> usize {
    let _: Option<hg_rpc::Engine> = None;
    std::mem::size_of::<hg_rpc::RpcError>()
}

// The fuzz targets' view (the probe's `fuzz_path` feature names it; its
// `fuzzing` feature adds hg-rpc's `fuzzing`).
#[cfg(feature = "fuzz_path")]
pub fn fuzzing() -> bool {
    let _ = hg_rpc::engine::fuzzing::SEAL_LEN;
    hg_rpc::engine::fuzzing::returned(&[]) == hg_rpc::engine::fuzzing::Returned::Other
}
"#;

#[test]
fn a_build_without_the_fuzzing_feature_cannot_reach_the_engines_decoders() {
    let probe = Probe::write(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "hg-rpc-fuzzing-probe",
        &[("hg-rpc", Path::new(env!("CARGO_MANIFEST_DIR")))],
        "fuzz_path = []\nfuzzing = [\"fuzz_path\", \"hg-rpc/fuzzing\"]",
        PROBE_LIB,
    );

    probe.assert_compiles("");
    probe.assert_refuses_only("fuzz_path", &["fuzzing"]);
    probe.assert_compiles("fuzzing");
}
