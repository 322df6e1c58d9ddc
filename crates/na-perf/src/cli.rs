//! Command-line interface (clap derive).

use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use na_core::ProgressMode;

use crate::stats::Plan;

/// Latency and bandwidth of the Quicksilver NA shared-memory plugin, each
/// figure printed with its ratio to this machine's raw floor (`--floors`).
#[derive(Debug, Parser)]
#[command(name = "na-perf", version, about)]
pub struct Cli {
    /// What to measure.
    #[command(subcommand)]
    pub command: Command,
    /// Transport spec for both sides: `sm://` (default) or, over RDMA,
    /// `verbs://DEVICE/IP:0` (e.g. `verbs://rxe0/10.77.0.1:0`). Floors
    /// exist for `sm` only.
    #[arg(long, global = true, default_value = "sm://")]
    pub transport: String,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Message ping-pong latency (one-way = round trip / 2), 8 B to 4 KiB.
    Lat(LatArgs),
    /// RMA put/get bandwidth, 4 KiB to 16 MiB, 1 and 16 segments.
    Bw(BwArgs),
    /// The peer side (started by `lat`/`bw` themselves; `--standalone` to
    /// serve a `--peer` client).
    #[command(hide = true)]
    Serve(ServeArgs),
}

/// Options shared by `lat` and `bw`.
#[derive(Debug, Args)]
pub struct CommonArgs {
    /// Address of a running `na-perf serve --standalone` (e.g. `sm://1234-0`);
    /// without it a peer process is started.
    #[arg(long)]
    pub peer: Option<String>,
    /// Progress modes to measure (comma-separated). Default: all three for
    /// `lat`, adaptive for `bw`.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub mode: Vec<ModeArg>,
    /// Spin window of adaptive mode, in microseconds.
    #[arg(long, default_value_t = 200)]
    pub adaptive_spin_us: u64,
    /// Pin this process to CPU A and the peer to CPU B (`--cpu 0,1`).
    /// Default: the first two allowed CPUs when there are two or more.
    #[arg(long, value_delimiter = ',', num_args = 1)]
    pub cpu: Vec<usize>,
    /// Do not pin the processes.
    #[arg(long, conflicts_with = "cpu")]
    pub no_pin: bool,
    /// Message or transfer sizes (comma-separated, suffixes K and M allowed).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    pub sizes: Vec<usize>,
    /// Upper bound on operations per timed batch.
    #[arg(long)]
    pub iters: Option<usize>,
    /// Upper bound on warm-up operations before each figure.
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Number of timed batches per figure (the median is taken over them).
    #[arg(long)]
    pub batches: Option<usize>,
    /// Target duration of one batch, in milliseconds.
    #[arg(long)]
    pub batch_ms: Option<f64>,
    /// Small preset for smoke runs (few, short batches).
    #[arg(long)]
    pub quick: bool,
    /// Also measure the raw floors of this machine and print ratios to them.
    #[arg(long)]
    pub floors: bool,
    /// One JSON object per line per result instead of a table.
    #[arg(long)]
    pub json: bool,
}

impl CommonArgs {
    /// The sampling plan: the preset (`--quick` or the default) with any
    /// explicit option applied over it.
    pub fn plan(&self) -> Plan {
        let mut plan = if self.quick {
            Plan {
                batches: 9,
                max_iters: 50,
                warmup: 10,
                batch_time: Duration::from_micros(500),
            }
        } else {
            Plan {
                batches: 11,
                max_iters: 100_000,
                warmup: 1000,
                batch_time: Duration::from_millis(20),
            }
        };
        if let Some(n) = self.iters {
            plan.max_iters = n.max(1);
        }
        if let Some(n) = self.warmup {
            plan.warmup = n;
        }
        if let Some(n) = self.batches {
            plan.batches = n.max(1);
        }
        if let Some(ms) = self.batch_ms {
            plan.batch_time = Duration::from_secs_f64(ms.max(0.0) / 1000.0);
        }
        plan
    }

