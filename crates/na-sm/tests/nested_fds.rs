//! A lingering socket left in flight inside passed UNIX sockets does not
//! hold a closing thread: na-sm reads a passed UNIX socket out before its
//! close and disposes of the descriptors in flight inside it the same way
//! (sockets set to abort at their close, UNIX sockets read out in turn),
//! within bounds (`MAX_NESTED_DEPTH` levels, `MAX_NESTED_FDS`
//! descriptors), past which the rest is closed as it is.
//!
//! Each test runs alone in a process of its own ([`jam::alone`]): the
//! closing threads and the descriptor table it counts are the process's.

use std::io::Read;
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use na_core::Plugin;
use na_sm::sys::socket::send_with_fds;
use na_sm::{ClosingThreads, MAX_NESTED_DEPTH, MAX_NESTED_FDS};

mod common;
mod jam;
use jam::{
    alone, closing_threads, flood, lingering_socket, listener, nested, open_fds, refusals_reaching,
    serves_an_honest_client, settle_for, wait_closers,
};

/// Every closing thread has nothing to drop: what was handed over is
/// closed.
fn idle(c: &ClosingThreads) -> bool {
    c.threads > 0 && c.idle()
}

/// Passes `levels` UNIX sockets deep a lingering TCP socket to a
/// listener in a hello: its closing thread is not held (a hand-off
/// behind it, once it would have been stuck for `CLOSE_STALL`, starts no
/// second thread), and the TCP connection is reset, not left to linger.
fn nested_lingering_socket_is_reset(tag: &str, levels: usize) {
    let (dir, mut srv, uri, path) = listener(tag);
    settle_for(&mut srv, Duration::from_millis(50));
    let (peer, tcp) = lingering_socket();
    let (mut theirs, _) = peer.accept().unwrap();
    let carrier = nested(tcp.into(), levels);
    let before = srv.stats().handshakes_refused;
    let conn = UnixStream::connect(&path).unwrap();
    send_with_fds(conn.as_fd(), b"hello", &[carrier.as_fd()]).unwrap();
    drop((carrier, conn));
    refusals_reaching(&mut srv, before + 1);
    // Its close ends long before the linger time would.
    let held =
        format!("the lingering socket {levels} level(s) inside the passed one held its closing thread");
    wait_closers(&mut srv, &held, jam::LINGER / 2, idle);
    // A hand-off behind it: another thread if the first were stuck.
    let made = flood(&mut srv, &path, 1);
    refusals_reaching(&mut srv, before + 1 + made);
    wait_closers(
        &mut srv,
        "the hand-off behind it was not closed",
        jam::LINGER / 2,
        idle,
    );
    assert_eq!(
        closing_threads(),
        1,
        "the lingering socket {levels} level(s) inside the passed one held its closing thread"
    );
    expect_reset(&mut theirs);
    serves_an_honest_client(&mut srv, &dir, &uri);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Reads the peer's end of a lingering connection until it is reset
/// (panics if it ends with a FIN, or neither within 10 s).
fn expect_reset(theirs: &mut TcpStream) {
    theirs.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(Instant::now() < end, "the connection was neither reset nor ended");
        match theirs.read(&mut buf) {
            Ok(0) => panic!("the connection ended with a FIN: its close waited for the data to go"),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("reading the peer's end: {e}"),
        }
    }
}

#[test]
fn a_lingering_socket_one_level_inside_a_passed_socket_holds_no_closing_thread() {
    alone(
        "a_lingering_socket_one_level_inside_a_passed_socket_holds_no_closing_thread",
        || nested_lingering_socket_is_reset("nested-1", 1),
    );
}

#[test]
fn a_lingering_socket_two_levels_inside_passed_sockets_holds_no_closing_thread() {
    alone(
        "a_lingering_socket_two_levels_inside_passed_sockets_holds_no_closing_thread",
        || nested_lingering_socket_is_reset("nested-2", 2),
    );
}

