//! A remote peer that breaks the protocol again and again (a new
//! connection each time) cannot flood the log: the warning comes at the
//! 1st, 2nd, 4th... violation, the others at debug level, and
//! `protocol_errors` counts every one. A binary of its own, for the global
//! tracing subscriber (a thread-local one would share tracing's
//! per-callsite interest cache with threads that have none).
//!
//! Without an RDMA device the RDMA part cannot run: the test says so loudly
//! (and checks the clear "no RDMA device" error).

mod common;

use common::flood::*;
use common::*;

#[test]
fn repeated_protocol_violations_are_all_counted_and_logged_at_powers_of_two() {
    let Some(env) = rdma_env("repeated_protocol_violations_are_all_counted_and_logged_at_powers_of_two")
    else {
        return;
    };
    let log = na_testsuite::log::CapturedLog::install_global();
    let (mut ep, id) = listener(&env);
    const ATTACKS: u64 = 5;
    for i in 0..ATTACKS {
        let seen = attack_listener(&env, &mut ep, id, env.ip, Attack::WriteWithImm);
        let why = seen.stopped_by.unwrap_or_default();
        assert!(
            ended_after_connect(&why),
            "attack {i}: the connection was not ended: {why}"
        );
        let st = ep.plugin(id).unwrap().stats();
        assert!(st.protocol_errors > i, "attack {i} not counted: {st:?}");
    }
    let n = ep.plugin(id).unwrap().stats().violations;
    log.assert_throttled("verbs: protocol violation", "violations", n);
    assert!(n > 2, "{n} violations: some at debug level");
}
