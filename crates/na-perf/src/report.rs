//! Results: one [`Record`] per figure, printed as a table row or a JSON line,
//! and the floors that figures are compared with.

use std::collections::HashMap;
use std::io::Write;

use serde::Serialize;

use crate::error::{PerfError, Result};

/// Unit of latency figures.
pub const NS: &str = "ns";
/// Unit of bandwidth figures.
pub const MIB_S: &str = "MiB/s";

/// One measured figure.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Record {
    /// `lat`, `bw`, `floor_shm_flag_lat`, `floor_eventfd_lat`, `floor_cma_read_bw` or `floor_cma_write_bw`.
    pub test: String,
    /// `expected`/`unexpected` for `lat`, `put`/`get` for `bw`, the mechanism for floors.
    pub op: String,
    /// Progress mode (`busy`, `adaptive`, `blocking`); for floors, how they wait.
    pub mode: String,
    /// Message or transfer size in bytes.
    pub size: usize,
    /// Segments per memory handle (1 for messages).
    pub segments: usize,
    /// Median over batches: one-way ns for latency, MiB/s for bandwidth.
    pub median: f64,
    /// 99th percentile of single operations: the slow tail (ns for latency;
    /// for bandwidth the rate of the 99th-percentile slowest transfer).
    pub p99: f64,
    /// Median of the individually timed operations (same unit).
    pub p50: f64,
    /// `ns` or `MiB/s`.
    pub unit: &'static str,
    /// Median of the matching floor, with `--floors`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub floor: Option<f64>,
    /// `median / floor`: above 1 is slower for latency, below 1 is slower for bandwidth.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_to_floor: Option<f64>,
    /// Operations per timed batch.
    pub iters: usize,
}

impl Record {
    /// Fills `floor` and `ratio_to_floor` from `floor`, if known.
    pub fn with_floor(mut self, floor: Option<f64>) -> Self {
        if let Some(f) = floor.filter(|f| *f > 0.0) {
            self.floor = Some(f);
            self.ratio_to_floor = Some(self.median / f);
        }
        self
    }
}

/// Which floor a figure is compared with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FloorKind {
    /// Busy-polled shared-memory flag.
    ShmFlag,
    /// Eventfd through epoll.
    EventFd,
    /// process_vm_readv.
    CmaRead,
    /// process_vm_writev.
    CmaWrite,
}

/// Floors measured in this run, by kind, size and segment count.
#[derive(Debug, Default)]
pub struct Floors {
    by_key: HashMap<(FloorKind, usize, usize), f64>,
}

impl Floors {
    /// Remembers a floor median.
    pub fn insert(&mut self, kind: FloorKind, size: usize, segments: usize, median: f64) {
        self.by_key.insert((kind, size, segments), median);
    }

    /// The floor median, if measured.
    pub fn get(&self, kind: FloorKind, size: usize, segments: usize) -> Option<f64> {
        self.by_key.get(&(kind, size, segments)).copied()
    }
}

/// Prints records as they come: a table (header first) or JSON lines.
pub struct Reporter {
    json: bool,
    header_done: bool,
}

impl Reporter {
    /// A reporter writing JSON lines if `json`, else a table.
    pub fn new(json: bool) -> Self {
        Reporter {
            json,
            header_done: false,
        }
    }

    /// Prints one record to stdout.
    pub fn emit(&mut self, r: &Record) -> Result<()> {
        let mut out = std::io::stdout().lock();
        if self.json {
            let line = serde_json::to_string(r).map_err(|e| PerfError::Output(e.into()))?;
            writeln!(out, "{line}").map_err(PerfError::Output)?;
        } else {
            if !self.header_done {
                writeln!(out, "{}", table_header()).map_err(PerfError::Output)?;
                self.header_done = true;
            }
            writeln!(out, "{}", table_row(r)).map_err(PerfError::Output)?;
        }
        out.flush().map_err(PerfError::Output)
    }
}

fn table_header() -> String {
    format!(
        "{:<19} {:<10} {:<8} {:>8} {:>4} {:>11} {:>11} {:<5} {:>11} {:>7}",
        "test", "op", "mode", "size", "segs", "median", "p99", "unit", "floor", "ratio"
    )
}

fn table_row(r: &Record) -> String {
    let num = |v: f64| {
        if r.unit == NS {
            format!("{v:.1}")
        } else {
            format!("{v:.0}")
        }
    };
    format!(
        "{:<19} {:<10} {:<8} {:>8} {:>4} {:>11} {:>11} {:<5} {:>11} {:>7}",
        r.test,
        r.op,
        r.mode,
        human_size(r.size),
        r.segments,
        num(r.median),
        num(r.p99),
        r.unit,
        r.floor.map(num).unwrap_or_else(|| "-".into()),
        r.ratio_to_floor
            .map(|x| format!("{x:.2}x"))
            .unwrap_or_else(|| "-".into()),
    )
}

/// `4096` as `4K`, `16777216` as `16M`.
pub fn human_size(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_json_and_ratio() {
        let r = Record {
            test: "lat".into(),
            op: "expected".into(),
            mode: "busy".into(),
            size: 8,
            segments: 1,
            median: 120.0,
            p99: 300.0,
            p50: 110.0,
            unit: NS,
            floor: None,
            ratio_to_floor: None,
            iters: 10,
        };
        let j = serde_json::to_value(&r).unwrap();
        assert!(j.get("floor").is_none());
        let r = r.with_floor(Some(60.0));
        assert_eq!(r.ratio_to_floor, Some(2.0));
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(j["floor"], 60.0);
        assert!(table_row(&r).contains("2.00x"));
        assert_eq!(human_size(16 << 20), "16M");
        assert_eq!(human_size(4096), "4K");
        assert_eq!(human_size(100), "100");
    }
}
