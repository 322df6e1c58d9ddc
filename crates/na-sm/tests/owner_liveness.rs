//! A live owner's socket and owner files survive every other process's
//! cleanup and listen, whatever the pid in their name says in that
//! process's PID namespace: liveness is the owner file's lock.
//!
//! The owners here are real processes running the real plugin: this test
//! binary run again as a helper (`helper_process`, which does nothing in
//! an ordinary run).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use na_core::PluginId;
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::{private_dir, sys, without_namespaces, UNSHARE_PID};
use std::os::fd::AsFd;

/// Set in a helper's environment: what it does.
const MODE_ENV: &str = "QS_SM_LIVENESS_HELPER";

/// The helper: with `$QS_SM_LIVENESS_HELPER` set to `listen` or `fork`,
/// creates a listening instance (directory and name from the environment)
/// and prints `READY <address>`, or `ERR <error>`. `listen` then waits for
/// end of file on stdin and drops it. `fork` forks a child that prints the
/// line and waits for end of file, while the helper itself exits at once
/// without dropping: the files stay, named with a pid that is gone, and
/// their lock with the child.
#[test]
fn helper_process() {
    let Ok(mode) = std::env::var(MODE_ENV) else {
        return;
    };
    let dir = std::env::var("QS_SM_LIVENESS_DIR").unwrap();
    let name = std::env::var("QS_SM_LIVENESS_NAME").unwrap();
    let plugin = match SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(dir).with_name(name)) {
        Ok(p) => p,
        Err(e) => {
            println!("ERR {}", na_core::ErrorChain(&e));
            return;
        }
    };
    let line = format!("READY {}\n", na_core::Plugin::self_addr(&plugin).uri());
    if mode == "fork" {
        // The child makes only async-signal-safe calls (write, read,
        // _exit) before it ends.
        let child = sys::fork();
        assert!(child >= 0, "fork");
        if child == 0 {
            // Writes our line, reads until end of file, ends the child.
            sys::write(std::io::stdout().as_fd(), line.as_bytes());
            let mut b = [0u8; 64];
            while sys::read(std::io::stdin().as_fd(), &mut b) > 0 {}
            sys::exit_now(0);
        }
        // Ends the helper without dropping the plugin.
        sys::exit_now(0);
    }
    print!("{line}");
    std::io::stdout().flush().unwrap();
    let mut rest = String::new();
    let _ = std::io::stdin().read_line(&mut rest);
    drop(plugin);
}

/// Starts this binary as a helper (through `wrapper`, e.g. `unshare`, if
/// given) and returns it with its first `READY`/`ERR` line.
// The child is returned whole, and its callers wait for it (the lint does
// not follow it into the returned tuple).
#[allow(clippy::zombie_processes)]
fn spawn_helper(wrapper: &[&str], mode: &str, dir: &Path, name: &str) -> (Child, String) {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match wrapper.split_first() {
        Some((w, args)) => {
            let mut c = Command::new(w);
            c.args(args).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    let mut child = cmd
        .args(["--exact", "helper_process", "--nocapture", "--test-threads=1"])
        .env(MODE_ENV, mode)
        .env("QS_SM_LIVENESS_DIR", dir)
        .env("QS_SM_LIVENESS_NAME", name)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {wrapper:?} {}: {e}", exe.display()));
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line).unwrap_or(0) == 0 {
            // Its output ended: it is exiting (the caller waits for it).
            let mut err = String::new();
            let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err);
            return (child, format!("EXITED {err}"));
        }
        // (libtest may have printed `test helper_process ... ` before it.)
        if let Some(at) = line.find("READY ").or_else(|| line.find("ERR ")) {
            // The rest is drained: a closed pipe would fail the helper's
            // later output.
            std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
            return (child, line[at..].trim_end().to_owned());
        }
    }
}

fn key_of(ready: &str) -> String {
    ready
        .strip_prefix("READY sm://")
        .unwrap_or_else(|| panic!("helper failed: {ready}"))
        .to_owned()
}

/// Whether a process with this pid exists here.
fn exists(pid: u32) -> bool {
    // Signal 0 only checks existence.
    sys::kill(pid as libc::pid_t, 0) == 0
}

