//! The engine's switches read from the environment: an unset variable is
//! its default, an unreadable or unknown value a configuration error that
//! names the variable.

#[cfg(doc)]
use crate::engine::Engine;
use crate::error::{Result, RpcError};

/// Environment variable that chooses how the engine receives requests and
/// responses: `pull` (the default: the transport's pull mode where it has
/// one, see [`na_core::Plugin::pull_unexpected`]) or `posted` (posted
/// unexpected receives and their completions, as on a transport without
/// pull mode).
pub const RECV_MODE_ENV: &str = "QS_RPC_RECV";

/// Environment variable that sets the default of
/// [`Engine::set_checksums`]: `on` or `off` (the default).
pub const CHECKSUM_ENV: &str = "QS_RPC_CHECKSUM";

/// Reads [`RECV_MODE_ENV`]: true for pull mode (the default).
pub(crate) fn recv_pull_from_env() -> Result<bool> {
    env_switch(RECV_MODE_ENV, true, ("pull", "posted"))
}

/// Reads [`CHECKSUM_ENV`]: true if requests carry checksums (default off).
pub(crate) fn checksums_from_env() -> Result<bool> {
    env_switch(CHECKSUM_ENV, false, ("on", "off"))
}

/// Reads a two-way switch from variable `name`: `words.0` is true,
/// `words.1` false (blanks around them allowed), unset is `default`, and
/// anything else a configuration error naming the variable and the words.
fn env_switch(name: &str, default: bool, words: (&str, &str)) -> Result<bool> {
    let bad = |value: String, reason: String| {
        RpcError::Transport(na_core::NaError::Config {
            name: name.into(),
            value,
            reason,
        })
    };
    match na_core::env_var(name, |value, reason| bad(value, reason.into()))? {
        None => Ok(default),
        Some(v) => match v.trim() {
            w if w == words.0 => Ok(true),
            w if w == words.1 => Ok(false),
            _ => Err(bad(v, format!("expected {} or {}", words.0, words.1))),
        },
    }
}
