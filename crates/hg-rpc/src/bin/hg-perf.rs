//! hg-perf: RPC rate, latency and bulk bandwidth of hg-rpc (a benchmark,
//! not a test). Starts its own server process unless `--addr` is given.
//!
//! ```text
//! hg-perf rate [--sizes 0,8,1K,4K,64K] [--inflight 1,16] [--floors] [--idle-clients 0]
//! hg-perf lat  [--sizes 0,8,1K] [--floors]   (--floors: ratio to the eventfd round trip, via na-perf)
//! hg-perf bw   [--op read,write] [--sizes 4K,64K,1M,16M] [--count 64] [--floors]
//! common: --mode busy,adaptive,blocking (also tokio, tokio-adaptive)  --json  --cpu A,B
//!         --transport sm://  --addr URI  --batch-ms 200  --batches 7
//! ```
#![warn(missing_docs)]
#![warn(clippy::missing_docs_in_private_items)]

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use hg_rpc::{Bulk, BulkCtx, BulkOp, Engine, Span};
use na_core::sys::affinity;
use na_core::{Access, ProgressMode};
use serde_bytes::ByteBuf;

#[path = "hgperf/floor.rs"]
mod floor;
#[path = "hgperf/rpcs.rs"]
mod rpcs;
#[path = "hgperf/tokio_runs.rs"]
mod tokio_runs;
use rpcs::*;

/// What the benchmark's steps return: any error ends the run with it.
type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[path = "shared/exit.rs"]
mod exit;
/// Bound of every call and wait: past it the run fails (a hang, not a
/// slow figure).
const T: Duration = Duration::from_secs(30);
/// Bytes of the client's and the server's bw buffers: one RPC's transfers
/// never reach beyond them.
const BW_SPAN: u64 = 16 << 20;
/// Most bytes one bw RPC moves when it carries several transfers, so that
/// the memory touched stays about the size of one transfer of 1 MiB (the
/// size of na-perf's raw `process_vm_readv` floor buffer at that size):
/// batching then changes the number of calls, not which cache level the
/// copy runs from.
const BW_BATCH_BYTES: u64 = 1 << 20;

/// hg-rpc benchmark: RPC rate, latency and bulk bandwidth over any NA transport
#[derive(Parser)]
struct Cli {
    /// The test to run.
    #[command(subcommand)]
    test: Test,
    /// Progress modes (comma-separated: busy, adaptive, blocking; `rate`
    /// and `lat` also take tokio: calls awaited through `AsyncEngine`,
    /// whose driver sleeps whenever idle, against a blocking server; and
    /// tokio-adaptive: the same with a driver that keeps polling for the
    /// default adaptive window after work (`AsyncEngine::spawn_with_spin`),
    /// against an adaptive server; `bw` takes both too: the client moves
    /// the data itself with `AsyncEngine::bulk`, see `bw`).
    #[arg(long, global = true, default_value = "busy,adaptive,blocking")]
    mode: String,
    /// One JSON object per result line instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// Pin the client to CPU A and the server to CPU B (`--cpu 0,1`).
    #[arg(long, global = true)]
    cpu: Option<String>,
    /// Transport spec for both sides: `sm://` (default) or, over RDMA,
    /// `verbs://DEVICE/IP:0` (e.g. `verbs://rxe0/10.77.0.1:0`).
    #[arg(long, global = true, default_value = "sm://")]
    transport: String,
    /// Address of a running `hg-perf serve` (otherwise one is started).
    #[arg(long, global = true)]
    addr: Option<String>,
    /// Length of one timed batch, in milliseconds (at least 1).
    #[arg(long, global = true, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..))]
    batch_ms: u64,
    /// Timed batches per figure (the median is reported; at least 1).
    #[arg(long, global = true, default_value_t = 7, value_parser = at_least_one)]
    batches: usize,
}

