//! compactor binary: parse CLI, load config (exit 64 on error), serve.

use std::process::ExitCode;

use clap::Parser;
use compactor::{cli::Cli, config, server, telemetry};

/// EX_USAGE: bad command line or configuration.
const EXIT_USAGE: u8 = 64;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let loaded =
        config::Config::load_with(cli.config.as_deref(), &config::ProcessEnv, &cli.overrides());
    let mut config = match loaded {
        Ok(c) => c,
        Err(e) => {
            eprintln!("compactor: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if cli.validate_and_exit {
        return ExitCode::SUCCESS;
    }
    // The binary keeps records across restarts unless told otherwise; an
    // embedding program (and the in-process tests) keep them in memory.
    config.store.use_binary_default();
    // Held to the end of `main`: dropping it writes the buffered log lines.
    let _log = match telemetry::init(config.log_format) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("compactor: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    // One process-wide provider, so nothing can pick a second one at runtime.
    let _ = rustls::crypto::ring::default_provider().install_default();
    match server::cores::run(config, server::shutdown_signal) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "compactor failed");
            eprintln!("compactor: {e:#}");
            ExitCode::FAILURE
        }
    }
}
