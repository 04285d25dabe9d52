//! The transactional outbox (design §7, invariant 5): business writes insert their events here
//! in the same transaction; one relay at a time publishes them, the one whose session holds
//! [`RELAY_LOCK`]: it reads the oldest unpublished rows ([`pending_batch`], checked by the
//! region fence), publishes outside any transaction and marks what the broker acknowledged
//! ([`mark_published`]). A relay that dies mid-batch leaves its rows unpublished; the relay
//! that takes the lock next publishes them again: at-least-once, made harmless by the
//! consumers' inbox.
//!
//! A row the producer refuses outright, or whose stored envelope the relay cannot read
//! ([`OutboxRow::message`]), is parked, and its order with it ([`park_refused`]):
//! [`pending_batch`] reads none of the order's rows until its retry is due (the relay's retry
//! interval, or [`retry_parked`]), and then a few due orders per batch, so an order's facts
//! still leave in order and refused rows never fill a batch. [`backlog`] counts parked orders'
//! rows apart.
//!
//! The columns of the per-row lease that came before the lock (`claimed_by`,
//! `claim_expires_at`, migration 0001) are no longer written or read. They stay while a relay
//! of an older build may run beside this one (a rolling deploy, a rollback): that relay claims
//! and publishes as before, and what both publish is a duplicate the inbox absorbs. A later
//! migration drops them.
//!
//! Every row also stores the W3C `traceparent` of the span that wrote it (design §16; NULL
//! when tracing is off or there is no span), in the same INSERT: the relay sends the stored
//! value, not its own context, so the consumer continues the trace of the request or message
//! that caused the fact ([`boxoffice_trace`]).
//!
//! Every insert here (and the hold's statement, [`crate::holds`]) also wakes this process's
//! relay ([`written`]): a relay whose reads keep finding nothing reads less often, and a
//! fact written in its own process need not wait for its next read. Facts written by other
//! processes are found by that read.

use crate::Tx;
use boxoffice_domain::{Envelope, Topic};
use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

static WRITTEN: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Woken after this process inserted outbox rows (before their transaction commits, so the
/// relay reads a little later). One wake-up is kept while nobody waits.
pub fn written() -> &'static tokio::sync::Notify {
    &WRITTEN
}

/// Wakes this process's relay ([`written`]).
pub(crate) fn wake_relay() {
    WRITTEN.notify_one();
}

/// Adds `envelope` to the outbox for `topic` inside the caller's transaction; the message key
/// is the envelope's aggregate (order) id, the trace context the current span's.
pub async fn insert(tx: &mut Tx<'_>, topic: Topic, envelope: &Envelope) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO outbox (id, topic, message_key, event_type, payload, traceparent)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(envelope.event_id)
    .bind(topic.name())
    .bind(envelope.aggregate_id.to_string())
    .bind(&envelope.event_type)
    .bind(sqlx::types::Json(envelope))
    .bind(boxoffice_trace::current_traceparent())
    .execute(&mut **tx)
    .await?;
    wake_relay();
    Ok(())
}

/// The event ids of the facts of `facts` this ledger did not commit as they are: no row in
/// the outbox, nor, once the relay pruned it, in `order_history` (kept
/// `order_history_retention_days`), with the fact's id, type, order and payload (a forged
/// fact that borrows a real fact's id, of another type or with other contents, is not one
/// this ledger committed). One statement. A consumer that reads a fact from the bus asks
/// this before it acts on a claim only the ledger's own writers may make
/// (`boxoffice_bus::Handler::verifies`).
pub async fn not_committed<'e>(
    ex: impl sqlx::PgExecutor<'e>,
    facts: &[&Envelope],
) -> Result<Vec<Uuid>, sqlx::Error> {
    let ids: Vec<Uuid> = facts.iter().map(|f| f.event_id).collect();
    let types: Vec<&str> = facts.iter().map(|f| f.event_type.as_str()).collect();
    let orders: Vec<Uuid> = facts.iter().map(|f| f.aggregate_id).collect();
    let payloads: Vec<&serde_json::Value> = facts.iter().map(|f| &f.payload).collect();
    sqlx::query_scalar(
        "SELECT t.id FROM unnest($1::uuid[], $2::text[], $3::uuid[], $4::jsonb[]) AS t(id, event_type, order_id, payload)
          WHERE (SELECT 1 FROM outbox o
                  WHERE o.id = t.id AND o.event_type = t.event_type
                    AND o.message_key = t.order_id::text AND o.payload->'payload' = t.payload LIMIT 1) IS NULL
            AND (SELECT 1 FROM order_history h
                  WHERE h.event_id = t.id AND h.event_type = t.event_type
                    AND h.order_id = t.order_id AND h.payload->'payload' = t.payload LIMIT 1) IS NULL",
    )
    .bind(ids)
    .bind(types)
    .bind(orders)
    .bind(payloads.into_iter().map(sqlx::types::Json).collect::<Vec<_>>())
    .fetch_all(ex)
    .await
}

