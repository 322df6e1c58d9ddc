//! Choosing the local device, port and IP address of a plugin instance.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use crate::config::VerbsConfig;
use crate::error::{Result, VerbsError};
use crate::sys::{devices, CmId, Context, EventChannel, PortSpace};

/// The local end a plugin binds to.
#[derive(Debug, Clone)]
pub(crate) struct LocalPort {
    /// Device name.
    pub device: String,
    /// Port number on the device.
    pub ib_port: u8,
    /// IP address to bind RDMA CM to.
    pub ip: IpAddr,
}

/// Checks that `ctx` has port `port` and that it is active.
fn check_port(ctx: &Context, port: u8) -> Result<()> {
    let count = ctx.query_device()?.phys_port_cnt;
    if port == 0 || port > count {
        return Err(VerbsError::NoPort {
            device: ctx.name().to_owned(),
            port,
            count,
        });
    }
    if !ctx.query_port(port)?.active {
        return Err(VerbsError::PortDown {
            device: ctx.name().to_owned(),
            port,
        });
    }
    Ok(())
}

/// The first IPv4 address among the port's GIDs.
fn port_ipv4(ctx: &Context, port: u8) -> Result<IpAddr> {
    let n = ctx.query_port(port)?.gid_tbl_len.min(256);
    (0..n)
        .filter_map(|i| ctx.query_gid(port, i).ok())
        .find_map(|g| g.ipv4())
        .map(IpAddr::V4)
        .ok_or_else(|| VerbsError::NoAddress {
            device: ctx.name().to_owned(),
            port,
        })
}

/// The device and port that own `ip`: where RDMA CM binds it (a probe id,
/// any port), which is where the plugin's own ids will be. A requested
/// port must be that one.
fn of_address(ip: IpAddr, ib_port: Option<u8>) -> Result<LocalPort> {
    let events = EventChannel::new()?;
    let probe = CmId::new(&events, PortSpace::Tcp)?;
    probe.bind(SocketAddr::new(ip, 0))?;
    let ctx = probe.context()?;
    let port = probe.port_num();
    if let Some(requested) = ib_port.filter(|&p| p != port) {
        return Err(VerbsError::WrongPort {
            addr: ip.to_string(),
            device: ctx.name().to_owned(),
            actual: port,
            requested,
        });
    }
    check_port(&ctx, port)?;
    Ok(LocalPort {
        device: ctx.name().to_owned(),
        ib_port: port,
        ip,
    })
}

/// The device and port of `ip`, checked against a named device. The
/// name is opened first (an unknown one is [`VerbsError::DeviceNotFound`]
/// whatever the IP), and a requested port checked on it; with no port
/// requested the IP's own port is taken, which need not be port 1.
fn named_and_address(cfg: &VerbsConfig, ip: IpAddr) -> Result<LocalPort> {
    if let Some(name) = &cfg.device {
        let ctx = Context::open(Some(name))?;
        if let Some(port) = cfg.ib_port {
            check_port(&ctx, port)?;
        }
    }
    let found = of_address(ip, cfg.ib_port)?;
    match &cfg.device {
        Some(name) if *name != found.device => Err(VerbsError::WrongDevice {
            addr: ip.to_string(),
            actual: found.device,
            requested: name.clone(),
        }),
        _ => Ok(found),
    }
}

/// Resolves the configured (or default) device, port and IP. Given an IP,
/// the device and port are those the IP belongs to; a device or port also
/// asked for must be those ([`VerbsError::WrongDevice`],
/// [`VerbsError::WrongPort`]). The default device is otherwise the first
/// one whose port is active; with no device at all the error is
/// [`VerbsError::NoDevice`] (what to install or load).
pub(crate) fn choose(cfg: &VerbsConfig) -> Result<LocalPort> {
    if let Some(bind) = cfg.bind {
        return named_and_address(cfg, bind.ip());
    }
    let port = cfg.ib_port.unwrap_or(1);
    let ctx: Arc<Context> = match &cfg.device {
        Some(name) => {
            let ctx = Context::open(Some(name))?;
            check_port(&ctx, port)?;
            ctx
        }
        None => {
            let mut first_err = None;
            let mut found = None;
            for d in devices()? {
                let attempt = Context::open(Some(&d.name)).and_then(|c| check_port(&c, port).map(|()| c));
                match attempt {
                    Ok(c) => {
                        found = Some(c);
                        break;
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            match (found, first_err) {
                (Some(c), _) => c,
                (None, Some(e)) => return Err(e),
                (None, None) => {
                    return Err(VerbsError::NoDevice {
                        reason: "no device listed".into(),
                    })
                }
            }
        }
    };
    let ip = port_ipv4(&ctx, port)?;
    Ok(LocalPort {
        device: ctx.name().to_owned(),
        ib_port: port,
        ip,
    })
}
