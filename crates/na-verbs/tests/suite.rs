//! The NA conformance suite (`na-testsuite`) over RDMA verbs: the same
//! scenarios as na-sm, against peer processes on the soft-RoCE device.
//!
//! Without an RDMA device (the host), each scenario asserts the clear
//! "no RDMA device found" error instead and says loudly that the RDMA part
//! did not run; `scripts/test-verbs.sh` runs it for real in the VM.

mod common;

use std::sync::Arc;
use std::time::Duration;

use na_core::Plugin;
use na_testsuite::{Suite, Transport};
use na_verbs::{VerbsConfig, VerbsPlugin};

/// Listen spec of the device under test, handed to peer processes.
const SPEC_ENV: &str = "QS_VERBS_SUITE_SPEC";

fn transport(spec: String) -> Transport {
    let (ip, dev) = {
        let u = na_verbs::VerbsUri::parse(&spec).expect("suite spec");
        let ip = u.sock.expect("suite spec has an address").ip();
        (ip, u.device.expect("suite spec has a device"))
    };
    let s = spec.clone();
    Transport {
        name: "verbs",
        make: Arc::new(move |id, listen| {
            // At most 3 SGEs per work request (the device allows 32): the
            // 16-segment RMA scenarios must split, as on NICs with few SGEs.
            let cfg = VerbsConfig {
                max_sge: Some(3),
                ..VerbsConfig::from_spec(&s, listen)?
            };
            Ok(Box::new(VerbsPlugin::new(id, cfg)?) as Box<dyn Plugin>)
        }),
        make_bounded: Arc::new({
            let s = spec.clone();
            move |id, max_backlog_bytes, max_backlog_total| {
                let cfg = VerbsConfig {
                    max_backlog_bytes,
                    max_backlog_total,
                    ..VerbsConfig::from_spec(&s, false)?
                };
                Ok(Box::new(VerbsPlugin::new(id, cfg)?) as Box<dyn Plugin>)
            }
        }),
        peer_env: vec![(SPEC_ENV.into(), spec.into())],
        // RDMA CM port 1 on the device's address: nobody listens there.
        unreachable_uri: format!("verbs://{dev}/{ip}:1"),
        malformed_uri: format!("verbs://{dev}/not-an-address:x"),
        timeout: Duration::from_secs(30),
        clients: 8,
        keeps_connection_after_rma_error: false,
        zero_copy_msg_bufs: true,
        merges_rma_batches: true,
        guard: None,
    }
}

fn setup(test: &str) -> Option<Transport> {
    let env = common::rdma_env(test)?;
    Some(transport(format!("verbs://{}/{}:0", env.device, env.ip)))
}

fn peer() -> Transport {
    transport(std::env::var(SPEC_ENV).expect("the harness sets the suite spec for peers"))
}

fn main() {
    na_testsuite::run_main(Suite {
        name: "verbs",
        setup,
        peer,
        extra_roles: |_| false,
        extra_trials: Vec::new(),
    });
}
