//! Spilling: arguments or results too large for one eager message travel
//! as a memory descriptor, and the receiving side pulls them.
//!
//! A spilled payload is the data length (u64 LE), the encoded
//! [`RemoteMem`] that exposes the data followed by an 8-byte seal, the
//! seal (u64 LE) and, when the message carries a checksum (header flag
//! bit 2), the CRC-32C of the data itself (u32 LE): the header's checksum
//! covers only the message, and the data travels apart from it.
//!
//! The seal says the memory still holds the data when it is pulled. Its
//! sender breaks it (zeroes it) before it lets the memory go unpulled (a
//! TTL ran out), and the puller checks the seal it pulled, which comes
//! after the data: memory freed and reused under a slow puller (shared
//! memory reads it without a fault) is refused, not taken for the data.

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

/// Bytes of the seal exposed after spilled data.
pub const SEAL_LEN: u64 = 8;

/// Exposes `data`, then `seal` (never 0), read-only on `plugin` and
/// returns the handle (keep it alive until the peer has pulled, or
/// [`break_seal`] it first) and the spilled payload describing it (with
/// the data's CRC-32C if `checksum`).
pub fn expose(
    ep: &mut Endpoint,
    plugin: PluginId,
    data: Vec<u8>,
    checksum: bool,
    seal: u64,
) -> na_core::Result<(MemHandle, Vec<u8>)> {
    let crc = checksum.then(|| crc32c(&data));
    let len = data.len() as u64;
    // A segment of its own: `data` may have no room left, and growing it
    // would copy it.
    let mem = MemHandle::new(vec![data, seal.to_le_bytes().to_vec()], Access::ReadOnly);
    let p = ep.plugin_mut(plugin)?;
    p.mem_register(&mem)?;
    let desc = p.mem_describe(&mem)?;
    let mut payload = Vec::with_capacity(8 + desc.encoded_len() + 8 + 4);
    payload.extend_from_slice(&len.to_le_bytes());
    desc.encode_into(&mut payload);
    payload.extend_from_slice(&seal.to_le_bytes());
    if let Some(crc) = crc {
        payload.extend_from_slice(&crc.to_le_bytes());
    }
    Ok((mem, payload))
}

/// Breaks the seal of `mem` (exposed by [`expose`]) before it is let go
/// unpulled: a pull that still reads it then fails its seal check instead
/// of taking whatever the memory holds next for the data.
pub fn break_seal(mem: &MemHandle) {
    if let Some(at) = mem.size().checked_sub(SEAL_LEN) {
        // Our own handle, of at least SEAL_LEN bytes: cannot fail.
        let _ = mem.write_at(at, &[0; SEAL_LEN as usize]);
    }
}

/// The spilled data pulled into `pulled` (the data, then the seal),
/// checked against `seal`: the seal is cut off, and a broken or wrong one
/// refuses the data.
pub fn unseal(pulled: &mut Vec<u8>, seal: u64) -> Result<(), String> {
    let at = pulled.len().saturating_sub(SEAL_LEN as usize);
    let got = pulled
        .get(at..)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes);
    if got != Some(seal) {
        let got = got.map_or_else(|| "missing".to_string(), |g| format!("{g:#x}"));
        return Err(format!(
            "the spilled data's seal is {got}, its sender said {seal:#x}: its memory was let go (a TTL ran out) \
             or reused before the pull"
        ));
    }
    pulled.truncate(at);
    Ok(())
}

/// A spilled payload from a peer, checked: the data's length, where it is
/// (with its seal after it), the seal, and the data's CRC-32C if the
/// message carries a checksum.
#[derive(Debug)]
pub struct Spilled {
    /// Bytes of data (the handle has [`SEAL_LEN`] more).
    pub len: u64,
    /// The peer's memory holding them, then the seal.
    pub remote: RemoteMem,
    /// The seal to find after the data once pulled (see [`unseal`]).
    pub seal: u64,
    /// Their CRC-32C, to check once pulled (`checksum` messages only).
    pub crc: Option<u32>,
}

