//! Record store inserts and lookups against a brute-force model
//! (invariants: ../checks.rs `records`).
#![no_main]

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::records(data));
