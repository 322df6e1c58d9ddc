//! The examples leave nothing behind and survive a hostile client: the
//! server an example's client starts is reaped when the client gives up
//! and dies when the client is killed, and the blob store refuses a blob
//! bigger than its maximum (before allocating it) and keeps serving.
//!
//! The example binaries are the ones cargo built next to this test
//! (`target/<profile>/examples/`): `cargo test` and `cargo nextest run` of
//! the package build them (`--test examples_robust` alone does not).

mod common;

#[path = "../examples/shared/server.rs"]
mod server;

#[allow(dead_code)]
#[path = "../examples/shared/blob.rs"]
mod blob;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use hg_rpc::{BulkDesc, Rpc, RpcError};
use na_core::{Access, RemoteMem, RemoteSegment};
use server::ServerProcess;

const T: Duration = Duration::from_secs(20);

fn modified(p: &Path) -> SystemTime {
    let m = std::fs::metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    m.modified().unwrap()
}

/// The built example `name`; fails if it is missing or older than its
/// sources.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // This test is target/<profile>/deps/examples_robust-<hash>.
    let profile = exe.parent().and_then(Path::parent).unwrap();
    let bin = profile.join("examples").join(name);
    let build = "cargo build -p hg-rpc --examples";
    assert!(bin.exists(), "{} is not built: {build}", bin.display());
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let shared = std::fs::read_dir(src.join("shared"))
        .unwrap()
        .map(|e| e.unwrap().path());
    for s in shared.chain([src.join(format!("{name}.rs"))]) {
        assert!(
            modified(&s) <= modified(&bin),
            "{} is older than {}: {build}",
            bin.display(),
            s.display()
        );
    }
    bin
}

/// Whether process `pid` still runs (a zombie nobody reaped does not).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name's closing parenthesis.
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z')),
        Err(_) => false,
    }
}

/// Waits up to `limit` for `pid` to end; whether it did.
fn ends_within(pid: u32, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    while alive(pid) {
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

#[test]
fn the_demo_server_dies_when_its_client_is_killed() {
    let dir = common::dir("demo-orphan");
    let mut client = Command::new(example("demo"))
        .env("QS_SM_DIR", &dir)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // "server sm://... (pid N), client sm://..."
    let mut line = String::new();
    BufReader::new(client.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let pid: u32 = line
        .split_once("(pid ")
        .and_then(|(_, r)| r.split_once(')'))
        .and_then(|(p, _)| p.parse().ok())
        .unwrap_or_else(|| panic!("no server pid in {line:?}"));
    client.kill().unwrap();
    client.wait().unwrap();
    if !ends_within(pid, Duration::from_secs(5)) {
        // SAFETY: kill(2) reads no memory.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        panic!("the demo server (pid {pid}) outlived its killed client by 5 s");
    }
}

#[test]
fn a_server_process_is_killed_and_reaped_when_dropped_unwaited() {
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "echo ADDR sm://x; exec sleep 60"]);
    let s = ServerProcess::spawn(cmd).unwrap();
    assert_eq!(s.addr().unwrap(), "sm://x");
    let pid = s.id();
    assert!(alive(pid));
    let t = Instant::now();
    drop(s);
    // Killed and reaped by the drop itself: no zombie, no waiting.
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "the drop waited for the process to end"
    );
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "pid {pid} left behind"
    );
}

#[test]
fn a_server_process_that_fails_is_an_error() {
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "echo ADDR sm://x; exit 3"]);
    let err = ServerProcess::spawn(cmd).unwrap().wait_ok().unwrap_err();
    assert!(err.to_string().contains("exit status: 3"), "{err}");
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "exit 0"]);
    assert!(ServerProcess::spawn(cmd).is_err(), "no address line is an error");
}

/// `blob.put` with the descriptor written out, so it can claim any size.
struct ForgedPut;
impl Rpc for ForgedPut {
    const NAME: &'static str = blob::Put::NAME;
    type Input = (String, BulkDesc);
    type Output = u64;
}

#[test]
fn the_blobstore_refuses_a_blob_over_its_maximum_and_keeps_serving() {
    let dir = common::dir("blob-max");
    let mut cmd = Command::new(example("blobstore"));
    cmd.args(["serve", "sm://"]).env("QS_SM_DIR", &dir);
    let srv = ServerProcess::spawn(cmd).unwrap();
    let mut c = common::client(&dir);
    let to = c.endpoint().lookup(srv.addr().unwrap()).unwrap();
    for size in [1 << 45, blob::MAX_BLOB + 1] {
        let seg = RemoteSegment {
            addr: 4096,
            len: size,
            key: 0,
        };
        let mem = RemoteMem::new(vec![seg], Access::ReadOnly).unwrap().to_bytes();
        let desc = BulkDesc {
            owner: c.self_addr().to_string(),
            mem: serde_bytes::ByteBuf::from(mem),
            inline: None,
        };
        match c.call::<ForgedPut>(&to, &("huge".to_string(), desc), T) {
            Err(RpcError::Handler { message, .. }) if message.contains("larger than the maximum") => {}
            other => panic!("a put of {size} bytes: {other:?}"),
        }
    }
    assert_eq!(c.call::<blob::Stat>(&to, &"huge".to_string(), T).unwrap(), None);
    c.call::<blob::Quit>(&to, &(), T).unwrap();
    srv.wait_ok().unwrap();
}
