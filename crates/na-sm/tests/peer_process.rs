//! `Plugin::peer_process`: the process behind a peer address, from the
//! kernel's pid (`SO_PEERCRED`) and the start time read as the connection
//! was made. Real processes: a listener in this process, two client
//! instances of this process and two of another (this binary, run again
//! in a peer role), each its own connection and address. The two of one
//! process have one answer, the two processes different ones.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use na_core::{Addr, Endpoint, OpId, PeerProcess};
use na_sm::sys::proc::start_time;

mod common;
use common::private_dir;

/// Set in the peer's environment: the listener's address.
const PEER_ENV: &str = "QS_SM_PEER_PROCESS_PEER";
/// Set in the peer's environment: the socket directory.
const PEER_DIR_ENV: &str = "QS_SM_PEER_PROCESS_DIR";

use common::busy_endpoint as endpoint;

/// Two client instances connect to `srv` and each sends its pid; then the
/// process waits (it is killed by the test; 30 s at most).
fn two_clients(srv: &str, dir: &std::path::Path, drive: impl Fn(&mut [Endpoint])) -> Vec<Endpoint> {
    let mut eps: Vec<Endpoint> = (0..2).map(|_| endpoint(dir, false).0).collect();
    let me = std::process::id().to_string();
    for (i, ep) in eps.iter_mut().enumerate() {
        let to = ep.lookup(srv).unwrap();
        ep.send_unexpected(&to, 1, me.as_bytes(), OpId(i as u64 + 1))
            .unwrap();
    }
    drive(&mut eps);
    eps
}

/// The peer role: with `$QS_SM_PEER_PROCESS_PEER` set, two connections.
#[test]
fn peer_role() {
    let (Some(srv), Some(dir)) = (std::env::var(PEER_ENV).ok(), std::env::var_os(PEER_DIR_ENV)) else {
        return;
    };
    let _eps = two_clients(&srv, std::path::Path::new(&dir), |eps| {
        let end = Instant::now() + Duration::from_secs(30);
        while Instant::now() < end {
            for ep in eps.iter_mut() {
                ep.progress(Some(Duration::from_millis(20))).unwrap();
                while ep.pop_completion().is_some() {}
            }
        }
    });
}

/// The peer process, killed when dropped.
struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn connections_of_one_process_have_one_identity_and_processes_differ() {
    let dir = private_dir("peer-process");
    let (mut srv, sid) = endpoint(&dir, true);
    let uri = srv.plugin(sid).unwrap().self_addr().uri().to_owned();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "peer_role", "--nocapture", "--test-threads=1"])
        .env(PEER_ENV, &uri)
        .env(PEER_DIR_ENV, &dir)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let child_pid = child.id();
    let peer = Peer(child);
    // Ours: sent from this thread; the listener drives the handshakes.
    let mut local = two_clients(&uri, &dir, |_| {});
    for op in 1..=4u64 {
        srv.post_recv_unexpected(sid, Vec::new(), OpId(100 + op)).unwrap();
    }
    let mut got: Vec<(u32, Addr)> = Vec::new();
    let end = Instant::now() + Duration::from_secs(20);
    while got.len() < 4 {
        assert!(Instant::now() < end, "only {} of 4 messages came", got.len());
        srv.progress(Some(Duration::from_millis(10))).unwrap();
        for ep in &mut local {
            ep.progress(Some(Duration::ZERO)).unwrap();
            while ep.pop_completion().is_some() {}
        }
        while let Some(c) = srv.pop_completion() {
            let (Some(buf), Some(src)) = (c.buf, c.source) else {
                panic!("a receive without data or source: {:?}", c.status)
            };
            let pid: u32 = std::str::from_utf8(&buf).unwrap().parse().unwrap();
            got.push((pid, src));
        }
    }
    let me = std::process::id();
    let plugin = srv.plugin(sid).unwrap();
    let identity = |pid: u32| -> Vec<Option<PeerProcess>> {
        got.iter()
            .filter(|(p, _)| *p == pid)
            .map(|(_, a)| plugin.peer_process(a))
            .collect()
    };
    let ours = identity(me);
    let theirs = identity(child_pid);
    assert_eq!((ours.len(), theirs.len()), (2, 2), "{got:?}");
    let distinct: std::collections::HashSet<_> = got.iter().map(|(_, a)| a.token()).collect();
    assert_eq!(distinct.len(), 4, "four connections, four addresses");
    let own = PeerProcess {
        pid: me,
        started: start_time(me).unwrap(),
    };
    assert_eq!(ours, vec![Some(own); 2], "two connections of this process");
    assert_eq!(theirs[0], theirs[1], "two connections of the peer process");
    let t = theirs[0].expect("the peer process is named");
    assert_eq!(t.pid, child_pid);
    assert_ne!(Some(t), ours[0], "two processes");
    // Our own address: this process too.
    let me_addr = plugin.self_addr();
    assert_eq!(plugin.peer_process(&me_addr), Some(own));
    drop(peer);
    let _ = std::fs::remove_dir_all(&dir);
}
