//! Quicksilver's RDMA verbs NA plugin (libibverbs + librdmacm through `rdma-sys`).
//!
//! [`VerbsPlugin`] implements [`na_core::Plugin`]; [`VerbsFactory`] builds
//! it from `verbs://` specs (scheme `verbs`, see [`addr`] for the address
//! format).
//!
//! # Design
//! * **Connections**: RC queue pairs through RDMA CM, one per peer,
//!   created lazily by the first operation on a peer; the connect and
//!   accept private data carry a hello (module `wire`) (who the side is, how many
//!   receive buffers it posted, its largest message). A hello of another
//!   version (another build: since version 2 a memory descriptor's key
//!   carries a secret in its high 32 bits) is rejected at the connect,
//!   the reject naming both versions. The address a hello
//!   names is checked only up to its IP, so an incoming connection is a
//!   peer of its own, which no lookup finds: a lookup always reaches the
//!   listener at the address, through a connection we made. Incoming
//!   and outgoing connections share one limit, of which
//!   [`VerbsConfig::outgoing_reserve`] slots only outgoing ones may use:
//!   peers that connect and stay idle cannot leave the process unable to
//!   call out (incoming connections past their share are rejected with
//!   the reason "too many incoming connections").
//! * **Messages**: every connection has `recv_depth` receive slots and as
//!   many send slots in one registered region; a message is a 16-byte
//!   header (module `wire`: kind, returned credits, tag, length) plus payload,
//!   sent with one SEND. Unexpected and expected messages share the
//!   buffers; expected ones match on (source peer, tag).
//! * **Flow control**: credits (module `credits`): a sender never has more
//!   messages in flight than the receiver has buffers posted, so QPs run
//!   with `rnr_retry_count = 0`. Sends beyond the credits queue in order
//!   (backpressure), never fail.
//! * **RMA**: RDMA WRITE (put) and READ (get), split (module `rma`) into work
//!   requests of at most the device's SGE limit and 16 MiB, one remote
//!   range each; a batch is checked whole before anything is queued, and
//!   queued work requests go out as linked lists (one `ibv_post_send` per
//!   64). A connection has no more reads outstanding than the read depth
//!   negotiated with its peer (module `reads`): the device holds the rest
//!   back, or the plugin where the device would allow more.
//! * **Registration**: through `na-regcache` with the real `ibv_reg_mr`
//!   registrar (`sys::IbvRegistrar`); validity flags checked on describe
//!   and on every RMA; counters via [`VerbsPlugin::cache_stats`] or a
//!   [`CacheStatsHandle`]. A handle whose pages are discarded or remapped
//!   (`munmap`, `madvise(MADV_DONTNEED)`, which glibc also does when it
//!   trims an arena) needs registering again: a never-described one is
//!   registered again on its next use, a described one fails its
//!   transfers until `mem_register` and `mem_describe` are called again
//!   (its peers hold the old keys). Registering a range discarded moments
//!   ago waits, at most [`na_regcache::REMOVE_SETTLE`] (100 ms), for the
//!   kernel to be done dropping its pages (the cache cannot see that
//!   happen), so the registration made then stays valid until the memory
//!   changes again. (Before 2026-11-29 one made within that time was
//!   valid only until it ended, and a described handle had to be
//!   registered again after it.)
//! * **Progress**: no threads; the completion channel and the RDMA CM
//!   channel sit in the plugin's own epoll fd ([`na_core::Plugin::poll_fd`]);
//!   busy progress polls the CQ without system calls.
//!
//! * **Configuration**: [`VerbsConfig`] in code, or the connection
//!   settings a deployer tunes from `QS_VERBS_*` environment variables
//!   ([`config_env`]: connections and their outgoing reserve, queue
//!   depths, the eager message size, read depth, timeouts), read by
//!   [`VerbsConfig::from_env`] and by the plugins of a
//!   [`VerbsFactory::default`] (hg-rpc's `Engine::from_spec`) at each
//!   creation; a value set in code wins, and a bad value is an error
//!   naming the variable.
//!
//! On a host without any RDMA device the crate builds and its tests run;
//! creating a plugin returns an error that says "no RDMA device found" and
//! what to install or load. The RDMA tests run inside the soft-RoCE VM
//! (`scripts/test-verbs.sh`, `tools/rxe-vm/`).
#![deny(unsafe_code)]
#![warn(missing_docs)]

// The crate's API is what the root re-exports plus the `addr`, `config`,
// `config_env` and `error` modules (address format, settings and their
// environment variables, errors). The other modules are private: `sys`
// wraps libibverbs/librdmacm objects for the plugin's own discipline, and
// `wire` and `credits` are its protocol internals. The `test-hooks`
// feature (off in a user's build; this crate's tests and the fuzz targets
// turn it on) makes `sys` and `wire` public for the tests and fuzz targets
// that drive them directly, and exports `VerbsConfigHooks` (the type of
// `VerbsConfig::debug`, whose switches exist only with the feature);
// `tests/test_hooks_hidden.rs` checks that a build without it cannot name
// them. Hooks are types defined once, real or empty (`config::hooks`,
// `plugin::hooks`), so that no function body carries a `cfg`. The
// `fuzzing` feature (the fuzz targets') adds `fuzzing`, the flow
// control's bookkeeping (`credits`, `held`), which no test hook reaches.
mod accept;
pub mod addr;
mod cancel;
pub mod config;
pub mod config_env;
mod conn;
mod connect;
mod credits;
mod device;
pub mod error;
mod factory;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod held;
mod mem;
mod msg;
mod msgbuf;
mod peers;
mod plugin;
mod progress;
mod reads;
mod rma;
#[allow(unsafe_code)]
#[cfg(feature = "test-hooks")]
pub mod sys;
// The sys layer wraps each verbs object whole (queue pair state changes,
// SRQs, immediate data, ...), more than the plugin itself calls; the
// tests drive the rest. Without the feature that rest is unused here:
// each such entry point of the tests carries its own
// `#[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]` (what
// only they use counts as used through them), so that anything else
// that falls out of use is still reported (`scripts/test-all.sh` lints
// the crate without the feature).
#[allow(unsafe_code)]
#[cfg(not(feature = "test-hooks"))]
mod sys;
#[cfg(feature = "test-hooks")]
pub mod wire;
#[cfg(not(feature = "test-hooks"))]
mod wire;

pub use addr::{VerbsUri, SCHEME};
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub use config::hooks::VerbsConfigHooks;
pub use config::VerbsConfig;
pub use error::{Result, VerbsError};
pub use factory::VerbsFactory;
pub use mem::CacheStatsHandle;
pub use msg::DEAD_HELD_GRACE;
pub use plugin::{VerbsPlugin, CM_POLL_EVERY};
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub use reads::ReadWindow;
pub use sys::{devices, DeviceInfo};
