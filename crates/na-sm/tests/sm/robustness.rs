//! Peer death, hostile peers, stale files, idle CPU.

use std::time::{Duration, Instant};

use na_core::ProgressMode;

use crate::common::{serve_echo, test_dir, Node, PeerProc};

const T: Duration = Duration::from_secs(10);

#[test]
fn hostile_scribbler_gets_errors_and_honest_client_is_served() {
    let dir = test_dir("hostile");
    let mut n = Node::new(&dir, ProgressMode::default(), true);
    let me = n.ep.self_addr(n.id).unwrap().uri().to_owned();
    let mut hostile = PeerProc::spawn(&dir, &["hostile", &me]);
    let mut honest = PeerProc::spawn(&dir, &["client", &me, "3000"]);
    let (mut h_done, mut c_done) = (false, false);
    serve_echo(&mut n, Duration::from_secs(60), || {
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

#[test]
fn stale_cleanup_removes_dead_owners_files_and_keeps_live_ones() {
    let dir = test_dir("stale");
    let mut dead = PeerProc::spawn(&dir, &["server"]);
    let dead_key = dead.uri.strip_prefix("sm://").unwrap().to_owned();
    dead.kill();
    let live = Node::new(&dir, ProgressMode::default(), true);
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
    // SAFETY (test): getrusage writes one rusage struct into `ru`.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY (test): valid pointer to a live rusage.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) }, 0);
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

#[test]
fn idle_progress_in_adaptive_and_blocking_mode_uses_no_cpu() {
    let dir = test_dir("idle");
    let server = PeerProc::spawn(&dir, &["server"]);
    for mode in [ProgressMode::default(), ProgressMode::Blocking] {
        let mut n = Node::new(&dir, mode, true);
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
#[test]
fn flooding_peer_is_bounded_and_nothing_is_lost() {
    use na_core::{Endpoint, OpId, Plugin, ProgressMode};
    use na_sm::{SmConfig, SmPlugin};
    const BOUND: usize = 32;
    const N: u32 = 2000;
    let dir = test_dir("flood");
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    let cfg = SmConfig {
        listen: true,
        max_queued_per_peer: BOUND,
        ..SmConfig::default()
    }
    .with_dir(&*dir);
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let me = ep.self_addr(id).unwrap();
    let mut flooder = PeerProc::spawn(&dir, &["flood", me.uri(), &N.to_string()]);
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

/// Same payload as the testpeer's `flood` role.
fn flood_payload(i: u32) -> Vec<u8> {
    (0..100u32).map(|j| (i.wrapping_mul(31) ^ j) as u8).collect()
}
