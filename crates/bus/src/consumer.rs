//! The consumer runner (design §8): each message is applied at most once per consumer and
//! never skipped.
//!
//! For each message: decode the envelope; skip types the handler does not want; skip event
//! ids already in the inbox; run the handler's `prepare` step outside any transaction (where
//! remote calls such as Stripe happen, each with a stable idempotency key); then, in one
//! PostgreSQL transaction, insert `(consumer, event_id)` into the inbox, apply the effect and
//! write the facts it emits to the outbox; commit; and only then commit the Kafka offset (batched, see [`run_consumers`]). A crash anywhere before the offset commit
//! replays the message, and the inbox turns the replay into a no-op (invariant 4).
//!
//! **Retries** (design §8). A transient error (database unreachable, provider 5xx, timeout, an
//! injected fault) rolls back and is retried in place a few times with short jittered backoff
//! (`RetryPolicy::inline_attempts`, about a second in all). If it still fails, the message is
//! copied to `ticketing.purchase.retry-5s.v1`, its offset is committed and the partition moves on.
//! A statement the database gave up for want of time or room ([`boxoffice_store::is_overload`]:
//! its `statement_timeout`, too many connections, …; [`HandlerError::Overloaded`]) is not tried
//! again in place, where every attempt would add to the load and hold the lane for up to the
//! statement timeout: the message is copied to the retry topic after that one attempt, and so
//! is every message of a shared batch that failed so (they are not processed alone).
//! Each consumer also runs a member on each retry topic: it takes only the copies addressed to it
//! (`x-retry-consumer` header), waits until the copy is due (`x-retry-not-before-ms`), and tries
//! once more; a failure there moves the copy to `ticketing.purchase.retry-1m.v1`, which retries
//! every minute until `RetryPolicy::max_attempts` attempts in all have failed. Then, as for a
//! permanent error (undecodable envelope or payload, impossible transition), the message goes to
//! the dead-letter topic with its original topic/partition/offset, the consumer, the error code and
//! the attempt count, and the runner moves on (a main-topic message that is no envelope at all
//! goes there from one consumer group only: [`Handler::dead_letters_unreadable`]). A copy is
//! durable in the next topic before the offset of the original is committed, so a crash in
//! between only duplicates it (into the inbox).
//!
//! **Batches.** On the purchase topic, a consumer applies what has queued up for one lane —
//! at most `consumer_batch_max` messages: what is queued when the lane is free, and what
//! arrives within `consumer_batch_linger_ms` after the batch's first message reached the lane
//! ([`Members`]; zero: never waiting for more) — in one transaction. First,
//! outside any transaction, the `prepare` of every message of the batch, all at once (they
//! are of different orders): for the payment worker these are its Stripe calls, each with
//! its own stable idempotency key, so a batch of k commands asks for k concurrent provider
//! calls and a main-topic member for at most `consumer_lanes` × `consumer_batch_max` (its
//! retry-topic members, two lanes each, call one at a time; batches form when messages queue
//! up while a lane works or arrive in one fetch ([`Fetch`]), and fill under a backlog), of which the process's Stripe client lets
//! `stripe_max_in_flight` be in flight at once, for all its roles together. What those calls
//! check in the ledger first (the inbox, the order's state) is read before them for the
//! whole batch in one statement (`Handler::precheck`), holding a connection only for that
//! read, never across a provider call. Then
//! the transaction: the inbox
//! rows of all of them in one statement; then the rows the effects of the messages whose row
//! was new work on, locked and read for all of them at once (`Handler::lock_rows`: the saga
//! and the ticket worker lock every order's hold and order in one statement, in ascending
//! order id, and the saga reads the payment rows in one more; the payment worker locks the
//! holds, then reads its re-fetches' payment rows in one more); then per such message, in the
//! order of their order ids (so two shared transactions lock their orders' rows in one order
//! and never deadlock each other) and in its own consumer span, the effect with what its
//! `prepare` returned and the rows locked for it; then the facts and commands all of them emit, in one outbox statement (each row
//! with its own message's trace context); then one commit, and the offsets of all of them
//! only after it. A batch may contain facts of different orders, at most one fact per order
//! (a second fact of an order starts the next transaction, after the commit of the first: a
//! lane holds every message of its keys in partition order, so one order's facts are still
//! applied in that order — and a command's provider call is made only after the previous
//! command of its order committed — and each transaction applies one fact of an order, the
//! step the per-order timeline shows), and copies of a fact already applied (the inbox turns
//! them into nothing; the payment worker's pre-check skips their provider call). It never
//! contains a retry-topic copy, an undecodable envelope or a fact of another region epoch:
//! those are processed alone, after the messages before them. A message whose `prepare`
//! fails (a provider error, or a read of its own) is left out of the transaction whole — no
//! inbox row, no effect — and processed alone after its commit, with its own attempts, retry
//! topics and dead letter; the others' answers are recorded, so their calls are not made
//! twice. If the batch's pre-check read or anything in the shared transaction fails (or every
//! `prepare` did), all of it is
//! rolled back and each of its messages is processed alone (or, when the database gave the
//! transaction up, handed to the retry topic: "Retries"), so one bad message costs the
//! others a second try and nothing else: their provider calls are sent again under the same
//! idempotency keys, and a call that succeeded the first time gets its first answer back (a
//! re-fetch, a read, gets the provider's state then). Messages of a type the
//! consumer does not act on are acknowledged unread, by the relay's `event-type` header when
//! it is there (the relay writes it from the outbox row the envelope is made of; a message
//! without it is decoded). A decoded fact whose handler does not act on it
//! (`Handler::acts_on`, decided from the payload alone) is acknowledged the same way: no
//! inbox row, no transaction.
//!
//! **Transaction slots.** A main-topic member may let fewer of its lanes be inside a
//! transaction at once than it has lanes (`consumer_transactions_max`, [`Members`]; zero:
//! one per lane). A lane takes a slot once its batch's (or its message's) provider calls
//! have answered, just before `BEGIN`, and gives it back when it is done with that
//! transaction — after the commit, or on an error as it drops the transaction (whose
//! rollback then goes out as the connection returns to the pool, so for a moment a failed
//! transaction's locks can outlive its slot) — so the provider calls of every lane still
//! run at once, no lane waits for a slot while it holds a row lock or a connection, and a
//! lane that waits keeps the answers it already has. Fewer transactions compete for the
//! database's cores at once; while a lane waits, more messages can queue up for it, so
//! under a backlog its next batch may be larger (up to `consumer_batch_max`). Nothing else
//! changes: the same messages share the same transactions by the same rules, in the same
//! order. Retry-topic members and the transaction that parks a fact of another region
//! epoch take no slot. The cost: a transaction that waits — for a row lock another session
//! holds, or for a database that does not answer — keeps its slot while it waits, up to
//! `db_statement_timeout_ms` per statement, and with one slot every lane of the member
//! waits with it (without slots only its own lane would). At shutdown a lane waiting for a
//! slot waits on and applies its batch, as every lane finishes the batch in hand, so a
//! member with one slot stops once its lanes' transactions have run one after another.
//!
//! **Group commit.** With `consumer_group_commit` ([`Members`]) a main-topic member does not
//! let each lane open its own transaction: a lane whose batch's calls have answered hands
//! its run — with a run of one message too, which otherwise is processed alone — and the
//! answers to the member's one committer (`GroupCommit`) and waits for its dispositions.
//! The committer takes the first run that arrives and every run already waiting behind it
//! (up to `consumer_lanes` × `consumer_batch_max` messages; a run with an order already in the
//! group starts the next one, so a transaction still applies at most one fact per order) and
//! applies them in one transaction, exactly as one lane's shared run: one inbox statement, the
//! rows of all of them locked at once in order-id order, the effects, one outbox statement,
//! one commit. So every lane still makes its provider calls at once while the member has at
//! most `consumer_group_commits_max` (default 1) group transactions open at once, and what
//! queued up while they were open shares the next one: with more than one, the runs that
//! arrive while one commits go on at once, on another connection, instead of queueing behind
//! it. A lane hands over its next run only once its last one
//! is answered, so the open groups never share an order whose facts are keyed by it (as the
//! relay keys them); a message keyed otherwise could put one order in two open groups, whose
//! row locks then order them as they order two lanes' own transactions. When a
//! group of several runs fails for good (a fact the ledger refuses), each run is committed
//! alone in its own transaction with the answers it has (no provider call is made again for
//! it), and the run that fails again is processed as a failed shared run is (one by one).
//! Any other failure of a group (transient, a follower's, the database giving it up) is
//! every run's: each lane processes its run as a failed shared run, one by one or, when the
//! database gave the group up, by handing it to the retry topic — outside the committer, so
//! what failed for all of them is not repeated there while the other lanes wait. The cost:
//! group transactions that wait hold up the commits of every lane of the member once all the
//! open ones wait (with `consumer_group_commits_max` 1, one that waits does, as one
//! transaction slot does). For a row lock that wait is bounded: a group transaction waits at
//! most [`GROUP_LOCK_TIMEOUT_MS`] for each lock (`lock_timeout`, set in its `BEGIN`; counted
//! per lock, not per transaction), then fails as transient, and each of its lanes applies its
//! run alone, where only the lane of the locked order waits for the lock (up to
//! `db_statement_timeout_ms`, as without a committer).
//! A message processed alone (a retry copy, one whose `prepare`
//! failed, one of a failed run) does not go through the committer.
//!
//! **Following through** ([`crate::follow`]). A consumer's transaction can also run, for the
//! facts it emits, the steps of the consumers of this process that make no remote call (the
//! saga, the ticket worker): their inbox rows and effects join the transaction, and the facts
//! name them in `applied_by`. When such a fact reaches one of them on the bus it is
//! acknowledged like a fact it does not act on (its inbox row is already there). If a
//! follower fails, the whole transaction is rolled back and the message is applied again
//! without followers, so a follower's failure never holds back the writer's own step, not
//! even when the database gave the follower's statement up (the writer's step may not touch
//! what the follower waited on: a locked `tickets` table must not keep a capture from being
//! recorded). A shared batch follows its facts after all its messages, before its commit; a
//! follower's failure there fails the batch, whose messages are then applied one by one, each
//! with its followers first and, when they fail, again without them.
//!
//! **Facts of an older region epoch** (design §15). After a regional failover the promoted
//! region's consumers may read facts stamped with the fenced epoch (`region_epoch`): those
//! inside the promoted ledger's cut are applied as usual (the inbox absorbs the ones
//! `region republish` sends again); one whose outbox row this ledger does not have is an
//! orphan, parked as an `orphan_fact` incident and never applied ([`handle_once_at`]).
//!
//! **Claims only the ledger makes** ([`Handler::verifies`]). A fact a consumer verifies
//! (every fact the saga, the payment worker and the ticket worker read) is applied from the
//! bus only when this ledger committed it: one statement looks for the run's facts in the
//! outbox and `order_history` (the same id, type, order and payload) — in the effect's
//! transaction, after the inbox rows, or, for a handler that calls out (the payment worker),
//! before the run's provider calls, so no call is made for such a fact (and the facts found
//! then are not looked up again). One found in neither — written to the topic by anyone but
//! the ledger's writers, with a fresh id or one borrowed from a real fact — is recorded as an
//! `unknown_fact` incident, never applied ([`Disposition::Unknown`]), and the rest of its run
//! goes on. Its inbox row is taken back in the same transaction: a forged message read first
//! (from another partition, or while the real fact waits in a retry topic), of the real
//! fact's type or any other, leaves the id free for the real one, which is applied when it
//! comes; each delivery of a forged fact is an incident. A fact followed through in the
//! transaction that writes it is not read from the bus and is not looked up.
//!
//! **Trace context** (design §16). Each attempt at a message runs inside a consumer span
//! (`otel.kind = consumer`) whose parent is the message's `traceparent` header — the stored
//! context of the span that committed the fact — or, for a copy that lost its headers (a
//! replayed dead letter), the envelope's `traceparent`. The span carries the `messaging.*`
//! attributes (topic, partition, offset, consumer group) and the fact's ids (`order.id`,
//! `correlation_id`, `causation_id`, `event_id`, `event_type`, `region`, `purchase_cell`), so
//! every log line of the handler has them too, and every fact the handler writes to the
//! outbox stores the consumer span's context: the purchase's trace goes on. Retry and
//! dead-letter copies keep the original's `traceparent` header.
//!
//! **What ordering still holds.** Within a partition, the messages of one order (one key)
//! are applied in offset order by one lane, as long as each succeeds within its in-place
//! attempts. A message that moves to a retry topic gives up its place: later messages of
//! the same order may be applied before it. Nothing in boxoffice relies on more than that:
//! the saga decides from the order's and hold's locked rows, not from arrival order (a late
//! authorization after expiry is compensated, a duplicate fact finds the order moved on);
//! the payment worker re-reads the order before each Stripe call and uses stable
//! idempotency keys; ticket issuance is idempotent per seat. Retry copies of one order keep
//! their relative order inside a retry topic (same key, same partition, one lane).

