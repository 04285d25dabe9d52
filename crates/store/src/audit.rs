//! Invariant checks over the ledger, shared by `boxoffice audit` and the onsale report.
//! Every count must be zero on a healthy system. These are the checks PostgreSQL alone can
//! answer; the checks against the payment provider and the dead-letter topic live beside
//! the command (`boxoffice::audit`), which needs Stripe and Kafka clients this crate does
//! not have.

use serde::Serialize;
use sqlx::PgPool;
use std::collections::BTreeMap;

/// Violations of the invariants, each a count of offending rows.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Violations {
    /// Seats with more than one ticket, or with a ticket and another order's unreleased hold
    /// (invariant 1).
    pub oversold: i64,
    /// Seats with more than one unreleased hold row (invariant 1).
    pub double_active_holds: i64,
    /// Tickets whose order has no captured payment (invariant 2).
    pub tickets_without_capture: i64,
    /// Payments captured for orders with neither tickets nor a full refund (invariant 6).
    pub captured_without_ticket_or_refund: i64,
    /// Valid (unvoided) tickets whose payment was refunded in full (case C14) or whose
    /// charge's dispute was lost (case C15): money back and the seat still admitted.
    pub tickets_valid_after_refund: i64,
    /// Authorizations the ledger still shows as `requires_capture` although their
    /// `capture_before` has passed (database clock): money held on a card that can no longer
    /// be captured and was never released (invariant 6, case C09).
    pub uncaptured_past_deadline: i64,
    /// Orders in a non-final state for longer than the bound.
    pub stuck_orders: i64,
    /// Outbox rows still unpublished [`UNPUBLISHED_GRACE_MS`] after they were written
    /// (invariant 5); younger rows are the relay's normal latency, not a violation.
    pub unpublished_outbox: i64,
    /// Webhook events still pending [`STRANDED_GRACE_MS`] after they arrived although their
    /// PaymentIntent's payment row exists: news of a payment the saga has not been asked to
    /// re-derive (design §10). The expiry worker's sweep
    /// ([`crate::stripe_events::resolve_stranded`]) resolves those of the last hour every
    /// 10 s, `boxoffice reconcile --fix` those of any age; this count has no age bound.
    pub stranded_webhooks: i64,
    /// Capture claims still unsettled [`UNSETTLED_CLAIM_GRACE_MS`] after they arrived: a
    /// capture a webhook reported while the saga's was outstanding, which the expiry worker's
    /// sweep ([`crate::stripe_events::settle_capture_claims`]) settles once
    /// [`crate::stripe_events::CAPTURE_CLAIM_GRACE_S`] have passed, asking the provider when
    /// the ledger does not record the capture. No sweep is running.
    pub unsettled_capture_claims: i64,
}

/// How old an unpublished outbox row must be before the audit counts it, ms. The relay
/// publishes within milliseconds when healthy; five seconds is far above that and far
/// below anything an operator would call stuck.
pub const UNPUBLISHED_GRACE_MS: i64 = 5_000;

/// How old a pending webhook event with a payment row must be before the audit counts it,
/// ms: three periods of the sweep that resolves it.
pub const STRANDED_GRACE_MS: i64 = 30_000;

/// How old a capture claim must be before the audit counts it, ms: its grace and three
/// periods of the sweep that settles it.
pub const UNSETTLED_CLAIM_GRACE_MS: i64 = crate::stripe_events::CAPTURE_CLAIM_GRACE_S * 1_000 + 30_000;

impl Violations {
    /// Sum of all counts.
    pub fn total(&self) -> i64 {
        self.oversold
            + self.double_active_holds
            + self.tickets_without_capture
            + self.captured_without_ticket_or_refund
            + self.tickets_valid_after_refund
            + self.uncaptured_past_deadline
            + self.stuck_orders
            + self.unpublished_outbox
            + self.stranded_webhooks
            + self.unsettled_capture_claims
    }
}

/// Business totals for a report.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Totals {
    /// Orders per status.
    pub orders_by_status: BTreeMap<String, i64>,
    /// Tickets issued (voided ones included: a ticket is never deleted).
    pub tickets: i64,
    /// Distinct seats with a valid (not voided) ticket.
    pub seats_sold: i64,
    /// Payments with a refund.
    pub refunds: i64,
    /// Payments captured.
    pub captured: i64,
    /// Incidents recorded.
    pub incidents: i64,
}

