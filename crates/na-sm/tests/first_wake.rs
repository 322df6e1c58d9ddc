//! A wake-up eventfd is readable from its creation (its counter is 1, so
//! that a peer's wake-up, a write of 0, is reported), and epoll reports a
//! ready descriptor once when it is added. Nobody wrote it: a sleep that
//! took that report would end at once, for nothing, and cost the caller a
//! progress round. `Plugin::sleep` takes it beforehand, so every sleep a
//! wake-up descriptor ends is a peer's signal. Two real plugins over real
//! eventfds, in one process; the listener's eventfd joins its epoll set
//! as it handles the client's hello, the case no later poll covered.

use std::time::{Duration, Instant};

use na_core::{OpId, Plugin, PluginId};
use na_sm::{SmConfig, SmPlugin, WakeKind};

mod common;
use common::private_dir;

/// Far above any honest handshake or wake-up, even on a loaded box.
const T: Duration = Duration::from_secs(60);

fn config(dir: &std::path::Path, listening: bool) -> SmConfig {
    let mut cfg = if listening {
        SmConfig::listening()
    } else {
        SmConfig::default()
    };
    cfg = cfg.with_dir(dir);
    cfg.wake = Some(WakeKind::EventFd);
    cfg
}

#[test]
fn no_sleep_ends_for_the_report_of_a_new_wake_up_eventfd() {
    let dir = private_dir("first-wake");
    let mut server = SmPlugin::new(PluginId(1), config(&dir, true)).unwrap();
    let mut client = SmPlugin::new(PluginId(2), config(&dir, false)).unwrap();
    let uri = server.self_addr().uri().to_owned();
    let to_server = client.lookup(&uri).unwrap();
    // The server handles the hello (adding its eventfd to its epoll set)
    // and sends the acknowledgement; the client's next progress reads it
    // (its events are polled on every call while it waits for one).
    let end = Instant::now() + T;
    while server.stats().peers != 1 {
        assert!(Instant::now() < end, "the handshake never ended");
        server.progress().unwrap();
    }
    for _ in 0..4 {
        client.progress().unwrap();
    }

    // Idle, both: no peer signalled, so no sleep may end by a wake-up
    // descriptor. (Each sleep ends at its timeout; nothing asserts how
    // long it took.)
    for p in [&mut server, &mut client] {
        for _ in 0..2 {
            p.sleep(Some(Duration::from_millis(50))).unwrap();
            p.progress().unwrap();
        }
    }
    assert_eq!(client.stats().signals_sent, 0, "the client signalled");
    assert_eq!(server.stats().signals_sent, 0, "the server signalled");
    assert_eq!(
        server.debug_wakeups(),
        0,
        "a sleep of the listener was ended by its new eventfd's first report, with no signal behind it"
    );
    assert_eq!(
        client.debug_wakeups(),
        0,
        "a sleep of the client was ended by its new eventfd's first report, with no signal behind it"
    );

    // A real wake-up is counted: the server sleeps (no timeout but the
    // test's) on a thread; once it armed, the client's message signals it.
    let sleeper = std::thread::spawn(move || {
        server.sleep(Some(T)).unwrap();
        server
    });
    let end = Instant::now() + T;
    while !client.debug_peer_sleeps(&to_server).unwrap() {
        assert!(Instant::now() < end, "the server never armed for a sleep");
        std::thread::sleep(Duration::from_millis(1));
    }
    client
        .send_unexpected(&to_server, 7, b"wake up", OpId(1))
        .unwrap();
    let server = sleeper.join().unwrap();
    assert_eq!(client.stats().signals_sent, 1, "the message did not signal");
    assert_eq!(server.debug_wakeups(), 1, "the signal's wake-up was not counted");

    drop(server);
    drop(client);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether `fd` is readable now (a `poll` of no time).
fn readable(fd: std::os::fd::RawFd) -> bool {
    let (n, revents) = common::sys::poll_one(fd, libc::POLLIN, 0);
    assert!(n >= 0, "poll: {}", std::io::Error::last_os_error());
    n == 1 && revents & libc::POLLIN != 0
}

/// The same report where the caller waits on the plugin's descriptor
/// itself (`try_wait`, then a wait on `poll_fd`: an endpoint of several
/// plugins, an async driver): a hello handled by `try_wait`'s own
/// harvest adds the listener's eventfd after that harvest's wait, and the
/// descriptor `try_wait` declared idle must not be readable for it.
#[test]
fn an_idle_try_wait_leaves_no_report_of_a_new_eventfd_behind() {
    let dir = private_dir("first-wake-try");
    let mut server = SmPlugin::new(PluginId(1), config(&dir, true)).unwrap();
    let mut client = SmPlugin::new(PluginId(2), config(&dir, false)).unwrap();
    let uri = server.self_addr().uri().to_owned();
    let _to_server = client.lookup(&uri).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&server.poll_fd().expect("an epoll descriptor"));
    let end = Instant::now() + T;
    // Only `try_wait` moves the server: its harvests accept the client
    // and handle its hello (a handshake makes no completion to progress).
    let mut idle = false;
    while server.stats().peers != 1 {
        assert!(Instant::now() < end, "the handshake never ended");
        idle = server.try_wait().unwrap();
    }
    // Checked before the client moves again (it might then write to the
    // server for real).
    assert!(idle, "the try_wait that ended the handshake saw work left");
    assert_eq!(client.stats().signals_sent, 0, "the client signalled");
    assert!(
        !readable(fd),
        "try_wait declared the listener idle, yet its descriptor is readable (its new eventfd's report)"
    );
    drop(server);
    drop(client);
    let _ = std::fs::remove_dir_all(&dir);
}
