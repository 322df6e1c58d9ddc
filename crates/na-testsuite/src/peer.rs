//! The peer program, run by a suite binary started with
//! [`PEER_ENV`](crate::PEER_ENV) set. Roles:
//!
//! * `server`: listens, prints `ADDR <uri>`, and answers unexpected
//!   messages by their first byte until told to quit (or idle for 60 s):
//!   - empty: an empty expected reply, same tag;
//!   - `e`: the whole message back as an expected reply, same tag;
//!   - `u`: the same, as an unexpected message;
//!   - `o` + tags (u32 LE each): one expected reply per tag, in that order,
//!     carrying the tag;
//!   - `z` + milliseconds (u32): stall without progress (so that the
//!     client's sends pile up in its backlog), no reply;
//!   - `m` + segment lengths (u32 each): expose (register and describe) a
//!     read-write handle of those segments filled with
//!     [`pattern`]; reply with its descriptor;
//!   - `c` + offset (u64) + len (u64) + seed (u8): reply `[1]` if the
//!     exposed handle holds [`pattern2`]`(seed, i)` over
//!     the range, else `[0]`;
//!   - `x` + dir (0 get, 1 put) + local offset + remote offset + len (u64
//!     each) + descriptor: RMA between the exposed handle and the client's
//!     memory; reply `[1]` on success, `[0]` on error;
//!   - `b`: like `e`, the reply built in a plugin-provided message buffer
//!     and sent with `send_expected_buf`;
//!   - `p` + tag (u32): post an expected receive for that tag from the
//!     sender, reply `p`; what arrives in it goes back unexpected, same tag;
//!   - `q`: reply, print `SERVED <n>`, exit.
//! * `client URI N`: N echo round trips with up to 50 in flight; prints
//!   `CLIENT OK N` and exits 0 if every echo came back intact.
//! * `flood URI N`: N unexpected messages (tag = index, payload
//!   [`flood_payload`]) as fast as the target takes
//!   them, without waiting for any answer; prints `FLOOD DONE N` once every
//!   send completed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use na_core::{
    Access, Addr, Completion, Endpoint, MemHandle, OpId, OpKind, PluginId, ProgressMode, RemoteMem,
};

use crate::{flood_payload, pattern, pattern2, Transport};

/// Runs role `args[0]` with its arguments.
pub fn main(t: &Transport, args: &[&str]) {
    let arg = |i: usize| -> &str {
        args.get(i)
            .copied()
            .unwrap_or_else(|| panic!("peer role {args:?}: argument {i} missing"))
    };
    match args.first().copied() {
        Some("server") => server(t),
        Some("client") => {
            // Optional: echoes in flight (default 50), longest progress
            // wait in ms (default 100).
            let window = args.get(3).map_or(50, |w| w.parse().expect("client window"));
            let tick = args.get(4).map_or(100, |w| w.parse().expect("client tick"));
            client(t, arg(1), arg(2).parse().expect("client count"), window, tick)
        }
        Some("flood") => flood(t, arg(1), arg(2).parse().expect("flood count")),
        other => panic!("unknown peer role {other:?}"),
    }
}

/// Progress mode of peer processes (default: adaptive, 50 µs spin).
pub const PEER_MODE_ENV: &str = "QS_TEST_PEER_MODE";

