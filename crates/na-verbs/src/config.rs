//! Configuration of a verbs plugin instance.

use std::net::SocketAddr;
use std::time::Duration;

use na_core::Result;
use na_regcache::CacheConfig;

use crate::addr::VerbsUri;

pub(crate) mod hooks;

/// Settings of one [`VerbsPlugin`](crate::VerbsPlugin). Build it from a
/// listen spec with [`VerbsConfig::from_spec`] and adjust fields; or start
/// from [`VerbsConfig::from_env`], the defaults with the `QS_VERBS_*`
/// variables applied ([`crate::config_env`]), which what code sets after
/// overrides. [`VerbsPlugin::new`](crate::VerbsPlugin::new) uses the
/// configuration as given (it reads no `QS_VERBS_*` variable).
#[derive(Debug, Clone)]
pub struct VerbsConfig {
    /// RDMA device; `None`: the first device with an active port.
    pub device: Option<String>,
    /// Port on the device (1-based); `None`: 1.
    pub ib_port: Option<u8>,
    /// IP (of the device's netdev) and RDMA CM port to bind; `None`: the
    /// port's first IPv4-mapped GID, port 0 (a free port). A link-local
    /// IPv6 address is refused (peers could not name it back).
    pub bind: Option<SocketAddr>,
    /// Accept connections from peers.
    pub listen: bool,
    /// Receive buffers posted per connection (the peer's credits), 4..=4096.
    pub recv_depth: u16,
    /// Largest message payload (both kinds), in bytes: what this side
    /// receives and sends. Each side tells its own in its hello, and a
    /// message past the peer's fails with `NaError::MessageTooLarge`;
    /// `Plugin::max_unexpected_size_to` tells a sender the smaller of the
    /// two. 0 is a size (empty messages only): the 16-byte header has
    /// room of its own. (hg-rpc needs at least its `MIN_EAGER_SIZE`,
    /// 1 KiB, and `QS_VERBS_MAX_MSG_SIZE` is refused below that,
    /// [`ENV_MAX_MSG_SIZE_FLOOR`](crate::config_env::ENV_MAX_MSG_SIZE_FLOOR);
    /// a value set here is not.)
    pub max_msg_size: usize,
    /// Most connections at once (sizes the completion queue).
    pub max_conns: usize,
    /// Connection slots kept for our own outgoing connections (the ones
    /// our operations on looked-up peers start): an incoming connection is
    /// accepted only while fewer than `limit - reserve` connections are
    /// live (incoming and outgoing, dead ones still flushing included),
    /// where `limit` is `max_conns` or the fewer the device's CQ holds;
    /// an outgoing one may use the whole limit. Peers that connect and
    /// stay idle (nothing closes an idle incoming connection) then cannot
    /// take every slot and leave this process unable to call out. A
    /// refused incoming connection is rejected with the reason "too many
    /// incoming connections", which the connecting side's failed
    /// operation names, and counts in `PluginStats::handshakes_refused`.
    /// `None`: `max(1, limit / 8)`; either way at most `limit - 1`
    /// ([`outgoing_reserve()`](crate::config::outgoing_reserve)), so a listener always takes at least one
    /// incoming connection (with a limit of 1: no reserve, the one slot
    /// goes to whoever comes first). `Some(0)`: no reserve. A value of
    /// `max_conns` or more is refused by [`validate`](Self::validate).
    pub outgoing_reserve: Option<usize>,
    /// Cap on scatter/gather entries per RMA work request (`None`: the
    /// device's `max_sge` / `max_sge_rd`). Lower it to force splitting.
    pub max_sge: Option<u32>,
    /// Send work requests per QP (messages and RMA pieces in flight).
    pub send_queue_depth: u32,
    /// Messages held per connection (nobody posted a receive yet) before
    /// credits are withheld from the sender.
    pub max_held: u32,
    /// Messages held over all connections, those of peers that went
    /// included. Once reached, every connection withholds the credits of
    /// its reposted buffers (as at `max_held`) and new connections are
    /// refused, until the application takes some; then every connection
    /// gets its withheld credits back. Many peers flooding at once then
    /// hold at most this plus what their credits already allowed (each
    /// connection's `recv_depth`), and a peer that reconnects over and
    /// over cannot bring a new connection's credits' worth each time.
    pub max_held_total: u32,
    /// Registration cache settings; `None`: from `QS_MR_CACHE_*`.
    pub cache: Option<CacheConfig>,
    /// RDMA CM address and route resolution timeout, in milliseconds.
    pub resolve_timeout_ms: i32,
    /// Most bytes of messages queued for one connection that has no send
    /// credit (each charged its payload plus 64); a send past it fails
    /// with `NaError::SendBacklogFull` and is not queued, so a peer that
    /// never reads cannot grow our memory.
    pub max_backlog_bytes: usize,
    /// Most bytes of messages queued for all connections together.
    pub max_backlog_total: usize,
    /// Longest a connection may take from its start (address and route
    /// resolution included, on the active side) or its connect request
    /// (passive side) to `Established`. Past it the connection is torn
    /// down: what waits on it fails with `PeerGone`, and an incoming one
    /// counts in `PluginStats::handshakes_refused`. The kernel's own CM
    /// retries would end a stalled handshake only after a minute or more,
    /// holding one of `max_conns` all along.
    pub setup_timeout: Duration,
    /// Longest an operation already handed to the device (an RDMA read or
    /// write, or a message on the wire) may take to end once canceled. A
    /// posted work request cannot be recalled, only waited for; a device
    /// or peer that never completes it would make that wait endless. Past
    /// this, the operation's connection is torn down (its QP goes to the
    /// error state, which flushes every work request on it): the canceled
    /// operation ends as `Canceled`, everything else on the connection
    /// fails with `PeerGone`, the address becomes unusable (look the peer
    /// up again to reconnect), and `PluginStats::cancels_forced` counts it.
    /// A connection whose send queue still completes work gets another
    /// `cancel_timeout` each time (a transfer behind others that move is
    /// not stuck). `Duration::MAX`: wait for ever; zero: tear down at the
    /// first check after the cancel, moving or not (for tests).
    pub cancel_timeout: Duration,
    /// Most RDMA reads in flight per connection, each way: the initiator
    /// depth we ask for and the responder resources we offer or grant
    /// (the device's `max_qp_init_rd_atom` and `max_qp_rd_atom` bound
    /// them further). A connection has no more of its gets' reads
    /// outstanding than the depth negotiated with the peer (the device
    /// or, where the device would allow more, the plugin holds the rest
    /// back). 0: no RDMA reads (a get fails with `NaError::Unsupported`,
    /// a peer's get of our memory fails on its side).
    pub max_rd_atomic: u8,
    /// Test hooks: with the `test-hooks` feature, the switches that
    /// provoke failures soft-RoCE cannot (`debug.ignore_established`: the
    /// passive side ignores `Established` events, as if the peer's
    /// ready-to-use message were lost; `debug.accept_responder_resources`:
    /// the responder resources an accept offers, unbounded by the device;
    /// `debug.fail_msgs_over` / `fail_msgs_count`: messages longer than
    /// that fail as a failed `ibv_post_send` would); without it, nothing
    /// (an empty value a user's build cannot name or set). Leave it at its
    /// default.
    #[doc(hidden)]
    pub debug: hooks::VerbsConfigHooks,
}

