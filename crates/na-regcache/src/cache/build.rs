//! Building a cache: the monitor chosen by the configuration (or given),
//! the shared state, and the attachment to the monitor (falling back to a
//! disabled cache where [`MonitorChoice::Auto`] allows).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Arc;

use super::entry::Backend;
use super::shared::{Shared, TrackedRanges};
use super::table::Table;
use super::Cache;
use crate::config::{CacheConfig, Consistency, MonitorChoice};
use crate::error::{Error, Result};
use crate::monitor::{alloc::AllocMonitor, uffd::UffdMonitor, InvalidationSink, Monitor};
use crate::registrar::Registrar;
use crate::stats::Stats;
use crate::sys::brlock::BrLock;
use crate::sys::mem::ForkGuard;

impl<R: Registrar> Cache<R> {
    /// Builds a cache; the monitor is created from `config.monitor`
    /// (process-global userfaultfd monitor or allocator hook).
    pub fn new(registrar: R, config: CacheConfig) -> Result<Cache<R>> {
        config.validate()?;
        let monitor: Option<Arc<dyn Monitor>> = match config.monitor {
            MonitorChoice::Uffd | MonitorChoice::Auto => match UffdMonitor::global_with(config.map_watch) {
                // The monitor watches for at most MAX_SINKS caches: past
                // them `Auto` falls back as it does without userfaultfd
                // (one more plugin instance must not fail to start). This
                // check only saves building a cache that cannot attach:
                // the place is taken by `attach` in `build`, which falls
                // back the same way when another cache took the last one
                // meanwhile.
                Ok(m) if config.monitor == MonitorChoice::Auto && !m.has_room() => {
                    tracing::warn!(
                        caches = crate::monitor::MAX_SINKS,
                        "userfaultfd monitor full: registration cache disabled"
                    );
                    return Self::build(registrar, config, None, false);
                }
                Ok(m) => Some(m),
                Err(source) if config.monitor == MonitorChoice::Uffd => {
                    return Err(Error::MonitorInit {
                        monitor: "uffd",
                        source,
                    })
                }
                Err(e) => {
                    tracing::warn!(error = %crate::error::Chain(&e), "userfaultfd unavailable: registration cache disabled");
                    return Self::build(registrar, config, None, false);
                }
            },
            MonitorChoice::Alloc if !AllocMonitor::installed() => return Err(Error::AllocHookNotInstalled),
            MonitorChoice::Alloc => Some(AllocMonitor::global()),
            MonitorChoice::None => None,
            MonitorChoice::Disabled => return Self::build(registrar, config, None, false),
        };
        Self::build(registrar, config, monitor, true)
    }

    /// Builds a cache configured from `QS_MR_CACHE_*` (see [`crate::config`]);
    /// an invalid variable is an [`Error::Config`] naming it.
    pub fn from_env(registrar: R) -> Result<Cache<R>> {
        Self::new(registrar, CacheConfig::from_env()?)
    }

    /// Builds a cache watched by a caller-supplied monitor (e.g. a kdreg2 backend).
    pub fn with_monitor(registrar: R, config: CacheConfig, monitor: Arc<dyn Monitor>) -> Result<Cache<R>> {
        config.validate()?;
        Self::build(registrar, config, Some(monitor), true)
    }

    fn build(
        registrar: R,
        config: CacheConfig,
        monitor: Option<Arc<dyn Monitor>>,
        caching: bool,
    ) -> Result<Self> {
        let fork_guard = if config.fork_guard {
            Some(ForkGuard::new().map_err(|source| Error::MonitorInit {
                monitor: "fork-guard",
                source,
            })?)
        } else {
            None
        };
        let mut monitor_name = monitor
            .as_ref()
            .map_or(if caching { "none" } else { "disabled" }, |m| m.name());
        let backend = Arc::new(Backend {
            registrar,
            stats: Stats::default(),
            monitor,
            fork_guard,
            closed: AtomicBool::new(false),
        });
        let mut shared = Arc::new(Shared {
            backend,
            table: BrLock::new(Table::new(config.max_count, config.max_bytes)),
            caching,
            in_flight: config.consistency == Consistency::InFlight,
            lo: AtomicUsize::new(usize::MAX),
            hi: AtomicUsize::new(0),
            zombies: AtomicUsize::new(0),
            generation: AtomicU64::new(0),
            tracked: TrackedRanges::new(),
            pending: Default::default(),
        });
        let attached = match &shared.backend.monitor {
            Some(m) => m
                .attach(Arc::clone(&shared) as Arc<dyn InvalidationSink>)
                .map(Some)
                .map_err(|source| Error::MonitorInit {
                    monitor: m.name(),
                    source,
                }),
            None => Ok(None),
        };
        let sink = match attached {
            Ok(sink) => sink,
            // `Auto` never fails for want of a monitor: when the monitor
            // refuses (another cache took its last place since `new`
            // looked), the cache comes up disabled.
            Err(e) if config.monitor == MonitorChoice::Auto => {
                Self::disable(&mut shared).ok_or(e)?;
                tracing::warn!(
                    caches = crate::monitor::MAX_SINKS,
                    "userfaultfd monitor full: registration cache disabled"
                );
                monitor_name = "disabled";
                None
            }
            Err(e) => return Err(e),
        };
        tracing::debug!(
            monitor = monitor_name,
            max_count = config.max_count,
            max_bytes = config.max_bytes,
            "registration cache created"
        );
        Ok(Cache {
            shared,
            sink,
            monitor_name,
        })
    }

    /// Turns a cache still being built, whose monitor refused it, into a
    /// disabled one (no monitor, no caching). `None` if the state is
    /// shared already (a monitor kept the sink it refused): then it stays
    /// as it is, and the caller reports the refusal.
    fn disable(shared: &mut Arc<Shared<R>>) -> Option<()> {
        let sh = Arc::get_mut(shared)?;
        Arc::get_mut(&mut sh.backend)?.monitor = None;
        sh.caching = false;
        Some(())
    }
}
