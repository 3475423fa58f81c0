//! Per-conversation state: who is talking ([`key`]), where their state lives
//! ([`store`]) and how big their prompt really is ([`calibration`]).

pub mod calibration;
pub mod key;
pub mod store;

pub use key::{SessionKey, SessionKeyer, SessionSource};
pub use store::{Entry, SessionStore, StoreLimits};
