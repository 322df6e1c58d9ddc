//! Address strings of the verbs plugin.
//!
//! ```text
//! verbs://[<device>[:<ib-port>]][/<ip>[:<port>]]      listen specs
//! verbs://[<device>/]<ip>:<port>                       peer addresses
//! ```
//!
//! * `<device>`: the RDMA device (`rxe0`, `mlx5_0`); default: the first
//!   device with an active port. `<ib-port>`: its port number (default 1).
//! * `<ip>`: the IPv4 (or bracketed IPv6) address of the device's netdev,
//!   used by RDMA CM; default for a listen spec: the first IPv4-mapped GID
//!   of the port. `<port>`: the RDMA CM port (TCP port space); 0 or absent
//!   picks a free one.
//!
//! A plugin's own address is canonical: `verbs://rxe0/10.77.0.1:45123`.
//! In a peer address the device part is informational (RDMA CM routes by
//! IP), so `verbs://10.77.0.1:45123` names the same peer; peers are equal
//! when their `ip:port` are.
//!
//! An IPv4 address written in IPv6 form (`[::ffff:10.77.0.1]:45123`, an
//! IPv4-mapped address) is the IPv4 address: it parses as
//! `10.77.0.1:45123`, so one listener has one key whichever way it is
//! spelt (one peer per listener, and a lookup of our own address in that
//! form is seen as ours: see `mem::exposed`).

use std::net::{SocketAddr, SocketAddrV6};

use na_core::{split_uri, NaError, Result};

/// The scheme served by this plugin.
pub const SCHEME: &str = "verbs";

/// A parsed `verbs://` string.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VerbsUri {
    /// RDMA device name, if given.
    pub device: Option<String>,
    /// Port number on the device (1-based), if given.
    pub ib_port: Option<u8>,
    /// IP address and RDMA CM port, if given.
    pub sock: Option<SocketAddr>,
}

fn invalid(uri: &str, reason: impl Into<String>) -> NaError {
    NaError::InvalidAddress {
        uri: uri.to_owned(),
        reason: reason.into(),
    }
}

/// The one form of a socket address that names a listener: an
/// IPv4-mapped IPv6 address as the IPv4 address, and an IPv6 one without
/// its flow label (which names no listener; the scope id does, for a
/// link-local address, and stays).
pub(crate) fn canonical_sock(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V4(_) => a,
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(v4.into(), v6.port()),
            None => SocketAddrV6::new(*v6.ip(), v6.port(), 0, v6.scope_id()).into(),
        },
    }
}

fn parse_sock(uri: &str, s: &str) -> Result<SocketAddr> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(canonical_sock(a));
    }
    // An IP without a port means port 0 (listen specs only).
    match s.parse::<std::net::IpAddr>() {
        Ok(ip) => Ok(SocketAddr::new(ip.to_canonical(), 0)),
        Err(_) => Err(invalid(
            uri,
            format!("`{s}` is not <ip>[:<port>] (IPv6 as [addr]:port)"),
        )),
    }
}

impl VerbsUri {
    /// Parses any `verbs://` string (listen spec or peer address).
    pub fn parse(uri: &str) -> Result<VerbsUri> {
        let (scheme, rest) = split_uri(uri)?;
        if scheme != SCHEME {
            return Err(invalid(uri, format!("scheme `{scheme}` is not `{SCHEME}`")));
        }
        let (dev_part, sock_part) = match rest.split_once('/') {
            Some((d, s)) => (d, Some(s)),
            // `verbs://10.0.0.1:5` is an address; `verbs://rxe0` a device.
            None if rest.parse::<SocketAddr>().is_ok() => ("", Some(rest)),
            None => (rest, None),
        };
        let mut out = VerbsUri::default();
        if !dev_part.is_empty() {
            let (name, port) = match dev_part.split_once(':') {
                Some((n, p)) => {
                    let p: u8 = p
                        .parse()
                        .ok()
                        .filter(|&p| p >= 1)
                        .ok_or_else(|| invalid(uri, format!("device port `{p}` is not 1..=255")))?;
                    (n, Some(p))
                }
                None => (dev_part, None),
            };
            if !is_device_name(name) {
                return Err(invalid(uri, format!("`{name}` is not a device name")));
            }
            out.device = Some(name.to_owned());
            out.ib_port = port;
        }
        if let Some(s) = sock_part.filter(|s| !s.is_empty()) {
            out.sock = Some(parse_sock(uri, s)?);
        }
        Ok(out)
    }

    /// Parses a peer address: it must name an IP and a non-zero port.
    pub fn parse_peer(uri: &str) -> Result<(SocketAddr, Option<String>)> {
        let u = Self::parse(uri)?;
        match u.sock {
            // RDMA CM reaches a peer through the IP of its RDMA device; a
            // loopback address names none (resolving it fails, or waits
            // out the whole set-up timeout): refused here, by name.
            Some(s) if s.ip().is_loopback() => Err(invalid(
                uri,
                "a loopback address names no RDMA device: use the IP of the peer's RDMA netdev \
                 (our own address too), e.g. verbs://rxe0/10.77.0.1:4791",
            )),
            Some(s) if s.port() != 0 && !s.ip().is_unspecified() => Ok((s, u.device)),
            _ => Err(invalid(
                uri,
                "a peer address needs <ip>:<port> with a non-zero port, e.g. verbs://rxe0/10.77.0.1:4791",
            )),
        }
    }
}

