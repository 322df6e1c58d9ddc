//! The small protocol `na-perf` speaks over the NA plugin itself between the
//! measuring client and the serving peer.
//!
//! * Control: the client sends an unexpected message with tag [`TAG_CTRL`]
//!   whose payload is a text command, after posting an expected receive for
//!   [`TAG_REPLY`]; the server answers with an expected message whose first
//!   byte is [`REPLY_OK`] or [`REPLY_ERR`], followed by data or error text.
//!   Commands: `mode <busy|adaptive[:us]|blocking>`, `expect-pings`,
//!   `stop-pings`, `mem <size> <segments>` (answer: the encoded
//!   [`RemoteMem`](na_core::RemoteMem) of a fresh read-write handle) and `bye`.
//! * Pings: [`TAG_PING`] messages from the client are echoed by the server
//!   with [`TAG_PONG`], of the same kind (unexpected or expected) and size.
//!   Expected pings are only sent between `expect-pings` and `stop-pings`,
//!   while the server keeps one expected receive posted for the client.
//! * Pulled sessions (the spawned peer's `sm pull` command): both sides
//!   take unexpected messages in pull mode, and pings and pongs are sent
//!   with no success completion, as hg-rpc's messages are; control works
//!   as above (its answers are expected messages).

use na_core::Tag;

/// Control command (unexpected, client to server).
pub const TAG_CTRL: Tag = 1;
/// Control answer (expected, server to client).
pub const TAG_REPLY: Tag = 2;
/// Ping (client to server).
pub const TAG_PING: Tag = 3;
/// Pong (server to client).
pub const TAG_PONG: Tag = 4;

/// First byte of a successful control answer.
pub const REPLY_OK: u8 = 0;
/// First byte of a failed control answer (followed by UTF-8 text).
pub const REPLY_ERR: u8 = 1;