/// The tests (and the hidden server side).
#[derive(Subcommand)]
enum Test {
    /// RPCs per second with a payload of each size, N in flight.
    Rate {
        /// Payload sizes in bytes, comma-separated; a `K` (KiB) or `M`
        /// (MiB) suffix, upper case, multiplies.
        #[arg(long, default_value = "0,8,1K,4K,64K")]
        sizes: String,
        /// Calls kept in flight, comma-separated counts of at least 1 (each
        /// size is measured with each).
        #[arg(long, default_value = "1,16")]
        inflight: String,
        /// Also measure, before and after, the ceilings of a busy rate with
        /// one call in flight (na-perf's shared-flag and NA 8-byte
        /// ping-pongs: `rate_ceiling_flag`, `rate_ceiling_na` with posted
        /// receives, and `rate_ceiling_na_pull` on hg-rpc's own pull path,
        /// the one that bounds it) and print each
        /// busy one-in-flight rate's ratio to them (`rate_vs_*`, against
        /// the mean of before and after), for payloads of at most 8 bytes
        /// (what the ceilings carry). Needs na-perf next to hg-perf.
        #[arg(long)]
        floors: bool,
        /// Connect this many more clients to the server first (each makes
        /// one call, then stays connected and idle): what a server with
        /// many clients pays for the ones that are quiet.
        #[arg(long, default_value_t = 0)]
        idle_clients: usize,
    },
    /// Round-trip latency percentiles, one call in flight.
    Lat {
        /// Payload sizes in bytes, comma-separated; a `K` (KiB) or `M`
        /// (MiB) suffix, upper case, multiplies.
        #[arg(long, default_value = "0,8,1K")]
        sizes: String,
        /// Also measure the raw eventfd round trip (na-perf's
        /// `floor_eventfd_lat` x 2, before and after) and print each
        /// sleeping figure's (blocking, tokio) ratio to their mean. Needs
        /// the na-perf binary next to hg-perf.
        #[arg(long)]
        floors: bool,
    },
    /// Bulk bandwidth: `write` (server pulls) and `read` (server pushes).
    /// Each RPC makes the server move `count` transfers of one size as one
    /// batch (to regions of the client's buffer 16 MiB / `count` apart,
    /// never touching, so that none merge into one copy), as Mercury's
    /// hg_bw_read/hg_bw_write do with their default of 64; the count
    /// shrinks so that size x count stays within 1 MiB. JSON: `inflight`
    /// is 1 (one RPC at a time), `transfers` the count. With
    /// `--mode tokio` the client moves the data itself, no RPC per round:
    /// `read` pulls from and `write` pushes to a buffer the server exposed,
    /// one `AsyncEngine::bulk` per transfer (`--count 1`) or one
    /// `bulk_batch` of `count` transfers per round.
    Bw {
        /// Directions, comma-separated: `read` (data into the client's
        /// buffer) and/or `write` (data out of it).
        #[arg(long, default_value = "read,write")]
        op: String,
        /// Transfer sizes, comma-separated, each 1 byte to 16M; a `K`
        /// (KiB) or `M` (MiB) suffix, upper case, multiplies.
        #[arg(long, default_value = "4K,64K,1M,16M")]
        sizes: String,
        /// Transfers per RPC (1 measures one RPC per transfer).
        #[arg(long, default_value_t = 64)]
        count: u64,
        /// Also measure, before and after, the raw `process_vm_readv` and
        /// `process_vm_writev` bandwidths of one transfer (na-perf's
        /// `floor_cma_read_bw`, `floor_cma_write_bw`) for every size moved
        /// one transfer per RPC (1M and up, or all with `--count 1`), and
        /// print each such figure's ratio to the readv floor
        /// (`bw_vs_cma_floor`) and each write's to the writev floor
        /// (`bw_vs_cma_write_floor`), against the mean of before and after.
        /// Needs na-perf next to hg-perf.
        #[arg(long)]
        floors: bool,
    },
    /// Run the server side (started automatically; hidden from users).
    #[command(hide = true)]
    Serve {
        /// CPU to pin the server to.
        #[arg(long)]
        server_cpu: Option<usize>,
        /// Process id of the `hg-perf` that started us: we are killed when
        /// it exits, so a busy server never outlives a killed run.
        #[arg(long)]
        parent: Option<u32>,
    },
}

