//! A connector exits between its `connect` and its hello (a child it
//! forked sends the hello on the socket it inherited), and a new process
//! takes its pid meanwhile. A listener that watches its peers' exits by
//! pid (`pidfd_open`, as on kernels before 6.5: `SmConfig::debug.pidfd_by_pid`)
//! must not take that process for the peer: the start time it read at
//! `accept` is not the new process's, so the peer is gone, with a warning
//! that says so, and the new process is never watched (nor targeted by
//! RMA) in its place.
//!
//! The pid is made to come round with `ns_last_pid`, in a PID namespace of
//! our own (`unshare`), where this binary, run again as a helper, is pid 1.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use na_core::{Plugin, PluginId};
use na_sm::channel::{init_region, REGION_LEN};
use na_sm::sys::proc::start_time;
use na_sm::sys::shm::SharedRegion;
use na_sm::sys::wake::{OwnWake, WakeKind};
use na_sm::{SmConfig, SmConfigHooks, SmPlugin};

mod common;
use common::{pipe, run_in_pid_namespace, sys, KillOnDrop};

/// Set in the helper's environment: its socket directory.
const HELPER_ENV: &str = "QS_SM_PID_REUSE_HELPER";

/// The helper: with `$QS_SM_PID_REUSE_HELPER` set, runs the scenario (in
/// the namespace) and prints `OK <what happened>` or `ERR <why>`.
#[test]
fn helper_process() {
    let Some(dir) = std::env::var_os(HELPER_ENV) else {
        return;
    };
    match reuse_during_handshake(std::path::Path::new(&dir)) {
        Ok(what) => println!("OK {what}"),
        Err(why) => println!("ERR {why}"),
    }
}

#[test]
fn a_pid_reused_between_accept_and_hello_is_not_taken_for_the_peer() {
    run_in_pid_namespace("pid-reuse", "helper_process", HELPER_ENV);
}

