//! One connection: its socket, shared region, wake-up eventfds and send
//! backlog; and the connection handshake.
//!
//! # Handshake
//! 1. The connector connects to the listener's socket and checks the
//!    listener with `SO_PEERCRED` (same uid, pid of the address).
//! 2. It creates the region (a sealed memfd), initializes it, creates the
//!    eventfd on which *it* will be woken for this connection, and sends
//!    [`Hello`] with both descriptors (`SCM_RIGHTS`). It may start sending
//!    into the region at once.
//! 3. The acceptor checks `SO_PEERCRED` (same uid; the pid in the hello's
//!    name must be the kernel's), the hello bytes, the region's seals, size
//!    and header, and that the second descriptor is an eventfd; then it
//!    answers [`ACK_MAGIC`] with its own eventfd for this connection.
//!    A connection it refuses by policy (not for a broken hello) gets
//!    [`REFUSAL_MAGIC`] and a short UTF-8 reason instead, then end-of-file,
//!    so that the connector's error says why.
//! 4. The socket stays open: end-of-file on it means the peer is gone.

use na_core::{OpId, SendBacklog, Tag};

use crate::channel::{Channel, MsgKind, RxCursor, TxCursor};
use crate::sys::shm::SharedRegion;
use crate::sys::wake::{OwnWake, PeerWake};

/// First bytes of a hello.
pub const HELLO_MAGIC: [u8; 8] = *b"QSSMHELO";
/// First bytes of the acknowledgement.
pub const ACK_MAGIC: [u8; 8] = *b"QSSMACK1";
/// First bytes of a refusal (then the reason, at most [`MAX_REFUSAL`] bytes).
pub const REFUSAL_MAGIC: [u8; 8] = *b"QSSMNAK1";
/// Most bytes of a refusal's reason.
pub const MAX_REFUSAL: usize = 240;
/// Handshake protocol version. 2: a side creates the eventfd it is woken
/// on with a counter of 1 and never reads it, and wakes its peer with a
/// write of 0 (which no peer can make block: see
/// [`EventFd::signal`](crate::sys::eventfd::EventFd::signal)); a version-1
/// side's eventfd starts at 0 and would never report a write of 0.
pub const PROTO_VERSION: u32 = 2;
/// Bytes of an acknowledgement.
pub const ACK_LEN: usize = 16;
/// Largest hello.
pub const MAX_HELLO: usize = 16 + crate::config::MAX_NAME_LEN + 16;

/// Which end of the connection we are: decides the channel we send on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// We connected and created the region: we send on channel 0.
    Connector,
    /// We accepted: we send on channel 1.
    Acceptor,
}

/// A send waiting for a free buffer.
pub(crate) struct QueuedSend {
    pub op: OpId,
    pub kind: MsgKind,
    pub tag: Tag,
    pub data: Vec<u8>,
}

/// An established (or, for the connector, awaiting-ack) connection.
pub(crate) struct Conn {
    /// Never reused; epoll token of the socket (and, with WAKE_BIT, of the
    /// eventfd).
    pub serial: u64,
    pub sock: crate::closer::PeerSocket,
    pub region: SharedRegion,
    /// Index of this connection's entry in the plugin's head list (see
    /// `heads`); set when the list is built.
    pub head: usize,
    pub role: Role,
    /// Where we are in the channel we send on / receive on.
    pub tx_cur: TxCursor,
    pub rx_cur: RxCursor,
    /// The eventfd (or pipe) the peer writes to wake us (in our epoll).
    pub my_wake: OwnWake,
    /// The eventfd (or pipe) we write to wake the peer (connector: after the ack).
    pub peer_wake: Option<PeerWake>,
    /// A wake-up was due before the ack brought `peer_wake`.
    pub wake_owed: bool,
    /// Connector: when the peer must have acknowledged by (see
    /// `SmPlugin::sweep_deadlines`); `None` once it did, and on the
    /// acceptor side.
    pub ack_deadline: Option<std::time::Instant>,
    /// We raised the tx_waiting / rx_waiting flags in `try_wait`.
    pub armed: bool,
    pub backlog: SendBacklog<QueuedSend>,
    /// A pidfd of the peer's process, in our epoll set (token `serial |
    /// PIDFD_BIT`): its exit ends the connection even when another process
    /// (a child it forked) keeps the socket open, so no end-of-file
    /// comes. Never another process's (see `identity`). `None` for our
    /// own process, or where the kernel has no pidfds (then end-of-file
    /// is the only sign).
    pub pidfd: Option<std::os::fd::OwnedFd>,
}

