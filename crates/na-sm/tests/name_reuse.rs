//! A peer dies, unseen, and a new process with its pid, and so its name,
//! connects: the new process gets a peer entry of its own, and the old
//! one's failure, seen later, does not take the new connection with it.
//!
//! Real processes (this binary, run again in a peer role): the listener S
//! watches its peers' exits by end-of-file only
//! (`SmConfig::debug.exits_by_eof_only`, the path of kernels without pidfds).
//! Peer P connects, forks a child G that holds P's end of the socket, and
//! is killed: S cannot see P go while G lives. Q takes P's pid (`unshare`
//! gives us a PID namespace of our own, where S is pid 1 and
//! `ns_last_pid` can be set), so its first instance has P's name, and
//! connects. Then G is killed: P's socket ends, and S sees P go. Q must
//! still be served.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use na_core::{Addr, Endpoint, OpId, Plugin, PluginId, ProgressMode};
use na_sm::sys::proc::start_time;
use na_sm::{SmConfig, SmConfigHooks, SmPlugin};

mod common;
use common::{run_in_pid_namespace, sys, KillOnDrop};

/// Set in the helper's environment (the scenario's S): the socket directory.
const HELPER_ENV: &str = "QS_SM_NAME_REUSE_HELPER";
/// Set in a peer's environment: S's address.
const PEER_ENV: &str = "QS_SM_NAME_REUSE_PEER";
/// Set in a peer's environment: the socket directory.
const PEER_DIR_ENV: &str = "QS_SM_NAME_REUSE_DIR";
/// Set in P's environment: fork a child that holds the connection.
const PEER_HOLD_ENV: &str = "QS_SM_NAME_REUSE_HOLD";

/// Tag of a peer's first message ("I am <pid>"), and of its answers.
const HELLO_TAG: u32 = 1;
/// Tag of S's request that a peer answer, and of the answer.
const ECHO_TAG: u32 = 2;

/// The helper: with `$QS_SM_NAME_REUSE_HELPER` set, runs the scenario (in
/// the namespace) and prints `OK <what happened>` or `ERR <why>`.
#[test]
fn helper_process() {
    let Some(dir) = std::env::var_os(HELPER_ENV) else {
        return;
    };
    match reuse_before_the_death_is_seen(std::path::Path::new(&dir)) {
        Ok(what) => println!("OK {what}"),
        Err(why) => println!("ERR {why}"),
    }
}

/// A peer (P or Q): with `$QS_SM_NAME_REUSE_PEER` set, connects and
/// answers until killed.
#[test]
fn peer_process() {
    let (Some(srv), Some(dir)) = (std::env::var(PEER_ENV).ok(), std::env::var_os(PEER_DIR_ENV)) else {
        return;
    };
    peer(
        &srv,
        std::path::Path::new(&dir),
        std::env::var_os(PEER_HOLD_ENV).is_some(),
    );
}

#[test]
fn a_new_process_with_a_dead_peers_pid_and_name_keeps_its_connection() {
    run_in_pid_namespace("name-reuse", "helper_process", HELPER_ENV);
}

/// The peer role: a client instance (its name `<pid>-0`, the first of its
/// process) that says who it is to `srv`, then answers each echo request.
/// With `hold`, a child forked after the connection holds its sockets and
/// sleeps (its pid printed as `HOLDER <pid>`).
fn peer(srv: &str, dir: &std::path::Path, hold: bool) {
    let cfg = SmConfig::default().with_dir(dir);
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let to = ep.lookup(srv).unwrap();
    if hold {
        let g = sys::fork();
        if g == 0 {
            // The holder: only sleeps (killed by the test; the namespace
            // ends it otherwise).
            std::thread::sleep(Duration::from_secs(120));
            sys::exit_now(0);
        }
        println!("HOLDER {g}");
    }
    ep.post_recv_unexpected(id, Vec::new(), OpId(1)).unwrap();
    let me = std::process::id().to_string();
    ep.send_unexpected(&to, HELLO_TAG, me.as_bytes(), OpId(2))
        .unwrap();
    let mut next = 10;
    loop {
        ep.progress(Some(Duration::from_millis(50))).unwrap();
        while let Some(c) = ep.pop_completion() {
            if c.op != OpId(1) {
                continue;
            }
            if c.status.is_ok() && c.tag == ECHO_TAG {
                next += 1;
                ep.send_unexpected(&to, ECHO_TAG, me.as_bytes(), OpId(next))
                    .unwrap();
            }
            ep.post_recv_unexpected(id, c.buf.unwrap_or_default(), OpId(1))
                .unwrap();
        }
    }
}

