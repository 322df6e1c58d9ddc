//! What travels between two verbs plugins: the 16-byte header in front of
//! every message, the hello exchanged in RDMA CM private data, and the
//! reason a reject carries in its private data.
//!
//! Everything here is decoded from untrusted peer bytes: decoding checks
//! every field and returns an error string, never panics.
//!
//! # Message header (little-endian)
//! ```text
//! 0      1      2        4        8        12       16
//! | 0xA5 | kind | credits| tag    | len    | 0      | payload (len bytes)
//! ```
//! `kind`: 1 unexpected, 2 expected, 3 credit update (no payload).
//! `credits`: receive buffers the sender reposted since its last message,
//! returned to the receiver of this message (credit-based flow control).
//!
//! # Hello (RDMA CM private data, at most 56 bytes)
//! ```text
//! 0     4   5      6     8      24      26      30     31
//! |QSv1 | 2 |family| port| ip[16]| depth | maxmsg| nlen | device name (nlen <= 24)
//! ```
//! Sent by the connecting side in `rdma_connect` (its own listen address:
//! who it is) and by the accepting side in `rdma_accept`. `depth` is the
//! number of receive buffers posted for the connection: the initial credits
//! of the other side. `maxmsg` is the largest payload a buffer holds.
//! `family` is 4 (the IPv4 address in `ip[0..4]`, the rest zero) or 6; an
//! IPv4 address in IPv6 form (IPv4-mapped) is refused, so an address has
//! one encoding.
//!
//! # Versions
//! The magic (bytes 0-3) and the version (byte 4) stay in place in every
//! version. Version 2 (2026-11-29) changed no hello field but what a
//! memory descriptor's key means: its high 32 bits carry a secret of the
//! owner's (`mem::exposed`), which a version-1 peer refuses as "not a
//! verbs rkey". So the two never connect: a listener refuses a hello of
//! another version with a reject whose reason names both versions
//! ([`version_mismatch`]), and a connecting side that gets a listener's
//! "bad hello" (what a version-1 listener says to a version-2 hello) is
//! told that the listener may be of another version.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Bytes of the message header.
pub const HEADER_LEN: usize = 16;
const HEADER_MAGIC: u8 = 0xA5;

/// Kind of a message on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgKind {
    /// An unexpected message.
    Unexpected = 1,
    /// An expected message.
    Expected = 2,
    /// Only returns credits.
    Credit = 3,
}

/// A decoded message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Message kind.
    pub kind: MsgKind,
    /// Credits returned to the receiver.
    pub credits: u16,
    /// Tag.
    pub tag: u32,
    /// Payload length.
    pub len: u32,
}

impl Header {
    /// The 16 header bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = HEADER_MAGIC;
        b[1] = self.kind as u8;
        b[2..4].copy_from_slice(&self.credits.to_le_bytes());
        b[4..8].copy_from_slice(&self.tag.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes the header of a received message of `byte_len` bytes (the
    /// length the device reported) whose buffer holds at most `max_payload`.
    pub fn decode(b: &[u8; HEADER_LEN], byte_len: usize, max_payload: usize) -> Result<Header, String> {
        if byte_len < HEADER_LEN {
            return Err(format!("message of {byte_len} bytes is shorter than its header"));
        }
        if b[0] != HEADER_MAGIC {
            return Err(format!("bad header magic {:#04x}", b[0]));
        }
        let kind = match b[1] {
            1 => MsgKind::Unexpected,
            2 => MsgKind::Expected,
            3 => MsgKind::Credit,
            k => return Err(format!("unknown message kind {k}")),
        };
        if b[12..16] != [0; 4] {
            return Err("reserved header bytes are not zero".into());
        }
        let word = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let h = Header {
            kind,
            credits: u16::from_le_bytes([b[2], b[3]]),
            tag: word(4),
            len: word(8),
        };
        let len = h.len as usize;
        if len != byte_len - HEADER_LEN {
            return Err(format!(
                "header says {len} payload bytes, {} arrived",
                byte_len - HEADER_LEN
            ));
        }
        if len > max_payload || (kind == MsgKind::Credit && len != 0) {
            return Err(format!(
                "payload of {len} bytes for a {kind:?} message (max {max_payload})"
            ));
        }
        Ok(h)
    }
}

const HELLO_MAGIC: [u8; 4] = *b"QSv1";
/// The hello version this build speaks (see "Versions" in the module
/// docs).
pub const HELLO_VERSION: u8 = 2;
const HELLO_FIXED: usize = 31;
/// Longest device name carried in a hello (longer names are left out).
pub const HELLO_MAX_NAME: usize = 24;
/// Smallest and largest receive depth a peer may announce.
pub const DEPTH_RANGE: (u16, u16) = (4, 4096);
/// Largest message payload a peer may announce.
pub const MAX_PAYLOAD_LIMIT: u32 = 1 << 20;

/// Who a side is and what it can receive (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The sender's listen address (its identity; port is unique per plugin).
    pub addr: SocketAddr,
    /// Receive buffers posted for this connection (initial credits).
    pub depth: u16,
    /// Largest payload one buffer takes (0 is a size: empty messages
    /// only).
    pub max_payload: u32,
    /// The sender's device name (informational, may be empty).
    pub device: String,
}

impl Hello {
    /// The private-data bytes (at most 55).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HELLO_FIXED + HELLO_MAX_NAME);
        b.extend_from_slice(&HELLO_MAGIC);
        b.push(HELLO_VERSION);
        let mut ip = [0u8; 16];
        match self.addr.ip() {
            IpAddr::V4(v4) => {
                b.push(4);
                ip[..4].copy_from_slice(&v4.octets());
            }
            IpAddr::V6(v6) => {
                b.push(6);
                ip = v6.octets();
            }
        }
        b.extend_from_slice(&self.addr.port().to_le_bytes());
        b.extend_from_slice(&ip);
        b.extend_from_slice(&self.depth.to_le_bytes());
        b.extend_from_slice(&self.max_payload.to_le_bytes());
        let name = if self.device.len() <= HELLO_MAX_NAME {
            self.device.as_bytes()
        } else {
            &[]
        };
        b.push(name.len() as u8);
        b.extend_from_slice(name);
        b
    }

