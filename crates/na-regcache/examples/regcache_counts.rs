//! Deterministic cost counts of the cache's own code, for
//! `valgrind --tool=callgrind` (instruction counts do not depend on the
//! machine's load, unlike the timings of `benches/regcache.rs`).
//!
//! ```sh
//! cargo build --release -p na-regcache --example regcache_counts
//! valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*measured*' \
//!     target/release/examples/regcache_counts churn 1000 20000
//! ```
//!
//! Workloads (`<workload> <entries> <operations>`), over a registrar that
//! registers nothing and no monitor, so that only the cache is counted:
//!
//! * `churn`: a cache of `entries` idle one-page entries scattered over
//!   the address space; each operation invalidates a random entry (taken
//!   out of the index) and misses on a random free page (put in): the
//!   index's insertions and removals at that size.
//! * `full`: a full cache whose entries are all in use; each operation is
//!   a miss (handed out uncached) and its release.
//! * `hits`: `entries` idle entries; each operation is a hit and its release.
//! * `tracked`: `entries` registrations for peers (`get_unshared`, each
//!   with a tracking slot; under a monitor that accepts every range and
//!   reports nothing); each operation invalidates by hand a page that none
//!   of them covers: the scan of the tracking slots.
//!
//! Only the operations are counted (the `measured` function); the set-up
//! is not.

use std::hint::black_box;
use std::io;
use std::sync::Arc;

use na_regcache::{
    Access, Cache, CacheConfig, Consistency, InvalidationSink, Monitor, MonitorChoice, Registrar, SinkId,
    Watch,
};

const PAGE: usize = 4096;
const W: Access = Access::LOCAL_WRITE;

struct Noop;

impl Registrar for Noop {
    type Region = ();
    type Error = io::Error;
    fn register(&self, _: usize, _: usize, _: Access) -> io::Result<()> {
        Ok(())
    }
    fn deregister(&self, _: ()) -> io::Result<()> {
        Ok(())
    }
}

/// Accepts every range and reports no change (invalidations come by
/// hand), so it keeps no sink.
struct Silent;

impl Monitor for Silent {
    fn name(&self) -> &'static str {
        "silent"
    }
    fn attach(&self, _: Arc<dyn InvalidationSink>) -> io::Result<SinkId> {
        Ok(SinkId::new())
    }
    fn detach(&self, _: SinkId) -> Option<Arc<dyn InvalidationSink>> {
        None
    }
    fn subscribe(&self, _: usize, _: usize, cookie: u64) -> io::Result<Watch> {
        Ok(Watch {
            cookie,
            token: [0; 2],
        })
    }
    fn unsubscribe(&self, _: &Watch) {}
    fn sync(&self) {}
}

struct Rng(u64);

impl Rng {
    fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn config(max_count: usize) -> CacheConfig {
    CacheConfig {
        max_count,
        max_bytes: usize::MAX / 2,
        monitor: MonitorChoice::None,
        fork_guard: false,
        consistency: Consistency::Returned,
        map_watch: false,
    }
}

fn cache(max_count: usize) -> Cache<Noop> {
    Cache::new(Noop, config(max_count)).expect("cache")
}

/// The counted part: `ops` operations of `workload`.
#[inline(never)]
fn measured(workload: &str, c: &Cache<Noop>, pages: &mut [bool], rng: &mut Rng, ops: usize) {
    let n = pages.len();
    match workload {
        "churn" => {
            for _ in 0..ops {
                // Out: a cached page; in: a free one (two pages apart at
                // least: entries never merge).
                let out = loop {
                    let p = rng.next(n);
                    if pages[p] {
                        break p;
                    }
                };
                c.invalidate(out * 2 * PAGE + PAGE, PAGE);
                pages[out] = false;
                let into = loop {
                    let p = rng.next(n);
                    if !pages[p] {
                        break p;
                    }
                };
                drop(black_box(c.get(into * 2 * PAGE + PAGE, PAGE, W).expect("miss")));
                pages[into] = true;
            }
        }
        "full" => {
            for _ in 0..ops {
                drop(black_box(c.get(PAGE, PAGE, W).expect("miss")));
            }
        }
        "hits" => {
            for _ in 0..ops {
                let p = rng.next(n);
                drop(black_box(c.get(p * 2 * PAGE + PAGE, PAGE, W).expect("hit")));
            }
        }
        "tracked" => {
            for _ in 0..ops {
                c.invalidate(PAGE, PAGE);
            }
        }
        other => panic!("unknown workload {other}: churn, full, hits or tracked"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: regcache_counts churn|full|hits|tracked <entries> <operations>";
    let (Some(workload), Some(entries), Some(ops)) = (args.first(), args.get(1), args.get(2)) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let (Ok(entries), Ok(ops)) = (entries.parse::<usize>(), ops.parse::<usize>()) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut held = Vec::new();
    let (c, mut pages) = match workload.as_str() {
        "churn" => {
            // Twice as many places as entries: half of them cached.
            let c = cache(entries);
            let mut pages = vec![false; 2 * entries];
            let mut cached = 0;
            while cached < entries {
                let p = rng.next(pages.len());
                if !pages[p] {
                    drop(c.get(p * 2 * PAGE + PAGE, PAGE, W).expect("fill"));
                    pages[p] = true;
                    cached += 1;
                }
            }
            (c, pages)
        }
        "full" | "hits" => {
            let c = cache(entries);
            for p in 0..entries {
                let h = c.get((p + 1) * 2 * PAGE + PAGE, PAGE, W).expect("fill");
                if workload == "full" {
                    held.push(h);
                }
            }
            (c, vec![true; entries])
        }
        "tracked" => {
            let c = Cache::with_monitor(Noop, config(16), Arc::new(Silent)).expect("cache");
            for p in 0..entries {
                held.push(
                    c.get_unshared((p + 1) * 2 * PAGE + PAGE, PAGE, W)
                        .expect("unshared"),
                );
            }
            (c, vec![true; entries])
        }
        other => {
            eprintln!("unknown workload {other}; {usage}");
            std::process::exit(2);
        }
    };
    measured(workload, &c, &mut pages, &mut rng, ops);
    eprintln!("{workload} {entries} {ops}: {:?}", c.stats());
}
