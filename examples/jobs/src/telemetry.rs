//! What an operator sees of the service: its log lines, through
//! `tracing-subscriber`, and its metrics, served for Prometheus to scrape.

use std::net::SocketAddr;

use metrics_exporter_prometheus::{BuildError, PrometheusBuilder};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing_subscriber::EnvFilter;

/// What is logged without `RUST_LOG`: the workers' start, progress and
/// stop and the service's own lines (`info`), and every warning and error,
/// such as each failed job with its error and each dead letter.
const DEFAULT_LOG: &str = "warn,diesel_claim::worker=info,jobs=info";

/// Logs to stderr, as `RUST_LOG` says (else [`DEFAULT_LOG`]); stdout is
/// left to the example's own report.
pub fn log_to_stderr() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// Installs the Prometheus exporter as the process's metrics recorder, its
/// scrape endpoint on `addr` (any path answers), served by a task of the
/// current tokio runtime. The crate's counters and histograms (feature
/// `metrics`) go to it from then on, labelled with their table.
pub fn serve_metrics(addr: SocketAddr) -> Result<(), BuildError> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()?;
    // Units and help texts, once the recorder is in place.
    diesel_claim::metrics::describe();
    Ok(())
}

/// The metrics as a scrape finds them: `GET /metrics` on `addr`, and the
/// response's body (the Prometheus text format).
pub async fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(addr).await?;
    // HTTP/1.0: the server closes the connection once it has answered.
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let body = response.split_once("\r\n\r\n").map(|(_, body)| body);
    Ok(body.unwrap_or_default().to_owned())
}

/// The value of `metric`'s series that has every label of `labels`
/// (`table="jobs"`, …) in a scraped `text`; `None` if there is none.
pub fn series(text: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(metric)?.strip_prefix('{')?;
        let (series_labels, value) = rest.rsplit_once("} ")?;
        let all = labels
            .iter()
            .all(|label| series_labels.split(',').any(|pair| pair.trim() == *label));
        all.then(|| value.trim().parse().ok()).flatten()
    })
}