use crate::follow::Followers;
use crate::{KafkaConfig, RetryPolicy};
use async_trait::async_trait;
use boxoffice_domain::{Envelope, EventKind, PurchaseEvent, Topic};
use boxoffice_store::{inbox, outbox, Tx};
use rand::Rng;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::producer::FutureProducer;
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use sqlx::PgPool;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// How a handler failed.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Worth retrying the same message later (the effect was rolled back).
    #[error("transient: {0:#}")]
    Transient(#[source] anyhow::Error),
    /// The database gave a statement up for want of time or room
    /// ([`boxoffice_store::is_overload`]; the effect was rolled back): worth retrying, but not
    /// in place, where it would add to the load — the message goes to the next retry topic
    /// at once, and a shared batch's messages with it.
    #[error("database overloaded: {0:#}")]
    Overloaded(#[source] anyhow::Error),
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

    /// The same failure again, with its message (for each lane of a group that failed).
    fn again(&self) -> Self {
        match self {
            Self::Transient(e) => Self::Transient(anyhow::anyhow!("{e:#}")),
            Self::Overloaded(e) => Self::Overloaded(anyhow::anyhow!("{e:#}")),
            Self::Permanent { code, source } => {
                Self::Permanent { code, source: anyhow::anyhow!("{source:#}") }
            }
        }
    }
}

impl From<sqlx::Error> for HandlerError {
    fn from(e: sqlx::Error) -> Self {
        if boxoffice_store::is_retryable(&e) {
            Self::Transient(e.into())
        } else if boxoffice_store::is_overload(&e) {
            Self::Overloaded(e.into())
        } else {
            Self::Permanent { code: "database_error", source: e.into() }
        }
    }
}

impl From<boxoffice_faults::Injected> for HandlerError {
    fn from(e: boxoffice_faults::Injected) -> Self {
        Self::Transient(e.into())
    }
}

impl From<boxoffice_store::StoreError> for HandlerError {
    fn from(e: boxoffice_store::StoreError) -> Self {
        match e {
            boxoffice_store::StoreError::Db(e) => e.into(),
            e @ boxoffice_store::StoreError::IllegalTransition(_) => Self::permanent("illegal_transition", e),
            other => Self::permanent("corrupt_row", other),
        }
    }
}

/// One consumer of the purchase topic.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// What `prepare` hands to `apply` (e.g. the provider's answer).
    type Prepared: Send + Clone + 'static;

    /// The consumer's name: its inbox key and consumer group (`ticketing-{name}`).
    fn name(&self) -> &'static str;

    /// Whether this consumer acts on facts of `kind`; other messages (and event types this
    /// build does not know) are acknowledged unread.
    fn wants(&self, kind: EventKind) -> bool;

    /// Whether this consumer acts on this decoded fact of a kind it [`Handler::wants`]; a
    /// fact it does not act on is acknowledged like an unwanted kind: no inbox row, no
    /// transaction. For what the payload alone rules out (the saga and a `HoldCreated` whose
    /// authorization the hold requested itself; the payment worker and a `HoldCreated` that
    /// is not the request); anything that depends on the ledger is decided in `apply`.
    fn acts_on(&self, _event: &PurchaseEvent) -> bool {
        true
    }

    /// Whether this fact, read from the bus, must be one this ledger committed before it is
    /// applied or takes an inbox row: the purchase path's consumers (saga, payment worker,
    /// ticket worker) verify every fact, since anyone who can write to the topic could
    /// otherwise make a claim only the ledger's writers may make, or borrow a real fact's id
    /// with a message of any type that is then applied or refused and takes the id's inbox
    /// row, so that the real fact arrives as a duplicate. The runner looks for its outbox or
    /// history row ([`boxoffice_store::outbox::not_committed`]): before the provider calls for
    /// a handler that [`Handler::calls_out`] (a fact found then is not looked up again: the
    /// outbox's prune moves a row into the history in one statement), in the effect's
    /// transaction otherwise; one this ledger did not commit is recorded as an
    /// `unknown_fact` incident, never applied, and leaves no inbox row
    /// ([`Disposition::Unknown`]: the id may be a real fact's, still to come). A fact followed
    /// through in the transaction that writes it ([`crate::follow`]) is not read from the bus
    /// and is not checked. Default: no fact (for handlers fed by something else than the
    /// ledger's outbox).
    fn verifies(&self, _event: &PurchaseEvent) -> bool {
        false
    }

    /// Whether this consumer dead-letters a main-topic message that is no envelope at all
    /// (`bad_envelope`, `empty_message`). Such a message is the same bytes for every consumer
    /// group that reads the topic, and no consumer can ever apply it, so one group keeps it
    /// (the saga's, which every deployment runs) and the others acknowledge it with a count
    /// (`boxoffice_unreadable_messages_skipped_total{consumer}`): junk written to the topic is
    /// not copied to the dead-letter topic once per group. A retry-topic copy is addressed to
    /// one consumer, which dead-letters it whatever this says. Default: true.
    fn dead_letters_unreadable(&self) -> bool {
        true
    }

    /// Whether `prepare` calls out (e.g. to Stripe): then the runner first checks the inbox
    /// so a known duplicate costs no remote call. Handlers without remote work skip that
    /// read; the inbox insert in the transaction still catches duplicates.
    fn calls_out(&self) -> bool {
        false
    }

    /// What `precheck` found of this message in the consumer's inbox: `Some(applied)` from a
    /// pre-check that reads the inbox itself, in its own statement (the runner then reads it
    /// no more, and prepares no message applied already); `None`, the default, from one that
    /// does not: for a handler that [`Handler::calls_out`] the runner then reads the inbox
    /// before `prepare`, so a known duplicate costs no remote call. A duplicate that gets
    /// past either is still caught by the inbox insert in the effect's transaction.
    fn applied(&self, _precheck: &Self::Precheck) -> Option<bool> {
        None
    }

    /// What [`Handler::precheck`] reads for one message and hands to its `prepare` (`()`
    /// for a handler that reads nothing first).
    type Precheck: Send + Sync + Default;

    /// Reads, outside any transaction, what the `prepare` of each message of `run` checks in
    /// the ledger before it calls out — for a shared batch, in one statement for all of them
    /// instead of one each; for a message processed alone, `run` has that message only. One
    /// [`Handler::Precheck`] per message, in `run`'s order. Read again before each attempt.
    /// An error fails every message of `run` (a batch's are then processed alone). Default:
    /// reads nothing.
    async fn precheck(
        &self,
        run: &[(&Envelope, &PurchaseEvent)],
    ) -> Result<Vec<Self::Precheck>, HandlerError> {
        Ok(run.iter().map(|_| Self::Precheck::default()).collect())
    }

    /// Work outside any transaction (remote calls with stable idempotency keys), given what
    /// [`Handler::precheck`] read for this message. May run more than once for one message.
    async fn prepare(
        &self,
        env: &Envelope,
        event: &PurchaseEvent,
        precheck: Self::Precheck,
    ) -> Result<Self::Prepared, HandlerError>;

    /// What [`Handler::lock_rows`] locks and reads for one message in the effect's
    /// transaction and hands to its `apply` (`()` for a handler whose `apply` reads its rows
    /// itself).
    type Rows: Send + Default;

    /// Locks and reads, inside the effect's transaction and before any effect of `run` runs,
    /// the rows each message's `apply` works on — for a shared batch, or a follower's run of
    /// facts ([`crate::follow`]), in one statement for all of them instead of one each.
    /// `run` holds the messages whose effects are about to run, in the order they will run
    /// (a shared batch's: ascending order id). One [`Handler::Rows`] per message, in `run`'s
    /// order; `Rows::default()` tells `apply` to read its rows itself — what a handler must
    /// hand to any message whose rows an earlier effect of `run` may change. The runner and
    /// the followers put facts of distinct orders in one run (a shared batch has one fact per
    /// order; a follower's run ends before a second fact of an order), which is enough for a
    /// handler whose effect changes only its own order's rows, as the saga's and the ticket
    /// worker's do (both still give a repeated order `Rows::default()`, whoever passes one).
    /// An error fails the transaction. Default: reads nothing.
    async fn lock_rows(
        &self,
        _tx: &mut Tx<'_>,
        run: &[(&Envelope, &PurchaseEvent)],
    ) -> Result<Vec<Self::Rows>, HandlerError> {
        Ok(run.iter().map(|_| Self::Rows::default()).collect())
    }

    /// The effect, inside the transaction that also records the inbox row, given the rows
    /// [`Handler::lock_rows`] locked for it. Returns the facts and commands that follow (made
    /// with [`Envelope::follow`]), which the runner writes to the outbox in the same
    /// transaction with the consumer span's trace context — for a batch, those of all its
    /// messages in one statement before the commit.
    async fn apply(
        &self,
        tx: &mut Tx<'_>,
        env: &Envelope,
        event: &PurchaseEvent,
        prepared: Self::Prepared,
        rows: Self::Rows,
    ) -> Result<Vec<Envelope>, HandlerError>;
}

/// [`Handler::lock_rows`] of `run`, one per message or an error.
pub(crate) async fn rows_of<H: Handler>(
    handler: &H,
    tx: &mut Tx<'_>,
    run: &[(&Envelope, &PurchaseEvent)],
) -> Result<Vec<H::Rows>, HandlerError> {
    let rows = handler.lock_rows(tx, run).await?;
    if rows.len() != run.len() {
        return Err(HandlerError::permanent(
            "lock_rows_count",
            anyhow::anyhow!("{} row sets for {} messages", rows.len(), run.len()),
        ));
    }
    Ok(rows)
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
    /// A fact of another region epoch (or, after a failover, of none) that is not in this
    /// ledger's cut: recorded in the inbox and as an `orphan_fact` incident, never applied.
    Orphan,
    /// A fact this ledger did not commit, of a kind the consumer [`Handler::verifies`] (a
    /// forged one, or one older than the history's retention): recorded as an `unknown_fact`
    /// incident, never applied; its inbox row is taken back in the same transaction, so a
    /// real fact with the same id is still applied when it comes.
    Unknown,
}

/// Which facts of `run` (read from the bus) the handler [`Handler::verifies`] and this ledger
/// did not commit, each recorded as an `unknown_fact` incident in `tx` and taken out of the
/// inbox again (the caller recorded the run's rows before); no statement when the handler
/// verifies none of them, one more (the inbox's) only when one is unknown.
async fn park_unknown<H: Handler>(
    tx: &mut Tx<'_>,
    handler: &H,
    run: &[(&Envelope, &PurchaseEvent)],
) -> Result<std::collections::HashSet<uuid::Uuid>, HandlerError> {
    let claims: Vec<&Envelope> =
        run.iter().filter(|(_, event)| handler.verifies(event)).map(|(env, _)| *env).collect();
    if claims.is_empty() {
        return Ok(Default::default());
    }
    let unknown = outbox::not_committed(&mut **tx, &claims).await?;
    // Not recorded as applied: a forged copy may borrow the id of a real fact still on its
    // way (another partition, a retry topic), which must then be applied, not skipped.
    inbox::forget_all(tx, handler.name(), &unknown).await?;
    for (env, _) in run.iter().filter(|(env, _)| unknown.contains(&env.event_id)) {
        boxoffice_store::stripe_events::incident(
            tx,
            Some(boxoffice_domain::OrderId(env.aggregate_id)),
            "unknown_fact",
            serde_json::json!({
                "consumer": handler.name(),
                "event_id": env.event_id,
                "event_type": env.event_type,
            }),
        )
        .await?;
        tracing::warn!(consumer = handler.name(), event.id = %env.event_id, event.type = %env.event_type,
            order.id = %env.aggregate_id, "a fact this ledger did not commit: parked, not applied");
    }
    Ok(unknown.into_iter().collect())
}

/// The first statements of a message's own transaction `tx`: its inbox row, then, for a fact
/// the handler verifies that this ledger did not commit, the `unknown_fact` incident (not
/// looked up when `looked_up`: found committed before the provider call). `Some` when
/// nothing is left to apply — `Duplicate` (the row was there; `tx` is rolled back as it is
/// dropped) or `Unknown` (`tx` committed) — and `None` (`tx` handed back) to apply it.
async fn recorded_or_parked<H: Handler>(
    mut tx: Tx<'static>,
    handler: &H,
    env: &Envelope,
    event: &PurchaseEvent,
    looked_up: bool,
) -> Result<Result<Disposition, Tx<'static>>, HandlerError> {
    if !inbox::record(&mut tx, handler.name(), env.event_id).await? {
        return Ok(Ok(Disposition::Duplicate));
    }
    if looked_up || park_unknown(&mut tx, handler, &[(env, event)]).await?.is_empty() {
        return Ok(Err(tx));
    }
    tx.commit().await?;
    Ok(Ok(Disposition::Unknown))
}

