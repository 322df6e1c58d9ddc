//! Fuzzes the RPC header decoder: any bytes give a header or an error,
//! never a panic, and a decoded message re-encodes to the same bytes.
//! The reader of another version's stable fields never panics either,
//! and reads only messages that the decoder refuses.
#![no_main]

use hg_rpc::header::{ForeignHeader, Header};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let foreign = ForeignHeader::parse(data);
    if let Ok((h, payload)) = Header::decode(data) {
        assert!(foreign.is_none(), "a message of our version read as foreign");
        let mut again = Vec::new();
        h.encode_with(payload, &mut again);
        assert_eq!(again, data, "decode then encode must round-trip");
    }
});
