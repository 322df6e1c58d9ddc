//! The plugin's side of its test hooks, defined once here so that no
//! function carries a `cfg` (as [`VerbsConfigHooks`](crate::config::hooks::VerbsConfigHooks)
//! on the configuration's): [`CmReadAhead`] holds the RDMA CM events
//! `VerbsPlugin::debug_cm_disconnects_waiting` (`test-hooks` feature
//! only) read off the channel and the plugin has not acted on yet. With
//! the feature, a queue; without it, an empty struct whose
//! [`pop`](CmReadAhead::pop) is an `#[inline(always)]` `None`, which the
//! compiler removes with the loop that asks it.

#[cfg(feature = "test-hooks")]
mod imp {
    use std::collections::VecDeque;

    use crate::sys::{CmEvent, CmEventKind};

    /// RDMA CM events read ahead by a test hook, in the order read.
    #[derive(Default)]
    pub(crate) struct CmReadAhead {
        events: VecDeque<CmEvent>,
    }

    impl CmReadAhead {
        /// The oldest event read ahead and not acted on yet.
        #[inline(always)]
        pub(crate) fn pop(&mut self) -> Option<CmEvent> {
            self.events.pop_front()
        }

        /// Keeps `ev` (read ahead) for the next call that reads CM events.
        pub(crate) fn push(&mut self, ev: CmEvent) {
            self.events.push_back(ev);
        }

        /// How many of the events kept are disconnects.
        pub(crate) fn disconnects(&self) -> usize {
            self.events
                .iter()
                .filter(|e| e.kind == CmEventKind::Disconnected)
                .count()
        }
    }
}

#[cfg(not(feature = "test-hooks"))]
mod imp {
    use crate::sys::CmEvent;

    /// No hook (a user's build): nothing is ever read ahead.
    #[derive(Default)]
    pub(crate) struct CmReadAhead {
        /// Keeps the struct unbuildable but by `Default`.
        _none: (),
    }

    impl CmReadAhead {
        /// Never an event (no `test-hooks` feature).
        #[inline(always)]
        pub(crate) fn pop(&mut self) -> Option<CmEvent> {
            None
        }
    }
}

pub(crate) use imp::CmReadAhead;