/// A size in bytes: a number, times 1024 with a `K` suffix, times 1 MiB
/// with an `M` suffix.
fn parse_size(s: &str) -> Res<u64> {
    let s = s.trim();
    let (n, mul) = match s.chars().last() {
        Some('K') => (&s[..s.len() - 1], 1 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    Ok(n.parse::<u64>().map_err(|e| format!("bad size {s:?}: {e}"))? * mul)
}

/// Each comma-separated item of `s`, parsed by `f`.
fn list<T>(s: &str, f: impl Fn(&str) -> Res<T>) -> Res<Vec<T>> {
    s.split(',').map(f).collect()
}

/// An engine on `spec` (listening if `listen`) that takes spills of up
/// to 64 MiB.
fn engine(spec: &str, mode: ProgressMode, listen: bool) -> Res<Engine> {
    let mut e = Engine::from_spec(spec, listen, mode)?;
    e.set_max_spill(64 << 20);
    Ok(e)
}

/// `n` more clients of the server at `uri`, connected (one call each) and
/// left idle while they live.
fn idle_clients_of(spec: &str, uri: &str, n: usize) -> Res<Vec<Engine>> {
    (0..n)
        .map(|_| {
            let mut e = engine(spec, ProgressMode::Blocking, false)?;
            let s = e.endpoint().lookup(uri)?;
            e.call::<Noop>(&s, &ByteBuf::new(), T)?;
            Ok(e)
        })
        .collect()
}

/// The server side (`hg-perf serve`): serves the benchmark's RPCs until
/// the client's `Quit`, pinned to `cpu`, exiting with process `parent`.
fn serve(spec: &str, cpu: Option<usize>, parent: Option<u32>) -> Res<()> {
    if let Some(p) = parent {
        na_core::sys::process::exit_with_parent(p)?;
    }
    if let Some(c) = cpu {
        affinity::pin_to(c)?;
    }
    let mode = ProgressMode::from_env("HG_PERF_MODE", ProgressMode::Busy)?;
    let mut e = engine(spec, mode, true)?;
    let quit = Arc::new(AtomicBool::new(false));
    e.register::<Noop>(|_| Ok(()))?;
    // Written, so that a read (a push from here) copies real pages, not the
    // kernel's zero page that untouched memory would be read from.
    let scratch =
        |ctx: &mut BulkCtx<'_>, len: u64, access| ctx.expose(vec![vec![0xa5; len as usize]], access);
    for (name, op) in [("write", BulkOp::Pull), ("read", BulkOp::Push)] {
        let mut buf = None;
        let handler = move |ctx: &mut BulkCtx<'_>, (remote, len, count): (Bulk, u64, u64)| {
            if count == 0 || len == 0 || len.saturating_mul(count) > BW_SPAN {
                return Err(format!(
                    "bw {name}: {count} x {len} bytes is empty or exceeds the {BW_SPAN}-byte buffer"
                ));
            }
            let b = match buf.take() {
                Some(b) => b,
                None => scratch(ctx, BW_SPAN, Access::ReadWrite)?,
            };
            let spans = bw_spans(len, count);
            let r = ctx.transfer_batch(op, &remote, &b, &spans);
            // The first and last byte of what moved: the client checks them
            // against its own buffer once, so a transfer that moved nothing
            // cannot make a figure.
            let mut ends = [0u8; 2];
            if let Some(m) = b.local() {
                let last = bw_extent(len, count) - 1;
                // The error as text is its whole chain (an `NaError` may
                // carry a cause, which its message leaves out).
                m.read_at(0, &mut ends[..1])
                    .map_err(|e| na_core::ErrorChain(&e).to_string())?;
                m.read_at(last, &mut ends[1..])
                    .map_err(|e| na_core::ErrorChain(&e).to_string())?;
            }
            buf = Some(b);
            r?;
            Ok((ends[0], ends[1]))
        };
        match op {
            BulkOp::Pull => e.register_with_bulk::<BulkWrite>(handler)?,
            BulkOp::Push => e.register_with_bulk::<BulkRead>(handler)?,
        }
    }
    let mut exposed: Option<Bulk> = None;
    e.register_with_bulk::<Exposed>(move |ctx: &mut BulkCtx<'_>, ()| {
        if exposed.is_none() {
            exposed = Some(scratch(ctx, BW_SPAN, Access::ReadWrite)?);
        }
        exposed.clone().ok_or_else(|| "no exposed buffer".to_owned())
    })?;
    let q = quit.clone();
    e.register::<Quit>(move |()| {
        q.store(true, Ordering::Relaxed);
        Ok(())
    })?;
    println!("ADDR {}", e.self_addr());
    while !quit.load(Ordering::Relaxed) {
        e.progress(Some(Duration::from_millis(100)))?;
        e.trigger()?;
    }
    let end = Instant::now() + Duration::from_millis(100);
    while Instant::now() < end {
        e.progress(Some(Duration::from_millis(10)))?;
        e.trigger()?;
    }
    Ok(())
}

/// A server process this run started: waited for when dropped, killed
/// past [`SERVER_EXIT_GRACE`].
struct Server(Child);

/// How long a dropped [`Server`] may take to exit on its own (after the
/// client's `Quit`, it serves 100 ms more) before it is killed. An exit of
/// its own runs its exit handlers: a profile-instrumented build
/// (`scripts/pgo-build.sh`) writes the server's profile then.
const SERVER_EXIT_GRACE: Duration = Duration::from_secs(2);

