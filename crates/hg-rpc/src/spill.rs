//! Spilling: arguments or results too large for one eager message travel
//! as a memory descriptor, and the receiving side pulls them.
//!
//! A spilled payload is the data length (u64 LE) followed by the encoded
//! [`RemoteMem`] that exposes the data.

use na_core::{Access, Endpoint, MemHandle, PluginId, RemoteMem};

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
/// alive until the peer has pulled) and the spilled payload describing it.
pub fn expose(ep: &mut Endpoint, plugin: PluginId, data: Vec<u8>) -> na_core::Result<(MemHandle, Vec<u8>)> {
    let mem = MemHandle::new(vec![data], Access::ReadOnly);
    let p = ep.plugin_mut(plugin)?;
    p.mem_register(&mem)?;
    let desc = p.mem_describe(&mem)?;
    let mut payload = Vec::with_capacity(8 + desc.encoded_len());
    payload.extend_from_slice(&mem.size().to_le_bytes());
    desc.encode_into(&mut payload);
    Ok((mem, payload))
}

/// Parses and checks a spilled payload from a peer: the length must match
/// the descriptor and be at most `max`.
pub fn parse(payload: &[u8], max: u64) -> Result<(u64, RemoteMem), String> {
    let len_bytes: [u8; 8] = payload
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or("spilled payload shorter than its length field")?;
    let len = u64::from_le_bytes(len_bytes);
    let remote = RemoteMem::from_bytes(&payload[8..]).map_err(|e| format!("spilled data: {e}"))?;
    if len != remote.size() {
        return Err(format!(
            "spilled data says {len} bytes, its handle has {}",
            remote.size()
        ));
    }
    if len > max {
        return Err(format!("spilled data of {len} bytes exceeds the limit of {max}"));
    }
    Ok((len, remote))
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
        assert_eq!(parse(&ok, 100).unwrap().0, 10);
        assert!(parse(&ok, 9).is_err(), "over the limit");
        assert!(parse(&[&11u64.to_le_bytes()[..], &r.to_bytes()].concat(), 100).is_err());
        for cut in 0..ok.len() {
            assert!(parse(&ok[..cut], 100).is_err());
        }
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
