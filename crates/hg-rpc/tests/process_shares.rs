//! The per-origin bounds count processes, not connections: a hostile
//! process (`hg-rpc-testpeer` as a stalled client, with
//! `HG_TESTPEER_STALLED_CONNS`: many engines of its own, each a connection
//! under an instance name of its own) that fills what it can through eight
//! connections holds one origin's share of the target's pull budget, of
//! its deferred requests and of its exposed outputs, and an honest client
//! process is still served. Before, each connection was an origin: two
//! filled the pull budget, two (with these bounds) the deferred requests,
//! four the exposed outputs, and the honest client was answered busy.
//! Also: our own calls' outputs keep a floor in the pull budget that other
//! origins' inputs cannot take.

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

/// A spilled input: 1 MiB.
const LEN: usize = 1 << 20;

/// Connections the hostile process opens.
const CONNS: u64 = 8;

/// Every test's calls are bounded by this (a failure, never a hang).
const T: Duration = Duration::from_secs(10);

/// Bytes one spilled input of [`LEN`] holds of a pull budget.
fn input_len() -> u64 {
    postcard::to_allocvec(&vec![1u8; LEN]).unwrap().len() as u64
}

/// A listening engine of this process, run by a tokio driver, serving
/// `Digest` with an async handler that holds the hostile process's inputs
/// (byte 1) until the gate opens and answers others at once, and `Fill`;
/// `setup` sets its bounds first.
fn target(
    d: &std::path::Path,
    setup: impl FnOnce(&mut Engine),
) -> (AsyncEngine, Arc<tokio::sync::Semaphore>, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (ep, id) = common::endpoint(d, true);
    let mut e = Engine::new(ep, id).unwrap();
    setup(&mut e);
    e.register::<Fill>(|(len, seed)| Ok(fill_output(len, seed)))
        .unwrap();
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

/// The hostile process: [`CONNS`] connections to `server`, each sending
/// `inputs` `Digest` calls with inputs of `len` bytes of byte 1 (or, with
/// `inputs` 0, one `Fill` of `len` bytes), then stalling.
fn hostile(d: &std::path::Path, server: &str, inputs: u64, len: usize) -> Server {
    let conns = CONNS.to_string();
    let len = len.to_string();
    let inputs = inputs.to_string();
    let mut vars = vec![
        ("QS_SM_DIR", d.as_os_str()),
        ("HG_TESTPEER_STALLED_CALL", OsStr::new(server)),
        ("HG_TESTPEER_STALLED_CONNS", OsStr::new(&conns)),
        ("HG_TESTPEER_STALLED_LEN", OsStr::new(&len)),
    ];
    if inputs != "0" {
        vars.push(("HG_TESTPEER_STALLED_INPUTS", OsStr::new(&inputs)));
    }
    Server::with_envs(&vars)
}

/// Waits (at most [`T`]) until `taken` says the target took all `calls`
/// of the hostile process (each admitted or refused); its counters.
fn all_taken(srv: &AsyncEngine, calls: u64, taken: impl Fn(&RpcStats) -> u64) -> RpcStats {
    let end = Instant::now() + T;
    loop {
        let s = srv.stats();
        if taken(&s) == calls {
            return s;
        }
        assert!(Instant::now() < end, "hostile calls not all taken: {s:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The honest client: an engine of this test process (a process apart
/// from the hostile one), connected to `server`.
fn honest_engine(d: &std::path::Path, server: &str) -> (Engine, hg_rpc::Addr) {
    let mut c = common::client(d);
    let at = c.lookup(server).unwrap();
    (c, at)
}

/// One process with eight connections, each sending two spilled 1 MiB
/// inputs held by the gate: it holds one share (half of a budget of four
/// inputs: two), not two connections' worth of it all, and the honest
/// client's spilled input is served.
#[test]
fn many_connections_of_one_process_hold_one_share_of_the_pull_budget() {
    let d = dir("proc-share-pull");
    let (srv, gate, _rt) = target(&d, |e| e.set_max_pull_bytes(4 * input_len()));
    let uri = srv.self_addr().to_string();
    let _h = hostile(&d, &uri, 2, LEN);
    let s = all_taken(&srv, 2 * CONNS, |s| s.deferred_in_flight + s.pulls_refused);
    let (mut c, at) = honest_engine(&d, &uri);
    let r = c.call::<Digest>(&at, &ByteBuf::from(vec![2u8; LEN]), T);
    assert_eq!(r.unwrap(), (LEN as u64, fnv(&vec![2u8; LEN])), "{s:?}");
    assert_eq!(
        (s.deferred_in_flight, s.pulls_refused),
        (2, 2 * CONNS - 2),
        "{s:?}"
    );
    gate.add_permits(2 * CONNS as usize);
}

/// Deferred requests (small inputs, bounds 4 per origin, 8 in all): the
/// process's eight connections hold four, and the honest client's request
/// for the async handler is served, not answered busy.
#[test]
fn many_connections_of_one_process_hold_one_origin_s_deferred_requests() {
    let d = dir("proc-share-deferred");
    let (srv, gate, _rt) = target(&d, |e| e.set_max_deferred(4, 8));
    let uri = srv.self_addr().to_string();
    let _h = hostile(&d, &uri, 4, 16);
    let s = all_taken(&srv, 4 * CONNS, |s| s.deferred_in_flight + s.deferred_refused);
    let (mut c, at) = honest_engine(&d, &uri);
    let r = c.call::<Digest>(&at, &ByteBuf::from(vec![2u8; 16]), T);
    assert_eq!(r.unwrap(), (16, fnv(&[2u8; 16])), "{s:?}");
    assert_eq!(
        (s.deferred_in_flight, s.deferred_refused),
        (4, 4 * CONNS - 4),
        "{s:?}"
    );
    gate.add_permits(4 * CONNS as usize);
}

/// Exposed outputs (1.5 MiB per origin, 4.5 MiB in all): the process's
/// eight connections each ask for a 1 MiB output and never pull it; one
/// is exposed, and the honest client still gets its own output.
#[test]
fn many_connections_of_one_process_hold_one_origin_s_exposed_outputs() {
    let d = dir("proc-share-exposed");
    let (srv, _gate, _rt) = target(&d, |e| {
        e.set_max_exposed_bytes(3 * input_len() / 2, 9 * input_len() / 2)
    });
    let uri = srv.self_addr().to_string();
    let _h = hostile(&d, &uri, 0, LEN);
    let s = all_taken(&srv, CONNS, |s| s.exposed_outputs + s.outputs_refused);
    let (mut c, at) = honest_engine(&d, &uri);
    let r = c.call::<Fill>(&at, &(LEN as u64, 7), T);
    assert_eq!(r.unwrap(), fill_pattern(LEN as u64, 7), "{s:?}");
    assert_eq!((s.exposed_outputs, s.outputs_refused), (1, CONNS - 1), "{s:?}");
}

/// Our own calls' outputs are not starved by others' inputs: an engine
/// that serves (its budget, four inputs, all of it one origin's share
/// here, filled by a hostile process's inputs its async handler holds)
/// calls a server process whose 1 MiB output spills. The output is
/// pulled within the floor (a quarter of the budget by default); before,
/// it waited for room until the call timed out.
#[test]
fn own_calls_outputs_keep_a_floor_that_others_inputs_cannot_take() {
    let d = dir("output-floor");
    let (srv, gate, rt) = target(&d, |e| {
        e.set_max_pull_bytes(4 * input_len());
        e.set_max_pull_bytes_per_peer(4 * input_len());
    });
    let uri = srv.self_addr().to_string();
    let _h = hostile(&d, &uri, 1, LEN);
    let s = all_taken(&srv, CONNS, |s| s.deferred_in_flight + s.pulls_refused);
    assert_eq!(s.deferred_in_flight, 4, "the budget is full: {s:?}");
    let server = Server::start(&d);
    let out = rt.block_on(async {
        let at = srv.lookup(&server.uri).await?;
        srv.call::<Fill>(&at, &(LEN as u64, 3), T).await
    });
    match out {
        Ok(v) => assert_eq!(v, fill_pattern(LEN as u64, 3)),
        Err(e @ RpcError::Timeout { .. }) => {
            panic!("the output starved behind others' inputs: {e} {:?}", srv.stats())
        }
        Err(e) => panic!("{}", na_core::ErrorChain(&e)),
    }
    gate.add_permits(CONNS as usize);
}

/// An engine's self-forwards and the calls of every other engine in its
/// process are one origin to it (its own process, which na-sm vouches
/// for): with one deferred request per origin, one self-forward held
/// unanswered has another engine of this process answered busy, and
/// answering it lets that engine in.
#[test]
fn self_forwards_and_other_engines_of_the_process_are_one_origin() {
    let d = dir("self-origin");
    let (ep, id) = common::endpoint(&d, true);
    let mut srv = Engine::new(ep, id).unwrap();
    srv.set_max_deferred(1, 100);
    srv.register_deferred::<Record>().unwrap();
    let me = srv.self_addr().clone();
    let own = srv.forward::<Record>(&me, &1).unwrap();
    let held = srv.take_deferred().expect("the self-forward is deferred");
    let (ep, id) = common::endpoint(&d, false);
    let mut other = Engine::new(ep, id).unwrap();
    let s = other.endpoint().lookup(srv.self_addr().uri()).unwrap();
    let run = |srv: &mut Engine, other: &mut Engine| {
        let call = other.forward::<Record>(&s, &2).unwrap();
        let end = Instant::now() + T;
        loop {
            for e in [&mut *srv, &mut *other] {
                e.progress(Some(Duration::from_millis(1))).unwrap();
                e.trigger().unwrap();
            }
            if let Some(req) = srv.take_deferred() {
                srv.respond_deferred(req, Ok(postcard::to_allocvec(&()).unwrap()));
            }
            if let Some(r) = other.take_response::<Record>(call) {
                return r;
            }
            assert!(Instant::now() < end, "no answer within {T:?}");
        }
    };
    match run(&mut srv, &mut other) {
        Err(RpcError::Busy { .. }) => {}
        r => panic!("another engine of this process got {r:?} past the self-forward's origin bound"),
    }
    srv.respond_deferred(held, Ok(postcard::to_allocvec(&()).unwrap()));
    srv.trigger().unwrap();
    assert!(srv.take_response::<Record>(own).is_some_and(|r| r.is_ok()));
    run(&mut srv, &mut other).expect("served once the self-forward was answered");
}
