//! An engine on the second sm plugin of its endpoint: addresses of the
//! first plugin are refused at once (the engine never receives there, so
//! the call would wait out its timeout and hold what it lent), and
//! `Engine::lookup` / `AsyncEngine::lookup` give addresses of the
//! engine's own plugin, whose calls are answered.

use std::time::Duration;

use hg_rpc::{AsyncEngine, Engine, RpcError};
use na_core::{Endpoint, Plugin, PluginId, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{call_both, dir, endpoint};

/// An endpoint with two client-only sm plugins; the engine runs on the
/// second.
fn two_plugin_engine(d: &std::path::Path) -> (Engine, PluginId) {
    let mut ep = Endpoint::new(ProgressMode::default()).unwrap();
    let cfg = SmConfig::default().with_dir(d);
    let add = |ep: &mut Endpoint| {
        let cfg = cfg.clone();
        ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
            .unwrap()
    };
    let first = add(&mut ep);
    let second = add(&mut ep);
    assert_ne!(first, second);
    (Engine::new(ep, second).unwrap(), first)
}

#[test]
fn an_address_of_another_plugin_is_refused_and_engine_lookup_uses_its_own() {
    let d = dir("engine-plugin");
    let (ep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    srv.register::<Add>(|(a, b)| Ok(a + b)).unwrap();
    let uri = srv.self_addr().uri().to_owned();
    let (mut c, first) = two_plugin_engine(&d);
    // The endpoint's lookup takes its first sm plugin.
    let foreign = c.endpoint().lookup(&uri).unwrap();
    assert_eq!(foreign.plugin(), first);
    match c.forward::<Add>(&foreign, &(1, 2)) {
        Err(RpcError::ForeignAddress {
            addr_plugin,
            engine_plugin,
            ..
        }) => assert_eq!((addr_plugin, engine_plugin), (first.0, c.plugin().0)),
        other => panic!("expected ForeignAddress, got {other:?}"),
    }
    assert!(matches!(
        c.forward_one_way::<Add>(&foreign, &(1, 2)),
        Err(RpcError::ForeignAddress { .. })
    ));
    assert!(matches!(
        c.call::<Add>(&foreign, &(1, 2), Duration::from_secs(5)),
        Err(RpcError::ForeignAddress { .. })
    ));
    assert_eq!(c.stats().in_flight + c.stats().abandoned_inputs, 0);
    // The engine's lookup: its own plugin, and the call is answered.
    let own = c.lookup(&uri).unwrap();
    assert_eq!(own.plugin(), c.plugin());
    let id = c.forward::<Add>(&own, &(2, 3)).unwrap();
    let end = std::time::Instant::now() + Duration::from_secs(10);
    let r = loop {
        assert!(std::time::Instant::now() < end, "no answer");
        srv.progress(Some(Duration::from_millis(1))).unwrap();
        srv.trigger().unwrap();
        c.progress(Some(Duration::from_millis(1))).unwrap();
        c.trigger().unwrap();
        if let Some(r) = c.take_response::<Add>(id) {
            break r;
        }
    };
    assert_eq!(r.unwrap(), 5);
    // And the ordinary one-plugin set-up is unchanged.
    let (ep, cid) = endpoint(&d, false);
    let mut plain = Engine::new(ep, cid).unwrap();
    assert_eq!(call_both::<Add>(&mut plain, &mut srv, &(4, 4)).unwrap(), 8);
}

#[test]
fn the_async_lookup_uses_the_engine_s_plugin() {
    let d = dir("engine-plugin-async");
    let (ep, sid) = endpoint(&d, true);
    let srv = Engine::new(ep, sid).unwrap();
    let uri = srv.self_addr().uri().to_owned();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (c, first) = two_plugin_engine(&d);
        let own = c.plugin();
        let c = AsyncEngine::spawn(c).unwrap();
        let addr = c.lookup(&uri).await.unwrap();
        assert_eq!(addr.plugin(), own);
        assert_ne!(addr.plugin(), first);
    });
    drop(srv);
}
