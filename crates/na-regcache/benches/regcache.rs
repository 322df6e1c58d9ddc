//! Registration cache benchmark (`cargo bench -p na-regcache`).
//!
//! Raw registration is an io_uring fixed-buffer update, which pins pages
//! long-term like `ibv_reg_mr` (and is cheaper than it, so the cache's
//! relative gains here are a lower bound). Every figure is the median of
//! several samples; compare ratios within one run (the machine is noisy).

use std::hint::black_box;
use std::time::Instant;

use na_regcache::{
    Access, Cache, CacheConfig, Consistency, MonitorChoice, Registrar, UffdMonitor, UringRegistrar,
};

const PAGE: usize = 4096;
const SAMPLES: usize = 9;
const W: Access = Access::LOCAL_WRITE;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median over samples of `f()`, which returns nanoseconds per operation.
fn bench(mut f: impl FnMut() -> f64) -> f64 {
    f(); // warm-up
    median((0..SAMPLES).map(|_| f()).collect())
}

/// `n` touched anonymous buffers of `len` bytes (one mapping each).
fn buffers(n: usize, len: usize) -> Vec<usize> {
    (0..n)
        .map(|_| {
            let v: &'static mut [u8] = Box::leak(vec![1u8; len + PAGE].into_boxed_slice());
            (v.as_ptr() as usize + PAGE - 1) & !(PAGE - 1)
        })
        .collect()
}

/// The cache set-ups compared: userfaultfd with each consistency, no monitor.
const VARIANTS: [(MonitorChoice, Consistency, &str); 3] = [
    (MonitorChoice::Uffd, Consistency::InFlight, "uffd, in-flight"),
    (MonitorChoice::Uffd, Consistency::Returned, "uffd, returned"),
    (MonitorChoice::None, Consistency::InFlight, "none"),
];

/// Whether the userfaultfd monitor opens its map watch:
/// `QS_MR_CACHE_MAP_WATCH=off` measures in-flight lookups without it.
fn map_watch() -> bool {
    CacheConfig::from_env()
        .expect("QS_MR_CACHE_* variables")
        .map_watch
}

fn cache(monitor: MonitorChoice, max_count: usize) -> Cache<UringRegistrar> {
    cache_with(monitor, Consistency::InFlight, max_count)
}

fn cache_with(monitor: MonitorChoice, consistency: Consistency, max_count: usize) -> Cache<UringRegistrar> {
    let reg = UringRegistrar::new(4096, false).expect("io_uring fixed buffers");
    Cache::new(
        reg,
        CacheConfig {
            max_count,
            max_bytes: 1 << 34,
            monitor,
            fork_guard: true,
            consistency,
            map_watch: map_watch(),
        },
    )
    .expect("cache")
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

fn hit_cost(c: &Cache<UringRegistrar>, bufs: &[usize], threads: usize) -> f64 {
    const OPS: usize = 200_000;
    bench(|| {
        let per_thread: Vec<f64> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    s.spawn(move || {
                        let mut rng = Rng(0x1234_5678 + t as u64);
                        let t0 = Instant::now();
                        for _ in 0..OPS {
                            let a = bufs[rng.next(bufs.len())];
                            black_box(c.get(a, PAGE, W).expect("hit"));
                        }
                        t0.elapsed().as_nanos() as f64 / OPS as f64
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("bench thread")).collect()
        });
        per_thread.into_iter().fold(0.0, f64::max)
    })
}