/// Parses and checks a spilled payload from a peer: the descriptor must
/// allow reading, the length plus the
/// seal must match the descriptor and the length be at most `max`; the
/// seal (never 0) follows the descriptor, then, with `checksum` (the
/// header's flag bit 2), the data's CRC-32C, else nothing.
pub fn parse(payload: &[u8], max: u64, checksum: bool) -> Result<Spilled, String> {
    let len_bytes: [u8; 8] = payload
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or("spilled payload shorter than its length field")?;
    let len = u64::from_le_bytes(len_bytes);
    let (remote, used) = RemoteMem::decode_prefix(&payload[8..])
        .map_err(|e| format!("spilled data: {}", na_core::ErrorChain(&e)))?;
    if !remote.access().can_read() {
        // Data to pull: a descriptor that forbids reading it is no
        // description of it (not a transport failure of the pull).
        return Err(format!(
            "spilled data described {:?}: its puller may not read it",
            remote.access()
        ));
    }
    let rest = &payload[8 + used..];
    let want = if checksum { 12 } else { 8 };
    if rest.len() != want {
        return Err(format!(
            "spilled payload has {} bytes after its descriptor, expected {want}",
            rest.len()
        ));
    }
    let seal = u64::from_le_bytes(rest[..8].try_into().unwrap_or([0; 8]));
    if seal == 0 {
        return Err("spilled payload has a broken (zero) seal".into());
    }
    let crc = checksum.then(|| u32::from_le_bytes(rest[8..12].try_into().unwrap_or([0; 4])));
    if len.checked_add(SEAL_LEN) != Some(remote.size()) {
        return Err(format!(
            "spilled data says {len} bytes and an {SEAL_LEN}-byte seal, its handle has {}",
            remote.size()
        ));
    }
    if len > max {
        return Err(format!("spilled data of {len} bytes exceeds the limit of {max}"));
    }
    Ok(Spilled {
        len,
        remote,
        seal,
        crc,
    })
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
                len: 10 + SEAL_LEN,
                key: 0,
            }],
            Access::ReadOnly,
        )
        .unwrap();
        let seal = 0x5ea1_u64.to_le_bytes();
        let ok = [&10u64.to_le_bytes()[..], &r.to_bytes(), &seal].concat();
        let s = parse(&ok, 100, false).unwrap();
        assert_eq!((s.len, s.seal, s.crc), (10, 0x5ea1, None));
        assert!(parse(&ok, 9, false).is_err(), "over the limit");
        assert!(parse(
            &[&11u64.to_le_bytes()[..], &r.to_bytes(), &seal].concat(),
            100,
            false
        )
        .is_err());
        assert!(parse(
            &[&18u64.to_le_bytes()[..], &r.to_bytes(), &seal].concat(),
            100,
            false
        )
        .is_err());
        let wo = RemoteMem::new(r.segments().to_vec(), Access::WriteOnly).unwrap();
        let write_only = [&10u64.to_le_bytes()[..], &wo.to_bytes(), &seal].concat();
        assert!(parse(&write_only, 100, false)
            .unwrap_err()
            .contains("may not read"));
        let broken = [&10u64.to_le_bytes()[..], &r.to_bytes(), &[0; 8]].concat();
        assert!(parse(&broken, 100, false).unwrap_err().contains("broken"));
        let huge = [&u64::MAX.to_le_bytes()[..], &r.to_bytes(), &seal].concat();
        assert!(
            parse(&huge, u64::MAX, false).is_err(),
            "length plus seal overflows"
        );
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
    fn unseal_cuts_the_seal_and_refuses_a_broken_or_missing_one() {
        let mut ok = [&b"data"[..], &7u64.to_le_bytes()].concat();
        unseal(&mut ok, 7).unwrap();
        assert_eq!(ok, b"data");
        let mut broken = [&b"data"[..], &[0; 8]].concat();
        assert!(unseal(&mut broken, 7).unwrap_err().contains("seal"));
        let mut short = vec![7u8; 7];
        assert!(unseal(&mut short, 7).is_err());
        // Broken in place, as a sender does before it lets the memory go.
        let mem = MemHandle::new(
            vec![b"data".to_vec(), 7u64.to_le_bytes().to_vec()],
            Access::ReadOnly,
        );
        break_seal(&mem);
        let mut pulled = mem.to_vec();
        assert!(unseal(&mut pulled, 7).is_err());
        assert_eq!(&pulled[..4], b"data", "the data itself untouched");
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
