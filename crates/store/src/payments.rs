//! The local mirror of each order's Stripe PaymentIntent (design §10).
//!
//! One payment row per order (`order_id` primary key, `payment_intent_id` unique). The
//! client secret is stored for the owner's status endpoint only and is cleared once payment
//! is no longer pending; it never leaves this table except through that endpoint.

use boxoffice_domain::OrderId;
use chrono::{DateTime, Utc};
use sqlx::{Executor, PgPool, Postgres};
use uuid::Uuid;

/// A payment row.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct PaymentRow {
    /// Order.
    pub order_id: Uuid,
    /// Stripe PaymentIntent id (`pi_…`).
    pub payment_intent_id: String,
    /// Last known PaymentIntent status (Stripe's vocabulary).
    pub status: String,
    /// Authorized amount, minor units.
    pub amount_minor: i64,
    /// Currency.
    pub currency: String,
    /// Captured so far, minor units.
    pub amount_captured_minor: i64,
    /// Refunded so far, minor units.
    pub amount_refunded_minor: i64,
    /// Stripe's capture deadline for the authorization, when known.
    pub capture_before: Option<DateTime<Utc>>,
}

/// A payment row with what reconciliation against the provider needs about it and its
/// order (read without locks: a snapshot, compared with a snapshot of the provider).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct LedgerPayment {
    /// The payment row.
    #[sqlx(flatten)]
    pub payment: PaymentRow,
    /// The order's event.
    pub event_id: Uuid,
    /// The order's status text.
    pub order_status: String,
    /// The buyer journey's correlation id (copied onto facts emitted for the order).
    pub correlation_id: Uuid,
    /// When the row was written.
    pub created_at: DateTime<Utc>,
    /// Whether `capture_before` has passed by the database clock (false when unknown).
    pub deadline_passed: bool,
}

const LEDGER_PAYMENT_SELECT: &str =
    "SELECT p.order_id, p.payment_intent_id, p.status, p.amount_minor, p.currency,
        p.amount_captured_minor, p.amount_refunded_minor, p.capture_before,
        o.event_id, o.status AS order_status, o.correlation_id, p.created_at,
        COALESCE(p.capture_before < clock_timestamp(), false) AS deadline_passed
   FROM payments p JOIN orders o ON o.id = p.order_id";

/// The ledger's payments for PaymentIntents `ids` (unknown ids are simply absent).
pub async fn ledger_for_intents(pool: &PgPool, ids: &[String]) -> Result<Vec<LedgerPayment>, sqlx::Error> {
    sqlx::query_as(&format!("{LEDGER_PAYMENT_SELECT} WHERE p.payment_intent_id = ANY($1)"))
        .bind(ids)
        .fetch_all(pool)
        .await
}

/// The ledger's payments written in `[since, until]` (either end open), optionally only for
/// orders of `event`.
pub async fn ledger_created_between(
    pool: &PgPool,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    event: Option<Uuid>,
) -> Result<Vec<LedgerPayment>, sqlx::Error> {
    sqlx::query_as(&format!(
        "{LEDGER_PAYMENT_SELECT}
          WHERE ($1::timestamptz IS NULL OR p.created_at >= $1)
            AND ($2::timestamptz IS NULL OR p.created_at <= $2)
            AND ($3::uuid IS NULL OR o.event_id = $3)"
    ))
    .bind(since)
    .bind(until)
    .bind(event)
    .fetch_all(pool)
    .await
}

/// The payment of `order`, if a PaymentIntent was recorded.
pub async fn get<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    order: OrderId,
) -> Result<Option<PaymentRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT order_id, payment_intent_id, status, amount_minor, currency, amount_captured_minor,
                amount_refunded_minor, capture_before
           FROM payments WHERE order_id = $1",
    )
    .bind(order.0)
    .fetch_optional(ex)
    .await
}

/// The order that owns PaymentIntent `pi`.
pub async fn order_for_intent<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    pi: &str,
) -> Result<Option<OrderId>, sqlx::Error> {
    let id: Option<Uuid> = sqlx::query_scalar("SELECT order_id FROM payments WHERE payment_intent_id = $1")
        .bind(pi)
        .fetch_optional(ex)
        .await?;
    Ok(id.map(OrderId))
}

