//! A storage service's story, written from the README, `docs/` and the
//! rustdoc alone: a server process with two contexts (one driven through
//! the blocking API with a plain bulk handler, one an `AsyncEngine` with
//! an async bulk handler), and a client process with 200 calls in flight
//! at once: 1 MiB inputs that spill, small ones, and a transform that
//! pulls a multi-segment client buffer at an offset, transforms it and
//! pushes the result into a second client handle; some calls dropped
//! mid-flight. Then every counter the client and the server keep is
//! checked against what the test itself saw.
//!
//! The server is this test binary run again (`the_story_server`, ignored
//! unless started by the story with its socket directory in
//! `QS_USER_STORY_SERVER`): it prints `CTX <i> <uri>` per context and
//! exits when its standard input closes, so a test killed mid-run leaves
//! no server behind.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{Access, AsyncEngine, Engine, RpcError};
use serde_bytes::ByteBuf;

mod common;
use common::{dir, endpoint, pattern};

mod user_story_server;
use user_story_server::*;

/// The variable that makes `the_story_server` serve, in this directory.
const SERVER_ENV: &str = "QS_USER_STORY_SERVER";
/// Calls in flight at once.
const CALLS: usize = 200;
/// The longest the server waits in a call the client drops (for the
/// [`Release`] the client sends once it dropped them all).
const SLOW_MS: u64 = 45_000;

/// The server process (see the module's doc).
#[test]
#[ignore = "the server process of the_service_story, which starts it"]
fn the_story_server() {
    let Some(dir) = std::env::var_os(SERVER_ENV) else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        std::process::exit(0);
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ctx0 = blocking_context(&dir).unwrap();
    let ctx1 = async_context(&dir, &rt).unwrap();
    println!("CTX 0 {ctx0}");
    println!("CTX 1 {ctx1}");
    std::thread::sleep(T * 5);
    panic!("the story server was not stopped within {:?}", T * 5);
}

/// The server process, killed when dropped, and its contexts' addresses.
struct StoryServer {
    child: std::process::Child,
    uris: Vec<String>,
}

impl StoryServer {
    fn start(dir: &std::path::Path) -> StoryServer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "the_story_server", "--ignored", "--nocapture"])
            .env(SERVER_ENV, dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the story server");
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut uris = Vec::new();
        for line in out.lines() {
            let line = line.expect("the server's output");
            if let Some(rest) = line.strip_prefix("CTX ") {
                let (_, uri) = rest.split_once(' ').expect("CTX <i> <uri>");
                uris.push(uri.to_owned());
                if uris.len() == 2 {
                    break;
                }
            }
        }
        assert_eq!(uris.len(), 2, "the server did not announce its two contexts");
        StoryServer { child, uris }
    }
}

impl Drop for StoryServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What one of the client's calls was.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// A 1 MiB `Digest` (spilled input).
    Spilled,
    /// A small `Ping`.
    Small,
    /// A slow `Ping`, dropped while the server runs it.
    Dropped,
    /// A `Transform` dropped while the server waits before its pull: the
    /// client's engine keeps both handles exposed until the answer.
    DroppedTransform,
    /// A `Transform` within bounds.
    Transform,
    /// A `Transform` past the end of its source: a handler error.
    OutOfRange,
}

/// Whether the story drops call `i` mid-flight.
fn is_dropped(i: usize) -> bool {
    matches!(kind(i), Kind::Dropped | Kind::DroppedTransform)
}

/// What call `i` is.
fn kind(i: usize) -> Kind {
    match i % 10 {
        0 | 5 => Kind::Spilled,
        1 | 6 | 8 => Kind::Small,
        3 if i % 20 == 13 => Kind::DroppedTransform,
        3 | 7 => Kind::Dropped,
        9 if i % 20 == 9 => Kind::OutOfRange,
        _ => Kind::Transform,
    }
}

