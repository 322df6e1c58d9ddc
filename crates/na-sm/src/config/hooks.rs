//! `SmConfig`'s test hooks, defined once here so that no function carries
//! a `cfg` (as the RMA pool's, `rma::hooks`, and the listener's,
//! `connect::hooks`): [`SmConfigHooks`] is the type of the one
//! `#[doc(hidden)]` field [`SmConfig::debug`](crate::SmConfig::debug).
//! With the `test-hooks` feature it holds the exit-watch overrides, public
//! fields a test sets; without it, an empty struct that the crate root
//! does not re-export (a user's build can neither name it nor set
//! anything in it) whose every method is an `#[inline(always)]` `false`,
//! which the compiler removes with its branch. `Default` both ways, so
//! `SmConfig::default` names it without a `cfg`.

#[cfg(feature = "test-hooks")]
mod imp {
    /// Test hooks of an [`SmConfig`](crate::SmConfig) (`test-hooks`
    /// feature only): how peers' exits are watched, overridden for tests
    /// of the paths older kernels take. Default: no override.
    #[derive(Clone, Debug, Default)]
    pub struct SmConfigHooks {
        /// Watch peers' exits as on kernels without `SO_PEERPIDFD`:
        /// through `pidfd_open` of the peer's pid, checked against its
        /// start time (`$QS_SM_PIDFD=pid` does the same, in every build).
        pub pidfd_by_pid: bool,
        /// Watch peers' exits as on kernels without pidfds: by the
        /// end-of-file of their sockets only (wins over `pidfd_by_pid`).
        /// A peer that handed its socket to a child before it died is
        /// then seen to go only when the child does.
        pub exits_by_eof_only: bool,
    }

    impl SmConfigHooks {
        /// [`pidfd_by_pid`](Self::pidfd_by_pid).
        #[inline(always)]
        pub(crate) fn by_pid(&self) -> bool {
            self.pidfd_by_pid
        }

        /// [`exits_by_eof_only`](Self::exits_by_eof_only).
        #[inline(always)]
        pub(crate) fn eof_only(&self) -> bool {
            self.exits_by_eof_only
        }
    }
}

#[cfg(not(feature = "test-hooks"))]
mod imp {
    /// No hooks (a user's build): nothing to set, nothing overridden.
    #[derive(Clone, Debug, Default)]
    pub struct SmConfigHooks {
        /// Keeps the struct unbuildable but by `Default`.
        _none: (),
    }

    impl SmConfigHooks {
        /// Never (no `test-hooks` feature).
        #[inline(always)]
        pub(crate) fn by_pid(&self) -> bool {
            false
        }

        /// Never (no `test-hooks` feature).
        #[inline(always)]
        pub(crate) fn eof_only(&self) -> bool {
            false
        }
    }
}

pub use imp::SmConfigHooks;
