//! The instructions of one busy RPC round trip, counted without the host's
//! noise: a client and a server engine in one thread, driven through the
//! same calls, in the same order, as two busy processes make them.
//!
//! ```text
//! cargo build --release -p hg-rpc --example busy_path_cost
//! scripts/busy-path-cost.sh        # callgrind: instructions per call
//! ```
//!
//! Natively it prints nanoseconds per call, which are the cost of both
//! sides' work with no cache line crossing cores (a floor of the software,
//! not a round trip). Under `valgrind --tool=callgrind` the instruction
//! count per call is the same every run, whatever the host does; the
//! script runs it twice and divides the difference by the calls.
//!
//! Each call goes through what `hg-perf rate --mode busy --inflight 1`
//! does on each side: the spin loop sees the message at its ring's head
//! (`spin_wait`), the message is taken and handled (`trigger`, with a
//! `progress_now` first only when the spin did not find it waiting), and
//! after the reply the next `progress_now` settles the ring and finds
//! nothing, as it does while the peer works.

use std::time::Instant;

use hg_rpc::{CallId, Engine, Rpc};
use na_core::{Addr, PluginId, ProgressMode};
use serde_bytes::ByteBuf;

/// hg-perf's rate RPC: a byte string in, nothing out.
struct Noop;
impl Rpc for Noop {
    const NAME: &'static str = "hgperf.noop";
    type Input = ByteBuf;
    type Output = ();
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[path = "../src/bin/shared/exit.rs"]
mod exit;

/// One side's turn: the spin sees the message; progress runs first only
/// if the spin found nothing to take (as `Endpoint::progress` does).
fn wake(e: &mut Engine, p: PluginId) -> Res<()> {
    e.endpoint().plugin_mut(p)?.spin_wait(1);
    if !e.endpoint().plugin(p)?.unexpected_ready() {
        e.progress_now()?;
    }
    e.trigger()?;
    Ok(())
}

/// The server's part of a round trip: the request is seen, taken and
/// answered; then the progress call that finds nothing while the client
/// works (it settles the ring).
#[inline(never)]
fn server_turn(server: &mut Engine, p: PluginId) -> Res<()> {
    wake(server, p)?;
    server.progress_now()?;
    Ok(())
}

/// The client's part: the response is seen and taken, the next call goes
/// out, then the progress call that finds nothing while the server works.
/// The first calls also complete the handshake: the server turns until
/// the response comes.
#[inline(never)]
fn client_turn(client: &mut Engine, server: &mut Engine, p: PluginId, id: CallId, to: &Addr) -> Res<CallId> {
    let mut turns = 0;
    loop {
        wake(client, p)?;
        if let Some(r) = client.take_response::<Noop>(id) {
            r?;
            break;
        }
        turns += 1;
        if turns > 100_000 {
            return Err("a call got no response".into());
        }
        server.progress_now()?;
        server.trigger()?;
    }
    let next = client.forward::<Noop>(to, &ByteBuf::new())?;
    client.progress_now()?;
    Ok(next)
}

fn main() -> std::process::ExitCode {
    exit::run("busy_path_cost", run)
}

/// The measured run: an error ends it with its message and causes on
/// stderr ([`exit::run`]).
fn run() -> Res<()> {
    let calls: u64 = match std::env::args().nth(1) {
        Some(n) => n.parse()?,
        None => 1_000_000,
    };
    let mut server = Engine::from_spec("sm://", true, ProgressMode::Busy)?;
    server.register::<Noop>(|_| Ok(()))?;
    let mut client = Engine::from_spec("sm://", false, ProgressMode::Busy)?;
    let uri = server.self_addr().to_string();
    let to = client.endpoint().lookup(&uri)?;
    // Plugin ids are unique in the process: each engine's own.
    let (sp, cp) = (server.self_addr().plugin(), to.plugin());
    let mut start = Instant::now();
    let warm = calls.min(1000);
    let mut id = client.forward::<Noop>(&to, &ByteBuf::new())?;
    for i in 0..calls {
        if i == warm {
            start = Instant::now();
        }
        server_turn(&mut server, sp)?;
        id = client_turn(&mut client, &mut server, cp, id, &to)?;
    }
    let timed = calls - warm;
    if timed > 0 {
        let ns = start.elapsed().as_nanos() as f64 / timed as f64;
        println!("{calls} calls; {ns:.0} ns per call (both sides' work, one thread)");
    }
    Ok(())
}
