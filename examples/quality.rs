//! Prints the compaction quality table (see tests/quality/harness.rs):
//! `cargo run --example quality` (add `--release` for speed).

#[path = "../tests/quality/harness.rs"]
mod harness;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut rows = Vec::new();
    let only: Option<u64> = std::env::var("QUALITY_WINDOW")
        .ok()
        .and_then(|w| w.parse().ok());
    for micro in [false, true] {
        for w in harness::WINDOWS
            .into_iter()
            .filter(|w| only.is_none_or(|o| o == *w))
        {
            let sc = harness::Scenario::standard(w, micro);
            let r = harness::run(sc).await;
            rows.push((sc, r));
        }
    }
    print!("{}", harness::table(&rows));
    for (sc, r) in &rows {
        if !r.lost.is_empty() {
            println!(
                "window {} {}: lost {}",
                sc.window,
                if sc.micro { "micro" } else { "batch" },
                r.lost.join(", ")
            );
        }
    }
}
