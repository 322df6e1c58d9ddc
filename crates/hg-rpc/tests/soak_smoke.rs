//! hg-soak works (a few seconds of it; long soaks are run by hand, see the
//! README): clients make verified calls, some are killed mid-run, and the
//! server ends with no leaked descriptor.

use std::process::Command;

#[test]
fn short_soak_with_kills_passes_its_own_checks() {
    let out = Command::new(env!("CARGO_BIN_EXE_hg-soak"))
        .args([
            "--secs",
            "5",
            "--clients",
            "2",
            "--kill-every-ms",
            "700",
            "--seed",
            "7",
        ])
        .output()
        .expect("run hg-soak");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "hg-soak failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("hg-soak:"))
        .expect("summary line");
    let number_before = |word: &str| -> u64 {
        let i = line.find(word).unwrap_or_else(|| panic!("{word} in {line}"));
        line[..i].split_whitespace().last().unwrap().parse().unwrap()
    };
    assert!(number_before("killed mid-run") >= 1, "{line}");
    assert!(number_before("verified calls") > 0, "{line}");
    let fds = line.split("server fds ").nth(1).unwrap();
    let (a, b) = fds.split_once(" -> ").unwrap();
    let b: u64 = b.split(',').next().unwrap().parse().unwrap();
    assert!(b <= a.parse::<u64>().unwrap(), "{line}");
}
