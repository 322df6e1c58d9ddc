//! An engine dropped with work its peers are owed (answers its transport
//! still queues, requests it has not answered, spilled outputs not yet
//! pulled) loses that work, and says
//! so: one warning with the counts. A drained or idle engine's drop logs
//! none.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hg_rpc::Rpc;
use serde_bytes::ByteBuf;
use tracing::field::{Field, Visit};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

mod common;
use common::{backlog_engine, client, dir};

/// Generous, for a loaded 2-core machine.
const T: Duration = Duration::from_secs(60);

struct Echo;
impl Rpc for Echo {
    const NAME: &'static str = "engine_drop.echo";
    type Input = ByteBuf;
    type Output = ByteBuf;
}

/// Registered deferred: nobody takes its requests.
struct Later;
impl Rpc for Later {
    const NAME: &'static str = "engine_drop.later";
    type Input = ();
    type Output = ();
}

/// The numeric fields of one warning.
type Fields = HashMap<String, u64>;

/// Records the numeric fields of every warning from hg-rpc.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<Fields>>>);

struct Numbers<'a>(&'a mut Fields);

impl Visit for Numbers<'_> {
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), value);
    }
    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

impl<S: Subscriber> Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let m = event.metadata();
        if *m.level() == tracing::Level::WARN && m.target().starts_with("hg_rpc") {
            let mut fields = Fields::new();
            event.record(&mut Numbers(&mut fields));
            self.0.lock().unwrap().push(fields);
        }
    }
}

/// The warnings from hg-rpc while `f` runs.
fn warnings_of(f: impl FnOnce()) -> Vec<Fields> {
    let w = Warnings::default();
    tracing::subscriber::with_default(tracing_subscriber::registry().with(w.clone()), f);
    let v = w.0.lock().unwrap().clone();
    v
}

/// A server whose caller stopped reading (its answers queue in the
/// transport's send backlog) and with a request for a deferred handler
/// nobody answered: its drop warns, with both counts.
#[test]
fn a_server_dropped_with_queued_answers_and_unanswered_requests_says_so() {
    const CALLS: u64 = 400;
    let d = dir("engine-drop");
    let mut srv = backlog_engine(&d, true, 64 << 20);
    srv.register::<Echo>(Ok).unwrap();
    srv.register_deferred::<Later>().unwrap();
    let mut c = client(&d);
    let s = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    for _ in 0..CALLS {
        c.forward::<Echo>(&s, &ByteBuf::from(vec![7u8; 4000])).unwrap();
    }
    c.forward::<Later>(&s, &()).unwrap();
    // The caller moves its own sends but takes no message in.
    let end = Instant::now() + T;
    while srv.stats().handled < CALLS + 1 {
        assert!(Instant::now() < end, "the server handled {:?}", srv.stats());
        c.progress_now().unwrap();
        srv.progress(Some(Duration::from_millis(1))).unwrap();
        srv.trigger().unwrap();
    }
    let queued = srv.transport_stats().backlog_bytes;
    assert!(queued > 0, "no answer queued: nothing tested");
    assert_eq!(srv.stats().deferred_in_flight, 1);
    let warned = warnings_of(|| drop(srv));
    let drops: Vec<_> = warned
        .iter()
        .filter(|f| f.contains_key("backlog_bytes"))
        .collect();
    assert_eq!(drops.len(), 1, "one warning for the drop: {warned:?}");
    assert_eq!(drops[0]["backlog_bytes"], queued, "{warned:?}");
    assert_eq!(drops[0]["requests"], 1, "{warned:?}");
    drop(c);
}

/// A server dropped with a spilled output its origin has not pulled yet
/// ends that output's exposure (the origin's pull fails): its drop warns,
/// with the output counted. (Before, `exposed` was not counted, and such
/// a drop said nothing.)
#[test]
fn a_server_dropped_with_a_spilled_output_not_yet_pulled_says_so() {
    let d = dir("engine-drop-exposed");
    let mut srv = backlog_engine(&d, true, 64 << 20);
    srv.register::<Echo>(Ok).unwrap();
    let mut c = client(&d);
    let s = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    // Too large for a message both ways: the input is pulled, the output
    // exposed for the client to pull.
    let data = ByteBuf::from(vec![5u8; 2 << 20]);
    c.forward::<Echo>(&s, &data).unwrap();
    let end = Instant::now() + T;
    while srv.stats().exposed_outputs == 0 {
        assert!(Instant::now() < end, "never exposed: {:?}", srv.stats());
        srv.progress(Some(Duration::from_millis(1))).unwrap();
        srv.trigger().unwrap();
        // The client moves its own sends but takes no message in (it
        // would pull the output).
        c.progress_now().unwrap();
    }
    assert_eq!(srv.stats().exposed_outputs, 1);
    let warned = warnings_of(|| drop(srv));
    let drops: Vec<_> = warned.iter().filter(|f| f.contains_key("exposed")).collect();
    assert_eq!(drops.len(), 1, "one warning for the drop: {warned:?}");
    assert_eq!(drops[0]["exposed"], 1, "{warned:?}");
    assert_eq!(drops[0]["requests"], 0, "{warned:?}");
    drop(c);
}

/// An engine that owes nothing (its calls answered, nothing queued) is
/// dropped without a warning.
#[test]
fn an_idle_engine_is_dropped_quietly() {
    let d = dir("engine-drop-idle");
    let mut srv = backlog_engine(&d, true, 64 << 20);
    srv.register::<Echo>(Ok).unwrap();
    let mut c = client(&d);
    assert_eq!(
        common::call_both::<Echo>(&mut c, &mut srv, &ByteBuf::from(vec![1, 2, 3])).unwrap(),
        vec![1, 2, 3]
    );
    let warned = warnings_of(|| {
        drop(c);
        drop(srv);
    });
    assert!(warned.is_empty(), "{warned:?}");
}
