//! Helpers shared by the verbs integration tests: environment detection,
//! bounded waits on the CM and completion channels, and test patterns.
#![allow(dead_code)]

pub mod flood;
pub mod pair;
pub mod raw_peer;
pub mod sys;

use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use na_verbs::sys::{
    poll_readable, CmEvent, CmEventKind, CompletionChannel, CompletionQueue, Context, EventChannel,
    WorkCompletion,
};
use na_verbs::VerbsError;

/// Upper bound for any single wait: TCG emulation is slow, but nothing
/// legitimate takes this long.
pub const WAIT: Duration = Duration::from_secs(30);

/// The connection set-up deadline of [`setup_plugin`]'s plugins.
pub const SETUP: Duration = Duration::from_secs(1);

/// Where the RDMA part of a test can run.
#[derive(Clone)]
pub struct RdmaEnv {
    /// Device name (`rxe0`).
    pub device: String,
    /// IPv4 address of the device's netdev, for RDMA CM.
    pub ip: Ipv4Addr,
}

/// Decides whether the RDMA part can run here. Returns `None` after printing
/// loudly why not, and after asserting that opening a device fails with the
/// clear "no RDMA device" error when there is none.
pub fn rdma_env(test: &str) -> Option<RdmaEnv> {
    let in_vm = std::env::var_os("RXE_VM").is_some();
    match na_verbs::sys::devices() {
        Err(VerbsError::NoDevice { reason }) => {
            assert!(
                !in_vm,
                "{test}: inside the rxe VM but libibverbs sees no device: {reason}"
            );
            // The real assertion of the host run: the error is the clear one.
            let err = Context::open(None).expect_err("no device is listed, so opening one must fail");
            let msg = err.to_string();
            assert!(
                matches!(err, VerbsError::NoDevice { .. }),
                "{test}: wrong error: {err:?}"
            );
            for needle in [
                "no RDMA device found",
                "ibverbs-providers",
                "rdma_rxe",
                "rdma link add",
                "rxe-vm",
            ] {
                assert!(
                    msg.contains(needle),
                    "{test}: the no-device error does not mention `{needle}`: {msg}"
                );
            }
            let err = Context::open(Some("rxe0")).expect_err("opening rxe0 must fail without devices");
            assert!(
                matches!(err, VerbsError::NoDevice { .. }),
                "{test}: wrong error for rxe0: {err:?}"
            );
            na_core::testing::report_not_run(&format!(
                "{test}: RDMA part on this host (no RDMA device: {reason}; checked instead that \
                 opening a device fails with: {msg}); scripts/test-verbs.sh runs it in the soft-RoCE VM"
            ));
            None
        }
        Err(e) => panic!(
            "{test}: listing RDMA devices failed unexpectedly: {}",
            na_core::ErrorChain(&e)
        ),
        Ok(devs) => {
            let ip = ["RXE_VM_IP", "QS_VERBS_TEST_IP"].into_iter().find_map(|var| {
                let v = std::env::var(var).ok()?;
                Some((var, v.split('/').next().unwrap_or_default().to_owned()))
            });
            let Some((var, ip)) = ip else {
                assert!(!in_vm, "{test}: inside the rxe VM but RXE_VM_IP is not set");
                na_core::testing::report_not_run(&format!(
                    "{test}: RDMA part: devices {devs:?} exist but no IPv4 address for RDMA CM is \
                     configured. Set QS_VERBS_TEST_IP=<IPv4 of the RDMA netdev> (never 127.0.0.1), \
                     or run scripts/test-verbs.sh (soft-RoCE VM)"
                ));
                return None;
            };
            let ip: Ipv4Addr = ip
                .parse()
                .unwrap_or_else(|e| panic!("{test}: bad {var} `{ip}`: {e}"));
            assert!(
                !ip.is_loopback(),
                "{test}: RDMA CM needs the device's address, not loopback"
            );
            let device = std::env::var("RXE_VM_DEV").unwrap_or_else(|_| devs[0].name.clone());
            eprintln!("{test}: running on {device} at {ip} (devices: {devs:?})");
            Some(RdmaEnv { device, ip })
        }
    }
}

/// Waits for the next CM event on `ch` and checks it is `want` with status 0.
pub fn wait_cm(ch: &Arc<EventChannel>, want: CmEventKind, who: &str) -> CmEvent {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(ev) = ch
            .get_event()
            .unwrap_or_else(|e| panic!("{who}: rdma_get_cm_event: {}", na_core::ErrorChain(&e)))
        {
            assert!(
                ev.kind == want && ev.status == 0,
                "{who}: expected {want:?}, got {} ({:?}) status {}",
                ev.kind.name(),
                ev.kind,
                ev.status
            );
            return ev;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "{who}: timed out after {WAIT:?} waiting for {want:?}"
        );
        poll_readable(ch.as_fd(), Some(left)).expect("poll on the CM channel");
    }
}

/// The next CM event on `ch`, whatever it is, waiting at most `WAIT`.
pub fn next_cm(ch: &Arc<EventChannel>) -> CmEvent {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(ev) = ch.get_event().expect("rdma_get_cm_event") {
            return ev;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no CM event within {WAIT:?}");
        poll_readable(ch.as_fd(), Some(left)).expect("poll on the CM channel");
    }
}

