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
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::producer::FutureProducer;
use rdkafka::ClientConfig;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use sqlx::PgPool;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
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
        Self::Permanent { code, source: e.into() }
    }
}

impl From<sqlx::Error> for HandlerError {
    fn from(e: sqlx::Error) -> Self {
        if boxoffice_store::is_retryable(&e) {
            Self::Transient(e.into())
        } else {
            Self::Permanent { code: "database_error", source: e.into() }
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

    /// Whether `prepare` calls out (e.g. to Stripe): then the runner first checks the inbox
    /// so a known duplicate costs no remote call. Handlers without remote work skip that
    /// read; the inbox insert in the transaction still catches duplicates.
    fn calls_out(&self) -> bool {
        false
    }

    /// Work outside any transaction (remote calls with stable idempotency keys). May run more
    /// than once for one message.
    async fn prepare(&self, env: &Envelope, event: &PurchaseEvent) -> Result<Self::Prepared, HandlerError>;

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
    let event = env.decode().map_err(|e| HandlerError::permanent("bad_payload", e))?;
    if handler.calls_out() {
        let seen: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM inbox WHERE consumer = $1 AND event_id = $2)")
                .bind(handler.name())
                .bind(env.event_id)
                .fetch_one(pool)
                .await?;
        if seen {
            return Ok(Disposition::Duplicate);
        }
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

/// Consumer-group membership of this process, for readiness and the
/// `boxoffice_consumer_assigned_partitions` gauge.
#[derive(Debug, Default)]
pub struct Assignment {
    partitions: AtomicI64,
}

impl Assignment {
    /// Partitions currently assigned to this process's members of the group.
    pub fn partitions(&self) -> i64 {
        self.partitions.load(Ordering::Relaxed)
    }
}

/// Rebalance callbacks: keeps [`Assignment`] current (cooperative-sticky assignment hands
/// out and takes back partitions incrementally; eager assignment revokes all, then assigns).
struct GroupContext {
    name: &'static str,
    assignment: Arc<Assignment>,
}

impl ClientContext for GroupContext {}

impl ConsumerContext for GroupContext {
    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let delta = match rebalance {
            Rebalance::Assign(tpl) => tpl.count() as i64,
            Rebalance::Revoke(tpl) => -(tpl.count() as i64),
            Rebalance::Error(e) => {
                tracing::warn!(consumer = self.name, error = %e, "rebalance error");
                0
            }
        };
        let now = self.assignment.partitions.fetch_add(delta, Ordering::Relaxed) + delta;
        metrics::gauge!("boxoffice_consumer_assigned_partitions", "consumer" => self.name).set(now as f64);
        tracing::info!(consumer = self.name, partitions = now, "partition assignment changed");
    }
}

type GroupConsumer = StreamConsumer<GroupContext>;

/// Runs `instances` members of the handler's consumer group until `shutdown`. Each member
/// reads its partitions and spreads messages over `lanes` concurrent lanes by message key
/// (the order id): one order's messages are applied in partition order, different orders in
/// parallel. Offsets are committed only up to the lowest message still in flight in its
/// partition, so a crash replays everything unfinished (into the inbox). Returns the tasks
/// and the group's [`Assignment`].
pub fn run_consumers<H: Handler>(
    cfg: &KafkaConfig,
    pool: PgPool,
    handler: Arc<H>,
    dlq: FutureProducer,
    instances: usize,
    lanes: usize,
    shutdown: CancellationToken,
) -> anyhow::Result<(Vec<tokio::task::JoinHandle<()>>, Arc<Assignment>)> {
    let assignment = Arc::new(Assignment::default());
    let mut tasks = Vec::new();
    for i in 0..instances.max(1) {
        let consumer: GroupConsumer = ClientConfig::new()
            .set("bootstrap.servers", &cfg.brokers)
            .set("group.id", cfg.group(handler.name()))
            .set("client.id", format!("{}-{}-{}", handler.name(), std::process::id(), i))
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", "10000")
            .set("heartbeat.interval.ms", "1000")
            .set("fetch.wait.max.ms", "20")
            .set("partition.assignment.strategy", "cooperative-sticky")
            .create_with_context(GroupContext { name: handler.name(), assignment: assignment.clone() })?;
        consumer.subscribe(&[&cfg.topic(Topic::Purchase.name())])?;
        let runner = Arc::new(Runner {
            cfg: cfg.clone(),
            pool: pool.clone(),
            handler: handler.clone(),
            dlq: dlq.clone(),
            shutdown: shutdown.clone(),
        });
        let lanes = lanes.max(1);
        tasks.push(tokio::spawn(async move { runner.run(consumer, lanes).await }));
    }
    Ok((tasks, assignment))
}

struct Runner<H> {
    cfg: KafkaConfig,
    pool: PgPool,
    handler: Arc<H>,
    dlq: FutureProducer,
    shutdown: CancellationToken,
}

/// Offsets dispatched but not finished, per partition: the commit point of a partition is
/// its lowest unfinished offset (or one past the highest dispatched when none is left).
#[derive(Default)]
struct InFlight {
    partitions: HashMap<(String, i32), (BTreeSet<i64>, i64)>,
}

impl InFlight {
    fn start(&mut self, topic: &str, partition: i32, offset: i64) {
        let e = self.partitions.entry((topic.to_owned(), partition)).or_default();
        e.0.insert(offset);
        e.1 = e.1.max(offset);
    }

    /// Marks `offset` done; returns the new commit offset if it moved.
    fn finish(&mut self, topic: &str, partition: i32, offset: i64) -> Option<i64> {
        let e = self.partitions.get_mut(&(topic.to_owned(), partition))?;
        let was_lowest = e.0.first() == Some(&offset);
        e.0.remove(&offset);
        if !was_lowest {
            return None;
        }
        Some(e.0.first().copied().unwrap_or(e.1 + 1))
    }
}

impl<H: Handler> Runner<H> {
    async fn run(self: Arc<Self>, consumer: GroupConsumer, lanes: usize) {
        let name = self.handler.name();
        let consumer = Arc::new(consumer);
        let lag_reporter = tokio::spawn(report_lag(consumer.clone(), name, self.shutdown.clone()));
        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(String, i32, i64)>();
        let mut lane_tx = Vec::with_capacity(lanes);
        let mut lane_tasks = Vec::with_capacity(lanes);
        for _ in 0..lanes {
            let (tx, mut rx) = mpsc::channel::<OwnedMessage>(64);
            lane_tx.push(tx);
            let (me, done) = (self.clone(), done_tx.clone());
            lane_tasks.push(tokio::spawn(async move {
                while let Some(msg) = rx.recv().await {
                    if !me.process(&msg).await {
                        break; // shutting down mid-retry: the offset stays uncommitted
                    }
                    let _ = done.send((msg.topic().to_owned(), msg.partition(), msg.offset()));
                }
            }));
        }
        drop(done_tx);
        let mut in_flight = InFlight::default();
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => break,
                Some((topic, partition, offset)) = done_rx.recv() => {
                    if let Some(next) = in_flight.finish(&topic, partition, offset) {
                        commit(&consumer, name, &topic, partition, next);
                    }
                }
                m = consumer.recv() => match m {
                    Ok(m) => {
                        let msg = m.detach();
                        in_flight.start(msg.topic(), msg.partition(), msg.offset());
                        let lane = msg.key().map(|k| lane_of(k, lanes)).unwrap_or(0);
                        tokio::select! {
                            _ = self.shutdown.cancelled() => break,
                            r = lane_tx[lane].send(msg) => if r.is_err() { break },
                        }
                    }
                    Err(e) => {
                        tracing::warn!(consumer = name, error = %e, "kafka receive failed");
                        metrics::counter!("boxoffice_consumer_errors_total", "consumer" => name).increment(1);
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                },
            }
        }
        // Let each lane finish the message in hand, then commit what completed.
        drop(lane_tx);
        for t in lane_tasks {
            let _ = t.await;
        }
        while let Ok((topic, partition, offset)) = done_rx.try_recv() {
            if let Some(next) = in_flight.finish(&topic, partition, offset) {
                commit(&consumer, name, &topic, partition, next);
            }
        }
        lag_reporter.abort();
        if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
            tracing::debug!(consumer = name, error = %e, "final offset commit");
        }
        tracing::info!(consumer = name, "consumer stopped");
    }

