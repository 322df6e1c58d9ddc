//! hg-rpc and hg-bulk over RDMA verbs: typed calls and their error kinds,
//! 1 MiB arguments spilled into bulk both ways (one-way included), and bulk
//! push/pull across segments, against an `hg-rpc-testpeer` process on the
//! soft-RoCE device. Runs for real inside the VM (`scripts/test-verbs.sh`).
//! Pulls of spilled data that fail at completion (a deregistered key):
//! `verbs/spill_pull_failures.rs`. Peers with different eager limits:
//! `verbs/eager_limits.rs`. A request send that fails at completion:
//! `verbs/send_failures.rs`; a response send that does:
//! `verbs/response_failures.rs`; a release notice that does:
//! `verbs/notice_failures.rs`. A self-forward carrying bulk handles:
//! `verbs/self_forward.rs`.
//!
//! Both sides log warnings and na-verbs' connection life (`LOG_FILTER`):
//! a failing test shows the client's lines with its output, and every
//! test that starts a test peer ([`server`]) prints the peer's too (its
//! standard error, captured) as it fails, so that a connection that went
//! says why on both sides.
//!
//! Without an RDMA device (the host) each test asserts that building an
//! engine on `verbs://` fails with the clear "no RDMA device found" error,
//! and says loudly that the RDMA part did not run.
#![cfg(feature = "verbs")]

use std::time::{Duration, Instant};

use hg_rpc::{BulkOp, Engine, Rpc, RpcError};
use na_core::{Access, ProgressMode};
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::Server;
#[path = "verbs/eager_limits.rs"]
mod eager_limits;
#[path = "verbs/notice_failures.rs"]
mod notice_failures;
#[path = "verbs/response_failures.rs"]
mod response_failures;
#[path = "verbs/self_forward.rs"]
mod self_forward;
#[path = "verbs/send_failures.rs"]
mod send_failures;
#[path = "verbs/spill_pull_failures.rs"]
mod spill_pull_failures;

/// TCG emulation is slow; nothing legitimate takes this long.
const T: Duration = Duration::from_secs(60);

/// What the test peers of [`server`] and the client engines log (the
/// client's through `tracing_subscriber`, shown with a failing test's
/// output; the peer's captured from its standard error, printed as the
/// test fails): warnings, and na-verbs' connection life (connects, read
/// depths, deaths and their reasons), so that a connection that goes
/// says why on both sides.
const LOG_FILTER: &str = "warn,na_verbs=debug";

/// Registered nowhere.
struct Missing;
impl Rpc for Missing {
    const NAME: &'static str = "test.missing";
    type Input = ();
    type Output = ();
}

/// The listen spec of the RDMA device, or `None` after checking the
/// no-device error and saying loudly why the RDMA part does not run.
fn rdma_spec(test: &str) -> Option<String> {
    let in_vm = std::env::var_os("RXE_VM").is_some();
    let ip = std::env::var("RXE_VM_IP")
        .or_else(|_| std::env::var("QS_VERBS_TEST_IP"))
        .ok()
        .map(|v| v.split('/').next().unwrap_or_default().to_owned());
    match (na_verbs::devices(), ip) {
        (Ok(devs), Some(ip)) if !devs.is_empty() => {
            // Once per process (the first test to get here installs it);
            // libtest shows a test's lines only if it fails.
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(LOG_FILTER))
                .with_test_writer()
                .with_ansi(false)
                .try_init();
            Some(format!("verbs://{}/{ip}:0", devs[0].name))
        }
        (Ok(devs), None) => {
            assert!(!in_vm, "{test}: inside the rxe VM but RXE_VM_IP is not set");
            na_core::testing::report_not_run(&format!(
                "{test}: RDMA part: devices {devs:?} but no IPv4 address for RDMA CM; \
                 set QS_VERBS_TEST_IP"
            ));
            None
        }
        (_, _) => {
            assert!(!in_vm, "{test}: inside the rxe VM but libibverbs sees no device");
            let err = Engine::from_spec("verbs://", false, ProgressMode::default())
                .err()
                .expect("without a device, a verbs engine cannot be built");
            let msg = na_core::ErrorChain(&err).to_string();
            assert!(
                msg.contains("no RDMA device found"),
                "{test}: unclear error: {msg}"
            );
            na_core::testing::report_not_run(&format!(
                "{test}: RDMA part on this host (no RDMA device; checked instead that a verbs \
                 engine fails with: {msg}); scripts/test-verbs.sh runs it in the soft-RoCE VM"
            ));
            None
        }
    }
}

/// The client's side of a failure, for its message: RPC counters and the
/// transport's (in flight, sends queued, peers, ...).
fn client_state(c: &mut Engine) -> String {
    let rpc = c.stats();
    let ep = c.endpoint();
    let ids: Vec<_> = ep.plugin_ids().collect();
    let transports: Vec<String> = ids
        .into_iter()
        .filter_map(|id| ep.plugin(id).ok().map(|p| format!("{:?}", p.stats())))
        .collect();
    format!("client {rpc:?}; transport {}", transports.join("; "))
}