/// S: a listening endpoint and its receive of unexpected messages.
struct Server {
    ep: Endpoint,
    id: PluginId,
    uri: String,
    next: u64,
}

impl Server {
    /// Drives S until an unexpected message with `tag` and `body` comes;
    /// returns its source. Sends' failures are errors.
    fn wait_for(&mut self, tag: u32, body: &str, limit: Duration) -> Result<Addr, String> {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            self.ep
                .progress(Some(Duration::from_millis(5)))
                .map_err(|e| na_core::ErrorChain(&e).to_string())?;
            while let Some(c) = self.ep.pop_completion() {
                if c.op != OpId(1) {
                    c.status
                        .map_err(|e| format!("op {:?} failed: {}", c.op, na_core::ErrorChain(&e)))?;
                    continue;
                }
                let found = (c.status.is_ok() && c.tag == tag && c.buf.as_deref() == Some(body.as_bytes()))
                    .then_some(c.source)
                    .flatten();
                self.ep
                    .post_recv_unexpected(self.id, c.buf.unwrap_or_default(), OpId(1))
                    .map_err(|e| na_core::ErrorChain(&e).to_string())?;
                if let Some(src) = found {
                    return Ok(src);
                }
            }
        }
        Err(format!("no message {body:?} (tag {tag}) within {limit:?}"))
    }

    /// Drives S for `d`.
    fn drive(&mut self, d: Duration) -> Result<(), String> {
        self.wait_for(u32::MAX, "", d).err().map_or(Ok(()), |why| {
            if why.starts_with("no message") {
                Ok(())
            } else {
                Err(why)
            }
        })
    }

    /// Asks `to` for an answer and waits for it (from `to` itself).
    fn echo(&mut self, to: &Addr, pid: u32) -> Result<(), String> {
        self.next += 1;
        self.ep
            .send_unexpected(to, ECHO_TAG, b"echo", OpId(self.next))
            .map_err(|e| format!("echo to {}: {}", to.uri(), na_core::ErrorChain(&e)))?;
        let from = self.wait_for(ECHO_TAG, &pid.to_string(), Duration::from_secs(10))?;
        if from != *to {
            return Err(format!(
                "the answer came from another peer entry than {}",
                to.uri()
            ));
        }
        Ok(())
    }
}

/// Spawns a peer of `srv` (this binary in the peer role).
fn spawn_peer(srv: &str, dir: &std::path::Path, hold: bool) -> Result<Child, String> {
    let mut cmd = Command::new(std::env::current_exe().map_err(|e| e.to_string())?);
    cmd.args(["--exact", "peer_process", "--nocapture", "--test-threads=1"])
        .env(PEER_ENV, srv)
        .env(PEER_DIR_ENV, dir)
        .env_remove(HELPER_ENV)
        .stdout(Stdio::piped());
    if hold {
        cmd.env(PEER_HOLD_ENV, "1");
    }
    cmd.spawn().map_err(|e| format!("spawning a peer: {e}"))
}

/// What the canary says in its hello.
const CANARY: &str = "canary";

/// A client endpoint of this process that connects to `srv` and sends its
/// hello ([`CANARY`]); S takes it in only by looking at its events.
fn canary(srv: &str, dir: &std::path::Path) -> Result<Endpoint, String> {
    let cfg = SmConfig::default().with_dir(dir);
    let mut ep = Endpoint::new(ProgressMode::Blocking).map_err(|e| na_core::ErrorChain(&e).to_string())?;
    ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .map_err(|e| na_core::ErrorChain(&e).to_string())?;
    let to = ep
        .lookup(srv)
        .map_err(|e| format!("the canary's lookup: {}", na_core::ErrorChain(&e)))?;
    ep.send_unexpected(&to, HELLO_TAG, CANARY.as_bytes(), OpId(1))
        .map_err(|e| format!("the canary's hello: {}", na_core::ErrorChain(&e)))?;
    Ok(ep)
}

/// Kills and reaps child `pid`.
fn kill_and_reap(pid: libc::pid_t) -> Result<(), String> {
    sys::kill(pid, libc::SIGKILL);
    let mut status = 0;
    if sys::waitpid(pid, &mut status, 0) != pid {
        return Err(format!("could not reap {pid}"));
    }
    Ok(())
}

