//! What the fault upstream sends for a request, derived from the request's
//! `x-fault-id` alone, so the load client can rebuild it byte for byte
//! (shared by examples/fault_upstream.rs and examples/fault_client.rs).

#![allow(dead_code)]

use std::time::Duration;

use bytes::Bytes;

/// A small deterministic PRNG (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// How the upstream misbehaves on one stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Frames back to back.
    None,
    /// Every frame cut into pieces of 1–7 bytes, a short pause between.
    Drip,
    /// One long pause in the middle of the stream.
    Stall(Duration),
    /// The connection is aborted after this many frames (the upstream
    /// truncates: the client must see a prefix and an error, never more).
    Reset(usize),
}

/// One stream: its frames and the fault.
pub struct Plan {
    pub frames: Vec<Bytes>,
    pub fault: Fault,
}

impl Plan {
    /// The bytes the upstream sends in full (before any reset).
    pub fn full(&self) -> Vec<u8> {
        self.frames.iter().flat_map(|f| f.iter().copied()).collect()
    }

    /// The bytes the upstream sends before it resets, or all of them.
    pub fn sent(&self) -> Vec<u8> {
        let n = match self.fault {
            Fault::Reset(n) => n.min(self.frames.len()),
            _ => self.frames.len(),
        };
        self.frames[..n]
            .iter()
            .flat_map(|f| f.iter().copied())
            .collect()
    }
}

/// The stream for request `id`; `usage`: the request asked for usage
/// (compactor always asks upstream for streaming requests).
pub fn plan(id: u64, usage: bool) -> Plan {
    let mut rng = Rng::new(id);
    let n = 5 + rng.below(40) as usize;
    let mut frames = Vec::with_capacity(n + 3);
    frames.push(Bytes::from(format!(
        "data: {{\"id\":\"chatcmpl-{id}\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"finish_reason\":null}}]{}}}\n\n",
        if usage { ",\"usage\":null" } else { "" }
    )));
    for i in 0..n {
        let words = 1 + rng.below(12);
        let text: String = (0..words)
            .map(|w| format!("w{}_{} ", i, rng.below(1000) + w))
            .collect();
        frames.push(Bytes::from(format!(
            "data: {{\"id\":\"chatcmpl-{id}\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}},\"finish_reason\":null}}]{}}}\n\n",
            if usage { ",\"usage\":null" } else { "" }
        )));
        if rng.below(10) == 0 {
            frames.push(Bytes::from_static(b": keep-alive\n\n"));
        }
    }
    frames.push(Bytes::from(format!(
        "data: {{\"id\":\"chatcmpl-{id}\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"stop\"}}]{}}}\n\n",
        if usage { ",\"usage\":null" } else { "" }
    )));
    if usage {
        frames.push(Bytes::from(format!(
            "data: {{\"id\":\"chatcmpl-{id}\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{},\"completion_tokens\":{n},\"total_tokens\":{}}}}}\n\n",
            10 + id % 100,
            10 + id % 100 + n as u64
        )));
    }
    frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
    let fault = match rng.below(10) {
        0 => Fault::Drip,
        1 => Fault::Stall(Duration::from_millis(500 + rng.below(1500))),
        2 => Fault::Reset(1 + rng.below(frames.len() as u64 - 1) as usize),
        _ => Fault::None,
    };
    Plan { frames, fault }
}

/// How the load client reads one response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reader {
    /// As fast as it can.
    Fast,
    /// Sleeps between frames (backpressure through compactor).
    Slow(Duration),
    /// Hangs up after this many body frames.
    HangUp(usize),
}

/// The client-side behaviour for request `id` (independent of the plan).
pub fn reader(id: u64) -> Reader {
    let mut rng = Rng::new(id ^ 0x5EED_CAFE);
    match rng.below(20) {
        0 | 1 => Reader::Slow(Duration::from_millis(2 + rng.below(8))),
        2 => Reader::HangUp(1 + rng.below(4) as usize),
        _ => Reader::Fast,
    }
}

/// Whether request `id` asks for usage itself (else compactor hides it).
pub fn client_wants_usage(id: u64) -> bool {
    id.is_multiple_of(3)
}
