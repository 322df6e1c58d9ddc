//! Shared-memory-specific multi-process tests: real processes (the
//! `qs-sm-testpeer` binary), real shm, eventfds, sockets and CMA. The
//! transport-independent scenarios (messages, tags, sizes, backpressure,
//! cancel, RMA, peer death) are the NA conformance suite in `suite.rs`.

#[path = "sm/common.rs"]
mod common;
#[path = "sm/messaging.rs"]
mod messaging;
#[path = "sm/robustness.rs"]
mod robustness;
