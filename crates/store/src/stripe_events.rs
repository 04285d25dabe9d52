//! Received Stripe webhook events, deduplicated on Stripe's event id (invariant 4): the row
//! and the outbox continuation commit together, so a redelivered event is acknowledged and
//! does nothing. Events for a PaymentIntent the ledger does not know yet are kept as
//! pending until its payment row exists (design §10: an early webhook is not lost). The
//! payment row's own statement resolves the pending events it sees; [`resolve_stranded`]
//! resolves those it could not see (their transaction committed after its snapshot).
//! Pending events of a PaymentIntent boxoffice did not create stay pending until
//! [`prune_unclaimed`] deletes them, with every other event recorded without an order id,
//! once Stripe can no longer redeliver them.
//!
//! It also keeps what webhook claims leave for later: capture claims the ledger settles
//! ([`settle_capture_claims`]), and the pending re-fetch of each PaymentIntent claims asked
//! for, per order they were made for ([`ask_refetch`], [`finish_refetch`]), so that claims
//! about one PaymentIntent for one order share one provider call while each is still checked
//! by a call made after it arrived, for its own order — within a budget per PaymentIntent and
//! order ([`REFETCHES_PER_PAYMENT_INTENT`] asks, [`FOLLOW_UPS_PER_PAYMENT_INTENT`] follow-ups
//! an hour, [`spend_follow_up`]), beyond which claims are left to the hold's provider check
//! and to reconciliation, so that a stream of claims costs a bounded number of provider calls;
//! and each order's budget of re-fetches for claims no pending re-fetch can cover
//! ([`spend_uncovered_refetch`]: claims naming a PaymentIntent that is not the order's, and
//! dispute claims), so that claims naming a new object id each cost a bounded number of
//! provider calls per order.

use crate::{outbox, StoreError, Tx};
use boxoffice_domain::events::refresh_reason;
use boxoffice_domain::OrderId;
use sqlx::PgPool;
use uuid::Uuid;

/// Records Stripe event `stripe_event_id`; `true` if it is new.
pub async fn record(
    tx: &mut Tx<'_>,
    stripe_event_id: &str,
    event_type: &str,
    payment_intent_id: Option<&str>,
    order: Option<OrderId>,
) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "INSERT INTO stripe_events (stripe_event_id, type, payment_intent_id, order_id)
         VALUES ($1, $2, $3, $4) ON CONFLICT (stripe_event_id) DO NOTHING",
    )
    .bind(stripe_event_id)
    .bind(event_type)
    .bind(payment_intent_id)
    .bind(order.map(|o| o.0))
    .execute(&mut **tx)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// [`record`] for an event about `order`, and in the same statement the order and its payment
/// as they stand ([`crate::payments::order_with_payment`]; `None` when the ledger has no such
/// order): whether the event is new, and what webhook ingress judges its claim against.
pub async fn record_with_order(
    tx: &mut Tx<'_>,
    stripe_event_id: &str,
    event_type: &str,
    payment_intent_id: Option<&str>,
    order: OrderId,
) -> Result<(bool, Option<crate::payments::OrderPayment>), crate::StoreError> {
    crate::payments::record_event_with_order(tx, stripe_event_id, event_type, payment_intent_id, order).await
}

