//! Helpers: peer processes (killed on drop), per-test socket directories,
//! and an endpoint wrapper whose every wait is bounded.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use na_core::{Addr, Completion, Endpoint, OpId, Plugin, PluginId, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

pub const TESTPEER: &str = env!("CARGO_BIN_EXE_qs-sm-testpeer");

/// A fresh 0700 socket directory for one test, removed when dropped.
pub struct TestDir(PathBuf);

impl std::ops::Deref for TestDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Creates the [`TestDir`] of test `tag`.
pub fn test_dir(tag: &str) -> TestDir {
    let d = std::env::temp_dir().join(format!("qs-sm-it-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
    TestDir(d)
}

/// A child process running `qs-sm-testpeer`; killed when dropped.
pub struct PeerProc {
    pub child: Child,
    pub uri: String,
    lines: Receiver<String>,
}

impl PeerProc {
    /// Starts `qs-sm-testpeer args...` with `QS_SM_DIR=dir`; for `server`,
    /// waits (at most 20 s) for its address.
    pub fn spawn(dir: &std::path::Path, args: &[&str]) -> PeerProc {
        let mut child = Command::new(TESTPEER)
            .args(args)
            .env("QS_SM_DIR", dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn qs-sm-testpeer");
        let out = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut p = PeerProc {
            child,
            uri: String::new(),
            lines,
        };
        if args[0] == "server" {
            let l = p.line(Duration::from_secs(20));
            p.uri = l.strip_prefix("ADDR ").expect("ADDR line").to_owned();
        }
        p
    }

    /// The next line of its stdout, waiting at most `t`.
    pub fn line(&mut self, t: Duration) -> String {
        self.lines
            .recv_timeout(t)
            .expect("peer process printed nothing in time")
    }

    /// Waits (at most `t`) for exit; returns success, killing it on timeout.
    pub fn wait(&mut self, t: Duration) -> bool {
        let end = Instant::now() + t;
        while Instant::now() < end {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.success();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        panic!("peer process did not exit within {t:?}");
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An endpoint with one sm plugin, and bounded waits on completions.
pub struct Node {
    pub ep: Endpoint,
    pub id: PluginId,
    pub stash: HashMap<OpId, Completion>,
    next: u64,
    echo_posted: bool,
}

impl Node {
    pub fn new(dir: &std::path::Path, mode: ProgressMode, listen: bool) -> Node {
        let mut ep = Endpoint::new(mode).unwrap();
        let cfg = SmConfig {
            listen,
            ..SmConfig::default()
        }
        .with_dir(dir);
        let id = ep
            .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
            .unwrap();
        Node {
            ep,
            id,
            stash: HashMap::new(),
            next: 1,
            echo_posted: false,
        }
    }

    pub fn op(&mut self) -> OpId {
        self.next += 1;
        OpId(self.next)
    }

    /// Progresses once (at most `t`) and stashes completions.
    pub fn pump(&mut self, t: Duration) {
        self.ep.progress(Some(t)).unwrap();
        while let Some(c) = self.ep.pop_completion() {
            assert!(
                self.stash.insert(c.op, c).is_none(),
                "an operation completed twice"
            );
        }
    }

    /// The completion of `op`, waiting at most `t` (panics on timeout).
    pub fn wait(&mut self, op: OpId, t: Duration) -> Completion {
        let end = Instant::now() + t;
        loop {
            if let Some(c) = self.stash.remove(&op) {
                return c;
            }
            assert!(Instant::now() < end, "timed out after {t:?} waiting for {op:?}");
            self.pump(Duration::from_millis(50));
        }
    }

    /// Sends `msg` unexpected with `tag` and returns the expected reply.
    pub fn request(&mut self, server: &Addr, tag: u32, msg: &[u8]) -> Vec<u8> {
        let r = self.op();
        let s = self.op();
        self.ep.post_recv_expected(server, tag, Vec::new(), r).unwrap();
        self.ep.send_unexpected(server, tag, msg, s).unwrap();
        self.wait(s, Duration::from_secs(10)).status.unwrap();
        let c = self.wait(r, Duration::from_secs(10));
        c.status.unwrap();
        assert_eq!(c.tag, tag);
        c.buf.unwrap()
    }

    pub fn stats(&self) -> na_core::PluginStats {
        self.ep.plugin(self.id).unwrap().stats()
    }
}

/// Serves echo (`e` and empty messages) as the testpeer does, until `done`
/// returns true or `t` passes; returns messages served.
pub fn serve_echo(node: &mut Node, t: Duration, mut done: impl FnMut() -> bool) -> u64 {
    let id = node.id;
    if !std::mem::replace(&mut node.echo_posted, true) {
        for i in 0..64 {
            node.ep
                .post_recv_unexpected(id, Vec::new(), OpId(1 << 40 | i))
                .unwrap();
        }
    }
    let end = Instant::now() + t;
    let mut served = 0;
    while !done() {
        assert!(Instant::now() < end, "echo server timed out");
        node.ep.progress(Some(Duration::from_millis(20))).unwrap();
        while let Some(c) = node.ep.pop_completion() {
            if c.op.0 >> 40 != 1 {
                continue;
            }
            if let (Ok(()), Some(buf), Some(src)) = (&c.status, &c.buf, &c.source) {
                served += 1;
                let op = node.op();
                // A reply to a peer that was just disconnected may fail: fine.
                let _ = node.ep.send_expected(src, c.tag, buf, op);
            }
            node.ep.post_recv_unexpected(id, Vec::new(), c.op).unwrap();
        }
    }
    served
}
