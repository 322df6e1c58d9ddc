//! Files in the socket directory, and removal of those left by dead
//! processes.
//!
//! A listening instance owns two files: `<pid>-<instance>.sock` and
//! `<pid>-<instance>.owner` (one line `qs-sm-owner 1 <pid> <start>`, the
//! owner's start time in clock ticks since boot). They are removed when the
//! plugin is dropped (including during unwinding and at the end of `main`,
//! when the plugin lives in a value that is dropped). A process that is
//! killed, or that calls `std::process::exit` without dropping, leaves them:
//! [`cleanup_stale`] removes them once the owner is dead, a listening
//! instance runs it on its directory at start, and so does `qs-sm-cleanup`.
//! Shared memory needs no cleanup: regions are anonymous sealed memfds,
//! freed by the kernel when the last process holding one exits.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::addr::SmName;
use crate::error::{SmError, SmResult};
use crate::sys::proc;

/// What [`cleanup_stale`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CleanupReport {
    /// Files removed (their owner is dead, or its pid was reused).
    pub removed: Vec<PathBuf>,
    /// Files kept (their owner is alive, or cannot be judged).
    pub kept: Vec<PathBuf>,
}

/// Writes `<dir>/<pid>-<instance>.owner` atomically (temp file + rename).
pub(crate) fn write_owner_file(dir: &Path, name: &SmName) -> io::Result<()> {
    let start = proc::start_time(name.pid)?;
    let path = name.owner_path(dir);
    let tmp = dir.join(format!(".{}.owner.tmp", name.key()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode_0600()
        .open(&tmp)?;
    writeln!(f, "qs-sm-owner 1 {} {start}", name.pid)?;
    drop(f);
    std::fs::rename(&tmp, &path)
}

trait Mode0600 {
    fn mode_0600(&mut self) -> &mut Self;
}

impl Mode0600 for std::fs::OpenOptions {
    fn mode_0600(&mut self) -> &mut Self {
        std::os::unix::fs::OpenOptionsExt::mode(self, 0o600)
    }
}

/// Parses an owner file: `(pid, start time)`.
fn parse_owner(text: &str) -> Option<(u32, u64)> {
    let mut w = text.split_ascii_whitespace();
    if w.next()? != "qs-sm-owner" || w.next()? != "1" {
        return None;
    }
    Some((w.next()?.parse().ok()?, w.next()?.parse().ok()?))
}

/// The text of an owner file, if it is one: a regular file (not a
/// symbolic link, and not a FIFO, which any process of our uid could put
/// in the directory under an owner file's name and so block the read, and
/// with it a listening instance's start), of which at most 256 bytes are
/// read (an owner line is about 40).
fn read_owner_file(path: &Path) -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path)
        .ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut text = String::new();
    f.take(256).read_to_string(&mut text).ok()?;
    Some(text)
}

/// True if the owner of `key`'s files is certainly dead: no process has
/// its pid, or the process with that pid started at another time than the
/// one recorded (the pid was reused).
fn owner_is_dead(dir: &Path, name: &SmName) -> bool {
    if !proc::is_alive(name.pid) {
        return true;
    }
    let recorded = read_owner_file(&name.owner_path(dir)).and_then(|t| parse_owner(&t));
    match (recorded, proc::start_time(name.pid)) {
        (Some((pid, start)), Ok(now)) => pid == name.pid && start != now,
        // No owner file, or /proc hidden: keep (never delete a live peer's files).
        _ => false,
    }
}

/// Removes the socket and owner files in `dir` whose owner process is dead
/// (its pid gone, or reused by a process that started later), keeping
/// those of live processes. Files that do not look like ours are left alone
/// and not reported.
pub fn cleanup_stale(dir: &Path) -> SmResult<CleanupReport> {
    let err = |path: &Path, source| SmError::Cleanup {
        path: path.to_owned(),
        source,
    };
    let mut groups: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(CleanupReport::default()),
        Err(e) => return Err(err(dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| err(dir, e))?;
        let file = entry.file_name();
        let Some(file) = file.to_str() else { continue };
        let Some(key) = file.strip_suffix(".sock").or_else(|| file.strip_suffix(".owner")) else {
            continue;
        };
        if SmName::parse_key(key).is_ok() {
            groups.entry(key.to_owned()).or_default().push(entry.path());
        }
    }
    let mut report = CleanupReport::default();
    for (key, files) in groups {
        let Ok(name) = SmName::parse_key(&key) else {
            continue;
        };
        if owner_is_dead(dir, &name) {
            for f in files {
                match std::fs::remove_file(&f) {
                    Ok(()) => report.removed.push(f),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(err(&f, e)),
                }
            }
        } else {
            report.kept.extend(files);
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_files_and_pid_reuse() {
        let dir = std::env::temp_dir().join(format!("qs-sm-cleanup-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let me = SmName {
            pid: std::process::id(),
            instance: "me".into(),
        };
        write_owner_file(&dir, &me).unwrap();
        std::fs::write(me.socket_path(&dir), b"").unwrap();
        // Our pid, but a different start time: a reused pid, so stale.
        let reused = SmName {
            pid: std::process::id(),
            instance: "old".into(),
        };
        std::fs::write(
            reused.owner_path(&dir),
            format!("qs-sm-owner 1 {} 1\n", reused.pid),
        )
        .unwrap();
        std::fs::write(reused.socket_path(&dir), b"").unwrap();
        std::fs::write(dir.join("unrelated.sock"), b"").unwrap();
        let r = cleanup_stale(&dir).unwrap();
        assert_eq!(r.removed.len(), 2, "{r:?}");
        assert_eq!(r.kept.len(), 2, "{r:?}");
        assert!(me.socket_path(&dir).exists() && dir.join("unrelated.sock").exists());
        assert!(!reused.socket_path(&dir).exists());
        assert_eq!(parse_owner("qs-sm-owner 1 5 77"), Some((5, 77)));
        assert_eq!(parse_owner("qs-sm-owner 2 5 77"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An owner file's name on a FIFO (anyone of our uid may create one in
    /// the directory) or on a symbolic link neither blocks the cleanup nor
    /// gets its group removed: a live pid's files whose owner cannot be
    /// read are kept.
    #[test]
    fn an_owner_name_on_a_fifo_or_a_link_is_kept_without_blocking() {
        let dir = std::env::temp_dir().join(format!("qs-sm-cleanup-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = SmName {
            pid: std::process::id(),
            instance: "fifo".into(),
        };
        let st = std::process::Command::new("mkfifo")
            .arg(fifo.owner_path(&dir))
            .status()
            .expect("mkfifo (coreutils) runs");
        assert!(st.success(), "mkfifo failed: {st}");
        std::fs::write(fifo.socket_path(&dir), b"").unwrap();
        let link = SmName {
            pid: std::process::id(),
            instance: "link".into(),
        };
        // A link to a file that says the owner started at another time.
        let target = dir.join("elsewhere");
        std::fs::write(&target, format!("qs-sm-owner 1 {} 1\n", link.pid)).unwrap();
        std::os::unix::fs::symlink(&target, link.owner_path(&dir)).unwrap();
        std::fs::write(link.socket_path(&dir), b"").unwrap();
        let d = dir.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(cleanup_stale(&d).map_err(|e| e.to_string())));
        let r = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("cleanup_stale blocked on a FIFO named as an owner file")
            .unwrap();
        assert!(r.removed.is_empty(), "{r:?}");
        assert_eq!(r.kept.len(), 4, "{r:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