/// Marks the just-recorded event `stripe_event_id` pending: its PaymentIntent has no
/// payment row yet and the event names no order.
pub async fn mark_pending(tx: &mut Tx<'_>, stripe_event_id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE stripe_events SET pending = true WHERE stripe_event_id = $1")
        .bind(stripe_event_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The `UPDATE` that resolves the pending events of PaymentIntent `pi` now that order `order`
/// owns it (the caller then re-derives the fact from Stripe); `pi` and `order` are the SQL
/// that names them (parameters, or a CTE's row; an `order` that is NULL resolves nothing).
/// [`crate::payments::record_created`] runs it in the statement that records the
/// PaymentIntent.
pub(crate) fn resolve_pending(pi: &str, order: &str) -> String {
    format!(
        "UPDATE stripe_events SET pending = false, resolved_at = clock_timestamp(), order_id = {order}
          WHERE pending AND payment_intent_id = {pi} AND {order} IS NOT NULL"
    )
}

/// How far back the expiry worker's [`resolve_stranded`] looks, seconds: a stranded event
/// arrived before its payment row was committed, so the sweep 10 s later finds it well within
/// this. The bound keeps each pass to the last hour's pending events, since those of
/// PaymentIntents boxoffice did not create (another integration on the same Stripe account)
/// are never resolved: they stay pending until [`prune_unclaimed`] deletes them. Older
/// stranded events (the expiry worker stopped for longer) are counted by the audit
/// (`stranded_webhooks`, no age bound) and resolved by `boxoffice reconcile --fix`, which
/// sweeps without the bound.
pub const STRANDED_WINDOW_S: i64 = 3_600;

/// Resolves up to `limit` pending events whose PaymentIntent has a committed payment row,
/// received within `within` seconds before this transaction began (`None`: of any age), and
/// asks for the re-fetch of each such PaymentIntent (`PaymentIntentRefreshRequested`, reason
/// [`refresh_reason::EARLY_WEBHOOK`]) in the same transaction; returns how many re-fetches it
/// asked for (one per PaymentIntent within one pass; a PaymentIntent whose events two passes
/// share is re-fetched twice, and what both report is applied once: the saga's transitions
/// are idempotent). Counted as `boxoffice_webhooks_stranded_resolved_total` (events
/// resolved).
///
/// Why it is needed: a webhook that finds no payment row marks its event pending, and the
/// statement that records the payment row resolves the pending events it sees
/// ([`crate::payments::record_created`]). Under READ COMMITTED neither sees the other's
/// uncommitted row: when the webhook read `payments` before the payment row committed, and
/// committed its event after that statement took its snapshot, the event stays pending with
/// its payment row in place, and the early webhook's news would wait for the hold's provider
/// check (rule 3 of `boxoffice_domain::hold`). Both rows are committed by the time the sweep
/// sees them, so it resolves each such event once: its row is locked (`SKIP LOCKED` for a
/// second sweeper) and a resolved row is no longer pending.
///
/// The expiry worker runs it every 10 s with [`STRANDED_WINDOW_S`]: the window is a range of
/// the partial index of pending rows by arrival (migration 0025; `now()`, not the volatile
/// `clock_timestamp()`, so that it is an index condition), so a pass reads the window's
/// pending events, not every one ever kept. Without a window it reads them all.
pub async fn resolve_stranded(pool: &PgPool, limit: i64, within: Option<i64>) -> Result<usize, StoreError> {
    static SQL: std::sync::LazyLock<[String; 2]> = std::sync::LazyLock::new(|| {
        let sweep = |window: &str| {
            format!(
                "WITH stranded AS (
                     SELECT se.id FROM stripe_events se
                       JOIN payments p ON p.payment_intent_id = se.payment_intent_id
                      WHERE se.pending {window}
                      ORDER BY se.received_at LIMIT $1 FOR UPDATE OF se SKIP LOCKED)
                 UPDATE stripe_events se
                    SET pending = false, resolved_at = clock_timestamp(), order_id = p.order_id
                   FROM stranded, payments p, orders o
                  WHERE se.id = stranded.id AND p.payment_intent_id = se.payment_intent_id
                    AND o.id = p.order_id
                 RETURNING p.order_id, o.correlation_id, p.payment_intent_id"
            )
        };
        [sweep("AND se.received_at > now() - make_interval(secs => $2)"), sweep("")]
    });
    let mut tx = pool.begin().await?;
    let rows: Vec<(Uuid, Uuid, String)> = match within {
        Some(s) => sqlx::query_as(&SQL[0]).bind(limit).bind(s as f64).fetch_all(&mut *tx).await?,
        None => sqlx::query_as(&SQL[1]).bind(limit).fetch_all(&mut *tx).await?,
    };
    if rows.is_empty() {
        return Ok(0);
    }
    let resolved = rows.len();
    // One re-fetch per PaymentIntent, however many of its events this pass resolved.
    let mut asks: Vec<(Uuid, Uuid, String)> = rows;
    asks.sort();
    asks.dedup();
    let events = outbox::refresh_requests(asks, refresh_reason::EARLY_WEBHOOK);
    outbox::insert_all(&mut tx, &events).await?;
    tx.commit().await?;
    metrics::counter!("boxoffice_webhooks_stranded_resolved_total").increment(resolved as u64);
    Ok(events.len())
}

/// A capture claimed by a webhook while the saga's capture request was outstanding
/// (`capture_outstanding`), which the ledger settles later instead of at once (migration
/// 0032).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureClaim {
    /// The webhook event that made the claim (`evt_…`).
    pub stripe_event_id: String,
    /// The order.
    pub order_id: OrderId,
    /// The PaymentIntent it claims captured (`pi_…`), the order's current one.
    pub payment_intent_id: String,
}

