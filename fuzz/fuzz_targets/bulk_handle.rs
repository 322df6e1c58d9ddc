//! Fuzzes the decoders of memory and bulk handles: `RemoteMem::from_bytes`
//! and a `Bulk` deserialized from postcard. Any bytes give a handle or an
//! error; a decoded handle's ranges are always consistent.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = na_core::RemoteMem::from_bytes(data) {
        assert_eq!(m.to_bytes(), data, "decode then encode must round-trip");
        let total: u64 = m.segments().iter().map(|s| s.len).sum();
        assert_eq!(total, m.size());
        let _ = m.for_each_piece(0, m.size(), |_, _, _| {});
        assert!(m.check_range(m.size(), 1).is_err());
    }
    if let Ok(b) = postcard::from_bytes::<hg_bulk::Bulk>(data) {
        assert!(b.local().is_none());
        if let Some(inline) = &b.desc().inline {
            assert_eq!(inline.len() as u64, b.size());
        }
    }
});
