//! Cache configuration, by API and from the environment.
//!
//! | variable | values | default |
//! |---|---|---|
//! | `QS_MR_CACHE_MAX_COUNT` | 1 ..= 1048576 entries | 1024 |
//! | `QS_MR_CACHE_MAX_SIZE` | bytes, optional `K`/`M`/`G` (binary) suffix | 1G |
//! | `QS_MR_CACHE_MONITOR` | `uffd`, `alloc`, `none`, `disabled` | uffd, else disabled |
//! | `QS_MR_CACHE_CONSISTENCY` | `in-flight`, `returned` (see [`Consistency`]) | in-flight |
//! | `QS_MR_CACHE_MAP_WATCH` | `off`, `on` (see [`CacheConfig::map_watch`]) | off |
//!
//! An invalid value is an [`Error::Config`] naming the variable, never a
//! silent default.

use std::ffi::OsString;

use crate::error::{Error, Result};

/// Environment variable: maximum number of cached registrations.
pub const ENV_MAX_COUNT: &str = "QS_MR_CACHE_MAX_COUNT";
/// Environment variable: maximum bytes held by cached registrations.
pub const ENV_MAX_SIZE: &str = "QS_MR_CACHE_MAX_SIZE";
/// Environment variable: which monitor keeps the cache correct.
pub const ENV_MONITOR: &str = "QS_MR_CACHE_MONITOR";
/// Environment variable: `in-flight` or `returned`.
pub const ENV_CONSISTENCY: &str = "QS_MR_CACHE_CONSISTENCY";
/// Environment variable: `on` (or `perf`) skips in-flight probes while
/// nothing was mapped, when perf side-band events are allowed; `off` (or
/// `auto`, the default) probes on every lookup (the watch cannot see
/// `mremap`; see docs/REGCACHE.md).
pub const ENV_MAP_WATCH: &str = "QS_MR_CACHE_MAP_WATCH";

/// Every variable [`CacheConfig::from_env`] reads.
pub const ENV_VARS: [&str; 5] = [
    ENV_MAX_COUNT,
    ENV_MAX_SIZE,
    ENV_MONITOR,
    ENV_CONSISTENCY,
    ENV_MAP_WATCH,
];

/// Upper bound of `max_count` (index and slot table are reserved up front).
pub const MAX_COUNT_LIMIT: usize = 1 << 20;

/// Which monitor keeps the cache coherent with the address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MonitorChoice {
    /// userfaultfd, falling back to `Disabled` (with a warning) if the kernel
    /// refuses it. The default when `QS_MR_CACHE_MONITOR` is unset.
    Auto,
    /// userfaultfd UNMAP/REMOVE/REMAP events; an error if unavailable.
    Uffd,
    /// The `InvalidatingAlloc` global-allocator hook.
    Alloc,
    /// Cache without any monitor: the application promises never to unmap,
    /// remap or madvise registered memory. Unsafe in general.
    None,
    /// No caching: every `get` registers, every release deregisters.
    Disabled,
}

impl MonitorChoice {
    /// Parses `uffd|alloc|none|disabled`.
    pub fn parse(s: &str) -> Option<MonitorChoice> {
        match s.trim().to_ascii_lowercase().as_str() {
            "uffd" | "userfaultfd" => Some(MonitorChoice::Uffd),
            "alloc" => Some(MonitorChoice::Alloc),
            "none" => Some(MonitorChoice::None),
            "disabled" => Some(MonitorChoice::Disabled),
            _ => None,
        }
    }
}

/// Which changes of the address space a lookup is guaranteed to see.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Consistency {
    /// A lookup never returns a registration of pages that any change has
    /// already taken away, even one whose `munmap`/`mremap` has not
    /// returned yet while another thread already got the freed address
    /// from `mmap`/`malloc`. With userfaultfd a lookup makes one `ioctl`
    /// (a hit costs ~0.5-0.65 µs instead of ~0.06 µs on the dev VM), or,
    /// with the opt-in [`CacheConfig::map_watch`], only if anything was
    /// mapped since the last such check (~0.1 µs).
    #[default]
    InFlight,
    /// A lookup sees every change whose call returned before the lookup
    /// began (in any thread) and nothing is ever stale after that; a lookup
    /// racing a change still in flight may return the old registration.
    /// Hits take no system call. Choose it when no thread reuses freed
    /// address ranges for registration while another may still be
    /// unmapping them, or when lookups and unmaps are otherwise ordered.
    Returned,
}

