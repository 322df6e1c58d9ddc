//! Helpers shared by the integration tests that run `hg-rpc-testpeer`.
// Each test binary uses a subset of them.
#![allow(dead_code)]

pub mod sys;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use hg_rpc::Engine;
use na_core::{Endpoint, Plugin, PluginId, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

/// A command that runs `hg-rpc-testpeer` tied to this test process: its
/// standard input is a pipe from us (kept open by the `Child`), and it
/// exits when the pipe closes, so a test killed mid-run (a timeout)
/// leaves no server behind.
pub fn testpeer() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hg-rpc-testpeer"));
    c.env("HG_TESTPEER_EXIT_WITH_STDIN", "1").stdin(Stdio::piped());
    c
}

/// Runs `hg-rpc-testpeer` with `var=value` and checks that it refuses to
/// start: it fails, announces no address, and its error names `var` and
/// says `why`. (Not `testpeer()`: its stdin watcher could exit before the
/// error is printed.)
pub fn assert_refused_at_start(dir: &std::path::Path, var: &str, value: &str, why: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_hg-rpc-testpeer"))
        .env("QS_SM_DIR", dir)
        .env(var, value)
        .output()
        .expect("run hg-rpc-testpeer");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started with {var}={value:?}");
    assert!(out.stdout.is_empty(), "announced an address with {var}={value:?}");
    assert!(
        stderr.contains(var) && stderr.contains(why),
        "{var}={value:?}: {stderr}"
    );
}

/// A process made by `start` with pid `pid` (freed and reaped): the
/// kernel's last allocated pid is set to the one before, and a process
/// that still got another pid (a fork elsewhere on the machine took it
/// first) is stopped and started again. Why not, where that setting cannot
/// be written (not root) or after 50 tries.
pub fn start_at_pid(pid: u32, mut start: impl FnMut() -> Server) -> Result<Server, String> {
    for _ in 0..50 {
        if let Err(e) = std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()) {
            return Err(format!("writing /proc/sys/kernel/ns_last_pid (needs root): {e}"));
        }
        let s = start();
        if s.child.id() == pid {
            return Ok(s);
        }
    }
    Err(format!("pid {pid} was taken by another process 50 times"))
}

/// The server process; killed when dropped.
pub struct Server {
    /// The process.
    pub child: Child,
    /// Its NA address.
    pub uri: String,
    /// Its standard error, line by line, when captured
    /// ([`Server::with_envs_logged`]).
    pub log: Option<ServerLog>,
}

/// A server's captured standard error.
pub struct ServerLog {
    /// Its lines so far.
    pub lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// The thread that reads them, until the server's end of the pipe
    /// closes.
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// Starts the server over sm with sockets in `dir` and waits for its address.
    pub fn start(dir: &std::path::Path) -> Server {
        Server::with_env("QS_SM_DIR", dir)
    }

    /// Starts the server with `key=value` in its environment (which picks
    /// its transport) and waits for its address.
    pub fn with_env(key: &str, value: impl AsRef<std::ffi::OsStr>) -> Server {
        Server::with_envs(&[(key, value.as_ref())])
    }

