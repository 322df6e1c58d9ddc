//! Stopping an [`AsyncEngine`]: draining it (requests taken go on to
//! their answers, new ones are refused) and shutting it down for good
//! (driver stopped, handlers dropped).

use std::time::Duration;

use super::*;

impl AsyncEngine {
    /// Stops the engine for good, while it is still referenced: the
    /// driver stops, calls waiting fail at once and later calls,
    /// transfers, registrations, lookups and [`expose`](Self::expose) are
    /// refused, with
    /// [`RpcError::DriverStopped`] whose reason names this method; and
    /// every handler, plain and async, is taken out and dropped, with what
    /// its closure captured. Dropping the `AsyncEngine` afterwards then
    /// releases the engine (its listener, connections and shared memory)
    /// even if a handler held an `Arc` of it: call this before dropping an
    /// engine whose handlers hold it (see [`register_async`](Self::register_async)).
    /// To let requests taken finish first, [`begin_drain`](Self::begin_drain)
    /// and await [`drained`](Self::drained) before.
    ///
    /// The handlers are dropped once the engine's locks are let go, so a
    /// closure whose drop ends the last reference to anything (this engine
    /// included) takes no lock held here. A handler task still running
    /// keeps its handler, and what it captured, until it returns (its
    /// calls on this engine fail at once), and its answer may not reach
    /// its caller. Requests not yet handed to a handler are not answered.
    /// Calling it again does nothing. From a plain handler of this engine
    /// it fails with [`RpcError::HandlerReentry`] and changes nothing.
    pub fn shutdown(&self) -> Result<()> {
        let (plain, asynchronous) = {
            let mut e = self.shared.try_engine("AsyncEngine::shutdown")?;
            let mut w = self.shared.waiters();
            // Under the engine lock, which lookups and `expose` hold while
            // they check it: none starts after.
            self.shared.shut_down.store(true, Ordering::Release);
            self.shared.mark_stopped(&mut w, || SHUT_DOWN.into());
            drop(w);
            // Both under the engine lock, which registrations hold while
            // they check that the engine runs: none comes after.
            let plain = e.take_handlers();
            let asynchronous = std::mem::take(
                &mut *self
                    .shared
                    .async_handlers
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()),
            );
            (plain, asynchronous)
        };
        // No lock held: the driver's exit takes the waiters' lock if the
        // task is dropped at once.
        self.driver.abort();
        drop(plain);
        drop(asynchronous);
        Ok(())
    }

    /// Stops taking requests (see [`Engine::begin_drain`]): each new one
    /// is answered "busy"; the ones taken go on to their answers. Then
    /// await [`drained`](Self::drained) and drop the engine.
    pub fn begin_drain(&self) -> Result<()> {
        self.shared.try_engine("AsyncEngine::begin_drain")?.begin_drain();
        Ok(())
    }

    /// Waits, at most `grace`, until the engine is drained (see
    /// [`Engine::drained`]: every request it took is answered, every
    /// spilled output pulled, every answer, release notice and
    /// acknowledgement handed to the transport and sent), while
    /// the driver goes on serving. True if it is; false if `grace` passed
    /// first (or [`begin_drain`](Self::begin_drain) was never called).
    /// It looks again after each turn of the driver and each answer of an
    /// async handler (and at least every [`DRAIN_RECHECK`]), not in a loop.
    /// A driver that stopped (nothing moves any more) is
    /// [`RpcError::DriverStopped`] at once, unless the engine is drained.
    pub async fn drained(&self, grace: Duration) -> Result<bool> {
        let start = tokio::time::Instant::now();
        loop {
            // Registered before the look: a wake-up between the look and
            // the wait is not lost.
            let moved = self.shared.drain_moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            {
                let e = self.shared.try_engine("AsyncEngine::drained")?;
                if e.drained() {
                    return Ok(true);
                }
                self.shared.check_running_quiet("AsyncEngine::drained")?;
                if !e.is_draining() || start.elapsed() >= grace {
                    return Ok(false);
                }
            }
            let left = grace.saturating_sub(start.elapsed());
            let _ = self
                .shared
                .timer(|| tokio::time::timeout(left.min(DRAIN_RECHECK), moved))
                .await;
        }
    }
}