/// True if `name` can be a device name in an address: 1 to 64 of
/// `[A-Za-z0-9_.-]` (so that the address it goes into parses back).
pub fn is_device_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// The canonical string of an address: `verbs://<device>/<ip>:<port>`
/// (`verbs://<ip>:<port>` when the device is unknown).
pub fn canonical(device: Option<&str>, sock: SocketAddr) -> String {
    match device {
        Some(d) if !d.is_empty() => format!("{SCHEME}://{d}/{sock}"),
        _ => format!("{SCHEME}://{sock}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_specs() {
        assert_eq!(VerbsUri::parse("verbs://").unwrap(), VerbsUri::default());
        let u = VerbsUri::parse("verbs://rxe0").unwrap();
        assert_eq!(
            (u.device.as_deref(), u.ib_port, u.sock),
            (Some("rxe0"), None, None)
        );
        let u = VerbsUri::parse("verbs://mlx5_0:2/10.77.0.1:0").unwrap();
        assert_eq!(u.device.as_deref(), Some("mlx5_0"));
        assert_eq!(u.ib_port, Some(2));
        assert_eq!(u.sock, Some("10.77.0.1:0".parse().unwrap()));
        let u = VerbsUri::parse("verbs://rxe0/10.77.0.1").unwrap();
        assert_eq!(u.sock, Some("10.77.0.1:0".parse().unwrap()));
        let u = VerbsUri::parse("verbs:///10.77.0.1:7").unwrap();
        assert_eq!((u.device, u.sock.unwrap().port()), (None, 7));
    }

    #[test]
    fn peer_addresses() {
        let (s, d) = VerbsUri::parse_peer("verbs://rxe0/10.77.0.1:4791").unwrap();
        assert_eq!(
            (s.to_string().as_str(), d.as_deref()),
            ("10.77.0.1:4791", Some("rxe0"))
        );
        let (s, d) = VerbsUri::parse_peer("verbs://10.77.0.1:4791").unwrap();
        assert_eq!((s.port(), d), (4791, None));
        let (s, _) = VerbsUri::parse_peer("verbs://rxe0/[fe80::1]:9").unwrap();
        assert!(s.is_ipv6());
        assert_eq!(canonical(Some("rxe0"), s), "verbs://rxe0/[fe80::1]:9");
        assert_eq!(canonical(None, s), "verbs://[fe80::1]:9");
    }

    #[test]
    fn ipv4_mapped_addresses_are_their_ipv4_address() {
        let (s, _) = VerbsUri::parse_peer("verbs://rxe0/[::ffff:10.77.0.1]:4791").unwrap();
        assert_eq!(s, "10.77.0.1:4791".parse().unwrap());
        let u = VerbsUri::parse("verbs://rxe0/::ffff:10.77.0.1").unwrap();
        assert_eq!(u.sock, Some("10.77.0.1:0".parse().unwrap()));
        // Other IPv6 addresses are kept, scope id included.
        let (s, _) = VerbsUri::parse_peer("verbs://[fe80::1%3]:9").unwrap();
        let SocketAddr::V6(v6) = s else { panic!("{s}") };
        assert_eq!((v6.ip().segments()[0], v6.scope_id()), (0xfe80, 3));
        let flow = SocketAddrV6::new("fe80::1".parse().unwrap(), 9, 7, 3);
        assert_eq!(
            canonical_sock(flow.into()),
            SocketAddrV6::new("fe80::1".parse().unwrap(), 9, 0, 3).into()
        );
    }

    #[test]
    fn malformed_addresses_are_clear_errors() {
        for bad in [
            "verbs://rxe0",
            "verbs://rxe0/10.77.0.1:0",
            "verbs://rxe0/10.77.0.1",
            "verbs://0.0.0.0:5",
            "verbs://[::ffff:0.0.0.0]:5",
            "verbs://127.0.0.1:5",
            "verbs://rxe0/127.0.0.2:5",
            "verbs://[::1]:5",
            "verbs://[::ffff:127.0.0.1]:5",
            "verbs://rxe0/not-an-ip:5",
            "verbs://rxe 0/10.0.0.1:5",
            "verbs://rxe0:0/10.0.0.1:5",
            "verbs://rxe0:300/10.0.0.1:5",
            "sm://rxe0/10.0.0.1:5",
            "verbs:/x",
        ] {
            let e = VerbsUri::parse_peer(bad).unwrap_err();
            assert!(matches!(e, NaError::InvalidAddress { .. }), "{bad}: {e:?}");
        }
    }
}
