//! `rate` and `lat` through [`hg_rpc::AsyncEngine`] (`--mode tokio`): calls
//! awaited on a current-thread tokio runtime, whose driver task sleeps on
//! the endpoint's fd. The server runs in blocking mode.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use na_core::ProgressMode;
use serde_bytes::ByteBuf;

use super::{
    engine, idle_clients_of, list, median, parse_size, report, report_lat, server_for, Cli, Noop, Res, Seen,
    T,
};

/// `lat` through [`hg_rpc::AsyncEngine`]: each call is awaited on a current-thread
/// tokio runtime, whose driver task sleeps on the endpoint's fd (the server
/// runs in blocking mode).
pub(crate) fn lat(cli: &Cli, sizes: &str, cpus: (Option<usize>, Option<usize>), seen: &mut Seen) -> Res<()> {
    let (_server, uri) = server_for(cli, ProgressMode::Blocking, cpus)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut c = engine(&cli.transport, ProgressMode::Blocking, false)?;
        let s = c.endpoint().lookup(&uri)?;
        let ae = hg_rpc::AsyncEngine::spawn(c)?;
        let batch = Duration::from_millis(cli.batch_ms);
        for size in list(sizes, parse_size)? {
            let input = ByteBuf::from(vec![7u8; size as usize]);
            for _ in 0..1000 {
                ae.call::<Noop>(&s, &input, T).await?;
            }
            let mut samples = Vec::new();
            let end = Instant::now() + batch * cli.batches as u32;
            while Instant::now() < end || samples.len() < 1000 {
                let t0 = Instant::now();
                ae.call::<Noop>(&s, &input, T).await?;
                samples.push(t0.elapsed().as_nanos() as u64);
            }
            let (p50, p99) = report_lat(cli, "tokio", size, samples);
            seen.lat_sleeping.push(("tokio", size, p50, p99));
        }
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}

/// `rate` through [`hg_rpc::AsyncEngine`]: `n` tasks each make calls one
/// after another until the batch ends, so `n` calls are in flight; the
/// driver task wakes each caller whose response came.
pub(crate) fn rate(
    cli: &Cli,
    sizes: &str,
    inflight: &str,
    idle_clients: usize,
    cpus: (Option<usize>, Option<usize>),
) -> Res<()> {
    let (_server, uri) = server_for(cli, ProgressMode::Blocking, cpus)?;
    let _idle = idle_clients_of(&cli.transport, &uri, idle_clients)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut c = engine(&cli.transport, ProgressMode::Blocking, false)?;
        let s = Arc::new(c.endpoint().lookup(&uri)?);
        let ae = Arc::new(hg_rpc::AsyncEngine::spawn(c)?);
        let batch = Duration::from_millis(cli.batch_ms);
        for size in list(sizes, parse_size)? {
            for n in list(inflight, |x| Ok(x.trim().parse::<usize>()?))? {
                let input = Arc::new(ByteBuf::from(vec![7u8; size as usize]));
                let mut rates = Vec::new();
                // Batch 0 warms up.
                for b in 0..=cli.batches {
                    let done = Arc::new(AtomicU64::new(0));
                    let t0 = Instant::now();
                    let end = t0 + batch;
                    let tasks: Vec<_> = (0..n)
                        .map(|_| {
                            let (ae, s, input, done) = (ae.clone(), s.clone(), input.clone(), done.clone());
                            tokio::spawn(async move {
                                while Instant::now() < end {
                                    ae.call::<Noop>(&s, &input, T).await?;
                                    done.fetch_add(1, Ordering::Relaxed);
                                }
                                Ok::<(), hg_rpc::RpcError>(())
                            })
                        })
                        .collect();
                    for t in tasks {
                        t.await??;
                    }
                    if b > 0 {
                        rates.push(done.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64());
                    }
                }
                let worst = rates.iter().copied().fold(f64::INFINITY, f64::min);
                report(
                    cli,
                    "rate",
                    "tokio",
                    "call",
                    size,
                    n,
                    median(rates),
                    worst,
                    None,
                    "ops/s",
                );
            }
        }
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}