/// The read-out is bounded: a chain of UNIX sockets far deeper than
/// `MAX_NESTED_DEPTH`, and a socket stuffed with far more than
/// `MAX_NESTED_FDS` descriptors in flight, each passed in a hello, are
/// closed without holding a closing thread (the rest closed as it is),
/// leave no descriptor open, and the listener goes on serving. The
/// bound is said in the log.
#[test]
fn reading_out_passed_sockets_is_bounded() {
    alone("reading_out_passed_sockets_is_bounded", || {
        let log = na_testsuite::log::CapturedLog::install_global();
        let (dir, mut srv, uri, path) = listener("nested-bound");
        settle_for(&mut srv, Duration::from_millis(50));
        let baseline = open_fds();
        // A chain 50 levels deep, with a plain socket at its end.
        let (end, _) = UnixStream::pair().unwrap();
        let chain = nested(end.into(), MAX_NESTED_DEPTH * 12);
        // A socket with 8 x 253 descriptors in flight (dups of one end).
        let (stuffed, feeder) = UnixStream::pair().unwrap();
        let (x, _y) = UnixStream::pair().unwrap();
        for _ in 0..(2 * MAX_NESTED_FDS).div_ceil(253) {
            let dups: Vec<OwnedFd> = (0..253)
                .map(|_| x.as_fd().try_clone_to_owned().unwrap())
                .collect();
            let raw: Vec<_> = dups.iter().map(|d| d.as_raw_fd()).collect();
            send_many(&feeder, &raw);
        }
        drop((feeder, x));
        let t0 = Instant::now();
        // One at a time: the second is not handed over while the first's
        // read-out may still run (a loaded box may run it late).
        for carrier in [chain, stuffed] {
            let before = srv.stats().handshakes_refused;
            let conn = UnixStream::connect(&path).unwrap();
            send_with_fds(conn.as_fd(), b"hello", &[carrier.as_fd()]).unwrap();
            drop((carrier, conn));
            refusals_reaching(&mut srv, before + 1);
            wait_closers(
                &mut srv,
                "a bounded read-out held its closing thread",
                jam::LINGER / 2,
                idle,
            );
        }
        let before = srv.stats().handshakes_refused;
        let made = flood(&mut srv, &path, 1);
        refusals_reaching(&mut srv, before + made);
        wait_closers(
            &mut srv,
            "the hand-off behind them was not closed",
            jam::LINGER / 2,
            idle,
        );
        assert_eq!(closing_threads(), 1, "a bounded read-out held its closing thread");
        serves_an_honest_client(&mut srv, &dir, &uri);
        assert!(t0.elapsed() < Duration::from_secs(20), "took {:?}", t0.elapsed());
        // What the read-outs took in is closed again (the honest client's
        // connection is the plugin's to keep).
        settle_for(&mut srv, Duration::from_millis(200));
        let grown = open_fds().saturating_sub(baseline);
        assert!(
            grown < 16,
            "{grown} more descriptors open after the bounded read-outs"
        );
        let said = log.lines_at("WARN", "held more in flight than is read out");
        assert!(
            !said.is_empty(),
            "the bound was never reached (or not said):\n{}",
            log.text()
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// The count bound holds: a socket with more than `MAX_NESTED_FDS`
/// descriptors in flight ahead of a lingering socket is read out only
/// that far, and its close, which releases the lingering socket, holds
/// its closing thread (a hand-off behind it starts a second one). This
/// is the jam the other tests fall back to where the kernel refuses a
/// chain deeper than `MAX_NESTED_DEPTH`.
#[test]
fn a_lingering_socket_past_the_count_bound_still_jams() {
    alone("a_lingering_socket_past_the_count_bound_still_jams", || {
        let (dir, mut srv, _, path) = listener("nested-count-jam");
        settle_for(&mut srv, Duration::from_millis(50));
        let (_peer, jam) = jam::stuffed_blocking_close_for(jam::LINGER);
        let jammed = Instant::now();
        jam::jam_with(&path, jam);
        // Until its thread has been stuck past `CLOSE_STALL` (then a
        // hand-off behind it starts a second one).
        let stuck = "the stuffed socket's close did not hold its thread";
        wait_closers(&mut srv, stuck, jam::LINGER / 2, |c| c.stuck == 1);
        flood(&mut srv, &path, 1);
        // (Named once it runs: counted in `/proc` a moment after its start.)
        wait_closers(&mut srv, stuck, jam::LINGER / 2, |c| {
            c.threads == 2 && closing_threads() == 2
        });
        assert!(jammed.elapsed() < jam::LINGER / 2);
        assert_eq!(
            closing_threads(),
            2,
            "the stuffed socket's close did not hold its thread"
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// Sends one message carrying `fds` (up to 253) on `sock`.
fn send_many(sock: &UnixStream, fds: &[std::os::fd::RawFd]) {
    common::sys::send_fds(sock.as_fd(), b"s", fds).unwrap();
}
