//! The NA conformance suite (`na-testsuite`) over shared memory, and the
//! shared-memory-only trials (`suite/sm_only.rs`): every trial in its own
//! 0700 socket directory, peers as real processes (this binary in peer
//! mode, with the extra roles `hostile` and `envcheck`).

mod common;
#[path = "suite/rma_pool.rs"]
mod rma_pool;
#[path = "suite/sm_only.rs"]
mod sm_only;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use std::time::Instant;

use na_core::{Addr, OpId, Plugin, PluginId};
use na_sm::{SmConfig, SmPlugin, WakeKind, SOCKET_DIR_ENV, WAKE_ENV};
use na_testsuite::{Suite, Transport};

/// A socket directory, removed when the transport is dropped.
struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn transport(dir: PathBuf, guard: Option<Dir>) -> Transport {
    transport_with_wake(dir, guard, None)
}

/// `wake`: what this process and its peers are woken by (`None`: the
/// default, or `$QS_SM_WAKE`).
fn transport_with_wake(dir: PathBuf, guard: Option<Dir>, wake: Option<WakeKind>) -> Transport {
    transport_with(dir, guard, wake, None)
}

/// As [`transport_with_wake`], and `rma_threads`: the RMA transfer
/// threads of this process and its peers (`None`: the default, or
/// `$QS_SM_RMA_THREADS`).
fn transport_with(
    dir: PathBuf,
    guard: Option<Dir>,
    wake: Option<WakeKind>,
    rma_threads: Option<usize>,
) -> Transport {
    let d = dir.clone();
    let d2 = dir.clone();
    let mut peer_env = vec![(SOCKET_DIR_ENV.into(), dir.into_os_string())];
    if let Some(k) = wake {
        peer_env.push((WAKE_ENV.into(), k.name().into()));
    }
    if let Some(n) = rma_threads {
        peer_env.push((na_sm::RMA_THREADS_ENV.into(), n.to_string().into()));
    }
    Transport {
        name: "sm",
        make: Arc::new(move |id, listen| {
            let cfg = SmConfig {
                listen,
                wake,
                rma_threads,
                ..SmConfig::default()
            }
            .with_dir(d.clone());
            Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>)
        }),
        make_bounded: Arc::new({
            let d = d2;
            move |id, max_backlog_bytes, max_backlog_total| {
                let cfg = SmConfig {
                    wake,
                    rma_threads,
                    max_backlog_bytes,
                    max_backlog_total,
                    ..SmConfig::default()
                }
                .with_dir(d.clone());
                Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>)
            }
        }),
        peer_env,
        unreachable_uri: "sm://999999-nobody".into(),
        malformed_uri: "sm://abc".into(),
        timeout: Duration::from_secs(10),
        clients: 16,
        keeps_connection_after_rma_error: true,
        zero_copy_msg_bufs: false,
        merges_rma_batches: true,
        guard: guard.map(|g| Box::new(g) as Box<dyn std::any::Any + Send>),
    }
}

fn setup(test: &str) -> Option<Transport> {
    let dir = std::env::temp_dir().join(format!("qs-sm-suite-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the socket directory");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).expect("chmod 0700");
    Some(transport(dir.clone(), Some(Dir(dir))))
}

fn peer() -> Transport {
    let dir = std::env::var_os(SOCKET_DIR_ENV).expect("the harness sets QS_SM_DIR for peers");
    transport(dir.into(), None)
}

/// `hostile URI`: connects, makes one honest round trip, then scribbles
/// random bytes over its connection's shared memory until the target
/// reports an error to it (prints `HOSTILE ...`). `envcheck`: creates a
/// plugin with the environment as given and prints `OK <addr>` or `ERR <e>`.
fn extra_roles(args: &[&str]) -> bool {
    match args {
        ["hostile", uri] => hostile(uri),
        ["envcheck"] => match SmPlugin::new(PluginId(0), SmConfig::listening()) {
            Ok(p) => println!("OK {}", p.self_addr()),
            Err(e) => println!("ERR {e}"),
        },
        _ => return false,
    }
    true
}

fn hostile(uri: &str) {
    let mut plugin = SmPlugin::new(PluginId(0), SmConfig::default()).expect("plugin");
    let target: Addr = plugin.lookup(uri).expect("lookup");
    plugin
        .post_recv_expected(&target, 1, Vec::new(), OpId(1))
        .expect("post");
    plugin
        .send_unexpected(&target, 1, b"ehello", OpId(2))
        .expect("send");
    let (deadline, mut got) = (Instant::now() + Duration::from_secs(20), 0);
    while got < 2 {
        assert!(Instant::now() < deadline, "no echo from the target");
        plugin.progress().expect("progress");
        while let Some(c) = plugin.pop_completion() {
            c.status.expect("honest round trip");
            got += 1;
        }
    }
    plugin
        .post_recv_expected(&target, 2, Vec::new(), OpId(3))
        .expect("post");
    let mut seed = u64::from(std::process::id());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(
            Instant::now() < deadline,
            "the target never reported an error to the hostile peer"
        );
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        if plugin.debug_scribble(&target, seed).is_err() {
            println!("HOSTILE disconnected (scribble refused)");
            return;
        }
        let _ = plugin.send_unexpected(&target, 3, b"junk", OpId(100 + (seed % 1000)));
        std::thread::sleep(Duration::from_millis(5));
        let _ = plugin.progress();
        while let Some(c) = plugin.pop_completion() {
            if c.op == OpId(3) {
                let e = c.status.expect_err("a hostile peer must get an error");
                println!("HOSTILE got error: {}", na_core::ErrorChain(&e));
                return;
            }
        }
    }
}

fn main() {
    na_testsuite::run_main(Suite {
        name: "sm",
        setup,
        peer,
        extra_roles,
        extra_trials: sm_only::trials().into_iter().chain(rma_pool::trials()).collect(),
    });
}
