//! The RPC wire header (see `docs/PROTOCOL.md`). Pure data: no I/O.
//!
//! Every RPC message is a 32-byte header followed by `payload_len` bytes of
//! encoded arguments (request) or results (response). All integers are
//! little-endian.
//!
//! | offset | size | field                                               |
//! |--------|------|-----------------------------------------------------|
//! | 0      | 4    | magic `"QSRP"`                                      |
//! | 4      | 1    | version (5)                                         |
//! | 5      | 1    | flags: bit 0 response, bit 1 one-way, bit 2 checksum, bit 3 spilled |
//! | 6      | 1    | status (responses): 0 ok, 1 handler error, 2 unknown RPC, 3 decode error, 4 busy, 5 response not sent |
//! | 7      | 1    | reserved, 0                                         |
//! | 8      | 8    | RPC id (FNV-1a 64 of the name)                      |
//! | 16     | 8    | cookie: the origin's call number; the response carries it back |
//! | 24     | 4    | payload length                                      |
//! | 28     | 4    | CRC-32C of the payload if flag bit 2, else 0        |

use na_core::hint::cold_path;

use crate::error::RpcError;

/// Header length in bytes.
pub const HEADER_LEN: usize = 32;
/// The magic bytes.
pub const MAGIC: [u8; 4] = *b"QSRP";
/// The protocol version this crate speaks.
pub const VERSION: u8 = 5;

/// Flag: this message is a response.
pub const FLAG_RESPONSE: u8 = 1;
/// Flag: the request expects no response.
pub const FLAG_ONE_WAY: u8 = 2;
/// Flag: the checksum field is set.
pub const FLAG_CHECKSUM: u8 = 4;
/// Flag: the arguments did not fit an eager message; the payload is their
/// length (u64 LE) and a memory descriptor to pull them from.
pub const FLAG_SPILL: u8 = 8;
const KNOWN_FLAGS: u8 = FLAG_RESPONSE | FLAG_ONE_WAY | FLAG_CHECKSUM | FLAG_SPILL;

/// Outcome carried by a response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Status {
    /// The handler ran; the payload is its encoded output.
    Ok = 0,
    /// The handler failed; the payload is its UTF-8 error message.
    HandlerError = 1,
    /// The target has no handler for the RPC id.
    UnknownRpc = 2,
    /// The target could not decode the request's arguments.
    DecodeError = 3,
    /// The target refused the request before running its handler, for
    /// lack of room (requests waiting for async handlers, spilled inputs
    /// being pulled); the payload says which bound. Trying again later
    /// may succeed.
    Busy = 4,
    /// The target's response to the request could not be sent (a
    /// transport failure of its own, the caller still reachable): this
    /// short error goes in its place, and the payload says why. The
    /// handler may have run. (Never in place of an answer from no
    /// handler, status 2 to 4: that one goes again as itself.)
    ResponseNotSent = 5,
}

impl Status {
    /// True for the answers a target gives without running a handler
    /// (unknown RPC, decode error, busy): the caller knows nothing ran,
    /// and a policy keyed on them (retry when busy) may act on that. One
    /// the transport cannot send goes again as it was (its reason cut
    /// short), never replaced by [`Status::ResponseNotSent`] ("the
    /// handler may have run"), which would lose that.
    pub(crate) fn ran_no_handler(self) -> bool {
        matches!(self, Status::UnknownRpc | Status::DecodeError | Status::Busy)
    }

    fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Status::Ok),
            1 => Some(Status::HandlerError),
            2 => Some(Status::UnknownRpc),
            3 => Some(Status::DecodeError),
            4 => Some(Status::Busy),
            5 => Some(Status::ResponseNotSent),
            _ => None,
        }
    }
}

