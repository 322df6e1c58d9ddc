//! A monitor that forwards the `Monitor` trait to the process's
//! userfaultfd monitor, but for the calls a test intercepts through its
//! [`Hooks`] (to hold a thread at a gate, or report a range settling).

use std::io;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use na_regcache::{InvalidationSink, Monitor, SinkId, UffdMonitor, Watch};

/// What a test's monitor does apart from forwarding; each call is given
/// the real monitor. The defaults forward.
pub trait Hooks: Send + Sync + 'static {
    /// The monitor's name.
    fn name(&self) -> &'static str;

    /// Runs before each `sync` and `sync_in_flight` is forwarded.
    fn before_sync(&self) {}

    /// `Monitor::settling`.
    fn settling(&self, inner: &UffdMonitor, start: usize, end: usize) -> Option<Duration> {
        inner.settling(start, end)
    }

    /// `Monitor::wait_settled`.
    fn wait_settled(
        &self,
        inner: &UffdMonitor,
        start: usize,
        end: usize,
        limit: Duration,
    ) -> Option<Duration> {
        inner.wait_settled(start, end, limit)
    }

    /// `Monitor::subscribe`.
    fn subscribe(&self, inner: &UffdMonitor, start: usize, len: usize, cookie: u64) -> io::Result<Watch> {
        inner.subscribe(start, len, cookie)
    }

    /// `Monitor::changed` (the userfaultfd monitor pushes its changes to
    /// the caches and always answers false; a kdreg2-style monitor
    /// answers true for a watch whose mapping changed while the events
    /// saying so are not applied yet).
    fn changed(&self, inner: &UffdMonitor, watch: &Watch) -> bool {
        inner.changed(watch)
    }
}

/// The process's userfaultfd monitor with `hooks`. Dereferences to the
/// hooks, so a test calls its own methods on it directly.
pub struct Forwarding<H> {
    /// The real monitor.
    pub inner: Arc<UffdMonitor>,
    /// The test's part.
    pub hooks: H,
}

impl<H: Hooks> Forwarding<H> {
    /// `hooks` around the process's userfaultfd monitor.
    pub fn new(hooks: H) -> Arc<Forwarding<H>> {
        Arc::new(Forwarding {
            inner: UffdMonitor::global().expect("userfaultfd monitor"),
            hooks,
        })
    }
}

impl<H> Deref for Forwarding<H> {
    type Target = H;
    fn deref(&self) -> &H {
        &self.hooks
    }
}

impl<H: Hooks> Monitor for Forwarding<H> {
    fn name(&self) -> &'static str {
        self.hooks.name()
    }
    fn attach(&self, sink: Arc<dyn InvalidationSink>) -> io::Result<SinkId> {
        self.inner.attach(sink)
    }
    fn detach(&self, id: SinkId) -> Option<Arc<dyn InvalidationSink>> {
        self.inner.detach(id)
    }
    fn subscribe(&self, start: usize, len: usize, cookie: u64) -> io::Result<Watch> {
        self.hooks.subscribe(&self.inner, start, len, cookie)
    }
    fn unsubscribe(&self, watch: &Watch) {
        self.inner.unsubscribe(watch)
    }
    fn sync(&self) {
        self.hooks.before_sync();
        self.inner.sync()
    }
    fn sync_in_flight(&self) {
        self.hooks.before_sync();
        self.inner.sync_in_flight()
    }
    fn settling(&self, start: usize, end: usize) -> Option<Duration> {
        self.hooks.settling(&self.inner, start, end)
    }
    fn wait_settled(&self, start: usize, end: usize, limit: Duration) -> Option<Duration> {
        self.hooks.wait_settled(&self.inner, start, end, limit)
    }
    fn changed(&self, watch: &Watch) -> bool {
        self.hooks.changed(&self.inner, watch)
    }
}
