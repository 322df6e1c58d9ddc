//! tonic-perf runs and reports well-formed JSON (a functional check; no
//! speed is asserted).

#[test]
fn tonic_perf_reports_json() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tonic-perf"))
        .arg("--json")
        .output()
        .expect("run tonic-perf");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5, "four rate results and one latency result");
    for v in &lines {
        for k in ["test", "transport", "size", "inflight", "median", "p99", "unit"] {
            assert!(v.get(k).is_some(), "missing {k} in {v}");
        }
        assert!(v["median"].as_f64().unwrap() > 0.0);
    }
}
