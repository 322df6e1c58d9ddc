//! The NA conformance suite (`na-testsuite`) over shared memory: every
//! scenario in its own 0700 socket directory, peers as real processes.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use na_core::Plugin;
use na_sm::{SmConfig, SmPlugin, SOCKET_DIR_ENV};
use na_testsuite::{Suite, Transport};

/// A socket directory, removed when the transport is dropped.
struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn transport(dir: PathBuf, guard: Option<Dir>) -> Transport {
    let d = dir.clone();
    Transport {
        name: "sm",
        make: Arc::new(move |id, listen| {
            let cfg = SmConfig {
                listen,
                ..SmConfig::default()
            }
            .with_dir(d.clone());
            Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>)
        }),
        peer_env: vec![(SOCKET_DIR_ENV.into(), dir.into_os_string())],
        unreachable_uri: "sm://999999-nobody".into(),
        malformed_uri: "sm://abc".into(),
        timeout: Duration::from_secs(10),
        clients: 16,
        keeps_connection_after_rma_error: true,
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

fn main() {
    na_testsuite::run_main(Suite {
        name: "sm",
        setup,
        peer,
    });
}
