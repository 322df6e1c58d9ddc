//! [`VerbsConfig`] from the environment: the connection settings a
//! deployer tunes without changing code.
//!
//! | variable | field | values | default |
//! |---|---|---|---|
//! | `QS_VERBS_MAX_CONNS` | [`max_conns`](VerbsConfig::max_conns) | 1 ..= 4096 | 64 |
//! | `QS_VERBS_OUTGOING_RESERVE` | [`outgoing_reserve`](VerbsConfig::outgoing_reserve) | 0 ..= max connections - 1 | `max(1, limit / 8)` |
//! | `QS_VERBS_RECV_DEPTH` | [`recv_depth`](VerbsConfig::recv_depth) | 4 ..= 4096 | 64 |
//! | `QS_VERBS_SEND_QUEUE_DEPTH` | [`send_queue_depth`](VerbsConfig::send_queue_depth) | receive depth + 8 ..= 65536 | 256 |
//! | `QS_VERBS_MAX_MSG_SIZE` | [`max_msg_size`](VerbsConfig::max_msg_size) (the eager size) | bytes, optional `K`/`M` suffix, 1K ..= 1M | 4096 |
//! | `QS_VERBS_MAX_RD_ATOMIC` | [`max_rd_atomic`](VerbsConfig::max_rd_atomic) | 0 ..= 255 | 16 |
//! | `QS_VERBS_SETUP_TIMEOUT_MS` | [`setup_timeout`](VerbsConfig::setup_timeout) | milliseconds, over 10000 | 15000 |
//! | `QS_VERBS_CANCEL_TIMEOUT_MS` | [`cancel_timeout`](VerbsConfig::cancel_timeout) | milliseconds (at least 1), or `never` | 5000 |
//!
//! `QS_VERBS_MAX_MSG_SIZE` may differ between processes that talk to each
//! other: each side's hello tells the other its limit, a message past the
//! peer's fails alone with `NaError::MessageTooLarge`, and
//! `Plugin::max_unexpected_size_to` answers the smaller of the two limits
//! (before the hello: 0, nothing known). hg-rpc spills whatever its
//! destination does not take (and, before the hello, anything past its
//! `MIN_EAGER_SIZE`, 1 KiB, the least limit an engine accepts).
//!
//! `QS_VERBS_MAX_MSG_SIZE` is refused below [`ENV_MAX_MSG_SIZE_FLOOR`]
//! (1 KiB, hg-rpc's `MIN_EAGER_SIZE`). The plugin itself needs no floor
//! (the 16-byte header has room of its own in every buffer, and a
//! `max_msg_size` of 0 takes empty messages), but the variable is read
//! by the default factory, whose users (hg-rpc's `Engine::from_spec`)
//! cannot work below it: without the floor a small value (`16`, or a
//! `1` meant as `1M`) was taken here and every engine creation failed
//! later, naming neither the value nor the variable as the one at fault.
//! A smaller size set in code ([`VerbsConfig::max_msg_size`]) is still
//! taken, for raw NA users and tests.
//!
//! The variables override the defaults, never a value set in code:
//! [`VerbsConfig::from_env`] is the defaults with the variables that are
//! set applied, and what code changes after that wins. The plugins of a
//! [`VerbsFactory::default`](crate::VerbsFactory) (the one hg-rpc's
//! `Engine::from_spec` and na-perf use) read them at each creation; a
//! configuration given in code ([`VerbsFactory::new`](crate::VerbsFactory::new),
//! [`VerbsPlugin::new`](crate::VerbsPlugin::new)) is used as given (start
//! it from [`VerbsConfig::from_env`] to keep the variables). This is
//! na-regcache's rule for `QS_MR_CACHE_*` ([`VerbsConfig::cache`]: `None`
//! reads them, a configuration given is used as given).
//!
//! A value that is not UTF-8, does not parse, or is out of range is an
//! error ([`NaError::Config`]) that names the variable and its value,
//! never a silent default; so is one that breaks a rule with another
//! setting (a receive depth the send queue cannot serve), which names the
//! variable that was set.

use std::ffi::OsString;
use std::time::Duration;

use na_core::{NaError, Result};

use crate::config::VerbsConfig;