/// Keeps `claims` (webhook events recorded in `tx`) for [`settle_capture_claims`], in one
/// statement; nothing when empty.
pub async fn await_capture(tx: &mut Tx<'_>, claims: &[CaptureClaim]) -> Result<(), sqlx::Error> {
    if claims.is_empty() {
        return Ok(());
    }
    let events: Vec<&str> = claims.iter().map(|c| c.stripe_event_id.as_str()).collect();
    let orders: Vec<Uuid> = claims.iter().map(|c| c.order_id.0).collect();
    let intents: Vec<&str> = claims.iter().map(|c| c.payment_intent_id.as_str()).collect();
    sqlx::query(
        "INSERT INTO capture_claims (stripe_event_id, order_id, payment_intent_id)
         SELECT * FROM unnest($1::text[], $2::uuid[], $3::text[])",
    )
    .bind(&events)
    .bind(&orders)
    .bind(&intents)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// How long a capture claim waits before [`settle_capture_claims`] looks at it, seconds: the
/// payment worker records the capture's answer milliseconds after the provider sent it, and
/// seconds after under load; a claim still unrecorded after this is asked of the provider.
pub const CAPTURE_CLAIM_GRACE_S: i64 = 30;

/// What one pass of [`settle_capture_claims`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SettledClaims {
    /// Claims settled (deleted), those of an order the ledger does not have included.
    pub settled: usize,
    /// Claims whose capture the ledger records: deleted, nothing asked.
    pub recorded: usize,
    /// Re-fetches asked for: one per PaymentIntent among the claims whose capture the ledger
    /// does not record (deleted too).
    pub refetches: usize,
}

/// Settles up to `limit` capture claims received more than `grace_s` seconds before this
/// transaction began, the oldest first, in one transaction: deletes them (`SKIP LOCKED`, so a
/// second sweeper takes others), and asks for a re-fetch (`PaymentIntentRefreshRequested`,
/// reason [`refresh_reason::CAPTURE_OUTSTANDING`]) of each PaymentIntent whose capture the
/// order's payment row does not record ([`boxoffice_domain::events::capture_claim_recorded`]):
/// the capture command may never record it (dead-lettered), and the provider's word is what
/// the saga then acts on. Counted as `boxoffice_capture_claims_settled_total{outcome}`
/// (`capture_recorded`, `refetch`).
///
/// The expiry worker runs it every 10 s with [`CAPTURE_CLAIM_GRACE_S`], pass after pass while
/// passes are full. It reads only the claims it settles, through the table's key (arrival
/// first; `now()`, not the volatile `clock_timestamp()`, so that the age is an index
/// condition), and each one's order and payment by their keys (`LATERAL` subqueries the
/// planner cannot turn into joins that read either table whole).
///
/// # Errors
/// The database's; nothing is settled then.
pub async fn settle_capture_claims(
    pool: &PgPool,
    grace_s: i64,
    limit: i64,
) -> Result<SettledClaims, StoreError> {
    let mut tx = pool.begin().await?;
    /// A settled claim with its order's correlation id and the payment row as it stands.
    #[derive(sqlx::FromRow)]
    struct Due {
        order_id: Uuid,
        correlation_id: Option<Uuid>,
        claimed: String,
        recorded_intent: Option<String>,
        recorded_status: Option<String>,
    }
    let rows: Vec<Due> = sqlx::query_as(
        "WITH due AS (
             DELETE FROM capture_claims WHERE ctid = ANY (ARRAY(
                 SELECT ctid FROM capture_claims
                  WHERE received_at < now() - make_interval(secs => $1::double precision)
                  ORDER BY received_at LIMIT $2 FOR UPDATE SKIP LOCKED))
             RETURNING order_id, payment_intent_id)
         SELECT due.order_id, o.correlation_id, due.payment_intent_id AS claimed,
                p.payment_intent_id AS recorded_intent, p.status AS recorded_status
           FROM due
           LEFT JOIN LATERAL (SELECT correlation_id FROM orders WHERE id = due.order_id OFFSET 0) o ON true
           LEFT JOIN LATERAL (
                SELECT payment_intent_id, status FROM payments WHERE order_id = due.order_id OFFSET 0) p ON true",
    )
    .bind(grace_s as f64)
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    if rows.is_empty() {
        return Ok(SettledClaims::default());
    }
    let settled = rows.len();
    let mut recorded = 0;
    let mut asks: Vec<(Uuid, Uuid, String)> = Vec::with_capacity(rows.len());
    for d in rows {
        // An order the ledger does not have has no saga step to re-fetch for (webhook
        // ingress keeps claims only for orders it found, and orders are never deleted).
        let Some(correlation_id) = d.correlation_id else { continue };
        let is_recorded = match (&d.recorded_intent, &d.recorded_status) {
            (Some(intent), Some(status)) => boxoffice_domain::events::capture_claim_recorded(
                intent,
                &boxoffice_domain::PaymentIntentStatus::from(status.as_str()),
                &d.claimed,
            ),
            _ => false,
        };
        if is_recorded {
            recorded += 1;
        } else {
            asks.push((d.order_id, correlation_id, d.claimed));
        }
    }
    // One re-fetch per PaymentIntent, however many of its claims this pass settled.
    asks.sort();
    asks.dedup();
    let events = outbox::refresh_requests(asks, refresh_reason::CAPTURE_OUTSTANDING);
    outbox::insert_all(&mut tx, &events).await?;
    tx.commit().await?;
    let refetches = events.len();
    metrics::counter!("boxoffice_capture_claims_settled_total", "outcome" => "capture_recorded")
        .increment(recorded as u64);
    metrics::counter!("boxoffice_capture_claims_settled_total", "outcome" => "refetch")
        .increment(refetches as u64);
    Ok(SettledClaims { settled, recorded, refetches })
}

