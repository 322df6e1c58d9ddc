//! NA-level demo: a server process and a client process over shared memory.
//!
//! The client starts the server (this same binary with `serve`), then does
//! request/response exchanges with unexpected and expected messages, and
//! bulk transfers where the server pulls (`get`) from and pushes (`put`)
//! into the client's 16-segment buffer. Everything is verified and timed.
//!
//! Run: `cargo run --release -p na-sm --example na_demo`

use std::error::Error;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use na_core::{
    Access, Addr, Completion, Endpoint, ErrorChain, MemHandle, OpId, OpKind, ProgressMode, RemoteMem,
};
use na_sm::{SmConfig, SmPlugin};

type Res<T> = Result<T, Box<dyn Error>>;

const PING: u8 = 1;
const PULL: u8 = 2;
const PUSH: u8 = 3;
const QUIT: u8 = 4;
const TIMEOUT: Duration = Duration::from_secs(20);
const BULK_SEGMENTS: usize = 16;
const BULK_SEGMENT: usize = 4 << 20;

/// Runs [`run`]; an error ends the process with its whole chain (the
/// error and each cause, [`ErrorChain`]) on stderr and exit status 1.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("na_demo: error: {}", ErrorChain(&*e));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    if std::env::args().nth(1).as_deref() == Some("serve") {
        return serve();
    }
    client()
}

fn endpoint(listen: bool) -> Res<Endpoint> {
    let mut ep = Endpoint::new(ProgressMode::default())?;
    let cfg = SmConfig {
        listen,
        ..SmConfig::default()
    };
    ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?)))?;
    Ok(ep)
}

/// Waits for the completion of `op`, failing after [`TIMEOUT`].
fn wait(ep: &mut Endpoint, op: OpId) -> Res<Completion> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        while let Some(c) = ep.pop_completion() {
            if c.op == op {
                c.status
                    .as_ref()
                    .map_err(|e| format!("{:?} {:?} failed: {}", c.kind, c.op, ErrorChain(e)))?;
                return Ok(c);
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("timed out waiting for {op:?}").into());
        }
        ep.progress(Some(left))?;
    }
}

fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn serve() -> Res<()> {
    let mut ep = endpoint(true)?;
    let me = ep.plugin_ids().next().ok_or("no plugin")?;
    println!("ADDR {}", ep.self_addr(me)?);
    let bulk = MemHandle::zeroed(BULK_SEGMENTS * BULK_SEGMENT, Access::ReadWrite);
    let mut next = 1u64;
    loop {
        let op = OpId(next);
        next += 1;
        ep.post_recv_unexpected(me, Vec::with_capacity(4096), op)?;
        let c = wait(&mut ep, op)?;
        let (src, tag, msg) = (c.source.ok_or("no source")?, c.tag, c.buf.ok_or("no buffer")?);
        // A request that cannot be served (a malformed or forged one, a
        // transfer that fails) is answered with an empty reply: whoever
        // sent it, the server goes on serving.
        let reply = match answer(&mut ep, &bulk, &src, msg, &mut next) {
            Ok(Some(reply)) => reply,
            Ok(None) => return Ok(()),
            Err(e) => {
                eprintln!("na_demo server: request from {src} refused: {}", ErrorChain(&*e));
                Vec::new()
            }
        };
        let op = OpId(next);
        next += 1;
        if let Err(e) = ep
            .send_expected(&src, tag, &reply, op)
            .map_err(Into::into)
            .and_then(|()| wait(&mut ep, op))
        {
            eprintln!("na_demo server: reply to {src} not sent: {}", ErrorChain(&*e));
        }
    }
}

/// The reply to request `msg` from `src`; `None` for `QUIT`.
fn answer(
    ep: &mut Endpoint,
    bulk: &MemHandle,
    src: &Addr,
    msg: Vec<u8>,
    next: &mut u64,
) -> Res<Option<Vec<u8>>> {
    Ok(Some(match msg.first().copied() {
        Some(PING) => msg,
        Some(kind @ (PULL | PUSH)) => {
            let remote = RemoteMem::from_bytes(&msg[1..])?;
            // The size is the client's word: checked before anything is
            // allocated for it.
            let len = remote.size();
            if len > bulk.size() {
                return Err(format!("a transfer of {len} bytes: the buffer has {}", bulk.size()).into());
            }
            let op = OpId(*next);
            *next += 1;
            if kind == PUSH {
                bulk.write_at(0, &pattern(len as usize))?;
            }
            let t = Instant::now();
            if kind == PULL {
                ep.get(bulk, 0, &remote, 0, len, src, op)?;
            } else {
                ep.put(bulk, 0, &remote, 0, len, src, op)?;
            }
            wait(ep, op)?;
            let ns = t.elapsed().as_nanos() as u64;
            let sum = if kind == PULL {
                let mut v = vec![0; len as usize];
                bulk.read_at(0, &mut v)?;
                checksum(&v)
            } else {
                0
            };
            [ns.to_le_bytes(), sum.to_le_bytes()].concat()
        }
        Some(QUIT) => return Ok(None),
        other => return Err(format!("unknown request {other:?}").into()),
    }))
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 4096) as u8).collect()
}

