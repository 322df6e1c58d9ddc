use super::*;

fn region() -> SharedRegion {
    let r = SharedRegion::create("qs-chan-test", REGION_LEN).unwrap();
    init_region(&r, 1);
    r
}

#[test]
fn slot_roundtrip_and_validation() {
    let s = Slot {
        kind: MsgKind::Expected,
        inline: false,
        index: NUM_BUFS - 1,
        len: BUF_SIZE,
        tag: u32::MAX,
    };
    for pos in [0u64, 63, 64, 2047 * 64, u64::MAX / 2] {
        assert_eq!(decode_slot(pos, encode_slot(pos, &s)).unwrap(), s);
        assert!(decode_slot(pos + 64, encode_slot(pos, &s)).is_err());
    }
    assert!(decode_slot(0, encode_slot(0, &s) | 3 << 51).is_err());
    assert!(
        decode_slot(0, encode_slot(0, &s) | 1 << 53).is_err(),
        "inline with a buffer's length"
    );
    assert!(decode_slot(
        0,
        encode_slot(
            0,
            &Slot {
                len: BUF_SIZE + 1,
                ..s
            }
        )
    )
    .is_err());
}

/// Fills the ring with `len`-byte messages until a send does not fit, then
/// drains it, checking payloads, wake-up flags and that sending resumes only
/// once the receiver publishes what it consumed.
fn fill_and_drain(len: usize) {
    let r = region();
    check_region(&r).unwrap();
    let ch = Channel::new(&r, 0);
    let (mut tx, mut rx) = (TxCursor::default(), RxCursor::default());
    // Inline messages need only a slot; larger ones a buffer too.
    let room = if len <= INLINE_MAX { RING_SLOTS } else { NUM_BUFS };
    for i in 0..room {
        assert!(ch
            .try_send(&mut tx, MsgKind::Unexpected, i as u32, &[&vec![i as u8; len]])
            .unwrap());
    }
    assert!(
        !ch.try_send(&mut tx, MsgKind::Unexpected, 0, &[&vec![0; len]])
            .unwrap(),
        "send {} must not fit",
        room + 1
    );
    assert!(!ch.can_send(&mut tx, len));
    assert!(ch.arm_sender(&mut tx, len), "nothing fits: the sender may sleep");
    let mut buf = Vec::new();
    for i in 0..room {
        let s = ch.peek(rx.pos).unwrap().unwrap();
        assert_eq!((s.tag, s.len, s.inline), (i as u32, len, len <= INLINE_MAX));
        ch.read_payload(rx.pos, &s, &mut buf);
        assert_eq!(buf, vec![i as u8; len]);
        ch.release(&mut rx, &s).unwrap();
    }
    if room == RING_SLOTS {
        assert!(!ch.can_send(&mut tx, len), "slots are reused only after publish");
    } else {
        assert!(
            ch.can_send(&mut tx, len),
            "released buffers are free again at once"
        );
    }
    assert!(ch.publish(&mut rx));
    assert!(!ch.publish(&mut rx), "nothing new to publish");
    assert!(ch.sender_needs_wake());
    assert!(!ch.sender_needs_wake(), "flag is consumed");
    assert!(
        !ch.arm_sender(&mut tx, len),
        "room again: the sender must not sleep"
    );
    assert_eq!(
        ch.peek(rx.pos).unwrap(),
        None,
        "the previous lap's slot is not a message"
    );
    assert!(ch.arm_receiver(rx.pos));
    assert!(ch
        .try_send(&mut tx, MsgKind::Expected, 5, &[&vec![7; len]])
        .unwrap());
    assert!(ch.receiver_needs_wake());
    assert!(
        !ch.arm_receiver(rx.pos),
        "a published message must prevent sleeping"
    );
    let s = ch.peek(rx.pos).unwrap().unwrap();
    ch.read_payload(rx.pos, &s, &mut buf);
    assert_eq!(buf, vec![7; len]);
    let mut again = rx;
    ch.release(&mut rx, &s).unwrap();
    if !s.inline {
        // Releasing a buffer the sender never reserved is a violation.
        assert!(ch.release(&mut again, &s).is_err());
    }
}

/// Over two full cycles of the lap marker (1024 laps each) with a receiver
/// that publishes rarely: the sender's cached credit and the lap markers
/// keep every message in order.
#[test]
fn many_laps_with_lazy_publish() {
    const MESSAGES: u32 = 2 * 1024 * RING_SLOTS as u32 + 100;
    let r = region();
    let ch = Channel::new(&r, 1);
    let (mut tx, mut rx) = (TxCursor::default(), RxCursor::default());
    let mut buf = Vec::new();
    let mut next_expected = 0u32;
    for i in 0..MESSAGES {
        while !ch
            .try_send(&mut tx, MsgKind::Expected, i, &[&i.to_le_bytes()])
            .unwrap()
        {
            // Drain up to 10 messages, publish, retry.
            for _ in 0..10 {
                let Some(s) = ch.peek(rx.pos).unwrap() else { break };
                ch.read_payload(rx.pos, &s, &mut buf);
                assert_eq!(
                    (s.tag, buf.as_slice()),
                    (next_expected, &next_expected.to_le_bytes()[..])
                );
                next_expected += 1;
                ch.release(&mut rx, &s).unwrap();
            }
            ch.publish(&mut rx);
        }
    }
    while let Some(s) = ch.peek(rx.pos).unwrap() {
        assert_eq!(s.tag, next_expected);
        next_expected += 1;
        ch.release(&mut rx, &s).unwrap();
    }
    assert_eq!(next_expected, MESSAGES);
}

