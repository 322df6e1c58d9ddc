//! Progress modes and their configuration.

use std::time::{Duration, Instant};

use crate::error::{NaError, Result};

/// `timeout` from now, saturating: a timeout too large for an [`Instant`]
/// (`Duration::MAX` as "wait forever") gives a deadline a century away
/// instead of overflowing.
pub fn deadline_after(timeout: Duration) -> Instant {
    const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    let now = Instant::now();
    now.checked_add(timeout.min(FOREVER))
        .or_else(|| now.checked_add(Duration::from_secs(24 * 3600)))
        .unwrap_or(now)
}

/// How [`Endpoint::progress`](crate::Endpoint::progress) waits for work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressMode {
    /// Never sleep: poll every plugin in a loop until a completion arrives
    /// or the timeout passes. Lowest latency; burns a core while waiting.
    Busy,
    /// Poll in a loop for up to `spin` after the last activity, then sleep
    /// on the poll fd. Low latency while traffic flows; no CPU when idle.
    Adaptive {
        /// How long to keep polling after the last completion.
        spin: Duration,
    },
    /// Always sleep on the poll fd when nothing is ready. Lowest CPU; pays a
    /// kernel wake-up per message.
    Blocking,
}

/// Default spin window of [`ProgressMode::Adaptive`].
pub const DEFAULT_ADAPTIVE_SPIN: Duration = Duration::from_micros(200);

impl Default for ProgressMode {
    fn default() -> Self {
        ProgressMode::Adaptive {
            spin: DEFAULT_ADAPTIVE_SPIN,
        }
    }
}

impl ProgressMode {
    /// Parses `busy`, `adaptive`, `adaptive:<micros>`, `adaptive:<nanos>ns`
    /// or `blocking`.
    pub fn parse(s: &str) -> Result<Self> {
        let bad = |reason: &str| NaError::Config {
            name: "progress mode".into(),
            value: s.into(),
            reason: reason.into(),
        };
        match s {
            "busy" => Ok(ProgressMode::Busy),
            "blocking" => Ok(ProgressMode::Blocking),
            "adaptive" => Ok(ProgressMode::default()),
            _ => {
                let window = s
                    .strip_prefix("adaptive:")
                    .ok_or_else(|| bad("expected busy, adaptive, adaptive:<micros> or blocking"))?;
                let spin = match window.strip_suffix("ns") {
                    Some(ns) => Duration::from_nanos(
                        ns.parse()
                            .map_err(|_| bad("spin must be a whole number of nanoseconds before `ns`"))?,
                    ),
                    None => Duration::from_micros(
                        window
                            .parse()
                            .map_err(|_| bad("spin must be a whole number of microseconds"))?,
                    ),
                };
                Ok(ProgressMode::Adaptive { spin })
            }
        }
    }

    /// The text [`parse`](Self::parse) reads back as this very mode
    /// (`adaptive:<micros>` keeps the spin window, which `Display`'s
    /// `adaptive` does not): for passing a mode to another process.
    pub fn spec(&self) -> String {
        match self {
            ProgressMode::Adaptive { spin } if spin.subsec_nanos() % 1000 == 0 => {
                format!("adaptive:{}", spin.as_micros())
            }
            // A window that is no whole number of microseconds (set through
            // the API) would lose its rest in micros.
            ProgressMode::Adaptive { spin } => format!("adaptive:{}ns", spin.as_nanos()),
            other => other.to_string(),
        }
    }

    /// Reads the mode from environment variable `var` (e.g.
    /// `QS_PROGRESS_MODE`); unset gives `default`, an invalid or non-UTF-8
    /// value is an error naming the variable.
    pub fn from_env(var: &str, default: ProgressMode) -> Result<Self> {
        let bad = |value, reason: &str| NaError::Config {
            name: var.into(),
            value,
            reason: reason.into(),
        };
        match crate::env::env_var(var, bad)? {
            Some(v) => Self::parse(&v).map_err(|e| match e {
                NaError::Config { value, reason, .. } => bad(value, &reason),
                other => other,
            }),
            None => Ok(default),
        }
    }
}

impl std::fmt::Display for ProgressMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProgressMode::Busy => f.write_str("busy"),
            ProgressMode::Adaptive { .. } => f.write_str("adaptive"),
            ProgressMode::Blocking => f.write_str("blocking"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_spec_parses_back_to_the_same_mode() {
        for m in [
            ProgressMode::Busy,
            ProgressMode::Blocking,
            ProgressMode::default(),
            ProgressMode::Adaptive {
                spin: Duration::from_micros(37),
            },
            ProgressMode::Adaptive { spin: Duration::ZERO },
        ] {
            assert_eq!(
                ProgressMode::parse(&m.spec()).expect("a spec parses"),
                m,
                "{}",
                m.spec()
            );
        }
    }

    #[test]
    fn the_largest_timeout_is_a_far_deadline_not_an_overflow() {
        let now = std::time::Instant::now();
        let d = deadline_after(Duration::MAX);
        assert!(d >= now + Duration::from_secs(3600));
        let d = deadline_after(Duration::from_millis(5));
        assert!(d >= now + Duration::from_millis(5) && d < now + Duration::from_secs(60));
    }

    use super::*;

    #[test]
    fn parse_modes() {
        assert_eq!(ProgressMode::parse("busy").unwrap(), ProgressMode::Busy);
        assert_eq!(ProgressMode::parse("blocking").unwrap(), ProgressMode::Blocking);
        assert_eq!(
            ProgressMode::parse("adaptive:5").unwrap(),
            ProgressMode::Adaptive {
                spin: Duration::from_micros(5)
            }
        );
        assert!(ProgressMode::parse("fast").is_err());
        assert!(ProgressMode::parse("adaptive:5xns").is_err());
        // `spec` reads back as the very mode, sub-microsecond windows too.
        for mode in [
            ProgressMode::Busy,
            ProgressMode::Blocking,
            ProgressMode::default(),
            ProgressMode::Adaptive {
                spin: Duration::from_nanos(1_500),
            },
            ProgressMode::Adaptive {
                spin: Duration::from_secs(3),
            },
        ] {
            assert_eq!(
                ProgressMode::parse(&mode.spec()).unwrap(),
                mode,
                "{}",
                mode.spec()
            );
        }
        assert!(ProgressMode::parse("adaptive:x").is_err());
    }

    #[test]
    fn env_errors_name_the_variable() {
        std::env::set_var("QS_TEST_MODE_VAR", "sideways");
        let e = ProgressMode::from_env("QS_TEST_MODE_VAR", ProgressMode::Busy).unwrap_err();
        assert!(e.to_string().contains("QS_TEST_MODE_VAR"), "{e}");
        std::env::remove_var("QS_TEST_MODE_VAR");
        assert_eq!(
            ProgressMode::from_env("QS_TEST_MODE_VAR", ProgressMode::Busy).unwrap(),
            ProgressMode::Busy
        );
    }
}
