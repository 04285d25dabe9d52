//! Stripe webhook ingress (design §10): the raw body's `Stripe-Signature` is verified before
//! anything is parsed (bad → 400, nothing written); the Stripe event id is recorded in
//! `stripe_events` and the mapped domain fact is inserted into the outbox in the same
//! transaction; 2xx is answered only after that commit. A redelivered event finds its row
//! and is acknowledged without effect (invariant 4). Events we do not act on are recorded and
//! acknowledged, so Stripe stops retrying them. Whole bodies are never logged.

use boxoffice_domain::{Envelope, OrderId, PurchaseEvent};
use boxoffice_payments::webhook::Event;
use boxoffice_store::{outbox, payments, stripe_events};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

/// The event types this endpoint subscribes to (Stripe's `enabled_events`); anything else
/// that arrives is recorded and acknowledged.
pub const HANDLED_EVENTS: [&str; 5] = [
    "payment_intent.amount_capturable_updated",
    "payment_intent.succeeded",
    "payment_intent.payment_failed",
    "payment_intent.canceled",
    "charge.refunded",
];

/// What happened to a verified event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ingested {
    /// First delivery; the fact (if any) is in the outbox.
    Recorded,
    /// Seen before: acknowledged, nothing written.
    Duplicate,
}

/// Records a verified Stripe event and its domain fact in one transaction.
pub async fn ingest(pool: &PgPool, event: &Event) -> Result<Ingested, sqlx::Error> {
    let object = &event.data.object;
    let pi = payment_intent_id(&event.r#type, object);
    let mut tx = pool.begin().await?;
    let order = match order_id(object) {
        Some(o) => Some(o),
        None => match &pi {
            Some(pi) => payments::order_for_intent(&mut *tx, pi).await?,
            None => None,
        },
    };
    if !stripe_events::record(&mut tx, &event.id, &event.r#type, pi.as_deref(), order).await? {
        tx.rollback().await?;
        metrics::counter!("boxoffice_stripe_webhooks_total", "outcome" => "duplicate").increment(1);
        return Ok(Ingested::Duplicate);
    }
    if let (Some(order), Some(pi)) = (order, pi.as_deref()) {
        if let Some(fact) = map_event(&event.r#type, object, order, pi) {
            if event.r#type == "payment_intent.amount_capturable_updated" {
                // Mirror the provider's state for the status endpoint (`authorized`); the
                // order itself is moved only by the saga.
                sqlx::query(
                    "UPDATE payments SET status = 'requires_capture', updated_at = clock_timestamp()
                      WHERE payment_intent_id = $1
                        AND status IN ('requires_payment_method', 'requires_confirmation', 'requires_action')",
                )
                .bind(pi)
                .execute(&mut *tx)
                .await?;
            }
            let correlation: Option<Uuid> =
                sqlx::query_scalar("SELECT correlation_id FROM orders WHERE id = $1")
                    .bind(order.0)
                    .fetch_optional(&mut *tx)
                    .await?;
            let env = Envelope::new(order, &fact, correlation.unwrap_or_else(Uuid::new_v4), None);
            outbox::insert(&mut tx, boxoffice_domain::Topic::Purchase, &env).await?;
        }
    } else if event.r#type.starts_with("payment_intent.") || event.r#type.starts_with("charge.") {
        tracing::warn!(stripe.event_id = %event.id, stripe.event_type = %event.r#type, "webhook names no known order");
    }
    tx.commit().await?;
    metrics::counter!("boxoffice_stripe_webhooks_total", "outcome" => "recorded").increment(1);
    Ok(Ingested::Recorded)
}

fn payment_intent_id(event_type: &str, object: &Value) -> Option<String> {
    let field = if event_type.starts_with("payment_intent.") { "id" } else { "payment_intent" };
    object.get(field).and_then(Value::as_str).map(str::to_owned)
}

fn order_id(object: &Value) -> Option<OrderId> {
    object.pointer("/metadata/order_id").and_then(Value::as_str).and_then(|s| s.parse().ok())
}

fn amount(object: &Value, field: &str) -> i64 {
    object.get(field).and_then(Value::as_i64).unwrap_or(0)
}

/// Maps a Stripe event type to the saga fact it reports.
pub fn map_event(event_type: &str, object: &Value, order_id: OrderId, pi: &str) -> Option<PurchaseEvent> {
    let payment_intent_id = pi.to_owned();
    Some(match event_type {
        "payment_intent.amount_capturable_updated" => PurchaseEvent::PaymentAuthorized {
            order_id,
            payment_intent_id,
            amount_capturable_minor: amount(object, "amount_capturable"),
            capture_before: None,
        },
        "payment_intent.succeeded" => PurchaseEvent::PaymentCaptured {
            order_id,
            payment_intent_id,
            amount_captured_minor: amount(object, "amount_received"),
        },
        "payment_intent.payment_failed" => PurchaseEvent::PaymentFailed {
            order_id,
            payment_intent_id,
            reason: object
                .pointer("/last_payment_error/decline_code")
                .or_else(|| object.pointer("/last_payment_error/code"))
                .and_then(Value::as_str)
                .unwrap_or("payment_failed")
                .to_owned(),
        },
        "payment_intent.canceled" => PurchaseEvent::PaymentCanceled { order_id, payment_intent_id },
        "charge.refunded" => PurchaseEvent::PaymentRefunded {
            order_id,
            payment_intent_id,
            amount_refunded_minor: amount(object, "amount_refunded"),
        },
        _ => return None,
    })
}
