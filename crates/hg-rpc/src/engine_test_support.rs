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