/// Default of [`VerbsConfig::setup_timeout`]: room for both 5 s
/// resolutions and the handshake itself.
pub const DEFAULT_SETUP_TIMEOUT: Duration = Duration::from_secs(15);

/// Default of [`VerbsConfig::cancel_timeout`]: far beyond what one posted
/// work request (at most 16 MiB) takes on a working device, and short of
/// the minute callers typically wait.
pub const DEFAULT_CANCEL_TIMEOUT: Duration = Duration::from_secs(5);

/// Default of [`VerbsConfig::max_rd_atomic`]: more reads in flight buy
/// nothing for the transfer sizes gets are split into, and cost the
/// responder.
pub const DEFAULT_MAX_RD_ATOMIC: u8 = 16;

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            device: None,
            ib_port: None,
            bind: None,
            listen: false,
            recv_depth: 64,
            max_msg_size: 4096,
            max_conns: 64,
            outgoing_reserve: None,
            max_sge: None,
            send_queue_depth: 256,
            max_held: 1024,
            max_held_total: 8192,
            cache: None,
            resolve_timeout_ms: 5000,
            max_backlog_bytes: na_core::DEFAULT_MAX_BACKLOG_BYTES,
            max_backlog_total: na_core::DEFAULT_MAX_BACKLOG_TOTAL,
            setup_timeout: DEFAULT_SETUP_TIMEOUT,
            cancel_timeout: DEFAULT_CANCEL_TIMEOUT,
            max_rd_atomic: DEFAULT_MAX_RD_ATOMIC,
            debug: hooks::VerbsConfigHooks::default(),
        }
    }
}

