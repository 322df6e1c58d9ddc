//! tonic-perf: the same RPC rate and latency tests as `hg-perf rate|lat`,
//! made with tonic (gRPC over HTTP/2) on a UNIX domain socket in two
//! processes, so the ratio to hg-rpc can be read off one machine.
//!
//! `tonic-perf [--json]` prints rate (0 B and 8 B payloads, 1 and 16 in
//! flight) and round-trip latency (p50/p99/p999).
#![deny(unsafe_code)]
#![warn(missing_docs)]

use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Endpoint, Server, Uri};
use tonic::{Request, Response, Status};

/// The messages and service generated from `proto/bench.proto` (prost
/// writes no doc comments on them).
#[allow(missing_docs)]
pub mod bench {
    tonic::include_proto!("bench");
}
use bench::bench_client::BenchClient;
use bench::bench_server::{Bench, BenchServer};
use bench::{Empty, Payload};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Default)]
struct Svc;

#[tonic::async_trait]
impl Bench for Svc {
    async fn noop(&self, _req: Request<Payload>) -> Result<Response<Empty>, Status> {
        Ok(Response::new(Empty {}))
    }
}

async fn serve(path: String) -> Res<()> {
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    println!("READY");
    Server::builder()
        .add_service(BenchServer::new(Svc))
        .serve_with_incoming(UnixListenerStream::new(listener))
        .await?;
    Ok(())
}

fn report(json: bool, test: &str, size: usize, inflight: usize, median: f64, p99: f64, unit: &str) {
    if json {
        let v = serde_json::json!({"test": test, "transport": "tonic-uds", "mode": "tokio", "op": "call",
            "size": size, "inflight": inflight, "median": median, "p99": p99, "unit": unit});
        println!("{v}");
    } else {
        println!("{test:<5} tonic-uds {size:>6} {inflight:>4} {median:>14.1} {p99:>14.1} {unit}");
    }
}

async fn client(path: String, json: bool) -> Res<()> {
    let channel = Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await?;
    let client = BenchClient::new(channel);
    for size in [0usize, 8] {
        for inflight in [1usize, 16] {
            let mut rates = Vec::new();
            for _ in 0..6 {
                let t0 = Instant::now();
                let mut tasks = tokio::task::JoinSet::new();
                for _ in 0..inflight {
                    let mut c = client.clone();
                    tasks.spawn(async move {
                        let mut n = 0u64;
                        while t0.elapsed() < Duration::from_millis(200) {
                            c.noop(Payload { data: vec![7; size] }).await?;
                            n += 1;
                        }
                        Ok::<u64, Status>(n)
                    });
                }
                let mut total = 0;
                while let Some(r) = tasks.join_next().await {
                    total += r??;
                }
                rates.push(total as f64 / t0.elapsed().as_secs_f64());
            }
            rates.remove(0);
            rates.sort_by(f64::total_cmp);
            report(
                json,
                "rate",
                size,
                inflight,
                rates[rates.len() / 2],
                rates[0],
                "ops/s",
            );
        }
    }
    let mut c = client.clone();
    let mut samples = Vec::new();
    for i in 0..6000 {
        let t = Instant::now();
        c.noop(Payload { data: Vec::new() }).await?;
        if i >= 1000 {
            samples.push(t.elapsed().as_nanos() as f64);
        }
    }
    samples.sort_by(f64::total_cmp);
    let p = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    report(json, "lat", 0, 1, p(0.5), p(0.99), "ns");
    Ok(())
}

#[tokio::main]
async fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve") {
        let Some(path) = args.get(2) else {
            return Err("usage: tonic-perf serve <socket path>".into());
        };
        return serve(path.clone()).await;
    }
    let json = args.iter().any(|a| a == "--json");
    let path = std::env::temp_dir().join(format!("tonic-perf-{}.sock", std::process::id()));
    let path = path.to_string_lossy().into_owned();
    let mut server = std::process::Command::new(std::env::current_exe()?)
        .args(["serve", &path])
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    use std::io::BufRead;
    std::io::BufReader::new(server.stdout.take().ok_or("no stdout")?).read_line(&mut line)?;
    let r = client(path.clone(), json).await;
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_file(&path);
    r
}
