//! The shared-memory layout of one connection and the lock-free protocol on
//! it. No system calls here: callers decide when to signal.
//!
//! # Region layout (one sealed memfd per connection, [`REGION_LEN`] bytes)
//!
//! | offset               | contents                                              |
//! |----------------------|-------------------------------------------------------|
//! | 0                    | header: magic, version, buffer count and size, pid    |
//! | 4 KiB × (1 + c)      | control page of channel `c` (0: connector → acceptor, 1: back) |
//! | 4 KiB × (3 + 2c)     | two ring pages of channel `c`: 64 slots of 128 bytes  |
//! | 28 KiB + c × 256 KiB | 32 buffers of 8 KiB of channel `c`                    |
//!
//! A control page holds, each on its own cache line: the **free mask** (low
//! 32 bits of a word; bit set = buffer free; the sender clears, the
//! receiver sets, and the sender ignores any higher bit a peer sets), the
//! receiver's **rx_waiting** flag (receiver asleep, wants an eventfd write),
//! the sender's **tx_waiting** flag (sender has a backlog, wants a write
//! when a slot or buffer is freed) and the receiver's **consumed** count
//! (messages it has read out of the ring).
//!
//! A ring **slot** is two cache lines: a header word, then up to
//! [`INLINE_MAX`] bytes of inline payload. The header is
//! `marker:10 | inline:1 | kind:2 | index:5 | len:14 | tag:32` (high to
//! low), or 0 before the slot's first use. Message `p` (counted privately by
//! both sides) goes to slot `p % 64` with marker `(p / 64 + 1) % 1024`:
//! the receiver waiting for message `p` sees the previous lap's marker
//! (or 0, in the first lap) until the sender writes the header, so a stale or replayed slot never
//! looks fresh, and any other marker is a protocol violation.
//! Messages of up to [`INLINE_MAX`] bytes travel inside the slot: one or
//! two cache lines move from sender to receiver (one up to 56 bytes), which
//! is what makes small-message latency close to the raw shared-flag floor;
//! an RPC request with its 32-byte header and a small argument fits.
//! Larger messages reserve an 8 KiB buffer and the slot names it: an RPC
//! with a 4 KiB argument (a storage block, say) and its header still goes
//! eagerly, without a spill into a one-sided pull (layout version 5; it
//! was 64 buffers of 4 KiB, the same memory). Version 6 changed the marker
//! from `(p / 64) % 1023 + 1` to the cheaper form above.
//!
//! # Credit without write-back
//!
//! The receiver never writes to a slot. It publishes how many messages it
//! has consumed (once per poll of the ring, not per message), and the
//! sender may write message `p` once `consumed + 64 > p`; it caches that
//! limit ([`TxCursor`]) and reads `consumed` again only when the cached
//! credit runs out, about once per 64 messages. So a slot's cache line
//! moves from the sender to the receiver once per message and never back:
//! the sender's next write to it (64 messages later) only invalidates the
//! receiver's read-only copy. An earlier layout had the receiver zero each
//! slot, which cost two more cross-core transfers per message, one of them
//! (the sender's check that the slot was empty) on the reply's path.
//!
//! Nothing the peer writes is trusted: a `consumed` beyond what we sent is
//! clamped (it can only make a lying receiver lose its own messages), and a
//! slot header is validated before any field is used.

use std::sync::atomic::{AtomicU64, Ordering};

use na_core::hint::cold_path;

use crate::sys::shm::SharedRegion;

/// Buffers per channel (the low bits of the free mask).
pub const NUM_BUFS: usize = 32;
/// Bytes per buffer: the largest message.
pub const BUF_SIZE: usize = 8192;
/// The free mask's bits that name buffers.
const ALL_BUFS: u64 = (1 << NUM_BUFS) - 1;
/// Slots per ring.
pub const RING_SLOTS: usize = 64;
/// Bytes per ring slot (two cache lines).
pub const SLOT_SIZE: usize = 128;
/// Largest payload carried inside a ring slot.
pub const INLINE_MAX: usize = SLOT_SIZE - 8;
const PAGE: usize = 4096;
const CTL_FREE: usize = 0;
const CTL_RX_WAITING: usize = 64;
const CTL_TX_WAITING: usize = 128;
const CTL_CONSUMED: usize = 192;
const RING_PAGES: usize = RING_SLOTS * SLOT_SIZE / PAGE;
const BUFS_BASE: usize = (3 + 2 * RING_PAGES) * PAGE;
/// Total region size.
pub const REGION_LEN: usize = BUFS_BASE + 2 * NUM_BUFS * BUF_SIZE;
/// First word of the header.
pub const REGION_MAGIC: u64 = u64::from_le_bytes(*b"QSSMRGN1");
/// Layout version.
pub const REGION_VERSION: u64 = 6;