impl Conn {
    /// The channel we send on.
    pub fn tx(&self) -> Channel<'_> {
        Channel::new(&self.region, if self.role == Role::Connector { 0 } else { 1 })
    }

    /// Before sleeping with a backlog: raises our waiting flag for the
    /// first queued send (see [`Channel::arm_sender`]). False (flag
    /// lowered) if it could go now; true with nothing queued.
    pub fn arm_backlog(&mut self) -> bool {
        let Some(next) = self.backlog.front() else {
            return true;
        };
        let mut tx_cur = self.tx_cur;
        let waiting = self.tx().arm_sender(&mut tx_cur, next.data.len());
        self.tx_cur = tx_cur;
        waiting
    }

    /// The channel we receive on.
    pub fn rx(&self) -> Channel<'_> {
        Channel::new(&self.region, if self.role == Role::Connector { 1 } else { 0 })
    }

    /// Wakes the peer; `Ok(true)` if an eventfd write was made.
    pub fn wake_peer(&mut self) -> std::io::Result<bool> {
        match &self.peer_wake {
            Some(e) => e.signal().map(|()| true),
            None => {
                self.wake_owed = true;
                Ok(false)
            }
        }
    }
}

/// The connector's first message.
#[derive(Debug, PartialEq, Eq)]
pub struct Hello {
    /// `<pid>-<instance>` of the connector.
    pub name: String,
}

/// Encodes a hello: magic, version (u32 LE), name length (u16 LE), name.
pub fn encode_hello(name: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(14 + name.len());
    v.extend_from_slice(&HELLO_MAGIC);
    v.extend_from_slice(&PROTO_VERSION.to_le_bytes());
    v.extend_from_slice(&(name.len() as u16).to_le_bytes());
    v.extend_from_slice(name.as_bytes());
    v
}

/// The handshake version a hello announces, if `b` starts as one does
/// (the magic and a version), whatever follows.
pub fn hello_version(b: &[u8]) -> Option<u32> {
    let v: [u8; 4] = b.strip_prefix(&HELLO_MAGIC)?.get(..4)?.try_into().ok()?;
    Some(u32::from_le_bytes(v))
}

/// Decodes and checks a hello.
pub fn decode_hello(b: &[u8]) -> Result<Hello, String> {
    if b.len() < 14 || b[..8] != HELLO_MAGIC {
        return Err(format!("not an sm hello ({} bytes)", b.len()));
    }
    let version = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    if version != PROTO_VERSION {
        return Err(format!("protocol version {version}, we speak {PROTO_VERSION}"));
    }
    let n = u16::from_le_bytes([b[12], b[13]]) as usize;
    if b.len() != 14 + n {
        return Err(format!("hello of {} bytes announces a {n}-byte name", b.len()));
    }
    let name = std::str::from_utf8(&b[14..]).map_err(|_| "name is not UTF-8".to_string())?;
    crate::addr::SmName::parse_key(name)?;
    Ok(Hello {
        name: name.to_owned(),
    })
}

/// What came with a hello, judged before its bytes are read (see
/// [`check_hello_parts`]).
#[derive(Debug, PartialEq, Eq)]
pub enum HelloParts {
    /// Some bytes and exactly the two descriptors a hello carries.
    Complete,
    /// Nothing at all: the connector closed before its hello.
    Departed,
    /// The peer broke the handshake (a protocol error), for this reason.
    Broken(String),
    /// The kernel dropped descriptors it could not give us (our limit):
    /// not the peer's doing.
    Dropped(String),
}

/// Judges a hello's `len` bytes and `fds` descriptors kept (of those
/// passed, `refused` were no memfd, eventfd or pipe, and `truncated` says
/// the kernel dropped some): a hello carries bytes and exactly two.
pub fn check_hello_parts(len: usize, fds: usize, refused: usize, truncated: bool) -> HelloParts {
    if len == 0 && fds == 0 && refused == 0 && !truncated {
        return HelloParts::Departed;
    }
    if len == 0 {
        return HelloParts::Broken("closed before its hello, with descriptors passed".into());
    }
    if refused > 0 {
        // Closed on a closing thread already (see `closer`).
        return HelloParts::Broken(format!(
            "hello carries {refused} descriptors that are neither a memfd, an eventfd nor a pipe"
        ));
    }
    if truncated && fds < 2 {
        // Fewer than the two a hello carries, and the kernel says it
        // dropped some: it could not give them to us (our descriptor
        // limit; the buffer holds the most one message can carry).
        return HelloParts::Dropped(format!(
            "the kernel passed {fds} of the hello's descriptors and dropped the rest (out of descriptors?)"
        ));
    }
    if truncated || fds != 2 {
        return HelloParts::Broken(format!("hello carries {fds} descriptors, expected 2"));
    }
    HelloParts::Complete
}

