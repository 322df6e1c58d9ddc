//! The corruption suite: every scenario runs in its own process (clean
//! allocator state, no other test threads touching the address space) with
//! monitor `none` (which must corrupt: proof the test can fail), `uffd`
//! (with both consistency levels) and `alloc`. Registrations are io_uring fixed buffers (long-term pins, like
//! `ibv_reg_mr`); checks are the data a READ_FIXED delivers and the page
//! frames in /proc/self/pagemap.

mod common;

use std::alloc::System;
use std::process::Command;

use common::{scenarios, Outcome, Rig};
use na_regcache::{Consistency, InvalidatingAlloc, MonitorChoice};

#[global_allocator]
static ALLOC: InvalidatingAlloc<System> = InvalidatingAlloc::new(System);

const MONITORS: [&str; 3] = ["none", "uffd", "alloc"];

/// Expected result per monitor: the table in `src/coverage.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Zero stale data and frames.
    Clean,
    /// Stale data or frames.
    Corrupt,
    /// Clean even without a monitor (the kernel keeps pinned pages).
    NotApplicable,
}
use Expect::{Clean as C, Corrupt as X, NotApplicable as NA};

const EXPECTED: &[(&str, &str, [Expect; 3])] = &[
    ("heap", "heap (Rust `Vec` freed, allocator unmaps it)", [X, C, C]),
    ("stack", "stack (thread exits, glibc drops its pages)", [X, C, X]),
    ("static_mem", "static (`MADV_DONTNEED` on .bss)", [X, C, X]),
    ("mmap", "mmap: munmap, new mmap at the same address", [X, C, X]),
    ("mremap", "mremap move, new mmap at the old address", [X, C, X]),
    ("madv_dontneed", "madvise `MADV_DONTNEED`", [X, C, X]),
    ("madv_free", "madvise `MADV_FREE` (+ `MADV_PAGEOUT`)", [NA, C, NA]),
    ("partial_unmap", "partial munmap of a registration", [X, C, X]),
    ("map_fixed", "`MAP_FIXED` overlay", [X, C, X]),
    ("shmat_remap", "SysV `shmat` with `SHM_REMAP` overlay", [X, X, X]),
    ("brk", "brk shrink and regrow", [X, C, X]),
    ("fork", "fork (child uses the parent's cache)", [X, C, C]),
    ("file", "file-backed (memfd `MAP_SHARED`) remapped", [X, C, C]),
    (
        "file_punch_hole",
        "memfd `MAP_SHARED`, `fallocate(PUNCH_HOLE)`",
        [X, C, C],
    ),
    (
        "file_truncate",
        "memfd `MAP_SHARED`, `ftruncate` shrink and regrow",
        [X, C, C],
    ),
    (
        "file_madv_remove",
        "memfd `MAP_SHARED`, `MADV_REMOVE` through another mapping",
        [X, C, C],
    ),
    (
        "file_private_truncate",
        "memfd `MAP_PRIVATE`, `ftruncate` shrink and regrow",
        [X, X, X],
    ),
    ("thp", "transparent huge page remapped", [X, C, X]),
    ("unaligned", "non-page-aligned range, pages remapped", [X, C, X]),
];

fn expected(scenario: &str) -> [Expect; 3] {
    EXPECTED
        .iter()
        .find(|(n, _, _)| *n == scenario)
        .map(|e| e.2)
        .expect("scenario in EXPECTED")
}

