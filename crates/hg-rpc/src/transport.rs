//! Choosing the transport by address spec: one registry of every NA plugin
//! this build has (`sm://` always, `verbs://` with the `verbs` feature), so
//! programs take a spec string and need no plugin-specific code.

use na_core::{Endpoint, PluginId, PluginRegistry, ProgressMode};

use crate::{Engine, Result};

/// A registry with every plugin compiled in: `sm` (settings from the
/// environment, see `na_sm::SmConfig`) and, with the `verbs` feature,
/// `verbs` (connection settings from `QS_VERBS_*`, see
/// `na_verbs::config_env`, and registration cache settings from
/// `QS_MR_CACHE_*`; a bad value fails the plugin's creation with an
/// error naming the variable).
pub fn registry() -> PluginRegistry {
    let mut reg = PluginRegistry::new();
    reg.register(Box::new(na_sm::SmFactory::default()));
    #[cfg(feature = "verbs")]
    reg.register(Box::new(na_verbs::VerbsFactory::default()));
    reg
}

/// The schemes [`registry`] knows, for help texts.
pub fn schemes() -> Vec<&'static str> {
    registry().schemes()
}

/// A new endpoint in `mode` with one plugin built from `spec` (`sm://`,
/// `sm://name`, `verbs://rxe0/10.77.0.1:0`...), listening if `listen`.
pub fn endpoint(spec: &str, listen: bool, mode: ProgressMode) -> Result<(Endpoint, PluginId)> {
    let mut ep = Endpoint::new(mode)?;
    let id = ep.add_from_spec(&registry(), spec, listen)?;
    Ok((ep, id))
}

impl Engine {
    /// An engine on a new endpoint with one plugin built from `spec` (see
    /// [`endpoint`]).
    pub fn from_spec(spec: &str, listen: bool, mode: ProgressMode) -> Result<Self> {
        let (ep, id) = endpoint(spec, listen, mode)?;
        Engine::new(ep, id)
    }
}
