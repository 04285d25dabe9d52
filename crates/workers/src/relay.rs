//! The outbox relay (design §7, invariant 5): claim a batch of unpublished rows with a lease
//! (`FOR UPDATE SKIP LOCKED`, claim committed before publishing), publish them with the
//! idempotent producer, await every delivery report, then mark published only the rows
//! still leased to this relay. Several relays may run at once; a relay that dies after the
//! broker acknowledged but before marking leaves rows whose lease expires and that another
//! relay publishes again — a duplicate the consumers' inbox absorbs, never a loss.
//!
//! Fault points: `relay.before_publish` (claimed, nothing sent), `relay.after_publish` (the
//! broker acknowledged, the rows are not marked: an injected error releases the claim so
//! the rows are published again at once — the duplicate §17 asks to prove harmless) and
//! `relay.after_commit` (marked).
//!
//! **Trace context** (design §16). Each message carries the row's stored `traceparent` as its
//! `traceparent` header — the context of the span that committed the fact, never the
//! relay's own, so the consumer continues the purchase's trace. With tracing on, each row
//! also gets a producer span, a child of that stored context, open from enqueue to the
//! delivery report (`messaging.*` attributes, the partition and offset the broker assigned);
//! with tracing off the relay creates no span at all.

use boxoffice_bus::KafkaConfig;
use boxoffice_store::outbox;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use sqlx::PgPool;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Relay tuning.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// Rows claimed per batch.
    pub batch: i64,
    /// Lease on claimed rows, ms; must exceed the producer's delivery timeout.
    pub lease_ms: i64,
    /// Pause when the outbox is empty, ms.
    pub idle_ms: u64,
    /// Published rows move to the order history after this many seconds.
    pub retention_s: i64,
    /// The order history (and its status changes) is deleted after this many seconds.
    pub history_retention_s: i64,
}

impl Default for RelaySettings {
    fn default() -> Self {
        Self {
            batch: 500,
            lease_ms: 45_000,
            idle_ms: 20,
            retention_s: 3_600,
            history_retention_s: 400 * 86_400,
        }
    }
}

/// Runs the relay until `shutdown`; the in-flight batch is finished first.
pub async fn run(
    pool: PgPool,
    producer: FutureProducer,
    kafka: KafkaConfig,
    relay_id: String,
    settings: RelaySettings,
    shutdown: CancellationToken,
) {
    let mut failures = 0u32;
    let mut last_gauge = std::time::Instant::now() - Duration::from_secs(5);
    let mut last_prune = std::time::Instant::now();
    while !shutdown.is_cancelled() {
        if last_gauge.elapsed() >= Duration::from_secs(1) {
            last_gauge = std::time::Instant::now();
            if let Ok(b) = outbox::backlog(&pool).await {
                metrics::gauge!("boxoffice_outbox_unpublished").set(b.unpublished as f64);
                metrics::gauge!("boxoffice_outbox_oldest_unpublished_age_ms").set(b.oldest_age_ms as f64);
            }
        }
        if last_prune.elapsed() >= Duration::from_secs(30) {
            last_prune = std::time::Instant::now();
            if let Err(e) = outbox::prune_published(&pool, settings.retention_s, 10_000).await {
                tracing::warn!(relay = %relay_id, error = %e, "pruning published outbox rows failed");
            }
            if let Err(e) =
                boxoffice_store::timeline::prune(&pool, settings.history_retention_s, 10_000).await
            {
                tracing::warn!(relay = %relay_id, error = %e, "pruning the order history failed");
            }
        }
        match publish_batch(&pool, &producer, &kafka, &relay_id, &settings).await {
            Ok(n) => {
                failures = 0;
                if n < settings.batch as usize {
                    tokio::select! {
                        _ = shutdown.cancelled() => {}
                        _ = tokio::time::sleep(Duration::from_millis(settings.idle_ms)) => {}
                    }
                }
            }
            Err(e) => {
                failures += 1;
                metrics::counter!("boxoffice_relay_errors_total").increment(1);
                tracing::warn!(relay = %relay_id, error = %format!("{e:#}"), failures, "relay batch failed");
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(crate::backoff(failures, 50, 2_000)) => {}
                }
            }
        }
    }
    tracing::info!(relay = %relay_id, "relay stopped");
}

/// The producer span of one row, a child of the row's stored context (a span of its own trace
/// when the row has none); disabled when tracing is off.
fn publish_span(kafka: &KafkaConfig, topic: &str, row: &outbox::OutboxRow) -> tracing::Span {
    if !boxoffice_trace::enabled() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!("relay.publish",
        otel.name = format!("publish {}", row.topic),
        otel.kind = "producer",
        otel.status_code = tracing::field::Empty,
        messaging.system = "kafka",
        messaging.operation.type = "send",
        messaging.destination.name = %topic,
        messaging.destination.partition.id = tracing::field::Empty,
        messaging.kafka.message.offset = tracing::field::Empty,
        messaging.kafka.message.key = %row.message_key,
        messaging.message.id = %row.id,
        order.id = %row.message_key,
        correlation_id = row.payload.0.get("correlation_id").and_then(|v| v.as_str()),
        causation_id = row.payload.0.get("causation_id").and_then(|v| v.as_str()),
        event_id = %row.id,
        event_type = %row.event_type,
        region = row.region.as_deref().unwrap_or(&kafka.labels.region),
        purchase_cell = %kafka.labels.purchase_cell,
    );
    boxoffice_trace::set_parent(&span, row.traceparent.as_deref());
    span
}

