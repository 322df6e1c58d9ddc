//! Server process for hg-rpc's multi-process tests (not a user tool).
//!
//! Listens on the transport of `HG_TESTPEER_SPEC` (default `sm://`, socket
//! dir from `QS_SM_DIR`; `verbs://rxe0/10.77.0.1:0` for RDMA), prints
//! `ADDR <uri>`, and serves the RPCs of `testpeer_rpcs` until `Quit`, 60 s
//! without a request, or (with `HG_TESTPEER_EXIT_WITH_STDIN=1`) the end of
//! its standard input. `HG_TESTPEER_TRANSFER_TIMEOUT_MS` sets its handler
//! transfer timeout. `HG_TESTPEER_MARKER` is what `Marker` answers (tells
//! servers apart). `HG_TESTPEER_LOG` (`warn,na_verbs=debug`) writes what
//! the engine and its transport log to standard error (`testpeer/log.rs`).
//!
//! With `HG_TESTPEER_STALLED_CALL=<server uri>` it is a client instead, one
//! that stalls: it calls `Fill` there for 1 MiB (an output that spills),
//! or with `HG_TESTPEER_STALLED_INPUTS=<n>` makes `n` calls of `Digest`
//! with 1 MiB inputs of byte 1 (inputs that spill), prints `ADDR <its
//! uri>`, and then drives its transport without ever taking a response
//! (so it never pulls an output, and keeps its inputs exposed), until it
//! is killed (or its standard input closes, or 60 s pass). With
//! `HG_TESTPEER_STALLED_CONNS=<k>` it does so from `k` engines of its own
//! (`k` connections, each under an instance name of its own: one process
//! that poses as many origins), each making those calls (`ADDR` is the
//! first engine's);
//! `HG_TESTPEER_STALLED_LEN=<bytes>` sets the length of the `Digest`
//! inputs, or of the `Fill` output (default 1 MiB).
#![warn(missing_docs)]
#![warn(clippy::missing_docs_in_private_items)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::Engine;
use na_core::{Endpoint, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

#[path = "testpeer/log.rs"]
mod log;
#[path = "testpeer/rpcs.rs"]
#[allow(dead_code)]
mod testpeer_rpcs;
use testpeer_rpcs::*;

#[path = "shared/exit.rs"]
mod exit;

/// Extra contexts (`HG_TESTPEER_CONTEXTS=n`): each a thread with its own
/// engine and address, printed as `CTX <i> <uri>`; they serve `WhoAmI`
/// (answering their index and the caller's token) until the process ends.
fn extra_contexts() -> Result<(), Box<dyn std::error::Error>> {
    let n: u64 = std::env::var("HG_TESTPEER_CONTEXTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    for ctx in 1..n {
        let mut ep = Endpoint::new(ProgressMode::default())?;
        let cfg = SmConfig {
            listen: true,
            ..SmConfig::default()
        };
        let id = ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))?;
        let mut engine = Engine::new(ep, id)?;
        engine.register::<WhoAmI>(move |token| Ok((ctx, token)))?;
        println!("CTX {ctx} {}", engine.self_addr());
        std::thread::spawn(move || loop {
            if engine.progress(Some(Duration::from_millis(200))).is_err() || engine.trigger().is_err() {
                return;
            }
        });
    }
    Ok(())
}

/// With `HG_TESTPEER_EXIT_WITH_STDIN=1`, exits once its standard input
/// reaches end-of-file: a test that spawns it with a pipe there takes it
/// along when it dies, from whatever thread it was spawned (unlike
/// `PR_SET_PDEATHSIG`, which follows the spawning thread).
fn exit_with_stdin() {
    if std::env::var_os("HG_TESTPEER_EXIT_WITH_STDIN").is_some_and(|v| v == "1") {
        std::thread::spawn(|| {
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
            eprintln!("hg-rpc-testpeer: standard input closed (the test is gone), exiting");
            std::process::exit(4);
        });
    }
}