/// How long a re-fetch asked for by a webhook claim covers later claims about its
/// PaymentIntent, seconds (migration 0033): a claim within this of the ask, before the payment
/// worker has made it, asks nothing more; one later asks again (the ask may have been
/// dead-lettered, or the worker may lag this much, and then a second re-fetch is cheap).
pub const REFETCH_COALESCE_S: i64 = 30;

/// How many re-fetches webhook claims about one PaymentIntent, made for one order, may ask for
/// per [`REFETCH_BUDGET_WINDOW_S`] (migration 0036). A genuine purchase asks one (its
/// authorization's claim), a card declined a few times one per decline; a claim that would ask
/// one more is recorded and left ([`RefetchAsk::OverBudget`]). The payment worker's follow-ups
/// have a budget of their own ([`FOLLOW_UPS_PER_PAYMENT_INTENT`]).
pub const REFETCHES_PER_PAYMENT_INTENT: i32 = 8;

/// How many follow-up re-fetches ([`finish_refetch`]: claims counted while a re-fetch's call
/// was under way) the payment worker may ask for one PaymentIntent and order per
/// [`REFETCH_BUDGET_WINDOW_S`] (migration 0036, [`spend_follow_up`]). A genuine purchase needs
/// one only when its authorization's webhook arrives during the hold's provider check.
pub const FOLLOW_UPS_PER_PAYMENT_INTENT: i32 = 4;

/// The window of [`REFETCHES_PER_PAYMENT_INTENT`] and [`FOLLOW_UPS_PER_PAYMENT_INTENT`],
/// seconds (an hour), from the first re-fetch that spent the budget.
pub const REFETCH_BUDGET_WINDOW_S: i64 = 3_600;

/// What a webhook claim about a PaymentIntent did with its re-fetch ([`ask_refetch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefetchAsk {
    /// No re-fetch of the PaymentIntent for the order is pending (or the pending one was asked
    /// more than [`REFETCH_COALESCE_S`] ago): the claim must ask for one now.
    Ask,
    /// The pending re-fetch covers the claim: it reads the provider after the claim arrived
    /// ([`finish_refetch`] asks once more for the claims it may have missed).
    Coalesced,
    /// A re-fetch would be due, but the claims about this PaymentIntent and order asked for
    /// [`REFETCHES_PER_PAYMENT_INTENT`] in the current window: nothing is asked, and the
    /// claim protects nothing: the hold's provider check, not budgeted, finds an authorization
    /// at the hold's end; reconciliation compares the provider's PaymentIntents with the ledger.
    OverBudget,
}

