//! A lookup of a name a peer chose (the owner a bulk descriptor names,
//! say) connects to that name's socket in the socket directory, where any
//! process of our uid may put a file (as it may an owner file: see
//! `cleanup`). A symbolic link planted under a socket's name, pointing
//! into a FUSE file system whose daemon never answers, must not hold the
//! lookup: `connect` would follow it and wait (killable only) on the
//! daemon's answer to its lookup of the target. `try_lookup`, which never
//! waits, would wait for as long as the daemon lived, and `lookup` past
//! its bound. A forked child mounts such a file system in a mount
//! namespace of its own ([`fork_fuse_peer`]; reached through its
//! `/proc/<pid>/root`) and plants the link under its own name.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use na_core::{Plugin, PluginId};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::fuse_peer::fork_fuse_peer;
use common::private_dir;

/// How long a lookup may take (generous: a loaded box; one held by the
/// daemon never comes back at all).
const BOUND: Duration = Duration::from_secs(10);

/// The hostile peer's part (in the forked FUSE peer, once its file
/// system is mounted at `mnt`): plants `<dir>/<pid>-trap.sock` as a link
/// to a name inside it.
fn plant(dir: &std::path::Path, mnt: &std::path::Path) -> Result<(), i32> {
    let me = std::process::id();
    let target = format!("/proc/{me}/root{}/sock", mnt.display());
    if std::os::unix::fs::symlink(target, dir.join(format!("{me}-trap.sock"))).is_err() {
        return Err(2);
    }
    Ok(())
}

#[test]
fn a_link_planted_under_a_sockets_name_does_not_hold_a_lookup() {
    let dir = private_dir("planted-socket");
    let peer = fork_fuse_peer("planted", "planted_socket", |mnt, _| plant(&dir, mnt));
    let Some(peer) = peer else {
        let _ = std::fs::remove_dir_all(&dir);
        return;
    };
    let uri = format!("sm://{}-trap", peer.pid);
    let (done, answer) = mpsc::channel();
    let looker = {
        let dir = dir.clone();
        std::thread::spawn(move || {
            let mut p = SmPlugin::new(PluginId(1), SmConfig::default().with_dir(&dir)).unwrap();
            let tried = p.try_lookup(&uri, Instant::now()).map(|_| ());
            let _ = done.send(("try_lookup", tried));
            let looked = p.lookup(&uri).map(|_| ());
            let _ = done.send(("lookup", looked));
        })
    };
    let answers: Vec<_> = (0..2).map_while(|_| answer.recv_timeout(BOUND).ok()).collect();
    // Ends the daemon, which lets a held lookup go, so the test ends.
    drop(peer);
    let _ = looker.join();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        answers.len(),
        2,
        "a lookup waited {BOUND:?} on the daemon of a FUSE mount a link planted under \
         the socket's name points into (answers before it: {answers:?})"
    );
    for (what, r) in answers {
        let e = r.expect_err("a link is no listener");
        assert!(
            na_core::ErrorChain(&e).to_string().contains("not a socket"),
            "{what}: {e:?}"
        );
    }
}
