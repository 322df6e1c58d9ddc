//! The NA conformance suite: every scenario is written once, here, against
//! [`na_core::Endpoint`] and run against each NA plugin (na-sm on the host,
//! na-verbs inside the soft-RoCE VM).
//!
//! # How a plugin crate uses it
//! A test target with `harness = false` whose `main` is one call:
//!
//! ```no_run
//! # use na_testsuite::{Suite, Transport};
//! fn setup(test: &str) -> Option<Transport> { unimplemented!() }
//! fn peer() -> Transport { unimplemented!() }
//! fn main() {
//!     na_testsuite::run_main(Suite {
//!         name: "sm",
//!         setup,
//!         peer,
//!         extra_roles: |_| false,
//!         extra_trials: Vec::new(),
//!     });
//! }
//! ```
//!
//! The test binary is also the peer process: the harness starts
//! `current_exe()` with [`PEER_ENV`] set, and [`run_main`] then runs the
//! peer program ([`peer`]) instead of the tests. The binary speaks libtest's
//! command line (through `libtest-mimic`), so `cargo test`, `cargo nextest`
//! and a direct run inside the VM all work, with filters.
//!
//! A transport that cannot run here (no RDMA device) returns `None` from
//! [`Suite::setup`] after printing loudly why and asserting whatever can be
//! checked instead (the clear "no device" error): the trial then passes on
//! that assertion, with the reason in its output.
#![deny(unsafe_code)]
#![warn(missing_docs)]

use std::any::Any;
use std::ffi::OsString;
use std::sync::Arc;
use std::time::Duration;

use na_core::{Plugin, PluginId};

mod harness;
pub mod log;
pub mod messaging;
pub mod peer;
pub mod probe;
pub mod pull;
pub mod rma;
pub mod robustness;

pub use harness::{Node, PeerProc};
pub use peer::PEER_MODE_ENV;

/// Environment variable that turns a suite binary into a peer process; its
/// value is the peer's role and arguments, separated by spaces.
pub const PEER_ENV: &str = "QS_NA_SUITE_PEER";

/// Builds a plugin instance: `(id, listen)`.
pub type MakePlugin = Arc<dyn Fn(PluginId, bool) -> na_core::Result<Box<dyn Plugin>> + Send + Sync>;

/// Builds a client-only plugin instance whose send backlogs are bounded
/// at the given numbers of bytes: `(id, per peer, all peers together)`.
pub type MakeBoundedPlugin =
    Arc<dyn Fn(PluginId, usize, usize) -> na_core::Result<Box<dyn Plugin>> + Send + Sync>;

/// One transport as the scenarios see it.
pub struct Transport {
    /// Short name (`sm`, `verbs`), for messages.
    pub name: &'static str,
    /// Creates a plugin of this transport in this process.
    pub make: MakePlugin,
    /// Creates a client plugin with a given send-backlog bound (the
    /// backlog-bound scenario fills a small one).
    pub make_bounded: MakeBoundedPlugin,
    /// Environment a peer process needs to build the same transport (its
    /// [`Suite::peer`] reads it back).
    pub peer_env: Vec<(OsString, OsString)>,
    /// A well-formed address nobody listens on: lookup or the first
    /// operation on it must fail with a clear error, never hang.
    pub unreachable_uri: String,
    /// A string that is not an address of this transport.
    pub malformed_uri: String,
    /// Bound of every single wait in the scenarios.
    pub timeout: Duration,
    /// Client processes of the many-clients scenario.
    pub clients: usize,
    /// Whether a failed RMA (a forged remote key or address) leaves the
    /// connection usable. On RDMA an RC queue pair goes to the error state on
    /// a remote access error, so the plugin must reconnect; on shared memory
    /// the failure is local to one system call.
    pub keeps_connection_after_rma_error: bool,
    /// Whether the plugin merges a batch of RMA transfers into few calls
    /// (na-sm: one `process_vm_readv` for a run of gets; na-verbs: linked
    /// work requests, one `ibv_post_send`); then `PluginStats::rma_calls`
    /// must show it.
    pub merges_rma_batches: bool,
    /// Whether the plugin's message buffers are sent without a copy
    /// (registered memory): then `PluginStats::sends_zero_copy` counts them.
    pub zero_copy_msg_bufs: bool,
    /// Kept alive as long as the transport (a socket directory...).
    pub guard: Option<Box<dyn Any + Send>>,
}

