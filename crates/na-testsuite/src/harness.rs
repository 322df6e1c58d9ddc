//! Peer processes (killed on drop) and an endpoint wrapper whose every wait
//! is bounded.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use na_core::{Addr, Completion, Endpoint, OpId, PluginId, PluginStats, ProgressMode};

use crate::{Transport, PEER_ENV};

/// A peer process (this test binary in peer mode); killed when dropped.
pub struct PeerProc {
    /// The process.
    pub child: Child,
    /// Its address, for a `server`.
    pub uri: String,
    lines: Receiver<String>,
}

impl PeerProc {
    /// Starts a peer with role and arguments `args` (`server`, `client URI
    /// N`, `flood URI N`); for `server`, waits for its address.
    pub fn spawn(t: &Transport, args: &[&str]) -> PeerProc {
        let exe = std::env::current_exe().expect("current_exe");
        let mut child = Command::new(exe)
            .env(PEER_ENV, args.join(" "))
            .envs(t.peer_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the peer process");
        let out = child.stdout.take().expect("piped stdout");
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
            let l = p.line(t.timeout * 2);
            p.uri = l.strip_prefix("ADDR ").expect("ADDR line").to_owned();
        }
        p
    }

    /// The next line of its stdout, waiting at most `t`.
    pub fn line(&mut self, t: Duration) -> String {
        self.lines
            .recv_timeout(t)
            .expect("the peer process printed nothing in time")
    }

    /// Waits (at most `t`) for exit and returns whether it succeeded; kills
    /// it and panics on timeout.
    pub fn wait(&mut self, t: Duration) -> bool {
        let end = Instant::now() + t;
        while Instant::now() < end {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return s.success();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        panic!("the peer process did not exit within {t:?}");
    }

    /// Whether it has exited.
    pub fn exited(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_some()
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An endpoint with one plugin of the transport, and bounded waits.
pub struct Node {
    /// The endpoint.
    pub ep: Endpoint,
    /// Its plugin.
    pub id: PluginId,
    /// Completions popped but not yet asked for.
    pub stash: HashMap<OpId, Completion>,
    /// Bound of each wait.
    pub timeout: Duration,
    next: u64,
    echo_posted: bool,
    /// Longest single progress wait of [`serve_echo`](Self::serve_echo)
    /// (default 20 ms).
    pub echo_tick: Duration,
    /// Progress waits of `serve_echo` that ended with nothing to do, once
    /// it has served a first echo (a slow peer start is not counted).
    pub echo_idle_ticks: u64,
}

impl Node {
    /// An endpoint in `mode` with one plugin (`listen` or client-only).
    pub fn new(t: &Transport, mode: ProgressMode, listen: bool) -> Node {
        let make = t.make.clone();
        Node::with_plugin(t, mode, move |id| make(id, listen))
    }

    /// A client endpoint in `mode` whose plugin bounds each peer's send
    /// backlog at `per_peer` bytes and all of them together at `total`.
    pub fn bounded(t: &Transport, mode: ProgressMode, per_peer: usize, total: usize) -> Node {
        let make = t.make_bounded.clone();
        Node::with_plugin(t, mode, move |id| make(id, per_peer, total))
    }

    fn with_plugin(
        t: &Transport,
        mode: ProgressMode,
        make: impl FnOnce(PluginId) -> na_core::Result<Box<dyn na_core::Plugin>>,
    ) -> Node {
        let mut ep = Endpoint::new(mode).expect("endpoint");
        let id = ep.add_plugin(make).expect("plugin");
        Node {
            ep,
            id,
            stash: HashMap::new(),
            timeout: t.timeout,
            next: 1,
            echo_posted: false,
            echo_tick: Duration::from_millis(20),
            echo_idle_ticks: 0,
        }
    }

    /// A fresh operation id.
    pub fn op(&mut self) -> OpId {
        self.next += 1;
        OpId(self.next)
    }

    /// Progresses once (at most `t`) and stashes completions; panics if an
    /// operation completes twice.
    pub fn pump(&mut self, t: Duration) {
        self.ep.progress(Some(t)).expect("progress");
        while let Some(c) = self.ep.pop_completion() {
            let op = c.op;
            assert!(self.stash.insert(op, c).is_none(), "{op:?} completed twice");
        }
    }

    /// The completion of `op`, waiting at most `t` (panics on timeout).
    pub fn wait_for(&mut self, op: OpId, t: Duration) -> Completion {
        let end = Instant::now() + t;
        loop {
            if let Some(c) = self.stash.remove(&op) {
                return c;
            }
            assert!(Instant::now() < end, "timed out after {t:?} waiting for {op:?}");
            self.pump(Duration::from_millis(50));
        }
    }

    /// The completion of `op`, waiting at most the transport's timeout.
    pub fn wait(&mut self, op: OpId) -> Completion {
        self.wait_for(op, self.timeout)
    }

    /// Sends `msg` unexpected with `tag` and returns the expected reply.
    pub fn request(&mut self, server: &Addr, tag: u32, msg: &[u8]) -> Vec<u8> {
        let (r, s) = (self.op(), self.op());
        self.ep
            .post_recv_expected(server, tag, Vec::new(), r)
            .expect("post reply receive");
        self.ep
            .send_unexpected(server, tag, msg, s)
            .expect("send request");
        self.wait(s).status.expect("request send");
        let c = self.wait(r);
        c.status.expect("reply");
        assert_eq!(c.tag, tag);
        c.buf.expect("reply buffer")
    }

    /// The plugin's counters.
    pub fn stats(&self) -> PluginStats {
        self.ep.plugin(self.id).expect("plugin").stats()
    }

    /// Serves echo (`e` and empty messages), as the peer server does, until
    /// `done` returns true or `t` passes. Returns the messages served and
    /// the source of the last one.
    pub fn serve_echo(&mut self, t: Duration, mut done: impl FnMut() -> bool) -> (u64, Option<Addr>) {
        let id = self.id;
        if !std::mem::replace(&mut self.echo_posted, true) {
            for i in 0..64 {
                self.ep
                    .post_recv_unexpected(id, Vec::new(), OpId(1 << 40 | i))
                    .expect("post");
            }
        }
        let end = Instant::now() + t;
        let (mut served, mut last) = (0, None);
        while !done() {
            assert!(Instant::now() < end, "echo server timed out");
            if self.ep.progress(Some(self.echo_tick)).expect("progress") == 0 && served > 0 {
                self.echo_idle_ticks += 1;
            }
            while let Some(c) = self.ep.pop_completion() {
                if c.op.0 >> 40 != 1 {
                    continue;
                }
                if let (Ok(()), Some(buf), Some(src)) = (&c.status, &c.buf, &c.source) {
                    served += 1;
                    let op = self.op();
                    // A reply to a peer that just died may fail: fine.
                    let _ = self.ep.send_expected(src, c.tag, buf, op);
                    last = Some(src.clone());
                }
                self.ep
                    .post_recv_unexpected(id, Vec::new(), c.op)
                    .expect("repost");
            }
        }
        (served, last)
    }
}