/// Counts a webhook claim about `payment_intent_id` made for `order` (the order its metadata
/// names, or the one that owns the PaymentIntent) that asks the provider for news, in `tx`, in
/// one statement, and says whether it asks for a re-fetch ([`RefetchAsk`]): it asks when no
/// re-fetch of this PaymentIntent for this order is pending (none was asked, the last one was
/// made, or the pending one was asked more than [`REFETCH_COALESCE_S`] ago) and the claims'
/// budget allows ([`REFETCHES_PER_PAYMENT_INTENT`] per [`REFETCH_BUDGET_WINDOW_S`], from the
/// first ask of the window); a pending re-fetch covers it otherwise: that re-fetch reads the
/// provider after the claim arrived (the claim's time is its statement's, later than its
/// request's arrival; [`finish_refetch`] asks once more for the claims the re-fetch may have
/// missed). Counted as `boxoffice_webhook_refetches_coalesced_total` when coalesced.
///
/// Only a re-fetch made for the same order covers a claim (migration 0034): one made for
/// another order, which a claim naming someone else's PaymentIntent could have asked for, is
/// refuted and checks nothing for this one.
///
/// The row's lock is held to `tx`'s commit: a claim waits for one in flight about the same
/// PaymentIntent and order (webhook ingress batches one event per order), never for the
/// payment worker, whose [`finish_refetch`] skips a locked row.
///
/// # Errors
/// The database's.
pub async fn ask_refetch(
    tx: &mut Tx<'_>,
    payment_intent_id: &str,
    order: OrderId,
) -> Result<RefetchAsk, sqlx::Error> {
    // `asked_at = statement_timestamp()` after the statement is true only of a row this
    // statement inserted or asked again: another statement's timestamp is earlier. A made
    // re-fetch's row has `asked_at` = '-infinity' (`finish_refetch`): asked long ago.
    let (asked, covered): (bool, bool) = sqlx::query_as(
        "INSERT INTO payment_intent_refetches AS r
                (payment_intent_id, order_id, asked_at, last_claim_at, window_started_at, asks)
         VALUES ($1, $2, statement_timestamp(), statement_timestamp(), statement_timestamp(), 1)
         ON CONFLICT (payment_intent_id, order_id) DO UPDATE
            SET claims = r.claims + 1,
                last_claim_at = statement_timestamp(),
                window_started_at = CASE WHEN r.window_started_at < statement_timestamp() - make_interval(secs => $4::double precision)
                                         THEN statement_timestamp() ELSE r.window_started_at END,
                asks = CASE WHEN r.asked_at >= statement_timestamp() - make_interval(secs => $3::double precision)
                                 AND r.window_started_at < statement_timestamp() - make_interval(secs => $4::double precision)
                            THEN 0
                            WHEN r.asked_at >= statement_timestamp() - make_interval(secs => $3::double precision)
                            THEN r.asks
                            WHEN r.window_started_at < statement_timestamp() - make_interval(secs => $4::double precision)
                            THEN 1
                            WHEN r.asks < $5 THEN r.asks + 1
                            ELSE r.asks END,
                asked_at = CASE WHEN r.asked_at >= statement_timestamp() - make_interval(secs => $3::double precision)
                                THEN r.asked_at
                                WHEN r.window_started_at < statement_timestamp() - make_interval(secs => $4::double precision)
                                     OR r.asks < $5
                                THEN statement_timestamp()
                                ELSE r.asked_at END
         RETURNING asked_at = statement_timestamp(),
                   asked_at >= statement_timestamp() - make_interval(secs => $3::double precision)",
    )
    .bind(payment_intent_id)
    .bind(order.0)
    .bind(REFETCH_COALESCE_S as f64)
    .bind(REFETCH_BUDGET_WINDOW_S as f64)
    .bind(REFETCHES_PER_PAYMENT_INTENT)
    .fetch_one(&mut **tx)
    .await?;
    Ok(if asked {
        RefetchAsk::Ask
    } else if covered {
        metrics::counter!("boxoffice_webhook_refetches_coalesced_total").increment(1);
        RefetchAsk::Coalesced
    } else {
        RefetchAsk::OverBudget
    })
}

/// Ends the pending re-fetch of `payment_intent_id` for `order` in `tx`, the transaction that
/// records what the provider said, in one statement: marks it made (its row stays, with the
/// claims' budget, [`REFETCHES_PER_PAYMENT_INTENT`]) if every claim it counts arrived before
/// `read_at` (the ledger's time when the payment worker read the ledger, before it asked the
/// provider: those claims are covered). Returns `true` if a claim may not be covered — one
/// counted at or after `read_at`, or one in flight (its row is locked; it is skipped, not
/// waited for) — and the caller must ask for one more re-fetch within its own budget
/// ([`spend_follow_up`]; also when such a claim asked for a re-fetch itself, its pending one
/// having aged past [`REFETCH_COALESCE_S`]: one re-fetch more than needed); `false` when no
/// re-fetch is pending (one the hold's provider check or a sweep asked for).
///
/// # Errors
/// The database's.
pub async fn finish_refetch(
    tx: &mut Tx<'_>,
    payment_intent_id: &str,
    order: OrderId,
    read_at: chrono::DateTime<chrono::Utc>,
) -> Result<bool, sqlx::Error> {
    // The snapshot's pending row, if any, is either marked made here or reported: a row whose
    // claim committed after the snapshot fails the re-check of `FOR UPDATE` and stays.
    let left: bool = sqlx::query_scalar(
        "WITH made AS (
             UPDATE payment_intent_refetches SET asked_at = '-infinity'
              WHERE payment_intent_id = $1 AND order_id = $3 AND ctid = ANY (ARRAY(
                 SELECT ctid FROM payment_intent_refetches
                  WHERE payment_intent_id = $1 AND order_id = $3 AND last_claim_at < $2
                    AND asked_at > '-infinity'
                    FOR UPDATE SKIP LOCKED))
             RETURNING payment_intent_id)
         SELECT EXISTS (SELECT 1 FROM payment_intent_refetches r
                         WHERE r.payment_intent_id = $1 AND r.order_id = $3 AND r.asked_at > '-infinity'
                           AND NOT EXISTS (SELECT 1 FROM made))",
    )
    .bind(payment_intent_id)
    .bind(read_at)
    .bind(order.0)
    .fetch_one(&mut **tx)
    .await?;
    Ok(left)
}

