//! The upstream response decoder (`upstream::h1::read_response`) on
//! arbitrary bytes and read cuts (invariants: ../checks.rs `response`).
#![no_main]

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::response(data));
