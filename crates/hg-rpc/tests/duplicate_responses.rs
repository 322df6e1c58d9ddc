//! A second response for a call that already has one in hand (a confused
//! or hostile target, played here by a raw endpoint in this process over
//! a real sm connection): while the first response's spilled output
//! waits for room in the origin's pull budget, a later response, plain
//! or of another protocol version, is dropped (counted in `malformed`,
//! or in `version_mismatches`), and the call still gets the output it
//! waited for. (During the pull itself: `response_routing.rs`.)

use std::time::Duration;

use hg_rpc::Engine;
use na_core::{Endpoint, OpId, PluginId};
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{dir, raw_target_and_client, send_raw, take_request, wait};
mod routing_helpers;
use routing_helpers::{postcard_echo_response, pump, spilled_echo_response};

/// Bytes of each spilled output: two do not fit the origin's budget.
const OUT: usize = 64 << 10;

/// A spilled `Echo` response to `cookie` carrying `data`, exposed by `x`:
/// the handle (keep it until pulled) and the message.
fn spilled(x: &mut Endpoint, xid: PluginId, cookie: u64, data: &[u8]) -> (na_core::MemHandle, Vec<u8>) {
    let output = postcard::to_allocvec(data).unwrap();
    let crc = hg_rpc::header::crc32c(&output);
    spilled_echo_response(x, xid, cookie, output, crc)
}

/// Calls `a` and `b` answered with spilled outputs; `a`'s pull takes the
/// budget, so `b`'s output waits for room; `dup` (a second response to
/// `b`) comes right behind, in the same batch. Returns what each call got
/// and the client.
fn answered_twice(tag: &str, dup: impl FnOnce(u64) -> Vec<u8>) -> (ByteBuf, ByteBuf, Engine) {
    let d = dir(tag);
    let (mut x, xid, mut c, s) = raw_target_and_client(&d, false);
    // Room for one output's pull at a time.
    c.set_max_pull_bytes((OUT + OUT / 2) as u64);
    let a = c.forward::<Echo>(&s, &ByteBuf::from(vec![1u8; 16])).unwrap();
    let b = c.forward::<Echo>(&s, &ByteBuf::from(vec![2u8; 16])).unwrap();
    let (origin, ca) = take_request(&mut x, xid, &mut c, 1);
    let (_, cb) = take_request(&mut x, xid, &mut c, 2);
    let (_ma, ra) = spilled(&mut x, xid, ca, &[0xa; OUT]);
    let (_mb, rb) = spilled(&mut x, xid, cb, &[0xb; OUT]);
    // All three are in the origin's queue before it looks.
    send_raw(&mut x, &origin, None, &ra, OpId(3));
    send_raw(&mut x, &origin, None, &rb, OpId(4));
    send_raw(&mut x, &origin, None, &dup(cb), OpId(5));
    let out_a = wait::<Echo>(&mut c, a).expect("a's output");
    let out_b = wait::<Echo>(&mut c, b).expect("b's output, not the duplicate's");
    pump(&mut c, Duration::from_millis(50));
    assert_eq!(
        c.stats().outputs_waited,
        1,
        "b's output did not wait: the test did not test it"
    );
    assert_eq!(
        (c.stats().in_flight, c.outputs_waiting()),
        (0, 0),
        "{:?}",
        c.stats()
    );
    // Both outputs were pulled: `x` kept them until the end.
    drop(x);
    (out_a, out_b, c)
}

#[test]
fn a_plain_second_response_while_the_spilled_output_waits_is_dropped() {
    let (a, b, c) = answered_twice("dup-wait", |cookie| postcard_echo_response(cookie, &[0xd; 8]));
    assert!(a == vec![0xa; OUT], "a's output corrupted");
    assert!(
        b == vec![0xb; OUT],
        "b got {} bytes, not its waiting output",
        b.len()
    );
    let st = c.stats();
    assert_eq!(
        (st.malformed, st.errors),
        (1, 0),
        "the duplicate is counted once: {st:?}"
    );
}

#[test]
fn a_second_response_of_another_version_while_the_output_waits_is_dropped() {
    let (a, b, c) = answered_twice("dup-wait-foreign", |cookie| {
        let mut foreign = postcard_echo_response(cookie, &[1]);
        foreign[4] = hg_rpc::header::VERSION.wrapping_add(1);
        foreign
    });
    assert!(a == vec![0xa; OUT] && b == vec![0xb; OUT], "outputs corrupted");
    let st = c.stats();
    assert_eq!((st.version_mismatches, st.errors), (1, 0), "{st:?}");
}