/// Spends one of the follow-up re-fetches of `payment_intent_id` for `order`
/// ([`FOLLOW_UPS_PER_PAYMENT_INTENT`] per [`REFETCH_BUDGET_WINDOW_S`]) in `tx`, the payment
/// worker's, in one statement: `true` if the follow-up [`finish_refetch`] called for may be
/// asked, `false` if that many were asked in the current window. Its table is written by the
/// payment worker alone (one transaction per order at a time), so it never waits for a
/// claim's lock. After a refusal the caller ends the pending re-fetch
/// ([`drop_pending_refetch`]): claims after it ask again within the claims' budget. The first
/// refusal of a window is logged as a warning; every one is
/// counted in `boxoffice_refetch_follow_ups_refused_total`.
///
/// # Errors
/// The database's.
pub async fn spend_follow_up(
    tx: &mut Tx<'_>,
    payment_intent_id: &str,
    order: OrderId,
) -> Result<bool, sqlx::Error> {
    let made: i32 = sqlx::query_scalar(
        "INSERT INTO payment_intent_follow_ups AS f (payment_intent_id, order_id, window_started_at, made)
         VALUES ($1, $2, statement_timestamp(), 1)
         ON CONFLICT (payment_intent_id, order_id) DO UPDATE
            SET window_started_at = CASE WHEN f.window_started_at < statement_timestamp() - make_interval(secs => $3::double precision)
                                         THEN statement_timestamp() ELSE f.window_started_at END,
                made = CASE WHEN f.window_started_at < statement_timestamp() - make_interval(secs => $3::double precision)
                            THEN 1 ELSE f.made + 1 END
         RETURNING made",
    )
    .bind(payment_intent_id)
    .bind(order.0)
    .bind(REFETCH_BUDGET_WINDOW_S as f64)
    .fetch_one(&mut **tx)
    .await?;
    if made > FOLLOW_UPS_PER_PAYMENT_INTENT {
        metrics::counter!("boxoffice_refetch_follow_ups_refused_total").increment(1);
    }
    if made == FOLLOW_UPS_PER_PAYMENT_INTENT + 1 {
        tracing::warn!(order.id = %order, payment_intent.id = %payment_intent_id, budget = FOLLOW_UPS_PER_PAYMENT_INTENT,
            window_s = REFETCH_BUDGET_WINDOW_S,
            "webhook claims kept arriving during this PaymentIntent's re-fetches: no more follow-up re-fetches this window; the claims are left to the hold's provider check and to reconciliation");
    }
    Ok(made <= FOLLOW_UPS_PER_PAYMENT_INTENT)
}

/// Marks the pending re-fetch of `payment_intent_id` for `order` made without making it, in
/// `tx`, the payment worker's, in one statement, after [`spend_follow_up`] refused the
/// follow-up [`finish_refetch`] called for: no re-fetch is pending any more, so a later claim
/// asks within the claims' budget ([`REFETCHES_PER_PAYMENT_INTENT`]) or is left, rather than
/// being counted as covered by a re-fetch that will not come. A row locked by a claim in
/// flight is skipped, not waited for (as [`finish_refetch`] does); that claim is then covered
/// by nothing until the pending ask ages past [`REFETCH_COALESCE_S`].
///
/// # Errors
/// The database's.
pub async fn drop_pending_refetch(
    tx: &mut Tx<'_>,
    payment_intent_id: &str,
    order: OrderId,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE payment_intent_refetches SET asked_at = '-infinity'
          WHERE payment_intent_id = $1 AND order_id = $2 AND ctid = ANY (ARRAY(
             SELECT ctid FROM payment_intent_refetches
              WHERE payment_intent_id = $1 AND order_id = $2 AND asked_at > '-infinity'
                FOR UPDATE SKIP LOCKED))",
    )
    .bind(payment_intent_id)
    .bind(order.0)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Deletes up to `limit` rows of [`spend_follow_up`]'s budgets whose window began more than
