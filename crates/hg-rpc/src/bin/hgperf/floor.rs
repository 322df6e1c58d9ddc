//! `hg-perf lat --floors`: the raw eventfd round trip of this machine,
//! measured by na-perf (its `floor_eventfd_lat`, two processes ping-ponging
//! eventfds through epoll, one-way) right before and after the RPC round
//! trips, so the blocking figure is judged against a floor of the same run.
//! `hg-perf rate --floors`: likewise the busy ceilings of one call in
//! flight (the shared-flag and NA ping-pongs), before and after the rates.
//! `hg-perf bw --floors`: likewise the raw `process_vm_readv` and
//! `process_vm_writev` bandwidths of one transfer (`floor_cma_read_bw`,
//! `floor_cma_write_bw`), before and after the bandwidths.

use std::path::PathBuf;
use std::process::Command;

/// What the benchmark's steps return: any error ends the run with it.
type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The na-perf binary next to this hg-perf (same build profile).
fn na_perf() -> Res<PathBuf> {
    let exe = std::env::current_exe()?.with_file_name("na-perf");
    if !exe.exists() {
        return Err(format!(
            "--floors runs na-perf, and {} does not exist: build it with the same profile \
             (`cargo build --release -p na-perf`)",
            exe.display()
        )
        .into());
    }
    Ok(exe)
}

/// Runs `na-perf lat --floors` for 8-byte messages of `kinds` (na-perf's
/// `--kind` list) in `mode` and returns its JSON results.
fn na_perf_lat(
    mode: &str,
    kinds: &str,
    cpus: (Option<usize>, Option<usize>),
    batches: usize,
    batch_ms: u64,
) -> Res<Vec<serde_json::Value>> {
    let mut cmd = Command::new(na_perf()?);
    cmd.args(["lat", "--floors", "--kind", kinds, "--sizes", "8", "--json"]);
    cmd.arg("--mode").arg(mode);
    cmd.arg("--batches").arg(batches.to_string());
    cmd.arg("--batch-ms").arg(batch_ms.to_string());
    if let (Some(a), Some(b)) = cpus {
        cmd.arg("--cpu").arg(format!("{a},{b}"));
    }
    run_json(cmd, mode)
}

