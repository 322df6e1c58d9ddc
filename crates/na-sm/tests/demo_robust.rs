//! The NA demo's server (`na_demo serve`) survives a hostile client: a
//! forged transfer request (a descriptor claiming 4 EiB, one of unmapped
//! memory, a malformed one) or an unknown request gets an empty reply,
//! and the server goes on serving. It used to allocate the claimed size
//! first (the allocation failure aborted it) and to exit on any request
//! it could not serve.
//!
//! The example binary is the one cargo built next to this test
//! (`target/<profile>/examples/`): `cargo test` and `cargo nextest run`
//! of the package build it (`--test demo_robust` alone does not).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use na_core::{Access, Addr, Endpoint, OpId, OpKind, ProgressMode, RemoteMem, RemoteSegment};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::private_dir;

const T: Duration = Duration::from_secs(20);
const PING: u8 = 1;
const PULL: u8 = 2;
const PUSH: u8 = 3;

/// The built example `na_demo`; fails if it is missing or older than its
/// source.
fn example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // This test is target/<profile>/deps/demo_robust-<hash>.
    let profile = exe.parent().and_then(Path::parent).unwrap();
    let bin = profile.join("examples").join("na_demo");
    let build = "cargo build -p na-sm --examples";
    assert!(bin.exists(), "{} is not built: {build}", bin.display());
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/na_demo.rs");
    let modified = |p: &Path| std::fs::metadata(p).unwrap().modified().unwrap();
    assert!(
        modified(&src) <= modified(&bin),
        "{} is older than {}: {build}",
        bin.display(),
        src.display()
    );
    bin
}

/// The server process, killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One request and its reply (an expected message under `tag`), or why
/// none came.
fn call(ep: &mut Endpoint, srv: &Addr, tag: u32, req: &[u8]) -> Result<Vec<u8>, String> {
    let (recv, send) = (OpId(u64::from(tag) << 1), OpId(u64::from(tag) << 1 | 1));
    ep.post_recv_expected(srv, tag, Vec::with_capacity(64), recv)
        .map_err(|e| na_core::ErrorChain(&e).to_string())?;
    ep.send_unexpected(srv, tag, req, send)
        .map_err(|e| na_core::ErrorChain(&e).to_string())?;
    let end = Instant::now() + T;
    loop {
        while let Some(c) = ep.pop_completion() {
            if let Err(e) = &c.status {
                return Err(format!("{:?} failed: {}", c.kind, na_core::ErrorChain(e)));
            }
            if c.kind == OpKind::RecvExpected && c.op == recv {
                return c.buf.ok_or_else(|| "no buffer".to_string());
            }
        }
        if Instant::now() > end {
            return Err(format!("no reply within {T:?}"));
        }
        ep.progress(Some(Duration::from_millis(100)))
            .map_err(|e| na_core::ErrorChain(&e).to_string())?;
    }
}

fn forged(addr: u64, len: u64) -> Vec<u8> {
    let seg = RemoteSegment { addr, len, key: 0 };
    RemoteMem::new(vec![seg], Access::ReadWrite).unwrap().to_bytes()
}

#[test]
fn the_demo_server_answers_forged_requests_and_keeps_serving() {
    let dir = private_dir("demo-robust");
    let mut child = Command::new(example())
        .arg("serve")
        .env("QS_SM_DIR", &dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn na_demo serve");
    let stdout = child.stdout.take().unwrap();
    let server = Server(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let uri = line.trim().strip_prefix("ADDR ").expect("ADDR line").to_owned();
    let mut ep = Endpoint::new(ProgressMode::default()).unwrap();
    let cfg = SmConfig::default().with_dir(&dir);
    ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?))).unwrap();
    let srv = ep.lookup(&uri).unwrap();
    let huge = forged(4096, 1 << 62);
    // Below vm.mmap_min_addr: never mapped, so the transfer fails.
    let unmapped = forged(4096, 4096);
    let hostile: [(&str, Vec<u8>); 6] = [
        ("a pull of 4 EiB", [&[PULL][..], &huge].concat()),
        ("a push of 4 EiB", [&[PUSH][..], &huge].concat()),
        ("a pull of unmapped memory", [&[PULL][..], &unmapped].concat()),
        ("a malformed descriptor", vec![PULL, b'Q', b'M']),
        ("an unknown request", vec![0x77]),
        ("an empty request", Vec::new()),
    ];
    for (tag, (what, req)) in (1u32..).zip(hostile) {
        match call(&mut ep, &srv, tag, &req) {
            Ok(reply) => assert!(reply.is_empty(), "{what}: a reply of {} bytes", reply.len()),
            Err(e) => panic!("{what}: {e}"),
        }
    }
    // Still serving.
    let ping = [PING, 1, 2, 3, 4];
    assert_eq!(call(&mut ep, &srv, 100, &ping).unwrap(), ping);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
