//! Files in the socket directory, and removal of those left by dead
//! processes.
//!
//! A listening instance owns two files: `<pid>-<instance>.sock` and
//! `<pid>-<instance>.owner` (one line `qs-sm-owner 2 <pid> <start>`, the
//! owner's pid and start time in clock ticks since boot, for people to
//! read). What makes an owner file alive is its [flock(2)] lock: the owner
//! takes it before the file appears under its name (`claim_name`)
//! and holds it, through a close-on-exec descriptor, for its whole life;
//! the kernel drops it when the process dies, however it dies. Any process
//! sharing the directory can test it, in whatever PID namespace (containers
//! sharing a volume see different pids, so a pid in a file name says
//! nothing there). A forked child shares its parent's lock (one open file
//! description), so the files are kept while either lives.
//!
//! The files are removed when the plugin is dropped (including during
//! unwinding and at the end of `main`, when the plugin lives in a value that
//! is dropped). A process that is killed, or that calls
//! `std::process::exit` without dropping, leaves them: [`cleanup_stale`]
//! removes them once nobody holds the lock, a listening instance runs it on
//! its directory at start, and so does `qs-sm-cleanup`. It also removes
//! `.<pid>-<instance>.owner.tmp` files a claim left behind (the process
//! died between creating one and putting it in place; they are locked from
//! creation too).
//!
//! Files without a lock to go by are judged as before version 2 (by pid and
//! start time, so only right within one PID namespace): version-1 owner
//! files of older builds, and a socket whose owner file is missing (a live
//! instance always has its owner file: it is in place before the bind and
//! removed after the socket). Such a socket is removed only under a claim
//! of its name (our own locked owner file linked in place), so that a new
//! owner claiming the name meanwhile keeps its socket. An owner file that
//! is there but cannot be opened or read (out of descriptors, a FIFO, a
//! link) keeps its group. A temporary owner file without an owner line and
//! without a lock (its claim died between creating and writing it) is
//! removed once a few seconds old, whatever its pid.
//!
//! On NFS, `flock` is emulated with POSIX locks, which belong to the
//! process: a listener there skips the cleanup at start (its own process
//! would see a sibling instance's lock as free); `qs-sm-cleanup`, another
//! process, still judges right.
//!
//! Shared memory needs no cleanup: regions are anonymous sealed memfds,
//! freed by the kernel when the last process holding one exits.
//!
//! [flock(2)]: https://man7.org/linux/man-pages/man2/flock.2.html

mod claim;
mod judge;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use crate::addr::SmName;
use crate::error::{SmError, SmResult};

pub(crate) use claim::claim_name;
use claim::{try_claim, Claim};
// A test's longer claim window (`test-hooks`).
#[cfg(feature = "test-hooks")]
pub use claim::debug_set_claim_wait;
use judge::{judge, judge_temp, same_file, Verdict};
// The owner line's reader and parser, for the fuzz targets (`test-hooks`).
#[cfg(feature = "test-hooks")]
pub use judge::{parse_owner, read_owner, OwnerLine};

/// Version of the owner line we write: 2 means "the owner holds the file's
/// lock" (version 1 files had no lock and are judged by pid).
pub const OWNER_VERSION: u32 = 2;

/// What [`cleanup_stale`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CleanupReport {
    /// Files removed (nobody holds their owner's lock; for files without
    /// one, the owner's pid is gone or was reused).
    pub removed: Vec<PathBuf>,
    /// Files kept (their owner is alive, or cannot be judged).
    pub kept: Vec<PathBuf>,
}

/// Removes `files` (in order) of a group judged dead by `judged`. With
/// `held` (that file, locked by us) only if `judged` still names it; if not
/// (another process replaced it meanwhile) nothing is removed: `None`.
/// Returns the files removed (those already gone are left out).
pub(super) fn remove_dead(
    held: Option<&File>,
    judged: &Path,
    files: &[PathBuf],
) -> SmResult<Option<Vec<PathBuf>>> {
    let err = |path: &Path, source| SmError::Cleanup {
        path: path.to_owned(),
        source,
    };
    if let Some(f) = held {
        if !same_file(f, judged).map_err(|e| err(judged, e))? {
            return Ok(None);
        }
    }
    let mut removed = Vec::new();
    for f in files {
        match std::fs::remove_file(f) {
            Ok(()) => removed.push(f.clone()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(f, e)),
        }
    }
    Ok(Some(removed))
}

