//! `--telemetry`: a `tracing` subscriber and a `metrics` recorder, installed
//! as a service that reads the crate's events and metrics installs them, so
//! that a run measures what they cost (BENCHMARKS.md, "What tracing and
//! metrics cost").

/// Installs the subscriber (`diesel_claim=info`, every span printed as it
/// closes, formatted and written to nowhere) and the recorder (metrics-util's,
/// which keeps every counter and sample in memory, as an exporter does).
#[cfg(feature = "telemetry")]
pub fn install() -> Result<(), String> {
    use tracing_subscriber::fmt::format::FmtSpan;

    tracing_subscriber::fmt()
        .with_env_filter("diesel_claim=info")
        .with_span_events(FmtSpan::CLOSE)
        .with_writer(std::io::sink)
        .try_init()
        .map_err(|error| format!("cannot install the subscriber: {error}"))?;
    metrics_util::debugging::DebuggingRecorder::new()
        .install()
        .map_err(|error| format!("cannot install the recorder: {error}"))
}

#[cfg(not(feature = "telemetry"))]
pub fn install() -> Result<(), String> {
    Err("--telemetry needs the benchmark's telemetry feature (on by default)".to_owned())
}