/// For a handler that [`Handler::calls_out`]: which facts of `run` it verifies that this
/// ledger did not commit, read before any provider call (one statement, outside any
/// transaction), so a forged command costs no call; [`park_unknown`] then records them in
/// the effect's transaction. Empty, without a statement, for any other handler.
async fn unverified_before_call<H: Handler>(
    pool: &PgPool,
    handler: &H,
    run: &[(&Envelope, &PurchaseEvent)],
) -> Result<std::collections::HashSet<uuid::Uuid>, HandlerError> {
    let claims: Vec<&Envelope> =
        run.iter().filter(|(_, event)| handler.verifies(event)).map(|(env, _)| *env).collect();
    if claims.is_empty() || !handler.calls_out() {
        return Ok(Default::default());
    }
    Ok(outbox::not_committed(pool, &claims).await?.into_iter().collect())
}

/// Applies one envelope once: the inbox check, `prepare`, then inbox + `apply` in one
/// transaction. Public so tests can drive a handler without a broker.
///
/// Fault points (`boxoffice_faults`): `{consumer}.before_remote` / `.after_remote` around
/// `prepare`, `.before_commit` / `.after_commit` around the commit.
pub async fn handle_once<H: Handler>(
    pool: &PgPool,
    handler: &H,
    env: &Envelope,
) -> Result<Disposition, HandlerError> {
    handle_once_at(pool, handler, env, None).await
}

/// [`handle_once`] for a process writing at region epoch `writer_epoch` (design §15). A fact
/// stamped with another epoch — an older one is a fenced writer's claim; a newer one no
/// writer legitimately has; and once a failover has happened (`writer_epoch` > 1), a fact with
/// no epoch came from a session the fence did not check — is applied only when its
/// outbox row is in this ledger (committed before the recovery point, replayed by `region
/// republish` or still in flight from before the failover). Otherwise it was committed by the
/// old primary after the cut, or by a zombie: its effects are not in this ledger, so it is
/// parked (inbox row plus an `orphan_fact` incident, in one transaction) and never applied,
/// and `prepare` (any remote call) is not run for it.
pub async fn handle_once_at<H: Handler>(
    pool: &PgPool,
    handler: &H,
    env: &Envelope,
    writer_epoch: Option<i64>,
) -> Result<Disposition, HandlerError> {
    let span = consumer_span(handler.name(), env, None, &boxoffice_trace::Labels::default());
    apply_once(pool, handler, env, writer_epoch, &Followers::none(), &TxSlots::unlimited())
        .instrument(span)
        .await
}

/// [`handle_once`] with `followers` following the facts it emits through in its transaction
/// ([`crate::follow`]), as a process running those consumers too does.
pub async fn handle_once_following<H: Handler>(
    pool: &PgPool,
    handler: &H,
    followers: &Followers,
    env: &Envelope,
) -> Result<Disposition, HandlerError> {
    let span = consumer_span(handler.name(), env, None, &boxoffice_trace::Labels::default());
    apply_once(pool, handler, env, None, followers, &TxSlots::unlimited()).instrument(span).await
}

/// Where a message was read: what the consumer span says about it besides the fact's ids.
#[derive(Debug, Clone, Copy)]
pub struct Delivery<'a> {
    /// The physical topic read.
    pub topic: &'a str,
    /// Its partition.
    pub partition: i32,
    /// The message's offset.
    pub offset: i64,
    /// The physical consumer group.
    pub group: &'a str,
    /// The message's `traceparent` header.
    pub traceparent: Option<&'a str>,
    /// Attempts at the message before this one.
    pub attempt: u32,
}

/// The span one attempt at `env` runs in: a consumer span whose parent is the delivery's
/// `traceparent` header, else the envelope's (see the module doc). Always created (its fields
/// are on every log line of the handler); joined to the stored trace only when tracing is on.
pub fn consumer_span(
    consumer: &'static str,
    env: &Envelope,
    delivery: Option<&Delivery<'_>>,
    labels: &boxoffice_trace::Labels,
) -> tracing::Span {
    use tracing::field::Empty;
    let span = tracing::info_span!("consume",
        otel.name = %format_args!("process {}", delivery.map_or("message", |d| d.topic)),
        otel.kind = "consumer",
        otel.status_code = Empty,
        messaging.system = "kafka",
        messaging.operation.type = "process",
        messaging.destination.name = delivery.map(|d| d.topic),
        messaging.destination.partition.id = delivery.map(|d| display(d.partition)),
        messaging.kafka.destination.partition = delivery.map(|d| d.partition),
        messaging.kafka.message.offset = delivery.map(|d| d.offset),
        messaging.consumer.group.name = delivery.map(|d| d.group),
        messaging.message.id = %env.event_id,
        retry.attempt = delivery.map(|d| d.attempt),
        consumer,
        order.id = %env.aggregate_id,
        correlation_id = %env.correlation_id,
        causation_id = env.causation_id.as_ref().map(display),
        event_id = %env.event_id,
        event_type = %env.event_type,
        region = env.region.as_deref().unwrap_or(&labels.region),
        purchase_cell = %labels.purchase_cell,
    );
    if boxoffice_trace::enabled() {
        let parent = delivery.and_then(|d| d.traceparent).or(env.traceparent.as_deref());
        boxoffice_trace::set_parent(&span, parent);
    }
    span
}

async fn apply_once<H: Handler>(
    pool: &PgPool,
    handler: &H,
    env: &Envelope,
    writer_epoch: Option<i64>,
    followers: &Followers,
    slots: &TxSlots,
) -> Result<Disposition, HandlerError> {
    if !EventKind::of(&env.event_type).is_some_and(|kind| handler.wants(kind)) {
        return Ok(Disposition::Ignored);
    }
    let event = env.decode().map_err(|e| HandlerError::permanent("bad_payload", e))?;
    let name = handler.name();
    if let Some(mine) = writer_epoch {
        // Facts of this epoch are this ledger's. Any other one is checked against the ledger:
        // an older epoch's (a fenced writer's), a newer one's (no writer legitimately has it),
        // and, once a failover has happened, one without an epoch (written by a session that
        // declared none, which the fence did not check).
        let suspect = match env.region_epoch {
            Some(theirs) => theirs != mine,
            None => mine > 1,
        };
        if suspect {
            let theirs = env.region_epoch;
            let mut tx = pool.begin().await?;
            if boxoffice_store::region::fact_in_cut(&mut tx, env.event_id).await? {
                tx.rollback().await?;
            } else {
                if !inbox::record(&mut tx, name, env.event_id).await? {
                    return Ok(Disposition::Duplicate);
                }
                boxoffice_store::stripe_events::incident(
                    &mut tx,
                    Some(boxoffice_domain::OrderId(env.aggregate_id)),
                    "orphan_fact",
                    serde_json::json!({
                        "consumer": name,
                        "event_id": env.event_id,
                        "event_type": env.event_type,
                        "region": env.region,
                        "region_epoch": theirs,
                        "writer_epoch": mine,
                    }),
                )
                .await?;
                tx.commit().await?;
                tracing::warn!(consumer = name, event.id = %env.event_id, event.type = %env.event_type,
                    order.id = %env.aggregate_id, region_epoch = ?theirs, writer_epoch = mine,
                    "fact of another region epoch outside this ledger's cut: parked, not applied");
                return Ok(Disposition::Orphan);
            }
        }
    }
    // After the epoch check: a fenced writer's fact is parked even if this consumer would
    // not act on it.
    if !handler.acts_on(&event) {
        return Ok(Disposition::Ignored);
    }
    if env.was_applied_by(name) {
        // Applied in the transaction that committed it (crate::follow): its inbox row is there.
        return Ok(Disposition::Duplicate);
    }
    // With followers first; if following fails, everything is rolled back and the message is
    // applied again alone (crate::follow, "Failure isolation").
    let mut followers = followers;
    let none = Followers::none();
    loop {
        let precheck = prechecks_of(handler, &[(env, &event)]).await?.pop().unwrap_or_default();
        if known_duplicate(pool, handler, env, &precheck).await? {
            return Ok(Disposition::Duplicate);
        }
        if !unverified_before_call(pool, handler, &[(env, &event)]).await?.is_empty() {
            // No call for a claim this ledger did not make: recorded and parked.
            if let Ok(d) = recorded_or_parked(pool.begin().await?, handler, env, &event, false).await? {
                return Ok(d);
            }
        }
        boxoffice_faults::check_consumer(name, "before_remote")?;
        let prepared = handler.prepare(env, &event, precheck).await?;
        boxoffice_faults::check_consumer(name, "after_remote")?;
        // Held until the transaction ends (this loop turn), taken after the provider call.
        let _slot = slots.take().await;
        // A handler that calls out looked it up before the call (above).
        let looked_up = handler.calls_out();
        let mut tx = match recorded_or_parked(pool.begin().await?, handler, env, &event, looked_up).await? {
            Ok(d) => return Ok(d),
            Err(tx) => tx,
        };
        let rows = rows_of(handler, &mut tx, &[(env, &event)]).await?.pop().unwrap_or_default();
        let emitted: Vec<outbox::Traced> = handler
            .apply(&mut tx, env, &event, prepared, rows)
            .await?
            .into_iter()
            .map(outbox::Traced::here)
            .collect();
        let (facts, followed) = match followers.follow(&mut tx, emitted).await {
            Ok(r) => r,
            Err(e) => {
                drop(tx);
                follow_failed(name, env, &e);
                followers = &none;
                continue;
            }
        };
        outbox::insert_traced_with_inbox(&mut tx, &facts, followed.inbox_rows()).await?;
        boxoffice_faults::check_consumer(name, "before_commit")?;
        tx.commit().await?;
        boxoffice_faults::check_consumer(name, "after_commit")?;
        Followers::after_commit(&followed)?;
        return Ok(Disposition::Applied);
    }
}

/// Applies `envs` — facts of different orders, at most one of each — as a lane's shared batch
/// is applied ([`apply_shared`]; the module doc, "Batches"): every `prepare` first, outside any
/// transaction, then one transaction for all of them. A fact the handler does not want or act
/// on is `Some(Ignored)` and left out; a fact whose `prepare` failed is `None` (nothing of it
/// was written; the runner then processes it alone). Public so tests can drive a handler's
/// batch without a broker; unlike the runner, it does not process anything alone itself.
///
/// # Errors
/// `bad_payload` (permanent) for an undecodable fact, `duplicate_order_in_batch` for two facts
/// of one order; otherwise the error of the transaction, or the first `prepare`'s when all of
/// them failed (nothing of the batch is then committed, unless the failure came after the
/// commit).
pub async fn handle_batch<H: Handler>(
    pool: &PgPool,
    handler: &H,
    followers: &Followers,
    envs: &[Envelope],
) -> Result<Vec<Option<Disposition>>, HandlerError> {
    let mut out = vec![Some(Disposition::Ignored); envs.len()];
    let mut run = Vec::new();
    let mut events = Vec::with_capacity(envs.len());
    for env in envs {
        events.push(env.decode().map_err(|e| HandlerError::permanent("bad_payload", e))?);
    }
    for (k, (env, event)) in envs.iter().zip(&events).enumerate() {
        let wanted = EventKind::of(&env.event_type).is_some_and(|kind| handler.wants(kind));
        if !wanted || !handler.acts_on(event) || env.was_applied_by(handler.name()) {
            continue;
        }
        if run
            .iter()
            .any(|(_, (e, _)): &(usize, (&Envelope, &PurchaseEvent))| e.aggregate_id == env.aggregate_id)
        {
            return Err(HandlerError::permanent(
                "duplicate_order_in_batch",
                anyhow::anyhow!("two facts of order {} in one batch", env.aggregate_id),
            ));
        }
        run.push((k, (env, event)));
    }
    let spans = run
        .iter()
        .map(|(_, (env, _))| consumer_span(handler.name(), env, None, &Default::default()))
        .collect();
    let shared: Vec<(&Envelope, &PurchaseEvent)> = run.iter().map(|(_, r)| *r).collect();
    let dispositions =
        apply_shared(pool, handler, followers, &Commit::Lane(TxSlots::unlimited()), &shared, spans).await?;
    for ((k, _), d) in run.iter().zip(dispositions) {
        out[*k] = d;
    }
    Ok(out)
}

