//! Payload checksums are the origin's choice (`Engine::set_checksums`, or
//! `QS_RPC_CHECKSUM`; off by default): its requests carry one or not, and
//! a target answers in kind. Seen on the wire by a raw NA endpoint, with
//! the target a separate process.

use std::time::{Duration, Instant};

use hg_rpc::codec::{Codec, Postcard};
use hg_rpc::header::{crc32c, Header, Status, FLAG_CHECKSUM, FLAG_RESPONSE};
use hg_rpc::Rpc;
use na_core::{Endpoint, OpId};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{assert_refused_at_start, client, dir, endpoint, wire_message, Server};

const T: Duration = Duration::from_secs(10);

/// Waits for the unexpected message received by op `op` on `ep`.
fn received(ep: &mut Endpoint, op: OpId) -> Vec<u8> {
    let end = Instant::now() + T;
    loop {
        assert!(Instant::now() < end, "nothing arrived");
        ep.progress(Some(Duration::from_millis(10))).unwrap();
        while let Some(c) = ep.pop_completion() {
            if c.op == op {
                c.status.unwrap();
                return c.buf.expect("a received message");
            }
        }
    }
}

#[test]
fn requests_carry_a_checksum_only_when_their_origin_asks() {
    let d = dir("checksum-requests");
    let (mut raw, sm) = endpoint(&d, true);
    let uri = raw.plugin(sm).unwrap().self_addr().uri().to_owned();
    let mut c = client(&d);
    match std::env::var(hg_rpc::engine::CHECKSUM_ENV) {
        Ok(v) => assert_eq!(c.checksums(), v.trim() == "on", "as {v:?} says"),
        Err(_) => assert!(!c.checksums(), "off by default"),
    }
    let s = c.endpoint().lookup(&uri).unwrap();
    for (n, on) in [(1u64, false), (2, true), (3, false)] {
        c.set_checksums(on);
        raw.post_recv_unexpected(sm, Vec::new(), OpId(n)).unwrap();
        c.forward::<Add>(&s, &(2, 3)).unwrap();
        let msg = received(&mut raw, OpId(n));
        // decode verifies a checksum that is present.
        let (h, payload) = Header::decode(&msg).unwrap();
        let mut want = Vec::new();
        Postcard.encode(&(2u64, 3u64), &mut want).unwrap();
        assert_eq!(payload, want.as_slice());
        if on {
            assert_eq!(h.flags & FLAG_CHECKSUM, FLAG_CHECKSUM, "request {n}");
            assert_eq!(h.checksum, crc32c(payload), "request {n}");
            assert_ne!(h.checksum, 0);
        } else {
            assert_eq!((h.flags & FLAG_CHECKSUM, h.checksum), (0, 0), "request {n}");
        }
    }
}

/// Whatever the target's own setting: one server with the default (off),
/// one with `QS_RPC_CHECKSUM=on`.
#[test]
fn a_response_carries_a_checksum_when_its_request_did() {
    for server_checksums in ["off", "on"] {
        let d = dir("checksum-responses");
        let srv = Server::with_envs(&[
            ("QS_SM_DIR", d.as_os_str()),
            (hg_rpc::engine::CHECKSUM_ENV, server_checksums.as_ref()),
        ]);
        responses_mirror_requests(&d, &srv.uri);
    }
}

fn responses_mirror_requests(d: &std::path::Path, uri: &str) {
    let (mut raw, sm) = endpoint(d, false);
    let s = raw.lookup(uri).unwrap();
    let mut input = Vec::new();
    Postcard.encode(&(20u64, 22u64), &mut input).unwrap();
    for (cookie, flags) in [(1u64, FLAG_CHECKSUM), (2, 0), (3, FLAG_CHECKSUM)] {
        let req = wire_message(flags, Add::NAME, cookie, &input);
        raw.post_recv_unexpected(sm, Vec::new(), OpId(cookie)).unwrap();
        raw.send_unexpected(&s, 0, &req, OpId(1 << 40 | cookie)).unwrap();
        let msg = received(&mut raw, OpId(cookie));
        let (h, payload) = Header::decode(&msg).unwrap();
        assert_eq!((h.cookie, h.status), (cookie, Status::Ok));
        assert_eq!(h.flags & !FLAG_CHECKSUM, FLAG_RESPONSE);
        assert_eq!(h.flags & FLAG_CHECKSUM, flags, "response to request {cookie}");
        let sum: u64 = Postcard.decode(payload).unwrap();
        assert_eq!(sum, 42);
    }
}

#[test]
fn a_bad_checksum_variable_is_a_clear_error_at_start() {
    for value in ["yes", "", "ON "] {
        let d = dir("bad-checksum-var");
        assert_refused_at_start(&d, hg_rpc::engine::CHECKSUM_ENV, value, "expected on or off");
    }
    // Both valid values (blanks around them allowed) start a server that answers.
    for value in ["on", " off"] {
        let d = dir("checksum-var");
        let server = Server::with_envs(&[
            ("QS_SM_DIR", d.as_os_str()),
            (hg_rpc::engine::CHECKSUM_ENV, value.as_ref()),
        ]);
        let mut c = client(&d);
        let s = c.endpoint().lookup(&server.uri).unwrap();
        assert_eq!(c.call::<Add>(&s, &(2, 3), T).unwrap(), 5, "server with {value:?}");
    }
}
