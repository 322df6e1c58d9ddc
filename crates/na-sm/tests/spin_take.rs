//! The busy path of pull mode: the spin loop (`Plugin::spin_wait`) sees an
//! unexpected message arrive and validates its slot, and the take right
//! after copies it out without reading the slot again. Every message must
//! come out once, whole and in order, whatever its size (inline in the
//! slot or in a buffer) and whether or not a progress call comes between
//! the spin and the take. Two real plugins over real shared memory in one
//! process.

use std::path::Path;
use std::time::{Duration, Instant};

use na_core::{OpId, Plugin, PluginId, Tag};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::private_dir;

const T: Duration = Duration::from_secs(10);

/// Sizes on both sides of the inline limit (`INLINE_MAX`, 120 bytes) and
/// up to a whole buffer.
const SIZES: [usize; 9] = [0, 1, 7, 8, 56, 120, 121, 4096, 8192];

fn payload(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 31 + j * 7) as u8).collect()
}

/// A listening plugin in pull mode, the taker of these tests.
fn pull_taker(dir: &Path) -> SmPlugin {
    let mut taker = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(dir)).unwrap();
    assert!(taker.pull_unexpected().unwrap(), "sm has a pull mode");
    taker
}

/// A sending plugin of id `id`.
fn sender(dir: &Path, id: u32) -> SmPlugin {
    SmPlugin::new(PluginId(id), SmConfig::default().with_dir(dir)).unwrap()
}

/// Spins on `p` until it says an unexpected message waits; `sender` makes
/// progress between spins (its sends wait for ring room once the taker
/// has not published how far it read for a while).
fn spin_until_seen(p: &mut SmPlugin, sender: &mut SmPlugin) {
    let end = Instant::now() + T;
    loop {
        assert!(Instant::now() < end, "the spin loop never saw the message");
        let checks = p.spin_wait(1000);
        if checks < 1000 && p.unexpected_ready() {
            return;
        }
        // The socket events were due (or nothing came yet): a progress
        // call, as the endpoint makes.
        p.progress().unwrap();
        sender.progress().unwrap();
    }
}

