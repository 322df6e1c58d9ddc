//! `hg-perf lat --floors`: the raw eventfd round trip of this machine,
//! measured by na-perf (its `floor_eventfd_lat`, two processes ping-ponging
//! eventfds through epoll, one-way) right before and after the RPC round
//! trips, so the blocking figure is judged against a floor of the same run.

use std::path::PathBuf;
use std::process::Command;

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

/// Median raw eventfd round trip in nanoseconds (twice na-perf's one-way
/// floor), between two processes on `cpus` when given.
pub fn eventfd_round_trip(cpus: (Option<usize>, Option<usize>), batches: usize, batch_ms: u64) -> Res<f64> {
    let mut cmd = Command::new(na_perf()?);
    cmd.args([
        "lat",
        "--floors",
        "--kind",
        "unexpected",
        "--sizes",
        "8",
        "--mode",
        "blocking",
        "--json",
    ]);
    cmd.arg("--batches").arg(batches.to_string());
    cmd.arg("--batch-ms").arg(batch_ms.to_string());
    if let (Some(a), Some(b)) = cpus {
        cmd.arg("--cpu").arg(format!("{a},{b}"));
    }
    let out = cmd.output()?;
    if !out.status.success() {
        return Err(format!(
            "na-perf (eventfd floor) failed with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    for line in stdout.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["test"] == "floor_eventfd_lat" {
            if let Some(one_way) = v["median"].as_f64().filter(|m| *m > 0.0) {
                return Ok(2.0 * one_way);
            }
        }
    }
    Err(format!("na-perf printed no floor_eventfd_lat result:\n{stdout}").into())
}
