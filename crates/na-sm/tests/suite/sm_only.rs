//! Shared-memory-only trials (run in the suite binary, named
//! `sm_only::...`): lookup error texts, two instances on one poll set, the
//! socket directory variable, a hostile peer scribbling over shared memory,
//! stale-file cleanup, idle CPU, and the bound on a flooding peer.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use na_core::{NaError, OpId, PluginRegistry, ProgressMode};
use na_sm::SmFactory;
use na_testsuite::{flood_payload, Node, PeerProc, Scenario, Transport};

const T: Duration = Duration::from_secs(10);

/// The trials, by name.
pub fn trials() -> Vec<(&'static str, Scenario)> {
    vec![
        (
            "lookup_errors_name_the_cause_and_sizes_are_8_kib",
            lookup_errors_name_the_cause_and_sizes_are_8_kib,
        ),
        (
            "two_instances_driven_by_one_poll_set",
            two_instances_driven_by_one_poll_set,
        ),
        (
            "invalid_socket_dir_env_is_a_clear_error",
            invalid_socket_dir_env_is_a_clear_error,
        ),
        (
            "pipe_wake_ups_between_processes_in_blocking_mode",
            pipe_wake_ups_between_processes_in_blocking_mode,
        ),
        (
            "spin_to_sleep_transitions_lose_no_wake_up",
            spin_to_sleep_transitions_lose_no_wake_up,
        ),
        (
            "hostile_scribbler_gets_errors_and_honest_client_is_served",
            hostile_scribbler_gets_errors_and_honest_client_is_served,
        ),
        (
            "stale_cleanup_removes_dead_owners_files_and_keeps_live_ones",
            stale_cleanup_removes_dead_owners_files_and_keeps_live_ones,
        ),
        (
            "idle_progress_in_adaptive_and_blocking_mode_uses_no_cpu",
            idle_progress_in_adaptive_and_blocking_mode_uses_no_cpu,
        ),
        (
            "flooding_peer_is_bounded_and_nothing_is_lost",
            flooding_peer_is_bounded_and_nothing_is_lost,
        ),
        (
            "a_departed_flooder_loses_nothing_beyond_the_bound",
            a_departed_flooder_loses_nothing_beyond_the_bound,
        ),
    ]
}

/// The scenario's socket directory (what peers get as `QS_SM_DIR`).
fn dir_of(t: &Transport) -> PathBuf {
    t.peer_env
        .iter()
        .find(|(k, _)| k == na_sm::SOCKET_DIR_ENV)
        .map(|(_, v)| PathBuf::from(v))
        .expect("the sm transport names its socket directory")
}

pub fn lookup_errors_name_the_cause_and_sizes_are_8_kib(t: &Transport) {
    let mut server = PeerProc::spawn(t, &["server"]);
    let mut n = Node::new(t, ProgressMode::default(), false);
    let e = n.ep.lookup("sm://999999-nope").unwrap_err();
    assert!(
        matches!(e, NaError::Lookup { .. }) && na_core::ErrorChain(&e).to_string().contains("no socket"),
        "{}",
        na_core::ErrorChain(&e)
    );
    assert!(matches!(
        n.ep.lookup("sm://abc").unwrap_err(),
        NaError::InvalidAddress { .. }
    ));
    let addr = n.ep.lookup(&server.uri).unwrap();
    let p = n.ep.plugin(n.id).unwrap();
    assert_eq!((p.max_unexpected_size(), p.max_expected_size()), (8192, 8192));
    assert_eq!(n.request(&addr, 1, b"eping"), b"eping");
    // The dead server's socket file is left behind: lookup says it is stale.
    server.kill();
    let end = std::time::Instant::now() + T;
    while n.stats().peers > 0 {
        assert!(
            std::time::Instant::now() < end,
            "the server's death went unnoticed"
        );
        n.pump(Duration::from_millis(20));
    }
    let e = n.ep.lookup(&server.uri).unwrap_err();
    assert!(
        na_core::ErrorChain(&e).to_string().contains("nobody listens"),
        "{e:?}"
    );
}

