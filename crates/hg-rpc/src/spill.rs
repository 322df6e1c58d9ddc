//! Spilling: arguments or results too large for one eager message travel
//! as a memory descriptor, and the receiving side pulls them.
//!
//! A spilled payload is the data length (u64 LE) followed by the encoded
//! [`RemoteMem`] that exposes the data and, when the message carries a
//! checksum (header flag bit 2), the CRC-32C of the data itself (u32 LE):
//! the header's checksum covers only the message, and the data travels
//! apart from it.

use na_core::{Access, Endpoint, MemHandle, PluginId, RemoteMem};

use crate::header::crc32c;

/// Internal one-way RPC: "I have pulled the output of call `cookie`; you
/// may release it". Payload: the cookie, u64 LE.
pub const RELEASE_RPC: &str = "hg.release-output";

/// The buffer to expose for `data`, whose length is what the budgets
/// charge: `data` itself, or, when it holds far more room than bytes (a
/// large spare buffer that took a small payload), an exact copy, with
/// `data` given back to be kept as a spare. An exposed buffer then never
/// holds more than twice what it is charged (a peer that never pulls
/// cannot pin a 16 MiB spare with an 8 KiB payload).
pub fn fit_to_len(data: Vec<u8>) -> (Vec<u8>, Option<Vec<u8>>) {
    if data.capacity() / 2 > data.len() {
        (data.to_vec(), Some(data))
    } else {
        (data, None)
    }
}

/// Exposes `data` read-only on `plugin` and returns the handle (keep it
/// alive until the peer has pulled) and the spilled payload describing it
/// (with the data's CRC-32C if `checksum`).
pub fn expose(
    ep: &mut Endpoint,
    plugin: PluginId,
    data: Vec<u8>,
    checksum: bool,
) -> na_core::Result<(MemHandle, Vec<u8>)> {
    let crc = checksum.then(|| crc32c(&data));
    let mem = MemHandle::new(vec![data], Access::ReadOnly);
    let p = ep.plugin_mut(plugin)?;
    p.mem_register(&mem)?;
    let desc = p.mem_describe(&mem)?;
    let mut payload = Vec::with_capacity(8 + desc.encoded_len() + 4);
    payload.extend_from_slice(&mem.size().to_le_bytes());
    desc.encode_into(&mut payload);
    if let Some(crc) = crc {
        payload.extend_from_slice(&crc.to_le_bytes());
    }
    Ok((mem, payload))
}

/// A spilled payload from a peer, checked: the data's length, where it is,
/// and its CRC-32C if the message carries a checksum.
#[derive(Debug)]
pub struct Spilled {
    /// Bytes of data.
    pub len: u64,
    /// The peer's memory holding them.
    pub remote: RemoteMem,
    /// Their CRC-32C, to check once pulled (`checksum` messages only).
    pub crc: Option<u32>,
}

/// Parses and checks a spilled payload from a peer: the length must match
/// the descriptor and be at most `max`; with `checksum` (the header's flag
/// bit 2) the data's CRC-32C follows the descriptor, else nothing does.
pub fn parse(payload: &[u8], max: u64, checksum: bool) -> Result<Spilled, String> {
    let len_bytes: [u8; 8] = payload
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or("spilled payload shorter than its length field")?;
    let len = u64::from_le_bytes(len_bytes);
    let (remote, used) = RemoteMem::decode_prefix(&payload[8..]).map_err(|e| format!("spilled data: {e}"))?;
    let rest = &payload[8 + used..];
    let crc = match (checksum, rest) {
        (true, &[a, b, c, d]) => Some(u32::from_le_bytes([a, b, c, d])),
        (false, []) => None,
        _ => {
            return Err(format!(
                "spilled payload has {} bytes after its descriptor, expected {}",
                rest.len(),
                if checksum { 4 } else { 0 }
            ))
        }
    };
    if len != remote.size() {
        return Err(format!(
            "spilled data says {len} bytes, its handle has {}",
            remote.size()
        ));
    }
    if len > max {
        return Err(format!("spilled data of {len} bytes exceeds the limit of {max}"));
    }
    Ok(Spilled { len, remote, crc })
}

/// Checks pulled spilled `data` against the CRC-32C its payload carried.
pub fn verify(data: &[u8], crc: Option<u32>) -> Result<(), String> {
    match crc {
        Some(want) if crc32c(data) != want => Err(format!(
            "the spilled data's CRC-32C is {:#010x}, its sender said {want:#010x} (corrupted in transit or in memory)",
            crc32c(data)
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use na_core::RemoteSegment;

    #[test]
    fn parse_checks_everything() {
        let r = RemoteMem::new(
            vec![RemoteSegment {
                addr: 4096,
                len: 10,
                key: 0,
            }],
            Access::ReadOnly,
        )
        .unwrap();
        let ok = [&10u64.to_le_bytes()[..], &r.to_bytes()].concat();
        let s = parse(&ok, 100, false).unwrap();
        assert_eq!((s.len, s.crc), (10, None));
        assert!(parse(&ok, 9, false).is_err(), "over the limit");
        assert!(parse(&[&11u64.to_le_bytes()[..], &r.to_bytes()].concat(), 100, false).is_err());
        for cut in 0..ok.len() {
            assert!(parse(&ok[..cut], 100, false).is_err());
        }
        // With a checksum: exactly four more bytes, the data's CRC.
        let with = [&ok[..], &0xdead_beefu32.to_le_bytes()].concat();
        assert_eq!(parse(&with, 100, true).unwrap().crc, Some(0xdead_beef));
        assert!(parse(&ok, 100, true).is_err(), "checksum missing");
        assert!(parse(&with, 100, false).is_err(), "trailing bytes");
        assert!(parse(&with[..with.len() - 1], 100, true).is_err());
        assert!(parse(&[&with[..], &[0]].concat(), 100, true).is_err());
    }

    #[test]
    fn verify_compares_the_crc_of_the_data() {
        let data = b"123456789";
        assert!(verify(data, None).is_ok());
        assert!(verify(data, Some(0xe306_9283)).is_ok());
        let e = verify(data, Some(0xe306_9284)).unwrap_err();
        assert!(e.contains("0xe3069283") && e.contains("0xe3069284"), "{e}");
    }

    #[test]
    fn a_payload_in_a_much_larger_buffer_is_exposed_as_an_exact_copy() {
        let mut big = Vec::with_capacity(8 << 20);
        big.extend((0..9000u32).map(|i| i as u8));
        let want: Vec<u8> = big.clone();
        let (exposed, spare) = fit_to_len(big);
        assert_eq!(exposed, want);
        assert_eq!(
            exposed.capacity(),
            9000,
            "charged 9000 bytes, holds {}",
            exposed.capacity()
        );
        assert!(
            spare.is_some_and(|s| s.capacity() >= 8 << 20),
            "the large buffer is given back"
        );
        // Up to twice the length: exposed as it is, no copy.
        let mut near = Vec::with_capacity(16_000);
        near.extend(std::iter::repeat_n(7u8, 9000));
        let cap = near.capacity();
        let (exposed, spare) = fit_to_len(near);
        assert_eq!((exposed.len(), exposed.capacity()), (9000, cap));
        assert!(spare.is_none());
    }
}
