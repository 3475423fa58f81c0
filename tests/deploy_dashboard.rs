//! The Grafana dashboard in `deploy/grafana/` names only series the binary
//! exports: each `compactor_*` name in it must be a family the running
//! proxy's `/_compactor/metrics` declares (a histogram's `_bucket`, `_sum`
//! and `_count` included), and it shows what an operator looks at first.

mod support;

use std::collections::BTreeSet;

use support::{get, start_proxy, MockUpstream};

/// Every string value in the dashboard, wherever it sits (expressions,
/// template queries, definitions).
fn strings(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::String(s) => out.push(s.clone()),
        serde_json::Value::Array(a) => a.iter().for_each(|x| strings(x, out)),
        serde_json::Value::Object(o) => o.values().for_each(|x| strings(x, out)),
        _ => {}
    }
}

/// The metric names a Prometheus text exposition declares: `# TYPE` lines,
/// with the series names a histogram family adds.
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("#") || words.next() != Some("TYPE") {
            continue;
        }
        let (Some(name), Some(kind)) = (words.next(), words.next()) else {
            continue;
        };
        names.insert(name.to_owned());
        if kind == "histogram" {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        }
    }
    names
}

#[tokio::test]
async fn the_grafana_dashboard_references_only_exported_metrics() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/compactor.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();

    let up = MockUpstream::builder().run().await;
    let proxy = start_proxy(&up.url(), "").await;
    let (status, _, body) = get(&format!("{}/_compactor/metrics", proxy.url())).await;
    assert_eq!(status, 200);
    let exported = exported(std::str::from_utf8(&body).unwrap());
    assert!(exported.len() > 30, "{exported:?}");

    let name = regex::Regex::new(r"compactor_[a-z_]+").unwrap();
    let mut texts = Vec::new();
    strings(&dashboard, &mut texts);
    let used: BTreeSet<String> = texts
        .iter()
        .flat_map(|t| name.find_iter(t).map(|m| m.as_str().to_owned()))
        .collect();
    let unknown: Vec<_> = used.difference(&exported).collect();
    assert!(
        unknown.is_empty(),
        "not exported by the binary: {unknown:?}"
    );

    // What an operator looks at first is on it.
    for needed in [
        "compactor_requests_total",
        "compactor_compactions_total",
        "compactor_tokens_saved_total",
        "compactor_summariser_seconds_bucket",
        "compactor_overflow_retries_total",
        "compactor_store_degraded_total",
    ] {
        assert!(used.contains(needed), "the dashboard lacks {needed}");
    }

    // Every panel queries the dashboard's Prometheus variable.
    let panels = dashboard["panels"].as_array().unwrap();
    let graphs: Vec<_> = panels.iter().filter(|p| p["type"] != "row").collect();
    assert!(graphs.len() >= 10);
    for p in graphs {
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        assert!(
            !p["targets"].as_array().unwrap().is_empty(),
            "{}",
            p["title"]
        );
    }
}
