//! The story server's side (`tests/user_story.rs`): the RPCs of the
//! story and its two contexts, a blocking engine with a plain bulk handler
//! and an `AsyncEngine` with an async one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hg_rpc::{Access, AsyncEngine, Bulk, BulkOp, Engine, PluginStats, Rpc};
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use super::common::endpoint;

/// A spilled input.
pub const MIB: usize = 1 << 20;
/// Every wait of the story: generous, for a loaded 2-core machine.
pub const T: Duration = Duration::from_secs(60);
/// A [`Ping`] of this or more does not sleep.
pub const NO_SLEEP: u64 = 100_000;

/// Pull `len` bytes of `src` at `offset`, transform them ([`transform`]),
/// push the result into `dst` at `dst_offset`; answers the result's
/// checksum.
pub struct Transform;
impl Rpc for Transform {
    const NAME: &'static str = "story.transform";
    type Input = TransformReq;
    type Output = u64;
}

/// [`Transform`]'s input.
#[derive(Serialize, Deserialize)]
pub struct TransformReq {
    pub src: Bulk,
    pub offset: u64,
    pub len: u64,
    pub dst: Bulk,
    pub dst_offset: u64,
    /// At most this many milliseconds the async context waits for a
    /// [`Release`] before it pulls (a call the client drops meanwhile;
    /// the blocking context ignores it).
    pub delay_ms: u64,
}

/// Length and checksum of the input (1 MiB: it spills). A `ByteBuf`,
/// which serde encodes as one byte string (a `Vec<u8>` goes element by
/// element, slow for a megabyte in a debug build).
pub struct Digest;
impl Rpc for Digest {
    const NAME: &'static str = "story.digest";
    type Input = ByteBuf;
    type Output = (u64, u64);
}

/// Answers the context's index and the input plus one; below
/// [`NO_SLEEP`], first waits the input's milliseconds (the async context:
/// at most, until a [`Release`]) (a slow call, to be dropped while the
/// server still runs it).
pub struct Ping;
impl Rpc for Ping {
    const NAME: &'static str = "story.ping";
    type Input = u64;
    type Output = (u64, u64);
}

/// What a server context did, by its own account and by its counters.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Report {
    /// `RpcStats::handled`.
    pub handled: u64,
    /// `RpcStats::malformed` + `version_mismatches` + `sends_failed` +
    /// `responses_dropped` + `responses_replaced` + `pulls_refused` +
    /// `deferred_refused`: all 0 in a healthy run.
    pub trouble: u64,
    /// `RpcStats::bulk_in_flight`.
    pub bulk_in_flight: u64,
    /// `PluginStats::get_bytes` / `put_bytes` of the context's plugin.
    pub get_bytes: u64,
    pub put_bytes: u64,
    /// What the handlers counted: requests, bytes pulled and pushed by
    /// `Transform`, spilled `Digest` inputs.
    pub requests: u64,
    pub pulled: u64,
    pub pushed: u64,
    pub digests_spilled: u64,
}

/// Ends the async context's waits in slow calls (the client sends it once
/// it dropped them all, so that every slow call's answer comes after its
/// drop, however loaded the machine).
pub struct Release;
impl Rpc for Release {
    const NAME: &'static str = "story.release";
    type Input = ();
    type Output = ();
}

/// A context's [`Report`].
pub struct Stats;
impl Rpc for Stats {
    const NAME: &'static str = "story.stats";
    type Input = ();
    type Output = Report;
}

/// What the story's transform does to the bytes it pulled.
pub fn transform(data: &[u8]) -> Vec<u8> {
    data.iter()
        .rev()
        .map(|b| b.wrapping_mul(3).wrapping_add(1))
        .collect()
}

