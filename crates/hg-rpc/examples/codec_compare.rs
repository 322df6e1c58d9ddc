//! Measures the serde codec candidates on typical RPC arguments: encoded
//! size and encode+decode time (median of 9 batches).
//! Run: `cargo run --release -p hg-rpc --example codec_compare`.
//!
//! bincode is not a candidate: 3.0.0 is a compile error, 2.x unmaintained.

use std::hint::black_box;
use std::time::Instant;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

#[derive(Serialize, Deserialize, PartialEq, Debug, Clone)]
struct Stat {
    key: String,
    offsets: Vec<u64>,
    mode: u32,
    owner: Option<String>,
    flags: (bool, bool, u8),
}

fn time<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(
    name: &str,
    what: &str,
    v: &T,
    enc: impl Fn(&T) -> Vec<u8>,
    dec: impl Fn(&[u8]) -> T,
) {
    let bytes = enc(v);
    assert_eq!(&dec(&bytes), v, "{name} does not round-trip {what}");
    let n = 20_000;
    let mut batches = Vec::new();
    for _ in 0..9 {
        let t = Instant::now();
        for _ in 0..n {
            let b = enc(black_box(v));
            black_box(dec(black_box(&b)));
        }
        batches.push(t.elapsed().as_nanos() as f64 / f64::from(n));
    }
    batches.sort_by(f64::total_cmp);
    println!(
        "{what:<12} {name:<10} {:>6} bytes {:>9.1} ns encode+decode",
        bytes.len(),
        batches[4]
    );
}

fn all<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(what: &str, v: &T) {
    time(
        "postcard",
        what,
        v,
        |v| postcard::to_allocvec(v).unwrap(),
        |b| postcard::from_bytes(b).unwrap(),
    );
    time(
        "msgpack",
        what,
        v,
        |v| rmp_serde::to_vec(v).unwrap(),
        |b| rmp_serde::from_slice(b).unwrap(),
    );
    time(
        "json",
        what,
        v,
        |v| serde_json::to_vec(v).unwrap(),
        |b| serde_json::from_slice(b).unwrap(),
    );
}

fn main() {
    all("(u64, u64)", &(40u64, 2u64));
    all(
        "struct",
        &Stat {
            key: "objects/2026/11/22/blob-000042".into(),
            offsets: (0..16).map(|i| i * 4096 + 7).collect(),
            mode: 0o644,
            owner: Some("alice".into()),
            flags: (true, false, 3),
        },
    );
    all("4 KiB bytes", &ByteBuf::from(vec![0xa5u8; 4096]));
}
