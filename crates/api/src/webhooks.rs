//! Stripe webhook ingress (design §10): the raw body's `Stripe-Signature` is verified before
//! anything is parsed (bad → 400, nothing written); the Stripe event id is recorded in
//! `stripe_events` and the mapped domain fact is inserted into the outbox in the same
//! transaction; 2xx is answered only after that commit. A redelivered event finds its row
//! and is acknowledged without effect (invariant 4). Events we do not act on are recorded and
//! acknowledged, so Stripe stops retrying them. Whole bodies are never logged.
//!
//! A webhook is a hint, not the truth (Stripe delivers at least once, late and in any order):
//! - **early**: an event for a PaymentIntent whose payment row is not committed yet is mapped
//!   through the order id in its metadata; if it names no order either, it is kept as
//!   pending and re-derived from Stripe once the payment row exists (the payment worker);
//! - **stale**: an event for a PaymentIntent that is not the order's current one is recorded
//!   and ignored — except an authorization, which the saga cancels (nobody may keep a
//!   buyer's funds reserved for nothing);
//! - **disagreeing**: an amount different from the order's, or a status contradicting a
//!   settled one in the ledger (captured vs canceled), is not acted on; instead the payment
//!   worker re-fetches the PaymentIntent and reports what Stripe says now
//!   (`PaymentIntentRefreshRequested`);
//! - out-of-order facts are harmless: the saga moves on the order's state, not on arrival.
//!
//! Fault points: `webhook.before_commit`, `webhook.after_commit` (committed, not answered:
//! Stripe redelivers and the duplicate is acknowledged without effect).

use boxoffice_domain::PaymentIntentStatus;
use boxoffice_domain::{Envelope, OrderId, PurchaseEvent};
use boxoffice_payments::webhook::Event;
use boxoffice_store::{orders, outbox, payments, stripe_events};
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
    /// Its PaymentIntent is not known yet: kept until the payment row exists.
    Pending,
    /// It disagreed with the ledger: a re-fetch of the PaymentIntent is queued instead.
    Refresh,
    /// It concerns a PaymentIntent that is not the order's current one: recorded, ignored.
    Stale,
}

impl Ingested {
    fn label(self) -> &'static str {
        match self {
            Ingested::Recorded => "recorded",
            Ingested::Duplicate => "duplicate",
            Ingested::Pending => "pending",
            Ingested::Refresh => "refresh",
            Ingested::Stale => "stale",
        }
    }
}

/// Why ingestion failed (the endpoint answers 5xx and Stripe redelivers).
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    /// The database failed; nothing was committed.
    #[error("database error")]
    Db(#[from] sqlx::Error),
    /// A fault point fired (`webhook.before_commit` / `webhook.after_commit`).
    #[error(transparent)]
    Fault(#[from] boxoffice_faults::Injected),
}

/// Records a verified Stripe event and its domain fact in one transaction.
pub async fn ingest(pool: &PgPool, event: &Event) -> Result<Ingested, IngestError> {
    let outcome = ingest_tx(pool, event).await?;
    boxoffice_faults::check("webhook.after_commit")?;
    metrics::counter!("boxoffice_stripe_webhooks_total", "outcome" => outcome.label()).increment(1);
    Ok(outcome)
}

async fn ingest_tx(pool: &PgPool, event: &Event) -> Result<Ingested, IngestError> {
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
        return Ok(Ingested::Duplicate);
    }
    let handled = HANDLED_EVENTS.contains(&event.r#type.as_str());
    let mut outcome = Ingested::Recorded;
    match (order, pi.as_deref()) {
        (Some(order), Some(pi)) if handled => {
            let local = payments::get(&mut *tx, order).await?;
            let known = orders::amount_and_correlation(&mut *tx, order).await?;
            let fact = match judge(&event.r#type, object, local.as_ref(), known.map(|k| k.0), pi) {
                Verdict::Act => map_event(&event.r#type, object, order, pi),
                Verdict::Stale => {
                    tracing::warn!(stripe.event_id = %event.id, stripe.event_type = %event.r#type, order.id = %order,
                        "webhook for a PaymentIntent that is not the order's current one: ignored");
                    outcome = Ingested::Stale;
                    None
                }
                Verdict::Refresh(reason) => {
                    tracing::warn!(stripe.event_id = %event.id, stripe.event_type = %event.r#type, order.id = %order,
                        reason, "webhook disagrees with the ledger: re-fetching the PaymentIntent");
                    outcome = Ingested::Refresh;
                    Some(PurchaseEvent::PaymentIntentRefreshRequested {
                        order_id: order,
                        payment_intent_id: pi.to_owned(),
                        reason: reason.to_owned(),
                    })
                }
            };
            if let Some(fact) = fact {
                if event.r#type == "payment_intent.amount_capturable_updated" && outcome == Ingested::Recorded
                {
                    // Mirror the provider's state for the status endpoint (`authorized`); the
                    // order itself is moved only by the saga.
                    payments::mirror_authorized(&mut *tx, pi).await?;
                }
                let correlation = known.map(|k| k.1);
                let env = Envelope::new(order, &fact, correlation.unwrap_or_else(Uuid::new_v4), None);
                outbox::insert(&mut tx, boxoffice_domain::Topic::Purchase, &env).await?;
            }
        }
        (None, Some(_)) if handled => {
            // Early: the payment worker has not committed the payment row. Keep the event;
            // the fact is re-derived from Stripe when the row is written.
            stripe_events::mark_pending(&mut tx, &event.id).await?;
            outcome = Ingested::Pending;
        }
        _ => {}
    }
    boxoffice_faults::check("webhook.before_commit")?;
    tx.commit().await?;
    Ok(outcome)
}

/// What to do with a handled event, given the ledger's view.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Map it to its fact.
    Act,
    /// It is about another PaymentIntent than the order's current one: ignore.
    Stale,
    /// It contradicts the ledger: ask Stripe (the reason is logged and sent along).
    Refresh(&'static str),
}

fn judge(
    event_type: &str,
    object: &Value,
    local: Option<&payments::PaymentRow>,
    order_amount: Option<i64>,
    pi: &str,
) -> Verdict {
    if let Some(p) = local {
        if p.payment_intent_id != pi {
            // A stray authorization is still mapped: the saga cancels it.
            return if event_type == "payment_intent.amount_capturable_updated" {
                Verdict::Act
            } else {
                Verdict::Stale
            };
        }
    }
    let amount_field = match event_type {
        "payment_intent.amount_capturable_updated" => Some("amount_capturable"),
        "payment_intent.succeeded" => Some("amount_received"),
        _ => None,
    };
    if let (Some(field), Some(expected)) = (amount_field, order_amount) {
        if amount(object, field) != expected {
            return Verdict::Refresh("amount_mismatch");
        }
    }
    if let Some(p) = local {
        let contradicts = match event_type {
            "payment_intent.amount_capturable_updated" | "payment_intent.succeeded" => {
                p.status == PaymentIntentStatus::Canceled
            }
            "payment_intent.canceled" | "payment_intent.payment_failed" => {
                p.status == PaymentIntentStatus::Succeeded
            }
            "charge.refunded" => {
                amount(object, "amount_refunded") > p.amount_captured_minor.max(p.amount_minor)
            }
            _ => false,
        };
        if contradicts {
            return Verdict::Refresh("status_contradicts_ledger");
        }
    }
    Verdict::Act
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
