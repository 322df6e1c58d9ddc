//! The smallest hg-rpc server and client.
//!
//! `cargo run -p hg-rpc --example hello` starts a server process (this
//! binary with `serve`), calls `hello` on it once, checks and prints the
//! answer, and checks that the server exited cleanly.

use std::time::Duration;

use hg_rpc::{Engine, Rpc};
use na_core::ProgressMode;
use na_sm::SmConfig;

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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().nth(1).as_deref() == Some("serve") {
        server::exit_with_parent()?;
        let mut server = engine(true)?;
        server.register::<Hello>(|name| Ok(format!("hello, {name}")))?;
        println!("ADDR {}", server.self_addr());
        // Serve one request, then give the response time to leave.
        while server.stats().handled == 0 {
            server.progress(Some(Duration::from_secs(10)))?;
            server.trigger()?;
        }
        server.progress(Some(Duration::from_millis(100)))?;
        server.trigger()?;
        return Ok(());
    }
    // Killed if the client gives up before it exits.
    let child = ServerProcess::start(&["serve"])?;
    let mut client = engine(false)?;
    let server = client.endpoint().lookup(child.addr()?)?;
    let answer = client.call::<Hello>(&server, &"quicksilver".to_string(), Duration::from_secs(5))?;
    println!("{answer}");
    if answer != "hello, quicksilver" {
        return Err(format!("expected \"hello, quicksilver\", got {answer:?}").into());
    }
    child.wait_ok()?;
    Ok(())
}
