//! The RMA thread pool's test hooks, defined once here so that no
//! function of the pool carries a `cfg`: with the `test-hooks` feature,
//! [`Hooks`] holds the switches and counters `RmaPoolProbe` sets and
//! reads; without it, a unit struct whose every method is an
//! `#[inline(always)]` no-op (no hook fails anything, nothing is
//! counted), which the compiler removes with its call.

#[cfg(feature = "test-hooks")]
mod imp {
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

    /// The pool's test hooks (see the module docs), in its shared state.
    #[derive(Default)]
    pub(crate) struct Hooks {
        /// Starting a thread fails (see `RmaPoolProbe::fail_spawns`).
        fail_spawns: AtomicBool,
        /// How many of the next duplicates of a peer's pidfd for its jobs
        /// fail (see `RmaPoolProbe::fail_pidfd_dups`).
        fail_pidfd_dups: AtomicUsize,
        /// Jobs that a thread started with a pidfd to check (see
        /// `RmaPoolProbe::pidfd_checked_jobs`).
        pidfd_checked_jobs: AtomicU64,
        /// Times the owner gave up its core for the transfer threads (see
        /// `RmaPoolProbe::owner_yields`).
        owner_yields: AtomicU64,
    }

    impl Hooks {
        /// No failure asked for, nothing counted yet.
        pub fn new() -> Hooks {
            Hooks::default()
        }

        /// Whether starting a transfer thread must fail now.
        pub fn spawn_fails(&self) -> bool {
            self.fail_spawns.load(Ordering::Relaxed)
        }

        /// Whether this duplicate of a peer's pidfd must fail (one of the
        /// failures asked for is used up if so).
        pub fn pidfd_dup_fails(&self) -> bool {
            self.fail_pidfd_dups
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
        }

        /// A thread starts a job (`checks_pidfd`: one that checks its
        /// peer's pidfd first).
        pub fn job_started(&self, checks_pidfd: bool) {
            if checks_pidfd {
                self.pidfd_checked_jobs.fetch_add(1, Ordering::Relaxed);
            }
        }

        /// The owner gives up its core for the transfer threads.
        pub fn owner_yielded(&self) {
            self.owner_yields.fetch_add(1, Ordering::Relaxed);
        }

        /// See `RmaPoolProbe::fail_spawns`.
        pub fn set_fail_spawns(&self, fail: bool) {
            self.fail_spawns.store(fail, Ordering::Relaxed);
        }

        /// See `RmaPoolProbe::fail_pidfd_dups`.
        pub fn set_fail_pidfd_dups(&self, n: usize) {
            self.fail_pidfd_dups.store(n, Ordering::Relaxed);
        }

        /// See `RmaPoolProbe::pidfd_dup_failures_left`.
        pub fn pidfd_dup_failures_left(&self) -> usize {
            self.fail_pidfd_dups.load(Ordering::Relaxed)
        }

        /// See `RmaPoolProbe::pidfd_checked_jobs`.
        pub fn pidfd_checked_jobs(&self) -> u64 {
            self.pidfd_checked_jobs.load(Ordering::Relaxed)
        }

        /// See `RmaPoolProbe::owner_yields`.
        pub fn owner_yields(&self) -> u64 {
            self.owner_yields.load(Ordering::Relaxed)
        }
    }
}

#[cfg(not(feature = "test-hooks"))]
mod imp {
    /// No hooks (a user's build): nothing fails, nothing is counted.
    pub(crate) struct Hooks;

    impl Hooks {
        /// The only value.
        #[inline(always)]
        pub fn new() -> Hooks {
            Hooks
        }

        /// Never.
        #[inline(always)]
        pub fn spawn_fails(&self) -> bool {
            false
        }

        /// Never.
        #[inline(always)]
        pub fn pidfd_dup_fails(&self) -> bool {
            false
        }

        /// Nothing to count.
        #[inline(always)]
        pub fn job_started(&self, _checks_pidfd: bool) {}

        /// Nothing to count.
        #[inline(always)]
        pub fn owner_yielded(&self) {}
    }
}

pub(crate) use imp::Hooks;
