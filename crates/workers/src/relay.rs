//! The outbox relay (design §7, invariant 5): one relay at a time publishes, the one whose
//! own PostgreSQL session holds the outbox's advisory lock ([`outbox::RELAY_LOCK`]). The
//! leader reads the oldest unpublished rows (through the region fence: a fenced relay
//! publishes nothing), publishes them with the idempotent producer, awaits every delivery
//! report, then marks the delivered rows published. Every process running the relay role
//! runs one; the others stand by and try the lock every [`STANDBY_TRY`].
//!
//! The lock lives as long as the leader's session: a relay that crashes or loses its network
//! gives it up at once, and one that goes silent (a frozen process, a host PostgreSQL can
//! no longer reach) once its session has sat idle for the relay's lease
//! (`relay_lease_ms`, the session's `idle_session_timeout`, longer than the producer's
//! delivery timeout so that a slow broker does not cost the lock). Rows the old leader
//! published but had not marked are published again by the next: a duplicate the
//! consumers' inbox absorbs, never a loss. A leader whose connection fails gives the lock
//! up and tries again from a new connection.
//!
//! Fault points: `relay.before_publish` (read, nothing sent), `relay.after_publish` (the
//! broker acknowledged, the rows are not marked: they are published again by the next
//! batch — the duplicate §17 asks to prove harmless) and `relay.after_commit` (marked).
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
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Relay tuning.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// Rows read and published per batch.
    pub batch: i64,
    /// How long the leader's session may sit idle before PostgreSQL ends it and with it the
    /// lead (`idle_session_timeout`), ms; must exceed the producer's delivery timeout.
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

/// How often a relay that does not lead tries the lock.
pub const STANDBY_TRY: Duration = Duration::from_millis(500);

/// Runs the relay until `shutdown`; the in-flight batch is finished first. `connect` opens
/// the relay's own session (the lock's holder, its reads and marks); `pool` serves the
/// backlog gauge and the pruning.
pub async fn run(
    pool: PgPool,
    connect: PgConnectOptions,
    producer: FutureProducer,
    kafka: KafkaConfig,
    relay_id: String,
    settings: RelaySettings,
    shutdown: CancellationToken,
) {
    let mut failures = 0u32;
    let mut last_gauge = std::time::Instant::now() - Duration::from_secs(5);
    let mut last_prune = std::time::Instant::now();
    let mut session: Option<PgConnection> = None;
    let mut leading = false;
    while !shutdown.is_cancelled() {
        if last_gauge.elapsed() >= Duration::from_secs(1) {
            last_gauge = std::time::Instant::now();
            if let Ok(b) = outbox::backlog(&pool).await {
                metrics::gauge!("boxoffice_outbox_unpublished").set(b.unpublished as f64);
                metrics::gauge!("boxoffice_outbox_oldest_unpublished_age_ms").set(b.oldest_age_ms as f64);
            }
        }
        if leading && last_prune.elapsed() >= Duration::from_secs(30) {
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
        let pause = match lead(&mut session, &mut leading, &connect, &relay_id, &settings).await {
            Ok(false) => STANDBY_TRY,
            Ok(true) => {
                let c = session.as_mut().expect("leading on a session");
                match publish_batch(c, &producer, &kafka, &relay_id, &settings).await {
                    Ok(n) => {
                        failures = 0;
                        if n < settings.batch as usize {
                            Duration::from_millis(settings.idle_ms)
                        } else {
                            Duration::ZERO
                        }
                    }
                    Err(e) => {
                        failures += 1;
                        metrics::counter!("boxoffice_relay_errors_total").increment(1);
                        tracing::warn!(relay = %relay_id, error = %format!("{e:#}"), failures, "relay batch failed");
                        if e.downcast_ref::<sqlx::Error>().is_some_and(session_lost) {
                            give_up(&mut session, &mut leading, &relay_id, "its session failed");
                        }
                        crate::backoff(failures, 50, 2_000)
                    }
                }
            }
            Err(e) => {
                failures += 1;
                metrics::counter!("boxoffice_relay_errors_total").increment(1);
                tracing::warn!(relay = %relay_id, error = %e, failures, "relay cannot reach PostgreSQL");
                give_up(&mut session, &mut leading, &relay_id, "its session failed");
                crate::backoff(failures, 50, 2_000)
            }
        };
        if !pause.is_zero() {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }
    if leading {
        metrics::gauge!("boxoffice_relay_leader").set(0.0);
    }
    // Closing the session gives the lock up at once (a standing-by relay takes it next try).
    if let Some(c) = session {
        let _ = tokio::time::timeout(Duration::from_secs(1), c.close()).await;
    }
    tracing::info!(relay = %relay_id, "relay stopped");
}

/// Whether this relay leads after this call: opens its session when it has none and tries
/// the lock when it does not hold it. An error means the session is unusable.
async fn lead(
    session: &mut Option<PgConnection>,
    leading: &mut bool,
    connect: &PgConnectOptions,
    relay_id: &str,
    settings: &RelaySettings,
) -> Result<bool, sqlx::Error> {
    if *leading {
        return Ok(true);
    }
    let bound = Duration::from_millis(settings.lease_ms.max(1) as u64);
    if session.is_none() {
        let opts = connect
            .clone()
            .application_name("boxoffice-relay")
            .options([("idle_session_timeout", settings.lease_ms.to_string())]);
        *session = Some(tokio::time::timeout(bound, opts.connect()).await.map_err(|_| timed_out())??);
    }
    let c = session.as_mut().expect("connected");
    if tokio::time::timeout(bound, outbox::try_relay_lock(c)).await.map_err(|_| timed_out())?? {
        *leading = true;
        metrics::gauge!("boxoffice_relay_leader").set(1.0);
        tracing::info!(relay = %relay_id, "relay: holding the outbox's lock, publishing");
    }
    Ok(*leading)
}

/// Drops the session, and with it the lock and the lead.
fn give_up(session: &mut Option<PgConnection>, leading: &mut bool, relay_id: &str, why: &str) {
    if std::mem::take(leading) {
        metrics::gauge!("boxoffice_relay_leader").set(0.0);
        tracing::warn!(relay = %relay_id, why, "relay: gave up the outbox's lock");
    }
    *session = None;
}

fn timed_out() -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, "relay: PostgreSQL call timed out"))
}