/// What a plugin crate provides to [`run_main`].
pub struct Suite {
    /// Transport name, used in trial names (`sm::lookup_...`).
    pub name: &'static str,
    /// Test side: the environment for test `test`, or `None` (after saying
    /// why, loudly) when this transport cannot run here.
    pub setup: fn(test: &str) -> Option<Transport>,
    /// Peer side: the transport rebuilt from the environment that
    /// [`Transport::peer_env`] gave the peer process.
    pub peer: fn() -> Transport,
    /// Peer side: roles of this transport's own (`args[0]` names the role);
    /// returns false for a role it does not know, which the suite's peer
    /// program then runs. Called before [`Suite::peer`].
    pub extra_roles: fn(args: &[&str]) -> bool,
    /// Trials of this transport's own, run beside the suite's and named
    /// `<name>_only::<trial>`.
    pub extra_trials: Vec<(&'static str, Scenario)>,
}

/// A scenario: the test body, given a transport.
pub type Scenario = fn(&Transport);

/// Every scenario of the suite, by name.
pub fn scenarios() -> Vec<(&'static str, Scenario)> {
    vec![
        (
            "lookup_addresses_and_unexpected_ping_pong",
            messaging::lookup_and_unexpected,
        ),
        (
            "expected_messages_tags_out_of_order_and_early",
            messaging::expected_and_tags,
        ),
        ("zero_byte_max_size_and_oversize_messages", messaging::sizes),
        (
            "backpressure_ten_thousand_messages_a_thousand_in_flight",
            messaging::backpressure,
        ),
        (
            "send_backlogs_bounded_per_peer_and_in_all_for_peers_that_stop_reading",
            messaging::send_backlog_bound,
        ),
        ("plugin_message_buffers_both_kinds_reused", messaging::msg_bufs),
        ("gathered_sends_odd_parts_both_reports", messaging::gathered_sends),
        ("cancel_posted_operations", messaging::cancel),
        (
            "duplicate_op_ids_are_refused_and_the_first_op_stands",
            messaging::duplicate_op_ids,
        ),
        (
            "pull_mode_messages_in_order_while_sleeping",
            pull::pull_mode_messages,
        ),
        (
            "pull_mode_keeps_messages_of_an_exited_peer",
            pull::pull_mode_keeps_messages_of_an_exited_peer,
        ),
        (
            "pull_mode_two_senders_interleave_and_lose_nothing",
            pull::pull_mode_two_senders_interleave_and_lose_nothing,
        ),
        (
            "pull_mode_spin_over_many_peers_finds_each_reply",
            pull::pull_mode_spin_over_many_peers_finds_each_reply,
        ),
        (
            "pull_mode_sleeping_after_takes_returns_room",
            pull::pull_mode_sleeping_after_takes_returns_room,
        ),
        (
            "many_client_processes_against_one_server",
            messaging::many_clients,
        ),
        ("put_get_contiguous_and_multi_segment_both_sides", rma::put_get),
        ("rma_bounds_access_and_forged_descriptor_errors", rma::errors),
        (
            "rma_batches_merged_mixed_refused_and_partly_failing",
            rma::batches,
        ),
        (
            "server_killed_mid_traffic_fails_every_op",
            robustness::server_killed,
        ),
        (
            "server_killed_under_a_busy_poller_fails_every_op",
            robustness::server_killed_busy,
        ),
        (
            "client_killed_mid_traffic_server_keeps_serving",
            robustness::client_killed,
        ),
    ]
}

/// The `main` of a suite binary: runs the peer program when started as a
/// peer, else the scenarios as libtest-compatible trials. Never returns.
pub fn run_main(suite: Suite) -> ! {
    if let Some(role) = std::env::var_os(PEER_ENV) {
        let role = role.to_string_lossy().into_owned();
        let args: Vec<&str> = role.split(' ').collect();
        if !(suite.extra_roles)(&args) {
            peer::main(&(suite.peer)(), &args);
        }
        std::process::exit(0);
    }
    let (args, filters) = arguments(std::env::args());
    let own = format!("{}_only", suite.name);
    let named = scenarios().into_iter().map(|(n, run)| (suite.name, n, run));
    let trials = named
        .chain(suite.extra_trials.iter().map(|&(n, run)| (own.as_str(), n, run)))
        .map(|(group, name, run)| {
            let setup = suite.setup;
            libtest_mimic::Trial::test(format!("{group}::{name}"), move || {
                let Some(t) = setup(name) else {
                    return Ok(());
                };
                catch(|| run(&t))
            })
        })
        .filter(|t: &libtest_mimic::Trial| {
            filters.is_empty() || filters.iter().any(|f| matches(t.name(), f, args.exact))
        })
        .collect();
    libtest_mimic::run(&args, trials).exit()
}

/// Options of libtest's command line that take a value as the next word.
const TAKES_VALUE: &[&str] = &[
    "--test-threads",
    "--logfile",
    "--skip",
    "--color",
    "--format",
    "-Z",
];

/// The harness arguments, and the name filters when there are several.
/// libtest runs a test that matches any of its filters; libtest-mimic takes
/// one, and exits with a usage error on a second (so `cargo test A B`, or
/// `scripts/test-verbs.sh A B`, failed this binary). One filter stays
/// libtest-mimic's; several are applied here.
fn arguments(argv: impl IntoIterator<Item = String>) -> (libtest_mimic::Arguments, Vec<String>) {
    let mut argv = argv.into_iter();
    let mut rest: Vec<String> = argv.next().into_iter().collect();
    let mut filters = Vec::new();
    while let Some(a) = argv.next() {
        if TAKES_VALUE.contains(&a.as_str()) {
            rest.push(a);
            rest.extend(argv.next());
        } else if a.starts_with('-') {
            rest.push(a);
        } else {
            filters.push(a);
        }
    }
    if filters.len() == 1 {
        rest.append(&mut filters);
    }
    (libtest_mimic::Arguments::from_iter(rest), filters)
}

/// Whether trial `name` passes name filter `filter`.
fn matches(name: &str, filter: &str, exact: bool) -> bool {
    if exact {
        name == filter
    } else {
        name.contains(filter)
    }
}

/// Runs `f`, turning a panic into a trial failure with its message.
fn catch(f: impl FnOnce()) -> Result<(), libtest_mimic::Failed> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "panicked".into());
        libtest_mimic::Failed::from(msg)
    })
}

