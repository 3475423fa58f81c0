//! proxy.toml and COMPACTOR_*: defaults, every section, overrides, the errors
//! that name the key.

use super::*;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::from_toml_str(text, &MapEnv::default())
}

#[test]
fn defaults_when_empty() {
    let c = parse("").unwrap();
    assert_eq!(c.listen, "127.0.0.1:4000".parse::<SocketAddr>().unwrap());
    assert_eq!(c.upstream.authority.as_str(), "127.0.0.1:8080");
    assert_eq!(c.upstream.path_prefix, "");
    assert!(!c.upstream.is_https());
    assert_eq!(c.max_body_bytes, 32 * 1024 * 1024);
    assert_eq!(c.timeouts.connect, Duration::from_secs(10));
    assert_eq!(c.timeouts.first_byte, Duration::from_secs(600));
    assert_eq!(c.timeouts.idle, Duration::from_secs(300));
    assert_eq!(c.timeouts.shutdown_grace, Duration::from_secs(30));
    assert_eq!(c.session.headers[0], "x-session-id");
    assert_eq!(c.session.headers.len(), DEFAULT_SESSION_HEADERS.len());
    assert_eq!(c.session.ttl, Duration::from_secs(3600));
    assert_eq!(c.session.max_sessions, 10_000);
    assert!(c.expose_headers);
    assert!(!c.underscores_in_headers);
    assert_eq!(c.log_format, LogFormat::Text);
    assert!(c.admin_token.is_none());
    assert_eq!(
        c.compaction.threshold_percent,
        crate::compaction::config::CompactionConfig::default().threshold_percent
    );
    // Config::default() is the same thing.
    assert_eq!(Config::default().listen, c.listen);
}

#[test]
fn full_file_parses() {
    let c = parse(
        r#"
listen = "0.0.0.0:9000"
upstream = "https://openrouter.ai/api/"
max_body_bytes = 1024
default_context_length = 8192
[timeouts]
connect_secs = 1
first_byte_secs = 2
idle_secs = 3
shutdown_grace_secs = 0
[session]
headers = ["X-My-Session"]
ttl_secs = 5
max_sessions = 6
[compaction]
threshold_percent = 75
strategy = "micro"
[models."gpt-4o"]
context_length = 128000
[admin]
token = "s3cret"
[headers]
expose = false
[server]
underscores_in_headers = true
[log]
format = "json"
"#,
    )
    .unwrap();
    assert_eq!(c.listen.port(), 9000);
    assert!(c.upstream.is_https());
    assert_eq!(c.upstream.authority.as_str(), "openrouter.ai");
    assert_eq!(c.upstream.path_prefix, "/api");
    assert_eq!(c.max_body_bytes, 1024);
    assert_eq!(c.timeouts.idle, Duration::from_secs(3));
    assert_eq!(c.timeouts.shutdown_grace, Duration::ZERO);
    assert_eq!(c.session.headers, vec!["x-my-session".to_owned()]);
    assert!((c.compaction.effective_threshold_percent() - 0.75).abs() < 1e-9);
    assert_eq!(
        c.compaction.strategy,
        crate::compaction::config::Strategy::Micro
    );
    assert_eq!(c.models["gpt-4o"].context_length, 128_000);
    assert_eq!(c.default_context_length, Some(8192));
    assert_eq!(c.admin_token.as_deref(), Some("s3cret"));
    assert!(!c.expose_headers);
    assert!(c.underscores_in_headers);
    assert_eq!(c.log_format, LogFormat::Json);
}

