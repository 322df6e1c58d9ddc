//! The task that drives an [`AsyncEngine`](super::AsyncEngine): turns of progress and
//! `trigger` while there is work (and for the spin window after it), then
//! a sleep on the endpoint's fd, armed by every plugin; and what happens
//! when it ends.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;

use super::Shared;
use crate::sys::async_fd::OwnedByArc;

/// Lives as long as the driver task's future: when it ends (an error
/// waiting on the fd, a panic, or the runtime shutting down, which drops
/// the task), every call waiting fails at once (its sender is dropped)
/// and later calls are refused.
pub(super) struct DriverExit {
    pub(super) shared: Arc<Shared>,
    /// The reason, once the driver knows it (else the task was dropped or
    /// panicked).
    pub(super) reason: Option<String>,
}

impl Drop for DriverExit {
    fn drop(&mut self) {
        let mut w = self.shared.waiters();
        // Set already when the AsyncEngine was dropped: the usual end.
        let reason = self.reason.take();
        let calls = w.calls.len();
        self.shared.mark_stopped(&mut w, || {
            let why = reason.unwrap_or_else(|| {
                if std::thread::panicking() {
                    "the driver task panicked (or its runtime was dropped during a panic)".into()
                } else {
                    "the driver task was dropped (its tokio runtime shut down)".into()
                }
            });
            tracing::warn!(reason = %why, calls, "hg-rpc driver stopped; calls in flight fail");
            why
        });
    }
}

/// How long the driver's turns may keep failing (progress, `trigger` or
/// arming for sleep: a transport whose event set broke, say) before the
/// driver stops and its calls fail with [`RpcError::DriverStopped`](crate::RpcError::DriverStopped) and
/// the cause, instead of the driver spinning on the failure while calls
/// time out. Failures less than [`DRIVER_FAILURE_GAP`] apart count as one
/// run (a broken transport fails only the turns that reach the broken
/// part); a longer gap ends the run.
pub const DRIVER_FAILURE_LIMIT: Duration = Duration::from_secs(1);

/// See [`DRIVER_FAILURE_LIMIT`].
pub const DRIVER_FAILURE_GAP: Duration = Duration::from_millis(250);

/// The driver's pause after a failed turn.
const DRIVER_FAILURE_BACKOFF: Duration = Duration::from_millis(1);