pub fn two_instances_driven_by_one_poll_set(t: &Transport) {
    let dir = dir_of(t);
    let mut reg = PluginRegistry::new();
    reg.register(Box::new(SmFactory::new(
        na_sm::SmConfig::default().with_dir(dir.to_path_buf()),
    )));
    let mut ep = na_core::Endpoint::new(ProgressMode::Blocking).unwrap();
    let a = ep.add_from_spec(&reg, "sm://alpha", true).unwrap();
    let b = ep.add_from_spec(&reg, "sm://beta", true).unwrap();
    let b_uri = ep.self_addr(b).unwrap().uri().to_owned();
    assert_eq!(b_uri, format!("sm://{}-beta", std::process::id()));
    let b_from_a = ep.plugin_mut(a).unwrap().lookup(&b_uri).unwrap();
    let mut stash = std::collections::HashMap::new();
    let mut wait = |ep: &mut na_core::Endpoint, op: OpId| {
        let end = std::time::Instant::now() + T;
        loop {
            if let Some(c) = stash.remove(&op) {
                return c;
            }
            assert!(std::time::Instant::now() < end, "timed out on {op:?}");
            ep.progress(Some(Duration::from_millis(100))).unwrap();
            while let Some(c) = ep.pop_completion() {
                stash.insert(c.op, c);
            }
        }
    };
    for i in 0..100u64 {
        ep.post_recv_unexpected(b, Vec::new(), OpId(10 * i)).unwrap();
        ep.post_recv_expected(&b_from_a, i as u32, Vec::new(), OpId(10 * i + 1))
            .unwrap();
        ep.send_unexpected(&b_from_a, i as u32, &i.to_le_bytes(), OpId(10 * i + 2))
            .unwrap();
        let c = wait(&mut ep, OpId(10 * i));
        let a_from_b = c.source.unwrap();
        assert_eq!(a_from_b.plugin(), b);
        assert_eq!(c.buf.unwrap(), i.to_le_bytes());
        ep.send_expected(&a_from_b, i as u32, b"pong", OpId(10 * i + 3))
            .unwrap();
        assert_eq!(wait(&mut ep, OpId(10 * i + 1)).buf.unwrap(), b"pong");
        wait(&mut ep, OpId(10 * i + 2)).status.unwrap();
        wait(&mut ep, OpId(10 * i + 3)).status.unwrap();
    }
    // Each instance also talks to its own server process: in blocking mode
    // the replies arrive while the endpoint sleeps in its one epoll set, so
    // only the plugins' poll fds (woken by the servers' eventfd writes) can
    // end the wait.
    let s1 = PeerProc::spawn(t, &["server"]);
    let s2 = PeerProc::spawn(t, &["server"]);
    let s1a = ep.plugin_mut(a).unwrap().lookup(&s1.uri).unwrap();
    let s2b = ep.plugin_mut(b).unwrap().lookup(&s2.uri).unwrap();
    for i in 0..50u64 {
        for (k, srv) in [&s1a, &s2b].into_iter().enumerate() {
            let base = 10_000 + 10 * i + 5 * k as u64;
            ep.post_recv_expected(srv, i as u32, Vec::new(), OpId(base))
                .unwrap();
            ep.send_unexpected(srv, i as u32, &[b'e', i as u8], OpId(base + 1))
                .unwrap();
            assert_eq!(wait(&mut ep, OpId(base)).buf.unwrap(), [b'e', i as u8]);
            wait(&mut ep, OpId(base + 1)).status.unwrap();
        }
    }
    let (sa, sb) = (ep.plugin(a).unwrap().stats(), ep.plugin(b).unwrap().stats());
    assert_eq!((sa.msgs_sent, sa.msgs_received), (150, 150), "{sa:?}");
    assert_eq!((sb.msgs_sent, sb.msgs_received), (150, 150), "{sb:?}");
}

