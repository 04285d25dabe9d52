//! The purchase saga orchestrator (design §9): the only code that moves an order between
//! states. Each transition locks the hold, then the order (the ledger's lock order), checks
//! the state machine, writes the new state and emits the next command through the outbox —
//! all in the consumer's inbox transaction.
//!
//! Transitions and their compensations:
//!
//! | fact                 | when                                   | effect                                                  |
//! |----------------------|----------------------------------------|---------------------------------------------------------|
//! | HoldCreated          | order `held`                           | PaymentAuthorizationRequested                           |
//! | PaymentIntentCreated | order `held`                           | → `payment_required`                                    |
//! |                      | order already ended                    | AuthorizationCancelRequested (compensation)             |
//! | PaymentAuthorized    | hold active and not lapsed             | hold confirmed, → `confirming`, OrderConfirmed + CaptureRequested |
//! |                      | hold lapsed / expired / order ended    | expire the hold if needed, → `canceled`, AuthorizationCancelRequested |
//! | PaymentCaptured      | order `confirming`                     | → `paid`, TicketIssueRequested                          |
//! |                      | order ended without seats              | incident, → `refunding`, RefundRequested (compensation) |
//! | CaptureFailed        | order `confirming`                     | release hold, → `failed`, AuthorizationCancelRequested  |
//! | PaymentCanceled      | order `confirming` (auth expired)      | release hold, → `failed`                                |
//! | PaymentRefunded      | order `refunding`                      | → `refunded`                                            |
//!
//! Duplicate facts (a webhook and a re-fetch both reporting the authorization, invariant 4)
//! find the order already moved and change nothing: state, not message identity, makes the
//! transition happen once.

use async_trait::async_trait;
use boxoffice_bus::{Handler, HandlerError};
use boxoffice_domain::{Envelope, HoldId, HoldStatus, OrderId, OrderStatus, PurchaseEvent};
use boxoffice_store::{holds, orders, outbox, payments, stripe_events, Tx};

/// The saga consumer.
#[derive(Debug, Default, Clone)]
pub struct Saga;

/// Consumer name (inbox key, consumer group `ticketing-saga`).
pub const NAME: &str = "saga";

#[async_trait]
impl Handler for Saga {
    type Prepared = ();

    fn name(&self) -> &'static str {
        NAME
    }

    fn wants(&self, event_type: &str) -> bool {
        matches!(
            event_type,
            "HoldCreated"
                | "PaymentIntentCreated"
                | "PaymentAuthorized"
                | "PaymentFailed"
                | "PaymentCaptured"
                | "CaptureFailed"
                | "PaymentCanceled"
                | "PaymentRefunded"
        )
    }

    async fn prepare(&self, _: &Envelope, _: &PurchaseEvent) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn apply(
        &self,
        tx: &mut Tx<'_>,
        env: &Envelope,
        event: &PurchaseEvent,
        _: (),
    ) -> Result<(), HandlerError> {
        apply(tx, env, event).await
    }
}

