//! `lookup` of a listener that never accepts (its queue full) fails within
//! the handshake timeout instead of blocking in `connect` forever.

use std::os::fd::AsFd;

mod common;
use common::sys;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use na_core::{Endpoint, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

#[test]
fn lookup_of_a_listener_that_never_accepts_fails_within_its_timeout() {
    let dir = std::env::temp_dir().join(format!("qs-sm-stuck-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let pid = std::process::id();
    let path = dir.join(format!("{pid}-stuck.sock"));
    let listener = UnixListener::bind(&path).unwrap();
    // Backlog 0 makes one pending connection fill the queue.
    assert_eq!(sys::listen(listener.as_fd(), 0), 0);
    let _queued = UnixStream::connect(&path).expect("the first connection is queued");
    let (tx, rx) = mpsc::channel();
    let d = dir.clone();
    std::thread::spawn(move || {
        let cfg = SmConfig {
            handshake_timeout: Duration::from_millis(300),
            ..SmConfig::default()
        }
        .with_dir(&*d);
        let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
        ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
            .unwrap();
        let t0 = Instant::now();
        let r = ep.lookup(&format!("sm://{pid}-stuck")).map(|_| ());
        let _ = tx.send((r, t0.elapsed()));
    });
    let (r, took) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("lookup still blocked after 20 s");
    let e = r.expect_err("nobody accepts, so lookup cannot succeed");
    assert!(
        na_core::ErrorChain(&e).to_string().contains("not accepting"),
        "{e:?}"
    );
    assert!(
        took >= Duration::from_millis(250),
        "gave up after {took:?}, before its timeout"
    );
    drop(listener);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Connections that never send their hello: one process holds at most
/// `MAX_PENDING_PER_PROCESS` of them waiting (its next one is refused at
/// once, with the reason, and the listener does not pause for it; many
/// processes past `MAX_PENDING_HANDSHAKES` pause it, see
/// `handshake_limits.rs`); each waiting one is closed when its own
/// handshake times out, and an honest client is served.
#[test]
fn silent_connections_beyond_the_handshake_limit_wait_and_are_closed() {
    use na_core::OpId;
    use std::io::Read;
    let dir = std::env::temp_dir().join(format!("qs-sm-silent-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    // 2 s, far above the 150 ms the test first watches for early closes:
    // with 400 ms, one progress call held ~250 ms by the scheduler of a
    // loaded box let the timeouts fire inside that window (seen once).
    let cfg = SmConfig {
        listen: true,
        handshake_timeout: Duration::from_secs(2),
        ..SmConfig::default()
    }
    .with_dir(&*dir);
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let me = ep.self_addr(id).unwrap();
    let key = me.uri().strip_prefix("sm://").unwrap().to_owned();
    let path = dir.join(format!("{key}.sock"));
    let mut silent: Vec<UnixStream> = (0..na_sm::MAX_PENDING_PER_PROCESS)
        .map(|_| UnixStream::connect(&path).unwrap())
        .collect();
    for s in &silent {
        s.set_nonblocking(true).unwrap();
    }
    // One more from this process: refused at once.
    let mut over = UnixStream::connect(&path).unwrap();
    over.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // Closed ones read end-of-file; kept ones would block.
    let closed = |silent: &mut Vec<UnixStream>| {
        silent
            .iter_mut()
            .filter(|s| matches!((&**s).read(&mut [0u8; 1]), Ok(0)))
            .count()
    };
    // 150 ms, and until the one over the bound is refused (at most 1.5 s,
    // short of the handshake timeout: a loaded box may run us late).
    let t0 = Instant::now();
    let refused = |ep: &Endpoint| ep.plugin(id).unwrap().stats().handshakes_refused;
    while t0.elapsed() < Duration::from_millis(150)
        || (refused(&ep) == 0 && t0.elapsed() < Duration::from_millis(1500))
    {
        ep.progress(Some(Duration::from_millis(10))).unwrap();
    }
    assert_eq!(closed(&mut silent), 0, "closed before its handshake timed out");
    let st = ep.plugin(id).unwrap().stats();
    assert_eq!(st.flow_blocked, 0, "accepting paused for one process: {st:?}");
    assert_eq!(st.handshakes_refused, 1, "{st:?}");
    let mut refusal = Vec::new();
    over.read_to_end(&mut refusal).unwrap();
    let text = String::from_utf8_lossy(&refusal);
    assert!(text.contains("waiting for their hello"), "{text:?}");
    let end = Instant::now() + Duration::from_secs(10);
    let mut n = 0;
    while n < silent.len() {
        assert!(Instant::now() < end, "only {n} silent connections were closed");
        ep.progress(Some(Duration::from_millis(10))).unwrap();
        n = closed(&mut silent);
    }
    drop(silent);
    // An honest client gets through.
    let (tx, rx) = mpsc::channel();
    let (d, uri) = (dir.clone(), me.uri().to_owned());
    std::thread::spawn(move || {
        let cfg = SmConfig::default().with_dir(&*d);
        let mut c = Endpoint::new(ProgressMode::Blocking).unwrap();
        let cid = c
            .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
            .unwrap();
        let _ = cid;
        let a = c.lookup(&uri).unwrap();
        c.send_unexpected(&a, 5, b"hello", OpId(1)).unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            c.progress(Some(Duration::from_millis(10))).unwrap();
            if std::iter::from_fn(|| c.pop_completion()).any(|k| k.op == OpId(1)) {
                break;
            }
        }
        let _ = tx.send(());
        std::thread::sleep(Duration::from_millis(500));
    });
    ep.post_recv_unexpected(id, Vec::new(), OpId(2)).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(Instant::now() < end, "the honest client was not served");
        ep.progress(Some(Duration::from_millis(10))).unwrap();
        if let Some(c) = std::iter::from_fn(|| ep.pop_completion()).find(|c| c.op == OpId(2)) {
            assert_eq!(c.buf.as_deref(), Some(&b"hello"[..]));
            break;
        }
    }
    let _ = rx.recv_timeout(Duration::from_secs(10));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A zero handshake timeout would mean no limit at all (the socket layer
/// reads zero so): refused when the plugin is made.
#[test]
fn a_zero_handshake_timeout_is_refused() {
    let cfg = SmConfig {
        handshake_timeout: Duration::ZERO,
        ..SmConfig::default()
    };
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    match ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>)) {
        Err(e) => assert!(
            na_core::ErrorChain(&e).to_string().contains("handshake_timeout"),
            "{e:?}"
        ),
        Ok(_) => panic!("a zero handshake timeout was accepted"),
    }
}

/// `try_lookup` never waits: a listener whose queue is full gives
/// `WouldBlock` at once (nothing set up: the next attempt tries again),
/// and, once the handshake timeout has passed since the first attempt,
/// the error the blocking `lookup` gives when its wait runs out. A healthy
/// listener is connected to (and messaged) as with `lookup`.
#[test]
fn try_lookup_does_not_wait_for_a_listener_that_never_accepts() {
    use na_core::{NaError, OpId};
    let dir = std::env::temp_dir().join(format!("qs-sm-trylookup-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let pid = std::process::id();
    let path = dir.join(format!("{pid}-stuck.sock"));
    let listener = UnixListener::bind(&path).unwrap();
    // Backlog 0 makes one pending connection fill the queue.
    assert_eq!(sys::listen(listener.as_fd(), 0), 0);
    let _queued = UnixStream::connect(&path).expect("the first connection is queued");
    let timeout = Duration::from_secs(3);
    let cfg = |listen| {
        SmConfig {
            listen,
            handshake_timeout: timeout,
            ..SmConfig::default()
        }
        .with_dir(&*dir)
    };
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg(false))?) as Box<dyn Plugin>))
        .unwrap();
    let stuck = format!("sm://{pid}-stuck");
    let t0 = Instant::now();
    for _ in 0..3 {
        match ep.try_lookup(&stuck, t0) {
            Err(e @ NaError::WouldBlock { .. }) => {
                assert!(e.is_would_block());
                assert!(e.to_string().contains(&stuck), "{}", na_core::ErrorChain(&e));
            }
            other => panic!("expected WouldBlock, got {other:?}"),
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(1), "waited {:?}", t0.elapsed());
    // A first attempt made longer ago than the handshake timeout: the
    // blocking lookup's timeout error, at once.
    let long_ago = Instant::now()
        .checked_sub(timeout + Duration::from_millis(1))
        .unwrap();
    let t1 = Instant::now();
    match ep.try_lookup(&stuck, long_ago) {
        Err(NaError::Lookup { uri, source }) => {
            assert_eq!(uri, stuck);
            assert_eq!(source.kind(), std::io::ErrorKind::TimedOut, "{source}");
            assert!(source.to_string().contains("not accepting"), "{source}");
        }
        other => panic!("expected the lookup timeout, got {other:?}"),
    }
    assert!(t1.elapsed() < Duration::from_secs(1), "waited {:?}", t1.elapsed());

    // A healthy listener (a plugin of its own, driven by a thread).
    let (tx, rx) = mpsc::channel();
    let scfg = cfg(true);
    let server = std::thread::spawn(move || {
        let mut sep = Endpoint::new(ProgressMode::Blocking).unwrap();
        let sid = sep
            .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, scfg)?) as Box<dyn Plugin>))
            .unwrap();
        tx.send(sep.self_addr(sid).unwrap().uri().to_owned()).unwrap();
        sep.post_recv_unexpected(sid, Vec::new(), OpId(7)).unwrap();
        let end = Instant::now() + Duration::from_secs(20);
        while Instant::now() < end {
            sep.progress(Some(Duration::from_millis(10))).unwrap();
            if let Some(c) = std::iter::from_fn(|| sep.pop_completion()).find(|c| c.op == OpId(7)) {
                return c.buf;
            }
        }
        None
    });
    let uri = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let a = ep
        .try_lookup(&uri, Instant::now())
        .expect("a healthy listener is connected to");
    assert_eq!(a.uri(), uri);
    ep.send_unexpected(&a, 5, b"hi", OpId(1)).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    let mut sent = false;
    while !sent {
        assert!(Instant::now() < end, "the send did not complete");
        ep.progress(Some(Duration::from_millis(10))).unwrap();
        sent = std::iter::from_fn(|| ep.pop_completion()).any(|c| c.op == OpId(1));
    }
    assert_eq!(server.join().unwrap().as_deref(), Some(&b"hi"[..]));
    drop(listener);
    let _ = std::fs::remove_dir_all(&dir);
}
