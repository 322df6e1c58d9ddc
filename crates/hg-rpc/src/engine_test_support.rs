//! Set-up shared by the engine's unit tests.

use std::path::PathBuf;

use super::Engine;

/// A busy-polling server engine (listening) and a client engine over
/// real sm plugins in a new directory named by `tag` (the caller
/// removes it), and the server's address as the client sees it.
pub(crate) fn sm_pair(tag: &str) -> (PathBuf, Engine, Engine, na_core::Addr) {
    let dir = std::env::temp_dir().join(format!("hg-rpc-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = |listen| {
        na_sm::SmConfig {
            listen,
            ..na_sm::SmConfig::default()
        }
        .with_dir(&dir)
    };
    let mode = na_core::ProgressMode::Busy;
    let srv = Engine::shared_memory(cfg(true), mode).unwrap();
    let mut c = Engine::shared_memory(cfg(false), mode).unwrap();
    let s = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    (dir, srv, c, s)
}

/// Puts a spilled response from `src` to call `cookie`, one `e` has no
/// call for, behind the spilled outputs that wait for room in the pull
/// budget: the next time budget comes back (a pull's end, a deferred
/// request answered), it is not pulled but released, a release notice
/// sent to `src` (which waits for a retry if the transport refuses it).
pub(crate) fn queue_unwanted_output(e: &mut Engine, src: &na_core::Addr, cookie: u64) {
    use crate::header::{Status, FLAG_RESPONSE, FLAG_SPILL};
    e.output_waits.push_back(super::WaitingOutput {
        src: src.clone(),
        header: super::header(FLAG_RESPONSE | FLAG_SPILL, Status::Ok, 0, cookie),
        payload: Vec::new(),
    });
}
