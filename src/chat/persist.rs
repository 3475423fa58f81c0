//! A conversation's calibration and trigger state (cooldown, strikes,
//! compaction count) outlive the process: written to the store when they
//! changed, in the background, and read back once when a conversation entry
//! is new (its key was not in memory).

use serde::{Deserialize, Serialize};

use crate::compaction::trigger::TriggerSnapshot;
use crate::session::calibration::CalibrationSnapshot;
use crate::session::key::SessionKey;

use super::conversation::Conversation;
use super::ChatState;

/// What is stored per conversation (JSON, under the session key).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Persisted {
    calibration: CalibrationSnapshot,
    /// `None` before the engine was first created (no model seen yet).
    trigger: Option<TriggerSnapshot>,
}

impl Persisted {
    /// What a write is worth making for: the trigger state, and the ratio
    /// to 1 %. The per-turn figures (last prompt size, observation count)
    /// change every turn and would make every turn a store write.
    fn worth_writing(&self) -> (Option<TriggerSnapshot>, Option<i64>) {
        let ratio = self.calibration.ratio.map(|r| (r * 100.0).round() as i64);
        (self.trigger.clone(), ratio)
    }
}

fn snapshot(conv: &Conversation) -> Persisted {
    Persisted {
        calibration: conv.calibration.snapshot(),
        trigger: conv
            .compressor
            .as_ref()
            .map(|c| c.trigger().snapshot())
            .or_else(|| conv.restored_trigger.clone()),
    }
}

/// Reads the stored state of a conversation seen for the first time by
/// this process: one store read per new entry, none after.
pub(super) async fn load(chat: &ChatState, conv: &mut Conversation, key: SessionKey) {
    if conv.state_loaded {
        return;
    }
    conv.state_loaded = true;
    if !chat.store.persistent() {
        return;
    }
    let Some(bytes) = chat.store.get_state(key.as_u128()).await else {
        return;
    };
    let Ok(p) = serde_json::from_slice::<Persisted>(&bytes) else {
        return;
    };
    conv.calibration.restore(&p.calibration);
    match (conv.compressor.as_mut(), p.trigger.clone()) {
        (Some(comp), Some(snap)) => comp.trigger_mut().restore(snap),
        (None, snap) => conv.restored_trigger = snap,
        (Some(_), None) => {}
    }
    conv.state_written = Some(p.worth_writing());
}

/// Writes the conversation's state when what matters of it differs from
/// what was last written (in the background; a failure is counted by the store).
pub(super) fn save(chat: &ChatState, conv: &mut Conversation, key: SessionKey) {
    if !chat.store.persistent() {
        return;
    }
    let snap = snapshot(conv);
    let worth = snap.worth_writing();
    if conv.state_written.as_ref() == Some(&worth) {
        return;
    }
    let Ok(bytes) = serde_json::to_vec(&snap) else {
        return;
    };
    conv.state_written = Some(worth);
    chat.store.put_state_in_background(key.as_u128(), bytes);
}