/// Environment variable: [`VerbsConfig::max_conns`].
pub const ENV_MAX_CONNS: &str = "QS_VERBS_MAX_CONNS";
/// Environment variable: [`VerbsConfig::outgoing_reserve`].
pub const ENV_OUTGOING_RESERVE: &str = "QS_VERBS_OUTGOING_RESERVE";
/// Environment variable: [`VerbsConfig::recv_depth`].
pub const ENV_RECV_DEPTH: &str = "QS_VERBS_RECV_DEPTH";
/// Environment variable: [`VerbsConfig::send_queue_depth`].
pub const ENV_SEND_QUEUE_DEPTH: &str = "QS_VERBS_SEND_QUEUE_DEPTH";
/// Environment variable: [`VerbsConfig::max_msg_size`].
pub const ENV_MAX_MSG_SIZE: &str = "QS_VERBS_MAX_MSG_SIZE";
/// Environment variable: [`VerbsConfig::max_rd_atomic`].
pub const ENV_MAX_RD_ATOMIC: &str = "QS_VERBS_MAX_RD_ATOMIC";
/// Environment variable: [`VerbsConfig::setup_timeout`], in milliseconds.
pub const ENV_SETUP_TIMEOUT_MS: &str = "QS_VERBS_SETUP_TIMEOUT_MS";
/// Environment variable: [`VerbsConfig::cancel_timeout`], in milliseconds
/// (`never`: wait for ever).
pub const ENV_CANCEL_TIMEOUT_MS: &str = "QS_VERBS_CANCEL_TIMEOUT_MS";

/// Every variable [`VerbsConfig::from_env`] reads.
pub const ENV_VARS: [&str; 8] = [
    ENV_MAX_CONNS,
    ENV_OUTGOING_RESERVE,
    ENV_RECV_DEPTH,
    ENV_SEND_QUEUE_DEPTH,
    ENV_MAX_MSG_SIZE,
    ENV_MAX_RD_ATOMIC,
    ENV_SETUP_TIMEOUT_MS,
    ENV_CANCEL_TIMEOUT_MS,
];

/// Least `QS_VERBS_MAX_MSG_SIZE`, in bytes: hg-rpc's `MIN_EAGER_SIZE`
/// (its engines refuse a plugin whose messages are smaller). Only the
/// variable is held to it: [`VerbsConfig::max_msg_size`] set in code may
/// be smaller, down to 0 (see the [module docs](self)).
pub const ENV_MAX_MSG_SIZE_FLOOR: usize = 1024;

/// Largest `QS_VERBS_SEND_QUEUE_DEPTH` (devices allow less or about this).
const MAX_SEND_QUEUE_DEPTH: u64 = 65536;

/// For each field [`VerbsConfig::validate`] may name: the variables whose
/// values its rule reads, the field's own first (the others are those of
/// the fields it is compared with).
const RULES: [(&str, &[&str]); 6] = [
    ("max_conns", &[ENV_MAX_CONNS]),
    ("outgoing_reserve", &[ENV_OUTGOING_RESERVE, ENV_MAX_CONNS]),
    ("recv_depth", &[ENV_RECV_DEPTH]),
    ("send_queue_depth", &[ENV_SEND_QUEUE_DEPTH, ENV_RECV_DEPTH]),
    ("max_msg_size", &[ENV_MAX_MSG_SIZE]),
    ("setup_timeout", &[ENV_SETUP_TIMEOUT_MS]),
];

impl VerbsConfig {
    /// The defaults overridden by the `QS_VERBS_*` variables that are set
    /// (see [`crate::config_env`]). An invalid value, or one that is not
    /// UTF-8, is an error naming its variable and value.
    pub fn from_env() -> Result<VerbsConfig> {
        Self::from_os_lookup(|k| std::env::var_os(k))
    }

    /// Like [`VerbsConfig::from_env`] with a custom lookup of raw values.
    pub fn from_os_lookup(get: impl Fn(&str) -> Option<OsString>) -> Result<VerbsConfig> {
        for var in ENV_VARS {
            if let Some(v) = get(var).filter(|v| v.to_str().is_none()) {
                return Err(bad(var, &v.to_string_lossy(), "not valid UTF-8".into()));
            }
        }
        Self::from_lookup(|k| get(k).and_then(|v| v.into_string().ok()))
    }

