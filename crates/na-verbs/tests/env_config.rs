//! The `QS_VERBS_*` variables ([`na_verbs::config_env`]) reach the
//! plugins of the default factory (the one hg-rpc's `Engine::from_spec`
//! and na-perf register), read at each creation: a value set takes
//! effect in the plugin, a bad one fails the creation with an error that
//! names the variable and its value, and a configuration given in code
//! is used as given.
//!
//! The only test of this binary: it sets the process's environment,
//! which no other thread of it reads meanwhile. Without an RDMA device
//! the configuration part runs (the variables are read before the device
//! is opened, so a bad one is reported there too) and the plugin part
//! says loudly that it did not run.

mod common;

use na_core::{Endpoint, NaError, PluginRegistry, ProgressMode};
use na_verbs::config_env::{ENV_MAX_CONNS, ENV_MAX_MSG_SIZE, ENV_OUTGOING_RESERVE, ENV_VARS};
use na_verbs::{VerbsConfig, VerbsFactory};

/// A blocking endpoint's attempt to add a plugin of the default factory
/// on `spec`; the endpoint, to look at the plugin, and its id.
fn create(spec: &str) -> (Endpoint, na_core::Result<na_core::PluginId>) {
    let mut registry = PluginRegistry::new();
    registry.register(Box::new(VerbsFactory::default()));
    let mut ep = Endpoint::new(ProgressMode::Blocking).expect("endpoint");
    let id = ep.add_from_spec(&registry, spec, true);
    (ep, id)
}

/// `r` is the configuration error of `var` set to `value`.
fn assert_refused<T: std::fmt::Debug>(r: na_core::Result<T>, var: &str, value: &str) {
    match r {
        Err(NaError::Config {
            name,
            value: v,
            reason,
        }) => {
            assert_eq!((name.as_str(), v.as_str()), (var, value), "{reason}");
            eprintln!("refused as it should be: {var}={value:?}: {reason}");
        }
        other => panic!("{var}={value:?} was not refused with its name: {other:?}"),
    }
}

#[test]
fn qs_verbs_variables_reach_the_default_factorys_plugins() {
    let rdma = common::rdma_env("qs_verbs_variables_reach_the_default_factorys_plugins");
    let spec = match &rdma {
        Some(env) => format!("verbs://{}/{}:0", env.device, env.ip),
        None => "verbs://".to_owned(),
    };
    for var in ENV_VARS {
        std::env::remove_var(var);
    }
    let default = VerbsConfig::default();
    // Negative control: nothing set, the defaults.
    let cfg = VerbsFactory::default().config_for(&spec, true).expect("config");
    assert_eq!(
        (cfg.max_msg_size, cfg.max_conns),
        (default.max_msg_size, default.max_conns)
    );

    std::env::set_var(ENV_MAX_MSG_SIZE, "1500");
    std::env::set_var(ENV_MAX_CONNS, "9");
    std::env::set_var(ENV_OUTGOING_RESERVE, "2");
    let cfg = VerbsFactory::default().config_for(&spec, true).expect("config");
    assert_eq!(
        (cfg.max_msg_size, cfg.max_conns, cfg.outgoing_reserve),
        (1500, 9, Some(2)),
        "the default factory did not read the variables"
    );
    assert!(cfg.listen, "the spec's settings are kept");
    // Code wins: a configuration given is used as given...
    let given = VerbsConfig {
        max_msg_size: 2048,
        ..VerbsConfig::default()
    };
    let cfg = VerbsFactory::new(given).config_for(&spec, true).expect("config");
    assert_eq!(
        (cfg.max_msg_size, cfg.max_conns, cfg.outgoing_reserve),
        (2048, default.max_conns, None)
    );
    // ...and what code changes after `from_env` overrides the variable.
    let mut cfg = VerbsConfig::from_env().expect("from_env");
    assert_eq!(cfg.max_msg_size, 1500);
    cfg.max_msg_size = 3000;
    let cfg = VerbsFactory::new(cfg).config_for(&spec, true).expect("config");
    assert_eq!((cfg.max_msg_size, cfg.max_conns), (3000, 9));

    if rdma.is_some() {
        let (mut ep, id) = create(&spec);
        let id = id.expect("a plugin with valid variables");
        let p = ep.plugin_mut(id).expect("plugin");
        assert_eq!(
            p.max_unexpected_size(),
            1500,
            "QS_VERBS_MAX_MSG_SIZE did not reach the plugin"
        );
    }

    // Bad values: the creation fails with the variable's error, on the
    // host before the device is looked for.
    for (var, value) in [
        (ENV_MAX_CONNS, "0x10"),
        (ENV_MAX_CONNS, "0"),
        (ENV_OUTGOING_RESERVE, "9"),
        (ENV_MAX_MSG_SIZE, "4M"),
        // Below the floor hg-rpc's engines need (the plugin would take it).
        (ENV_MAX_MSG_SIZE, "16"),
    ] {
        let keep = std::env::var(var).expect("set above");
        std::env::set_var(var, value);
        assert_refused(create(&spec).1, var, value);
        assert_refused(VerbsFactory::default().config_for(&spec, true), var, value);
        std::env::set_var(var, keep);
    }
    // Not UTF-8: an error too, never "unset".
    {
        use std::os::unix::ffi::OsStrExt;
        std::env::set_var(ENV_MAX_CONNS, std::ffi::OsStr::from_bytes(b"1\xff"));
        match create(&spec).1 {
            Err(NaError::Config { name, reason, .. }) => {
                assert_eq!(name, ENV_MAX_CONNS);
                assert!(reason.contains("UTF-8"), "{reason}");
            }
            other => panic!("a value that is not UTF-8 was taken: {other:?}"),
        }
        std::env::set_var(ENV_MAX_CONNS, "9");
    }
    // A factory given its configuration reads none of them, bad or not.
    std::env::set_var(ENV_MAX_CONNS, "none");
    VerbsFactory::new(VerbsConfig::default())
        .config_for(&spec, true)
        .expect("a configuration given in code ignores the environment");

    for var in ENV_VARS {
        std::env::remove_var(var);
    }
    if rdma.is_some() {
        // Negative control of the plugin check: unset, the default size.
        let (mut ep, id) = create(&spec);
        let id = id.expect("a plugin with no variables set");
        let p = ep.plugin_mut(id).expect("plugin");
        assert_eq!(p.max_unexpected_size(), default.max_msg_size);
    }
}
