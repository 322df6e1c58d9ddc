//! Test hooks for hostile-peer tests (`#[doc(hidden)]`): what a peer
//! may do to its own side of a connection, done to ours. Compiled only
//! with the `test-hooks` feature (on for this crate's own tests, through
//! its dev-dependency on itself), so a normal build cannot call them.

use na_core::{Addr, NaError, Result, Tag};

use super::SmPlugin;

impl SmPlugin {
    /// Test hook for hostile-peer tests: overwrites the control pages, rings
    /// and buffers of our connection to `peer` (the real shared mapping the
    /// peer reads) with pseudo-random bytes from `seed`, then wakes the peer.
    /// Never use outside tests: it destroys the connection.
    #[doc(hidden)]
    pub fn debug_scribble(&mut self, peer: &Addr, seed: u64) -> Result<()> {
        let conn = self.debug_conn(peer)?;
        crate::channel::scribble(&conn.region, seed);
        conn.wake_peer().map_err(|e| NaError::sys("eventfd write", e))?;
        Ok(())
    }

    /// Test hook for hostile-peer tests: publishes to `peer` an unexpected
    /// message with tag `tag` that names buffer 0 without reserving it (a
    /// protocol violation the receiver finds when it frees the buffer),
    /// then wakes the peer. Never use outside tests.
    #[doc(hidden)]
    pub fn debug_forge_unreserved(&mut self, peer: &Addr, tag: Tag) -> Result<()> {
        let conn = self.debug_conn(peer)?;
        assert!(
            conn.backlog.is_empty(),
            "debug_forge_unreserved: sends are queued"
        );
        let mut tx_cur = conn.tx_cur;
        conn.tx().forge_unreserved(&mut tx_cur, tag);
        conn.tx_cur = tx_cur;
        conn.wake_peer().map_err(|e| NaError::sys("eventfd write", e))?;
        Ok(())
    }

    /// Test hook for hostile-peer tests: closes the read end of our own
    /// wake-up pipe for `peer`, so that its wake-up writes fail with
    /// `EPIPE`, as if we had exited. Pipe wake-ups only (eventfd: an
    /// error). Never use outside tests.
    #[doc(hidden)]
    pub fn debug_deafen(&mut self, peer: &Addr) -> Result<()> {
        let conn = self.debug_conn(peer)?;
        let crate::sys::wake::OwnWake::Pipe { read, .. } = &mut conn.my_wake else {
            return Err(NaError::sys(
                "debug_deafen",
                std::io::Error::other("needs pipe wake-ups (SmConfig::wake)"),
            ));
        };
        let null = std::fs::File::open("/dev/null").map_err(|e| NaError::sys("open /dev/null", e))?;
        *read = std::os::fd::OwnedFd::from(null);
        Ok(())
    }

    /// Test hook for hostile-peer tests: tells `peer` we wait for room
    /// (without arming anything), so that it tries to wake us when it next
    /// hands slots back. Never use outside tests.
    #[doc(hidden)]
    pub fn debug_want_wake(&mut self, peer: &Addr) -> Result<()> {
        let conn = self.debug_conn(peer)?;
        conn.tx()
            .tx_waiting()
            .store(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// Test hook for hostile-peer tests: does `t` to the eventfd we wake
    /// `peer` on (the peer's: what a hostile peer may do to its victim's
    /// eventfd). An error before the peer's eventfd came (a connector's
    /// before the acknowledgement) or with pipe wake-ups. Never use
    /// outside tests.
    #[doc(hidden)]
    pub fn debug_tamper_peer_wake(&mut self, peer: &Addr, t: crate::sys::eventfd::WakeTamper) -> Result<()> {
        let conn = self.debug_conn(peer)?;
        let Some(wake) = &conn.peer_wake else {
            return Err(NaError::sys(
                "debug_tamper_peer_wake",
                std::io::Error::other("no wake-up descriptor of the peer yet"),
            ));
        };
        wake.tamper(t)
            .map_err(|e| NaError::sys("debug_tamper_peer_wake", e))
    }

    /// Test hook for hostile-peer tests: does `t` to the eventfd `peer`
    /// wakes us on (ours, whose description the peer shares: what a
    /// hostile peer may do to the eventfd its victim writes). Never use
    /// outside tests.
    #[doc(hidden)]
    pub fn debug_tamper_own_wake(&mut self, peer: &Addr, t: crate::sys::eventfd::WakeTamper) -> Result<()> {
        let conn = self.debug_conn(peer)?;
        conn.my_wake
            .tamper(t)
            .map_err(|e| NaError::sys("debug_tamper_own_wake", e))
    }

    /// Test hook: whether `peer` has raised its sleep flag on the channel
    /// we send it on (it armed for a sleep, and a message from us will
    /// write its wake-up descriptor). Never use outside tests.
    #[doc(hidden)]
    pub fn debug_peer_sleeps(&mut self, peer: &Addr) -> Result<bool> {
        let conn = self.debug_conn(peer)?;
        Ok(conn.tx().rx_waiting().load(std::sync::atomic::Ordering::SeqCst) != 0)
    }

    /// Test hook: how many blocking waits of [`Plugin::sleep`](na_core::Plugin::sleep)
    /// an event of a wake-up descriptor ended. Each should be a peer's
    /// signal (its `PluginStats::signals_sent`), none the report epoll
    /// makes of an eventfd when it is added. Never use outside tests.
    #[doc(hidden)]
    pub fn debug_wakeups(&self) -> u64 {
        self.wakeups
    }

    /// Test hook: how many accepted connections wait for their hello (a
    /// listener's pending handshakes), so that a test can wait until its
    /// connection was accepted rather than for a while. Never use outside
    /// tests.
    #[doc(hidden)]
    pub fn debug_pending_handshakes(&self) -> usize {
        self.pending.len()
    }

    /// Test hook: a probe of the RMA transfer-thread pool's shared state
    /// (made now if no batch made it yet); an error without transfer
    /// threads (`SmConfig::rma_threads` 0). Never use outside tests.
    #[doc(hidden)]
    pub fn debug_rma_pool(&mut self) -> Result<crate::rma::RmaPoolProbe> {
        if self.rma_threads == 0 {
            return Err(NaError::Plugin {
                plugin: "sm",
                message: "no RMA transfer threads (SmConfig::rma_threads is 0)".into(),
            });
        }
        Ok(self.rma_pool()?.probe())
    }

    /// Test hook: a probe of the listener's accept pause (see
    /// [`ListenerProbe`](crate::connect::ListenerProbe)), to take before
    /// the plugin goes into an `Endpoint`. Never use outside tests.
    #[doc(hidden)]
    pub fn debug_listener_probe(&mut self) -> crate::connect::ListenerProbe {
        let pause = self.accept_pause;
        self.listener_hooks.probe(pause)
    }

    fn debug_conn(&mut self, peer: &Addr) -> Result<&mut crate::conn::Conn> {
        let p = self
            .peers
            .get_mut(peer.token())
            .ok_or_else(|| NaError::PeerGone {
                peer: peer.uri().into(),
                reason: "not connected".into(),
            })?;
        p.conns.first_mut().ok_or_else(|| NaError::PeerGone {
            peer: peer.uri().into(),
            reason: "no connection".into(),
        })
    }
}