/// What a member's committer does with `runs` handed to it together (`GroupCommit`; the
/// module doc, "Group commit"): each run prepared as a lane prepares it ([`handle_batch`]'s
/// rules: every fact of a run wanted and of a distinct order, the runs' orders distinct),
/// then all of them in one transaction; when that fails for good, each run again in its
/// own, with the answers it has (otherwise every run gets the group's error). One result per
/// run: its dispositions, or the error its lane would get. Public so tests can drive the
/// committer without a broker.
///
/// # Errors
/// `bad_payload` (permanent) for an undecodable fact.
pub async fn handle_group<H: Handler>(
    pool: &PgPool,
    handler: &H,
    followers: &Followers,
    runs: &[Vec<Envelope>],
) -> Result<Vec<Result<Vec<Option<Disposition>>, HandlerError>>, HandlerError> {
    let mut parts = Vec::with_capacity(runs.len());
    let mut answers = Vec::with_capacity(runs.len());
    for envs in runs {
        let mut run = Vec::with_capacity(envs.len());
        for env in envs {
            run.push((env.clone(), env.decode().map_err(|e| HandlerError::permanent("bad_payload", e))?));
        }
        let borrowed: Vec<(&Envelope, &PurchaseEvent)> =
            run.iter().map(|(env, event)| (env, event)).collect();
        let spans: Vec<tracing::Span> = borrowed
            .iter()
            .map(|(env, _)| consumer_span(handler.name(), env, None, &Default::default()))
            .collect();
        let (reply, answer) = oneshot::channel();
        answers.push(answer);
        match prepare_shared(pool, handler, &borrowed, &spans).await {
            Ok(Ready { prepared, left_out }) => parts.push(Part { run, prepared, left_out, spans, reply }),
            Err(e) => {
                let _ = reply.send(Err(e));
            }
        }
    }
    commit_group(pool, handler, followers, parts).await;
    let mut out = Vec::with_capacity(answers.len());
    for answer in answers {
        out.push(answer.await.unwrap_or_else(|_| Err(HandlerError::Transient(anyhow::anyhow!("no answer")))));
    }
    Ok(out)
}

/// `run`'s remote work, then one transaction for it. First, outside any transaction, the
/// handler's [`Handler::precheck`] of the whole run (one read), then every message's `prepare` (for a handler that [`Handler::calls_out`], its provider calls, each
/// with its stable idempotency key), all at once — they are of different orders — each in
/// its message's consumer span; a message known to be applied already is not prepared (from
/// its pre-check, [`Handler::applied`], or else, for a handler that calls out, the inbox).
/// Then the transaction, as `commit` says — the lane's own, or the member's group transaction
/// that joins other lanes' runs (module doc, "Group commit"): the inbox rows of all its
/// messages in one statement; then the facts the handler [`Handler::verifies`] that this
/// ledger did not commit, parked ([`Disposition::Unknown`]); then
/// [`Handler::lock_rows`] of the other messages whose row was new, in the order of their order ids;
/// then, per such message, in that order (one fact per order: no order's facts
/// are reordered) and inside its consumer span, its effect with those rows (a duplicate — of
/// an applied fact, or a second copy of an id in the run — does nothing); then what they emitted, in one outbox statement; then one commit. The fault
/// points are those of [`handle_once`], once per message around `prepare` and once per
/// batch around the commit. A message whose `prepare` failed is left out of the transaction
/// whole (no inbox row, no effect) and returned as `None`, for the caller to process alone;
/// the others' answers are recorded. When every `prepare` failed, or the transaction did,
/// the error is returned and nothing is kept: the caller processes every message alone, and
/// their `prepare` runs again — a provider call that succeeded, repeated under the same
/// idempotency key, gets its first answer back.
async fn apply_shared<H: Handler>(
    pool: &PgPool,
    handler: &H,
    followers: &Followers,
    commit: &Commit<H>,
    run: &[(&Envelope, &PurchaseEvent)],
    spans: Vec<tracing::Span>,
) -> Result<Vec<Option<Disposition>>, HandlerError> {
    let Ready { prepared, left_out } = prepare_shared(pool, handler, run, &spans).await?;
    match commit {
        Commit::Lane(slots) => {
            commit_shared(pool, handler, followers, Open::Lane(slots), run, prepared, &left_out, &spans).await
        }
        Commit::Member(group) => group.commit(run, prepared, left_out, spans).await,
    }
}

/// What a run's `prepare`s answered: per message, its answer (`None`: known to be applied
/// already, or left out) and whether it is left out (its `prepare` failed).
struct Ready<P> {
    prepared: Vec<Option<P>>,
    left_out: Vec<bool>,
}

/// The remote half of [`apply_shared`]: the run's pre-check, then every `prepare` at once.
/// An error when the pre-check failed or every `prepare` did (the first one's).
async fn prepare_shared<H: Handler>(
    pool: &PgPool,
    handler: &H,
    run: &[(&Envelope, &PurchaseEvent)],
    spans: &[tracing::Span],
) -> Result<Ready<H::Prepared>, HandlerError> {
    let name = handler.name();
    // What the `prepare`s check first, read for all of them at once.
    let prechecks = prechecks_of(handler, run).await?;
    let unverified = &unverified_before_call(pool, handler, run).await?;
    // Every call is let finish (none is abandoned half-way).
    let outcomes: Vec<Result<Option<H::Prepared>, HandlerError>> = futures::future::join_all(
        run.iter().zip(spans).zip(prechecks).map(|(((env, event), span), precheck)| {
            async move {
                if known_duplicate(pool, handler, env, &precheck).await? || unverified.contains(&env.event_id)
                {
                    return Ok::<_, HandlerError>(None);
                }
                boxoffice_faults::check_consumer(name, "before_remote")?;
                let prepared = handler.prepare(env, event, precheck).await?;
                boxoffice_faults::check_consumer(name, "after_remote")?;
                Ok(Some(prepared))
            }
            .instrument(span.clone())
        }),
    )
    .await;
    // A message whose `prepare` failed is left out whole (no inbox row, no effect): the caller
    // processes it alone. The others' answers are recorded, not thrown away with it.
    let mut prepared: Vec<Option<H::Prepared>> = Vec::with_capacity(run.len());
    let mut left_out = vec![false; run.len()];
    let mut first_error = None;
    for (k, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Ok(p) => prepared.push(p),
            Err(e) => {
                tracing::debug!(parent: &spans[k], consumer = name, error = %e,
                    "prepare failed: the message is left out of its batch and applied alone");
                left_out[k] = true;
                prepared.push(None);
                first_error.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_error.filter(|_| left_out.iter().all(|&l| l)) {
        return Err(e);
    }
    Ok(Ready { prepared, left_out })
}

/// The transaction of [`apply_shared`] for `run` with its `prepared` answers (`left_out`:
/// the messages whose `prepare` failed, left out whole), opened as `open` says. One fact per
/// order in `run`: a member's group transaction ([`GroupCommit`]) joins runs of different
/// lanes, whose orders differ (and the committer starts a new group for a run that would
/// repeat one).
#[allow(clippy::too_many_arguments)]
async fn commit_shared<H: Handler>(
    pool: &PgPool,
    handler: &H,
    followers: &Followers,
    open: Open<'_>,
    run: &[(&Envelope, &PurchaseEvent)],
    mut prepared: Vec<Option<H::Prepared>>,
    left_out: &[bool],
    spans: &[tracing::Span],
) -> Result<Vec<Option<Disposition>>, HandlerError> {
    let name = handler.name();
    // Each order's rows are locked in order-id order: two shared transactions (of two
    // lanes, or of the saga and the ticket worker) never wait for each other in a cycle.
    // A run holds one fact per order, so this reorders no order's facts.
    let mut by_order: Vec<usize> = (0..run.len()).collect();
    by_order.sort_by_key(|&k| run[k].0.aggregate_id);
    // Taken after every provider call, held until the transaction ends.
    let (slot, mut tx) = match open {
        Open::Lane(slots) => (slots.take().await, pool.begin().await?),
        Open::Group => (None, pool.begin_with(GROUP_BEGIN.as_str()).await?),
    };
    // Every inbox row of the run in one statement: a message whose id it did not record
    // now is a duplicate, and so is a second copy of an id within the run (each id counts
    // as new once, for the first message that carries it).
    let ids: Vec<uuid::Uuid> =
        run.iter().zip(left_out).filter(|(_, &l)| !l).map(|((env, _), _)| env.event_id).collect();
    let mut fresh = inbox::record_all(&mut tx, name, &ids).await?;
    let mut out: Vec<Option<Disposition>> =
        left_out.iter().map(|&l| (!l).then_some(Disposition::Duplicate)).collect();
    // The messages whose effects run: found in the inbox before their `prepare`, or not new
    // now, a message has nothing to apply.
    let new: Vec<usize> =
        by_order.into_iter().filter(|&k| !left_out[k] && fresh.remove(&run[k].0.event_id)).collect();
    // Claims only this ledger's writers may make, that it did not commit: parked, not applied
    // (a handler that calls out made no call for them: `unverified_before_call`; one it
    // prepared was found committed there, and is not looked up again).
    let claims: Vec<(&Envelope, &PurchaseEvent)> =
        new.iter().filter(|&&k| !(handler.calls_out() && prepared[k].is_some())).map(|&k| run[k]).collect();
    let unknown = park_unknown(&mut tx, handler, &claims).await?;
    let mut todo: Vec<(usize, H::Prepared)> = Vec::with_capacity(new.len());
    for k in new {
        if unknown.contains(&run[k].0.event_id) {
            out[k] = Some(Disposition::Unknown);
        } else if let Some(p) = prepared[k].take() {
            todo.push((k, p));
        }
    }
    // Their rows, locked for all of them at once, in the order their effects run.
    let locking: Vec<(&Envelope, &PurchaseEvent)> = todo.iter().map(|(k, _)| run[*k]).collect();
    let rows = rows_of(handler, &mut tx, &locking).await?;
    let mut follows: Vec<outbox::Traced> = Vec::new();
    for ((k, prepared), rows) in todo.into_iter().zip(rows) {
        let (env, event) = run[k];
        let (tx, follows) = (&mut tx, &mut follows);
        async move {
            let emitted = handler.apply(tx, env, event, prepared, rows).await?;
            // Stored with this message's span: its trace goes on from its own fact.
            follows.extend(emitted.into_iter().map(outbox::Traced::here));
            Ok::<_, HandlerError>(())
        }
        .instrument(spans[k].clone())
        .await?;
        out[k] = Some(Disposition::Applied);
    }
    // A follower's failure fails the batch: each message is then processed alone, and applied
    // without followers if they fail again. Even when the database gave the follower's
    // statement up: that is the follower's table, not the batch's, so the batch is not handed
    // to the retry topic for it (a locked `tickets` must not hold back the captures).
    let (facts, followed) = followers.follow(&mut tx, follows).await.map_err(|e| match e {
        HandlerError::Overloaded(e) => HandlerError::Transient(e),
        other => other,
    })?;
    outbox::insert_traced_with_inbox(&mut tx, &facts, followed.inbox_rows()).await?;
    boxoffice_faults::check_consumer(name, "before_commit")?;
    tx.commit().await?;
    drop(slot);
    boxoffice_faults::check_consumer(name, "after_commit")?;
    boxoffice_faults::check_consumer(name, "before_ack")?;
    Followers::after_commit(&followed)?;
    Ok(out)
}

/// How [`commit_shared`] opens its transaction.
enum Open<'a> {
    /// A lane's own: `BEGIN` after taking one of the member's transaction slots.
    Lane(&'a TxSlots),
    /// A member's committer's ([`GroupCommit`]): [`GROUP_BEGIN`], no slot.
    Group,
}

/// Longest a member's group transaction waits for any one row lock, in milliseconds (each
/// lock counted alone, as PostgreSQL's `lock_timeout` does): past it the
/// statement fails (SQLSTATE 55P03, transient) and so does the group, whose lanes then apply
/// their runs alone, so a row another session holds (an operator's, say) delays one group
/// this long instead of stalling every lane's commits for up to `db_statement_timeout_ms`.
/// Lock waits between the purchase path's own transactions last milliseconds.
pub const GROUP_LOCK_TIMEOUT_MS: u64 = 1_000;

/// How a group transaction begins: `BEGIN` and its lock timeout ([`GROUP_LOCK_TIMEOUT_MS`])
/// in one round trip.
static GROUP_BEGIN: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("BEGIN; SET LOCAL lock_timeout = {GROUP_LOCK_TIMEOUT_MS}"));

/// How a main-topic member's lanes commit their shared runs.
pub(crate) enum Commit<H: Handler> {
    /// Each lane in its own transaction, within the member's transaction slots.
    Lane(TxSlots),
    /// Through the member's committer (`consumer_group_commit`).
    Member(GroupCommit<H>),
}

/// A lane's prepared run handed to its member's committer, and where the answer goes.
struct Part<H: Handler> {
    run: Vec<(Envelope, PurchaseEvent)>,
    prepared: Vec<Option<H::Prepared>>,
    left_out: Vec<bool>,
    spans: Vec<tracing::Span>,
    reply: oneshot::Sender<Result<Vec<Option<Disposition>>, HandlerError>>,
}

/// A main-topic member's committer (module doc, "Group commit"): one task that applies, in
/// one transaction, the prepared runs of every lane that has one ready, then answers each
/// lane; with up to `consumer_group_commits_max` such transactions open at once. Cloned into
/// each lane; the task ends when every clone is gone and its open transactions have ended.
pub(crate) struct GroupCommit<H: Handler> {
    parts: mpsc::Sender<Part<H>>,
}

impl<H: Handler> Clone for GroupCommit<H> {
    fn clone(&self) -> Self {
        Self { parts: self.parts.clone() }
    }
}

impl<H: Handler> GroupCommit<H> {
    /// Starts a committer that joins runs of at most `max` messages in all into one
    /// transaction, with at most `open` (at least 1) such transactions at once.
    pub(crate) fn start(
        pool: PgPool,
        handler: Arc<H>,
        followers: Followers,
        max: usize,
        open: usize,
    ) -> Self {
        let (parts, rx) = mpsc::channel(64);
        tokio::spawn(committer(pool, handler, followers, rx, max.max(1), open.max(1)));
        Self { parts }
    }

    /// Hands `run` with its answers to the committer and waits for its dispositions (as
    /// [`commit_shared`]'s).
    async fn commit(
        &self,
        run: &[(&Envelope, &PurchaseEvent)],
        prepared: Vec<Option<H::Prepared>>,
        left_out: Vec<bool>,
        spans: Vec<tracing::Span>,
    ) -> Result<Vec<Option<Disposition>>, HandlerError> {
        let (reply, answer) = oneshot::channel();
        let run = run.iter().map(|(env, event)| ((*env).clone(), (*event).clone())).collect();
        let gone = || HandlerError::Transient(anyhow::anyhow!("the member's committer is gone"));
        self.parts.send(Part { run, prepared, left_out, spans, reply }).await.map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }
}

/// The committer's loop: once fewer than `open` of its group transactions are open, the
/// first part that arrives, then every part already waiting (up to `max` messages, and none
/// with an order already in the group: it starts the next group), in one transaction of its
/// own task. The parts that arrive while every transaction is open wait for the next group.
/// A lane hands over its next run only once its last one is answered, so the facts of one
/// message key are never in two open groups (the module doc, "Group commit").
async fn committer<H: Handler>(
    pool: PgPool,
    handler: Arc<H>,
    followers: Followers,
    mut rx: mpsc::Receiver<Part<H>>,
    max: usize,
    open: usize,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(open));
    let mut running = tokio::task::JoinSet::new();
    let mut next: Option<Part<H>> = None;
    loop {
        let slot = slots.clone().acquire_owned().await.expect("the committer's semaphore is never closed");
        while running.try_join_next().is_some() {}
        let first = match next.take() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(p) => p,
                None => break,
            },
        };
        let mut orders: std::collections::HashSet<uuid::Uuid> =
            first.run.iter().map(|(env, _)| env.aggregate_id).collect();
        let mut size = first.run.len();
        let mut parts = vec![first];
        while size < max {
            let Ok(part) = rx.try_recv() else { break };
            if part.run.iter().any(|(env, _)| orders.contains(&env.aggregate_id)) {
                next = Some(part);
                break;
            }
            orders.extend(part.run.iter().map(|(env, _)| env.aggregate_id));
            size += part.run.len();
            parts.push(part);
        }
        let (pool, handler, followers) = (pool.clone(), handler.clone(), followers.clone());
        running.spawn(async move {
            commit_group(&pool, &*handler, &followers, parts).await;
            drop(slot);
        });
    }
    while running.join_next().await.is_some() {}
}