/// One call of the story, from its own task: `Ok(true)` if it succeeded
/// and its answer was right, `Ok(false)` for an error the story expects,
/// `Err` for anything else.
async fn one_call(
    e: Arc<AsyncEngine>,
    to: hg_rpc::Addr,
    i: usize,
    started: Arc<AtomicBool>,
) -> Result<bool, String> {
    started.store(true, Ordering::SeqCst);
    match kind(i) {
        Kind::Spilled => {
            let data = ByteBuf::from(pattern(MIB, i));
            let want = (MIB as u64, checksum(&data));
            let got = e.call::<Digest>(&to, &data, T).await?;
            if got != want {
                return Err(format!("call {i}: digest {got:?}, expected {want:?}"));
            }
            Ok(true)
        }
        Kind::Small | Kind::Dropped => {
            let x = if kind(i) == Kind::Dropped {
                SLOW_MS
            } else {
                NO_SLEEP + i as u64
            };
            let (_, y) = e.call::<Ping>(&to, &x, T).await?;
            if y != x + 1 {
                return Err(format!("call {i}: ping {x} answered {y}"));
            }
            Ok(true)
        }
        Kind::Transform | Kind::OutOfRange | Kind::DroppedTransform => {
            // Three segments; the span starts inside the first and ends
            // inside the third.
            let segs = vec![pattern(1000, i), pattern(70_000, i + 1), pattern(3000, i + 2)];
            let whole = segs.concat();
            let (offset, len) = (500u64, 71_000u64);
            let offset = if kind(i) == Kind::OutOfRange { 4000 } else { offset };
            let src = e.expose(segs, Access::ReadOnly)?;
            let dst_offset = 5u64;
            let dst = e.expose(vec![vec![0; 10], vec![0; len as usize + 100]], Access::WriteOnly)?;
            let req = TransformReq {
                src,
                offset,
                len,
                dst: dst.clone(),
                dst_offset,
                delay_ms: if kind(i) == Kind::DroppedTransform {
                    SLOW_MS
                } else {
                    0
                },
            };
            let r = e.call::<Transform>(&to, &req, T).await;
            drop(req);
            match (r, kind(i)) {
                (Ok(sum), Kind::Transform) => {
                    let want = transform(&whole[offset as usize..(offset + len) as usize]);
                    let back = dst
                        .try_into_buffers()
                        .map_err(|e| format!("call {i}: after the answer, {}", na_core::ErrorChain(&e)))?
                        .concat();
                    let at = dst_offset as usize;
                    if back[at..at + len as usize] != want[..] || sum != checksum(&want) {
                        return Err(format!("call {i}: the transform pushed wrong data"));
                    }
                    if back[..at]
                        .iter()
                        .chain(&back[at + len as usize..])
                        .any(|&b| b != 0)
                    {
                        return Err(format!("call {i}: bytes outside the span were written"));
                    }
                    Ok(true)
                }
                (Err(RpcError::Handler { message, .. }), Kind::OutOfRange) => {
                    if !message.contains("4000") && !message.contains("bound") && !message.contains("range") {
                        return Err(format!(
                            "call {i}: the out-of-range error does not say so: {message}"
                        ));
                    }
                    Ok(false)
                }
                (other, k) => Err(format!("call {i} ({k:?}): {other:?}")),
            }
        }
    }
}

