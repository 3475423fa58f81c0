//! A `redis-server` of the test's own on a free loopback port, without
//! persistence, killed on drop. `scripts/install_prereqs.sh` installs it;
//! a machine without it fails the test with that name (never a skip).

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    extra: Vec<String>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl RedisServer {
    /// Starts one on a free port.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts one with extra `redis-server` arguments (`--requirepass`, …).
    pub fn start_with(extra: &[&str]) -> Self {
        let mut s = Self {
            child: None,
            port: free_port(),
            extra: extra.iter().map(|a| (*a).to_owned()).collect(),
        };
        s.up();
        s
    }

    /// Starts one that speaks only TLS (its port is the TLS port).
    pub fn start_tls(cert: &str, key: &str) -> Self {
        let port = free_port();
        let p = port.to_string();
        let mut s = Self {
            child: None,
            port,
            extra: [
                "--port",
                "0",
                "--tls-port",
                &p,
                "--tls-cert-file",
                cert,
                "--tls-key-file",
                key,
                "--tls-auth-clients",
                "no",
            ]
            .iter()
            .map(|a| (*a).to_owned())
            .collect(),
        };
        s.up();
        s
    }

    /// The URL proxies are given.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Kills it (SIGKILL): its data is gone, as after a crash without persistence.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Freezes it (SIGSTOP): connections stay open and nothing answers, a
    /// slow store at its worst.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws it (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        let ok = Command::new("kill").args([sig, &pid]).status().unwrap();
        assert!(ok.success());
    }

    /// Starts it again on the same port (empty).
    pub fn up(&mut self) {
        let spawned = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match spawned {
            Ok(c) => c,
            Err(e) => panic!(
                "cannot run redis-server ({e}): the Redis store tests need it; \
                 install it with scripts/install_prereqs.sh"
            ),
        };
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if self.child.is_some() {
            // A frozen server would not die of SIGKILL's reaping wait otherwise.
            let _ = Command::new("kill")
                .args([
                    "-CONT",
                    &self.child.as_ref().map_or(0, Child::id).to_string(),
                ])
                .status();
        }
        self.kill();
    }
}
