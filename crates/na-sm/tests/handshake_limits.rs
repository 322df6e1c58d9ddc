//! The listener under connection pressure, and a connector whose listener
//! never answers: nothing an honest peer sent is lost, and every deadline
//! is kept while the plugin sleeps.
//!
//! * More connections than `MAX_PENDING_HANDSHAKES` that never say hello,
//!   from many processes: the listener pauses (the rest wait in the
//!   kernel's queue) instead of closing honest connections queued behind
//!   them, and resumes when the silent ones time out.
//! * Silent connections from one process past `MAX_PENDING_PER_PROCESS`
//!   are refused as they are accepted: it cannot pause the listener.
//! * A listener that never accepts: the connector's operations fail with
//!   `PeerGone` after twice the handshake timeout instead of waiting forever.
//! * One process past `max_conns_per_process` connections: its next
//!   handshake is refused.
//! * A listener paused for departed peers' queued messages resumes when
//!   the application takes them.
//! * A connector that closes before its hello is a departure, not a
//!   protocol error.
//! * A queue of connections is taken a bounded number per progress call,
//!   and a driver that waits edge-triggered (as tokio does) never sleeps
//!   on the rest.

use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use na_core::{Endpoint, NaError, OpId, Plugin, PluginId, ProgressMode};
use na_sm::{SmConfig, SmPlugin, MAX_ACCEPTS_PER_CALL, MAX_PENDING_HANDSHAKES, MAX_PENDING_PER_PROCESS};

mod common;
use common::sys;

const HANDSHAKE: Duration = Duration::from_millis(500);

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("qs-sm-hs-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    d
}

fn node(d: &Path, listen: bool, mode: ProgressMode) -> (Endpoint, PluginId) {
    node_with(d, listen, mode, HANDSHAKE)
}

fn node_with(d: &Path, listen: bool, mode: ProgressMode, handshake: Duration) -> (Endpoint, PluginId) {
    let cfg = SmConfig {
        listen,
        handshake_timeout: handshake,
        ..SmConfig::default()
    }
    .with_dir(d);
    let mut ep = Endpoint::new(mode).unwrap();
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    (ep, id)
}

/// A listening configuration in `d` with this file's handshake timeout.
fn listening(d: &Path) -> SmConfig {
    SmConfig {
        listen: true,
        handshake_timeout: HANDSHAKE,
        ..SmConfig::default()
    }
    .with_dir(d)
}

/// A busy-polling endpoint listening with `cfg`, and its address.
fn busy_listener(cfg: SmConfig) -> (Endpoint, PluginId, String) {
    let mut srv = Endpoint::new(ProgressMode::Busy).unwrap();
    let sid = srv
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    (srv, sid, uri)
}

/// Raises the descriptor limit to the hard limit: this test holds a few
/// hundred descriptors in one process.
fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    assert_eq!(sys::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
    lim.rlim_cur = lim.rlim_max;
    sys::setrlimit(libc::RLIMIT_NOFILE, &lim);
}

/// Environment of a helper process (this test binary run again) that
/// makes `count` connections to `path` (the value is `path|count`), never
/// says hello, prints `SILENT <count>` and holds them until its stdin
/// closes.
const SILENT_ENV: &str = "QS_TEST_SILENT_CONNECTIONS";

/// In a helper process: what [`SILENT_ENV`] asks. True if it was one.
fn silent_helper() -> bool {
    let Ok(role) = std::env::var(SILENT_ENV) else {
        return false;
    };
    let mut parts = role.split('|');
    let (path, count) = (
        parts.next().unwrap(),
        parts.next().unwrap().parse::<usize>().unwrap(),
    );
    let held: Vec<UnixStream> = (0..count)
        .map(|_| UnixStream::connect(path).expect("connect (silent)"))
        .collect();
    println!("SILENT {}", held.len());
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut std::io::stdin(), &mut rest);
    true
}

/// A process (this test binary, `test` its test's name) holding `count`
/// silent connections to `path`, once it said it made them. Exits when
/// dropped (its stdin closes).
struct SilentProcess(std::process::Child);

impl SilentProcess {
    fn start(path: &Path, count: usize, test: &str) -> SilentProcess {
        use std::io::BufRead;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads", "1"])
            .env(SILENT_ENV, format!("{}|{count}", path.display()))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "the helper exited before connecting"
            );
            if line.contains("SILENT ") {
                break;
            }
        }
        SilentProcess(child)
    }
}

