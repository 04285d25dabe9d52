//! The versioned event envelope (design §6) and every purchase-saga payload.
//!
//! Every fact and command travels as an [`Envelope`]: a stable `event_id` (the inbox key that
//! makes redelivery harmless, invariant 4), the order as aggregate (and as Kafka key, so one
//! order's saga stays ordered within a partition), a schema version, trace context
//! (`correlation_id` = one buyer journey, `causation_id` = the event that caused this one,
//! `traceparent` = the W3C trace context of the span that committed it),
//! and the payload. Payloads never carry card data or Stripe client secrets.
//!
//! Compatibility: fields are only ever added within `schema_version` 1 and consumers ignore
//! unknown fields; a breaking change publishes version 2 beside version 1. A field that hands
//! a step from one consumer to another (`HoldCreated`'s `is_authorization_request`, which an
//! older payment worker ignores) comes with a way to write the older form for as long as
//! older consumers run (`hold_fact_requests_authorization`); likewise `OrderConfirmed`'s
//! `capture` (`confirmation_fact_requests_capture`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::ids::{EventId, HoldId, OrderId, SeatId};
use crate::status::PaymentIntentStatus;

/// The schema version this build writes and reads.
pub const SCHEMA_VERSION: u32 = 1;

/// Logical topics. The physical name is `{prefix}{name}` so that several deployments (or
/// tests) can share one cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Topic {
    /// `ticketing.purchase.v1`: every saga fact and command, keyed by order id.
    Purchase,
    /// `ticketing.purchase.retry-5s.v1`: messages a consumer failed transiently, re-delivered
    /// to that consumer after 5 s (design §8).
    Retry5s,
    /// `ticketing.purchase.retry-1m.v1`: messages that failed again after the 5 s retry,
    /// re-delivered after 1 min until the attempt budget is spent.
    Retry1m,
    /// `ticketing.purchase.dlq.v1`: messages a consumer could not apply permanently.
    DeadLetter,
}

impl Topic {
    /// Every topic `boxoffice migrate` / `topics create` provisions.
    pub const ALL: [Topic; 4] = [Topic::Purchase, Topic::Retry5s, Topic::Retry1m, Topic::DeadLetter];

    /// The logical (unprefixed) topic name.
    pub fn name(self) -> &'static str {
        match self {
            Topic::Purchase => "ticketing.purchase.v1",
            Topic::Retry5s => "ticketing.purchase.retry-5s.v1",
            Topic::Retry1m => "ticketing.purchase.retry-1m.v1",
            Topic::DeadLetter => "ticketing.purchase.dlq.v1",
        }
    }
}

/// The wire form of every message on the purchase topics (JSON).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Unique id of this message; consumers dedupe on `(consumer, event_id)`.
    pub event_id: Uuid,
    /// The payload's type name, e.g. `"HoldCreated"`.
    pub event_type: String,
    /// Payload schema version, currently [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Always `"order"` for purchase events.
    pub aggregate_type: String,
    /// The order id; also the Kafka message key.
    pub aggregate_id: Uuid,
    /// When the fact was recorded (UTC).
    pub occurred_at: DateTime<Utc>,
    /// One buyer journey: the hold request's correlation id, copied onto every later event.
    pub correlation_id: Uuid,
    /// The event that caused this one (absent for events caused by an HTTP request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causation_id: Option<Uuid>,
    /// The type-specific payload (see [`PurchaseEvent`]).
    pub payload: serde_json::Value,
    /// The region whose ledger committed the fact (design §15). Stamped by the outbox from
    /// the writing session when the relay publishes (also the `region` header); absent on
    /// facts written before regions existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// The region epoch the fact was committed under (also the `region-epoch` header):
    /// consumers of a promoted region check a fact of an older epoch against their ledger.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region_epoch: Option<i64>,
    /// The W3C `traceparent` of the span that committed the fact (design §16), stamped by the
    /// outbox from its `traceparent` column when the relay publishes, like `region` (also the
    /// `traceparent` header); absent when the writer did not trace. Kept in the envelope so a
    /// retry copy or a replayed dead letter stays in the purchase's trace, and so the payment
    /// worker can send the very value the fact carries to Stripe on every retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The consumers that applied this fact in the very transaction that committed it (a
    /// step followed through in its writer's transaction, `boxoffice_bus::follow`): each has
    /// its inbox row for `event_id` in that transaction, so when the fact reaches it on the
    /// bus it acknowledges it without a transaction. Empty (and absent on the wire) for
    /// every other fact; a consumer that does not know the field still finds its inbox row.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub applied_by: Vec<String>,
}

