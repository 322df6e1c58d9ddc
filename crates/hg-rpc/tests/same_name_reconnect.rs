//! A server process dies (SIGKILL) and another process starts under the
//! same sm instance name: a client that talked to the first gets a clear
//! error for what it still sends there (never a hang, never the new
//! server's answer), and its next lookup and call reach the new server.
//!
//! An sm address is `sm://<pid>-<name>`, so the new server's address is
//! another one unless it got the dead one's pid: the tests run both, the
//! second by setting the kernel's last allocated pid
//! (`/proc/sys/kernel/ns_last_pid`, root only; reported as not run
//! elsewhere) so that the replacement takes the pid just freed. That is
//! the case where a client's table of peers, which knows the dead server
//! by that very address, could hand out the dead connection again.
//! Real server processes (`hg-rpc-testpeer`, whose `Marker` answer tells
//! them apart), for the blocking [`Engine`] and for the `AsyncEngine`.

use std::ffi::OsStr;
use std::path::Path;
use std::time::{Duration, Instant};

use hg_rpc::{Addr, AsyncEngine, Engine, RpcError};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{client, dir, start_at_pid, Server};

/// The instance name both servers take.
const NAME: &str = "reborn";
/// The timeout of each call: far above what any answer or failure takes.
const T: Duration = Duration::from_secs(5);

/// A test server named [`NAME`] in `d` whose `Marker` answers `marker`.
fn start(d: &Path, marker: &str) -> Server {
    Server::with_envs(&[
        ("QS_SM_DIR", d.as_os_str()),
        ("HG_TESTPEER_SPEC", OsStr::new(&format!("sm://{NAME}"))),
        ("HG_TESTPEER_MARKER", OsStr::new(marker)),
    ])
}

/// What the scenario needs of a client engine, blocking or async.
trait Client {
    fn lookup(&mut self, uri: &str) -> hg_rpc::Result<Addr>;
    fn marker(&mut self, at: &Addr) -> hg_rpc::Result<(String, u32)>;
}

impl Client for Engine {
    fn lookup(&mut self, uri: &str) -> hg_rpc::Result<Addr> {
        Engine::lookup(self, uri)
    }
    fn marker(&mut self, at: &Addr) -> hg_rpc::Result<(String, u32)> {
        self.call::<Marker>(at, &(), T)
    }
}

/// An `AsyncEngine` and the runtime it runs on (the test's thread blocks
/// on each of its futures); the engine is dropped first.
struct AsyncClient(AsyncEngine, tokio::runtime::Runtime);

impl Client for AsyncClient {
    fn lookup(&mut self, uri: &str) -> hg_rpc::Result<Addr> {
        self.1.block_on(self.0.lookup(uri))
    }
    fn marker(&mut self, at: &Addr) -> hg_rpc::Result<(String, u32)> {
        self.1.block_on(self.0.call::<Marker>(at, &(), T))
    }
}

fn async_client(d: &Path) -> AsyncClient {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let e = rt.block_on(async { common::async_engine(d, false) });
    AsyncClient(e, rt)
}

/// A call that must fail with a transport error (the peer is gone), and
/// soon: not a timeout, not an answer.
fn assert_fails_fast(what: &str, r: hg_rpc::Result<(String, u32)>, took: Duration) {
    assert!(matches!(r, Err(RpcError::Transport(_))), "{what}: {r:?}");
    assert!(took < T / 2, "{what} took {took:?}");
}

/// Server A at [`NAME`] answers `c`; A is killed; server B starts under
/// the same name (`same_address`: with A's pid, once A is reaped, so at
/// A's very address). Then `c`'s lookups of B's address and calls there reach
/// B after at most one failed call (a transport error), and a call at the
/// address `c` looked A up as fails with a transport error, before B is
/// called (`!same_address`) or after (`same_address`: B now owns that
/// name; the old address must still not reach it).
fn server_replaced(tag: &str, c: &mut impl Client, d: &Path, same_address: bool) {
    let mut a = start(d, "A");
    let pid_a = a.child.id();
    let old = c.lookup(&a.uri).unwrap();
    assert_eq!(c.marker(&old).unwrap(), ("A".to_owned(), pid_a));
    a.child.kill().unwrap();
    let b = if same_address {
        a.child.wait().unwrap();
        let b = match start_at_pid(pid_a, || start(d, "B")) {
            Ok(b) => b,
            Err(why) => {
                na_core::testing::report_not_run(&format!(
                    "same_name_reconnect {tag}: a server started again with the dead one's pid ({why}); \
                     the replacement under a new pid is tested"
                ));
                return;
            }
        };
        assert_eq!(b.uri, a.uri, "same pid and name, same address");
        b
    } else {
        // A, dead but not yet reaped, keeps its pid from B (whatever
        // another test does to the kernel's last pid meanwhile).
        let b = start(d, "B");
        a.child.wait().unwrap();
        assert_ne!(b.uri, a.uri);
        // What the client still sends to A fails, and says so.
        let t0 = Instant::now();
        let r = c.marker(&old);
        assert_fails_fast("a call to the dead server", r, t0.elapsed());
        b
    };
    let t0 = Instant::now();
    let mut failed = Vec::new();
    let answer = loop {
        let r = c.lookup(&b.uri).and_then(|at| c.marker(&at));
        match r {
            Ok(answer) => break answer,
            Err(e) => failed.push((e, t0.elapsed())),
        }
        assert!(
            failed.len() <= 1,
            "calls at B's address failed again and again: {failed:?}"
        );
    };
    assert_eq!(
        answer,
        ("B".to_owned(), b.child.id()),
        "failed before: {failed:?}"
    );
    for (e, at) in &failed {
        assert!(matches!(e, RpcError::Transport(_)), "{e:?}");
        assert!(*at < T / 2, "the failure took {at:?}: {e:?}");
    }
    if same_address {
        let t0 = Instant::now();
        let r = c.marker(&old);
        assert_fails_fast("a call at the dead server's address got before", r, t0.elapsed());
    }
    // And B goes on answering.
    let at = c.lookup(&b.uri).unwrap();
    assert_eq!(c.marker(&at).unwrap(), ("B".to_owned(), b.child.id()));
}

#[test]
fn a_blocking_client_reaches_the_server_started_again_under_the_same_name() {
    let d = dir("reborn-name");
    let mut c = client(&d);
    server_replaced("blocking, new pid", &mut c, &d, false);
}

#[test]
fn a_blocking_client_reaches_the_server_started_again_at_the_same_address() {
    let d = dir("reborn-addr");
    let mut c = client(&d);
    server_replaced("blocking, same pid", &mut c, &d, true);
}

#[test]
fn an_async_client_reaches_the_server_started_again_under_the_same_name() {
    let d = dir("reborn-async-name");
    let mut c = async_client(&d);
    server_replaced("async, new pid", &mut c, &d, false);
}

#[test]
fn an_async_client_reaches_the_server_started_again_at_the_same_address() {
    let d = dir("reborn-async-addr");
    let mut c = async_client(&d);
    server_replaced("async, same pid", &mut c, &d, true);
}
