//! Per-call tracing spans: a subscriber that wants debug spans sees one
//! `rpc forward` and one `rpc handle` span per call, and one `rpc bulk`
//! span per batch of transfers started; one that wants less sees none. Warnings a peer can cause per message are logged at 1, 2, 4,
//! 8... of them, not once each.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use hg_rpc::{Engine, Rpc};
use na_core::{Endpoint, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};
use tracing::span::{Attributes, Id};
use tracing::Subscriber;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

mod common;

struct Double;
impl Rpc for Double {
    const NAME: &'static str = "spans.double";
    type Input = u64;
    type Output = u64;
}

/// Records the name of every span created.
#[derive(Clone, Default)]
struct Names(Arc<Mutex<Vec<&'static str>>>);

impl<S: Subscriber> Layer<S> for Names {
    fn on_new_span(&self, attrs: &Attributes<'_>, _id: &Id, _ctx: Context<'_, S>) {
        self.0.lock().unwrap().push(attrs.metadata().name());
    }
}

/// Counts the warning events.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<usize>>);

impl<S: Subscriber> Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::WARN {
            *self.0.lock().unwrap() += 1;
        }
    }
}

fn engine(dir: &std::path::Path) -> Engine {
    let mut ep = Endpoint::new(ProgressMode::default()).unwrap();
    let cfg = SmConfig::listening().with_dir(dir);
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let mut e = Engine::new(ep, id).unwrap();
    e.register::<Double>(|x| Ok(2 * x)).unwrap();
    e
}

/// Makes `n` self-forwarded calls under a subscriber at `level`; returns
/// the span names it saw.
fn calls_under(level: LevelFilter, n: u64) -> Vec<&'static str> {
    let names = Names::default();
    let subscriber = tracing_subscriber::registry().with(names.clone().with_filter(level));
    let dir = common::dir(&format!("spans-{level}"));
    tracing::subscriber::with_default(subscriber, || {
        let mut e = engine(&dir);
        let me = e.self_addr().clone();
        for i in 0..n {
            assert_eq!(e.call::<Double>(&me, &i, Duration::from_secs(10)).unwrap(), 2 * i);
        }
    });
    let v = names.0.lock().unwrap().clone();
    v
}

#[test]
fn debug_subscriber_sees_a_forward_and_a_handle_span_per_call() {
    let names = calls_under(LevelFilter::DEBUG, 5);
    let count = |n: &str| names.iter().filter(|x| **x == n).count();
    assert_eq!(count("rpc forward"), 5, "{names:?}");
    assert_eq!(count("rpc handle"), 5, "{names:?}");
}

#[test]
fn info_subscriber_gets_no_per_call_spans() {
    let names = calls_under(LevelFilter::INFO, 5);
    assert!(
        !names.iter().any(|n| n.starts_with("rpc ")),
        "per-call spans built for an info subscriber: {names:?}"
    );
}

/// Pulls a peer's handle three times (once as a batch of four spans) with
/// `Engine::bulk` and `bulk_start_batch` under a subscriber at `level`;
/// returns the span names it saw.
fn transfers_under(level: LevelFilter) -> Vec<&'static str> {
    use hg_rpc::{BulkOp, Span};
    use na_core::Access;
    let names = Names::default();
    let subscriber = tracing_subscriber::registry().with(names.clone().with_filter(level));
    let dir = common::dir(&format!("spans-bulk-{level}"));
    tracing::subscriber::with_default(subscriber, || {
        let mut owner = engine(&dir);
        let (ep, id) = common::endpoint(&dir, false);
        let mut c = Engine::new(ep, id).unwrap();
        let exposed = owner.expose(vec![vec![7; 8192]], Access::ReadOnly).unwrap();
        let remote: hg_rpc::Bulk = postcard::from_bytes(&postcard::to_allocvec(&exposed).unwrap()).unwrap();
        c.endpoint().lookup(owner.self_addr().uri()).unwrap();
        let local = c.expose(vec![vec![0; 8192]], Access::ReadWrite).unwrap();
        for _ in 0..2 {
            c.bulk(BulkOp::Pull, &remote, 0, &local, 0, 8192, Duration::from_secs(10))
                .unwrap();
        }
        let spans: Vec<Span> = (0..4)
            .map(|k| Span {
                remote_offset: k * 2048,
                local_offset: k * 2048,
                len: 2048,
            })
            .collect();
        let ids = c.bulk_start_batch(BulkOp::Pull, &remote, &local, &spans).unwrap();
        let end = std::time::Instant::now() + Duration::from_secs(10);
        for id in ids {
            while c.take_bulk(id).is_none() {
                assert!(std::time::Instant::now() < end, "a batched pull did not end");
                c.progress(Some(Duration::from_millis(1))).unwrap();
                c.trigger().unwrap();
            }
        }
    });
    let v = names.0.lock().unwrap().clone();
    v
}

#[test]
fn debug_subscriber_sees_a_bulk_span_per_batch_started() {
    let names = transfers_under(LevelFilter::DEBUG);
    assert_eq!(names.iter().filter(|n| **n == "rpc bulk").count(), 3, "{names:?}");
    let names = transfers_under(LevelFilter::INFO);
    assert!(
        !names.iter().any(|n| n.starts_with("rpc ")),
        "bulk spans built for an info subscriber: {names:?}"
    );
}

/// 100 garbage messages from a peer: each is counted in `malformed`, and
/// the warning is logged 7 times (at 1, 2, 4, ..., 64), not 100.
#[test]
fn a_peer_repeating_garbage_gets_logged_at_powers_of_two_only() {
    use na_core::OpId;
    let warnings = Warnings::default();
    let subscriber = tracing_subscriber::registry().with(warnings.clone().with_filter(LevelFilter::WARN));
    let dir = common::dir("spans-garbage");
    tracing::subscriber::with_default(subscriber, || {
        let mut srv = engine(&dir);
        let (mut raw, _) = common::endpoint(&dir, false);
        let s = raw.lookup(srv.self_addr().uri()).unwrap();
        for i in 0..100 {
            raw.send_unexpected(&s, 0, b"garbage", OpId(i)).unwrap();
            raw.progress(Some(Duration::ZERO)).unwrap();
            srv.progress(Some(Duration::ZERO)).unwrap();
            srv.trigger().unwrap();
        }
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while srv.stats().malformed < 100 {
            assert!(std::time::Instant::now() < end, "{:?}", srv.stats());
            raw.progress(Some(Duration::ZERO)).unwrap();
            srv.progress(Some(Duration::from_millis(1))).unwrap();
            srv.trigger().unwrap();
        }
    });
    assert_eq!(*warnings.0.lock().unwrap(), 7);
}
