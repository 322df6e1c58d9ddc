//! The listener's test hook, defined once here so that no function of the
//! plugin carries a `cfg` (as the RMA pool's, `rma::hooks`): with the
//! `test-hooks` feature, `ListenerHooks` mirrors the accept pause for
//! the `ListenerProbe` a test took (`SmPlugin::debug_listener_probe`),
//! if it took one; without it, a unit struct whose every method is an
//! `#[inline(always)]` no-op, which the compiler removes with its call.

#[cfg(feature = "test-hooks")]
mod imp {
    use std::sync::atomic::{AtomicU8, Ordering};
    use std::sync::Arc;

    use crate::connect::AcceptPause;

    /// The listener's test hook (see the module docs), in the plugin.
    #[derive(Default)]
    pub(crate) struct ListenerHooks {
        /// Where the accept pause is mirrored for the probe handed out,
        /// if one was.
        seen: Option<Arc<AtomicU8>>,
    }

    impl ListenerHooks {
        /// No probe handed out yet.
        pub fn new() -> ListenerHooks {
            ListenerHooks::default()
        }

        /// The accept pause is now `pause`: the probe, if there is one,
        /// sees it.
        pub fn pause_set(&self, pause: Option<AcceptPause>) {
            if let Some(seen) = &self.seen {
                seen.store(ListenerProbe::encode(pause), Ordering::SeqCst);
            }
        }

        /// A probe of the accept pause, `pause` now (every probe handed
        /// out shares one mirror).
        pub fn probe(&mut self, pause: Option<AcceptPause>) -> ListenerProbe {
            let seen = self
                .seen
                .get_or_insert_with(|| Arc::new(AtomicU8::new(ListenerProbe::encode(pause))));
            ListenerProbe {
                seen: Arc::clone(seen),
            }
        }
    }

    /// Test hook (`test-hooks` feature): the listener's accept pause seen from
    /// outside the plugin (see `SmPlugin::debug_listener_probe`), so that a
    /// test can wait until the listener paused, or until it takes connections
    /// in, rather than for a while: a paused listener is out of the epoll set
    /// and nothing happens that a test could wait for instead.
    #[doc(hidden)]
    #[derive(Clone, Debug)]
    pub struct ListenerProbe {
        seen: Arc<AtomicU8>,
    }

    impl ListenerProbe {
        const RUNNING: u8 = 0;
        const HANDSHAKES: u8 = 1;
        const RETRY: u8 = 2;
        const QUEUED: u8 = 3;

        /// `pause` as the probe keeps it.
        fn encode(pause: Option<AcceptPause>) -> u8 {
            match pause {
                None => Self::RUNNING,
                Some(AcceptPause::Handshakes) => Self::HANDSHAKES,
                Some(AcceptPause::Until(_)) => Self::RETRY,
                Some(AcceptPause::Queued) => Self::QUEUED,
            }
        }

        fn now(&self) -> u8 {
            self.seen.load(Ordering::SeqCst)
        }

        /// Whether the listener is paused now (out of the epoll set: new
        /// connections wait in the kernel's queue), for any reason.
        pub fn paused(&self) -> bool {
            self.now() != Self::RUNNING
        }

        /// Whether it is paused because departed peers' queued messages reached
        /// `SmConfig::max_queued_total` (until the application takes some).
        pub fn paused_for_queued_total(&self) -> bool {
            self.now() == Self::QUEUED
        }
    }
}

#[cfg(not(feature = "test-hooks"))]
mod imp {
    use crate::connect::AcceptPause;

    /// No hook (a user's build): nothing is mirrored.
    pub(crate) struct ListenerHooks;

    impl ListenerHooks {
        /// The only value.
        #[inline(always)]
        pub fn new() -> ListenerHooks {
            ListenerHooks
        }

        /// Nothing to tell.
        #[inline(always)]
        pub fn pause_set(&self, _pause: Option<AcceptPause>) {}
    }
}

pub(crate) use imp::ListenerHooks;
#[cfg(feature = "test-hooks")]
pub use imp::ListenerProbe;