/// FNV-1a 64 of `data`.
pub fn checksum(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// What a context's handlers counted (shared with its stats handler).
#[derive(Default)]
struct Counted {
    requests: AtomicU64,
    pulled: AtomicU64,
    pushed: AtomicU64,
    digests_spilled: AtomicU64,
}

impl Counted {
    fn add(&self, what: &AtomicU64, n: u64) {
        what.fetch_add(n, Ordering::Relaxed);
    }

    fn report(&self, s: &hg_rpc::RpcStats, p: &PluginStats) -> Report {
        Report {
            handled: s.handled,
            trouble: s.malformed
                + s.version_mismatches
                + s.sends_failed
                + s.responses_dropped
                + s.responses_replaced
                + s.pulls_refused
                + s.deferred_refused,
            bulk_in_flight: s.bulk_in_flight,
            get_bytes: p.get_bytes,
            put_bytes: p.put_bytes,
            requests: self.requests.load(Ordering::Relaxed),
            pulled: self.pulled.load(Ordering::Relaxed),
            pushed: self.pushed.load(Ordering::Relaxed),
            digests_spilled: self.digests_spilled.load(Ordering::Relaxed),
        }
    }
}

/// The checks a handler makes on a length a client sent before it
/// allocates that much.
fn checked_len(len: u64) -> Result<usize, String> {
    match usize::try_from(len) {
        Ok(n) if n <= 4 * MIB => Ok(n),
        _ => Err(format!(
            "a transform of {len} bytes: at most {} per call",
            4 * MIB
        )),
    }
}

/// The plain handlers both contexts share.
fn ping(ctx: u64, x: u64) -> Result<(u64, u64), String> {
    if x < NO_SLEEP {
        std::thread::sleep(Duration::from_millis(x));
    }
    Ok((ctx, x + 1))
}

/// Context 0: a blocking engine on a thread of its own, its transform a
/// plain handler with a [`hg_rpc::BulkCtx`].
pub fn blocking_context(dir: &std::path::Path) -> Result<String, Box<dyn std::error::Error>> {
    let (ep, id) = endpoint(dir, true);
    let mut e = Engine::new(ep, id)?;
    let counted = Arc::new(Counted::default());
    let c = counted.clone();
    e.register_with_bulk::<Transform>(move |ctx, req| {
        c.add(&c.requests, 1);
        let n = checked_len(req.len)?;
        let local = ctx.expose(vec![vec![0; n]], Access::ReadWrite)?;
        ctx.transfer(BulkOp::Pull, &req.src, req.offset, &local, 0, req.len)?;
        c.add(&c.pulled, req.len);
        let out = transform(&local.to_vec()?);
        local.write_at(0, &out)?;
        ctx.transfer(BulkOp::Push, &req.dst, req.dst_offset, &local, 0, req.len)?;
        c.add(&c.pushed, req.len);
        Ok(checksum(&out))
    })?;
    let c = counted.clone();
    e.register::<Digest>(move |data| {
        c.add(&c.requests, 1);
        if data.len() >= MIB {
            c.add(&c.digests_spilled, 1);
        }
        Ok((data.len() as u64, checksum(&data)))
    })?;
    let c = counted.clone();
    e.register::<Ping>(move |x| {
        c.add(&c.requests, 1);
        ping(0, x)
    })?;
    // A plain handler has no way to its own engine's counters: the loop
    // publishes them after every turn.
    let published = Arc::new(Mutex::new(Report::default()));
    let p = published.clone();
    e.register::<Stats>(move |()| Ok(*p.lock().map_err(|_| "poisoned")?))?;
    let uri = e.self_addr().uri().to_owned();
    std::thread::spawn(move || loop {
        if let Err(err) = e
            .progress(Some(Duration::from_millis(50)))
            .and_then(|_| e.trigger())
        {
            eprintln!("story server context 0: {}", na_core::ErrorChain(&err));

            std::process::exit(3);
        }
        let report = counted.report(&e.stats(), &e.transport_stats());
        match published.lock() {
            Ok(mut p) => *p = report,
            Err(_) => std::process::exit(3),
        }
    });
    Ok(uri)
}

/// A slow call's wait: until `released` says so, at most `millis`.
async fn slow(mut released: tokio::sync::watch::Receiver<bool>, millis: u64) {
    let _ = tokio::time::timeout(Duration::from_millis(millis), released.wait_for(|&r| r)).await;
}

/// Context 1: an [`AsyncEngine`], its transform an async handler with an
/// [`hg_rpc::AsyncBulkCtx`].
pub fn async_context(
    dir: &std::path::Path,
    rt: &tokio::runtime::Runtime,
) -> Result<String, Box<dyn std::error::Error>> {
    let _in_rt = rt.enter();
    let (ep, id) = endpoint(dir, true);
    let engine = Arc::new(AsyncEngine::spawn(Engine::new(ep, id)?)?);
    let counted = Arc::new(Counted::default());
    let (release, released) = tokio::sync::watch::channel(false);
    let c = counted.clone();
    let r = released.clone();
    engine.register_async_with_bulk::<Transform, _, _>(move |ctx, req| {
        let (c, r) = (c.clone(), r.clone());
        async move {
            c.add(&c.requests, 1);
            let n = checked_len(req.len)?;
            if req.delay_ms > 0 {
                slow(r, req.delay_ms).await;
            }
            let local = ctx.expose(vec![vec![0; n]], Access::ReadWrite)?;
            ctx.transfer(BulkOp::Pull, &req.src, req.offset, &local, 0, req.len, T)
                .await?;
            c.add(&c.pulled, req.len);
            let out = transform(&local.to_vec()?);
            local.write_at(0, &out)?;
            ctx.transfer(BulkOp::Push, &req.dst, req.dst_offset, &local, 0, req.len, T)
                .await?;
            c.add(&c.pushed, req.len);
            Ok(checksum(&out))
        }
    })?;
    let c = counted.clone();
    engine.register_async::<Digest, _, _>(move |data| {
        let c = c.clone();
        async move {
            c.add(&c.requests, 1);
            if data.len() >= MIB {
                c.add(&c.digests_spilled, 1);
            }
            Ok((data.len() as u64, checksum(&data)))
        }
    })?;
    let c = counted.clone();
    engine.register_async::<Ping, _, _>(move |x| {
        let (c, r) = (c.clone(), released.clone());
        async move {
            c.add(&c.requests, 1);
            if x < NO_SLEEP {
                slow(r, x).await;
            }
            Ok((1, x + 1))
        }
    })?;
    let c = counted.clone();
    engine.register_async::<Release, _, _>(move |()| {
        c.add(&c.requests, 1);
        release.send_replace(true);
        async { Ok(()) }
    })?;
    let weak = Arc::downgrade(&engine);
    engine.register_async::<Stats, _, _>(move |()| {
        let (weak, c) = (weak.clone(), counted.clone());
        async move {
            let e = weak.upgrade().ok_or("the engine is gone")?;
            Ok(c.report(&e.stats(), &e.transport_stats()))
        }
    })?;
    let uri = engine.self_addr().uri().to_owned();
    // Served until the process exits.
    std::mem::forget(engine);
    Ok(uri)
}