/// One request/response exchange; returns the reply.
fn call(ep: &mut Endpoint, srv: &Addr, next: &mut u64, req: &[u8]) -> Res<Vec<u8>> {
    let tag = (*next % u64::from(u32::MAX)) as u32;
    let (recv, send) = (OpId(*next), OpId(*next + 1));
    *next += 2;
    ep.post_recv_expected(srv, tag, Vec::with_capacity(64), recv)?;
    ep.send_unexpected(srv, tag, req, send)?;
    let mut reply = None;
    let deadline = Instant::now() + TIMEOUT;
    let mut sent = false;
    while reply.is_none() || !sent {
        match ep.pop_completion() {
            Some(c) => {
                c.status
                    .as_ref()
                    .map_err(|e| format!("{:?} failed: {}", c.kind, ErrorChain(e)))?;
                match c.kind {
                    OpKind::RecvExpected if c.op == recv => reply = c.buf,
                    OpKind::SendUnexpected if c.op == send => sent = true,
                    _ => {}
                }
            }
            None if Instant::now() > deadline => return Err("call timed out".into()),
            None => {
                ep.progress(Some(TIMEOUT))?;
            }
        }
    }
    reply.ok_or_else(|| "no reply".into())
}

fn client() -> Res<()> {
    let exe = std::env::current_exe()?;
    let mut server = Command::new(exe).arg("serve").stdout(Stdio::piped()).spawn()?;
    let mut line = String::new();
    BufReader::new(server.stdout.take().ok_or("no stdout")?).read_line(&mut line)?;
    let uri = line
        .trim()
        .strip_prefix("ADDR ")
        .ok_or("server printed no address")?
        .to_owned();
    let mut ep = endpoint(false)?;
    let srv = ep.lookup(&uri)?;
    println!(
        "server {uri} (pid {}), client {}",
        server.id(),
        ep.self_addr(srv.plugin())?
    );
    let mut next = 1u64;

    let n = 100_000u32;
    let mut rtts = Vec::with_capacity(n as usize);
    let t = Instant::now();
    for i in 0..n {
        let t0 = Instant::now();
        let req = [&[PING][..], &i.to_le_bytes()].concat();
        let reply = call(&mut ep, &srv, &mut next, &req)?;
        if reply != req {
            return Err(format!("ping {i}: reply {reply:?} != request").into());
        }
        rtts.push(t0.elapsed().as_nanos() as u64);
    }
    let secs = t.elapsed().as_secs_f64();
    rtts.sort_unstable();
    println!(
        "request/response: {n} calls in {secs:.2} s: {:.0} calls/s, median round trip {:.2} us, p99 {:.2} us",
        f64::from(n) / secs,
        rtts[rtts.len() / 2] as f64 / 1e3,
        rtts[rtts.len() * 99 / 100] as f64 / 1e3
    );

    let total = BULK_SEGMENTS * BULK_SEGMENT;
    let data = pattern(total);
    let segs: Vec<Vec<u8>> = data.chunks(BULK_SEGMENT).map(<[u8]>::to_vec).collect();
    let mine = MemHandle::new(segs, Access::ReadWrite);
    let desc = ep.plugin(srv.plugin())?.mem_describe(&mine)?.to_bytes();
    // Three rounds of each; the first touches fresh pages, the median is reported.
    for kind in [PULL, PUSH] {
        let mut rates = Vec::new();
        for _ in 0..3 {
            if kind == PUSH {
                mine.write_at(0, &vec![0; total])?;
            }
            let reply = call(&mut ep, &srv, &mut next, &[&[kind][..], &desc].concat())?;
            let word = |i: usize| {
                reply
                    .get(i * 8..i * 8 + 8)
                    .and_then(|b| b.try_into().ok())
                    .map(u64::from_le_bytes)
            };
            let (ns, sum) = (word(0).ok_or("short reply")?, word(1).ok_or("short reply")?);
            let ok = if kind == PULL {
                sum == checksum(&data)
            } else {
                mine.to_vec() == data
            };
            if !ok {
                return Err(format!("bulk {kind} data mismatch").into());
            }
            rates.push((total as f64 / (1 << 20) as f64) / (ns as f64 / 1e9));
        }
        rates.sort_by(f64::total_cmp);
        let name = if kind == PULL {
            "pull (server get)"
        } else {
            "push (server put)"
        };
        println!(
            "bulk {name}: {} MiB in {BULK_SEGMENTS} segments x3, median {:.0} MiB/s, data verified",
            total >> 20,
            rates[1]
        );
    }
    let op = OpId(next);
    ep.send_unexpected(&srv, 0, &[QUIT], op)?;
    wait(&mut ep, op)?;
    let status = server.wait()?;
    println!("server exited: {status}");
    if !status.success() {
        return Err("server failed".into());
    }
    Ok(())
}