/// A test peer whose log ([`LOG_FILTER`]) is captured, and printed (its
/// last [`PEER_LOG_LINES`] lines, once the peer has stopped and all it
/// wrote is read) if it is dropped while its test panics: a failing test
/// shows the peer's side with its own lines (the client's log, through
/// the test writer) whatever assertion failed.
struct LoggedPeer(Server);

/// How many of its last lines a [`LoggedPeer`] prints.
const PEER_LOG_LINES: usize = 200;

impl std::ops::Deref for LoggedPeer {
    type Target = Server;
    fn deref(&self) -> &Server {
        &self.0
    }
}

impl Drop for LoggedPeer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- the test peer's side ---\n{}",
                self.0.stop_and_log(PEER_LOG_LINES)
            );
        }
    }
}

/// The test peer serving `spec`, with `envs` in its environment besides,
/// its log captured ([`LoggedPeer`]): the one way this file starts a
/// peer.
fn server(spec: &str, envs: &[(&str, &std::ffi::OsStr)]) -> LoggedPeer {
    let mut vars = vec![("HG_TESTPEER_SPEC", std::ffi::OsStr::new(spec))];
    vars.extend_from_slice(envs);
    let srv = LoggedPeer(Server::with_envs_logged(&vars, LOG_FILTER));
    assert!(srv.uri.starts_with("verbs://"), "{}", srv.uri);
    srv
}

#[test]
fn typed_calls_error_kinds_and_1mib_spill_over_verbs() {
    let Some(spec) = rdma_spec("typed_calls_error_kinds_and_1mib_spill_over_verbs") else {
        return;
    };
    let srv = server(&spec, &[]);
    let mut c = Engine::from_spec(&spec, false, ProgressMode::default()).expect("client engine");
    let s = c.endpoint().lookup(&srv.uri).expect("lookup");
    for i in 0..200u64 {
        assert_eq!(c.call::<Add>(&s, &(i, 1000), T).expect("add"), i + 1000);
    }
    match c.call::<Fail>(&s, &"boom".into(), T) {
        Err(RpcError::Handler { message, .. }) => assert_eq!(message, "boom"),
        other => panic!("expected a handler error, got {other:?}"),
    }
    assert!(matches!(
        c.call::<Missing>(&s, &(), T),
        Err(RpcError::UnknownRpc { .. })
    ));
    // 1 MiB both ways: the input and the output spill into bulk handles
    // that the other side pulls with RDMA READ.
    let big = ByteBuf::from(
        (0..1usize << 20)
            .map(|i| (i * 7 + i / 4096) as u8)
            .collect::<Vec<u8>>(),
    );
    assert!(
        c.call::<Echo>(&s, &big, T).expect("1 MiB echo") == big,
        "1 MiB echo differs"
    );
    assert_eq!(
        c.call::<Digest>(&s, &big, T).expect("digest"),
        (big.len() as u64, fnv(&big))
    );
    // One-way requests spill too (Mercury #542).
    for _ in 0..3 {
        c.forward_one_way::<RecordBlob>(&s, &big).expect("one-way");
    }
    let end = Instant::now() + T;
    loop {
        let (n, sum) = c.call::<Count>(&s, &(), T).expect("count");
        if n == 3 {
            assert_eq!(sum, 3 * big.len() as u64);
            break;
        }
        assert!(Instant::now() < end, "one-way spilled requests lost: {n} arrived");
    }
    let st = c.stats();
    eprintln!("client stats over verbs: {st:?}");
    c.call::<Quit>(&s, &(), T).expect("quit");
}

