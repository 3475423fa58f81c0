//! The chat-completions brain: what happens to `POST /v1/chat/completions`
//! between the client and the upstream (design §1, §2, §8).

pub mod record;
