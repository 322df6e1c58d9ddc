//! Fuzzes na-core's `RemoteMem::decode_prefix` (a descriptor at the start
//! of a longer message, as a spilled payload carries one) and, from
//! structured inputs, the round trip of a memory descriptor and of an
//! hg-bulk descriptor with inline data: a descriptor built from any
//! segments, access and inline bytes encodes, decodes to itself, and a
//! `Bulk` is made of it exactly when its inline data fits the handle.
#![no_main]

use hg_bulk::{Bulk, BulkDesc};
use libfuzzer_sys::fuzz_target;
use na_core::{Access, RemoteMem, RemoteSegment};
use serde_bytes::ByteBuf;

type Input<'a> = (u8, Vec<(u64, u64, u64)>, Option<Vec<u8>>, String, &'a [u8]);

fuzz_target!(|input: Input<'_>| {
    let (access, segs, inline, owner, raw) = input;
    if let Ok((m, used)) = RemoteMem::decode_prefix(raw) {
        assert_eq!(used, m.encoded_len());
        assert_eq!(m.to_bytes(), raw[..used], "decode then encode must round-trip");
    }
    let access = [Access::ReadOnly, Access::WriteOnly, Access::ReadWrite][usize::from(access % 3)];
    let segments = segs
        .into_iter()
        .map(|(addr, len, key)| RemoteSegment { addr, len, key })
        .collect();
    let Ok(mem) = RemoteMem::new(segments, access) else {
        return;
    };
    let bytes = mem.to_bytes();
    let longer = [&bytes[..], raw].concat();
    assert_eq!(
        RemoteMem::decode_prefix(&longer).ok(),
        Some((mem.clone(), bytes.len()))
    );
    assert_eq!(RemoteMem::from_bytes(&bytes).ok().as_ref(), Some(&mem));
    let fits = inline
        .as_ref()
        .is_none_or(|d| d.len() as u64 == mem.size() && access == Access::ReadOnly);
    let desc = BulkDesc {
        owner,
        mem: ByteBuf::from(bytes),
        inline: inline.map(ByteBuf::from),
    };
    let wire = postcard::to_allocvec(&desc).expect("a descriptor encodes");
    match postcard::from_bytes::<Bulk>(&wire) {
        Ok(b) => {
            assert!(fits, "inline data that does not fit its handle was taken");
            assert_eq!(*b.desc(), desc);
            assert_eq!(
                postcard::to_allocvec(&b).expect("encodes"),
                wire,
                "decode then encode must round-trip"
            );
        }
        Err(e) => assert!(!fits, "a consistent descriptor was refused: {e}"),
    }
});