/// Encodes the acknowledgement: magic, version, status 0.
pub fn encode_ack() -> [u8; ACK_LEN] {
    let mut a = [0u8; ACK_LEN];
    a[..8].copy_from_slice(&ACK_MAGIC);
    a[8..12].copy_from_slice(&PROTO_VERSION.to_le_bytes());
    a
}

/// A refusal carrying `reason` (cut to [`MAX_REFUSAL`] bytes).
pub fn encode_refusal(reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_REFUSAL);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut b = REFUSAL_MAGIC.to_vec();
    b.extend_from_slice(&reason.as_bytes()[..end]);
    b
}

/// The reason of a refusal, if `b` is one: the peer's text, with control
/// characters replaced (it goes into our error messages and logs).
pub fn refusal_reason(b: &[u8]) -> Option<String> {
    let text = b.strip_prefix(&REFUSAL_MAGIC)?;
    let text = &text[..text.len().min(MAX_REFUSAL)];
    Some(
        String::from_utf8_lossy(text)
            .chars()
            .map(|c| if c.is_control() { '?' } else { c })
            .collect(),
    )
}

/// Checks an acknowledgement.
pub fn check_ack(b: &[u8]) -> Result<(), String> {
    if b.len() != ACK_LEN || b[..8] != ACK_MAGIC {
        return Err(format!("not an sm acknowledgement ({} bytes)", b.len()));
    }
    if b[8..12] != PROTO_VERSION.to_le_bytes() || b[12..16] != [0; 4] {
        return Err("acknowledgement with another version or a refusal".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_version_reads_any_hello_s_version() {
        let mut h = encode_hello("12-a");
        assert_eq!(hello_version(&h), Some(PROTO_VERSION));
        h[8..12].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(hello_version(&h[..12]), Some(1), "the version alone is enough");
        assert_eq!(hello_version(&h[..11]), None, "cut short");
        assert_eq!(hello_version(&encode_ack()), None, "not a hello");
    }

    #[test]
    fn hello_and_ack() {
        let h = encode_hello("12-a");
        assert_eq!(decode_hello(&h).unwrap().name, "12-a");
        for cut in 0..h.len() {
            assert!(decode_hello(&h[..cut]).is_err());
        }
        let mut bad = h.clone();
        bad[8] = 9;
        assert!(decode_hello(&bad).is_err());
        assert!(decode_hello(&encode_hello("x-a")).is_err());
        check_ack(&encode_ack()).unwrap();
        assert!(check_ack(&encode_ack()[..15]).is_err());
    }

    /// What came with a hello, as `accept_hello` judges it: bytes and two
    /// descriptors pass; silence is a departure; a dropped descriptor is
    /// ours to blame only when the kernel says it dropped some.
    #[test]
    fn hello_parts_are_judged_before_the_bytes() {
        assert_eq!(check_hello_parts(20, 2, 0, false), HelloParts::Complete);
        assert_eq!(check_hello_parts(0, 0, 0, false), HelloParts::Departed);
        assert!(matches!(check_hello_parts(0, 2, 0, false), HelloParts::Broken(_)));
        assert!(matches!(check_hello_parts(0, 0, 1, false), HelloParts::Broken(_)));
        assert!(
            matches!(check_hello_parts(20, 2, 1, false), HelloParts::Broken(r) if r.contains("1 descriptors"))
        );
        assert!(matches!(
            check_hello_parts(20, 1, 0, true),
            HelloParts::Dropped(_)
        ));
        assert!(matches!(check_hello_parts(20, 2, 0, true), HelloParts::Broken(_)));
        assert!(
            matches!(check_hello_parts(20, 3, 0, false), HelloParts::Broken(r) if r.contains("3 descriptors"))
        );
        assert!(matches!(
            check_hello_parts(20, 1, 0, false),
            HelloParts::Broken(_)
        ));
    }

    #[test]
    fn refusal_round_trip_is_cut_and_cleaned() {
        assert_eq!(
            refusal_reason(&encode_refusal("too many")).as_deref(),
            Some("too many")
        );
        assert_eq!(refusal_reason(&encode_ack()), None);
        assert!(check_ack(&encode_refusal("x")).is_err());
        // Cut at a character boundary, never past MAX_REFUSAL bytes.
        let long = "é".repeat(MAX_REFUSAL);
        let r = refusal_reason(&encode_refusal(&long)).unwrap();
        assert!(r.len() <= MAX_REFUSAL && r.chars().all(|c| c == 'é'), "{r}");
        // A peer's control characters never reach our logs as such.
        let mut raw = REFUSAL_MAGIC.to_vec();
        raw.extend_from_slice(b"a\x1b[2Jb\n");
        assert_eq!(refusal_reason(&raw).as_deref(), Some("a?[2Jb?"));
    }
}