/// `window_s` seconds ago, the oldest first, through `payment_intent_follow_ups_window_idx`
/// (migration 0036). Returns how many went. The expiry worker runs it every 10 s with
/// [`REFETCH_BUDGET_WINDOW_S`].
///
/// # Errors
/// The database's.
pub async fn prune_follow_ups(pool: &PgPool, window_s: i64, limit: i64) -> Result<u64, sqlx::Error> {
    prune_ended_windows(pool, "payment_intent_follow_ups", window_s, limit).await
}

/// The prune of a budget table whose rows carry the start of their window
/// (`window_started_at`, indexed): deletes up to `limit` rows whose window began more than
/// `window_s` seconds ago, the oldest first. `table` is one of this module's budget tables.
async fn prune_ended_windows(
    pool: &PgPool,
    table: &'static str,
    window_s: i64,
    limit: i64,
) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(&format!(
        "DELETE FROM {table} WHERE ctid = ANY (ARRAY(
            SELECT ctid FROM {table}
             WHERE window_started_at < now() - make_interval(secs => $1::double precision)
             ORDER BY window_started_at LIMIT $2))"
    ))
    .bind(window_s as f64)
    .bind(limit)
    .execute(pool)
    .await?;
    Ok(r.rows_affected())
}

/// How long after its last claim a re-fetch's row is kept, seconds (an hour): made or
/// dead-lettered, a row older than [`REFETCH_COALESCE_S`] no longer holds back a claim, and
/// its budget's window ([`REFETCH_BUDGET_WINDOW_S`], which began at or before its last claim)
/// has ended, so this only bounds the table.
pub const REFETCH_RETENTION_S: i64 = 3_600;

/// Deletes up to `limit` rows of re-fetches whose last claim is more than `retention_s`
/// seconds old (made, or never ended), the oldest first, through
/// `payment_intent_refetches_claimed_idx` (migration 0033). Returns how many went. The
/// expiry worker runs it every 10 s with [`REFETCH_RETENTION_S`].
///
/// # Errors
/// The database's.
pub async fn prune_refetches(pool: &PgPool, retention_s: i64, limit: i64) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(
        "DELETE FROM payment_intent_refetches WHERE ctid = ANY (ARRAY(
            SELECT ctid FROM payment_intent_refetches
             WHERE last_claim_at < now() - make_interval(secs => $1::double precision)
             ORDER BY last_claim_at LIMIT $2))",
    )
    .bind(retention_s as f64)
    .bind(limit)
    .execute(pool)
    .await?;
    Ok(r.rows_affected())
}

/// How many of one order's webhook claims that no pending re-fetch of the order's own
/// PaymentIntent can cover may ask for a re-fetch, per [`UNCOVERED_REFETCH_WINDOW_S`]
/// (migration 0035): authorization claims naming a PaymentIntent that is not the order's
/// recorded one (or claimed before the order records one), and dispute claims. Each such claim
/// spends one, also one whose re-fetch is then covered by a pending re-fetch of the same
/// PaymentIntent ([`ask_refetch`]). A genuine order has none of these or one or two (an
/// authorization of a PaymentIntent a fenced region's writer created; a dispute opened and
/// closed).
pub const UNCOVERED_REFETCHES_PER_ORDER: i32 = 4;

/// The window of [`UNCOVERED_REFETCHES_PER_ORDER`], seconds (an hour), from the first claim
/// that spent the budget.
pub const UNCOVERED_REFETCH_WINDOW_S: i64 = 3_600;

/// Spends one of `order`'s uncovered re-fetches ([`UNCOVERED_REFETCHES_PER_ORDER`]) in `tx`,
/// in one statement: `true` if the claim may ask for its re-fetch, `false` if the order has
/// asked for that many in the current window ([`UNCOVERED_REFETCH_WINDOW_S`], begun by the
/// first of them; a claim after the window begins a new one). A claim refused here is
/// recorded without a re-fetch and left to reconciliation, which compares the provider's
/// PaymentIntents with the ledger whatever the claims said (`boxoffice reconcile`). The
/// first refusal of a window is logged as a warning; every one is counted in
/// `boxoffice_stripe_webhooks_total{outcome="left_to_reconciliation"}`.
///
/// The row's lock is held to `tx`'s commit: claims about one order are counted one at a time
/// (webhook ingress batches one event per order).
///
/// # Errors
/// The database's.
pub async fn spend_uncovered_refetch(tx: &mut Tx<'_>, order: OrderId) -> Result<bool, sqlx::Error> {
    let asked: i32 = sqlx::query_scalar(
        "INSERT INTO order_refetch_budget AS b (order_id, window_started_at, asked)
         VALUES ($1, statement_timestamp(), 1)
         ON CONFLICT (order_id) DO UPDATE
            SET window_started_at = CASE WHEN b.window_started_at < statement_timestamp() - make_interval(secs => $2::double precision)
                                         THEN statement_timestamp() ELSE b.window_started_at END,
                asked = CASE WHEN b.window_started_at < statement_timestamp() - make_interval(secs => $2::double precision)
                             THEN 1 ELSE b.asked + 1 END
         RETURNING asked",
    )
    .bind(order.0)
    .bind(UNCOVERED_REFETCH_WINDOW_S as f64)
    .fetch_one(&mut **tx)
    .await?;
    if asked == UNCOVERED_REFETCHES_PER_ORDER + 1 {
        tracing::warn!(order.id = %order, budget = UNCOVERED_REFETCHES_PER_ORDER, window_s = UNCOVERED_REFETCH_WINDOW_S,
            "webhook claims about objects the ledger does not record for this order spent its re-fetch budget: this one and the rest of the window are left to reconciliation");
    }
    Ok(asked <= UNCOVERED_REFETCHES_PER_ORDER)
}