/// One group transaction for `parts`, each part answered. When it fails for good (a
/// [`HandlerError::Permanent`]: a fact the ledger refuses) and it held more than one part,
/// each part is committed alone with the answers it has, so such a fact costs the other
/// lanes one more transaction, not their provider calls. Any other failure — transient, a
/// follower's, the database giving the group up, a panic — is every part's: each lane then
/// does what it does when its own shared run fails so (one by one, or to the retry topic),
/// outside the committer, which is not held up by repeating what failed for all of them.
async fn commit_group<H: Handler>(
    pool: &PgPool,
    handler: &H,
    followers: &Followers,
    mut parts: Vec<Part<H>>,
) {
    let name = handler.name();
    let sizes: Vec<usize> = parts.iter().map(|p| p.run.len()).collect();
    let spare: Option<Vec<Vec<Option<H::Prepared>>>> =
        (parts.len() > 1).then(|| parts.iter().map(|p| p.prepared.clone()).collect());
    let prepared: Vec<Option<H::Prepared>> =
        parts.iter_mut().flat_map(|p| std::mem::take(&mut p.prepared)).collect();
    let left_out: Vec<bool> = parts.iter().flat_map(|p| p.left_out.iter().copied()).collect();
    let spans: Vec<tracing::Span> = parts.iter().flat_map(|p| p.spans.iter().cloned()).collect();
    let run: Vec<(&Envelope, &PurchaseEvent)> =
        parts.iter().flat_map(|p| p.run.iter().map(|(env, event)| (env, event))).collect();
    let result =
        caught(commit_shared(pool, handler, followers, Open::Group, &run, prepared, &left_out, &spans)).await;
    drop(run);
    metrics::histogram!("boxoffice_consumer_group_commit_messages", "consumer" => name)
        .record(sizes.iter().sum::<usize>() as f64);
    let spare = match (result, spare) {
        (Ok(mut out), _) => {
            for (part, n) in parts.into_iter().zip(sizes) {
                let rest = out.split_off(n);
                let _ = part.reply.send(Ok(std::mem::replace(&mut out, rest)));
            }
            return;
        }
        (Err(e), None) => {
            if let Some(part) = parts.pop() {
                let _ = part.reply.send(Err(e));
            }
            return;
        }
        (Err(e @ HandlerError::Permanent { .. }), Some(spare)) => {
            tracing::debug!(consumer = name, parts = sizes.len(), error = %e,
                "group transaction failed: committing each lane's run alone");
            metrics::counter!("boxoffice_consumer_group_commit_fallbacks_total", "consumer" => name)
                .increment(1);
            spare
        }
        (Err(e), Some(_)) => {
            for part in parts {
                let _ = part.reply.send(Err(e.again()));
            }
            return;
        }
    };
    for (part, prepared) in parts.into_iter().zip(spare) {
        let run: Vec<(&Envelope, &PurchaseEvent)> =
            part.run.iter().map(|(env, event)| (env, event)).collect();
        let result = caught(commit_shared(
            pool,
            handler,
            followers,
            Open::Group,
            &run,
            prepared,
            &part.left_out,
            &part.spans,
        ))
        .await;
        let _ = part.reply.send(result);
    }
}

/// `f`'s result, or a transient error when it panicked (its transaction is rolled back as it
/// is dropped): the committer goes on, and the lanes process their messages alone.
async fn caught<T>(f: impl std::future::Future<Output = Result<T, HandlerError>>) -> Result<T, HandlerError> {
    use futures::FutureExt;
    match std::panic::AssertUnwindSafe(f).catch_unwind().await {
        Ok(result) => result,
        Err(_) => Err(HandlerError::Transient(anyhow::anyhow!("the group transaction panicked"))),
    }
}

/// Whether `env` is known to be applied before its `prepare`: as its pre-check found
/// ([`Handler::applied`]), or, when the pre-check did not read the inbox, as the inbox says
/// for a handler that [`Handler::calls_out`] (others leave it to the effect's inbox insert).
async fn known_duplicate<H: Handler>(
    pool: &PgPool,
    handler: &H,
    env: &Envelope,
    precheck: &H::Precheck,
) -> Result<bool, HandlerError> {
    Ok(match handler.applied(precheck) {
        Some(applied) => applied,
        None => handler.calls_out() && inbox::seen(pool, handler.name(), env.event_id).await?,
    })
}

/// [`Handler::precheck`] of `run`, one per message or an error.
async fn prechecks_of<H: Handler>(
    handler: &H,
    run: &[(&Envelope, &PurchaseEvent)],
) -> Result<Vec<H::Precheck>, HandlerError> {
    let prechecks = handler.precheck(run).await?;
    if prechecks.len() != run.len() {
        return Err(HandlerError::permanent(
            "precheck_count",
            anyhow::anyhow!("{} pre-checks for {} messages", prechecks.len(), run.len()),
        ));
    }
    Ok(prechecks)
}

/// Following `env`'s facts through failed: the transaction is gone, the message is applied
/// again without followers.
fn follow_failed(consumer: &'static str, env: &Envelope, e: &HandlerError) {
    tracing::warn!(consumer, event.id = %env.event_id, event.type = %env.event_type, order.id = %env.aggregate_id,
        error = %e, "following through in the transaction failed: applying the message alone");
    metrics::counter!("boxoffice_follow_failures_total", "consumer" => consumer).increment(1);
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
    /// Whether this member's assignment is exported (main-topic members only).
    report: bool,
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
        if !self.report {
            return;
        }
        metrics::gauge!("boxoffice_consumer_assigned_partitions", "consumer" => self.name).set(now as f64);
        tracing::info!(consumer = self.name, partitions = now, "partition assignment changed");
    }
}

type GroupConsumer = StreamConsumer<GroupContext>;

/// The topic a consumer member reads: the purchase topic or one of the retry topics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// `ticketing.purchase.v1`, group `ticketing-{consumer}`.
    Main,
    /// `ticketing.purchase.retry-5s.v1`, group `ticketing-{consumer}-retry-5s`.
    Retry5s,
    /// `ticketing.purchase.retry-1m.v1`, group `ticketing-{consumer}-retry-1m`.
    Retry1m,
}

impl Stage {
    fn topic(self) -> Topic {
        match self {
            Stage::Main => Topic::Purchase,
            Stage::Retry5s => Topic::Retry5s,
            Stage::Retry1m => Topic::Retry1m,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Stage::Main => "main",
            Stage::Retry5s => "retry-5s",
            Stage::Retry1m => "retry-1m",
        }
    }

    /// The consumer-group suffix of a member on this stage.
    fn group_suffix(self) -> &'static str {
        match self {
            Stage::Main => "",
            Stage::Retry5s => "-retry-5s",
            Stage::Retry1m => "-retry-1m",
        }
    }

    /// Where a message that failed its attempts on this stage goes next.
    fn next(self) -> Stage {
        match self {
            Stage::Main => Stage::Retry5s,
            Stage::Retry5s | Stage::Retry1m => Stage::Retry1m,
        }
    }

    fn delay_ms(self, p: &RetryPolicy) -> u64 {
        match self {
            Stage::Main => 0,
            Stage::Retry5s => p.retry_5s_delay_ms,
            Stage::Retry1m => p.retry_1m_delay_ms,
        }
    }
}

/// Headers of a retry copy.
pub mod retry_headers {
    /// The consumer the copy is for (retry topics are shared by every consumer).
    pub const CONSUMER: &str = "x-retry-consumer";
    /// Attempts made so far.
    pub const ATTEMPT: &str = "x-retry-attempt";
    /// Not to be retried before this Unix time, ms.
    pub const NOT_BEFORE_MS: &str = "x-retry-not-before-ms";
    /// The last error's code: `transient`, or `overloaded` (the database gave a statement up,
    /// [`super::HandlerError::Overloaded`]).
    pub const LAST_ERROR: &str = "x-retry-last-error";
    /// Logical topic of the original message.
    pub const ORIGIN_TOPIC: &str = "x-origin-topic";
    /// Partition of the original message.
    pub const ORIGIN_PARTITION: &str = "x-origin-partition";
    /// Offset of the original message.
    pub const ORIGIN_OFFSET: &str = "x-origin-offset";
}

fn header<'a>(msg: &'a OwnedMessage, key: &str) -> Option<&'a str> {
    let headers = msg.headers()?;
    headers.iter().find(|h| h.key == key).and_then(|h| h.value).and_then(|v| std::str::from_utf8(v).ok())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Where a message first entered the bus: reported in dead letters and carried by retry
/// copies.
#[derive(Debug, Clone)]
struct Origin {
    topic: String,
    partition: i32,
    offset: i64,
}

/// How many members a process runs and how each applies messages.
#[derive(Debug, Clone, Copy)]
pub struct Members {
    /// Members of the consumer group in this process (`consumers_per_role`).
    pub instances: usize,
    /// Concurrent lanes per member (`consumer_lanes`).
    pub lanes: usize,
    /// Most messages a lane applies in one transaction (`consumer_batch_max`; see the
    /// module doc, "Batches").
    pub batch: usize,
    /// How a main-topic member fetches (`consumer_fetch_min_bytes`, `consumer_fetch_wait_ms`).
    pub fetch: Fetch,
    /// How long a main-topic lane waits, after a batch's first message, for more to join
    /// it before it starts the batch (`consumer_batch_linger_ms`; zero: never waits, the
    /// batch is what has queued up). See the module doc, "Batches".
    pub linger: Duration,
    /// Most transactions a main-topic member's lanes have open at once
    /// (`consumer_transactions_max`; zero: one per lane). See the module doc, "Transaction
    /// slots".
    pub transactions: usize,
    /// Whether a main-topic member's lanes commit through one committer, which joins the
    /// runs every lane has ready into one transaction (`consumer_group_commit`; then
    /// `transactions` is not used). See the module doc, "Group commit".
    pub group_commit: bool,
    /// With `group_commit`: most group transactions a member has open at once
    /// (`consumer_group_commits_max`; at least 1). See the module doc, "Group commit".
    pub group_commits: usize,
}

