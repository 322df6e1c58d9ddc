//! Pulls of spilled data that fail at completion over verbs: the memory
//! a spilled payload's descriptor names is deregistered before the
//! puller's RDMA READ reaches it, so the READ is posted (the key looks
//! fine to the puller) and ends with a remote access error (the
//! responder no longer knows the rkey). Two engines of this process,
//! each driven only when the test says, so that the order is fixed:
//! the holder lets the memory go first (its TTL, zero here, runs out),
//! then the puller pulls.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{Engine, RpcError, SPILLED_OUTPUT_TTL};
use na_core::{NaError, ProgressMode};
use serde_bytes::ByteBuf;

use super::rpcs::{fill_output, fill_pattern, Add, Echo, Fill};
use super::{client_state, common, rdma_spec, T};

/// Drives `e` alone until `done` gives something (within `T`, else
/// fails with `what`).
fn drive_until<X>(e: &mut Engine, what: &str, mut done: impl FnMut(&mut Engine) -> Option<X>) -> X {
    let end = Instant::now() + T;
    loop {
        if let Some(x) = done(e) {
            return x;
        }
        assert!(Instant::now() < end, "{what}: {:?}", e.stats());
        e.progress(Some(Duration::from_millis(1))).expect("progress");
        e.trigger().expect("trigger");
    }
}

/// A server engine on `spec` serving [`Add`], [`Fill`] and [`Echo`], and
/// how many times its [`Echo`] handler ran.
fn server(spec: &str) -> (Engine, Arc<AtomicU64>) {
    let mut srv = Engine::from_spec(spec, true, ProgressMode::default()).expect("server engine");
    srv.register::<Add>(|(a, b)| Ok(a + b)).expect("register");
    srv.register::<Fill>(|(len, seed)| Ok(fill_output(len, seed)))
        .expect("register");
    let runs = Arc::new(AtomicU64::new(0));
    let counter = runs.clone();
    srv.register::<Echo>(move |v| {
        counter.fetch_add(1, Ordering::SeqCst);
        Ok(v)
    })
    .expect("register");
    (srv, runs)
}

/// The target's spilled output is deregistered (its TTL ran out) before
/// the origin's RDMA READ of it: the call ends with the READ's own
/// transport error (`Rma`: a remote access error, wrong rkey), within
/// its timeout, not with a hang or a decode of whatever was read. The READ's failure takes the connection down (the QP goes to
/// ERROR), so an address of it fails at once with `PeerGone`; the target
/// serves the next calls over a new connection (a lookup again), a
/// spilled output among them.
#[test]
fn a_spilled_outputs_pull_that_fails_at_completion_ends_its_call_over_verbs() {
    let Some(spec) = rdma_spec("a_spilled_outputs_pull_that_fails_at_completion_ends_its_call_over_verbs")
    else {
        return;
    };
    let (mut srv, _) = server(&spec);
    let mut c = Engine::from_spec(&spec, false, ProgressMode::default()).expect("client engine");
    let len = 256u64 << 10;
    // Control: the same call works with the default TTL, so the path is
    // sound and the failure below is the deregistration's.
    let out = common::call_both::<Fill>(&mut c, &mut srv, &(len, 3)).unwrap_or_else(|e| {
        panic!(
            "a spilled output: {}; {}",
            na_core::ErrorChain(&e),
            client_state(&mut c)
        )
    });
    assert!(out == fill_pattern(len, 3), "pulled output differs");
    let s = c.endpoint().lookup(srv.self_addr().uri()).expect("lookup");

    srv.set_spilled_output_ttl(Duration::ZERO);
    let errors = c.stats().errors;
    let before = srv.stats();
    let id = c.forward::<Fill>(&s, &(len, 5)).expect("forward");
    // The target alone: it answers (the response is on the wire: the
    // client's posted receive takes it without the client's progress),
    // and lets the output go at its next sweep, deregistering it (maybe
    // in the same turn: the last sweep may be a second old).
    drive_until(&mut srv, "the output was never let go", |srv| {
        let st = srv.stats();
        (st.handled > before.handled && st.exposed_outputs == 0).then_some(())
    });
    let st = srv.stats();
    assert_eq!(st.handled, before.handled + 1, "{st:?}");
    assert_eq!(
        st.outputs_refused, before.outputs_refused,
        "not exposed at all: {st:?}"
    );
    // The origin alone: it takes the response and pulls what is gone.
    let started = Instant::now();
    let r = drive_until(&mut c, "the call whose pull fails never ended", |c| {
        c.take_response::<Fill>(id)
    });
    // The READ's own error (`Rma`: remote access), not `PeerGone`: the
    // READ's failure takes the connection down, and the engine's watch
    // of the peer fails, but a call whose output is being read is left to
    // that read.
    let msg = match &r {
        Err(RpcError::Transport(NaError::Rma { op, source, .. })) => {
            assert_eq!(*op, "get", "{r:?}");
            assert_eq!(source.kind(), std::io::ErrorKind::PermissionDenied, "{r:?}");
            r.as_ref()
                .err()
                .map(|e| na_core::ErrorChain(e).to_string())
                .unwrap_or_default()
        }
        other => panic!(
            "expected the failed READ's own error (NaError::Rma), got {:?}; {}",
            other.as_ref().map(|v| v.len()),
            client_state(&mut c)
        ),
    };
    assert!(
        msg.contains("RMA get") && msg.contains("remote access error") && msg.contains("wrong rkey"),
        "not the remote access error of a deregistered key: {r:?}"
    );
    eprintln!(
        "the pull failed at completion after {:?}: {:?}",
        started.elapsed(),
        r.as_ref().err()
    );
    assert_eq!(c.stats().errors, errors + 1, "{:?}", c.stats());
    assert_eq!(c.stats().in_flight, 0, "{:?}", c.stats());
    // The connection went with the READ: the old address fails at once.
    match c.call::<Add>(&s, &(1, 2), T) {
        Err(RpcError::Transport(NaError::PeerGone { .. })) => {}
        other => panic!("a call on the dead connection: {other:?}"),
    }

    // The target serves on, over a new connection, spilled outputs and
    // inputs included (call_both looks the server up again).
    srv.set_spilled_output_ttl(SPILLED_OUTPUT_TTL);
    for i in 0..20u64 {
        assert_eq!(
            common::call_both::<Add>(&mut c, &mut srv, &(i, 1)).expect("add after the failed pull"),
            i + 1
        );
    }
    let out = common::call_both::<Fill>(&mut c, &mut srv, &(len, 9)).unwrap_or_else(|e| {
        panic!(
            "a spilled output after the failed pull: {}; {}",
            na_core::ErrorChain(&e),
            client_state(&mut c)
        )
    });
    assert!(out == fill_pattern(len, 9), "pulled output differs");
    let big = ByteBuf::from(fill_pattern(300_000, 1));
    let back =
        common::call_both::<Echo>(&mut c, &mut srv, &big).expect("a spilled echo after the failed pull");
    assert!(back == big, "echo differs");
    let st = srv.stats();
    assert_eq!((st.exposed_outputs, st.exposed_bytes), (0, 0), "{st:?}");
}