pub fn invalid_socket_dir_env_is_a_clear_error(t: &Transport) {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    // What a listener made with this environment (and `QS_SM_DIR`) says.
    let envcheck = |dir: &OsStr, vars: &[(&str, &str)]| {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .env(na_testsuite::PEER_ENV, "envcheck")
            .env("QS_SM_DIR", dir)
            .envs(vars.iter().copied())
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let s = envcheck("relative/dir".as_ref(), &[]);
    assert!(
        s.starts_with("ERR") && s.contains("QS_SM_DIR") && s.contains("absolute"),
        "{s}"
    );
    let s = envcheck(OsStr::from_bytes(b"/tmp/\xff\xfe"), &[]);
    assert!(
        s.starts_with("ERR") && s.contains("QS_SM_DIR") && s.contains("UTF-8"),
        "{s}"
    );
    let dir = dir_of(t);
    let s = envcheck(dir.as_ref(), &[(na_sm::WAKE_ENV, "futex")]);
    assert!(
        s.starts_with("ERR") && s.contains("QS_SM_WAKE") && s.contains("eventfd or pipe"),
        "{s}"
    );
    let s = envcheck(dir.as_ref(), &[(na_sm::PIDFD_ENV, "pidfd")]);
    assert!(
        s.starts_with("ERR") && s.contains("QS_SM_PIDFD") && s.contains("socket or pid"),
        "{s}"
    );
    for ok in ["pid", "socket"] {
        let s = envcheck(dir.as_ref(), &[(na_sm::PIDFD_ENV, ok)]);
        assert!(s.starts_with("OK"), "QS_SM_PIDFD={ok}: {s}");
    }
}

/// `(inode, descriptors)` of every pipe process `pid` holds.
fn pipes_of(pid: u32) -> Vec<(String, usize)> {
    let mut v: Vec<(String, usize)> = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(link) = std::fs::read_link(e.path()) else {
            continue;
        };
        let link = link.to_string_lossy().into_owned();
        if let Some(ino) = link.strip_prefix("pipe:") {
            match v.iter_mut().find(|(i, _)| i == ino) {
                Some(x) => x.1 += 1,
                None => v.push((ino.to_owned(), 1)),
            }
        }
    }
    v
}

/// Both sides woken through pipes (`SmConfig::wake`, `QS_SM_WAKE=pipe` for
/// the peer), both in blocking mode (so each echo must wake the client):
/// 2,000 echoes arrive, wake-ups were written, and each side really holds
/// the write end of a pipe whose both ends the other holds.
pub fn pipe_wake_ups_between_processes_in_blocking_mode(t: &Transport) {
    let mut tp = crate::transport_with_wake(dir_of(t), None, Some(na_sm::WakeKind::Pipe));
    tp.peer_env
        .push((na_testsuite::PEER_MODE_ENV.into(), "blocking".into()));
    let mut n = Node::new(&tp, ProgressMode::Blocking, true);
    let me = n.ep.self_addr(n.id).unwrap().uri().to_owned();
    let mut client = PeerProc::spawn(&tp, &["client", &me, "2000"]);
    let client_pid = client.child.id();
    let (mut ours_to_client, mut clients_to_us, mut done) = (false, false, false);
    let mut rounds = 0u32;
    n.serve_echo(Duration::from_secs(60), || {
        // Now and then answer late: the client, blocking, runs out of
        // replies and sleeps, so the next reply must wake it (on a fast
        // machine a pipelining client could otherwise always find one).
        rounds += 1;
        if rounds.is_multiple_of(50) {
            std::thread::sleep(Duration::from_millis(3));
        }
        done = done || client.child.try_wait().unwrap().is_some();
        let found = ours_to_client && clients_to_us;
        if !done && !found {
            let (mine, theirs) = (pipes_of(std::process::id()), pipes_of(client_pid));
            let shared = |a: &[(String, usize)], b: &[(String, usize)]| {
                a.iter().any(|(i, k)| *k >= 2 && b.iter().any(|(j, _)| j == i))
            };
            ours_to_client |= shared(&mine, &theirs);
            clients_to_us |= shared(&theirs, &mine);
        }
        done
    });
    assert!(client.wait(T), "client failed");
    assert_eq!(client.line(T), "CLIENT OK 2000");
    assert!(
        ours_to_client,
        "the client holds the write end of our wake-up pipe"
    );
    assert!(
        clients_to_us,
        "we hold the write end of the client's wake-up pipe"
    );
    let st = n.stats();
    assert!(
        st.signals_sent > 0,
        "the client was woken through its pipe: {st:?}"
    );
}

