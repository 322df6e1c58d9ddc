//! A receiver that stays awake publishes how far it read only every
//! `PUBLISH_EVERY` messages (`channel::PUBLISH_EVERY`, 16), not at every
//! poll. A sender whose ring is full queues its sends and sleeps until the
//! receiver says there is room: that word must still come, from the lazy
//! publishes alone, since this receiver never sleeps (sleeping publishes
//! everything). Two real plugins over real shared memory, the sender in a
//! thread of its own in blocking mode, the receiver taking in pull mode
//! and slowly, so that the sender runs ahead and waits again and again.

use std::time::{Duration, Instant};

use na_core::{Endpoint, OpId, Plugin, PluginId, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::private_dir;

const T: Duration = Duration::from_secs(30);
const MESSAGES: u64 = 3000;

#[test]
fn a_sender_waiting_for_room_is_woken_by_an_awake_receivers_lazy_publishes() {
    let dir = private_dir("lazy-publish");
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
            ep.send_unexpected(&to, 7, &i.to_le_bytes(), OpId(i)).unwrap();
        }
        // Every send completes, the queued ones once the receiver made
        // room: the sender sleeps in between (blocking mode).
        let (mut done, end) = (0, Instant::now() + T);
        while done < MESSAGES {
            assert!(
                Instant::now() < end,
                "only {done} of {MESSAGES} sends completed: the sender never got room"
            );
            ep.progress(Some(Duration::from_millis(100))).unwrap();
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
            assert_eq!(buf, next.to_le_bytes(), "message {next} out of order or garbled");
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
