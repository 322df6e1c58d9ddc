//! Peers of different protocol versions (`docs/PROTOCOL.md`, "Other
//! versions"): a request of another version gets an answer that names
//! both versions, and a response of another version ends its call with
//! `RpcError::VersionMismatch` instead of leaving it to time out. Real
//! processes and real sm plugins; the other version's messages are ours
//! with the version byte changed (all a peer of any version keeps in
//! place is what the receiver reads).

use std::time::{Duration, Instant};

use hg_rpc::header::{Header, Status, FLAG_ONE_WAY, FLAG_RESPONSE, VERSION};
use hg_rpc::{Rpc, RpcError};
use na_core::{Addr, Endpoint, OpId, PluginId};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{
    client, dir, endpoint, raw_target_and_client, send_raw, take_request, wait, wire_message, Server,
};

const T: Duration = Duration::from_secs(10);
/// A version no build of this crate speaks.
const OTHER: u8 = 9;

/// `msg` as a peer of version `OTHER` would send it.
fn of_other_version(mut msg: Vec<u8>) -> Vec<u8> {
    msg[4] = OTHER;
    msg
}

/// Sends `msg` from `ep` to `to` and returns the first message `ep` then
/// receives (posting one unexpected receive for it).
fn send_and_take_reply(ep: &mut Endpoint, id: PluginId, to: &Addr, msg: &[u8], op: u64) -> Vec<u8> {
    ep.post_recv_unexpected(id, Vec::new(), OpId(op)).unwrap();
    ep.send_unexpected(to, 0, msg, OpId(1 << 40 | op)).unwrap();
    let end = Instant::now() + T;
    loop {
        assert!(Instant::now() < end, "no reply to message {op}");
        ep.progress(Some(Duration::from_millis(20))).unwrap();
        if let Some(c) = std::iter::from_fn(|| ep.pop_completion()).find(|c| c.op == OpId(op)) {
            return c.buf.unwrap();
        }
    }
}

#[test]
fn a_request_of_another_version_is_answered_with_both_versions() {
    let d = dir("foreign-request");
    let srv = Server::start(&d);
    let (mut ep, sm) = endpoint(&d, false);
    let s = ep.lookup(&srv.uri).unwrap();
    let input = postcard::to_allocvec(&(20u64, 22u64)).unwrap();
    for (i, flags) in [0, FLAG_ONE_WAY].into_iter().enumerate() {
        let cookie = 700 + i as u64;
        let msg = of_other_version(wire_message(flags, Add::NAME, cookie, &input));
        let reply = send_and_take_reply(&mut ep, sm, &s, &msg, cookie);
        // The answer is in the target's own version, which we speak.
        let (h, text) = Header::decode(&reply).unwrap();
        let text = String::from_utf8_lossy(text);
        assert!(h.is_response(), "flags {flags}: {h:?}");
        assert_eq!(
            (h.cookie, h.rpc_id, h.status),
            (cookie, hg_rpc::rpc_id(Add::NAME), Status::DecodeError),
            "flags {flags}: {text}"
        );
        assert!(
            text.contains(&format!("version {VERSION}")) && text.contains(&format!("version {OTHER}")),
            "{text}"
        );
    }
    // The server keeps serving a client of its own version.
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    assert_eq!(c.call::<Add>(&s, &(2, 2), T).unwrap(), 4);
}

#[test]
fn a_response_of_another_version_ends_its_call_only_from_its_target() {
    let d = dir("foreign-response");
    // A raw endpoint plays the target; the client listens, so that a third
    // party can reach it too.
    let (mut x, xid, mut c, s) = raw_target_and_client(&d, true);
    let id = c.forward::<Sleep>(&s, &0).unwrap();
    let (origin, cookie) = take_request(&mut x, xid, &mut c, 1);
    let answer = of_other_version(wire_message(FLAG_RESPONSE, Sleep::NAME, cookie, &[]));
    // From a third party: counted, and the call goes on.
    let (mut y, _) = endpoint(&d, false);
    let to_c = y.lookup(c.self_addr().uri()).unwrap();
    send_raw(&mut y, &to_c, None, &answer, OpId(2));
    let end = Instant::now() + T;
    while c.stats().version_mismatches == 0 {
        assert!(Instant::now() < end, "the third party's message never arrived");
        c.progress(Some(Duration::from_millis(10))).unwrap();
        c.trigger().unwrap();
    }
    assert!(!c.is_finished(id), "another peer ended the call");
    // From the target: the call ends now, with the error that says why.
    send_raw(&mut x, &origin, None, &answer, OpId(3));
    let started = Instant::now();
    match wait::<Sleep>(&mut c, id) {
        Err(RpcError::VersionMismatch { rpc, ours, theirs }) => {
            assert_eq!((rpc.as_str(), ours, theirs), (Sleep::NAME, VERSION, OTHER));
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < T, "the call ended only at its timeout");
    let st = c.stats();
    assert_eq!(
        (st.version_mismatches, st.malformed, st.in_flight, st.errors),
        (2, 0, 0, 1),
        "{st:?}"
    );
}
