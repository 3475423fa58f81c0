//! Command-line arguments (clap structs only).

use std::path::PathBuf;

use clap::Parser;

/// compactor: a transparent OpenAI-compatible reverse proxy that compacts
/// long conversations in flight.
#[derive(Debug, Clone, Parser)]
#[command(name = "compactor", version, about)]
pub struct Cli {
    /// Config file (default: ./proxy.toml if present, else built-in defaults).
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Validate the configuration, print nothing on success, and exit.
    #[arg(long)]
    pub validate_and_exit: bool,
}