/// Runs an na-perf command and returns its JSON result lines.
fn run_json(mut cmd: Command, what: &str) -> Res<Vec<serde_json::Value>> {
    let out = cmd.output()?;
    if !out.status.success() {
        return Err(format!(
            "na-perf ({what}) failed with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// Twice the positive `field` (`median`: of batch means; `p50`: of single
/// operations) of the result named `test` (a one-way latency), in
/// `results` of na-perf.
fn round_trip(results: &[serde_json::Value], test: &str, field: &str) -> Res<f64> {
    round_trip_of(results, test, None, field)
}

/// [`round_trip`] of the result whose `op` is `op` too, when given.
fn round_trip_of(results: &[serde_json::Value], test: &str, op: Option<&str>, field: &str) -> Res<f64> {
    results
        .iter()
        .filter(|v| v["test"] == test && op.is_none_or(|op| v["op"] == op))
        .find_map(|v| v[field].as_f64().filter(|m| *m > 0.0))
        .map(|one_way| 2.0 * one_way)
        .ok_or_else(|| {
            let op = op.map_or(String::new(), |op| format!(" of kind {op}"));
            format!("na-perf printed no {test} result{op} (is na-perf built from this tree?): {results:?}")
                .into()
        })
}

/// Raw eventfd round trip in nanoseconds (twice na-perf's one-way floor),
/// between two processes on `cpus` when given: the median and the p99 of
/// single timed round trips, as hg-perf's `lat` times its calls (a batch
/// mean would carry the sleeping ping-pong's slow tail).
pub fn eventfd_round_trip(
    cpus: (Option<usize>, Option<usize>),
    batches: usize,
    batch_ms: u64,
) -> Res<(f64, f64)> {
    let results = na_perf_lat("blocking", "unexpected", cpus, batches, batch_ms)?;
    Ok((
        round_trip(&results, "floor_eventfd_lat", "p50")?,
        round_trip(&results, "floor_eventfd_lat", "p99")?,
    ))
}

/// The ceilings of a busy RPC rate with one call in flight, as round trips
/// in nanoseconds.
pub struct BusyRoundTrips {
    /// The raw shared-flag ping-pong (`floor_shm_flag_lat`): what two
    /// processes spinning on one cache line do with no software at all.
    pub flag: f64,
    /// The NA ping-pong of 8-byte unexpected messages over na-sm, received
    /// in posted receives and reported by completions (na-perf's classic
    /// `unexpected` kind).
    pub na_posted: f64,
    /// The same ping-pong on hg-rpc's own path (`pulled`): both sides take
    /// the messages in pull mode and sends report no success completion.
    /// Everything below hg-rpc; the gap to an RPC round trip is hg-rpc's.
    pub na_pulled: f64,
}

/// Measures [`BusyRoundTrips`]. An RPC needs one round trip of each kind
/// per call, so one in flight cannot beat 1 / round trip.
pub fn busy_round_trips(
    cpus: (Option<usize>, Option<usize>),
    batches: usize,
    batch_ms: u64,
) -> Res<BusyRoundTrips> {
    let r = na_perf_lat("busy", "unexpected,pulled", cpus, batches, batch_ms)?;
    // Batch means, as the rates they bound are measured.
    Ok(BusyRoundTrips {
        flag: round_trip(&r, "floor_shm_flag_lat", "median")?,
        na_posted: round_trip_of(&r, "lat", Some("unexpected"), "median")?,
        na_pulled: round_trip_of(&r, "lat", Some("pulled"), "median")?,
    })
}

/// The raw cross-memory bandwidths of one transfer of one size between two
/// processes, in MiB/s (na-perf's `floor_cma_read_bw` and
/// `floor_cma_write_bw`, one segment).
#[derive(Clone, Copy, Debug)]
pub struct CmaFloor {
    /// Transfer size in bytes.
    pub size: u64,
    /// `process_vm_readv`: the floor the targets name for both
    /// directions, and the floor of a read (pull).
    pub read: f64,
    /// `process_vm_writev`: the floor of a write (push).
    pub write: f64,
}

/// Measures [`CmaFloor`] for each of `sizes`, in the order of `sizes`.
pub fn cma_floors(
    cpus: (Option<usize>, Option<usize>),
    sizes: &[u64],
    batches: usize,
    batch_ms: u64,
) -> Res<Vec<CmaFloor>> {
    let mut cmd = Command::new(na_perf()?);
    let list: Vec<String> = sizes.iter().map(u64::to_string).collect();
    cmd.args(["bw", "--floors", "--segments", "1", "--op", "get,put", "--json"]);
    cmd.arg("--sizes").arg(list.join(","));
    cmd.arg("--batches").arg(batches.to_string());
    cmd.arg("--batch-ms").arg(batch_ms.to_string());
    if let (Some(a), Some(b)) = cpus {
        cmd.arg("--cpu").arg(format!("{a},{b}"));
    }
    let results = run_json(cmd, "cma floor")?;
    let floor = |test: &str, size: u64| -> Res<f64> {
        results
            .iter()
            .filter(|v| v["test"] == test && v["size"].as_u64() == Some(size))
            .find_map(|v| v["median"].as_f64().filter(|m| *m > 0.0))
            .ok_or_else(|| format!("na-perf printed no {test} for {size} bytes: {results:?}").into())
    };
    sizes
        .iter()
        .map(|&size| {
            Ok(CmaFloor {
                size,
                read: floor("floor_cma_read_bw", size)?,
                write: floor("floor_cma_write_bw", size)?,
            })
        })
        .collect()
}
