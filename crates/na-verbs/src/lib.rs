//! Quicksilver's RDMA verbs plugin (libibverbs + librdmacm through `rdma-sys`).
//!
//! This crate currently provides the verbs `sys` layer: safe RAII wrappers over
//! devices, protection domains, memory regions, completion channels and
//! queues, RC queue pairs, shared receive queues and RDMA CM ids (see
//! [`sys`]). The NA plugin on top of it follows once the NA trait of
//! `na-core` is settled.
//!
//! On a host without any RDMA device the crate builds and its tests run;
//! opening a device returns [`VerbsError::NoDevice`], whose message says what
//! to install or load. The RDMA tests run inside the soft-RoCE VM
//! (`scripts/test-verbs.sh`, `tools/rxe-vm/`).
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod error;
#[allow(unsafe_code)]
pub mod sys;

pub use error::{Result, VerbsError};
