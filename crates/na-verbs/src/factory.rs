//! [`VerbsFactory`]: builds verbs plugins from `verbs://` specs.

use na_core::{Plugin, PluginFactory, PluginId, Result};

use crate::addr::SCHEME;
use crate::config::VerbsConfig;
use crate::plugin::VerbsPlugin;

/// Creates [`VerbsPlugin`]s for an endpoint's plugin registry. Settings not
/// in the spec come from `base` (sizes, cache).
#[derive(Debug, Clone, Default)]
pub struct VerbsFactory {
    base: VerbsConfig,
}

impl VerbsFactory {
    /// A factory whose plugins use `base` for what the spec leaves out.
    pub fn new(base: VerbsConfig) -> Self {
        VerbsFactory { base }
    }

    /// The configuration a spec gives.
    pub fn config_for(&self, spec: &str, listen: bool) -> Result<VerbsConfig> {
        let s = VerbsConfig::from_spec(spec, listen)?;
        Ok(VerbsConfig {
            device: s.device.or_else(|| self.base.device.clone()),
            ib_port: s.ib_port.or(self.base.ib_port),
            bind: s.bind.or(self.base.bind),
            listen,
            ..self.base.clone()
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
