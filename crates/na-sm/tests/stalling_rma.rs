//! A peer decides what its memory does when we read it: a transfer names
//! its addresses, and `process_vm_readv` faults its pages in on the
//! calling thread, waiting (killable only) for whatever serves the fault.
//! Memory of the peer's that is registered with a userfaultfd it never
//! answers (or a mapping of a file on a FUSE mount whose daemon hangs)
//! holds that thread in the system call for as long as the peer lives.
//!
//! With transfer threads (`SmConfig::rma_threads` > 0) the `rma` call
//! returns at once and a stuck transfer holds one transfer thread only:
//! the engine goes on serving other peers (their messages and their RMA),
//! the stuck transfer can be canceled, and the endpoint can be dropped.
//! With none (the default, inline mode) the caller's thread is held: the
//! last test shows that known limit, ignored (`--ignored` runs it).
//!
//! Each scenario runs the endpoint on a thread of its own that reports
//! every step; this thread waits at most [`BOUND`] for each, so a step
//! that hangs fails the test (and the peers are killed, which lets a held
//! thread go) instead of hanging it.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use na_core::{Access, Completion, Endpoint, MemHandle, NaError, OpId, OpKind};
use na_sm::RMA_QUIET_YIELD_EVERY;

mod common;
mod stalling;
use common::{private_dir, rma_endpoint, sys};
use stalling::{
    busy_turn, fork_peer, honest_peer, leave, leaving_hostile_peer, pattern, poll_turn, receive_descriptor,
    run_steps, scene, scene_with, serve_honest, turns_until, wait_op, wait_until_running, Scene, Step, BOUND,
    LEN,
};

/// Transfer threads on: the get of the stalling memory returns at once;
/// the honest peer's get and messages complete while it is stuck (one
/// job running, the stuck one); cancel completes it `Canceled`, and the
/// handle it writes stays held by the job meanwhile; the endpoint drops
/// within the bound.
#[test]
fn with_transfer_threads_a_stalling_peer_holds_neither_the_caller_nor_other_peers() {
    const THREADS: usize = 2;
    let Some((mut s, kills, dir)) = scene("stalling-rma-pool", THREADS) else {
        return;
    };
    let steps = run_steps(4, kills, dir, move |tx| {
        let mut stash = HashMap::new();
        let local = MemHandle::zeroed(LEN, Access::ReadWrite);
        s.ep.plugin_mut(s.id).unwrap().mem_register(&local).unwrap();
        let (src, remote) = s.hostile.clone();
        let t0 = Instant::now();
        s.ep.get(&local, 0, &remote, 0, LEN as u64, &src, OpId(10))
            .unwrap();
        let _ = tx.send(Step::GetReturned(t0.elapsed()));
        serve_honest(&mut s, &mut stash, OpId(20), 30);
        let stats = s.ep.plugin_mut(s.id).unwrap().stats();
        let _ = tx.send(Step::HonestServed(stats));
        // The stuck job holds a clone of the handle it writes.
        let local = local
            .into_buffers()
            .expect_err("a running transfer's handle was given back");
        s.ep.cancel(s.id, OpId(10)).unwrap();
        let c = wait_op(&mut s.ep, &mut stash, OpId(10));
        assert_eq!(c.kind, OpKind::Get);
        let _ = tx.send(Step::Canceled(
            c.status.map_or_else(|e| e.to_string(), |()| "Ok".into()),
        ));
        let t0 = Instant::now();
        drop(s);
        drop(local);
        let _ = tx.send(Step::Dropped(t0.elapsed()));
    });
    let [Step::GetReturned(_), Step::HonestServed(stats), Step::Canceled(err), Step::Dropped(_)] = &steps[..]
    else {
        panic!("steps out of order: {steps:?}");
    };
    assert_eq!(stats.rma_offloaded, 2, "{stats:?}");
    assert_eq!(stats.rma_jobs_running, 1, "the stuck get runs: {stats:?}");
    assert_eq!(stats.rma_jobs_waiting, 0, "{stats:?}");
    assert_eq!(
        stats.get_bytes, LEN as u64,
        "only the honest get moved: {stats:?}"
    );
    assert_eq!(err, &NaError::Canceled.to_string());
}