#[test]
fn env_overrides_file() {
    let env = MapEnv::from_pairs([
        ("COMPACTOR_LISTEN", "127.0.0.1:0"),
        ("COMPACTOR_UPSTREAM", "http://llama:8080/prefix"),
        ("COMPACTOR_IDLE_SECS", "7"),
        ("COMPACTOR_LOG_FORMAT", "json"),
        ("COMPACTOR_UNDERSCORES_IN_HEADERS", "on"),
    ]);
    let c = Config::from_toml_str(
        "listen = \"127.0.0.1:1\"\nupstream = \"http://a:1\"\n",
        &env,
    )
    .unwrap();
    assert_eq!(c.listen.port(), 0);
    assert_eq!(c.upstream.authority.as_str(), "llama:8080");
    assert_eq!(c.upstream.path_prefix, "/prefix");
    assert_eq!(c.timeouts.idle, Duration::from_secs(7));
    assert_eq!(c.log_format, LogFormat::Json);
    assert!(c.underscores_in_headers);
    let env = MapEnv::from_pairs([("COMPACTOR_UNDERSCORES_IN_HEADERS", "maybe")]);
    let e = Config::from_toml_str("[server]\nunderscores_in_headers = true\n", &env).unwrap_err();
    assert_eq!(e.keys(), vec!["COMPACTOR_UNDERSCORES_IN_HEADERS"]);
    let env = MapEnv::from_pairs([("COMPACTOR_UNDERSCORES_IN_HEADERS", "0")]);
    let c = Config::from_toml_str("[server]\nunderscores_in_headers = true\n", &env).unwrap();
    assert!(!c.underscores_in_headers);
}

/// `--listen` / `--upstream` win over `COMPACTOR_*`, which wins over the
/// file; a flag left out leaves the others in force.
#[test]
fn flags_win_over_env_which_wins_over_file() {
    let file = "listen = \"127.0.0.1:1\"\nupstream = \"http://file:1\"\n";
    let env = MapEnv::from_pairs([
        ("COMPACTOR_LISTEN", "127.0.0.1:2"),
        ("COMPACTOR_UPSTREAM", "http://env:2"),
    ]);
    let flags = Overrides {
        listen: Some("127.0.0.1:3".to_owned()),
        upstream: Some("https://flag:3/api/".to_owned()),
    };
    let c = Config::parse(file, &env, &flags, "").unwrap();
    assert_eq!(c.listen.port(), 3);
    assert_eq!(c.upstream.authority.as_str(), "flag:3");
    assert_eq!(c.upstream.path_prefix, "/api");
    assert!(c.upstream.is_https());

    // Only --upstream: the env's listen stays.
    let flags = Overrides {
        upstream: Some("http://flag:4".to_owned()),
        ..Overrides::default()
    };
    let c = Config::parse(file, &env, &flags, "").unwrap();
    assert_eq!(c.listen.port(), 2);
    assert_eq!(c.upstream.authority.as_str(), "flag:4");

    // No env either: the file's listen.
    let c = Config::parse(file, &MapEnv::default(), &flags, "").unwrap();
    assert_eq!(c.listen.port(), 1);

    // No flags: what the environment says, as before.
    let c = Config::parse(file, &env, &Overrides::default(), "").unwrap();
    assert_eq!(c.listen.port(), 2);
    assert_eq!(c.upstream.authority.as_str(), "env:2");
}

/// A bad flag value is named by its key, like the file's and the env's.
#[test]
fn bad_flag_values_are_named_by_their_keys() {
    let flags = Overrides {
        listen: Some("not-an-address".to_owned()),
        upstream: Some("ftp://nope".to_owned()),
    };
    let e = Config::parse("", &MapEnv::default(), &flags, "").unwrap_err();
    let mut keys = e.keys();
    keys.sort_unstable();
    assert_eq!(keys, vec!["listen", "upstream"]);
}

#[test]
fn store_section_env_and_bounds() {
    use crate::store::StoreBackend;
    // Unset: memory here (the binary switches to the file), with the
    // session's TTL and byte bound.
    let c = parse("[session]\nttl_secs = 90\nmax_record_bytes = 4096\n").unwrap();
    assert_eq!(c.store.backend, StoreBackend::Memory);
    assert!(!c.store.explicit);
    assert_eq!(c.store.ttl, Duration::from_secs(90));
    assert_eq!(c.store.max_bytes, 4096);
    let c = parse("[store]\npath = \"/tmp/s.log\"\ntimeout_ms = 5\n").unwrap();
    assert_eq!(c.store.backend, StoreBackend::File("/tmp/s.log".into()));
    assert_eq!(c.store.timeout, Duration::from_millis(5));
    let env = MapEnv::from_pairs([("COMPACTOR_STORE_BACKEND", "memory")]);
    let c = Config::from_toml_str("[store]\nbackend = \"file\"\n", &env).unwrap();
    assert_eq!(c.store.backend, StoreBackend::Memory);
    assert!(c.store.explicit);
    let e = parse("[store]\nbackend = \"etcd\"\n").unwrap_err();
    assert_eq!(e.keys(), vec!["store.backend"]);
    let env = MapEnv::from_pairs([("COMPACTOR_STORE_URL", "redis://:pw@cache:6380/1")]);
    let c = Config::from_toml_str("", &env).unwrap();
    assert_eq!(
        c.store.backend,
        StoreBackend::Redis("redis://:pw@cache:6380/1".into())
    );
    let e = parse("[store]\nurl = \"cache:6379\"\n").unwrap_err();
    assert_eq!(e.keys(), vec!["store.url"]);
    assert!(!format!("{e}").contains("pw"));
    // The image sets COMPACTOR_STORE_PATH; a deployment that adds a URL
    // (docker-compose.scale.yml) shares the Redis store, not the file.
    let env = MapEnv::from_pairs([
        ("COMPACTOR_STORE_PATH", "/var/lib/compactor/state.log"),
        ("COMPACTOR_STORE_URL", "redis://valkey:6379/0"),
    ]);
    let c = Config::from_toml_str("", &env).unwrap();
    assert_eq!(
        c.store.backend,
        StoreBackend::Redis("redis://valkey:6379/0".into())
    );
}

