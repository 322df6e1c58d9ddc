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

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::addr::SmName;
use crate::error::{SmError, SmResult};
use crate::sys::{lock, proc};

/// Version of the owner line we write: 2 means "the owner holds the file's
/// lock" (version 1 files had no lock and are judged by pid).
const OWNER_VERSION: u32 = 2;

/// How long [`claim_name`] keeps trying while the name's owner file stays
/// locked before it reports the name in use. A cleanup in another process
/// holds a dead owner's lock while it removes its files: microseconds
/// usually, but that process may be descheduled (a loaded machine) or
/// slowed by the file system for much longer than a few retries last. A
/// live owner holds the lock for good: its name is refused once this
/// passes (names carry our pid, so that owner shares our pid from another
/// PID namespace, or is this process: rare enough to wait for).
const CLAIM_WAIT: Duration = Duration::from_secs(1);

/// First and longest pause between [`claim_name`]'s tries (it doubles).
const CLAIM_PAUSE: (Duration, Duration) = (Duration::from_millis(2), Duration::from_millis(50));

/// What [`cleanup_stale`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CleanupReport {
    /// Files removed (nobody holds their owner's lock; for files without
    /// one, the owner's pid is gone or was reused).
    pub removed: Vec<PathBuf>,
    /// Files kept (their owner is alive, or cannot be judged).
    pub kept: Vec<PathBuf>,
}

/// The temporary owner file of `name` in `dir` (`.<pid>-<instance>.owner.tmp`).
fn temp_path(dir: &Path, name: &SmName) -> PathBuf {
    dir.join(format!(".{}.owner.tmp", name.key()))
}

/// Makes `name` ours in `dir` and returns our owner file, open and locked:
/// keep it open for as long as the name is ours (dropping it releases the
/// lock, so remove the files first).
///
/// The owner file is written and locked under a temporary name first and
/// then hard-linked into place, which fails if an owner file exists: a live
/// owner's file is never overwritten, and ours is never visible unlocked.
/// An existing owner file whose lock is free (or, for a version-1 file,
/// whose owner is dead) is removed with its socket, under its lock, and the
/// claim tried again; one whose lock stays held for [`CLAIM_WAIT`] (tried
/// again and again, with pauses of up to 50 ms) means the name is in use:
/// `AddrInUse`, saying what the owner file names. So does something there
/// that cannot be opened as an owner file (a FIFO, a link), whose owner
/// cannot be judged: the error says which of the two it was.
pub(crate) fn claim_name(dir: &Path, name: &SmName) -> SmResult<File> {
    let owner = name.owner_path(dir);
    let err = |source| SmError::Listen {
        path: name.socket_path(dir),
        source,
    };
    let deadline = Instant::now() + CLAIM_WAIT;
    let mut pause = CLAIM_PAUSE.0;
    // What held us up last: a claim of the name in progress (its
    // temporary file, `None`), or why the owner file's owner was kept (or
    // its files not removed).
    let kept = loop {
        // Whether to try again at once: a dead owner's files went.
        let (kept, removed) = match try_claim(dir, name).map_err(err)? {
            Claim::Ours(file) => return Ok(file),
            Claim::Retry => (None, false),
            Claim::Taken => match judge(&owner, name) {
                Verdict::Alive(kept) => (Some(kept), false),
                Verdict::Dead(held) => {
                    let files = [name.socket_path(dir), owner.clone()];
                    let removed = remove_dead(held.as_ref(), &owner, &files)?;
                    if let Some(removed) = &removed {
                        tracing::info!(name = %name.uri(), files = ?removed, "removed a dead owner's files to take its name");
                    }
                    let why = if removed.is_some() {
                        None
                    } else {
                        Some(Kept::Replaced)
                    };
                    (why, removed.is_some())
                }
            },
        };
        let now = Instant::now();
        if now >= deadline {
            break kept;
        }
        if !removed {
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(CLAIM_PAUSE.1);
        }
    };
    tracing::warn!(name = %name.uri(), dir = %dir.display(), "sm instance name in use: refused");
    Err(err(io::Error::new(
        io::ErrorKind::AddrInUse,
        refusal(dir, name, &owner, kept),
    )))
}

