//! The test peer's log: with `HG_TESTPEER_LOG` set (`warn`,
//! `warn,na_verbs=debug`: a default level, then `target=level` for
//! targets whose name starts with `target`, the longest such prefix
//! deciding), what the engine and its transports log through `tracing`
//! goes to standard error, one line per event, with the seconds since
//! the peer started. A test that reads the peer's standard error can then
//! say why the peer ended a connection when it fails (`tests/verbs.rs`).
//! A small subscriber of its own: the package has no dependency on
//! `tracing-subscriber` (only its tests have), and the peer needs only
//! lines.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// The variable that turns the log on and names its levels.
pub const LOG_ENV: &str = "HG_TESTPEER_LOG";

/// Which events are written: `(target prefix, most verbose level)`; the
/// default has the empty prefix.
#[derive(Debug, PartialEq)]
struct Filter(Vec<(String, Level)>);

impl Filter {
    /// Parses `warn,na_verbs=debug` (levels by name, any case).
    fn parse(spec: &str) -> Result<Filter, String> {
        let level = |s: &str| -> Result<Level, String> {
            s.trim().parse::<Level>().map_err(|_| {
                format!("{LOG_ENV}={spec:?}: {s:?} is not a level (error, warn, info, debug, trace)")
            })
        };
        let mut rules = Vec::new();
        for part in spec.split(',').filter(|p| !p.trim().is_empty()) {
            match part.split_once('=') {
                Some((target, l)) => rules.push((target.trim().to_owned(), level(l)?)),
                None => rules.push((String::new(), level(part)?)),
            }
        }
        Ok(Filter(rules))
    }

    /// Whether an event of `meta` is written.
    fn enabled(&self, meta: &Metadata<'_>) -> bool {
        self.0
            .iter()
            .filter(|(prefix, _)| meta.target().starts_with(prefix.as_str()))
            .max_by_key(|(prefix, _)| prefix.len())
            .is_some_and(|(_, most)| meta.level() <= most)
    }
}

/// Writes the events its filter lets through to standard error.
struct StderrLog {
    /// Which events.
    filter: Filter,
    /// When the peer started (each line says the seconds since).
    start: Instant,
    /// The next span id (spans are not written, but need ids).
    next_span: AtomicU64,
}

/// An event's fields, appended to its line (`message` first, bare).
struct Fields<'a>(&'a mut String);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = if field.name() == "message" {
            write!(self.0, " {value:?}")
        } else {
            write!(self.0, " {}={value:?}", field.name())
        };
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        let _ = write!(self.0, " {}={value}", field.name());
    }
}

impl Subscriber for StderrLog {
    fn enabled(&self, meta: &Metadata<'_>) -> bool {
        self.filter.enabled(meta)
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(self.next_span.fetch_add(1, Ordering::Relaxed))
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let meta = event.metadata();
        let mut line = format!(
            "hg-rpc-testpeer[{}] {:9.3}s {} {}:",
            std::process::id(),
            self.start.elapsed().as_secs_f64(),
            meta.level(),
            meta.target()
        );
        event.record(&mut Fields(&mut line));
        eprintln!("{line}");
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

/// Installs the log if `HG_TESTPEER_LOG` is set; a value that does not
/// parse is an error (the peer does not start).
pub fn init() -> Result<(), String> {
    let Some(spec) = na_core::env_var(LOG_ENV, |v, why| format!("{LOG_ENV}={v:?}: {why}"))? else {
        return Ok(());
    };
    let log = StderrLog {
        filter: Filter::parse(&spec)?,
        start: Instant::now(),
        next_span: AtomicU64::new(1),
    };
    tracing::subscriber::set_global_default(log).map_err(|e| format!("{LOG_ENV}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filter_takes_a_default_and_the_longest_matching_target() {
        let f = Filter::parse("warn, na_verbs=debug,na_verbs::x=error").unwrap();
        assert_eq!(
            f,
            Filter(vec![
                (String::new(), Level::WARN),
                ("na_verbs".into(), Level::DEBUG),
                ("na_verbs::x".into(), Level::ERROR),
            ])
        );
        assert!(Filter::parse("warn,na_verbs=loud").is_err());
        assert!(Filter::parse("").unwrap().0.is_empty());
    }
}