/// How many of a member's lanes may be inside a transaction at once (see the module doc,
/// "Transaction slots"). A lane takes a slot after its batch's provider calls and before
/// `BEGIN`, and gives it back after the commit or, on an error, as it drops the transaction,
/// so no lane holds a row lock or a connection while it waits for one, and no provider call
/// waits for one; a transaction waiting on a lock keeps its slot.
#[derive(Clone, Default)]
pub(crate) struct TxSlots(Option<Arc<tokio::sync::Semaphore>>);

impl TxSlots {
    /// No limit: every lane may be in a transaction at once.
    pub(crate) fn unlimited() -> Self {
        Self(None)
    }

    /// `n` slots for `lanes` lanes; no limit when `n` is zero or at least `lanes`.
    pub(crate) fn new(n: usize, lanes: usize) -> Self {
        Self((n > 0 && n < lanes).then(|| Arc::new(tokio::sync::Semaphore::new(n))))
    }

    /// Waits for a slot; held until the returned guard is dropped.
    async fn take(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        // The semaphore is never closed.
        self.0.clone()?.acquire_owned().await.ok()
    }
}

/// How long a main-topic member's fetch may wait at the broker for how much data: the fetch
/// returns once `min_bytes` of messages are there or `wait_ms` has passed, whichever comes
/// first (librdkafka's `fetch.min.bytes` and `fetch.wait.max.ms`). A larger `min_bytes` makes
/// fewer, larger fetches under load, and so larger lane batches (fewer transactions per
/// fact); it never delays a fact by more than `wait_ms` per hop. Retry members always wait
/// [`RETRY_FETCH_WAIT_MS`] for any data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fetch {
    /// Bytes of messages a fetch waits for (1: answer as soon as anything is there).
    pub min_bytes: u32,
    /// Longest a fetch waits for them, in milliseconds.
    pub wait_ms: u32,
}

impl Default for Fetch {
    /// The defaults of `consumer_fetch_min_bytes` and `consumer_fetch_wait_ms`.
    fn default() -> Self {
        Self { min_bytes: 1, wait_ms: 20 }
    }
}

/// A retry member's fetch wait, in milliseconds: retry copies mostly wait for their due
/// times, and a longer poll costs the broker less.
pub const RETRY_FETCH_WAIT_MS: u32 = 500;

/// Runs `members.instances` members of the handler's consumer group until `shutdown`. Each
/// member reads its partitions and spreads messages over `members.lanes` concurrent lanes by
/// message key (the order id): one order's messages are applied in partition order, different
/// orders in parallel. Offsets are committed only up to the lowest message still in flight in
/// its partition, every 200 ms for all partitions that moved in one request, so a crash
/// replays everything unfinished and what finished since the last commit (into the inbox).
/// Each instance also runs one member on each retry topic (see the module doc). Returns the
/// tasks and the main group's [`Assignment`].
pub fn run_consumers<H: Handler>(
    cfg: &KafkaConfig,
    pool: PgPool,
    handler: Arc<H>,
    producer: FutureProducer,
    members: Members,
    followers: Followers,
    shutdown: CancellationToken,
) -> anyhow::Result<(Vec<tokio::task::JoinHandle<()>>, Arc<Assignment>)> {
    let followers = followers.without(handler.name()).labelled(cfg.labels.clone());
    let Members { instances, lanes, batch, fetch, linger, transactions, group_commit, group_commits } =
        members;
    let assignment = Arc::new(Assignment::default());
    let retry_assignment = Arc::new(Assignment::default());
    let mut tasks = Vec::new();
    for i in 0..instances.max(1) {
        for stage in [Stage::Main, Stage::Retry5s, Stage::Retry1m] {
            let group = format!("{}{}", handler.name(), stage.group_suffix());
            let consumer: GroupConsumer = member_client_config(cfg, &group, i, stage, fetch)
                .create_with_context(GroupContext {
                    name: handler.name(),
                    assignment: if stage == Stage::Main {
                        assignment.clone()
                    } else {
                        retry_assignment.clone()
                    },
                    report: stage == Stage::Main,
                })?;
            consumer.subscribe(&[&cfg.topic(stage.topic().name())])?;
            // Retry members mostly wait for due times; a couple of lanes is plenty.
            let lanes = if stage == Stage::Main { lanes.max(1) } else { lanes.clamp(1, 2) };
            let runner = Arc::new(Runner {
                group: cfg.group(&group),
                cfg: cfg.clone(),
                pool: pool.clone(),
                handler: handler.clone(),
                producer: producer.clone(),
                shutdown: shutdown.clone(),
                stage,
                // A batch shares one transaction, only on the main topic (a retry copy waits
                // for its own due time).
                batch: if stage == Stage::Main { batch.max(1) } else { 1 },
                linger: if stage == Stage::Main && batch > 1 { linger } else { Duration::ZERO },
                followers: followers.clone(),
                commit: match stage {
                    Stage::Main if group_commit => Commit::Member(GroupCommit::start(
                        pool.clone(),
                        handler.clone(),
                        followers.clone(),
                        lanes * batch.max(1),
                        group_commits,
                    )),
                    Stage::Main => Commit::Lane(TxSlots::new(transactions, lanes)),
                    Stage::Retry5s | Stage::Retry1m => Commit::Lane(TxSlots::unlimited()),
                },
            });
            tasks.push(tokio::spawn(async move { runner.run(consumer, lanes).await }));
        }
    }
    Ok((tasks, assignment))
}

/// The librdkafka settings of one member: group `group` (unprefixed), instance `i`, on
/// `stage`; the main topic's fetches as `fetch` says, a retry topic's as
/// [`RETRY_FETCH_WAIT_MS`] with any data.
fn member_client_config(
    cfg: &KafkaConfig,
    group: &str,
    i: usize,
    stage: Stage,
    fetch: Fetch,
) -> ClientConfig {
    let (wait_ms, min_bytes) = match stage {
        Stage::Main => (fetch.wait_ms, fetch.min_bytes),
        Stage::Retry5s | Stage::Retry1m => (RETRY_FETCH_WAIT_MS, 1),
    };
    let mut c = cfg.client_config();
    c.set("group.id", cfg.group(group))
        .set("client.id", format!("{}-{}-{}", group, std::process::id(), i))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "10000")
        .set("heartbeat.interval.ms", "1000")
        .set("fetch.wait.max.ms", wait_ms.to_string())
        .set("fetch.min.bytes", min_bytes.to_string())
        .set("partition.assignment.strategy", "cooperative-sticky");
    c
}

struct Runner<H: Handler> {
    /// The physical consumer group of this member.
    group: String,
    cfg: KafkaConfig,
    pool: PgPool,
    handler: Arc<H>,
    producer: FutureProducer,
    shutdown: CancellationToken,
    stage: Stage,
    /// Most messages one lane applies in one transaction.
    batch: usize,
    /// How long a lane waits after a batch's first message for more (zero: never).
    linger: Duration,
    /// The consumers that follow this one's facts through in its transactions.
    followers: Followers,
    /// How this member's lanes commit their shared runs.
    commit: Commit<H>,
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

/// A lane's next batch, `first` (handed to the lane at `first_at`) and what follows it on
/// `rx` (each with when it was handed over), at most `max` in all: what is queued now, and
/// with a non-zero `linger` what arrives until `linger` after `first_at`. The batch is
/// started when it is full, the linger is over, or `rx` is closed; so no message waits in a
/// lane longer than `linger` beyond the batches before it (one that queued behind a busy
/// lane for longer has waited enough, and does not linger again).
async fn gather<T>(
    first: T,
    first_at: tokio::time::Instant,
    rx: &mut mpsc::Receiver<(T, tokio::time::Instant)>,
    max: usize,
    linger: Duration,
) -> Vec<T> {
    let until = first_at + linger;
    let mut batch = vec![first];
    while batch.len() < max {
        match rx.try_recv() {
            Ok((m, _)) => batch.push(m),
            Err(mpsc::error::TryRecvError::Empty) if !linger.is_zero() => {
                match tokio::time::timeout_at(until, rx.recv()).await {
                    Ok(Some((m, _))) => batch.push(m),
                    _ => break,
                }
            }
            Err(_) => break,
        }
    }
    batch
}

/// Whether a message can join a shared transaction ([`Runner::process_all`]).
enum Batchable {
    /// Not a fact this consumer acts on: acknowledged unread.
    Ignored,
    /// Yes: the decoded envelope and fact.
    Yes(Box<Envelope>, Box<PurchaseEvent>),
    /// Only on its own (undecodable, or of another region epoch).
    Alone,
}

/// How one stage's attempts at a message ended.
enum Outcome {
    Done,
    /// `code`: the last error's, `transient` or `overloaded` ([`retry_headers::LAST_ERROR`]).
    Retry {
        attempts: u32,
        error: String,
        code: &'static str,
    },
    DeadLetter {
        code: &'static str,
        error: String,
        attempts: u32,
    },
    ShuttingDown,
}

impl<H: Handler> Runner<H> {
    /// How many of this member's lanes may be in a transaction at once, for a message
    /// processed alone (with a committer: no limit; it takes none of its runs).
    fn slots(&self) -> &TxSlots {
        static UNLIMITED: TxSlots = TxSlots(None);
        match &self.commit {
            Commit::Lane(slots) => slots,
            Commit::Member(_) => &UNLIMITED,
        }
    }

    /// Whether a run of one message goes to the member's committer (to share its transaction
    /// with the other lanes' runs) rather than being processed alone.
    fn groups_singles(&self) -> bool {
        matches!(self.commit, Commit::Member(_))
    }