/// How far the pipeline is from idle, read in one statement (one snapshot): what a drain
/// waits for before anything compares the ledger with the provider or counts the result.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// Orders of the event not in a final status.
    pub open_orders: i64,
    /// Outbox rows not yet published (all events: the outbox is shared).
    pub unpublished: i64,
    /// Orders of the event that ended without a sale (`expired`, `failed` or `canceled`)
    /// whose PaymentIntent the ledger does not show `canceled` yet; `None` when not counted
    /// (no event given, or orders still open or rows unpublished, when it decides nothing
    /// and would read every payment of the onsale each time).
    pub pending_cancels: Option<i64>,
}

impl Progress {
    /// Every order final, every row published and every counted cancel recorded.
    pub fn idle(&self) -> bool {
        self.open_orders == 0 && self.unpublished == 0 && self.pending_cancels.unwrap_or(0) == 0
    }
}

/// Reads [`Progress`] for `event` (or the outbox alone when `None`).
///
/// The pending cancels are the gap between an order's end and its PaymentIntent's cancel in
/// the ledger. Every expired, failed or canceled order's PaymentIntent is canceled
/// (invariant 6): by the cancel requested when the order ended
/// ([`crate::payments::request_cancel`]), or, for an intent the payment worker recorded after
/// the order ended, by the cancel the saga requests when it reads `PaymentIntentCreated`; a
/// cancel that finds the money captured turns the order into `refunding`, which is not
/// final. The order is final before the cancel lands: the payment worker calls the provider
/// and records the answer in a transaction of its own, and a crash, a provider error after
/// the cancel applied, or a retry stretches the gap. Until it closes, the provider and the
/// ledger disagree. An intent that can never be canceled (Stripe refuses to cancel one in
/// `processing`) keeps the count above 0.
pub async fn progress(pool: &PgPool, event: Option<uuid::Uuid>) -> Result<Progress, sqlx::Error> {
    use boxoffice_domain::{OrderStatus, PaymentIntentStatus};
    let finals: Vec<&str> = OrderStatus::ALL.iter().filter(|s| s.is_final()).map(|s| s.as_str()).collect();
    let unsold: Vec<&str> = OrderStatus::ALL
        .iter()
        .filter(|s| s.is_final() && !matches!(s, OrderStatus::Ticketed | OrderStatus::Refunded))
        .map(|s| s.as_str())
        .collect();
    // The cancels' subquery is an InitPlan: PostgreSQL runs it only when the CASE reaches it.
    let (open_orders, unpublished, pending_cancels): (i64, i64, Option<i64>) = sqlx::query_as(
        "WITH progress AS (
            SELECT (SELECT count(*) FROM orders WHERE event_id = $1 AND NOT (status = ANY($2))) AS open_orders,
                   (SELECT count(*) FROM outbox WHERE published_at IS NULL) AS unpublished)
         SELECT open_orders, unpublished,
                CASE WHEN $1::uuid IS NOT NULL AND open_orders = 0 AND unpublished = 0 THEN
                    (SELECT count(*) FROM payments p JOIN orders o ON o.id = p.order_id
                      WHERE o.event_id = $1 AND o.status = ANY($3) AND p.status <> $4)
                END
           FROM progress",
    )
    .bind(event)
    .bind(&finals)
    .bind(&unsold)
    .bind(PaymentIntentStatus::Canceled.as_str())
    .fetch_one(pool)
    .await?;
    Ok(Progress { open_orders, unpublished, pending_cancels })
}