/// The client of `HG_TESTPEER_STALLED_CALL` (see the top of the file):
/// progress without `trigger` moves its messages but takes none, so the
/// spilled response waits in the transport and nothing is pulled.
fn stalled_client(spec: &str, server: &str) -> Result<(), Box<dyn std::error::Error>> {
    let number = |var: &str, default: u64| -> Result<u64, String> {
        match std::env::var(var) {
            Ok(v) => v.parse().map_err(|e| format!("{var}={v:?}: {e}")),
            Err(_) => Ok(default),
        }
    };
    let conns = number("HG_TESTPEER_STALLED_CONNS", 1)?;
    let len = number("HG_TESTPEER_STALLED_LEN", 1 << 20)?;
    if conns == 0 || conns > 256 || len > 64 << 20 {
        return Err(
            "HG_TESTPEER_STALLED_CONNS must be 1..=256, HG_TESTPEER_STALLED_LEN at most 64 MiB".into(),
        );
    }
    let mut engines = Vec::new();
    for _ in 0..conns {
        let mut engine = Engine::from_spec(spec, true, ProgressMode::default())?;
        let at = engine.lookup(server)?;
        match std::env::var("HG_TESTPEER_STALLED_INPUTS") {
            Ok(n) => {
                let n: u32 = n
                    .parse()
                    .map_err(|e| format!("HG_TESTPEER_STALLED_INPUTS={n:?}: {e}"))?;
                let input = serde_bytes::ByteBuf::from(vec![1u8; len as usize]);
                for _ in 0..n {
                    engine.forward::<Digest>(&at, &input)?;
                }
            }
            Err(_) => {
                engine.forward::<Fill>(&at, &(len, 0))?;
            }
        }
        engines.push(engine);
    }
    // One line (the test reads one, then closes the pipe): the first's.
    if let Some(first) = engines.first() {
        println!("ADDR {}", first.self_addr());
    }
    // Each engine's share of a 200 ms round, at least 1 ms: with more than
    // 200 connections, 200 / conns is 0 and the loop would spin.
    let slice = Duration::from_millis((200 / conns).max(1));
    let end = Instant::now() + Duration::from_secs(60);
    while Instant::now() < end {
        for engine in &mut engines {
            engine.progress(Some(slice))?;
        }
    }
    eprintln!("hg-rpc-testpeer: stalled client not killed within 60 s, exiting");
    std::process::exit(3);
}

fn main() -> std::process::ExitCode {
    exit::run("hg-rpc-testpeer", run)
}