/// The origin's spilled input is deregistered before the target's RDMA
/// READ of it: the origin gave the call up (`abandon`), and its
/// abandoned-input TTL (zero here) ran out at its next sweep, which lets
/// the input go, before the target looked at the request. The target's
/// pull is posted and fails at completion; the target does not run the
/// handler, its answer (a decode error that names the failed pull) finds
/// the connection gone with the READ and is counted as dropped, nothing
/// is counted as malformed, and it serves the next calls (a spilled
/// input among them, so its pull budget was given back) over a new
/// connection.
#[test]
fn a_spilled_inputs_pull_that_fails_at_completion_leaves_the_target_serving_over_verbs() {
    let Some(spec) =
        rdma_spec("a_spilled_inputs_pull_that_fails_at_completion_leaves_the_target_serving_over_verbs")
    else {
        return;
    };
    let (mut srv, runs) = server(&spec);
    let ran = |runs: &AtomicU64| runs.load(Ordering::SeqCst);
    let mut c = Engine::from_spec(&spec, false, ProgressMode::default()).expect("client engine");
    let big = ByteBuf::from(fill_pattern(300_000, 2));
    // Control: the same call works when the input stays, so the path is
    // sound and the failure below is the deregistration's.
    let back = common::call_both::<Echo>(&mut c, &mut srv, &big).unwrap_or_else(|e| {
        panic!(
            "a spilled input: {}; {}",
            na_core::ErrorChain(&e),
            client_state(&mut c)
        )
    });
    assert!(back == big, "echo differs");
    assert_eq!(ran(&runs), 1);
    let uri = srv.self_addr().uri().to_owned();
    let s = c.endpoint().lookup(&uri).expect("lookup");

    c.set_abandoned_input_ttl(Duration::ZERO);
    let id = c
        .forward::<Echo>(&s, &ByteBuf::from(fill_pattern(300_000, 4)))
        .expect("forward");
    c.abandon(id);
    assert_eq!(c.stats().abandoned_inputs, 1, "{:?}", c.stats());
    // The origin alone: the request is on the wire (the target's posted
    // receive takes it without the target's progress); the input goes at
    // the next sweep, deregistered.
    drive_until(&mut c, "the abandoned input was never let go", |c| {
        (c.stats().abandoned_inputs == 0).then_some(())
    });
    // The target alone: it takes the request and pulls what is gone.
    let before = srv.stats();
    drive_until(&mut srv, "the target's failed pull never ended", |srv| {
        (srv.stats().responses_dropped > before.responses_dropped).then_some(())
    });
    let after = srv.stats();
    assert_eq!(ran(&runs), 1, "the handler ran on an input whose pull failed");
    assert_eq!(
        after.malformed, before.malformed,
        "a failed pull is not malformed data: {after:?}"
    );
    assert_eq!(after.responses_dropped, before.responses_dropped + 1, "{after:?}");

    // Both learn that the connection went; the origin's next lookup
    // connects afresh, and the target serves on.
    let end = Instant::now() + T;
    while c.endpoint().lookup(&uri).expect("lookup") == s {
        assert!(Instant::now() < end, "the origin never saw its connection go");
        for e in [&mut c, &mut srv] {
            e.progress(Some(Duration::from_millis(1))).expect("progress");
            e.trigger().expect("trigger");
        }
    }
    for i in 0..20u64 {
        assert_eq!(
            common::call_both::<Add>(&mut c, &mut srv, &(i, 1)).expect("add after the failed pull"),
            i + 1
        );
    }
    let back = common::call_both::<Echo>(&mut c, &mut srv, &big).unwrap_or_else(|e| {
        panic!(
            "a spilled input after the failed pull: {}; {}",
            na_core::ErrorChain(&e),
            client_state(&mut c)
        )
    });
    assert!(back == big, "echo differs");
    assert_eq!(ran(&runs), 2);
    assert_eq!(srv.stats().malformed, before.malformed);
}