/// A receiver that claims to have consumed more than was sent cannot make
/// the sender run ahead of its own count; one that goes back keeps the
/// credit it already gave.
#[test]
fn consumed_count_from_the_peer_is_clamped() {
    let r = region();
    let ch = Channel::new(&r, 0);
    let mut tx = TxCursor::default();
    r.atomic(PAGE + CTL_CONSUMED)
        .store(u64::MAX / 2, Ordering::SeqCst);
    for i in 0..RING_SLOTS as u32 {
        assert!(ch.try_send(&mut tx, MsgKind::Unexpected, i, &[&[]]).unwrap());
    }
    // consumed (clamped to 0 when first read) + 64: the ring is full.
    r.atomic(PAGE + CTL_CONSUMED).store(10, Ordering::SeqCst);
    for i in 0..10 {
        assert!(ch.try_send(&mut tx, MsgKind::Unexpected, i, &[&[]]).unwrap());
    }
    assert!(!ch.try_send(&mut tx, MsgKind::Unexpected, 0, &[&[]]).unwrap());
    r.atomic(PAGE + CTL_CONSUMED).store(3, Ordering::SeqCst);
    assert!(!ch.can_send(&mut tx, 0), "a count that goes back gives nothing");
    assert_eq!(tx.pos, 74);
}

#[test]
fn buffered_messages_backpressure_and_wakeups() {
    fill_and_drain(100);
    fill_and_drain(BUF_SIZE);
}

#[test]
fn inline_messages_backpressure_and_wakeups() {
    fill_and_drain(0);
    fill_and_drain(9);
    fill_and_drain(INLINE_MAX);
}

#[test]
fn inline_slot_validation() {
    let s = Slot {
        kind: MsgKind::Unexpected,
        inline: true,
        index: 0,
        len: INLINE_MAX,
        tag: 1,
    };
    assert_eq!(decode_slot(3, encode_slot(3, &s)).unwrap(), s);
    assert!(decode_slot(
        3,
        encode_slot(
            3,
            &Slot {
                len: INLINE_MAX + 1,
                ..s
            }
        )
    )
    .is_err());
    assert!(decode_slot(3, encode_slot(3, &Slot { index: 5, ..s })).is_err());
}

#[test]
fn scribbled_ring_is_detected_not_trusted() {
    for seed in 1..50u64 {
        let r = region();
        scribble(&r, seed);
        let ch = Channel::new(&r, 1);
        // Whatever the bytes, peek either reports a violation or a slot whose
        // fields are in range; it never panics.
        match ch.peek(seed) {
            Err(_) => {}
            Ok(None) => {}
            Ok(Some(s)) => assert!(s.index < NUM_BUFS && s.len <= BUF_SIZE),
        }
    }
}

#[test]
fn only_this_lap_or_the_previous_one_is_valid() {
    let r = region();
    let ch = Channel::new(&r, 0);
    let mut tx = TxCursor::default();
    assert_eq!(ch.peek(0).unwrap(), None, "a never-used slot is empty");
    assert!(ch.try_send(&mut tx, MsgKind::Unexpected, 1, &[&[]]).unwrap());
    assert_eq!(ch.peek(0).unwrap().map(|s| s.tag), Some(1));
    assert_eq!(
        ch.peek(64).unwrap(),
        None,
        "the previous lap's message is not the next one"
    );
    assert!(ch.peek(128).is_err(), "a marker two laps old is a violation");
}

/// The previous-lap rule holds where the marker wraps (1023 → 0 → 1).
#[test]
fn previous_lap_marker_wraps() {
    let r = region();
    let ch = Channel::new(&r, 0);
    let s = Slot {
        kind: MsgKind::Unexpected,
        inline: true,
        index: 0,
        len: 0,
        tag: 9,
    };
    let zero = 1023 * RING_SLOTS as u64; // marker 0, after marker 1023
    let one = 1024 * RING_SLOTS as u64; // marker 1 again, after marker 0
    for pos in [zero - 1, zero, zero + 1, one - 1, one, one + 1, 5 * one + 7] {
        let prev = pos - RING_SLOTS as u64;
        r.atomic(ch.slot_offset(pos))
            .store(encode_slot(prev, &s), Ordering::SeqCst);
        assert_eq!(
            ch.peek(pos).unwrap(),
            None,
            "message {pos}: previous lap is empty"
        );
        r.atomic(ch.slot_offset(pos))
            .store(encode_slot(pos, &s), Ordering::SeqCst);
        assert_eq!(ch.peek(pos).unwrap(), Some(s));
        r.atomic(ch.slot_offset(pos))
            .store(encode_slot(pos - 2 * RING_SLOTS as u64, &s), Ordering::SeqCst);
        assert!(ch.peek(pos).is_err(), "message {pos}: two laps back");
    }
}

