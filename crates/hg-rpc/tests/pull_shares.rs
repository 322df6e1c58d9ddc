//! One origin's share of a target's pull budget: a greedy origin, a real
//! process (`hg-rpc-testpeer` as a stalled client that sends many `Digest`
//! calls with 1 MiB inputs and never reads an answer), whose inputs an
//! async handler holds (it waits on a gate), takes at most its share, and
//! an honest origin's spilled call is still served instead of being
//! answered busy.

use std::ffi::OsStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{AsyncEngine, Engine, RpcError, RpcStats};
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{dir, Server};

/// One call's input: 1 MiB of a byte (1 for the greedy origin's calls).
const LEN: usize = 1 << 20;

/// Calls the greedy origin sends at once.
const GREEDY_CALLS: u64 = 8;

/// Bytes one spilled input holds of the budget: its encoding.
fn input_len() -> u64 {
    postcard::to_allocvec(&vec![1u8; LEN]).unwrap().len() as u64
}

/// A target whose budget holds four inputs (so its default share, half,
/// two), serving `Digest` with an async handler that holds the greedy
/// origin's inputs (byte 1) until the gate opens and answers others at
/// once; with `share` set, one origin's share is that.
fn target(
    d: &std::path::Path,
    share: Option<u64>,
) -> (AsyncEngine, Arc<tokio::sync::Semaphore>, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (ep, id) = common::endpoint(d, true);
    let mut e = Engine::new(ep, id).unwrap();
    e.set_max_pull_bytes(4 * input_len());
    if let Some(share) = share {
        e.set_max_pull_bytes_per_peer(share);
    }
    let srv = rt.block_on(async { AsyncEngine::spawn(e) }).unwrap();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = gate.clone();
    srv.register_async::<Digest, _, _>(move |data| {
        let g = g.clone();
        async move {
            if data.first() == Some(&1) {
                g.acquire().await.map_err(|e| e.to_string())?.forget();
            }
            Ok((data.len() as u64, fnv(&data)))
        }
    })
    .unwrap();
    (srv, gate, rt)
}

/// The greedy origin: sends its calls, then stalls.
fn greedy(d: &std::path::Path, server: &str) -> Server {
    Server::with_envs(&[
        ("QS_SM_DIR", d.as_os_str()),
        ("HG_TESTPEER_STALLED_CALL", OsStr::new(server)),
        (
            "HG_TESTPEER_STALLED_INPUTS",
            OsStr::new(&GREEDY_CALLS.to_string()),
        ),
    ])
}

/// Waits (at most 10 s) until the target has taken every greedy call
/// (each admitted or answered busy), and returns its counters.
fn greedy_calls_taken(srv: &AsyncEngine) -> RpcStats {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let s = srv.stats();
        if s.deferred_in_flight + s.pulls_refused == GREEDY_CALLS {
            return s;
        }
        assert!(Instant::now() < end, "greedy calls not all taken: {s:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The honest origin's call (input byte 2), from an engine of this
/// process, blocking.
fn honest_call(d: &std::path::Path, server: &str) -> hg_rpc::Result<(u64, u64)> {
    let mut c = common::client(d);
    let at = c.lookup(server).unwrap();
    c.call::<Digest>(&at, &ByteBuf::from(vec![2u8; LEN]), Duration::from_secs(10))
}

#[test]
fn a_greedy_origin_takes_its_share_of_the_pull_budget_not_all_of_it() {
    let d = dir("pull-share");
    let (srv, gate, _rt) = target(&d, None);
    let uri = srv.self_addr().to_string();
    let _greedy = greedy(&d, &uri);
    let s = greedy_calls_taken(&srv);
    // Served, not answered busy.
    let r = honest_call(&d, &uri);
    assert_eq!(r.unwrap(), (LEN as u64, fnv(&vec![2u8; LEN])), "{s:?}");
    // Half the budget: two inputs held, the rest answered busy.
    assert_eq!(
        (s.deferred_in_flight, s.pulls_refused),
        (2, GREEDY_CALLS - 2),
        "{s:?}"
    );
    gate.add_permits(GREEDY_CALLS as usize);
}

/// The share is a setting: the whole budget brings back one origin that
/// takes all of it (and the honest call is answered busy: what the share
/// prevents), a smaller one holds the greedy origin to one input at a
/// time plus none (an origin that holds nothing always gets one in).
#[test]
fn the_share_is_set_with_the_budget() {
    let d = dir("pull-share-set");
    let (srv, gate, _rt) = target(&d, Some(4 * input_len()));
    let uri = srv.self_addr().to_string();
    let greedy_all = greedy(&d, &uri);
    let s = greedy_calls_taken(&srv);
    assert_eq!(
        (s.deferred_in_flight, s.pulls_refused),
        (4, GREEDY_CALLS - 4),
        "{s:?}"
    );
    match honest_call(&d, &uri) {
        Err(RpcError::Busy { reason, .. }) => assert!(reason.contains("would exceed"), "{reason}"),
        other => panic!("expected the budget's refusal, got {other:?}"),
    }
    drop(greedy_all);
    gate.add_permits(GREEDY_CALLS as usize);
    drop(srv);

    let (srv, gate, _rt2) = target(&d, Some(1));
    let uri = srv.self_addr().to_string();
    let _greedy = greedy(&d, &uri);
    let s = greedy_calls_taken(&srv);
    assert_eq!(
        (s.deferred_in_flight, s.pulls_refused),
        (1, GREEDY_CALLS - 1),
        "{s:?}"
    );
    let r = honest_call(&d, &uri);
    assert_eq!(r.unwrap(), (LEN as u64, fnv(&vec![2u8; LEN])));
    gate.add_permits(GREEDY_CALLS as usize);
}
