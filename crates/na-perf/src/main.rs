//! `na-perf`: latency and bandwidth of a Quicksilver NA plugin (shared
//! memory by default, `--transport verbs://...` for RDMA), each shared-memory
//! figure next to this machine's raw floor.
//!
//! * `na-perf lat [--mode busy,adaptive,blocking] [--floors] [--json]`
//! * `na-perf bw [--segments 1,16] [--op put,get] [--floors] [--json]`
//!
//! Without `--peer`, a peer process is started by re-executing this binary
//! with the hidden `serve` subcommand; the two are pinned to different CPUs.
//! See [`stats`] for how medians and p99s are sampled.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod bw;
mod cli;
mod error;
mod floors;
mod lat;
mod peer;
mod report;
mod run;
mod serve;
mod sm_client;
mod sm_proto;
mod sm_server;
mod stats;
#[allow(unsafe_code)]
mod sys;

use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    sm_server::set_transport(&cli.transport);
    let res = match &cli.command {
        Command::Lat(a) => lat::run(a),
        Command::Bw(a) => bw::run(a),
        Command::Serve(a) => serve::run(a),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut msg = format!("na-perf: error: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!("\n  caused by: {s}"));
                src = s.source();
            }
            eprintln!("{msg}");
            ExitCode::FAILURE
        }
    }
}
