//! Smoke test of the `na-perf` binary: runs the quick presets against a real
//! peer process and checks that every JSON line parses and carries the
//! required fields with positive values. A functional check only: no speed
//! threshold is asserted (speed is judged from the benchmark's own output).

use std::process::Command;

use serde_json::Value;

fn run(args: &[&str]) -> Vec<Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_na-perf"))
        .args(args)
        .output()
        .expect("na-perf runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "na-perf {args:?} failed: {}\n{stderr}",
        out.status
    );
    let stdout = String::from_utf8(out.stdout).expect("UTF-8 output");
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}")))
        .collect();
    assert!(
        !lines.is_empty(),
        "na-perf {args:?} printed no result; stderr:\n{stderr}"
    );
    lines
}

fn check_fields(v: &Value) {
    for key in ["test", "op", "mode", "unit"] {
        assert!(
            v[key].as_str().is_some_and(|s| !s.is_empty()),
            "{key} missing in {v}"
        );
    }
    for key in ["size", "segments"] {
        assert!(v[key].as_u64().is_some(), "{key} missing in {v}");
    }
    assert!(v["segments"].as_u64().unwrap() >= 1, "{v}");
    for key in ["median", "p50", "p99"] {
        let x = v[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {v}"));
        assert!(x.is_finite() && x > 0.0, "{key} not positive in {v}");
    }
}

#[test]
fn lat_quick_json() {
    let lines = run(&["lat", "--quick", "--json"]);
    for v in &lines {
        check_fields(v);
        assert_eq!(v["test"], "lat", "{v}");
        assert_eq!(v["unit"], "ns", "{v}");
        assert!(v.get("floor").is_none(), "no floors were asked for: {v}");
    }
    for mode in ["busy", "adaptive", "blocking"] {
        for op in ["expected", "unexpected"] {
            let sizes: Vec<u64> = lines
                .iter()
                .filter(|v| v["mode"] == mode && v["op"] == op)
                .filter_map(|v| v["size"].as_u64())
                .collect();
            assert!(
                sizes.contains(&8),
                "no 8-byte {op} result in {mode} mode: {sizes:?}"
            );
            assert!(sizes.len() >= 2, "{op}/{mode}: only sizes {sizes:?}");
        }
    }
}

/// `--kind pulled` ping-pongs on hg-rpc's path (both sides in pull mode,
/// in a session of their own after the posted kinds) in every mode, next
/// to the classic unexpected kind of the same run.
#[test]
fn lat_pulled_kind_runs_in_a_session_of_its_own() {
    let lines = run(&[
        "lat",
        "--quick",
        "--json",
        "--kind",
        "unexpected,pulled",
        "--sizes",
        "8,4096",
    ]);
    for v in &lines {
        check_fields(v);
    }
    for mode in ["busy", "adaptive", "blocking"] {
        for op in ["unexpected", "pulled"] {
            let sizes: Vec<u64> = lines
                .iter()
                .filter(|v| v["test"] == "lat" && v["mode"] == mode && v["op"] == op)
                .filter_map(|v| v["size"].as_u64())
                .collect();
            assert_eq!(sizes, [8, 4096], "{op} in {mode} mode");
        }
    }
    // The pulled session comes second: every pulled figure after every
    // unexpected one.
    let last_unexpected = lines.iter().rposition(|v| v["op"] == "unexpected").unwrap();
    let first_pulled = lines.iter().position(|v| v["op"] == "pulled").unwrap();
    assert!(last_unexpected < first_pulled, "{lines:?}");
}

#[test]
fn bw_quick_json_with_floors() {
    let lines = run(&["bw", "--quick", "--json", "--floors"]);
    for v in &lines {
        check_fields(v);
        assert_eq!(v["unit"], "MiB/s", "{v}");
    }
    for segs in [1u64, 16] {
        for test in ["floor_cma_read_bw", "floor_cma_write_bw"] {
            let floor = lines
                .iter()
                .filter(|v| v["test"] == test && v["segments"] == segs)
                .count();
            assert_eq!(floor, 7, "{test} at 7 sizes for {segs} segment(s)");
        }
        // A get is compared with the read floor, a put with the write floor.
        let floor_of = |test: &str, size: &Value| {
            lines
                .iter()
                .find(|v| v["test"] == test && v["segments"] == segs && v["size"] == *size)
                .and_then(|v| v["median"].as_f64())
                .unwrap_or_else(|| panic!("no {test} of {size} bytes, {segs} segment(s)"))
        };
        for op in ["put", "get"] {
            let figures: Vec<&Value> = lines
                .iter()
                .filter(|v| v["test"] == "bw" && v["op"] == op && v["segments"] == segs)
                .collect();
            assert_eq!(figures.len(), 7, "{op} with {segs} segment(s) at 7 sizes");
            for v in figures {
                let floor = v["floor"].as_f64().unwrap_or_else(|| panic!("no floor in {v}"));
                let want = if op == "put" {
                    "floor_cma_write_bw"
                } else {
                    "floor_cma_read_bw"
                };
                assert_eq!(
                    floor,
                    floor_of(want, &v["size"]),
                    "{op} compared with {want}: {v}"
                );
                let ratio = v["ratio_to_floor"]
                    .as_f64()
                    .unwrap_or_else(|| panic!("no ratio in {v}"));
                assert!(floor > 0.0 && ratio > 0.0, "{v}");
                let expect = v["median"].as_f64().unwrap() / floor;
                assert!(
                    (ratio - expect).abs() <= 1e-9 * expect.max(1.0),
                    "ratio inconsistent in {v}"
                );
            }
        }
    }
}

#[test]
fn bad_arguments_are_clear_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_na-perf"))
        .args(["lat", "--quick", "--cpu", "0,1,2"])
        .output()
        .expect("na-perf runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--cpu"), "{stderr}");
}

/// Children started by the main thread of `pid` (proc(5), `children`).
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .collect()
}

/// A run killed while its peer spins in the shared-flag floor must not
/// leave the peer behind: before `--parent`, it burned a core forever.
#[test]
fn a_killed_run_takes_its_spinning_peer_with_it() {
    let mut run = Command::new(env!("CARGO_BIN_EXE_na-perf"))
        .args(["lat", "--floors", "--mode", "busy", "--sizes", "8"])
        .args(["--batches", "1000", "--batch-ms", "1000"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("na-perf starts");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let peer = loop {
        if let Some(&p) = children_of(run.id()).first() {
            break p;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "na-perf started no peer in 20 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // Let it get into the floor's busy loop.
    std::thread::sleep(std::time::Duration::from_millis(500));
    run.kill().expect("SIGKILL to na-perf");
    run.wait().expect("reaped");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{peer}")).exists() {
        // A zombie waiting for its (new) parent to reap it is gone enough.
        let state = std::fs::read_to_string(format!("/proc/{peer}/stat")).unwrap_or_default();
        if state
            .rsplit_once(')')
            .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        {
            break;
        }
        if std::time::Instant::now() > deadline {
            // Do not leave it spinning for the tests after us.
            let _ = Command::new("kill").args(["-9", &peer.to_string()]).status();
            panic!("peer {peer} still runs 10 s after its na-perf was killed");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