/// ns per get+release over `ops` accesses of `bufs` in `order`.
fn workload(c: &Cache<UringRegistrar>, bufs: &[usize], len: usize, ops: usize) -> f64 {
    bench(|| {
        let t0 = Instant::now();
        for i in 0..ops {
            black_box(c.get(bufs[i % bufs.len()], len, W).expect("get"));
        }
        let ns = t0.elapsed().as_nanos() as f64 / ops as f64;
        c.evict_idle();
        ns
    })
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let ring_ok = UringRegistrar::new(1, false);
    if let Err(e) = ring_ok {
        eprintln!("regcache bench: io_uring unavailable ({e}); nothing measured");
        std::process::exit(1);
    }
    // `cargo bench -p na-regcache -- <section>` runs one section: hit, miss, reuse, noreuse.
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let run = |name: &str| filter.is_empty() || filter.iter().any(|f| name.contains(f.as_str()));
    println!("na-regcache benchmark: medians of {SAMPLES} samples, ns per operation");
    if let Ok(m) = UffdMonitor::global_with(map_watch()) {
        match m.map_watch_rings() {
            Some(n) => println!("userfaultfd map watch: on ({n} CPU rings)"),
            None => println!("userfaultfd map watch: off (every in-flight lookup probes)"),
        }
    }

    // 1. Hit cost with 1024 cached one-page entries.
    let bufs = buffers(1024, PAGE);
    for (monitor, consistency, label) in VARIANTS.into_iter().filter(|_| run("hit")) {
        let c = cache_with(monitor, consistency, 2048);
        for &a in &bufs {
            drop(c.get(a, PAGE, W).expect("fill"));
        }
        let h1 = hit_cost(&c, &bufs, 1);
        let h2 = hit_cost(&c, &bufs, 2);
        println!("hit (get+release, 1024 entries, {label}): 1 thread {h1:.0} ns, 2 threads {h2:.0} ns");
    }

    // 2. Miss cost vs raw registration (64 KiB buffers).
    const LEN: usize = 64 << 10;
    let bufs = buffers(512, LEN);
    let raw_reg = UringRegistrar::new(1024, false).expect("ring");
    let raw = bench(|| {
        let t0 = Instant::now();
        let regs: Vec<_> = bufs
            .iter()
            .map(|&a| raw_reg.register(a, LEN, W).expect("register"))
            .collect();
        let ns = t0.elapsed().as_nanos() as f64 / bufs.len() as f64;
        regs.into_iter()
            .for_each(|r| raw_reg.deregister(r).expect("deregister"));
        ns
    });
    let raw_pair = bench(|| {
        let t0 = Instant::now();
        for &a in &bufs {
            raw_reg
                .deregister(raw_reg.register(a, LEN, W).expect("register"))
                .expect("deregister");
        }
        t0.elapsed().as_nanos() as f64 / bufs.len() as f64
    });
    println!("raw registration (64 KiB): register {raw:.0} ns, register+deregister {raw_pair:.0} ns");
    for (monitor, consistency, label) in VARIANTS.into_iter().filter(|_| run("miss")) {
        let c = cache_with(monitor, consistency, 1024);
        let miss = workload(&c, &bufs, LEN, bufs.len());
        println!(
            "miss (64 KiB, {label}): {miss:.0} ns = {:.2}x raw register",
            miss / raw
        );
    }

    // 3. 16-buffer reuse vs registering every time.
    let reuse = &bufs[..16];
    let disabled = cache(MonitorChoice::Disabled, 16);
    let base = workload(&disabled, reuse, LEN, 20_000);
    for (monitor, consistency, label) in VARIANTS.into_iter().filter(|_| run("reuse")) {
        let c = cache_with(monitor, consistency, 64);
        let t = workload(&c, reuse, LEN, 20_000);
        println!(
            "reuse 16 buffers ({label}): {t:.0} ns vs no cache {base:.0} ns: {:.1}x faster",
            base / t
        );
    }

    // 4. No reuse (each buffer once per 512 accesses, 64-entry cache) and
    // 5. thrashing (cyclic over 2x the entry limit) vs cache disabled.
    let base = workload(&disabled, &bufs, LEN, 2048);
    for (label, max) in [("no reuse", 64), ("thrash 2x limit", 256)]
        .into_iter()
        .filter(|_| run("noreuse"))
    {
        for (monitor, consistency, mlabel) in VARIANTS {
            let c = cache_with(monitor, consistency, max);
            let t = workload(&c, &bufs[..if max == 256 { 512 } else { bufs.len() }], LEN, 2048);
            println!(
                "{label} ({mlabel}): {t:.0} ns vs no cache {base:.0} ns: {:.2}x",
                t / base
            );
        }
    }
    if let Ok(m) = UffdMonitor::global() {
        println!("userfaultfd events during the run: {:?}", m.counters());
    }
}
