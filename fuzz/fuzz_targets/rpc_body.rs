//! Fuzzes what hg-rpc makes of a message's body after its header: a
//! spilled payload (data length, memory descriptor, seal, CRC-32C), the
//! pulled data's seal and checksum, a response's status and reason, and
//! the classification of a message the transport gave back. Any bytes
//! give a value or an error, never a panic; a spilled payload that
//! parses is within its limit and encodes back to its bytes.
#![no_main]

use hg_rpc::engine::fuzzing::{
    parse_spilled, response_outcome, returned, unseal, verify, Returned, RELEASE_RPC, SEAL_LEN,
};
use hg_rpc::header::{crc32c, Header, Status, FLAG_ONE_WAY};
use hg_rpc::{rpc_id, RpcError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&first, body)) = data.split_first() else {
        return;
    };
    let checksum = first & 1 == 1;
    let max = [0, 100, 64 << 20, u64::MAX][usize::from(first >> 1 & 3)];
    if let Ok(s) = parse_spilled(body, max, checksum) {
        assert!(s.len <= max && s.seal != 0 && s.remote.access().can_read());
        assert_eq!(s.remote.size(), s.len + SEAL_LEN);
        let mut again = s.len.to_le_bytes().to_vec();
        s.remote.encode_into(&mut again);
        again.extend_from_slice(&s.seal.to_le_bytes());
        again.extend(s.crc.map(u32::to_le_bytes).into_iter().flatten());
        assert_eq!(again, body, "parse then encode must round-trip");
        assert_eq!(s.crc.is_some(), checksum);
    }
    // The pulled data: the seal cut off only if it is the one said.
    let seal = u64::from(first).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut pulled = body.to_vec();
    let sealed = body.len() >= 8 && body[body.len() - 8..] == seal.to_le_bytes();
    assert_eq!(unseal(&mut pulled, seal).is_ok(), sealed);
    assert_eq!(pulled.len(), body.len() - if sealed { 8 } else { 0 });
    let crc = (body.len() >= 4).then(|| u32::from_le_bytes(body[..4].try_into().expect("4")));
    assert_eq!(
        verify(&body[4.min(body.len())..], crc).is_ok(),
        crc.is_none_or(|c| c == crc32c(&body[4..]))
    );
    // A response: its output only with status ok, else an error.
    match Header::decode(body) {
        Ok((h, payload)) => {
            match response_outcome("fuzz.rpc", h.rpc_id, h, payload) {
                Ok(out) => assert!(h.status == Status::Ok && out == payload),
                Err(RpcError::UnknownRpc { .. }) => assert_eq!(h.status, Status::UnknownRpc),
                Err(e) => assert!(h.status != Status::Ok, "{e}"),
            }
            let want = match (h.is_response(), h.is_one_way()) {
                (true, true) if payload.is_empty() => Returned::Ack(h),
                (true, _) => Returned::Response(h, payload),
                (false, true) if h.rpc_id == rpc_id(RELEASE_RPC) => Returned::Release(h.cookie),
                _ => Returned::Other,
            };
            assert_eq!(returned(body), want);
            assert!(h.flags & FLAG_ONE_WAY != 0 || !matches!(want, Returned::Ack(_) | Returned::Release(_)));
        }
        Err(_) => assert_eq!(returned(body), Returned::Other),
    }
});
