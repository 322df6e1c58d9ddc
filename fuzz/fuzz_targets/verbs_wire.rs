//! Fuzzes what an RDMA peer controls in na-verbs: a received message's
//! header (`wire::Header::decode`, with the length the device reported)
//! and the hello in the connection's private data (`wire::Hello::decode`).
//! Any bytes give a value or an error, never a panic; what decodes is
//! within the limits the decoders promise and encodes back to its bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use na_verbs::wire::{Header, Hello, MsgKind, DEPTH_RANGE, HEADER_LEN, HELLO_MAX_NAME, MAX_PAYLOAD_LIMIT};

fuzz_target!(|data: &[u8]| {
    if data.len() >= HEADER_LEN + 4 {
        let (head, rest) = data.split_at(HEADER_LEN);
        let head: &[u8; HEADER_LEN] = head.try_into().expect("split at HEADER_LEN");
        // The device's byte count and the buffer size, as the peer makes
        // them look (the byte count is what it sent).
        let byte_len = u16::from_le_bytes([rest[0], rest[1]]) as usize;
        let max_payload = u16::from_le_bytes([rest[2], rest[3]]) as usize;
        if let Ok(h) = Header::decode(head, byte_len, max_payload) {
            assert_eq!(h.len as usize + HEADER_LEN, byte_len);
            assert!(h.len as usize <= max_payload);
            assert!(h.kind != MsgKind::Credit || h.len == 0);
            assert_eq!(&h.encode(), head, "decode then encode must round-trip");
        }
    }
    if let Ok(h) = Hello::decode(data) {
        assert!(h.addr.port() != 0 && !h.addr.ip().is_unspecified());
        assert!((DEPTH_RANGE.0..=DEPTH_RANGE.1).contains(&h.depth));
        assert!(h.max_payload <= MAX_PAYLOAD_LIMIT);
        assert!(h.device.len() <= HELLO_MAX_NAME);
        let again = h.encode();
        // Trailing bytes (the CM pads private data) are ignored.
        assert_eq!(Hello::decode(&again).as_ref(), Ok(&h));
        assert_eq!(
            &data[..again.len()],
            &again[..],
            "decode then encode must round-trip"
        );
    }
});
