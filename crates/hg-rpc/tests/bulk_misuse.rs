//! A bulk transfer's own mistakes (out of bounds, an access mode that
//! forbids the direction, too many buffers) are `RpcError::BulkRefused`
//! in every context (an origin's `Engine::bulk`, a plain handler's
//! `BulkCtx`, an async handler's `AsyncBulkCtx`), never
//! `RpcError::Transport`, which an application may retry; a transport
//! failure (the owner gone) stays `Transport`. The handlers return those
//! errors with `?` (no `map_err`), and read their buffers with
//! `Bulk::to_vec`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use hg_rpc::{Access, Bulk, BulkOp, Engine, Rpc, RpcError};

mod common;
use common::{async_engine, call_both, client, dir, endpoint, Server};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;

/// Generous, for a loaded 2-core machine.
const T: Duration = Duration::from_secs(60);

/// Pulls 64 bytes at the given offset of the caller's handle; answers them.
struct Pull64;
impl Rpc for Pull64 {
    const NAME: &'static str = "bulk_misuse.pull64";
    type Input = (Bulk, u64);
    type Output = Vec<u8>;
}

/// The variant of a transfer's error, as the tests name it.
fn kind(r: &hg_rpc::Result<()>) -> &'static str {
    match r {
        Ok(()) => "ok",
        Err(RpcError::BulkRefused { .. }) => "refused",
        Err(RpcError::Transport(_)) => "transport",
        Err(_) => "other",
    }
}

/// 4 KiB (too large to travel inline: a pull is a real RMA) of `i % 251`.
fn data() -> Vec<u8> {
    (0..4096).map(|i| (i % 251) as u8).collect()
}

#[test]
fn an_origins_own_mistakes_are_refused_and_a_gone_owner_is_a_transport_error() {
    let d = dir("bulk-misuse-origin");
    let (ep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    let mut c = client(&d);
    let theirs = srv.expose(vec![data()], Access::ReadOnly).unwrap();
    let remote = Bulk::from_desc(theirs.desc().into_owned()).unwrap();
    let local = c.expose(vec![vec![0; 4096]], Access::ReadWrite).unwrap();
    let ro = c.expose(vec![vec![0; 4096]], Access::ReadOnly).unwrap();
    let cases = [
        // Past the remote handle's end.
        (
            "remote bounds",
            c.bulk(BulkOp::Pull, &remote, 4000, &local, 0, 200, T),
        ),
        // Past the local handle's end.
        (
            "local bounds",
            c.bulk(BulkOp::Pull, &remote, 0, &local, 4000, 200, T),
        ),
        // Into a read-only remote handle.
        (
            "remote access",
            c.bulk(BulkOp::Push, &remote, 0, &local, 0, 16, T),
        ),
        // Into a read-only local handle.
        ("local access", c.bulk(BulkOp::Pull, &remote, 0, &ro, 0, 16, T)),
        // A remote handle as the local side.
        ("not local", c.bulk(BulkOp::Pull, &remote, 0, &remote, 0, 16, T)),
    ];
    for (what, r) in &cases {
        assert_eq!(kind(r), "refused", "{what}: {r:?}");
    }
    let many = vec![vec![1u8]; na_core::MAX_REMOTE_SEGMENTS + 1];
    match c.expose(many, Access::ReadOnly) {
        Err(RpcError::BulkRefused { reason }) => assert!(reason.contains("segments"), "{reason}"),
        other => panic!("expected too many buffers refused, got {other:?}"),
    }
    // The owner gone: the transport's failure, which a retry elsewhere may
    // get past.
    drop(theirs);
    drop(srv);
    let gone = c.bulk(BulkOp::Pull, &remote, 0, &local, 0, 16, T);
    assert_eq!(kind(&gone), "transport", "{gone:?}");
}

#[test]
fn a_plain_handlers_mistakes_are_refused() {
    let d = dir("bulk-misuse-ctx");
    let (ep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    srv.register_with_bulk::<Pull64>(move |ctx, (remote, at)| {
        let local = ctx.expose(vec![vec![0; 64]], Access::ReadWrite)?;
        let r = ctx.transfer(BulkOp::Pull, &remote, at, &local, 0, 64);
        s2.lock().unwrap().push(kind(&r));
        r?;
        Ok(local.to_vec()?)
    })
    .unwrap();
    let mut c = client(&d);
    let mine = c.expose(vec![data()], Access::ReadOnly).unwrap();
    let wo = c.expose(vec![vec![0; 4096]], Access::WriteOnly).unwrap();
    let got = call_both::<Pull64>(&mut c, &mut srv, &(mine.clone(), 100)).unwrap();
    assert_eq!(got, data()[100..164]);
    for (what, handle, at) in [("bounds", &mine, 4090), ("access", &wo, 0)] {
        match call_both::<Pull64>(&mut c, &mut srv, &(handle.clone(), at)) {
            Err(RpcError::Handler { message, .. }) => {
                assert!(message.starts_with("bulk transfer refused"), "{what}: {message}")
            }
            other => panic!("{what}: expected the handler's refusal, got {other:?}"),
        }
    }
    assert_eq!(*seen.lock().unwrap(), ["ok", "refused", "refused"]);
}

#[test]
fn an_async_handlers_mistakes_are_refused() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let d = dir("bulk-misuse-async");
        let srv = async_engine(&d, true);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        srv.register_async_with_bulk::<Pull64, _, _>(move |ctx, (remote, at)| {
            let seen = s2.clone();
            async move {
                let local = ctx.expose(vec![vec![0; 64]], Access::ReadWrite)?;
                let r = ctx.transfer(BulkOp::Pull, &remote, at, &local, 0, 64, T).await;
                seen.lock().unwrap().push(kind(&r));
                r?;
                Ok(local.to_vec()?)
            }
        })
        .unwrap();
        let c = async_engine(&d, false);
        let s = c.lookup(srv.self_addr().uri()).await.unwrap();
        let mine = c.expose(vec![data()], Access::ReadOnly).unwrap();
        let wo = c.expose(vec![vec![0; 4096]], Access::WriteOnly).unwrap();
        let got = c.call::<Pull64>(&s, &(mine.clone(), 100), T).await.unwrap();
        assert_eq!(got, data()[100..164]);
        for (what, handle, at) in [("bounds", &mine, 4090), ("access", &wo, 0)] {
            match c.call::<Pull64>(&s, &(handle.clone(), at), T).await {
                Err(RpcError::Handler { message, .. }) => {
                    assert!(message.starts_with("bulk transfer refused"), "{what}: {message}")
                }
                other => panic!("{what}: expected the handler's refusal, got {other:?}"),
            }
        }
        assert_eq!(*seen.lock().unwrap(), ["ok", "refused", "refused"]);
        // And the origin's own: the async twin of `Engine::bulk`.
        let remote = Bulk::from_desc(mine.desc().into_owned()).unwrap();
        let local = c.expose(vec![vec![0; 64]], Access::ReadWrite).unwrap();
        let r = c.bulk(BulkOp::Pull, &remote, 0, &local, 0, 100, T).await;
        assert_eq!(kind(&r), "refused", "{r:?}");
    });
}

