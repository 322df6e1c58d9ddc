//! A sender whose ring is full queues its sends and sleeps until the
//! receiver says there is room. The receiver here never sleeps (a sleep
//! publishes how far it read on its own), so the word must come from its
//! polls and takes, with a wake-up each time the sender sleeps. Two real
//! plugins over real shared memory, the sender in a thread of its own in
//! blocking mode, the receiver taking in pull mode and slowly, so that the
//! sender runs ahead and waits again and again; messages in the ring
//! slots and in buffers (over 120 bytes). Each wait of the sender is
//! bounded far below its timeout: a lost wake-up shows as a sleep that
//! runs to the timeout.

use std::time::{Duration, Instant};

use na_core::{Endpoint, OpId, Plugin, PluginId, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::private_dir;

const T: Duration = Duration::from_secs(60);
const MESSAGES: u64 = 3000;

#[test]
fn a_sender_waiting_for_room_is_woken_by_an_awake_receiver() {
    for len in [8usize, 1000] {
        sender_waits_and_is_woken(len);
    }
}

/// Sizes: 8 bytes (slots run out first) and 1,000 (buffers run out).
fn sender_waits_and_is_woken(len: usize) {
    let dir = private_dir(&format!("credit-wake-{len}"));
    let mut taker = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(&dir)).unwrap();
    assert!(taker.pull_unexpected().unwrap(), "sm has a pull mode");
    let uri = taker.self_addr().uri().to_owned();

    let sender_dir = dir.clone();
    let sender = std::thread::spawn(move || {
        let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
        let id = ep
            .add_plugin(|id| {
                Ok(Box::new(SmPlugin::new(
                    id,
                    SmConfig::default().with_dir(&sender_dir),
                )?))
            })
            .unwrap();
        let to = ep.lookup(&uri).unwrap();
        for i in 0..MESSAGES {
            ep.send_unexpected(&to, 7, &message(i, len), OpId(i)).unwrap();
        }
        // Every send completes, the queued ones once the receiver made
        // room: the sender sleeps in between (blocking mode).
        let (mut done, end) = (0, Instant::now() + T);
        while done < MESSAGES {
            assert!(
                Instant::now() < end,
                "only {done} of {MESSAGES} sends completed: the sender never got room"
            );
            // A wake-up lost would leave this sleep to its timeout.
            let t0 = Instant::now();
            ep.progress(Some(Duration::from_secs(10))).unwrap();
            assert!(
                t0.elapsed() < Duration::from_secs(3),
                "the sender slept {:?} with {done} of {MESSAGES} sends done: a wake-up was lost",
                t0.elapsed()
            );
            while let Some(c) = ep.pop_completion() {
                c.status.unwrap();
                done += 1;
            }
        }
        ep.plugin(id).unwrap().stats()
    });

    // The receiver: awake throughout (progress and takes, never a sleep),
    // and slow, a pause every few messages.
    let (mut buf, mut next, end) = (Vec::new(), 0u64, Instant::now() + T);
    while next < MESSAGES {
        assert!(Instant::now() < end, "only {next} of {MESSAGES} messages came");
        taker.progress().unwrap();
        while let Some((_, tag)) = taker.take_unexpected(&mut buf).unwrap() {
            assert_eq!(tag, 7);
            assert!(
                buf == message(next, len),
                "message {next} ({len} bytes) out of order or garbled"
            );
            next += 1;
            if next % 5 == 0 {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
    let sent = sender.join().expect("the sender failed");
    assert!(
        sent.sends_queued > 0,
        "the ring never filled: nothing tested ({sent:?})"
    );
    let got = taker.stats();
    assert!(
        got.signals_sent > 0,
        "the sender never slept waiting for room: nothing tested ({got:?})"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Message `i` of `len` bytes: its number, then a pattern of it.
fn message(i: u64, len: usize) -> Vec<u8> {
    let mut m = i.to_le_bytes().to_vec();
    m.extend((8..len).map(|j| (i as usize * 13 + j) as u8));
    m
}
