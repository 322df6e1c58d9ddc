//! `rate`, `lat` and `bw` through [`hg_rpc::AsyncEngine`] (`--mode
//! tokio`): calls and transfers awaited on a current-thread tokio runtime,
//! whose driver task sleeps on the endpoint's fd; the server runs in
//! blocking mode. `--mode tokio-adaptive`: the driver keeps polling for
//! the default adaptive window after work
//! ([`hg_rpc::AsyncEngine::spawn_with_spin`]), and the server runs in
//! adaptive mode.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{BulkOp, Span};
use na_core::{Access, ProgressMode};
use serde_bytes::ByteBuf;

use super::{
    bw_extent, bw_sizes, bw_spans, engine, idle_clients_of, inflight_counts, list, median, parse_size,
    report, report_bw, report_lat, server_for, transfers_per_rpc, Cli, Exposed, Noop, Quit, Res, Seen,
    BW_SPAN, T,
};

/// Which tokio run: the label of its figures, the server's mode and the
/// client driver's spin window.
#[derive(Clone, Copy)]
pub(crate) struct Flavor {
    /// The mode name its figures carry.
    label: &'static str,
    /// The server's progress mode.
    server: ProgressMode,
    /// How long the client's driver keeps polling after work.
    spin: Duration,
}

impl Flavor {
    /// `tokio` (a driver that always sleeps, a blocking server) or
    /// `tokio-adaptive` (a driver that spins for the default adaptive
    /// window, an adaptive server); `None` for any other mode name.
    pub(crate) fn parse(mode: &str) -> Option<Flavor> {
        match mode {
            "tokio" => Some(Flavor {
                label: "tokio",
                server: ProgressMode::Blocking,
                spin: Duration::ZERO,
            }),
            "tokio-adaptive" => Some(Flavor {
                label: "tokio-adaptive",
                server: ProgressMode::default(),
                spin: na_core::DEFAULT_ADAPTIVE_SPIN,
            }),
            _ => None,
        }
    }
}

/// Runs `body` on a current-thread tokio runtime with a client
/// [`hg_rpc::AsyncEngine`] (its driver task sleeps on the endpoint's fd,
/// after the flavor's spin window) and the server at `uri` looked up.
fn client<F, Fut>(cli: &Cli, f: Flavor, uri: &str, body: F) -> Res<()>
where
    F: FnOnce(Arc<hg_rpc::AsyncEngine>, na_core::Addr) -> Fut,
    Fut: std::future::Future<Output = Res<()>>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut c = engine(&cli.transport, ProgressMode::Blocking, false)?;
        let s = c.endpoint().lookup(uri)?;
        let ae = Arc::new(hg_rpc::AsyncEngine::spawn_with_spin(c, f.spin)?);
        body(ae.clone(), s.clone()).await?;
        // A server we started exits on its own (see `SERVER_EXIT_GRACE`).
        if cli.addr.is_none() {
            ae.call::<Quit>(&s, &(), T).await?;
        }
        Ok(())
    })
}

/// `lat` through [`hg_rpc::AsyncEngine`]: each call is awaited on a
/// current-thread tokio runtime (the driver and the server as the flavor
/// says).
pub(crate) fn lat(
    cli: &Cli,
    f: Flavor,
    sizes: &str,
    cpus: (Option<usize>, Option<usize>),
    seen: &mut Seen,
) -> Res<()> {
    let (_server, uri) = server_for(cli, f.server, cpus)?;
    client(cli, f, &uri, |ae, s| async move {
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
            let (p50, p99) = report_lat(cli, f.label, size, samples);
            // Only a driver that sleeps is compared with the eventfd floor.
            if f.spin.is_zero() {
                seen.lat_sleeping.push((f.label, size, p50, p99));
            }
        }
        Ok(())
    })
}