/// True for an IPv6 unicast link-local address (fe80::/10), which names a
/// host only together with an interface number of the host that uses it.
fn is_link_local(ip: std::net::IpAddr) -> bool {
    matches!(ip, std::net::IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80)
}

impl VerbsConfig {
    /// The defaults with device, port and bind address taken from a listen
    /// spec (`verbs://`, `verbs://rxe0`, `verbs://rxe0:1/10.77.0.1:0`).
    pub fn from_spec(spec: &str, listen: bool) -> Result<VerbsConfig> {
        let u = VerbsUri::parse(spec)?;
        Ok(VerbsConfig {
            device: u.device,
            ib_port: u.ib_port,
            bind: u.sock,
            listen,
            ..VerbsConfig::default()
        })
    }

    /// Checks the sizes; an error names the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &str, value: String, reason: &str| {
            Err(na_core::NaError::Config {
                name: name.into(),
                value,
                reason: reason.into(),
            })
        };
        if let Some(SocketAddr::V6(v6)) = self.bind.filter(|b| is_link_local(b.ip())) {
            return bad(
                "bind",
                v6.to_string(),
                "a link-local IPv6 address cannot be a listener's address: the hello that \
                 tells a peer where to answer carries no scope id (a scope is an interface \
                 number of one host), so peers could not name it back; bind a global or \
                 unique-local address (or IPv4)",
            );
        }
        let (lo, hi) = crate::wire::DEPTH_RANGE;
        if self.recv_depth < lo || self.recv_depth > hi {
            return bad("recv_depth", self.recv_depth.to_string(), "must be 4..=4096");
        }
        if self.max_msg_size > crate::wire::MAX_PAYLOAD_LIMIT as usize {
            return bad(
                "max_msg_size",
                self.max_msg_size.to_string(),
                "must be at most 1 MiB",
            );
        }
        if self.max_conns == 0 || self.max_conns > 4096 {
            return bad("max_conns", self.max_conns.to_string(), "must be 1..=4096");
        }
        if let Some(r) = self.outgoing_reserve.filter(|&r| r >= self.max_conns) {
            return bad(
                "outgoing_reserve",
                r.to_string(),
                &format!(
                    "must be below max_conns ({}): a listener must keep at least one slot for incoming connections (Some(0): no reserve)",
                    self.max_conns
                ),
            );
        }
        if self.send_queue_depth < u32::from(self.recv_depth) + 8 {
            return bad(
                "send_queue_depth",
                self.send_queue_depth.to_string(),
                "must exceed recv_depth by at least 8",
            );
        }
        if self.max_held == 0 {
            return bad(
                "max_held",
                "0".into(),
                "must be at least 1 (0 would withhold every credit from the first message)",
            );
        }
        if self.max_held_total < u32::from(self.recv_depth) {
            return bad(
                "max_held_total",
                self.max_held_total.to_string(),
                "must be at least recv_depth",
            );
        }
        if self.max_sge == Some(0) {
            return bad("max_sge", "0".into(), "must be at least 1");
        }
        // The active side's set-up includes both resolutions.
        let resolutions = Duration::from_millis(2 * u64::try_from(self.resolve_timeout_ms).unwrap_or(0));
        if self.setup_timeout <= resolutions {
            return bad(
                "setup_timeout",
                format!("{:?}", self.setup_timeout),
                &format!("must exceed twice resolve_timeout_ms ({resolutions:?}): address and route resolution count in it"),
            );
        }
        Ok(())
    }
}

