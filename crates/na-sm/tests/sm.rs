//! Multi-process tests of the shared-memory plugin: real processes (the
//! `qs-sm-testpeer` binary), real shm, eventfds, sockets and CMA.

#[path = "sm/common.rs"]
mod common;
#[path = "sm/messaging.rs"]
mod messaging;
#[path = "sm/rma.rs"]
mod rma;
#[path = "sm/robustness.rs"]
mod robustness;