#[test]
fn bulk_push_and_pull_across_segments_over_verbs() {
    let Some(spec) = rdma_spec("bulk_push_and_pull_across_segments_over_verbs") else {
        return;
    };
    let srv = server(&spec, &[]);
    let mut c = Engine::from_spec(&spec, false, ProgressMode::default()).expect("client engine");
    let s = c.endpoint().lookup(&srv.uri).expect("lookup");
    let data: Vec<u8> = (0..3_000_017usize).map(|i| (i * 13 + 5) as u8).collect();
    let segs = vec![
        data[..1000].to_vec(),
        data[1000..2_000_000].to_vec(),
        data[2_000_000..].to_vec(),
    ];
    let put = c.expose(segs, Access::ReadOnly).expect("expose");
    // The server pulls the three segments (RDMA READ).
    let digest = c
        .call::<BlobPut>(&s, &("k".into(), put), T)
        .unwrap_or_else(|e| panic!("put: {}; {}", na_core::ErrorChain(&e), client_state(&mut c)));
    assert_eq!(digest, fnv(&data));
    // The server pushes into three uneven segments of ours at offset 100 (RDMA WRITE).
    let into = c
        .expose(
            vec![vec![0; 1_000_000], vec![0; 7], vec![0; 2_100_000]],
            Access::ReadWrite,
        )
        .expect("expose");
    let got = c
        .call::<BlobGet>(&s, &("k".into(), into.clone(), 100), T)
        .unwrap_or_else(|e| panic!("get: {}; {}", na_core::ErrorChain(&e), client_state(&mut c)));
    assert_eq!(got, data.len() as u64);
    let mut back = vec![0; data.len()];
    into.local()
        .expect("local handle")
        .read_at(100, &mut back)
        .expect("read back");
    assert!(back == data, "pushed data differs");
    // Out of bounds: the server's push fails, says so, and keeps serving.
    match c.call::<BlobGet>(&s, &("k".into(), into.clone(), 200_000), T) {
        Err(RpcError::Handler { message, .. }) => assert!(message.contains("out of bounds"), "{message}"),
        Err(e) => panic!(
            "expected a handler error, got: {}; {}",
            na_core::ErrorChain(&e),
            client_state(&mut c)
        ),
        Ok(n) => panic!("expected a handler error, got Ok({n})"),
    }
    let sum = c
        .call::<Add>(&s, &(2, 3), T)
        .unwrap_or_else(|e| panic!("add: {}; {}", na_core::ErrorChain(&e), client_state(&mut c)));
    assert_eq!(sum, 5);
    // Client-driven pull from the server's copy is not exposed by the
    // testpeer; instead pull our own handle through the engine's bulk API.
    let dst = c
        .expose(vec![vec![0; 5000], vec![0; 5000]], Access::ReadWrite)
        .expect("expose");
    c.bulk(BulkOp::Pull, &into, 900, &dst, 4000, 3000, T)
        .unwrap_or_else(|e| panic!("self pull: {}; {}", na_core::ErrorChain(&e), client_state(&mut c)));
    let mut got = vec![0; 3000];
    dst.local().expect("local").read_at(4000, &mut got).expect("read");
    assert!(got == data[800..3800], "self pull differs");
    c.call::<Quit>(&s, &(), T)
        .unwrap_or_else(|e| panic!("quit: {}; {}", na_core::ErrorChain(&e), client_state(&mut c)));
}

/// A handler's transfer that outlasts the engine's handler transfer
/// timeout (0 here: `HG_TESTPEER_TRANSFER_TIMEOUT_MS=0`) fails with an
/// error that says so, and the windows of spans after the one in flight
/// are not started. The RDMA READs in flight are canceled and waited for
/// before the answer: the client drops its handle (deregisters its memory)
/// as soon as it has the answer, and a READ arriving after that would fail
/// with a remote access error that kills the connection (it did, before
/// the wait: the calls below failed with PeerGone). The server goes on
/// serving.
#[test]
fn a_handler_transfer_past_its_timeout_fails_and_starts_no_more_windows_over_verbs() {
    let Some(spec) =
        rdma_spec("a_handler_transfer_past_its_timeout_fails_and_starts_no_more_windows_over_verbs")
    else {
        return;
    };
    let srv = server(
        &spec,
        &[("HG_TESTPEER_TRANSFER_TIMEOUT_MS", std::ffi::OsStr::new("0"))],
    );
    let mut c = Engine::from_spec(&spec, false, ProgressMode::default()).expect("client engine");
    let s = c.endpoint().lookup(&srv.uri).expect("lookup");
    // 2,500 chunks of 64 bytes: three windows of at most BATCH_WINDOW spans.
    let spans = 2500usize;
    assert!(spans > 2 * hg_rpc::BATCH_WINDOW && spans < 3 * hg_rpc::BATCH_WINDOW);
    let data: Vec<u8> = (0..spans * 64).map(|i| (i * 31 + 7) as u8).collect();
    let put = c.expose(vec![data], Access::ReadOnly).expect("expose");
    match c.call::<BlobPutChunked>(&s, &("k".into(), put, 64), T) {
        // `BulkCtx` fails as `Engine::bulk` does: `RpcError::Timeout`
        // (tests/bulk_transfers.rs checks, by the bytes read, that the
        // later windows do not start).
        Err(RpcError::Handler { message, .. }) => {
            assert_eq!(message, "bulk transfer timed out after 0 ms", "{message}");
        }
        other => panic!("expected the handler's timeout, got {other:?}"),
    }
    // `put` went with the call's input: the client's memory is gone, and
    // the connection stands.
    for i in 0..50u64 {
        assert_eq!(
            c.call::<Add>(&s, &(i, 1), T).expect("add after the timeout"),
            i + 1
        );
    }
    c.call::<Quit>(&s, &(), T).expect("quit");
}

