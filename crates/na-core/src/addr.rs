//! Addresses of NA peers.
//!
//! An [`Addr`] is a cheap, clonable name of a peer as seen by one plugin
//! instance. It carries the peer's canonical URI (`sm://1234-0`,
//! `verbs://rxe0/10.77.0.1:4791`), which is also its serialized form, and a
//! plugin-private token that the plugin uses to find its peer state without a
//! string lookup. Two addresses are equal when they name the same peer of the
//! same plugin instance.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::error::{NaError, Result};

/// Identifies one plugin instance inside an [`Endpoint`](crate::Endpoint).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PluginId(pub u32);

/// The address of a peer (or of ourselves) on one plugin instance.
#[derive(Clone)]
pub struct Addr {
    inner: Arc<AddrInner>,
}

struct AddrInner {
    uri: Box<str>,
    plugin: PluginId,
    token: u64,
    is_self: bool,
}

impl Addr {
    /// Creates an address. Called by plugins only: `token` is the plugin's
    /// private handle for the peer (a slot index with a generation, say) and
    /// must be the same for every `Addr` the plugin hands out for that peer.
    pub fn new(uri: impl Into<Box<str>>, plugin: PluginId, token: u64, is_self: bool) -> Self {
        Addr {
            inner: Arc::new(AddrInner {
                uri: uri.into(),
                plugin,
                token,
                is_self,
            }),
        }
    }

    /// The canonical URI of the peer, e.g. `sm://4242-0`.
    pub fn uri(&self) -> &str {
        &self.inner.uri
    }

    /// The scheme part of the URI (`sm`, `verbs`, ...).
    pub fn scheme(&self) -> &str {
        scheme_of(&self.inner.uri).unwrap_or("")
    }

    /// The plugin instance this address belongs to.
    pub fn plugin(&self) -> PluginId {
        self.inner.plugin
    }

    /// The plugin-private token (see [`Addr::new`]).
    pub fn token(&self) -> u64 {
        self.inner.token
    }

    /// True if this is the address of the local plugin instance itself.
    pub fn is_self(&self) -> bool {
        self.inner.is_self
    }

    /// The serialized form: the URI as UTF-8 bytes. Feed them to
    /// [`Endpoint::addr_from_bytes`](crate::Endpoint::addr_from_bytes) on the
    /// other side.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.inner.uri.as_bytes().to_vec()
    }
}

impl PartialEq for Addr {
    fn eq(&self, other: &Self) -> bool {
        self.inner.plugin == other.inner.plugin && self.inner.token == other.inner.token
    }
}

impl Eq for Addr {}

impl Hash for Addr {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.inner.plugin.hash(state);
        self.inner.token.hash(state);
    }
}

impl fmt::Debug for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Addr({})", self.inner.uri)
    }
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.inner.uri)
    }
}

/// Returns the scheme of `uri` (`"sm"` for `"sm://1-0"`), or `None` if the
/// string has no `scheme://` prefix.
pub fn scheme_of(uri: &str) -> Option<&str> {
    let (scheme, _) = uri.split_once("://")?;
    if scheme.is_empty() || !scheme.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'+') {
        return None;
    }
    Some(scheme)
}

/// Splits `uri` into scheme and the rest, with a clear error if malformed.
pub fn split_uri(uri: &str) -> Result<(&str, &str)> {
    let scheme = scheme_of(uri).ok_or_else(|| NaError::InvalidAddress {
        uri: uri.to_owned(),
        reason: "expected <scheme>://<address>".into(),
    })?;
    Ok((scheme, &uri[scheme.len() + 3..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn equality_is_by_plugin_and_token() {
        let a = Addr::new("sm://1-0", PluginId(0), 7, false);
        let b = Addr::new("sm://1-0", PluginId(0), 7, false);
        let c = Addr::new("sm://1-0", PluginId(1), 7, false);
        assert_eq!(a, b);
        assert_ne!(a, c);
        let set: HashSet<_> = [a.clone(), b, c].into_iter().collect();
        assert_eq!(set.len(), 2);
        assert_eq!(a.scheme(), "sm");
        assert_eq!(a.to_bytes(), b"sm://1-0");
    }

    #[test]
    fn uri_parsing() {
        assert_eq!(
            split_uri("verbs://rxe0/10.0.0.1:1").unwrap(),
            ("verbs", "rxe0/10.0.0.1:1")
        );
        assert!(split_uri("nothing").is_err());
        assert!(split_uri("://x").is_err());
        assert!(split_uri("s m://x").is_err());
    }
}