/// Both sides in adaptive mode with short spin windows, the server
/// answering after stalls of varied length: each side keeps going from
/// spinning to sleeping while the other sends, which is where a wake-up
/// gets lost if the flag protocol is wrong. Both wait in 2 s steps, and no
/// stall here lasts a millisecond, so a wait that ends with nothing to do
/// before the client is done means a lost wake-up. (Checked: with the
/// receiver's flag left unraised the trial fails.)
pub fn spin_to_sleep_transitions_lose_no_wake_up(t: &Transport) {
    let mut tp = crate::transport_with_wake(dir_of(t), None, None);
    tp.peer_env
        .push((na_testsuite::PEER_MODE_ENV.into(), "adaptive:20".into()));
    let spin = ProgressMode::Adaptive {
        spin: Duration::from_micros(5),
    };
    let mut n = Node::new(&tp, spin, true);
    n.echo_tick = Duration::from_secs(2);
    let me = n.ep.self_addr(n.id).unwrap().uri().to_owned();
    // One echo in flight: every reply finds the client spinning, or just
    // going to sleep, or asleep.
    let mut client = PeerProc::spawn(&tp, &["client", &me, "3000", "1", "2000"]);
    // Stall lengths around both spin windows, and past them.
    let stalls_us = [0u64, 0, 3, 8, 15, 25, 40, 0, 90, 300];
    let (mut round, mut done) = (0usize, false);
    n.serve_echo(Duration::from_secs(60), || {
        round += 1;
        let us = stalls_us[round % stalls_us.len()];
        if us > 0 {
            std::thread::sleep(Duration::from_micros(us));
        }
        done = done || client.child.try_wait().unwrap().is_some();
        done
    });
    assert!(client.wait(T), "client failed");
    assert_eq!(client.line(T), "CLIENT OK 3000");
    assert_eq!(client.line(T), "CLIENT IDLE 0", "the client missed a wake-up");
    // The last wait may end idle: the client exits after its last echo.
    assert!(
        n.echo_idle_ticks <= 1,
        "the server missed a wake-up ({} idle waits)",
        n.echo_idle_ticks
    );
    let st = n.stats();
    assert!(
        st.signals_sent > 0,
        "the client was never asleep when a reply came: {st:?}"
    );
}

pub fn hostile_scribbler_gets_errors_and_honest_client_is_served(t: &Transport) {
    let mut n = Node::new(t, ProgressMode::default(), true);
    let me = n.ep.self_addr(n.id).unwrap().uri().to_owned();
    let mut hostile = PeerProc::spawn(t, &["hostile", &me]);
    let mut honest = PeerProc::spawn(t, &["client", &me, "3000"]);
    let (mut h_done, mut c_done) = (false, false);
    n.serve_echo(Duration::from_secs(60), || {
        h_done = h_done || hostile.child.try_wait().unwrap().is_some();
        c_done = c_done || honest.child.try_wait().unwrap().is_some();
        h_done && c_done
    });
    assert!(hostile.wait(T), "hostile peer saw no error");
    assert!(hostile.line(T).starts_with("HOSTILE"));
    assert!(honest.wait(T), "honest client failed");
    assert_eq!(honest.line(T), "CLIENT OK 3000");
    let st = n.stats();
    assert!(st.protocol_errors >= 1, "{st:?}");
}