/// Why an envelope could not be decoded: a permanent error (dead-letter material).
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The bytes are not a JSON envelope.
    #[error("malformed envelope: {0}")]
    Envelope(#[source] serde_json::Error),
    /// The schema version is not one this build reads.
    #[error("unsupported schema_version {0}")]
    Version(u32),
    /// The payload does not match its declared event type.
    #[error("payload does not match event_type {event_type}: {source}")]
    Payload {
        /// Declared type.
        event_type: String,
        /// Underlying serde error.
        #[source]
        source: serde_json::Error,
    },
    /// The payload names another order than the envelope's `aggregate_id`: consumers batch,
    /// order and lock by the envelope's order and act on the payload's, so such a fact (a
    /// forged or corrupt one; every writer wraps a fact for its own order) is not applied.
    #[error("payload of order {payload} in an envelope of order {envelope}")]
    OtherOrder {
        /// The envelope's `aggregate_id`.
        envelope: Uuid,
        /// The payload's order id.
        payload: Uuid,
    },
}

impl Envelope {
    /// Wraps `event` for `order`, caused by `cause` (copying its correlation id) or starting
    /// a new journey under `correlation_id` when there is no cause.
    pub fn new(
        order: OrderId,
        event: &PurchaseEvent,
        correlation_id: Uuid,
        causation_id: Option<Uuid>,
    ) -> Self {
        let tagged = serde_json::to_value(event).expect("payloads serialize");
        let (event_type, payload) = match tagged {
            serde_json::Value::Object(mut m) => (
                m.remove("event_type").and_then(|v| v.as_str().map(str::to_owned)).expect("tagged"),
                m.remove("payload").unwrap_or(serde_json::Value::Null),
            ),
            _ => unreachable!("adjacently tagged enums serialize to objects"),
        };
        Self {
            event_id: crate::ids::time_ordered(),
            event_type,
            schema_version: SCHEMA_VERSION,
            aggregate_type: "order".into(),
            aggregate_id: order.0,
            occurred_at: Utc::now(),
            correlation_id,
            causation_id,
            payload,
            region: None,
            region_epoch: None,
            traceparent: None,
            applied_by: Vec::new(),
        }
    }

    /// An event caused by `self`: same order and correlation, `causation_id = self.event_id`.
    pub fn follow(&self, event: &PurchaseEvent) -> Self {
        Self::new(OrderId(self.aggregate_id), event, self.correlation_id, Some(self.event_id))
    }

    /// Parses an envelope from message bytes.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, DecodeError> {
        let env: Envelope = serde_json::from_slice(bytes).map_err(DecodeError::Envelope)?;
        if env.schema_version != SCHEMA_VERSION {
            return Err(DecodeError::Version(env.schema_version));
        }
        Ok(env)
    }

    /// The typed payload. Unknown event types decode as [`DecodeError::Payload`]; a payload
    /// of another order than `aggregate_id` as [`DecodeError::OtherOrder`].
    pub fn decode(&self) -> Result<PurchaseEvent, DecodeError> {
        let event: PurchaseEvent = serde_json::from_value(serde_json::json!({
            "event_type": self.event_type,
            "payload": self.payload,
        }))
        .map_err(|source| DecodeError::Payload { event_type: self.event_type.clone(), source })?;
        if event.order_id().0 != self.aggregate_id {
            return Err(DecodeError::OtherOrder { envelope: self.aggregate_id, payload: event.order_id().0 });
        }
        Ok(event)
    }

    /// Whether `consumer` applied this fact in the transaction that committed it (it is in
    /// the `applied_by` field).
    pub fn was_applied_by(&self, consumer: &str) -> bool {
        self.applied_by.iter().any(|c| c == consumer)
    }

    /// The order this event belongs to.
    pub fn order_id(&self) -> OrderId {
        OrderId(self.aggregate_id)
    }
}

