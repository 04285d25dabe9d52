//! Received Stripe webhook events, deduplicated on Stripe's event id (invariant 4): the row
//! and the outbox continuation commit together, so a redelivered event is acknowledged and
//! does nothing. Events for a PaymentIntent the ledger does not know yet are kept as
//! pending until its payment row exists (design §10: an early webhook is not lost).

use crate::Tx;
use boxoffice_domain::OrderId;

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

/// Pending events older than `older_than_ms` (for the audit: a pending event nobody claims
/// is a PaymentIntent boxoffice did not create, or a lost payment row).
pub async fn pending_count<'e, E: sqlx::Executor<'e, Database = sqlx::Postgres>>(
    ex: E,
    older_than_ms: i64,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM stripe_events
          WHERE pending AND received_at < clock_timestamp() - make_interval(secs => $1::double precision / 1000.0)",
    )
    .bind(older_than_ms as f64)
    .fetch_one(ex)
    .await
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