/// The fields of a message of another protocol version that every version
/// keeps in place (`docs/PROTOCOL.md`, "Other versions"): enough to answer
/// a request with an error, or to end the call a response belongs to,
/// instead of dropping it and leaving its origin to time out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForeignHeader {
    /// The version the peer speaks (never [`VERSION`]).
    pub version: u8,
    /// True for a response (flag bit 0, the same in every version).
    pub response: bool,
    /// The RPC id.
    pub rpc_id: u64,
    /// The cookie.
    pub cookie: u64,
}

impl ForeignHeader {
    /// Bytes a message of any version has at least: the fields kept in
    /// place end at byte 24.
    pub const STABLE_LEN: usize = 24;

    /// The stable fields of `msg` if it starts with the magic and names a
    /// version other than ours; `None` otherwise (ours, or not an RPC
    /// message at all). Nothing else in `msg` is read or trusted.
    pub fn parse(msg: &[u8]) -> Option<Self> {
        let head = msg.get(..Self::STABLE_LEN)?;
        if head[..4] != MAGIC || head[4] == VERSION {
            return None;
        }
        let u64_at = |o: usize| u64::from_le_bytes(head[o..o + 8].try_into().unwrap_or([0; 8]));
        Some(ForeignHeader {
            version: head[4],
            response: head[5] & FLAG_RESPONSE != 0,
            rpc_id: u64_at(8),
            cookie: u64_at(16),
        })
    }
}

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Flag bits (`FLAG_*`).
    pub flags: u8,
    /// Response status (requests: `Ok`).
    pub status: Status,
    /// RPC id.
    pub rpc_id: u64,
    /// Call cookie.
    pub cookie: u64,
    /// Payload length.
    pub payload_len: u32,
    /// CRC-32C of the payload (if `FLAG_CHECKSUM`).
    pub checksum: u32,
}

impl Header {
    /// True for responses.
    pub fn is_response(&self) -> bool {
        self.flags & FLAG_RESPONSE != 0
    }

    /// True for one-way requests.
    pub fn is_one_way(&self) -> bool {
        self.flags & FLAG_ONE_WAY != 0
    }

    /// The header bytes for `payload`: its length, and its checksum if
    /// `FLAG_CHECKSUM` is set.
    pub fn encode_head(mut self, payload: &[u8]) -> [u8; HEADER_LEN] {
        self.payload_len = payload.len() as u32;
        self.checksum = if self.flags & FLAG_CHECKSUM == 0 {
            0
        } else {
            cold_path();
            crc32c(payload)
        };
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(&MAGIC);
        h[4..8].copy_from_slice(&[VERSION, self.flags, self.status as u8, 0]);
        h[8..16].copy_from_slice(&self.rpc_id.to_le_bytes());
        h[16..24].copy_from_slice(&self.cookie.to_le_bytes());
        h[24..28].copy_from_slice(&self.payload_len.to_le_bytes());
        h[28..32].copy_from_slice(&self.checksum.to_le_bytes());
        h
    }

    /// Appends the header and `payload` to `out` (see [`Header::encode_head`]).
    pub fn encode_with(self, payload: &[u8], out: &mut Vec<u8>) {
        out.extend_from_slice(&self.encode_head(payload));
        out.extend_from_slice(payload);
    }

    /// Decodes a whole message: checks magic, version, flags, status,
    /// length (exactly the bytes present) and checksum. Returns the header
    /// and the payload. Never panics, whatever the bytes.
    #[inline]
    pub fn decode(msg: &[u8]) -> Result<(Header, &[u8]), RpcError> {
        // A well-formed message is accepted by a few word compares; any
        // other goes through the field-by-field checks, which say what
        // is wrong (and accept what this path may have passed over).
        match Self::decode_well_formed(msg) {
            Some(r) => Ok(r),
            None => Self::decode_checked(msg),
        }
    }

