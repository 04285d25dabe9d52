//! The process's log subscriber and, when `otlp_endpoint` is set, its OpenTelemetry span
//! export (design §16).
//!
//! Logs go to stderr as before, in colour only when stderr is a terminal (a file or a pipe
//! gets no ANSI escape codes): `BOXOFFICE_LOG` (an `EnvFilter`), else the command's default
//! filter; JSON lines when `log_format` is `json`, each with the fields of its span and of
//! the spans around it (`order.id`, `correlation_id`, `causation_id`, `event_id`, `region`,
//! `purchase_cell` wherever a handler runs for a fact or a request).
//!
//! With `otlp_endpoint` set, a `tracing_opentelemetry` layer beside the log layer sends spans
//! to that collector (OTLP/gRPC, batched off the request path), the W3C TraceContext
//! propagator is installed and [`boxoffice_trace::enable`] switches on the trace context of
//! outbox rows, Kafka headers and PaymentIntent metadata. The resource says which process
//! it is: `service.name=boxoffice`, `service.instance.id` (random per process),
//! `boxoffice.roles`, `region`, `purchase_cell`. The layer has its own filter, independent
//! of `BOXOFFICE_LOG`: every span at `info` or above, and only warnings and errors as span
//! events; the exporter's own transport (`tonic`, `h2`, `hyper`, `tower`) and
//! `opentelemetry` itself are never traced, so exporting cannot feed itself. Unset: no
//! layer, no exporter, no propagator, and every trace-context check is one atomic load.
//!
//! A collector that is down costs dropped spans, never a stalled request: the batch queue is
//! bounded and full means dropped. [`shutdown`] flushes what is queued (the binary calls it
//! after a graceful stop, so the last spans of a SIGTERM'd process are exported).

use crate::config::Config;
use anyhow::Context;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::io::IsTerminal;
use std::sync::OnceLock;
use tracing_subscriber::filter::{filter_fn, EnvFilter};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Targets the OpenTelemetry layer never sees: the exporter's transport and the SDK.
const UNTRACED: [&str; 6] = ["opentelemetry", "tonic", "h2", "hyper", "tower", "rustls"];

/// Installs the subscriber (see the module doc) for a process running `roles` (their names,
/// for the resource; empty for one-off commands). Must run inside the tokio runtime when
/// `otlp_endpoint` is set (the exporter's channel lives on it). An exporter that cannot be
/// built is reported on stderr and the process runs without export.
pub fn init(cfg: &Config, default_filter: &str, roles: &[&str]) {
    let filter = EnvFilter::try_from_env("BOXOFFICE_LOG").unwrap_or_else(|_| EnvFilter::new(default_filter));
    // Colours only on a terminal: a file or a pipe gets plain text, no ANSI escape codes.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let fmt = if cfg.log_format == "json" { fmt.json().boxed() } else { fmt.boxed() };
    let otel = match cfg.otlp_endpoint.as_deref().map(|e| provider(cfg, e, roles)) {
        Some(Ok(p)) => {
            let tracer = p.tracer("boxoffice");
            let _ = PROVIDER.set(p);
            let keep = filter_fn(|m| {
                !UNTRACED.iter().any(|t| m.target().starts_with(t))
                    && (if m.is_span() {
                        *m.level() <= tracing::Level::INFO
                    } else {
                        *m.level() <= tracing::Level::WARN
                    })
            });
            Some(tracing_opentelemetry::layer().with_tracer(tracer).with_filter(keep))
        }
        Some(Err(e)) => {
            eprintln!("warning: otlp_endpoint: {e:#}; running without span export");
            None
        }
        None => None,
    };
    let on = otel.is_some();
    tracing_subscriber::registry().with(fmt.with_filter(filter)).with(otel).init();
    if on {
        opentelemetry::global::set_text_map_propagator(
            opentelemetry_sdk::propagation::TraceContextPropagator::new(),
        );
        boxoffice_trace::enable();
        tracing::info!(endpoint = cfg.otlp_endpoint.as_deref(), "exporting spans (OTLP/gRPC)");
    }
}

fn provider(cfg: &Config, endpoint: &str, roles: &[&str]) -> anyhow::Result<SdkTracerProvider> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .context("building the OTLP exporter")?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name("boxoffice")
        .with_attributes([
            KeyValue::new("service.instance.id", uuid::Uuid::new_v4().to_string()),
            KeyValue::new("boxoffice.roles", roles.join(",")),
            KeyValue::new("region", cfg.region.clone()),
            KeyValue::new("purchase_cell", cfg.purchase_cell.clone()),
        ])
        .build();
    Ok(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build())
}

/// Exports every span still queued and stops the exporter; nothing when export is off. Call
/// once, after the roles have stopped.
pub async fn shutdown() {
    let Some(p) = PROVIDER.get().cloned() else { return };
    // Blocks until the batch is sent (or the exporter's timeout): off the async workers.
    let r = tokio::task::spawn_blocking(move || p.shutdown()).await;
    if let Ok(Err(e)) = r {
        eprintln!("warning: flushing spans: {e}");
    }
}
