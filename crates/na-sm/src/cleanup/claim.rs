//! Claiming a name: our owner file, written and locked under a temporary
//! name and linked into place, and what a refused claim says.

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::judge::{judge, judge_temp, open_owner, read_owner, same_file, Kept, OwnerLine, Verdict};
use super::{remove_dead, OWNER_VERSION};
use crate::addr::SmName;
use crate::error::{SmError, SmResult};
use crate::sys::{lock, proc};

/// How long [`claim_name`] keeps trying while the name's owner file stays
/// locked before it reports the name in use. A cleanup in another process
/// holds a dead owner's lock while it removes its files: microseconds
/// usually, but that process may be descheduled (a loaded machine) or
/// slowed by the file system for much longer than a few retries last. A
/// live owner holds the lock for good: its name is refused once this
/// passes (names carry our pid, so that owner shares our pid from another
/// PID namespace, or is this process: rare enough to wait for).
const CLAIM_WAIT: Duration = Duration::from_secs(1);

/// How long this claim keeps trying: [`CLAIM_WAIT`], or (with the
/// `test-hooks` feature) what [`debug_set_claim_wait`] set for the calling
/// thread.
#[cfg(feature = "test-hooks")]
fn claim_wait() -> Duration {
    CLAIM_WAIT_OVERRIDE.get().unwrap_or(CLAIM_WAIT)
}

/// How long this claim keeps trying: [`CLAIM_WAIT`].
#[cfg(not(feature = "test-hooks"))]
fn claim_wait() -> Duration {
    CLAIM_WAIT
}

#[cfg(feature = "test-hooks")]
thread_local! {
    static CLAIM_WAIT_OVERRIDE: std::cell::Cell<Option<Duration>> = const { std::cell::Cell::new(None) };
}

/// Test hook (`test-hooks` feature): the claims of a listen made on the
/// calling thread (and only there) keep trying for `wait` instead of
/// [`CLAIM_WAIT`] (`None`: that again), so that a test that holds a name's
/// lock for a while cannot see its listen give up because the test's
/// other thread was descheduled on a loaded machine. Refusals still name
/// [`CLAIM_WAIT`]. Never use outside tests.
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub fn debug_set_claim_wait(wait: Option<Duration>) {
    CLAIM_WAIT_OVERRIDE.set(wait);
}

/// First and longest pause between [`claim_name`]'s tries (it doubles).
const CLAIM_PAUSE: (Duration, Duration) = (Duration::from_millis(2), Duration::from_millis(50));

/// The temporary owner file of `name` in `dir` (`.<pid>-<instance>.owner.tmp`).
pub(super) fn temp_path(dir: &Path, name: &SmName) -> PathBuf {
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
    let deadline = Instant::now() + claim_wait();
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
pub(super) enum Claim {
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
pub(super) fn try_claim(dir: &Path, name: &SmName) -> io::Result<Claim> {
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
        let line = OwnerLine {
            version: OWNER_VERSION,
            pid: name.pid,
            start,
        };
        writeln!(&file, "{line}")?;
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
