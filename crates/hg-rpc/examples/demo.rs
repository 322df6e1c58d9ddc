//! The main job: a small key-value store served over shared memory.
//!
//! The client starts the server (this binary with `serve`), then: makes
//! 20,000 small RPCs (`add`) one at a time and reports the round trip;
//! stores 16 blobs of 4 MiB (`put`: the input spills, the server pulls it
//! with one-sided RMA), reads them back (`get`: the output spills, the
//! client pulls it), verifies checksums, and reports bandwidth. It does
//! that in several passes (`--passes N`, default 4), each overwriting every blob with new
//! contents, and reports the first pass apart from the later ones: the
//! first pass also pays for memory the processes never touched before
//! (page faults, which are slow in a VM), the later ones reuse it, as a
//! long-running service does.
//!
//! Run: `./x demo`, or `cargo run --release -p hg-rpc --example demo`.

use std::collections::HashMap;
use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{Engine, Rpc, RpcError};
use na_core::ProgressMode;
use na_sm::SmConfig;
use serde_bytes::ByteBuf;

type Res<T> = Result<T, Box<dyn Error>>;

#[path = "../src/bin/shared/exit.rs"]
mod exit;
const T: Duration = Duration::from_secs(20);

#[path = "shared/server.rs"]
mod server;
use server::ServerProcess;

/// The largest blob either side takes (the engines' spill bound): a
/// bigger input or output is refused by the engine before it allocates.
const MAX_BLOB: u64 = 256 << 20;

struct Add;
impl Rpc for Add {
    const NAME: &'static str = "demo.add";
    type Input = (u64, u64);
    type Output = u64;
}

struct Put;
impl Rpc for Put {
    const NAME: &'static str = "demo.put";
    type Input = (String, ByteBuf);
    type Output = u64;
}

struct Get;
impl Rpc for Get {
    const NAME: &'static str = "demo.get";
    type Input = String;
    type Output = Blob;
}

/// A stored blob, shared: the server answers a `get` without copying the
/// blob first (the response's encoding is the one copy). Encoded as one
/// byte string, like a `ByteBuf`.
#[derive(Clone)]
struct Blob(Arc<ByteBuf>);

impl serde::Serialize for Blob {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for Blob {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        ByteBuf::deserialize(d).map(|b| Blob(Arc::new(b)))
    }
}

/// Default passes of put + get over all blobs; the first is reported on
/// its own.
const PASSES: usize = 4;

/// The `--passes N` argument (at least 2: the first pass is reported apart
/// from the rest).
fn passes() -> Res<usize> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [] => Ok(PASSES),
        [flag, n] if flag == "--passes" => match n.parse::<usize>() {
            Ok(p) if p >= 2 => Ok(p),
            _ => Err(format!("--passes takes a whole number of at least 2, not {n:?}").into()),
        },
        other => Err(format!("usage: demo [--passes N]; got {other:?}").into()),
    }
}

struct Stat;
impl Rpc for Stat {
    const NAME: &'static str = "demo.stat";
    type Input = ();
    type Output = (u64, u64);
}

struct Quit;
impl Rpc for Quit {
    const NAME: &'static str = "demo.quit";
    type Input = ();
    type Output = ();
}

fn engine(listen: bool) -> Res<Engine> {
    let cfg = SmConfig {
        listen,
        ..SmConfig::default()
    };
    Ok(Engine::shared_memory(cfg, ProgressMode::default())?)
}

