//! Fuzzes the decode of a user's type from peer bytes through hg-rpc's
//! `Codec` (postcard, the default), with a deliberately nested type:
//! recursion through boxes, sequences and maps, strings, bytes and a
//! collection of zero-sized values. Any bytes give a value or an error,
//! never a panic nor a hang; a value re-encodes no longer than its input
//! and decodes back to itself; and a length field does not make the
//! decoder allocate far more than the input justifies.
#![no_main]
#![deny(unsafe_code)]

use std::collections::{BTreeMap, HashMap};

use hg_rpc::{Codec, Postcard};
use libfuzzer_sys::fuzz_target;
use serde::{Deserialize, Serialize};

// The allocator that notes the largest allocation (all the unsafe).
#[allow(unsafe_code)]
mod sys;

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum Tree {
    Leaf(u64),
    Signed(i32, i8),
    Text(String),
    Bytes(#[serde(with = "serde_bytes")] Vec<u8>),
    Boxed(Box<Tree>),
    Seq(Vec<Tree>),
    Map(BTreeMap<String, Tree>),
    Hashed(HashMap<u16, Tree>),
    Opt(Option<Box<Tree>>),
    Units(Vec<()>),
    Pair { left: Box<Tree>, right: (bool, char) },
}

fuzz_target!(|data: &[u8]| {
    sys::alloc::reset_largest();
    let decoded = Postcard.decode::<Tree>(data);
    // Each input byte may become at most one element of the largest
    // element type (a `Tree`, or a map's entry and its table slack).
    let justified = 4096 + data.len() * 4 * std::mem::size_of::<(u16, Tree)>();
    let largest = sys::alloc::largest();
    assert!(
        largest <= justified,
        "{} input bytes made a {largest}-byte allocation",
        data.len()
    );
    if let Ok(v) = decoded {
        let mut again = Vec::new();
        Postcard.encode(&v, &mut again).expect("a decoded value encodes");
        assert!(again.len() <= data.len(), "re-encoded longer than the input");
        assert_eq!(
            Postcard.decode::<Tree>(&again).expect("our own encoding decodes"),
            v
        );
    }
});