/// Applies one saga fact inside `tx` (which already holds the inbox row).
pub async fn apply(tx: &mut Tx<'_>, env: &Envelope, event: &PurchaseEvent) -> Result<(), HandlerError> {
    let order_id = event.order_id();
    let hold = holds::lock_for_order(tx, order_id).await?;
    let Some(order) = orders::lock(tx, order_id).await? else {
        return Err(HandlerError::permanent(
            "unknown_order",
            anyhow::anyhow!("order {order_id} does not exist"),
        ));
    };
    let status = order.status()?;
    let mut emit: Vec<PurchaseEvent> = Vec::new();

    match event {
        PurchaseEvent::HoldCreated { hold_id, amount_minor, currency, .. } => {
            if status == OrderStatus::Held {
                emit.push(PurchaseEvent::PaymentAuthorizationRequested {
                    order_id,
                    hold_id: *hold_id,
                    amount_minor: *amount_minor,
                    currency: currency.clone(),
                });
            }
        }
        PurchaseEvent::PaymentIntentCreated { payment_intent_id, .. } => {
            if status == OrderStatus::Held {
                orders::set_status(tx, order_id, OrderStatus::PaymentRequired, None).await?;
            } else if status.is_final() && !matches!(status, OrderStatus::Ticketed) {
                emit.extend(cancel_once(tx, order_id, payment_intent_id, "order_already_ended").await?);
            }
        }
        PurchaseEvent::PaymentAuthorized { payment_intent_id, capture_before, .. } => {
            if let Some(when) = capture_before {
                payments::set_capture_before(&mut **tx, payment_intent_id, *when).await?;
            }
            if !is_current_intent(tx, order_id, payment_intent_id).await? {
                tracing::warn!(order.id = %order_id, "authorization for a PaymentIntent that is not the order's; cancelling it");
                emit.push(cancel(order_id, payment_intent_id, "not_current_payment_intent"));
            } else if status.awaits_authorization() {
                let hold = hold.ok_or_else(|| {
                    HandlerError::permanent("missing_hold", anyhow::anyhow!("order {order_id} has no hold"))
                })?;
                if hold.status == HoldStatus::Active.as_str() && !hold.lapsed {
                    // Invariant 2: confirmed only with a live hold and an authorized payment.
                    holds::set_status(tx, hold.id, HoldStatus::Confirmed).await?;
                    orders::set_status(tx, order_id, OrderStatus::Confirming, None).await?;
                    payments::update_status(
                        &mut **tx,
                        payment_intent_id,
                        "requires_capture",
                        None,
                        None,
                        None,
                    )
                    .await?;
                    // Case C09: the deadline the expiry worker watches.
                    payments::default_capture_before(&mut **tx, payment_intent_id).await?;
                    emit.push(PurchaseEvent::OrderConfirmed { order_id, hold_id: HoldId(hold.id) });
                    emit.push(PurchaseEvent::CaptureRequested {
                        order_id,
                        payment_intent_id: payment_intent_id.clone(),
                        amount_minor: order.amount_minor,
                    });
                } else {
                    // Expiry won the race (or is due and has not run yet): one legal end
                    // state, the seats released and the authorization cancelled.
                    if hold.status == HoldStatus::Active.as_str() {
                        // Emits HoldExpired (and the cancel request, once per payment).
                        holds::expire_locked(tx, &hold).await?;
                    }
                    emit.extend(
                        cancel_once(tx, order_id, payment_intent_id, "authorization_after_expiry").await?,
                    );
                    orders::set_status(
                        tx,
                        order_id,
                        OrderStatus::Canceled,
                        Some("authorization_after_expiry"),
                    )
                    .await?;
                    metrics::counter!("boxoffice_late_authorizations_total").increment(1);
                }
            } else if matches!(status, OrderStatus::Expired | OrderStatus::Failed) {
                emit.extend(
                    cancel_once(tx, order_id, payment_intent_id, "authorization_after_expiry").await?,
                );
                orders::set_status(tx, order_id, OrderStatus::Canceled, Some("authorization_after_expiry"))
                    .await?;
                metrics::counter!("boxoffice_late_authorizations_total").increment(1);
            }
            // confirming / paid / ticketed / canceled / refunding / refunded: already handled.
        }
        PurchaseEvent::PaymentFailed { payment_intent_id, reason, .. } => {
            // The buyer may try another card while the hold lives; nothing moves. A decline
            // delivered after the payment settled (cancelled, authorized) changes nothing.
            payments::record_decline(&mut **tx, payment_intent_id, reason).await?;
        }
        PurchaseEvent::PaymentCaptured { payment_intent_id, amount_captured_minor, .. } => {
            payments::update_status(
                &mut **tx,
                payment_intent_id,
                "succeeded",
                Some(*amount_captured_minor),
                None,
                None,
            )
            .await?;
            match status {
                OrderStatus::Confirming => {
                    orders::set_status(tx, order_id, OrderStatus::Paid, None).await?;
                    let hold = hold.ok_or_else(|| {
                        HandlerError::permanent(
                            "missing_hold",
                            anyhow::anyhow!("order {order_id} has no hold"),
                        )
                    })?;
                    emit.push(PurchaseEvent::TicketIssueRequested { order_id, hold_id: HoldId(hold.id) });
                }
                s if s.is_final() && s != OrderStatus::Ticketed || s.awaits_authorization() => {
                    // Invariant 6: money captured for an order that no longer owns seats.
                    stripe_events::incident(
                        tx,
                        Some(order_id),
                        "capture_after_release",
                        serde_json::json!({"payment_intent_id": payment_intent_id, "order_status": s.as_str(),
                                           "amount_captured_minor": amount_captured_minor}),
                    )
                    .await?;
                    if let Some(h) = &hold {
                        if h.status == HoldStatus::Active.as_str() {
                            holds::expire_locked(tx, h).await?;
                        }
                    }
                    orders::set_status(tx, order_id, OrderStatus::Refunding, Some("capture_after_release"))
                        .await?;
                    emit.push(PurchaseEvent::RefundRequested {
                        order_id,
                        payment_intent_id: payment_intent_id.clone(),
                        amount_minor: *amount_captured_minor,
                        reason: "capture_after_release".into(),
                    });
                }
                _ => {} // paid / ticketed / refunding / refunded: duplicate fact
            }
        }
        PurchaseEvent::CaptureFailed { payment_intent_id, reason, .. } => {
            if status == OrderStatus::Confirming {
                if let Some(h) = &hold {
                    holds::set_status(tx, h.id, HoldStatus::Released).await?;
                }
                orders::set_status(tx, order_id, OrderStatus::Failed, Some(reason)).await?;
                emit.extend(cancel_once(tx, order_id, payment_intent_id, "capture_failed").await?);
            }
        }
        PurchaseEvent::PaymentCanceled { payment_intent_id, .. } => {
            payments::update_status(&mut **tx, payment_intent_id, "canceled", None, None, None).await?;
            if status == OrderStatus::Confirming {
                // The authorization lapsed or was cancelled before capture (case C09).
                if let Some(h) = &hold {
                    holds::set_status(tx, h.id, HoldStatus::Released).await?;
                }
                orders::set_status(tx, order_id, OrderStatus::Failed, Some("authorization_canceled")).await?;
                metrics::counter!("boxoffice_authorizations_lost_before_capture_total").increment(1);
            }
        }
        PurchaseEvent::PaymentRefunded { payment_intent_id, amount_refunded_minor, .. } => {
            payments::update_status(
                &mut **tx,
                payment_intent_id,
                "succeeded",
                None,
                Some(*amount_refunded_minor),
                None,
            )
            .await?;
            if status == OrderStatus::Refunding {
                orders::set_status(tx, order_id, OrderStatus::Refunded, None).await?;
            }
        }
        other => {
            return Err(HandlerError::permanent(
                "unexpected_event",
                anyhow::anyhow!("saga does not handle {}", env.event_type).context(format!("{other:?}")),
            ))
        }
    }
    let envelopes: Vec<Envelope> = emit.iter().map(|e| env.follow(e)).collect();
    outbox::insert_all(tx, &envelopes).await?;
    Ok(())
}