#[test]
fn bad_env_value_names_variable() {
    let env = MapEnv::from_pairs([("COMPACTOR_IDLE_SECS", "soon")]);
    let e = Config::from_toml_str("", &env).unwrap_err();
    assert_eq!(e.keys(), vec!["COMPACTOR_IDLE_SECS"]);
    assert!(e.to_string().contains("COMPACTOR_IDLE_SECS"));
}

#[test]
fn unknown_top_level_key_is_named() {
    let e = parse("listen = \"127.0.0.1:1\"\nlisten_port = 3\n").unwrap_err();
    assert_eq!(e.keys(), vec!["listen_port"]);
    let s = e.to_string();
    assert!(s.contains("`listen_port`"), "{s}");
    assert!(s.contains("line 2"), "{s}");
    assert!(!s.contains('\n'), "one line: {s}");
}

#[test]
fn unknown_nested_key_is_named_with_its_table() {
    let e = parse("[timeouts]\nconnect_secs = 1\nconect = 2\n").unwrap_err();
    assert_eq!(e.keys(), vec!["timeouts.conect"]);
    let e = parse("[models.\"m\"]\ncontext_len = 2\n").unwrap_err();
    assert_eq!(e.keys(), vec!["models.\"m\".context_len"]);
}

#[test]
fn wrong_type_is_named() {
    let e = parse("[timeouts]\nidle_secs = \"ten\"\n").unwrap_err();
    assert_eq!(e.keys(), vec!["timeouts.idle_secs"]);
    let e = parse("[log]\nformat = \"xml\"\n").unwrap_err();
    assert_eq!(e.keys(), vec!["log.format"]);
}

#[test]
fn invalid_values_all_reported() {
    let e = parse(
            "listen = \"localhost\"\nupstream = \"ftp://x\"\nmax_body_bytes = 0\n[timeouts]\nidle_secs = 0\n",
        )
        .unwrap_err();
    assert_eq!(
        e.keys(),
        vec!["listen", "upstream", "max_body_bytes", "timeouts.idle_secs"]
    );
    assert!(!e.to_string().contains('\n'));
}

#[test]
fn upstream_parsing() {
    assert!(UpstreamBase::parse("http://h:1/?q=1").is_err());
    assert!(UpstreamBase::parse("h:1").is_err());
    assert!(UpstreamBase::parse("http://user:pw@h/").is_err());
    let u = UpstreamBase::parse("http://h:1///").unwrap();
    assert_eq!(u.path_prefix, "");
    let u = UpstreamBase::parse("https://h/a/b/").unwrap();
    assert_eq!(u.path_prefix, "/a/b");
}

