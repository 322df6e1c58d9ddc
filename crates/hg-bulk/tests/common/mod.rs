//! Helpers shared by hg-bulk's integration tests.

use na_core::{Endpoint, Plugin, PluginId};
use na_sm::{SmConfig, SmPlugin};

/// Adds an sm plugin with its sockets in `dir` to `ep`, listening or not.
pub fn add_sm(ep: &mut Endpoint, dir: &std::path::Path, listen: bool) -> PluginId {
    let cfg = SmConfig {
        listen,
        ..SmConfig::default()
    }
    .with_dir(dir);
    ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap()
}
