//! A listen waits, within a bound, for a name whose owner file is locked.
//!
//! A cleanup (at another listener's start, or `qs-sm-cleanup`) holds a
//! dead owner's `flock` while it removes its files. A listener taking that
//! name meanwhile must wait for it rather than report the name in use;
//! one whose name a live owner holds must still be refused, within the
//! bound, with an error that says what holds it. The lock here is a real
//! one, held through another open file description (as another process's
//! would be: `flock` locks belong to the open file description).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use na_core::{Plugin, PluginId};
use na_sm::sys::lock::try_lock_exclusive;
use na_sm::{SmConfig, SmError, SmPlugin};

mod common;
use common::private_dir;

/// The owner and socket files of instance `instance` of this process in
/// `dir`, left as a dead owner leaves them (a version-2 owner line), the
/// owner file locked through a new open file description, returned.
fn dead_owners_files_locked(dir: &Path, instance: &str) -> (File, [PathBuf; 2]) {
    let key = format!("{}-{instance}", std::process::id());
    let owner = dir.join(format!("{key}.owner"));
    let sock = dir.join(format!("{key}.sock"));
    std::fs::write(&owner, format!("qs-sm-owner 2 {} 1\n", std::process::id())).unwrap();
    std::fs::write(&sock, b"").unwrap();
    let held = File::open(&owner).unwrap();
    assert!(
        try_lock_exclusive(&held).unwrap(),
        "the owner file's lock is free"
    );
    (held, [owner, sock])
}

fn listen_as(dir: &Path, instance: &str) -> na_sm::SmResult<SmPlugin> {
    SmPlugin::new(
        PluginId(1),
        SmConfig::listening().with_dir(dir).with_name(instance),
    )
}

/// A cleanup holding the name's lock for 150 ms (then removing the dead
/// owner's files, as `cleanup_stale` does) delays the listen, which then
/// succeeds under that name.
///
/// The listen's claims keep trying for [`TRY_WINDOW`] here (a test hook,
/// for this thread only) rather than the 1 s a listen has: the cleanup
/// thread, descheduled on a loaded machine, could otherwise let the lock
/// go after the listen gave up, a false failure. What the window is for
/// a lock held for good is the next test's.
#[test]
fn a_listen_waits_out_a_cleanup_that_holds_the_names_lock() {
    const HOLD: Duration = Duration::from_millis(150);
    const TRY_WINDOW: Duration = Duration::from_secs(120);
    let dir = private_dir("claim-wait");
    let (held, files) = dead_owners_files_locked(&dir, "busy");
    let t0 = Instant::now();
    let cleanup = std::thread::spawn(move || {
        std::thread::sleep(HOLD);
        for f in &files {
            std::fs::remove_file(f).unwrap();
        }
        drop(held);
    });
    na_sm::cleanup::debug_set_claim_wait(Some(TRY_WINDOW));
    let srv = listen_as(&dir, "busy");
    na_sm::cleanup::debug_set_claim_wait(None);
    let srv = srv.expect("the listen gave up while a cleanup held the name's lock");
    assert!(t0.elapsed() >= HOLD, "listened before the lock was let go");
    cleanup.join().unwrap();
    assert!(
        srv.self_addr().uri().ends_with("-busy"),
        "{}",
        srv.self_addr().uri()
    );
    // The name is the listener's now: its socket is in place, and a
    // client reaches it.
    let mut cli = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(&dir)).unwrap();
    cli.lookup(srv.self_addr().uri())
        .expect("the new listener is reachable");
    drop((cli, srv));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A lock that stays held (a live owner, here another open file
/// description of this process) refuses the listen with `AddrInUse`
/// within the bound (1 s, with room for a loaded machine), saying that
/// the owner file stayed locked and what it names; its files are left as
/// they were.
#[test]
fn a_lock_held_for_good_refuses_the_listen_within_the_bound() {
    let dir = private_dir("claim-held");
    let (held, [owner, sock]) = dead_owners_files_locked(&dir, "held");
    let before = std::fs::read(&owner).unwrap();
    let t0 = Instant::now();
    let e = match listen_as(&dir, "held") {
        Ok(_) => panic!("listened under a name whose owner file is locked"),
        Err(e) => e,
    };
    let waited = t0.elapsed();
    assert!(
        (Duration::from_millis(900)..Duration::from_secs(5)).contains(&waited),
        "refused after {waited:?}"
    );
    let SmError::Listen { source, .. } = &e else {
        panic!("{}", na_core::ErrorChain(&e))
    };
    assert_eq!(
        source.kind(),
        std::io::ErrorKind::AddrInUse,
        "{}",
        na_core::ErrorChain(&e)
    );
    let text = na_core::ErrorChain(&e).to_string();
    for says in [
        "stayed locked for 1s",
        &format!("names pid {}, a live process", std::process::id()),
        "by a live process",
    ] {
        assert!(text.contains(says), "the error does not say {says:?}: {text}");
    }
    assert_eq!(std::fs::read(&owner).unwrap(), before, "the owner file changed");
    assert!(sock.exists(), "the live owner's socket was removed");
    drop(held);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Something at the owner file's path that cannot be opened as one (a
/// symbolic link: owner files are opened with `O_NOFOLLOW`) refuses the
/// listen too, and the error says so rather than that the file stayed
/// locked.
#[test]
fn an_owner_file_that_cannot_be_opened_is_named_as_such() {
    let dir = private_dir("claim-unopenable");
    let owner = dir.join(format!("{}-odd.owner", std::process::id()));
    std::os::unix::fs::symlink("/dev/null", &owner).unwrap();
    let e = match listen_as(&dir, "odd") {
        Ok(_) => panic!("listened under a name whose owner file cannot be opened"),
        Err(e) => e,
    };
    let SmError::Listen { source, .. } = &e else {
        panic!("{}", na_core::ErrorChain(&e))
    };
    assert_eq!(
        source.kind(),
        std::io::ErrorKind::AddrInUse,
        "{}",
        na_core::ErrorChain(&e)
    );
    let text = na_core::ErrorChain(&e).to_string();
    assert!(text.contains("could not be opened as a regular file"), "{text}");
    assert!(!text.contains("stayed locked"), "{text}");
    assert!(
        owner.symlink_metadata().unwrap().file_type().is_symlink(),
        "the link was touched"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