/// Whether `e` means the session is gone (and with it the lock): the connection failed, or
/// the server ended the session (SQLSTATE classes 08, connection exception, and 57P, e.g.
/// `57P05` after `idle_session_timeout`).
fn session_lost(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| c.starts_with("08") || c.starts_with("57P")),
        _ => false,
    }
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

/// Reads, publishes and marks one batch on the leader's session `c` (which must hold
/// [`outbox::RELAY_LOCK`]); returns how many rows were read. A database error from `c`, and a
/// call to it that outlasts the lease (an unreachable server), is returned as an
/// `sqlx::Error`, so the caller can tell a lost session.
pub async fn publish_batch(
    c: &mut PgConnection,
    producer: &FutureProducer,
    kafka: &KafkaConfig,
    relay_id: &str,
    settings: &RelaySettings,
) -> anyhow::Result<usize> {
    let bound = Duration::from_millis(settings.lease_ms.max(1) as u64);
    let rows = tokio::time::timeout(bound, outbox::pending_batch(c, settings.batch))
        .await
        .map_err(|_| timed_out())??;
    if rows.is_empty() {
        return Ok(0);
    }
    let read = rows.len();
    boxoffice_faults::check("relay.before_publish")?;
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
    // As if the relay died here: delivered but unmarked, so the next batch sends them again.
    boxoffice_faults::check("relay.after_publish")?;
    if !delivered.is_empty() {
        let marked = tokio::time::timeout(bound, outbox::mark_published(c, &delivered))
            .await
            .map_err(|_| timed_out())??;
        metrics::counter!("boxoffice_outbox_published_total").increment(marked);
    }
    if !failed.is_empty() {
        // Unmarked: the next batch reads them again, oldest first.
        anyhow::bail!("{} of {} messages were not delivered", failed.len(), read);
    }
    boxoffice_faults::check("relay.after_commit")?;
    Ok(read)
}
