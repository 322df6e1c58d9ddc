//! Two verbs endpoints in one process (a listener and a client on one
//! device) and the transfers the single-process tests make between them.

use std::time::{Duration, Instant};

use na_core::{
    Access, Addr, Completion, Endpoint, MemHandle, OpId, Plugin, PluginId, ProgressMode, RemoteMem,
};
use na_verbs::{VerbsConfig, VerbsPlugin};

use super::RdmaEnv;

/// The bound of every wait of these tests.
pub const T: Duration = Duration::from_secs(30);

/// A listening endpoint and a client endpoint, the client connected.
pub struct Pair {
    /// The listener's endpoint.
    pub srv: Endpoint,
    /// The client's endpoint.
    pub cli: Endpoint,
    /// The listener's plugin.
    pub srv_id: PluginId,
    /// The client's plugin.
    pub cli_id: PluginId,
    /// The listener, as the client looked it up.
    pub srv_addr: Addr,
}

/// One endpoint with a verbs plugin of the default largest message.
pub fn node(env: &RdmaEnv, listen: bool) -> (Endpoint, PluginId) {
    node_with(env, listen, VerbsConfig::default().max_msg_size)
}

/// A listener and a client connected to it.
pub fn pair(env: &RdmaEnv) -> Pair {
    let (srv, srv_id) = node(env, true);
    let (mut cli, cli_id) = node(env, false);
    let uri = srv.self_addr(srv_id).unwrap().uri().to_owned();
    let srv_addr = cli.lookup(&uri).unwrap();
    Pair {
        srv,
        cli,
        srv_id,
        cli_id,
        srv_addr,
    }
}

/// Drives both endpoints until `until` says so, given the client's and
/// the server's completions so far (or fails after `T`).
pub fn drive(
    p: &mut Pair,
    until: impl FnMut(&[Completion], &[Completion]) -> bool,
) -> (Vec<Completion>, Vec<Completion>) {
    drive_two(&mut p.cli, &mut p.srv, until)
}

/// Drives two endpoints until `done` says so (or fails after `T`).
pub fn drive_two(
    a: &mut Endpoint,
    b: &mut Endpoint,
    mut done: impl FnMut(&[Completion], &[Completion]) -> bool,
) -> (Vec<Completion>, Vec<Completion>) {
    let (mut ca, mut cb) = (Vec::new(), Vec::new());
    let end = Instant::now() + T;
    while !done(&ca, &cb) {
        assert!(Instant::now() < end, "timed out: {ca:?} / {cb:?}");
        a.progress(Some(Duration::ZERO)).unwrap();
        b.progress(Some(Duration::ZERO)).unwrap();
        ca.extend(std::iter::from_fn(|| a.pop_completion()));
        cb.extend(std::iter::from_fn(|| b.pop_completion()));
    }
    (ca, cb)
}

/// A zeroed buffer of `len` bytes on the server, registered and described:
/// the remote side of the client's transfers.
pub fn server_target(p: &mut Pair, len: usize) -> (MemHandle, RemoteMem) {
    let mem = MemHandle::zeroed(len, Access::ReadWrite);
    p.srv.plugin_mut(p.srv_id).unwrap().mem_register(&mem).unwrap();
    let desc = p.srv.plugin(p.srv_id).unwrap().mem_describe(&mem).unwrap();
    (mem, desc)
}

/// Puts `len` bytes of `h` at `off` to the start of `desc` and waits for
/// the put to succeed.
pub fn put_done(p: &mut Pair, h: &MemHandle, off: u64, desc: &RemoteMem, len: u64, op: OpId) {
    let to = p.srv_addr.clone();
    p.cli.put(h, off, desc, 0, len, &to, op).unwrap();
    let (c, _) = drive(p, |c, _| !c.is_empty());
    c[0].status.as_ref().unwrap();
}

/// Discards (madvise DONTNEED: the monitor invalidates their registration)
/// `pages` whole pages of the handle's first segment, or all of them for
/// `None`; returns the offset of the first one in the handle.
pub fn discard_pages(h: &MemHandle, pages: Option<usize>) -> u64 {
    let (addr, len) = h.segments_raw().next().unwrap();
    let page = 4096;
    let (start, whole) = (addr.div_ceil(page) * page, (addr + len) / page * page);
    let end = pages.map_or(whole, |n| start + n * page);
    assert!(start < end && end <= whole, "the segment holds the pages");
    // [start, end) lies inside the handle's own heap buffer, which is only
    // accessed by copies; DONTNEED makes it read as zeros.
    let rc = super::sys::madvise_dontneed(start, end - start);
    assert_eq!(rc, 0);
    (start - addr) as u64
}

/// One endpoint with a verbs plugin whose largest message is `max_msg_size`.
pub fn node_with(env: &RdmaEnv, listen: bool, max_msg_size: usize) -> (Endpoint, PluginId) {
    let mut ep = Endpoint::new(ProgressMode::Busy).unwrap();
    let cfg = VerbsConfig {
        listen,
        max_msg_size,
        ..VerbsConfig::from_spec(&format!("verbs://{}/{}:0", env.device, env.ip), listen).unwrap()
    };
    let id = ep
        .add_plugin(|id| Ok(Box::new(VerbsPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .expect("verbs plugin");
    (ep, id)
}
