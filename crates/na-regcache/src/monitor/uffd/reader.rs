//! The reader thread: steps 1-4 of the module docs of [`super`] ("Why
//! lookups can never see a stale registration"), allocation-free.

use std::io;
use std::sync::atomic::Ordering::SeqCst;

use super::Shared;
use crate::sys::uffd::{self, UffdEvent, UffdMsg};

/// The reader thread: allocation-free after start.
pub(super) fn reader_loop(s: &Shared) {
    let mut buf = [UffdMsg::default(); 64];
    while !s.stop.load(SeqCst) {
        let (ready, _woken) = match uffd::poll_readable(s.uffd.as_raw_fd(), s.wake.as_raw_fd(), -1) {
            Ok(r) => r,
            Err(_) => {
                s.counters[4].fetch_add(1, SeqCst);
                continue;
            }
        };
        if !ready {
            continue;
        }
        let round = s.started.fetch_add(1, SeqCst) + 1;
        loop {
            match s.uffd.read_events(&mut buf) {
                Ok(0) => break,
                Ok(n) => buf[..n].iter().for_each(|m| handle(s, m.decode())),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    s.counters[4].fetch_add(1, SeqCst);
                    break;
                }
            }
        }
        s.finished.store(round, SeqCst);
    }
}

fn handle(s: &Shared, ev: UffdEvent) {
    match ev {
        UffdEvent::Unmap { start, end } => {
            s.counters[0].fetch_add(1, SeqCst);
            s.forget(start as usize, end as usize);
            s.sinks.dispatch(start as usize, end as usize);
        }
        UffdEvent::Remove { start, end } => {
            s.counters[1].fetch_add(1, SeqCst);
            // Before the invalidation: a miss that inserts after it must see the mark.
            s.mark_settling(start as usize, end as usize);
            s.sinks.dispatch(start as usize, end as usize);
        }
        UffdEvent::Remap { from, len, .. } => {
            s.counters[2].fetch_add(1, SeqCst);
            let (from, to) = (from as usize, from.saturating_add(len) as usize);
            s.forget(from, to);
            s.sinks.dispatch(from, to);
        }
        UffdEvent::Pagefault { .. } | UffdEvent::Fork | UffdEvent::Unknown(_) => {
            s.counters[3].fetch_add(1, SeqCst);
        }
    }
}