/// The re-fetches a sweep asks for: one `PaymentIntentRefreshRequested` with `reason` per
/// `(order, correlation id, PaymentIntent)` row, each the first fact of its own step (no
/// cause), for [`insert_all`] in the sweep's transaction.
pub(crate) fn refresh_requests(
    rows: impl IntoIterator<Item = (Uuid, Uuid, String)>,
    reason: &str,
) -> Vec<Envelope> {
    rows.into_iter()
        .map(|(order, correlation, pi)| {
            let order = boxoffice_domain::OrderId(order);
            let fact = boxoffice_domain::PurchaseEvent::PaymentIntentRefreshRequested {
                order_id: order,
                payment_intent_id: pi,
                reason: reason.to_owned(),
            };
            Envelope::new(order, &fact, correlation, None)
        })
        .collect()
}

/// Adds several envelopes for the purchase topic in one statement, in order, all with the
/// current span's trace context.
pub async fn insert_all(tx: &mut Tx<'_>, envelopes: &[Envelope]) -> Result<(), sqlx::Error> {
    match envelopes {
        [] => Ok(()),
        [one] => insert(tx, Topic::Purchase, one).await,
        many => {
            let ids: Vec<Uuid> = many.iter().map(|e| e.event_id).collect();
            let keys: Vec<String> = many.iter().map(|e| e.aggregate_id.to_string()).collect();
            let types: Vec<&str> = many.iter().map(|e| e.event_type.as_str()).collect();
            let payloads: Vec<serde_json::Value> =
                many.iter().map(|e| serde_json::to_value(e).expect("envelopes serialize")).collect();
            // clock_timestamp() + ordinality keeps created_at (the relay's order) as given.
            sqlx::query(
                "INSERT INTO outbox (id, topic, message_key, event_type, payload, created_at, traceparent)
                 SELECT u.id, $1, u.k, u.t, u.p, clock_timestamp() + u.n * interval '1 microsecond', $6
                   FROM unnest($2::uuid[], $3::text[], $4::text[], $5::jsonb[]) WITH ORDINALITY AS u(id, k, t, p, n)",
            )
            .bind(Topic::Purchase.name())
            .bind(&ids)
            .bind(&keys)
            .bind(&types)
            .bind(&payloads)
            .bind(boxoffice_trace::current_traceparent())
            .execute(&mut **tx)
            .await?;
            wake_relay();
            Ok(())
        }
    }
}

/// A fact for the purchase topic with the trace context to store beside it (the span that
/// decided it; `None` stores NULL).
#[derive(Debug, Clone)]
pub struct Traced {
    /// The fact.
    pub envelope: Envelope,
    /// W3C `traceparent` of the span that wrote it.
    pub traceparent: Option<String>,
}

impl Traced {
    /// `envelope` with the current span's trace context.
    pub fn here(envelope: Envelope) -> Self {
        Self { envelope, traceparent: boxoffice_trace::current_traceparent() }
    }
}

/// Adds the facts of several writers (a consumer's batch) for the purchase topic in one
/// statement, in order, each with its own trace context.
pub async fn insert_traced(tx: &mut Tx<'_>, rows: &[Traced]) -> Result<(), sqlx::Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = rows.iter().map(|r| r.envelope.event_id).collect();
    let keys: Vec<String> = rows.iter().map(|r| r.envelope.aggregate_id.to_string()).collect();
    let types: Vec<&str> = rows.iter().map(|r| r.envelope.event_type.as_str()).collect();
    let payloads: Vec<serde_json::Value> =
        rows.iter().map(|r| serde_json::to_value(&r.envelope).expect("envelopes serialize")).collect();
    let traceparents: Vec<Option<&str>> = rows.iter().map(|r| r.traceparent.as_deref()).collect();
    // clock_timestamp() + ordinality keeps created_at (the relay's order) as given.
    sqlx::query(
        "INSERT INTO outbox (id, topic, message_key, event_type, payload, created_at, traceparent)
         SELECT u.id, $1, u.k, u.t, u.p, clock_timestamp() + u.n * interval '1 microsecond', u.tp
           FROM unnest($2::uuid[], $3::text[], $4::text[], $5::jsonb[], $6::text[])
                WITH ORDINALITY AS u(id, k, t, p, tp, n)",
    )
    .bind(Topic::Purchase.name())
    .bind(&ids)
    .bind(&keys)
    .bind(&types)
    .bind(&payloads)
    .bind(&traceparents)
    .execute(&mut **tx)
    .await?;
    wake_relay();
    Ok(())
}

