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
/// Besides errors and departures, the busy paths also mark the side of a
/// branch that the busy RPC path never takes and that costs far more than
/// a jump when it runs (a buffer's copy, a system call, a spill, a
/// completion the RPC layer does not ask for): without a profile the
/// compiler lays out the `if` side in line and the common path jumps over
/// it (docs/PERFORMANCE.md, session 38).
///
/// A stable stand-in for `std::hint::cold_path` (Rust 1.95; the workspace
/// supports 1.88): a call to a `#[cold]` function makes the block that
/// makes it cold. It is never inlined, so that the hint survives inlining;
/// the call costs a few instructions on the rare path only.
#[cold]
#[inline(never)]
pub fn cold_path() {}