/// Drives everything (see the module's doc).
#[test]
fn the_service_story() {
    let d = dir("user-story");
    let server = StoryServer::start(&d);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (ep, id) = endpoint(&d, false);
        let e = Arc::new(AsyncEngine::spawn(Engine::new(ep, id).unwrap()).unwrap());
        let mut ctxs = Vec::new();
        for uri in &server.uris {
            ctxs.push(e.lookup(uri).await.expect("look the server's context up"));
        }
        // Both contexts answer, each as itself.
        for (i, to) in ctxs.iter().enumerate() {
            let (ctx, _) = e.call::<Ping>(to, &NO_SLEEP, T).await.unwrap();
            assert_eq!(ctx, i as u64, "context {i} answered as {ctx}");
        }
        // Before any of them is sent.
        let spawned_at = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..CALLS {
            let started = Arc::new(AtomicBool::new(false));
            let to = ctxs[i % 2].clone();
            let task = tokio::spawn(one_call(e.clone(), to, i, started.clone()));
            tasks.push((i, started, task));
        }
        // Drop each slow call once it is on its way (its request sent:
        // context 1, the async one, where they all go, waits in each for
        // the release sent below, at most SLOW_MS, before it answers).
        let wait_start = Instant::now();
        let mut aborted = [false; CALLS];
        while aborted.iter().enumerate().any(|(i, &a)| is_dropped(i) && !a) {
            assert!(wait_start.elapsed() < T, "the tasks did not start");
            for (i, started, task) in &tasks {
                if is_dropped(*i) && !aborted[*i] && started.load(Ordering::SeqCst) {
                    task.abort();
                    aborted[*i] = true;
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let (mut ok, mut expected_errors, mut dropped) = (0u64, 0u64, 0u64);
        for (i, _, task) in tasks {
            match task.await {
                Ok(Ok(true)) => ok += 1,
                Ok(Ok(false)) => expected_errors += 1,
                Ok(Err(why)) => panic!("{why}"),
                Err(j) if j.is_cancelled() => {
                    assert!(is_dropped(i), "call {i} canceled");
                    dropped += 1
                }
                Err(j) => panic!("call {i}: {j}"),
            }
        }
        let dropped_calls = (0..CALLS).filter(|&i| is_dropped(i)).count() as u64;
        let dropped_transforms = (0..CALLS).filter(|&i| kind(i) == Kind::DroppedTransform).count() as u64;
        // Mid-flight: the dropped transforms' handles stay exposed for
        // their target (their memory is the engine's now), the others
        // are forgotten. The server still waits before its pulls, for the
        // release (or SLOW_MS from the first send: a slower run skips it).
        let mid = e.stats();
        if spawned_at.elapsed() < Duration::from_millis(SLOW_MS / 2) {
            assert_eq!(mid.abandoned_inputs, dropped_transforms, "{mid:?}");
        }
        assert!(mid.abandoned_inputs <= dropped_transforms, "{mid:?}");
        // A slow call could only have finished if the story had been
        // kept from its loop for SLOW_MS.
        assert_eq!(dropped, dropped_calls, "slow calls finished before their drop");
        // Every slow call dropped: their answers may come now, each
        // after its drop (so each is stray).
        e.call::<Release>(&ctxs[1], &(), T).await.unwrap();
        assert_eq!(
            expected_errors,
            (0..CALLS).filter(|&i| kind(i) == Kind::OutOfRange).count() as u64
        );
        // Every request the client made went out once: 2 pings first,
        // the release last.
        let forwarded = 2 + CALLS as u64 + 1;
        // The client's own counters, once the dropped calls' answers came
        // (and were discarded: a dropped call's answer is stray).
        let end = Instant::now() + T;
        let s = loop {
            let s = e.stats();
            if s.in_flight == 0 && s.stray_responses >= dropped && s.abandoned_inputs == 0 {
                break s;
            }
            assert!(Instant::now() < end, "the client did not settle: {s:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(s.calls, forwarded, "{s:?}");
        assert_eq!(s.errors, expected_errors, "{s:?}");
        assert_eq!(s.stray_responses, dropped, "{s:?}");
        assert_eq!(s.succeeded, ok + 3, "{s:?}");
        assert_eq!(s.abandoned, dropped, "{s:?}");
        assert_eq!(
            s.calls,
            s.succeeded + s.errors + s.abandoned,
            "every call ended as exactly one of succeeded, errors, abandoned: {s:?}"
        );
        assert_eq!((s.abandoned_inputs, s.abandoned_bytes), (0, 0), "{s:?}");
        assert_eq!(s.bulk_in_flight, 0, "{s:?}");
        assert_eq!(s.handled, 0, "the client served nothing: {s:?}");
        // The server's, per context, by its own count and the engine's.
        let mut reports = Vec::new();
        for to in &ctxs {
            reports.push(e.call::<Stats>(to, &(), T).await.unwrap());
        }
        let (mut pulled, mut pushed, mut spilled, mut handled) = (0, 0, 0, 0);
        for (i, r) in reports.iter().enumerate() {
            // Context 1's Stats call counts itself in `handled` (the
            // engine counts a request as it queues it for its task), not
            // in the handlers' own count; context 0's counters are those
            // of the turn before.
            assert_eq!(r.handled, r.requests + i as u64, "context {i}: {r:?}");
            assert_eq!(r.trouble, 0, "context {i}: {r:?}");
            assert_eq!(r.bulk_in_flight, 0, "context {i}: {r:?}");
            assert_eq!(r.pulled, r.pushed, "context {i}: {r:?}");
            pulled += r.pulled;
            pushed += r.pushed;
            spilled += r.digests_spilled;
            handled += r.requests;
        }
        assert_eq!(handled, forwarded, "{reports:?}");
        // The dropped transforms ran to the end too.
        let transforms = (0..CALLS)
            .filter(|&i| matches!(kind(i), Kind::Transform | Kind::DroppedTransform))
            .count() as u64;
        assert_eq!(pushed, transforms * 71_000, "{reports:?}");
        assert_eq!(
            spilled,
            (0..CALLS).filter(|&i| kind(i) == Kind::Spilled).count() as u64
        );
        assert_eq!(pulled, pushed, "{reports:?}");
        // Each context's plugin pushed exactly what its handler pushed,
        // and pulled its transforms' spans and its spilled inputs, each
        // as encoded (postcard: a 3-byte length, then the bytes) and then
        // its 8-byte seal, in one get (docs/PROTOCOL.md).
        for (i, r) in reports.iter().enumerate() {
            assert_eq!(r.put_bytes, r.pushed, "context {i}: {r:?}");
            assert_eq!(
                r.get_bytes,
                r.pulled + r.digests_spilled * (3 + MIB as u64 + 8),
                "context {i}: {r:?}"
            );
        }
        // The client's transport saw the other side of it: nothing of
        // its own moved by RMA.
        let t = e.transport_stats();
        assert_eq!((t.get_bytes, t.put_bytes), (0, 0), "{t:?}");
        e.shutdown().unwrap();
    });
    drop(server);
}
