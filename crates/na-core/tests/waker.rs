//! `Endpoint::waker`: another thread ends an endpoint's sleep, in every
//! progress mode, over a real plugin (na-sm, listening, no peer: nothing
//! else wakes it); a wake-up posted before the sleep is not lost, and
//! many coalesce into one (the sleep after it sleeps).

mod common;

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::sys::readable;
use na_core::{Endpoint, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

/// What a sleep that was woken must stay well under: the sleeps below ask
/// for 60 s (or no limit), so a return within this was the wake-up's.
/// Generous, for a loaded machine: not a speed check.
const WOKEN_WITHIN: Duration = Duration::from_secs(20);

/// A directory for the plugin's socket, removed when dropped.
struct Dir(std::path::PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An endpoint in `mode` with one listening sm plugin (which then sleeps
/// on its own primitive unless a waker exists).
fn endpoint(tag: &str, mode: ProgressMode) -> (Endpoint, Dir) {
    let d = std::env::temp_dir().join(format!("qs-na-core-waker-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let mut ep = Endpoint::new(mode).unwrap();
    let cfg = SmConfig {
        listen: true,
        ..SmConfig::default()
    }
    .with_dir(&d);
    ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    (ep, Dir(d))
}

const MODES: [ProgressMode; 3] = [
    ProgressMode::Blocking,
    ProgressMode::Adaptive {
        spin: na_core::DEFAULT_ADAPTIVE_SPIN,
    },
    ProgressMode::Busy,
];

/// A thread wakes the endpoint once `progress` has begun (after a pause,
/// so that it sleeps, or spins, first); `progress(timeout)` returns,
/// after the wake-up was posted and well before its timeout, and the
/// wake-up is spent: the next `progress` sleeps.
fn woken_in_progress(mode: ProgressMode, timeout: Option<Duration>) {
    let (mut ep, _d) = endpoint(&format!("{mode}-{}", timeout.is_some()), mode);
    let waker = ep.waker().unwrap();
    let posted = Arc::new(AtomicBool::new(false));
    let wake = std::thread::spawn({
        let posted = posted.clone();
        move || {
            std::thread::sleep(Duration::from_millis(300));
            posted.store(true, Ordering::SeqCst);
            waker.wake().unwrap();
        }
    });
    let t0 = Instant::now();
    let n = ep.progress(timeout).unwrap();
    let took = t0.elapsed();
    assert!(
        posted.load(Ordering::SeqCst),
        "{mode}: progress returned ({n}) after {took:?}, before the wake-up was posted"
    );
    assert!(
        took < WOKEN_WITHIN,
        "{mode}: the wake-up did not end the sleep: progress returned after {took:?}"
    );
    assert_eq!(n, 0, "{mode}: nothing but the wake-up happened");
    wake.join().unwrap();
    // Taken as it woke the sleep: the next one sleeps its whole timeout.
    let pause = Duration::from_millis(300);
    let t0 = Instant::now();
    assert_eq!(ep.progress(Some(pause)).unwrap(), 0);
    let slept = t0.elapsed();
    assert!(
        slept >= pause,
        "{mode}: woken again, after {slept:?}, by the wake-up it had"
    );
}

#[test]
fn a_wake_from_another_thread_ends_a_progress_sleep_in_every_mode() {
    for mode in MODES {
        woken_in_progress(mode, Some(Duration::from_secs(60)));
    }
}

#[test]
fn a_wake_ends_a_blocking_sleep_without_a_timeout() {
    woken_in_progress(ProgressMode::Blocking, None);
}

/// A wake-up posted while nobody sleeps ends the next sleep: `progress`
/// returns at once, in every mode, and so does `try_wait` say false (once).
#[test]
fn a_wake_posted_before_the_sleep_is_not_lost() {
    for mode in MODES {
        let (mut ep, _d) = endpoint(&format!("before-{mode}"), mode);
        let waker = ep.waker().unwrap();
        std::thread::spawn(move || waker.wake().unwrap()).join().unwrap();
        let t0 = Instant::now();
        assert_eq!(ep.progress(Some(Duration::from_secs(60))).unwrap(), 0);
        let took = t0.elapsed();
        assert!(
            took < WOKEN_WITHIN,
            "{mode}: the wake-up posted before was lost ({took:?})"
        );
    }
    let (mut ep, _d) = endpoint("before-try-wait", ProgressMode::Blocking);
    let waker = ep.waker().unwrap();
    assert!(ep.try_wait().unwrap(), "nothing pending: may sleep");
    waker.wake().unwrap();
    assert!(!ep.try_wait().unwrap(), "a wake-up pending: look first");
    assert!(ep.try_wait().unwrap(), "taken: may sleep again");
}

/// Many wake-ups from several threads before the sleeper looks: one
/// `progress` returns for all of them, and the next one sleeps its whole
/// timeout (the eventfd was drained, the flag lowered).
#[test]
fn many_wakes_coalesce_and_the_next_sleep_sleeps() {
    for mode in MODES {
        let (mut ep, _d) = endpoint(&format!("coalesce-{mode}"), mode);
        let waker = ep.waker().unwrap();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let w = waker.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        w.wake().unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let t0 = Instant::now();
        assert_eq!(ep.progress(Some(Duration::from_secs(60))).unwrap(), 0);
        assert!(
            t0.elapsed() < WOKEN_WITHIN,
            "{mode}: not woken ({:?})",
            t0.elapsed()
        );
        let pause = Duration::from_millis(300);
        let t0 = Instant::now();
        assert_eq!(ep.progress(Some(pause)).unwrap(), 0);
        let slept = t0.elapsed();
        assert!(
            slept >= pause,
            "{mode}: the sleep after the wake-ups were taken ended after {slept:?}, before its timeout"
        );
    }
}

/// A loop of the caller's own: `try_wait`, then a sleep on the endpoint's
/// fd. A wake-up after `try_wait` said yes makes the fd readable (the
/// sleep ends); the next `try_wait` takes it, says no once, and the fd is
/// no longer readable.
#[test]
fn a_wake_makes_the_endpoint_fd_readable_for_a_loop_of_ones_own() {
    let (mut ep, _d) = endpoint("own-loop", ProgressMode::Blocking);
    let waker = ep.waker().unwrap();
    assert!(ep.try_wait().unwrap());
    assert!(!readable(ep.as_fd(), 0), "idle: the fd is not readable");
    let wake = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        waker.wake().unwrap();
    });
    assert!(
        readable(ep.as_fd(), WOKEN_WITHIN.as_millis() as i32),
        "the wake-up did not make the fd readable"
    );
    wake.join().unwrap();
    assert_eq!(ep.progress_now().unwrap(), 0);
    assert!(!ep.try_wait().unwrap(), "the wake-up is taken by try_wait");
    assert!(ep.try_wait().unwrap());
    assert!(!readable(ep.as_fd(), 0), "taken: the fd is quiet again");
}

/// A waker outlives its endpoint harmlessly, and every call hands out a
/// clone of one waker (one eventfd in the set); waking it then reaches
/// no endpoint made since (its eventfd stays open, so no descriptor of
/// theirs takes its number).
#[test]
fn a_waker_outlives_its_endpoint() {
    let (mut ep, d) = endpoint("outlive", ProgressMode::Blocking);
    let a = ep.waker().unwrap();
    let b = ep.waker().unwrap();
    b.wake().unwrap();
    assert!(!ep.try_wait().unwrap(), "a clone's wake-up reaches the endpoint");
    drop(ep);
    drop(d);
    a.wake().unwrap();
    b.wake().unwrap();
    // The old wakers keep their eventfd open, so a new endpoint's
    // descriptors never take its number: waking them reaches no one else.
    let (mut other, _d2) = endpoint("outlive-other", ProgressMode::Blocking);
    let _own = other.waker().unwrap();
    assert!(other.try_wait().unwrap(), "a new endpoint, nothing pending");
    for w in [&a, &b, &a] {
        w.wake().unwrap();
    }
    assert!(
        !readable(other.as_fd(), 0),
        "a dropped endpoint's waker woke another endpoint"
    );
    assert!(other.try_wait().unwrap(), "no wake-up reached the new endpoint");
}

/// Wake-ups racing the sleeper: another thread posts one per round at
/// whatever point the sleeper has reached (taking the last one in
/// `try_wait`, arming, entering `epoll_wait`, asleep), and waits for the
/// sleeper to see it before the next. Each round's blocking `progress`
/// must return because of that round's wake-up: one lost in any window
/// between the take and the sleep would leave the sleep to its (long)
/// timeout, and the round would fail.
#[test]
fn wakes_racing_the_sleep_are_never_lost() {
    const ROUNDS: u64 = 20_000;
    let (mut ep, _d) = endpoint("race", ProgressMode::Blocking);
    let waker = ep.waker().unwrap();
    let posted = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let poster = std::thread::spawn({
        let (posted, seen, stop) = (posted.clone(), seen.clone(), stop.clone());
        move || {
            for round in 1..=ROUNDS {
                // Vary where the wake-up lands in the sleeper's turn.
                for _ in 0..(round % 7) * 50 {
                    std::hint::spin_loop();
                }
                if round % 3 == 0 {
                    std::thread::yield_now();
                }
                posted.store(round, Ordering::SeqCst);
                waker.wake().unwrap();
                while seen.load(Ordering::SeqCst) < round {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    std::thread::yield_now();
                }
            }
        }
    });
    let mut round = 0;
    while round < ROUNDS {
        let want = round + 1;
        let t0 = Instant::now();
        while posted.load(Ordering::SeqCst) < want {
            ep.progress(Some(Duration::from_secs(60))).unwrap();
            if posted.load(Ordering::SeqCst) < want && t0.elapsed() >= WOKEN_WITHIN {
                stop.store(true, Ordering::SeqCst);
                panic!("round {want}: no wake-up ended the sleep within {WOKEN_WITHIN:?}");
            }
        }
        if t0.elapsed() >= WOKEN_WITHIN {
            stop.store(true, Ordering::SeqCst);
            panic!(
                "round {want}: the wake-up was lost (the sleep ended after {:?}, at its timeout)",
                t0.elapsed()
            );
        }
        round = want;
        seen.store(round, Ordering::SeqCst);
    }
    poster.join().unwrap();
}