/// [`insert_traced`], and in the same statement the inbox rows `(consumer, event_id)` of the
/// consumers that applied some of these facts in this transaction (they followed them
/// through, `boxoffice_bus::follow`). The facts are new, so no inbox row can exist yet; a
/// conflict would be a bug, and fails the statement.
pub async fn insert_traced_with_inbox(
    tx: &mut Tx<'_>,
    rows: &[Traced],
    inbox: &[(&str, Uuid)],
) -> Result<(), sqlx::Error> {
    if inbox.is_empty() {
        return insert_traced(tx, rows).await;
    }
    let ids: Vec<Uuid> = rows.iter().map(|r| r.envelope.event_id).collect();
    let keys: Vec<String> = rows.iter().map(|r| r.envelope.aggregate_id.to_string()).collect();
    let types: Vec<&str> = rows.iter().map(|r| r.envelope.event_type.as_str()).collect();
    let payloads: Vec<serde_json::Value> =
        rows.iter().map(|r| serde_json::to_value(&r.envelope).expect("envelopes serialize")).collect();
    let traceparents: Vec<Option<&str>> = rows.iter().map(|r| r.traceparent.as_deref()).collect();
    let consumers: Vec<&str> = inbox.iter().map(|(c, _)| *c).collect();
    let applied: Vec<Uuid> = inbox.iter().map(|(_, id)| *id).collect();
    sqlx::query(
        "WITH followed AS (
            INSERT INTO inbox (consumer, event_id) SELECT * FROM unnest($7::text[], $8::uuid[]))
         INSERT INTO outbox (id, topic, message_key, event_type, payload, created_at, traceparent)
         SELECT u.id, $1, u.k, u.t, u.p, clock_timestamp() + u.n * interval '1 microsecond', u.tp
           FROM unnest($2::uuid[], $3::text[], $4::text[], $5::jsonb[], $6::text[])
                WITH ORDINALITY AS u(id, k, t, p, tp, n)",
    )
    .bind(Topic::Purchase.name())
    .bind(&ids)
    .bind(&keys)
    .bind(&types)
    .bind(&payloads)
    .bind(&traceparents)
    .bind(&consumers)
    .bind(&applied)
    .execute(&mut **tx)
    .await?;
    wake_relay();
    Ok(())
}

/// An unpublished outbox row: the logical topic, key and serialized envelope.
#[derive(Debug, sqlx::FromRow)]
pub struct OutboxRow {
    /// The envelope's event id.
    pub id: Uuid,
    /// Logical topic name (unprefixed), e.g. `ticketing.purchase.v1`.
    pub topic: String,
    /// Kafka key (the order id).
    pub message_key: String,
    /// The envelope's type, sent as a header.
    pub event_type: String,
    /// The envelope as JSON text, as stored: read as text, so a row the relay cannot parse
    /// (e.g. nested deeper than serde_json's limit) fails alone in [`OutboxRow::message`],
    /// not the whole batch's read.
    pub payload: String,
    /// When the business write committed.
    pub created_at: DateTime<Utc>,
    /// The region and epoch of the session that wrote the row (column defaults read from
    /// the session, [`crate::region`]); `None` for a session that declared none.
    pub region: Option<String>,
    /// See `region`.
    pub region_epoch: Option<i64>,
    /// The W3C trace context of the span that wrote the row (`None`: it did not trace).
    pub traceparent: Option<String>,
    /// When the producer last refused it (`None`: never), for a parked row read again.
    pub refused_at: Option<DateTime<Utc>>,
}

/// One outbox row as the relay sends it ([`OutboxRow::message`]).
#[derive(Debug)]
pub struct Message {
    /// The message bytes.
    pub bytes: Vec<u8>,
    /// The envelope's `correlation_id`, for the publish span.
    pub correlation_id: Option<String>,
    /// The envelope's `causation_id`, for the publish span.
    pub causation_id: Option<String>,
}