/// Every fact and command of the purchase saga (design §6, §9). Amounts are minor units.
///
/// [`EventKind`] is derived from these variants (one unit variant each, named alike): the
/// envelope's `event_type` text is the variant's name, and consumers route on `EventKind`
/// rather than on strings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, strum::EnumDiscriminants)]
#[strum_discriminants(
    name(EventKind),
    vis(pub),
    derive(Hash, strum::EnumString, strum::IntoStaticStr, strum::Display, strum::VariantArray)
)]
#[serde(tag = "event_type", content = "payload")]
pub enum PurchaseEvent {
    /// Fact: the hold transaction committed an order, a hold and its seats.
    HoldCreated {
        order_id: OrderId,
        hold_id: HoldId,
        event_id: EventId,
        seat_ids: Vec<SeatId>,
        expires_at: DateTime<Utc>,
        amount_minor: i64,
        currency: String,
        /// Whether the hold transaction wrote the order's `PaymentAuthorizationRequested`
        /// beside this fact ([`crate::saga::hold_created`] with
        /// [`crate::saga::AuthorizationRequest::Command`]); `false` (the default) on facts
        /// written before it did and on facts that are the request themselves. The saga
        /// requests the authorization only when this is `false` and the fact is not the
        /// request ([`crate::saga::acts_on`]); an older build's saga, which knows only this
        /// field, requests it for every `false`.
        #[serde(default)]
        authorization_requested: bool,
        /// Whether this fact is itself the order's authorization request: the payment worker
        /// creates the PaymentIntent from it (idempotency key `authorize:{event_id}`, this
        /// fact's envelope id) and no `PaymentAuthorizationRequested` is written for the
        /// order ([`crate::saga::AuthorizationRequest::InHoldFact`]). `false` (the default)
        /// on facts written beside that command (with
        /// [`crate::saga::AuthorizationRequest::Command`]) and on older writers' facts.
        /// Never written together with `authorization_requested`.
        #[serde(default)]
        is_authorization_request: bool,
    },
    /// Command to the payment worker: create the manual-capture PaymentIntent.
    PaymentAuthorizationRequested { order_id: OrderId, hold_id: HoldId, amount_minor: i64, currency: String },
    /// Fact: a PaymentIntent exists for the order.
    PaymentIntentCreated { order_id: OrderId, payment_intent_id: String, status: PaymentIntentStatus },
    /// Fact: Stripe reserved the funds (`requires_capture`).
    PaymentAuthorized {
        order_id: OrderId,
        payment_intent_id: String,
        amount_capturable_minor: i64,
        #[serde(default)]
        capture_before: Option<DateTime<Utc>>,
    },
    /// Fact: an authorization attempt failed (e.g. card declined); the buyer may retry
    /// within the hold.
    PaymentFailed { order_id: OrderId, payment_intent_id: String, reason: String },
    /// Fact: the saga froze the hold after authorization.
    OrderConfirmed {
        order_id: OrderId,
        hold_id: HoldId,
        /// The capture this fact requests, when it is itself the order's capture request:
        /// the payment worker captures from it (idempotency key `capture:{order_id}`, as for
        /// a `CaptureRequested`) and no `CaptureRequested` is written for the order
        /// ([`crate::saga::CaptureRequest::InConfirmationFact`]). Absent on facts written
        /// beside that command ([`crate::saga::CaptureRequest::Command`]) and on older
        /// writers' facts; an older payment worker does not read it
        /// (`confirmation_fact_requests_capture`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        capture: Option<RequestedCapture>,
    },
    /// Command to the payment worker: capture the authorized PaymentIntent.
    CaptureRequested { order_id: OrderId, payment_intent_id: String, amount_minor: i64 },
    /// Fact: the money was captured.
    PaymentCaptured { order_id: OrderId, payment_intent_id: String, amount_captured_minor: i64 },
    /// Fact: the capture was refused permanently by the provider.
    CaptureFailed { order_id: OrderId, payment_intent_id: String, reason: String },
    /// Command to the ticket worker.
    TicketIssueRequested { order_id: OrderId, hold_id: HoldId },
    /// Fact: one ticket exists per held seat.
    TicketIssued { order_id: OrderId, ticket_ids: Vec<Uuid> },
    /// Command to the payment worker: a webhook claims dispute `dispute_id` of the order's
    /// charge changed; retrieve it and report what Stripe says.
    DisputeRefreshRequested { order_id: OrderId, payment_intent_id: String, dispute_id: String },
    /// Fact: the provider reports dispute `dispute_id` of the order's charge in `status`
    /// (Stripe's: `needs_response`, `under_review`, `won`, `lost`, …).
    PaymentDisputed { order_id: OrderId, payment_intent_id: String, dispute_id: String, status: String },
    /// Fact: the tickets of an order were voided (its money went back); the seats are not
    /// resold unless an operator chooses to.
    TicketsVoided { order_id: OrderId, ticket_ids: Vec<Uuid>, reason: String },
    /// Fact: an operator put the seats of an order's voided tickets back on sale
    /// (`boxoffice tickets resell`); the tickets stay void.
    SeatsReturnedToSale { order_id: OrderId, ticket_ids: Vec<Uuid>, seat_ids: Vec<Uuid> },
    /// Fact: the hold timed out and its seats were released.
    HoldExpired { order_id: OrderId, hold_id: HoldId },
    /// Command to the payment worker: cancel the uncaptured PaymentIntent (compensation).
    AuthorizationCancelRequested { order_id: OrderId, payment_intent_id: String, reason: String },
    /// Fact: the PaymentIntent is canceled at the provider.
    PaymentCanceled { order_id: OrderId, payment_intent_id: String },
    /// Command to the payment worker: refund captured money (compensation).
    RefundRequested { order_id: OrderId, payment_intent_id: String, amount_minor: i64, reason: String },
    /// Fact: money was refunded; `amount_refunded_minor` is everything refunded on the
    /// PaymentIntent's charge so far (minor units), not one refund's amount.
    PaymentRefunded { order_id: OrderId, payment_intent_id: String, amount_refunded_minor: i64 },
    /// Command to the payment worker: a webhook disagreed with the ledger (amount, or a
    /// status contradicting a settled one), so re-fetch the PaymentIntent from Stripe and
    /// report what Stripe says now (design §10: the provider is the source of truth for
    /// money; the webhook is only a hint).
    PaymentIntentRefreshRequested { order_id: OrderId, payment_intent_id: String, reason: String },
}

