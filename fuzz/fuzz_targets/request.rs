//! `ChatRequest::parse`, the messages replacement and `force_include_usage`
//! on arbitrary bytes (invariants: ../checks.rs `request`).
#![no_main]

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::request(data));
