//! [`VerbsFactory`]: builds verbs plugins from `verbs://` specs.

use na_core::{Plugin, PluginFactory, PluginId, Result};

use crate::addr::SCHEME;
use crate::config::VerbsConfig;
use crate::plugin::VerbsPlugin;

/// Creates [`VerbsPlugin`]s for an endpoint's plugin registry. Settings not
/// in the spec come from the base configuration given to
/// [`VerbsFactory::new`] (used as given), or, for the
/// [`default`](Default::default) factory, from [`VerbsConfig::from_env`],
/// read at each creation: the `QS_VERBS_*` variables
/// ([`crate::config_env`]) over the defaults, and a bad value fails the
/// creation with an error naming the variable.
#[derive(Debug, Clone, Default)]
pub struct VerbsFactory {
    /// `None`: the environment's, at each creation.
    base: Option<VerbsConfig>,
}

impl VerbsFactory {
    /// A factory whose plugins use `base` for what the spec leaves out;
    /// no `QS_VERBS_*` variable is read (start `base` from
    /// [`VerbsConfig::from_env`] to keep them).
    pub fn new(base: VerbsConfig) -> Self {
        VerbsFactory { base: Some(base) }
    }

    /// The configuration a spec gives.
    pub fn config_for(&self, spec: &str, listen: bool) -> Result<VerbsConfig> {
        let s = VerbsConfig::from_spec(spec, listen)?;
        let base = match &self.base {
            Some(b) => b.clone(),
            None => VerbsConfig::from_env()?,
        };
        Ok(VerbsConfig {
            device: s.device.or(base.device.clone()),
            ib_port: s.ib_port.or(base.ib_port),
            bind: s.bind.or(base.bind),
            listen,
            ..base
        })
    }
}

impl PluginFactory for VerbsFactory {
    fn scheme(&self) -> &'static str {
        SCHEME
    }

    fn create(&self, id: PluginId, spec: &str, listen: bool) -> Result<Box<dyn Plugin>> {
        Ok(Box::new(VerbsPlugin::new(id, self.config_for(spec, listen)?)?))
    }
}
