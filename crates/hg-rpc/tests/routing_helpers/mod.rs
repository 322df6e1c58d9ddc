//! Helpers of the tests of how an origin files responses and holds
//! inputs (`response_routing.rs`, `abandoned_inputs.rs`,
//! `bulk_given_up.rs`, `duplicate_responses.rs`): driving engines, and responses written by hand.
// Each test binary uses a subset of them.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use hg_rpc::header::{FLAG_CHECKSUM, FLAG_RESPONSE, FLAG_SPILL};
use hg_rpc::{Engine, Rpc};
use na_core::{Endpoint, PluginId};

use crate::common::wire_message;
use crate::rpcs::Echo;
pub const T: Duration = Duration::from_secs(10);

/// A response header for `cookie` with an empty payload (the encoding of `()`).
pub fn response(rpc: &str, cookie: u64) -> Vec<u8> {
    wire_message(FLAG_RESPONSE | FLAG_CHECKSUM, rpc, cookie, &[])
}

/// Drives `c` for `d`.
pub fn pump(c: &mut Engine, d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        c.progress(Some(Duration::from_millis(10))).unwrap();
        c.trigger().unwrap();
    }
}

/// Drives two engines in turn until `done` says so.
pub fn pump_both(a: &mut Engine, b: &mut Engine, what: &str, mut done: impl FnMut(&Engine, &Engine) -> bool) {
    let end = Instant::now() + T;
    while !done(a, b) {
        assert!(Instant::now() < end, "{what}: not within {T:?}");
        for e in [&mut *a, &mut *b] {
            e.progress(Some(Duration::from_millis(1))).unwrap();
            e.trigger().unwrap();
        }
    }
}

/// An `Echo` response to `cookie` carrying `data`.
pub fn postcard_echo_response(cookie: u64, data: &[u8]) -> Vec<u8> {
    wire_message(
        FLAG_RESPONSE | FLAG_CHECKSUM,
        Echo::NAME,
        cookie,
        &postcard::to_allocvec(data).unwrap(),
    )
}

/// A spilled `Echo` response with a checksum, written by hand: `output`
/// exposed by `x` (keep the handle until it was pulled), described, with
/// `crc` as the data's CRC-32C.
pub fn spilled_echo_response(
    x: &mut Endpoint,
    xid: PluginId,
    cookie: u64,
    output: Vec<u8>,
    crc: u32,
) -> (na_core::MemHandle, Vec<u8>) {
    let len = output.len() as u64;
    let mem = crate::common::sealed(output);
    x.plugin_mut(xid).unwrap().mem_register(&mem).unwrap();
    let desc = x.plugin(xid).unwrap().mem_describe(&mem).unwrap().to_bytes();
    let payload = crate::common::spilled_payload(len, &desc, Some(crc));
    let msg = wire_message(
        FLAG_RESPONSE | FLAG_CHECKSUM | FLAG_SPILL,
        Echo::NAME,
        cookie,
        &payload,
    );
    (mem, msg)
}
