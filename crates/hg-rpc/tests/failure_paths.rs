//! How calls end when something goes wrong on the target's side: it exits
//! right after answering, its handler fails with a long message or
//! panics, or the RPC it is sent does not exist. Two engines in one test
//! process over real sm plugins, each driven by hand. (A caller that
//! stops reading its responses is in `full_backlog.rs`.)

use std::time::{Duration, Instant};

use hg_rpc::{Engine, Rpc, RpcError};
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{call_both, client, dir, endpoint, wait, wire_message};

const T: Duration = Duration::from_secs(10);

/// A server engine (listening) with `Add`, `Echo` and `Fail` registered.
fn server(d: &std::path::Path) -> Engine {
    let (ep, sid) = endpoint(d, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    srv.register::<Add>(|(a, b)| Ok(a + b)).unwrap();
    srv.register::<Echo>(Ok).unwrap();
    srv.register::<Fail>(Err).unwrap();
    srv
}

/// Drives `srv` alone until it handled `n` requests in all.
fn serve_until(srv: &mut Engine, n: u64) {
    let end = Instant::now() + T;
    while srv.stats().handled < n {
        assert!(Instant::now() < end, "the server handled {:?}", srv.stats());
        srv.progress(Some(Duration::from_millis(5))).unwrap();
        srv.trigger().unwrap();
    }
}

/// A target answers and exits at once (a "shutdown" RPC, say): the origin
/// notices the hang-up in the same pass that brings the response, and the
/// call must still get its answer, not `PeerGone` (pull mode kept the
/// peer's last messages but filed its death first).
#[test]
fn a_response_sent_just_before_the_target_exits_is_the_call_s_result() {
    for round in 0..3 {
        let d = dir(&format!("last-words-{round}"));
        let mut srv = server(&d);
        let mut c = client(&d);
        // Connected and watched both ways.
        assert_eq!(call_both::<Add>(&mut c, &mut srv, &(1, 1)).unwrap(), 2);
        let s = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
        let id = c.forward::<Add>(&s, &(1, 2)).unwrap();
        // Only the server runs: the response waits in the client's ring.
        serve_until(&mut srv, 2);
        drop(srv);
        std::thread::sleep(Duration::from_millis(50));
        // What the tokio driver does before it sleeps: the plugin reads the
        // hang-up (and keeps the peer's unread response) in this check.
        assert!(
            !c.try_wait().expect("try_wait"),
            "a response and a hang-up are waiting"
        );
        let r = wait::<Add>(&mut c, id);
        assert_eq!(r.unwrap(), 3, "round {round}");
        assert_eq!(c.stats().malformed, 0, "{:?}", c.stats());
    }
}

/// The same with an output too large for a message: the target exposes
/// it, answers with its descriptor and exits before the origin pulls it.
/// The output cannot be had, and the call says why: the target is gone
/// (`PeerGone`, as for its other calls), not that the output failed to
/// decode. (It said `Decode` when the pull was refused for the departed
/// peer.)
#[test]
fn a_spilled_response_from_a_target_that_exited_ends_with_peer_gone() {
    for round in 0..3 {
        let d = dir(&format!("spilled-last-words-{round}"));
        let mut srv = server(&d);
        let mut c = client(&d);
        assert_eq!(call_both::<Add>(&mut c, &mut srv, &(1, 1)).unwrap(), 2);
        let s = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
        let id = c
            .forward::<Echo>(&s, &ByteBuf::from(vec![5u8; 64 << 10]))
            .unwrap();
        serve_until(&mut srv, 2);
        drop(srv);
        std::thread::sleep(Duration::from_millis(50));
        match wait::<Echo>(&mut c, id) {
            Err(RpcError::Transport(na_core::NaError::PeerGone { .. })) => {}
            other => panic!("round {round}: expected PeerGone, got {other:?}"),
        }
    }
}

/// Drives `c`'s transport without taking or handling anything: while
/// messages wait, a progress call neither sleeps nor looks at the
/// sockets (connections, hang-ups) except every so many calls, and
/// `try_wait` does not ask the transport either.
fn pump_transport(c: &mut Engine) {
    for _ in 0..64 {
        c.progress_now().unwrap();
    }
    c.try_wait().unwrap();
    std::thread::sleep(Duration::from_millis(1));
}

/// The same when other departed peers' last messages are queued ahead of
/// the target's response, more than one take handles at once: the
/// response still comes before the target's death. (The death used to
/// come after one take of 64 messages, or after the 64 receive buffers
/// of posted mode, and the call got `PeerGone`.)
#[test]
fn a_last_response_behind_other_departed_peers_messages_is_the_call_s_result() {
    use hg_rpc::header::FLAG_ONE_WAY;
    use na_core::OpId;
    let d = dir("last-words-behind");
    let mut srv = server(&d);
    // The origin listens: other peers send it requests and leave.
    let (ep, cid) = endpoint(&d, true);
    let mut c = Engine::new(ep, cid).unwrap();
    assert_eq!(call_both::<Add>(&mut c, &mut srv, &(1, 1)).unwrap(), 2);
    let s = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    let input = postcard::to_allocvec(&(1u64, 1u64)).unwrap();
    let stats = |c: &mut Engine| c.endpoint().plugin(cid).unwrap().stats();
    // Messages received and not handled: queued in the transport, or (in
    // posted mode, QS_RPC_RECV=posted) in our receive buffers.
    let arrived = |c: &mut Engine| stats(c).queued_arrivals + c.endpoint().pending_completions() as u64;
    const SENT: u64 = 40;
    for peer in 0..2u64 {
        let (mut x, _) = endpoint(&d, false);
        let to_c = x.lookup(c.self_addr().uri()).unwrap();
        for i in 0..SENT {
            let msg = wire_message(FLAG_ONE_WAY, Add::NAME, 0, &input);
            x.send_unexpected(&to_c, 0, &msg, OpId(peer << 32 | i)).unwrap();
        }
        // In c's ring before it leaves: every send done and none waiting
        // in x's backlog (c takes none yet).
        let xid = x.plugin_ids().next().unwrap();
        let (mut done, end) = (0, Instant::now() + T);
        while done < SENT || x.plugin(xid).unwrap().stats().backlog_bytes > 0 {
            assert!(
                Instant::now() < end,
                "peer {peer}: {:?}",
                x.plugin(xid).unwrap().stats()
            );
            x.progress(Some(Duration::from_millis(1))).unwrap();
            pump_transport(&mut c);
            for k in std::iter::from_fn(|| x.pop_completion()) {
                k.status.unwrap();
                done += 1;
            }
        }
        drop(x);
        // Its end seen (its messages kept for us).
        while stats(&mut c).peers > 1 || arrived(&mut c) < (peer + 1) * SENT {
            assert!(Instant::now() < end, "peer {peer}'s end was not seen");
            pump_transport(&mut c);
        }
    }
    assert_eq!(c.stats().handled, 0, "nothing taken yet");
    let id = c.forward::<Add>(&s, &(1, 2)).unwrap();
    serve_until(&mut srv, 2);
    drop(srv);
    // The target's end seen (its response kept for us, behind the others'
    // messages), and its death reported, before anything is taken.
    let end = Instant::now() + T;
    while stats(&mut c).peers > 0 {
        assert!(
            Instant::now() < end,
            "the target's end was not seen: {:?}",
            stats(&mut c)
        );
        pump_transport(&mut c);
    }
    assert_eq!(c.stats().handled, 0);
    assert_eq!(wait::<Add>(&mut c, id).unwrap(), 3);
    let st = c.stats();
    assert_eq!((st.malformed, st.handled), (0, 2 * SENT), "{st:?}");
}

/// A handler error longer than a message is cut to fit, not spilled: the
/// caller gets `Handler` with the start of the message and how long it
/// was, and the target keeps nothing exposed for it.
#[test]
fn a_long_handler_error_is_cut_to_fit_and_nothing_stays_exposed() {
    let d = dir("long-error");
    let mut srv = server(&d);
    let mut c = client(&d);
    let long = "é".repeat(10_000); // 20,000 bytes, more than an sm message
    match call_both::<Fail>(&mut c, &mut srv, &long) {
        Err(RpcError::Handler { message, .. }) => {
            assert!(message.starts_with("éé"), "{message:.40}");
            assert!(message.ends_with("cut from 20000 bytes]"), "{message}");
            assert!(message.len() < 8192, "{}", message.len());
        }
        other => panic!("expected a handler error, got {other:?}"),
    }
    assert_eq!(srv.stats().exposed_outputs, 0, "{:?}", srv.stats());
    // An error that fits travels whole.
    match call_both::<Fail>(&mut c, &mut srv, &"short".to_string()) {
        Err(RpcError::Handler { message, .. }) => assert_eq!(message, "short"),
        other => panic!("expected a handler error, got {other:?}"),
    }
}

/// A panicking handler answers its caller with a handler error, and the
/// engine serves the next call.
#[test]
fn a_panicking_handler_answers_with_an_error_and_the_engine_lives_on() {
    let d = dir("panic");
    let mut srv = server(&d);
    srv.register::<Sleep>(|ms| {
        if ms == 0 {
            panic!("told to panic");
        }
        Ok(())
    })
    .unwrap();
    let mut c = client(&d);
    match call_both::<Sleep>(&mut c, &mut srv, &0) {
        Err(RpcError::Handler { message, .. }) => {
            assert!(message.contains("panicked: told to panic"), "{message}")
        }
        other => panic!("expected a handler error, got {other:?}"),
    }
    assert_eq!(call_both::<Add>(&mut c, &mut srv, &(4, 5)).unwrap(), 9);
}

/// An RPC the target does not have, with a spilled (1 MiB) input, is
/// answered `UnknownRpc` without pulling the input first.
#[test]
fn an_unknown_rpc_s_spilled_input_is_not_pulled() {
    struct Missing;
    impl Rpc for Missing {
        const NAME: &'static str = "test.failure_paths.missing";
        type Input = ByteBuf;
        type Output = ();
    }
    let d = dir("unknown-spill");
    let mut srv = server(&d);
    let sid = srv.endpoint().plugin_ids().next().unwrap();
    let mut c = client(&d);
    match call_both::<Missing>(&mut c, &mut srv, &ByteBuf::from(vec![1u8; 1 << 20])) {
        Err(RpcError::UnknownRpc { .. }) => {}
        other => panic!("expected UnknownRpc, got {other:?}"),
    }
    let pulled = srv.endpoint().plugin(sid).unwrap().stats().get_bytes;
    assert_eq!(
        pulled, 0,
        "the server pulled the input of an RPC it does not have"
    );
    assert_eq!(
        c.stats().abandoned_inputs + c.stats().in_flight,
        0,
        "{:?}",
        c.stats()
    );
}

/// Spilled outputs a target keeps for origins that have not pulled them
/// are bounded per origin and in all: an origin with more large outputs
/// unpulled than its share gets a handler error saying so (its other calls
/// succeed); a silent origin that never pulls (a process of its own,
/// `hg-rpc-testpeer` as a stalled client, with two connections: one
/// origin) holds at most its share, and past the total another origin's
/// call is refused the same way; once outputs are pulled, calls succeed
/// again.
#[test]
fn spilled_outputs_not_yet_pulled_are_bounded_per_caller_and_in_all() {
    // Encoded, an output is 3 bytes longer: four fit in 1 MiB, five do not.
    const K250: u64 = 250_000;
    let d = dir("exposed");
    let mut srv = server(&d);
    srv.register::<Fill>(|(len, seed)| Ok(fill_output(len, seed)))
        .unwrap();
    srv.set_max_exposed_bytes(1 << 20, 5 << 18);
    let uri = srv.self_addr().uri().to_owned();
    let filled = |n| fill_pattern(n, 0);

    // Five at once: the target answers all five before we pull any.
    let mut c = client(&d);
    let s = c.endpoint().lookup(&uri).unwrap();
    let ids: Vec<_> = (0..5)
        .map(|_| c.forward::<Fill>(&s, &(K250, 0)).unwrap())
        .collect();
    serve_until(&mut srv, 5);
    assert_eq!(srv.stats().outputs_refused, 1, "{:?}", srv.stats());
    for (i, id) in ids.into_iter().enumerate() {
        let r = wait::<Fill>(&mut c, id);
        if i < 4 {
            assert_eq!(r.unwrap(), filled(K250), "call {i}");
        } else {
            match r {
                Err(RpcError::Handler { message, .. }) => {
                    assert!(message.contains("has not pulled 1000012 bytes"), "{message}")
                }
                other => panic!("call {i}: {other:?}"),
            }
        }
    }
    let end = Instant::now() + T;
    while srv.stats().exposed_outputs > 0 {
        assert!(Instant::now() < end, "outputs never released: {:?}", srv.stats());
        for e in [&mut c, &mut srv] {
            e.progress(Some(Duration::from_millis(1))).unwrap();
            e.trigger().unwrap();
        }
    }

    // A silent origin asks for ~1 MiB of outputs and never pulls them.
    let silent = common::Server::with_envs(&[
        ("QS_SM_DIR", d.as_os_str()),
        ("HG_TESTPEER_STALLED_CALL", std::ffi::OsStr::new(&uri)),
        ("HG_TESTPEER_STALLED_CONNS", std::ffi::OsStr::new("2")),
        ("HG_TESTPEER_STALLED_LEN", std::ffi::OsStr::new("500000")),
    ]);
    serve_until(&mut srv, 7);
    assert_eq!(srv.stats().exposed_bytes, 2 * 500_003);

    // ~1 MiB held of 1.25 MiB in all: one more 250 KB output fits, two do not.
    let a = c.forward::<Fill>(&s, &(K250, 0)).unwrap();
    let b = c.forward::<Fill>(&s, &(K250, 0)).unwrap();
    serve_until(&mut srv, 9);
    assert_eq!(wait::<Fill>(&mut c, a).unwrap(), filled(K250));
    match wait::<Fill>(&mut c, b) {
        Err(RpcError::Handler { message, .. }) => assert!(message.contains("in all"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(srv.stats().outputs_refused, 2);
    // Pulled and released: the next call fits again.
    assert_eq!(
        call_both::<Fill>(&mut c, &mut srv, &(K250, 0)).unwrap(),
        filled(K250)
    );
    drop(silent);
}

/// Spilled requests for a deferred (async) handler take their place under
/// `set_max_deferred` before their input is pulled, and keep it through
/// the pull: two arriving together with room for one, the second is
/// answered busy without its input being pulled (before, both passed the
/// check, both were pulled, and the second was refused after its pull).
#[test]
fn a_spilled_request_past_the_deferred_bound_is_refused_before_its_pull() {
    use hg_rpc::codec::{Codec, Postcard};
    const MIB: usize = 1 << 20;
    let d = dir("deferred-pull");
    let mut srv = server(&d);
    srv.register_deferred::<Digest>().unwrap();
    srv.set_max_deferred(1, 1);
    let uri = srv.self_addr().uri().to_owned();
    let mut c = client(&d);
    let s = c.endpoint().lookup(&uri).unwrap();
    let (x, y) = (ByteBuf::from(vec![1u8; MIB]), ByteBuf::from(vec![2u8; MIB]));
    let a = c.forward::<Digest>(&s, &x).unwrap();
    let b = c.forward::<Digest>(&s, &y).unwrap();
    serve_until(&mut srv, 2);
    let sid = srv.endpoint().plugin_ids().next().unwrap();
    let pulled = srv.endpoint().plugin(sid).unwrap().stats().get_bytes;
    let mut encoded = Vec::new();
    Postcard.encode(&x, &mut encoded).unwrap();
    // The data and the 8-byte seal after it (protocol version 5).
    assert_eq!(
        pulled,
        encoded.len() as u64 + 8,
        "only the admitted input is pulled"
    );
    let req = srv.take_deferred().expect("the admitted request");
    assert!(srv.take_deferred().is_none());
    let mut out = Vec::new();
    Postcard.encode(&(MIB as u64, fnv(&x)), &mut out).unwrap();
    srv.respond_deferred(req, Ok(out));
    let end = Instant::now() + T;
    let (mut ra, mut rb) = (None, None);
    while ra.is_none() || rb.is_none() {
        assert!(Instant::now() < end, "no answers");
        for e in [&mut c, &mut srv] {
            e.progress(Some(Duration::from_millis(1))).unwrap();
            e.trigger().unwrap();
        }
        ra = ra.or_else(|| c.take_response::<Digest>(a));
        rb = rb.or_else(|| c.take_response::<Digest>(b));
    }
    assert_eq!(ra.unwrap().unwrap(), (MIB as u64, fnv(&x)));
    match rb.unwrap() {
        Err(RpcError::Busy { reason, .. }) => assert!(reason.contains("target busy"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

/// A deferred request holds its pulled input while its handler runs, and
/// the pull budget charges the input's length: the buffer it holds must
/// fit that length, not be a spare left by an earlier, far larger pull
/// (4 MiB held per 64 KiB request here, past any budget).
#[test]
fn a_deferred_request_holds_a_buffer_that_fits_its_input() {
    const MIB: usize = 1 << 20;
    let d = dir("deferred-fit");
    let mut srv = server(&d);
    srv.register_deferred::<Digest>().unwrap();
    let uri = srv.self_addr().uri().to_owned();
    let mut c = client(&d);
    let s = c.endpoint().lookup(&uri).unwrap();
    // A large input to a plain handler: its buffer stays as a spare.
    let big = ByteBuf::from(vec![3u8; 4 * MIB]);
    let echo = c.forward::<Echo>(&s, &big).unwrap();
    let end = Instant::now() + T;
    let mut got = None;
    while got.is_none() {
        assert!(Instant::now() < end, "no echo");
        for e in [&mut c, &mut srv] {
            e.progress(Some(Duration::from_millis(1))).unwrap();
            e.trigger().unwrap();
        }
        got = c.take_response::<Echo>(echo);
    }
    assert!(got.unwrap().unwrap() == big);
    // A spilled input (over one message) to the deferred handler.
    let small = ByteBuf::from(vec![4u8; 64 << 10]);
    let _parked = c.forward::<Digest>(&s, &small).unwrap();
    let end = Instant::now() + T;
    let req = loop {
        assert!(Instant::now() < end, "the deferred request never came");
        srv.progress(Some(Duration::from_millis(1))).unwrap();
        srv.trigger().unwrap();
        if let Some(r) = srv.take_deferred() {
            break r;
        }
    };
    assert!(
        req.payload.capacity() <= 2 * req.payload.len(),
        "a {} byte input held in a buffer of {} bytes",
        req.payload.len(),
        req.payload.capacity()
    );
    srv.respond_deferred(req, Err("parked".into()));
}

/// Drives both engines until `done` holds.
fn pump_until(c: &mut Engine, srv: &mut Engine, what: &str, mut done: impl FnMut(&Engine) -> bool) {
    let end = Instant::now() + T;
    while !done(c) {
        assert!(Instant::now() < end, "{what}: {:?}", c.stats());
        for e in [&mut *c, &mut *srv] {
            e.progress(Some(Duration::from_millis(1))).unwrap();
            e.trigger().unwrap();
        }
    }
}

/// A call that timed out while its input was spilled stays (the target
/// may still pull the input) until its response: that response is late,
/// and counts in `stray_responses` like any late one. A spilled one-way
/// request's acknowledgement, the same kind of kept call's response, is
/// expected and does not count.
#[test]
fn a_late_response_to_a_call_kept_for_its_spilled_input_counts_as_stray() {
    let d = dir("late-spilled");
    let mut srv = server(&d);
    srv.register::<RecordBlob>(|_| Ok(())).unwrap();
    let uri = srv.self_addr().uri().to_owned();
    let mut c = client(&d);
    let s = c.endpoint().lookup(&uri).unwrap();
    // The one-way request first: its acknowledgement is no stray.
    c.forward_one_way::<RecordBlob>(&s, &ByteBuf::from(vec![5u8; 1 << 20]))
        .unwrap();
    assert_eq!(c.stats().abandoned_inputs, 1);
    pump_until(&mut c, &mut srv, "no acknowledgement", |c| {
        c.stats().abandoned_inputs == 0
    });
    assert_eq!(
        c.stats().stray_responses,
        0,
        "an acknowledgement counted as stray"
    );
    // The server is not driven while the client waits: a timeout.
    let r = c.call::<Echo>(&s, &ByteBuf::from(vec![6u8; 1 << 20]), Duration::from_millis(20));
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    assert_eq!((c.stats().in_flight, c.stats().abandoned_inputs), (0, 1));
    pump_until(&mut c, &mut srv, "the late response never came", |c| {
        c.stats().abandoned_inputs == 0
    });
    let st = c.stats();
    assert_eq!((st.stray_responses, st.malformed), (1, 0), "{st:?}");
    // Its spilled output was let go, not pulled.
    let end = Instant::now() + T;
    while srv.stats().exposed_outputs > 0 {
        assert!(Instant::now() < end, "the output was never released");
        for e in [&mut c, &mut srv] {
            e.progress(Some(Duration::from_millis(1))).unwrap();
            e.trigger().unwrap();
        }
    }
}

/// A spilled output whose TTL ran out before its origin pulled it is let
/// go with its seal broken: the late pull (shared memory reads another
/// process's freed memory without a fault) ends the call with a decode
/// error, counted as malformed, never with whatever the memory holds. A
/// server process (in one process, na-sm's own check of what is exposed
/// refuses such a pull anyway).
#[test]
fn an_output_pulled_after_its_ttl_is_refused_not_taken() {
    let d = dir("late-pull");
    let srv = common::Server::with_envs(&[
        ("QS_SM_DIR", d.as_ref()),
        ("HG_TESTPEER_OUTPUT_TTL_MS", "10".as_ref()),
    ]);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    // Large enough to spill both ways.
    let id = c
        .forward::<Echo>(&s, &ByteBuf::from(vec![9u8; 64 << 10]))
        .unwrap();
    c.progress_now().unwrap();
    // The origin does not look until the target has answered and let the
    // output go (its TTL passed, its sweep ran: at most a second or so),
    // as a probe engine of our own asks it (`c` must not be driven).
    let mut probe = client(&d);
    let ps = probe.endpoint().lookup(&srv.uri).unwrap();
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let (answered, exposed) = probe.call::<EchoOutputs>(&ps, &(), T).unwrap();
        if answered >= 1 && exposed == 0 {
            break;
        }
        assert!(
            Instant::now() < end,
            "the output was not answered and let go: {answered} answered, {exposed} exposed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    match wait::<Echo>(&mut c, id) {
        Err(RpcError::Decode { what, reason, .. }) => {
            assert_eq!(what, "output");
            eprintln!("late pull refused: {reason}");
        }
        other => panic!(
            "a late pull was taken for the output: {:?}",
            other.map(|v| v.len())
        ),
    }
    assert_eq!(c.stats().malformed, 1, "{:?}", c.stats());
}

/// An origin whose send backlog to the target is full when it has pulled
/// a spilled output (the target is not reading: its ring to it full, and
/// the plugin's backlog at its bound) cannot send the release then: it
/// sends it again once the target reads, and the target frees the output
/// at once, not at the end of its TTL (60 s), all that time charging it
/// to this origin's bound.
#[test]
fn a_release_refused_by_a_full_backlog_is_sent_again() {
    use na_core::NaError;
    let d = dir("release-again");
    let mut srv = server(&d);
    srv.register::<Record>(|_| Ok(())).unwrap();
    let mut c = common::small_backlog_engine(&d, false);
    assert_eq!(call_both::<Add>(&mut c, &mut srv, &(1, 1)).unwrap(), 2);
    let s = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    // A 64 KiB output: spilled, exposed until the origin releases it.
    let id = c
        .forward::<Echo>(&s, &ByteBuf::from(vec![5u8; 64 << 10]))
        .unwrap();
    let end = Instant::now() + T;
    while srv.stats().exposed_outputs == 0 {
        assert!(
            Instant::now() < end,
            "the output was never exposed: {:?}",
            srv.stats()
        );
        c.progress_now().unwrap();
        c.trigger().unwrap();
        srv.progress_now().unwrap();
        srv.trigger().unwrap();
    }
    // The server stops reading; one-way calls fill the ring and the
    // backlog until the plugin refuses one.
    let mut refused = None;
    for i in 0..100_000u64 {
        if let Err(e) = c.forward_one_way::<Record>(&s, &i) {
            refused = Some((i, e));
            break;
        }
    }
    let (sent, refused) = refused.expect("the backlog never filled");
    assert!(
        matches!(refused, RpcError::Transport(NaError::SendBacklogFull { .. })),
        "{}",
        na_core::ErrorChain(&refused)
    );
    // The call refused is not counted: Add, Echo and the one-way calls
    // that went out.
    assert_eq!(c.stats().calls, 2 + sent, "{:?}", c.stats());
    // The origin takes the response and pulls the output; its release
    // finds the backlog full.
    let end = Instant::now() + T;
    let out = loop {
        assert!(Instant::now() < end, "the response never came");
        c.progress_now().unwrap();
        c.trigger().unwrap();
        if let Some(r) = c.take_response::<Echo>(id) {
            break r.unwrap();
        }
    };
    assert_eq!(out.len(), 64 << 10);
    assert_eq!(
        srv.stats().exposed_outputs,
        1,
        "released although the backlog was full?"
    );
    // Both run again: the release goes once the target reads (and is
    // counted in the bytes sent: a header and a cookie).
    let bytes = c.stats().bytes_sent;
    let end = Instant::now() + Duration::from_secs(5);
    while srv.stats().exposed_outputs > 0 {
        assert!(
            Instant::now() < end,
            "the output is still exposed 5 s later (the release was lost): {:?}",
            srv.stats()
        );
        srv.progress_now().unwrap();
        srv.trigger().unwrap();
        c.progress_now().unwrap();
        c.trigger().unwrap();
    }
    assert_eq!(srv.stats().exposed_bytes, 0);
    assert_eq!(c.stats().bytes_sent - bytes, 32 + 8, "{:?}", c.stats());
}

/// Releases wait per target: one target that stopped reading (its
/// release refused by the full backlog to it) does not hold back the
/// releases to another, which frees its output at once.
#[test]
fn a_stuck_target_does_not_hold_back_releases_to_another() {
    let d = dir("release-per-target");
    let mut y = server(&d);
    y.register::<Record>(|_| Ok(())).unwrap();
    let mut x = server(&d);
    let mut c = common::small_backlog_engine(&d, false);
    assert_eq!(call_both::<Add>(&mut c, &mut y, &(1, 1)).unwrap(), 2);
    assert_eq!(call_both::<Add>(&mut c, &mut x, &(1, 1)).unwrap(), 2);
    let to_y = c.endpoint().lookup(y.self_addr().uri()).unwrap();
    let to_x = c.endpoint().lookup(x.self_addr().uri()).unwrap();
    // Y's output exposed, Y stops reading, the backlog to Y fills, and
    // the origin pulls: Y's release waits.
    let id = c
        .forward::<Echo>(&to_y, &ByteBuf::from(vec![5u8; 64 << 10]))
        .unwrap();
    let end = Instant::now() + T;
    while y.stats().exposed_outputs == 0 {
        assert!(Instant::now() < end, "Y never exposed its output");
        c.progress_now().unwrap();
        c.trigger().unwrap();
        y.progress_now().unwrap();
        y.trigger().unwrap();
    }
    for i in 0..100_000u64 {
        if c.forward_one_way::<Record>(&to_y, &i).is_err() {
            break;
        }
    }
    let end = Instant::now() + T;
    while c.take_response::<Echo>(id).is_none() {
        assert!(Instant::now() < end, "Y's response never came");
        c.progress_now().unwrap();
        c.trigger().unwrap();
    }
    // A spilled call to X, with Y still stuck: X's output is released.
    let id = c
        .forward::<Echo>(&to_x, &ByteBuf::from(vec![6u8; 64 << 10]))
        .unwrap();
    let end = Instant::now() + Duration::from_secs(5);
    let mut answered = false;
    while !answered || x.stats().exposed_outputs > 0 {
        assert!(
            Instant::now() < end,
            "X's output is still exposed (its release waits behind Y's?): {:?}",
            x.stats()
        );
        x.progress_now().unwrap();
        x.trigger().unwrap();
        c.progress_now().unwrap();
        c.trigger().unwrap();
        if let Some(r) = c.take_response::<Echo>(id) {
            assert_eq!(r.unwrap().len(), 64 << 10);
            answered = true;
        }
    }
    assert_eq!(
        y.stats().exposed_outputs,
        1,
        "Y read nothing: its release cannot have gone"
    );
}
