//! The consumer runner (design §8): each message is applied at most once per consumer and
//! never skipped.
//!
//! For each message: decode the envelope; skip types the handler does not want; skip event
//! ids already in the inbox; run the handler's `prepare` step outside any transaction (where
//! remote calls such as Stripe happen, each with a stable idempotency key); then, in one
//! PostgreSQL transaction, insert `(consumer, event_id)` into the inbox and apply the effect;
//! commit; and only then commit the Kafka offset. A crash anywhere before the offset commit
//! replays the message, and the inbox turns the replay into a no-op (invariant 4).
//!
//! A transient error (database unreachable, provider 5xx, timeout) rolls back and retries the
//! same message with capped, jittered backoff, blocking its partition so per-order order is
//! kept. A permanent error (undecodable envelope, unknown type, impossible transition) goes to
//! the dead-letter topic with the source topic/partition/offset, consumer, error code and
//! attempt count, and the runner moves on.

use crate::KafkaConfig;
use async_trait::async_trait;
use boxoffice_domain::{Envelope, PurchaseEvent, Topic};
use boxoffice_store::{inbox, Tx};
use rand::Rng;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::producer::FutureProducer;
use rdkafka::ClientConfig;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How a handler failed.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Worth retrying the same message later (the effect was rolled back).
    #[error("transient: {0:#}")]
    Transient(#[source] anyhow::Error),
    /// Retrying cannot help: dead-letter the message under `code`.
    #[error("permanent ({code}): {source:#}")]
    Permanent {
        /// Stable machine-readable reason, e.g. `illegal_transition`.
        code: &'static str,
        /// Details.
        #[source]
        source: anyhow::Error,
    },
}

impl HandlerError {
    /// A permanent error with `code`.
    pub fn permanent(code: &'static str, e: impl Into<anyhow::Error>) -> Self {
        Self::Permanent {
            code,
            source: e.into(),
        }
    }
}

impl From<sqlx::Error> for HandlerError {
    fn from(e: sqlx::Error) -> Self {
        if boxoffice_store::is_retryable(&e) {
            Self::Transient(e.into())
        } else {
            Self::Permanent {
                code: "database_error",
                source: e.into(),
            }
        }
    }
}

impl From<boxoffice_store::StoreError> for HandlerError {
    fn from(e: boxoffice_store::StoreError) -> Self {
        match e {
            boxoffice_store::StoreError::Db(e) => e.into(),
            other => Self::permanent("corrupt_row", other),
        }
    }
}

/// One consumer of the purchase topic.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// What `prepare` hands to `apply` (e.g. the provider's answer).
    type Prepared: Send;

    /// The consumer's name: its inbox key and consumer group (`ticketing-{name}`).
    fn name(&self) -> &'static str;

    /// Whether this consumer acts on `event_type`; other messages are acknowledged unread.
    fn wants(&self, event_type: &str) -> bool;

    /// Work outside any transaction (remote calls with stable idempotency keys). May run more
    /// than once for one message.
    async fn prepare(
        &self,
        env: &Envelope,
        event: &PurchaseEvent,
    ) -> Result<Self::Prepared, HandlerError>;

    /// The effect, inside the transaction that also records the inbox row.
    async fn apply(
        &self,
        tx: &mut Tx<'_>,
        env: &Envelope,
        event: &PurchaseEvent,
        prepared: Self::Prepared,
    ) -> Result<(), HandlerError>;
}

/// What happened to one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// The effect was applied and committed.
    Applied,
    /// Already in the inbox: nothing done.
    Duplicate,
    /// Not an event type this consumer handles.
    Ignored,
    /// Sent to the dead-letter topic.
    DeadLettered,
}

/// Applies one envelope once: the inbox check, `prepare`, then inbox + `apply` in one
/// transaction. Public so tests can drive a handler without a broker.
pub async fn handle_once<H: Handler>(
    pool: &PgPool,
    handler: &H,
    env: &Envelope,
) -> Result<Disposition, HandlerError> {
    if !handler.wants(&env.event_type) {
        return Ok(Disposition::Ignored);
    }
    let event = env
        .decode()
        .map_err(|e| HandlerError::permanent("bad_payload", e))?;
    let seen: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM inbox WHERE consumer = $1 AND event_id = $2)",
    )
    .bind(handler.name())
    .bind(env.event_id)
    .fetch_one(pool)
    .await?;
    if seen {
        return Ok(Disposition::Duplicate);
    }
    let prepared = handler.prepare(env, &event).await?;
    let mut tx = pool.begin().await?;
    if !inbox::record(&mut tx, handler.name(), env.event_id).await? {
        return Ok(Disposition::Duplicate);
    }
    handler.apply(&mut tx, env, &event, prepared).await?;
    tx.commit().await?;
    Ok(Disposition::Applied)
}

/// Runs `instances` members of the handler's consumer group until `shutdown`; each member
/// processes its assigned partitions one message at a time.
pub fn run_consumers<H: Handler>(
    cfg: &KafkaConfig,
    pool: PgPool,
    handler: Arc<H>,
    dlq: FutureProducer,
    instances: usize,
    shutdown: CancellationToken,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let mut tasks = Vec::new();
    for i in 0..instances.max(1) {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &cfg.brokers)
            .set("group.id", cfg.group(handler.name()))
            .set(
                "client.id",
                format!("{}-{}-{}", handler.name(), std::process::id(), i),
            )
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", "10000")
            .set("heartbeat.interval.ms", "1000")
            .set("fetch.wait.max.ms", "50")
            .set("partition.assignment.strategy", "cooperative-sticky")
            .create()?;
        consumer.subscribe(&[&cfg.topic(Topic::Purchase.name())])?;
        let runner = Runner {
            cfg: cfg.clone(),
            pool: pool.clone(),
            handler: handler.clone(),
            dlq: dlq.clone(),
            shutdown: shutdown.clone(),
        };
        tasks.push(tokio::spawn(async move { runner.run(consumer).await }));
    }
    Ok(tasks)
}

