//! A small storage service on hg-rpc + hg-bulk.
//!
//! * `put(key, bulk)`: the server **pulls** the blob from the client's
//!   memory (one-sided), stores it, and answers its checksum;
//! * `get(key, bulk)`: the server **pushes** the blob into the client's
//!   buffer and answers its length;
//! * `stat(key)`: length and checksum; `delete(key)`.
//!
//! Blobs are at most [`blob::MAX_BLOB`] bytes: a bigger put is refused
//! before the server allocates anything.
//!
//! The client stores blobs made of several segments, reads them back into
//! differently split buffers, and verifies every checksum.
//! Run: `cargo run --release -p hg-rpc --example blobstore [-- --transport SPEC]`
//! (default `sm://`; `verbs://rxe0/10.77.0.1:0` over RDMA). The client
//! starts its own server process, unless given one that runs already
//! (`blobstore serve [SPEC]` prints its address): `-- --connect ADDR`
//! (then the server is left running). A server that answers wrong data
//! or checksums makes the client fail with an error that names the blob.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hg_rpc::{Access, BulkOp, Engine, ProgressMode, RpcError};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[path = "../src/bin/shared/exit.rs"]
mod exit;
const T: Duration = Duration::from_secs(20);

#[path = "shared/blob.rs"]
mod blob;
use blob::{checked_size, checksum, Delete, Get, Put, Quit, Stat};

#[path = "shared/server.rs"]
mod server;
use server::ServerProcess;

/// An engine on the transport of `spec` (`sm://` by default).
fn engine(spec: &str, listen: bool) -> Res<Engine> {
    Ok(Engine::from_spec(spec, listen, ProgressMode::default())?)
}

type Store = Arc<Mutex<HashMap<String, Vec<u8>>>>;

fn serve(spec: &str) -> Res<()> {
    server::exit_with_parent()?;
    let mut e = engine(spec, true)?;
    let store: Store = Arc::default();
    let quit = Arc::new(Mutex::new(false));
    let s = store.clone();
    e.register_with_bulk::<Put>(move |ctx, (key, blob)| {
        let size = checked_size(blob.size())?;
        let local = ctx.expose(vec![vec![0; size]], Access::WriteOnly)?;
        ctx.transfer(BulkOp::Pull, &blob, 0, &local, 0, blob.size())?;
        // One buffer exposed, one back: no copy.
        let mut bufs = local.try_into_buffers()?;
        let data = bufs.pop().ok_or("no buffer")?;
        let sum = checksum(&data);
        s.lock().map_err(|_| "store poisoned")?.insert(key, data);
        Ok(sum)
    })?;
    let s = store.clone();
    e.register_with_bulk::<Get>(move |ctx, (key, into)| {
        let data = s.lock().map_err(|_| "store poisoned")?.get(&key).cloned();
        let data = data.ok_or_else(|| format!("no blob {key:?}"))?;
        let len = data.len() as u64;
        let local = ctx.expose(vec![data], Access::ReadOnly)?;
        ctx.transfer(BulkOp::Push, &into, 0, &local, 0, len)?;
        Ok(len)
    })?;
    let s = store.clone();
    e.register::<Stat>(move |key| {
        let s = s.lock().map_err(|_| "store poisoned")?;
        Ok(s.get(&key).map(|d| (d.len() as u64, checksum(d))))
    })?;
    let s = store.clone();
    e.register::<Delete>(move |key| Ok(s.lock().map_err(|_| "store poisoned")?.remove(&key).is_some()))?;
    let q = quit.clone();
    e.register::<Quit>(move |()| {
        *q.lock().map_err(|_| "poisoned")? = true;
        Ok(())
    })?;
    println!("ADDR {}", e.self_addr());
    while !*quit.lock().map_err(|_| "poisoned")? {
        e.progress(Some(Duration::from_millis(500)))?;
        e.trigger()?;
    }
    // Drain: take no more requests, and drive the engine until the
    // answers it owes (Quit's) have left, at most T.
    e.begin_drain();
    let end = std::time::Instant::now() + T;
    while !e.drained() && std::time::Instant::now() < end {
        e.progress(Some(Duration::from_millis(10)))?;
        e.trigger()?;
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    exit::run("blobstore", run)
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("serve") {
        return serve(args.get(1).map_or("sm://", String::as_str));
    }
    let (spec, connect) = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        [] => ("sm://".to_owned(), None),
        ["--transport", spec] => (spec.to_owned(), None),
        ["--connect", addr] => ("sm://".to_owned(), Some(addr.to_owned())),
        ["--transport", spec, "--connect", addr] => (spec.to_owned(), Some(addr.to_owned())),
        _ => {
            let schemes = hg_rpc::transport::schemes().join(", ");
            return Err(format!(
                "usage: blobstore [--transport SPEC] [--connect ADDR]  (schemes: {schemes})"
            )
            .into());
        }
    };
    // Ours is killed if the client gives up before it exits.
    let (child, addr) = match connect {
        Some(addr) => (None, addr),
        None => {
            let child = ServerProcess::start(&["serve", &spec])?;
            let addr = child.addr()?.to_owned();
            (Some(child), addr)
        }
    };
    let mut c = engine(&spec, false)?;
    let srv = c.lookup(&addr)?;
    for (i, parts) in [vec![3usize << 20], vec![1000, 250_000, 17, 2 << 20], vec![100]]
        .iter()
        .enumerate()
    {
        let key = format!("blob-{i}");
        let segs: Vec<Vec<u8>> = parts
            .iter()
            .enumerate()
            .map(|(s, &n)| (0..n).map(|j| (j * 31 + s * 7 + i) as u8).collect())
            .collect();
        let whole = segs.concat();
        let blob = c.expose(segs, Access::ReadOnly)?;
        let sum = c.call::<Put>(&srv, &(key.clone(), blob), T)?;
        if sum != checksum(&whole) {
            return Err(format!("the server stored {key} with another checksum ({sum:#018x})").into());
        }
        // Read it back into two uneven buffers.
        let half = whole.len() / 3;
        let into = c.expose(
            vec![vec![0; half], vec![0; whole.len() - half]],
            Access::WriteOnly,
        )?;
        let len = c.call::<Get>(&srv, &(key.clone(), into.clone()), T)?;
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
        let stat = c.call::<Stat>(&srv, &key, T)?;
        if stat != Some((whole.len() as u64, sum)) {
            return Err(format!("stat of {key} is wrong: {stat:?}").into());
        }
    }
    if !c.call::<Delete>(&srv, &"blob-1".to_string(), T)? {
        return Err("delete of blob-1 found nothing".into());
    }
    let stat = c.call::<Stat>(&srv, &"blob-1".to_string(), T)?;
    if stat.is_some() {
        return Err(format!("stat of the deleted blob-1 found {stat:?}").into());
    }
    let missing = c.expose(vec![vec![0; 10]], Access::WriteOnly)?;
    match c.call::<Get>(&srv, &("blob-1".to_string(), missing), T) {
        Err(RpcError::Handler { message, .. }) if message.contains("no blob \"blob-1\"") => {
            println!("get of a deleted blob: refused ({message})")
        }
        other => {
            return Err(format!("get of a deleted blob: expected the handler's error, got {other:?}").into())
        }
    }
    // A server we were given is not ours to stop.
    if let Some(child) = child {
        c.call::<Quit>(&srv, &(), T)?;
        child.wait_ok()?;
    }
    Ok(())
}