/// The owner of a listening instance's files is a process whose pid, the
/// one in the files' names, no longer exists (its forked child holds the
/// lock, as an owner in another PID namespace would, whose pid means
/// nothing here): cleanup keeps the files while the lock is held, and
/// removes them once it is not.
#[test]
fn cleanup_keeps_a_live_owners_files_though_the_pid_in_their_name_is_gone() {
    let dir = private_dir("liveness-fork");
    let (mut helper, ready) = spawn_helper(&[], "fork", &dir, "forked");
    let key = key_of(&ready);
    let pid: u32 = key.split('-').next().unwrap().parse().unwrap();
    // (Taken first: `wait` would close it, and the holder would end.)
    let holder_stdin = helper.stdin.take();
    assert!(helper.wait().unwrap().success());
    assert!(!exists(pid), "the pid in the name ({pid}) still exists");
    let sock = dir.join(format!("{key}.sock"));
    let owner = dir.join(format!("{key}.owner"));
    assert!(sock.exists() && owner.exists());
    let r = na_sm::cleanup_stale(&dir).unwrap();
    assert!(r.removed.is_empty() && r.kept.len() == 2, "{r:?}");
    assert!(
        sock.exists() && owner.exists(),
        "a live owner's files were removed"
    );
    // The command keeps them too.
    let out = Command::new(env!("CARGO_BIN_EXE_qs-sm-cleanup"))
        .arg(&*dir)
        .output()
        .unwrap();
    assert!(out.status.success() && sock.exists() && owner.exists());
    // The holder ends (end of file on the stdin it shares): the lock is free.
    drop(holder_stdin);
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let r = loop {
        let r = na_sm::cleanup_stale(&dir).unwrap();
        if !r.removed.is_empty() || std::time::Instant::now() > end {
            break r;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(r.removed.contains(&sock) && r.removed.contains(&owner), "{r:?}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The real thing: owners in PID namespaces of their own (`unshare`), both
/// pid 1 there, sharing the directory. A cleanup here (where pid 1 is
/// another process) keeps the first's files, and the second, which gets
/// the same name `1-ns`, is refused without touching them. A lookup of
/// the first from here is refused with an error that says why.
#[test]
fn owners_in_other_pid_namespaces_are_kept_and_their_names_refused() {
    let dir = private_dir("liveness-ns");
    let unshare = UNSHARE_PID;
    let (mut first, ready) = spawn_helper(&unshare, "listen", &dir, "ns");
    if !ready.starts_with("READY ") {
        let _ = first.wait();
        let _ = std::fs::remove_dir_all(&dir);
        without_namespaces(&format!(
            "`{}` could not run a listening helper in a new PID namespace: {ready}",
            unshare.join(" ")
        ));
        return;
    }
    let key = key_of(&ready);
    assert_eq!(key, "1-ns", "the helper is pid 1 of its namespace");
    let sock = dir.join(format!("{key}.sock"));
    let owner = dir.join(format!("{key}.owner"));
    let state = || {
        (
            std::fs::read(&owner).ok(),
            std::fs::metadata(&owner).ok().map(|m| m.ino()),
            std::fs::metadata(&sock).ok().map(|m| m.ino()),
        )
    };
    let before = state();
    // Reached from here, it is refused, saying why: sm names processes
    // by pid, and this one is pid 1 only in its own namespace.
    let mut c = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(&dir)).unwrap();
    let refused = na_core::Plugin::lookup(&mut c, &format!("sm://{key}")).unwrap_err();
    let text = na_core::ErrorChain(&refused).to_string();
    assert!(
        text.contains("pid 1 in its own PID namespace") && text.contains("one PID namespace"),
        "{text}"
    );
    drop(c);
    let r = na_sm::cleanup_stale(&dir).unwrap();
    assert!(r.removed.is_empty(), "a live owner's files were removed: {r:?}");
    assert_eq!(state(), before);
    // A second namespace: its helper is pid 1 too, so it wants `1-ns`.
    let (mut second, refused) = spawn_helper(&unshare, "listen", &dir, "ns");
    assert!(
        refused.starts_with("ERR ") && refused.contains("by a live process"),
        "{refused}"
    );
    let _ = second.wait();
    assert_eq!(
        state(),
        before,
        "the refused listen touched the live owner's files"
    );
    // The first is still the owner: it removes its files as it ends.
    drop(first.stdin.take());
    assert!(first.wait().unwrap().success());
    assert!(!sock.exists() && !owner.exists());
    let _ = std::fs::remove_dir_all(&dir);
}