/// Removes `files` of `name`'s group, judged dead without an owner file
/// (`judged`, the owner file's path, named none): only under a claim of
/// the name, so that a new owner that claimed it meanwhile keeps its
/// socket. The claim (our locked owner file, linked in place) fails if an
/// owner file appeared: `None`, nothing removed. Ours goes last.
fn remove_unowned(name: &SmName, judged: &Path, files: &[PathBuf]) -> SmResult<Option<Vec<PathBuf>>> {
    let err = |path: &Path, source| SmError::Cleanup {
        path: path.to_owned(),
        source,
    };
    let Some(dir) = judged.parent() else {
        return Ok(None);
    };
    let Claim::Ours(ours) = try_claim(dir, name).map_err(|e| err(judged, e))? else {
        return Ok(None);
    };
    // The name is ours: nobody binds its socket now. Its other files go,
    // then our owner file, still locked.
    let others: Vec<PathBuf> = files.iter().filter(|f| f.as_path() != judged).cloned().collect();
    let removed = remove_dead(None, judged, &others)?;
    if same_file(&ours, judged).unwrap_or(false) {
        let _ = std::fs::remove_file(judged);
    }
    drop(ours);
    Ok(removed)
}

/// The files of one name found in the directory.
#[derive(Default)]
struct Group {
    sock: Option<PathBuf>,
    owner: Option<PathBuf>,
    tmp: Option<PathBuf>,
}

/// Removes the socket, owner and temporary owner files in `dir` whose owner
/// process is dead (nobody holds the owner file's lock; for files of older
/// builds, or a socket without an owner file, its pid is gone or was
/// reused by a process that started later), keeping those of live
/// processes, in this PID namespace or another. Files that do not look like
/// ours are left alone and not reported.
pub fn cleanup_stale(dir: &Path) -> SmResult<CleanupReport> {
    let err = |path: &Path, source| SmError::Cleanup {
        path: path.to_owned(),
        source,
    };
    let mut groups: BTreeMap<String, Group> = BTreeMap::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(CleanupReport::default()),
        Err(e) => return Err(err(dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| err(dir, e))?;
        let file = entry.file_name();
        let Some(file) = file.to_str() else { continue };
        let (key, slot): (_, fn(&mut Group) -> &mut Option<PathBuf>) =
            if let Some(k) = file.strip_prefix('.').and_then(|f| f.strip_suffix(".owner.tmp")) {
                (k, |g| &mut g.tmp)
            } else if let Some(k) = file.strip_suffix(".sock") {
                (k, |g| &mut g.sock)
            } else if let Some(k) = file.strip_suffix(".owner") {
                (k, |g| &mut g.owner)
            } else {
                continue;
            };
        if SmName::parse_key(key).is_ok() {
            *slot(groups.entry(key.to_owned()).or_default()) = Some(entry.path());
        }
    }
    let mut report = CleanupReport::default();
    for (key, group) in groups {
        let Ok(name) = SmName::parse_key(&key) else {
            continue;
        };
        // Judged by the owner file there now, even if the listing missed
        // it (it is created before the socket).
        let owner = name.owner_path(dir);
        let listed: Vec<PathBuf> = [group.sock, group.owner].into_iter().flatten().collect();
        if !listed.is_empty() {
            sweep(&name, &owner, listed, &mut report)?;
        }
        if let Some(tmp) = group.tmp {
            sweep(&name, &tmp.clone(), vec![tmp], &mut report)?;
        }
    }
    Ok(report)
}

/// Judges `name`'s owner by `judged` and removes `files` if it is dead,
/// recording what was done in `report`.
fn sweep(name: &SmName, judged: &Path, files: Vec<PathBuf>, report: &mut CleanupReport) -> SmResult<()> {
    let is_temp = judged.extension().is_some_and(|e| e == "tmp");
    let verdict = if is_temp {
        judge_temp(judged, name)
    } else {
        judge(judged, name)
    };
    match verdict {
        // No file held to check the removal against: a temporary file is
        // left alone (see `judge_temp`), and a socket without an owner file
        // goes only under a claim of the name (`remove_unowned`).
        Verdict::Dead(None) if is_temp => report.kept.extend(files),
        Verdict::Dead(None) => match remove_unowned(name, judged, &files)? {
            Some(removed) => {
                tracing::info!(name = %name.uri(), files = ?removed, "removed a dead owner's sm files");
                report.removed.extend(removed);
            }
            None => report.kept.extend(files),
        },
        Verdict::Dead(held) => match remove_dead(held.as_ref(), judged, &files)? {
            Some(removed) => {
                tracing::info!(name = %name.uri(), files = ?removed, "removed a dead owner's sm files");
                report.removed.extend(removed);
            }
            None => report.kept.extend(files),
        },
        Verdict::Alive(_) => {
            tracing::debug!(name = %name.uri(), files = ?files, "kept a live owner's sm files");
            report.kept.extend(files);
        }
    }
    Ok(())
}