    /// The modes to run, `default` if none was given.
    pub fn modes(&self, default: &[ModeArg]) -> Vec<ProgressMode> {
        let chosen = if self.mode.is_empty() {
            default
        } else {
            &self.mode[..]
        };
        chosen
            .iter()
            .map(|m| m.to_mode(Duration::from_micros(self.adaptive_spin_us)))
            .collect()
    }
}

/// `lat` options.
#[derive(Debug, Args)]
pub struct LatArgs {
    /// Shared options.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Message kinds to ping-pong (comma-separated). Default: expected and
    /// unexpected. `pulled` runs last, whatever the order given, in a
    /// session of its own (it needs the peer na-perf starts, not --peer).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub kind: Vec<MsgKind>,
}

/// `bw` options.
#[derive(Debug, Args)]
pub struct BwArgs {
    /// Shared options.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Segments per memory handle, on both sides (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16])]
    pub segments: Vec<usize>,
    /// RMA operations (comma-separated). Default: both.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub op: Vec<RmaOp>,
}

/// The hidden peer subcommand.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// CPU to pin to.
    #[arg(long)]
    pub pin: Option<usize>,
    /// Inherited floor descriptors: `<eventfd to peer>,<eventfd from peer>,<memfd>`.
    #[arg(long, value_delimiter = ',', num_args = 1)]
    pub floor_fds: Vec<i32>,
    /// Serve `--peer` clients forever instead of reading commands on stdin.
    #[arg(long)]
    pub standalone: bool,
    /// Process id of the `na-perf` that started us: we are killed when it
    /// exits, so a peer spinning in a floor never outlives a killed run.
    #[arg(long)]
    pub parent: Option<u32>,
}

/// A progress mode on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// Spin.
    Busy,
    /// Spin a while after activity, then sleep.
    Adaptive,
    /// Always sleep when idle.
    Blocking,
}

impl ModeArg {
    /// The na-core mode, with `spin` for adaptive.
    pub fn to_mode(self, spin: Duration) -> ProgressMode {
        match self {
            ModeArg::Busy => ProgressMode::Busy,
            ModeArg::Adaptive => ProgressMode::Adaptive { spin },
            ModeArg::Blocking => ProgressMode::Blocking,
        }
    }
}

/// Message kind of a latency test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MsgKind {
    /// Expected messages, matched on (source, tag).
    Expected,
    /// Unexpected messages.
    Unexpected,
    /// Unexpected messages that both sides take in pull mode, sent without
    /// a success completion: the path hg-rpc's messages take (measured in
    /// a session of its own, with the peer pulling too).
    Pulled,
}

/// RMA direction of a bandwidth test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RmaOp {
    /// Local to remote.
    Put,
    /// Remote to local.
    Get,
}

/// Parses `4096`, `4K`, `4KiB`, `16M`, `16MiB`.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.trim_end_matches("iB").trim_end_matches('B') {
        x if x.ends_with(['k', 'K']) => (&x[..x.len() - 1], 1usize << 10),
        x if x.ends_with(['m', 'M']) => (&x[..x.len() - 1], 1 << 20),
        x if x.ends_with(['g', 'G']) => (&x[..x.len() - 1], 1 << 30),
        x => (x, 1),
    };
    let n: usize = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size like 4096, 4K or 16M"))?;
    n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("16M"), Ok(16 << 20));
        assert!(parse_size("x").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn cli_parses() {
        Cli::try_parse_from([
            "na-perf",
            "lat",
            "--quick",
            "--mode",
            "busy,blocking",
            "--cpu",
            "0,1",
        ])
        .unwrap();
        Cli::try_parse_from(["na-perf", "bw", "--segments", "16", "--op", "get", "--floors"]).unwrap();
        assert!(Cli::try_parse_from(["na-perf", "lat", "--mode", "sideways"]).is_err());
    }
}
