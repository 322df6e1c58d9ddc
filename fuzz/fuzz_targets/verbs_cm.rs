//! Fuzzes the rest of what an RDMA peer controls in na-verbs' connection
//! set-up: the version a hello of another build names
//! (`wire::version_mismatch`), and the reason a listener's reject
//! carries in its private data (`wire::reject_reason`, which the
//! connecting side shows). Never a panic; a version mismatch is never a
//! hello we take, and a reason is short printable ASCII, never padding.
#![no_main]

use libfuzzer_sys::fuzz_target;
use na_verbs::wire::{reject_reason, version_mismatch, Hello, HELLO_VERSION};

fuzz_target!(|data: &[u8]| {
    if let Some(v) = version_mismatch(data) {
        assert_ne!(v, HELLO_VERSION);
        assert!(Hello::decode(data).is_err(), "a hello of version {v} was taken");
    }
    if let Some(r) = reject_reason(data) {
        assert!(!r.is_empty() && r.len() <= 128, "{r:?}");
        assert!(r.bytes().all(|b| (0x20..0x7f).contains(&b)), "{r:?}");
        assert!(data.starts_with(r.as_bytes()) && data[r.len()..].iter().all(|&b| b == 0));
    }
});
