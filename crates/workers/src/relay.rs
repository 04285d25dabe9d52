//! The outbox relay (design §7, invariant 5): one relay at a time publishes, the one whose
//! own PostgreSQL session holds the outbox's advisory lock ([`outbox::RELAY_LOCK`]). The
//! leader reads the oldest unpublished rows (through the region fence: a fenced relay
//! publishes nothing), publishes them with the idempotent producer, awaits every delivery
//! report, then marks the delivered rows published. Every process running the relay role
//! runs one; the others stand by and try the lock every [`STANDBY_TRY`].
//!
//! The lock lives as long as the leader's session. A relay that crashes or closes its
//! connection gives it up at once. While a batch waits on the broker, the leader keeps its
//! session busy (a `SELECT 1` every third of the lease), so one that goes silent — a frozen
//! process, a host PostgreSQL can no longer reach — loses the session, and the lock, once it
//! has sat idle for the relay's lease (`relay_lease_ms`, the session's `idle_session_timeout`)
//! or once the server has waited that long to get a reply through to it
//! (`tcp_user_timeout`). A leader that can reach PostgreSQL but whose batches fail
//! [`GIVE_UP_AFTER`] times in a row (its broker, its producer or its configuration failing),
//! or that the region fence refuses, gives the lock up and sits out [`SIT_OUT`], so that a
//! relay of another process may carry on. Rows an old leader published but had not marked are
//! published again by the next: a duplicate the consumers' inbox absorbs, never a loss.
//!
//! **Refused messages are parked.** A message the producer refuses at once for its own sake
//! (`MessageSizeTooLarge`: larger than the producer's `message.max.bytes`) is left
//! unpublished and parked in the ledger ([`outbox::park_refused`]: `refused_at`, the
//! producer's error and the message's size, `retry_at`), and its order with it: no batch
//! reads any fact of that order until `refused_retry_s` has passed or an operator's
//! `boxoffice outbox retry` makes it due, and then a batch reads at most
//! [`outbox::DUE_PARKED_PER_BATCH`] due orders. So an order's facts still leave in order,
//! and no number of refused rows stops the relay for the other orders. A row whose stored
//! envelope the relay cannot read (JSON nested deeper than serde_json reads, say: no writer
//! of this build stores one) is parked the same way, with `unreadable envelope: …` as its
//! refusal. Such a refusal is no broker failure: it counts towards no give-up. Any other
//! error at enqueue (a fatal producer, a topic the producer does not know) is the
//! producer's, not the message's: the row and the later rows of its order stay
//! unpublished for the next batch, and the batch counts as failed, towards the give-up. A
//! message the broker refuses (its own size limit) comes back as a failed delivery, likewise.
//! The parked rows are the `boxoffice_outbox_parked` gauge, counted apart from the backlog
//! ([`outbox::Backlog`]), and `boxoffice outbox parked` lists them with their refusals.
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
use std::collections::HashMap;
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
    /// Pause after a read that found less than a batch, ms. Reads that keep finding nothing
    /// double it, up to [`IDLE_MAX`] ([`idle_pause`]).
    pub idle_ms: u64,
    /// Published rows move to the order history after this many seconds.
    pub retention_s: i64,
    /// The order history (with its status changes and the webhook events recorded with an
    /// order id) is deleted after this many seconds (`boxoffice_store::timeline::prune`).
    pub history_retention_s: i64,
    /// A row the producer refused is parked this long before a batch tries it again, s
    /// (0: the next batch).
    pub refused_retry_s: i64,
}

impl Default for RelaySettings {
    fn default() -> Self {
        Self {
            batch: 500,
            lease_ms: 45_000,
            idle_ms: 20,
            retention_s: 3_600,
            history_retention_s: 400 * 86_400,
            refused_retry_s: 300,
        }
    }
}

/// The longest pause of a leading relay whose reads keep finding nothing: how long a fact
/// written by another process may wait for a relay at rest. A fact written in the relay's
/// own process wakes it ([`boxoffice_store::outbox::written`]).
pub const IDLE_MAX: Duration = Duration::from_millis(200);