/// Reasons a `PaymentIntentRefreshRequested` carries, for the writers in more than one crate.
/// Only [`refresh_reason::CAPTURE_OUTSTANDING`] changes how its re-fetch runs; every other
/// reason — these, `webhook_claim`, `amount_mismatch`, `hold_lapsing`, … — is only logged
/// and counted.
pub mod refresh_reason {
    /// A capture was claimed (a webhook) while the saga's own capture request was outstanding:
    /// most likely the capture's own webhook, ahead of the payment worker's record of the same
    /// answer. Webhook ingress keeps such a claim in the ledger (`capture_claims`) and the
    /// expiry worker's sweep asks for its re-fetch only when the capture is still unrecorded
    /// half a minute later; a re-fetch with this reason (the sweep's, or an older writer's
    /// sent at once) stops at the ledger when the capture is recorded by the time it runs
    /// ([`super::capture_claim_recorded`]), and asks the provider otherwise.
    pub const CAPTURE_OUTSTANDING: &str = "capture_outstanding";
    /// Webhooks about the PaymentIntent arrived before its payment row, and were kept as
    /// pending until the row was written (design §10): what they reported is re-derived
    /// from the provider.
    pub const EARLY_WEBHOOK: &str = "early_webhook";
    /// Webhook claims about the PaymentIntent were counted while a re-fetch of it was under
    /// way (after the payment worker read the ledger before its call), so that re-fetch may
    /// predate what they report: the payment worker asks once more
    /// (`stripe_events::finish_refetch`, migration 0033).
    pub const CLAIMED_DURING_REFETCH: &str = "claimed_during_refetch";
}

/// Whether a capture claimed for PaymentIntent `claimed` while the saga's capture was
/// outstanding is recorded now: the order's payment row names that PaymentIntent
/// (`recorded_intent`) and records it `succeeded`. Such a claim then agrees with the ledger,
/// as one judged known on arrival would (its amount was checked against the order's when it
/// came in), and no one need be asked. The one rule for the capture-claim sweep and for the
/// payment worker's re-fetch with [`refresh_reason::CAPTURE_OUTSTANDING`].
pub fn capture_claim_recorded(
    recorded_intent: &str,
    recorded_status: &PaymentIntentStatus,
    claimed: &str,
) -> bool {
    recorded_intent == claimed && *recorded_status == PaymentIntentStatus::Succeeded
}