/// One transfer thread, held by the stalling peer: the honest peer's get
/// waits queued (the caller is not held, and its messages are served),
/// and can be canceled; once the hostile peer is gone (its stuck get
/// fails as gone, whatever the thread still does) the thread serves the
/// honest peer again.
#[test]
fn a_held_thread_leaves_other_peers_jobs_queued_and_the_caller_free() {
    let Some((mut s, kills, dir)) = scene("stalling-rma-one", 1) else {
        return;
    };
    // Killed by the endpoint's thread mid-scenario (and by `kills` at the
    // end, or when a step does not come).
    let hostile_pid = kills[0].pid();
    let steps = run_steps(3, kills, dir, move |tx| {
        let mut stash = HashMap::new();
        let local = MemHandle::zeroed(LEN, Access::ReadWrite);
        let (src, remote) = s.hostile.clone();
        let t0 = Instant::now();
        s.ep.get(&local, 0, &remote, 0, LEN as u64, &src, OpId(10))
            .unwrap();
        let (to, honest) = s.honest.clone();
        let queued = MemHandle::zeroed(LEN, Access::ReadWrite);
        s.ep.get(&queued, 0, &honest, 0, LEN as u64, &to, OpId(11))
            .unwrap();
        let _ = tx.send(Step::GetReturned(t0.elapsed()));
        // Messages need no transfer thread.
        s.ep.post_recv_expected(&to, 9, Vec::with_capacity(64), OpId(13))
            .unwrap();
        s.ep.send_unexpected(&to, 9, b"ping", OpId(12)).unwrap();
        let c = wait_op(&mut s.ep, &mut stash, OpId(13));
        assert_eq!(c.buf.as_deref(), Some(&b"ping"[..]));
        // The thread takes the first job (the stalling get) when it has
        // started: wait for that.
        let end = Instant::now() + BOUND;
        let stats = loop {
            let stats = s.ep.plugin_mut(s.id).unwrap().stats();
            if stats.rma_jobs_running > 0 || Instant::now() > end {
                break stats;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        s.ep.progress(Some(Duration::from_millis(50))).unwrap();
        while let Some(c) = s.ep.pop_completion() {
            stash.insert(c.op, c);
        }
        assert!(
            !stash.contains_key(&OpId(11)),
            "the queued get ran beside the stuck one"
        );
        s.ep.cancel(s.id, OpId(11)).unwrap();
        let c = wait_op(&mut s.ep, &mut stash, OpId(11));
        assert!(matches!(c.status, Err(NaError::Canceled)), "{:?}", c.status);
        let _ = tx.send(Step::HonestServed(stats));
        sys::kill(hostile_pid, libc::SIGKILL);
        let c = wait_op(&mut s.ep, &mut stash, OpId(10));
        serve_honest(&mut s, &mut stash, OpId(20), 30);
        let _ = tx.send(Step::Canceled(
            c.status
                .map_or_else(|e| na_core::ErrorChain(&e).to_string(), |()| "Ok".into()),
        ));
    });
    let [Step::GetReturned(_), Step::HonestServed(stats), Step::Canceled(hostile_end)] = &steps[..] else {
        panic!("steps out of order: {steps:?}");
    };
    assert_eq!(stats.rma_jobs_running, 1, "{stats:?}");
    assert_eq!(stats.rma_jobs_waiting, 1, "the honest get waits: {stats:?}");
    eprintln!("the stuck get ended: {hostile_end}");
}

/// A stuck peer's queue is bounded: behind its stuck job,
/// `RMA_QUEUE_PER_PEER` more wait, and the batch past them is refused
/// whole (nothing started, counted nowhere); the other peer is served
/// meanwhile. When the stuck peer closes its connection (and lives on,
/// its job still stuck), every one of its transfers completes at once as
/// gone (within [`stalling::GONE_WITHIN_CALLS`] progress calls of a busy endpoint
/// after the peer says it closed), queued and running alike, once.
#[test]
fn a_stuck_peers_queue_is_bounded_and_fails_as_gone_when_it_goes() {
    let Some((mut s, kills, dir)) = scene_with("stalling-rma-bound", 2, leaving_hostile_peer) else {
        return;
    };
    let steps = run_steps(2, kills, dir, move |tx| {
        let mut stash = HashMap::new();
        let local = MemHandle::zeroed(LEN, Access::ReadWrite);
        let (src, remote) = s.hostile.clone();
        let max = na_sm::RMA_QUEUE_PER_PEER as u64;
        // The first runs (and sticks: wait for its thread to take it);
        // then the queue fills.
        s.ep.get(&local, 0, &remote, 0, 64, &src, OpId(1000)).unwrap();
        wait_until_running(&mut s);
        for k in 1..=max {
            s.ep.get(&local, 0, &remote, 0, 64, &src, OpId(1000 + k)).unwrap();
        }
        let e =
            s.ep.get(&local, 0, &remote, 0, 64, &src, OpId(5000))
                .expect_err("a get past the peer's queue bound");
        assert!(
            e.to_string().contains("RMA_QUEUE_PER_PEER"),
            "{}",
            na_core::ErrorChain(&e)
        );
        serve_honest(&mut s, &mut stash, OpId(20), 30);
        let stats = s.ep.plugin_mut(s.id).unwrap().stats();
        let _ = tx.send(Step::HonestServed(stats));
        // The peer leaves: wait until it says it closed its connection.
        leave(&mut s, &mut stash, &src);
        let calls = turns_until(&mut s, &mut stash, OpId(1000), poll_turn);
        eprintln!("the stuck get failed as gone after {calls} progress calls");
        let mut gone = 0;
        for k in 0..=max {
            let c = wait_op(&mut s.ep, &mut stash, OpId(1000 + k));
            gone += usize::from(matches!(c.status, Err(NaError::PeerGone { .. })));
        }
        s.ep.progress(Some(Duration::from_millis(50))).unwrap();
        while let Some(c) = s.ep.pop_completion() {
            stash.insert(c.op, c);
        }
        stash.retain(|op, _| op.0 >= 1000);
        assert!(stash.is_empty(), "completed twice, or never posted: {stash:?}");
        let _ = tx.send(Step::Canceled(format!("{gone} failed as gone")));
        assert_eq!(
            gone,
            max as usize + 1,
            "of {} gets, only {gone} failed as gone",
            max + 1
        );
    });
    let [Step::HonestServed(stats), Step::Canceled(_)] = &steps[..] else {
        panic!("steps out of order: {steps:?}");
    };
    assert_eq!(
        stats.rma_offloaded,
        na_sm::RMA_QUEUE_PER_PEER as u64 + 2,
        "{stats:?}"
    );
}

/// Busy turns watched for yields once the transfer threads' pool has
/// been quiet for over a second.
const QUIET_TURNS: u64 = 2000;

/// A busy owner gives up its core to the transfer threads while their
/// pool is active, not for as long as a stalling peer holds one: its spin
/// yields after the batch, and of [`QUIET_TURNS`] busy turns made once no
/// job has started or ended for over a second, at most one per
/// `RMA_QUIET_YIELD_EVERY` does (each did before: a system call per
/// turn, and on a loaded core a time slice, for as long as the peer
/// stalled). Nor does it stop for good: a quiet pool still gets a yield
/// within that gap (a thread sharing the owner's core at real-time
/// priority runs only then; a busy owner that never yielded held its
/// healthy transfer forever). The peer that then closes its connection is
/// still noticed by such turns: its stuck get fails as gone within
/// [`stalling::GONE_WITHIN_CALLS`] of them.
#[test]
fn a_busy_owner_yields_to_a_stuck_transfer_only_now_and_then_and_still_sees_its_peer_leave() {
    let Some((mut s, kills, dir)) = scene_with("stalling-rma-yield", 1, leaving_hostile_peer) else {
        return;
    };
    let steps = run_steps(3, kills, dir, move |tx| {
        let probe = s.probe.take().expect("the scene's pool probe");
        let mut stash = HashMap::new();
        let local = MemHandle::zeroed(LEN, Access::ReadWrite);
        let (src, remote) = s.hostile.clone();
        s.ep.get(&local, 0, &remote, 0, 64, &src, OpId(10)).unwrap();
        wait_until_running(&mut s);
        // The batch made the pool active: the turn's spin yields, and its
        // progress call sees the job's start (the last change).
        busy_turn(&mut s, &mut stash);
        let active = probe.owner_yields();
        assert_eq!(active, 1, "the spin after the batch");
        std::thread::sleep(Duration::from_millis(1500));
        // This turn's spin still yields; its progress call sees the quiet.
        busy_turn(&mut s, &mut stash);
        let before = probe.owner_yields();
        let started = Instant::now();
        for _ in 0..QUIET_TURNS {
            busy_turn(&mut s, &mut stash);
        }
        let took = started.elapsed();
        let quiet = probe.owner_yields() - before;
        let _ = tx.send(Step::Counted(format!(
            "{active} yield(s) active, {quiet} in {QUIET_TURNS} quiet turns ({took:?})"
        )));
        let most = 1 + (took.as_nanos() / RMA_QUIET_YIELD_EVERY.as_nanos()) as u64;
        assert!(
            quiet <= most,
            "a busy owner yielded {quiet} times in {QUIET_TURNS} turns ({took:?}) to a pool quiet for a \
             second: at most {most}, one per {RMA_QUIET_YIELD_EVERY:?}"
        );
        // Still quiet: a yield comes within the gap (given generously).
        let before = probe.owner_yields();
        let started = Instant::now();
        while probe.owner_yields() == before {
            assert!(
                started.elapsed() < BOUND / 2,
                "a busy owner made no yield in {:?} to a pool quiet for a second (one per {RMA_QUIET_YIELD_EVERY:?})",
                BOUND / 2
            );
            busy_turn(&mut s, &mut stash);
        }
        let _ = tx.send(Step::Counted(format!(
            "a quiet yield after {:?}",
            started.elapsed()
        )));
        assert!(!stash.contains_key(&OpId(10)), "the stalling get ended");
        leave(&mut s, &mut stash, &src);
        let calls = turns_until(&mut s, &mut stash, OpId(10), busy_turn);
        let c = stash.remove(&OpId(10)).expect("the stuck get");
        assert!(
            matches!(c.status, Err(NaError::PeerGone { .. })),
            "{:?}",
            c.status
        );
        let _ = tx.send(Step::Counted(format!("gone after {calls} busy turns")));
    });
    assert!(
        matches!(&steps[..], [Step::Counted(_), Step::Counted(_), Step::Counted(_)]),
        "{steps:?}"
    );
    eprintln!("{steps:?}");
}

/// A peer whose turn was queued and then left with nothing to run (its
/// queued get canceled: its queue emptied while it waited its turn; or
/// an empty batch for it) and who then gets more is still one peer: at
/// most one of its jobs runs at a time. Two transfer threads, held by two
/// stalling peers; a third stalling peer is given an empty turn by
/// `idle_turn`, then two gets; when the first two peers die, one thread
/// takes the third's next job (and sticks), and the other must stay free
/// for the honest peer (it took the third peer's second job beside the
/// first when its turn was queued twice).
fn one_thread_per_peer_after(tag: &str, idle_turn: fn(&mut Scene, &mut HashMap<OpId, Completion>)) {
    let dir = private_dir(tag);
    let (mut ep, id) = rma_endpoint(&dir, true, 2);
    let uri = ep.self_addr(id).unwrap().uri().to_owned();
    let mut kills = Vec::new();
    let mut stalling = Vec::new();
    for k in 0..3u64 {
        let (kill, said) = fork_peer(&dir, &uri, common::stalling_peer);
        kills.push(kill);
        if said == b'U' {
            na_core::testing::report_not_run("na-sm stalling_rma: no userfaultfd for kernel faults here");
            drop(kills);
            let _ = std::fs::remove_dir_all(&dir);
            return;
        }
        stalling.push(receive_descriptor(&mut ep, id, OpId(1 + k)));
    }
    let (kill, said) = fork_peer(&dir, &uri, honest_peer);
    assert_eq!(said, b'S', "the honest peer could not start");
    kills.push(kill);
    let honest = receive_descriptor(&mut ep, id, OpId(4));
    let (g_pid, h_pid) = (kills[0].pid(), kills[1].pid());
    let mut s = Scene {
        ep,
        id,
        hostile: stalling[2].clone(),
        honest,
        hostile_status: None,
        probe: None,
    };
    let steps = run_steps(2, kills, dir, move |tx| {
        let mut stash = HashMap::new();
        let local = MemHandle::zeroed(LEN, Access::ReadWrite);
        // Both threads held.
        for (k, (src, remote)) in stalling[..2].iter().enumerate() {
            s.ep.get(&local, 0, remote, 0, 64, src, OpId(100 + k as u64))
                .unwrap();
            let end = Instant::now() + BOUND;
            while s.ep.plugin_mut(s.id).unwrap().stats().rma_jobs_running <= k as u64 {
                assert!(Instant::now() < end, "{} jobs never ran", k + 1);
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        idle_turn(&mut s, &mut stash);
        // Two gets for the third peer, behind each other.
        let (src, remote) = s.hostile.clone();
        for op in [103, 104] {
            s.ep.get(&local, 0, &remote, 0, 64, &src, OpId(op)).unwrap();
        }
        // The threads are let go, one after the other.
        for (pid, op) in [(g_pid, 100), (h_pid, 101)] {
            sys::kill(pid, libc::SIGKILL);
            wait_op(&mut s.ep, &mut stash, OpId(op));
        }
        let _ = tx.send(Step::Canceled("the first two peers' gets ended".into()));
        // One thread is free for the honest peer.
        serve_honest(&mut s, &mut stash, OpId(20), 30);
        let stats = s.ep.plugin_mut(s.id).unwrap().stats();
        let _ = tx.send(Step::HonestServed(stats));
    });
    let [Step::Canceled(_), Step::HonestServed(stats)] = &steps[..] else {
        panic!("steps out of order: {steps:?}");
    };
    assert_eq!(
        stats.rma_jobs_running, 1,
        "one job of the third peer runs: {stats:?}"
    );
    assert_eq!(stats.rma_jobs_waiting, 1, "its other waits: {stats:?}");
}

/// [`one_thread_per_peer_after`] a get that waits its turn and is
/// canceled.
#[test]
fn a_canceled_queued_job_does_not_give_its_peer_a_second_thread() {
    one_thread_per_peer_after("stalling-rma-turn", |s, stash| {
        let local = MemHandle::zeroed(LEN, Access::ReadWrite);
        let (src, remote) = s.hostile.clone();
        s.ep.get(&local, 0, &remote, 0, 64, &src, OpId(102)).unwrap();
        s.ep.cancel(s.id, OpId(102)).unwrap();
        let c = wait_op(&mut s.ep, stash, OpId(102));
        assert!(matches!(c.status, Err(NaError::Canceled)), "{:?}", c.status);
    });
}

/// [`one_thread_per_peer_after`] an empty batch (accepted, nothing to
/// move, nothing queued).
#[test]
fn an_empty_batch_does_not_give_its_peer_a_second_thread() {
    one_thread_per_peer_after("stalling-rma-empty", |s, _| {
        let (src, _) = s.hostile.clone();
        s.ep.rma(&src, &[]).unwrap();
        let stats = s.ep.plugin_mut(s.id).unwrap().stats();
        assert_eq!(
            stats.rma_jobs_waiting, 0,
            "an empty batch queued a job: {stats:?}"
        );
    });
}

/// A queued transfer that is canceled lets its local handle go at once
/// (nothing will ever write it) though other transfers of its batch stay
/// queued: one thread, held by the stalling peer; a batch of two gets
/// into two handles waits behind; the first is canceled, and its handle's
/// buffers come back while the peer still stalls (the second's stays
/// held by its job).
#[test]
fn a_canceled_queued_transfer_gives_its_handle_back() {
    let Some((mut s, kills, dir)) = scene("stalling-rma-handle", 1) else {
        return;
    };
    let steps = run_steps(1, kills, dir, move |tx| {
        let mut stash = HashMap::new();
        let local = MemHandle::zeroed(LEN, Access::ReadWrite);
        let (src, remote) = s.hostile.clone();
        s.ep.get(&local, 0, &remote, 0, 64, &src, OpId(10)).unwrap();
        wait_until_running(&mut s);
        let (a, b) = (
            MemHandle::zeroed(64, Access::ReadWrite),
            MemHandle::zeroed(64, Access::ReadWrite),
        );
        let batch = [
            na_core::Rma::get(&a, 0, &remote, 0, 64, OpId(11)),
            na_core::Rma::get(&b, 0, &remote, 0, 64, OpId(12)),
        ];
        s.ep.rma(&src, &batch).unwrap();
        s.ep.cancel(s.id, OpId(11)).unwrap();
        let c = wait_op(&mut s.ep, &mut stash, OpId(11));
        assert!(matches!(c.status, Err(NaError::Canceled)), "{:?}", c.status);
        let stats = s.ep.plugin_mut(s.id).unwrap().stats();
        assert_eq!(stats.rma_jobs_waiting, 1, "the other get waits: {stats:?}");
        a.into_buffers()
            .expect("a canceled queued get still holds its handle");
        b.into_buffers()
            .expect_err("a queued get's handle was given back");
        let _ = tx.send(Step::HonestServed(stats));
    });
    assert!(matches!(&steps[..], [Step::HonestServed(_)]), "{steps:?}");
}

/// An op id reused after a cancel names the new transfer only: one
/// thread, held by the stalling peer's get (op 10), which is canceled;
/// op 10 again, a get of the honest peer, waits behind it. When the
/// stalling peer dies its old job ends, and its outcome for op 10 (of
/// another job) is dropped: op 10 completes once, with the honest get's
/// bytes, and only those are counted.
#[test]
fn an_op_id_reused_after_a_cancel_takes_only_its_own_result() {
    let Some((mut s, kills, dir)) = scene("stalling-rma-reuse", 1) else {
        return;
    };
    let hostile_pid = kills[0].pid();
    let steps = run_steps(1, kills, dir, move |tx| {
        let mut stash = HashMap::new();
        let stuck = MemHandle::zeroed(LEN, Access::ReadWrite);
        let (src, remote) = s.hostile.clone();
        s.ep.get(&stuck, 0, &remote, 0, 64, &src, OpId(10)).unwrap();
        wait_until_running(&mut s);
        s.ep.cancel(s.id, OpId(10)).unwrap();
        let c = wait_op(&mut s.ep, &mut stash, OpId(10));
        assert!(matches!(c.status, Err(NaError::Canceled)), "{:?}", c.status);
        let local = MemHandle::zeroed(LEN, Access::ReadWrite);
        let (to, honest) = s.honest.clone();
        s.ep.get(&local, 0, &honest, 0, LEN as u64, &to, OpId(10))
            .unwrap();
        sys::kill(hostile_pid, libc::SIGKILL);
        let c = wait_op(&mut s.ep, &mut stash, OpId(10));
        c.status.expect("the honest get under the reused id");
        // What else could complete op 10 has had its chance once both
        // have been taken in: the stuck job's result (its system call is
        // counted in `rma_calls` when its result is taken, one call each
        // for it and the honest get; the one thread ran the stuck job
        // first, so this holds already) and the stalling peer's end (it
        // fails what the peer still has in the pool; the honest peer is
        // left).
        let end = Instant::now() + BOUND;
        loop {
            let stats = s.ep.plugin_mut(s.id).unwrap().stats();
            if stats.rma_calls >= 2 && stats.peers == 1 {
                break;
            }
            assert!(
                Instant::now() < end,
                "the stuck job's result or the stalling peer's end was never taken in: {stats:?}"
            );
            s.ep.progress(Some(Duration::from_millis(5))).unwrap();
            while let Some(c) = s.ep.pop_completion() {
                stash.insert(c.op, c);
            }
        }
        while let Some(c) = s.ep.pop_completion() {
            stash.insert(c.op, c);
        }
        assert!(!stash.contains_key(&OpId(10)), "op 10 completed twice");
        let mut got = vec![0u8; LEN];
        local.read_at(0, &mut got).unwrap();
        assert!(
            (0..LEN).all(|i| got[i] == pattern(i)),
            "the honest get moved wrong bytes"
        );
        let stats = s.ep.plugin_mut(s.id).unwrap().stats();
        let _ = tx.send(Step::HonestServed(stats));
    });
    let [Step::HonestServed(stats)] = &steps[..] else {
        panic!("steps out of order: {steps:?}");
    };
    assert_eq!(
        stats.get_bytes, LEN as u64,
        "only the honest get's bytes count (not the canceled job's): {stats:?}"
    );
}

/// Threads of this process named `name` (the pool names its threads
/// `qs-sm-rma-K`, K counting from 0 in each pool).
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|comm| comm.trim_end() == name)
                .count()
        })
        .unwrap_or(0)
}

