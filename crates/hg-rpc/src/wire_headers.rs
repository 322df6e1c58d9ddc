//! The headers the engine builds ([`header`], [`response_header`]) and
//! what a response's header makes of its call ([`response_outcome`]).

use crate::error::{Result, RpcError};
use crate::header::{Header, Status, FLAG_CHECKSUM, FLAG_RESPONSE};
/// The header of the response to `request`: it carries a checksum if the
/// request did (the origin's choice, see [`Engine::set_checksums`](crate::Engine::set_checksums)).
pub(super) fn response_header(request: &Header, status: Status) -> Header {
    header(
        FLAG_RESPONSE | (request.flags & FLAG_CHECKSUM),
        status,
        request.rpc_id,
        request.cookie,
    )
}

pub(super) fn header(flags: u8, status: Status, rpc_id: u64, cookie: u64) -> Header {
    Header {
        flags,
        status,
        rpc_id,
        cookie,
        payload_len: 0,
        checksum: 0,
    }
}

/// Turns a response header and payload into the call's outcome.
pub(super) fn response_outcome(
    rpc: &str,
    id: u64,
    h: Header,
    payload: impl Into<Vec<u8>>,
) -> Result<Vec<u8>> {
    let payload = payload.into();
    let text = || String::from_utf8_lossy(&payload).into_owned();
    match h.status {
        Status::Ok => Ok(payload),
        Status::HandlerError => Err(RpcError::Handler {
            rpc: rpc.into(),
            message: text(),
        }),
        Status::UnknownRpc => Err(RpcError::UnknownRpc { rpc: rpc.into(), id }),
        Status::DecodeError => Err(RpcError::Decode {
            rpc: rpc.into(),
            what: "input",
            reason: text(),
        }),
        Status::Busy => Err(RpcError::Busy {
            rpc: rpc.into(),
            reason: text(),
        }),
        Status::ResponseNotSent => Err(RpcError::ResponseNotSent {
            rpc: rpc.into(),
            reason: text(),
        }),
    }
}
