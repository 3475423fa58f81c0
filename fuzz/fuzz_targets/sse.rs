//! The SSE scanner and the usage hider on an arbitrary stream cut into
//! frames (invariants: ../checks.rs `sse`). The first byte picks how many
//! cut points the next bytes give (two bytes each).
#![no_main]

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n % 8).min(rest.len() / 2);
    let (cuts, stream) = rest.split_at(n * 2);
    let cuts: Vec<usize> = cuts
        .chunks(2)
        .map(|c| usize::from(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    checks::sse(stream, &cuts);
});
