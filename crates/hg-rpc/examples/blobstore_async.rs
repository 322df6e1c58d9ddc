//! The blob store of `blobstore.rs` with tokio: `.await` on every call,
//! async handlers that move bulk data with their caller
//! ([`AsyncEngine::register_async_with_bulk`]), and a client that stores
//! several blobs at once from concurrent tasks.
//!
//! * `put(key, bulk)`: the server's async handler **pulls** the blob from
//!   the client's memory and answers its checksum;
//! * `get(key, bulk)`: it **pushes** the blob into the client's buffer;
//! * `stat(key)`, `delete(key)`.
//!
//! The client verifies every checksum, and that the server refuses to move
//! data with a handle its caller does not own. Blobs are at most
//! [`blob::MAX_BLOB`] bytes, as in `blobstore.rs`.
//! Run: `cargo run --release -p hg-rpc --example blobstore_async`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hg_rpc::{Access, AsyncBulkCtx, AsyncEngine, Bulk, BulkOp, Engine, ProgressMode, RpcError};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;
const T: Duration = Duration::from_secs(20);

#[path = "shared/blob.rs"]
mod blob;
use blob::{checked_size, checksum, Delete, Get, Put, Quit, Stat};

#[path = "shared/server.rs"]
mod server;
use server::ServerProcess;

#[path = "../src/bin/shared/exit.rs"]
mod exit;

fn engine(listen: bool) -> Res<AsyncEngine> {
    let e = Engine::from_spec("sm://", listen, ProgressMode::default())?;
    Ok(AsyncEngine::spawn(e)?)
}

type Store = Arc<Mutex<HashMap<String, Vec<u8>>>>;

async fn put(ctx: AsyncBulkCtx, store: Store, key: String, blob: Bulk) -> Result<u64, String> {
    let size = checked_size(blob.size())?;
    let local = ctx.expose(vec![vec![0; size]], Access::WriteOnly)?;
    ctx.transfer(BulkOp::Pull, &blob, 0, &local, 0, blob.size(), T)
        .await?;
    // One buffer exposed, one back: no copy.
    let mut bufs = local.try_into_buffers()?;
    let data = bufs.pop().ok_or("no buffer")?;
    let sum = checksum(&data);
    store.lock().map_err(|_| "store poisoned")?.insert(key, data);
    Ok(sum)
}

async fn get(ctx: AsyncBulkCtx, store: Store, key: String, into: Bulk) -> Result<u64, String> {
    let data = store.lock().map_err(|_| "store poisoned")?.get(&key).cloned();
    let data = data.ok_or_else(|| format!("no blob {key:?}"))?;
    let len = data.len() as u64;
    let local = ctx.expose(vec![data], Access::ReadOnly)?;
    ctx.transfer(BulkOp::Push, &into, 0, &local, 0, len, T).await?;
    Ok(len)
}

async fn serve() -> Res<()> {
    server::exit_with_parent()?;
    let e = engine(true)?;
    let store: Store = Arc::default();
    let s = store.clone();
    e.register_async_with_bulk::<Put, _, _>(move |ctx, (key, blob)| put(ctx, s.clone(), key, blob))?;
    let s = store.clone();
    e.register_async_with_bulk::<Get, _, _>(move |ctx, (key, into)| get(ctx, s.clone(), key, into))?;
    let s = store.clone();
    e.register::<Stat>(move |key| {
        let s = s.lock().map_err(|_| "store poisoned")?;
        Ok(s.get(&key).map(|d| (d.len() as u64, checksum(d))))
    })?;
    let s = store.clone();
    e.register::<Delete>(move |key| Ok(s.lock().map_err(|_| "store poisoned")?.remove(&key).is_some()))?;
    let quit = Arc::new(tokio::sync::Notify::new());
    let q = quit.clone();
    e.register::<Quit>(move |()| {
        q.notify_one();
        Ok(())
    })?;
    println!("ADDR {}", e.self_addr());
    quit.notified().await;
    // Drain: take no more requests, and wait (at most T) until the
    // answers the engine owes (Quit's) have left.
    e.begin_drain()?;
    if !e.drained(T).await? {
        return Err(format!("the server did not drain within {T:?}").into());
    }
    Ok(())
}