impl Drop for SilentProcess {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}

#[test]
fn honest_clients_queued_behind_silent_connections_are_served_not_refused() {
    const TEST: &str = "honest_clients_queued_behind_silent_connections_are_served_not_refused";
    if silent_helper() {
        return;
    }
    raise_fd_limit();
    let d = dir("burst");
    let (mut srv, sid) = node(&d, true, ProgressMode::Blocking);
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    let sock_path = d.join(format!("{}.sock", uri.trim_start_matches("sm://")));
    // More silent connections than may wait for a hello, from processes
    // that each stay within their own bound...
    let processes = MAX_PENDING_HANDSHAKES / MAX_PENDING_PER_PROCESS + 1;
    let silent: Vec<SilentProcess> = (0..processes)
        .map(|_| SilentProcess::start(&sock_path, MAX_PENDING_PER_PROCESS, TEST))
        .collect();
    // ...then honest clients, each sending one message.
    const HONEST: usize = 20;
    let mut clients = Vec::new();
    for i in 0..HONEST {
        let (mut c, _) = node(&d, false, ProgressMode::Busy);
        let a = c.lookup(&uri).unwrap();
        c.send_unexpected(&a, i as u32, b"hi", OpId(1)).unwrap();
        clients.push(c);
    }
    for i in 0..HONEST as u64 {
        srv.post_recv_unexpected(sid, Vec::new(), OpId(100 + i)).unwrap();
    }
    // The server sleeps with long timeouts: the silent connections' end
    // (and the listener's resumption) must come from its own timer.
    let t0 = Instant::now();
    let mut tags = Vec::new();
    while tags.len() < HONEST {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "only {} of {HONEST} honest clients' messages arrived (stats {:?})",
            tags.len(),
            srv.plugin(sid).unwrap().stats()
        );
        // (Far past the deadline, so that a loaded box's delays cannot pass
        // for a sleep through it.)
        srv.progress(Some(Duration::from_secs(10))).unwrap();
        while let Some(c) = srv.pop_completion() {
            c.status.as_ref().expect("an honest client's message");
            tags.push(c.tag);
        }
        for c in clients.iter_mut() {
            c.progress(Some(Duration::ZERO)).unwrap();
            while c.pop_completion().is_some() {}
        }
    }
    let took = t0.elapsed();
    tags.sort_unstable();
    assert_eq!(tags, (0..HONEST as u32).collect::<Vec<_>>());
    let stats = srv.plugin(sid).unwrap().stats();
    assert!(stats.flow_blocked > 0, "the listener never paused: {stats:?}");
    assert!(
        took < Duration::from_secs(9),
        "served after {took:?}: the server slept through the handshake deadline"
    );
    drop(silent);
    let _ = std::fs::remove_dir_all(&d);
}

/// One process that makes more silent connections than the listener lets
/// wait for a hello in all: those past `MAX_PENDING_PER_PROCESS` are
/// refused as they are accepted, so the listener never pauses, and an
/// honest client is served at once, not after the handshake timeout.
#[test]
fn one_process_of_silent_connections_cannot_pause_the_listener() {
    const TEST: &str = "one_process_of_silent_connections_cannot_pause_the_listener";
    if silent_helper() {
        return;
    }
    let d = dir("silent1");
    // The silent connections time out after 5 s: far longer than serving
    // the honest client takes, even on a loaded box.
    const SILENT_TIMEOUT: Duration = Duration::from_secs(5);
    let (mut srv, sid) = node_with(&d, true, ProgressMode::Blocking, SILENT_TIMEOUT);
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    let sock_path = d.join(format!("{}.sock", uri.trim_start_matches("sm://")));
    let count = MAX_PENDING_HANDSHAKES + 20;
    let silent = SilentProcess::start(&sock_path, count, TEST);
    let (mut c, _) = node(&d, false, ProgressMode::Busy);
    let a = c.lookup(&uri).unwrap();
    c.send_unexpected(&a, 7, b"hi", OpId(1)).unwrap();
    srv.post_recv_unexpected(sid, Vec::new(), OpId(100)).unwrap();
    let t0 = Instant::now();
    let got = loop {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the honest client's message never arrived (stats {:?})",
            srv.plugin(sid).unwrap().stats()
        );
        srv.progress(Some(Duration::from_millis(100))).unwrap();
        c.progress(Some(Duration::ZERO)).unwrap();
        while c.pop_completion().is_some() {}
        if let Some(k) = srv.pop_completion() {
            break k;
        }
    };
    got.status.as_ref().expect("the honest client's message");
    assert_eq!(got.tag, 7);
    let stats = srv.plugin(sid).unwrap().stats();
    assert_eq!(stats.flow_blocked, 0, "the listener paused: {stats:?}");
    assert!(
        stats.handshakes_refused >= (count - MAX_PENDING_PER_PROCESS) as u64,
        "{stats:?}"
    );
    assert!(
        t0.elapsed() < SILENT_TIMEOUT,
        "served after {:?}: it waited for the silent connections to time out",
        t0.elapsed()
    );
    drop(silent);
    let _ = std::fs::remove_dir_all(&d);
}