    /// Processes one message until applied, skipped or dead-lettered; `false` if shutdown
    /// interrupted the retries.
    async fn process(&self, msg: &OwnedMessage) -> bool {
        let name = self.handler.name();
        let env = match msg.payload().map(Envelope::from_slice) {
            Some(Ok(env)) => env,
            Some(Err(e)) => {
                self.dead_letter(msg, None, "bad_envelope", &e.to_string(), 1).await;
                return true;
            }
            None => {
                self.dead_letter(msg, None, "empty_message", "message has no payload", 1).await;
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
                    self.dead_letter(msg, Some(&env), code, &format!("{source:#}"), attempt).await;
                    return true;
                }
                Err(HandlerError::Transient(e)) => {
                    metrics::counter!("boxoffice_consumer_retries_total", "consumer" => name).increment(1);
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
        msg: &OwnedMessage,
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
        // The original key (the order id), so one order's dead letters stay in order.
        let key = msg.key().map(|k| String::from_utf8_lossy(k).into_owned()).unwrap_or_default();
        let topic = self.cfg.topic(Topic::DeadLetter.name());
        let body = record.to_string();
        let mut attempt = 0u32;
        // The dead letter must be durable before the offset moves past the message.
        while let Err(e) =
            crate::producer::send(&self.dlq, &topic, &key, body.as_bytes(), &[("error-code", code)]).await
        {
            attempt += 1;
            tracing::warn!(consumer = name, error = %e, attempt, "dead-letter publish failed; retrying");
            if self.shutdown.is_cancelled() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200 * attempt.min(10) as u64)).await;
        }
        metrics::counter!("boxoffice_dead_letters_total", "consumer" => name, "code" => code.to_owned())
            .increment(1);
    }
}

