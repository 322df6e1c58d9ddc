//! Fuzzes what a shared-memory peer controls in na-sm: the words of the
//! ring a receiver reads. A region of the real layout (a sealed memfd
//! mapping, as between two processes) is written with the fuzzer's slot headers and free mask (the
//! words whose values steer the receiver; payload bytes are only copied),
//! and a receiver walks the ring as the plugin does: peek, copy out,
//! release, publish. Any contents give messages within the layout's
//! bounds or a protocol error, never a panic or a read outside the region.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::atomic::Ordering;

use na_sm::channel::{
    decode_slot, encode_slot, init_region, Channel, RxCursor, BUF_SIZE, INLINE_MAX, NUM_BUFS, REGION_LEN,
};
use na_sm::sys::shm::SharedRegion;

/// Where each channel's free mask lives: the first word of its control
/// page (page 1 + channel; see `na_sm::channel`'s layout table).
const FREE_MASK: [usize; 2] = [4096, 8192];

thread_local! {
    static REGION: SharedRegion = SharedRegion::create("qs-fuzz-ring", REGION_LEN).expect("a shared region");
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks the channel (0 or 1) and where the walk starts
    // (a lap far along, to reach every marker); the next 8 are the
    // buffers' free mask; then 8-byte slot headers, one per message.
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let Some((mask, rest)) = rest.split_first_chunk::<8>() else {
        return;
    };
    let c = usize::from(first & 1);
    let start = u64::from(first >> 1) * 997;
    let words: Vec<u64> = rest
        .chunks_exact(8)
        .take(256)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .collect();
    // Pure decoding: a decoded slot is within the layout and re-encodes.
    for (k, &v) in words.iter().enumerate() {
        let pos = start + k as u64;
        if let Ok(s) = decode_slot(pos, v) {
            assert!(s.len <= BUF_SIZE && s.index < NUM_BUFS);
            assert!(!s.inline || (s.len <= INLINE_MAX && s.index == 0));
            assert_eq!(encode_slot(pos, &s), v, "decode then encode must round-trip");
        }
    }
    REGION.with(|region| {
        init_region(region, 1);
        let ch = Channel::new(region, c);
        // The free mask the peer wrote (the receiver validates a release
        // against it). Each slot the walk reads is written just before.
        region.write(FREE_MASK[c], mask);
        let mut rx = RxCursor::default();
        rx.pos = start;
        let mut buf = Vec::new();
        for (k, &v) in words.iter().enumerate() {
            let pos = start + k as u64;
            // The peer publishes message `pos` (or garbage) in its slot.
            let (off, _) = ch.head_word(pos);
            region.atomic(off).store(v, Ordering::Release);
            match ch.peek(pos) {
                Ok(Some(s)) => {
                    ch.read_payload(pos, &s, &mut buf);
                    assert_eq!(buf.len(), s.len);
                    if ch.release(&mut rx, &s).is_err() {
                        break;
                    }
                    assert_eq!(rx.pos, pos + 1);
                    ch.publish(&mut rx);
                }
                Ok(None) | Err(_) => break,
            }
        }
    });
});
