//! hg-perf runs and reports well-formed results (a functional check; no
//! speed is asserted: speed is measured by running hg-perf itself).

use std::process::Command;

fn run(args: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_hg-perf"))
        .args(args)
        .args(["--json", "--batch-ms", "20", "--batches", "2"])
        .output()
        .expect("run hg-perf");
    assert!(
        out.status.success(),
        "hg-perf {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
        .collect()
}

fn check(v: &serde_json::Value, unit: &str) {
    for k in [
        "test",
        "transport",
        "mode",
        "op",
        "size",
        "inflight",
        "median",
        "p99",
        "unit",
    ] {
        assert!(v.get(k).is_some(), "missing {k} in {v}");
    }
    assert_eq!(v["unit"], unit);
    assert!(v["median"].as_f64().unwrap() > 0.0, "{v}");
}

/// `--floors` runs na-perf: a workspace build has it next to hg-perf.
/// Without it, checks that `args` fail with a message that says how to
/// build it, and returns true (the figures cannot be checked).
fn na_perf_missing(args: &[&str]) -> bool {
    let hg = std::path::Path::new(env!("CARGO_BIN_EXE_hg-perf"));
    let na = hg.with_file_name("na-perf");
    if na.exists() {
        return false;
    }
    na_core::testing::report_not_run(&format!(
        "hg-perf --floors figures: {} is not built (cargo build -p na-perf); checked the error instead",
        na.display()
    ));
    let out = Command::new(hg).args(args).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cargo build --release -p na-perf"), "{err}");
    true
}

/// Checks a floor measured `before` and `after` the figures, and that
/// `ratio` is `figure` over their mean.
fn check_ratio(
    ratio: &serde_json::Value,
    figure: &serde_json::Value,
    before: &serde_json::Value,
    after: &serde_json::Value,
) {
    let m = |v: &serde_json::Value| v["median"].as_f64().unwrap();
    check(ratio, "x");
    assert_eq!(
        (before["op"].as_str(), after["op"].as_str()),
        (Some("before"), Some("after"))
    );
    let floor = (m(before) + m(after)) / 2.0;
    let expect = m(figure) / floor;
    assert!(
        (m(ratio) - expect).abs() < 1e-9 * expect.max(1.0),
        "{ratio} vs {expect}"
    );
}

#[test]
fn rate_lat_and_bw_report_json() {
    let rate = run(&[
        "rate",
        "--mode",
        "adaptive",
        "--sizes",
        "0,8K",
        "--inflight",
        "1,4",
    ]);
    assert_eq!(rate.len(), 4);
    rate.iter().for_each(|v| check(v, "ops/s"));
    // With quiet clients connected to the same server.
    let rate = run(&[
        "rate",
        "--mode",
        "busy",
        "--sizes",
        "0",
        "--inflight",
        "1",
        "--idle-clients",
        "8",
    ]);
    assert_eq!(rate.len(), 1);
    check(&rate[0], "ops/s");
    let lat = run(&["lat", "--mode", "blocking", "--sizes", "8"]);
    assert_eq!(lat.len(), 1);
    check(&lat[0], "ns");
    assert!(lat[0]["p999"].as_f64().unwrap() >= lat[0]["p99"].as_f64().unwrap());
    // Calls awaited through AsyncEngine: one at a time, and from many tasks.
    let lat = run(&["lat", "--mode", "tokio", "--sizes", "0,1K"]);
    assert_eq!(lat.len(), 2);
    lat.iter().for_each(|v| check(v, "ns"));
    assert!(lat.iter().all(|v| v["mode"] == "tokio"), "{lat:?}");
    let rate = run(&["rate", "--mode", "tokio", "--sizes", "0", "--inflight", "1,64"]);
    assert_eq!(rate.len(), 2);
    rate.iter().for_each(|v| check(v, "ops/s"));
    assert!(rate.iter().all(|v| v["mode"] == "tokio"), "{rate:?}");
    assert_eq!(rate[1]["inflight"], 64);
    // The same with a driver that spins after work, against an adaptive server.
    let both = run(&[
        "rate",
        "--mode",
        "tokio-adaptive",
        "--sizes",
        "0",
        "--inflight",
        "1,16",
    ]);
    assert_eq!(both.len(), 2);
    both.iter().for_each(|v| check(v, "ops/s"));
    assert!(both.iter().all(|v| v["mode"] == "tokio-adaptive"), "{both:?}");
    let lat = run(&["lat", "--mode", "tokio-adaptive", "--sizes", "0"]);
    assert_eq!(lat.len(), 1);
    check(&lat[0], "ns");
    assert_eq!(lat[0]["mode"], "tokio-adaptive");
    let bw = run(&["bw", "--mode", "busy", "--sizes", "4K,1M"]);
    assert_eq!(bw.len(), 4);
    bw.iter().for_each(|v| check(v, "MiB/s"));
    // One RPC in flight, moving 64 transfers of 4 KiB (1 of 1 MiB).
    let shape: Vec<_> = bw
        .iter()
        .map(|v| {
            (
                v["size"].as_u64(),
                v["inflight"].as_u64(),
                v["transfers"].as_u64(),
            )
        })
        .collect();
    assert_eq!(
        shape,
        [
            (Some(4096), Some(1), Some(64)),
            (Some(1 << 20), Some(1), Some(1)),
            (Some(4096), Some(1), Some(64)),
            (Some(1 << 20), Some(1), Some(1)),
        ],
        "{bw:?}"
    );
    // Transfers the client makes itself through AsyncEngine: one per
    // round, then 64 per round as one batch.
    let bw = run(&["bw", "--mode", "tokio", "--sizes", "4K,1M", "--count", "1"]);
    assert_eq!(bw.len(), 4);
    bw.iter().for_each(|v| check(v, "MiB/s"));
    assert!(
        bw.iter().all(|v| v["mode"] == "tokio" && v["inflight"] == 1),
        "{bw:?}"
    );
    let bw = run(&["bw", "--mode", "tokio", "--op", "read", "--sizes", "4K"]);
    assert_eq!(bw.len(), 1);
    check(&bw[0], "MiB/s");
    assert_eq!(
        (bw[0]["inflight"].as_u64(), bw[0]["transfers"].as_u64()),
        (Some(1), Some(64))
    );
}

/// Floors are this machine's shared-memory floors: a ratio of another
/// transport's figures, or a remote server's, to them is refused.
#[test]
fn floors_only_for_local_shared_memory() {
    for args in [
        &["rate", "--floors", "--transport", "verbs://"][..],
        &["lat", "--floors", "--addr", "sm://1-x"][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_hg-perf"))
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} must fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("needs --transport sm and no --addr"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn bad_arguments_are_clear_errors() {
    for (args, says) in [
        (&["rate", "--mode", "sideways"][..], "sideways"),
        (
            &["bw", "--mode", "tokio", "--op", "sideways", "--sizes", "4K"][..],
            "unknown op",
        ),
        // No batch would report a median of 0.
        (&["rate", "--batches", "0"][..], "at least 1"),
        (&["rate", "--batch-ms", "0"][..], "--batch-ms"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_hg-perf"))
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} must fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // An error of the run itself is printed in words, not in Debug form.
    let out = Command::new(env!("CARGO_BIN_EXE_hg-perf"))
        .args(["bw", "--mode", "tokio", "--op", "sideways", "--sizes", "4K"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("hg-perf: error: unknown op \"sideways\""),
        "{err}"
    );
}

/// `lat --floors` measures the eventfd round trip with na-perf before and
/// after the RPC round trips and reports the blocking figure's ratio to it.
/// A workspace build has na-perf next to hg-perf; without it the flag must
/// fail with a message that says how to build it.
#[test]
fn lat_floors_report_the_eventfd_round_trip_and_the_ratio() {
    let args = ["lat", "--mode", "busy,blocking", "--sizes", "8", "--floors"];
    if na_perf_missing(&args) {
        return;
    }
    let lines = run(&args);
    let tests: Vec<&str> = lines.iter().map(|v| v["test"].as_str().unwrap()).collect();
    assert_eq!(
        tests,
        [
            "floor_eventfd_rtt",
            "lat",
            "lat",
            "floor_eventfd_rtt",
            "lat_vs_eventfd_rtt"
        ],
        "{lines:?}"
    );
    check(&lines[0], "ns");
    check(&lines[3], "ns");
    assert_eq!(lines[2]["mode"], "blocking");
    assert_eq!(lines[4]["mode"], "blocking");
    // Against the mean of the floors before and after, as rate and bw.
    check_ratio(&lines[4], &lines[2], &lines[0], &lines[3]);
}

/// `rate --floors` measures the busy one-in-flight ceilings (shared-flag
/// and NA ping-pongs) with na-perf before and after, and reports each busy
/// one-in-flight rate's ratio to their mean; other rates (more in flight, a
/// payload larger than the ceilings' 8 bytes) get no ratio.
#[test]
fn rate_floors_report_the_busy_ceilings_and_the_ratios() {
    let args = [
        "rate",
        "--mode",
        "busy",
        "--sizes",
        "0,1K",
        "--inflight",
        "1,4",
        "--floors",
    ];
    if na_perf_missing(&args) {
        return;
    }
    let lines = run(&args);
    let tests: Vec<&str> = lines.iter().map(|v| v["test"].as_str().unwrap()).collect();
    assert_eq!(
        tests,
        [
            "rate_ceiling_flag",
            "rate_ceiling_na",
            "rate_ceiling_na_pull",
            "rate",
            "rate",
            "rate",
            "rate",
            "rate_ceiling_flag",
            "rate_ceiling_na",
            "rate_ceiling_na_pull",
            "rate_vs_flag_ceiling",
            "rate_vs_na_ceiling",
            "rate_vs_na_pull_ceiling"
        ],
        "{lines:?}"
    );
    for v in &lines[..10] {
        check(v, "ops/s");
    }
    let busy_single = &lines[3];
    assert_eq!(
        (lines[5]["size"].as_u64(), lines[5]["inflight"].as_u64()),
        (Some(1024), Some(1))
    );
    assert_eq!(
        (busy_single["mode"].as_str(), busy_single["inflight"].as_u64()),
        (Some("busy"), Some(1))
    );
    for (ratio, before, after) in [
        (&lines[10], &lines[0], &lines[7]),
        (&lines[11], &lines[1], &lines[8]),
        (&lines[12], &lines[2], &lines[9]),
    ] {
        check_ratio(ratio, busy_single, before, after);
    }
}

/// `bw --floors` measures the raw `process_vm_readv` and
/// `process_vm_writev` bandwidths of one transfer with na-perf before and
/// after, and reports the ratio of every figure moved one transfer per RPC
/// to the readv floor, and of every write to the writev floor (1M here; 4K
/// goes 64 per RPC and gets none). Sizes that all go many per RPC are
/// refused with a clear error.
#[test]
fn bw_floors_report_the_cma_floor_and_the_ratios() {
    let hg = env!("CARGO_BIN_EXE_hg-perf");
    if na_perf_missing(&["bw", "--floors", "--sizes", "1M"]) {
        return;
    }
    let out = Command::new(hg)
        .args(["bw", "--floors", "--sizes", "4K"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("one per RPC"), "{err}");

    let lines = run(&["bw", "--mode", "adaptive", "--sizes", "4K,1M", "--floors"]);
    let tests: Vec<&str> = lines.iter().map(|v| v["test"].as_str().unwrap()).collect();
    assert_eq!(
        tests,
        [
            "floor_cma_read_bw",
            "floor_cma_write_bw",
            "bw",
            "bw",
            "bw",
            "bw",
            "floor_cma_read_bw",
            "floor_cma_write_bw",
            "bw_vs_cma_floor",
            "bw_vs_cma_floor",
            "bw_vs_cma_write_floor"
        ],
        "{lines:?}"
    );
    let (read0, write0, read1, write1) = (&lines[0], &lines[1], &lines[6], &lines[7]);
    for floor in [read0, write0, read1, write1] {
        check(floor, "MiB/s");
    }
    // Both 1 MiB figures against the readv floor; the write also against
    // the writev floor.
    for (ratio, bw, before, after) in [
        (&lines[8], &lines[3], read0, read1),
        (&lines[9], &lines[5], read0, read1),
        (&lines[10], &lines[5], write0, write1),
    ] {
        assert_eq!(
            (bw["size"].as_u64(), bw["op"].as_str()),
            (Some(1 << 20), ratio["op"].as_str())
        );
        check_ratio(ratio, bw, before, after);
    }
}

/// A busy hg-perf server must not outlive the run that started it (killed
/// by `timeout`, say): it would spin on a core forever.
#[test]
fn a_killed_run_takes_its_busy_server_with_it() {
    use std::time::{Duration, Instant};
    let mut run = Command::new(env!("CARGO_BIN_EXE_hg-perf"))
        .args(["rate", "--mode", "busy", "--sizes", "0", "--inflight", "1"])
        .args(["--batches", "1000", "--batch-ms", "1000"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("hg-perf starts");
    let pid = run.id();
    let deadline = Instant::now() + Duration::from_secs(20);
    let server: u32 = loop {
        let kids = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        if let Some(p) = kids.split_whitespace().find_map(|c| c.parse().ok()) {
            break p;
        }
        assert!(Instant::now() < deadline, "hg-perf started no server in 20 s");
        std::thread::sleep(Duration::from_millis(20));
    };
    std::thread::sleep(Duration::from_millis(500));
    run.kill().expect("SIGKILL to hg-perf");
    run.wait().expect("reaped");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{server}/stat")).unwrap_or_default();
        // Gone, or a zombie waiting for its new parent to reap it.
        if stat
            .rsplit_once(')')
            .is_none_or(|(_, r)| r.trim_start().starts_with('Z'))
        {
            break;
        }
        if Instant::now() > deadline {
            let _ = Command::new("kill").args(["-9", &server.to_string()]).status();
            panic!("server {server} still runs 10 s after its hg-perf was killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