/// `Engine::bulk` past its timeout (0 here) cancels its RDMA READ and
/// waits for it before it returns: a READ on the wire cannot be recalled,
/// and the owner of the remote handle may free it as soon as `bulk` has
/// returned (a deferred handler answers its caller, say). So once `bulk`
/// returned, the client's plugin has nothing in flight; the server then
/// drops the handle (deregisters its memory), and the connection still
/// works. Two engines of this process; the READ is served by the kernel's
/// RDMA stack, with no progress of the server's.
#[test]
fn a_timed_out_bulk_has_ended_when_it_returns_over_verbs() {
    let Some(spec) = rdma_spec("a_timed_out_bulk_has_ended_when_it_returns_over_verbs") else {
        return;
    };
    let mut srv = Engine::from_spec(&spec, true, ProgressMode::default()).expect("server engine");
    srv.register::<Add>(|(a, b)| Ok(a + b)).expect("register");
    let mut c = Engine::from_spec(&spec, false, ProgressMode::default()).expect("client engine");
    let cid = c.self_addr().plugin();
    // Connected first: the timed-out pull below must be on the wire.
    assert_eq!(
        common::call_both::<Add>(&mut c, &mut srv, &(1, 2)).expect("add"),
        3
    );
    let len = 16usize << 20;
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let exposed = srv.expose(vec![data.clone()], Access::ReadOnly).expect("expose");
    let remote: hg_rpc::Bulk =
        postcard::from_bytes(&postcard::to_allocvec(&exposed).expect("encode")).expect("decode");
    let dst = c.expose(vec![vec![0; len]], Access::ReadWrite).expect("expose");
    // Operations in flight (the engine's posted receives among them: the
    // engine reposts the one the call used when it next progresses).
    let in_flight = |c: &mut Engine| c.endpoint().plugin(cid).expect("plugin").stats().in_flight;
    let mut before = u64::MAX;
    for _ in 0..10 {
        c.trigger().expect("trigger");
        c.progress_now().expect("progress");
        let now = in_flight(&mut c);
        if now == before {
            break;
        }
        before = now;
    }
    let r = c.bulk(BulkOp::Pull, &remote, 0, &dst, 0, len as u64, Duration::ZERO);
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    assert_eq!(
        in_flight(&mut c),
        before,
        "bulk returned with its canceled RDMA READ in flight"
    );
    assert_eq!(c.stats().bulk_in_flight, 0);
    // The owner frees its memory now.
    drop((remote, exposed));
    let small = srv
        .expose(vec![data[..4096].to_vec()], Access::ReadOnly)
        .expect("expose");
    let small: hg_rpc::Bulk =
        postcard::from_bytes(&postcard::to_allocvec(&small).expect("encode")).expect("decode");
    c.bulk(BulkOp::Pull, &small, 100, &dst, 0, 1000, T)
        .expect("a pull after the timed-out one");
    let mut got = vec![0; 1000];
    dst.local().expect("local").read_at(0, &mut got).expect("read");
    assert!(got == data[100..1100], "pulled data differs");
    for i in 0..20u64 {
        assert_eq!(
            common::call_both::<Add>(&mut c, &mut srv, &(i, 1)).expect("add"),
            i + 1
        );
    }
}

/// A tokio runtime with two workers, for the tests of `AsyncEngine`.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// An `AsyncEngine` on `spec` (call inside the runtime).
fn async_engine(spec: &str, listen: bool) -> hg_rpc::AsyncEngine {
    let e = Engine::from_spec(spec, listen, ProgressMode::default()).expect("engine");
    hg_rpc::AsyncEngine::spawn(e).expect("spawn")
}

