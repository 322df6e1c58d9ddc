//! A peer cannot stall a listener with the descriptors it passes.
//!
//! Closing a descriptor runs its file's release when ours is the last
//! reference, and some releases wait: a TCP socket with `SO_LINGER` and
//! unsent data waits out its linger time. Passed directly, such a socket
//! no longer waits (na-sm sets the sockets it discards to abort at their
//! close), nor left in flight inside passed UNIX sockets (na-sm reads
//! them out first: `nested_fds.rs`); nested deeper than na-sm reads out,
//! it still does, when the deepest socket read out is closed
//! ([`jam::blocking_close`]: the jam these tests use). A hostile connector passes such a descriptor (in place of the
//! memfd and eventfd a hello carries), or leaves it queued on the
//! connection, then closes its own copy: the listener must refuse the
//! handshake and go on at once (the close happens on na-sm's closing
//! threads), not block its progress call.
//!
//! Each test runs alone in a process of its own ([`jam::alone`]): the
//! closing threads, their queue and the descriptor table the tests jam
//! and count are the process's.

use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use na_core::Plugin;
use na_sm::sys::socket::send_with_fds;
use na_sm::{SmPlugin, MAX_PENDING_FDS};

mod common;
mod jam;
use jam::{
    alone, blocking_close, closing_threads, congested_or_all_refused, flood, jam_every_closing_thread,
    jam_with, lingering_socket, listener, open_fds, refusals_reaching, serves_an_honest_client, settle_for,
    wait_closers, LINGER,
};

