//! After the handshake, a peer cannot push descriptors at us.
//!
//! Both ends of an established connection set `SO_PASSRIGHTS` to 0
//! (Linux 6.16): a peer's `sendmsg` with `SCM_RIGHTS` on its socket then
//! fails with `EPERM` at the sender, nothing reaches our descriptor
//! table, and the connection goes on as before. Here both plugins live in
//! this process, so the test reaches each end's socket (through a `dup`
//! found by its addresses) and plays the hostile peer on it. On an older
//! kernel the message arrives: the test says so, and checks the screening
//! instead (the passed descriptor is closed, the sender cut off as a
//! protocol violation, the listener serves on).

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use na_core::{Addr, OpId, Plugin, PluginId};
use na_sm::sys::socket::{peer_closed, refuse_passed_fds, send_with_fds};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::{connection_ends, listener_path, private_dir, sys};

/// Descriptors this process has open.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Whether bytes (or descriptors) wait to be read on `end`.
fn queued(end: &UnixStream) -> bool {
    use std::os::fd::AsRawFd;
    sys::poll_one(end.as_raw_fd(), libc::POLLIN, 0).1 & libc::POLLIN != 0
}

/// Progresses both for `time` (once at least).
fn settle(a: &mut SmPlugin, b: &mut SmPlugin, time: Duration) {
    let end = Instant::now() + time;
    loop {
        a.progress().unwrap();
        b.progress().unwrap();
        if Instant::now() >= end {
            break;
        }
    }
}

/// The first completion of `op` on `p`, progressing both within 10 s.
fn wait_for(p: &mut SmPlugin, other: &mut SmPlugin, op: OpId) -> na_core::Completion {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(Instant::now() < end, "{op:?} never completed");
        p.progress().unwrap();
        other.progress().unwrap();
        if let Some(k) = std::iter::from_fn(|| p.pop_completion()).find(|k| k.op == op) {
            return k;
        }
    }
}

/// A message from `cli` to `srv` (at `to`) and the answer back; returns
/// the client's address as the server saw it.
fn round_trip(cli: &mut SmPlugin, srv: &mut SmPlugin, to: &Addr, n: u64) -> Addr {
    srv.post_recv_unexpected(Vec::new(), OpId(10 * n)).unwrap();
    cli.send_unexpected(to, 3, b"question", OpId(10 * n + 1)).unwrap();
    let got = wait_for(srv, cli, OpId(10 * n));
    assert_eq!(
        got.buf.as_deref(),
        Some(&b"question"[..]),
        "round {n}: {:?}",
        got.status
    );
    let from = got.source.expect("an unexpected receive names its sender");
    cli.post_recv_expected(to, 4, Vec::new(), OpId(10 * n + 2))
        .unwrap();
    srv.send_expected(&from, 4, b"answer", OpId(10 * n + 3)).unwrap();
    let back = wait_for(cli, srv, OpId(10 * n + 2));
    assert_eq!(
        back.buf.as_deref(),
        Some(&b"answer"[..]),
        "round {n}: {:?}",
        back.status
    );
    from
}

/// Whether this kernel knows `SO_PASSRIGHTS` (asked of a socket pair).
fn kernel_refuses_passed_fds() -> bool {
    let (a, _b) = UnixStream::pair().unwrap();
    refuse_passed_fds(a.as_fd())
}

