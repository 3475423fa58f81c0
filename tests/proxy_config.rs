//! The real binary: config errors exit 64 with one line naming the key; it
//! starts on an ephemeral port, logs `listening on <addr>`, honours env
//! overrides, and shuts down cleanly on SIGTERM.

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use bytes::Bytes;
use support::*;

const BIN: &str = env!("CARGO_BIN_EXE_compactor");

/// A child process killed on drop (by its own handle, never by name).
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn command(dir: &std::path::Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.current_dir(dir)
        .env_remove("RUST_LOG")
        .env_remove("COMPACTOR_LISTEN")
        .env_remove("COMPACTOR_UPSTREAM")
        .env_remove("COMPACTOR_STORE_BACKEND")
        // Each run its own store file, never the user's state directory.
        .env("COMPACTOR_STORE_PATH", dir.join("state.log"))
        .env("NO_COLOR", "1");
    cmd
}

fn spawn(mut cmd: Command) -> Proc {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Proc { child, lines }
}

/// Waits for the `listening on <addr>` log line and returns the address.
fn listening_addr(p: &Proc) -> (std::net::SocketAddr, String) {
    loop {
        let line = p
            .lines
            .recv_timeout(Duration::from_secs(20))
            .expect("no `listening on` line");
        if let Some(i) = line.find("listening on ") {
            let rest = &line[i + "listening on ".len()..];
            let addr: String = rest
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
                .collect();
            return (addr.parse().unwrap(), line);
        }
    }
}

fn run_to_end(mut cmd: Command) -> (i32, String) {
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn unknown_key_exits_64_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.toml");
    std::fs::write(
        &cfg,
        "listen = \"127.0.0.1:0\"\n[timeouts]\nfirst_byte = 5\n",
    )
    .unwrap();
    let mut cmd = command(dir.path());
    cmd.arg("--config").arg(&cfg);
    let (code, stderr) = run_to_end(cmd);
    assert_eq!(code, 64, "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(stderr.contains("timeouts.first_byte"), "{stderr}");
    assert!(stderr.contains("bad.toml"), "{stderr}");
}

#[test]
fn invalid_value_and_bad_env_exit_64() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, "upstream = \"ftp://nope\"\n").unwrap();
    let mut cmd = command(dir.path());
    cmd.arg("--config").arg(&cfg);
    let (code, stderr) = run_to_end(cmd);
    assert_eq!(code, 64);
    assert!(stderr.contains("`upstream`"), "{stderr}");

    let mut cmd = command(dir.path());
    cmd.env("COMPACTOR_LISTEN", "not-an-address");
    let (code, stderr) = run_to_end(cmd);
    assert_eq!(code, 64);
    assert!(stderr.contains("`listen`"), "{stderr}");

    let mut cmd = command(dir.path());
    cmd.arg("--config").arg(dir.path().join("missing.toml"));
    let (code, stderr) = run_to_end(cmd);
    assert_eq!(code, 64);
    assert!(stderr.contains("missing.toml"), "{stderr}");
}

#[test]
fn default_proxy_toml_in_working_directory_is_used() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("proxy.toml"), "bogus_key = 1\n").unwrap();
    let (code, stderr) = run_to_end(command(dir.path()));
    assert_eq!(code, 64);
    assert!(
        stderr.contains("bogus_key") && stderr.contains("proxy.toml"),
        "{stderr}"
    );

    std::fs::write(dir.path().join("proxy.toml"), "listen = \"127.0.0.1:0\"\n").unwrap();
    let mut cmd = command(dir.path());
    cmd.arg("--validate-and-exit");
    let (code, stderr) = run_to_end(cmd);
    assert_eq!(code, 0, "{stderr}");
}

/// The next line of `p`'s output that contains `what`.
fn line_of(p: &Proc, what: &str) -> String {
    loop {
        let l = p.lines.recv_timeout(Duration::from_secs(10)).unwrap();
        if l.contains(what) {
            return l;
        }
    }
}