    async fn run(self: Arc<Self>, consumer: GroupConsumer, lanes: usize) {
        let name = self.handler.name();
        let consumer = Arc::new(consumer);
        let lag_label = if self.stage == Stage::Main {
            name.to_owned()
        } else {
            format!("{name}-{}", self.stage.label())
        };
        let lag_reporter = tokio::spawn(report_lag(consumer.clone(), lag_label, self.shutdown.clone()));
        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(String, i32, i64)>();
        let mut lane_tx = Vec::with_capacity(lanes);
        let mut lane_tasks = Vec::with_capacity(lanes);
        for _ in 0..lanes {
            let (tx, mut rx) = mpsc::channel::<(OwnedMessage, tokio::time::Instant)>(64);
            lane_tx.push(tx);
            let (me, done) = (self.clone(), done_tx.clone());
            lane_tasks.push(tokio::spawn(async move {
                while let Some((first, at)) = rx.recv().await {
                    let batch = gather(first, at, &mut rx, me.batch, me.linger).await;
                    let (finished, stopped) = me.process_all(&batch).await;
                    for i in finished {
                        let msg = &batch[i];
                        let _ = done.send((msg.topic().to_owned(), msg.partition(), msg.offset()));
                    }
                    if stopped {
                        break; // shutting down mid-retry: those offsets stay uncommitted
                    }
                }
            }));
        }
        drop(done_tx);
        let mut in_flight = InFlight::default();
        let mut commits = PendingCommits::default();
        let mut flush = tokio::time::interval(COMMIT_EVERY);
        flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => break,
                Some((topic, partition, offset)) = done_rx.recv() => {
                    if let Some(next) = in_flight.finish(&topic, partition, offset) {
                        commits.set(topic, partition, next);
                    }
                }
                _ = flush.tick() => commits.flush(&consumer, name, CommitMode::Async),
                m = consumer.recv() => match m {
                    Ok(m) => {
                        let msg = m.detach();
                        in_flight.start(msg.topic(), msg.partition(), msg.offset());
                        let lane = msg.key().map(|k| lane_of(k, lanes)).unwrap_or(0);
                        tokio::select! {
                            _ = self.shutdown.cancelled() => break,
                            r = lane_tx[lane].send((msg, tokio::time::Instant::now())) => if r.is_err() { break },
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
        // Let each lane finish the message in hand, then commit what completed (and nothing
        // past a message a lane gave up on at shutdown).
        drop(lane_tx);
        for t in lane_tasks {
            let _ = t.await;
        }
        while let Ok((topic, partition, offset)) = done_rx.try_recv() {
            if let Some(next) = in_flight.finish(&topic, partition, offset) {
                commits.set(topic, partition, next);
            }
        }
        lag_reporter.abort();
        commits.flush(&consumer, name, CommitMode::Sync);
        tracing::info!(consumer = name, stage = self.stage.label(), "consumer stopped");
    }

    /// Where `msg` was read, for its consumer span; `attempt`: attempts before this one.
    fn delivery<'m>(&'m self, msg: &'m OwnedMessage, attempt: u32) -> Delivery<'m> {
        Delivery {
            topic: msg.topic(),
            partition: msg.partition(),
            offset: msg.offset(),
            group: &self.group,
            traceparent: header(msg, boxoffice_trace::TRACEPARENT),
            attempt,
        }
    }

    /// Processes a lane's batch in order: consecutive messages this consumer applies share
    /// one transaction ([`Runner::apply_batch`]); a message it does not want is acknowledged
    /// unread; anything else (an undecodable envelope, a fact of another region epoch, a batch
    /// of one) goes through [`Runner::process`] alone, after the messages before it. When a
    /// shared transaction fails, nothing of it is kept and each of its messages is processed
    /// alone, with its own attempts, retry topics and dead letter. Returns the indexes of the
    /// finished messages and whether shutdown interrupted the batch.
    async fn process_all(&self, batch: &[OwnedMessage]) -> (Vec<usize>, bool) {
        if batch.len() == 1 && !self.groups_singles() {
            return if self.process(&batch[0]).await { (vec![0], false) } else { (vec![], true) };
        }
        let name = self.handler.name();
        let mut finished = Vec::with_capacity(batch.len());
        let mut run: Vec<(usize, Envelope, PurchaseEvent)> = Vec::new();
        for (i, msg) in batch.iter().enumerate() {
            match self.batchable(msg) {
                // One fact per order in a transaction: a second one of an order waits for
                // the commit of the first.
                Batchable::Yes(env, event)
                    if run.iter().any(|(_, e, _)| e.aggregate_id == env.aggregate_id) =>
                {
                    if !self.flush_run(batch, &mut run, &mut finished).await {
                        return (finished, true);
                    }
                    run.push((i, *env, *event));
                }
                Batchable::Ignored => {
                    metrics::counter!("boxoffice_consumer_messages_total", "consumer" => name, "outcome" => "Ignored")
                        .increment(1);
                    finished.push(i);
                }
                Batchable::Yes(env, event) => run.push((i, *env, *event)),
                Batchable::Alone => {
                    if !self.flush_run(batch, &mut run, &mut finished).await {
                        return (finished, true);
                    }
                    if !self.process(msg).await {
                        return (finished, true);
                    }
                    finished.push(i);
                }
            }
        }
        let complete = self.flush_run(batch, &mut run, &mut finished).await;
        (finished, !complete)
    }

    /// Whether `msg` can share a transaction: a fact this consumer wants, decoded, of this
    /// writer's region epoch.
    fn batchable(&self, msg: &OwnedMessage) -> Batchable {
        // The relay's `event-type` header spares decoding what this consumer ignores.
        if let Some(kind) = header(msg, crate::fact_headers::EVENT_TYPE).and_then(EventKind::of) {
            if !self.handler.wants(kind) {
                return Batchable::Ignored;
            }
        }
        let Some(Ok(env)) = msg.payload().map(Envelope::from_slice) else { return Batchable::Alone };
        if !EventKind::of(&env.event_type).is_some_and(|kind| self.handler.wants(kind)) {
            return Batchable::Ignored;
        }
        if let Some(mine) = self.cfg.writer_epoch {
            let suspect = match env.region_epoch {
                Some(theirs) => theirs != mine,
                None => mine > 1,
            };
            if suspect {
                return Batchable::Alone;
            }
        }
        match env.decode() {
            Ok(event) if !self.handler.acts_on(&event) => Batchable::Ignored,
            // Applied in the transaction that committed it (crate::follow).
            Ok(_) if env.was_applied_by(self.handler.name()) => Batchable::Ignored,
            Ok(event) => Batchable::Yes(Box::new(env), Box::new(event)),
            Err(_) => Batchable::Alone,
        }
    }

    /// Applies `run` (emptied) in one transaction, or each message alone when that fails;
    /// `false` if shutdown interrupted it.
    async fn flush_run(
        &self,
        batch: &[OwnedMessage],
        run: &mut Vec<(usize, Envelope, PurchaseEvent)>,
        finished: &mut Vec<usize>,
    ) -> bool {
        let name = self.handler.name();
        match run.len() {
            0 => return true,
            1 if !self.groups_singles() => {
                let (i, _, _) = run.remove(0);
                if !self.process(&batch[i]).await {
                    return false;
                }
                finished.push(i);
                return true;
            }
            _ => {}
        }
        let started = std::time::Instant::now();
        match self.apply_batch(batch, run).await {
            Ok(dispositions) => {
                let per = started.elapsed().as_secs_f64() / run.len() as f64;
                metrics::histogram!("boxoffice_consumer_batch_messages", "consumer" => name)
                    .record(run.len() as f64);
                let mut alone = Vec::new();
                for ((i, _, _), d) in run.drain(..).zip(dispositions) {
                    let Some(d) = d else {
                        alone.push(i);
                        continue;
                    };
                    if d == Disposition::Applied {
                        metrics::histogram!("boxoffice_consumer_apply_seconds", "consumer" => name)
                            .record(per);
                    }
                    metrics::counter!("boxoffice_consumer_messages_total", "consumer" => name, "outcome" => format!("{d:?}"))
                        .increment(1);
                    finished.push(i);
                }
                // Those whose `prepare` failed: alone, with their own attempts, after the commit.
                if !alone.is_empty() {
                    metrics::counter!("boxoffice_consumer_batch_left_out_total", "consumer" => name)
                        .increment(alone.len() as u64);
                }
                for i in alone {
                    if !self.process(&batch[i]).await {
                        return false;
                    }
                    finished.push(i);
                }
                true
            }
            Err(HandlerError::Overloaded(e)) if self.stage == Stage::Main => {
                // Not one by one: each would wait on the same database. Every message of the
                // run goes to the retry topic, with the run's one attempt counted.
                let error = format!("{e:#}");
                tracing::warn!(
                    consumer = name,
                    messages = run.len(),
                    error,
                    "shared transaction: database overloaded, handing its messages to the retry topic"
                );
                for (i, env, _) in run.drain(..) {
                    metrics::counter!("boxoffice_consumer_retries_total", "consumer" => name, "stage" => self.stage.label())
                        .increment(1);
                    let origin = self.origin(&batch[i]);
                    let retry = Outcome::Retry { attempts: 1, error: error.clone(), code: "overloaded" };
                    if !self.conclude(&batch[i], &origin, &env, retry).await {
                        return false;
                    }
                    finished.push(i);
                }
                true
            }
            Err(e) => {
                tracing::debug!(consumer = name, messages = run.len(), error = %e,
                    "shared transaction failed: applying its messages one by one");
                metrics::counter!("boxoffice_consumer_batch_fallbacks_total", "consumer" => name)
                    .increment(1);
                for (i, _, _) in run.drain(..) {
                    if !self.process(&batch[i]).await {
                        return false;
                    }
                    finished.push(i);
                }
                true
            }
        }
    }

    /// [`apply_shared`] for `run`, with each message's delivery in its consumer span.
    async fn apply_batch(
        &self,
        batch: &[OwnedMessage],
        run: &[(usize, Envelope, PurchaseEvent)],
    ) -> Result<Vec<Option<Disposition>>, HandlerError> {
        let spans = run
            .iter()
            .map(|(i, env, _)| {
                consumer_span(self.handler.name(), env, Some(&self.delivery(&batch[*i], 0)), &self.cfg.labels)
            })
            .collect();
        let run: Vec<(&Envelope, &PurchaseEvent)> = run.iter().map(|(_, env, event)| (env, event)).collect();
        apply_shared(&self.pool, &*self.handler, &self.followers, &self.commit, &run, spans).await
    }

    /// Processes one message until applied, skipped, handed to the next retry topic or
    /// dead-lettered; `false` if shutdown interrupted it (its offset must not be committed).
    async fn process(&self, msg: &OwnedMessage) -> bool {
        let name = self.handler.name();
        if self.stage == Stage::Main {
            // The relay's `event-type` header spares decoding what this consumer ignores.
            if header(msg, crate::fact_headers::EVENT_TYPE)
                .and_then(EventKind::of)
                .is_some_and(|k| !self.handler.wants(k))
            {
                metrics::counter!("boxoffice_consumer_messages_total", "consumer" => name, "outcome" => "Ignored")
                    .increment(1);
                return true;
            }
        }
        let (origin, attempts_before) = if self.stage == Stage::Main {
            (self.origin(msg), 0)
        } else {
            // Retry topics are shared: take only the copies addressed to this consumer.
            if header(msg, retry_headers::CONSUMER) != Some(name) {
                return true;
            }
            let due =
                header(msg, retry_headers::NOT_BEFORE_MS).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            let wait = due.saturating_sub(now_ms());
            if wait > 0 {
                tokio::select! {
                    _ = self.shutdown.cancelled() => return false,
                    _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
                }
            }
            let origin = Origin {
                topic: header(msg, retry_headers::ORIGIN_TOPIC).unwrap_or(Topic::Purchase.name()).to_owned(),
                partition: header(msg, retry_headers::ORIGIN_PARTITION)
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(-1),
                offset: header(msg, retry_headers::ORIGIN_OFFSET).and_then(|v| v.parse().ok()).unwrap_or(-1),
            };
            (origin, header(msg, retry_headers::ATTEMPT).and_then(|v| v.parse().ok()).unwrap_or(1))
        };
        let env = match msg.payload().map(Envelope::from_slice) {
            Some(Ok(env)) => env,
            Some(Err(_)) | None if self.stage == Stage::Main && !self.handler.dead_letters_unreadable() => {
                metrics::counter!("boxoffice_unreadable_messages_skipped_total", "consumer" => name)
                    .increment(1);
                return true;
            }
            Some(Err(e)) => {
                return self
                    .dead_letter(msg, &origin, None, "bad_envelope", &e.to_string(), attempts_before + 1)
                    .await;
            }
            None => {
                return self
                    .dead_letter(
                        msg,
                        &origin,
                        None,
                        "empty_message",
                        "message has no payload",
                        attempts_before + 1,
                    )
                    .await;
            }
        };
        let outcome = self.attempt(msg, &env, attempts_before).await;
        self.conclude(msg, &origin, &env, outcome).await
    }

    /// Where a main-topic message was read.
    fn origin(&self, msg: &OwnedMessage) -> Origin {
        Origin {
            topic: self.cfg.logical(msg.topic()).to_owned(),
            partition: msg.partition(),
            offset: msg.offset(),
        }
    }

    /// Acts on a message's `outcome`: done, dead-lettered, or handed to the next retry topic
    /// (dead-lettered once `max_attempts` are spent); `false` if shutdown interrupted it.
    async fn conclude(&self, msg: &OwnedMessage, origin: &Origin, env: &Envelope, outcome: Outcome) -> bool {
        let name = self.handler.name();
        match outcome {
            Outcome::Done => true,
            Outcome::ShuttingDown => false,
            Outcome::DeadLetter { code, error, attempts } => {
                self.dead_letter(msg, origin, Some(env), code, &error, attempts).await
            }
            Outcome::Retry { attempts, error, .. } if attempts >= self.cfg.retry.max_attempts => {
                tracing::error!(consumer = name, event.id = %env.event_id, event.type = %env.event_type,
                    order.id = %env.aggregate_id, attempts, error, "retries exhausted: dead-lettering");
                self.dead_letter(msg, origin, Some(env), "retries_exhausted", &error, attempts).await
            }
            Outcome::Retry { attempts, error, code } => {
                self.forward(msg, origin, env, attempts, code, &error).await
            }
        }
    }

    /// This stage's attempts: `inline_attempts` on the main topic, one on a retry topic.
    async fn attempt(&self, msg: &OwnedMessage, env: &Envelope, attempts_before: u32) -> Outcome {
        let name = self.handler.name();
        let budget = if self.stage == Stage::Main { self.cfg.retry.inline_attempts.max(1) } else { 1 };
        let mut attempts = attempts_before;
        let mut last_error = String::new();
        for i in 0..budget {
            attempts += 1;
            let started = std::time::Instant::now();
            let delivery = self.delivery(msg, attempts - 1);
            let span = consumer_span(name, env, Some(&delivery), &self.cfg.labels);
            let applied = apply_once(
                &self.pool,
                &*self.handler,
                env,
                self.cfg.writer_epoch,
                &self.followers,
                self.slots(),
            )
            .instrument(span.clone())
            .await;
            if applied.is_err() {
                span.record("otel.status_code", "ERROR");
            }
            let result = match applied {
                // The acknowledgement boundary: an injected failure here means the offset is
                // not committed and the message comes again (into the inbox).
                Ok(d) => boxoffice_faults::check_consumer(name, "before_ack")
                    .map(|_| d)
                    .map_err(HandlerError::from),
                Err(e) => Err(e),
            };
            match result {
                Ok(d) => {
                    if d == Disposition::Applied {
                        metrics::histogram!("boxoffice_consumer_apply_seconds", "consumer" => name)
                            .record(started.elapsed().as_secs_f64());
                    }
                    metrics::counter!("boxoffice_consumer_messages_total", "consumer" => name, "outcome" => format!("{d:?}"))
                        .increment(1);
                    return Outcome::Done;
                }
                Err(HandlerError::Permanent { code, source }) => {
                    tracing::error!(parent: &span, consumer = name, event.id = %env.event_id, event.type = %env.event_type,
                        order.id = %env.aggregate_id, code, error = %format!("{source:#}"), "permanent failure: dead-lettering");
                    return Outcome::DeadLetter { code, error: format!("{source:#}"), attempts };
                }
                Err(HandlerError::Overloaded(e)) => {
                    // Not again in place, where it would add to the database's load: on the
                    // next retry topic, after its delay.
                    let error = format!("{e:#}");
                    metrics::counter!("boxoffice_consumer_retries_total", "consumer" => name, "stage" => self.stage.label())
                        .increment(1);
                    tracing::warn!(parent: &span, consumer = name, stage = self.stage.label(), event.id = %env.event_id,
                        event.type = %env.event_type, order.id = %env.aggregate_id, attempts,
                        error, "database overloaded: handing to the retry topic");
                    return Outcome::Retry { attempts, error, code: "overloaded" };
                }
                Err(HandlerError::Transient(e)) => {
                    last_error = format!("{e:#}");
                    metrics::counter!("boxoffice_consumer_retries_total", "consumer" => name, "stage" => self.stage.label())
                        .increment(1);
                    tracing::warn!(parent: &span, consumer = name, stage = self.stage.label(), event.id = %env.event_id,
                        event.type = %env.event_type, order.id = %env.aggregate_id, attempts,
                        error = %last_error, "transient failure");
                    if i + 1 < budget {
                        let base = (50u64 << i.min(4)).min(1_000);
                        let delay = base / 2 + rand::thread_rng().gen_range(0..=base / 2);
                        tokio::select! {
                            _ = self.shutdown.cancelled() => return Outcome::ShuttingDown,
                            _ = tokio::time::sleep(Duration::from_millis(delay)) => {}
                        }
                    }
                }
            }
        }
        Outcome::Retry { attempts, error: last_error, code: "transient" }
    }

    /// Copies the message to the next retry topic, durably, before its offset may move.
    async fn forward(
        &self,
        msg: &OwnedMessage,
        origin: &Origin,
        env: &Envelope,
        attempts: u32,
        code: &str,
        error: &str,
    ) -> bool {
        let name = self.handler.name();
        let next = self.stage.next();
        let due = now_ms() + next.delay_ms(&self.cfg.retry);
        let key = msg.key().map(|k| String::from_utf8_lossy(k).into_owned()).unwrap_or_default();
        let topic = self.cfg.topic(next.topic().name());
        let (attempt_s, due_s, part_s, off_s) =
            (attempts.to_string(), due.to_string(), origin.partition.to_string(), origin.offset.to_string());
        let mut headers = vec![
            (retry_headers::CONSUMER, name),
            (retry_headers::ATTEMPT, attempt_s.as_str()),
            (retry_headers::NOT_BEFORE_MS, due_s.as_str()),
            (retry_headers::LAST_ERROR, code),
            (retry_headers::ORIGIN_TOPIC, origin.topic.as_str()),
            (retry_headers::ORIGIN_PARTITION, part_s.as_str()),
            (retry_headers::ORIGIN_OFFSET, off_s.as_str()),
        ];
        // The copy stays in the purchase's trace.
        headers.extend(header(msg, boxoffice_trace::TRACEPARENT).map(|t| (boxoffice_trace::TRACEPARENT, t)));
        let payload = msg.payload().unwrap_or_default();
        if !self.publish_durably(&topic, &key, payload, &headers).await {
            return false;
        }
        tracing::warn!(consumer = name, event.id = %env.event_id, event.type = %env.event_type,
            order.id = %env.aggregate_id, attempts, to = next.label(), error, "handed to the retry topic");
        metrics::counter!("boxoffice_retry_forwarded_total", "consumer" => name, "topic" => next.label())
            .increment(1);
        true
    }

    /// Publishes until the broker acknowledges; `false` if shutdown came first.
    async fn publish_durably(
        &self,
        topic: &str,
        key: &str,
        payload: &[u8],
        headers: &[(&str, &str)],
    ) -> bool {
        let mut attempt = 0u32;
        while let Err(e) = crate::producer::send(&self.producer, topic, key, payload, headers).await {
            attempt += 1;
            tracing::warn!(consumer = self.handler.name(), topic, error = %e, attempt, "publish failed; retrying");
            tokio::select! {
                _ = self.shutdown.cancelled() => return false,
                _ = tokio::time::sleep(Duration::from_millis(200 * attempt.min(10) as u64)) => {}
            }
        }
        true
    }

    /// Sends the message to the dead-letter topic with its origin and error; `false` if
    /// shutdown interrupted the publish.
    async fn dead_letter(
        &self,
        msg: &OwnedMessage,
        origin: &Origin,
        env: Option<&Envelope>,
        code: &str,
        detail: &str,
        attempts: u32,
    ) -> bool {
        let name = self.handler.name();
        let record = serde_json::json!({
            "consumer": name,
            "error_code": code,
            "error": detail,
            "attempts": attempts,
            "source_topic": origin.topic,
            "source_partition": origin.partition,
            "source_offset": origin.offset,
            "event_id": env.map(|e| e.event_id),
            "event_type": env.map(|e| e.event_type.clone()),
            // Whole when it is an envelope (what `dlq replay` sends again); the first
            // `UNREADABLE_ORIGINAL_MAX` bytes of one that is not, which nothing can replay.
            "original": msg.payload().map(|p| {
                let keep = if env.is_some() { p.len() } else { p.len().min(UNREADABLE_ORIGINAL_MAX) };
                String::from_utf8_lossy(&p[..keep]).into_owned()
            }),
            "original_bytes": msg.payload().map_or(0, <[u8]>::len),
        });
        // The original key (the order id), so one order's dead letters stay in order.
        let key = msg.key().map(|k| String::from_utf8_lossy(k).into_owned()).unwrap_or_default();
        let topic = self.cfg.topic(Topic::DeadLetter.name());
        // The dead letter must be durable before the offset moves past the message.
        let mut headers = vec![("error-code", code)];
        headers.extend(header(msg, boxoffice_trace::TRACEPARENT).map(|t| (boxoffice_trace::TRACEPARENT, t)));
        if !self.publish_durably(&topic, &key, record.to_string().as_bytes(), &headers).await {
            return false;
        }
        metrics::counter!("boxoffice_dead_letters_total", "consumer" => name, "code" => code.to_owned())
            .increment(1);
        true
    }
}

/// The most bytes of a message that is no envelope its dead letter keeps (`original`;
/// `original_bytes` says how long it was): enough to recognise it, not a copy of whatever
/// size a writer to the topic chose.
pub const UNREADABLE_ORIGINAL_MAX: usize = 4_096;

/// Every 5 s, exports `boxoffice_consumer_lag{consumer, partition}`: the partition's high
/// watermark minus this member's position, for each partition it holds (design §16: lag by
/// partition shows a slow worker or a hot key).
async fn report_lag(consumer: Arc<GroupConsumer>, name: String, shutdown: CancellationToken) {
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
            metrics::gauge!("boxoffice_consumer_lag", "consumer" => name.clone(), "partition" => partition.to_string())
                .set(lag as f64);
        }
    }
}

/// How often a member sends the commit points that moved: one request for all its
/// partitions, instead of one per message.
const COMMIT_EVERY: Duration = Duration::from_millis(200);

/// Commit points (the next offset to read) that moved since the last flush, per partition.
#[derive(Default)]
struct PendingCommits {
    next: HashMap<(String, i32), i64>,
}

impl PendingCommits {
    fn set(&mut self, topic: String, partition: i32, offset: i64) {
        self.next.insert((topic, partition), offset);
    }