fn endpoint(t: &Transport, listen: bool) -> (Endpoint, PluginId) {
    let default = ProgressMode::Adaptive {
        spin: Duration::from_micros(50),
    };
    let mode = ProgressMode::from_env(PEER_MODE_ENV, default).expect(PEER_MODE_ENV);
    let mut ep = Endpoint::new(mode).expect("endpoint");
    let make = t.make.clone();
    let id = ep.add_plugin(|id| make(id, listen)).expect("plugin");
    (ep, id)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn u32s(b: &[u8]) -> impl Iterator<Item = u32> + '_ {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

/// State of the server role.
struct Server {
    ep: Endpoint,
    id: PluginId,
    op: u64,
    exposed: Option<MemHandle>,
    /// Completions of the server's own RMA, waited for by `x`.
    stash: HashMap<OpId, Completion>,
}

impl Server {
    fn next_op(&mut self) -> OpId {
        self.op += 1;
        OpId(self.op)
    }

    /// The reply to command `msg` from `src`, if it has one.
    fn command(&mut self, msg: &[u8], src: &Addr, tag: u32) -> Option<Vec<u8>> {
        match msg.first() {
            None => Some(Vec::new()),
            Some(b'e') => Some(msg.to_vec()),
            Some(b'z') => {
                let ms = msg
                    .get(1..5)
                    .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                std::thread::sleep(Duration::from_millis(u64::from(ms)));
                None
            }
            Some(b'u') => {
                let op = self.next_op();
                self.ep
                    .send_unexpected(src, tag, msg, op)
                    .expect("send unexpected");
                None
            }
            Some(b'o') => {
                for t in u32s(&msg[1..]) {
                    let op = self.next_op();
                    self.ep.send_expected(src, t, &t.to_le_bytes(), op).expect("send");
                }
                None
            }
            Some(b'm') => {
                let mut next = 0u64;
                let bufs = u32s(&msg[1..])
                    .map(|n| {
                        let v = (next..next + u64::from(n)).map(pattern).collect();
                        next += u64::from(n);
                        v
                    })
                    .collect();
                let h = MemHandle::new(bufs, Access::ReadWrite);
                let plugin = self.ep.plugin_mut(self.id).expect("plugin");
                plugin.mem_register(&h).expect("register");
                let d = plugin.mem_describe(&h).expect("describe");
                self.exposed = Some(h);
                Some(d.to_bytes())
            }
            Some(b'c') => {
                let (off, len, seed) = (u64_at(msg, 1), u64_at(msg, 9), msg[17]);
                let h = self.exposed.as_ref().expect("m before c");
                let mut v = vec![0; len as usize];
                let ok = h.read_at(off, &mut v).is_ok()
                    && v.iter().enumerate().all(|(i, b)| *b == pattern2(seed, i as u64));
                Some(vec![u8::from(ok)])
            }
            Some(b'x') => Some(vec![u8::from(self.rma(msg, src))]),
            Some(b'b') => {
                let mut buf = self.ep.alloc_msg_buf(src, msg.len()).expect("message buffer");
                buf.extend_from_slice(msg).expect("fits the buffer");
                let op = self.next_op();
                self.ep
                    .send_expected_buf(src, tag, buf, op)
                    .expect("send from buffer");
                None
            }
            Some(b'p') => {
                let want = u32s(&msg[1..]).next().expect("p + tag");
                let op = self.next_op();
                self.ep
                    .post_recv_expected(src, want, Vec::new(), op)
                    .expect("post expected");
                Some(b"p".to_vec())
            }
            Some(_) => None,
        }
    }

    /// Command `x`: an RMA between the exposed handle and the client's.
    fn rma(&mut self, msg: &[u8], src: &Addr) -> bool {
        let h = self.exposed.clone().expect("m before x");
        let (lo, ro, len) = (u64_at(msg, 2), u64_at(msg, 10), u64_at(msg, 18));
        let remote = RemoteMem::from_bytes(&msg[26..]).expect("descriptor");
        let op = self.next_op();
        let posted = if msg[1] == 0 {
            self.ep.get(&h, lo, &remote, ro, len, src, op)
        } else {
            self.ep.put(&h, lo, &remote, ro, len, src, op)
        };
        if posted.is_err() {
            return false;
        }
        let end = Instant::now() + Duration::from_secs(30);
        while Instant::now() < end {
            if let Some(c) = self.stash.remove(&op) {
                return c.status.is_ok();
            }
            self.ep
                .progress(Some(Duration::from_millis(50)))
                .expect("progress");
            while let Some(c) = self.ep.pop_completion() {
                self.stash.insert(c.op, c);
            }
        }
        false
    }
}

fn server(t: &Transport) {
    let (ep, id) = endpoint(t, true);
    println!("ADDR {}", ep.self_addr(id).expect("self addr"));
    let mut s = Server {
        ep,
        id,
        op: 1_000_000,
        exposed: None,
        stash: HashMap::new(),
    };
    for i in 0..64 {
        s.ep.post_recv_unexpected(id, Vec::with_capacity(4096), OpId(i))
            .expect("post");
    }
    let (mut served, mut last) = (0u64, Instant::now());
    let mut quit_op = None;
    loop {
        if last.elapsed() > Duration::from_secs(60) {
            eprintln!("suite peer server idle for 60 s; exiting");
            std::process::exit(4);
        }
        s.ep.progress(Some(Duration::from_millis(200))).expect("progress");
        let mut done: Vec<Completion> = s.stash.drain().map(|(_, c)| c).collect();
        done.extend(std::iter::from_fn(|| s.ep.pop_completion()));
        for c in done {
            last = Instant::now();
            if Some(c.op) == quit_op {
                println!("SERVED {served}");
                std::process::exit(0);
            }
            if c.kind == OpKind::RecvExpected {
                // Posted by `p`: echo what arrived, unexpected, same tag.
                if let (Ok(()), Some(msg), Some(src)) = (&c.status, &c.buf, &c.source) {
                    let op = s.next_op();
                    s.ep.send_unexpected(src, c.tag, msg, op).expect("echo");
                }
                continue;
            }
            if c.kind != OpKind::RecvUnexpected {
                continue;
            }
            if let (Ok(()), Some(msg), Some(src)) = (&c.status, &c.buf, &c.source) {
                served += 1;
                let reply = if msg.first() == Some(&b'q') {
                    quit_op = Some(OpId(s.op + 1));
                    Some(Vec::new())
                } else {
                    s.command(msg, src, c.tag)
                };
                if let Some(r) = reply {
                    let op = s.next_op();
                    s.ep.send_expected(src, c.tag, &r, op).expect("reply");
                }
            }
            s.ep.post_recv_unexpected(id, Vec::with_capacity(4096), c.op)
                .expect("repost");
        }
    }
}

/// Echoes `n` messages, `window` in flight, through `uri`; prints
/// `CLIENT OK <n>`, then `CLIENT IDLE <k>`: how many progress waits of
/// `tick_ms` ended with nothing to do.
fn client(t: &Transport, uri: &str, n: u64, window: usize, tick_ms: u64) {
    let (mut ep, _) = endpoint(t, false);
    let server = ep.lookup(uri).expect("lookup");
    let mut stash = HashMap::new();
    let mut idle = 0u64;
    let mut wait = |ep: &mut Endpoint, op: OpId| -> Completion {
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(c) = stash.remove(&op) {
                return c;
            }
            assert!(Instant::now() < end, "client: timed out waiting for {op:?}");
            if ep
                .progress(Some(Duration::from_millis(tick_ms)))
                .expect("progress")
                == 0
            {
                idle += 1;
            }
            while let Some(c) = ep.pop_completion() {
                stash.insert(c.op, c);
            }
        }
    };
    let (mut next, mut done) = (0u64, 0u64);
    let mut inflight = std::collections::VecDeque::new();
    while done < n {
        while next < n && inflight.len() < window.max(1) {
            let mut msg = vec![b'e'];
            msg.extend_from_slice(&std::process::id().to_le_bytes());
            msg.extend_from_slice(&next.to_le_bytes());
            msg.resize(16 + (next as usize * 13) % 200, next as u8);
            let recv = OpId(next * 2 + 1);
            ep.post_recv_expected(&server, next as u32, Vec::new(), recv)
                .expect("post");
            ep.send_unexpected(&server, next as u32, &msg, OpId(next * 2))
                .expect("send");
            inflight.push_back((next, recv, msg));
            next += 1;
        }
        let (i, recv, msg) = inflight.pop_front().expect("in flight");
        let c = wait(&mut ep, recv);
        c.status.unwrap_or_else(|e| panic!("echo {i} failed: {e}"));
        assert_eq!(c.buf.as_deref(), Some(&msg[..]), "echo {i} corrupted");
        wait(&mut ep, OpId(i * 2)).status.expect("send");
        done += 1;
    }
    println!("CLIENT OK {n}");
    println!("CLIENT IDLE {idle}");
}

fn flood(t: &Transport, uri: &str, n: u32) {
    let (mut ep, _) = endpoint(t, false);
    let target = ep.lookup(uri).expect("lookup");
    for i in 0..n {
        ep.send_unexpected(&target, i, &flood_payload(i), OpId(u64::from(i)))
            .expect("send");
    }
    let (mut done, end) = (0, Instant::now() + Duration::from_secs(60));
    while done < n {
        assert!(Instant::now() < end, "flood: only {done} of {n} sends completed");
        ep.progress(Some(Duration::from_millis(100))).expect("progress");
        while let Some(c) = ep.pop_completion() {
            c.status.expect("flood send");
            done += 1;
        }
    }
    println!("FLOOD DONE {n}");
}