/// [`a_timed_out_bulk_has_ended_when_it_returns_over_verbs`] for
/// `AsyncEngine::bulk`: past its timeout the RDMA READ is canceled and
/// waited for before the future returns, so the owner may free its memory
/// right after; the connection still works. Without the wait the owner's
/// deregistration under the READ breaks the connection, and the next pull
/// fails. A future dropped while it waits forgets its READ, which counts
/// in flight until the device ends it. Two async engines of this process.
#[test]
fn an_async_timed_out_bulk_has_ended_when_it_returns_over_verbs() {
    let Some(spec) = rdma_spec("an_async_timed_out_bulk_has_ended_when_it_returns_over_verbs") else {
        return;
    };
    runtime().block_on(async {
        let srv = async_engine(&spec, true);
        srv.register::<Add>(|(a, b)| Ok(a + b)).expect("register");
        let c = async_engine(&spec, false);
        let s = c.lookup(srv.self_addr().uri()).await.expect("lookup");
        assert_eq!(c.call::<Add>(&s, &(1, 2), T).await.expect("add"), 3);
        let len = 16usize << 20;
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let exposed = srv.expose(vec![data.clone()], Access::ReadWrite).expect("expose");
        let remote: hg_rpc::Bulk =
            postcard::from_bytes(&postcard::to_allocvec(&exposed).expect("encode")).expect("decode");
        let dst = c.expose(vec![vec![0; len]], Access::ReadWrite).expect("expose");
        // A zero timeout, then one that runs out while the READ is on the
        // wire (16 MiB over emulated soft-RoCE takes far longer than 1 ms).
        for timeout in [Duration::ZERO, Duration::from_millis(1)] {
            let r = c
                .bulk(BulkOp::Pull, &remote, 0, &dst, 0, len as u64, timeout)
                .await;
            assert!(matches!(r, Err(RpcError::Timeout { .. })), "{timeout:?}: {r:?}");
            assert_eq!(
                c.stats().bulk_in_flight,
                0,
                "{timeout:?}: the future returned with its canceled RDMA READ in flight"
            );
        }
        // A future dropped while it waits (a `select!` that went the other
        // way): the READ is forgotten, counted in flight until the device
        // ends it, then filed by the driver.
        let mut fut = Box::pin(c.bulk(BulkOp::Pull, &remote, 0, &dst, 0, len as u64, T));
        let first = common::poll_once(&mut fut).await;
        assert!(
            first.is_none(),
            "a 16 MiB READ ended at its first poll: {first:?}"
        );
        drop(fut);
        let end = Instant::now() + T;
        while c.stats().bulk_in_flight != 0 {
            assert!(Instant::now() < end, "the forgotten READ never ended");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The owner frees its memory now.
        drop((remote, exposed));
        let small = srv
            .expose(vec![data[..4096].to_vec()], Access::ReadWrite)
            .expect("expose");
        let small: hg_rpc::Bulk =
            postcard::from_bytes(&postcard::to_allocvec(&small).expect("encode")).expect("decode");
        c.bulk(BulkOp::Pull, &small, 100, &dst, 0, 1000, Duration::from_secs(20))
            .await
            .expect("a pull after the timed-out one");
        let mut got = vec![0; 1000];
        dst.local().expect("local").read_at(0, &mut got).expect("read");
        assert!(got == data[100..1100], "pulled data differs");
        for i in 0..20u64 {
            assert_eq!(c.call::<Add>(&s, &(i, 1), T).await.expect("add"), i + 1);
        }
    });
}

/// Pulls the caller's handle in an async handler, drops the transfer's
/// future after its first poll, and answers.
struct DropPull;
impl Rpc for DropPull {
    const NAME: &'static str = "verbs_test.drop_pull";
    type Input = hg_rpc::Bulk;
    type Output = ();
}

/// Pulls the caller's handle in an async handler; answers its hash.
struct PullHash;
impl Rpc for PullHash {
    const NAME: &'static str = "verbs_test.pull_hash";
    type Input = hg_rpc::Bulk;
    type Output = u64;
}

/// Pulls the caller's handle in a task that keeps the handler's context,
/// and answers whether the pull was still on the wire when the handler
/// returned; the task reports the pull's outcome and the hash of what it
/// read.
struct KeptPull;
impl Rpc for KeptPull {
    const NAME: &'static str = "verbs_test.kept_pull";
    type Input = hg_rpc::Bulk;
    type Output = bool;
}

/// A handler's context moved into a task that outlives the handler: the
/// answer waits until that task's RDMA READ (16 MiB in 2,048 segments,
/// far more work requests than the send queue holds) has ended, because
/// the caller frees its memory at the answer, and the READ itself
/// completes normally (the wait does not stall the transfer it waits
/// for). Soft-RoCE may run a READ to its end inside the posting call, so
/// a pull can end at its first poll; up to three rounds are made until
/// one was on the wire when its handler returned. Without the wait this
/// test still passes: the answer's send goes on the same reliable
/// connection as the READs and soft-RoCE serves them in order. The wait
/// itself and the refusal of a later transfer are tested over sm
/// (`async_bulk.rs`, a kept pull held unpolled).
#[test]
fn a_kept_context_s_read_completes_and_its_answer_follows_over_verbs() {
    let Some(spec) = rdma_spec("a_kept_context_s_read_completes_and_its_answer_follows_over_verbs") else {
        return;
    };
    runtime().block_on(async {
        let srv = async_engine(&spec, true);
        let (report, mut reports) = tokio::sync::mpsc::unbounded_channel::<Result<u64, String>>();
        srv.register_async_with_bulk::<KeptPull, _, _>(move |ctx, from| {
            let report = report.clone();
            async move {
                let into = ctx.expose(vec![vec![0; from.size() as usize]], Access::ReadWrite)?;
                let (started, pending) = tokio::sync::oneshot::channel();
                tokio::spawn(async move {
                    let mut pull = Box::pin(ctx.transfer(BulkOp::Pull, &from, 0, &into, 0, from.size(), T));
                    let first = common::poll_once(&mut pull).await;
                    let _ = started.send(first.is_none());
                    let r = match first {
                        Some(r) => r,
                        None => pull.await,
                    };
                    let _ = report.send(
                        r.map_err(|e| na_core::ErrorChain(&e).to_string())
                            .and_then(|()| Ok(fnv(&into.local().ok_or("not local")?.to_vec()))),
                    );
                });
                pending
                    .await
                    .map_err(|_| "the task that keeps the context failed".to_string())
            }
        })
        .expect("register");
        let c = async_engine(&spec, false);
        let s = c.lookup(srv.self_addr().uri()).await.expect("lookup");
        let mut on_the_wire = 0;
        for round in 0..3 {
            let segs: Vec<Vec<u8>> = (0..2048).map(|k| vec![((k + round) % 251) as u8; 8192]).collect();
            let all: Vec<u8> = segs.concat();
            let handle = c.expose(segs, Access::ReadOnly).expect("expose");
            let pending = c.call::<KeptPull>(&s, &handle, T).await.expect("kept pull");
            assert_eq!(
                srv.stats().bulk_in_flight,
                0,
                "answered with the kept context's RDMA READ in flight"
            );
            // We free the memory at the answer.
            drop(handle);
            let hash = tokio::time::timeout(T, reports.recv())
                .await
                .expect("the kept task's report")
                .expect("a report");
            assert_eq!(hash, Ok(fnv(&all)), "the kept context's pull, round {round}");
            if pending {
                on_the_wire += 1;
                break;
            }
            eprintln!(
                "round {round}: the pull ended at its first poll (soft-RoCE ran it in the post); again"
            );
        }
        assert_eq!(
            on_the_wire, 1,
            "in three rounds, no pull was on the wire when its handler returned"
        );
    });
}

/// An async handler that drops its transfer's future while its RDMA READs
/// are on the wire or queued (a `select!`, say) does not answer before
/// they ended: the transfer is canceled and the handler's task waits for
/// it. Its caller frees its memory at the answer; a READ posted after
/// that would fail and break the connection. So when the answer comes the
/// server has no transfer in flight, and after the caller dropped its
/// handle, calls and a real pull still work. Two async engines of this
/// process.
#[test]
fn an_async_handler_that_drops_its_transfer_answers_after_it_ended_over_verbs() {
    let Some(spec) = rdma_spec("an_async_handler_that_drops_its_transfer_answers_after_it_ended_over_verbs")
    else {
        return;
    };
    runtime().block_on(async {
        let srv = async_engine(&spec, true);
        srv.register::<Add>(|(a, b)| Ok(a + b)).expect("register");
        srv.register_async_with_bulk::<DropPull, _, _>(|ctx, from| async move {
            let into = ctx.expose(vec![vec![0; from.size() as usize]], Access::ReadWrite)?;
            let mut pull = Box::pin(ctx.transfer(BulkOp::Pull, &from, 0, &into, 0, from.size(), T));
            let first = common::poll_once(&mut pull).await;
            if first.is_some() {
                return Err(format!("the pull ended at its first poll: {first:?}"));
            }
            Ok(())
        })
        .expect("register");
        srv.register_async_with_bulk::<PullHash, _, _>(|ctx, from| async move {
            let into = ctx.expose(vec![vec![0; from.size() as usize]], Access::ReadWrite)?;
            ctx.transfer(BulkOp::Pull, &from, 0, &into, 0, from.size(), T)
                .await?;
            Ok(fnv(&into.local().ok_or("not local")?.to_vec()))
        })
        .expect("register");
        let c = async_engine(&spec, false);
        let s = c.lookup(srv.self_addr().uri()).await.expect("lookup");
        assert_eq!(c.call::<Add>(&s, &(1, 2), T).await.expect("add"), 3);
        // 2,048 segments: a work request each, far more than the send
        // queue holds, so most wait in the plugin's backlog, where the
        // answer's send could overtake them.
        let segs: Vec<Vec<u8>> = (0..2048).map(|s| vec![s as u8; 8192]).collect();
        let handle = c.expose(segs, Access::ReadOnly).expect("expose");
        c.call::<DropPull>(&s, &handle, T).await.expect("drop pull");
        assert_eq!(
            srv.stats().bulk_in_flight,
            0,
            "the handler answered with its dropped RDMA READ in flight"
        );
        // We free the memory at the answer.
        drop(handle);
        let data: Vec<u8> = (0..1usize << 20).map(|i| (i % 241) as u8).collect();
        let handle = c.expose(vec![data.clone()], Access::ReadOnly).expect("expose");
        assert_eq!(
            c.call::<PullHash>(&s, &handle, T)
                .await
                .expect("a pull after the dropped one"),
            fnv(&data)
        );
        for i in 0..20u64 {
            assert_eq!(c.call::<Add>(&s, &(i, 1), T).await.expect("add"), i + 1);
        }
    });
}

/// Answers its input plus one once the test lets it.
struct HeldAdd;
impl Rpc for HeldAdd {
    const NAME: &'static str = "verbs_test.held_add";
    type Input = u64;
    type Output = u64;
}

/// Draining over verbs: a draining server answers new calls "busy" and is
/// drained only once the answer to the call its handler held has been
/// sent, which here means completed by the device (`sends_posted` back to
/// zero), so that dropping the server right away loses nothing: five
/// servers in a row are dropped the moment they say they are drained, and
/// each held call gets its answer.
#[test]
fn a_drained_server_dropped_at_once_has_sent_its_answers_over_verbs() {
    let Some(spec) = rdma_spec("a_drained_server_dropped_at_once_has_sent_its_answers_over_verbs") else {
        return;
    };
    runtime().block_on(async {
        let c = std::sync::Arc::new(async_engine(&spec, false));
        for round in 0..5u64 {
            let srv = async_engine(&spec, true);
            let (started, release) = (
                std::sync::Arc::new(tokio::sync::Notify::new()),
                std::sync::Arc::new(tokio::sync::Notify::new()),
            );
            let (s2, r2) = (started.clone(), release.clone());
            srv.register_async::<HeldAdd, _, _>(move |x| {
                let (started, release) = (s2.clone(), r2.clone());
                async move {
                    started.notify_one();
                    release.notified().await;
                    Ok(x + 1)
                }
            })
            .expect("register");
            srv.register::<Add>(|(a, b)| Ok(a + b)).expect("register");
            let s = c.lookup(srv.self_addr().uri()).await.expect("lookup");
            let (c2, s2) = (c.clone(), s.clone());
            let held = tokio::spawn(async move { c2.call::<HeldAdd>(&s2, &round, T).await });
            started.notified().await;
            srv.begin_drain().expect("begin_drain");
            match c.call::<Add>(&s, &(1, 2), T).await {
                Err(RpcError::Busy { reason, .. }) => assert!(reason.contains("draining"), "{reason}"),
                other => panic!("round {round}: expected a busy answer, got {other:?}"),
            }
            release.notify_one();
            assert!(
                srv.drained(T).await.expect("drained"),
                "round {round}: not drained"
            );
            assert_eq!(srv.stats().refused_draining, 1);
            drop(srv);
            assert_eq!(
                held.await.expect("join").expect("the held call's answer"),
                round + 1,
                "round {round}"
            );
        }
    });
}

/// Registers, on `srv`, a [`BlobPut`] that pulls the caller's handle and
/// answers its hash, and a [`BlobGet`] that pushes `blob(len)` into the
/// caller's handle at the offset given and answers the length (plain
/// handlers, through their `BulkCtx`).
fn serve_put_and_get(srv: &mut Engine) {
    srv.register_with_bulk::<BlobPut>(|ctx, (_, from)| {
        let into = ctx.expose(vec![vec![0; from.size() as usize]], Access::ReadWrite)?;
        ctx.transfer(BulkOp::Pull, &from, 0, &into, 0, from.size())?;
        Ok(fnv(&into.local().ok_or("not local")?.to_vec()))
    })
    .expect("register put");
    srv.register_with_bulk::<BlobGet>(|ctx, (_, into, at)| {
        let len = into.size() - at;
        let from = ctx.expose(vec![blob(len as usize)], Access::ReadOnly)?;
        ctx.transfer(BulkOp::Push, &into, at, &from, 0, len)?;
        Ok(len)
    })
    .expect("register get");
}

/// `len` bytes of a pattern.
fn blob(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 11 + 3) as u8).collect()
}