fn cancel(order_id: OrderId, payment_intent_id: &str, reason: &str) -> PurchaseEvent {
    PurchaseEvent::AuthorizationCancelRequested {
        order_id,
        payment_intent_id: payment_intent_id.to_owned(),
        reason: reason.to_owned(),
    }
}

/// The cancel command for the order's authorization, unless one was already requested. When
/// the payment row is not recorded yet (the webhook overtook the payment worker), the cancel
/// is emitted anyway: Stripe's idempotency key `cancel:{order_id}` makes repeats harmless.
async fn cancel_once(
    tx: &mut Tx<'_>,
    order_id: OrderId,
    pi: &str,
    reason: &str,
) -> Result<Option<PurchaseEvent>, sqlx::Error> {
    match payments::get(&mut **tx, order_id).await? {
        Some(p) if p.payment_intent_id == pi => {
            Ok(payments::request_cancel(&mut **tx, order_id).await?.map(|pi| cancel(order_id, &pi, reason)))
        }
        _ => Ok(Some(cancel(order_id, pi, reason))),
    }
}

/// Whether `pi` is the order's recorded PaymentIntent (or none is recorded yet, in which
/// case the fact is accepted: the webhook can overtake the payment worker's commit).
async fn is_current_intent(tx: &mut Tx<'_>, order: OrderId, pi: &str) -> Result<bool, sqlx::Error> {
    Ok(match payments::get(&mut **tx, order).await? {
        Some(p) => p.payment_intent_id == pi,
        None => true,
    })
}