/// Kind of a message in a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MsgKind {
    /// Unexpected message.
    Unexpected = 1,
    /// Expected message.
    Expected = 2,
}

impl MsgKind {
    /// [`NaError::MessageTooLarge`](na_core::NaError::MessageTooLarge) for
    /// a message of this kind and `len` bytes, past [`BUF_SIZE`].
    pub fn too_large(self, len: usize) -> na_core::NaError {
        na_core::NaError::MessageTooLarge {
            len,
            max: BUF_SIZE,
            kind: match self {
                MsgKind::Unexpected => "unexpected",
                MsgKind::Expected => "expected",
            },
        }
    }
}

/// A decoded, validated ring slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Message kind.
    pub kind: MsgKind,
    /// True if the payload is inside the slot (then `index` is 0).
    pub inline: bool,
    /// Buffer index (< [`NUM_BUFS`]).
    pub index: usize,
    /// Payload length (<= [`BUF_SIZE`]).
    pub len: usize,
    /// Tag.
    pub tag: u32,
}

/// The sender's private position on a channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TxCursor {
    /// Number of the next message to send.
    pub pos: u64,
    /// Messages below this number fit in the ring (from the receiver's
    /// last `consumed` we read, plus [`RING_SLOTS`]).
    limit: u64,
}

/// The receiver's private position on a channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RxCursor {
    /// Number of the next message to read.
    pub pos: u64,
    /// The `consumed` count last published to the sender.
    published: u64,
}

/// The sequence marker of message `pos`: its lap plus one, modulo 1024
/// (a shift, an add and a mask: it is computed on every look at a ring).
fn marker(pos: u64) -> u64 {
    ((pos / RING_SLOTS as u64) + 1) & 1023
}

/// True if slot value `v` holds no message `pos`: the slot was never used
/// (lap 0), or still holds the previous lap's message, whose marker is one
/// less (1023 before 0).
fn is_stale(pos: u64, v: u64) -> bool {
    if pos < RING_SLOTS as u64 {
        v == 0
    } else {
        v >> 54 == marker(pos).wrapping_sub(1) & 1023
    }
}

/// Packs a slot for message number `pos`.
pub fn encode_slot(pos: u64, s: &Slot) -> u64 {
    marker(pos) << 54
        | u64::from(s.inline) << 53
        | (s.kind as u64) << 51
        | (s.index as u64) << 46
        | (s.len as u64) << 32
        | u64::from(s.tag)
}

/// Why a ring slot is invalid: the sender broke the protocol. Small and
/// `Copy`, so that the hot path of a poll carries no string; the text is
/// made only when a violation is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotError {
    /// The sequence marker is neither this lap's nor the previous one's.
    Marker {
        /// Message number polled for.
        pos: u64,
        /// The slot's value.
        value: u64,
    },
    /// The kind field holds no known kind.
    Kind {
        /// The slot's value.
        value: u64,
    },
    /// The length exceeds a buffer.
    Len {
        /// The length claimed.
        len: usize,
    },
    /// An inline slot claims more than fits inline, or names a buffer.
    Inline {
        /// The length claimed.
        len: usize,
        /// The buffer index claimed.
        index: usize,
    },
}

impl std::fmt::Display for SlotError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            SlotError::Marker { pos, value } => write!(
                f,
                "ring slot {value:#018x} for message {pos} has sequence marker {}, expected {}",
                value >> 54,
                marker(pos)
            ),
            SlotError::Kind { value } => {
                write!(
                    f,
                    "ring slot {value:#018x} has invalid kind {}",
                    (value >> 51) & 3
                )
            }
            SlotError::Len { len } => write!(f, "ring slot claims {len} bytes (max {BUF_SIZE})"),
            SlotError::Inline { len, index } => {
                write!(f, "inline ring slot claims {len} bytes in buffer {index}")
            }
        }
    }
}