/// The shipped proxy.toml parses, and every documented (commented) key
/// is a real key with a value of the right type and the stated default.
#[test]
fn shipped_proxy_toml_documents_real_keys() {
    let text = include_str!("../../proxy.toml");
    let c = parse(text).unwrap();
    assert_eq!(c.listen, Config::default().listen);
    let re = regex::Regex::new(r"^# ([a-z_]+ = .+|\[models\..+\]|context_length = .+)$").unwrap();
    let uncommented: String = text
        .lines()
        .map(|l| match re.captures(l) {
            Some(c) => c[1].to_owned(),
            None => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    let raw: RawConfig = toml::from_str(&uncommented).unwrap();
    let d = RawConfig::default();
    assert_eq!(raw.listen, d.listen);
    assert_eq!(raw.upstream, d.upstream);
    assert_eq!(raw.max_body_bytes, d.max_body_bytes);
    assert_eq!(raw.timeouts.connect_secs, d.timeouts.connect_secs);
    assert_eq!(raw.timeouts.first_byte_secs, d.timeouts.first_byte_secs);
    assert_eq!(raw.timeouts.idle_secs, d.timeouts.idle_secs);
    assert_eq!(
        raw.timeouts.shutdown_grace_secs,
        d.timeouts.shutdown_grace_secs
    );
    assert_eq!(raw.session.headers, d.session.headers);
    assert_eq!(raw.session.ttl_secs, d.session.ttl_secs);
    assert_eq!(raw.session.max_sessions, d.session.max_sessions);
    assert_eq!(raw.headers.expose, d.headers.expose);
    assert_eq!(
        raw.server.underscores_in_headers,
        d.server.underscores_in_headers
    );
    assert_eq!(raw.log.format, d.log.format);
    assert!(raw.admin.token.is_some());
    assert!(raw.upstream_ca_file.is_some());
    assert!(raw.default_context_length.is_some());
    assert_eq!(raw.models.len(), 1);
    // The documented [compaction] keys are real and show the defaults.
    let engine = crate::compaction::config::CompactionConfig::from_table(&raw.compaction).unwrap();
    let de = crate::compaction::config::CompactionConfig::default();
    assert!(raw.compaction.len() >= 10, "{:?}", raw.compaction);
    assert_eq!(engine.threshold_percent, de.threshold_percent);
    assert_eq!(engine.threshold_tokens, de.threshold_tokens);
    assert_eq!(engine.protect_first_n, de.protect_first_n);
    assert_eq!(engine.protect_last_n, de.protect_last_n);
    assert_eq!(engine.min_tail_user_messages, de.min_tail_user_messages);
    assert_eq!(engine.summary_target_ratio, de.summary_target_ratio);
    assert_eq!(engine.strategy, de.strategy);
    assert_eq!(engine.abort_on_summary_failure, de.abort_on_summary_failure);
    assert_eq!(
        engine.abort_on_degraded_summary,
        de.abort_on_degraded_summary
    );
    assert_eq!(engine.summary_timeout_secs, de.summary_timeout_secs);
}

#[test]
fn max_record_bytes_default_value_and_validation() {
    let c = parse("").unwrap();
    assert_eq!(c.session.max_record_bytes, 256 << 20);
    let c = parse("[session]\nmax_record_bytes = 1048576\n").unwrap();
    assert_eq!(c.session.max_record_bytes, 1 << 20);
    let e = parse("[session]\nmax_record_bytes = 0\n").unwrap_err();
    assert_eq!(e.keys(), vec!["session.max_record_bytes"]);
    // proxy.toml documents the default.
    let doc = format!("# max_record_bytes = {}", 256 << 20);
    assert!(include_str!("../../proxy.toml").contains(&doc));
}

#[test]
fn admin_inspector_keys_defaults_values_and_validation() {
    let c = parse("").unwrap();
    assert!(!c.admin_show_content);
    assert_eq!(c.admin_turn_history, 200);
    let c = parse("[admin]\ntoken = \"t\"\nshow_content = true\nturn_history = 5\n").unwrap();
    assert!(c.admin_show_content);
    assert_eq!(c.admin_turn_history, 5);
    for bad in ["0", "10001"] {
        let e = parse(&format!("[admin]\nturn_history = {bad}\n")).unwrap_err();
        assert_eq!(e.keys(), vec!["admin.turn_history"], "{bad}");
    }
    assert!(parse("[admin]\nshow_content = \"yes\"\n").is_err());
    // proxy.toml documents both defaults.
    let doc = include_str!("../../proxy.toml");
    assert!(doc.contains("# show_content = false"));
    assert!(doc.contains("# turn_history = 200"));
}

#[test]
fn missing_ca_file_is_reported() {
    let e = parse("upstream_ca_file = \"/nonexistent/ca.pem\"\n").unwrap_err();
    assert_eq!(e.keys(), vec!["upstream_ca_file"]);
}