/// Deletes up to `limit` rows of [`spend_uncovered_refetch`]'s budgets whose window began more
/// than `window_s` seconds ago (they no longer limit anything), the oldest first, through
/// `order_refetch_budget_window_idx` (migration 0035). Returns how many went. The expiry
/// worker runs it every 10 s with [`UNCOVERED_REFETCH_WINDOW_S`].
///
/// # Errors
/// The database's.
pub async fn prune_refetch_budgets(pool: &PgPool, window_s: i64, limit: i64) -> Result<u64, sqlx::Error> {
    prune_ended_windows(pool, "order_refetch_budget", window_s, limit).await
}

/// How long an event recorded without an order id is kept, by default, seconds (7
/// days): Stripe retries an unacknowledged webhook for up to three days, and the row is what
/// makes a redelivery a duplicate (invariant 4).
pub const UNCLAIMED_RETENTION_S: i64 = 7 * 86_400;

/// The shortest retention [`prune_unclaimed`] accepts, seconds (4 days): Stripe's three days of
/// redelivery and a day's margin.
pub const MIN_UNCLAIMED_RETENTION_S: i64 = 4 * 86_400;

/// Deletes up to `limit` events recorded without an order id (`order_id` NULL: no
/// `metadata.order_id` and no payment row, such as the events of another integration's
/// PaymentIntents on the same Stripe account, and of types boxoffice does not handle; an
/// event whose metadata names an order this ledger lacks keeps that id and is kept, as
/// evidence of a PaymentIntent `reconcile --fix` settles), the oldest first, received more than
/// `retention_s` seconds ago (at least [`MIN_UNCLAIMED_RETENTION_S`]; a shorter one is
/// raised to it). An event whose PaymentIntent has a payment row is kept whatever its age:
/// it is stranded news for an order, which [`resolve_stranded`] hands on (the audit counts
/// it). Events about an order stay with the order's timeline. Returns how many went;
/// counted as `boxoffice_webhook_events_pruned_total`.
///
/// Reads only the rows it deletes, through `stripe_events_unclaimed_idx` (migration 0028;
/// aged by `now()`, see "Periodic sweeps" in the crate docs). The expiry worker runs it every
/// 10 s with `webhook_event_retention_s`.
pub async fn prune_unclaimed(pool: &PgPool, retention_s: i64, limit: i64) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(
        "DELETE FROM stripe_events WHERE ctid = ANY (ARRAY(
            SELECT se.ctid FROM stripe_events se
             WHERE se.order_id IS NULL
               AND se.received_at < now() - make_interval(secs => $1::double precision)
               AND NOT EXISTS (SELECT 1 FROM payments p WHERE p.payment_intent_id = se.payment_intent_id)
             ORDER BY se.received_at LIMIT $2))",
    )
    .bind(retention_s.max(MIN_UNCLAIMED_RETENTION_S) as f64)
    .bind(limit)
    .execute(pool)
    .await?;
    let pruned = r.rows_affected();
    if pruned > 0 {
        metrics::counter!("boxoffice_webhook_events_pruned_total").increment(pruned);
    }
    Ok(pruned)
}

/// Records an incident (money moved for an order that could not be fulfilled, drift, …).
pub async fn incident(
    tx: &mut Tx<'_>,
    order: Option<OrderId>,
    kind: &str,
    detail: serde_json::Value,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO incidents (order_id, kind, detail) VALUES ($1, $2, $3)")
        .bind(order.map(|o| o.0))
        .bind(kind)
        .bind(detail)
        .execute(&mut **tx)
        .await?;
    metrics::counter!("boxoffice_incidents_total", "kind" => kind.to_owned()).increment(1);
    Ok(())
}