/// A blocking listener with `QUEUED` silent connections of this process
/// waiting in the kernel's queue, none accepted yet (within the listen
/// backlog of 128). Its handshake timeout is far beyond a test, so that the
/// `MAX_PENDING_PER_PROCESS` that wait for a hello cannot time out (and
/// count as refusals) midway; the rest are refused as they are accepted,
/// so [`taken`](Self::taken) counts the accepts.
struct QueuedListener {
    d: PathBuf,
    srv: Endpoint,
    sid: PluginId,
    _conns: Vec<UnixStream>,
}

const QUEUED: usize = 100;

impl QueuedListener {
    fn new(tag: &str) -> Self {
        let d = dir(tag);
        let (srv, sid) = node_with(&d, true, ProgressMode::Blocking, Duration::from_secs(60));
        let uri = srv.self_addr(sid).unwrap().uri().to_owned();
        let sock_path = d.join(format!("{}.sock", uri.trim_start_matches("sm://")));
        let _conns = (0..QUEUED)
            .map(|_| UnixStream::connect(&sock_path).unwrap())
            .collect();
        QueuedListener { d, srv, sid, _conns }
    }

    /// Connections accepted so far (waiting for a hello or refused).
    fn taken(&self) -> usize {
        self.srv.plugin(self.sid).unwrap().stats().handshakes_refused as usize + MAX_PENDING_PER_PROCESS
    }
}

impl Drop for QueuedListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.d);
    }
}

/// Connections that keep coming cannot hold one progress call: a pass
/// over the listener accepts (or refuses) at most `MAX_ACCEPTS_PER_CALL`
/// of them; the plugin then refuses to sleep (a caller waiting on its fd
/// edge-triggered, as tokio does, would get no new edge for the rest), and
/// the next calls take the rest with no new event.
#[test]
fn queued_connections_are_accepted_a_bounded_number_per_progress_call() {
    let mut q = QueuedListener::new("acceptcap");
    let sid = q.sid;
    // One zero-timeout sleep is one epoll_wait: the listener's event, one
    // pass.
    q.srv
        .plugin_mut(sid)
        .unwrap()
        .sleep(Some(Duration::ZERO))
        .unwrap();
    assert_eq!(
        q.taken(),
        MAX_ACCEPTS_PER_CALL,
        "one pass must accept MAX_ACCEPTS_PER_CALL of {QUEUED} queued connections"
    );
    // What tokio's driver asks before it sleeps on the fd: its harvest is
    // one more pass, and with connections still queued the answer is no.
    let may_sleep = q.srv.plugin_mut(sid).unwrap().try_wait().unwrap();
    assert_eq!(q.taken(), 2 * MAX_ACCEPTS_PER_CALL);
    assert!(
        !may_sleep,
        "the plugin would sleep with connections queued behind a full pass"
    );
    // The rest, call by call, with no new event: the listener stays readable.
    let mut before = q.taken();
    while before < QUEUED {
        q.srv.plugin_mut(sid).unwrap().progress().unwrap();
        let now = q.taken();
        assert_eq!(
            now - before,
            MAX_ACCEPTS_PER_CALL.min(QUEUED - before),
            "a later call accepted a wrong number ({before} before)"
        );
        before = now;
    }
    // All taken (the last pass found the queue empty): it may sleep now.
    assert!(
        q.srv.plugin_mut(sid).unwrap().try_wait().unwrap(),
        "nothing is queued any more"
    );
    assert_eq!(q.taken(), QUEUED);
    assert_eq!(q.srv.plugin(sid).unwrap().stats().flow_blocked, 0);
}

