//! Fuzzes the RPC header decoder: any bytes give a header or an error,
//! never a panic, and a decoded message re-encodes to the same bytes.
#![no_main]

use hg_rpc::header::Header;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((h, payload)) = Header::decode(data) {
        let mut again = Vec::new();
        h.encode_with(payload, &mut again);
        assert_eq!(again, data, "decode then encode must round-trip");
    }
});