/// Runs every invariant check. `stuck_after_ms` bounds how long an order may sit in a
/// non-final state; `event` restricts the checks to one event when given.
pub async fn violations(
    pool: &PgPool,
    stuck_after_ms: i64,
    event: Option<uuid::Uuid>,
) -> Result<Violations, sqlx::Error> {
    let q = |sql: &'static str| sqlx::query_scalar::<_, i64>(sql).bind(event);
    Ok(Violations {
        oversold: q("SELECT
                (SELECT count(*) FROM (SELECT seat_id FROM tickets WHERE seat_released_at IS NULL AND ($1::uuid IS NULL OR event_id = $1)
                                        GROUP BY seat_id HAVING count(*) > 1) d)
              + (SELECT count(DISTINCT t.seat_id) FROM tickets t
                   JOIN hold_seats hs ON hs.seat_id = t.seat_id AND hs.released_at IS NULL
                   JOIN holds h ON h.id = hs.hold_id
                  WHERE h.order_id <> t.order_id AND t.seat_released_at IS NULL AND ($1::uuid IS NULL OR t.event_id = $1))")
        .fetch_one(pool)
        .await?,
        double_active_holds: q("SELECT count(*) FROM (
                SELECT hs.seat_id FROM hold_seats hs JOIN seats s ON s.id = hs.seat_id
                 WHERE hs.released_at IS NULL AND ($1::uuid IS NULL OR s.event_id = $1)
                 GROUP BY hs.seat_id HAVING count(*) > 1) d")
        .fetch_one(pool)
        .await?,
        tickets_without_capture: q("SELECT count(*) FROM tickets t
                LEFT JOIN payments p ON p.order_id = t.order_id
               WHERE (p.order_id IS NULL OR p.amount_captured_minor <= 0)
                 AND ($1::uuid IS NULL OR t.event_id = $1)")
        .fetch_one(pool)
        .await?,
        captured_without_ticket_or_refund: q(
            "SELECT count(*) FROM payments p JOIN orders o ON o.id = p.order_id
               WHERE p.amount_captured_minor > 0
                 AND p.amount_refunded_minor < p.amount_captured_minor
                 AND NOT EXISTS (SELECT 1 FROM tickets t WHERE t.order_id = p.order_id)
                 AND ($1::uuid IS NULL OR o.event_id = $1)",
        )
        .fetch_one(pool)
        .await?,
        tickets_valid_after_refund: q(
            "SELECT count(*) FROM tickets t JOIN payments p ON p.order_id = t.order_id
               WHERE t.voided_at IS NULL AND p.amount_captured_minor > 0
                 AND (p.amount_refunded_minor >= p.amount_captured_minor OR p.dispute_status = 'lost')
                 AND ($1::uuid IS NULL OR t.event_id = $1)",
        )
        .fetch_one(pool)
        .await?,
        uncaptured_past_deadline: q("SELECT count(*) FROM payments p JOIN orders o ON o.id = p.order_id
               WHERE p.status = 'requires_capture' AND p.capture_before < clock_timestamp()
                 AND ($1::uuid IS NULL OR o.event_id = $1)")
        .fetch_one(pool)
        .await?,
        stuck_orders: sqlx::query_scalar(
            "SELECT count(*) FROM orders
              WHERE status NOT IN ('ticketed', 'expired', 'failed', 'canceled', 'refunded')
                AND updated_at < clock_timestamp() - make_interval(secs => $2::double precision / 1000.0)
                AND ($1::uuid IS NULL OR event_id = $1)",
        )
        .bind(event)
        .bind(stuck_after_ms as f64)
        .fetch_one(pool)
        .await?,
        unpublished_outbox: sqlx::query_scalar(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL
                AND created_at < clock_timestamp() - make_interval(secs => $1::double precision / 1000.0)",
        )
        .bind(UNPUBLISHED_GRACE_MS as f64)
        .fetch_one(pool)
        .await?,
        stranded_webhooks: sqlx::query_scalar(
            "SELECT count(*) FROM stripe_events se
               JOIN payments p ON p.payment_intent_id = se.payment_intent_id
               JOIN orders o ON o.id = p.order_id
              WHERE se.pending
                AND se.received_at < clock_timestamp() - make_interval(secs => $2::double precision / 1000.0)
                AND ($1::uuid IS NULL OR o.event_id = $1)",
        )
        .bind(event)
        .bind(STRANDED_GRACE_MS as f64)
        .fetch_one(pool)
        .await?,
        unsettled_capture_claims: sqlx::query_scalar(
            "SELECT count(*) FROM capture_claims c JOIN orders o ON o.id = c.order_id
              WHERE c.received_at < clock_timestamp() - make_interval(secs => $2::double precision / 1000.0)
                AND ($1::uuid IS NULL OR o.event_id = $1)",
        )
        .bind(event)
        .bind(UNSETTLED_CLAIM_GRACE_MS as f64)
        .fetch_one(pool)
        .await?,
    })
}

/// Business totals, optionally for one event.
pub async fn totals(pool: &PgPool, event: Option<uuid::Uuid>) -> Result<Totals, sqlx::Error> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT status, count(*) FROM orders WHERE $1::uuid IS NULL OR event_id = $1 GROUP BY status",
    )
    .bind(event)
    .fetch_all(pool)
    .await?;
    let (tickets, seats_sold): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT seat_id) FILTER (WHERE voided_at IS NULL)
           FROM tickets WHERE $1::uuid IS NULL OR event_id = $1",
    )
    .bind(event)
    .fetch_one(pool)
    .await?;
    let (captured, refunds): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE p.amount_captured_minor > 0), count(*) FILTER (WHERE p.amount_refunded_minor > 0)
           FROM payments p JOIN orders o ON o.id = p.order_id WHERE $1::uuid IS NULL OR o.event_id = $1",
    )
    .bind(event)
    .fetch_one(pool)
    .await?;
    let incidents: i64 = sqlx::query_scalar("SELECT count(*) FROM incidents").fetch_one(pool).await?;
    Ok(Totals {
        orders_by_status: rows.into_iter().collect(),
        tickets,
        seats_sold,
        refunds,
        captured,
        incidents,
    })
}