struct Runner<H> {
    cfg: KafkaConfig,
    pool: PgPool,
    handler: Arc<H>,
    dlq: FutureProducer,
    shutdown: CancellationToken,
}

impl<H: Handler> Runner<H> {
    async fn run(self, consumer: StreamConsumer) {
        let name = self.handler.name();
        loop {
            let msg = tokio::select! {
                _ = self.shutdown.cancelled() => break,
                m = consumer.recv() => m,
            };
            let msg = match msg {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(consumer = name, error = %e, "kafka receive failed");
                    metrics::counter!("boxoffice_consumer_errors_total", "consumer" => name)
                        .increment(1);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            if !self.process(&msg).await {
                break; // shutting down mid-retry: leave the offset uncommitted
            }
            if let Err(e) = consumer.commit_message(&msg, CommitMode::Async) {
                tracing::warn!(consumer = name, error = %e, "offset commit failed; message will replay into the inbox");
            }
        }
        if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
            tracing::debug!(consumer = name, error = %e, "final offset commit");
        }
        tracing::info!(consumer = name, "consumer stopped");
    }

    /// Processes one message until applied, skipped or dead-lettered; `false` if shutdown
    /// interrupted the retries.
    async fn process(&self, msg: &BorrowedMessage<'_>) -> bool {
        let name = self.handler.name();
        let env = match msg.payload().map(Envelope::from_slice) {
            Some(Ok(env)) => env,
            Some(Err(e)) => {
                self.dead_letter(msg, None, "bad_envelope", &e.to_string(), 1)
                    .await;
                return true;
            }
            None => {
                self.dead_letter(msg, None, "empty_message", "message has no payload", 1)
                    .await;
                return true;
            }
        };
        let mut attempt: u32 = 0;
        loop {
            attempt += 1;
            let started = std::time::Instant::now();
            match handle_once(&self.pool, &*self.handler, &env).await {
                Ok(d) => {
                    if d == Disposition::Applied {
                        metrics::histogram!("boxoffice_consumer_apply_seconds", "consumer" => name)
                            .record(started.elapsed().as_secs_f64());
                    }
                    metrics::counter!("boxoffice_consumer_messages_total", "consumer" => name, "outcome" => format!("{d:?}"))
                        .increment(1);
                    return true;
                }
                Err(HandlerError::Permanent { code, source }) => {
                    tracing::error!(consumer = name, event.id = %env.event_id, event.type = %env.event_type,
                        order.id = %env.aggregate_id, code, error = %format!("{source:#}"), "permanent failure: dead-lettering");
                    self.dead_letter(msg, Some(&env), code, &format!("{source:#}"), attempt)
                        .await;
                    return true;
                }
                Err(HandlerError::Transient(e)) => {
                    metrics::counter!("boxoffice_consumer_retries_total", "consumer" => name)
                        .increment(1);
                    tracing::warn!(consumer = name, event.id = %env.event_id, event.type = %env.event_type,
                        order.id = %env.aggregate_id, attempt, error = %format!("{e:#}"), "transient failure: retrying");
                    let cap = 5_000u64;
                    let base = (50u64 << attempt.min(7)).min(cap);
                    let delay = base / 2 + rand::thread_rng().gen_range(0..=base / 2);
                    tokio::select! {
                        _ = self.shutdown.cancelled() => return false,
                        _ = tokio::time::sleep(Duration::from_millis(delay)) => {}
                    }
                }
            }
        }
    }

    async fn dead_letter(
        &self,
        msg: &BorrowedMessage<'_>,
        env: Option<&Envelope>,
        code: &str,
        detail: &str,
        attempts: u32,
    ) {
        let name = self.handler.name();
        let record = serde_json::json!({
            "consumer": name,
            "error_code": code,
            "error": detail,
            "attempts": attempts,
            "source_topic": self.cfg.logical(msg.topic()),
            "source_partition": msg.partition(),
            "source_offset": msg.offset(),
            "event_id": env.map(|e| e.event_id),
            "event_type": env.map(|e| e.event_type.clone()),
            "original": msg.payload().map(|p| String::from_utf8_lossy(p).into_owned()),
        });
        let key = env.map(|e| e.aggregate_id.to_string()).unwrap_or_default();
        let topic = self.cfg.topic(Topic::DeadLetter.name());
        let body = record.to_string();
        let mut attempt = 0u32;
        // The dead letter must be durable before the offset moves past the message.
        while let Err(e) = crate::producer::send(
            &self.dlq,
            &topic,
            &key,
            body.as_bytes(),
            &[("error-code", code)],
        )
        .await
        {
            attempt += 1;
            tracing::warn!(consumer = name, error = %e, attempt, "dead-letter publish failed; retrying");
            if self.shutdown.is_cancelled() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200 * attempt.min(10) as u64)).await;
        }
        metrics::counter!("boxoffice_dead_letters_total", "consumer" => name, "code" => code.to_owned()).increment(1);
    }
}