    /// [`decode`](Self::decode)'s fast path: the header and payload if
    /// every check passes, `None` if any fails (or is not made here).
    #[inline]
    fn decode_well_formed(msg: &[u8]) -> Option<(Header, &[u8])> {
        let (head, payload) = msg.split_first_chunk::<HEADER_LEN>()?;
        let word = |o: usize| u64::from_le_bytes(head[o..o + 8].try_into().unwrap_or([0; 8]));
        let w0 = word(0);
        // Bytes 0-4 and 7: magic, version, reserved (0).
        const FIXED: u64 = 0xff00_00ff_ffff_ffff;
        let expected = u64::from_le_bytes([MAGIC[0], MAGIC[1], MAGIC[2], MAGIC[3], VERSION, 0, 0, 0]);
        let flags = head[5];
        if w0 & FIXED != expected || flags & !KNOWN_FLAGS != 0 || flags & FLAG_CHECKSUM != 0 {
            return None;
        }
        let status = Status::from_u8(head[6])?;
        let w3 = word(24);
        // Length exactly the bytes present (which fit the 32-bit field);
        // checksum field 0 (no flag).
        if payload.len() > u32::MAX as usize || w3 != payload.len() as u64 {
            return None;
        }
        let h = Header {
            flags,
            status,
            rpc_id: word(8),
            cookie: word(16),
            payload_len: w3 as u32,
            checksum: 0,
        };
        Some((h, payload))
    }

    /// [`decode`](Self::decode) field by field, each failure with its reason.
    #[cold]
    #[inline(never)]
    fn decode_checked(msg: &[u8]) -> Result<(Header, &[u8]), RpcError> {
        let bad = |reason: String| RpcError::Malformed { reason };
        if msg.len() < HEADER_LEN {
            return Err(bad(format!(
                "{} bytes is shorter than the {HEADER_LEN}-byte header",
                msg.len()
            )));
        }
        if msg[0..4] != MAGIC {
            return Err(bad("bad magic".into()));
        }
        if msg[4] != VERSION {
            return Err(bad(format!("unsupported version {}", msg[4])));
        }
        let flags = msg[5];
        if flags & !KNOWN_FLAGS != 0 {
            return Err(bad(format!("unknown flags {flags:#x}")));
        }
        let status = Status::from_u8(msg[6]).ok_or_else(|| bad(format!("unknown status {}", msg[6])))?;
        if msg[7] != 0 {
            return Err(bad(format!("reserved byte is {}", msg[7])));
        }
        let u64_at = |o: usize| u64::from_le_bytes(msg[o..o + 8].try_into().unwrap_or([0; 8]));
        let u32_at = |o: usize| u32::from_le_bytes(msg[o..o + 4].try_into().unwrap_or([0; 4]));
        let h = Header {
            flags,
            status,
            rpc_id: u64_at(8),
            cookie: u64_at(16),
            payload_len: u32_at(24),
            checksum: u32_at(28),
        };
        let payload = &msg[HEADER_LEN..];
        if payload.len() != h.payload_len as usize {
            return Err(bad(format!(
                "header says {} payload bytes, message has {}",
                h.payload_len,
                payload.len()
            )));
        }
        if flags & FLAG_CHECKSUM != 0 && crc32c(payload) != h.checksum {
            return Err(bad("payload checksum mismatch".into()));
        }
        if flags & FLAG_CHECKSUM == 0 && h.checksum != 0 {
            return Err(bad("checksum field set without the checksum flag".into()));
        }
        Ok((h, payload))
    }
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78): with the CPU's
/// CRC instruction where it has one (SSE 4.2), else slicing-by-8 through
/// tables built at compile time.
pub fn crc32c(data: &[u8]) -> u32 {
    match crate::sys::crc32c::update(!0, data) {
        Some(crc) => !crc,
        None => crc32c_tables(data),
    }
}