/// The connection slots kept for outgoing connections out of `conn_limit`
/// (see [`VerbsConfig::outgoing_reserve`]): `asked`, or by default
/// `max(1, conn_limit / 8)`, and in both cases at most `conn_limit - 1`,
/// so that incoming connections always get at least one slot (a limit of
/// 1 keeps nothing back). Incoming connections are accepted while fewer
/// than `conn_limit - outgoing_reserve(..)` connections are live.
pub fn outgoing_reserve(conn_limit: usize, asked: Option<usize>) -> usize {
    asked
        .unwrap_or((conn_limit / 8).max(1))
        .min(conn_limit.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_local_bind_is_refused_by_name() {
        for spec in [
            "verbs://rxe0/[fe80::1%2]:0",
            "verbs:///[fe80::a:b]:7",
            "verbs:///[febf::1]:0",
        ] {
            let e = VerbsConfig::from_spec(spec, true)
                .unwrap()
                .validate()
                .unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains("bind") && text.contains("link-local"),
                "{spec}: {text}"
            );
        }
        for spec in [
            "verbs:///[fd00::1]:0",
            "verbs:///[2001:db8::1]:0",
            "verbs:///[fec0::1]:0",
        ] {
            VerbsConfig::from_spec(spec, true).unwrap().validate().unwrap();
        }
    }

    #[test]
    fn specs_and_validation() {
        let c = VerbsConfig::from_spec("verbs://rxe0:1/10.77.0.1:0", true).unwrap();
        assert_eq!(c.device.as_deref(), Some("rxe0"));
        assert_eq!(c.ib_port, Some(1));
        assert!(c.listen);
        c.validate().unwrap();
        assert!(VerbsConfig::from_spec("sm://", true).is_err());
        let c = VerbsConfig {
            recv_depth: 2,
            ..VerbsConfig::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("recv_depth"));
        let c = VerbsConfig {
            send_queue_depth: 10,
            ..VerbsConfig::default()
        };
        assert!(c.validate().is_err());
        let c = VerbsConfig {
            setup_timeout: Duration::ZERO,
            ..VerbsConfig::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("setup_timeout"));
        let c = VerbsConfig {
            resolve_timeout_ms: 8000,
            ..VerbsConfig::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("setup_timeout"));
        let c = VerbsConfig {
            setup_timeout: Duration::MAX,
            ..VerbsConfig::default()
        };
        c.validate().unwrap();
        let c = VerbsConfig {
            max_held: 0,
            ..VerbsConfig::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("max_held"));
    }

    #[test]
    fn the_outgoing_reserve_rule() {
        // Default: an eighth, at least one, never the whole limit.
        assert_eq!(outgoing_reserve(64, None), 8);
        assert_eq!(outgoing_reserve(15, None), 1);
        assert_eq!(outgoing_reserve(4, None), 1);
        assert_eq!(outgoing_reserve(2, None), 1);
        // A limit of 1: the one slot is anyone's.
        assert_eq!(outgoing_reserve(1, None), 0);
        // Asked for: as asked, within the same bound (a device whose CQ
        // lowered the limit below what was asked for).
        assert_eq!(outgoing_reserve(64, Some(0)), 0);
        assert_eq!(outgoing_reserve(64, Some(20)), 20);
        assert_eq!(outgoing_reserve(4, Some(20)), 3);
        assert_eq!(outgoing_reserve(1, Some(1)), 0);
        // Incoming connections always keep at least one slot.
        for limit in 1..=300 {
            for asked in [None, Some(0), Some(1), Some(limit), Some(usize::MAX)] {
                let r = outgoing_reserve(limit, asked);
                assert!(r < limit, "limit {limit}, asked {asked:?}: reserve {r}");
                assert!(asked.is_some() || limit == 1 || r >= 1);
            }
        }
    }

    #[test]
    fn nonsense_outgoing_reserves_are_refused() {
        for (max_conns, reserve) in [(4, 4), (4, 100), (1, 1)] {
            let c = VerbsConfig {
                max_conns,
                outgoing_reserve: Some(reserve),
                ..VerbsConfig::default()
            };
            let msg = c.validate().unwrap_err().to_string();
            assert!(
                msg.contains("outgoing_reserve") && msg.contains("below max_conns"),
                "{max_conns}/{reserve}: {msg}"
            );
        }
        for (max_conns, reserve) in [(4, Some(3)), (4, Some(0)), (1, Some(0)), (1, None)] {
            VerbsConfig {
                max_conns,
                outgoing_reserve: reserve,
                ..VerbsConfig::default()
            }
            .validate()
            .unwrap();
        }
    }
}