/// Stores blob `i` (in `parts` segments), reads it back into two uneven
/// buffers and checks both checksums; returns its length.
async fn round_trip(c: Arc<AsyncEngine>, srv: hg_rpc::Addr, i: usize, parts: Vec<usize>) -> Res<usize> {
    let key = format!("blob-{i}");
    let segs: Vec<Vec<u8>> = parts
        .iter()
        .enumerate()
        .map(|(s, &n)| (0..n).map(|j| (j * 31 + s * 7 + i) as u8).collect())
        .collect();
    let whole = segs.concat();
    let blob = c.expose(segs, Access::ReadOnly)?;
    let sum = c.call::<Put>(&srv, &(key.clone(), blob), T).await?;
    if sum != checksum(&whole) {
        return Err(format!("server stored {key} with another checksum").into());
    }
    let half = whole.len() / 3;
    let into = c.expose(
        vec![vec![0; half], vec![0; whole.len() - half]],
        Access::WriteOnly,
    )?;
    let len = c.call::<Get>(&srv, &(key.clone(), into.clone()), T).await?;
    let back = into.try_into_buffers()?.concat();
    let ok = len as usize == whole.len() && checksum(&back) == sum;
    println!(
        "{key}: {} bytes in {} segment(s), put + get, checksum {sum:#018x} {}",
        whole.len(),
        parts.len(),
        if ok { "verified" } else { "MISMATCH" }
    );
    if !ok {
        return Err(format!("{key} read back corrupted").into());
    }
    if c.call::<Stat>(&srv, &key, T).await? != Some((whole.len() as u64, sum)) {
        return Err(format!("stat of {key} is wrong").into());
    }
    Ok(whole.len())
}

async fn client() -> Res<()> {
    // Killed if the client gives up before it exits.
    let child = ServerProcess::start(&["serve"])?;
    let c = Arc::new(engine(false)?);
    let srv = c.lookup(child.addr()?).await?;
    // Eight blobs stored and read back at once, from eight tasks.
    let started = Instant::now();
    let shapes = [
        vec![3usize << 20],
        vec![1000, 250_000, 17, 2 << 20],
        vec![100],
        vec![1 << 20, 1 << 20],
        vec![4096; 16],
        vec![5 << 20],
        vec![1],
        vec![700_000, 3],
    ];
    let mut tasks = tokio::task::JoinSet::new();
    for (i, parts) in shapes.into_iter().enumerate() {
        tasks.spawn(round_trip(c.clone(), srv.clone(), i, parts));
    }
    let mut bytes = 0;
    while let Some(r) = tasks.join_next().await {
        bytes += r??;
    }
    // Mostly checksums and copies: `./x demo` measures transfer speed.
    println!(
        "8 blobs ({:.1} MiB) stored, read back and verified from 8 tasks in {:.1} ms",
        bytes as f64 / 1048576.0,
        started.elapsed().as_secs_f64() * 1e3
    );
    if !c.call::<Delete>(&srv, &"blob-1".to_string(), T).await? {
        return Err("delete of blob-1 found nothing".into());
    }
    let missing = c.expose(vec![vec![0; 10]], Access::WriteOnly)?;
    match c.call::<Get>(&srv, &("blob-1".to_string(), missing), T).await {
        Err(RpcError::Handler { message, .. }) if message.contains("no blob \"blob-1\"") => {
            println!("get of a deleted blob: refused ({message})")
        }
        other => {
            return Err(format!("get of a deleted blob: expected the handler's error, got {other:?}").into())
        }
    }
    // A handle owned by another endpoint (a second engine of ours, not the
    // one the request comes from) is refused by the handler: a client
    // cannot aim the server's transfers at a third party.
    let other = engine(true)?;
    let theirs = other.expose(vec![vec![7; 1 << 20]], Access::ReadOnly)?;
    match c.call::<Put>(&srv, &("stolen".to_string(), theirs), T).await {
        Err(RpcError::Handler { message, .. }) if message.contains("not to the caller") => {
            println!("put with another endpoint's handle: refused ({message})")
        }
        other => return Err(format!("a handle of another endpoint was not refused: {other:?}").into()),
    }
    c.call::<Quit>(&srv, &(), T).await?;
    child.wait_ok()?;
    Ok(())
}

fn main() -> std::process::ExitCode {
    // `main` returning `Err` would print the error's `Debug` form.
    exit::run("blobstore_async", || {
        let rt = tokio::runtime::Runtime::new()?;
        let serving = std::env::args().nth(1).as_deref() == Some("serve");
        let r = rt.block_on(async {
            if serving {
                serve().await
            } else {
                client().await
            }
        });
        r.map_err(|e| -> Box<dyn std::error::Error> { e })
    })
}
