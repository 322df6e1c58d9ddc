//! hg-rpc's log, recorded for the whole test process: a test that must
//! act once the engine reached a state it only logs (a lookup that waits,
//! an output that waits for room) waits until the log says so, instead of
//! sleeping a guessed time. Each record keeps an event's message and its
//! `peer` field, so tests running in one process tell their own events
//! from each other's by the peer.

use std::sync::Mutex;

use tracing::field::{Field, Visit};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

/// `(message, peer)` of every hg-rpc event since [`install`].
static EVENTS: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

/// Installs the recorder as the process's subscriber (once: events of
/// tasks on a runtime's workers, which a thread's own subscriber would
/// not see, are recorded too).
pub fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Recorder))
            .expect("no other subscriber in this test binary");
    });
}

/// True if hg-rpc logged an event whose message contains `message` and
/// whose `peer` field passes `peer`.
pub fn said(message: &str, peer: impl Fn(&str) -> bool) -> bool {
    EVENTS
        .lock()
        .unwrap()
        .iter()
        .any(|(m, p)| m.contains(message) && peer(p))
}

/// Records hg-rpc's events in [`EVENTS`].
struct Recorder;

/// The `message` and `peer` fields of an event.
#[derive(Default)]
struct MessageAndPeer(String, String);

impl Visit for MessageAndPeer {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "message" => self.0 = value.to_owned(),
            "peer" => self.1 = value.to_owned(),
            _ => {}
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => self.0 = format!("{value:?}"),
            "peer" => self.1 = format!("{value:?}"),
            _ => {}
        }
    }
}

impl<S: Subscriber> Layer<S> for Recorder {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        if !event.metadata().target().starts_with("hg_rpc") {
            return;
        }
        let mut f = MessageAndPeer::default();
        event.record(&mut f);
        EVENTS.lock().unwrap().push((f.0, f.1));
    }
}