#[tokio::test]
async fn binary_serves_with_env_override_and_stops_on_sigterm() {
    let up = MockUpstream::builder()
        .route(
            "/v1/models",
            Reply::Full {
                status: 200,
                headers: vec![],
                body: Bytes::from_static(b"models"),
            },
        )
        .route(
            "/v1/chat/completions",
            Reply::Full {
                status: 200,
                headers: vec![("content-type", "application/json".into())],
                body: Bytes::from_static(br#"{"choices":[],"usage":{"prompt_tokens":3}}"#),
            },
        )
        .run()
        .await;
    let dir = tempfile::tempdir().unwrap();
    // File says one upstream; the environment wins.
    std::fs::write(
        dir.path().join("proxy.toml"),
        "listen = \"127.0.0.1:1\"\nupstream = \"http://127.0.0.1:9\"\n",
    )
    .unwrap();
    let mut cmd = command(dir.path());
    cmd.env("COMPACTOR_LISTEN", "127.0.0.1:0")
        .env("COMPACTOR_UPSTREAM", up.url());
    let mut p = spawn(cmd);
    let (addr, _) = listening_addr(&p);

    let (status, _, body) = get(&format!("http://{addr}/_compactor/health")).await;
    assert_eq!(status, 200);
    assert_eq!(body, r#"{"status":"ok"}"#);
    let (status, _, body) = get(&format!("http://{addr}/v1/models")).await;
    assert_eq!(status, 200);
    assert_eq!(body, "models");

    // One content-free line per request.
    let line = line_of(&p, "path=/v1/models");
    for field in [
        "method=GET",
        "status=200",
        "bytes_out=6",
        "upstream_ms=",
        "total_ms=",
    ] {
        assert!(line.contains(field), "{field} missing: {line}");
    }
    // A chat request's line counts its wait for the upstream too (the chat
    // walk hands the request's accounting to the upstream's attempt).
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let (status, _, _) = fetch(request(
        "POST",
        &format!("http://{addr}/v1/chat/completions"),
        full(chat),
    ))
    .await;
    assert_eq!(status, 200);
    let line = line_of(&p, "path=/v1/chat/completions");
    for field in ["method=POST", "route=\"chat\"", "upstream_ms=", "total_ms="] {
        assert!(line.contains(field), "{field} missing: {line}");
    }

    let pid = p.child.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = p.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "did not exit on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0));
}

#[test]
fn json_log_format() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = command(dir.path());
    cmd.env("COMPACTOR_LISTEN", "127.0.0.1:0")
        .env("COMPACTOR_LOG_FORMAT", "json");
    let p = spawn(cmd);
    let (_, line) = listening_addr(&p);
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert!(v["fields"]["message"]
        .as_str()
        .unwrap()
        .starts_with("listening on 127.0.0.1:"));
    // RFC 3339 UTC with microseconds: 2026-11-30T12:51:24.732882Z.
    let ts = v["timestamp"].as_str().unwrap();
    let shape: String = ts
        .chars()
        .map(|c| if c.is_ascii_digit() { 'd' } else { c })
        .collect();
    assert_eq!(shape, "dddd-dd-ddTdd:dd:dd.ddddddZ", "{ts}");
}

/// `--listen` and `--upstream` win over `COMPACTOR_*` and the file: the
/// binary serves on the flag's address and forwards to the flag's upstream.
#[tokio::test]
async fn flags_win_over_env_and_file() {
    let up = MockUpstream::builder()
        .route(
            "/v1/models",
            Reply::Full {
                status: 200,
                headers: vec![],
                body: Bytes::from_static(b"from the flag's upstream"),
            },
        )
        .run()
        .await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("proxy.toml"),
        "listen = \"127.0.0.1:1\"\nupstream = \"http://127.0.0.1:9\"\n",
    )
    .unwrap();
    let mut cmd = command(dir.path());
    // The environment says something else (and an address that cannot be
    // bound): the flags win.
    cmd.env("COMPACTOR_LISTEN", "127.0.0.1:1")
        .env("COMPACTOR_UPSTREAM", "http://127.0.0.1:9")
        .args(["--listen", "127.0.0.1:0", "--upstream", &up.url()]);
    let p = spawn(cmd);
    let (addr, line) = listening_addr(&p);
    assert_ne!(addr.port(), 1, "{line}");
    let (status, _, body) = get(&format!("http://{addr}/v1/models")).await;
    assert_eq!(status, 200);
    assert_eq!(body, "from the flag's upstream");
}

/// A bad flag value exits 64 naming its key; `--help` names the config
/// file, the env prefix and the inspector; `--version` the crate's version.
#[test]
fn flag_errors_help_and_version() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = command(dir.path());
    cmd.args(["--listen", "not-an-address"]);
    let (code, stderr) = run_to_end(cmd);
    assert_eq!(code, 64, "{stderr}");
    assert!(stderr.contains("`listen`"), "{stderr}");

    let out = command(dir.path()).arg("--help").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--upstream <URL>",
        "--listen <ADDR>",
        "--config <FILE>",
        "proxy.toml",
        "COMPACTOR_",
        "/_compactor/ui",
    ] {
        assert!(help.contains(needle), "{needle} missing:\n{help}");
    }

    let out = command(dir.path()).arg("--version").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let version = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        version.trim(),
        format!("compactor {}", env!("CARGO_PKG_VERSION"))
    );
}
