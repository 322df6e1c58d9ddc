//! Branch hints for the busy paths of the plugins and the RPC layer.
//!
//! A round trip of a busy RPC is a few thousand instructions spread over
//! many functions, and the error branches inside them (a protocol
//! violation, a peer gone, a refused send) are laid out by the compiler's
//! guesses unless they are marked. Marking them moves them out of the
//! straight line the common case runs through (docs/PERFORMANCE.md,
//! session 37).

/// Marks the path that calls it as rarely taken: the compiler lays the
/// branch out of line and does not inline into it.
///
/// A stable stand-in for `std::hint::cold_path` (Rust 1.95; the workspace
/// supports 1.88): a call to a `#[cold]` function makes the block that
/// makes it cold. It is never inlined, so that the hint survives inlining;
/// the call costs a few instructions on the rare path only.
#[cold]
#[inline(never)]
pub fn cold_path() {}
