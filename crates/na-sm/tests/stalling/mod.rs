//! The scenes of `stalling_rma.rs`: its peers (forked: the stalling one
//! of `common`, one that leaves while its memory stalls, an honest one),
//! a listening endpoint with transfer threads and those peers connected
//! ([`scene`]), the bounded waits for an op and for each step a
//! scenario's thread reports ([`run_steps`]), and the turns of a busy or
//! polling endpoint counted until a departed peer's stuck get fails.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use na_core::{Access, Addr, Completion, Endpoint, MemHandle, OpId, OpKind, PluginId, RemoteMem};
use na_sm::{RmaPoolProbe, EVENT_POLL_MAX_GAP};

use crate::common::{self, private_dir, sys, KillOnDrop};

/// How long any step may take (generous: a loaded box; an honest transfer
/// of a page takes microseconds).
pub const BOUND: Duration = Duration::from_secs(10);

/// Bytes of each peer's exposed memory.
pub const LEN: usize = 4096;

/// What the honest peer's memory holds at byte `i`.
pub fn pattern(i: usize) -> u8 {
    (i * 7 + 3) as u8
}

/// The hostile peer of [`common::stalling_peer`] that, told to (any message),
/// closes its connection (says `L` on `status` once it has) and lives on,
/// its memory still stalling: a departed peer whose transfer never ends.
pub fn leaving_hostile_peer(dir: &std::path::Path, uri: &str, status: std::fs::File) -> i32 {
    use std::os::fd::AsFd;
    let Ok((_uffd, addr)) = sys::stalling_memory(LEN) else {
        sys::write(status.as_fd(), b"U");
        return 0;
    };
    let (mut ep, id) = common::busy_endpoint(dir, false);
    let Ok(to) = ep.lookup(uri) else { return 2 };
    let seg = na_core::RemoteSegment {
        addr: addr as u64,
        len: LEN as u64,
        key: 0,
    };
    let Ok(desc) = RemoteMem::new(vec![seg], Access::ReadOnly) else {
        return 3;
    };
    if ep
        .post_recv_unexpected(id, Vec::with_capacity(64), OpId(2))
        .is_err()
        || ep.send_unexpected(&to, 0, &desc.to_bytes(), OpId(1)).is_err()
    {
        return 4;
    }
    sys::write(status.as_fd(), b"S");
    loop {
        let _ = ep.progress(Some(Duration::from_millis(10)));
        if std::iter::from_fn(|| ep.pop_completion()).any(|c| c.op == OpId(2)) {
            break;
        }
    }
    drop(ep);
    sys::write(status.as_fd(), b"L");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The honest peer (a forked child): exposes [`LEN`] bytes of
/// [`pattern`], sends their descriptor to `uri`, says `S` on `status`,
/// then answers every unexpected message with an expected one of the same
/// tag and bytes, until it is killed.
pub fn honest_peer(dir: &std::path::Path, uri: &str, status: std::fs::File) -> i32 {
    use std::os::fd::AsFd;
    let (mut ep, id) = common::busy_endpoint(dir, false);
    let Ok(to) = ep.lookup(uri) else { return 2 };
    let mem = MemHandle::new(vec![(0..LEN).map(pattern).collect()], Access::ReadWrite);
    let Ok(plugin) = ep.plugin_mut(id) else { return 3 };
    if plugin.mem_register(&mem).is_err() {
        return 3;
    }
    let Ok(desc) = plugin.mem_describe(&mem) else {
        return 3;
    };
    if ep.send_unexpected(&to, 0, &desc.to_bytes(), OpId(1)).is_err() {
        return 4;
    }
    sys::write(status.as_fd(), b"S");
    let mut next = 100u64;
    let _ = ep.post_recv_unexpected(id, Vec::with_capacity(64), OpId(next));
    loop {
        let _ = ep.progress(Some(Duration::from_millis(10)));
        while let Some(c) = ep.pop_completion() {
            if c.kind == OpKind::RecvUnexpected && c.status.is_ok() {
                if let (Some(src), Some(buf)) = (&c.source, &c.buf) {
                    next += 1;
                    let _ = ep.send_expected(src, c.tag, buf, OpId(next));
                }
                next += 1;
                let _ = ep.post_recv_unexpected(id, Vec::with_capacity(64), OpId(next));
            }
        }
    }
}

/// A scenario's endpoint and its peers (see [`scene`]).
pub struct Scene {
    /// The listening endpoint.
    pub ep: Endpoint,
    /// Its sm plugin.
    pub id: PluginId,
    /// The hostile peer's address and stalling memory.
    pub hostile: (Addr, RemoteMem),
    /// The honest peer's address and memory ([`pattern`]).
    pub honest: (Addr, RemoteMem),
    /// The pipe the hostile peer reports on (what it says after `S`).
    pub hostile_status: Option<std::fs::File>,
    /// The probe of the plugin's transfer-thread pool (`None` in inline
    /// mode, which has no pool).
    pub probe: Option<RmaPoolProbe>,
}

/// A listening endpoint with `threads` transfer threads and the two peers,
/// forked, with their descriptors received: (endpoint, its plugin, the
/// hostile peer's address and memory, the honest peer's, the peers'
/// killers, the directory); `None` where the kernel refuses the hostile
/// peer its userfaultfd (reported as not run).
pub fn scene(tag: &str, threads: usize) -> Option<(Scene, Vec<KillOnDrop>, std::path::PathBuf)> {
    scene_with(tag, threads, common::stalling_peer)
}

/// [`scene`] with `hostile` as the hostile peer.
pub fn scene_with(
    tag: &str,
    threads: usize,
    hostile: PeerMain,
) -> Option<(Scene, Vec<KillOnDrop>, std::path::PathBuf)> {
    let dir = private_dir(tag);
    let (mut ep, id, probe) = if threads > 0 {
        let (ep, id, probe) = common::probed_rma_endpoint(&dir, threads);
        (ep, id, Some(probe))
    } else {
        // Inline mode: no pool to probe (the plugin refuses a probe).
        let (ep, id) = common::rma_endpoint(&dir, true, 0);
        (ep, id, None)
    };
    let uri = ep.self_addr(id).unwrap().uri().to_owned();
    let mut kills = Vec::new();
    let mut fork_peer = |f: PeerMain| {
        let (kill, said, status) = fork_peer_with_status(&dir, &uri, f);
        kills.push(kill);
        (said, status)
    };
    let (said, hostile_status) = fork_peer(hostile);
    if said == b'U' {
        na_core::testing::report_not_run(
            "na-sm stalling_rma: the kernel refuses a userfaultfd that handles the kernel's \
             own faults here (vm.unprivileged_userfaultfd 0, no CAP_SYS_PTRACE)",
        );
        let _ = std::fs::remove_dir_all(&dir);
        return None;
    }
    let hostile = receive_descriptor(&mut ep, id, OpId(1));
    assert_eq!(fork_peer(honest_peer).0, b'S', "the honest peer could not start");
    let honest = receive_descriptor(&mut ep, id, OpId(2));
    Some((
        Scene {
            ep,
            id,
            hostile,
            honest,
            hostile_status: Some(hostile_status),
            probe,
        },
        kills,
        dir,
    ))
}

/// What a forked peer runs: (socket directory, listener's address, the
/// pipe it reports on) to its exit code.
pub type PeerMain = fn(&std::path::Path, &str, std::fs::File) -> i32;

/// Forks a peer that runs `f`: its killer, and the byte it reported.
pub fn fork_peer(dir: &std::path::Path, uri: &str, f: PeerMain) -> (KillOnDrop, u8) {
    let (kill, said, _) = fork_peer_with_status(dir, uri, f);
    (kill, said)
}

/// [`fork_peer`], with the pipe the peer reports on (for what it says
/// later).
pub fn fork_peer_with_status(
    dir: &std::path::Path,
    uri: &str,
    f: PeerMain,
) -> (KillOnDrop, u8, std::fs::File) {
    let (mut status_r, status_w) = common::pipe();
    let child = sys::fork();
    assert!(child >= 0, "fork");
    if child == 0 {
        drop(status_r);
        sys::exit_now(f(dir, uri, status_w));
    }
    let kill = KillOnDrop::new(child);
    drop(status_w);
    let mut said = [0u8; 1];
    std::io::Read::read_exact(&mut status_r, &mut said).expect("the peer said nothing");
    (kill, said[0], status_r)
}

/// The next unexpected message, as a memory descriptor, and its sender.
pub fn receive_descriptor(ep: &mut Endpoint, id: PluginId, op: OpId) -> (Addr, RemoteMem) {
    ep.post_recv_unexpected(id, Vec::with_capacity(LEN), op).unwrap();
    let c = wait_op(ep, &mut HashMap::new(), op);
    c.status.expect("a descriptor");
    let src = c.source.expect("a received message has a source");
    (
        src,
        RemoteMem::from_bytes(&c.buf.expect("its buffer")).expect("a descriptor"),
    )
}

/// Drives `ep` until `op` completes (within [`BOUND`]; other completions
/// are kept in `stash`).
pub fn wait_op(ep: &mut Endpoint, stash: &mut HashMap<OpId, Completion>, op: OpId) -> Completion {
    let end = Instant::now() + BOUND;
    loop {
        if let Some(c) = stash.remove(&op) {
            return c;
        }
        assert!(Instant::now() < end, "{op:?} never completed");
        ep.progress(Some(Duration::from_millis(5))).unwrap();
        while let Some(c) = ep.pop_completion() {
            stash.insert(c.op, c);
        }
    }
}

/// A get of the honest peer's memory and a message round trip with it,
/// both checked.
pub fn serve_honest(s: &mut Scene, stash: &mut HashMap<OpId, Completion>, get: OpId, ping: u64) {
    let local = MemHandle::zeroed(LEN, Access::ReadWrite);
    let (to, remote) = s.honest.clone();
    s.ep.get(&local, 0, &remote, 0, LEN as u64, &to, get).unwrap();
    let c = wait_op(&mut s.ep, stash, get);
    c.status.expect("the honest peer's get");
    let mut got = vec![0u8; LEN];
    local.read_at(0, &mut got).unwrap();
    assert!(
        (0..LEN).all(|i| got[i] == pattern(i)),
        "the honest get moved wrong bytes"
    );
    let tag = 5 + ping as u32;
    s.ep.post_recv_expected(&to, tag, Vec::with_capacity(64), OpId(ping + 1))
        .unwrap();
    s.ep.send_unexpected(&to, tag, b"ping", OpId(ping)).unwrap();
    let c = wait_op(&mut s.ep, stash, OpId(ping + 1));
    c.status.expect("the honest peer's answer");
    assert_eq!(c.buf.as_deref(), Some(&b"ping"[..]));
}

/// The steps a scenario's thread reports, in order.
#[derive(Debug)]
pub enum Step {
    /// The get of the stalling memory returned (how long it took, shown
    /// when a later step fails).
    GetReturned(#[allow(dead_code)] Duration),
    /// The honest peer was served meanwhile; the plugin's counters then.
    HonestServed(na_core::PluginStats),
    /// The stuck get was canceled (or ended): its completion's status.
    Canceled(String),
    /// The endpoint was dropped (how long that took, as above).
    Dropped(#[allow(dead_code)] Duration),
    /// What the scenario counted (shown when a later step fails).
    Counted(#[allow(dead_code)] String),
}

/// Runs `body` on a thread of its own and waits for each of `steps`
/// steps at most [`BOUND`]; kills the peers (which lets a held thread go)
/// before it fails or returns.
pub fn run_steps(
    steps: usize,
    kills: Vec<KillOnDrop>,
    dir: std::path::PathBuf,
    body: impl FnOnce(mpsc::Sender<Step>) + Send + 'static,
) -> Vec<Step> {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || body(tx));
    let mut got = Vec::new();
    for _ in 0..steps {
        match rx.recv_timeout(BOUND) {
            Ok(s) => got.push(s),
            Err(e) => {
                drop(kills);
                let _ = worker.join();
                let _ = std::fs::remove_dir_all(&dir);
                match e {
                    mpsc::RecvTimeoutError::Timeout => {
                        panic!(
                            "a step did not come within {BOUND:?} after {got:?}: the caller's thread is held"
                        )
                    }
                    mpsc::RecvTimeoutError::Disconnected => {
                        panic!("the endpoint's thread ended (panicked) after {got:?}")
                    }
                }
            }
        }
    }
    drop(kills);
    let joined = worker.join();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(joined.is_ok(), "the endpoint's thread panicked");
    got
}

/// How many progress calls (each after a pause of a quarter of
/// `EVENT_POLL_MAX_GAP`) may pass after a peer closed its connection
/// before its transfers stuck in the threads fail as gone (five do, at
/// the latest). The busy loop polls the socket events itself only every
/// `EVENT_POLL_INTERVAL` (1024) spin checks, or `EVENT_POLL_MAX_GAP` looked
/// at every 64, and while the pool is active it makes none (one
/// `yield_now` per progress call instead): without the look at every
/// call, such a peer's hang-up waited for 1024 yields, seconds on a
/// loaded core.
pub const GONE_WITHIN_CALLS: usize = 8;

/// Tells the leaving hostile peer (`src`) to go, and waits until it says
/// it closed its connection.
pub fn leave(s: &mut Scene, stash: &mut HashMap<OpId, Completion>, src: &Addr) {
    s.ep.send_unexpected(src, 0, b"leave", OpId(40)).unwrap();
    wait_op(&mut s.ep, stash, OpId(40))
        .status
        .expect("the leave message");
    let mut status = s.hostile_status.take().expect("the hostile peer's pipe");
    let mut said = [0u8; 1];
    std::io::Read::read_exact(&mut status, &mut said).expect("the leaving peer never closed");
    assert_eq!(&said, b"L");
}

/// Makes `turn`s, each after a pause of a quarter of
/// `EVENT_POLL_MAX_GAP`, until `op` is in `stash`, at most
/// [`GONE_WITHIN_CALLS`] (and fails if it never is); returns the turns made.
pub fn turns_until(
    s: &mut Scene,
    stash: &mut HashMap<OpId, Completion>,
    op: OpId,
    turn: fn(&mut Scene, &mut HashMap<OpId, Completion>),
) -> usize {
    let mut calls = 0;
    while calls < GONE_WITHIN_CALLS && !stash.contains_key(&op) {
        std::thread::sleep(EVENT_POLL_MAX_GAP / 4);
        turn(s, stash);
        calls += 1;
    }
    assert!(
        stash.contains_key(&op),
        "the stuck get of a peer that closed its connection was still pending after {calls} progress calls"
    );
    calls
}

/// Waits (at most [`BOUND`]) until a transfer thread has taken up the
/// stalling get just made, and fails if none does.
pub fn wait_until_running(s: &mut Scene) {
    let end = Instant::now() + BOUND;
    while s.ep.plugin_mut(s.id).unwrap().stats().rma_jobs_running == 0 {
        assert!(Instant::now() < end, "the stalling get never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A zero-timeout progress call of the endpoint (no spin).
pub fn poll_turn(s: &mut Scene, stash: &mut HashMap<OpId, Completion>) {
    s.ep.progress(Some(Duration::ZERO)).unwrap();
    while let Some(c) = s.ep.pop_completion() {
        stash.insert(c.op, c);
    }
}

/// One turn of a busy endpoint's loop, made on the plugin itself (so that
/// turns can be counted): a spin of up to 64 checks, then a progress call.
pub fn busy_turn(s: &mut Scene, stash: &mut HashMap<OpId, Completion>) {
    let p = s.ep.plugin_mut(s.id).unwrap();
    p.spin_wait(64);
    p.progress().unwrap();
    while let Some(c) = p.pop_completion() {
        stash.insert(c.op, c);
    }
}