/// The server (or the stalled client): an error ends the process with its
/// message and causes on stderr ([`exit::run`]).
fn run() -> Result<(), Box<dyn std::error::Error>> {
    log::init()?;
    exit_with_stdin();
    let spec = std::env::var("HG_TESTPEER_SPEC").unwrap_or_else(|_| "sm://".into());
    if let Ok(server) = std::env::var("HG_TESTPEER_STALLED_CALL") {
        return stalled_client(&spec, &server);
    }
    extra_contexts()?;
    let mut engine = Engine::from_spec(&spec, true, ProgressMode::default())?;
    // A handler transfer timeout in milliseconds (tests of its expiry).
    if let Some(ms) = na_core::env_var("HG_TESTPEER_TRANSFER_TIMEOUT_MS", |v, why| {
        format!("HG_TESTPEER_TRANSFER_TIMEOUT_MS={v:?}: {why}")
    })? {
        let ms: u64 = ms
            .parse()
            .map_err(|e| format!("HG_TESTPEER_TRANSFER_TIMEOUT_MS={ms:?}: {e}"))?;
        engine.set_handler_transfer_timeout(Duration::from_millis(ms));
    }
    // A spilled output TTL in milliseconds (tests of late pulls).
    if let Some(ms) = na_core::env_var("HG_TESTPEER_OUTPUT_TTL_MS", |v, why| {
        format!("HG_TESTPEER_OUTPUT_TTL_MS={v:?}: {why}")
    })? {
        let ms: u64 = ms
            .parse()
            .map_err(|e| format!("HG_TESTPEER_OUTPUT_TTL_MS={ms:?}: {e}"))?;
        engine.set_spilled_output_ttl(Duration::from_millis(ms));
    }
    let quit = Arc::new(AtomicBool::new(false));
    let (records, sum) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    engine.register::<Add>(|(a, b)| a.checked_add(b).ok_or_else(|| "overflow".to_string()))?;
    // Echoes answered, counted as their handler returns; and a snapshot
    // of that count with the exposed outputs, taken together after each
    // turn of the loop below (what `EchoOutputs` answers).
    let echoes = Arc::new(AtomicU64::new(0));
    let snapshot = Arc::new(std::sync::Mutex::new((0u64, 0u64)));
    let e = echoes.clone();
    engine.register::<Echo>(move |data| {
        e.fetch_add(1, Ordering::Relaxed);
        Ok(data)
    })?;
    let snap = snapshot.clone();
    engine.register::<EchoOutputs>(move |()| Ok(*snap.lock().map_err(|_| "poisoned")?))?;
    engine.register::<WhoAmI>(|token| Ok((0, token)))?;
    let marker = std::env::var("HG_TESTPEER_MARKER").unwrap_or_default();
    engine.register::<Marker>(move |()| Ok((marker.clone(), std::process::id())))?;
    engine.register::<Fail>(Err)?;
    engine.register::<Sleep>(|ms| {
        std::thread::sleep(Duration::from_millis(ms));
        Ok(())
    })?;
    let (r, s) = (records.clone(), sum.clone());
    engine.register::<Record>(move |v| {
        r.fetch_add(1, Ordering::Relaxed);
        s.fetch_add(v, Ordering::Relaxed);
        Ok(())
    })?;
    let (r, s) = (records.clone(), sum.clone());
    engine.register::<RecordBlob>(move |blob| {
        r.fetch_add(1, Ordering::Relaxed);
        s.fetch_add(blob.len() as u64, Ordering::Relaxed);
        Ok(())
    })?;
    engine.register::<Digest>(|data| Ok((data.len() as u64, fnv(&data))))?;
    let fills = Arc::new(AtomicU64::new(0));
    let f = fills.clone();
    engine.register::<Fill>(move |(len, seed)| {
        if len > MAX_BLOB {
            return Err(format!("{len} bytes: at most {MAX_BLOB}"));
        }
        let out = fill_output(len, seed);
        f.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    })?;
    engine.register::<FillsAnswered>(move |()| Ok(fills.load(Ordering::Relaxed)))?;
    let blobs: Arc<Blobs> = Arc::default();
    let b = blobs.clone();
    engine.register_with_bulk::<BlobPut>(move |ctx, (key, data)| {
        let whole = data.size().max(1);
        store_blob(ctx, &b, key, &data, whole)
    })?;
    let b = blobs.clone();
    engine.register_with_bulk::<BlobPutChunked>(move |ctx, (key, data, chunk)| {
        store_blob(ctx, &b, key, &data, chunk)
    })?;
    let b = blobs.clone();
    engine.register_with_bulk::<BlobGet>(move |ctx, (key, into, offset)| {
        let bytes = blob(&b, &key)?;
        let len = bytes.len() as u64;
        let local = ctx.expose(vec![bytes], na_core::Access::ReadOnly)?;
        ctx.transfer(hg_rpc::BulkOp::Push, &into, offset, &local, 0, len)?;
        Ok(len)
    })?;
    let exposed: Arc<std::sync::Mutex<std::collections::HashMap<String, hg_rpc::Bulk>>> = Arc::default();
    let (b, x) = (blobs.clone(), exposed.clone());
    engine.register_with_bulk::<BlobExpose>(move |ctx, (key, segment)| {
        let bytes = blob(&b, &key)?;
        // The segment size is the client's word: a handle names at most
        // MAX_REMOTE_SEGMENTS, refused before a vector is made for each.
        let segment = segment.max(1);
        let count = (bytes.len() as u64).div_ceil(segment);
        if count > na_core::MAX_REMOTE_SEGMENTS as u64 {
            return Err(format!(
                "{} bytes in segments of {segment}: at most {} segments",
                bytes.len(),
                na_core::MAX_REMOTE_SEGMENTS
            ));
        }
        let segs = bytes.chunks(segment as usize).map(<[u8]>::to_vec).collect();
        let handle = ctx.expose(segs, na_core::Access::ReadWrite)?;
        x.lock().map_err(|_| "poisoned")?.insert(key, handle.clone());
        Ok(handle)
    })?;
    let x = exposed.clone();
    engine.register::<BlobExposedDigest>(move |key| {
        let x = x.lock().map_err(|_| "poisoned")?;
        let bytes = x.get(&key).and_then(|h| h.local()).ok_or("not exposed")?.to_vec();
        Ok((bytes.len() as u64, fnv(&bytes)))
    })?;
    engine.register::<Count>(move |()| Ok((records.load(Ordering::Relaxed), sum.load(Ordering::Relaxed))))?;
    let q = quit.clone();
    engine.register::<Quit>(move |()| {
        q.store(true, Ordering::Relaxed);
        Ok(())
    })?;
    println!("ADDR {}", engine.self_addr());
    let mut last = Instant::now();
    while !quit.load(Ordering::Relaxed) {
        engine.progress(Some(Duration::from_millis(200)))?;
        if engine.trigger()? > 0 {
            last = Instant::now();
        }
        if let Ok(mut snap) = snapshot.lock() {
            *snap = (echoes.load(Ordering::Relaxed), engine.stats().exposed_outputs);
        }
        if last.elapsed() > Duration::from_secs(60) {
            eprintln!("hg-rpc-testpeer: idle for 60 s, exiting");
            std::process::exit(3);
        }
    }
    // Let the Quit response go out.
    let end = Instant::now() + Duration::from_millis(200);
    while Instant::now() < end {
        engine.progress(Some(Duration::from_millis(20)))?;
        engine.trigger()?;
    }
    Ok(())
}