impl Consistency {
    /// Parses `in-flight` (or `strict`) and `returned`, case-insensitively.
    pub fn parse(s: &str) -> Option<Consistency> {
        match s.trim().to_ascii_lowercase().as_str() {
            "in-flight" | "inflight" | "strict" => Some(Consistency::InFlight),
            "returned" => Some(Consistency::Returned),
            _ => None,
        }
    }
}

/// Cache limits and monitor choice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    /// Maximum number of cached (live or idle) registrations.
    pub max_count: usize,
    /// Maximum bytes registered by the cached entries, summed over them:
    /// each entry counts its whole range, so pages that two overlapping
    /// entries share count once per entry. That is what the registrar
    /// holds: each registration pins its pages on its own (the kernel
    /// charges every `ibv_reg_mr` to the locked-memory limit, and the NIC
    /// keeps a translation for each), not the distinct memory covered.
    /// Entries overlap only after concurrent misses of overlapping ranges
    /// (see `Table::superseded` in the cache's sources, and docs/REGCACHE.md).
    pub max_bytes: usize,
    /// The monitor.
    pub monitor: MonitorChoice,
    /// Refuse use in a forked child (default true). Turning it off exists
    /// only to demonstrate the corruption it prevents.
    pub fork_guard: bool,
    /// Which changes a lookup must see (userfaultfd only; the allocator
    /// hook is synchronous anyway).
    pub consistency: Consistency,
    /// Let in-flight lookups skip their system call while nothing was
    /// mapped (perf side-band records, when the kernel allows them; see
    /// [`crate::UffdMonitor`]). **Default false**: the kernel writes no
    /// record for `mremap`, so a range freed by an unmap still in flight
    /// and handed out again by a moving or growing `mremap` (glibc's
    /// `realloc` of a large block, so Rust's `Vec` growth) would be served
    /// the old registration. Turn it on only where nothing in the process
    /// calls `mremap`. Read when the process-wide userfaultfd monitor is
    /// created, by the first cache that uses it.
    pub map_watch: bool,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            max_count: 1024,
            max_bytes: 1 << 30,
            monitor: MonitorChoice::Auto,
            fork_guard: true,
            consistency: Consistency::InFlight,
            map_watch: false,
        }
    }
}

impl CacheConfig {
    /// The defaults overridden by `QS_MR_CACHE_*` variables that are set.
    /// An invalid value, or one that is not UTF-8, is an error naming its
    /// variable.
    pub fn from_env() -> Result<CacheConfig> {
        Self::from_os_lookup(|k| std::env::var_os(k))
    }

    /// Like [`CacheConfig::from_env`] with a custom lookup of raw values.
    pub fn from_os_lookup(get: impl Fn(&str) -> Option<OsString>) -> Result<CacheConfig> {
        for var in ENV_VARS {
            if let Some(v) = get(var).filter(|v| v.to_str().is_none()) {
                return Err(config_err(var, &v.to_string_lossy(), "not valid UTF-8".into()));
            }
        }
        Self::from_lookup(|k| get(k).and_then(|v| v.into_string().ok()))
    }