/// Unpacks and validates the slot value `v` read for message number `pos`.
pub fn decode_slot(pos: u64, v: u64) -> Result<Slot, SlotError> {
    if v >> 54 != marker(pos) {
        cold_path();
        return Err(SlotError::Marker { pos, value: v });
    }
    let kind = match (v >> 51) & 3 {
        1 => MsgKind::Unexpected,
        2 => MsgKind::Expected,
        _ => {
            cold_path();
            return Err(SlotError::Kind { value: v });
        }
    };
    let index = ((v >> 46) & 31) as usize;
    let len = ((v >> 32) & 0x3fff) as usize;
    let inline = (v >> 53) & 1 == 1;
    if len > BUF_SIZE {
        cold_path();
        return Err(SlotError::Len { len });
    }
    if inline && (len > INLINE_MAX || index != 0) {
        cold_path();
        return Err(SlotError::Inline { len, index });
    }
    Ok(Slot {
        kind,
        inline,
        index,
        len,
        tag: v as u32,
    })
}

/// Writes the header and initial free masks of a fresh region.
pub fn init_region(region: &SharedRegion, creator_pid: u32) {
    region.atomic(0).store(REGION_MAGIC, Ordering::Relaxed);
    region.atomic(8).store(REGION_VERSION, Ordering::Relaxed);
    region.atomic(16).store(NUM_BUFS as u64, Ordering::Relaxed);
    region.atomic(24).store(BUF_SIZE as u64, Ordering::Relaxed);
    region.atomic(32).store(u64::from(creator_pid), Ordering::Relaxed);
    for c in 0..2 {
        region
            .atomic(ctl(c) + CTL_FREE)
            .store(ALL_BUFS, Ordering::Release);
    }
}

/// Checks the header of a region received from a peer.
pub fn check_region(region: &SharedRegion) -> Result<(), String> {
    let w = |o| region.atomic(o).load(Ordering::Acquire);
    if w(0) != REGION_MAGIC {
        return Err(format!("bad region magic {:#x}", w(0)));
    }
    if w(8) != REGION_VERSION || w(16) != NUM_BUFS as u64 || w(24) != BUF_SIZE as u64 {
        return Err(format!("unsupported region layout v{} {}x{}", w(8), w(16), w(24)));
    }
    Ok(())
}

const fn ctl(channel: usize) -> usize {
    PAGE * (1 + channel)
}

/// Offsets of each channel's control page, ring and buffers.
const LAYOUT: [(usize, usize, usize); 2] = [
    (ctl(0), PAGE * 3, BUFS_BASE),
    (ctl(1), PAGE * (3 + RING_PAGES), BUFS_BASE + NUM_BUFS * BUF_SIZE),
];

/// One direction of a connection, seen through the mapping.
#[derive(Clone, Copy)]
pub struct Channel<'a> {
    region: &'a SharedRegion,
    ctl: usize,
    ring: usize,
    bufs: usize,
}

impl<'a> Channel<'a> {
    /// Channel `c` (0 or 1) of `region`.
    #[inline]
    pub fn new(region: &'a SharedRegion, c: usize) -> Self {
        assert!(c < 2);
        // Both layouts are constants: the choice is a select, not arithmetic
        // (a channel is made for every look at a ring).
        let (ctl, ring, bufs) = if c == 0 { LAYOUT[0] } else { LAYOUT[1] };
        Channel {
            region,
            ctl,
            ring,
            bufs,
        }
    }