#[test]
fn descriptors_whose_close_blocks_do_not_stall_the_listener() {
    alone("descriptors_whose_close_blocks_do_not_stall_the_listener", || {
        let (dir, srv, uri, path) = listener("hostile-fds");
        // Progress runs on a thread of its own: a blocked close shows as a
        // call that does not come back.
        let (to_srv, calls) = mpsc::channel::<()>();
        let (done, answers) = mpsc::channel();
        let server = std::thread::spawn(move || {
            let mut srv = srv;
            for () in calls {
                let end = Instant::now() + Duration::from_millis(200);
                while Instant::now() < end {
                    srv.progress().unwrap();
                }
                if done.send(srv.stats().protocol_errors).is_err() {
                    break;
                }
            }
            srv
        });
        let mut kept = Vec::new();
        let mut errors_before = 0;
        // 1: the jam passed as the hello's two descriptors.
        // 2: a garbage hello, then the jam queued behind it.
        for variant in 1..=2 {
            let (listener, jam) = blocking_close();
            let conn = UnixStream::connect(&path).unwrap();
            let fds = [jam.as_fd(), jam.as_fd()];
            if variant == 1 {
                send_with_fds(conn.as_fd(), b"hello, with a jam", &fds).unwrap();
            } else {
                // More than any hello's buffer: the message with the
                // descriptors stays queued behind what is read, and goes with
                // the socket when the listener drops it.
                send_with_fds(conn.as_fd(), &[b'?'; 4096], &[]).unwrap();
                send_with_fds(conn.as_fd(), b"x", &fds).unwrap();
            }
            // The listener's copies are now the last: its close would block.
            drop(jam);
            kept.push((listener, conn));
            to_srv.send(()).unwrap();
            let t0 = Instant::now();
            let errors = answers.recv_timeout(LINGER / 2).unwrap_or_else(|_| {
                panic!("variant {variant}: a progress call blocked on a peer's descriptor")
            });
            assert!(t0.elapsed() < LINGER / 2);
            assert_eq!(
                errors,
                errors_before + 1,
                "variant {variant}: the bad hello went uncounted"
            );
            errors_before = errors;
        }
        drop(to_srv);
        let mut srv = server.join().unwrap();
        // Still serving: an honest client's message arrives.
        serves_an_honest_client(&mut srv, &dir, &uri);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// A lingering TCP socket passed directly, the cheapest jam, holds no
/// closing thread: the thread sets it to abort at its close, so the
/// connection is reset at once instead of waiting out the linger time
/// (with the thread stuck, a hand-off behind it started a second one,
/// and the peer saw the connection end with a FIN once it read it all).
#[test]
fn a_passed_lingering_socket_is_reset_not_waited_for() {
    alone("a_passed_lingering_socket_is_reset_not_waited_for", || {
        let (dir, mut srv, _, path) = listener("hostile-fds-abort");
        settle_for(&mut srv, Duration::from_millis(50));
        let (peer, tcp) = lingering_socket();
        let (mut theirs, _) = peer.accept().unwrap();
        let before = srv.stats().handshakes_refused;
        let conn = UnixStream::connect(&path).unwrap();
        send_with_fds(conn.as_fd(), b"hello", &[tcp.as_fd()]).unwrap();
        drop((tcp, conn));
        refusals_reaching(&mut srv, before + 1);
        // Its close ends long before the linger time would.
        let idle = |c: &na_sm::ClosingThreads| c.threads > 0 && c.idle();
        wait_closers(
            &mut srv,
            "the lingering socket held its closing thread",
            LINGER / 2,
            idle,
        );
        // A hand-off behind it: another thread if the first were stuck.
        let made = flood(&mut srv, &path, 1);
        refusals_reaching(&mut srv, before + 1 + made);
        wait_closers(
            &mut srv,
            "the hand-off behind it was not closed",
            LINGER / 2,
            idle,
        );
        assert_eq!(
            closing_threads(),
            1,
            "the lingering socket held its closing thread"
        );
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
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// A connection the listener never accepted, with a jam queued on it, goes when the listener is closed: dropping the plugin
/// does not wait for the jam's close.
#[test]
fn dropping_a_listener_with_unaccepted_descriptors_does_not_block() {
    alone(
        "dropping_a_listener_with_unaccepted_descriptors_does_not_block",
        || {
            let (dir, srv, _, path) = listener("hostile-fds-drop");
            let (listener, jam) = blocking_close();
            // Queued in the accept queue (no progress call accepts it).
            let conn = UnixStream::connect(&path).unwrap();
            send_with_fds(conn.as_fd(), b"x", &[jam.as_fd()]).unwrap();
            drop(jam);
            let (done, dropped) = mpsc::channel();
            std::thread::spawn(move || {
                drop(srv);
                let _ = done.send(());
            });
            dropped
                .recv_timeout(LINGER / 2)
                .expect("dropping the plugin blocked on a descriptor queued on an unaccepted connection");
            drop((listener, conn));
            let _ = std::fs::remove_dir_all(&dir);
        },
    );
}

/// One close that never ends (a jam passed in a hello) does
/// not refuse handshakes: once its closing thread has been stuck for
/// `CLOSE_STALL`, another takes the queue on, so a flood of descriptors
/// behind the jam (more than `MAX_PENDING_FDS`) does not congest it, and
/// an honest client is served while the jam lasts. (With a single closing
/// thread the client was refused until the jamming close ended.)
#[test]
fn handshakes_are_accepted_while_one_closing_thread_is_jammed() {
    alone(
        "handshakes_are_accepted_while_one_closing_thread_is_jammed",
        || {
            let (dir, mut srv, uri, path) = listener("hostile-fds-one-jam");
            settle_for(&mut srv, Duration::from_millis(50));
            // The jam, for longer than the test.
            let (_peer, jam) = blocking_close();
            let jammed = Instant::now();
            jam_with(&path, jam);
            // Until its thread has been stuck past `CLOSE_STALL`: the flood's
            // first hand-off then starts another.
            wait_closers(&mut srv, "the jam's thread stuck", LINGER / 2, |c| c.stuck == 1);
            let before = srv.stats().handshakes_refused;
            let made = flood(&mut srv, &path, 2 * MAX_PENDING_FDS / 4 + 100);
            // Every flood hello refused before the baseline (on a loaded machine
            // they are still being refused well after the flood ends).
            let refused = refusals_reaching(&mut srv, before + made);
            serves_an_honest_client(&mut srv, &dir, &uri);
            assert!(
                jammed.elapsed() < LINGER / 2,
                "served only after the jam may have cleared"
            );
            assert!(
                closing_threads() >= 2,
                "no closing thread was started beside the jammed one"
            );
            assert_eq!(
                srv.stats().handshakes_refused,
                refused,
                "the honest client was refused"
            );
            let _ = std::fs::remove_dir_all(&dir);
        },
    );
}

/// A peer that jams every closing thread and then
/// sends hello after hello with descriptors cannot fill our descriptor
/// table: past `MAX_PENDING_FDS` waiting to be closed the listener refuses
/// handshakes unread and pauses accepts; once the jam clears, it serves
/// again.
#[test]
fn a_jammed_closing_thread_does_not_let_peers_fill_the_descriptor_table() {
    alone(
        "a_jammed_closing_thread_does_not_let_peers_fill_the_descriptor_table",
        || {
            // Longer than jamming every thread and the flood take, even on a
            // loaded box (dropping the lingering sockets' peers resets them
            // sooner).
            const JAM: Duration = Duration::from_secs(10);
            let (dir, mut srv, uri, path) = listener("hostile-fds-jam");
            let settle = |srv: &mut SmPlugin| settle_for(srv, Duration::from_millis(50));
            settle(&mut srv);
            let baseline = open_fds();
            // The jam.
            let peers = jam_every_closing_thread(&mut srv, &path, JAM);
            // The flood: 400 hellos of 4 socket ends each (1,600 descriptors),
            // taken in until the accepts pause (or, without the bound, all
            // read), then a little more time to take in more.
            let before = srv.stats().handshakes_refused;
            let made = flood(&mut srv, &path, 400);
            congested_or_all_refused(&mut srv, before, made);
            settle(&mut srv);
            let grown = open_fds().saturating_sub(baseline);
            assert!(
                grown < MAX_PENDING_FDS + 200,
                "{grown} more descriptors open while the closing threads are jammed"
            );
            assert!(
                srv.stats().flow_blocked > 0,
                "accepts never paused: the jammed threads did not hold the flood"
            );
            // The jam clears (its sockets are reset, or the linger time
            // passes) and what was queued behind it is closed: an honest
            // client is served.
            drop(peers);
            wait_closers(&mut srv, "the jam never cleared", 3 * JAM, |c| c.idle());
            serves_an_honest_client(&mut srv, &dir, &uri);
            let _ = std::fs::remove_dir_all(&dir);
        },
    );
}

/// A jammed closing thread keeps open only what jammed it and what is
/// queued behind it: the sockets of honest peers that come and go (both
/// ends are in this process here) are closed in place once read out, so a
/// jam leaks no descriptor per connection. (Every such socket used to wait
/// behind the jam, uncounted.)
#[test]
fn connections_that_come_and_go_while_the_closing_thread_is_jammed_leave_nothing_open() {
    alone(
        "connections_that_come_and_go_while_the_closing_thread_is_jammed_leave_nothing_open",
        || {
            const CLIENTS: usize = 40;
            let (dir, mut srv, uri, path) = listener("hostile-fds-churn");
            let settle = |srv: &mut SmPlugin| settle_for(srv, Duration::from_millis(30));
            // The jam, for longer than the test: the socket's close waits out
            // LINGER on the closing thread (the test process may end first).
            let (_peer, jam) = blocking_close();
            jam_with(&path, jam);
            settle(&mut srv);
            // One client first: what a connection keeps for the plugin's lifetime
            // (if anything) is not a leak.
            serves_an_honest_client(&mut srv, &dir, &uri);
            settle(&mut srv);
            let jammed = open_fds();
            for _ in 0..CLIENTS {
                serves_an_honest_client(&mut srv, &dir, &uri);
                settle(&mut srv);
            }
            // Until the last clients' departures are seen (a loaded box may
            // take a while): a leak per connection stays.
            let end = Instant::now() + Duration::from_secs(20);
            let grown = loop {
                settle(&mut srv);
                let grown = open_fds().saturating_sub(jammed);
                if grown < CLIENTS / 4 || Instant::now() > end {
                    break grown;
                }
            };
            assert!(
                grown < CLIENTS / 4,
                "{grown} more descriptors open after {CLIENTS} clients came and went behind a jammed closing thread"
            );
            let _ = std::fs::remove_dir_all(&dir);
        },
    );
}

/// Past the closing queue's bound, a socket being closed is not read out
/// (that would take its queued descriptors into our table whatever the
/// bound): it goes whole to a closing thread. Here the listener holds
/// connections it never accepted, each with 256 descriptors queued,
/// when the plugin is dropped behind jammed, congested closing threads.
#[test]
fn sockets_closed_past_the_bound_are_not_read_out() {
    alone("sockets_closed_past_the_bound_are_not_read_out", || {
        let (dir, mut srv, _, path) = listener("hostile-fds-bound");
        let settle = |srv: &mut SmPlugin| settle_for(srv, Duration::from_millis(50));
        settle(&mut srv);
        let baseline = open_fds();
        // The jam, for longer than the test.
        let _peers = jam_every_closing_thread(&mut srv, &path, LINGER);
        // Congestion: hellos of 4 socket ends each until the listener stops
        // taking them (accepts pause past the bound).
        let before = srv.stats().handshakes_refused;
        let made = flood(&mut srv, &path, 100);
        let paused = congested_or_all_refused(&mut srv, before, made);
        assert!(
            paused > 0,
            "accepts never paused: the jammed threads did not hold the flood"
        );
        settle(&mut srv);
        // Connections left in the accept queue, 256 descriptors queued on each.
        let (x, _y) = UnixStream::pair().unwrap();
        let mut queued = Vec::new();
        for _ in 0..6 {
            let Ok(conn) = UnixStream::connect(&path) else {
                break;
            };
            // (send_with_fds takes a few at a time: 64 messages of 4.)
            for _ in 0..64 {
                let dups: Vec<std::os::fd::OwnedFd> =
                    (0..4).map(|_| x.as_fd().try_clone_to_owned().unwrap()).collect();
                let raw: Vec<_> = dups.iter().map(|d| d.as_fd()).collect();
                send_with_fds(conn.as_fd(), b"h", &raw).unwrap();
            }
            queued.push(conn);
        }
        assert!(queued.len() >= 2, "no connection could be queued");
        drop(queued);
        let before_drop = open_fds();
        drop(srv);
        let grown = open_fds().saturating_sub(baseline);
        assert!(
            grown < MAX_PENDING_FDS + 200,
            "{grown} more descriptors open after dropping the plugin (before the drop: {})",
            before_drop.saturating_sub(baseline)
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}