/// The pause after a read that found `read` rows of a batch of `batch`, the `empty`-th read
/// in a row to find none (0 when this one found some): none after a full batch, `idle_ms`
/// after a partial one or the first empty one, then doubling with each empty read up to
/// [`IDLE_MAX`] (or `idle_ms`, if that is longer).
pub fn idle_pause(read: usize, batch: usize, empty: u32, idle_ms: u64) -> Duration {
    if read >= batch {
        return Duration::ZERO;
    }
    let idle = Duration::from_millis(idle_ms);
    let doubled = idle.saturating_mul(1u32 << empty.saturating_sub(1).min(16));
    doubled.min(IDLE_MAX.max(idle))
}

/// How often a relay that does not lead tries the lock.
pub const STANDBY_TRY: Duration = Duration::from_millis(500);

/// Batches in a row that failed, or had a message the broker did not take, after which the
/// leader gives the lock up: whatever keeps it from publishing (its broker connection, its
/// producer, its configuration) may not stop another process's relay. With the broker gone,
/// each such batch lasts the producer's 30 s delivery timeout.
pub const GIVE_UP_AFTER: u32 = 5;

/// How long a relay that gave the lock up waits before it tries again, so that a relay
/// standing by elsewhere takes it first.
pub const SIT_OUT: Duration = Duration::from_secs(2);

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
    let mut stalled = 0u32;
    // Reads in a row that found nothing (`idle_pause`).
    let mut empty = 0u32;
    let mut last_gauge = std::time::Instant::now() - Duration::from_secs(5);
    let mut last_prune = std::time::Instant::now();
    let mut session: Option<PgConnection> = None;
    let mut leading = false;
    metrics::gauge!("boxoffice_relay_leader").set(0.0);
    // Exported from the start, so a first refusal is an increase from 0.
    metrics::counter!("boxoffice_outbox_refused_total").increment(0);
    metrics::gauge!("boxoffice_outbox_parked").set(0.0);
    while !shutdown.is_cancelled() {
        if last_gauge.elapsed() >= Duration::from_secs(1) {
            last_gauge = std::time::Instant::now();
            match outbox::backlog(&pool).await {
                Ok(b) => {
                    metrics::gauge!("boxoffice_outbox_unpublished").set(b.unpublished as f64);
                    metrics::gauge!("boxoffice_outbox_oldest_unpublished_age_ms").set(b.oldest_age_ms as f64);
                    metrics::gauge!("boxoffice_outbox_parked").set(b.parked as f64);
                }
                // The gauges keep their last values: the failure counts as a relay error, so
                // BoxofficeRelayErrors tells of it.
                Err(e) => {
                    metrics::counter!("boxoffice_relay_errors_total").increment(1);
                    tracing::warn!(relay = %relay_id, error = %e, "reading the outbox's backlog failed");
                }
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
        let mut pause = match lead(&mut session, &mut leading, &connect, &relay_id, &settings).await {
            Ok(false) => STANDBY_TRY,
            Ok(true) => {
                let c = session.as_mut().expect("leading on a session");
                match publish_batch(c, &producer, &kafka, &relay_id, &settings).await {
                    // Refused rows are no broker failure: they are parked, neither back off
                    // nor count towards the give-up (the rest of the outbox flows past them).
                    Ok(b) if b.failed == 0 => {
                        (failures, stalled) = (0, 0);
                        empty = if b.read == 0 { empty.saturating_add(1) } else { 0 };
                        idle_pause(b.read, settings.batch as usize, empty, settings.idle_ms)
                    }
                    Ok(b) => {
                        // Any delivery failure counts towards the give-up, even with other
                        // rows delivered: a leader that reaches only part of the broker should
                        // let another relay try.
                        failures += 1;
                        stalled += 1;
                        metrics::counter!("boxoffice_relay_errors_total").increment(1);
                        tracing::warn!(relay = %relay_id, failed = b.failed, read = b.read, marked = b.marked, failures,
                            "relay batch: some messages were not delivered; they stay unpublished for the next batch");
                        crate::backoff(failures, 50, 2_000)
                    }
                    Err(e) => {
                        failures += 1;
                        stalled += 1;
                        metrics::counter!("boxoffice_relay_errors_total").increment(1);
                        tracing::warn!(relay = %relay_id, error = %format!("{e:#}"), failures, "relay batch failed");
                        let db = e.downcast_ref::<sqlx::Error>();
                        if db.is_some_and(session_lost) {
                            give_up(&mut session, &mut leading, &relay_id, "session_lost");
                        } else if db.and_then(boxoffice_store::region::refusal).is_some() {
                            // A fenced (or lease-lapsed) relay reads nothing: it stands aside at
                            // once, for a relay of the current epoch.
                            give_up(&mut session, &mut leading, &relay_id, "fenced");
                        }
                        crate::backoff(failures, 50, 2_000)
                    }
                }
            }
            Err(e) => {
                failures += 1;
                metrics::counter!("boxoffice_relay_errors_total").increment(1);
                tracing::warn!(relay = %relay_id, error = %e, failures, "relay cannot reach PostgreSQL");
                give_up(&mut session, &mut leading, &relay_id, "session_lost");
                crate::backoff(failures, 50, 2_000)
            }
        };
        if leading && stalled >= GIVE_UP_AFTER {
            give_up(&mut session, &mut leading, &relay_id, "stalled");
        }
        if !leading && stalled > 0 {
            // Gave the lock up (or lost it): the next spell as leader counts afresh, after a
            // pause that lets a relay standing by elsewhere take the lock first.
            (failures, stalled) = (0, 0);
            pause = pause.max(SIT_OUT);
        }
        if !pause.is_zero() {
            let idle = Duration::from_millis(settings.idle_ms);
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(pause) => {}
                // A fact written here while the relay rests: read it after the usual short
                // pause (its transaction commits meanwhile), as under load.
                _ = boxoffice_store::outbox::written().notified(), if leading && pause > idle => {
                    empty = 0;
                    tokio::select! {
                        _ = shutdown.cancelled() => {}
                        _ = tokio::time::sleep(idle) => {}
                    }
                }
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
        let keepalive_s = (settings.lease_ms / 4_000).max(1);
        let opts = connect.clone().application_name("boxoffice-relay").options([
            ("idle_session_timeout", settings.lease_ms.to_string()),
            // A server blocked sending to a relay it can no longer reach gives the session
            // (and the lock) up after the lease too, not when TCP's retries run out.
            ("tcp_user_timeout", settings.lease_ms.to_string()),
            // And one that stops answering between the messages of a statement.
            ("tcp_keepalives_idle", keepalive_s.to_string()),
            ("tcp_keepalives_interval", keepalive_s.to_string()),
            ("tcp_keepalives_count", "3".to_owned()),
            // Its read hashes the parked orders' keys (`outbox::pending_batch`).
            ("work_mem", outbox::PARKED_WORK_MEM.to_owned()),
        ]);
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

/// Drops the session, and with it the lock and the lead. `why` is `session_lost` (the
/// session failed or the server ended it), `fenced` (the region fence refused the read) or
/// `stalled` ([`GIVE_UP_AFTER`] failing batches in a row), the `reason` of
/// `boxoffice_relay_gave_up_total`.
fn give_up(session: &mut Option<PgConnection>, leading: &mut bool, relay_id: &str, why: &'static str) {
    if std::mem::take(leading) {
        metrics::gauge!("boxoffice_relay_leader").set(0.0);
        metrics::counter!("boxoffice_relay_gave_up_total", "reason" => why).increment(1);
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
fn publish_span(
    kafka: &KafkaConfig,
    topic: &str,
    row: &outbox::OutboxRow,
    message: &outbox::Message,
) -> tracing::Span {
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
        correlation_id = message.correlation_id.as_deref(),
        causation_id = message.causation_id.as_deref(),
        event_id = %row.id,
        event_type = %row.event_type,
        region = row.region.as_deref().unwrap_or(&kafka.labels.region),
        purchase_cell = %kafka.labels.purchase_cell,
    );
    boxoffice_trace::set_parent(&span, row.traceparent.as_deref());
    span
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Batch {
    /// Unpublished rows read.
    pub read: usize,
    /// Rows the broker acknowledged and this relay marked published.
    pub marked: u64,
    /// Rows the broker did not take (the delivery failed or timed out), and rows the producer
    /// refused at enqueue for a reason of its own (fatal, unknown topic), with the later rows
    /// of their orders in this batch. They stay unpublished for the next batch; a later row of
    /// the same order whose delivery had started arrives before a failed delivery (consumers
    /// decide by state, not by arrival order).
    pub failed: usize,
    /// Rows the producer refused when enqueued as too large, and rows whose envelope the relay
    /// could not read, with the later rows of their orders in this batch held back behind
    /// them. They stay unpublished; the refused ones count in `boxoffice_outbox_refused_total`
    /// and are parked.
    pub refused: usize,
    /// Refused rows this batch parked ([`outbox::park_refused`]).
    pub parked: u64,
}

/// Reads, publishes and marks one batch on the leader's session `c` (which must hold
/// [`outbox::RELAY_LOCK`]). While the batch waits on the broker, the session is kept busy
/// ([`with_heartbeat`]), so a slow broker does not cost the lock. A row the producer refuses
/// at once (e.g. too large), or whose envelope cannot be read, is left unpublished, with the
/// later rows of its order in this batch, and parked (after the delivered rows are marked);
/// the rest go on. A database error from `c`, and a call to it that outlasts the lease (an
/// unreachable server), is returned as an `sqlx::Error`, so the caller can tell a lost
/// session.
pub async fn publish_batch(
    c: &mut PgConnection,
    producer: &FutureProducer,
    kafka: &KafkaConfig,
    relay_id: &str,
    settings: &RelaySettings,
) -> anyhow::Result<Batch> {
    let bound = Duration::from_millis(settings.lease_ms.max(1) as u64);
    let rows = tokio::time::timeout(bound, outbox::pending_batch(c, settings.batch))
        .await
        .map_err(|_| timed_out())??;
    if rows.is_empty() {
        return Ok(Batch::default());
    }
    let read = rows.len();
    boxoffice_faults::check("relay.before_publish")?;
    // A row whose envelope cannot be read is refused here, as the producer refuses one too
    // large: parked, with its order's later rows held back, while the batch goes on.
    let encoded: Vec<(String, Result<outbox::Message, String>)> = rows
        .iter()
        .map(|row| {
            let message = row.message().map_err(|e| format!("unreadable envelope: {e}"));
            (kafka.topic(&row.topic), message)
        })
        .collect();
    let sent = send_all(producer, kafka, relay_id, &rows, &encoded);
    let Sent { delivered, failed, refused, held_back } = with_heartbeat(c, bound, sent).await?;
    // As if the relay died here: delivered but unmarked, so the next batch sends them again.
    boxoffice_faults::check("relay.after_publish")?;
    let mut marked = 0;
    if !delivered.is_empty() {
        marked = tokio::time::timeout(bound, outbox::mark_published(c, &delivered))
            .await
            .map_err(|_| timed_out())??;
        metrics::counter!("boxoffice_outbox_published_total").increment(marked);
    }
    boxoffice_faults::check("relay.after_commit")?;
    let parked = tokio::time::timeout(bound, outbox::park_refused(c, &refused, settings.refused_retry_s))
        .await
        .map_err(|_| timed_out())??;
    Ok(Batch { read, marked, failed, refused: refused.len() + held_back, parked })
}

/// What [`send_all`] did with a batch's rows.
struct Sent {
    delivered: Vec<uuid::Uuid>,
    /// Deliveries that failed, rows the producer would not enqueue for a reason of its own,
    /// and the later rows of their orders.
    failed: usize,
    /// The rows the producer refused as too large, with its error and their size, and the
    /// rows whose envelope could not be read, with why.
    refused: Vec<(uuid::Uuid, String)>,
    /// Later rows of their orders, not sent.
    held_back: usize,
}

/// Enqueues `rows` in order and awaits every delivery report. A row refused as too large is
/// reported at warn on its first refusal, at debug when a retry is refused again.
async fn send_all(
    producer: &FutureProducer,
    kafka: &KafkaConfig,
    relay_id: &str,
    rows: &[outbox::OutboxRow],
    encoded: &[(String, Result<outbox::Message, String>)],
) -> Sent {
    let mut pending = Vec::with_capacity(rows.len());
    // Orders with a row refused at enqueue: their later rows wait behind it, so none of them
    // is sent ahead of the refused one (`true`: parked, too large; `false`: the producer's
    // own failure).
    let mut held: HashMap<&str, bool> = HashMap::new();
    let (mut failed, mut refused, mut held_back) = (0, Vec::new(), 0);
    for (row, (topic, message)) in rows.iter().zip(encoded) {
        match held.get(row.message_key.as_str()) {
            Some(true) => {
                held_back += 1;
                continue;
            }
            Some(false) => {
                failed += 1;
                continue;
            }
            None => {}
        }
        let message = match message {
            Ok(message) => message,
            Err(why) => {
                metrics::counter!("boxoffice_outbox_refused_total").increment(1);
                if row.refused_at.is_none() {
                    tracing::warn!(relay = relay_id, outbox.id = %row.id, error = %why,
                        "the relay cannot read the row's envelope: parked, with its order's later facts");
                }
                refused.push((row.id, why.clone()));
                held.insert(row.message_key.as_str(), true);
                continue;
            }
        };
        let payload = &message.bytes;
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
        let span = publish_span(kafka, topic, row, message);
        let mut record = FutureRecord::to(topic).key(&row.message_key).payload(payload).headers(headers);
        // Enqueue in order; all delivery futures are awaited before anything is marked.
        let fut = loop {
            match producer.send_result(record) {
                Ok(f) => break Ok(f),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e @ KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge), _)) => {
                    span.record("otel.status_code", "ERROR");
                    metrics::counter!("boxoffice_outbox_refused_total").increment(1);
                    if row.refused_at.is_none() {
                        tracing::warn!(parent: &span, relay = relay_id, outbox.id = %row.id, bytes = payload.len(),
                            error = %e, "the producer refused the message: parked, with its order's later facts");
                    } else {
                        tracing::debug!(parent: &span, relay = relay_id, outbox.id = %row.id, bytes = payload.len(),
                            error = %e, "the producer refused the message again: parked again");
                    }
                    refused.push((row.id, format!("{e} ({} bytes)", payload.len())));
                    break Err(true);
                }
                Err((e, _)) => {
                    span.record("otel.status_code", "ERROR");
                    tracing::warn!(parent: &span, relay = relay_id, outbox.id = %row.id, error = %e,
                        "the producer could not enqueue the message: left for the next batch, with its order's later facts");
                    failed += 1;
                    break Err(false);
                }
            }
        };
        match fut {
            Ok(fut) => pending.push((row.id, row.created_at, fut, span)),
            Err(parked) => {
                held.insert(row.message_key.as_str(), parked);
            }
        }
    }
    let mut delivered = Vec::with_capacity(pending.len());
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
                failed += 1;
            }
            Err(_canceled) => failed += 1,
        }
    }
    Sent { delivered, failed, refused, held_back }
}