impl EventKind {
    /// The kind named by an envelope's `event_type`; `None` for a type this build does not
    /// know (a newer producer's), which consumers acknowledge unread.
    pub fn of(event_type: &str) -> Option<EventKind> {
        event_type.parse().ok()
    }

    /// The `event_type` text (the variant's name).
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// What an authorization request asks the payment worker for: a manual-capture
/// PaymentIntent of `amount_minor` (minor units of `currency`) for the order and its hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuthorizationAsk<'a> {
    /// The order.
    pub order_id: OrderId,
    /// Its hold.
    pub hold_id: HoldId,
    /// The amount to authorize, minor units.
    pub amount_minor: i64,
    /// Lower-case ISO 4217 currency.
    pub currency: &'a str,
}

/// The capture an `OrderConfirmed` requests when it is the order's capture request: the
/// order's PaymentIntent and the amount to capture, minor units (the order's total).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestedCapture {
    /// The authorized PaymentIntent to capture.
    pub payment_intent_id: String,
    /// The amount to capture, minor units.
    pub amount_minor: i64,
}

/// What a capture request asks the payment worker for: capture `payment_intent_id`, the
/// order's authorized PaymentIntent, for `amount_minor` (minor units).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CaptureAsk<'a> {
    /// The order.
    pub order_id: OrderId,
    /// The PaymentIntent to capture.
    pub payment_intent_id: &'a str,
    /// The amount to capture, minor units.
    pub amount_minor: i64,
}

impl PurchaseEvent {
    /// The event's kind.
    pub fn kind(&self) -> EventKind {
        self.into()
    }

