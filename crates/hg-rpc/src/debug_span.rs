//! [`DebugSpan`]: the engine's debug spans, built only when a subscriber
//! wants them.
/// A debug span entered for as long as this lives, or none when no
/// subscriber wants debug spans (see [`DebugSpan::enter`]).
pub(crate) struct DebugSpan(Option<tracing::span::EnteredSpan>);

impl DebugSpan {
    /// Enters the span `make` builds, only if a subscriber wants debug
    /// spans: tracing's `log` feature (which any crate in a build can
    /// switch on) would otherwise format a disabled span for `log` on
    /// every call.
    #[inline]
    pub(crate) fn enter(make: impl FnOnce() -> tracing::Span) -> DebugSpan {
        DebugSpan(tracing::level_enabled!(tracing::Level::DEBUG).then(|| make().entered()))
    }
}

impl Drop for DebugSpan {
    /// An inlined check: the drop glue of the bare `Option` is a call on
    /// every RPC even when it holds nothing.
    #[inline]
    fn drop(&mut self) {
        if let Some(span) = self.0.take() {
            drop(span);
        }
    }
}