    fn free(&self) -> &'a AtomicU64 {
        self.region.atomic(self.ctl + CTL_FREE)
    }

    fn slot_offset(&self, pos: u64) -> usize {
        self.ring + (pos as usize % RING_SLOTS) * SLOT_SIZE
    }

    fn slot(&self, pos: u64) -> &'a AtomicU64 {
        self.region.atomic(self.slot_offset(pos))
    }

    /// The receiver's sleep flag.
    pub fn rx_waiting(&self) -> &'a AtomicU64 {
        self.region.atomic(self.ctl + CTL_RX_WAITING)
    }

    /// The sender's backlog flag.
    pub fn tx_waiting(&self) -> &'a AtomicU64 {
        self.region.atomic(self.ctl + CTL_TX_WAITING)
    }

    fn consumed(&self) -> &'a AtomicU64 {
        self.region.atomic(self.ctl + CTL_CONSUMED)
    }

    /// Sender: true if the ring has a slot for message `tx.pos`, reading
    /// the receiver's `consumed` count (with `order`) only when the cached
    /// credit is used up.
    #[inline(always)]
    fn has_slot(&self, tx: &mut TxCursor, order: Ordering) -> bool {
        tx.pos < tx.limit || self.renew_credit(tx, order)
    }

    /// [`has_slot`](Self::has_slot) once the cached credit is used up
    /// (once a ring's worth of messages): reads `consumed` again.
    #[cold]
    #[inline(never)]
    fn renew_credit(&self, tx: &mut TxCursor, order: Ordering) -> bool {
        // The peer may write anything here: a count beyond what we sent is
        // clamped, one that goes back is ignored (we keep the credit it gave).
        let consumed = self.consumed().load(order).min(tx.pos);
        tx.limit = tx.limit.max(consumed + RING_SLOTS as u64);
        tx.pos < tx.limit
    }

    /// Sender: true if message `tx.pos` of `len` bytes could be published
    /// now (its slot is free, and a buffer is free if it needs one).
    pub fn can_send(&self, tx: &mut TxCursor, len: usize) -> bool {
        self.has_slot(tx, Ordering::SeqCst)
            && (len <= INLINE_MAX || self.free().load(Ordering::SeqCst) & ALL_BUFS != 0)
    }

    #[cfg(any(test, feature = "test-hooks"))]
    /// Sender: publishes message `tx.pos`, the concatenation of `parts`
    /// (a header and a payload, say, written in place without joining
    /// them first), if its slot is free and (for more than [`INLINE_MAX`]
    /// bytes) a buffer is free; false otherwise (the caller queues it).
    /// Parts that add up to more than [`BUF_SIZE`] bytes are
    /// [`NaError::MessageTooLarge`](na_core::NaError::MessageTooLarge)
    /// (published, they would run over their buffer into the next one),
    /// and parts whose lengths add up past `usize::MAX` (aliases of one
    /// huge region: a wrapped sum would pass for a small message)
    /// [`NaError::LengthOverflow`](na_core::NaError::LengthOverflow);
    /// nothing is written then.
    ///
    /// (The plugin's sends go through `try_send_len` with the length
    /// their caller checked once; this checks the parts itself.)
    pub fn try_send(
        &self,
        tx: &mut TxCursor,
        kind: MsgKind,
        tag: u32,
        parts: &[&[u8]],
    ) -> na_core::Result<bool> {
        let len = na_core::msgbuf::parts_len(parts)?;
        if len > BUF_SIZE {
            return Err(kind.too_large(len));
        }
        Ok(self.try_send_len(tx, kind, tag, parts, len))
    }

    /// `try_send` (a test hook) of parts whose lengths add up to
    /// `len`, at most [`BUF_SIZE`] (the caller summed and bounded them
    /// already, checked: see `na_core::msgbuf::parts_len`). Crate-private:
    /// a `len` that is not the parts' sum, or past `BUF_SIZE`, would write
    /// past the slot or the buffer.
    #[inline(always)]
    pub(crate) fn try_send_len(
        &self,
        tx: &mut TxCursor,
        kind: MsgKind,
        tag: u32,
        parts: &[&[u8]],
        len: usize,
    ) -> bool {
        debug_assert_eq!(len, parts.iter().map(|p| p.len()).sum::<usize>());
        debug_assert!(len <= BUF_SIZE);
        // Acquire pairs with the receiver's release of `consumed` after it
        // copied the previous lap's payload out, so we never overwrite it early.
        if !self.has_slot(tx, Ordering::Acquire) {
            return false;
        }
        let pos = tx.pos;
        let inline = len <= INLINE_MAX;
        let (index, mut at) = if inline {
            (0, self.slot_offset(pos) + 8)
        } else {
            let free = self.free();
            // Bits above the buffers are the peer's doing: never ours to use.
            let mask = free.load(Ordering::Acquire) & ALL_BUFS;
            if mask == 0 {
                return false;
            }
            let index = mask.trailing_zeros() as usize;
            // Only we clear bits, so the bit is still set; Acquire pairs with
            // the receiver's release of this buffer (its reads are done).
            free.fetch_and(!(1u64 << index), Ordering::Acquire);
            (index, self.bufs + index * BUF_SIZE)
        };
        for p in parts {
            self.region.write(at, p);
            at += p.len();
        }
        let header = Slot {
            kind,
            inline,
            index,
            len,
            tag,
        };
        // SeqCst: with the receiver's SeqCst store of rx_waiting and load of
        // this slot in `arm_receiver`, and our SeqCst load of rx_waiting,
        // one side must see the other's write (store-buffering litmus). It
        // also releases the payload written above.
        self.slot(pos).store(encode_slot(pos, &header), Ordering::SeqCst);
        tx.pos += 1;
        true
    }

    /// Sender, after publishing: true if the receiver is asleep and must be
    /// woken (consumes its flag, so one wake-up per sleep).
    ///
    /// (The wake-up is out of the busy path's line: a busy receiver never
    /// sleeps, and a sleeping one costs a system call anyway.)
    #[inline(always)]
    pub fn receiver_needs_wake(&self) -> bool {
        let w = self.rx_waiting();
        if w.load(Ordering::SeqCst) == 0 {
            return false;
        }
        cold_path();
        w.swap(0, Ordering::Relaxed) != 0
    }

    /// Receiver: the message at `pos`, if one is published. Errors describe a
    /// protocol violation by the sender.
    #[inline]
    pub fn peek(&self, pos: u64) -> Result<Option<Slot>, SlotError> {
        self.peek_with(pos, Ordering::Acquire)
    }

    #[inline]
    fn peek_with(&self, pos: u64, order: Ordering) -> Result<Option<Slot>, SlotError> {
        let v = self.slot(pos).load(order);
        if v >> 54 == marker(pos) {
            return decode_slot(pos, v).map(Some);
        }
        if is_stale(pos, v) {
            Ok(None)
        } else {
            cold_path();
            Err(SlotError::Marker { pos, value: v })
        }
    }

    /// The region this channel lives in.
    pub fn region(&self) -> &'a SharedRegion {
        self.region
    }

    /// Receiver: the offset in the region of message `pos`'s slot header,
    /// and a value that the header holds exactly while no message `pos`
    /// has arrived: what it holds now if that is a previous lap's (or 0),
    /// or else its complement, so that a message already there reads as
    /// a change.
    pub fn head_word(&self, pos: u64) -> (usize, u64) {
        let v = self.slot(pos).load(Ordering::Acquire);
        (self.slot_offset(pos), if is_stale(pos, v) { v } else { !v })
    }

    /// Receiver: copies the payload of message `pos` (slot `s`) into `dst`
    /// (replacing its contents).
    #[inline(always)]
    pub fn read_payload(&self, pos: u64, s: &Slot, dst: &mut Vec<u8>) {
        let at = if s.inline {
            self.slot_offset(pos) + 8
        } else {
            // (Out of the busy path's line: a buffer's copy of up to 8 KiB
            // costs far more than the jump.)
            cold_path();
            self.bufs + s.index * BUF_SIZE
        };
        self.region.read_to_vec(at, s.len, dst);
    }

    /// Receiver: retires message `rx.pos` and frees its buffer. Fails if
    /// the buffer was not reserved (its free bit was already set): the
    /// sender broke the protocol. One atomic RMW both frees and validates,
    /// so the contended mask line moves once per buffered message. The slot
    /// itself is handed back in bulk by [`publish`](Self::publish).
    #[inline]
    pub fn release(&self, rx: &mut RxCursor, s: &Slot) -> Result<(), String> {
        rx.pos += 1;
        if !s.inline {
            cold_path();
            return self.release_buf(rx, s);
        }
        Ok(())
    }

    /// [`release`](Self::release) of a message in a buffer: frees it.
    #[inline(never)]
    fn release_buf(&self, rx: &RxCursor, s: &Slot) -> Result<(), String> {
        let old = self.free().fetch_or(1 << s.index, Ordering::SeqCst);
        if old & (1 << s.index) != 0 {
            cold_path();
            return Err(format!(
                "message {} used buffer {} that the sender had not reserved",
                rx.pos - 1,
                s.index
            ));
        }
        Ok(())
    }

    /// Receiver: tells the sender how far it has read (every slot before
    /// `rx.pos` may be reused). Returns true if the count moved; then call
    /// [`sender_needs_wake`](Self::sender_needs_wake). Call it after each
    /// batch of releases and always before sleeping.
    pub fn publish(&self, rx: &mut RxCursor) -> bool {
        if rx.published == rx.pos {
            return false;
        }
        // SeqCst: releases our payload reads to the sender's next write of
        // these slots, and pairs with `arm_sender` (a sender waiting for a
        // slot either sees the new count or we see its tx_waiting flag).
        self.consumed().store(rx.pos, Ordering::SeqCst);
        rx.published = rx.pos;
        true
    }

    /// Receiver, after publishing or releasing buffers: true if the sender
    /// waits for a free slot or buffer and must be woken (consumes its flag).
    pub fn sender_needs_wake(&self) -> bool {
        let w = self.tx_waiting();
        w.load(Ordering::SeqCst) != 0 && w.swap(0, Ordering::Relaxed) != 0
    }

    /// Receiver going to sleep: raises rx_waiting, then re-checks the ring.
    /// Returns false (and lowers the flag) if a message is already there.
    /// Pairs with [`receiver_needs_wake`](Self::receiver_needs_wake): the
    /// flag store, the slot load, the sender's slot store and its flag load
    /// are all SeqCst, so either we see the slot or the sender sees the flag.
    /// (The `consumed` store or free-mask RMW, `tx_waiting` and `arm_sender`
    /// pair the same way.)
    pub fn arm_receiver(&self, pos: u64) -> bool {
        self.rx_waiting().store(1, Ordering::SeqCst);
        // A violation is work too: progress reports it.
        if self.peek_with(pos, Ordering::SeqCst) != Ok(None) {
            self.rx_waiting().store(0, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Sender with a backlog going to sleep: raises tx_waiting, then
    /// re-checks whether message `tx.pos` of `len` bytes could go now; false
    /// (flag lowered) if it could.
    pub fn arm_sender(&self, tx: &mut TxCursor, len: usize) -> bool {
        self.tx_waiting().store(1, Ordering::SeqCst);
        if self.can_send(tx, len) {
            self.tx_waiting().store(0, Ordering::Relaxed);
            return false;
        }
        true
    }
}

impl Channel<'_> {
    #[cfg(any(test, feature = "test-hooks"))]
    /// Test hook: publishes message `tx.pos`, unexpected, tag `tag`, 8
    /// bytes in buffer 0, without reserving the buffer (its free bit stays
    /// set): the receiver's release of it is a protocol violation. The
    /// ring must have room and buffer 0 must be free (checked).
    #[doc(hidden)]
    pub fn forge_unreserved(&self, tx: &mut TxCursor, tag: u32) {
        assert!(
            self.has_slot(tx, Ordering::SeqCst),
            "forge_unreserved: the ring is full"
        );
        assert!(
            self.free().load(Ordering::SeqCst) & 1 != 0,
            "forge_unreserved: buffer 0 is in use"
        );
        let header = Slot {
            kind: MsgKind::Unexpected,
            inline: false,
            index: 0,
            len: 8,
            tag,
        };
        self.slot(tx.pos)
            .store(encode_slot(tx.pos, &header), Ordering::SeqCst);
        tx.pos += 1;
    }
}

#[cfg(any(test, feature = "test-hooks"))]
/// Test hook: overwrites both channels' control pages and buffers with
/// pseudo-random bytes from `seed` (header left intact).
pub fn scribble(region: &SharedRegion, seed: u64) {
    let mut x = seed | 1;
    let mut page = vec![0u8; PAGE];
    let mut off = PAGE;
    while off < region.len() {
        for chunk in page.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes());
        }
        region.write(off, &page);
        off += PAGE;
    }
}

#[cfg(test)]
mod tests;