/// The free mask is in memory the peer writes: bits above the buffers
/// never make the sender write past its buffers, and a mask with only such
/// bits means no buffer is free.
#[test]
fn free_mask_bits_above_the_buffers_are_ignored() {
    let r = region();
    let ch = Channel::new(&r, 0);
    let mut tx = TxCursor::default();
    let free = r.atomic(PAGE + CTL_FREE);
    free.store(!ALL_BUFS, Ordering::SeqCst);
    assert!(!ch.can_send(&mut tx, BUF_SIZE), "no buffer is free");
    assert!(!ch
        .try_send(&mut tx, MsgKind::Unexpected, 0, &[&vec![1; BUF_SIZE]])
        .unwrap());
    free.store(u64::MAX, Ordering::SeqCst);
    let mut rx = RxCursor::default();
    for i in 0..NUM_BUFS {
        assert!(ch
            .try_send(
                &mut tx,
                MsgKind::Unexpected,
                i as u32,
                &[&vec![i as u8; BUF_SIZE]]
            )
            .unwrap());
        let s = ch.peek(rx.pos).unwrap().unwrap();
        assert_eq!(s.index, i, "buffers are taken lowest first, none past the last");
        rx.pos += 1;
    }
    assert!(!ch
        .try_send(&mut tx, MsgKind::Unexpected, 0, &[&vec![0; BUF_SIZE]])
        .unwrap());
}

/// Parts whose lengths add up past `usize::MAX` (aliases of one huge
/// region; here read-only zero pages, so nothing is ever allocated) are
/// refused with `LengthOverflow` before anything is written: a wrapped
/// sum would pass for a small inline message.
#[test]
fn parts_adding_up_past_usize_max_are_refused() {
    // The largest region the address space takes; as many aliases of it
    // as add up to 2^64 bytes (2^18 parts of 64 TiB: a 4 MiB list).
    let huge = (40..=46)
        .rev()
        .find_map(|bits| crate::sys::zero_pages::ZeroPages::map(1usize << bits).ok())
        .expect("no address space for a 1 TiB read-only mapping");
    let part = huge.bytes();
    let count = (u64::MAX / part.len() as u64 + 1) as usize;
    let parts = vec![part; count];
    assert!(
        parts
            .iter()
            .try_fold(0usize, |s, p| s.checked_add(p.len()))
            .is_none(),
        "the parts must add up past usize::MAX"
    );
    let r = region();
    let ch = Channel::new(&r, 0);
    let mut tx = TxCursor::default();
    let err = ch.try_send(&mut tx, MsgKind::Unexpected, 0, &parts).unwrap_err();
    assert!(
        matches!(err, na_core::NaError::LengthOverflow { parts: n, .. } if n == count),
        "{err}"
    );
    assert_eq!(tx.pos, 0, "nothing was published");
    assert_eq!(ch.peek(0).unwrap(), None, "nothing was published");
}

/// A message past [`BUF_SIZE`] is refused (`MessageTooLarge`) before
/// anything is written: published, it would run over its buffer into the
/// next one (a message the receiver may be reading) and the peer would
/// take its slot for a protocol violation. `try_send` is public: its
/// callers outside the plugin have no other check.
#[test]
fn a_message_past_buf_size_is_refused_before_anything_is_written() {
    let r = region();
    let ch = Channel::new(&r, 0);
    let mut tx = TxCursor::default();
    let big = vec![0xa5u8; BUF_SIZE + 1];
    for parts in [&[&big[..]][..], &[&big[..BUF_SIZE], &big[BUF_SIZE..]]] {
        let err = ch
            .try_send(&mut tx, MsgKind::Unexpected, 1, parts)
            .expect_err("a message past BUF_SIZE was taken");
        assert!(
            matches!(err, na_core::NaError::MessageTooLarge { len, max, .. }
                if len == BUF_SIZE + 1 && max == BUF_SIZE),
            "{err}"
        );
        assert_eq!(tx.pos, 0, "nothing was published");
        assert_eq!(ch.peek(0).unwrap(), None, "nothing was published");
        assert_eq!(
            ch.free().load(Ordering::SeqCst) & ALL_BUFS,
            ALL_BUFS,
            "no buffer was taken"
        );
    }
    // Negative control: BUF_SIZE bytes exactly go.
    assert!(ch
        .try_send(&mut tx, MsgKind::Unexpected, 2, &[&big[..BUF_SIZE]])
        .unwrap());
    assert_eq!(ch.peek(0).unwrap().map(|s| (s.tag, s.len)), Some((2, BUF_SIZE)));
}
