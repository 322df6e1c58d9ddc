//! Peers with different eager limits over verbs: each process picks its
//! own `VerbsConfig::max_msg_size` and tells it in its connection's
//! hello, and a message past the *peer's* limit would fail with
//! `MessageTooLarge`. The engine spills (into bulk memory the peer pulls)
//! whatever the destination does not take: inputs from a client with a
//! large limit to a server with a small one (calls and one-way calls),
//! outputs the other way, and, before the hello told the peer's limit,
//! anything past `MIN_EAGER_SIZE`. An engine refuses a plugin whose limit
//! is below `MIN_EAGER_SIZE`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{Engine, RpcError, MIN_EAGER_SIZE};
use na_core::{Addr, Endpoint, NaError, Plugin, PluginId, ProgressMode};
use serde_bytes::ByteBuf;

use super::rpcs::{fill_output, fill_pattern, fnv, Add, Digest, Fill};
use super::{client_state, rdma_spec, T};

/// The small limit (the default).
const SMALL: usize = 4096;
/// The large limit.
const LARGE: usize = 16 << 10;
/// A payload between the two limits.
const BETWEEN: usize = 8000;

/// A verbs plugin on `spec` whose largest message is `max_msg_size`, in
/// a new endpoint.
pub(super) fn verbs_endpoint(spec: &str, listen: bool, max_msg_size: usize) -> (Endpoint, PluginId) {
    let mut cfg = na_verbs::VerbsFactory::default()
        .config_for(spec, listen)
        .expect("verbs config");
    cfg.max_msg_size = max_msg_size;
    let mut ep = Endpoint::new(ProgressMode::default()).expect("endpoint");
    let id = ep
        .add_plugin(|id| Ok(Box::new(na_verbs::VerbsPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .expect("verbs plugin");
    (ep, id)
}

/// An engine on a verbs plugin whose largest message is `max_msg_size`.
fn engine(spec: &str, listen: bool, max_msg_size: usize) -> Engine {
    let (ep, id) = verbs_endpoint(spec, listen, max_msg_size);
    Engine::new(ep, id).expect("engine")
}

/// A server on `spec` with limit `max_msg_size`, serving [`Add`],
/// [`Digest`] (counting its runs) and [`Fill`].
fn server(spec: &str, max_msg_size: usize) -> (Engine, Arc<AtomicU64>) {
    let mut srv = engine(spec, true, max_msg_size);
    srv.register::<Add>(|(a, b)| Ok(a + b)).expect("register");
    let runs = Arc::new(AtomicU64::new(0));
    let counter = runs.clone();
    srv.register::<Digest>(move |v| {
        counter.fetch_add(1, Ordering::SeqCst);
        Ok((v.len() as u64, fnv(&v)))
    })
    .expect("register");
    srv.register::<Fill>(|(len, seed)| Ok(fill_output(len, seed)))
        .expect("register");
    (srv, runs)
}

/// Calls `R` on `dest` and drives both engines until it ends.
fn call<R: hg_rpc::Rpc>(
    c: &mut Engine,
    srv: &mut Engine,
    dest: &Addr,
    input: &R::Input,
) -> hg_rpc::Result<R::Output> {
    call_within::<R>(c, srv, dest, input, T)
}

/// Calls `R` on `dest` and drives both engines until it ends, or fails
/// (instead of hanging) once `bound` has passed.
pub(super) fn call_within<R: hg_rpc::Rpc>(
    c: &mut Engine,
    srv: &mut Engine,
    dest: &Addr,
    input: &R::Input,
    bound: Duration,
) -> hg_rpc::Result<R::Output> {
    let id = c.forward::<R>(dest, input)?;
    let end = Instant::now() + bound;
    loop {
        if let Some(r) = c.take_response::<R>(id) {
            return r;
        }
        assert!(
            Instant::now() < end,
            "{}: no result within {bound:?}; {}; server {:?}",
            R::NAME,
            client_state(c),
            srv.stats()
        );
        for e in [&mut *c, &mut *srv] {
            e.progress(Some(Duration::from_millis(1))).expect("progress");
            e.trigger().expect("trigger");
        }
    }
}

/// What `c`'s plugin says `dest` accepts.
fn limit_to(c: &mut Engine, dest: &Addr) -> usize {
    let id = dest.plugin();
    c.endpoint()
        .plugin(id)
        .expect("plugin")
        .max_unexpected_size_to(dest)
}

/// A client with a large limit calls a server with a small one: an input
/// between the two limits spills (the request that goes is the small
/// descriptor) and the call succeeds, before the hello (limit unknown:
/// anything past `MIN_EAGER_SIZE` spills) and after; so does a one-way
/// call's. (Before: sent eagerly, it failed with `MessageTooLarge`.)
#[test]
fn an_input_past_the_servers_smaller_limit_spills_over_verbs() {
    let Some(spec) = rdma_spec("an_input_past_the_servers_smaller_limit_spills_over_verbs") else {
        return;
    };
    let (mut srv, runs) = server(&spec, SMALL);
    let mut c = engine(&spec, false, LARGE);
    let s = c.endpoint().lookup(srv.self_addr().uri()).expect("lookup");
    // Not connected yet: the peer's limit is not known.
    assert_eq!(limit_to(&mut c, &s), 0, "a limit before the hello");
    let input = ByteBuf::from(fill_pattern(BETWEEN as u64, 1));
    let want = (input.len() as u64, fnv(&input));
    for round in ["before the hello", "after it"] {
        let sent = c.stats().bytes_sent;
        let got = call::<Digest>(&mut c, &mut srv, &s, &input).unwrap_or_else(|e| {
            panic!(
                "{round}: an input of {BETWEEN} bytes: {}; {}",
                na_core::ErrorChain(&e),
                client_state(&mut c)
            )
        });
        assert_eq!(got, want, "{round}");
        let request = c.stats().bytes_sent - sent;
        assert!(
            request < SMALL as u64,
            "{round}: a request of {request} bytes went (not spilled)"
        );
    }
    assert_eq!(limit_to(&mut c, &s), SMALL, "the server's hello");
    assert_eq!(call::<Add>(&mut c, &mut srv, &s, &(2, 3)).expect("add"), 5);

    // One-way: spilled too, and run once the server pulled it.
    let before = runs.load(Ordering::SeqCst);
    c.forward_one_way::<Digest>(&s, &input)
        .unwrap_or_else(|e| panic!("one-way: {}; {}", na_core::ErrorChain(&e), client_state(&mut c)));
    let end = Instant::now() + T;
    while runs.load(Ordering::SeqCst) == before {
        assert!(
            Instant::now() < end,
            "the one-way call never ran; {}",
            client_state(&mut c)
        );
        for e in [&mut c, &mut srv] {
            e.progress(Some(Duration::from_millis(1))).expect("progress");
            e.trigger().expect("trigger");
        }
    }
    assert_eq!(c.stats().errors, 0, "{}", client_state(&mut c));
}

/// The reverse: a server with a large limit answers a client with a
/// small one: an output between the two limits spills (the client pulls
/// it) and the call succeeds. (Before: the server's response failed
/// with `MessageTooLarge` and the call never ended.) Also: an engine
/// refuses a plugin whose limit is under `MIN_EAGER_SIZE`.
#[test]
fn an_output_past_the_clients_smaller_limit_spills_over_verbs() {
    let Some(spec) = rdma_spec("an_output_past_the_clients_smaller_limit_spills_over_verbs") else {
        return;
    };
    let (mut srv, _) = server(&spec, LARGE);
    let mut c = engine(&spec, false, SMALL);
    let s = c.endpoint().lookup(srv.self_addr().uri()).expect("lookup");
    assert_eq!(call::<Add>(&mut c, &mut srv, &s, &(1, 2)).expect("add"), 3);
    let sent = srv.stats().bytes_sent;
    let out = call::<Fill>(&mut c, &mut srv, &s, &(BETWEEN as u64, 7)).unwrap_or_else(|e| {
        panic!(
            "an output of {BETWEEN} bytes: {}; {}",
            na_core::ErrorChain(&e),
            client_state(&mut c)
        )
    });
    assert!(out == fill_pattern(BETWEEN as u64, 7), "pulled output differs");
    let response = srv.stats().bytes_sent - sent;
    assert!(
        response < SMALL as u64,
        "a response of {response} bytes went (not spilled)"
    );
    // An output under both limits still goes eagerly.
    let sent = srv.stats().bytes_sent;
    let out = call::<Fill>(&mut c, &mut srv, &s, &(2000, 8)).expect("a small output");
    assert!(out == fill_pattern(2000, 8), "output differs");
    assert!(srv.stats().bytes_sent - sent > 2000, "a small output spilled");

    // Too small for any engine.
    let (ep, id) = verbs_endpoint(&spec, false, MIN_EAGER_SIZE - 1);
    match Engine::new(ep, id) {
        Err(RpcError::Transport(NaError::Config { name, .. })) => assert_eq!(name, "max_unexpected_size"),
        Err(e) => panic!(
            "an engine on a {}-byte plugin: {}",
            MIN_EAGER_SIZE - 1,
            na_core::ErrorChain(&e)
        ),

        Ok(_) => panic!("an engine on a {}-byte plugin was built", MIN_EAGER_SIZE - 1),
    }
}