impl OutboxRow {
    /// The message: the stored envelope with the writer's `region`, `region_epoch` and
    /// `traceparent` (the column is the fact's trace context: without one, the envelope has
    /// none either). Errors: the stored text is not JSON serde_json reads (the relay parks
    /// such a row as it parks one the producer refuses).
    pub fn message(&self) -> Result<Message, serde_json::Error> {
        let mut v: serde_json::Value = serde_json::from_str(&self.payload)?;
        let id = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_owned);
        let (correlation_id, causation_id) = (id("correlation_id"), id("causation_id"));
        if let serde_json::Value::Object(m) = &mut v {
            if let Some(r) = &self.region {
                m.insert("region".into(), r.clone().into());
            }
            if let Some(e) = self.region_epoch {
                m.insert("region_epoch".into(), e.into());
            }
            match &self.traceparent {
                Some(t) => m.insert(boxoffice_trace::TRACEPARENT.into(), t.clone().into()),
                None => m.remove(boxoffice_trace::TRACEPARENT),
            };
        }
        Ok(Message { bytes: serde_json::to_vec(&v)?, correlation_id, causation_id })
    }
}

/// The session-level advisory lock that makes one relay at a time publish this ledger's
/// outbox: the key pair (`'BXR1'`, 1), beside the region fence's ([`crate::region::FENCE_LOCK`]).
/// Held by the leading relay's own connection for as long as that session lives: when the
/// session ends (the relay crashed, went silent past its lease, or gave the lock up), a
/// standing-by relay takes it on its next try (`boxoffice_workers::relay` says how the lead
/// changes hands).
pub const RELAY_LOCK: (i32, i32) = (1_113_084_465, 1);

/// Tries [`RELAY_LOCK`] on `c`'s connection; `true` when that connection holds it (again: the lock
/// is re-entrant, so the holder may ask twice).
pub async fn try_relay_lock(c: &mut sqlx::PgConnection) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
        .bind(RELAY_LOCK.0)
        .bind(RELAY_LOCK.1)
        .fetch_one(&mut *c)
        .await
}

/// Parked orders whose retry is due that one batch reads at most ([`pending_batch`]): a wave
/// of orders parked together, or released together by `boxoffice outbox retry --all`, is tried
/// a few at a time, so refused rows (often large ones) never fill a batch.
pub const DUE_PARKED_PER_BATCH: i64 = 10;

/// The `work_mem` under which the relay's read and [`backlog`] test the parked orders' keys:
/// PostgreSQL hashes them only when the hash fits `work_mem` × `hash_mem_multiplier` (2 in
/// PostgreSQL 15), and otherwise compares each row with every key. 64 MB holds about two
/// million parked rows' keys; the relay's session sets it at its start, [`backlog`] for its
/// own statement.
pub const PARKED_WORK_MEM: &str = "64MB";