/// Claims, publishes and marks one batch; returns how many rows were claimed.
pub async fn publish_batch(
    pool: &PgPool,
    producer: &FutureProducer,
    kafka: &KafkaConfig,
    relay_id: &str,
    settings: &RelaySettings,
) -> anyhow::Result<usize> {
    let rows = outbox::claim_batch(pool, relay_id, settings.batch, settings.lease_ms).await?;
    if rows.is_empty() {
        return Ok(0);
    }
    let claimed = rows.len();
    if let Err(e) = boxoffice_faults::check("relay.before_publish") {
        let ids: Vec<_> = rows.iter().map(|r| r.id).collect();
        outbox::release_claim(pool, relay_id, &ids).await?;
        return Err(e.into());
    }
    let encoded: Vec<(String, Vec<u8>)> = rows
        .iter()
        .map(|row| Ok((kafka.topic(&row.topic), row.message()?)))
        .collect::<Result<_, serde_json::Error>>()?;
    let mut pending = Vec::with_capacity(rows.len());
    for (row, (topic, payload)) in rows.iter().zip(&encoded) {
        let id = row.id.to_string();
        let epoch = row.region_epoch.map(|e| e.to_string());
        let mut headers = OwnedHeaders::new()
            .insert(Header { key: boxoffice_bus::fact_headers::EVENT_ID, value: Some(id.as_str()) })
            .insert(Header {
                key: boxoffice_bus::fact_headers::EVENT_TYPE,
                value: Some(row.event_type.as_str()),
            });
        if let (Some(region), Some(epoch)) = (&row.region, &epoch) {
            headers = headers
                .insert(Header { key: "region", value: Some(region.as_str()) })
                .insert(Header { key: "region-epoch", value: Some(epoch.as_str()) });
        }
        if let Some(tp) = &row.traceparent {
            headers = headers.insert(Header { key: boxoffice_trace::TRACEPARENT, value: Some(tp.as_str()) });
        }
        let span = publish_span(kafka, topic, row);
        let mut record = FutureRecord::to(topic).key(&row.message_key).payload(payload).headers(headers);
        // Enqueue in order; all delivery futures are awaited before anything is marked.
        let fut = loop {
            match producer.send_result(record) {
                Ok(f) => break f,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, _)) => return Err(e.into()),
            }
        };
        pending.push((row.id, row.created_at, fut, span));
    }
    let mut delivered = Vec::with_capacity(pending.len());
    let mut failed = Vec::new();
    let now = chrono::Utc::now();
    for (id, created_at, fut, span) in pending {
        match fut.await {
            Ok(Ok(delivery)) => {
                span.record("messaging.destination.partition.id", delivery.partition.to_string().as_str());
                span.record("messaging.kafka.message.offset", delivery.offset);
                delivered.push(id);
                metrics::histogram!("boxoffice_outbox_publish_delay_seconds")
                    .record((now - created_at).num_milliseconds().max(0) as f64 / 1000.0);
            }
            Ok(Err((e, _))) => {
                span.record("otel.status_code", "ERROR");
                tracing::warn!(parent: &span, relay = relay_id, outbox.id = %id, error = %e, "publish failed");
                failed.push(id);
            }
            Err(_canceled) => failed.push(id),
        }
    }
    if let Err(e) = boxoffice_faults::check("relay.after_publish") {
        // As if the relay died here: delivered but unmarked, so they go out again.
        let mut all = delivered;
        all.extend(failed);
        outbox::release_claim(pool, relay_id, &all).await?;
        return Err(e.into());
    }
    if !delivered.is_empty() {
        let marked = outbox::mark_published(pool, relay_id, &delivered).await?;
        metrics::counter!("boxoffice_outbox_published_total").increment(marked);
        if marked < delivered.len() as u64 {
            // Our lease ran out and another relay owns these rows now: it will publish them
            // again, and the consumers' inbox makes the duplicate harmless.
            metrics::counter!("boxoffice_outbox_lease_lost_total").increment(delivered.len() as u64 - marked);
        }
    }
    if !failed.is_empty() {
        outbox::release_claim(pool, relay_id, &failed).await?;
        anyhow::bail!("{} of {} messages were not delivered", failed.len(), claimed);
    }
    boxoffice_faults::check("relay.after_commit")?;
    Ok(claimed)
}