/// Runs `scenario` under `monitor` in a child process of this test binary.
fn run_isolated(scenario: &str, monitor: &str) -> Outcome {
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "scenario_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("QS_RC_SCENARIO", scenario)
        .env("QS_RC_MONITOR", monitor)
        .env_remove("QS_MR_CACHE_MONITOR")
        .output()
        .expect("spawn scenario child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.split("OUTCOME ").nth(1))
        .unwrap_or_else(|| {
            panic!(
                "{scenario}/{monitor}: child printed no outcome\n{stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    let mut it = line.split_whitespace();
    let stale_data = it.next() == Some("true");
    let stale_pfns = it.next().and_then(|n| n.parse().ok()).expect("pfn count");
    Outcome {
        stale_data,
        stale_pfns,
    }
}

fn classify(o: Outcome) -> Expect {
    if o.corrupt() {
        X
    } else {
        C
    }
}

fn check_scenario(scenario: &str) {
    common::require_io_uring();
    let want = expected(scenario);
    // `uffd-returned` (Consistency::Returned) must match `uffd` here: each
    // scenario's change returns before the lookup that follows it.
    let runs = MONITORS
        .iter()
        .enumerate()
        .chain(std::iter::once((1, &"uffd-returned")));
    for (i, monitor) in runs {
        let got = run_isolated(scenario, monitor);
        eprintln!("{scenario:>14} / {monitor:<5}: {got:?}");
        let ok = match want[i] {
            NA => !got.corrupt(),
            w => classify(got) == w,
        };
        assert!(
            ok,
            "{scenario} with monitor {monitor}: expected {:?}, got {got:?}",
            want[i]
        );
    }
}

/// Executed in the child process by `run_isolated`.
#[test]
#[ignore = "helper: run in a subprocess by the scenario tests"]
fn scenario_child() {
    let scenario = std::env::var("QS_RC_SCENARIO").expect("QS_RC_SCENARIO");
    let monitor = std::env::var("QS_RC_MONITOR").expect("QS_RC_MONITOR");
    let rig = match monitor.as_str() {
        // The unprotected baseline: no monitor and no fork guard.
        "none" => Rig::with_guard(MonitorChoice::None, false),
        "uffd-returned" => Rig::with_consistency(MonitorChoice::Uffd, Consistency::Returned),
        m => Rig::new(MonitorChoice::parse(m).expect("monitor name")),
    };
    let o = scenarios::run(&scenario, &rig).unwrap_or_else(|e| panic!("{scenario}/{monitor}: {e}"));
    println!("OUTCOME {} {}", o.stale_data, o.stale_pfns);
}

macro_rules! scenario_tests {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            check_scenario(stringify!($name));
        }
    )*};
}

scenario_tests!(
    heap,
    stack,
    static_mem,
    mmap,
    mremap,
    madv_dontneed,
    madv_free,
    partial_unmap,
    map_fixed,
    shmat_remap,
    brk,
    fork,
    file,
    file_punch_hole,
    file_truncate,
    file_madv_remove,
    file_private_truncate,
    thp,
    unaligned
);

/// The documented table (src/coverage.md) is exactly `EXPECTED`, which the
/// scenario tests above check against reality.
#[test]
fn coverage_table_matches_docs() {
    let sym = |e: Expect| match e {
        C => "✔",
        X => "✘",
        NA => "n/a",
    };
    let mut table = String::from("| memory change | none | uffd | alloc |\n|---|---|---|---|\n");
    for (_, label, row) in EXPECTED {
        table.push_str(&format!(
            "| {label} | {} | {} | {} |\n",
            sym(row[0]),
            sym(row[1]),
            sym(row[2])
        ));
    }
    println!("{table}");
    let doc = include_str!("../src/coverage.md");
    assert!(
        doc.contains(&table),
        "src/coverage.md is out of date; expected table:\n{table}"
    );
    let repo_doc = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/REGCACHE.md");
    let repo_doc = std::fs::read_to_string(repo_doc).expect("docs/REGCACHE.md");
    assert!(
        repo_doc.contains(&table),
        "docs/REGCACHE.md table is out of date; expected:\n{table}"
    );
    assert_eq!(scenarios::ALL.len(), EXPECTED.len());
}

/// hugetlbfs needs reserved huge pages, which this host does not have by
/// default: then the test says so loudly and checks nothing else.
#[test]
fn hugetlbfs_where_available() {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let free: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("HugePages_Free:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    if free < 2 {
        na_core::testing::report_not_run(&format!(
            "na-regcache hugetlbfs_where_available: HugePages_Free={free} (reserve pages with \
             `sysctl vm.nr_hugepages=4`; scripts/test-all.sh does as root)"
        ));
        return;
    }
    common::require_io_uring();
    let none = run_isolated("hugetlb", "none");
    let uffd = run_isolated("hugetlb", "uffd");
    eprintln!("hugetlb: none {none:?}, uffd {uffd:?}");
    assert!(none.corrupt(), "hugetlb without monitor must corrupt: {none:?}");
    assert!(!uffd.corrupt(), "hugetlb with uffd must be clean: {uffd:?}");
}
