//! hg-soak: a long-running soak of hg-rpc over shared memory (not a test:
//! the test suite runs it for a few seconds; run it for hours by hand).
//!
//! ```text
//! hg-soak [--secs 600] [--clients 4] [--kill-every-ms 1500] [--seed 1]
//! ```
//!
//! It starts one server (`hg-rpc-testpeer`) and keeps `--clients` client
//! processes running against it. Each client loops over random calls and
//! checks every answer: sums, echoes of up to 1 MiB (spilled both ways),
//! digests, blobs stored with batched pulls in random chunks and read back
//! by push, handler errors and timeouts. Every `--kill-every-ms` one client
//! is killed with SIGKILL, mid-call, and replaced. At the end the server
//! must still answer, its descriptor count must be back to its start (every
//! dead client's socket, memory and wake-up descriptors closed) and its
//! memory must not have grown beyond the bounded blob store. Any wrong
//! answer, hang (a call past its timeout) or leak is a non-zero exit.
#![warn(missing_docs)]
#![warn(clippy::missing_docs_in_private_items)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use hg_rpc::{BulkOp, Engine, RpcError};
use na_core::{Access, Endpoint, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};
use serde_bytes::ByteBuf;

#[path = "testpeer/rpcs.rs"]
#[allow(dead_code)]
mod testpeer_rpcs;
use testpeer_rpcs::*;

/// What the soak's steps return: any error ends the run with it.
type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[path = "shared/exit.rs"]
mod exit;

/// Bound of every call: a call that takes longer is a hang.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the server's descriptors and memory are printed.
const REPORT_EVERY: Duration = Duration::from_secs(10);
/// Blob keys per client: the server's store stays bounded.
const KEYS: u64 = 4;
/// Largest blob and echo.
const MAX_LEN: usize = 1 << 20;
/// Server memory growth (kB) allowed over the run: the blob store holds at
/// most clients x KEYS blobs of MAX_LEN; this is that plus allocator slack.
fn rss_allowance_kb(clients: usize) -> u64 {
    (clients as u64 * KEYS * MAX_LEN as u64 * 2) / 1024 + 64 * 1024
}

/// Soak of hg-rpc over shared memory: random verified calls, clients killed mid-call, leak checks
#[derive(Parser)]
struct Cli {
    /// How long to run.
    #[arg(long, default_value_t = 600)]
    secs: u64,
    /// Client processes kept running.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Kill one client (SIGKILL) this often, in milliseconds.
    #[arg(long, default_value_t = 1500)]
    kill_every_ms: u64,
    /// Seed of the clients' random choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Internal: run as client number `SLOT` of `URI` for `SECS` seconds.
    #[arg(long, num_args = 3, value_names = ["URI", "SECS", "SLOT"], hide = true)]
    client: Option<Vec<String>>,
}

/// xorshift64*: reproducible choices without a dependency.
struct Rng(u64);
impl Rng {
    /// The next random number.
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// A random number below `n` (0 for `n` 0).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// Random bytes, of a random length in `lo..hi`.
    fn bytes(&mut self, lo: usize, hi: usize) -> Vec<u8> {
        let n = lo as u64 + self.below((hi - lo) as u64);
        let salt = self.next();
        (0..n)
            .map(|i| (i.wrapping_mul(31) ^ salt ^ (i >> 9)) as u8)
            .collect()
    }
}

