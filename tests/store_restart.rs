//! Records outlive the process: the real binary on its state file is killed
//! with SIGKILL mid-conversation and started again on the same file; the
//! next turn goes upstream with the byte-identical replacement prefix and
//! no summary call.

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;
use support::chat::*;

const BIN: &str = env!("CARGO_BIN_EXE_compactor");
const ALICE: (&str, &str) = ("authorization", "Bearer alice");
const TOKEN: &str = "admin-secret";
const CONFIG: &str = "[admin]\ntoken = \"admin-secret\"\n[models.\"m\"]\ncontext_length = 2048\n";

/// The binary, killed on drop (by its own handle).
struct Proc {
    child: Child,
    url: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the binary on `upstream` with its records in `store`.
fn start(dir: &Path, upstream: &str, store: &Path) -> Proc {
    let cfg = dir.join("proxy.toml");
    std::fs::write(&cfg, CONFIG).unwrap();
    let child = Command::new(BIN)
        .current_dir(dir)
        .arg("--config")
        .arg(&cfg)
        .env_remove("RUST_LOG")
        .env_remove("COMPACTOR_STORE_BACKEND")
        .env("NO_COLOR", "1")
        .env("COMPACTOR_LISTEN", "127.0.0.1:0")
        .env("COMPACTOR_UPSTREAM", upstream)
        .env("COMPACTOR_STORE_PATH", store)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Owned from here on: killed and reaped on every path, panics included.
    let mut proc = Proc {
        child,
        url: String::new(),
    };
    let stdout = proc.child.stdout.take().unwrap();
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    loop {
        let line = lines
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("no `listening on` line in {seen:?}"));
        assert!(
            !line.contains("store cannot be opened"),
            "the store must open: {line}"
        );
        if let Some(i) = line.find("listening on ") {
            let addr: String = line[i + "listening on ".len()..]
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
                .collect();
            // Keep draining stdout so the child never blocks on a full pipe.
            std::thread::spawn(move || {
                while let Ok(l) = lines.recv() {
                    eprintln!("PROXY {l}");
                }
            });
            proc.url = format!("http://{addr}");
            return proc;
        }
        seen.push(line);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_and_restart_on_the_same_store_resends_the_prefix_without_a_summary() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("state/state.log");
    let mock = ChatMock::start(Settings::default()).await;
    let headers = [ALICE, ("x-session-id", "a")];

    let proxy = start(dir.path(), &mock.url(), &store);
    let mut conv = Conversation::new(600);
    let mut compacted = None;
    for _ in 0..20 {
        let sent = conv.ask();
        let (st, h, _) = post_chat(&proxy.url, chat_body("m", &sent, false), &headers).await;
        assert_eq!(st, 200);
        if action(&h) == "compacted" {
            compacted = Some(sent);
            break;
        }
        conv.answer();
    }
    let sent = compacted.expect("no compaction");
    let first = mock.last_chat();
    let calls = mock.summaries().len();
    assert!(calls > 0);
    // The write-through runs beside the upstream call; give it a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut proxy = proxy;
    proxy.child.kill().unwrap(); // SIGKILL: no shutdown path runs
    proxy.child.wait().unwrap();
    drop(proxy);

    let proxy = start(dir.path(), &mock.url(), &store);
    // The same turn again: byte-identical body upstream, no summary.
    let (st, h, _) = post_chat(&proxy.url, chat_body("m", &sent, false), &headers).await;
    assert_eq!(st, 200);
    assert!(substituted(&h), "{}", action(&h));
    assert_eq!(mock.summaries().len(), calls);
    assert_eq!(mock.last_chat().body, first.body);

    // The next turn of the conversation: the prefix sent before the kill
    // is still what goes upstream first.
    conv.answer();
    let next = conv.ask();
    let (st, h, _) = post_chat(&proxy.url, chat_body("m", &next, false), &headers).await;
    assert_eq!(st, 200);
    assert!(substituted(&h), "{}", action(&h));
    assert_eq!(
        mock.summaries().len(),
        calls,
        "no summary after the restart"
    );
    let before: Vec<Value> = first.messages();
    let after: Vec<Value> = mock.last_chat().messages();
    assert_eq!(after[..before.len()], before[..], "replacement prefix kept");

    let body = std::fs::metadata(&store).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(body.permissions().mode() & 0o777, 0o600);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_and_restart_keeps_the_cooldown_and_the_calibration() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("state.log");
    let mock = ChatMock::start(Settings {
        summary: SummaryMode::Status(500),
        bytes_per_token: 2.0,
        ..Settings::default()
    })
    .await;
    let headers = [ALICE, ("x-session-id", "cool")];
    let mut proxy = start(dir.path(), &mock.url(), &store);
    let mut conv = Conversation::new(600);
    let mut key = String::new();
    for _ in 0..25 {
        let before = mock.summaries().len();
        let sent = conv.ask();
        let (st, h, _) = post_chat(&proxy.url, chat_body("m", &sent, false), &headers).await;
        assert_eq!(st, 200);
        conv.answer();
        key = session_of(&h);
        if mock.summaries().len() > before {
            break;
        }
    }
    let (_, view) = admin_view(&proxy.url, TOKEN, &key).await;
    assert!(
        view["trigger"]["cooldown_remaining_secs"]
            .as_u64()
            .is_some_and(|s| s > 0),
        "the failed summary started a cooldown: {view}"
    );
    let reports = view["usage_reports"].as_u64().unwrap();
    assert!(reports >= 2, "{view}");
    // The state is written after the turn, in the background.
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.child.kill().unwrap();
    proxy.child.wait().unwrap();
    drop(proxy);

    let proxy = start(dir.path(), &mock.url(), &store);
    let calls = mock.summaries().len();
    let sent = conv.ask();
    let (st, h, _) = post_chat(&proxy.url, chat_body("m", &sent, false), &headers).await;
    assert_eq!(st, 200);
    assert_eq!(session_of(&h), key);
    assert_eq!(
        mock.summaries().len(),
        calls,
        "still in cooldown: no summary call"
    );
    let (_, view) = admin_view(&proxy.url, TOKEN, &key).await;
    assert!(
        view["trigger"]["cooldown_remaining_secs"]
            .as_u64()
            .is_some_and(|s| s > 0),
        "{view}"
    );
    // One report is the restarted process's own; the rest were restored.
    assert!(view["usage_reports"].as_u64().unwrap() >= 2, "{view}");
    let ratio = view["calibration_ratio"].as_f64().unwrap();
    assert!((1.8..2.2).contains(&ratio), "{view}");
}