/// The pool starts a thread when a peer's turn finds none free, not all
/// its threads at the first batch: gets from one peer, one after the
/// other, run on one thread of the four allowed. The pool's probe counts
/// the threads it started (a thread starts within the `rma` call that
/// needs it, so the count is final when the gets are done), and says
/// when each has named itself; then the process's threads are looked at.
/// (Other tests' pools have at most two threads: a `qs-sm-rma-3` is this
/// test's.)
#[test]
fn a_pool_starts_threads_as_peers_need_them() {
    let dir = private_dir("rma-pool-lazy");
    let (mut ep, id, probe) = common::probed_rma_endpoint(&dir, 4);
    let uri = ep.self_addr(id).unwrap().uri().to_owned();
    let (kill, said) = fork_peer(&dir, &uri, honest_peer);
    assert_eq!(said, b'S', "the honest peer could not start");
    let (to, remote) = receive_descriptor(&mut ep, id, OpId(1));
    let local = MemHandle::zeroed(LEN, Access::ReadWrite);
    let mut stash = HashMap::new();
    for op in 10..13 {
        ep.get(&local, 0, &remote, 0, LEN as u64, &to, OpId(op)).unwrap();
        wait_op(&mut ep, &mut stash, OpId(op)).status.expect("the get");
    }
    let (started, _) = probe.threads();
    // A thread names itself as it starts, before it takes the pool's lock:
    // once none is starting, every thread started has its name.
    let end = Instant::now() + BOUND;
    while probe.threads().1 > 0 {
        assert!(
            Instant::now() < end,
            "a transfer thread never took the pool's lock"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let (first, fourth) = (threads_named("qs-sm-rma-0"), threads_named("qs-sm-rma-3"));
    drop(kill);
    drop(ep);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        started, 1,
        "one peer's gets, one after the other, started {started} transfer threads"
    );
    assert!(first >= 1, "no transfer thread ran the gets");
    assert_eq!(fourth, 0, "one peer's gets started a fourth transfer thread");
}

/// Bytes of the big peer's memory: a transfer of it takes a while, so the
/// owner is asleep before it ends.
const BIG: usize = 64 << 20;

/// A peer (forked) that exposes [`BIG`] bytes (touched, so really there)
/// and sends their descriptor; then serves until killed.
fn big_peer(dir: &std::path::Path, uri: &str, status: std::fs::File) -> i32 {
    use std::os::fd::AsFd;
    let (mut ep, id) = common::busy_endpoint(dir, false);
    let Ok(to) = ep.lookup(uri) else { return 2 };
    let mem = MemHandle::new(vec![vec![0x5a; BIG]], Access::ReadOnly);
    let Ok(desc) = ep.plugin_mut(id).and_then(|p| p.mem_describe(&mem)) else {
        return 3;
    };
    if ep.send_unexpected(&to, 0, &desc.to_bytes(), OpId(1)).is_err() {
        return 4;
    }
    sys::write(status.as_fd(), b"S");
    loop {
        let _ = ep.progress(Some(Duration::from_millis(10)));
        while ep.pop_completion().is_some() {}
    }
}

/// An owner asleep in a blocking progress call is woken by a transfer
/// thread's result: a call with a long timeout returns with the get's
/// completion before that timeout. (Checked: with the threads' wake-up write removed, it
/// sleeps to the timeout.)
#[test]
fn a_blocking_owner_asleep_is_woken_by_a_transfer_threads_result() {
    let dir = private_dir("rma-pool-wake");
    let cfg = na_sm::SmConfig {
        listen: true,
        rma_threads: Some(1),
        ..na_sm::SmConfig::default()
    }
    .with_dir(&dir);
    let mut ep = Endpoint::new(na_core::ProgressMode::Blocking).unwrap();
    let id = ep
        .add_plugin(|id| Ok(Box::new(na_sm::SmPlugin::new(id, cfg)?) as Box<dyn na_core::Plugin>))
        .unwrap();
    let uri = ep.self_addr(id).unwrap().uri().to_owned();
    let (kill, said) = fork_peer(&dir, &uri, big_peer);
    assert_eq!(said, b'S', "the peer could not start");
    let (src, remote) = receive_descriptor(&mut ep, id, OpId(1));
    let local = MemHandle::zeroed(BIG, Access::ReadWrite);
    for round in 0..3u64 {
        let op = OpId(10 + round);
        ep.get(&local, 0, &remote, 0, BIG as u64, &src, op).unwrap();
        // Each call sleeps until something wakes it, or to its timeout:
        // the result must be that something.
        let t0 = Instant::now();
        let mut got = None;
        while got.is_none() && t0.elapsed() < BOUND {
            ep.progress(Some(BOUND)).unwrap();
            got = std::iter::from_fn(|| ep.pop_completion()).find(|c| c.op == op);
        }
        let took = t0.elapsed();
        let c = got.unwrap_or_else(|| panic!("round {round}: the get never completed"));
        c.status.expect("the get");
        assert!(
            took < BOUND,
            "round {round}: the owner slept to its timeout ({took:?}): the result did not wake it"
        );
    }
    let mut last = [0u8; 1];
    local.read_at(BIG as u64 - 1, &mut last).unwrap();
    assert_eq!(last, [0x5a]);
    drop(kill);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Inline mode (no transfer threads, the default): the get of the
/// stalling memory holds the caller's thread until the peer ends. The
/// known limit that `SmConfig::rma_threads` lifts: ignored, as it holds a
/// thread for [`BOUND`]; run with `--ignored` to see it.
#[test]
#[ignore = "inline mode: the known limit; run with --ignored"]
fn inline_mode_a_stalling_peer_holds_the_caller() {
    let Some((mut s, kills, dir)) = scene("stalling-rma-inline", 0) else {
        return;
    };
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let local = MemHandle::zeroed(LEN, Access::ReadWrite);
        s.ep.plugin_mut(s.id).unwrap().mem_register(&local).unwrap();
        let (src, remote) = s.hostile.clone();
        let _ = s.ep.get(&local, 0, &remote, 0, LEN as u64, &src, OpId(10));
        let _ = tx.send(());
    });
    let held = rx.recv_timeout(BOUND).is_err();
    drop(kills);
    let _ = worker.join();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(held, "the inline get came back while the peer's memory stalled");
}