/// Connections the plugin of `e` holds (its `peers` counter).
fn connections(e: &mut Engine) -> u64 {
    let id = e.self_addr().plugin();
    e.endpoint().plugin(id).expect("plugin").stats().peers
}

/// A handler moves data with its caller's handle through the address the
/// request came from, not by looking up the handle's owner: the verbs
/// plugin files an incoming connection under a peer of its own, which no
/// lookup finds. So a server pulls from and pushes into a client that
/// does not listen (a lookup of its address would be refused: nobody
/// listens there), and a client that listens gets no second connection
/// (one each way) for it. Two engines of this process.
#[test]
fn a_handler_moves_data_through_its_request_s_source_over_verbs() {
    let Some(spec) = rdma_spec("a_handler_moves_data_through_its_request_s_source_over_verbs") else {
        return;
    };
    for listen in [false, true] {
        let mut srv = Engine::from_spec(&spec, true, ProgressMode::default()).expect("server engine");
        serve_put_and_get(&mut srv);
        let mut c = Engine::from_spec(&spec, listen, ProgressMode::default()).expect("client engine");
        let data = blob(300_001);
        let put = c
            .expose(
                vec![data[..1000].to_vec(), data[1000..].to_vec()],
                Access::ReadOnly,
            )
            .expect("expose");
        let hash = common::call_both::<BlobPut>(&mut c, &mut srv, &("k".into(), put)).unwrap_or_else(|e| {
            panic!(
                "listen {listen}: the server's pull: {}; {}",
                na_core::ErrorChain(&e),
                client_state(&mut c)
            )
        });
        assert_eq!(hash, fnv(&data), "listen {listen}: pulled data differs");
        let into = c
            .expose(vec![vec![0; 70_000], vec![0; 30_000]], Access::ReadWrite)
            .expect("expose");
        let len = common::call_both::<BlobGet>(&mut c, &mut srv, &("k".into(), into.clone(), 10))
            .unwrap_or_else(|e| {
                panic!(
                    "listen {listen}: the server's push: {}; {}",
                    na_core::ErrorChain(&e),
                    client_state(&mut c)
                )
            });
        assert_eq!(len, 100_000 - 10);
        let mut back = vec![0; len as usize];
        into.local()
            .expect("local")
            .read_at(10, &mut back)
            .expect("read back");
        assert!(back == blob(len as usize), "listen {listen}: pushed data differs");
        assert_eq!(
            (connections(&mut c), connections(&mut srv)),
            (1, 1),
            "listen {listen}: the transfers opened a connection besides the client's own"
        );
    }
}