/// One client process: random verified calls until `secs` pass. Its blobs
/// are keyed by its slot, which a replacement reuses only after it died.
fn client(uri: &str, secs: u64, slot: u64, seed: u64) -> Res<()> {
    let mut c = Engine::from_spec("sm://", false, ProgressMode::default())?;
    c.set_max_spill(4 * MAX_LEN as u64);
    let s = c.endpoint().lookup(uri)?;
    let mut rng = Rng(seed | 1);
    let end = Instant::now() + Duration::from_secs(secs);
    let mut ops = 0u64;
    while Instant::now() < end {
        match rng.below(20) {
            0..=4 => {
                let (a, b) = (rng.below(1 << 40), rng.below(1 << 40));
                check(c.call::<Add>(&s, &(a, b), CALL_TIMEOUT)? == a + b, "add")?;
            }
            5..=8 => {
                let v = ByteBuf::from(rng.bytes(0, MAX_LEN));
                check(c.call::<Echo>(&s, &v, CALL_TIMEOUT)? == v, "echo")?;
            }
            9..=11 => {
                let v = ByteBuf::from(rng.bytes(0, 64 << 10));
                check(
                    c.call::<Digest>(&s, &v, CALL_TIMEOUT)? == (v.len() as u64, fnv(&v)),
                    "digest",
                )?;
            }
            12..=15 => {
                let key = format!("{slot}-{}", rng.below(KEYS));
                // Larger than an inline handle: the server must pull it from
                // this (live) process, so a killed client's put stores nothing.
                let data = rng.bytes(hg_bulk::INLINE_MAX + 1, MAX_LEN);
                let chunk = 1 + rng.below(256 << 10);
                let bulk = c.expose(vec![data.clone()], Access::ReadOnly)?;
                let sum = c.call::<BlobPutChunked>(&s, &(key.clone(), bulk, chunk), CALL_TIMEOUT)?;
                check(sum == fnv(&data), "blob put")?;
                let into = c.expose(vec![vec![0; data.len() + 8]], Access::ReadWrite)?;
                let len = c.call::<BlobGet>(&s, &(key, into.clone(), 8), CALL_TIMEOUT)?;
                let mut back = vec![0; data.len()];
                into.local().ok_or("not local")?.read_at(8, &mut back)?;
                check(len == data.len() as u64 && back == data, "blob get")?;
            }
            16 | 17 => match c.call::<Fail>(&s, &"no".to_string(), CALL_TIMEOUT) {
                Err(RpcError::Handler { .. }) => {}
                other => return Err(format!("fail: expected a handler error, got {other:?}").into()),
            },
            // The server's only thread sleeps: keep it short and rare.
            18 => match c.call::<Sleep>(&s, &10, Duration::from_millis(2)) {
                Err(RpcError::Timeout { .. }) => {}
                other => return Err(format!("sleep: expected a timeout, got {other:?}").into()),
            },
            _ => {
                // A local transfer through the bulk layer, checked.
                let v = rng.bytes(1, 1 << 16);
                let src = c.expose(vec![v.clone()], Access::ReadOnly)?;
                let dst = c.expose(vec![vec![0; v.len()]], Access::ReadWrite)?;
                c.bulk(BulkOp::Pull, &src, 0, &dst, 0, v.len() as u64, CALL_TIMEOUT)?;
                check(dst.local().ok_or("not local")?.to_vec() == v, "local bulk")?;
            }
        }
        ops += 1;
    }
    println!("CLIENT OK {ops}");
    Ok(())
}

/// An error naming `what` unless `ok`.
fn check(ok: bool, what: &str) -> Res<()> {
    if ok {
        Ok(())
    } else {
        Err(format!("{what}: wrong answer").into())
    }
}

/// Open descriptors of process `pid`.
fn fd_count(pid: u32) -> Res<usize> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?.count())
}

/// Resident set of process `pid`, in kB.
fn rss_kb(pid: u32) -> Res<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| "no VmRSS in /proc status".into())
}

/// The binary `name` next to this one.
fn sibling(name: &str) -> Res<PathBuf> {
    let p = std::env::current_exe()?.with_file_name(name);
    if !p.exists() {
        return Err(format!("{} not found: build hg-rpc's binaries first", p.display()).into());
    }
    Ok(p)
}

/// Starts client process `slot` of the server at `uri` for `secs`
/// seconds, its choices seeded by `seed`, its sm directory `dir`.
fn spawn_client(uri: &str, secs: u64, slot: usize, seed: u64, dir: &Path) -> Res<Child> {
    Ok(Command::new(std::env::current_exe()?)
        .args([
            "--seed",
            &seed.to_string(),
            "--client",
            uri,
            &secs.to_string(),
            &slot.to_string(),
        ])
        .env("QS_SM_DIR", dir)
        .stdout(Stdio::piped())
        .spawn()?)
}

/// Waits for a client that was not killed; it must have succeeded.
fn reap(mut child: Child) -> Res<u64> {
    let status = child.wait()?;
    let mut out = String::new();
    if let Some(o) = child.stdout.take() {
        BufReader::new(o).read_line(&mut out)?;
    }
    if !status.success() {
        return Err(format!("a client failed ({status}): {out}").into());
    }
    Ok(out
        .trim()
        .strip_prefix("CLIENT OK ")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0))
}

fn main() -> std::process::ExitCode {
    exit::run("hg-soak", run)
}

