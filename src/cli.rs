//! Command-line arguments (clap structs only) and what they override.
//!
//! The two settings everyone changes first are flags too: `--upstream` and
//! `--listen` win over `COMPACTOR_UPSTREAM` / `COMPACTOR_LISTEN`, which win
//! over the config file (`crate::config` merges the three).

use std::path::PathBuf;

use clap::Parser;

use crate::config::Overrides;

/// What `--help` prints after the flags: where the rest of the settings
/// come from, and where to look once it runs.
const AFTER_HELP: &str = "\
Configuration, each source over the next:
  1. these flags (--upstream, --listen);
  2. COMPACTOR_* environment variables (COMPACTOR_UPSTREAM, COMPACTOR_LISTEN,
     COMPACTOR_ADMIN_TOKEN, COMPACTOR_STORE_URL, ...);
  3. the config file: --config FILE, else ./proxy.toml when it exists;
  4. built-in defaults (listen 127.0.0.1:4000, upstream http://127.0.0.1:8080).
Every key and its variable are documented in the repository's proxy.toml.
A bad key or value exits with code 64 and one line naming the key.

Once running (ADDR is --listen):
  clients:    point the base URL at http://ADDR/v1 (Anthropic: http://ADDR)
  inspector:  http://ADDR/_compactor/ui (needs [admin] token / COMPACTOR_ADMIN_TOKEN)
  metrics:    http://ADDR/_compactor/metrics, health: http://ADDR/_compactor/health";

/// compactor: a transparent OpenAI-compatible reverse proxy that compacts
/// long conversations in flight.
#[derive(Debug, Clone, Parser)]
#[command(name = "compactor", version, about, after_help = AFTER_HELP)]
pub struct Cli {
    /// Config file [default: ./proxy.toml if present, else built-in defaults].
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Upstream base URL, http or https, may carry a path prefix
    /// (overrides COMPACTOR_UPSTREAM and `upstream`) [default: http://127.0.0.1:8080].
    #[arg(long, value_name = "URL")]
    pub upstream: Option<String>,

    /// Address to listen on, port 0 for a free one (overrides COMPACTOR_LISTEN
    /// and `listen`) [default: 127.0.0.1:4000].
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,

    /// Validate the configuration, print nothing on success, and exit.
    #[arg(long)]
    pub validate_and_exit: bool,
}

impl Cli {
    /// The settings given as flags, to be applied over env and file.
    pub fn overrides(&self) -> Overrides {
        Overrides {
            listen: self.listen.clone(),
            upstream: self.upstream.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_upstream_and_listen_flags_are_overrides() {
        let cli = Cli::try_parse_from([
            "compactor",
            "--upstream",
            "https://openrouter.ai/api",
            "--listen",
            "0.0.0.0:9000",
        ])
        .unwrap();
        let o = cli.overrides();
        assert_eq!(o.upstream.as_deref(), Some("https://openrouter.ai/api"));
        assert_eq!(o.listen.as_deref(), Some("0.0.0.0:9000"));
        assert!(cli.config.is_none());

        let cli = Cli::try_parse_from(["compactor", "-c", "my.toml"]).unwrap();
        let o = cli.overrides();
        assert!(o.upstream.is_none() && o.listen.is_none());
        assert_eq!(cli.config, Some(PathBuf::from("my.toml")));
    }

    #[test]
    fn cli_flags_need_a_value() {
        assert!(Cli::try_parse_from(["compactor", "--upstream"]).is_err());
        assert!(Cli::try_parse_from(["compactor", "--listen"]).is_err());
    }

    #[test]
    fn cli_help_names_config_file_env_prefix_and_inspector() {
        let help = Cli::command().render_long_help().to_string();
        for needle in [
            "--config",
            "proxy.toml",
            "--upstream",
            "--listen",
            "COMPACTOR_",
            "/_compactor/ui",
            "/_compactor/metrics",
        ] {
            assert!(help.contains(needle), "{needle} missing from:\n{help}");
        }
    }

    #[test]
    fn cli_version_is_the_crate_version() {
        let version = Cli::command().render_version().to_string();
        assert!(version.contains(env!("CARGO_PKG_VERSION")), "{version}");
    }
}