pub fn stale_cleanup_removes_dead_owners_files_and_keeps_live_ones(t: &Transport) {
    let dir = dir_of(t);
    let mut dead = PeerProc::spawn(t, &["server"]);
    let dead_key = dead.uri.strip_prefix("sm://").unwrap().to_owned();
    dead.kill();
    let live = Node::new(t, ProgressMode::default(), true);
    // (Node's listening plugin already ran a cleanup at start; recreate
    // the dead one's files to test the API and the command explicitly.)
    let sock = dir.join(format!("{dead_key}.sock"));
    let owner = dir.join(format!("{dead_key}.owner"));
    std::fs::write(&sock, b"").unwrap();
    std::fs::write(&owner, b"qs-sm-owner 1 1 1\n").unwrap();
    let live_key = live
        .ep
        .self_addr(live.id)
        .unwrap()
        .uri()
        .strip_prefix("sm://")
        .unwrap()
        .to_owned();
    let live_sock = dir.join(format!("{live_key}.sock"));
    assert!(live_sock.exists());
    let r = na_sm::cleanup_stale(&dir).unwrap();
    assert!(r.removed.contains(&sock) && r.removed.contains(&owner), "{r:?}");
    assert!(r.kept.contains(&live_sock), "{r:?}");
    assert!(!sock.exists() && !owner.exists() && live_sock.exists());
    // The command does the same and reports it.
    std::fs::write(&sock, b"").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_qs-sm-cleanup"))
        .arg(&*dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 removed") && text.contains("kept"),
        "{text}"
    );
    assert!(!sock.exists() && live_sock.exists());
    drop(live);
    assert!(!live_sock.exists(), "drop removes our socket file");
    assert_eq!(
        std::fs::read_dir(&*dir).unwrap().count(),
        0,
        "drop leaves nothing behind"
    );
}