/// Parses the command line and runs a client, or the soak with its
/// server.
fn run() -> Res<()> {
    let cli = Cli::parse();
    if let Some(args) = &cli.client {
        return client(&args[0], args[1].parse()?, args[2].parse()?, cli.seed);
    }
    let dir = std::env::temp_dir().join(format!("hg-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    let mut server = Command::new(sibling("hg-rpc-testpeer")?)
        .env("QS_SM_DIR", &dir)
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(server.stdout.take().ok_or("no server stdout")?).read_line(&mut line)?;
    let uri = line
        .trim()
        .strip_prefix("ADDR ")
        .ok_or("server printed no address")?
        .to_string();
    let spid = server.id();
    let result = soak(&cli, &uri, spid, &dir);
    if let Ok(Some(status)) = server.try_wait() {
        eprintln!("hg-soak: the server exited during the soak: {status}");
        result
            .as_ref()
            .map_err(|e| eprintln!("hg-soak: {}", na_core::ErrorChain(&**e)))
            .ok();
        return Err(format!("the server exited during the soak: {status}").into());
    }
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The soak against the server at `uri` (process `spid`): clients kept
/// running and killed, then the server's descriptors and memory checked.
fn soak(cli: &Cli, uri: &str, spid: u32, dir: &Path) -> Res<()> {
    // Baseline after one client connected and left (lazy allocations done).
    reap(spawn_client(uri, 1, 0, cli.seed, dir)?)?;
    std::thread::sleep(Duration::from_millis(300));
    let (fds0, rss0) = (fd_count(spid)?, rss_kb(spid)?);
    let end = Instant::now() + Duration::from_secs(cli.secs);
    let mut seed = cli.seed;
    let mut next_seed = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        seed
    };
    let left = |end: Instant| end.saturating_duration_since(Instant::now()).as_secs().max(1);
    let mut running: Vec<(usize, Child)> = (0..cli.clients)
        .map(|slot| Ok((slot, spawn_client(uri, left(end), slot, next_seed(), dir)?)))
        .collect::<Res<_>>()?;
    let (mut kills, mut finished, mut ops) = (0u64, 0u64, 0u64);
    let mut next_kill = Instant::now() + Duration::from_millis(cli.kill_every_ms);
    let (start, mut next_report) = (Instant::now(), Instant::now() + REPORT_EVERY);
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
        if Instant::now() >= next_report {
            eprintln!(
                "hg-soak: {:>5}s server fds {} rss {} kB, {kills} killed",
                start.elapsed().as_secs(),
                fd_count(spid)?,
                rss_kb(spid)?
            );
            next_report += REPORT_EVERY;
        }
        if Instant::now() >= next_kill && Instant::now() + Duration::from_secs(2) < end {
            let victim = (next_seed() % running.len() as u64) as usize;
            let (slot, mut c) = running.swap_remove(victim);
            c.kill()?;
            c.wait()?;
            kills += 1;
            running.push((slot, spawn_client(uri, left(end), slot, next_seed(), dir)?));
            next_kill += Duration::from_millis(cli.kill_every_ms);
        }
        // A client that exited early must have failed.
        if let Some(i) = running
            .iter_mut()
            .position(|(_, c)| matches!(c.try_wait(), Ok(Some(_))))
        {
            let (slot, c) = running.swap_remove(i);
            ops += reap(c)?;
            finished += 1;
            if Instant::now() + Duration::from_secs(2) < end {
                running.push((slot, spawn_client(uri, left(end), slot, next_seed(), dir)?));
            }
        }
    }
    let deadline = Instant::now() + CALL_TIMEOUT + Duration::from_secs(5);
    for (_, mut c) in running {
        while matches!(c.try_wait(), Ok(None)) {
            if Instant::now() > deadline {
                let _ = c.kill();
                return Err("a client hung past the end of the soak".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        ops += reap(c)?;
        finished += 1;
    }
    // Every dead client's descriptors are closed once the server noticed.
    let settle = Instant::now() + Duration::from_secs(5);
    let mut fds1 = fd_count(spid)?;
    while fds1 > fds0 && Instant::now() < settle {
        std::thread::sleep(Duration::from_millis(100));
        fds1 = fd_count(spid)?;
    }
    let rss1 = rss_kb(spid)?;
    let mut ep = Endpoint::new(ProgressMode::default())?;
    let cfg = SmConfig::default().with_dir(dir);
    let id = ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))?;
    let mut probe = Engine::new(ep, id)?;
    let s = probe.endpoint().lookup(uri)?;
    let alive = probe.call::<Add>(&s, &(40, 2), CALL_TIMEOUT)? == 42;
    println!(
        "hg-soak: {}s, {finished} clients finished, {kills} killed mid-run, {ops} verified calls; \
         server fds {fds0} -> {fds1}, rss {rss0} -> {rss1} kB",
        cli.secs
    );
    if !alive {
        return Err("the server answered a wrong sum at the end".into());
    }
    if fds1 > fds0 {
        return Err(format!("server descriptors leaked: {fds0} at start, {fds1} at the end").into());
    }
    if rss1 > rss0 + rss_allowance_kb(cli.clients) {
        return Err(format!("server memory grew from {rss0} to {rss1} kB").into());
    }
    if ops == 0 {
        return Err("no client completed a call".into());
    }
    Ok(())
}