/// Runs `work` while keeping the leader's session `c` busy: a `SELECT 1` every third of
/// `lease`, so PostgreSQL ends the session (`idle_session_timeout`) when this process goes
/// silent, not while it waits on the broker; a lost session shows at the next beat. The
/// beat's error is returned as is.
async fn with_heartbeat<T>(
    c: &mut PgConnection,
    lease: Duration,
    work: impl std::future::Future<Output = T>,
) -> Result<T, sqlx::Error> {
    tokio::pin!(work);
    let every = (lease / 3).max(Duration::from_millis(10));
    let mut beat = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            out = &mut work => return Ok(out),
            _ = beat.tick() => {
                tokio::time::timeout(lease, sqlx::query("SELECT 1").execute(&mut *c))
                    .await
                    .map_err(|_| timed_out())??;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relay_at_rest_reads_less_often_up_to_the_bound() {
        let ms = |d: Duration| d.as_millis();
        // A full batch: read again at once; a partial one or the first empty one: the usual pause.
        assert_eq!(ms(idle_pause(500, 500, 0, 20)), 0);
        assert_eq!(ms(idle_pause(7, 500, 0, 20)), 20);
        assert_eq!(ms(idle_pause(0, 500, 1, 20)), 20);
        // Empty reads in a row double it, up to IDLE_MAX.
        let pauses: Vec<u128> = (1..=8).map(|n| ms(idle_pause(0, 500, n, 20))).collect();
        assert_eq!(pauses, [20, 40, 80, 160, 200, 200, 200, 200]);
        assert_eq!(ms(idle_pause(0, 500, u32::MAX, 20)), ms(IDLE_MAX));
        // A configured pause longer than the bound is kept as it is.
        assert_eq!(ms(idle_pause(0, 500, 9, 1_000)), 1_000);
    }
}
