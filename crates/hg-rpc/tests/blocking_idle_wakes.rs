//! A blocking `Engine` (its own `progress`, and a blocking `call`) while
//! a spilled output of its own call waits for room in the pull budget
//! that a deferred request's pulled input holds (a server process,
//! `hg-rpc-testpeer`, over na-sm): the engine sleeps until something
//! brings room back, instead of waking every 10 ms (the recheck it once
//! had), and the request dropped unanswered on another thread wakes it
//! (the endpoint's `Waker`, which `register_deferred` gave the engine):
//! the output is pulled and the call answered. The blocking twin of
//! `driver_idle_wakes.rs`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::RpcError;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::dir;
mod held_budget;
mod logged;
use held_budget::{budget_held, HeldParts};

const MIB: u64 = 1 << 20;
const T: Duration = Duration::from_secs(30);

/// How long the request holds the room while the engine idles.
const IDLE: Duration = Duration::from_secs(2);

/// The peer whose request was never answered timed out.
fn end_holder(
    parts_end: std::sync::mpsc::Sender<()>,
    holder: std::thread::JoinHandle<hg_rpc::Result<(u64, u64)>>,
) {
    let _ = parts_end.send(());
    let r = holder.join().unwrap();
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
}

/// Idle for 2 s in a blocking `progress` (with a timeout far past the
/// test's bound) while an output waits for room a deferred request
/// holds: `progress` returns a handful of times at most (it returned
/// every 10 ms, about 200 times, with the recheck). Then the request,
/// dropped unanswered on another thread, wakes it, and the output is
/// pulled intact.
#[test]
fn a_blocking_progress_sleeps_while_an_output_waits_and_wakes_when_a_dropped_request_gives_room_back() {
    let d = dir("blocking-idle-wakes");
    let HeldParts {
        mut c,
        srv,
        req,
        end_holder: end,
        holder,
    } = budget_held(&d);
    let s = c.lookup(&srv.uri).unwrap();
    let call = c.forward::<Fill>(&s, &(MIB, 7)).unwrap();
    let deadline = Instant::now() + T;
    while c.outputs_waiting() == 0 {
        assert!(
            Instant::now() < deadline,
            "the output did not wait: {:?}",
            c.stats()
        );
        c.progress(Some(Duration::from_millis(10))).unwrap();
        c.trigger().unwrap();
    }
    let dropped = Arc::new(AtomicBool::new(false));
    let dropper = std::thread::spawn({
        let dropped = dropped.clone();
        move || {
            std::thread::sleep(IDLE);
            // Raised first: the return the drop causes counts as after it.
            dropped.store(true, Ordering::SeqCst);
            drop(req);
        }
    });
    let started = Instant::now();
    let (mut returns_held, deadline) = (0u32, Instant::now() + T + IDLE);
    while !c.is_finished(call) {
        assert!(
            Instant::now() < deadline,
            "the output still waits after the request holding its room was dropped \
             (the drop did not wake the sleep): {:?}",
            c.stats()
        );
        c.progress(Some(T + T)).unwrap();
        if !dropped.load(Ordering::SeqCst) {
            returns_held += 1;
        }
        c.trigger().unwrap();
    }
    dropper.join().unwrap();
    assert!(
        started.elapsed() >= IDLE,
        "the call finished before the request was dropped: the test did not test the wait"
    );
    assert!(
        returns_held <= 10,
        "a blocking progress returned {returns_held} times in {IDLE:?} while an output waited \
         and nothing happened: {:?}",
        c.stats()
    );
    let out = c.take_response::<Fill>(call).expect("finished").unwrap();
    assert!(out == fill_pattern(MIB, 7), "corrupted");
    let st = c.stats();
    assert_eq!((st.in_flight, st.errors, st.outputs_waited), (0, 0, 1), "{st:?}");
    end_holder(end, holder);
}

/// A blocking `call` (its own progress loop, a deadline far past the
/// drop) whose spilled output waits for room a deferred request holds:
/// the request dropped on another thread wakes it, and it answers with
/// the output intact.
#[test]
fn a_blocking_call_is_answered_when_a_request_dropped_on_another_thread_gives_room_back() {
    let d = dir("blocking-call-wakes");
    let HeldParts {
        mut c,
        srv,
        req,
        end_holder: end,
        holder,
    } = budget_held(&d);
    let s = c.lookup(&srv.uri).unwrap();
    // Dropped once the call's output waits (the engine logs it; the call
    // blocks this thread, so its stats cannot be read meanwhile), and a
    // moment later, so the call is most likely asleep by then (a drop
    // before its sleep must end that sleep at once, too).
    logged::install();
    let server = srv.uri.clone();
    let dropper = std::thread::spawn(move || {
        let end = Instant::now() + T;
        while !logged::said("output waits for room", |p| p.contains(&server)) {
            if Instant::now() >= end {
                break; // The stats check below says the output never waited.
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(300));
        drop(req);
    });
    let out = c.call::<Fill>(&s, &(MIB, 7), T).unwrap_or_else(|e| {
        panic!(
            "the call was not answered once the room came back: {e}: {:?}",
            c.stats()
        )
    });
    assert!(out == fill_pattern(MIB, 7), "corrupted");
    dropper.join().unwrap();
    let st = c.stats();
    assert_eq!(
        (st.in_flight, st.errors, st.outputs_waited),
        (0, 0, 1),
        "the output did not wait for the room (the test did not test it): {st:?}"
    );
    end_holder(end, holder);
}