/// [`crc32c`] with tables (slicing by 8), for CPUs without a CRC instruction.
fn crc32c_tables(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        let lo = crc ^ u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        let hi = u32::from_le_bytes([c[4], c[5], c[6], c[7]]);
        crc = CRC_TABLES[7][(lo & 0xff) as usize]
            ^ CRC_TABLES[6][((lo >> 8) & 0xff) as usize]
            ^ CRC_TABLES[5][((lo >> 16) & 0xff) as usize]
            ^ CRC_TABLES[4][(lo >> 24) as usize]
            ^ CRC_TABLES[3][(hi & 0xff) as usize]
            ^ CRC_TABLES[2][((hi >> 8) & 0xff) as usize]
            ^ CRC_TABLES[1][((hi >> 16) & 0xff) as usize]
            ^ CRC_TABLES[0][(hi >> 24) as usize];
    }
    for &b in chunks.remainder() {
        crc = CRC_TABLES[0][((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

static CRC_TABLES: [[u32; 256]; 8] = crc_tables();

const fn crc_tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82f6_3b78
            } else {
                c >> 1
            };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut s = 1;
    while s < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = t[s - 1][i];
            t[s][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            i += 1;
        }
        s += 1;
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(flags: u8) -> Vec<u8> {
        let mut v = Vec::new();
        Header {
            flags,
            status: Status::Ok,
            rpc_id: 0x1122_3344_5566_7788,
            cookie: 42,
            payload_len: 0,
            checksum: 0,
        }
        .encode_with(b"payload", &mut v);
        v
    }

    #[test]
    fn roundtrip() {
        let v = sample(FLAG_CHECKSUM);
        let (h, p) = Header::decode(&v).unwrap();
        assert_eq!(
            (h.rpc_id, h.cookie, h.payload_len, p),
            (0x1122_3344_5566_7788, 42, 7, &b"payload"[..])
        );
        assert!(!h.is_response() && !h.is_one_way());
    }

    #[test]
    fn every_status_round_trips_and_an_unknown_one_is_refused() {
        let all = [
            Status::Ok,
            Status::HandlerError,
            Status::UnknownRpc,
            Status::DecodeError,
            Status::Busy,
            Status::ResponseNotSent,
        ];
        for status in all {
            let mut v = Vec::new();
            let h = Header {
                flags: FLAG_RESPONSE | FLAG_CHECKSUM,
                status,
                rpc_id: 7,
                cookie: 9,
                payload_len: 0,
                checksum: 0,
            };
            h.encode_with(b"why", &mut v);
            assert_eq!(v[6], status as u8);
            assert_eq!(Header::decode(&v).unwrap().0.status, status);
        }
        let mut v = sample(0);
        v[6] = all.len() as u8;
        let e = Header::decode(&v).unwrap_err();
        assert!(e.to_string().contains("unknown status 6"), "{e}");
    }

    /// The fast path never accepts what the field-by-field checks refuse,
    /// and what it accepts decodes the same: every header byte of valid
    /// messages (each flag combination, payloads of 0 to 9 bytes) set to
    /// a spread of values, plus messages one byte short and one too long.
    #[test]
    fn the_fast_path_agrees_with_the_field_by_field_checks() {
        let (mut accepted_fast, mut refused) = (0, 0);
        for flags in 0..=KNOWN_FLAGS {
            for len in 0..10 {
                let payload: Vec<u8> = (0..len).map(|i| i as u8 ^ 0x5a).collect();
                let mut base = Vec::new();
                header(flags).encode_with(&payload, &mut base);
                let mut variants = vec![base.clone(), base[..base.len() - 1].to_vec()];
                variants.push([&base[..], &[0]].concat());
                for at in 0..HEADER_LEN {
                    for v in [0u8, 1, 2, 3, 4, 5, 8, 0x0f, 0x10, 0x7f, 0x80, 0xff] {
                        let mut m = base.clone();
                        m[at] = v;
                        variants.push(m);
                    }
                }
                for m in &variants {
                    let checked = Header::decode_checked(m).map_err(|e| e.to_string());
                    match Header::decode_well_formed(m) {
                        Some(fast) => {
                            accepted_fast += 1;
                            assert_eq!(Ok(fast), checked, "{m:02x?}");
                        }
                        None => refused += usize::from(checked.is_err()),
                    }
                    assert_eq!(Header::decode(m).map_err(|e| e.to_string()), checked);
                }
            }
        }
        // Both outcomes were exercised.
        assert!(
            accepted_fast > 1000 && refused > 1000,
            "{accepted_fast} {refused}"
        );
    }

    fn header(flags: u8) -> Header {
        Header {
            flags,
            status: Status::Ok,
            rpc_id: 0x0102_0304_0506_0708,
            cookie: 0x1112_1314_1516_1718,
            payload_len: 0,
            checksum: 0,
        }
    }

    #[test]
    fn every_truncation_and_corruption_is_an_error() {
        let v = sample(FLAG_CHECKSUM);
        for cut in 0..v.len() {
            assert!(Header::decode(&v[..cut]).is_err(), "cut at {cut}");
        }
        for i in 0..v.len() {
            let mut c = v.clone();
            c[i] ^= 0x40;
            // Cookie and rpc id bytes may change freely; everything else is checked.
            if !(8..24).contains(&i) {
                assert!(Header::decode(&c).is_err(), "flip at byte {i} accepted");
            }
        }
        let mut huge = v.clone();
        huge[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Header::decode(&huge).is_err());
    }

    #[test]
    fn the_stable_fields_of_another_version_are_read_and_nothing_else() {
        let mut v = sample(FLAG_RESPONSE | FLAG_CHECKSUM);
        // Ours, or not an RPC message: none.
        assert_eq!(ForeignHeader::parse(&v), None);
        v[4] = VERSION + 1;
        let f = ForeignHeader {
            version: VERSION + 1,
            response: true,
            rpc_id: 0x1122_3344_5566_7788,
            cookie: 42,
        };
        assert_eq!(ForeignHeader::parse(&v), Some(f));
        // Everything after byte 24 (and bytes 6, 7) may differ or be absent.
        let mut other = v[..ForeignHeader::STABLE_LEN].to_vec();
        other[6] = 0xff;
        other[7] = 0xff;
        assert_eq!(ForeignHeader::parse(&other), Some(f));
        assert_eq!(ForeignHeader::parse(&v[..ForeignHeader::STABLE_LEN - 1]), None);
        let mut bad_magic = v.clone();
        bad_magic[0] ^= 1;
        assert_eq!(ForeignHeader::parse(&bad_magic), None);
        v[5] = 0;
        assert!(!ForeignHeader::parse(&v).unwrap().response);
        // The decoder proper refuses it, and says which version.
        let e = Header::decode(&v).unwrap_err();
        assert!(e.to_string().contains(&format!("version {}", VERSION + 1)), "{e}");
    }

    /// The plain bitwise definition, to check the tables against.
    fn crc32c_bitwise(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ 0x82f6_3b78
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    #[test]
    fn crc32c_tables_and_instruction_match_the_definition() {
        let data: Vec<u8> = (0..1100u32).map(|i| (i * 31 + i / 7) as u8).collect();
        let hw = crate::sys::crc32c::update(!0, &[]).is_some();
        if !hw {
            eprintln!("NOTE: this CPU has no CRC-32C instruction; only the tables are checked here");
        }
        // Every start offset mod 8 (unaligned words) and lengths around
        // the 8-byte steps.
        for start in 0..8 {
            for len in [0, 1, 7, 8, 9, 63, 64, 65, 1000] {
                let d = &data[start..start + len];
                let want = crc32c_bitwise(d);
                assert_eq!(crc32c_tables(d), want, "tables, start {start} len {len}");
                assert_eq!(crc32c(d), want, "crc32c, start {start} len {len}");
                if let Some(c) = crate::sys::crc32c::update(!0, d) {
                    assert_eq!(!c, want, "instruction, start {start} len {len}");
                }
            }
        }
    }

    #[test]
    fn crc32c_known_value() {
        // RFC 3720 test vector: 32 bytes of zeros.
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }
}
