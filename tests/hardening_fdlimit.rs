//! Under a low open-file limit, more silent connections than the limit
//! allows never make the proxy unreachable: the connection cap is clamped
//! to what the limit leaves, so health still gets an answer (200, or the
//! cap's own 503) instead of an accept loop starved of descriptors.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_compactor");
/// Soft and hard limit the binary runs under.
const NOFILE: usize = 256;

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The whole response to a GET of `path`.
fn get(addr: &str, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

fn health(addr: &str) -> Option<String> {
    get(addr, "/_compactor/health")?
        .lines()
        .next()
        .map(str::to_owned)
}

#[test]
fn health_answers_with_more_idle_connections_than_the_file_limit() {
    let dir = tempfile::tempdir().unwrap();
    let child = Command::new("prlimit")
        .arg(format!("--nofile={NOFILE}:{NOFILE}"))
        .arg(BIN)
        .current_dir(dir.path())
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1")
        .env("COMPACTOR_LISTEN", "127.0.0.1:0")
        .env("COMPACTOR_UPSTREAM", "http://127.0.0.1:9")
        .env("COMPACTOR_STORE_BACKEND", "memory")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut proc = Proc(child);
    let mut lines = BufReader::new(proc.0.stdout.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("no `listening on` line").unwrap();
        if let Some(i) = line.find("listening on ") {
            break line[i + "listening on ".len()..]
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
                .collect::<String>();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    // The cap in force is exported: the default 4,096 clamped to the limit.
    let cap = compactor::server::fdlimit::clamp(4096, Some(NOFILE as u64));
    assert!(cap < 4096);
    let metrics = get(&addr, "/_compactor/metrics").expect("metrics answered");
    assert!(
        metrics.contains(&format!("\ncompactor_max_connections {cap}\n")),
        "{metrics}"
    );
    // Silent connections, more than the process could hold.
    let idle: Vec<TcpStream> = (0..NOFILE + 50)
        .filter_map(|_| TcpStream::connect(&addr).ok())
        .collect();
    assert!(idle.len() > NOFILE, "{} connected", idle.len());
    let status = health(&addr).expect("health answered");
    assert!(
        status.contains(" 200 ") || status.contains(" 503 "),
        "{status}"
    );
    drop(idle);
}
