//! Per-conversation state: who is talking ([`key`]), where their state lives
//! ([`store`]) and how big their prompt really is ([`calibration`]).
//!
//! Per chat request the chat path does:
//! 1. parse the body ([`crate::request::ChatRequest`]) and derive the key
//!    with [`SessionKeyer::derive`];
//! 2. `store.get_or_create(key, ..)` and lock the entry (never across the
//!    streamed response);
//! 3. compute the chain of what will be sent
//!    ([`crate::request::message_hashes`]) and
//!    [`calibration::Calibration::estimate`] it;
//! 4. after the response ends, take the tap's real `prompt_tokens` and call
//!    [`calibration::Calibration::observe`] with the estimate's `sent`.

pub mod calibration;
pub mod key;
pub mod store;

pub use key::{SessionKey, SessionKeyer, SessionSource};
pub use store::{SessionStore, StoreLimits};
