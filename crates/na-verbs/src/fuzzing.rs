//! The fuzz targets' access (`fuzz/`, feature `fuzzing`, off in a user's
//! build; not an API) to the flow control's bookkeeping, which has no
//! I/O: one connection's credits (`credits.rs`) and the bounds on held
//! messages that withhold them (`held.rs`).

pub use crate::credits::Credits;
pub use crate::held::{release_for_total, HeldBounds, HeldTotal};
