//! The test server: an echo loop with commands (first byte of each
//! unexpected message):
//! - empty message: reply with an empty expected message, same tag;
//! - `e`: reply with the whole message as an expected message, same tag;
//! - `u`: the same, as an unexpected message;
//! - `o` + tags (u32 LE each): reply an expected message per tag, in that
//!   order, carrying the tag;
//! - `m` + segment lengths (u32 LE each): expose a read-write handle of
//!   those segments filled with `pattern(i)`; reply with its descriptor;
//! - `c` + offset (u64) + len (u64) + seed (u8): reply `[1]` if the exposed
//!   handle holds `pattern2(seed, i)` at every byte of the range, else `[0]`;
//! - `x` + dir (0 get, 1 put) + local off + remote off + len (u64 each) +
//!   descriptor: RMA between the exposed handle and the client's memory;
//!   reply `[1]` on success, `[0]` on error;
//! - `q`: reply, then exit; prints `SERVED <n>` (messages served).

use std::time::{Duration, Instant};

use na_core::{Access, Endpoint, MemHandle, OpId, OpKind, RemoteMem};

/// Byte `i` of a handle exposed with `m`.
pub fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(7) + 3) as u8
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

pub fn server() {
    let (mut ep, id): (Endpoint, _) = super::endpoint(true);
    println!("ADDR {}", ep.self_addr(id).expect("self addr"));
    let mut op = 1_000_000u64;
    for i in 0..64 {
        ep.post_recv_unexpected(id, Vec::with_capacity(4096), OpId(i))
            .expect("post");
    }
    let mut exposed: Option<MemHandle> = None;
    let mut served = 0u64;
    let mut quit_op = None;
    let mut last = Instant::now();
    loop {
        if last.elapsed() > Duration::from_secs(60) {
            eprintln!("testpeer server idle for 60 s; exiting");
            std::process::exit(4);
        }
        ep.progress(Some(Duration::from_millis(200))).expect("progress");
        while let Some(c) = ep.pop_completion() {
            last = Instant::now();
            if Some(c.op) == quit_op {
                println!("SERVED {served}");
                std::process::exit(0);
            }
            if c.kind != OpKind::RecvUnexpected {
                continue;
            }
            let (Ok(()), Some(msg), Some(src)) = (&c.status, c.buf, c.source) else {
                continue;
            };
            served += 1;
            let tag = c.tag;
            op += 1;
            let reply: Option<Vec<u8>> = match msg.first() {
                None => Some(Vec::new()),
                Some(b'e') => Some(msg.clone()),
                Some(b'z') => {
                    // Stall without progress, so that the client's sends
                    // pile up in its backlog deterministically.
                    let ms = msg
                        .get(1..5)
                        .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                    std::thread::sleep(Duration::from_millis(u64::from(ms)));
                    None
                }
                Some(b'u') => {
                    ep.send_unexpected(&src, tag, &msg, OpId(op)).expect("send");
                    None
                }
                Some(b'o') => {
                    for t in msg[1..].chunks_exact(4) {
                        let t = u32::from_le_bytes([t[0], t[1], t[2], t[3]]);
                        op += 1;
                        ep.send_expected(&src, t, &t.to_le_bytes(), OpId(op))
                            .expect("send");
                    }
                    None
                }
                Some(b'm') => {
                    let mut next = 0u64;
                    let bufs = msg[1..]
                        .chunks_exact(4)
                        .map(|l| {
                            let n = u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as u64;
                            let v = (next..next + n).map(pattern).collect();
                            next += n;
                            v
                        })
                        .collect();
                    let h = MemHandle::new(bufs, Access::ReadWrite);
                    let d = ep.plugin(id).expect("plugin").mem_describe(&h).expect("describe");
                    exposed = Some(h);
                    Some(d.to_bytes())
                }
                Some(b'c') => {
                    let (off, len, seed) = (u64_at(&msg, 1), u64_at(&msg, 9), msg[17]);
                    let h = exposed.as_ref().expect("m before c");
                    let mut v = vec![0; len as usize];
                    let ok = h.read_at(off, &mut v).is_ok()
                        && v.iter().enumerate().all(|(i, b)| *b == pattern2(seed, i as u64));
                    Some(vec![ok as u8])
                }
                Some(b'x') => {
                    let h = exposed.clone().expect("m before x");
                    let (lo, ro, len) = (u64_at(&msg, 2), u64_at(&msg, 10), u64_at(&msg, 18));
                    let remote = RemoteMem::from_bytes(&msg[26..]).expect("descriptor");
                    op += 1;
                    let rma = if msg[1] == 0 {
                        ep.get(&h, lo, &remote, ro, len, &src, OpId(op))
                    } else {
                        ep.put(&h, lo, &remote, ro, len, &src, OpId(op))
                    };
                    let mut ok = rma.is_ok();
                    if ok {
                        // RMA completes inside the call; its completion is queued.
                        ep.progress(Some(Duration::from_secs(5))).expect("progress");
                        while let Some(r) = ep.pop_completion() {
                            if r.op == OpId(op) {
                                ok = r.status.is_ok();
                            }
                        }
                    }
                    Some(vec![ok as u8])
                }
                Some(b'q') => {
                    quit_op = Some(OpId(op));
                    Some(Vec::new())
                }
                Some(_) => None,
            };
            if let Some(r) = reply {
                ep.send_expected(&src, tag, &r, OpId(op)).expect("reply");
            }
            ep.post_recv_unexpected(id, Vec::with_capacity(4096), c.op)
                .expect("repost");
        }
    }
}

/// Byte `i` written by a client before a `c` check.
pub fn pattern2(seed: u8, i: u64) -> u8 {
    (i.wrapping_mul(13) as u8) ^ seed
}
