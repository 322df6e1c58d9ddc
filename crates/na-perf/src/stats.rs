//! Sampling: how each figure is measured.
//!
//! A figure is measured in three phases: a warm-up (bounded by an operation
//! count and by one batch time), then `batches` timed batches of the same
//! number of operations, whose per-operation means give the **median**, then
//! as many operations again, each timed on its own, whose distribution gives
//! the **p99**. The two timed phases are kept apart so that the median is
//! not inflated by a clock read per operation.

use std::time::{Duration, Instant};

/// How long and how often to measure one figure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Number of timed batches (the median is taken over them).
    pub batches: usize,
    /// Upper bound on operations per batch.
    pub max_iters: usize,
    /// Upper bound on warm-up operations.
    pub warmup: usize,
    /// Target duration of one batch; the operation count per batch is
    /// chosen from the warm-up so that a batch takes about this long.
    pub batch_time: Duration,
}

impl Plan {
    /// Operations per batch for an operation that takes `per_op`.
    fn iters_for(&self, per_op: Duration) -> usize {
        let n = self.batch_time.as_nanos() / per_op.as_nanos().max(1);
        (n.min(self.max_iters as u128) as usize).max(1)
    }
}

/// The measured times of one operation, in nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    /// Median over batches of the mean time per operation.
    pub median_ns: f64,
    /// 99th percentile of the individually timed operations.
    pub p99_ns: f64,
    /// Median of the individually timed operations (what a caller that
    /// times single operations, as hg-perf's `lat` does, compares with;
    /// the batch median above excludes the clock reads).
    pub p50_ns: f64,
    /// Operations per batch.
    pub iters: usize,
}

impl Summary {
    /// The same summary with every time divided by `d` (e.g. 2 for one-way
    /// latency out of a round trip).
    pub fn scaled(self, d: f64) -> Summary {
        Summary {
            median_ns: self.median_ns / d,
            p99_ns: self.p99_ns / d,
            p50_ns: self.p50_ns / d,
            iters: self.iters,
        }
    }
}

/// Measures `op` according to `plan`. Any error of `op` stops the
/// measurement and is returned.
pub fn measure<E>(plan: &Plan, mut op: impl FnMut() -> Result<(), E>) -> Result<Summary, E> {
    let start = Instant::now();
    let mut warm = 0usize;
    while warm < plan.warmup.max(1) && (warm == 0 || start.elapsed() < plan.batch_time) {
        op()?;
        warm += 1;
    }
    let iters = plan.iters_for(start.elapsed() / warm as u32);
    let batches = plan.batches.max(1);
    let mut means = Vec::with_capacity(batches);
    for _ in 0..batches {
        let t0 = Instant::now();
        for _ in 0..iters {
            op()?;
        }
        means.push(t0.elapsed().as_nanos() as f64 / iters as f64);
    }
    let mut samples = Vec::with_capacity(batches * iters);
    let mut prev = Instant::now();
    for _ in 0..batches * iters {
        op()?;
        let now = Instant::now();
        samples.push(now.duration_since(prev).as_nanos() as f64);
        prev = now;
    }
    Ok(Summary {
        median_ns: median(&mut means),
        p99_ns: percentile(&mut samples, 0.99),
        p50_ns: percentile(&mut samples, 0.5),
        iters,
    })
}

/// The median of `v` (mean of the two middle values for even lengths); 0 if empty.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The nearest-rank `q` quantile of `v` (0 < q <= 1); 0 if empty.
pub fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = (q * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// Bandwidth in MiB/s of moving `bytes` in `ns` nanoseconds.
pub fn mib_per_s(bytes: usize, ns: f64) -> f64 {
    if ns <= 0.0 {
        return 0.0;
    }
    bytes as f64 / (1024.0 * 1024.0) / (ns * 1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_percentile() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 0.99), 99.0);
        assert_eq!(percentile(&mut [5.0], 0.99), 5.0);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn measure_counts_and_stops_on_error() {
        let plan = Plan {
            batches: 3,
            max_iters: 4,
            warmup: 2,
            batch_time: Duration::from_secs(1),
        };
        let mut calls = 0;
        let s = measure(&plan, || {
            calls += 1;
            Ok::<(), ()>(())
        })
        .unwrap();
        assert_eq!(s.iters, 4);
        assert_eq!(calls, 2 + 3 * 4 * 2);
        let mut left = 5;
        let r = measure(&plan, || {
            left -= 1;
            if left == 0 {
                Err("boom")
            } else {
                Ok(())
            }
        });
        assert_eq!(r.unwrap_err(), "boom");
        assert!((mib_per_s(1 << 20, 1e9) - 1.0).abs() < 1e-9);
    }
}
