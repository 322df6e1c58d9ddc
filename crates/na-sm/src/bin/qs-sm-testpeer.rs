//! Peer process for na-sm's multi-process tests (not a user tool).
//!
//! `qs-sm-testpeer server` listens (socket dir from `QS_SM_DIR`), prints
//! `ADDR <uri>` and serves the command protocol of [`serve`] until told to
//! quit or idle for 60 s. `client <uri> <n>` sends n echo requests with up to
//! 50 in flight and exits 0 if every echo came back intact. `flood <uri> <n>` sends n
//! unexpected messages without waiting for any answer. `hostile <uri>`
//! connects, scribbles random bytes over its connection's shared memory and
//! exits 0 once it observed an error completion. `envcheck` creates a plugin
//! with the environment as given and prints the result.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use na_core::{Addr, Completion, Endpoint, OpId, Plugin, PluginId, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

#[path = "testpeer/serve.rs"]
mod serve;

fn endpoint(listen: bool) -> (Endpoint, PluginId) {
    let mut ep = Endpoint::new(ProgressMode::Adaptive {
        spin: Duration::from_micros(50),
    })
    .expect("endpoint");
    let cfg = SmConfig {
        listen,
        ..SmConfig::default()
    };
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .expect("sm plugin");
    (ep, id)
}

fn wait_for(ep: &mut Endpoint, stash: &mut HashMap<OpId, Completion>, op: OpId, secs: u64) -> Completion {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(c) = stash.remove(&op) {
            return c;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {op:?}");
        ep.progress(Some(Duration::from_millis(100))).expect("progress");
        while let Some(c) = ep.pop_completion() {
            stash.insert(c.op, c);
        }
    }
}

fn client(uri: &str, n: u64) {
    let (mut ep, _) = endpoint(false);
    let server = ep.lookup(uri).expect("lookup");
    let mut stash = HashMap::new();
    let mut next = 0u64;
    let mut done = 0u64;
    let mut inflight: Vec<(u64, OpId, Vec<u8>)> = Vec::new();
    while done < n {
        while next < n && inflight.len() < 50 {
            let mut msg = vec![b'e'];
            msg.extend_from_slice(&std::process::id().to_le_bytes());
            msg.extend_from_slice(&next.to_le_bytes());
            msg.resize(16 + (next as usize * 13) % 200, next as u8);
            let tag = next as u32;
            let recv = OpId(next * 2 + 1);
            ep.post_recv_expected(&server, tag, Vec::new(), recv)
                .expect("post");
            ep.send_unexpected(&server, tag, &msg, OpId(next * 2))
                .expect("send");
            inflight.push((next, recv, msg));
            next += 1;
        }
        let (i, recv, msg) = inflight.remove(0);
        let c = wait_for(&mut ep, &mut stash, recv, 30);
        c.status.unwrap_or_else(|e| panic!("echo {i} failed: {e}"));
        assert_eq!(c.buf.as_deref(), Some(&msg[..]), "echo {i} corrupted");
        let s = wait_for(&mut ep, &mut stash, OpId(i * 2), 30);
        s.status.expect("send");
        done += 1;
    }
    println!("CLIENT OK {n}");
}

/// Payload of flood message `i`: 100 bytes (so it takes a shared buffer).
pub fn flood_payload(i: u32) -> Vec<u8> {
    (0..100u32).map(|j| (i.wrapping_mul(31) ^ j) as u8).collect()
}

/// Sends `n` unexpected messages (tag = index) as fast as the target takes
/// them, then waits until every send completed.
fn flood(uri: &str, n: u32) {
    let (mut ep, _) = endpoint(false);
    let target = ep.lookup(uri).expect("lookup");
    for i in 0..n {
        ep.send_unexpected(&target, i, &flood_payload(i), OpId(u64::from(i)))
            .expect("send");
    }
    let mut done = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while done < n {
        assert!(
            Instant::now() < deadline,
            "flood: only {done} of {n} sends completed"
        );
        ep.progress(Some(Duration::from_millis(100))).expect("progress");
        while let Some(c) = ep.pop_completion() {
            c.status.expect("flood send");
            done += 1;
        }
    }
    println!("FLOOD DONE {n}");
}

fn hostile(uri: &str) {
    let mut plugin = SmPlugin::new(PluginId(0), SmConfig::default()).expect("plugin");
    let target: Addr = plugin.lookup(uri).expect("lookup");
    // One honest round trip so that the connection is established.
    plugin
        .post_recv_expected(&target, 1, Vec::new(), OpId(1))
        .expect("post");
    plugin
        .send_unexpected(&target, 1, b"ehello", OpId(2))
        .expect("send");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = 0;
    while got < 2 {
        assert!(Instant::now() < deadline, "no echo from target");
        plugin.progress().expect("progress");
        while let Some(c) = plugin.pop_completion() {
            c.status.expect("honest round trip");
            got += 1;
        }
    }
    // Now scribble until the target throws us out.
    plugin
        .post_recv_expected(&target, 2, Vec::new(), OpId(3))
        .expect("post");
    let mut seed = u64::from(std::process::id());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(
            Instant::now() < deadline,
            "target never reported an error to the hostile peer"
        );
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        if plugin.debug_scribble(&target, seed).is_err() {
            println!("HOSTILE disconnected (scribble refused)");
            return;
        }
        let _ = plugin.send_unexpected(&target, 3, b"junk", OpId(100 + (seed % 1000)));
        std::thread::sleep(Duration::from_millis(5));
        let _ = plugin.progress();
        while let Some(c) = plugin.pop_completion() {
            if c.op == OpId(3) {
                let e = c.status.expect_err("a hostile peer must get an error");
                println!("HOSTILE got error: {e}");
                return;
            }
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("server") => serve::server(),
        Some("client") => client(&args[1], args[2].parse().expect("count")),
        Some("hostile") => hostile(&args[1]),
        Some("flood") => flood(&args[1], args[2].parse().expect("count")),
        Some("envcheck") => match SmPlugin::new(PluginId(0), SmConfig::listening()) {
            Ok(p) => println!("OK {}", p.self_addr()),
            Err(e) => println!("ERR {e}"),
        },
        _ => {
            eprintln!("usage: qs-sm-testpeer server|client URI N|hostile URI|envcheck");
            std::process::exit(2);
        }
    }
}
