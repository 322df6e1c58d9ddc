//! A peer that breaks the protocol again and again (a new connection each
//! time) cannot flood the log: the warning comes at the 1st, 2nd, 4th, 8th
//! violation, the others at debug level, and `protocol_errors` counts
//! every one (with refused handshakes, whose log throttle is their own). Real plugins over real shared memory; a binary of its own,
//! for the global tracing subscriber (a thread-local one would share
//! tracing's per-callsite interest cache with threads that have none).

use std::time::{Duration, Instant};

use na_core::{NaError, OpId, Plugin, PluginId};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::private_dir;

const T: Duration = Duration::from_secs(10);

#[test]
fn repeated_protocol_violations_are_all_counted_and_logged_at_powers_of_two() {
    let log = na_testsuite::log::CapturedLog::install_global();

    let dir = private_dir("violation-log");
    let mut taker = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(&dir)).unwrap();
    assert!(taker.pull_unexpected().unwrap(), "sm has a pull mode");
    // Refused handshakes count as protocol errors too, but have a log
    // throttle of their own: they must not move the violations' one.
    const BAD_HELLOS: u64 = 3;
    let sock = dir.join(format!(
        "{}.sock",
        taker.self_addr().uri().trim_start_matches("sm://")
    ));
    for _ in 0..BAD_HELLOS {
        let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        std::io::Write::write_all(&mut s, &[0xab; 64]).unwrap();
    }
    let end = Instant::now() + T;
    while taker.stats().protocol_errors < BAD_HELLOS {
        assert!(
            Instant::now() < end,
            "bad hellos not refused: {:?}",
            taker.stats()
        );
        taker.progress().unwrap();
    }
    const N: u64 = 9;
    for i in 0..N {
        // A new sender each time: a connection is cut off at its violation.
        let mut sender = SmPlugin::new(PluginId(10 + i as u32), SmConfig::default().with_dir(&dir)).unwrap();
        let to = sender.lookup(taker.self_addr().uri()).unwrap();
        sender.debug_forge_unreserved(&to, 9).unwrap();
        let (end, mut op) = (Instant::now() + T, 100);
        let mut buf = Vec::new();
        loop {
            assert!(Instant::now() < end, "violation {i} was never found");
            sender.progress().unwrap();
            taker.progress().unwrap();
            assert!(
                taker.take_unexpected(&mut buf).unwrap().is_none(),
                "a forged message was delivered"
            );
            while sender.pop_completion().is_some() {}
            op += 1;
            match sender.send_unexpected(&to, 10, b"after", OpId(op)) {
                Err(NaError::PeerGone { .. }) => break,
                Err(e) => panic!("{}", na_core::ErrorChain(&e)),
                Ok(()) => {}
            }
        }
        assert_eq!(
            taker.stats().protocol_errors,
            BAD_HELLOS + i + 1,
            "every violation counted"
        );
        assert_eq!(taker.stats().violations, i + 1, "counted apart from the hellos");
    }
    log.assert_throttled("sm protocol violation", "violations", N);
    let _ = std::fs::remove_dir_all(&dir);
}
