//! A call an engine forwards to itself carrying bulk handles of its own,
//! over verbs: the handler's transfers name the engine's own address, and
//! the plugin serves them by a copy in memory after checking they reach
//! only what the handles expose (na-verbs `mem::exposed`): no loopback
//! connection, so a client that does not listen works too.

use hg_rpc::Engine;
use na_core::{Access, ProgressMode};

use super::rpcs::{fnv, BlobGet, BlobPut};
use super::{blob, client_state, connections, rdma_spec, serve_put_and_get, T};

#[test]
fn a_self_forward_carrying_bulk_moves_data_over_verbs() {
    let Some(spec) = rdma_spec("a_self_forward_carrying_bulk_moves_data_over_verbs") else {
        return;
    };
    for listen in [false, true] {
        let mut e = Engine::from_spec(&spec, listen, ProgressMode::default()).expect("engine");
        serve_put_and_get(&mut e);
        let me = e.self_addr().clone();
        let data = blob(300_001);
        let put = e
            .expose(
                vec![data[..1000].to_vec(), data[1000..].to_vec()],
                Access::ReadOnly,
            )
            .expect("expose");
        let hash = e
            .call::<BlobPut>(&me, &("k".into(), put), T)
            .unwrap_or_else(|err| {
                panic!(
                    "listen {listen}: self pull: {}; {}",
                    na_core::ErrorChain(&err),
                    client_state(&mut e)
                )
            });
        assert_eq!(hash, fnv(&data), "listen {listen}: pulled data differs");
        let into = e
            .expose(vec![vec![0; 70_000], vec![0; 30_000]], Access::ReadWrite)
            .expect("expose");
        let len = e
            .call::<BlobGet>(&me, &("k".into(), into.clone(), 10), T)
            .unwrap_or_else(|err| {
                panic!(
                    "listen {listen}: self push: {}; {}",
                    na_core::ErrorChain(&err),
                    client_state(&mut e)
                )
            });

        assert_eq!(len, 100_000 - 10);
        let mut back = vec![0; len as usize];
        into.local()
            .expect("local")
            .read_at(10, &mut back)
            .expect("read back");
        assert!(back == blob(len as usize), "listen {listen}: pushed data differs");
        assert_eq!(
            connections(&mut e),
            0,
            "listen {listen}: a loopback connection was opened"
        );
    }
}