pub(super) async fn drive(
    shared: Arc<Shared>,
    afd: AsyncFd<OwnedByArc<Shared>>,
    mut exit: DriverExit,
    spin: Duration,
) {
    // The current run of failed turns (progress, trigger or arming): when
    // it began and when its last failure was.
    let mut failing: Option<(Instant, Instant)> = None;
    // With a spin window: when a turn last found work (the driver keeps
    // turning, without arming the plugins, until `spin` has passed since).
    let mut last_work: Option<Instant> = None;
    // Work first, then sleep: the engine may have been used before it was
    // spawned (its plugins disarmed, their messages waiting without a
    // signal), and only `try_wait` arms them for the fd to wake us.
    loop {
        let expiry;
        loop {
            let turn = {
                let mut e = shared.engine();
                let held = e.held_input_bytes();
                let worked = e.progress_now().and_then(|p| Ok(p + e.trigger()?));
                shared.spawn_deferred(&mut e);
                shared.notify_finished(&mut e);
                shared.drain_may_have_moved(&e);
                shared.room_may_have_come(&e, held);
                // A failed turn never sleeps: the fd might never wake it.
                worked.and_then(|n| {
                    if !spin.is_zero() {
                        let now = Instant::now();
                        if n > 0 {
                            last_work = Some(now);
                        }
                        if last_work.is_some_and(|t| now.duration_since(t) < spin) {
                            // Inside the window: turn again, plugins unarmed
                            // (a peer's next message needs no signal).
                            return Ok(None);
                        }
                    }
                    e.try_wait().map(|sleep| {
                        sleep.then(|| {
                            // Woken when room comes back (the hook
                            // `spawn` set), the driver needs no deadline
                            // while spilled outputs wait for it.
                            let at = e.next_expiry();
                            // Under the lock: work done outside this task
                            // from now on knows when we wake.
                            shared.sleeping_until(at);
                            at
                        })
                    })
                })
            };
            match turn {
                Ok(Some(at)) => {
                    expiry = at;
                    break;
                }
                // Turn again (inside the spin window, or a plugin said
                // not to sleep) behind every task the turn woke; the
                // runtime polls its I/O driver first (a system call per
                // turn: see docs/PERFORMANCE.md on why not less).
                Ok(None) => tokio::task::yield_now().await,
                Err(err) => {
                    let now = Instant::now();
                    let (began, last) = match failing {
                        Some((began, last)) if now.duration_since(last) < DRIVER_FAILURE_GAP => (began, now),
                        _ => {
                            tracing::warn!(error = %na_core::ErrorChain(&err), "hg-rpc driver: progress failed");
                            (now, now)
                        }
                    };
                    failing = Some((began, last));
                    if now.duration_since(began) >= DRIVER_FAILURE_LIMIT {
                        tracing::error!(error = %na_core::ErrorChain(&err), "hg-rpc driver: progress kept failing; the driver stops");
                        exit.reason = Some(format!(
                            "progress kept failing for {DRIVER_FAILURE_LIMIT:?} (the transport is broken): {}",
                            na_core::ErrorChain(&err)
                        ));
                        return;
                    }
                    // Not a hot loop: a transient failure gets time to pass.
                    tokio::time::sleep(DRIVER_FAILURE_BACKOFF).await;
                }
            }
        }
        // Sleeps until the fd is readable, or until a kept spilled output
        // or abandoned input expires (then `trigger` lets it go: without
        // this, only the next traffic would).
        let wake = async {
            tokio::select! {
                r = afd.readable() => Some(r),
                () = shared.rearm.notified() => None,
            }
        };
        let until = async {
            match expiry {
                None => wake.await,
                Some(at) => tokio::time::timeout_at(tokio::time::Instant::from_std(at), wake)
                    .await
                    .ok()
                    .flatten(),
            }
        };
        let readable = counting_sleep(until, &shared.sleeps).await;
        // The next turn asks the engine's next expiry anew before it
        // sleeps: work done outside it need not wake it meanwhile.
        shared.woke();
        if let Some(readable) = readable {
            match readable {
                // Clear first, then work until the plugins agree to sleep:
                // an event after the clear sets readiness again.
                Ok(mut ready) => ready.clear_ready(),
                Err(e) => {
                    tracing::error!(error = %na_core::ErrorChain(&e), "hg-rpc driver: waiting on the endpoint fd failed");
                    exit.reason = Some(format!(
                        "waiting on the endpoint fd failed: {}",
                        na_core::ErrorChain(&e)
                    ));
                    return;
                }
            }
        }
    }
}

/// Awaits `wait`, adding one to `sleeps` if it was not ready at its first
/// poll: a wake-up already pending when the driver comes to sleep (a
/// stored `rearm` permit, readiness set during the last turn) is no sleep,
/// and `RpcStats::driver_sleeps` counts only the real ones.
async fn counting_sleep<F: Future>(wait: F, sleeps: &AtomicU64) -> F::Output {
    let mut wait = std::pin::pin!(wait);
    let mut counted = false;
    std::future::poll_fn(|cx| {
        let poll = wait.as_mut().poll(cx);
        if poll.is_pending() && !counted {
            counted = true;
            sleeps.fetch_add(1, Ordering::Relaxed);
        }
        poll
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait that is over at once (a stored notification) is not
    /// counted; one that has to wait is counted once, however often it
    /// is polled before it ends.
    #[tokio::test]
    async fn only_waits_that_wait_are_counted_as_sleeps() {
        let sleeps = AtomicU64::new(0);
        let notify = tokio::sync::Notify::new();
        notify.notify_one();
        counting_sleep(notify.notified(), &sleeps).await;
        assert_eq!(
            sleeps.load(Ordering::Relaxed),
            0,
            "a stored permit counted as a sleep"
        );

        let notify = Arc::new(tokio::sync::Notify::new());
        let waker = {
            let notify = notify.clone();
            tokio::spawn(async move {
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                notify.notify_one();
            })
        };
        let spurious = async {
            // Pending on three polls (woken each time) before it waits.
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
            notify.notified().await;
        };
        counting_sleep(spurious, &sleeps).await;
        waker.await.unwrap();
        assert_eq!(sleeps.load(Ordering::Relaxed), 1);
    }
}