/// Byte `i` of memory the peer exposes with its `m` command.
pub fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(7) + 3) as u8
}

/// Payload of message `i` of the peer's `flood` role: 100 bytes.
pub fn flood_payload(i: u32) -> Vec<u8> {
    (0..100u32).map(|j| (i.wrapping_mul(31) ^ j) as u8).collect()
}

/// Byte `i` written by a client before the peer's `c` check.
pub fn pattern2(seed: u8, i: u64) -> u8 {
    (i.wrapping_mul(13) as u8) ^ seed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(words: &[&str]) -> (libtest_mimic::Arguments, Vec<String>) {
        arguments(words.iter().map(|w| w.to_string()))
    }

    #[test]
    fn several_name_filters_are_kept_apart_from_the_options_and_their_values() {
        let (args, filters) = parse(&[
            "suite",
            "--skip",
            "slow",
            "alpha",
            "--test-threads",
            "1",
            "beta",
            "--exact",
        ]);
        assert_eq!(filters, ["alpha", "beta"]);
        assert_eq!(args.filter, None);
        assert_eq!(args.skip, ["slow"]);
        assert_eq!(args.test_threads, Some(1));
        assert!(args.exact);
        assert!(matches("verbs::alpha", "alpha", false));
        assert!(!matches("verbs::alpha", "alpha", true));
        assert!(matches("verbs::alpha", "verbs::alpha", true));
    }

    #[test]
    fn one_name_filter_stays_the_harness_own() {
        let (args, filters) = parse(&["suite", "alpha", "--nocapture"]);
        assert!(filters.is_empty());
        assert_eq!(args.filter.as_deref(), Some("alpha"));
        let (args, filters) = parse(&["suite", "--color", "never"]);
        assert!(filters.is_empty() && args.filter.is_none());
    }
}
