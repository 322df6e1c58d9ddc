//! Judging an owner file: alive or dead, by its lock (version 2) or by
//! pid and start time (older files, or no owner file).

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::time::Duration;

use super::OWNER_VERSION;
use crate::addr::SmName;
use crate::sys::{lock, proc};

/// A parsed owner line: `qs-sm-owner <version> <pid> <start>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OwnerLine {
    /// 1 (judged by pid and start time) or 2 (judged by the file's lock).
    pub version: u32,
    /// The owner's pid.
    pub pid: u32,
    /// The owner's start time, in clock ticks since boot.
    pub start: u64,
}

/// The line as an owner file holds it (without its newline).
impl std::fmt::Display for OwnerLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "qs-sm-owner {} {} {}", self.version, self.pid, self.start)
    }
}

/// Parses an owner file's text (version 1 or 2).
pub fn parse_owner(text: &str) -> Option<OwnerLine> {
    let mut w = text.split_ascii_whitespace();
    if w.next()? != "qs-sm-owner" {
        return None;
    }
    let version = w
        .next()?
        .parse()
        .ok()
        .filter(|v| (1..=OWNER_VERSION).contains(v))?;
    Some(OwnerLine {
        version,
        pid: w.next()?.parse().ok()?,
        start: w.next()?.parse().ok()?,
    })
}

/// Opens an owner (or temporary owner) file for reading, if it is one: a
/// regular file (not a symbolic link, and not a FIFO, which any process of
/// our uid could put in the directory under an owner file's name and so
/// block the open or the read, and with it a listening instance's start).
///
/// `Err(true)`: there is no such file; `Err(false)`: there is something
/// there that cannot be opened or is no regular file (a FIFO, a link, or
/// we are out of descriptors): its owner cannot be judged.
pub(super) fn open_owner(path: &Path) -> Result<File, bool> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| e.kind() == io::ErrorKind::NotFound)?;
    match f.metadata() {
        Ok(m) if m.is_file() => Ok(f),
        _ => Err(false),
    }
}

/// The owner line of `f` (an owner file), of which at most 256 bytes are
/// read (a line is about 40).
pub fn read_owner(f: impl Read) -> Option<OwnerLine> {
    let mut text = String::new();
    f.take(256).read_to_string(&mut text).ok()?;
    parse_owner(&text)
}

/// What an owner (or temporary owner) file says about its owner.
#[derive(Debug)]
pub(super) enum Verdict {
    /// The owner may be alive: keep its files.
    Alive(Kept),
    /// The owner is dead. With the judged file, open and locked by us: a
    /// removal first checks that the path still names it.
    Dead(Option<File>),
}

/// Why an owner was judged [`Verdict::Alive`]: what a refused claim says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kept {
    /// Its owner file is locked.
    Locked,
    /// Something is there that cannot be opened or is no regular file (a
    /// FIFO, a link, or we are out of descriptors).
    Unopenable,
    /// No lock to go by (flock failed) and no version-1 owner line.
    NoLock,
    /// Judged by pid: a live process has it.
    LivePid,
    /// Judged dead, but its owner file was replaced before we could
    /// remove its files (another process took or cleaned the name).
    Replaced,
}

/// Judges the owner of `path`, a file of `name`'s group: by its lock if it
/// is a version-2 file (held: alive; free: dead), else by pid and start
/// time ([`judge_by_pid`]).
pub(super) fn judge(path: &Path, name: &SmName) -> Verdict {
    let file = match open_owner(path) {
        Ok(f) => f,
        // No owner file (a socket of an older build, or one whose owner
        // file went meanwhile): by pid, and a removal must then claim the
        // name first (see `remove_unowned`).
        Err(true) => return judge_by_pid(name, None, None),
        // Something we cannot open or read (out of descriptors, a FIFO):
        // never a reason to remove a live owner's files.
        Err(false) => return Verdict::Alive(Kept::Unopenable),
    };
    match lock::try_lock_exclusive(&file) {
        Ok(true) => {}
        Ok(false) => return Verdict::Alive(Kept::Locked),
        Err(e) => {
            // No lock to go by (a file system without flock): a version-2
            // owner cannot be judged.
            tracing::debug!(path = %path.display(), error = %na_core::ErrorChain(&e), "flock on an owner file failed");
            return match read_owner(&file) {
                Some(line) if line.version == 1 => judge_by_pid(name, Some(line), None),
                _ => Verdict::Alive(Kept::NoLock),
            };
        }
    }
    match read_owner(&file) {
        Some(line) if line.version == OWNER_VERSION => Verdict::Dead(Some(file)),
        line => judge_by_pid(name, line, Some(file)),
    }
}

/// How old a temporary owner file that holds no owner line and no lock
/// must be to count as left by a claim that died between creating and
/// writing it (a live claim does both within microseconds).
pub(super) const TEMP_STALE: Duration = Duration::from_secs(5);

/// Judges a temporary owner file: as [`judge`], except that one without
/// an owner line whose lock is free is dead once older than
/// [`TEMP_STALE`], whatever its pid says (the pid judgement would keep it
/// for as long as that pid lives, and with it refuse the name).
pub(super) fn judge_temp(path: &Path, name: &SmName) -> Verdict {
    match judge(path, name) {
        Verdict::Alive(kept) => {
            let Ok(f) = open_owner(path) else {
                return Verdict::Alive(kept);
            };
            let stale = f
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age >= TEMP_STALE);
            if stale && lock::try_lock_exclusive(&f).unwrap_or(false) && read_owner(&f).is_none() {
                Verdict::Dead(Some(f))
            } else {
                Verdict::Alive(kept)
            }
        }
        dead => dead,
    }
}

/// The judgement of files without a lock to go by (version 1, or no
/// readable owner file), as before version 2: dead if no process has the
/// name's pid, or the one that has it started at another time than the one
/// recorded (the pid was reused). Only right within one PID namespace.
fn judge_by_pid(name: &SmName, line: Option<OwnerLine>, file: Option<File>) -> Verdict {
    let dead = !proc::is_alive(name.pid)
        || match (line, proc::start_time(name.pid)) {
            (Some(l), Ok(now)) => l.pid == name.pid && l.start != now,
            // No owner line, or /proc hidden: keep (never delete a live peer's files).
            _ => false,
        };
    if dead {
        Verdict::Dead(file)
    } else {
        Verdict::Alive(Kept::LivePid)
    }
}

/// Whether `path` names the file open as `f` (it may have been removed, or
/// replaced, since `f` was opened).
pub(super) fn same_file(f: &File, path: &Path) -> io::Result<bool> {
    let ours = f.metadata()?;
    match std::fs::symlink_metadata(path) {
        Ok(m) => Ok(m.dev() == ours.dev() && m.ino() == ours.ino()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}