/// `Engine::bulk` checks no owner of the local side, and needs none: a
/// handle holds its memory (the buffers live as long as the handle), and
/// the transfer goes through the transport the engine drives, so a
/// handle another engine of this process exposed serves as either side,
/// also once that engine is gone. (An origin picks the remote handle
/// itself, so its owner is whom it means to move data with; a handle a
/// peer sent is vetted by its receiver: see `Engine::bulk`'s docs.) What
/// no process could serve, a remote handle as the local side, is refused
/// (`an_origins_own_mistakes_are_refused_...`).
#[test]
fn a_handle_another_engine_of_this_process_exposed_serves_either_side() {
    let d = dir("bulk-misuse-other-engine");
    let peer = Server::start(&d);
    let mut c = client(&d);
    let mut other = client(&d);
    let p = c.lookup(&peer.uri).unwrap();
    let mine = c.expose(vec![data()], Access::ReadOnly).unwrap();
    assert_eq!(
        c.call::<rpcs::BlobPut>(&p, &("k".into(), mine), T).unwrap(),
        rpcs::fnv(&data())
    );
    // The server's copy: 4 KiB, too large to travel inline.
    let theirs = c.call::<rpcs::BlobExpose>(&p, &("k".into(), 4096), T).unwrap();
    assert!(theirs.local().is_none() && theirs.desc().inline.is_none());
    let into = other.expose(vec![vec![0; 4096]], Access::ReadWrite).unwrap();
    // The other engine's handle as the local side of an RMA.
    c.bulk(BulkOp::Pull, &theirs, 0, &into, 0, 2048, T).unwrap();
    drop(other);
    // The other engine gone: its handle still holds its memory.
    c.bulk(BulkOp::Pull, &theirs, 2048, &into, 2048, 2048, T).unwrap();
    assert_eq!(into.to_vec().unwrap(), data());
    // And as the remote side: a copy in memory.
    let back = c.expose(vec![vec![0; 4096]], Access::ReadWrite).unwrap();
    c.bulk(BulkOp::Pull, &into, 0, &back, 0, 4096, T).unwrap();
    assert_eq!(back.to_vec().unwrap(), data());
    let st = c.stats();
    assert_eq!(
        (st.bulk_done, st.bulk_failed, st.bulk_in_flight),
        (3, 0, 0),
        "{st:?}"
    );
}