    /// [`Server::with_env`] with several variables.
    pub fn with_envs(vars: &[(&str, &std::ffi::OsStr)]) -> Server {
        let mut child = testpeer()
            .envs(vars.iter().copied())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn hg-rpc-testpeer");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read the server's address");
        let uri = line.trim().strip_prefix("ADDR ").expect("ADDR line").to_owned();
        Server {
            child,
            uri,
            log: None,
        }
    }

    /// [`Server::with_envs`], with the server's log on
    /// (`HG_TESTPEER_LOG=filter`, see the peer's `testpeer/log.rs`) and
    /// its standard error captured: [`Server::log_text`] gives it to a
    /// test's failure message.
    pub fn with_envs_logged(vars: &[(&str, &std::ffi::OsStr)], filter: &str) -> Server {
        let mut child = testpeer()
            .envs(vars.iter().copied())
            .env("HG_TESTPEER_LOG", filter)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn hg-rpc-testpeer");
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (err, kept) = (child.stderr.take().expect("stderr"), lines.clone());
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                kept.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        });
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read the server's address");
        let uri = match line.trim().strip_prefix("ADDR ") {
            Some(uri) => uri.to_owned(),
            None => panic!(
                "no ADDR line: {line:?}; server log:\n{}",
                lines.lock().unwrap().join("\n")
            ),
        };
        Server {
            child,
            uri,
            log: Some(ServerLog {
                lines,
                reader: Some(reader),
            }),
        }
    }

    /// The last `n` lines of the server's captured standard error (none
    /// unless made by [`Server::with_envs_logged`]), for a failure message.
    pub fn log_text(&self, n: usize) -> String {
        let Some(log) = &self.log else {
            return "(server log not captured)".into();
        };
        let lines = log.lines.lock().unwrap_or_else(|p| p.into_inner());
        let skip = lines.len().saturating_sub(n);
        format!(
            "server log ({} lines, last {}):\n{}",
            lines.len(),
            lines.len() - skip,
            lines[skip..].join("\n")
        )
    }

    /// Stops the server, waits (at most 5 s) until its whole standard
    /// error has been read, and gives [`Server::log_text`]: for a failing
    /// test, whose server may have logged why just before it failed.
    pub fn stop_and_log(&mut self, n: usize) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut cut = "";
        if let Some(reader) = self.log.as_mut().and_then(|l| l.reader.take()) {
            let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while !reader.is_finished() && std::time::Instant::now() < end {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            if reader.is_finished() {
                let _ = reader.join();
            } else {
                cut = "\n(still reading it after 5 s: later lines may be missing)";
            }
        }
        format!("{}{cut}", self.log_text(n))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A server process over sm and its socket directory (removed after the
/// server stops: the fields drop in this order).
pub struct ServerInDir {
    /// The server.
    pub server: Server,
    /// Its socket directory.
    pub dir: TestDir,
}

/// A server process in a fresh socket directory (`async-{tag}`) and a
/// client [`hg_rpc::AsyncEngine`] there, with progress `mode` and a driver
/// that spins for `spin` after work (`AsyncEngine::spawn_with_spin`). Call
/// it inside a tokio runtime.
pub fn async_setup(
    tag: &str,
    mode: ProgressMode,
    spin: std::time::Duration,
) -> (ServerInDir, hg_rpc::AsyncEngine) {
    let dir = dir(&format!("async-{tag}"));
    let server = Server::start(&dir);
    let mut ep = Endpoint::new(mode).expect("endpoint");
    let cfg = SmConfig::default().with_dir(&*dir);
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .expect("sm plugin");
    let engine =
        hg_rpc::AsyncEngine::spawn_with_spin(Engine::new(ep, id).expect("engine"), spin).expect("spawn");
    (ServerInDir { server, dir }, engine)
}

/// A test's private (0700) socket directory, removed with everything in
/// it when dropped (declare it before the servers that use it, so that
/// they are stopped first).
pub struct TestDir(std::path::PathBuf);

impl std::ops::Deref for TestDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for TestDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh [`TestDir`] named after the process and `tag` (unique per test).
pub fn dir(tag: &str) -> TestDir {
    use std::os::unix::fs::PermissionsExt;
    let d = std::env::temp_dir().join(format!("hg-rpc-it-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
    TestDir(d)
}

/// An endpoint with one sm plugin in `dir` (others can look it up if it
/// `listen`s), for tests that drive NA directly or build an engine on it.
pub fn endpoint(dir: &std::path::Path, listen: bool) -> (Endpoint, PluginId) {
    let mut ep = Endpoint::new(ProgressMode::default()).unwrap();
    let cfg = SmConfig {
        listen,
        ..SmConfig::default()
    }
    .with_dir(dir);
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    (ep, id)
}

/// An engine over a new sm plugin in `dir` (see [`endpoint`]), driven by
/// tokio (call inside a runtime).
pub fn async_engine(dir: &std::path::Path, listen: bool) -> hg_rpc::AsyncEngine {
    let (ep, id) = endpoint(dir, listen);
    hg_rpc::AsyncEngine::spawn(Engine::new(ep, id).unwrap()).unwrap()
}

/// An engine over a new sm plugin in `dir` whose send backlog holds
/// 4 KiB per peer (others can look it up if it `listen`s).
pub fn small_backlog_engine(dir: &std::path::Path, listen: bool) -> Engine {
    backlog_engine(dir, listen, 4096)
}

/// An engine over a new sm plugin in `dir` whose send backlog holds
/// `bytes` per peer (others can look it up if it `listen`s).
pub fn backlog_engine(dir: &std::path::Path, listen: bool, bytes: usize) -> Engine {
    let mut ep = Endpoint::new(ProgressMode::default()).unwrap();
    let cfg = SmConfig {
        listen,
        max_backlog_bytes: bytes,
        ..SmConfig::default()
    }
    .with_dir(dir);
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    Engine::new(ep, id).unwrap()
}

/// A client engine over a new (not listening) sm plugin in `dir`.
pub fn client(dir: &std::path::Path) -> Engine {
    let (ep, id) = endpoint(dir, false);
    Engine::new(ep, id).unwrap()
}

/// Operations the engine's transport has posted after a progress call:
/// its receive buffers (`Engine::posted_receives`: every one a response or
/// request used is posted again; none in pull mode) plus one watch per
/// peer it has called.
pub fn posted_ops(c: &mut Engine) -> u64 {
    c.progress_now().unwrap();
    let ep = c.endpoint();
    let id = ep.plugin_ids().next().unwrap();
    ep.plugin(id).unwrap().stats().in_flight
}

/// Drives `c` until call `id` of `R` has its result (at most 60 s: generous,
/// for a loaded machine).
pub fn wait<R: hg_rpc::Rpc>(c: &mut Engine, id: hg_rpc::CallId) -> hg_rpc::Result<R::Output> {
    let limit = std::time::Duration::from_secs(60);
    let end = std::time::Instant::now() + limit;
    loop {
        assert!(std::time::Instant::now() < end, "no result within {limit:?}");
        if let Some(r) = c.take_response::<R>(id) {
            return r;
        }
        c.progress(Some(std::time::Duration::from_millis(20))).unwrap();
        c.trigger().unwrap();
    }
}

/// Calls `R` from `c` on `srv`, two engines of this process, driving
/// both (at most 60 s), and returns the result.
pub fn call_both<R: hg_rpc::Rpc>(
    c: &mut Engine,
    srv: &mut Engine,
    input: &R::Input,
) -> hg_rpc::Result<R::Output> {
    let limit = std::time::Duration::from_secs(60);
    let s = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    let id = c.forward::<R>(&s, input).unwrap();
    let end = std::time::Instant::now() + limit;
    loop {
        assert!(std::time::Instant::now() < end, "no result within {limit:?}");
        if let Some(r) = c.take_response::<R>(id) {
            return r;
        }
        for e in [&mut *c, &mut *srv] {
            e.progress(Some(std::time::Duration::from_millis(1))).unwrap();
            e.trigger().unwrap();
        }
    }
}

/// An RPC message as it goes on the wire: a header with `flags`, status
/// ok, the id of RPC `rpc` and `cookie`, then `payload` (its length and,
/// with `FLAG_CHECKSUM`, its checksum filled in by the encoder).
pub fn wire_message(flags: u8, rpc: &str, cookie: u64, payload: &[u8]) -> Vec<u8> {
    let mut msg = Vec::new();
    hg_rpc::header::Header {
        flags,
        status: hg_rpc::header::Status::Ok,
        rpc_id: hg_rpc::rpc_id(rpc),
        cookie,
        payload_len: 0,
        checksum: 0,
    }
    .encode_with(payload, &mut msg);
    msg
}

/// Polls `fut` once: its output if it was ready at once, else `None` (it
/// is left started, for the caller to drop or poll again).
pub async fn poll_once<F: std::future::Future + Unpin>(fut: &mut F) -> Option<F::Output> {
    tokio::select! {
        biased;
        r = fut => Some(r),
        () = std::future::ready(()) => None,
    }
}

/// The seal the tests' hand-made spilled payloads carry (protocol
/// version 5: 8 bytes exposed after the data, and named in the payload).
pub const TEST_SEAL: u64 = 0x5ea1_0f5e_a15e_a1ed;

/// `data` followed by [`TEST_SEAL`], as a read-only handle to expose for
/// a hand-made spilled payload.
pub fn sealed(data: Vec<u8>) -> na_core::MemHandle {
    na_core::MemHandle::new(
        vec![data, TEST_SEAL.to_le_bytes().to_vec()],
        na_core::Access::ReadOnly,
    )
}

/// A hand-made spilled payload: the data's length, the descriptor of its
/// handle (data then seal), [`TEST_SEAL`], and the data's CRC-32C if the
/// message carries a checksum.
pub fn spilled_payload(len: u64, desc: &[u8], crc: Option<u32>) -> Vec<u8> {
    let mut payload = len.to_le_bytes().to_vec();
    payload.extend_from_slice(desc);
    payload.extend_from_slice(&TEST_SEAL.to_le_bytes());
    if let Some(crc) = crc {
        payload.extend_from_slice(&crc.to_le_bytes());
    }
    payload
}

/// Sends `msg` from `ep` to `to` (unexpected, or expected with `tag`) and
/// waits for the send to complete.
pub fn send_raw(
    ep: &mut na_core::Endpoint,
    to: &na_core::Addr,
    expected: Option<u32>,
    msg: &[u8],
    op: na_core::OpId,
) {
    match expected {
        Some(tag) => ep.send_expected(to, tag, msg, op).unwrap(),
        None => ep.send_unexpected(to, 0, msg, op).unwrap(),
    }
    let end = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        assert!(std::time::Instant::now() < end, "send did not complete");
        ep.progress(Some(std::time::Duration::from_millis(10))).unwrap();
        if let Some(c) = std::iter::from_fn(|| ep.pop_completion()).find(|c| c.op == op) {
            c.status.unwrap();
            return;
        }
    }
}

/// Posts one unexpected receive on `x` and drives `c` and `x` until a
/// request arrives in it: returns the origin and the request's cookie.
pub fn take_request(
    x: &mut na_core::Endpoint,
    xid: na_core::PluginId,
    c: &mut Engine,
    op: u64,
) -> (na_core::Addr, u64) {
    x.post_recv_unexpected(xid, Vec::new(), na_core::OpId(op))
        .unwrap();
    let end = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        assert!(std::time::Instant::now() < end, "no request");
        c.progress_now().unwrap();
        x.progress(Some(std::time::Duration::from_millis(5))).unwrap();
        if let Some(done) = std::iter::from_fn(|| x.pop_completion()).find(|k| k.op == na_core::OpId(op)) {
            let (h, _) = hg_rpc::header::Header::decode(done.buf.as_ref().unwrap()).unwrap();
            return (done.source.unwrap(), h.cookie);
        }
    }
}

/// A raw endpoint (listening) that plays a target, a client engine (that
/// listens too if `client_listens`, so that a third party can reach it),
/// and the target's address as the client knows it.
pub fn raw_target_and_client(
    dir: &std::path::Path,
    client_listens: bool,
) -> (na_core::Endpoint, PluginId, Engine, na_core::Addr) {
    let (x, xid) = endpoint(dir, true);
    let x_uri = x.plugin(xid).unwrap().self_addr().uri().to_owned();
    let (ep, cid) = endpoint(dir, client_listens);
    let mut c = Engine::new(ep, cid).unwrap();
    let s = c.endpoint().lookup(&x_uri).unwrap();
    (x, xid, c, s)
}

/// A silent target in a socket directory: a listening sm endpoint that
/// accepts connections, reads nothing and stays alive, progressed by its
/// own thread until dropped (a failure of that thread then fails the test).
pub struct SilentTarget {
    /// Its NA address.
    pub uri: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SilentTarget {
    /// Starts one in `dir`.
    pub fn start(dir: &std::path::Path) -> SilentTarget {
        let (mut x, xid) = endpoint(dir, true);
        let uri = x.plugin(xid).unwrap().self_addr().uri().to_owned();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop_x = stop.clone();
        let thread = std::thread::spawn(move || {
            while !stop_x.load(std::sync::atomic::Ordering::Relaxed) {
                x.progress(Some(std::time::Duration::from_millis(10))).unwrap();
            }
        });
        SilentTarget {
            uri,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for SilentTarget {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() && !std::thread::panicking() {
                panic!("the silent target's thread failed (its panic is printed above)");
            }
        }
    }
}

/// `len` bytes of a pattern that repeats every 251 (from `seed` on).
pub fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| ((i + seed) % 251) as u8).collect()
}

/// What a local `handle` holds.
pub fn contents(handle: &hg_rpc::Bulk) -> Vec<u8> {
    handle.local().expect("a local handle").to_vec()
}
