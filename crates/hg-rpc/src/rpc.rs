//! RPC definitions and their ids.

use serde::de::DeserializeOwned;
use serde::Serialize;

/// An RPC: a name, an input type and an output type. Define one per
/// operation with a unit struct:
///
/// ```
/// use hg_rpc::Rpc;
/// struct Add;
/// impl Rpc for Add {
///     const NAME: &'static str = "calc.add";
///     type Input = (u64, u64);
///     type Output = u64;
/// }
/// assert_eq!(hg_rpc::rpc_id(Add::NAME), hg_rpc::rpc_id("calc.add"));
/// ```
pub trait Rpc: 'static {
    /// The name both sides register; its hash is the wire id.
    const NAME: &'static str;
    /// Arguments.
    type Input: Serialize + DeserializeOwned + Send + 'static;
    /// Results.
    type Output: Serialize + DeserializeOwned + Send + 'static;
}

/// The wire id of an RPC name: FNV-1a 64 over its UTF-8 bytes. Stable
/// across builds, platforms and versions (unlike `std`'s hashers).
pub const fn rpc_id(name: &str) -> u64 {
    let b = name.as_bytes();
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut i = 0;
    while i < b.len() {
        h ^= b[i] as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    h
}

#[cfg(test)]
mod tests {
    #[test]
    fn fnv1a_known_values() {
        assert_eq!(super::rpc_id(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(super::rpc_id("a"), 0xaf63_dc4c_8601_ec8c);
    }
}
