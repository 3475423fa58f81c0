//! Tracing setup: `RUST_LOG`-style filter (default `compactor=info`), text or JSON.

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Filter used when `RUST_LOG` is unset or invalid.
pub const DEFAULT_FILTER: &str = "compactor=info";

/// Telemetry initialisation failure.
#[derive(Debug, thiserror::Error)]
#[error("cannot initialise logging: {0}")]
pub struct TelemetryError(String);

/// Installs the global subscriber. Logs go to stdout.
pub fn init(format: LogFormat) -> Result<(), TelemetryError> {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    // Colour only on a terminal, so piped logs stay parseable.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi);
    let result = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    result.map_err(|e| TelemetryError(e.to_string()))
}
