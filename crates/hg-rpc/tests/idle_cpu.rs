//! The adaptive target's other half: a server in the default (adaptive)
//! mode that has served traffic and then has none uses under 5 % of a
//! CPU, all its threads counted (the tokio driver's own test measures
//! the client side). A real server process, measured from outside.

use std::time::Duration;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{client, dir, Server};

const T: Duration = Duration::from_secs(10);

/// User plus system CPU time of process `pid`, all threads, in seconds
/// (`/proc/<pid>/stat` fields 14 and 15, in clock ticks).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the server's /proc stat");
    // The command name (field 2) may hold spaces: count from after it.
    let rest = &stat[stat.rfind(')').expect("a stat line") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let per_second = common::sys::sysconf(libc::_SC_CLK_TCK).expect("sysconf(_SC_CLK_TCK)");
    ticks as f64 / per_second as f64
}

#[test]
fn an_idle_adaptive_server_uses_under_5_percent_of_a_cpu() {
    let d = dir("idle-server");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    // Traffic first (adaptive spins while it flows), then none; the
    // client stays connected.
    for i in 0..2_000u64 {
        assert_eq!(c.call::<Add>(&s, &(i, 1), T).unwrap(), i + 1);
    }
    std::thread::sleep(Duration::from_millis(100));
    let pid = srv.child.id();
    let (t0, c0) = (std::time::Instant::now(), cpu_seconds(pid));
    std::thread::sleep(Duration::from_secs(2));
    let share = (cpu_seconds(pid) - c0) / t0.elapsed().as_secs_f64();
    assert!(
        share < 0.05,
        "the idle server used {:.1} % of a CPU",
        share * 100.0
    );
    // It still serves.
    assert_eq!(c.call::<Add>(&s, &(2, 2), T).unwrap(), 4);
}
