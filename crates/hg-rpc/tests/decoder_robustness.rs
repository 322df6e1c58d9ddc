//! Every decoder that reads peer bytes, fed random and mutated inputs in
//! bulk (a fixed-seed stand-in for the cargo-fuzz targets in `fuzz/`, so
//! that CI exercises them on stable): no input may panic, and what decodes
//! must re-encode to the same bytes.

use hg_rpc::header::{Header, Status, FLAG_CHECKSUM};
use na_core::{Access, RemoteMem, RemoteSegment};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A copy of `base` with a few random byte edits, truncations or extensions.
    fn mutate(&mut self, base: &[u8]) -> Vec<u8> {
        let mut v = base.to_vec();
        for _ in 0..1 + self.next() % 4 {
            match self.next() % 4 {
                0 if !v.is_empty() => {
                    let i = (self.next() % v.len() as u64) as usize;
                    v[i] = self.next() as u8;
                }
                1 if !v.is_empty() => v.truncate((self.next() % v.len() as u64) as usize),
                2 => v.push(self.next() as u8),
                _ => {
                    if v.len() >= 8 {
                        let i = (self.next() % (v.len() as u64 - 7)) as usize;
                        v[i..i + 8].copy_from_slice(&self.next().to_le_bytes());
                    }
                }
            }
        }
        v
    }
}

#[test]
fn header_decoder_survives_random_and_mutated_input() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut valid = Vec::new();
    Header {
        flags: FLAG_CHECKSUM,
        status: Status::Ok,
        rpc_id: 7,
        cookie: 9,
        payload_len: 0,
        checksum: 0,
    }
    .encode_with(b"some payload bytes", &mut valid);
    let mut decoded = 0;
    for i in 0..200_000 {
        let input = if i % 2 == 0 {
            rng.mutate(&valid)
        } else {
            (0..rng.next() % 80).map(|_| rng.next() as u8).collect()
        };
        if let Ok((h, p)) = Header::decode(&input) {
            let mut again = Vec::new();
            h.encode_with(p, &mut again);
            assert_eq!(again, input);
            decoded += 1;
        }
    }
    // Edits to cookie or id bytes keep a message valid: some must decode.
    assert!(decoded > 0);
}

#[test]
fn memory_and_bulk_decoders_survive_random_and_mutated_input() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let segs = (0..5)
        .map(|i| RemoteSegment {
            addr: 4096 * (i + 1),
            len: 100 + i,
            key: i,
        })
        .collect();
    let valid = RemoteMem::new(segs, Access::ReadWrite).unwrap().to_bytes();
    let bulk = hg_rpc::BulkDesc {
        owner: "sm://1-0".into(),
        mem: serde_bytes::ByteBuf::from(valid.clone()),
        inline: None,
    };
    let valid_bulk = postcard::to_allocvec(&bulk).unwrap();
    for _ in 0..100_000 {
        let m = rng.mutate(&valid);
        if let Ok(r) = RemoteMem::from_bytes(&m) {
            assert_eq!(r.to_bytes(), m);
            assert!(r.check_range(r.size(), 1).is_err());
        }
        let b = rng.mutate(&valid_bulk);
        if let Ok(h) = postcard::from_bytes::<hg_rpc::Bulk>(&b) {
            assert!(h.local().is_none());
            if let Some(d) = &h.desc().inline {
                assert_eq!(d.len() as u64, h.size());
            }
        }
    }
}
