//! The fuzz targets' `unsafe` (the workspace's rule: a crate root denies
//! `unsafe_code`, only its `sys` module allows it, a `// SAFETY:` comment
//! on every block), one file per facility. A target that needs one
//! declares `#[allow(unsafe_code)] mod sys;` under `#![deny(unsafe_code)]`.

pub mod alloc;