/// Records a newly created PaymentIntent. Idempotent: a replay (same order, same intent)
/// leaves the row as it is and returns `false`.
pub async fn insert_created<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    order: OrderId,
    payment_intent_id: &str,
    client_secret: Option<&str>,
    status: &str,
    amount_minor: i64,
    currency: &str,
) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "INSERT INTO payments (order_id, payment_intent_id, client_secret, status, amount_minor, currency)
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (order_id) DO NOTHING",
    )
    .bind(order.0)
    .bind(payment_intent_id)
    .bind(client_secret)
    .bind(status)
    .bind(amount_minor)
    .bind(currency)
    .execute(ex)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// Updates the mirrored status (and amounts where given) of the payment for PaymentIntent
/// `pi`; clears the client secret once payment is no longer pending.
pub async fn update_status<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    pi: &str,
    status: &str,
    amount_captured_minor: Option<i64>,
    amount_refunded_minor: Option<i64>,
    last_error_code: Option<&str>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE payments SET status = $2,
                amount_captured_minor = COALESCE($3, amount_captured_minor),
                amount_refunded_minor = COALESCE($4, amount_refunded_minor),
                last_error_code = COALESCE($5, last_error_code),
                client_secret = CASE WHEN $2 IN ('requires_payment_method', 'requires_confirmation', 'requires_action')
                                     THEN client_secret ELSE NULL END,
                updated_at = clock_timestamp()
          WHERE payment_intent_id = $1",
    )
    .bind(pi)
    .bind(status)
    .bind(amount_captured_minor)
    .bind(amount_refunded_minor)
    .bind(last_error_code)
    .execute(ex)
    .await?;
    Ok(())
}

/// Records a declined confirmation (`requires_payment_method` with the decline code) for
/// PaymentIntent `pi`, but only while the payment is still pending
/// (`requires_payment_method`, `requires_confirmation`, `requires_action`, `processing`):
/// Stripe lets a buyer retry another card after a decline, so a decline never follows
/// authorization, capture or cancellation. A decline fact that arrives late (its outbox row
/// waited out a crashed relay's lease) must not move a settled payment back to pending.
/// Returns whether the row changed.
pub async fn record_decline<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    pi: &str,
    decline_code: &str,
) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE payments SET status = 'requires_payment_method',
                last_error_code = $2,
                updated_at = clock_timestamp()
          WHERE payment_intent_id = $1
            AND status IN ('requires_payment_method', 'requires_confirmation', 'requires_action', 'processing')",
    )
    .bind(pi)
    .bind(decline_code)
    .execute(ex)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// Records Stripe's capture deadline for the authorization.
pub async fn set_capture_before<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    pi: &str,
    capture_before: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE payments SET capture_before = $2 WHERE payment_intent_id = $1")
        .bind(pi)
        .bind(capture_before)
        .execute(ex)
        .await?;
    Ok(())
}

/// Marks the payment of `order` as having a cancel requested. Returns the PaymentIntent id
/// the first time (the caller emits AuthorizationCancelRequested), `None` if a cancel was
/// already requested or no payment is recorded. One cancel with key `cancel:{order_id}`
/// covers the intent whatever its state when it runs (invariant 6).
pub async fn request_cancel<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    order: OrderId,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE payments SET cancel_requested_at = clock_timestamp()
          WHERE order_id = $1 AND cancel_requested_at IS NULL AND status NOT IN ('canceled', 'succeeded')
          RETURNING payment_intent_id",
    )
    .bind(order.0)
    .fetch_optional(ex)
    .await
}

/// How long Stripe keeps an online card authorization capturable when it does not say
/// (<https://docs.stripe.com/payments/place-a-hold-on-a-payment-method>: 7 days).
pub const DEFAULT_AUTHORIZATION_VALIDITY_DAYS: i32 = 7;

/// Records a capture deadline for `pi` if none is known yet: now + the default validity.
pub async fn default_capture_before<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    pi: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE payments SET capture_before = COALESCE(capture_before, clock_timestamp() + make_interval(days => $2))
          WHERE payment_intent_id = $1",
    )
    .bind(pi)
    .bind(DEFAULT_AUTHORIZATION_VALIDITY_DAYS)
    .execute(ex)
    .await?;
    Ok(())
}
