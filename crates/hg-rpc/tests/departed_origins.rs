//! A target lets the spilled outputs of an origin that dies before it
//! pulls them go when the transport reports the death, not at the
//! spilled-output TTL (60 s): the origin, a real process
//! (`hg-rpc-testpeer` as a stalled client: it calls `Fill` for 1 MiB and
//! never takes the response), is killed with SIGKILL while the target
//! holds its output. Another origin's output stays until that one dies
//! too, and a process that comes back under the dead one's name (at its
//! very address, where the kernel's pid can be set) is not taken for it.

use std::ffi::OsStr;
use std::path::Path;
use std::time::{Duration, Instant};

use hg_rpc::{AsyncEngine, RpcStats};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{dir, start_at_pid, Server};

/// The stalled call's output (what `hg-rpc-testpeer` asks for).
const LEN: u64 = 1 << 20;

/// Bytes of one exposed output: the encoded `Vec<u8>` of [`LEN`] bytes.
fn output_len() -> u64 {
    postcard::to_allocvec(&vec![0x5au8; LEN as usize]).unwrap().len() as u64
}

/// How long a release may take: far below the 60 s TTL, far above what
/// noticing a death takes on a loaded machine.
const DEADLINE: Duration = Duration::from_secs(10);

/// A target (an `AsyncEngine`, whose driver serves on its own) in `d`
/// that answers `Fill`, with the runtime it runs on. Its spilled-output
/// TTL stays the default, 60 s: only an origin's death can release an
/// output within [`DEADLINE`].
fn target(d: &Path) -> (AsyncEngine, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let srv = rt.block_on(async { common::async_engine(d, true) });
    srv.register::<Fill>(|(len, seed)| Ok(fill_output(len, seed)))
        .unwrap();
    (srv, rt)
}

/// A stalled client process of `server` in `d`, named `sm://<pid>-<name>`
/// if `name` is given: its call is made once this returns.
fn stalled_client(d: &Path, server: &str, name: Option<&str>) -> Server {
    let spec = name.map(|n| format!("sm://{n}"));
    let mut envs = vec![
        ("QS_SM_DIR", d.as_os_str()),
        ("HG_TESTPEER_STALLED_CALL", OsStr::new(server)),
    ];
    if let Some(spec) = &spec {
        envs.push(("HG_TESTPEER_SPEC", OsStr::new(spec)));
    }
    Server::with_envs(&envs)
}

/// Waits (at most [`DEADLINE`]) until the target's counters satisfy
/// `done`, and returns them.
fn wait_for(srv: &AsyncEngine, what: &str, done: impl Fn(&RpcStats) -> bool) -> RpcStats {
    let end = Instant::now() + DEADLINE;
    loop {
        let s = srv.stats();
        if done(&s) {
            return s;
        }
        assert!(Instant::now() < end, "{what}: not within {DEADLINE:?}: {s:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Kills `c` (SIGKILL) and reaps it.
fn kill(c: &mut Server) {
    c.child.kill().unwrap();
    c.child.wait().unwrap();
}

#[test]
fn outputs_of_an_origin_killed_before_it_pulled_them_are_released_at_once() {
    let d = dir("departed-origin");
    let (srv, _rt) = target(&d);
    let uri = srv.self_addr().to_string();
    let mut a = stalled_client(&d, &uri, None);
    let mut b = stalled_client(&d, &uri, None);
    let s = wait_for(&srv, "both outputs exposed", |s| s.exposed_outputs == 2);
    assert_eq!(
        (s.exposed_bytes, s.outputs_origin_gone),
        (2 * output_len(), 0),
        "{s:?}"
    );
    kill(&mut a);
    let s = wait_for(&srv, "a's output released", |s| s.outputs_origin_gone == 1);
    // b lives: its output waits for it.
    assert_eq!((s.exposed_outputs, s.exposed_bytes), (1, output_len()), "{s:?}");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(srv.stats().exposed_outputs, 1, "b's output let go while b lives");
    kill(&mut b);
    let s = wait_for(&srv, "b's output released", |s| s.outputs_origin_gone == 2);
    assert_eq!((s.exposed_outputs, s.exposed_bytes), (0, 0), "{s:?}");
    // The target serves on: a new origin's output is exposed, and watched.
    let mut c = stalled_client(&d, &uri, None);
    wait_for(&srv, "c's output exposed", |s| s.exposed_outputs == 1);
    kill(&mut c);
    let s = wait_for(&srv, "c's output released", |s| s.outputs_origin_gone == 3);
    assert_eq!((s.exposed_outputs, s.exposed_bytes), (0, 0), "{s:?}");
}

/// Origin A dies and its output goes; a new process comes back under A's
/// name (with A's pid where the kernel's last pid can be set: at A's very
/// address) and stalls a call too. Its output is its own: kept while it
/// lives (not ended with A's), and released when it dies in turn (its
/// death watched afresh, not taken as watched already).
#[test]
fn an_origin_back_under_a_dead_ones_name_is_watched_as_itself() {
    const NAME: &str = "stalled";
    let d = dir("departed-reborn");
    let (srv, _rt) = target(&d);
    let uri = srv.self_addr().to_string();
    let mut a = stalled_client(&d, &uri, Some(NAME));
    let pid_a = a.child.id();
    wait_for(&srv, "a's output exposed", |s| s.exposed_outputs == 1);
    kill(&mut a);
    wait_for(&srv, "a's output released", |s| {
        s.outputs_origin_gone == 1 && s.exposed_outputs == 0
    });
    let mut again = match start_at_pid(pid_a, || stalled_client(&d, &uri, Some(NAME))) {
        Ok(c) => {
            assert_eq!(c.uri, a.uri, "same pid and name, same address");
            c
        }
        Err(why) => {
            na_core::testing::report_not_run(&format!(
                "departed_origins: an origin back with the dead one's pid ({why}); \
                 one back under its name with a new pid is tested"
            ));
            stalled_client(&d, &uri, Some(NAME))
        }
    };
    let s = wait_for(&srv, "the new output exposed", |s| s.exposed_outputs == 1);
    assert_eq!(s.outputs_origin_gone, 1, "{s:?}");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(srv.stats().exposed_outputs, 1, "released while its origin lives");
    kill(&mut again);
    let s = wait_for(&srv, "the new output released", |s| s.outputs_origin_gone == 2);
    assert_eq!((s.exposed_outputs, s.exposed_bytes), (0, 0), "{s:?}");
}