/// `rate` through [`hg_rpc::AsyncEngine`]: `n` tasks each make calls one
/// after another until the batch ends, so `n` calls are in flight; the
/// driver task wakes each caller whose response came.
pub(crate) fn rate(
    cli: &Cli,
    f: Flavor,
    sizes: &str,
    inflight: &str,
    idle_clients: usize,
    cpus: (Option<usize>, Option<usize>),
) -> Res<()> {
    let (_server, uri) = server_for(cli, f.server, cpus)?;
    let _idle = idle_clients_of(&cli.transport, &uri, idle_clients)?;
    client(cli, f, &uri, |ae, s| async move {
        let s = Arc::new(s);
        let batch = Duration::from_millis(cli.batch_ms);
        for size in list(sizes, parse_size)? {
            for n in inflight_counts(inflight)? {
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
                    f.label,
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
        Ok(())
    })
}

/// `bw` through [`hg_rpc::AsyncEngine`], driven by the client: `read` pulls
/// from the buffer the server exposed, `write` pushes to it; each round is
/// one `bulk` (`count` 1) or one `bulk_batch` of `count` transfers to
/// consecutive regions, awaited before the next.
pub(crate) fn bw(
    cli: &Cli,
    f: Flavor,
    ops: &str,
    sizes: &str,
    count: u64,
    cpus: (Option<usize>, Option<usize>),
) -> Res<()> {
    let (_server, uri) = server_for(cli, f.server, cpus)?;
    client(cli, f, &uri, |ae, s| async move {
        let remote = ae.call::<Exposed>(&s, &(), T).await?;
        let local = ae.expose(vec![vec![1u8; BW_SPAN as usize]], Access::ReadWrite)?;
        let batch = Duration::from_millis(cli.batch_ms);
        let mut checks = 0u8;
        for op in ops.split(',').map(str::trim) {
            let bulk_op = match op {
                "read" => BulkOp::Pull,
                "write" => BulkOp::Push,
                other => return Err(format!("unknown op {other:?} (read, write)").into()),
            };
            for size in bw_sizes(sizes)? {
                let n = transfers_per_rpc(count, size);
                let spans: Vec<Span> = bw_spans(size, n);
                let round = || async {
                    if n == 1 {
                        ae.bulk(bulk_op, &remote, 0, &local, 0, size, T).await
                    } else {
                        ae.bulk_batch(bulk_op, &remote, &local, &spans, T).await
                    }
                };
                // Checks once that a round moves data: marks no earlier
                // check used go to the mover's ends, and after the round
                // the receiver's ends (for a push, pulled back into a fresh
                // buffer) must be those marks.
                checks += 1;
                let marks = [0x20 + 2 * (checks % 60), 0x21 + 2 * (checks % 60)];
                let len = bw_extent(size, n);
                let mem = local.local().ok_or("the bw buffer has no local memory")?;
                mem.write_at(0, &marks[..1])?;
                mem.write_at(len - 1, &marks[1..])?;
                let ends = if bulk_op == BulkOp::Push {
                    round().await?;
                    let back = ae.expose(vec![vec![0u8; len as usize]], Access::ReadWrite)?;
                    ae.bulk(BulkOp::Pull, &remote, 0, &back, 0, len, T).await?;
                    back.local().ok_or("no local memory")?.to_vec()
                } else {
                    ae.bulk(BulkOp::Push, &remote, 0, &local, 0, len, T).await?;
                    mem.write_at(0, &[0])?;
                    mem.write_at(len - 1, &[0])?;
                    round().await?;
                    mem.to_vec()
                };
                let got = [ends[0], ends[len as usize - 1]];
                if got != marks {
                    return Err(format!(
                        "bw tokio {op} of {n} x {size} bytes moved no data: ends {got:?}, marks {marks:?}"
                    )
                    .into());
                }
                let mut rates = Vec::new();
                for b in 0..=cli.batches {
                    let (mut bytes, t0) = (0u64, Instant::now());
                    while t0.elapsed() < batch {
                        round().await?;
                        bytes += size * n;
                    }
                    if b > 0 {
                        rates.push(bytes as f64 / f64::from(1 << 20) / t0.elapsed().as_secs_f64());
                    }
                }
                let worst = rates.iter().copied().fold(f64::INFINITY, f64::min);
                report_bw(cli, f.label, op, size, n, median(rates), worst);
            }
        }
        Ok(())
    })
}