impl Drop for Server {
    fn drop(&mut self) {
        let end = Instant::now() + SERVER_EXIT_GRACE;
        while Instant::now() < end {
            match self.0.try_wait() {
                Ok(Some(_)) => return,
                Ok(None) => {}
                // Its state cannot be read: kill it rather than leave it.
                Err(_) => break,
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `hg-perf serve` on `spec` in `mode` (pinned to `cpu`) and
/// returns it with the address it printed.
fn start_server(spec: &str, mode: ProgressMode, cpu: Option<usize>) -> Res<(Server, String)> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["serve", "--transport", spec])
        .args(["--parent", &std::process::id().to_string()])
        // The whole mode: an adaptive server spins as long as the client.
        .env("HG_PERF_MODE", mode.spec())
        .stdout(Stdio::piped());
    if let Some(c) = cpu {
        cmd.args(["--server-cpu", &c.to_string()]);
    }
    let mut child = cmd.spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().ok_or("no stdout")?).read_line(&mut line)?;
    let uri = line
        .trim()
        .strip_prefix("ADDR ")
        .ok_or("server printed no address")?
        .to_owned();
    Ok((Server(child), uri))
}

/// Measures and reports the busy one-in-flight ceilings (ops/s): the raw
/// shared-flag ping-pong, the NA ping-pong with posted receives and the NA
/// ping-pong on hg-rpc's pull path. Returns them in that order.
fn report_ceilings(cli: &Cli, cpus: (Option<usize>, Option<usize>), when: &str) -> Res<(f64, f64, f64)> {
    let rtt = floor::busy_round_trips(cpus, cli.batches, cli.batch_ms)?;
    let (flag, na, pulled) = (1e9 / rtt.flag, 1e9 / rtt.na_posted, 1e9 / rtt.na_pulled);
    report(
        cli,
        "rate_ceiling_flag",
        "busy",
        when,
        8,
        1,
        flag,
        flag,
        None,
        "ops/s",
    );
    report(cli, "rate_ceiling_na", "busy", when, 8, 1, na, na, None, "ops/s");
    report(
        cli,
        "rate_ceiling_na_pull",
        "busy",
        when,
        8,
        1,
        pulled,
        pulled,
        None,
        "ops/s",
    );
    Ok((flag, na, pulled))
}

/// The sizes of `bw`'s list, each 1 byte to 16 MiB (the buffer's size).
fn bw_sizes(sizes: &str) -> Res<Vec<u64>> {
    let sizes = list(sizes, parse_size)?;
    if sizes.iter().any(|&s| s == 0 || s > BW_SPAN) {
        return Err("bw sizes are 1 byte to 16M".into());
    }
    Ok(sizes)
}

/// Transfers each `bw` RPC makes for `size`: `count`, shrunk so that size
/// x count stays within [`BW_BATCH_BYTES`] (at least 1).
fn transfers_per_rpc(count: u64, size: u64) -> u64 {
    count.clamp(1, (BW_BATCH_BYTES / size.max(1)).max(1))
}

/// `rate --inflight`'s counts, each at least 1 (with none in flight
/// nothing is ever sent: each turn waited [`T`] for nothing, and the rate
/// was 0).
fn inflight_counts(s: &str) -> Res<Vec<usize>> {
    list(s, |x| {
        Ok(at_least_one(x.trim()).map_err(|e| format!("bad --inflight {x:?}: {e}"))?)
    })
}

/// Parses a count that must be at least 1 (`--batches`: none would
/// report a median of 0 and no p99).
fn at_least_one(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// The spans of one bw round: `count` transfers of `size` bytes, at the
/// same offsets on both sides, `BW_SPAN / count` apart (as Mercury's
/// hg_bw_read/write place theirs, `buf_size_max` apart). Never
/// contiguous: na-sm would merge touching pieces into one, and 64 x 4 KiB
/// would measure one 256 KiB copy.
pub(crate) fn bw_spans(size: u64, count: u64) -> Vec<Span> {
    let stride = if count > 1 { BW_SPAN / count } else { size };
    (0..count)
        .map(|i| Span {
            remote_offset: i * stride,
            local_offset: i * stride,
            len: size,
        })
        .collect()
}

/// One past the last byte the spans of [`bw_spans`] cover.
pub(crate) fn bw_extent(size: u64, count: u64) -> u64 {
    bw_spans(size, count).last().map_or(0, |s| s.local_offset + s.len)
}

/// Measures and reports the raw `process_vm_readv` bandwidth of one
/// transfer of each of `sizes` (MiB/s); returns (size, MiB/s).
fn report_cma_floors(
    cli: &Cli,
    cpus: (Option<usize>, Option<usize>),
    sizes: &[u64],
    when: &str,
) -> Res<Vec<floor::CmaFloor>> {
    let floors = floor::cma_floors(cpus, sizes, cli.batches, cli.batch_ms)?;
    for f in &floors {
        for (test, v) in [("floor_cma_read_bw", f.read), ("floor_cma_write_bw", f.write)] {
            report(cli, test, "n/a", when, f.size, 1, v, v, None, "MiB/s");
        }
    }
    Ok(floors)
}

/// The name of a progress mode in the results.
fn mode_name(m: ProgressMode) -> &'static str {
    match m {
        ProgressMode::Busy => "busy",
        ProgressMode::Adaptive { .. } => "adaptive",
        ProgressMode::Blocking => "blocking",
    }
}

/// The median (the mean of the middle two of an even count, as na-perf
/// computes it); 0 for no values.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The `p` quantile (0 to 1) of `sorted`, which must not be empty.
fn pct(sorted: &[u64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)] as f64
}

