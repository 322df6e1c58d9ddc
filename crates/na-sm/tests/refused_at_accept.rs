//! A listener that refuses a connection as it accepts it (here: its
//! connector already has `MAX_PENDING_PER_PROCESS` connections waiting
//! for their hello) says why, then closes the connection at once. When
//! that close comes before the connector has identified the listener's
//! process, or sent its hello, the lookup fails there: its error must
//! give the listener's reason, not take the listener for gone ("could not
//! be identified") or report a broken pipe.
//!
//! The listener is a real sm plugin in another process (this binary run
//! again), progressing without pause so that its refusals race the
//! lookups; half of them watch its exit by pid (`debug.pidfd_by_pid`, where
//! the identification reads its start time and so sees the close first),
//! half through `SO_PEERPIDFD` where the kernel has it (the close then
//! shows at the hello's send).

use std::io::{BufRead, BufReader, Read};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use na_core::{Plugin, PluginId};
use na_sm::{SmConfig, SmConfigHooks, SmPlugin, MAX_PENDING_PER_PROCESS};

mod common;
use common::{private_dir, KillOnDrop};

const TEST: &str = "a_refusal_at_accept_fails_the_lookup_with_its_reason";
/// Set (to the socket directory) in the listener's process.
const ROLE_ENV: &str = "QS_SM_TEST_REFUSER";
/// Lookups made: enough for some to lose the race on a 2-core machine.
const ATTEMPTS: usize = 300;
/// Batches of [`ATTEMPTS`] lookups made, at most, while none lost it.
const MAX_BATCHES: usize = 20;

/// The listener: prints its URI, then progresses until its stdin closes.
fn refuser(dir: &str) {
    let cfg = SmConfig {
        handshake_timeout: Duration::from_secs(120),
        ..SmConfig::listening().with_dir(dir).with_name("refuser")
    };
    let mut srv = SmPlugin::new(PluginId(1), cfg).unwrap();
    println!("URI {}", srv.self_addr().uri());
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        let _ = tx.send(());
    });
    while rx.try_recv().is_err() {
        srv.progress().unwrap();
    }
}

#[test]
fn a_refusal_at_accept_fails_the_lookup_with_its_reason() {
    if let Ok(dir) = std::env::var(ROLE_ENV) {
        return refuser(&dir);
    }
    let dir = private_dir("refused-at-accept");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, &dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let _kill = KillOnDrop::new(child.id() as libc::pid_t);
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    // (libtest may print "test <name> ... " before it on the same line.)
    while !line.contains("URI ") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the listener exited");
    }
    let uri = line[line.find("URI ").unwrap() + 4..].trim().to_owned();
    let path = dir.join(format!("{}.sock", uri.trim_start_matches("sm://")));
    // Connections that never send their hello: every later one of ours is
    // refused as it is accepted.
    let silent: Vec<UnixStream> = (0..MAX_PENDING_PER_PROCESS)
        .map(|_| UnixStream::connect(&path).unwrap())
        .collect();
    // One more, read to its end: the listener refuses it for the bound
    // only once it has accepted the silent ones (the accept queue is in
    // order), so every lookup below is refused as it is accepted.
    let mut probe = UnixStream::connect(&path).unwrap();
    probe.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut said = Vec::new();
    probe
        .read_to_end(&mut said)
        .expect("the listener neither refused nor closed the connection past the bound");
    let reason = na_sm::conn::refusal_reason(&said);
    assert!(
        reason.as_deref().is_some_and(|r| r.contains("already has")),
        "the connection past the bound was not refused for it: {reason:?} ({} bytes)",
        said.len()
    );
    drop(probe);
    let mut failed = Vec::new();
    // Batches of lookups until some lost the race: on a loaded machine
    // (other tests, builds) a batch may see none.
    let mut made = 0;
    while made < ATTEMPTS || (failed.is_empty() && made < ATTEMPTS * MAX_BATCHES) {
        let i = made;
        made += 1;
        let cfg = SmConfig {
            // Both ways of watching the listener's exit.
            debug: SmConfigHooks {
                pidfd_by_pid: i % 2 == 0,
                ..SmConfigHooks::default()
            },
            ..SmConfig::default().with_dir(&dir)
        };
        let mut c = SmPlugin::new(PluginId(2), cfg).unwrap();
        if let Err(e) = c.lookup(&uri) {
            failed.push(e.to_string());
        }
    }
    let wrong: Vec<_> = failed
        .iter()
        .filter(|e| !e.contains("refused the connection"))
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} failed lookups do not give the refusal, e.g. {:?}",
        wrong.len(),
        failed.len(),
        wrong.first()
    );
    assert!(
        !failed.is_empty(),
        "no lookup of {made} failed: the refusals never raced them (inconclusive)"
    );
    assert!(
        failed.iter().all(|e| e.contains("already has")),
        "not the listener's reason: {failed:?}"
    );
    eprintln!("{} of {made} lookups lost the race", failed.len());
    drop(silent);
    drop(child.stdin.take());
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