#[test]
fn messages_seen_by_the_spin_loop_are_taken_once_whole_and_in_order() {
    let dir = private_dir("spin-take");
    let mut taker = pull_taker(&dir);
    let mut sender = sender(&dir, 2);
    let to = sender.lookup(taker.self_addr().uri()).unwrap();

    // The first message also completes the handshake.
    sender.send_unexpected(&to, 1, b"hello", OpId(1)).unwrap();
    let mut buf = Vec::new();
    let end = Instant::now() + T;
    loop {
        assert!(Instant::now() < end, "the handshake never finished");
        sender.progress().unwrap();
        taker.progress().unwrap();
        if let Some((_, tag)) = taker.take_unexpected(&mut buf).unwrap() {
            assert_eq!((tag, buf.as_slice()), (1, &b"hello"[..]));
            break;
        }
    }
    assert!(taker.take_unexpected(&mut buf).unwrap().is_none());

    for i in 0..400usize {
        let len = SIZES[i % SIZES.len()];
        let sent = payload(i, len);
        let tag = 100 + i as Tag;
        sender
            .send_unexpected(&to, tag, &sent, OpId(10 + i as u64))
            .unwrap();
        // Every other round, a second message waits behind the first one:
        // it is taken by the take after, from the same ring.
        let second = (i % 2 == 1).then(|| payload(i + 1000, SIZES[(i + 4) % SIZES.len()]));
        if let Some(m) = &second {
            sender
                .send_unexpected(&to, tag + 1000, m, OpId(100_000 + i as u64))
                .unwrap();
        }
        spin_until_seen(&mut taker, &mut sender);
        // Every third round, the endpoint's progress call comes between
        // the spin and the take (a caller's loop may make one).
        if i % 3 == 0 {
            taker.progress().unwrap();
        }
        let (src, got_tag) = taker
            .take_unexpected(&mut buf)
            .unwrap()
            .unwrap_or_else(|| panic!("message {i} seen but not taken"));
        assert_eq!(src.uri(), sender.self_addr().uri());
        assert_eq!(got_tag, tag, "message {i}: wrong tag");
        assert_eq!(buf, sent, "message {i} ({len} bytes) came out wrong");
        if let Some(m) = &second {
            // It may still wait in the sender's backlog for ring room (the
            // taker publishes how far it read in its progress calls).
            let end = Instant::now() + T;
            let t2 = loop {
                if let Some((_, t2)) = taker.take_unexpected(&mut buf).unwrap() {
                    break t2;
                }
                assert!(Instant::now() < end, "the message behind {i} was not taken");
                taker.progress().unwrap();
                sender.progress().unwrap();
            };
            assert_eq!(
                (t2, &buf),
                (tag + 1000, m),
                "the message behind {i} came out wrong"
            );
        }
        // Taken once: the next take finds nothing.
        assert!(
            taker.take_unexpected(&mut buf).unwrap().is_none(),
            "message {i} was delivered twice, or one that was never sent"
        );
        // The sender's completions (none: failures only) and its ring's
        // read position, published by the taker's next progress call.
        sender.progress().unwrap();
    }
    assert_eq!(taker.stats().protocol_errors, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn with_two_senders_each_message_is_taken_once_from_its_own_ring() {
    let dir = private_dir("spin-take-two");
    let mut taker = pull_taker(&dir);
    let mut a = sender(&dir, 2);
    let mut b = sender(&dir, 3);
    let to_a = a.lookup(taker.self_addr().uri()).unwrap();
    let to_b = b.lookup(taker.self_addr().uri()).unwrap();
    let (uri_a, uri_b) = (a.self_addr().uri().to_string(), b.self_addr().uri().to_string());

    // Both handshakes, by a first message each.
    a.send_unexpected(&to_a, 1, b"a", OpId(1)).unwrap();
    b.send_unexpected(&to_b, 1, b"b", OpId(1)).unwrap();
    let mut buf = Vec::new();
    let mut greeted = Vec::new();
    let end = Instant::now() + T;
    while greeted.len() < 2 {
        assert!(Instant::now() < end, "the handshakes never finished");
        a.progress().unwrap();
        b.progress().unwrap();
        taker.progress().unwrap();
        while let Some((src, _)) = taker.take_unexpected(&mut buf).unwrap() {
            greeted.push(src.uri().to_string());
        }
    }
    greeted.sort();
    let mut both = vec![uri_a.clone(), uri_b.clone()];
    both.sort();
    assert_eq!(greeted, both);

    for i in 0..300usize {
        // Round by round: A alone, B alone, or both (in either order).
        let senders: &[bool] = match i % 4 {
            0 => &[true],
            1 => &[false],
            2 => &[true, false],
            _ => &[false, true],
        };
        let mut expected = Vec::new();
        for (k, &from_a) in senders.iter().enumerate() {
            let len = SIZES[(i + 3 * k) % SIZES.len()];
            let msg = payload(i * 2 + k, len);
            let tag = 1000 + (i * 2 + k) as Tag;
            let (p, to, uri) = if from_a {
                (&mut a, &to_a, &uri_a)
            } else {
                (&mut b, &to_b, &uri_b)
            };
            p.send_unexpected(to, tag, &msg, OpId(10 + (i * 2 + k) as u64))
                .unwrap();
            expected.push((uri.clone(), tag, msg));
        }
        let end = Instant::now() + T;
        loop {
            assert!(
                Instant::now() < end,
                "round {i}: the spin loop never saw a message"
            );
            if taker.spin_wait(1000) < 1000 && taker.unexpected_ready() {
                break;
            }
            taker.progress().unwrap();
            a.progress().unwrap();
            b.progress().unwrap();
        }
        let mut got = Vec::new();
        let end = Instant::now() + T;
        while got.len() < expected.len() {
            assert!(
                Instant::now() < end,
                "round {i}: only {} of {} taken",
                got.len(),
                expected.len()
            );
            match taker.take_unexpected(&mut buf).unwrap() {
                Some((src, tag)) => got.push((src.uri().to_string(), tag, buf.clone())),
                None => {
                    taker.progress().unwrap();
                    a.progress().unwrap();
                    b.progress().unwrap();
                }
            }
        }
        // One ring's messages come in order; the two rings in any order.
        got.sort_by_key(|(_, tag, _)| *tag);
        assert_eq!(got, expected, "round {i}: wrong messages taken");
        assert!(
            taker.take_unexpected(&mut buf).unwrap().is_none(),
            "round {i}: a message was delivered twice, or one that was never sent"
        );
        a.progress().unwrap();
        b.progress().unwrap();
    }
    assert_eq!(taker.stats().protocol_errors, 0);
    let _ = std::fs::remove_dir_all(&dir);
}
