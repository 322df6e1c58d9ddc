//! The smallest hg-rpc server and client.
//!
//! `cargo run -p hg-rpc --example hello` starts a server process (this
//! binary with `serve`), calls `hello` on it once, and prints the answer.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use hg_rpc::{Engine, Rpc};
use na_core::ProgressMode;
use na_sm::SmConfig;

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
        let mut server = engine(true)?;
        server.register::<Hello>(|name| Ok(format!("hello, {name}")))?;
        println!("{}", server.self_addr());
        // Serve one request, then give the response time to leave.
        while server.stats().handled == 0 {
            server.progress(Some(Duration::from_secs(10)))?;
            server.trigger()?;
        }
        server.progress(Some(Duration::from_millis(100)))?;
        server.trigger()?;
        return Ok(());
    }
    let mut child = Command::new(std::env::current_exe()?)
        .arg("serve")
        .stdout(Stdio::piped())
        .spawn()?;
    let mut addr = String::new();
    BufReader::new(child.stdout.take().ok_or("no stdout")?).read_line(&mut addr)?;
    let mut client = engine(false)?;
    let server = client.endpoint().lookup(addr.trim())?;
    let answer = client.call::<Hello>(&server, &"quicksilver".to_string(), Duration::from_secs(5))?;
    println!("{answer}");
    child.wait()?;
    Ok(())
}