    /// Decodes and validates a peer's hello. Trailing bytes (the CM may pad
    /// private data with zeros) are ignored.
    pub fn decode(b: &[u8]) -> Result<Hello, String> {
        if b.len() < HELLO_FIXED {
            return Err(format!("hello of {} bytes is too short", b.len()));
        }
        if b[0..4] != HELLO_MAGIC {
            return Err("not a Quicksilver verbs hello (bad magic)".into());
        }
        if let Some(theirs) = version_mismatch(b) {
            return Err(format!(
                "the peer speaks verbs hello version {theirs}, this build version {HELLO_VERSION}"
            ));
        }
        let port = u16::from_le_bytes([b[6], b[7]]);
        let mut raw = [0u8; 16];
        raw.copy_from_slice(&b[8..24]);
        let ip = match b[5] {
            // The rest of the field is zero, so a hello has one encoding.
            4 if raw[4..] != [0; 12] => return Err("IPv4 hello with a non-zero address tail".into()),
            4 => IpAddr::V4(Ipv4Addr::new(raw[0], raw[1], raw[2], raw[3])),
            // An IPv4 address goes as family 4 (our own encoding): in
            // IPv6 form it would be a second spelling of one identity.
            6 if Ipv6Addr::from(raw).to_ipv4_mapped().is_some() => {
                return Err("IPv6 hello with an IPv4-mapped address (IPv4 goes as family 4)".into())
            }
            6 => IpAddr::V6(Ipv6Addr::from(raw)),
            f => return Err(format!("bad address family {f}")),
        };
        if port == 0 || ip.is_unspecified() {
            return Err(format!("hello names no usable address ({ip}:{port})"));
        }
        let depth = u16::from_le_bytes([b[24], b[25]]);
        if depth < DEPTH_RANGE.0 || depth > DEPTH_RANGE.1 {
            return Err(format!("receive depth {depth} not in {DEPTH_RANGE:?}"));
        }
        let max_payload = u32::from_le_bytes([b[26], b[27], b[28], b[29]]);
        if max_payload > MAX_PAYLOAD_LIMIT {
            return Err(format!("max payload {max_payload} exceeds {MAX_PAYLOAD_LIMIT}"));
        }
        let n = b[30] as usize;
        if n > HELLO_MAX_NAME || b.len() < HELLO_FIXED + n {
            return Err(format!("device name of {n} bytes does not fit"));
        }
        let device = std::str::from_utf8(&b[HELLO_FIXED..HELLO_FIXED + n])
            .ok()
            .filter(|s| s.is_empty() || crate::addr::is_device_name(s))
            .ok_or("device name is not [A-Za-z0-9_.-]")?
            .to_owned();
        Ok(Hello {
            addr: SocketAddr::new(ip, port),
            depth,
            max_payload,
            device,
        })
    }
}

/// The version of a hello that is one of ours (its magic matches) but of
/// another version than [`HELLO_VERSION`]: a peer of another build, not a
/// broken one. `None` for a hello of our version and for bytes that are
/// no hello.
pub fn version_mismatch(b: &[u8]) -> Option<u8> {
    match b.get(..5) {
        Some(head) if head[..4] == HELLO_MAGIC && head[4] != HELLO_VERSION => Some(head[4]),
        _ => None,
    }
}