/// Reads up to `limit` unpublished rows, oldest first, for the relay that holds
/// [`RELAY_LOCK`] (the lock, not a per-row claim, keeps two relays from publishing the same
/// rows; the caller must hold it). Nothing is written: the rows stay unpublished until
/// [`mark_published`].
///
/// An order with a row parked by [`park_refused`] is parked whole: none of its unpublished
/// rows is read (the later ones wait behind the refused fact, so an order's facts still leave
/// in the order they were written; an earlier one, whose delivery failed beside it, waits for
/// the retry too), and parked orders, however many, take no room in the batch. An order's
/// parked rows share one `retry_at`; once it has passed, the order is due, and the orders
/// of the [`DUE_PARKED_PER_BATCH`] due refused rows with the earliest `retry_at` (so at most
/// that many orders, fewer when one has several refused rows) are read again, whole; the
/// other due orders wait for a later batch.
///
/// Cost: when nothing is parked, the test is not run at all (an `OR` on a one-time result
/// from the parked rows' partial index, migration 0024), so the read is the pending index's
/// scan in `created_at` order, stopped at `limit`. Otherwise the parked orders' keys are
/// hashed once per statement (on a session with [`PARKED_WORK_MEM`], as the relay's is) and
/// each row scanned costs a probe of that hash; the scan passes over the parked orders' rows,
/// which are the oldest (20,000 parked orders with 100,000 rows: README, "Parked outbox
/// rows").
///
/// The statement runs the region fence's check (migration 0013) as a write would, through an
/// `UPDATE` of no row (statement-level triggers fire all the same): a relay whose session
/// declares an epoch the ledger has moved past, or whose region's lease has lapsed, gets the
/// fence's refusal ([`crate::region::refusal`]) and publishes nothing.
pub async fn pending_batch(c: &mut sqlx::PgConnection, limit: i64) -> Result<Vec<OutboxRow>, sqlx::Error> {
    sqlx::query_as(
        "WITH fence AS (UPDATE outbox SET published_at = NULL WHERE false RETURNING id),
         due AS MATERIALIZED (
            SELECT coalesce(array_agg(DISTINCT message_key), '{}') AS keys FROM (
              SELECT message_key FROM outbox
               WHERE retry_at <= statement_timestamp() AND refused_at IS NOT NULL AND published_at IS NULL
               ORDER BY retry_at
               LIMIT $2) d)
         SELECT o.id, o.topic, o.message_key, o.event_type, o.payload::text AS payload, o.created_at, o.region, o.region_epoch,
                o.traceparent, o.refused_at
           FROM outbox o
          WHERE o.published_at IS NULL AND NOT EXISTS (SELECT 1 FROM fence)
            AND (NOT EXISTS (SELECT 1 FROM outbox r WHERE r.refused_at IS NOT NULL AND r.published_at IS NULL)
                 OR o.message_key NOT IN (
                      SELECT p.message_key FROM outbox p
                       WHERE p.refused_at IS NOT NULL AND p.published_at IS NULL
                         AND p.message_key <> ALL ((SELECT keys FROM due)::text[])))
          ORDER BY o.created_at
          LIMIT $1",
    )
    .bind(limit)
    .bind(DUE_PARKED_PER_BATCH)
    .fetch_all(&mut *c)
    .await
}

/// Parks rows the producer refused outright (`(id, why)`: the row and the producer's error),
/// and with each its order: `refused_at` is set to now and `refusal` to `why` on the refused
/// rows, and `retry_at` to `retry_s` seconds from now on every parked row of their orders
/// (one time for the statement: `statement_timestamp()`, as the read's due test uses), so
/// an order is tried again whole ([`pending_batch`]) at that time, or when [`retry_parked`]
/// makes it due. Rows published meanwhile are left alone. Returns how many rows were refused
/// and parked.
pub async fn park_refused(
    c: &mut sqlx::PgConnection,
    refused: &[(Uuid, String)],
    retry_s: i64,
) -> Result<u64, sqlx::Error> {
    if refused.is_empty() {
        return Ok(0);
    }
    let (ids, why): (Vec<Uuid>, Vec<&str>) = refused.iter().map(|(id, w)| (*id, w.as_str())).unzip();
    let parked: i64 = sqlx::query_scalar(
        "WITH refused AS (
            UPDATE outbox o SET refused_at = statement_timestamp(), refusal = r.why,
                   retry_at = statement_timestamp() + make_interval(secs => $3::double precision)
              FROM unnest($1::uuid[], $2::text[]) AS r(id, why)
             WHERE o.id = r.id AND o.published_at IS NULL
            RETURNING o.id, o.message_key),
         others AS (
            UPDATE outbox o SET retry_at = statement_timestamp() + make_interval(secs => $3::double precision)
             WHERE o.message_key IN (SELECT message_key FROM refused) AND o.id NOT IN (SELECT id FROM refused)
               AND o.refused_at IS NOT NULL AND o.published_at IS NULL
            RETURNING 1)
         SELECT (SELECT count(*) FROM refused) + 0 * (SELECT count(*) FROM others)",
    )
    .bind(&ids)
    .bind(&why)
    .bind(retry_s)
    .fetch_one(&mut *c)
    .await?;
    Ok(parked as u64)
}

/// A parked outbox row ([`park_refused`]), as `boxoffice outbox parked` lists it.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct ParkedRow {
    /// The envelope's event id (`boxoffice outbox retry --id`).
    pub id: Uuid,
    /// The message key (the order id).
    pub message_key: String,
    /// The envelope's type.
    pub event_type: String,
    /// When the business write committed.
    pub created_at: DateTime<Utc>,
    /// When the producer last refused it.
    pub refused_at: DateTime<Utc>,
    /// When the relay tries its order again (a batch reads at most [`DUE_PARKED_PER_BATCH`]
    /// due orders).
    pub retry_at: Option<DateTime<Utc>>,
    /// The producer's error then, with the message's size.
    pub refusal: Option<String>,
    /// The other unpublished rows of its order, waiting with it.
    pub held_back: i64,
}

