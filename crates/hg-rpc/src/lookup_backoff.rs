//! The pauses between the tries of a lookup that would wait to connect,
//! shared by the blocking engine (which drives itself meanwhile) and the
//! tokio front end (which pauses without the engine lock).

use std::time::{Duration, Instant};

#[cfg(doc)]
use crate::AsyncEngine;

/// The first pause of a lookup that would wait to connect (see
/// [`AsyncEngine::lookup`]) before it tries again; each later pause is
/// twice the one before, up to [`LOOKUP_RETRY_MAX`].
pub(crate) const LOOKUP_RETRY_FIRST: Duration = Duration::from_millis(1);

/// See [`LOOKUP_RETRY_FIRST`].
pub(crate) const LOOKUP_RETRY_MAX: Duration = Duration::from_millis(20);

/// The pauses between the tries of a lookup that would wait to connect:
/// [`LOOKUP_RETRY_FIRST`], then each twice the one before up to
/// [`LOOKUP_RETRY_MAX`], never past what the caller has left. Shared by
/// the async engine's pauses (without the lock) and the blocking ones
/// (driving the engine or a handler's endpoint meanwhile).
pub(crate) struct LookupBackoff {
    next: Duration,
}

impl LookupBackoff {
    /// Before the first pause.
    pub(crate) fn new() -> Self {
        LookupBackoff {
            next: LOOKUP_RETRY_FIRST,
        }
    }

    /// The next pause, cut to `left` (the caller's time left; `None`: no
    /// bound), or `None` once nothing is left.
    pub(crate) fn next_pause(&mut self, left: Option<Duration>) -> Option<Duration> {
        let pause = match left {
            Some(left) if left.is_zero() => return None,
            Some(left) => self.next.min(left),
            None => self.next,
        };
        self.next = (self.next * 2).min(LOOKUP_RETRY_MAX);
        Some(pause)
    }

    /// The next pause before `deadline`, spent in `drive(wait)` (called
    /// until the pause has passed, with what is left of it: progress
    /// that may return early). `Ok(false)`, driving nothing, once
    /// `deadline` has passed.
    pub(crate) fn drive_pause<E>(
        &mut self,
        deadline: Instant,
        mut drive: impl FnMut(Duration) -> std::result::Result<(), E>,
    ) -> std::result::Result<bool, E> {
        let Some(pause) = self.next_pause(Some(deadline.saturating_duration_since(Instant::now()))) else {
            return Ok(false);
        };
        let retry_at = Instant::now() + pause;
        loop {
            let wait = retry_at.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                return Ok(true);
            }
            drive(wait)?;
        }
    }
}

#[cfg(test)]
mod backoff_tests {
    use super::*;

    #[test]
    fn lookup_pauses_double_up_to_the_cap_and_never_pass_what_is_left() {
        let ms = Duration::from_millis;
        let mut b = LookupBackoff::new();
        let pauses: Vec<_> = (0..7).map(|_| b.next_pause(None).unwrap()).collect();
        assert_eq!(pauses, [1, 2, 4, 8, 16, 20, 20].map(ms));
        let mut b = LookupBackoff::new();
        assert_eq!(b.next_pause(Some(ms(5))), Some(ms(1)));
        assert_eq!(b.next_pause(Some(ms(1))), Some(ms(1)), "cut to what is left");
        assert_eq!(b.next_pause(Some(Duration::ZERO)), None);
        let past = Instant::now();
        assert_eq!(
            b.drive_pause::<()>(past, |_| unreachable!("nothing left")),
            Ok(false)
        );
        // The next pause (4 ms) is spent driving, in steps that return early.
        // (A loaded host may oversleep the first step past the whole
        // pause: a second step is owed only if the first ended before it.)
        let (t0, mut calls, mut first_ended) = (Instant::now(), 0, None);
        let paused = b.drive_pause::<()>(t0 + Duration::from_secs(5), |wait| {
            calls += 1;
            std::thread::sleep(wait.min(ms(1)));
            first_ended.get_or_insert_with(|| t0.elapsed());
            Ok(())
        });
        assert_eq!(paused, Ok(true));
        assert!(t0.elapsed() >= ms(4), "{:?}", t0.elapsed());
        let first_ended = first_ended.expect("driven at least once");
        // (The pause began a moment after t0: one that ended before t0 +
        // 4 ms surely ended before the pause did.)
        assert!(
            calls >= 2 || first_ended >= ms(4),
            "driven again until the pause passed: {calls} steps, the first ended at {first_ended:?}"
        );
        assert_eq!(
            b.drive_pause(t0 + Duration::from_secs(5), |_| Err("broken")),
            Err("broken")
        );
    }
}