    /// Like [`CacheConfig::from_env`] with a custom variable lookup.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<CacheConfig> {
        let mut cfg = CacheConfig::default();
        if let Some(v) = get(ENV_MAX_COUNT) {
            let n = parse_size(&v).map_err(|reason| config_err(ENV_MAX_COUNT, &v, reason))?;
            if n == 0 || n > MAX_COUNT_LIMIT {
                return Err(config_err(
                    ENV_MAX_COUNT,
                    &v,
                    format!("must be 1..={MAX_COUNT_LIMIT}"),
                ));
            }
            cfg.max_count = n;
        }
        if let Some(v) = get(ENV_MAX_SIZE) {
            let n = parse_size(&v).map_err(|reason| config_err(ENV_MAX_SIZE, &v, reason))?;
            if n < crate::sys::mem::page_size() {
                return Err(config_err(ENV_MAX_SIZE, &v, "must be at least one page".into()));
            }
            cfg.max_bytes = n;
        }
        if let Some(v) = get(ENV_MONITOR) {
            cfg.monitor = MonitorChoice::parse(&v).ok_or_else(|| {
                config_err(ENV_MONITOR, &v, "expected uffd, alloc, none or disabled".into())
            })?;
        }
        if let Some(v) = get(ENV_CONSISTENCY) {
            cfg.consistency = Consistency::parse(&v)
                .ok_or_else(|| config_err(ENV_CONSISTENCY, &v, "expected in-flight or returned".into()))?;
        }
        if let Some(v) = get(ENV_MAP_WATCH) {
            cfg.map_watch = match v.trim().to_ascii_lowercase().as_str() {
                "on" | "perf" => true,
                "off" | "auto" => false,
                _ => return Err(config_err(ENV_MAP_WATCH, &v, "expected off or on".into())),
            };
        }
        Ok(cfg)
    }

    /// Checks the limits.
    pub fn validate(&self) -> Result<()> {
        if self.max_count == 0 || self.max_count > MAX_COUNT_LIMIT {
            return Err(Error::InvalidConfig(format!(
                "max_count {} not in 1..={MAX_COUNT_LIMIT}",
                self.max_count
            )));
        }
        if self.max_bytes == 0 {
            return Err(Error::InvalidConfig("max_bytes is 0".into()));
        }
        Ok(())
    }
}

fn config_err(var: &'static str, value: &str, reason: String) -> Error {
    Error::Config {
        var,
        value: value.to_string(),
        reason,
    }
}

/// Parses `123`, `64K`, `16M`, `2G` (also `KiB`/`MiB`/`GiB`), binary multiples.
pub fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits == 0 {
        return Err("expected a number".into());
    }
    let n: usize = t[..digits].parse().map_err(|e| format!("{e}"))?;
    let mult: usize = match t[digits..].trim().to_ascii_lowercase().as_str() {
        "" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => return Err(format!("unknown suffix {other:?}")),
    };
    n.checked_mul(mult).ok_or_else(|| "value overflows".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn parses_env_values() {
        let cfg = CacheConfig::from_lookup(env(&[
            (ENV_MAX_COUNT, "64"),
            (ENV_MAX_SIZE, "16M"),
            (ENV_MONITOR, "none"),
            (ENV_CONSISTENCY, "Returned"),
            (ENV_MAP_WATCH, "On"),
        ]))
        .unwrap();
        assert!(cfg.map_watch, "opted in");
        assert!(!CacheConfig::default().map_watch, "off unless asked for");
        assert_eq!(cfg.consistency, Consistency::Returned);
        assert_eq!(cfg.max_count, 64);
        assert_eq!(cfg.max_bytes, 16 << 20);
        assert_eq!(cfg.monitor, MonitorChoice::None);
        assert_eq!(
            CacheConfig::from_lookup(env(&[])).unwrap(),
            CacheConfig::default()
        );
    }

    #[test]
    fn invalid_values_name_the_variable() {
        for (var, val) in [
            (ENV_MAX_COUNT, "lots"),
            (ENV_MAX_COUNT, "0"),
            (ENV_MAX_COUNT, "99999999"),
            (ENV_MAX_SIZE, "12Q"),
            (ENV_MAX_SIZE, "1"),
            (ENV_MONITOR, "kdreg2"),
            (ENV_CONSISTENCY, "eventual"),
            (ENV_MAP_WATCH, "maybe"),
        ] {
            let err = CacheConfig::from_lookup(env(&[(var, val)])).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains(var) && msg.contains(val), "{msg}");
        }
    }

    #[test]
    fn a_value_that_is_not_utf8_is_an_error_not_unset() {
        use std::os::unix::ffi::OsStringExt;
        for var in ENV_VARS {
            let raw = |k: &str| (k == var).then(|| OsString::from_vec(b"16\xffM".to_vec()));
            let msg = CacheConfig::from_os_lookup(raw).unwrap_err().to_string();
            assert!(msg.contains(var) && msg.contains("not valid UTF-8"), "{msg}");
        }
        let ok = |k: &str| (k == ENV_MAX_SIZE).then(|| OsString::from("16M"));
        assert_eq!(CacheConfig::from_os_lookup(ok).unwrap().max_bytes, 16 << 20);
    }
}