    /// Commits every moved partition in one request: a lost or failed commit only replays
    /// messages into the inbox.
    fn flush(&mut self, consumer: &GroupConsumer, name: &'static str, mode: CommitMode) {
        if self.next.is_empty() {
            return;
        }
        let mut tpl = TopicPartitionList::new();
        for ((topic, partition), offset) in self.next.drain() {
            let _ = tpl.add_partition_offset(&topic, partition, Offset::Offset(offset));
        }
        if let Err(e) = consumer.commit(&tpl, mode) {
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

    /// Without a linger a batch is what is queued; with one, what arrives within it after
    /// the batch's first message joins, up to the batch size; a later message starts the
    /// next batch, and a closed lane ends the wait. Tokio's paused clock: no real waiting.
    #[tokio::test(start_paused = true)]
    async fn a_lane_gathers_what_arrives_within_its_linger() {
        use tokio::time::Instant;
        let ms = Duration::from_millis;
        let (tx, mut rx) = mpsc::channel::<(u32, Instant)>(16);
        let next = |rx: &mut mpsc::Receiver<(u32, Instant)>| rx.try_recv().expect("queued");
        tx.send((2, Instant::now())).await.unwrap();
        let sender = tokio::spawn(async move {
            let send = |m| tx.send((m, Instant::now()));
            tokio::time::sleep(ms(5)).await;
            send(3).await.unwrap();
            tokio::time::sleep(ms(10)).await;
            send(4).await.unwrap();
            tokio::time::sleep(ms(30)).await;
            for m in [5, 6, 7] {
                send(m).await.unwrap();
            }
            tokio::time::sleep(ms(100)).await;
            send(8).await.unwrap();
            send(9).await.unwrap();
            tokio::time::sleep(ms(100)).await;
            send(10).await.unwrap();
        });
        assert_eq!(
            gather(1, Instant::now(), &mut rx, 16, Duration::ZERO).await,
            [1, 2],
            "no linger: what is queued"
        );
        let (first, at) = rx.recv().await.unwrap();
        assert_eq!(gather(first, at, &mut rx, 16, ms(20)).await, [3, 4]);
        assert_eq!(at.elapsed(), ms(20), "the linger ends the batch, counted from its first's arrival");
        let (first, at) = rx.recv().await.unwrap();
        assert_eq!(gather(first, at, &mut rx, 2, ms(20)).await, [5, 6], "full: at once");
        assert_eq!(at.elapsed(), Duration::ZERO);
        // 7 has queued since 6 arrived: what is still left of its linger.
        let (first, at) = next(&mut rx);
        tokio::time::sleep(ms(15)).await; // the lane was busy with the batch before
        assert_eq!(gather(first, at, &mut rx, 16, ms(20)).await, [7]);
        assert_eq!(at.elapsed(), ms(20), "counted from its arrival, not from when the lane took it");
        let (first, at) = rx.recv().await.unwrap();
        tokio::time::sleep(ms(30)).await; // busy for longer than the linger
        let took = Instant::now();
        assert_eq!(gather(first, at, &mut rx, 16, ms(20)).await, [8, 9]);
        assert_eq!(took.elapsed(), Duration::ZERO, "queued longer than the linger: no second wait");
        sender.await.unwrap();
        let (first, at) = rx.recv().await.unwrap();
        let took = Instant::now();
        assert_eq!(gather(first, at, &mut rx, 16, ms(50)).await, [10]);
        assert_eq!(took.elapsed(), Duration::ZERO, "closed: at once");
    }

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

    /// The configured fetch reaches the main topic's members only; a retry member keeps its
    /// long poll for any data; and the member builds as a librdkafka consumer.
    #[test]
    fn the_fetch_settings_reach_the_main_members_only() {
        let cfg = KafkaConfig {
            brokers: "127.0.0.1:1".into(),
            security: Default::default(),
            prefix: "p-".into(),
            partitions: 1,
            replication: 1,
            retry: Default::default(),
            writer_epoch: None,
            labels: Default::default(),
        };
        let fetch = Fetch { min_bytes: 16_384, wait_ms: 40 };
        let main = member_client_config(&cfg, "saga", 0, Stage::Main, fetch);
        assert_eq!(main.get("fetch.min.bytes"), Some("16384"));
        assert_eq!(main.get("fetch.wait.max.ms"), Some("40"));
        assert_eq!(main.get("group.id"), Some("p-ticketing-saga"));
        for stage in [Stage::Retry5s, Stage::Retry1m] {
            let retry = member_client_config(&cfg, "saga-retry", 0, stage, fetch);
            assert_eq!(retry.get("fetch.min.bytes"), Some("1"));
            assert_eq!(retry.get("fetch.wait.max.ms"), Some("500"));
        }
        let _: BaseConsumer = main.create().expect("a consumer with these settings");
    }

    #[test]
    fn a_key_always_maps_to_one_lane() {
        assert_eq!(lane_of(b"order-1", 8), lane_of(b"order-1", 8));
        assert!(lane_of(b"order-2", 8) < 8);
    }
}
