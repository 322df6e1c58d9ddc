//! The examples leave nothing behind and survive a hostile client: the
//! server an example's client starts is reaped when the client gives up
//! and dies when the client is killed, and the blob store refuses a blob
//! bigger than its maximum (before allocating it) and keeps serving. The
//! blob store's client checks what it reads: a server that corrupts a
//! blob, or answers another checksum, makes it fail with an error naming
//! the blob (not a panic, and not "verified").
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
        let _ = common::sys::kill(pid, libc::SIGKILL);
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

/// How the lying server of [`lying_server`] lies.
#[derive(Clone, Copy)]
enum Lie {
    /// `get` pushes the blob with one byte flipped.
    FlippedByte,
    /// `put` stores honestly but answers another checksum.
    PutChecksum,
}

/// A blob store in a thread of this process that lies as `lie` says (and
/// is otherwise honest); stops when `stop` is set. Returns its address.
fn lying_server(
    dir: &Path,
    lie: Lie,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> (String, std::thread::JoinHandle<()>) {
    use std::collections::HashMap;
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Mutex};
    let (ep, id) = common::endpoint(dir, true);
    let mut e = hg_rpc::Engine::new(ep, id).unwrap();
    let store: Arc<Mutex<HashMap<String, Vec<u8>>>> = Arc::default();
    let s = store.clone();
    e.register_with_bulk::<blob::Put>(move |ctx, (key, from)| {
        let local = ctx.expose(vec![vec![0; from.size() as usize]], Access::WriteOnly)?;
        ctx.transfer(hg_rpc::BulkOp::Pull, &from, 0, &local, 0, from.size())?;
        let data = local.into_buffers().map_err(|_| "in use")?.concat();
        let sum = blob::checksum(&data);
        s.lock().unwrap().insert(key, data);
        Ok(match lie {
            Lie::PutChecksum => sum ^ 1,
            Lie::FlippedByte => sum,
        })
    })
    .unwrap();
    let s = store.clone();
    e.register_with_bulk::<blob::Get>(move |ctx, (key, into)| {
        let mut data = s.lock().unwrap().get(&key).cloned().ok_or("no such blob")?;
        if let Lie::FlippedByte = lie {
            let mid = data.len() / 2;
            data[mid] ^= 0x40;
        }
        let len = data.len() as u64;
        let local = ctx.expose(vec![data], Access::ReadOnly)?;
        ctx.transfer(hg_rpc::BulkOp::Push, &into, 0, &local, 0, len)?;
        Ok(len)
    })
    .unwrap();
    let s = store;
    e.register::<blob::Stat>(move |key| {
        Ok(s.lock()
            .unwrap()
            .get(&key)
            .map(|d| (d.len() as u64, blob::checksum(d))))
    })
    .unwrap();
    let addr = e.self_addr().to_string();
    let t = std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            e.progress(Some(Duration::from_millis(10))).unwrap();
            e.trigger().unwrap();
        }
    });
    (addr, t)
}

/// Runs the blob store's client against a server that lies as `lie` says,
/// and returns its exit status and everything it printed.
fn client_against(tag: &str, lie: Lie) -> (std::process::ExitStatus, String) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = common::dir(tag);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let (addr, server) = lying_server(&dir, lie, stop.clone());
    let out = Command::new(example("blobstore"))
        .args(["--connect", &addr])
        .env("QS_SM_DIR", &*dir)
        .output()
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    server.join().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains("panicked"), "the client panicked:\n{text}");
    (out.status, text)
}

#[test]
fn the_blobstore_client_detects_a_corrupted_read() {
    let (status, text) = client_against("blob-flipped", Lie::FlippedByte);
    assert!(!status.success(), "the client accepted a corrupted blob:\n{text}");
    assert!(text.contains("MISMATCH"), "{text}");
    assert!(text.contains("blob-0 read back corrupted"), "{text}");
    assert!(!text.contains("verified"), "{text}");
}

#[test]
fn the_blobstore_client_detects_a_wrong_stored_checksum() {
    let (status, text) = client_against("blob-bad-sum", Lie::PutChecksum);
    assert!(!status.success(), "the client accepted a wrong checksum:\n{text}");
    assert!(text.contains("stored blob-0 with another checksum"), "{text}");
}
