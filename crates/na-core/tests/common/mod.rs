//! Helpers shared by na-core's integration tests.
#![allow(dead_code)]

pub mod sys;