/// One result: a JSON object per line with `--json`, else a table row.
/// `p99` is the worst batch for rate and bw (medians of batches), the
/// 99th percentile for lat, which also reports `p999`.
#[allow(clippy::too_many_arguments)]
fn report(
    cli: &Cli,
    test: &str,
    mode: &str,
    op: &str,
    size: u64,
    inflight: usize,
    median: f64,
    p99: f64,
    p999: Option<f64>,
    unit: &str,
) {
    report_with(cli, test, mode, op, size, inflight, median, p99, p999, unit, None);
}

/// A bw result: one round (RPC) in flight, moving `transfers` spans of
/// `size` bytes each (JSON field `transfers`; the table shows `op x N`).
pub(crate) fn report_bw(cli: &Cli, mode: &str, op: &str, size: u64, transfers: u64, median: f64, p99: f64) {
    report_with(
        cli,
        "bw",
        mode,
        op,
        size,
        1,
        median,
        p99,
        None,
        "MiB/s",
        Some(transfers),
    );
}

/// [`report`], with the count of transfers per RPC of a bw figure.
#[allow(clippy::too_many_arguments)]
fn report_with(
    cli: &Cli,
    test: &str,
    mode: &str,
    op: &str,
    size: u64,
    inflight: usize,
    median: f64,
    p99: f64,
    p999: Option<f64>,
    unit: &str,
    transfers: Option<u64>,
) {
    if cli.json {
        let mut v = serde_json::json!({
            "test": test, "transport": cli.transport.split("://").next().unwrap_or("?"), "mode": mode, "op": op, "size": size,
            "inflight": inflight, "median": median, "p99": p99, "unit": unit,
        });
        if let Some(p) = p999 {
            v["p999"] = serde_json::json!(p);
        }
        if let Some(t) = transfers {
            v["transfers"] = serde_json::json!(t);
        }
        println!("{v}");
    } else {
        let extra = p999.map(|p| format!(" p999 {p:.1}")).unwrap_or_default();
        let digits = if unit == "x" { 2 } else { 1 };
        let op = match transfers {
            Some(t) => format!("{op}x{t}"),
            None => op.to_owned(),
        };
        println!(
            "{test:<5} {mode:<9} {op:<6} {size:>9} {inflight:>4} {median:>14.digits$} {p99:>14.digits$} {unit}{extra}"
        );
    }
}

/// The server's address: `--addr`, or a server started in `mode`.
fn server_for(
    cli: &Cli,
    mode: ProgressMode,
    cpus: (Option<usize>, Option<usize>),
) -> Res<(Option<Server>, String)> {
    match &cli.addr {
        Some(a) => Ok((None, a.clone())),
        None => {
            let (s, u) = start_server(&cli.transport, mode, cpus.1)?;
            Ok((Some(s), u))
        }
    }
}

/// Reports the percentiles of round-trip `samples` (ns); returns the
/// median and p99.
fn report_lat(cli: &Cli, mode: &str, size: u64, mut samples: Vec<u64>) -> (f64, f64) {
    samples.sort_unstable();
    let (p50, p99, p999) = (pct(&samples, 0.5), pct(&samples, 0.99), pct(&samples, 0.999));
    report(cli, "lat", mode, "call", size, 1, p50, p99, Some(p999), "ns");
    (p50, p99)
}

/// One bw RPC: `op` (`write`: the server pulls, `read`: it pushes) of
/// `count` x `size` bytes of `local`; the server's bytes at both ends.
fn bw_call(
    c: &mut Engine,
    s: &na_core::Addr,
    local: &Bulk,
    op: &str,
    size: u64,
    count: u64,
) -> Res<(u8, u8)> {
    let input = (local.clone(), size, count);
    Ok(match op {
        "write" => c.call::<BulkWrite>(s, &input, T)?,
        "read" => c.call::<BulkRead>(s, &input, T)?,
        other => return Err(format!("unknown op {other:?} (read, write)").into()),
    })
}

