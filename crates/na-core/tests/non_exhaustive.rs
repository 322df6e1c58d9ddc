//! `NaError`, `PluginStats` and `OpKind` are `#[non_exhaustive]`: a later
//! version adds errors, counters and kinds of operation without breaking
//! its users (other crates' plugins included). This test builds a probe
//! crate that uses them the way a user's crate would, with `cargo check`
//! in a build of its own: matching `NaError` and `OpKind` with a wildcard
//! arm, reading `PluginStats` and building one from `Default::default()`
//! (field by field, as a plugin does) compiles (the positive control, so
//! each refusal is the attribute's and not a broken probe); a match that
//! names every variant of `NaError`, or of `OpKind`, and no wildcard
//! (which a new variant would break) is refused (E0004, `_` not covered),
//! and so is a `PluginStats` struct expression (E0639).

use std::path::Path;

use na_testsuite::probe::Probe;

const PROBE_LIB: &str = r#"
use na_core::{NaError, OpKind, PluginStats};

pub fn is_send(k: OpKind) -> bool {
    match k {
        OpKind::SendUnexpected | OpKind::SendExpected => true,
        _ => false,
    }
}

pub fn transient(e: &NaError) -> bool {
    match e {
        NaError::WouldBlock { .. } | NaError::SendBacklogFull { .. } => true,
        _ => false,
    }
}

pub fn moved(s: &PluginStats) -> u64 {
    s.msgs_sent + s.msgs_received
}

pub fn built() -> PluginStats {
    let mut s = PluginStats::default();
    s.msgs_sent = 1;
    s
}

#[cfg(feature = "exhaustive")]
pub fn every_variant(e: &NaError) -> u8 {
    match e {
        NaError::InvalidAddress { .. } => 0,
        NaError::NoPlugin { .. } => 1,
        NaError::Lookup { .. } => 2,
        NaError::WouldBlock { .. } => 3,
        NaError::Handshake { .. } => 4,
        NaError::MessageTooLarge { .. } => 5,
        NaError::LengthOverflow { .. } => 6,
        NaError::Truncated { .. } => 7,
        NaError::OutOfBounds { .. } => 8,
        NaError::AccessDenied { .. } => 9,
        NaError::Malformed { .. } => 10,
        NaError::Protocol { .. } => 11,
        NaError::PeerGone { .. } => 12,
        NaError::SendBacklogFull { .. } => 13,
        NaError::Canceled { .. } => 14,
        NaError::UnknownOp { .. } => 15,
        NaError::OpInFlight { .. } => 16,
        NaError::Rma { .. } => 17,
        NaError::Sys { .. } => 18,
        NaError::Config { .. } => 19,
        NaError::Unsupported { .. } => 20,
        NaError::Plugin { .. } => 21,
    }
}

#[cfg(feature = "every_kind")]
pub fn every_kind(k: OpKind) -> u8 {
    match k {
        OpKind::SendUnexpected => 0,
        OpKind::SendExpected => 1,
        OpKind::RecvUnexpected => 2,
        OpKind::RecvExpected => 3,
        OpKind::Put => 4,
        OpKind::Get => 5,
    }
}

#[cfg(feature = "literal")]
pub fn forged() -> PluginStats {
    PluginStats { msgs_sent: 1, ..PluginStats::default() }
}
"#;

#[test]
fn na_error_plugin_stats_and_op_kind_are_non_exhaustive_outside_the_crate() {
    let probe = Probe::write(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "na-core-non-exhaustive-probe",
        &[("na-core", Path::new(env!("CARGO_MANIFEST_DIR")))],
        "exhaustive = []\nevery_kind = []\nliteral = []",
        PROBE_LIB,
    );
    probe.assert_compiles("");

    probe.assert_refused_as(
        "exhaustive",
        "E0004",
        "_` not covered",
        "NaError was matched without a wildcard arm",
    );
    probe.assert_refused_as(
        "every_kind",
        "E0004",
        "_` not covered",
        "OpKind was matched without a wildcard arm",
    );
    probe.assert_refused_as(
        "literal",
        "E0639",
        "non-exhaustive",
        "PluginStats was built by a struct expression",
    );
}