fn thread_cpu() -> Duration {
    let (r, ru) = crate::common::sys::getrusage(libc::RUSAGE_THREAD);
    assert_eq!(r, 0);
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

pub fn idle_progress_in_adaptive_and_blocking_mode_uses_no_cpu(t: &Transport) {
    let server = PeerProc::spawn(t, &["server"]);
    for mode in [ProgressMode::default(), ProgressMode::Blocking] {
        let mut n = Node::new(t, mode, true);
        let addr = n.ep.lookup(&server.uri).unwrap();
        assert_eq!(
            n.request(&addr, 1, b"eping"),
            b"eping",
            "connected and traffic flowed"
        );
        let r = n.op();
        n.ep.post_recv_expected(&addr, 99, Vec::new(), r).unwrap();
        let (cpu0, t0) = (thread_cpu(), Instant::now());
        while t0.elapsed() < Duration::from_secs(1) {
            n.pump(Duration::from_secs(1) - t0.elapsed().min(Duration::from_secs(1)));
        }
        let (cpu, wall) = (thread_cpu() - cpu0, t0.elapsed());
        assert!(n.stash.is_empty());
        assert!(cpu < wall / 20, "{mode}: {cpu:?} CPU in {wall:?}");
        eprintln!("{mode}: {cpu:?} CPU over {wall:?} idle");
    }
}

/// A peer that floods us while we post no receive: we hold at most the
/// configured number of its messages, the rest wait in shared memory and in
/// its backlog, and once we post receives every message arrives, in order.
pub fn flooding_peer_is_bounded_and_nothing_is_lost(t: &Transport) {
    const BOUND: usize = 32;
    const N: u32 = 2000;
    let (mut ep, id, mut flooder) = flooded_listener(t, BOUND, N);
    // No receive posted: progress for a while; the held queue must stay bounded.
    let until = std::time::Instant::now() + Duration::from_millis(700);
    while std::time::Instant::now() < until {
        ep.progress(Some(Duration::from_millis(20))).unwrap();
        assert!(
            ep.pop_completion().is_none(),
            "nothing was posted, nothing may complete"
        );
    }
    let st = ep.plugin(id).unwrap().stats();
    assert!(st.queued_arrivals >= 1, "the flooder never reached us: {st:?}");
    assert!(
        st.queued_arrivals <= BOUND as u64,
        "held {} > bound {BOUND}",
        st.queued_arrivals
    );
    assert!(st.flow_blocked > 0, "{st:?}");
    // Now receive everything, in order, intact.
    let mut got = 0u32;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut posted = 0u32;
    while got < N {
        assert!(
            std::time::Instant::now() < deadline,
            "only {got} of {N} messages arrived"
        );
        while posted < N && posted - got < 100 {
            ep.post_recv_unexpected(id, Vec::new(), OpId(u64::from(posted)))
                .unwrap();
            posted += 1;
        }
        ep.progress(Some(Duration::from_millis(100))).unwrap();
        while let Some(c) = ep.pop_completion() {
            c.status.as_ref().unwrap();
            assert_eq!(c.tag, got, "messages out of order");
            assert_eq!(
                c.buf.as_deref(),
                Some(&flood_payload(got)[..]),
                "message {got} corrupted"
            );
            got += 1;
            let held = ep.plugin(id).unwrap().stats().queued_arrivals;
            assert!(held <= BOUND as u64, "held {held} > bound {BOUND}");
        }
    }
    assert!(flooder.wait(Duration::from_secs(30)), "flooder failed");
    assert_eq!(flooder.line(Duration::from_secs(5)), format!("FLOOD DONE {N}"));
}

/// A peer that sends more than the flood bound and exits before we post a
/// receive: its sends completed, so every message must still arrive (the
/// ring goes away with the peer; what it held is taken out first, bound
/// or not).
pub fn a_departed_flooder_loses_nothing_beyond_the_bound(t: &Transport) {
    const BOUND: usize = 4;
    const N: u32 = 10;
    let (mut ep, id, mut flooder) = flooded_listener(t, BOUND, N);
    let end = std::time::Instant::now() + Duration::from_secs(30);
    // Its sends all complete (the ring holds them), then it exits.
    while !flooder.exited() {
        assert!(std::time::Instant::now() < end, "the flooder did not finish");
        ep.progress(Some(Duration::from_millis(10))).unwrap();
    }
    assert!(flooder.wait(Duration::from_secs(5)), "the flooder failed");
    assert_eq!(flooder.line(Duration::from_secs(5)), format!("FLOOD DONE {N}"));
    // We see it go.
    while ep.plugin(id).unwrap().stats().peers > 0 {
        assert!(std::time::Instant::now() < end, "the flooder's end was not seen");
        ep.progress(Some(Duration::from_millis(10))).unwrap();
    }
    for i in 0..N {
        ep.post_recv_unexpected(id, Vec::new(), OpId(u64::from(i)))
            .unwrap();
    }
    let mut got = 0u32;
    while got < N {
        assert!(
            std::time::Instant::now() < end,
            "only {got} of {N} messages arrived"
        );
        ep.progress(Some(Duration::from_millis(10))).unwrap();
        while let Some(c) = ep.pop_completion() {
            c.status.as_ref().unwrap();
            assert_eq!(c.tag, got, "messages out of order");
            assert_eq!(c.buf.as_deref(), Some(&flood_payload(got)[..]));
            got += 1;
        }
    }
}

/// A listening endpoint holding at most `bound` messages per peer, and a
/// peer process that sends it `n` unexpected messages.
fn flooded_listener(t: &Transport, bound: usize, n: u32) -> (na_core::Endpoint, na_core::PluginId, PeerProc) {
    use na_core::{Endpoint, Plugin};
    use na_sm::{SmConfig, SmPlugin};
    let cfg = SmConfig {
        listen: true,
        max_queued_per_peer: bound,
        ..SmConfig::default()
    }
    .with_dir(&*dir_of(t));
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let me = ep.self_addr(id).unwrap();
    let flooder = PeerProc::spawn(t, &["flood", me.uri(), &n.to_string()]);
    (ep, id, flooder)
}