/// Checks once that a bw transfer of `count` x `size` bytes moves data:
/// the client's bytes at both ends of the span are marked first, and after
/// the call they must be what the server reports holding (and, for a
/// write, still the marks; for a read, the server's bytes).
fn check_bw_moves(
    c: &mut Engine,
    s: &na_core::Addr,
    local: &Bulk,
    op: &str,
    size: u64,
    count: u64,
) -> Res<()> {
    let mem = local.local().ok_or("the bw buffer has no local memory")?;
    let last = bw_extent(size, count) - 1;
    let marks = [0x11u8, 0x22];
    mem.write_at(0, &marks[..1])?;
    mem.write_at(last, &marks[1..])?;
    let server = bw_call(c, s, local, op, size, count)?;
    let mut ends = [0u8; 2];
    mem.read_at(0, &mut ends[..1])?;
    mem.read_at(last, &mut ends[1..])?;
    let moved = (server == (ends[0], ends[1])) && ((op == "write") == (ends == marks));
    if !moved {
        return Err(format!(
            "bw {op} of {count} x {size} bytes moved no data: client ends {ends:?}, server ends {server:?}"
        )
        .into());
    }
    Ok(())
}

/// Figures that `--floors` compares with a floor measured after the runs.
#[derive(Default)]
pub(crate) struct Seen {
    /// Busy rates with one call in flight and at most 8 bytes of payload:
    /// (size, ops/s), for `rate --floors`.
    busy_single: Vec<(u64, f64)>,
    /// Bandwidths of one transfer per RPC: (mode, op, size, MiB/s), for
    /// `bw --floors`.
    bw_single: Vec<(&'static str, String, u64, f64)>,
    /// Sleeping round trips (blocking and tokio): (mode, size, p50, p99),
    /// for `lat --floors`.
    pub(crate) lat_sleeping: Vec<(&'static str, u64, f64, f64)>,
}

/// Runs `cli.test` in `mode`, noting in `seen` the figures `--floors`
/// compares.
fn run_mode(cli: &Cli, mode: ProgressMode, cpus: (Option<usize>, Option<usize>), seen: &mut Seen) -> Res<()> {
    let (_server, uri) = server_for(cli, mode, cpus)?;
    let mut c = engine(&cli.transport, mode, false)?;
    c.set_max_spill(64 << 20);
    let s = c.endpoint().lookup(&uri)?;
    let m = mode_name(mode);
    let batch = Duration::from_millis(cli.batch_ms);
    match &cli.test {
        Test::Rate {
            sizes,
            inflight,
            idle_clients,
            ..
        } => {
            let _idle = idle_clients_of(&cli.transport, &uri, *idle_clients)?;
            for size in list(sizes, parse_size)? {
                for n in inflight_counts(inflight)? {
                    let input = ByteBuf::from(vec![7u8; size as usize]);
                    let mut rates = Vec::new();
                    for b in 0..=cli.batches {
                        let (mut done, mut q) = (0u64, VecDeque::new());
                        let t0 = Instant::now();
                        // The clock is read every 16 turns: at millions of
                        // calls a second a read per turn would be a few
                        // percent of the figure. The rate divides by the
                        // exact elapsed time below.
                        let mut turns = 0u32;
                        while !turns.is_multiple_of(16) || t0.elapsed() < batch {
                            turns = turns.wrapping_add(1);
                            while q.len() < n {
                                q.push_back(c.forward::<Noop>(&s, &input)?);
                            }
                            c.progress(Some(T))?;
                            c.trigger()?;
                            while let Some(&id) = q.front() {
                                match c.take_response::<Noop>(id) {
                                    Some(r) => {
                                        r?;
                                        q.pop_front();
                                        done += 1;
                                    }
                                    None => break,
                                }
                            }
                        }
                        while let Some(id) = q.pop_front() {
                            while c.take_response::<Noop>(id).is_none() {
                                c.progress(Some(T))?;
                                c.trigger()?;
                            }
                        }
                        if b > 0 {
                            rates.push(done as f64 / t0.elapsed().as_secs_f64());
                        }
                    }
                    let p = rates.iter().copied().fold(f64::INFINITY, f64::min);
                    let med = median(rates);
                    // The ceilings are 8-byte ping-pongs: larger payloads
                    // move more data than they do and get no ratio.
                    if n == 1 && mode == ProgressMode::Busy && size <= 8 {
                        seen.busy_single.push((size, med));
                    }
                    report(cli, "rate", m, "call", size, n, med, p, None, "ops/s");
                }
            }
        }
        Test::Lat { sizes, .. } => {
            for size in list(sizes, parse_size)? {
                let input = ByteBuf::from(vec![7u8; size as usize]);
                let mut samples = Vec::new();
                for _ in 0..1000 {
                    c.call::<Noop>(&s, &input, T)?;
                }
                // Timed after the warm-up, and never fewer than 1,000 samples.
                let end = Instant::now() + batch * cli.batches as u32;
                while Instant::now() < end || samples.len() < 1000 {
                    let t0 = Instant::now();
                    c.call::<Noop>(&s, &input, T)?;
                    samples.push(t0.elapsed().as_nanos() as u64);
                }
                let (p50, p99) = report_lat(cli, m, size, samples);
                // The floor is a sleeping round trip: only blocking compares.
                if mode == ProgressMode::Blocking {
                    seen.lat_sleeping.push((m, size, p50, p99));
                }
            }
        }
        Test::Bw { op, sizes, count, .. } => {
            let local = c.expose(vec![vec![1u8; BW_SPAN as usize]], Access::ReadWrite)?;
            for op in op.split(',') {
                for size in bw_sizes(sizes)? {
                    let count = transfers_per_rpc(*count, size);
                    check_bw_moves(&mut c, &s, &local, op.trim(), size, count)?;
                    let mut rates = Vec::new();
                    for b in 0..=cli.batches {
                        let (mut bytes, t0) = (0u64, Instant::now());
                        while t0.elapsed() < batch {
                            bw_call(&mut c, &s, &local, op.trim(), size, count)?;
                            bytes += size * count;
                        }
                        if b > 0 {
                            rates.push(bytes as f64 / f64::from(1 << 20) / t0.elapsed().as_secs_f64());
                        }
                    }
                    let p = rates.iter().copied().fold(f64::INFINITY, f64::min);
                    let med = median(rates);
                    if count == 1 {
                        seen.bw_single.push((m, op.trim().to_owned(), size, med));
                    }
                    report_bw(cli, m, op.trim(), size, count, med, p);
                }
            }
        }
        Test::Serve { .. } => unreachable!("handled in main"),
    }
    if cli.addr.is_none() {
        c.call::<Quit>(&s, &(), T)?;
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    exit::run("hg-perf", run)
}

/// Parses the command line and runs the server side or the test.
fn run() -> Res<()> {
    let cli = Cli::parse();
    if let Test::Serve { server_cpu, parent } = cli.test {
        return serve(&cli.transport, server_cpu, parent);
    }
    let cpus = match &cli.cpu {
        Some(s) => {
            let v = list(s, |x| Ok(x.trim().parse::<usize>()?))?;
            match v[..] {
                [a, b] => (Some(a), Some(b)),
                _ => return Err("--cpu takes two CPUs: A,B".into()),
            }
        }
        None => {
            let cpus = affinity::allowed_cpus()?;
            (cpus.first().copied(), cpus.get(1).copied())
        }
    };
    if let Some(c) = cpus.0 {
        affinity::pin_to(c)?;
    }
    if !cli.json {
        println!(
            "{:<5} {:<9} {:<6} {:>9} {:>4} {:>14} {:>14} unit",
            "test", "mode", "op", "size", "infl", "median", "p99/worst"
        );
    }
    let any_floors = matches!(
        cli.test,
        Test::Lat { floors: true, .. } | Test::Rate { floors: true, .. } | Test::Bw { floors: true, .. }
    );
    if any_floors && (!cli.transport.starts_with("sm") || cli.addr.is_some()) {
        // na-perf measures shared-memory floors between two processes it
        // starts: a ratio of another transport's (or a remote server's)
        // figure to them would compare unlike things.
        return Err("--floors compares with shared-memory floors of this machine: it needs --transport sm and no --addr".into());
    }
    let with_floors = matches!(cli.test, Test::Lat { floors: true, .. });
    let floor_before = if with_floors {
        let f = floor::eventfd_round_trip(cpus, cli.batches, cli.batch_ms)?;
        report(
            &cli,
            "floor_eventfd_rtt",
            "blocking",
            "before",
            8,
            1,
            f.0,
            f.1,
            None,
            "ns",
        );
        Some(f)
    } else {
        None
    };
    let rate_floors = matches!(cli.test, Test::Rate { floors: true, .. });
    let ceilings_before = if rate_floors {
        Some(report_ceilings(&cli, cpus, "before")?)
    } else {
        None
    };
    let cma_floors_before = match &cli.test {
        Test::Bw {
            floors: true,
            sizes,
            count,
            ..
        } => {
            let single: Vec<u64> = list(sizes, parse_size)?
                .into_iter()
                .filter(|&s| s > 0 && transfers_per_rpc(*count, s) == 1)
                .collect();
            if single.is_empty() {
                return Err(
                    "bw --floors compares transfers made one per RPC: give sizes of 1M or more, or --count 1"
                        .into(),
                );
            }
            Some(report_cma_floors(&cli, cpus, &single, "before")?)
        }
        _ => None,
    };
    let mut seen = Seen::default();
    for m in cli.mode.split(',') {
        let m = m.trim();
        match tokio_runs::Flavor::parse(m) {
            None => run_mode(&cli, ProgressMode::parse(m)?, cpus, &mut seen)?,
            Some(f) => match &cli.test {
                Test::Lat { sizes, .. } => tokio_runs::lat(&cli, f, sizes, cpus, &mut seen)?,
                Test::Rate {
                    sizes,
                    inflight,
                    idle_clients,
                    ..
                } => tokio_runs::rate(&cli, f, sizes, inflight, *idle_clients, cpus)?,
                Test::Bw { op, sizes, count, .. } => tokio_runs::bw(&cli, f, op, sizes, *count, cpus)?,
                _ => return Err(format!("mode {m} exists for rate, lat and bw only").into()),
            },
        }
    }
    if let Some((flag0, na0, pull0)) = ceilings_before {
        let (flag1, na1, pull1) = report_ceilings(&cli, cpus, "after")?;
        for (size, rate) in seen.busy_single {
            for (test, before, after) in [
                ("rate_vs_flag_ceiling", flag0, flag1),
                ("rate_vs_na_ceiling", na0, na1),
                ("rate_vs_na_pull_ceiling", pull0, pull1),
            ] {
                let ratio = rate / ((before + after) / 2.0);
                report(&cli, test, "busy", "call", size, 1, ratio, ratio, None, "x");
            }
        }
    }
    if let Some(before) = cma_floors_before {
        let sizes: Vec<u64> = before.iter().map(|f| f.size).collect();
        let after = report_cma_floors(&cli, cpus, &sizes, "after")?;
        for (mode, op, size, bw) in seen.bw_single {
            let floor = |v: &[floor::CmaFloor]| v.iter().find(|f| f.size == size).copied();
            let (Some(f0), Some(f1)) = (floor(&before), floor(&after)) else {
                continue;
            };
            // Every figure against the readv floor (the targets' floor);
            // a write also against the writev floor, its own operation.
            let mut ratios = vec![("bw_vs_cma_floor", bw / ((f0.read + f1.read) / 2.0))];
            if op == "write" {
                ratios.push(("bw_vs_cma_write_floor", bw / ((f0.write + f1.write) / 2.0)));
            }
            for (test, ratio) in ratios {
                report(&cli, test, mode, &op, size, 1, ratio, ratio, None, "x");
            }
        }
    }
    if let Some(f0) = floor_before {
        // The machine may have drifted: the floor again, and the ratios to
        // the mean of both (as for rate and bw).
        let f1 = floor::eventfd_round_trip(cpus, cli.batches, cli.batch_ms)?;
        report(
            &cli,
            "floor_eventfd_rtt",
            "blocking",
            "after",
            8,
            1,
            f1.0,
            f1.1,
            None,
            "ns",
        );
        // Median to median, p99 to p99.
        let (f50, f99) = ((f0.0 + f1.0) / 2.0, (f0.1 + f1.1) / 2.0);
        for (mode, size, p50, p99) in seen.lat_sleeping {
            report(
                &cli,
                "lat_vs_eventfd_rtt",
                mode,
                "call",
                size,
                1,
                p50 / f50,
                p99 / f99,
                None,
                "x",
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The transfers of a bw round never touch (na-sm would merge touching
    /// ones into one copy) and stay within the buffer, for every size
    /// and count the command uses.
    #[test]
    fn bw_spans_are_apart_and_within_the_buffer() {
        for size in [1, 4096, 64 << 10, 1 << 20, 16 << 20] {
            for asked in [1, 16, 64] {
                let count = transfers_per_rpc(asked, size);
                let spans = bw_spans(size, count);
                assert_eq!(spans.len() as u64, count);
                assert!(bw_extent(size, count) <= BW_SPAN, "{size} x {count}");
                for w in spans.windows(2) {
                    assert!(
                        w[0].local_offset + w[0].len < w[1].local_offset,
                        "{size} x {count}: {w:?}"
                    );
                    assert_eq!(w[0].local_offset, w[0].remote_offset);
                }
            }
        }
    }
}
