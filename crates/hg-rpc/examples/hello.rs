//! The smallest hg-rpc server and client.
//!
//! `cargo run -p hg-rpc --example hello` starts a server process (this
//! binary with `serve`), calls `hello` on it once, checks and prints the
//! answer, and checks that the server exited cleanly. An error ends
//! either side with its message on stderr and a failure status.

use std::time::{Duration, Instant};

use hg_rpc::{Engine, ProgressMode, Rpc};
use na_sm::SmConfig;

#[path = "../src/bin/shared/exit.rs"]
mod exit;

#[path = "shared/server.rs"]
mod server;
use server::ServerProcess;

/// The RPC: a name in, a greeting out.
struct Hello;
impl Rpc for Hello {
    const NAME: &'static str = "hello";
    type Input = String;
    type Output = String;
}

fn engine(listen: bool) -> Result<Engine, Box<dyn std::error::Error>> {
    let cfg = SmConfig {
        listen,
        ..SmConfig::default()
    };
    Ok(Engine::shared_memory(cfg, ProgressMode::default())?)
}

fn main() -> std::process::ExitCode {
    // `main` returning `Err` would print the error's `Debug` form.
    exit::run("hello", run)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().nth(1).as_deref() == Some("serve") {
        server::exit_with_parent()?;
        let mut server = engine(true)?;
        server.register::<Hello>(|name| Ok(format!("hello, {name}")))?;
        println!("ADDR {}", server.self_addr());
        // Serve one request, then drain: take no more, and drive the
        // engine until its answer has left (at most 10 s).
        while server.stats().handled == 0 {
            server.progress(Some(Duration::from_secs(10)))?;
            server.trigger()?;
        }
        server.begin_drain();
        let end = Instant::now() + Duration::from_secs(10);
        while !server.drained() && Instant::now() < end {
            server.progress(Some(Duration::from_millis(10)))?;
            server.trigger()?;
        }
        return Ok(());
    }
    // Killed if the client gives up before it exits.
    let child = ServerProcess::start(&["serve"])?;
    let mut client = engine(false)?;
    let server = client.lookup(child.addr()?)?;
    let answer = client.call::<Hello>(&server, &"quicksilver".to_string(), Duration::from_secs(5))?;
    println!("{answer}");
    if answer != "hello, quicksilver" {
        return Err(format!("expected \"hello, quicksilver\", got {answer:?}").into());
    }
    child.wait_ok()?;
    Ok(())
}