/// The scenario, as pid 1 of a new PID namespace: see the file's docs.
fn reuse_before_the_death_is_seen(dir: &std::path::Path) -> Result<String, String> {
    let log = na_testsuite::log::CapturedLog::install_global();
    let cfg = SmConfig {
        debug: SmConfigHooks {
            exits_by_eof_only: true,
            ..SmConfigHooks::default()
        },
        ..SmConfig::listening().with_dir(dir)
    };
    let mut ep = Endpoint::new(ProgressMode::Blocking).map_err(|e| na_core::ErrorChain(&e).to_string())?;
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .map_err(|e| na_core::ErrorChain(&e).to_string())?;
    let uri = ep
        .self_addr(id)
        .map_err(|e| na_core::ErrorChain(&e).to_string())?
        .uri()
        .to_owned();
    ep.post_recv_unexpected(id, Vec::new(), OpId(1))
        .map_err(|e| na_core::ErrorChain(&e).to_string())?;
    let mut s = Server {
        ep,
        id,
        uri,
        next: 100,
    };

    // P connects, hands its socket to G, and says who it is.
    let mut p = spawn_peer(&s.uri, dir, true)?;
    let p_pid = p.id();
    let _p = KillOnDrop::new(p_pid as libc::pid_t);
    // Read on a thread: P's lookup may wait for S's acknowledgement, which
    // S gives only while it makes progress.
    let out = p.stdout.take().ok_or("no stdout of P")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(g) = line.split("HOLDER ").nth(1) {
                let _ = tx.send(g.trim().parse::<libc::pid_t>().ok());
            }
        }
    });
    let p_addr = s.wait_for(HELLO_TAG, &p_pid.to_string(), Duration::from_secs(10))?;
    let g = rx
        .recv_timeout(Duration::from_secs(10))
        .ok()
        .flatten()
        .ok_or("P did not say which child holds its socket")?;
    let _g = KillOnDrop::new(g);
    s.echo(&p_addr, p_pid)?;
    let p_start = start_time(p_pid).map_err(|e| e.to_string())?;

    // P dies; G holds its socket, so S does not see it go. A canary of
    // this process connects after P is reaped and says hello: S takes the
    // connection in at a look at its events that began after P's exit, and
    // a pidfd of P (readable from its exit on, and reported while it stays
    // so) would have been reported then or before. So once the canary's
    // hello is in, S has had its chance to see P go.
    kill_and_reap(p_pid as libc::pid_t)?;
    drop(p);
    let canary = canary(&s.uri, dir)?;
    s.wait_for(HELLO_TAG, CANARY, Duration::from_secs(10))?;
    let peers =
        s.ep.plugin(s.id)
            .map_err(|e| na_core::ErrorChain(&e).to_string())?
            .stats()
            .peers;
    if peers != 2 {
        return Err(format!(
            "S saw P go (peers: {peers}, P's and the canary's expected): exits are not watched by end-of-file only"
        ));
    }
    drop(canary);

    // Q takes P's pid (a later clock tick, so another start time).
    std::thread::sleep(Duration::from_millis(30));
    let mut q = None;
    for _ in 0..20 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (p_pid - 1).to_string())
            .map_err(|e| format!("writing ns_last_pid: {e}"))?;
        let child = spawn_peer(&s.uri, dir, false)?;
        if child.id() == p_pid {
            q = Some(child);
            break;
        }
        kill_and_reap(child.id() as libc::pid_t)?;
    }
    let q = q.ok_or(format!("pid {p_pid} did not come round"))?;
    let _q = KillOnDrop::new(q.id() as libc::pid_t);
    let q_start = start_time(p_pid).map_err(|e| e.to_string())?;
    if q_start == p_start {
        return Err(format!(
            "Q started in P's clock tick ({p_start}): nothing to tell them apart"
        ));
    }
    let q_addr = s.wait_for(HELLO_TAG, &p_pid.to_string(), Duration::from_secs(10))?;
    if q_addr.uri() != p_addr.uri() {
        return Err(format!(
            "Q is {}, P was {}: not the same name",
            q_addr.uri(),
            p_addr.uri()
        ));
    }

    // G dies: P's socket ends, and S sees P go (if it had not already).
    kill_and_reap(g)?;
    let end = Instant::now() + Duration::from_secs(10);
    while !log
        .lines_at("INFO", "sm disconnect")
        .iter()
        .any(|l| l.contains(p_addr.uri()))
    {
        if Instant::now() > end {
            return Err(format!("S never saw P go:\n{}", log.text()));
        }
        s.drive(Duration::from_millis(20))?;
    }
    s.drive(Duration::from_millis(200))?;

    // Q is still served, through an entry of its own.
    s.echo(&q_addr, p_pid)
        .map_err(|e| format!("Q's connection did not survive P's failure: {e}\n{}", log.text()))?;
    if q_addr == p_addr {
        return Err(format!("Q joined P's peer entry ({})", q_addr.uri()));
    }
    let gone = log.lines_at("INFO", "sm disconnect");
    Ok(format!(
        "pid {p_pid}: P started at {p_start}, Q at {q_start}; {}",
        gone.join("; ")
    ))
}
