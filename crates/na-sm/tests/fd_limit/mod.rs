//! What the descriptor-exhaustion tests share: lowering this process's
//! descriptor limit, and serving the client process's one request once
//! descriptors are back. Each such test is the only one in its binary
//! (the limit is per process).

use std::io::BufRead;
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use na_core::{Endpoint, OpId, Plugin, PluginId, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

use crate::common::sys;

/// A listening sm plugin on a blocking endpoint, with its own socket
/// directory (`qs-sm-<tag>-<pid>` in the temporary directory, mode 0700):
/// the endpoint, the plugin, its URI and the directory.
pub fn listener(tag: &str) -> (Endpoint, PluginId, String, PathBuf) {
    let dir = std::env::temp_dir().join(format!("qs-sm-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let cfg = SmConfig {
        listen: true,
        ..SmConfig::default()
    }
    .with_dir(&dir);
    let mut srv = Endpoint::new(ProgressMode::Blocking).unwrap();
    let sid = srv
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    (srv, sid, uri, dir)
}

/// Sets the soft descriptor limit to `cur`; returns the limits before.
pub fn set_fd_limit(cur: libc::rlim_t) -> libc::rlimit {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    assert_eq!(sys::getrlimit(libc::RLIMIT_NOFILE, &mut old), 0);
    let new = libc::rlimit {
        rlim_cur: cur,
        rlim_max: old.rlim_max,
    };
    assert_eq!(sys::setrlimit(libc::RLIMIT_NOFILE, &new), 0);
    old
}

/// Waits for the client's request (it must hold `want`), answers it with
/// `ok` under tag 7, and keeps serving until the client process exits;
/// then checks it exited well and printed `CLIENT OK` (on `out`, its
/// stdout).
pub fn serve_request_until_exit(srv: &mut Endpoint, child: &mut Child, out: &mut impl BufRead, want: &[u8]) {
    let end = Instant::now() + Duration::from_secs(20);
    let req = loop {
        assert!(Instant::now() < end, "the client's request never arrived");
        srv.progress(Some(Duration::from_millis(100))).unwrap();
        if let Some(c) = srv.pop_completion() {
            break c;
        }
    };
    assert_eq!(req.buf.as_deref(), Some(want));
    srv.send_expected(req.source.as_ref().unwrap(), 7, b"ok", OpId(2))
        .unwrap();
    let end = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < end, "the client did not finish");
        srv.progress(Some(Duration::from_millis(50))).unwrap();
        while srv.pop_completion().is_some() {}
    }
    let status = child.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(out, &mut rest).unwrap();
    assert!(status.success() && rest.contains("CLIENT OK"), "client: {rest}");
}