/// The largest blob `BlobPut` stores (and `Fill` answers).
const MAX_BLOB: u64 = 64 << 20;

/// The most chunks `BlobPutChunked` pulls a blob in (a span of 24 bytes
/// each is listed first).
const MAX_CHUNKS: u64 = 1 << 20;

/// The blob store, by key.
type Blobs = std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>;

/// A copy of the blob stored under `key`.
fn blob(blobs: &Blobs, key: &str) -> Result<Vec<u8>, String> {
    let blobs = blobs.lock().map_err(|_| "poisoned")?;
    blobs.get(key).cloned().ok_or_else(|| "no such blob".into())
}

/// Pulls `data` in chunks of `chunk` bytes, started as one batch, last
/// chunk first; stores it under `key` and answers its hash.
fn store_blob(
    ctx: &mut hg_rpc::BulkCtx<'_>,
    blobs: &Blobs,
    key: String,
    data: &hg_rpc::Bulk,
    chunk: u64,
) -> Result<u64, String> {
    if chunk == 0 {
        return Err("chunk size 0".into());
    }
    // The size is the client's word: checked before anything is allocated.
    let size = data.size();
    if size > MAX_BLOB {
        return Err(format!("a blob of {size} bytes: at most {MAX_BLOB}"));
    }
    // As is the chunk size: one span each, listed before anything moves.
    if size.div_ceil(chunk) > MAX_CHUNKS {
        return Err(format!(
            "{size} bytes in chunks of {chunk}: at most {MAX_CHUNKS} chunks"
        ));
    }
    let local = ctx.expose(vec![vec![0; size as usize]], na_core::Access::ReadWrite)?;
    let spans: Vec<hg_rpc::Span> = (0..size.div_ceil(chunk))
        .rev()
        .map(|i| hg_rpc::Span {
            remote_offset: i * chunk,
            local_offset: i * chunk,
            len: chunk.min(size - i * chunk),
        })
        .collect();
    ctx.transfer_batch(hg_rpc::BulkOp::Pull, data, &local, &spans)?;
    let bytes = local.local().ok_or("not local")?.to_vec();
    let sum = fnv(&bytes);
    blobs.lock().map_err(|_| "poisoned")?.insert(key, bytes);
    Ok(sum)
}