/// [`a_handler_moves_data_through_its_request_s_source_over_verbs`] for
/// async handlers ([`AsyncBulkCtx`](hg_rpc::AsyncBulkCtx)): an async
/// server pulls from and pushes into a client that does not listen.
#[test]
fn an_async_handler_moves_data_with_a_client_that_does_not_listen_over_verbs() {
    let Some(spec) = rdma_spec("an_async_handler_moves_data_with_a_client_that_does_not_listen_over_verbs")
    else {
        return;
    };
    runtime().block_on(async {
        let srv = async_engine(&spec, true);
        srv.register_async_with_bulk::<BlobPut, _, _>(|ctx, (_, from)| async move {
            let into = ctx.expose(vec![vec![0; from.size() as usize]], Access::ReadWrite)?;
            ctx.transfer(BulkOp::Pull, &from, 0, &into, 0, from.size(), T)
                .await?;
            Ok(fnv(&into.local().ok_or("not local")?.to_vec()))
        })
        .expect("register put");
        srv.register_async_with_bulk::<BlobGet, _, _>(|ctx, (_, into, at)| async move {
            let len = into.size() - at;
            let from = ctx.expose(vec![blob(len as usize)], Access::ReadOnly)?;
            ctx.transfer(BulkOp::Push, &into, at, &from, 0, len, T).await?;
            Ok(len)
        })
        .expect("register get");
        let c = async_engine(&spec, false);
        let s = c.lookup(srv.self_addr().uri()).await.expect("lookup");
        let data = blob(200_003);
        let put = c.expose(vec![data.clone()], Access::ReadOnly).expect("expose");
        let hash = c
            .call::<BlobPut>(&s, &("k".into(), put), T)
            .await
            .expect("the async server's pull");
        assert_eq!(hash, fnv(&data), "pulled data differs");
        let into = c
            .expose(vec![vec![0; 50_000]], Access::ReadWrite)
            .expect("expose");
        let len = c
            .call::<BlobGet>(&s, &("k".into(), into.clone(), 5), T)
            .await
            .expect("the async server's push");
        let mut back = vec![0; len as usize];
        into.local()
            .expect("local")
            .read_at(5, &mut back)
            .expect("read back");
        assert!(back == blob(len as usize), "pushed data differs");
    });
}

