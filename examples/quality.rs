//! Prints the compaction quality table (see tests/quality/harness.rs):
//! `cargo run --example quality` (add `--release` for speed).

#[path = "../tests/quality/harness.rs"]
mod harness;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut rows = Vec::new();
    for micro in [false, true] {
        for w in harness::WINDOWS {
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
