//! An incoming connection the listener cannot set up for lack of its own
//! resources (here: its receive and send buffers, 8 GiB at the largest
//! depth and message size, cannot be mapped in the VM's 2 GiB) is counted
//! in `accept_errors` (and `handshakes_refused`), never as the peer's
//! protocol error, is logged as a warning, and the peer is told at once
//! (rejected). A binary of its own: for the global tracing subscriber,
//! and so that the failing 8 GiB mapping concerns no other test.
//!
//! Without an RDMA device the RDMA part cannot run: the test says so loudly
//! (and checks the clear "no RDMA device" error).

mod common;

use common::flood::*;
use common::*;

/// Receive slots of the listener: the most `recv_depth` allows.
const LISTENER_DEPTH: u16 = 4096;

/// `kB` value of `field` in /proc/meminfo.
fn meminfo_kib(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(&format!("{field}:")))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Whether mapping `bytes` fails here for sure: the kernel's heuristic
/// overcommit (mode 0) refuses a mapping larger than RAM and swap
/// together; with any other mode it could succeed and be pinned.
fn mapping_must_fail(bytes: u64) -> Result<(), String> {
    let mode = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").map_err(|e| e.to_string())?;
    if mode.trim() != "0" {
        return Err(format!("vm.overcommit_memory is {}, not 0", mode.trim()));
    }
    let total = meminfo_kib("MemTotal").ok_or("no MemTotal")? + meminfo_kib("SwapTotal").unwrap_or(0);
    if total * 1024 >= bytes {
        return Err(format!("RAM and swap ({total} kB) could hold {bytes} bytes"));
    }
    Ok(())
}

#[test]
fn a_connection_the_listener_cannot_set_up_counts_as_an_accept_error() {
    let test = "a_connection_the_listener_cannot_set_up_counts_as_an_accept_error";
    let Some(env) = rdma_env(test) else {
        return;
    };
    let max_msg = na_verbs::wire::MAX_PAYLOAD_LIMIT as usize;
    let slot = (na_verbs::wire::HEADER_LEN + max_msg).div_ceil(64) * 64;
    let buffers = (slot * usize::from(LISTENER_DEPTH) * 2) as u64;
    if let Err(why) = mapping_must_fail(buffers) {
        assert!(
            std::env::var_os("RXE_VM").is_none(),
            "{test}: in the rxe VM the listener's buffers must not fit: {why}"
        );
        na_core::testing::report_not_run(&format!(
            "{test}: the listener's {buffers} bytes of buffers might be mapped and pinned here ({why}); \
             scripts/test-verbs.sh runs it in the soft-RoCE VM"
        ));
        return;
    }
    let log = na_testsuite::log::CapturedLog::install_global();
    let (mut ep, id) = plugin_with(&env, true, |cfg| {
        cfg.recv_depth = LISTENER_DEPTH;
        cfg.send_queue_depth = u32::from(LISTENER_DEPTH) + 8;
        cfg.max_msg_size = max_msg;
        cfg.max_conns = 1;
    });
    let seen = attack_listener(&env, &mut ep, id, env.ip, Attack::Flood);
    let st = ep.plugin(id).unwrap().stats();
    let why = seen.stopped_by.unwrap_or_default();
    eprintln!("{test}: peer stopped by {why:?}; listener {st:?}");
    assert_eq!(seen.delivered, 0, "the connection carried messages");
    assert!(why.contains("REJECTED"), "the peer was not rejected: {why}");
    assert_eq!(st.accept_errors, 1, "the failed set-up was not counted: {st:?}");
    assert_eq!(st.handshakes_refused, 1, "{st:?}");
    assert_eq!(
        st.protocol_errors, 0,
        "our own failure counted as the peer's: {st:?}"
    );
    let warned = log.lines_at("WARN", "verbs: could not accept a connection");
    assert_eq!(warned.len(), 1, "not logged as a warning:\n{}", log.text());
    assert!(
        warned[0].contains("accept_errors=1") && warned[0].contains("mmap"),
        "the warning names neither the count nor the failure: {}",
        warned[0]
    );
}
