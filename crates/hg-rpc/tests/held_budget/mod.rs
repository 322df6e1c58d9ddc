//! A client engine whose pull budget (1.5 MiB) is held by a 1 MiB input it
//! pulled for a deferred handler of its own (shared by
//! `output_pull_budget.rs`, `blocking_idle_wakes.rs` and
//! `driver_idle_wakes.rs`).

use std::sync::mpsc::Sender;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hg_rpc::{DeferredRequest, Engine};
use serde_bytes::ByteBuf;

use super::common::{client, endpoint, Server};
use super::rpcs::{fill_pattern, Digest};

const MIB: u64 = 1 << 20;
const T: Duration = Duration::from_secs(30);

/// The timeout of the holder's call, which nobody answers. Short: the
/// tests join the holder as they end, and a longer one (it was 2 s) was
/// a floor under each of them. Nothing waits for its expiry or needs it
/// later: the request goes out before the call first looks at its
/// deadline (over na-sm a send is complete once in shared memory), and a
/// spilled input given up on stays exposed for its target (the
/// abandoned-input TTL, 60 s, runs only in the holder's `trigger`, which
/// nothing calls once the call returned), so the client pulls it whether
/// the call timed out already or not; nothing goes from the holder to the
/// client when it times out; and the tests read only its outcome, a
/// timeout either way.
const HOLDER_TIMEOUT: Duration = Duration::from_millis(100);

/// What [`budget_held`] made.
pub struct HeldParts {
    /// The client engine (blocking API), its budget held.
    pub c: Engine,
    /// A server process for the client's own calls.
    pub srv: Server,
    /// The deferred request whose pulled input holds the budget.
    pub req: DeferredRequest,
    /// Tells the peer that sent `req` to end (its engine, and so its
    /// connection, kept until then).
    pub end_holder: Sender<()>,
    /// That peer's thread: its call's outcome (a timeout: never answered).
    pub holder: JoinHandle<hg_rpc::Result<(u64, u64)>>,
}

/// A client engine in `d` whose pull budget is held by a 1 MiB input it
/// pulled for its deferred `Digest` handler, the request in hand, driven
/// with the blocking API until it arrived.
pub fn budget_held(d: &std::path::Path) -> HeldParts {
    let srv = Server::start(d);
    let (ep, id) = endpoint(d, true);
    let mut c = Engine::new(ep, id).unwrap();
    c.set_max_pull_bytes(MIB + MIB / 2);
    c.register_deferred::<Digest>().unwrap();
    let c_uri = c.self_addr().uri().to_owned();
    let (end_holder, ended) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn({
        let d = d.to_path_buf();
        move || {
            let mut h = client(&d);
            let to = h.lookup(&c_uri).unwrap();
            // Never answered: it times out.
            let r = h.call::<Digest>(&to, &ByteBuf::from(fill_pattern(MIB, 5)), HOLDER_TIMEOUT);
            let _ = ended.recv();
            r
        }
    });
    let end = Instant::now() + T;
    let req = loop {
        assert!(
            Instant::now() < end,
            "the held input never arrived: {:?}",
            c.stats()
        );
        c.progress(Some(Duration::from_millis(10))).unwrap();
        c.trigger().unwrap();
        if let Some(r) = c.take_deferred() {
            break r;
        }
    };
    HeldParts {
        c,
        srv,
        req,
        end_holder,
        holder,
    }
}