/// The message of a refused claim of `name` (owner file `owner`): what was
/// found there (`kept`: why its owner was judged alive; `None`: another
/// claim held the temporary owner file), and what that leaves to do. The
/// tail says who can hold the name only where something found says so: a
/// locked file (a live process, or a cleanup), a live pid; where the owner
/// could not be judged, or another claim or cleanup was at work, it says
/// that instead.
fn refusal(dir: &Path, name: &SmName, owner: &Path, kept: Option<Kept>) -> String {
    let owner_shown = owner.display();
    let (held, tail) = match kept {
        None => (
            format!(
                "another claim of the name held its temporary owner file {} for {CLAIM_WAIT:?}",
                temp_path(dir, name).display()
            ),
            "by a claim in progress, of this process or another, or a cleanup removing a dead \
             claim's file has not finished; try again or choose another name"
                .to_owned(),
        ),
        Some(Kept::Locked) => (
            format!(
                "its owner file {owner_shown} stayed locked for {CLAIM_WAIT:?}; {}",
                lock_holder(owner)
            ),
            "by a live process, this one or one in another PID namespace sharing the directory, \
             or a cleanup removing a dead owner's files has not finished; choose another name or \
             try again"
                .to_owned(),
        ),
        Some(Kept::Unopenable) => (
            format!(
                "its owner file {owner_shown} could not be opened as a regular file (something \
                 else is there, such as a FIFO or a link, or this process is out of descriptors), \
                 so its owner cannot be judged dead"
            ),
            format!(
                "whether a process holds it cannot be told: remove what is at {owner_shown} if \
                 no process uses the name, or choose another name (or, if this process was out \
                 of descriptors, try again with fewer open)"
            ),
        ),
        Some(Kept::NoLock) => (
            format!(
                "its owner file {owner_shown} could not be locked (no flock on this file system) \
                 and holds no owner line of a version judged by pid; {}",
                lock_holder(owner)
            ),
            "whether a process holds it cannot be told on this file system: remove the name's \
             files if no process uses them, or choose another name"
                .to_owned(),
        ),
        Some(Kept::Replaced) => (
            format!(
                "its owner file {owner_shown} was judged dead, but at the last try it was \
                 replaced before its files could be removed (another process is taking or \
                 cleaning the name)"
            ),
            "by whichever process takes it now, or a cleanup that has not finished; try again \
             or choose another name"
                .to_owned(),
        ),
        Some(Kept::LivePid) => (
            format!(
                "its owner file {owner_shown} (of a version without a lock, or unreadable) names \
                 a live process; {}",
                lock_holder(owner)
            ),
            format!(
                "by the live process with pid {} in this PID namespace, judged by pid alone (an \
                 older build's owner, or a process that reused a dead owner's pid); choose another \
                 name, or remove the name's files if that process does not use them",
                name.pid
            ),
        ),
    };
    format!("instance name {} is in use ({held}): {tail}", name.uri())
}

/// What the owner file at `path` says of the process holding its lock,
/// for an error (read without the lock).
fn lock_holder(path: &Path) -> String {
    match open_owner(path).ok().as_ref().and_then(read_owner) {
        Some(line) if proc::is_alive(line.pid) => {
            format!("it names pid {}, a live process in this PID namespace", line.pid)
        }
        Some(line) => format!(
            "it names pid {}, which no process has in this PID namespace (its holder lives in \
             another one, or is a cleanup)",
            line.pid
        ),
        None => "it holds no owner line that can be read".to_owned(),
    }
}

/// What one attempt to claim a name gave.
enum Claim {
    /// The name is ours: our owner file, open and locked.
    Ours(File),
    /// An owner file is there already (judge it).
    Taken,
    /// Try again: another claim holds the temporary file.
    Retry,
}

/// One attempt to make `name` ours: our locked temporary owner file,
/// hard-linked into place (which fails if an owner file exists), the
/// temporary name removed either way (we hold its lock, so no cleanup
/// removes it meanwhile).
fn try_claim(dir: &Path, name: &SmName) -> io::Result<Claim> {
    let Some(file) = create_locked_temp(dir, name)? else {
        return Ok(Claim::Retry);
    };
    let tmp = temp_path(dir, name);
    let linked = std::fs::hard_link(&tmp, name.owner_path(dir));
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(Claim::Ours(file)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(Claim::Taken),
        Err(e) => Err(e),
    }
}

