//! The instructions of one busy NA round trip on hg-rpc's own path, counted
//! without the host's noise: the floor under `hg-rpc`'s `busy_path_cost`.
//!
//! Two endpoints in one thread, each with one sm plugin in pull mode, ping
//! and pong an empty unexpected message sent with `Report::FailuresOnly`,
//! each side's turn made of the NA calls an hg-rpc engine makes in
//! `hg-perf rate --mode busy --inflight 1`: the spin sees the message
//! (`spin_wait`, with a `progress_now` first only when it did not), the
//! message is taken, the answer (or the next ping) goes out, a second take
//! finds nothing (as `Engine::trigger` looks until none is left), and a
//! `progress_now` settles the ring while the peer works. What
//! `busy_path_cost` counts beyond this is hg-rpc's own work.
//!
//! ```text
//! scripts/busy-path-cost.sh     # callgrind: both examples, and the difference
//! ```

use std::time::Instant;

use na_core::{Addr, Endpoint, OpId, PluginId, ProgressMode, Report, Tag};
use na_sm::{SmConfig, SmPlugin};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// A busy endpoint with one sm plugin in pull mode.
fn endpoint(listen: bool) -> Res<(Endpoint, PluginId)> {
    let mut ep = Endpoint::new(ProgressMode::Busy)?;
    let cfg = SmConfig {
        listen,
        ..SmConfig::default()
    };
    let id = ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?)))?;
    if !ep.pull_unexpected(id)? {
        return Err("the sm plugin has no pull mode".into());
    }
    Ok((ep, id))
}

/// One side's turn: the message is seen and taken (`None` if it has not
/// come), then one more take that finds nothing.
fn take(ep: &mut Endpoint, p: PluginId, buf: &mut Vec<u8>) -> Res<Option<Addr>> {
    ep.plugin_mut(p)?.spin_wait(1);
    if !ep.plugin(p)?.unexpected_ready() {
        ep.progress_now()?;
    }
    let got = ep.take_unexpected(p, buf)?;
    if got.is_some() && ep.take_unexpected(p, buf)?.is_some() {
        return Err("a second message came".into());
    }
    Ok(got.map(|(src, _)| src))
}

/// Sends an empty message with no success completion.
fn send(ep: &mut Endpoint, to: &Addr, tag: Tag, op: u64) -> Res<()> {
    ep.send_unexpected_parts(to, tag, &[&[]], OpId(op), Report::FailuresOnly)?;
    Ok(())
}

/// The server's part: the ping is taken and answered; then the progress
/// call that finds nothing while the client works.
#[inline(never)]
fn server_turn(server: &mut Endpoint, p: PluginId, buf: &mut Vec<u8>, op: u64) -> Res<()> {
    if let Some(src) = take(server, p, buf)? {
        send(server, &src, 2, op)?;
    }
    server.progress_now()?;
    Ok(())
}

/// The client's part: the pong is taken (the server turns until it comes:
/// the first pings also complete the handshake), the next ping goes out,
/// then the progress call that finds nothing while the server works.
#[inline(never)]
fn client_turn(
    client: &mut Endpoint,
    server: &mut Endpoint,
    ps: (PluginId, PluginId),
    to: &Addr,
    bufs: (&mut Vec<u8>, &mut Vec<u8>),
    op: u64,
) -> Res<()> {
    let mut turns = 0;
    while take(client, ps.1, bufs.1)?.is_none() {
        turns += 1;
        if turns > 100_000 {
            return Err("a ping got no pong".into());
        }
        server_turn(server, ps.0, bufs.0, op)?;
    }
    send(client, to, 1, op)?;
    client.progress_now()?;
    Ok(())
}

/// Runs [`run`]; an error ends the process with its whole chain (the
/// error and each cause, [`na_core::ErrorChain`]) on stderr and exit
/// status 1.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pull_path_cost: error: {}", na_core::ErrorChain(&*e));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let pings: u64 = match std::env::args().nth(1) {
        Some(n) => n.parse()?,
        None => 1_000_000,
    };
    let (mut server, sp) = endpoint(true)?;
    let (mut client, cp) = endpoint(false)?;
    let uri = server.self_addr(sp)?.uri().to_owned();
    let to = client.lookup(&uri)?;
    let (mut sbuf, mut cbuf) = (Vec::with_capacity(64), Vec::with_capacity(64));
    let mut start = Instant::now();
    let warm = pings.min(1000);
    send(&mut client, &to, 1, 0)?;
    for i in 0..pings {
        if i == warm {
            start = Instant::now();
        }
        server_turn(&mut server, sp, &mut sbuf, i)?;
        client_turn(&mut client, &mut server, (sp, cp), &to, (&mut sbuf, &mut cbuf), i)?;
    }
    let timed = pings - warm;
    if timed > 0 {
        let ns = start.elapsed().as_nanos() as f64 / timed as f64;
        println!("{pings} round trips; {ns:.0} ns each (both sides' work, one thread)");
    }
    Ok(())
}