    /// Like [`VerbsConfig::from_env`] with a custom variable lookup.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<VerbsConfig> {
        let mut cfg = VerbsConfig::default();
        let mut set: Vec<(&'static str, String)> = Vec::new();
        for var in ENV_VARS {
            let Some(v) = get(var) else { continue };
            apply(&mut cfg, var, &v)?;
            set.push((var, v));
        }
        match cfg.validate() {
            Ok(()) => Ok(cfg),
            Err(NaError::Config { name, value, reason }) => {
                // Name the variable that was set, not a field the deployer
                // never wrote.
                let vars = RULES.iter().find(|(field, _)| *field == name).map(|r| r.1);
                let culprit = vars.and_then(|vars| {
                    vars.iter()
                        .enumerate()
                        .find_map(|(i, w)| set.iter().find(|(var, _)| var == w).map(|s| (i == 0, s)))
                });
                match culprit {
                    Some((own, (var, raw))) => {
                        let reason = if own {
                            reason
                        } else {
                            format!("{name} {value} {reason}")
                        };
                        Err(bad(var, raw, reason))
                    }
                    None => Err(NaError::Config { name, value, reason }),
                }
            }
            Err(e) => Err(e),
        }
    }
}

/// Sets the field of `var` from its value `v`, checking its own range.
fn apply(cfg: &mut VerbsConfig, var: &'static str, v: &str) -> Result<()> {
    let count = |lo: u64, hi: u64| -> Result<u64> {
        let n = digits(v).ok_or_else(|| bad(var, v, format!("expected a whole number {lo}..={hi}")))?;
        if n < lo || n > hi {
            return Err(bad(var, v, format!("must be {lo}..={hi}")));
        }
        Ok(n)
    };
    let millis = || -> Result<u64> {
        let what = match var {
            ENV_CANCEL_TIMEOUT_MS => "expected a whole number of milliseconds, or never",
            _ => "expected a whole number of milliseconds",
        };
        digits(v).ok_or_else(|| bad(var, v, what.into()))
    };
    // Each bound fits its field, so the conversions below cannot fail.
    let (lo, hi) = crate::wire::DEPTH_RANGE;
    match var {
        ENV_MAX_CONNS => cfg.max_conns = count(1, 4096)? as usize,
        ENV_OUTGOING_RESERVE => cfg.outgoing_reserve = Some(count(0, 4095)? as usize),
        ENV_RECV_DEPTH => cfg.recv_depth = count(lo.into(), hi.into())? as u16,
        ENV_SEND_QUEUE_DEPTH => cfg.send_queue_depth = count(1, MAX_SEND_QUEUE_DEPTH)? as u32,
        ENV_MAX_MSG_SIZE => {
            let max = crate::wire::MAX_PAYLOAD_LIMIT as usize;
            let n = na_regcache::config::parse_size(v).map_err(|why| bad(var, v, why))?;
            if n > max {
                return Err(bad(var, v, format!("must be at most {max} bytes (1M)")));
            }
            if n < ENV_MAX_MSG_SIZE_FLOOR {
                return Err(bad(
                    var,
                    v,
                    format!(
                        "must be at least {ENV_MAX_MSG_SIZE_FLOOR} bytes (1K): hg-rpc's engines need \
                         messages of that size (a smaller max_msg_size can be set in code)"
                    ),
                ));
            }
            cfg.max_msg_size = n;
        }
        ENV_MAX_RD_ATOMIC => cfg.max_rd_atomic = count(0, u8::MAX.into())? as u8,
        ENV_SETUP_TIMEOUT_MS => cfg.setup_timeout = Duration::from_millis(millis()?),
        ENV_CANCEL_TIMEOUT_MS => {
            cfg.cancel_timeout = if v.trim().eq_ignore_ascii_case("never") {
                Duration::MAX
            } else {
                // Zero tears a connection down at the first check after any
                // cancel, failing everything else on it: a test setting,
                // not one a deployment means.
                match millis()? {
                    0 => {
                        return Err(bad(
                            var,
                            v,
                            "must be at least 1 (0 is for tests: set it in code)".into(),
                        ))
                    }
                    ms => Duration::from_millis(ms),
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// A whole number written with digits only (surrounding blanks allowed),
/// as `na_regcache::config::parse_size` reads sizes: no sign, so `+5` is
/// refused here as it is for `QS_VERBS_MAX_MSG_SIZE`.
fn digits(v: &str) -> Option<u64> {
    let t = v.trim();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    t.parse().ok()
}

fn bad(var: &str, value: &str, reason: String) -> NaError {
    NaError::Config {
        name: var.into(),
        value: value.into(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    /// The error of `pairs`, checked to be a `Config` error naming `var`
    /// and its value.
    fn refused(pairs: &[(&str, &str)], var: &str) -> String {
        let err = VerbsConfig::from_lookup(env(pairs)).expect_err("an invalid value was taken");
        let msg = err.to_string();
        let value = pairs
            .iter()
            .find(|(n, _)| *n == var)
            .map(|p| p.1)
            .expect("var in pairs");
        match &err {
            NaError::Config { name, value: v, .. } => {
                assert_eq!((name.as_str(), v.as_str()), (var, value), "{msg}");
            }
            other => panic!("not a configuration error: {other:?}"),
        }
        assert!(msg.contains(var) && msg.contains(value), "{msg}");
        msg
    }

    #[test]
    fn every_variable_sets_its_field() {
        let cfg = VerbsConfig::from_lookup(env(&[
            (ENV_MAX_CONNS, "200"),
            (ENV_OUTGOING_RESERVE, " 30 "),
            (ENV_RECV_DEPTH, "128"),
            (ENV_SEND_QUEUE_DEPTH, "512"),
            (ENV_MAX_MSG_SIZE, "16K"),
            (ENV_MAX_RD_ATOMIC, "4"),
            (ENV_SETUP_TIMEOUT_MS, "30000"),
            (ENV_CANCEL_TIMEOUT_MS, "250"),
        ]))
        .unwrap();
        assert_eq!(cfg.max_conns, 200);
        assert_eq!(cfg.outgoing_reserve, Some(30));
        assert_eq!(cfg.recv_depth, 128);
        assert_eq!(cfg.send_queue_depth, 512);
        assert_eq!(cfg.max_msg_size, 16 << 10);
        assert_eq!(cfg.max_rd_atomic, 4);
        assert_eq!(cfg.setup_timeout, Duration::from_secs(30));
        assert_eq!(cfg.cancel_timeout, Duration::from_millis(250));
        // Nothing else moved.
        let d = VerbsConfig::default();
        assert_eq!((cfg.max_held, cfg.max_held_total), (d.max_held, d.max_held_total));
        let never = VerbsConfig::from_lookup(env(&[(ENV_CANCEL_TIMEOUT_MS, "Never")])).unwrap();
        assert_eq!(never.cancel_timeout, Duration::MAX);
        let none = VerbsConfig::from_lookup(env(&[(ENV_OUTGOING_RESERVE, "0")])).unwrap();
        assert_eq!(none.outgoing_reserve, Some(0));
        // The floor itself is taken.
        let floor = VerbsConfig::from_lookup(env(&[(ENV_MAX_MSG_SIZE, "1K")])).unwrap();
        assert_eq!(floor.max_msg_size, ENV_MAX_MSG_SIZE_FLOOR);
    }

    /// Negative control of the tests below: nothing set is the defaults.
    #[test]
    fn nothing_set_is_the_defaults() {
        let cfg = VerbsConfig::from_lookup(env(&[])).unwrap();
        let d = VerbsConfig::default();
        assert_eq!(
            format!("{cfg:?}"),
            format!("{d:?}"),
            "the environment changed something that was not set"
        );
        // A lookup that answers for other names changes nothing either.
        let other =
            VerbsConfig::from_lookup(|k| (!ENV_VARS.contains(&k)).then(|| "junk".to_owned())).unwrap();
        assert_eq!(format!("{other:?}"), format!("{d:?}"));
    }

    #[test]
    fn unparsable_and_out_of_range_values_name_the_variable() {
        for (var, val, why) in [
            (ENV_MAX_CONNS, "lots", "whole number"),
            (ENV_MAX_CONNS, "0", "1..=4096"),
            (ENV_MAX_CONNS, "4097", "1..=4096"),
            (ENV_MAX_CONNS, "-1", "whole number"),
            (ENV_MAX_CONNS, "+8", "whole number"),
            (ENV_SETUP_TIMEOUT_MS, "+20000", "milliseconds"),
            (ENV_MAX_MSG_SIZE, "+4K", "number"),
            (ENV_MAX_CONNS, "", "whole number"),
            (ENV_MAX_CONNS, "99999999999999999999999", "whole number"),
            (ENV_OUTGOING_RESERVE, "some", "whole number"),
            (ENV_OUTGOING_RESERVE, "5000", "0..=4095"),
            (ENV_RECV_DEPTH, "3", "4..=4096"),
            (ENV_RECV_DEPTH, "70000", "4..=4096"),
            (ENV_SEND_QUEUE_DEPTH, "0", "1..=65536"),
            (ENV_SEND_QUEUE_DEPTH, "4.5", "whole number"),
            (ENV_MAX_MSG_SIZE, "12Q", "suffix"),
            (ENV_MAX_MSG_SIZE, "2M", "at most"),
            (ENV_MAX_MSG_SIZE, "big", "number"),
            (ENV_MAX_MSG_SIZE, "0", "at least 1024"),
            (ENV_MAX_MSG_SIZE, "1", "at least 1024"),
            (ENV_MAX_MSG_SIZE, "16", "at least 1024"),
            (ENV_MAX_MSG_SIZE, "1023", "at least 1024"),
            (ENV_MAX_RD_ATOMIC, "256", "0..=255"),
            (ENV_SETUP_TIMEOUT_MS, "15s", "milliseconds"),
            (ENV_SETUP_TIMEOUT_MS, "5000", "must exceed"),
            (ENV_CANCEL_TIMEOUT_MS, "forever", "milliseconds, or never"),
            (ENV_CANCEL_TIMEOUT_MS, "0", "at least 1"),
        ] {
            let msg = refused(&[(var, val)], var);
            assert!(msg.contains(why), "{var}={val}: {msg}");
        }
    }

    #[test]
    fn a_value_that_breaks_a_rule_with_another_setting_names_the_variable_set() {
        // The reserve must stay below max connections, whichever was set.
        let msg = refused(&[(ENV_OUTGOING_RESERVE, "64")], ENV_OUTGOING_RESERVE);
        assert!(msg.contains("below max_conns (64)"), "{msg}");
        let msg = refused(
            &[(ENV_MAX_CONNS, "8"), (ENV_OUTGOING_RESERVE, "8")],
            ENV_OUTGOING_RESERVE,
        );
        assert!(msg.contains("below max_conns (8)"), "{msg}");
        // A receive depth the default send queue cannot serve names the
        // receive depth, the variable that was set, and the field it broke.
        let msg = refused(&[(ENV_RECV_DEPTH, "1024")], ENV_RECV_DEPTH);
        assert!(
            msg.contains("send_queue_depth 256") && msg.contains("exceed recv_depth"),
            "{msg}"
        );
        // With both set, the send queue's own variable is named.
        let msg = refused(
            &[(ENV_RECV_DEPTH, "1024"), (ENV_SEND_QUEUE_DEPTH, "1000")],
            ENV_SEND_QUEUE_DEPTH,
        );
        assert!(msg.contains("exceed recv_depth"), "{msg}");
        // Negative controls: the same settings made consistent are taken.
        for ok in [
            &[(ENV_OUTGOING_RESERVE, "63")][..],
            &[(ENV_MAX_CONNS, "8"), (ENV_OUTGOING_RESERVE, "7")],
            &[(ENV_RECV_DEPTH, "1024"), (ENV_SEND_QUEUE_DEPTH, "1032")],
            &[(ENV_SETUP_TIMEOUT_MS, "10001")],
        ] {
            VerbsConfig::from_lookup(env(ok))
                .unwrap_or_else(|e| panic!("{ok:?}: {}", na_core::ErrorChain(&e)));
        }
    }

    #[test]
    fn a_value_that_is_not_utf8_is_an_error_not_unset() {
        use std::os::unix::ffi::OsStringExt;
        for var in ENV_VARS {
            let raw = |k: &str| (k == var).then(|| OsString::from_vec(b"6\xff4".to_vec()));
            let msg = VerbsConfig::from_os_lookup(raw).unwrap_err().to_string();
            assert!(msg.contains(var) && msg.contains("not valid UTF-8"), "{msg}");
        }
        let ok = |k: &str| (k == ENV_MAX_CONNS).then(|| OsString::from("16"));
        assert_eq!(VerbsConfig::from_os_lookup(ok).unwrap().max_conns, 16);
    }
}