/// The reason a listener's reject carries in its private data (what its
/// `on_connect_request` passes to `rdma_reject`), if it is one: printable
/// ASCII after the padding the transport adds (InfiniBand CM delivers its
/// REJ's whole private data field, zeros after the reason). Peer data:
/// anything else is no reason, and it is never printed.
pub fn reject_reason(private: &[u8]) -> Option<&str> {
    let end = private.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let text = &private[..end];
    if text.is_empty() || text.len() > 128 || !text.iter().all(|b| (0x20..0x7f).contains(b)) {
        return None;
    }
    std::str::from_utf8(text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrip_and_validation() {
        let h = Header {
            kind: MsgKind::Expected,
            credits: 31,
            tag: 0xdead_beef,
            len: 100,
        };
        let b = h.encode();
        assert_eq!(Header::decode(&b, HEADER_LEN + 100, 4096), Ok(h));
        assert!(
            Header::decode(&b, HEADER_LEN + 99, 4096).is_err(),
            "length mismatch"
        );
        assert!(Header::decode(&b, HEADER_LEN + 100, 99).is_err(), "over the max");
        assert!(Header::decode(&b, 3, 4096).is_err(), "short");
        let mut bad = b;
        bad[0] = 0;
        assert!(Header::decode(&bad, HEADER_LEN + 100, 4096).is_err());
        let mut bad = b;
        bad[1] = 9;
        assert!(Header::decode(&bad, HEADER_LEN + 100, 4096).is_err());
        let mut bad = b;
        bad[13] = 1;
        assert!(Header::decode(&bad, HEADER_LEN + 100, 4096).is_err());
        let c = Header {
            kind: MsgKind::Credit,
            credits: 1,
            tag: 0,
            len: 4,
        };
        assert!(
            Header::decode(&c.encode(), HEADER_LEN + 4, 4096).is_err(),
            "credit with payload"
        );
    }

    #[test]
    fn hello_roundtrip_and_validation() {
        let h = Hello {
            addr: "10.77.0.1:4791".parse().unwrap(),
            depth: 64,
            max_payload: 4096,
            device: "rxe0".into(),
        };
        let b = h.encode();
        assert!(b.len() <= 56, "RDMA CM connect private data is at most 56 bytes");
        assert_eq!(Hello::decode(&b).unwrap(), h);
        let mut padded = b.clone();
        padded.resize(56, 0);
        assert_eq!(Hello::decode(&padded).unwrap(), h, "CM zero padding is ignored");
        for cut in 0..b.len() {
            assert!(Hello::decode(&b[..cut]).is_err(), "truncated at {cut}");
        }
        let v6 = Hello {
            addr: "[fe80::1]:9".parse().unwrap(),
            device: "a-device-name-longer-than-twenty-four".into(),
            ..h.clone()
        };
        let d = Hello::decode(&v6.encode()).unwrap();
        assert_eq!((d.addr, d.device.as_str()), (v6.addr, ""));
        let mut bad = b.clone();
        bad[24..26].copy_from_slice(&1u16.to_le_bytes());
        assert!(Hello::decode(&bad).unwrap_err().contains("depth"));
        let mut bad = b.clone();
        bad[6..8].copy_from_slice(&0u16.to_le_bytes());
        assert!(Hello::decode(&bad).is_err());
        let mut bad = b.clone();
        bad[5] = 5;
        assert!(Hello::decode(&bad).is_err());
        // An IPv4 address with bytes in the rest of its field.
        let mut bad = b.clone();
        bad[12] = 1;
        assert!(Hello::decode(&bad).unwrap_err().contains("non-zero address tail"));
        // Our IPv4 address in IPv6 (mapped) form.
        let mapped = Hello {
            addr: "[::ffff:10.77.0.1]:4791".parse().unwrap(),
            ..h.clone()
        };
        let e = Hello::decode(&mapped.encode()).unwrap_err();
        assert!(e.contains("IPv4-mapped"), "{e}");
        // A device name that would not parse back in an address.
        let slash = Hello {
            device: "rx/e0".into(),
            ..Hello::decode(&b).unwrap()
        };
        let e = Hello::decode(&slash.encode()).unwrap_err();
        assert!(e.contains("device name"), "{e}");
    }

    /// A hello of another version (the one before keys carried a secret)
    /// is told apart from a broken one, and its error names both versions.
    #[test]
    fn a_hello_of_another_version_is_named_as_such() {
        let h = Hello {
            addr: "10.77.0.1:4791".parse().unwrap(),
            depth: 64,
            max_payload: 4096,
            device: "rxe0".into(),
        };
        let mut b = h.encode();
        assert_eq!(b[4], HELLO_VERSION);
        assert_eq!(HELLO_VERSION, 2, "keys with a secret are version 2");
        assert_eq!(version_mismatch(&b), None, "our own version");
        b[4] = 1;
        assert_eq!(version_mismatch(&b), Some(1));
        let e = Hello::decode(&b).unwrap_err();
        assert!(e.contains("version 1") && e.contains("version 2"), "{e}");
        // Not a hello at all: no version to name.
        b[0] = b'X';
        assert_eq!(version_mismatch(&b), None);
        assert_eq!(version_mismatch(b"QSv"), None, "too short");
    }
}
