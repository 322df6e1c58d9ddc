//! A forked child does not inherit its parent's congestion: the
//! descriptors its parent's closing threads hold (and count) are the
//! parent's to close, so a child forked while every closing thread of its
//! parent was jammed and the closing queue full serves handshakes on a
//! listener of its own at once.
//!
//! (The child reports through its exit status and ends with `_exit`.)

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use na_core::{Plugin, PluginId};
use na_sm::{SmConfig, SmPlugin};

mod common;
mod jam;
use common::{sys, wait_child};
use jam::{flood, honest_client_served, jam_every_closing_thread, listener, settle_for, LINGER};

/// In the child: 0 if a listener of its own serves an honest client
/// without ever pausing its accepts, else what went wrong.
fn child_serves(dir: &std::path::Path) -> i32 {
    let cfg = SmConfig::listening().with_dir(dir).with_name("child");
    let Ok(mut mine) = SmPlugin::new(PluginId(3), cfg) else {
        return 2;
    };
    let uri = mine.self_addr().uri().to_owned();
    if !honest_client_served(&mut mine, dir, &uri, Duration::from_secs(10)) {
        return 3;
    }
    if mine.stats().flow_blocked != 0 {
        return 4;
    }
    0
}

#[test]
fn a_child_forked_while_its_parent_is_congested_is_not() {
    let (dir, mut srv, _, path) = listener("forked-congestion");
    settle_for(&mut srv, Duration::from_millis(50));
    // Congested: every closing thread jammed, more than MAX_PENDING_FDS
    // descriptors queued behind them, accepts paused.
    let _peers = jam_every_closing_thread(&mut srv, &path, LINGER);
    let jammed = Instant::now();
    flood(&mut srv, &path, 100);
    settle_for(&mut srv, Duration::from_millis(50));
    // Still congested just before the fork: accepts pause again each time
    // their pause ends (the flood left connections in the queue).
    // (Each pause lasts 100 ms: waited for, not for a fixed time.)
    let blocked = srv.stats().flow_blocked;
    let end = Instant::now() + Duration::from_secs(5);
    while srv.stats().flow_blocked == blocked {
        assert!(
            Instant::now() < end,
            "the parent is not congested (accepts paused {blocked} times, not since)"
        );
        settle_for(&mut srv, Duration::from_millis(5));
    }
    // The child makes plugins of its own (the fork handlers cover
    // na-sm's locks) and ends with `exit_now`, never returning into the
    // test harness.
    let child = sys::fork();
    assert!(child >= 0, "fork");
    if child == 0 {
        let code = std::panic::catch_unwind(AssertUnwindSafe(|| child_serves(&dir))).unwrap_or(5);
        sys::exit_now(code);
    }
    let status = wait_child(child, Duration::from_secs(30));
    assert!(
        jammed.elapsed() < LINGER / 2,
        "the jam may have cleared before the child ran"
    );
    assert_eq!(
        status,
        Some(0),
        "the child (2: no plugin, 3: the honest client was not served, 4: accepts paused, 5: panic, None: hung)"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
