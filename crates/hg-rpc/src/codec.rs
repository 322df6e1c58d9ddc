//! Serialization behind a small trait, with postcard as the default.

use na_core::hint::cold_path;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Turns serde values into bytes and back. Errors are strings: the RPC
/// layer wraps them with the RPC name and direction.
pub trait Codec: Clone + Send + Sync + 'static {
    /// Appends the encoding of `value` to `out`.
    fn encode<T: Serialize>(&self, value: &T, out: &mut Vec<u8>) -> Result<(), String>;
    /// Decodes a value from exactly `bytes` (trailing bytes are an error).
    fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, String>;
}

/// [postcard](https://docs.rs/postcard): compact varint encoding, no
/// schema on the wire, maintained, `no_std`-capable; the default.
///
/// Chosen by measurement (`cargo run --release -p hg-rpc --example
/// codec_compare`, this machine, encode+decode, median): `(u64, u64)` 2
/// bytes in 28 ns (MessagePack 3 B / 32 ns, JSON 6 B / 36 ns); a typical
/// metadata struct 87 B / 225 ns (MessagePack 94 B / 292 ns, JSON 192 B /
/// 598 ns); 4 KiB of bytes 131 ns (MessagePack 119 ns, JSON 52 us). It is
/// the smallest and, for the small arguments RPCs mostly carry, the
/// fastest. bincode is not a candidate: 3.0.0 is a compile error and 2.x is
/// unmaintained.
#[derive(Clone, Copy, Debug, Default)]
pub struct Postcard;

impl Codec for Postcard {
    fn encode<T: Serialize>(&self, value: &T, out: &mut Vec<u8>) -> Result<(), String> {
        let taken = std::mem::take(out);
        match postcard::to_extend(value, taken) {
            Ok(v) => {
                *out = v;
                Ok(())
            }
            Err(e) => {
                cold_path();
                Err(e.to_string())
            }
        }
    }

    fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, String> {
        let (v, rest) = match postcard::take_from_bytes(bytes) {
            Ok(r) => r,
            Err(e) => {
                cold_path();
                return Err(e.to_string());
            }
        };
        if !rest.is_empty() {
            cold_path();
            return Err(format!("{} trailing bytes", rest.len()));
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_garbage() {
        let c = Postcard;
        let mut out = vec![9];
        c.encode(&("x".to_string(), 5u64), &mut out).unwrap();
        assert_eq!(out[0], 9, "encode appends");
        let v: (String, u64) = c.decode(&out[1..]).unwrap();
        assert_eq!(v, ("x".into(), 5));
        assert!(c.decode::<(String, u64)>(&out[1..out.len() - 1]).is_err());
        assert!(c
            .decode::<(String, u64)>(&[&out[1..], &[0][..]].concat())
            .is_err());
        assert!(c.decode::<String>(&[0xff, 0xff, 0xff, 0xff, 0x0f]).is_err());
    }
}