#[test]
fn descriptors_sent_on_an_established_connection_are_refused_and_the_connection_goes_on() {
    let dir = private_dir("passed-rights");
    let mut srv = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(&dir)).unwrap();
    let mut cli = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(&dir)).unwrap();
    let path = listener_path(&dir, srv.self_addr().uri());
    let to = cli.lookup(srv.self_addr().uri()).unwrap();
    let seen_as = round_trip(&mut cli, &mut srv, &to, 1);
    let (connector, acceptor) = connection_ends(&path);
    // Each side has taken in what the handshake carries: the listener its
    // hello (the round trip went through it), the client its
    // acknowledgement once nothing waits on its end (it sets
    // `SO_PASSRIGHTS` as it reads it).
    let end = Instant::now() + Duration::from_secs(10);
    while queued(&connector) {
        assert!(Instant::now() < end, "the client never read its acknowledgement");
        settle(&mut cli, &mut srv, Duration::from_millis(1));
    }
    // What a hostile peer would push: a socket end (whose close may run
    // code of its own, unlike a memfd's).
    let (hostile, _other) = UnixStream::pair().unwrap();
    let errors = (srv.stats().protocol_errors, cli.stats().protocol_errors);
    let baseline = open_fds();

    if !kernel_refuses_passed_fds() {
        na_core::testing::report_not_run(
            "na-sm passed_rights: SO_PASSRIGHTS unavailable (kernel older than 6.16): checking \
             instead that descriptors passed after the handshake are screened and closed, and \
             that the sender is cut off as a protocol violation",
        );
        screened_instead(&mut srv, &mut cli, &connector, hostile.as_fd(), baseline, errors);
        drop((connector, acceptor));
        // The listener serves on: a new client is answered.
        let mut again = SmPlugin::new(PluginId(3), SmConfig::default().with_dir(&dir)).unwrap();
        let to = again.lookup(srv.self_addr().uri()).unwrap();
        round_trip(&mut again, &mut srv, &to, 2);
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }

    // The connector's end pushes at the listener, and the acceptor's end
    // at the client: the kernel refuses both at the sender.
    for (who, end) in [("connector", &connector), ("acceptor", &acceptor)] {
        let e = send_with_fds(end.as_fd(), b"x", &[hostile.as_fd()]).expect_err(&format!(
            "the {who}'s end passed a descriptor after the handshake"
        ));
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "the {who}'s end: {e}");
    }
    // Nothing of them reached either end (no progress ran since: had any
    // byte been queued, it would wait there now), so neither plugin has
    // anything to count or take in, now or later.
    for (who, end) in [("connector", &connector), ("acceptor", &acceptor)] {
        assert!(!queued(end), "a refused send left bytes at the {who}'s end");
    }
    assert_eq!(
        (srv.stats().protocol_errors, cli.stats().protocol_errors),
        errors,
        "a refused send counted as a violation"
    );
    assert_eq!(open_fds(), baseline, "descriptors came into our table");
    // The same connection still carries messages both ways.
    for (who, end) in [("connector", &connector), ("acceptor", &acceptor)] {
        assert!(
            !peer_closed(end.as_fd()).unwrap(),
            "the {who}'s peer closed the connection"
        );
    }
    let from = round_trip(&mut cli, &mut srv, &to, 2);
    assert_eq!(from, seen_as, "the client came back on another connection");
    assert_eq!(srv.stats().peers, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Before Linux 6.16: `fd`, sent on the client's end, reaches the
/// listener, which screens it (closes it off the progress thread), cuts
/// the client off as a protocol violation and keeps no descriptor of it.
fn screened_instead(
    srv: &mut SmPlugin,
    cli: &mut SmPlugin,
    connector: &UnixStream,
    fd: BorrowedFd<'_>,
    baseline: usize,
    errors: (u64, u64),
) {
    let sent = send_with_fds(connector.as_fd(), b"x", &[fd.as_fd()]).expect("sent without SO_PASSRIGHTS");
    assert_eq!(sent, 1);
    // Until the listener has read it (a loaded box may take a while).
    let end = Instant::now() + Duration::from_secs(10);
    while srv.stats().protocol_errors == errors.0 {
        assert!(Instant::now() < end, "the pushed descriptor went unnoticed");
        settle(cli, srv, Duration::from_millis(5));
    }
    // Then until the client's connection is gone (nothing of it is left to
    // read, so nothing more to count): counted once.
    let end = Instant::now() + Duration::from_secs(10);
    while srv.stats().peers > 0 {
        assert!(
            Instant::now() < end,
            "the client was not cut off: {:?}",
            srv.stats()
        );
        settle(cli, srv, Duration::from_millis(5));
    }
    assert_eq!(
        srv.stats().protocol_errors,
        errors.0 + 1,
        "the pushed descriptor was counted more than once"
    );
    let end = Instant::now() + Duration::from_secs(5);
    while open_fds() > baseline {
        assert!(
            Instant::now() < end,
            "{} descriptors more than before",
            open_fds() - baseline
        );
        settle(cli, srv, Duration::from_millis(20));
    }
}
