//! Bulk transfers with `.await`: `AsyncEngine::expose` and `bulk` against
//! a separate server process over na-sm, and async handlers that move
//! data with their caller (`register_async_with_bulk`, `AsyncBulkCtx`).

use std::sync::Arc;
use std::time::Duration;

use hg_rpc::{AsyncBulkCtx, Bulk, BulkOp, Engine, Rpc, RpcError, Span};
use na_core::Access;
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;

mod common;
use common::{contents, pattern, Server};

const T: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_and_pushes_across_segments_with_a_server_process() {
    let d = common::dir("async-bulk");
    let srv = Server::start(&d);
    let c = Arc::new(common::async_engine(&d, false));
    let s = c.lookup(&srv.uri).await.unwrap();
    // The server pulls a three-segment handle of ours (its handler), then
    // exposes its copy in segments of 300,000 bytes for us.
    let data = pattern(3 * 1024 * 1024 + 5, 0);
    let segs = vec![
        data[..1_000_000].to_vec(),
        data[1_000_000..1_000_007].to_vec(),
        data[1_000_007..].to_vec(),
    ];
    let put = c.expose(segs, Access::ReadOnly).unwrap();
    assert_eq!(
        c.call::<BlobPut>(&s, &("k".into(), put), T).await.unwrap(),
        fnv(&data)
    );
    let remote = c.call::<BlobExpose>(&s, &("k".into(), 300_000), T).await.unwrap();
    assert_eq!(remote.size(), data.len() as u64);

    // One pull across both sides' segment boundaries, at offsets.
    let local = c
        .expose(
            vec![vec![0; 1 << 20], vec![0; 7], vec![0; 2 << 20]],
            Access::ReadWrite,
        )
        .unwrap();
    let len = (2 << 20) + 100;
    c.bulk(BulkOp::Pull, &remote, 1234, &local, 5, len, T)
        .await
        .unwrap();
    assert!(
        contents(&local)[5..5 + len as usize] == data[1234..1234 + len as usize],
        "pulled data differs"
    );

    // Sixteen pulls in flight at once, each its own range.
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..16u64 {
        let (c, remote) = (c.clone(), remote.clone());
        tasks.spawn(async move {
            let into = c.expose(vec![vec![0; 70_000]], Access::ReadWrite).unwrap();
            c.bulk(BulkOp::Pull, &remote, i * 190_000, &into, 0, 70_000, T)
                .await
                .unwrap();
            (i, contents(&into))
        });
    }
    while let Some(r) = tasks.join_next().await {
        let (i, got) = r.unwrap();
        let at = (i * 190_000) as usize;
        assert!(got == data[at..at + 70_000], "pull {i} differs");
    }

    // One batch of 300 spans of 5,000 bytes, scattered and out of order,
    // then a batch with one span out of bounds: refused whole.
    let spans: Vec<Span> = (0..300u64)
        .rev()
        .map(|k| Span {
            remote_offset: k * 10_007,
            local_offset: k * 5_000,
            len: 5_000,
        })
        .collect();
    let scattered = c
        .expose(vec![vec![0; 1_000_000], vec![0; 500_000]], Access::ReadWrite)
        .unwrap();
    c.bulk_batch(BulkOp::Pull, &remote, &scattered, &spans, T)
        .await
        .unwrap();
    let got = contents(&scattered);
    for s in &spans {
        let (r, l) = (s.remote_offset as usize, s.local_offset as usize);
        assert!(
            got[l..l + 5_000] == data[r..r + 5_000],
            "batch span at {r} differs"
        );
    }
    let mut bad = spans.clone();
    bad[150].remote_offset = data.len() as u64 - 10;
    let untouched = c.expose(vec![vec![0; 1_500_000]], Access::ReadWrite).unwrap();
    match c.bulk_batch(BulkOp::Pull, &remote, &untouched, &bad, T).await {
        Err(RpcError::BulkRefused { reason }) => assert!(reason.contains("bounds"), "{reason}"),
        other => panic!("expected a bounds error, got {other:?}"),
    }
    // na-sm moves data as it posts: a partial start would show here.
    assert!(
        contents(&untouched).iter().all(|&b| b == 0),
        "a refused batch moved data"
    );
    assert_eq!(c.stats().bulk_in_flight, 0, "a refused batch started something");
    c.bulk_batch(BulkOp::Pull, &remote, &untouched, &[], T)
        .await
        .unwrap();

    // A push into the server's copy, checked by the server.
    let new = pattern(100_000, 17);
    let src = c
        .expose(
            vec![new[..40_000].to_vec(), new[40_000..].to_vec()],
            Access::ReadOnly,
        )
        .unwrap();
    c.bulk(BulkOp::Push, &remote, 777, &src, 0, 100_000, T)
        .await
        .unwrap();
    let mut expect = data.clone();
    expect[777..100_777].copy_from_slice(&new);
    let digest = c.call::<BlobExposedDigest>(&s, &"k".into(), T).await.unwrap();
    assert_eq!(
        digest,
        (expect.len() as u64, fnv(&expect)),
        "the server's copy after the push"
    );

    // Refused before anything moves: out of bounds, and a local side that
    // is not ours.
    let end = data.len() as u64;
    match c.bulk(BulkOp::Pull, &remote, end - 10, &local, 0, 11, T).await {
        Err(RpcError::BulkRefused { reason }) => assert!(reason.contains("bounds"), "{reason}"),
        other => panic!("expected a bounds error, got {other:?}"),
    }
    match c.bulk(BulkOp::Pull, &remote, 0, &remote, 0, 10, T).await {
        Err(RpcError::BulkRefused { reason }) => assert!(reason.contains("local side"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }

    assert_eq!(c.call::<Add>(&s, &(2, 3), T).await.unwrap(), 5);
}

/// Past its timeout a transfer is canceled and waited for (a Timeout, not
/// the transfer's own outcome); dropping a transfer's future gives it up.
/// The engine goes on either way. On a current-thread runtime, so that
/// the driver cannot file the outcome before the timeout is checked
/// (na-sm moves the data as the transfer starts: on a second worker
/// thread the driver may win that race, and the transfer is done in time).
#[tokio::test(flavor = "current_thread")]
async fn a_timed_out_or_dropped_transfer_leaves_the_engine_working() {
    let d = common::dir("async-bulk-timeout");
    let srv = Server::start(&d);
    let c = common::async_engine(&d, false);
    let s = c.lookup(&srv.uri).await.unwrap();
    let data = pattern(3 << 20, 1);
    let put = c.expose(vec![data.clone()], Access::ReadOnly).unwrap();
    assert_eq!(
        c.call::<BlobPut>(&s, &("t".into(), put), T).await.unwrap(),
        fnv(&data)
    );
    let remote = c.call::<BlobExpose>(&s, &("t".into(), 1 << 20), T).await.unwrap();
    let local = c.expose(vec![vec![0; 3 << 20]], Access::ReadWrite).unwrap();
    for round in 0..3 {
        let r = c
            .bulk(BulkOp::Pull, &remote, 0, &local, 0, 1 << 20, Duration::ZERO)
            .await;
        assert!(matches!(r, Err(RpcError::Timeout { .. })), "round {round}: {r:?}");
        assert_eq!(
            c.stats().bulk_in_flight,
            0,
            "round {round}: the future returned before its canceled transfer ended"
        );
    }
    // A batch past its timeout: every span canceled and waited for.
    let spans: Vec<Span> = (0..64u64)
        .map(|k| Span {
            remote_offset: k * 40_000,
            local_offset: k * 40_000,
            len: 40_000,
        })
        .collect();
    let r = c
        .bulk_batch(BulkOp::Pull, &remote, &local, &spans, Duration::ZERO)
        .await;
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "batch: {r:?}");
    assert_eq!(
        c.stats().bulk_in_flight,
        0,
        "the batch returned with spans in flight"
    );
    // A batch polled once (started), then dropped: forgotten whole. (With
    // a timeout, na-sm's transfers end within the first poll, which does
    // the driver's work itself; a zero timeout makes no progress, so the
    // future waits for the driver to file the canceled spans' ends.)
    let mut fut = Box::pin(c.bulk_batch(BulkOp::Pull, &remote, &local, &spans, Duration::ZERO));
    let first = common::poll_once(&mut fut).await;
    assert!(first.is_none(), "a batch finished at its first poll: {first:?}");
    drop(fut);
    // Polled once (started), then dropped.
    let mut fut = Box::pin(c.bulk(BulkOp::Pull, &remote, 0, &local, 0, 3 << 20, Duration::ZERO));
    let first = common::poll_once(&mut fut).await;
    assert!(first.is_none(), "a pull finished at its first poll: {first:?}");
    drop(fut);
    let again = c.expose(vec![vec![0; 4096]], Access::ReadWrite).unwrap();
    c.bulk(BulkOp::Pull, &remote, 99_999, &again, 0, 4096, T)
        .await
        .unwrap();
    assert!(
        contents(&again) == data[99_999..99_999 + 4096],
        "a pull after the timeouts and the drop differs"
    );
    // The dropped transfer's end came before the last one's.
    assert_eq!(c.stats().bulk_in_flight, 0);
    assert_eq!(c.call::<Add>(&s, &(2, 3), T).await.unwrap(), 5);
}

/// Stores the caller's blob (pulled through the handler's context) and
/// answers its FNV-1a hash.
struct AsyncPut;
impl Rpc for AsyncPut {
    const NAME: &'static str = "async_bulk.put";
    type Input = Bulk;
    type Output = u64;
}

/// `AsyncPut` with the caller-only rule lifted.
struct AsyncPutAny;
impl Rpc for AsyncPutAny {
    const NAME: &'static str = "async_bulk.put_any";
    type Input = Bulk;
    type Output = u64;
}

/// Starts pulling the caller's handle, then panics with the pull pending.
struct PanicMidPull;
impl Rpc for PanicMidPull {
    const NAME: &'static str = "async_bulk.panic_mid_pull";
    type Input = Bulk;
    type Output = ();
}

/// Answers the URI of the caller, as its context names it.
struct WhoCalls;
impl Rpc for WhoCalls {
    const NAME: &'static str = "async_bulk.who_calls";
    type Input = ();
    type Output = String;
}

/// Pulls `from` in spans of 64 KiB, last first, as one batch; answers
/// the hash.
async fn pull_and_hash(ctx: AsyncBulkCtx, from: Bulk) -> Result<u64, String> {
    let into = ctx.expose(vec![vec![0; from.size() as usize]], Access::ReadWrite)?;
    let (size, chunk) = (from.size(), 64 * 1024);
    let spans: Vec<Span> = (0..size.div_ceil(chunk))
        .rev()
        .map(|k| Span {
            remote_offset: k * chunk,
            local_offset: k * chunk,
            len: chunk.min(size - k * chunk),
        })
        .collect();
    ctx.transfer_batch(BulkOp::Pull, &from, &into, &spans, T).await?;
    Ok(fnv(&contents(&into)))
}

/// An async handler moves data with its caller's handle through its
/// context, and refuses a handle someone else owns (a client must not aim
/// the server's transfers at a third process) unless it lifted the rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_handler_moves_data_only_with_its_caller() {
    let d = common::dir("async-bulk-owner");
    let srv = common::async_engine(&d, true);
    srv.register_async_with_bulk::<AsyncPut, _, _>(pull_and_hash)
        .unwrap();
    srv.register_async_with_bulk::<AsyncPutAny, _, _>(|mut ctx, from| async move {
        ctx.allow_any_owner();
        pull_and_hash(ctx, from).await
    })
    .unwrap();
    srv.register_async_with_bulk::<WhoCalls, _, _>(
        |ctx, ()| async move { Ok(ctx.caller().uri().to_owned()) },
    )
    .unwrap();
    srv.register_async_with_bulk::<PanicMidPull, _, _>(|ctx, from| async move {
        let into = ctx.expose(vec![vec![0; from.size() as usize]], Access::ReadWrite)?;
        // Two spans, one batch.
        let half = from.size() / 2;
        let spans = [
            Span {
                remote_offset: 0,
                local_offset: 0,
                len: half,
            },
            Span {
                remote_offset: half,
                local_offset: half,
                len: from.size() - half,
            },
        ];
        // A zero timeout: no progress within the first poll (see
        // a_timed_out_or_dropped_transfer_leaves_the_engine_working).
        let mut pull = Box::pin(ctx.transfer_batch(BulkOp::Pull, &from, &into, &spans, Duration::ZERO));
        let first = common::poll_once(&mut pull).await;
        panic!("with the pull pending (first poll: {first:?})");
    })
    .unwrap();
    let c = common::async_engine(&d, false);
    let third = common::async_engine(&d, true);
    let s = c.lookup(srv.self_addr().uri()).await.unwrap();
    assert_eq!(c.call::<WhoCalls>(&s, &(), T).await.unwrap(), c.self_addr().uri());

    // 2 MiB: no inline data, a real pull from our memory.
    let data = pattern(2 << 20, 3);
    let ours = c.expose(vec![data.clone()], Access::ReadOnly).unwrap();
    assert_eq!(c.call::<AsyncPut>(&s, &ours, T).await.unwrap(), fnv(&data));

    // The third engine's handle, sent by us: not ours to hand out.
    let theirs = third.expose(vec![pattern(1 << 20, 9)], Access::ReadOnly).unwrap();
    match c.call::<AsyncPut>(&s, &theirs, T).await {
        Err(RpcError::Handler { message, .. }) => {
            assert!(message.contains("not to the caller"), "{message}");
            assert!(message.contains("AsyncBulkCtx::allow_any_owner"), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // Lifted: the handler pulls from the third process (engine) itself.
    assert_eq!(
        c.call::<AsyncPutAny>(&s, &theirs, T).await.unwrap(),
        fnv(&pattern(1 << 20, 9))
    );
    // A handler that panics with its transfer pending: the transfer is
    // canceled and ended before the answer (a handler error).
    match c.call::<PanicMidPull>(&s, &ours, T).await {
        Err(RpcError::Handler { message, .. }) => {
            assert!(message.contains("with the pull pending"), "{message}")
        }
        other => panic!("expected a handler error, got {other:?}"),
    }
    assert_eq!(
        srv.stats().bulk_in_flight,
        0,
        "answered with the transfer in flight"
    );
    // And the server goes on serving.
    assert_eq!(c.call::<AsyncPut>(&s, &ours, T).await.unwrap(), fnv(&data));
}

/// Starts pulling the caller's handle in a task of its own, which keeps
/// the handler's context, and returns while that pull is in flight.
struct KeptPull;
impl Rpc for KeptPull {
    const NAME: &'static str = "async_bulk.kept_pull";
    type Input = Bulk;
    type Output = ();
}

/// What the task that keeps a handler's context reports: which step, and
/// how it went (for "polled": whether the pull was still in flight after
/// its first poll).
type Report = (&'static str, Result<bool, RpcError>);

/// A context moved into a task that outlives its handler. The task polls
/// its pull once (in flight: a zero timeout makes no progress within the
/// first poll) and then leaves it alone until the test says so: the
/// handler's answer must not come meanwhile, since the transfer is still
/// running. Once resumed, the pull ends and the answer comes. A transfer
/// the task starts after that is refused: the caller may have freed its
/// memory. (The driver may file a zero-timeout pull's end before its
/// first poll returns; such a round proves nothing and another is made.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_kept_past_its_handler_holds_the_answer_and_moves_nothing_after_it() {
    let d = common::dir("async-bulk-kept");
    let srv = common::async_engine(&d, true);
    let (report, mut reports) = tokio::sync::mpsc::unbounded_channel::<Report>();
    let (resume, late) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let (r2, l2) = (resume.clone(), late.clone());
    srv.register_async_with_bulk::<KeptPull, _, _>(move |ctx, from| {
        let (report, resume, late) = (report.clone(), r2.clone(), l2.clone());
        async move {
            let into = ctx.expose(vec![vec![0; from.size() as usize]], Access::ReadWrite)?;
            let (polled, polled_rx) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                let mut pull =
                    Box::pin(ctx.transfer(BulkOp::Pull, &from, 0, &into, 0, from.size(), Duration::ZERO));
                let first = common::poll_once(&mut pull).await;
                let _ = report.send(("polled", Ok(first.is_none())));
                let _ = polled.send(());
                resume.notified().await;
                let r = match first {
                    Some(r) => r,
                    None => pull.await,
                };
                let _ = report.send(("in flight", r.map(|()| true)));
                late.notified().await;
                let r = ctx
                    .transfer(BulkOp::Pull, &from, 0, &into, 0, from.size(), T)
                    .await;
                let _ = report.send(("late", r.map(|()| true)));
            });
            polled_rx
                .await
                .map_err(|_| "the task that keeps the context failed".to_string())
        }
    })
    .unwrap();
    let c = Arc::new(common::async_engine(&d, false));
    let s = c.lookup(srv.self_addr().uri()).await.unwrap();
    let ours = c.expose(vec![pattern(2 << 20, 5)], Access::ReadOnly).unwrap();
    // Each round needs the 2 MiB pull still in flight after its first
    // poll; under load na-sm may finish it as it starts (all 5 rounds did
    // once in CI), so up to 40 rounds, stopping at the first that held.
    const ROUNDS: usize = 40;
    let mut held = 0;
    for round in 0..ROUNDS {
        let (c2, s2, ours2) = (c.clone(), s.clone(), ours.clone());
        let mut call = tokio::spawn(async move { c2.call::<KeptPull>(&s2, &ours2, T).await });
        let pending = match reports.recv().await {
            Some(("polled", Ok(p))) => p,
            other => panic!("expected the first poll's report, got {other:?}"),
        };
        if pending {
            // The handler returned; its answer waits for the kept pull.
            assert!(
                tokio::time::timeout(Duration::from_millis(300), &mut call)
                    .await
                    .is_err(),
                "answered with the kept context's transfer still running"
            );
            held += 1;
        }
        resume.notify_one();
        call.await.unwrap().unwrap();
        assert_eq!(srv.stats().bulk_in_flight, 0, "round {round}");
        match reports.recv().await {
            // A zero timeout: canceled, or ended before its cancel.
            Some(("in flight", Err(RpcError::Timeout { .. }) | Ok(true))) => {}
            other => panic!("expected the zero-timeout pull's end, got {other:?}"),
        }
        // The caller may free its memory now; the context starts nothing.
        late.notify_one();
        match reports.recv().await {
            Some(("late", Err(RpcError::BulkRefused { reason }))) => {
                assert!(reason.contains("already returned"), "{reason}")
            }
            other => panic!("expected the late pull to be refused, got {other:?}"),
        }
        if held > 0 {
            break;
        }
    }
    assert_eq!(
        held, 1,
        "in {ROUNDS} rounds, no pull was in flight after its first poll"
    );
    assert_eq!(srv.stats().bulk_in_flight, 0);
}

/// A task that starts a transfer files the transfer's end itself (na-sm
/// moves the data as the transfer starts), but the engine's handlers still
/// run on its driver task: a request already waiting in the transport when
/// a task starts a transfer is not handled on that task (a long handler
/// would delay it, and it would run outside the driver's order).
#[tokio::test(flavor = "current_thread")]
async fn a_task_that_starts_a_transfer_runs_no_handler() {
    let d = common::dir("async-bulk-no-handler");
    let srv = Server::start(&d);
    let c = Arc::new(common::async_engine(&d, true));
    let ran_on = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = ran_on.clone();
    c.register::<Add>(move |(a, b)| {
        record.lock().unwrap().push(tokio::task::try_id());
        Ok(a + b)
    })
    .unwrap();
    let s = c.lookup(&srv.uri).await.unwrap();
    let data = pattern(1 << 20, 11);
    let put = c.expose(vec![data.clone()], Access::ReadOnly).unwrap();
    assert_eq!(
        c.call::<BlobPut>(&s, &("k".into(), put), T).await.unwrap(),
        fnv(&data)
    );
    let remote = c.call::<BlobExpose>(&s, &("k".into(), 1 << 20), T).await.unwrap();

    // A blocking client of ours on a thread of its own: one call to
    // connect, then a request, sent when we say and reported as sent.
    let uri = c.self_addr().uri().to_owned();
    let (connected_tx, connected) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel();
    let (sent_tx, sent_rx) = std::sync::mpsc::channel();
    let dir = d.to_path_buf();
    let client = std::thread::spawn(move || {
        let (ep, id) = common::endpoint(&dir, false);
        let mut b = Engine::new(ep, id).unwrap();
        let to = b.endpoint().lookup(&uri).unwrap();
        assert_eq!(b.call::<Add>(&to, &(1, 2), T).unwrap(), 3);
        connected_tx.send(()).unwrap();
        go_rx.recv().unwrap();
        let call = b.forward::<Add>(&to, &(3, 4)).unwrap();
        sent_tx.send(()).unwrap();
        loop {
            b.progress(Some(T)).unwrap();
            b.trigger().unwrap();
            if let Some(r) = b.take_response::<Add>(call) {
                return r.unwrap();
            }
        }
    });
    let c2 = c.clone();
    let puller = tokio::spawn(async move {
        connected.await.unwrap();
        // From here until the transfer starts this task does not yield,
        // and this runtime has one thread: the driver cannot take the
        // request, sent meanwhile, first.
        go_tx.send(()).unwrap();
        sent_rx.recv().unwrap();
        let into = c2.expose(vec![vec![0; 1 << 20]], Access::ReadWrite).unwrap();
        c2.bulk(BulkOp::Pull, &remote, 0, &into, 0, 1 << 20, T)
            .await
            .unwrap();
        assert!(contents(&into) == data, "pulled data differs");
        tokio::task::id()
    });
    let puller_id = puller.await.unwrap();
    assert_eq!(
        tokio::task::spawn_blocking(move || client.join().unwrap())
            .await
            .unwrap(),
        7
    );
    let ran_on = ran_on.lock().unwrap().clone();
    assert_eq!(ran_on.len(), 2, "{ran_on:?}");
    assert!(
        ran_on.iter().all(|t| t.is_some() && *t != Some(puller_id)),
        "a handler ran on the task that started a transfer: {ran_on:?} (that task: {puller_id})"
    );
}

/// A self-call to a plain handler that moves bulk data runs on the
/// caller's task, and its transfer polls the transports there, which
/// leaves them unarmed: the driver must be woken to arm them again, or it
/// sleeps deaf to the next request from another engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_self_call_that_moves_bulk_data_leaves_the_driver_listening() {
    let d = common::dir("async-self-bulk");
    let (ep, id) = common::endpoint(&d, true);
    let mut e = Engine::new(ep, id).unwrap();
    e.register::<Echo>(Ok).unwrap();
    e.register_with_bulk::<BlobPut>(|ctx, (_key, data)| {
        let local = ctx.expose(vec![vec![0; data.size() as usize]], Access::ReadWrite)?;
        ctx.transfer(BulkOp::Pull, &data, 0, &local, 0, data.size())?;
        Ok(fnv(&local.local().ok_or("not local")?.to_vec()))
    })
    .unwrap();
    let a = hg_rpc::AsyncEngine::spawn(e).unwrap();
    let c = common::async_engine(&d, false);
    let s = c.lookup(&a.self_addr().to_string()).await.unwrap();
    assert_eq!(
        c.call::<Echo>(&s, &ByteBuf::from(vec![1]), T).await.unwrap(),
        vec![1]
    );
    // Whether the self-call's poll lands while the driver sleeps armed is
    // a race: several rounds.
    for round in 0..8u8 {
        // Idle long enough for the driver to arm the transports and sleep
        // (on a loaded machine its first sleep may come later: waited for,
        // within a generous bound).
        tokio::time::sleep(Duration::from_millis(50)).await;
        let end = std::time::Instant::now() + T;
        while a.stats().driver_sleeps == 0 {
            assert!(
                std::time::Instant::now() < end,
                "the driver never slept: nothing tested"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Too large to travel inline: the handler's pull is a transfer.
        let data = pattern(64 << 10, round.into());
        let h = a.expose(vec![data.clone()], Access::ReadOnly).unwrap();
        let me = a.self_addr();
        assert_eq!(
            a.call::<BlobPut>(&me, &("k".into(), h), T).await.unwrap(),
            fnv(&data)
        );
        // Long enough for the driver to sleep again, then a call from
        // another engine: served. The engine keeps nothing for a TTL
        // (no spilled output, no abandoned input), so its driver sleeps
        // with no deadline: only the transports can wake it, and a deaf
        // driver would never answer, however long the wait. The bound is
        // generous (a loaded machine is slow, not deaf): no speed is
        // asserted.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let st = a.stats();
        assert_eq!(
            (st.exposed_outputs, st.abandoned_inputs),
            (0, 0),
            "the driver has a deadline to wake at: a deaf one could still answer"
        );
        let r = c
            .call::<Echo>(&s, &ByteBuf::from(vec![round]), Duration::from_secs(30))
            .await;
        assert_eq!(r.expect("the driver no longer hears the transports"), vec![round]);
    }
}

/// Hands its context out and answers.
struct HandOut;
impl Rpc for HandOut {
    const NAME: &'static str = "async_bulk.hand_out";
    type Input = ();
    type Output = ();
}

/// A context kept past its handler and past the AsyncEngine itself: its
/// exposure is refused (`DriverStopped`), as its transfers are, instead of
/// exposing memory on an engine nobody drives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_kept_past_its_engine_exposes_nothing() {
    let d = common::dir("async-bulk-expose-after-drop");
    let srv = common::async_engine(&d, true);
    let (tx, rx) = std::sync::mpsc::channel::<AsyncBulkCtx>();
    let tx = std::sync::Mutex::new(tx);
    srv.register_async_with_bulk::<HandOut, _, _>(move |ctx, ()| {
        let _ = tx.lock().unwrap().send(ctx);
        async { Ok(()) }
    })
    .unwrap();
    let c = common::async_engine(&d, false);
    let s = c.lookup(srv.self_addr().uri()).await.unwrap();
    c.call::<HandOut>(&s, &(), T).await.unwrap();
    let ctx = rx.recv_timeout(T).expect("the handler handed its context out");
    // While the engine lives, the kept context may expose.
    assert!(ctx.expose(vec![vec![1u8; 64]], Access::ReadOnly).is_ok());
    drop(srv);
    match ctx.expose(vec![vec![1u8; 64]], Access::ReadOnly) {
        Err(RpcError::DriverStopped { .. }) => {}
        other => panic!("expected DriverStopped, got {:?}", other.map(|b| b.size())),
    }
}
