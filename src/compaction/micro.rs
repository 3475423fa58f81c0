//! Micro-compaction (reference §4): the alternative strategy that folds one
//! exchange per turn into a rolling summary.

/// Rolling state of micro-compaction for one conversation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MicroState {
    /// Index of the first message not yet absorbed.
    pub cursor: Option<usize>,
    /// The rolling summary text.
    pub rolling_summary: String,
    /// Consecutive failures at the current cursor.
    pub consecutive_failures: u32,
    /// Passes that absorbed something.
    pub passes: u32,
    /// Tokens saved over all passes (negative when the marker cost more).
    pub tokens_saved_total: i64,
}
