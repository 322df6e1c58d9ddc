//! `VerbsConfig`'s test hooks, defined once here so that no function
//! carries a `cfg` (as na-sm's `SmConfigHooks`): [`VerbsConfigHooks`] is
//! the type of the one `#[doc(hidden)]` field
//! [`VerbsConfig::debug`](crate::VerbsConfig::debug). With the
//! `test-hooks` feature it holds the switches that make the plugin ignore
//! handshake events, offer more responder resources than the device
//! allows or fail messages on purpose, public fields a test sets; without
//! it, an empty struct that nothing re-exports (a user's build can
//! neither name it nor set anything in it) whose every method is an
//! `#[inline(always)]` "no": `false`, or the value the plugin would use
//! anyway, which the compiler folds away with its branch. `Default` both
//! ways, so `VerbsConfig::default` names it without a `cfg`.

#[cfg(feature = "test-hooks")]
mod imp {
    /// Test hooks of a [`VerbsConfig`](crate::VerbsConfig) (`test-hooks`
    /// feature only): failures soft-RoCE offers no way to provoke.
    /// Default: none of them.
    #[derive(Clone, Debug, Default)]
    pub struct VerbsConfigHooks {
        /// The passive side ignores RDMA CM's `Established` events, as if
        /// the peer's ready-to-use message were lost.
        pub ignore_established: bool,
        /// The responder resources the passive side offers in its accept,
        /// not bounded by the device. A value past the device's
        /// `max_qp_rd_atom` makes `rdma_accept` fail after the QP and
        /// buffers were set up (the failure the accept path must reject
        /// on).
        pub accept_responder_resources: Option<u8>,
        /// A message whose payload is longer than this is not posted but
        /// fails at its completion as a failed `ibv_post_send` would
        /// (`ENOMEM`), its connection left up, the message and its
        /// destination given back in the completion (as every such
        /// failure gives them; see [`Completion::source`](na_core::Completion)).
        pub fail_msgs_over: Option<usize>,
        /// With [`fail_msgs_over`](Self::fail_msgs_over), how many
        /// messages fail (then the hook lets them all through); `None`:
        /// every one.
        pub fail_msgs_count: Option<usize>,
    }

    impl VerbsConfigHooks {
        /// Whether to ignore an `Established` event
        /// ([`ignore_established`](Self::ignore_established) and the
        /// connection is on the passive side: `passive`, asked only when
        /// the switch is on).
        #[inline(always)]
        pub(crate) fn ignores_established(&self, passive: impl FnOnce() -> bool) -> bool {
            self.ignore_established && passive()
        }

        /// The responder resources to offer in an accept: `r`, unless
        /// [`accept_responder_resources`](Self::accept_responder_resources)
        /// overrides it.
        #[inline(always)]
        pub(crate) fn responder(&self, r: u8) -> u8 {
            self.accept_responder_resources.unwrap_or(r)
        }

        /// Whether a message of `len` payload bytes is to fail instead of
        /// being posted ([`fail_msgs_over`](Self::fail_msgs_over)); counts
        /// it against [`fail_msgs_count`](Self::fail_msgs_count) when so.
        #[inline(always)]
        pub(crate) fn fail_send(&mut self, len: usize) -> bool {
            let fail = self.fail_msgs_over.is_some_and(|max| len > max)
                && self.fail_msgs_count.is_none_or(|n| n > 0);
            if fail {
                if let Some(n) = self.fail_msgs_count.as_mut() {
                    *n -= 1;
                }
            }
            fail
        }
    }
}

#[cfg(not(feature = "test-hooks"))]
mod imp {
    /// No hooks (a user's build): nothing to set, nothing overridden.
    #[derive(Clone, Debug, Default)]
    pub struct VerbsConfigHooks {
        /// Keeps the struct unbuildable but by `Default`.
        _none: (),
    }

    impl VerbsConfigHooks {
        /// Never (no `test-hooks` feature); `passive` is not asked.
        #[inline(always)]
        pub(crate) fn ignores_established(&self, _passive: impl FnOnce() -> bool) -> bool {
            false
        }

        /// `r` (no `test-hooks` feature).
        #[inline(always)]
        pub(crate) fn responder(&self, r: u8) -> u8 {
            r
        }

        /// Never (no `test-hooks` feature).
        #[inline(always)]
        pub(crate) fn fail_send(&mut self, _len: usize) -> bool {
            false
        }
    }
}

pub use imp::VerbsConfigHooks;

#[cfg(test)]
mod tests {
    use super::VerbsConfigHooks;

    #[test]
    fn the_defaults_override_nothing() {
        let mut h = VerbsConfigHooks::default();
        assert!(!h.ignores_established(|| true));
        assert_eq!(h.responder(3), 3);
        assert!(!h.fail_send(usize::MAX));
    }

    #[cfg(feature = "test-hooks")]
    #[test]
    fn the_switches_fail_as_many_messages_over_the_size_as_counted() {
        let mut h = VerbsConfigHooks {
            ignore_established: true,
            accept_responder_resources: Some(254),
            fail_msgs_over: Some(10),
            fail_msgs_count: Some(2),
        };
        assert!(h.ignores_established(|| true));
        assert!(!h.ignores_established(|| false), "the active side never ignores");
        assert_eq!(h.responder(3), 254);
        assert!(!h.fail_send(10), "not over the size");
        assert!(h.fail_send(11));
        assert!(h.fail_send(4096));
        assert!(!h.fail_send(11), "the count is spent");
        assert_eq!(h.fail_msgs_count, Some(0));
        h.fail_msgs_count = None;
        assert!((0..5).all(|_| h.fail_send(11)), "no count: every one fails");
    }
}
