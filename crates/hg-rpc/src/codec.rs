//! Serialization behind a small trait, with postcard as the default.

use na_core::hint::cold_path;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::codec_guard::Budget;
pub use crate::codec_guard::{MAX_DEPTH, ZERO_SIZED_ALLOWANCE};

/// Turns serde values into bytes and back. Errors are strings: the RPC
/// layer wraps them with the RPC name and direction.
///
/// `decode` is given a peer's bytes. The default codec, [`Postcard`],
/// decodes through a guard that bounds what those bytes can make it do
/// (nesting depth, [`MAX_DEPTH`]; length hints; elements of zero-sized
/// values, [`ZERO_SIZED_ALLOWANCE`]). The guard is private to that codec:
/// a codec of your own gets none of these limits, and must keep its own
/// (a format decoder that recurses per nesting level, or preallocates
/// what a length field claims, lets a peer overflow the stack of the
/// decoding thread, which aborts the process, or allocate far more than
/// it sent).
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

    /// Decodes through a guard (`codec_guard`): a value nested deeper
    /// than [`MAX_DEPTH`] levels is refused (unbounded, a deeply nested
    /// input of a recursive type overflowed the decoding thread's stack),
    /// no claimed length makes serde preallocate for more elements than
    /// the input has bytes, and collections of zero-sized values hold at
    /// most [`ZERO_SIZED_ALLOWANCE`] more elements than that in all.
    fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, String> {
        let mut de = postcard::Deserializer::from_bytes(bytes);
        let budget = Budget::for_input(bytes.len());
        let v = match crate::codec_guard::decode::<T, _>(&mut de, bytes.len(), &budget) {
            Ok(v) => v,
            Err(e) => {
                cold_path();
                return Err(budget.refused().map_or_else(|| e.to_string(), str::to_owned));
            }
        };
        let rest = de.finalize().map_err(|e| e.to_string())?;
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

    /// A recursive type: each `Node` one level deeper, one byte each.
    #[derive(Debug, serde::Deserialize)]
    enum Chain {
        End,
        Node(Box<Chain>),
    }

    impl Chain {
        fn levels(&self) -> usize {
            let (mut n, mut at) = (0, self);
            while let Chain::Node(next) = at {
                (n, at) = (n + 1, next);
            }
            n
        }
    }

    /// `levels` nodes, then the end.
    fn chain(levels: usize) -> Vec<u8> {
        let mut b = vec![1u8; levels];
        b.push(0);
        b
    }

    /// A value of a recursive type nested far deeper than any real one
    /// is refused, not decoded until the stack overflows (which aborted
    /// the process: fuzz target `rpc_codec`). Decoded on a thread with a
    /// 2 MiB stack (tokio's workers' and std's default), with 100 000
    /// levels (a 100 KB input; a spilled input may be 64 MiB).
    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        let deep = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(|| Postcard.decode::<Chain>(&chain(100_000)).map(|_| ()))
            .unwrap()
            .join()
            .expect("the decoding thread survives");
        let e = deep.unwrap_err();
        assert!(e.contains(&format!("deeper than {MAX_DEPTH}")), "{e}");
        // Within the bound it decodes: each variant is a level (the
        // innermost `End` too).
        let ok = Postcard.decode::<Chain>(&chain(MAX_DEPTH - 1)).unwrap();
        assert_eq!(ok.levels(), MAX_DEPTH - 1);
        assert!(Postcard.decode::<Chain>(&chain(MAX_DEPTH)).is_err());
        // And a later, unrelated error says what it is.
        let e = Postcard.decode::<Chain>(&[7]).unwrap_err();
        assert!(!e.contains("deeper"), "{e}");
    }

    /// Records the length hint a map's decoder is given.
    struct HintProbe(Option<usize>);

    impl<'de> serde::Deserialize<'de> for HintProbe {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = HintProbe;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a map")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(self, m: A) -> Result<HintProbe, A::Error> {
                    Ok(HintProbe(m.size_hint()))
                }
            }
            d.deserialize_map(V)
        }
    }

    /// A map's claimed length reaches serde (which preallocates up to it,
    /// at most 1 MiB of entries) as at most the input's length: postcard
    /// passes it as it is, and 4 bytes made a 2 MiB allocation (fuzz
    /// target `rpc_codec`), once per nesting level.
    #[test]
    fn a_claimed_map_length_is_no_hint_past_the_input() {
        let claims_117179 = [0xbb, 0x93, 0x07];
        let hint = Postcard.decode::<HintProbe>(&claims_117179).map(|h| h.0);
        assert_eq!(hint, Ok(Some(3)), "the hint is capped at the 3 input bytes");
        assert!(Postcard
            .decode::<std::collections::HashMap<u16, u64>>(&claims_117179)
            .is_err());
    }

    /// A collection of zero-sized values (no byte per element) that
    /// claims 2^40 elements in six bytes is refused at once, not decoded
    /// element by element for a quarter of an hour (2^63 in ten bytes:
    /// for ever); up to the allowance, such collections decode.
    #[test]
    fn zero_sized_elements_are_bounded_by_the_input_plus_an_allowance() {
        let claims_2_40 = [0x80, 0x80, 0x80, 0x80, 0x80, 0x20];
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(Postcard.decode::<Vec<()>>(&claims_2_40).map(|v| v.len()));
        });
        let r = rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("the decode is still counting zero-sized elements after 30 s");
        assert!(r.unwrap_err().contains("more collection elements"));
        let mut fits = Vec::new();
        Postcard
            .encode(&vec![(); ZERO_SIZED_ALLOWANCE], &mut fits)
            .unwrap();
        let units: Vec<()> = Postcard.decode(&fits).unwrap();
        assert_eq!(units.len(), ZERO_SIZED_ALLOWANCE);
        // Elements that take bytes never reach the bound.
        let mut bytes = Vec::new();
        Postcard
            .encode(&vec![7u8; 3 * ZERO_SIZED_ALLOWANCE], &mut bytes)
            .unwrap();
        assert_eq!(
            Postcard.decode::<Vec<u8>>(&bytes).unwrap().len(),
            3 * ZERO_SIZED_ALLOWANCE
        );
    }
}
