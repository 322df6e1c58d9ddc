//! `CacheStats` is `#[non_exhaustive]`: a later version adds counters
//! without breaking its users. This test builds a probe crate that uses
//! it the way a user's crate would, with `cargo check` in a build of its
//! own: reading its fields and taking `Default::default()` compiles (the
//! positive control, so the refusal is the attribute's and not a broken
//! probe), and building one with a struct expression (which a new field
//! would break) is refused (E0639).

use std::path::Path;

use na_testsuite::probe::Probe;

const PROBE_LIB: &str = r#"
use na_regcache::CacheStats;

pub fn hits(s: &CacheStats) -> u64 {
    s.hits + s.misses
}

pub fn zero() -> CacheStats {
    CacheStats::default()
}

#[cfg(feature = "literal")]
pub fn forged() -> CacheStats {
    CacheStats { hits: 1, ..CacheStats::default() }
}
"#;

#[test]
fn cache_stats_cannot_be_built_by_a_struct_expression_outside_the_crate() {
    let probe = Probe::write(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "na-regcache-non-exhaustive-probe",
        &[("na-regcache", Path::new(env!("CARGO_MANIFEST_DIR")))],
        "literal = []",
        PROBE_LIB,
    );
    probe.assert_compiles("");
    probe.assert_refused_as(
        "literal",
        "E0639",
        "non-exhaustive",
        "CacheStats was built by a struct expression",
    );
}