/// The same queue, drained the way tokio's driver waits: on the
/// endpoint's fd registered edge-triggered, after `try_wait` said yes. The
/// listener stays readable past a full pass, but that makes no new edge
/// through the nested epoll sets: the plugin must not agree to sleep
/// while connections may be queued, or the driver would sleep on them.
#[test]
fn a_driver_waiting_edge_triggered_takes_every_queued_connection() {
    let mut q = QueuedListener::new("acceptet");
    let waiter = na_core::sys::epoll::Epoll::new().unwrap();
    waiter.add_edge_triggered(q.srv.as_fd(), 1).unwrap();
    let mut tokens = Vec::new();
    let t0 = Instant::now();
    while q.taken() < QUEUED {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{} of {QUEUED} taken",
            q.taken()
        );
        q.srv.progress_now().unwrap();
        if q.taken() < QUEUED && q.srv.try_wait().unwrap() && q.taken() < QUEUED {
            let woken = waiter.wait(&mut tokens, Some(Duration::from_secs(2))).unwrap();
            assert!(
                woken > 0,
                "the driver slept with {} of {QUEUED} connections taken, and no edge came",
                q.taken()
            );
        }
    }
    assert_eq!(q.taken(), QUEUED);
}

#[test]
fn a_listener_that_never_answers_fails_the_connectors_operations() {
    let d = dir("mute");
    // Bound and listening (connects succeed into its queue), never accepting.
    let name = format!("{}-mute", std::process::id());
    let _mute = UnixListener::bind(d.join(format!("{name}.sock"))).unwrap();
    let (mut c, cid) = node(&d, false, ProgressMode::Blocking);
    // Before the lookup, whose connection the deadline runs from: a loaded
    // box may take a while over the sends, which must not count as an
    // early failure.
    let t0 = Instant::now();
    let a = c.lookup(&format!("sm://{name}")).unwrap();
    let big = vec![7u8; 4000];
    const SENDS: u64 = 300; // beyond the ring: some wait in the backlog
    for i in 0..SENDS {
        c.send_unexpected(&a, 0, &big, OpId(i)).unwrap();
    }
    let (mut done, mut failed) = (0, 0);
    while done < SENDS {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{done} of {SENDS} sends completed; stats {:?}",
            c.plugin(cid).unwrap().stats()
        );
        // Long sleeps (far past the deadline, so that a loaded box's delays
        // cannot pass for a sleep through it): the deadline must wake the
        // plugin.
        c.progress(Some(Duration::from_secs(10))).unwrap();
        while let Some(k) = c.pop_completion() {
            done += 1;
            // Those that fit the ring completed when written to it; the
            // ones waiting behind them fail.
            if let Err(e) = k.status {
                assert!(
                    matches!(e, NaError::PeerGone { .. }),
                    "{}",
                    na_core::ErrorChain(&e)
                );
                assert!(
                    e.to_string().contains("acknowledgement"),
                    "{}",
                    na_core::ErrorChain(&e)
                );
                failed += 1;
            }
        }
    }
    assert!(failed > SENDS / 2, "only {failed} of {SENDS} sends failed");
    let took = t0.elapsed();
    assert!(
        took >= 2 * HANDSHAKE - Duration::from_millis(50),
        "failed too early: {took:?}"
    );
    assert!(
        took < Duration::from_secs(9),
        "failed after {took:?}: the deadline did not wake the plugin"
    );
    assert_eq!(c.plugin(cid).unwrap().stats().in_flight, 0);
    let e = c.send_unexpected(&a, 0, b"x", OpId(999)).unwrap_err();
    assert!(
        matches!(e, NaError::PeerGone { .. } | NaError::InvalidAddress { .. }),
        "{}",
        na_core::ErrorChain(&e)
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// Clients that connect, send messages nobody receives, and go, again and
/// again: each peer is within its own bound (and a departing peer's ring
/// is taken whole), so only a bound over all peers keeps the listener's
/// memory in check. At `max_queued_total` it stops accepting until the
/// application takes some; then new clients are served again.
///
/// Each round waits for what it checks, never for a while: for the
/// listener to take the client in (or to stay paused, the client left in
/// the kernel's queue), then, the client gone, for its departure (peers
/// 0: its messages are all queued) or the pause. A paused listener is out
/// of the epoll set, so no event would say so: the listener probe does.
#[test]
fn queued_messages_stay_bounded_when_clients_keep_coming() {
    const PER_PEER: usize = 16;
    const TOTAL: usize = 48;
    const RING: u64 = 64;
    let d = dir("total");
    let cfg = SmConfig {
        max_queued_per_peer: PER_PEER,
        max_queued_total: TOTAL,
        // Departed peers' messages stay (a loaded box's rounds may take
        // longer than the default 10 s): only the application's receives
        // end the pause.
        departed_hold: Duration::from_secs(600),
        ..listening(&d)
    };
    let mut srv = Endpoint::new(ProgressMode::Busy).unwrap();
    let mut probe = None;
    let sid = srv
        .add_plugin(|id| {
            let mut p = SmPlugin::new(id, cfg)?;
            probe = Some(p.debug_listener_probe());
            Ok(Box::new(p) as Box<dyn Plugin>)
        })
        .unwrap();
    let probe = probe.expect("the plugin was made");
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    let stats = |srv: &Endpoint| srv.plugin(sid).unwrap().stats();
    let queued = |srv: &Endpoint| stats(srv).queued_arrivals;
    let until = |srv: &mut Endpoint, what: &str, done: &dyn Fn(&Endpoint) -> bool| {
        let t0 = Instant::now();
        while !done(srv) {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "never: {what} ({:?}, paused: {})",
                stats(srv),
                probe.paused()
            );
            srv.progress(Some(Duration::from_millis(1))).unwrap();
        }
    };
    let mut paused_in = None;
    for round in 0..10u64 {
        let (mut c, _) = node(&d, false, ProgressMode::Busy);
        let a = c.lookup(&uri).unwrap();
        for i in 0..20u64 {
            c.send_unexpected(&a, round as u32, &i.to_le_bytes(), OpId(i))
                .unwrap();
        }
        until(&mut srv, "the client taken in, or the listener paused", &|srv| {
            stats(srv).peers > 0 || probe.paused_for_queued_total()
        });
        c.progress(Some(Duration::ZERO)).unwrap();
        drop(c);
        until(
            &mut srv,
            "the client's departure, or the listener paused",
            &|srv| stats(srv).peers == 0 || probe.paused_for_queued_total(),
        );
        if probe.paused_for_queued_total() {
            paused_in.get_or_insert(round);
        }
        assert!(
            queued(&srv) <= TOTAL as u64 + RING,
            "round {round}: {} queued, bound {TOTAL} + a departing ring's {RING}",
            queued(&srv)
        );
    }
    let st = stats(&srv);
    assert!(
        st.flow_blocked > 0,
        "the total bound never held anything back: {st:?}"
    );
    // 20 messages a client, 48 at most: a few departures reach the bound
    // (peers' own bounds raise `flow_blocked` too: the pause is the total's).
    assert!(
        paused_in.is_some(),
        "the listener never paused for the total bound: {st:?}"
    );
    let settle = |srv: &mut Endpoint| {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(50) {
            srv.progress(Some(Duration::from_millis(1))).unwrap();
        }
    };
    // The application takes what is queued: clients are served again.
    let n = queued(&srv);
    for i in 0..n {
        srv.post_recv_unexpected(sid, Vec::new(), OpId(1000 + i)).unwrap();
    }
    settle(&mut srv);
    while srv.pop_completion().is_some() {}
    let (mut c, _) = node(&d, false, ProgressMode::Busy);
    let a = c.lookup(&uri).unwrap();
    c.send_unexpected(&a, 7, b"served again", OpId(1)).unwrap();
    // Connections that waited in the kernel's queue meanwhile are taken in
    // too (their rings hold what they sent): receive until ours shows up.
    let end = Instant::now() + Duration::from_secs(10);
    let mut next = 2000u64;
    srv.post_recv_unexpected(sid, Vec::new(), OpId(next)).unwrap();
    loop {
        assert!(
            Instant::now() < end,
            "a client after the queue drained was not served"
        );
        c.progress(Some(Duration::ZERO)).unwrap();
        srv.progress(Some(Duration::from_millis(1))).unwrap();
        let mut found = false;
        while let Some(k) = srv.pop_completion() {
            found |= k.buf.as_deref() == Some(&b"served again"[..]);
            next += 1;
            srv.post_recv_unexpected(sid, Vec::new(), OpId(next)).unwrap();
        }
        if found {
            break;
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A listener paused for departed peers' queued messages goes on when the
/// application takes them, at the receive itself, not at the next progress
/// call: an owner that sleeps meanwhile (the receive posted from another
/// thread) would get no event for it, the listener being out of the epoll
/// set.
#[test]
fn a_listener_paused_for_departed_messages_resumes_when_they_are_taken() {
    let d = dir("resume");
    let (mut srv, sid, uri) = busy_listener(SmConfig {
        max_queued_per_peer: 16,
        max_queued_total: 4,
        ..listening(&d)
    });
    let stats = |srv: &Endpoint| srv.plugin(sid).unwrap().stats();
    let until =
        |srv: &mut Endpoint, c: Option<&mut Endpoint>, what: &str, done: &dyn Fn(&Endpoint) -> bool| {
            let mut c = c;
            let t0 = Instant::now();
            while !done(srv) {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "never: {what} ({:?})",
                    stats(srv)
                );
                if let Some(c) = c.as_deref_mut() {
                    c.progress(Some(Duration::ZERO)).unwrap();
                }
                srv.progress(Some(Duration::from_millis(1))).unwrap();
            }
        };
    // A client sends 10 messages (no receive posted): 4 are queued (the
    // total bound), the rest wait in its ring; then it goes, and its ring
    // is taken whole.
    let (mut c, _) = node(&d, false, ProgressMode::Busy);
    let a = c.lookup(&uri).unwrap();
    for i in 0..10u64 {
        c.send_unexpected(&a, 1, &i.to_le_bytes(), OpId(i)).unwrap();
    }
    until(&mut srv, Some(&mut c), "4 messages queued", &|s| {
        stats(s).queued_arrivals == 4
    });
    drop(c);
    until(&mut srv, None, "the client left", &|s| stats(s).peers == 0);
    assert_eq!(stats(&srv).queued_arrivals, 10, "a departing ring is taken whole");
    // The next client is not accepted while they are held: the listener
    // pauses, the connection waits in the kernel's queue.
    // Its next look at the queue either pauses (counted in
    // `flow_blocked`: nothing else counts there with no peer connected)
    // or accepts (the hello, sent with the connection, makes a peer at
    // once): either way, the decision is made.
    let (mut c2, _) = node(&d, false, ProgressMode::Busy);
    let blocked = stats(&srv).flow_blocked;
    let a2 = c2.lookup(&uri).unwrap();
    c2.send_unexpected(&a2, 2, b"later", OpId(100)).unwrap();
    until(
        &mut srv,
        Some(&mut c2),
        "the listener looked at the new client",
        &|s| stats(s).flow_blocked > blocked || stats(s).peers > 0,
    );
    assert_eq!(
        stats(&srv).peers,
        0,
        "accepted while departed messages were over the bound"
    );
    // The application takes them; no progress call follows.
    for i in 0..10u64 {
        srv.post_recv_unexpected(sid, Vec::new(), OpId(1000 + i)).unwrap();
    }
    assert_eq!(stats(&srv).queued_arrivals, 0);
    assert_eq!(
        stats(&srv).peers,
        1,
        "the listener did not resume when the departed messages were taken"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// A connection to ourselves made and then left without progress for
/// longer than twice the handshake timeout: the first progress call
/// accepts it, acknowledges it and reads the acknowledgement, and must
/// not then declare it unacknowledged (its operations failing with
/// `PeerGone`, a backlog of sends lost).
#[test]
fn a_connection_to_ourselves_survives_a_long_gap_before_progress() {
    let d = dir("self-gap");
    let (mut ep, id) = node_with(&d, true, ProgressMode::Blocking, Duration::from_millis(50));
    let uri = ep.self_addr(id).unwrap().uri().to_owned();
    let me = ep.lookup(&uri).unwrap();
    ep.post_recv_expected(&me, 9, Vec::new(), OpId(1)).unwrap();
    ep.send_expected(&me, 9, b"to myself", OpId(2)).unwrap();
    // More than the ring holds: some wait in the backlog.
    for i in 0..70u64 {
        ep.send_unexpected(&me, 0, b"more", OpId(100 + i)).unwrap();
    }
    std::thread::sleep(Duration::from_millis(150));
    let mut done = std::collections::HashMap::new();
    let end = Instant::now() + Duration::from_secs(10);
    while done.len() < 72 {
        assert!(Instant::now() < end, "{} of 72 operations completed", done.len());
        ep.progress(Some(Duration::from_millis(20))).unwrap();
        while let Some(c) = ep.pop_completion() {
            if let Err(e) = &c.status {
                panic!("operation {:?} failed: {}", c.op, na_core::ErrorChain(e));
            }
            done.insert(c.op, c.buf);
        }
        // Take the unexpected messages, freeing ring space for the backlog.
        let mut buf = Vec::new();
        while ep.take_unexpected(id, &mut buf).unwrap().is_some() {}
    }
    assert_eq!(done[&OpId(1)].as_deref(), Some(&b"to myself"[..]));
    let _ = std::fs::remove_dir_all(&d);
}

/// A process holding `max_conns_per_process` connections (a client that
/// leaks plugin instances, say) has its next handshake refused: that
/// connection's send fails with a clear error instead of costing the
/// listener more descriptors, the connections it holds keep working, and
/// once it closes one a new one is accepted. (The clients here are in the
/// listener's own process: the bound counts by kernel-reported pid.)
#[test]
fn connections_from_one_process_are_bounded() {
    const MAX: usize = 3;
    let d = dir("perproc");
    let (mut srv, sid, uri) = busy_listener(SmConfig {
        max_conns_per_process: MAX,
        ..listening(&d)
    });
    let mut next_recv = 0u64;
    // Sends one message from a new client; drives both until the server
    // has it (`Ok`) or the client's send failed (`Err`).
    let mut try_client = |srv: &mut Endpoint, tag: u32| -> (Endpoint, Result<(), NaError>) {
        let (mut c, _) = node(&d, false, ProgressMode::Busy);
        let a = c.lookup(&uri).unwrap();
        next_recv += 1;
        srv.post_recv_unexpected(sid, Vec::new(), OpId(1000 + next_recv))
            .unwrap();
        // Posted on the server: fails with the connection (as hg-rpc's watch).
        c.post_recv_expected(&a, u32::MAX, Vec::new(), OpId(2)).unwrap();
        c.send_unexpected(&a, tag, b"hi", OpId(1)).unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            assert!(Instant::now() < end, "neither delivered nor refused");
            srv.progress(Some(Duration::ZERO)).unwrap();
            c.progress(Some(Duration::ZERO)).unwrap();
            if let Some(done) = srv.pop_completion() {
                assert_eq!(done.tag, tag);
                return (c, Ok(()));
            }
            while let Some(done) = c.pop_completion() {
                if let Err(e) = done.status {
                    return (c, Err(e));
                }
            }
        }
    };
    let mut held: Vec<Endpoint> = (0..MAX as u32)
        .map(|i| {
            let (c, r) = try_client(&mut srv, i);
            r.expect("within the bound");
            c
        })
        .collect();
    let (_refused, r) = try_client(&mut srv, 99);
    match r {
        Err(NaError::PeerGone { reason, .. }) => {
            assert!(reason.contains("refused the connection"), "{reason}");
            assert!(reason.contains("max_conns_per_process"), "{reason}");
        }
        other => panic!("the handshake past the bound was not refused: {other:?}"),
    }
    let st = srv.plugin(sid).unwrap().stats();
    assert_eq!((st.peers, st.handshakes_refused), (MAX as u64, 1), "{st:?}");
    // One of the three goes away: the server notices, and a new one fits.
    held.pop();
    let end = Instant::now() + Duration::from_secs(10);
    while srv.plugin(sid).unwrap().stats().peers >= MAX as u64 {
        assert!(Instant::now() < end, "the closed connection was never noticed");
        srv.progress(Some(Duration::from_millis(1))).unwrap();
    }
    let (_c, r) = try_client(&mut srv, 7);
    r.expect("a connection fits again");
    let _ = std::fs::remove_dir_all(&d);
}

/// Connected peers holding messages nobody takes (expected messages under
/// a tag never posted) reach the total bound: their rings stop being
/// drained, so what we hold stays bounded, but new clients still connect
/// and are served (only departed peers' messages, whose rings are taken
/// whole, pause the listener). Before, 32 such peers locked every new
/// client out for as long as they stayed.
#[test]
fn connected_peers_at_the_total_bound_do_not_lock_out_new_clients() {
    const PER_PEER: usize = 4;
    const TOTAL: usize = 8;
    let d = dir("lockout");
    let (mut srv, sid, uri) = busy_listener(SmConfig {
        max_queued_per_peer: PER_PEER,
        max_queued_total: TOTAL,
        ..listening(&d)
    });
    let queued = |srv: &Endpoint| srv.plugin(sid).unwrap().stats().queued_arrivals;
    let mut hoarders: Vec<Endpoint> = (0..3)
        .map(|_| {
            let (mut c, _) = node(&d, false, ProgressMode::Busy);
            let a = c.lookup(&uri).unwrap();
            for i in 0..6u64 {
                c.send_expected(&a, 77, b"hoard", OpId(i)).unwrap();
            }
            c
        })
        .collect();
    let end = Instant::now() + Duration::from_secs(10);
    while queued(&srv) < TOTAL as u64 || srv.plugin(sid).unwrap().stats().peers < 3 {
        assert!(
            Instant::now() < end,
            "the hoarders never got in: {:?}",
            srv.plugin(sid).unwrap().stats()
        );
        srv.progress(Some(Duration::from_millis(1))).unwrap();
        for h in hoarders.iter_mut() {
            h.progress(Some(Duration::ZERO)).unwrap();
        }
    }
    srv.post_recv_unexpected(sid, Vec::new(), OpId(500)).unwrap();
    let (mut c, _) = node(&d, false, ProgressMode::Busy);
    let a = c.lookup(&uri).unwrap();
    c.send_unexpected(&a, 5, b"new client", OpId(1)).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            Instant::now() < end,
            "a new client was locked out: {:?}",
            srv.plugin(sid).unwrap().stats()
        );
        srv.progress(Some(Duration::from_millis(1))).unwrap();
        c.progress(Some(Duration::ZERO)).unwrap();
        for h in hoarders.iter_mut() {
            h.progress(Some(Duration::ZERO)).unwrap();
        }
        if let Some(done) = srv.pop_completion() {
            assert_eq!(done.buf.as_deref(), Some(&b"new client"[..]));
            break;
        }
    }
    let st = srv.plugin(sid).unwrap().stats();
    assert_eq!(st.queued_arrivals, TOTAL as u64, "{st:?}");
    assert!(st.flow_blocked > 0, "{st:?}");
    let _ = std::fs::remove_dir_all(&d);
}

/// A connector that closes its end before its hello (it exited, or gave up
/// its lookup) has departed: no protocol error is counted, and the
/// listener goes on serving. A connector that sends bytes that are no
/// hello is a protocol error, which the same count shows it still catches.
#[test]
fn a_connector_closing_before_its_hello_is_no_protocol_error() {
    let d = dir("closed-early");
    let (mut srv, sid, uri) = busy_listener(listening(&d));
    let sock_path = d.join(format!("{}.sock", uri.trim_start_matches("sm://")));
    // Until the listener has accepted every connection (its queue is
    // empty): each one's hello, or its end, is read as it is accepted, so
    // whatever the connections were to be counted as is counted then.
    let listener = common::listener_copy(&sock_path);
    let settle = |srv: &mut Endpoint| {
        let t0 = Instant::now();
        loop {
            srv.progress(Some(Duration::ZERO)).unwrap();
            let (_, revents) = sys::poll_one(listener.as_raw_fd(), libc::POLLIN, 0);
            if revents & libc::POLLIN == 0 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the listener never accepted the connections"
            );
        }
    };
    for _ in 0..5 {
        drop(UnixStream::connect(&sock_path).unwrap());
    }
    settle(&mut srv);
    let stats = srv.plugin(sid).unwrap().stats();
    assert_eq!(
        stats.protocol_errors, 0,
        "early closes counted as violations: {stats:?}"
    );
    {
        use std::io::Write;
        let mut s = UnixStream::connect(&sock_path).unwrap();
        s.write_all(b"not a hello").unwrap();
        settle(&mut srv);
    }
    let stats = srv.plugin(sid).unwrap().stats();
    assert_eq!(
        stats.protocol_errors, 1,
        "a garbage hello went uncounted: {stats:?}"
    );
    // An honest client is still served.
    let (mut c, _) = node(&d, false, ProgressMode::Busy);
    let a = c.lookup(&uri).unwrap();
    c.send_unexpected(&a, 9, b"after", OpId(1)).unwrap();
    srv.post_recv_unexpected(sid, Vec::new(), OpId(100)).unwrap();
    let t0 = Instant::now();
    let got = loop {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the honest message never arrived"
        );
        srv.progress(Some(Duration::ZERO)).unwrap();
        c.progress(Some(Duration::ZERO)).unwrap();
        while c.pop_completion().is_some() {}
        if let Some(k) = srv.pop_completion() {
            break k;
        }
    };
    assert_eq!(got.tag, 9);
    let _ = std::fs::remove_dir_all(&d);
}