fn checksum(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn serve() -> Res<()> {
    use std::sync::Mutex;
    server::exit_with_parent()?;
    let mut e = engine(true)?;
    e.set_max_spill(MAX_BLOB);
    // Blobs are `ByteBuf`s: serde then encodes them as one byte string
    // (a memcpy) instead of a sequence of single bytes.
    let store: Arc<Mutex<HashMap<String, Blob>>> = Arc::default();
    let quit = Arc::new(Mutex::new(false));
    e.register::<Add>(|(a, b)| Ok(a.wrapping_add(b)))?;
    let s = store.clone();
    e.register::<Put>(move |(key, data)| {
        let len = data.len() as u64;
        // The old blob (if any) is dropped here: its memory serves the next.
        s.lock()
            .map_err(|_| "store poisoned")?
            .insert(key, Blob(Arc::new(data)));
        Ok(len)
    })?;
    let s = store.clone();
    e.register::<Get>(move |key| {
        let s = s.lock().map_err(|_| "store poisoned")?;
        s.get(&key).cloned().ok_or_else(|| format!("no key {key:?}"))
    })?;
    let s = store.clone();
    e.register::<Stat>(move |()| {
        let s = s.lock().map_err(|_| "store poisoned")?;
        Ok((s.len() as u64, s.values().map(|v| v.0.len() as u64).sum()))
    })?;
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
    let end = Instant::now() + Duration::from_millis(200);
    while Instant::now() < end {
        e.progress(Some(Duration::from_millis(20)))?;
        e.trigger()?;
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    exit::run("demo", run)
}

fn run() -> Res<()> {
    if std::env::args().nth(1).as_deref() == Some("serve") {
        return serve();
    }
    let passes = passes()?;
    // Killed if the client gives up before it exits.
    let server = ServerProcess::start(&["serve"])?;
    let uri = server.addr()?.to_owned();
    let mut c = engine(false)?;
    c.set_max_spill(MAX_BLOB);
    let srv = c.endpoint().lookup(&uri)?;
    println!("server {uri} (pid {}), client {}", server.id(), c.self_addr());

    let n = 20_000u64;
    let mut rtts = Vec::with_capacity(n as usize);
    let t = Instant::now();
    for i in 0..n {
        let t0 = Instant::now();
        let r = c.call::<Add>(&srv, &(i, 1), T)?;
        if r != i + 1 {
            return Err(format!("add({i}, 1) returned {r}").into());
        }
        rtts.push(t0.elapsed().as_nanos() as u64);
    }
    let secs = t.elapsed().as_secs_f64();
    rtts.sort_unstable();
    println!(
        "rpc add: {n} calls, {:.0} calls/s, median round trip {:.2} us, p99 {:.2} us",
        n as f64 / secs,
        rtts[rtts.len() / 2] as f64 / 1e3,
        rtts[rtts.len() * 99 / 100] as f64 / 1e3
    );

    let (blobs, size) = (16usize, 4usize << 20);
    let mib = (blobs * size) as f64 / f64::from(1 << 20);
    let (mut put_rates, mut get_rates) = (Vec::new(), Vec::new());
    for pass in 0..passes {
        let (put, get) = blob_pass(&mut c, &srv, pass, blobs, size)?;
        put_rates.push(mib / put);
        get_rates.push(mib / get);
    }
    let later = |v: &[f64]| {
        let mut l = v[1..].to_vec();
        l.sort_by(f64::total_cmp);
        l[l.len() / 2]
    };
    println!(
        "put: {blobs} blobs of {} MiB per pass (input spilled, server pulls): first pass {:.0} MiB/s, \
         later passes (median of {}) {:.0} MiB/s",
        size >> 20,
        put_rates[0],
        passes - 1,
        later(&put_rates)
    );
    println!(
        "get: {blobs} blobs per pass (output spilled, client pulls): first pass {:.0} MiB/s, \
         later passes {:.0} MiB/s; every checksum of every pass verified",
        get_rates[0],
        later(&get_rates)
    );
    let (keys, bytes) = c.call::<Stat>(&srv, &(), T)?;
    println!("stat: {keys} keys, {} MiB stored", bytes >> 20);
    match c.call::<Get>(&srv, &"missing".to_string(), T) {
        Err(RpcError::Handler { message, .. }) if message.contains("no key \"missing\"") => {
            println!("get of a missing key: refused as expected ({message})")
        }
        Err(e) => {
            return Err(format!(
                "get of a missing key: expected the handler's error, got {}",
                na_core::ErrorChain(&e)
            )
            .into())
        }
        Ok(_) => return Err("a missing key returned data".into()),
    }
    c.call::<Quit>(&srv, &(), T)?;
    let status = server.wait_ok()?;
    println!("server exited: {status}; client stats: {:?}", c.stats());
    Ok(())
}

/// One pass: stores `blobs` blobs of `size` bytes whose contents depend on
/// `pass` (each pass overwrites the last), reads them back and verifies
/// every checksum. Returns the seconds spent in puts and in gets.
fn blob_pass(c: &mut Engine, srv: &na_core::Addr, pass: usize, blobs: usize, size: usize) -> Res<(f64, f64)> {
    let data: Vec<Vec<u8>> = (0..blobs)
        .map(|b| {
            (0..size)
                .map(|i| (i * 31 + b * 7 + pass * 13 + i / 4096) as u8)
                .collect()
        })
        .collect();
    let sums: Vec<u64> = data.iter().map(|d| checksum(d)).collect();
    let inputs: Vec<(String, ByteBuf)> = data
        .into_iter()
        .enumerate()
        .map(|(b, d)| (format!("blob-{b}"), ByteBuf::from(d)))
        .collect();
    let t = Instant::now();
    for input in &inputs {
        let len = c.call::<Put>(srv, input, T)?;
        if len != size as u64 {
            return Err(format!("server stored {} with {len} bytes", input.0).into());
        }
    }
    let put_secs = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut back = Vec::with_capacity(blobs);
    for (key, _) in &inputs {
        back.push(c.call::<Get>(srv, key, T)?);
    }
    let get_secs = t.elapsed().as_secs_f64();
    // Verified outside the timed loops: every byte, by checksum.
    for (b, (got, sum)) in back.iter().zip(&sums).enumerate() {
        if got.0.len() != size || checksum(&got.0) != *sum {
            return Err(format!("blob-{b} of pass {pass} read back corrupted").into());
        }
    }
    Ok((put_secs, get_secs))
}