/// Collects exactly `n` completions from `cq`, waiting on `ch`. It never
/// polls more than it still needs, so a completion that arrived early stays
/// in the CQ for the next call (after arming, a completion already in the
/// CQ is found by the first poll of that call).
pub fn wait_wc(cq: &CompletionQueue, ch: &CompletionChannel, n: usize, who: &str) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    cq.poll(&mut out, n).expect("poll_cq");
    while out.len() < n {
        cq.req_notify(false).expect("req_notify_cq");
        let want = n - out.len();
        cq.poll(&mut out, want).expect("poll_cq");
        if out.len() == n {
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "{who}: timed out waiting for {n} completions, got {out:?}"
        );
        if poll_readable(ch.as_fd(), Some(left)).expect("poll on the completion channel") {
            ch.consume_events().expect("consume_events");
        }
        let want = n - out.len();
        cq.poll(&mut out, want).expect("poll_cq");
    }
    assert_eq!(out.len(), n, "{who}: more completions than expected: {out:?}");
    out
}

/// Asserts that every completion succeeded.
pub fn assert_ok(wcs: &[WorkCompletion], who: &str) {
    for wc in wcs {
        assert!(
            wc.is_ok(),
            "{who}: work request {} failed: {} ({wc:?})",
            wc.wr_id,
            wc.status_str()
        );
    }
}

/// Deterministic pseudo-random bytes (xorshift), different for each `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Encodes a remote region for private data: addr, len, rkey (little endian).
pub fn encode_remote(r: &na_verbs::sys::RemoteRegion) -> Vec<u8> {
    let mut v = Vec::with_capacity(20);
    v.extend_from_slice(&r.addr.to_le_bytes());
    v.extend_from_slice(&r.len.to_le_bytes());
    v.extend_from_slice(&r.rkey.to_le_bytes());
    v
}

/// Decodes [`encode_remote`]; the bytes come from the peer, so they are checked.
pub fn decode_remote(b: &[u8]) -> na_verbs::sys::RemoteRegion {
    assert!(
        b.len() >= 20,
        "private data too short for a remote region: {} bytes",
        b.len()
    );
    na_verbs::sys::RemoteRegion {
        addr: u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
        len: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
        rkey: u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")),
    }
}

/// The connect parameters of a raw peer (no plugin on its side) whose
/// hello names `ip` (port 1) and `depth` receive buffers.
pub fn raw_connect_param(ip: Ipv4Addr, depth: u16) -> na_verbs::sys::ConnParam {
    let hello = na_verbs::wire::Hello {
        addr: std::net::SocketAddr::V4(std::net::SocketAddrV4::new(ip, 1)),
        depth,
        max_payload: 4096,
        device: String::new(),
    };
    na_verbs::sys::ConnParam {
        private_data: hello.encode(),
        responder_resources: 1,
        initiator_depth: 1,
        retry_count: 2,
        // RNR retries of the plugin's sends to the raw peer.
        rnr_retry_count: 7,
        qp_num: 0,
    }
}

/// A raw peer's RDMA CM id with its address and route to `dst` resolved:
/// its event channel, the id, and the device context the route uses.
pub fn raw_resolved(
    dst: std::net::SocketAddr,
    who: &str,
) -> (Arc<EventChannel>, Arc<na_verbs::sys::CmId>, Arc<Context>) {
    use na_verbs::sys::{CmId, PortSpace};
    let ch = EventChannel::new().expect("event channel");
    let id = CmId::new(&ch, PortSpace::Tcp).expect("cm id");
    id.resolve_addr(None, dst, 5000).expect("resolve_addr");
    wait_cm(&ch, CmEventKind::AddrResolved, who);
    id.resolve_route(5000).expect("resolve_route");
    wait_cm(&ch, CmEventKind::RouteResolved, who);
    let ctx = id.context().expect("resolved id has a device");
    (ch, id, ctx)
}

/// A blocking-mode endpoint with one verbs plugin on `env`'s device whose
/// set-up deadline is [`SETUP`]; its passive side ignores `Established`
/// events when `ignore_established` (the test hook for a lost RTU).
pub fn setup_plugin(
    env: &RdmaEnv,
    listen: bool,
    ignore_established: bool,
) -> (na_core::Endpoint, na_core::PluginId) {
    plugin_with(env, listen, |cfg| {
        cfg.setup_timeout = SETUP;
        // The deadline must exceed both resolutions' timeouts (local here).
        cfg.resolve_timeout_ms = 200;
        cfg.debug.ignore_established = ignore_established;
    })
}

/// A blocking-mode endpoint with one plugin on the test device, its
/// configuration (from `verbs://DEV/IP:0`) changed by `edit`.
pub fn plugin_with(
    env: &RdmaEnv,
    listen: bool,
    edit: impl FnOnce(&mut na_verbs::VerbsConfig),
) -> (na_core::Endpoint, na_core::PluginId) {
    let spec = format!("verbs://{}/{}:0", env.device, env.ip);
    let mut cfg = na_verbs::VerbsConfig::from_spec(&spec, listen).unwrap();
    edit(&mut cfg);
    let mut ep = na_core::Endpoint::new(na_core::ProgressMode::Blocking).unwrap();
    let id = ep
        .add_plugin(|id| Ok(Box::new(na_verbs::VerbsPlugin::new(id, cfg)?) as Box<dyn na_core::Plugin>))
        .expect("verbs plugin");
    (ep, id)
}

/// The port of a `verbs://dev/ip:port` address.
pub fn port_of(uri: &str) -> u16 {
    uri.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port in the uri")
}

/// The init attributes of a raw peer's small RC QP: one CQ for both
/// queues, no SRQ, 4 work requests each way of one SGE, nothing inline.
pub fn small_qp_attr(cq: &Arc<CompletionQueue>) -> na_verbs::sys::QpInitAttr<'_> {
    na_verbs::sys::QpInitAttr {
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        caps: na_verbs::sys::QpCaps {
            max_send_wr: 4,
            max_recv_wr: 4,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
    }
}