    /// The order's authorization request this message is, if it is one: a
    /// `PaymentAuthorizationRequested`, or a `HoldCreated` written as the request
    /// (`is_authorization_request`, [`crate::saga::hold_created`]).
    pub fn authorization_request(&self) -> Option<AuthorizationAsk<'_>> {
        match self {
            PurchaseEvent::PaymentAuthorizationRequested { order_id, hold_id, amount_minor, currency }
            | PurchaseEvent::HoldCreated {
                order_id,
                hold_id,
                amount_minor,
                currency,
                is_authorization_request: true,
                ..
            } => Some(AuthorizationAsk {
                order_id: *order_id,
                hold_id: *hold_id,
                amount_minor: *amount_minor,
                currency,
            }),
            _ => None,
        }
    }

    /// The order's capture request this message is, if it is one: a `CaptureRequested`, or an
    /// `OrderConfirmed` written as the request (`capture`, [`crate::saga::CaptureRequest`]).
    pub fn capture_request(&self) -> Option<CaptureAsk<'_>> {
        match self {
            PurchaseEvent::CaptureRequested { order_id, payment_intent_id, amount_minor }
            | PurchaseEvent::OrderConfirmed {
                order_id,
                capture: Some(RequestedCapture { payment_intent_id, amount_minor }),
                ..
            } => Some(CaptureAsk { order_id: *order_id, payment_intent_id, amount_minor: *amount_minor }),
            _ => None,
        }
    }

    /// The PaymentIntent the event is about, for the facts and commands that name one.
    pub fn payment_intent_id(&self) -> Option<&str> {
        use PurchaseEvent::*;
        match self {
            PaymentIntentCreated { payment_intent_id, .. }
            | PaymentAuthorized { payment_intent_id, .. }
            | PaymentFailed { payment_intent_id, .. }
            | CaptureRequested { payment_intent_id, .. }
            | PaymentCaptured { payment_intent_id, .. }
            | CaptureFailed { payment_intent_id, .. }
            | AuthorizationCancelRequested { payment_intent_id, .. }
            | PaymentCanceled { payment_intent_id, .. }
            | RefundRequested { payment_intent_id, .. }
            | PaymentRefunded { payment_intent_id, .. }
            | PaymentIntentRefreshRequested { payment_intent_id, .. }
            | DisputeRefreshRequested { payment_intent_id, .. }
            | PaymentDisputed { payment_intent_id, .. }
            | OrderConfirmed { capture: Some(RequestedCapture { payment_intent_id, .. }), .. } => {
                Some(payment_intent_id)
            }
            HoldCreated { .. }
            | PaymentAuthorizationRequested { .. }
            | OrderConfirmed { .. }
            | TicketIssueRequested { .. }
            | TicketIssued { .. }
            | TicketsVoided { .. }
            | SeatsReturnedToSale { .. }
            | HoldExpired { .. } => None,
        }
    }

    /// The order the event belongs to.
    pub fn order_id(&self) -> OrderId {
        use PurchaseEvent::*;
        match self {
            HoldCreated { order_id, .. }
            | PaymentAuthorizationRequested { order_id, .. }
            | PaymentIntentCreated { order_id, .. }
            | PaymentAuthorized { order_id, .. }
            | PaymentFailed { order_id, .. }
            | OrderConfirmed { order_id, .. }
            | CaptureRequested { order_id, .. }
            | PaymentCaptured { order_id, .. }
            | CaptureFailed { order_id, .. }
            | TicketIssueRequested { order_id, .. }
            | TicketIssued { order_id, .. }
            | TicketsVoided { order_id, .. }
            | SeatsReturnedToSale { order_id, .. }
            | DisputeRefreshRequested { order_id, .. }
            | PaymentDisputed { order_id, .. }
            | HoldExpired { order_id, .. }
            | AuthorizationCancelRequested { order_id, .. }
            | PaymentCanceled { order_id, .. }
            | RefundRequested { order_id, .. }
            | PaymentRefunded { order_id, .. }
            | PaymentIntentRefreshRequested { order_id, .. } => *order_id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trips_and_carries_type() {
        let order = OrderId::new();
        let ev = PurchaseEvent::OrderConfirmed { order_id: order, hold_id: HoldId::new(), capture: None };
        let env = Envelope::new(order, &ev, Uuid::new_v4(), None);
        assert_eq!(env.event_type, "OrderConfirmed");
        let bytes = serde_json::to_vec(&env).unwrap();
        let back = Envelope::from_slice(&bytes).unwrap();
        assert_eq!(back.decode().unwrap(), ev);
        let next = back.follow(&ev);
        assert_eq!(next.causation_id, Some(env.event_id));
        assert_eq!(next.correlation_id, env.correlation_id);
    }

    #[test]
    fn event_kinds_are_the_envelope_types() {
        use strum::VariantArray;
        let order = OrderId::new();
        let ev = PurchaseEvent::HoldExpired { order_id: order, hold_id: HoldId::new() };
        let env = Envelope::new(order, &ev, Uuid::new_v4(), None);
        assert_eq!(EventKind::of(&env.event_type), Some(ev.kind()));
        assert_eq!(ev.kind().as_str(), "HoldExpired");
        assert_eq!(EventKind::of("SomethingNew"), None);
        assert_eq!(EventKind::VARIANTS.len(), 21);
    }

    #[test]
    fn unknown_fields_are_ignored_and_bad_payloads_rejected() {
        let order = OrderId::new();
        let mut env = Envelope::new(
            order,
            &PurchaseEvent::HoldExpired { order_id: order, hold_id: HoldId::new() },
            Uuid::new_v4(),
            None,
        );
        env.payload["added_later"] = serde_json::json!(true);
        assert!(env.decode().is_ok());
        env.payload = serde_json::json!({"nope": 1});
        assert!(matches!(env.decode(), Err(DecodeError::Payload { .. })));
        // Another order's payload in this order's envelope.
        let other = OrderId::new();
        let mut forged = env.follow(&PurchaseEvent::HoldExpired { order_id: order, hold_id: HoldId::new() });
        forged.payload["order_id"] = serde_json::json!(other.0);
        assert!(matches!(
            forged.decode(),
            Err(DecodeError::OtherOrder { envelope, payload }) if envelope == order.0 && payload == other.0
        ));
        let mut v = serde_json::to_value(&env).unwrap();
        v["schema_version"] = 2.into();
        assert!(matches!(
            Envelope::from_slice(&serde_json::to_vec(&v).unwrap()),
            Err(DecodeError::Version(2))
        ));
    }
}