/// Every parked row that is still unpublished, oldest first.
pub async fn parked<'e>(ex: impl sqlx::PgExecutor<'e>) -> Result<Vec<ParkedRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT r.id, r.message_key, r.event_type, r.created_at, r.refused_at, r.retry_at, r.refusal,
                (SELECT count(*) FROM outbox l
                  WHERE l.message_key = r.message_key AND l.published_at IS NULL
                    AND l.id <> r.id) AS held_back
           FROM outbox r
          WHERE r.refused_at IS NOT NULL AND r.published_at IS NULL
          ORDER BY r.created_at",
    )
    .fetch_all(ex)
    .await
}

/// Those of `ids` that are parked rows ([`park_refused`], unpublished).
pub async fn parked_among<'e>(ex: impl sqlx::PgExecutor<'e>, ids: &[Uuid]) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT id FROM outbox WHERE id = ANY($1) AND refused_at IS NOT NULL AND published_at IS NULL",
    )
    .bind(ids)
    .fetch_all(ex)
    .await
}

/// Which parked orders [`retry_parked`] makes due.
#[derive(Debug, Clone, Copy)]
pub enum Release<'a> {
    /// The orders of these rows (event ids); ids of rows that are not parked are ignored.
    Rows(&'a [Uuid]),
    /// Every parked order (the relay still tries [`DUE_PARKED_PER_BATCH`] of them per batch).
    All,
}

/// Makes parked orders due at once (`boxoffice outbox retry`), after their cause is fixed:
/// every parked row of the orders named (by one of their rows' ids), or of all. The relay's
/// next batches try them again, and a row the producer refuses again is parked again (its
/// order with it). Returns how many parked rows were made due.
pub async fn retry_parked<'e>(ex: impl sqlx::PgExecutor<'e>, which: Release<'_>) -> Result<u64, sqlx::Error> {
    let (all, ids): (bool, &[Uuid]) = match which {
        Release::Rows(ids) => (false, ids),
        Release::All => (true, &[]),
    };
    // Still parked until published (the relay's read and the backlog count it so), due now.
    let done = sqlx::query(
        "UPDATE outbox SET retry_at = statement_timestamp()
          WHERE refused_at IS NOT NULL AND published_at IS NULL
            AND ($1 OR message_key IN (SELECT message_key FROM outbox
                                        WHERE id = ANY($2) AND refused_at IS NOT NULL AND published_at IS NULL))",
    )
    .bind(all)
    .bind(ids)
    .execute(ex)
    .await?;
    Ok(done.rows_affected())
}

/// The channel [`mark_published`] notifies: the payload is a comma-separated list of the
/// order ids (message keys) just published, at most [`NOTIFY_IDS`] per notification.
pub const ORDER_CHANNEL: &str = "boxoffice_orders";

/// Order ids per notification: 200 ids of 36 characters and their commas stay far below
/// PostgreSQL's 8,000-byte payload limit.
pub const NOTIFY_IDS: i64 = 200;

/// Marks those of `ids` that are still unpublished as published (a parked row, released and
/// now delivered, is parked no more: `refused_at` is cleared, its last `refusal` kept) and
/// counts the publication in `publish_attempts`. Returns how many rows were marked (a row marked already, by a relay
/// that led before this one, is not marked again).
///
/// The same statement notifies [`ORDER_CHANNEL`] with the distinct order ids of the rows it
/// marked (the buyers' live order status, `GET /orders/{id}/events`): one notifying
/// transaction per relay batch, since PostgreSQL serializes the commits of notifying
/// transactions.
pub async fn mark_published(c: &mut sqlx::PgConnection, ids: &[Uuid]) -> Result<u64, sqlx::Error> {
    let marked: i64 = sqlx::query_scalar(
        "WITH marked AS (
            UPDATE outbox SET published_at = clock_timestamp(), publish_attempts = publish_attempts + 1,
                              refused_at = NULL, retry_at = NULL
             WHERE id = ANY($1) AND published_at IS NULL
            RETURNING message_key),
         keys AS (
            SELECT k, (row_number() OVER (ORDER BY k) - 1) / $3 AS chunk
              FROM (SELECT DISTINCT message_key AS k FROM marked) d),
         sent AS (
            SELECT pg_notify($2, string_agg(k, ',')) FROM keys GROUP BY chunk)
         SELECT (SELECT count(*) FROM marked) + 0 * (SELECT count(*) FROM sent)",
    )
    .bind(ids)
    .bind(ORDER_CHANNEL)
    .bind(NOTIFY_IDS)
    .fetch_one(&mut *c)
    .await?;
    Ok(marked as u64)
}

