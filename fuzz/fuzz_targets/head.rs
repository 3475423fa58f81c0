//! The server's fast-path request reader against httparse and the wire
//! rules read plainly, on arbitrary bytes (invariants: ../checks.rs
//! `request_head`).
#![no_main]

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::request_head(data));