/// Code outside any handler (here: a deferred request, answered later by
/// the application) moves data with a client that does not listen, by
/// giving the handle the request's source (`Bulk::reached_through`): the
/// transfer then goes over the connection the request came on. Without
/// it the handle's owner is looked up, and nobody listens there: that
/// transfer fails (checked first). The async engine's `bulk` takes the
/// same path (`hg_bulk::start_batch_via`).
#[test]
fn a_deferred_request_moves_data_with_a_client_that_does_not_listen_over_verbs() {
    let Some(spec) = rdma_spec("a_deferred_request_moves_data_with_a_client_that_does_not_listen_over_verbs")
    else {
        return;
    };
    let mut srv = Engine::from_spec(&spec, true, ProgressMode::default()).expect("server engine");
    srv.register_deferred::<BlobPut>().expect("register");
    let mut c = Engine::from_spec(&spec, false, ProgressMode::default()).expect("client engine");
    let s = c.endpoint().lookup(srv.self_addr().uri()).expect("lookup");
    let data = blob(100_003);
    let put = c.expose(vec![data.clone()], Access::ReadOnly).expect("expose");
    let id = c.forward::<BlobPut>(&s, &("k".into(), put)).expect("forward");
    let req = drive_both_until(
        &mut c,
        &mut srv,
        "the request never reached the server",
        |_, srv| srv.take_deferred(),
    );
    let (_, from): (String, hg_rpc::Bulk) = postcard::from_bytes(&req.payload).expect("decode the input");
    let into = srv
        .expose(vec![vec![0; from.size() as usize]], Access::ReadWrite)
        .expect("expose");
    let looked_up = srv.bulk(BulkOp::Pull, &from, 0, &into, 0, from.size(), T);
    assert!(
        looked_up.is_err(),
        "a pull that looked up a client that does not listen succeeded: nothing tested"
    );
    let from = from.reached_through(req.source());
    srv.bulk(BulkOp::Pull, &from, 0, &into, 0, from.size(), T)
        .unwrap_or_else(|e| {
            panic!(
                "the pull through the request's source: {}; {}",
                na_core::ErrorChain(&e),
                client_state(&mut c)
            )
        });
    let hash = fnv(&into.local().expect("local").to_vec());
    assert_eq!(hash, fnv(&data), "pulled data differs");
    srv.respond_deferred(req, Ok(postcard::to_allocvec(&hash).expect("encode")));
    let answer = drive_both_until(&mut c, &mut srv, "no answer", |c, _| {
        c.take_response::<BlobPut>(id)
    });
    assert_eq!(answer.expect("the answer"), fnv(&data));
    assert_eq!(
        (connections(&mut c), connections(&mut srv)),
        (1, 1),
        "the transfer opened a connection besides the client's own"
    );
}

/// Drives `a` and `b` in turn until `done` gives something (within `T`,
/// else fails with `what`).
fn drive_both_until<X>(
    a: &mut Engine,
    b: &mut Engine,
    what: &str,
    mut done: impl FnMut(&mut Engine, &mut Engine) -> Option<X>,
) -> X {
    let end = Instant::now() + T;
    loop {
        assert!(Instant::now() < end, "{what}");
        for e in [&mut *a, &mut *b] {
            e.progress(Some(Duration::from_millis(1))).expect("progress");
            e.trigger().expect("trigger");
        }
        if let Some(x) = done(a, b) {
            return x;
        }
    }
}
