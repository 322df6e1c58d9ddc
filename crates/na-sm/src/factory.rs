//! Creating instances from `sm://` specs through a [`PluginRegistry`](na_core::PluginRegistry).

use na_core::{split_uri, NaError, Plugin, PluginFactory, PluginId, Result};

use crate::config::{check_name, SmConfig};
use crate::plugin::SmPlugin;

/// Builds [`SmPlugin`]s from `"sm://"` (numbered instance) or
/// `"sm://<name>"` (named instance, address `sm://<pid>-<name>`). Other
/// settings come from `base`.
#[derive(Clone, Debug, Default)]
pub struct SmFactory {
    /// Configuration every instance starts from.
    pub base: SmConfig,
}

impl SmFactory {
    /// A factory using `base` for everything but `listen` and the name.
    pub fn new(base: SmConfig) -> Self {
        SmFactory { base }
    }

    /// The configuration an instance built from `spec` gets.
    pub fn config_for(&self, spec: &str, listen: bool) -> Result<SmConfig> {
        let (scheme, rest) = split_uri(spec)?;
        let invalid = |reason: String| NaError::InvalidAddress {
            uri: spec.to_owned(),
            reason,
        };
        if scheme != "sm" {
            return Err(invalid("expected sm:// or sm://<name>".into()));
        }
        let mut cfg = self.base.clone();
        cfg.listen = listen;
        if !rest.is_empty() {
            check_name(rest).map_err(invalid)?;
            cfg.name = Some(rest.to_owned());
        }
        Ok(cfg)
    }
}

impl PluginFactory for SmFactory {
    fn scheme(&self) -> &'static str {
        "sm"
    }

    fn create(&self, id: PluginId, spec: &str, listen: bool) -> Result<Box<dyn Plugin>> {
        let cfg = self.config_for(spec, listen)?;
        Ok(Box::new(SmPlugin::new(id, cfg)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs() {
        let f = SmFactory::default();
        assert_eq!(f.config_for("sm://", true).unwrap().name, None);
        assert_eq!(
            f.config_for("sm://srv", false).unwrap().name.as_deref(),
            Some("srv")
        );
        assert!(f.config_for("sm://a/b", true).is_err());
        assert!(f.config_for("verbs://x", true).is_err());
    }
}