/// Backlog figures. The age of the oldest row the relay will publish is the business's
/// event-delivery latency (design §7, §16); the rows of parked orders are counted apart, so a
/// parked row does not read as a stalled relay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Rows not yet published, the rows of parked orders excepted.
    pub unpublished: i64,
    /// Age of the oldest of those, ms (0 when there is none).
    pub oldest_age_ms: i64,
    /// Unpublished rows of parked orders ([`park_refused`]): the refused rows and the rows
    /// waiting with them.
    pub parked: i64,
}

/// Reads the current [`Backlog`]: one count of the unpublished rows, as before parking
/// existed; the parked orders through their partial index and their rows through the message
/// key's; the oldest publishable row by the pending index, in order (with orders parked, a
/// probe of their hashed keys per row passed over). One read-only transaction, under
/// [`PARKED_WORK_MEM`].
pub async fn backlog<'a>(
    conn: impl sqlx::Acquire<'a, Database = sqlx::Postgres>,
) -> Result<Backlog, sqlx::Error> {
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT set_config('work_mem', $1, true)").bind(PARKED_WORK_MEM).execute(&mut *tx).await?;
    let (unpublished, oldest_age_ms, parked): (i64, Option<f64>, i64) = sqlx::query_as(
        "WITH parked AS MATERIALIZED (
            SELECT DISTINCT message_key FROM outbox WHERE refused_at IS NOT NULL AND published_at IS NULL),
         held AS MATERIALIZED (
            SELECT count(*) AS n FROM parked p
              JOIN outbox o ON o.message_key = p.message_key
             WHERE o.published_at IS NULL)
         SELECT (SELECT count(*) FROM outbox WHERE published_at IS NULL) - (SELECT n FROM held),
                (SELECT EXTRACT(EPOCH FROM clock_timestamp() - o.created_at) * 1000 FROM outbox o
                  WHERE o.published_at IS NULL
                    AND (NOT EXISTS (SELECT 1 FROM parked)
                         OR o.message_key NOT IN (SELECT message_key FROM parked))
                  ORDER BY o.created_at LIMIT 1)::float8,
                (SELECT n FROM held)",
    )
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Backlog { unpublished, oldest_age_ms: oldest_age_ms.unwrap_or(0.0).max(0.0) as i64, parked })
}

/// Moves up to `limit` rows published more than `retention_s` seconds ago out of the outbox
/// and into `order_history`, in one statement (the outbox is a queue; the history keeps each
/// order's facts for its timeline, [`crate::timeline`]). A row whose key is not an order id
/// is deleted without a copy. Returns how many rows left the outbox.
///
/// Reads only the rows it moves, through `outbox_published_idx` (migration 0027; aged by
/// `now()`, which the index can take, see "Periodic sweeps" in the crate docs).
pub async fn prune_published(pool: &PgPool, retention_s: i64, limit: i64) -> Result<u64, sqlx::Error> {
    let moved: i64 = sqlx::query_scalar(
        "WITH moved AS (
            DELETE FROM outbox WHERE ctid = ANY (ARRAY(
                SELECT ctid FROM outbox
                 WHERE created_at < now() - make_interval(secs => $1::double precision)
                   AND published_at IS NOT NULL
                 ORDER BY created_at LIMIT $2))
            RETURNING id, topic, message_key, event_type, payload, created_at, published_at,
                      region, region_epoch, traceparent, xact),
         kept AS (
            INSERT INTO order_history (event_id, order_id, topic, event_type, payload, created_at,
                                       published_at, region, region_epoch, traceparent, xact)
            SELECT id, message_key::uuid, topic, event_type, payload, created_at, published_at,
                   region, region_epoch, traceparent, xact
              FROM moved
             WHERE message_key ~* '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
            ON CONFLICT (event_id) DO NOTHING)
         SELECT count(*) FROM moved",
    )
    .bind(retention_s as f64)
    .bind(limit)
    .fetch_one(pool)
    .await?;
    Ok(moved as u64)
}
