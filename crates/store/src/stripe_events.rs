//! Received Stripe webhook events, deduplicated on Stripe's event id (invariant 4): the row
//! and the outbox continuation commit together, so a redelivered event is acknowledged and
//! does nothing.

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
