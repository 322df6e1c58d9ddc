//! Unit tests of the cleanup: owner files, claims and their refusals.

use super::claim::*;
use super::judge::*;
use super::*;
use crate::sys::{lock, proc};

/// A pid no process has: a child's, once it is reaped (pids are only
/// reused after wrapping around).
fn dead_pid() -> u32 {
    let mut c = std::process::Command::new("true").spawn().expect("spawn true");
    let pid = c.id();
    c.wait().unwrap();
    assert!(!proc::is_alive(pid));
    pid
}

fn test_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("qs-sm-cleanup-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn name(pid: u32, instance: &str) -> SmName {
    SmName {
        pid,
        instance: instance.into(),
    }
}

/// A file holding an owner line, open and locked as a live owner holds it.
fn locked(path: &Path, pid: u32) -> File {
    std::fs::write(path, format!("qs-sm-owner 2 {pid} 1\n")).unwrap();
    let f = File::open(path).unwrap();
    assert!(lock::try_lock_exclusive(&f).unwrap());
    f
}

#[test]
fn owner_files_and_pid_reuse() {
    let dir = test_dir("unit");
    let me = name(std::process::id(), "me");
    let _claim = claim_name(&dir, &me).unwrap();
    std::fs::write(me.socket_path(&dir), b"").unwrap();
    let line = std::fs::read_to_string(me.owner_path(&dir)).unwrap();
    assert!(line.starts_with(&format!("qs-sm-owner 2 {} ", me.pid)), "{line}");
    assert!(!temp_path(&dir, &me).exists(), "the temporary file is gone");
    // Version 1, our pid, but a different start time: a reused pid, so stale.
    let reused = name(std::process::id(), "old");
    std::fs::write(
        reused.owner_path(&dir),
        format!("qs-sm-owner 1 {} 1\n", reused.pid),
    )
    .unwrap();
    std::fs::write(reused.socket_path(&dir), b"").unwrap();
    // Version 1, our pid and start time: alive by the old judgement
    // (no lock is looked for).
    let v1 = name(std::process::id(), "v1");
    let start = proc::start_time(v1.pid).unwrap();
    std::fs::write(v1.owner_path(&dir), format!("qs-sm-owner 1 {} {start}\n", v1.pid)).unwrap();
    std::fs::write(dir.join("unrelated.sock"), b"").unwrap();
    let r = cleanup_stale(&dir).unwrap();
    assert_eq!(r.removed.len(), 2, "{r:?}");
    assert_eq!(r.kept.len(), 3, "{r:?}");
    assert!(me.socket_path(&dir).exists() && dir.join("unrelated.sock").exists());
    assert!(v1.owner_path(&dir).exists());
    assert!(!reused.socket_path(&dir).exists());
    let line = |version, pid, start| OwnerLine { version, pid, start };
    assert_eq!(parse_owner("qs-sm-owner 1 5 77"), Some(line(1, 5, 77)));
    assert_eq!(parse_owner("qs-sm-owner 2 5 77"), Some(line(2, 5, 77)));
    assert_eq!(parse_owner("qs-sm-owner 3 5 77"), None);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Version-2 files are judged by their lock alone: a live pid whose
/// file nobody locks is dead (the owner of that name, maybe in another
/// PID namespace, is gone), and a dead pid whose file is locked is
/// alive (its owner lives in another PID namespace, or is a forked
/// child of the process that made it).
#[test]
fn version_2_files_are_judged_by_the_lock_not_the_pid() {
    let dir = test_dir("lock");
    let unlocked = name(std::process::id(), "unlocked");
    std::fs::write(
        unlocked.owner_path(&dir),
        format!("qs-sm-owner 2 {} 1\n", unlocked.pid),
    )
    .unwrap();
    std::fs::write(unlocked.socket_path(&dir), b"").unwrap();
    let held = name(dead_pid(), "held");
    let _lock = locked(&held.owner_path(&dir), held.pid);
    std::fs::write(held.socket_path(&dir), b"").unwrap();
    let r = cleanup_stale(&dir).unwrap();
    assert!(!unlocked.owner_path(&dir).exists() && !unlocked.socket_path(&dir).exists());
    assert!(held.owner_path(&dir).exists() && held.socket_path(&dir).exists());
    assert_eq!((r.removed.len(), r.kept.len()), (2, 2), "{r:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An owner file that is there but cannot be opened or read as one
/// (out of descriptors, say; here: a symbolic link, refused by
/// `O_NOFOLLOW`, and a directory) keeps its group, even where the pid
/// judgement would call the owner dead (another PID namespace's pid,
/// gone here). Only a missing owner file falls back to the pid.
#[test]
fn an_owner_file_that_cannot_be_opened_keeps_its_group() {
    let dir = test_dir("unopenable");
    let link = name(dead_pid(), "link");
    let target = dir.join("elsewhere");
    let _lock = locked(&target, link.pid);
    std::os::unix::fs::symlink(&target, link.owner_path(&dir)).unwrap();
    std::fs::write(link.socket_path(&dir), b"").unwrap();
    let subdir = name(link.pid, "subdir");
    std::fs::create_dir(subdir.owner_path(&dir)).unwrap();
    std::fs::write(subdir.socket_path(&dir), b"").unwrap();
    let r = cleanup_stale(&dir).unwrap();
    assert!(r.removed.is_empty(), "{r:?}");
    assert!(link.socket_path(&dir).exists() && subdir.socket_path(&dir).exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A socket without an owner file, judged dead by its pid, goes only
/// under a claim of the name: not if an owner file appeared meanwhile
/// (a new owner claimed the name and is binding its socket).
#[test]
fn a_socket_without_owner_file_goes_only_under_a_claim() {
    let dir = test_dir("unowned");
    let gone = name(dead_pid(), "gone");
    std::fs::write(gone.socket_path(&dir), b"").unwrap();
    // A new owner's claim between the listing and the removal.
    let new_owner = locked(&gone.owner_path(&dir), gone.pid);
    let r = remove_unowned(&gone, &gone.owner_path(&dir), &[gone.socket_path(&dir)]).unwrap();
    assert!(r.is_none(), "{r:?}");
    assert!(
        gone.socket_path(&dir).exists(),
        "the new owner's socket was removed"
    );
    assert!(same_file(&new_owner, &gone.owner_path(&dir)).unwrap());
    drop(new_owner);
    std::fs::remove_file(gone.owner_path(&dir)).unwrap();
    // No owner: the socket goes, and so does the claim made for it.
    let r = cleanup_stale(&dir).unwrap();
    assert_eq!(r.removed, vec![gone.socket_path(&dir)]);
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "something was left behind"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A temporary owner file a claim left without writing it (it died
/// between creating and writing, or failed to write) does not hold the
/// name for as long as its pid lives: once stale it is removed and the
/// name claimed.
#[test]
fn an_unwritten_temporary_owner_file_does_not_hold_the_name() {
    let dir = test_dir("unwritten");
    let me = name(std::process::id(), "unwritten");
    let tmp = File::create(temp_path(&dir, &me)).unwrap();
    tmp.set_modified(std::time::SystemTime::now() - 2 * TEMP_STALE)
        .unwrap();
    drop(tmp);
    let _claim = claim_name(&dir, &me).expect("the name is free");
    assert!(me.owner_path(&dir).exists() && !temp_path(&dir, &me).exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `.<key>.owner.tmp` files a claim left (its process died before the
/// link) are removed once nobody holds their lock; one a claim holds
/// is kept, whatever its pid.
#[test]
fn leftover_temporary_owner_files_are_removed_unless_locked() {
    let dir = test_dir("tmp");
    let dead = name(dead_pid(), "left");
    std::fs::write(temp_path(&dir, &dead), format!("qs-sm-owner 2 {} 1\n", dead.pid)).unwrap();
    let empty = name(dead.pid, "empty");
    std::fs::write(temp_path(&dir, &empty), b"").unwrap();
    let claiming = name(dead.pid, "claiming");
    let _lock = locked(&temp_path(&dir, &claiming), claiming.pid);
    let r = cleanup_stale(&dir).unwrap();
    assert!(!temp_path(&dir, &dead).exists() && !temp_path(&dir, &empty).exists());
    assert!(temp_path(&dir, &claiming).exists());
    assert_eq!((r.removed.len(), r.kept.len()), (2, 1), "{r:?}");
    // A claim of a name whose temporary file a dead claim left goes on.
    let _claim = claim_name(&dir, &dead).unwrap();
    assert!(dead.owner_path(&dir).exists() && !temp_path(&dir, &dead).exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An owner file's name on a FIFO (anyone of our uid may create one in
/// the directory) or on a symbolic link neither blocks the cleanup nor
/// gets its group removed: a live pid's files whose owner cannot be
/// read are kept.
#[test]
fn an_owner_name_on_a_fifo_or_a_link_is_kept_without_blocking() {
    let dir = test_dir("fifo");
    let fifo = name(std::process::id(), "fifo");
    let st = std::process::Command::new("mkfifo")
        .arg(fifo.owner_path(&dir))
        .status()
        .expect("mkfifo (coreutils) runs");
    assert!(st.success(), "mkfifo failed: {st}");
    std::fs::write(fifo.socket_path(&dir), b"").unwrap();
    let link = name(std::process::id(), "link");
    // A link to a file that says the owner started at another time.
    let target = dir.join("elsewhere");
    std::fs::write(&target, format!("qs-sm-owner 1 {} 1\n", link.pid)).unwrap();
    std::os::unix::fs::symlink(&target, link.owner_path(&dir)).unwrap();
    std::fs::write(link.socket_path(&dir), b"").unwrap();
    // The same on a claim's temporary file.
    std::os::unix::fs::symlink(&target, temp_path(&dir, &link)).unwrap();
    let d = dir.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(cleanup_stale(&d).map_err(|e| na_core::ErrorChain(&e).to_string())));
    let r = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("cleanup_stale blocked on a FIFO named as an owner file")
        .unwrap();
    assert!(r.removed.is_empty(), "{r:?}");
    assert_eq!(r.kept.len(), 5, "{r:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The message of a claim refused after [`CLAIM_WAIT`], checked to say
/// `says` and not the tail of a locked owner file (a live process or a
/// cleanup), which only that case found.
fn refused_saying(dir: &Path, name: &SmName, says: &[&str]) {
    let e = claim_name(dir, name).expect_err("the claim was refused");
    let text = na_core::ErrorChain(&e).to_string();
    assert!(text.contains("is in use"), "{text}");
    for s in says {
        assert!(text.contains(s), "the error does not say {s:?}: {text}");
    }
    assert!(
        !text.contains("by a live process, this one or one in another PID namespace"),
        "the error names a live process that nothing found: {text}"
    );
}

/// A claim refused because the owner file cannot be opened (here a
/// FIFO) says the owner cannot be judged and what to do, not that a
/// live process or a cleanup holds the name.
#[test]
fn a_claim_refused_on_an_unopenable_owner_file_says_it_cannot_be_judged() {
    let dir = test_dir("refused-unopenable");
    let me = name(std::process::id(), "fifo");
    let st = std::process::Command::new("mkfifo")
        .arg(me.owner_path(&dir))
        .status()
        .expect("mkfifo (coreutils) runs");
    assert!(st.success(), "mkfifo failed: {st}");
    refused_saying(
        &dir,
        &me,
        &[
            "could not be opened as a regular file",
            "cannot be told",
            "remove what is at",
        ],
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A claim refused because an older build's owner file names a live
/// process (ours, started when it says) names that pid, judged by pid.
#[test]
fn a_claim_refused_on_a_live_pid_names_that_pid() {
    let dir = test_dir("refused-pid");
    let me = name(std::process::id(), "v1");
    let start = proc::start_time(me.pid).unwrap();
    std::fs::write(me.owner_path(&dir), format!("qs-sm-owner 1 {} {start}\n", me.pid)).unwrap();
    refused_saying(
        &dir,
        &me,
        &[&format!(
            "by the live process with pid {} in this PID namespace, judged by pid alone",
            me.pid
        )],
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A claim refused because another claim held the temporary owner file
/// throughout says a claim is in progress, not that a live process
/// owns the name (no owner file is there at all).
#[test]
fn a_claim_refused_by_another_claim_says_so() {
    let dir = test_dir("refused-temp");
    let me = name(std::process::id(), "claiming");
    let _claiming = locked(&temp_path(&dir, &me), me.pid);
    refused_saying(
        &dir,
        &me,
        &["held its temporary owner file", "by a claim in progress"],
    );
    assert!(!me.owner_path(&dir).exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