/// Creates `name`'s temporary owner file (exclusively, mode 0600,
/// close-on-exec as every file std opens), locks it and writes our owner
/// line. `None`: try again (another claim of the name holds the temporary
/// file, or a cleanup removed ours before we locked it).
fn create_locked_temp(dir: &Path, name: &SmName) -> io::Result<Option<File>> {
    let tmp = temp_path(dir, name);
    let file = match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            // Only one we judged with its lock held by us: without it, the
            // path may name another claim's new file by now.
            if let Verdict::Dead(Some(held)) = judge_temp(&tmp, name) {
                if let Ok(Some(removed)) = remove_dead(Some(&held), &tmp, std::slice::from_ref(&tmp)) {
                    tracing::info!(files = ?removed, "removed a dead claim's temporary owner file");
                }
            }
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let written = (|| {
        if !lock::try_lock_exclusive(&file)? || !same_file(&file, &tmp)? {
            return Ok(false);
        }
        let start = proc::start_time(name.pid).unwrap_or(0);
        writeln!(&file, "qs-sm-owner {OWNER_VERSION} {} {start}", name.pid)?;
        Ok(true)
    })();
    match written {
        Ok(true) => Ok(Some(file)),
        // Ours is not left behind (unlocked, it would hold the name for
        // as long as the pid in it lives): removed if the path still
        // names it.
        r => {
            if same_file(&file, &tmp).unwrap_or(false) {
                let _ = std::fs::remove_file(&tmp);
            }
            r.map(|_| None)
        }
    }
}

/// A parsed owner line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct OwnerLine {
    version: u32,
    pid: u32,
    start: u64,
}

/// Parses an owner file's text (version 1 or 2).
fn parse_owner(text: &str) -> Option<OwnerLine> {
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
fn open_owner(path: &Path) -> Result<File, bool> {
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

/// The owner line of `f`, of which at most 256 bytes are read (a line is
/// about 40).
fn read_owner(f: &File) -> Option<OwnerLine> {
    let mut text = String::new();
    f.take(256).read_to_string(&mut text).ok()?;
    parse_owner(&text)
}

/// What an owner (or temporary owner) file says about its owner.
#[derive(Debug)]
enum Verdict {
    /// The owner may be alive: keep its files.
    Alive(Kept),
    /// The owner is dead. With the judged file, open and locked by us: a
    /// removal first checks that the path still names it.
    Dead(Option<File>),
}

/// Why an owner was judged [`Verdict::Alive`]: what a refused claim says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kept {
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
fn judge(path: &Path, name: &SmName) -> Verdict {
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
            tracing::debug!(path = %path.display(), error = %e, "flock on an owner file failed");
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
const TEMP_STALE: Duration = Duration::from_secs(5);

/// Judges a temporary owner file: as [`judge`], except that one without
/// an owner line whose lock is free is dead once older than
/// [`TEMP_STALE`], whatever its pid says (the pid judgement would keep it
/// for as long as that pid lives, and with it refuse the name).
fn judge_temp(path: &Path, name: &SmName) -> Verdict {
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
fn same_file(f: &File, path: &Path) -> io::Result<bool> {
    let ours = f.metadata()?;
    match std::fs::symlink_metadata(path) {
        Ok(m) => Ok(m.dev() == ours.dev() && m.ino() == ours.ino()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Removes `files` (in order) of a group judged dead by `judged`. With
/// `held` (that file, locked by us) only if `judged` still names it; if not
/// (another process replaced it meanwhile) nothing is removed: `None`.
/// Returns the files removed (those already gone are left out).
fn remove_dead(held: Option<&File>, judged: &Path, files: &[PathBuf]) -> SmResult<Option<Vec<PathBuf>>> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
        std::thread::spawn(move || tx.send(cleanup_stale(&d).map_err(|e| e.to_string())));
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
        let text = e.to_string();
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
}
