//! Fuzzes the words of an na-sm region the peer writes and the sender
//! side reads: the region header (`check_region`), the receiver's
//! `consumed` count, the free mask and the receiver's sleep flag. A
//! sender sends as the plugin does between the peer's writes; whatever
//! they hold, it never panics nor writes outside the region, never takes
//! a buffer bit above the buffers', and never sends past the credit the
//! largest `consumed` it could have read gives.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::atomic::Ordering;

use na_sm::channel::{
    check_region, decode_slot, init_region, Channel, MsgKind, TxCursor, BUF_SIZE, INLINE_MAX, NUM_BUFS,
    REGION_LEN, REGION_MAGIC, REGION_VERSION, RING_SLOTS,
};
use na_sm::sys::shm::SharedRegion;

/// Each channel's control page (page 1 + channel): free mask, then
/// rx_waiting, tx_waiting and consumed, a cache line apart.
const CTL: [usize; 2] = [4096, 8192];
/// The header words `init_region` writes (the pid word is not checked).
const HEADER: [u64; 4] = [REGION_MAGIC, REGION_VERSION, NUM_BUFS as u64, BUF_SIZE as u64];

thread_local! {
    static REGION: SharedRegion = SharedRegion::create("qs-fuzz-sender", REGION_LEN).expect("a shared region");
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let words: Vec<u64> = rest
        .chunks_exact(8)
        .take(512)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8")))
        .collect();
    REGION.with(|region| {
        // A fresh region: control pages and rings zero, as a new one is.
        region.write(CTL[0], &[0u8; 6 * 4096]);
        init_region(region, 1);
        // The header: any word the peer changed is refused.
        if first & 0x80 != 0 {
            let k = usize::from(first & 3);
            let v = words.first().copied().unwrap_or(0);
            region.atomic(8 * k).store(v, Ordering::Relaxed);
            assert_eq!(
                check_region(region).is_ok(),
                v == HEADER[k],
                "header word {k} = {v:#x}"
            );
            init_region(region, 1);
        }
        assert!(check_region(region).is_ok());
        let c = usize::from(first & 1);
        let ch = Channel::new(region, c);
        let mut tx = TxCursor::default();
        let mut most_consumed = 0u64;
        let payload = [0xa5u8; BUF_SIZE];
        for &w in &words {
            let v = w >> 3;
            match w & 7 {
                0 => {
                    region.atomic(CTL[c] + 192).store(v, Ordering::Release);
                    most_consumed = most_consumed.max(v);
                }
                1 => region.atomic(CTL[c]).store(w, Ordering::Release),
                2 => {
                    region.atomic(CTL[c] + 64).store(v & 3, Ordering::Release);
                    let _ = ch.receiver_needs_wake();
                }
                3 => {
                    let _ = ch.arm_sender(&mut tx, (v % (BUF_SIZE as u64 + 1)) as usize);
                }
                _ => {
                    let len = (v % (BUF_SIZE as u64 + 1)) as usize;
                    let pos = tx.pos;
                    let kind = if w & 1 == 0 {
                        MsgKind::Unexpected
                    } else {
                        MsgKind::Expected
                    };
                    let sent = ch
                        .try_send(&mut tx, kind, v as u32, &[&payload[..len]])
                        .expect("len <= BUF_SIZE");
                    if !sent {
                        assert_eq!(tx.pos, pos);
                        continue;
                    }
                    assert_eq!(tx.pos, pos + 1);
                    assert!(
                        pos < RING_SLOTS as u64 || most_consumed.saturating_add(RING_SLOTS as u64) > pos,
                        "sent {pos} past the credit of consumed {most_consumed}"
                    );
                    // What the receiver will read: our own message, a buffer in range.
                    let slot = region.atomic(ch.head_word(pos).0).load(Ordering::Acquire);
                    let s = decode_slot(pos, slot).expect("our own slot decodes");
                    assert!(
                        s.len == len
                            && s.kind == kind
                            && s.index < NUM_BUFS
                            && s.inline == (len <= INLINE_MAX)
                    );
                }
            }
        }
    });
});
