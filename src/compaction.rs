//! The compaction engine: the crate `compactor_engine`
//! (`crates/compactor-engine`), under the name the rest of this crate and
//! its users (`compactor::compaction::…`) reach it by. The compiler now
//! guards its boundary: it sees nothing of this crate.
//!
//! The submodules only keep the engine's old module paths
//! (`compaction::config::CompactionConfig`) working for this crate's
//! importers; they re-export the engine's public items and hold nothing
//! else. New code may name the items directly (`compaction::Trigger`).

pub use compactor_engine::*;

pub(crate) mod budget {
    pub use compactor_engine::DEFAULT_CONTEXT_LENGTH;
}

pub(crate) mod compressor {
    pub use compactor_engine::Carry;

    pub(crate) mod micro {
        pub use compactor_engine::MicroState;
    }
}

pub(crate) mod config {
    pub use compactor_engine::{CompactionConfig, Strategy};
}

pub(crate) mod last_resort {
    pub use compactor_engine::{fit_budget, Fit, FitInputs};
}

pub(crate) mod markers {
    pub use compactor_engine::{declare_summary, undeclare_summary};
    // What the chat path's tests check a history with.
    #[cfg(test)]
    pub use compactor_engine::is_declared_summary;
}

pub(crate) mod tokens {
    pub use compactor_engine::{
        estimate_msg_budget_tokens, estimate_text_tokens, estimate_tools_tokens,
    };
}

pub(crate) mod trigger {
    pub use compactor_engine::{Trigger, TriggerSnapshot, Usage, WindowSource};
}
