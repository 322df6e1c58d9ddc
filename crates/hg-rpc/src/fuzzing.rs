//! The fuzz targets' access (`fuzz/`, feature `fuzzing`, off in a user's
//! build; not an API) to what the engine makes of a message's body after
//! its header: a spilled payload's descriptor, seal and checksum, a
//! response's status and reason, and a message the transport gave back.

use crate::header::Header;
use crate::RpcError;

pub use crate::spill::{parse as parse_spilled, unseal, verify, Spilled, RELEASE_RPC, SEAL_LEN};

/// What the engine makes of response `h` with `payload` to a call of RPC
/// `rpc` (id `id`): the output, or the error the status says.
pub fn response_outcome(rpc: &str, id: u64, h: Header, payload: &[u8]) -> Result<Vec<u8>, RpcError> {
    super::response_outcome(rpc, id, h, payload)
}

/// What a message the transport gave back was (the engine's `Returned`).
#[derive(Debug, PartialEq, Eq)]
pub enum Returned<'a> {
    /// A one-way request's acknowledgement (a notice).
    Ack(Header),
    /// A response, with its payload.
    Response(Header, &'a [u8]),
    /// A release notice, with its cookie.
    Release(u64),
    /// Anything else.
    Other,
}

/// The engine's classification of `msg`, a message given back.
pub fn returned(msg: &[u8]) -> Returned<'_> {
    use super::unsent_response_ops::{returned, Returned as R};
    match returned(msg) {
        R::Ack(h) => Returned::Ack(h),
        R::Response(h, p) => Returned::Response(h, p),
        R::Release(c) => Returned::Release(c),
        R::Other => Returned::Other,
    }
}