/// Every 5 s, exports `boxoffice_consumer_lag{consumer, partition}`: the partition's high
/// watermark minus this member's position, for each partition it holds (design §16: lag by
/// partition shows a slow worker or a hot key).
async fn report_lag(consumer: Arc<GroupConsumer>, name: &'static str, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
        let c = consumer.clone();
        let lags = tokio::task::spawn_blocking(move || -> Vec<(i32, i64)> {
            let Ok(positions) = c.position() else { return vec![] };
            positions
                .elements()
                .iter()
                .filter_map(|e| {
                    let Offset::Offset(pos) = e.offset() else { return None };
                    let (_, high) =
                        c.fetch_watermarks(e.topic(), e.partition(), Duration::from_secs(2)).ok()?;
                    Some((e.partition(), (high - pos).max(0)))
                })
                .collect()
        })
        .await
        .unwrap_or_default();
        for (partition, lag) in lags {
            metrics::gauge!("boxoffice_consumer_lag", "consumer" => name, "partition" => partition.to_string())
                .set(lag as f64);
        }
    }
}

/// Commits `offset` (the next to read) for one partition, asynchronously: a lost commit only
/// replays messages into the inbox.
fn commit(consumer: &GroupConsumer, name: &'static str, topic: &str, partition: i32, offset: i64) {
    let mut tpl = TopicPartitionList::new();
    if tpl.add_partition_offset(topic, partition, Offset::Offset(offset)).is_ok() {
        if let Err(e) = consumer.commit(&tpl, CommitMode::Async) {
            tracing::debug!(consumer = name, error = %e, "offset commit failed; messages will replay into the inbox");
        }
    }
}

/// The lane of a message key (FNV-1a), so one order always lands in the same lane.
fn lane_of(key: &[u8], lanes: usize) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % lanes as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_point_is_lowest_unfinished_offset() {
        let mut f = InFlight::default();
        for o in [10, 11, 12] {
            f.start("t", 0, o);
        }
        assert_eq!(f.finish("t", 0, 11), None, "10 is still in flight");
        assert_eq!(f.finish("t", 0, 10), Some(12));
        assert_eq!(f.finish("t", 0, 12), Some(13));
        f.start("t", 0, 13);
        assert_eq!(f.finish("t", 0, 13), Some(14));
    }

    #[test]
    fn a_key_always_maps_to_one_lane() {
        assert_eq!(lane_of(b"order-1", 8), lane_of(b"order-1", 8));
        assert!(lane_of(b"order-2", 8) < 8);
    }
}
