use compactor::usage::{BodyKind, UsageExtractor};
const JSON: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":1764460800,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"Hello from the mock upstream. This reply is a fixed size."},"finish_reason":"stop"}],"usage":{"prompt_tokens":42,"completion_tokens":12,"total_tokens":54}}"#;
fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10000);
    let mut total = 0u64;
    for _ in 0..n {
        let mut x = UsageExtractor::new(BodyKind::Json);
        x.feed(std::hint::black_box(JSON.as_bytes()));
        x.finish();
        total += x
            .report()
            .usage
            .map(|u| u.prompt_tokens.unwrap_or(0))
            .unwrap_or(0);
    }
    println!("{total}");
}