/// The scenario, as pid 1 of a new PID namespace: see the file's docs.
fn reuse_during_handshake(dir: &std::path::Path) -> Result<String, String> {
    let log = na_testsuite::log::CapturedLog::install_global();
    let cfg = SmConfig {
        debug: SmConfigHooks {
            pidfd_by_pid: true,
            ..SmConfigHooks::default()
        },
        ..SmConfig::listening().with_dir(dir)
    };
    let mut srv = SmPlugin::new(PluginId(1), cfg).map_err(|e| na_core::ErrorChain(&e).to_string())?;
    let sock_path = dir.join(format!(
        "{}.sock",
        srv.self_addr().uri().trim_start_matches("sm://")
    ));
    // What the hello carries, made before the fork (the connector's
    // child sends it).
    let region = SharedRegion::create("pid-reuse", REGION_LEN).map_err(|e| e.to_string())?;
    init_region(&region, 0);
    let region_fd = region.fd().ok_or("no region fd")?;
    let wake = OwnWake::new(WakeKind::EventFd).map_err(|e| e.to_string())?;
    let wake_fd = wake.fd_for_peer();
    let (mut from_p, to_us) = pipe();
    let (go_p, mut to_p) = pipe();
    let (go_g, mut to_g) = pipe();

    // The child (the connector P) and its child (G) end with `exit_now`.
    let p = sys::fork();
    if p == 0 {
        let ok = (|| {
            let sock = UnixStream::connect(&sock_path).ok()?;
            let mut to_us = to_us;
            to_us.write_all(b"c").ok()?;
            wait_for(&go_p)?;
            let name = format!("{}-reused", std::process::id());
            // G sends the hello and sleeps, holding the socket.
            let g = sys::fork();
            if g == 0 {
                if wait_for(&go_g).is_some() {
                    let hello = na_sm::conn::encode_hello(&name);
                    let _ = na_sm::sys::socket::send_with_fds(sock.as_fd(), &hello, &[region_fd, wake_fd]);
                    std::thread::sleep(Duration::from_secs(60));
                }
                sys::exit_now(0);
            }
            to_us.write_all(&g.to_le_bytes()).ok()
        })();
        sys::exit_now(if ok.is_some() { 0 } else { 2 });
    }
    drop(to_us);
    let mut b = [0u8; 1];
    from_p
        .read_exact(&mut b)
        .map_err(|e| format!("P did not connect: {e}"))?;
    let p_start = start_time(p as u32).map_err(|e| e.to_string())?;
    // The listener accepts P's connection (and reads its start time) now,
    // while P lives: progress until it waits for P's hello.
    let end = Instant::now() + Duration::from_secs(60);
    while srv.debug_pending_handshakes() == 0 {
        if Instant::now() > end {
            return Err("the listener did not accept P's connection within 60 s".into());
        }
        drive(&mut srv, Duration::from_millis(5));
    }
    // A later clock tick for the process that will take P's pid.
    std::thread::sleep(Duration::from_millis(30));
    to_p.write_all(b"g").map_err(|e| e.to_string())?;
    let mut g = [0u8; 4];
    from_p
        .read_exact(&mut g)
        .map_err(|e| format!("P did not fork G: {e}"))?;
    let _g = KillOnDrop::new(i32::from_le_bytes(g));
    let mut status = 0;
    // Reaps our own child P: its pid is free.
    if sys::waitpid(p, &mut status, 0) != p || !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        return Err(format!("P failed: {status:#x}"));
    }
    let q = take_pid(p)?;
    let _q = KillOnDrop::new(q);
    let q_start = start_time(p as u32).map_err(|e| e.to_string())?;
    if q_start == p_start {
        return Err(format!(
            "Q started in P's clock tick ({p_start}): nothing to tell them apart"
        ));
    }
    // G sends P's hello: the listener acknowledges, then checks who has
    // the pid now.
    to_g.write_all(b"h").map_err(|e| e.to_string())?;
    let end = Instant::now() + Duration::from_secs(60);
    let warned = loop {
        drive(&mut srv, Duration::from_millis(20));
        let w = log.lines_at("WARN", "names another process now");
        if !w.is_empty() || Instant::now() > end {
            break w;
        }
    };
    let [warning] = &warned[..] else {
        return Err(format!(
            "no warning (one) that pid {p} names another process (Q, started at {q_start}, P at {p_start}):\n{}",
            log.text()
        ));
    };
    let expect = [
        format!("pid={p}"),
        format!("expected={p_start}"),
        format!("found={q_start}"),
    ];
    if !expect.iter().all(|e| warning.contains(e.as_str())) {
        return Err(format!("the warning does not say {expect:?}: {warning}"));
    }
    let gone = log.lines_at("INFO", "sm disconnect");
    let peer = format!("sm://{p}-reused");
    if !gone
        .iter()
        .any(|l| l.contains(&peer) && l.contains("now names another process"))
    {
        return Err(format!("{peer} was not disconnected as gone:\n{}", log.text()));
    }
    Ok(format!(
        "pid {p}: P started at {p_start}, Q at {q_start}: {warning}"
    ))
}

/// Makes a new child (which only sleeps) take pid `pid`: `ns_last_pid`
/// set just below it, then fork (a few tries: a thread made meanwhile
/// would take it first).
fn take_pid(pid: libc::pid_t) -> Result<libc::pid_t, String> {
    for _ in 0..10 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
            .map_err(|e| format!("writing ns_last_pid: {e}"))?;
        // The child sleeps and ends with `exit_now`.
        let q = sys::fork();
        if q == 0 {
            std::thread::sleep(Duration::from_secs(60));
            sys::exit_now(0);
        }
        if q == pid {
            return Ok(q);
        }
        // Kills and reaps the child that missed.
        drop(KillOnDrop::new(q));
    }
    Err(format!("pid {pid} did not come round"))
}

/// Runs `srv`'s progress for `d`.
fn drive(srv: &mut SmPlugin, d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        let _ = srv.progress();
        let _ = srv.sleep(Some(Duration::from_millis(5)));
    }
}

/// Reads one byte from `f`: `None` if it ended instead.
fn wait_for(f: &File) -> Option<()> {
    let mut b = [0u8; 1];
    (&*f).read_exact(&mut b).ok()
}
