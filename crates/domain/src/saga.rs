//! The purchase saga's decisions (design §9): for each fact, what the order, its hold and its
//! payment become next and which facts or commands follow — each forward step with its
//! compensation named beside it (release the hold, cancel the authorization, refund the
//! capture). Pure: no IO.
//!
//! `boxoffice_workers::saga` reads a [`Snapshot`] under the hold → order row locks, calls
//! [`decide`], and executes the [`Step`]s through the store, whose transition functions refuse
//! any move the status tables of [`crate::status`] do not list. The store's hold expiry asks
//! [`lapsed_hold_expires_order`] which orders follow their released holds.
//!
//! | fact                 | when                                   | steps                                                   |
//! |----------------------|----------------------------------------|---------------------------------------------------------|
//! | HoldCreated          | written without its authorization request (older facts), order `held` | PaymentAuthorizationRequested |
//! | PaymentIntentCreated | order `held`                           | → `payment_required`                                    |
//! |                      | order ended (not ticketed)             | cancel the authorization (compensation)                 |
//! | PaymentAuthorized    | not the order's PaymentIntent          | cancel that authorization                               |
//! |                      | the intent is already settled          | nothing (a reordered, stale fact)                       |
//! |                      | hold active and not lapsed             | hold confirmed, → `confirming`, OrderConfirmed (the capture request) |
//! |                      | hold lapsed / expired / order ended    | expire the hold if active, cancel, → `canceled`         |
//! | PaymentFailed        | payment unsettled                      | record the decline (the buyer may retry)                |
//! | PaymentCaptured      | not the order's PaymentIntent          | incident, RefundRequested for it; the order unchanged   |
//! |                      | order `confirming`                     | → `paid`, TicketIssueRequested                          |
//! |                      | order without seats                    | incident, → `refunding`, RefundRequested (compensation) |
//! | CaptureFailed        | order `confirming`                     | release hold, → `failed`, cancel the authorization      |
//! | PaymentCanceled      | not the order's PaymentIntent          | nothing (a stray authorization's cancel)                |
//! |                      | order `confirming` (auth expired)      | release hold, → `failed`                                |
//! |                      | unpaid order, its own intent           | expire the hold, → `canceled` (nobody can pay it)       |
//! | PaymentRefunded      | not the order's PaymentIntent          | nothing (the refund of a stray capture)                 |
//! |                      | order `refunding`                      | → `refunded`                                            |
//! |                      | order `ticketed`, refunded in full     | → `refunded`, tickets void, TicketsVoided (case C14)    |
//! |                      | order `paid` / `ticketed`, in part     | recorded, incident; tickets stay valid                  |
//! | PaymentDisputed      | opened, order `ticketed`               | incident, tickets flagged (or void, per the event)      |
//! |                      | lost, order `ticketed`                 | → `refunded`, tickets void, TicketsVoided (case C15)    |
//! |                      | won                                    | tickets valid again                                     |
//!
//! The first forward step is not a row: the hold transaction requests the order's
//! authorization itself ([`hold_created`]), since the order is `held` when it commits and the
//! step has no other condition. Its `HoldCreated` is the request, which the payment worker
//! acts on, or, for builds that do not, a `PaymentAuthorizationRequested` beside it
//! ([`AuthorizationRequest`]). The saga acts on a `HoldCreated` only when it was written
//! without either ([`acts_on`]).
//!
//! Likewise the confirmation's `OrderConfirmed` is the capture request the payment worker
//! acts on, or, for builds that do not, a `CaptureRequested` follows it ([`CaptureRequest`],
//! [`confirmed`]).
//!
//! Invariant 2: only `PaymentAuthorized` for the order's PaymentIntent with an active,
//! unlapsed hold confirms. Invariant 6: a late authorization is cancelled and a capture for an
//! order that no longer owns seats is refunded. Invariant 4: decisions depend on state, not on
//! message identity, so a duplicate fact finds the order moved and decides nothing new.

use chrono::{DateTime, Utc};

use crate::events::{EventKind, PurchaseEvent, RequestedCapture};
use crate::ids::{EventId, HoldId, OrderId, SeatId};
use crate::status::{CaptureDeadline, HoldStatus, OrderStatus, PaymentIntentStatus, PaymentUpdate};

/// The facts the saga consumes (its consumer routes on these).
pub const FACTS: [EventKind; 9] = [
    EventKind::HoldCreated,
    EventKind::PaymentIntentCreated,
    EventKind::PaymentAuthorized,
    EventKind::PaymentFailed,
    EventKind::PaymentCaptured,
    EventKind::CaptureFailed,
    EventKind::PaymentCanceled,
    EventKind::PaymentRefunded,
    EventKind::PaymentDisputed,
];

/// Why an order failed, expired or was canceled (`orders.failure_reason`), and why a
/// compensation was requested (the `reason` of cancel and refund commands).
pub mod reason {
    /// The hold ran out before the payment was authorized.
    pub const HOLD_EXPIRED: &str = "hold_expired";
    /// An authorization arrived after the hold lapsed or the order ended.
    pub const AUTHORIZATION_AFTER_EXPIRY: &str = "authorization_after_expiry";
    /// A PaymentIntent was created for an order that had already ended.
    pub const ORDER_ALREADY_ENDED: &str = "order_already_ended";
    /// An authorization for a PaymentIntent that is not the order's recorded one.
    pub const NOT_CURRENT_PAYMENT_INTENT: &str = "not_current_payment_intent";
    /// Money was captured for an order that no longer owns seats.
    pub const CAPTURE_AFTER_RELEASE: &str = "capture_after_release";
    /// The provider refused the capture.
    pub const CAPTURE_FAILED: &str = "capture_failed";
    /// The authorization was cancelled (or lapsed) before capture.
    pub const AUTHORIZATION_CANCELED: &str = "authorization_canceled";
    /// The authorization neared Stripe's capture deadline uncaptured (case C09).
    pub const CAPTURE_DEADLINE: &str = "capture_deadline";
    /// The captured money was refunded in full at the provider, not by the saga (case C14).
    pub const REFUNDED_AT_PROVIDER: &str = "refunded_at_provider";
    /// Part of the captured money was refunded at the provider; the tickets stay valid.
    pub const PARTIAL_REFUND: &str = "partial_refund";
    /// The cardholder's bank opened a dispute of the order's charge (case C15).
    pub const DISPUTE_OPENED: &str = "dispute_opened";
    /// The dispute closed lost: the money went back to the cardholder.
    pub const DISPUTE_LOST: &str = "dispute_lost";
}

/// What the saga knows about an order when a fact arrives (read under its row locks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The order's stored status.
    pub order: OrderStatus,
    /// The order's total, minor units (what is captured).
    pub amount_minor: i64,
    /// The order's hold (every order has one; `None` is corrupt data and refused where a
    /// hold is needed).
    pub hold: Option<HoldSnapshot>,
    /// How the fact's PaymentIntent relates to the order's recorded one.
    pub intent: IntentMatch,
    /// The recorded payment's mirrored status (`None` until the payment worker records it).
    pub payment: Option<PaymentIntentStatus>,
    /// What the event does with tickets under an open dispute.
    pub dispute_policy: DisputePolicy,
    /// How a confirmation asks for the capture (the saga's configuration, not a row).
    pub capture_request: CaptureRequest,
}

/// What an open dispute does to an order's tickets (`events.dispute_policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DisputePolicy {
    /// Keep them valid, flagged as disputed (the default).
    #[default]
    Keep,
    /// Void them until the dispute is won.
    Void,
}

impl DisputePolicy {
    /// The stored text (`keep`, `void`); anything else reads as `keep`.
    pub fn parse(s: &str) -> Self {
        if s == "void" {
            Self::Void
        } else {
            Self::Keep
        }
    }
}

/// Where a dispute stands, from Stripe's dispute status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DisputeOutcome {
    /// Still open (`needs_response`, `under_review`, `warning_*` but `warning_closed`).
    Open,
    /// Closed in the merchant's favour (`won`, `warning_closed`).
    Won,
    /// Closed in the cardholder's favour: the money went back (`lost`).
    Lost,
}

impl DisputeOutcome {
    /// The outcome of Stripe's dispute `status`.
    pub fn of(status: &str) -> Self {
        match status {
            "won" | "warning_closed" => Self::Won,
            "lost" => Self::Lost,
            _ => Self::Open,
        }
    }
}

/// A locked hold as the saga sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HoldSnapshot {
    /// Hold id.
    pub id: HoldId,
    /// Stored status.
    pub status: HoldStatus,
    /// Whether `expires_at` has passed by the database clock.
    pub lapsed: bool,
}

impl HoldSnapshot {
    /// Active and not lapsed: the only hold an authorization may confirm (invariant 2).
    pub fn is_live(&self) -> bool {
        self.status == HoldStatus::Active && !self.lapsed
    }
}

/// How a fact's PaymentIntent relates to the payment the ledger recorded for the order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntentMatch {
    /// It is the order's recorded PaymentIntent.
    Current,
    /// No payment is recorded yet (a webhook overtook the payment worker's commit): the fact
    /// is accepted as the order's.
    Unrecorded,
    /// The order records another PaymentIntent.
    Other,
}

/// One effect of a decision, executed in order inside the fact's transaction.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Record the provider's capture deadline for the authorization.
    SetCaptureBefore(DateTime<Utc>),
    /// Mirror the PaymentIntent on the payment row.
    MirrorPayment(PaymentUpdate),
    /// Record a declined confirmation, only while the payment is unsettled.
    RecordDecline {
        /// Stripe's decline code.
        reason: String,
    },
    /// Move the hold (seats are released for `expired` and `released`).
    MoveHold(HoldStatus),
    /// Compensation for a hold that must not keep its seats: expire it as the expiry worker
    /// does (seats released; an unpaid order → `expired`; its authorization cancelled once;
    /// HoldExpired).
    ExpireHold,
    /// Move the order.
    MoveOrder {
        /// The new status.
        to: OrderStatus,
        /// Recorded as `failure_reason` (failure states).
        reason: Option<String>,
    },
    /// Compensation: cancel authorization `payment_intent_id`. For the order's recorded
    /// PaymentIntent only the first request is emitted (one cancel per payment); any other
    /// is emitted as is (Stripe's idempotency key `cancel:{payment_intent_id}` makes repeats harmless).
    CancelAuthorization {
        /// The PaymentIntent to cancel.
        payment_intent_id: String,
        /// Why (one of [`reason`]).
        reason: &'static str,
    },
    /// Void every valid ticket of the order (kept, marked; the seats are not resold) and emit
    /// `TicketsVoided`.
    VoidTickets {
        /// Why (one of [`reason`]).
        reason: &'static str,
    },
    /// Mirror the provider's dispute on the payment row.
    MirrorDispute {
        /// `dp_…`
        dispute_id: String,
        /// Stripe's dispute status.
        status: String,
    },
    /// Flag the order's tickets as disputed (they stay valid).
    FlagTicketsDisputed,
    /// A dispute was won: clear the flag, and make valid again the tickets voided because the
    /// dispute opened.
    RestoreDisputedTickets,
    /// Record an incident for an operator.
    Incident {
        /// Incident kind.
        kind: &'static str,
        /// What the operator needs (no secrets).
        details: serde_json::Value,
    },
    /// Emit a fact or command through the outbox.
    Emit(PurchaseEvent),
    /// Count one occurrence in the counter named so.
    Count(&'static str),
}

/// Why the saga refused a fact (permanent: dead-letter material).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The order has no hold where the step needs one.
    #[error("order {0} has no hold")]
    MissingHold(OrderId),
    /// Not a fact the saga consumes.
    #[error("the saga does not handle {0}")]
    NotASagaFact(EventKind),
}

impl Refusal {
    /// A stable code for dead-letter headers and metrics.
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::MissingHold(_) => "missing_hold",
            Refusal::NotASagaFact(_) => "unexpected_event",
        }
    }
}

/// How the hold transaction asks for a new order's authorization, the saga's first forward
/// step (its only condition: the order is `held`, which it is when the hold commits; its
/// compensation is the hold's expiry, which cancels whatever authorization follows).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AuthorizationRequest {
    /// `HoldCreated` is the request (`is_authorization_request`): one fact per new order,
    /// which the payment worker acts on. The default.
    #[default]
    InHoldFact,
    /// A `PaymentAuthorizationRequested` command beside `HoldCreated`, as builds that do not
    /// act on a `HoldCreated` need it: for a rolling upgrade from such a build, or before a
    /// rollback to one (configuration `hold_fact_requests_authorization = false`).
    Command,
}

/// How the saga asks for a confirmed order's capture, the step after the confirmation (its
/// condition, the hold confirmed and the order `confirming`, is what the confirmation wrote;
/// its compensation is the refund of a capture that lands on an order without seats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CaptureRequest {
    /// `OrderConfirmed` is the request (its `capture`): one fact per confirmation, which the
    /// payment worker acts on. The default.
    #[default]
    InConfirmationFact,
    /// A `CaptureRequested` command beside `OrderConfirmed`, as builds whose payment worker
    /// does not act on an `OrderConfirmed` need it: for a rolling upgrade from such a build,
    /// or before a rollback to one (configuration `confirmation_fact_requests_capture =
    /// false`).
    Command,
}

/// The facts the hold transaction writes for a new order, in order: `HoldCreated`, and with
/// [`AuthorizationRequest::Command`] the `PaymentAuthorizationRequested` after it. `seat_ids`
/// are the hold's seats, `amount_minor` their total in `currency`'s minor units.
#[allow(clippy::too_many_arguments)]
pub fn hold_created(
    order_id: OrderId,
    hold_id: HoldId,
    event_id: EventId,
    seat_ids: Vec<SeatId>,
    expires_at: DateTime<Utc>,
    amount_minor: i64,
    currency: String,
    request: AuthorizationRequest,
) -> Vec<PurchaseEvent> {
    let in_fact = request == AuthorizationRequest::InHoldFact;
    let created = PurchaseEvent::HoldCreated {
        order_id,
        hold_id,
        event_id,
        seat_ids,
        expires_at,
        amount_minor,
        currency: currency.clone(),
        // `false` in the one-fact form, so that an older build's saga, which does not know
        // `is_authorization_request`, requests the authorization itself: a rollback, a
        // dead letter replayed to or a region republished by such a build still gets the
        // order its PaymentIntent (this build's payment worker skips the second request).
        authorization_requested: !in_fact,
        is_authorization_request: in_fact,
    };
    if in_fact {
        vec![created]
    } else {
        vec![
            created,
            PurchaseEvent::PaymentAuthorizationRequested { order_id, hold_id, amount_minor, currency },
        ]
    }
}

/// Whether the saga acts on `fact` at all (the consumer acknowledges the rest unapplied,
/// without a transaction): every fact of [`FACTS`] but a `HoldCreated` whose authorization
/// the hold transaction requested itself ([`hold_created`]: the command beside it,
/// `authorization_requested`, or the fact is the request).
pub fn acts_on(fact: &PurchaseEvent) -> bool {
    !matches!(fact, PurchaseEvent::HoldCreated { authorization_requested: true, .. })
        && fact.authorization_request().is_none()
}

/// The saga's decision for `fact` given `s`: the steps to execute, in order.
pub fn decide(s: &Snapshot, fact: &PurchaseEvent) -> Result<Vec<Step>, Refusal> {
    use PurchaseEvent as E;
    Ok(match fact {
        E::HoldCreated { .. } if !acts_on(fact) => vec![],
        E::HoldCreated { order_id, hold_id, amount_minor, currency, .. } => {
            request_authorization(s, *order_id, *hold_id, *amount_minor, currency)
        }
        E::PaymentIntentCreated { payment_intent_id, .. } => intent_created(s, payment_intent_id),
        E::PaymentAuthorized { order_id, payment_intent_id, capture_before, .. } => {
            authorized(s, *order_id, payment_intent_id, *capture_before)?
        }
        E::PaymentFailed { reason, .. } => vec![Step::RecordDecline { reason: reason.clone() }],
        E::PaymentCaptured { order_id, payment_intent_id, amount_captured_minor } => {
            captured(s, *order_id, payment_intent_id, *amount_captured_minor)?
        }
        E::CaptureFailed { payment_intent_id, reason, .. } => capture_failed(s, payment_intent_id, reason),
        E::PaymentCanceled { .. } => canceled(s),
        E::PaymentRefunded { amount_refunded_minor, .. } => refunded(s, *amount_refunded_minor),
        E::PaymentDisputed { dispute_id, status, .. } => disputed(s, dispute_id, status),
        other => return Err(Refusal::NotASagaFact(other.kind())),
    })
}

/// Whether an order follows its lapsed hold to `expired` (the lapsed-hold compensation): only
/// while it still waits for an authorization; a confirmed or settled order keeps its status.
/// Its authorization, if any, is cancelled and `HoldExpired` is emitted either way.
pub fn lapsed_hold_expires_order(order: OrderStatus) -> bool {
    order.awaits_authorization()
}

/// The facts that follow a lapsed hold, in order: `HoldExpired`, then the cancel of the
/// order's authorization when the ledger marked one to cancel (`cancel`: its PaymentIntent,
/// the first time only).
pub fn lapsed_hold_facts(order_id: OrderId, hold_id: HoldId, cancel: Option<String>) -> Vec<PurchaseEvent> {
    let mut facts = vec![PurchaseEvent::HoldExpired { order_id, hold_id }];
    facts.extend(cancel.map(|payment_intent_id| PurchaseEvent::AuthorizationCancelRequested {
        order_id,
        payment_intent_id,
        reason: reason::HOLD_EXPIRED.into(),
    }));
    facts
}

/// Case C09: a confirmed order whose authorization nears the capture deadline uncaptured is
/// given up on purpose rather than left to lapse — hold released, order failed, incident, and
/// the authorization cancelled. Nothing for an order that moved on meanwhile.
pub fn give_up_before_capture_deadline(s: &Snapshot, payment_intent_id: &str) -> Vec<Step> {
    if s.order != OrderStatus::Confirming {
        return vec![];
    }
    let mut steps = release_hold(s);
    steps.extend([
        fail(reason::CAPTURE_DEADLINE),
        Step::Incident {
            kind: reason::CAPTURE_DEADLINE,
            details: serde_json::json!({ "payment_intent_id": payment_intent_id }),
        },
        cancel(payment_intent_id, reason::CAPTURE_DEADLINE),
    ]);
    steps
}

/// Forward, on a HoldCreated written without its request (see [`hold_created`]): ask the
/// payment worker for a manual-capture PaymentIntent.
fn request_authorization(
    s: &Snapshot,
    order_id: OrderId,
    hold_id: HoldId,
    amount_minor: i64,
    currency: &str,
) -> Vec<Step> {
    if s.order != OrderStatus::Held {
        return vec![];
    }
    vec![Step::Emit(PurchaseEvent::PaymentAuthorizationRequested {
        order_id,
        hold_id,
        amount_minor,
        currency: currency.to_owned(),
    })]
}

/// Forward, on PaymentIntentCreated: the buyer may pay. Compensation: An order that ended meanwhile gets the
/// intent cancelled (nobody may pay for nothing).
fn intent_created(s: &Snapshot, payment_intent_id: &str) -> Vec<Step> {
    match s.order {
        OrderStatus::Held => vec![move_order(OrderStatus::PaymentRequired)],
        o if o.is_final() && o != OrderStatus::Ticketed => {
            vec![cancel(payment_intent_id, reason::ORDER_ALREADY_ENDED)]
        }
        _ => vec![],
    }
}

/// Forward, on PaymentAuthorized: confirm a live hold and request the capture. Compensation: Cancel an
/// authorization that came too late or names another PaymentIntent. A capture deadline the
/// fact states is written to the intent's payment row whatever the decision (a no-op when
/// the ledger has no row for that intent; a fact refused as impossible writes nothing);
/// when the hold is confirmed, in the same write as the payment's status.
fn authorized(
    s: &Snapshot,
    order_id: OrderId,
    payment_intent_id: &str,
    capture_before: Option<DateTime<Utc>>,
) -> Result<Vec<Step>, Refusal> {
    let mut steps: Vec<Step> = capture_before.map(Step::SetCaptureBefore).into_iter().collect();
    if s.intent == IntentMatch::Other {
        steps.push(cancel(payment_intent_id, reason::NOT_CURRENT_PAYMENT_INTENT));
        return Ok(steps);
    }
    if s.intent == IntentMatch::Current && s.payment.as_ref().is_some_and(PaymentIntentStatus::is_final) {
        // Stripe reported the intent cancelled or captured before this authorization was
        // delivered (webhooks arrive in any order): nothing is left to confirm or cancel.
        return Ok(steps);
    }
    if s.order.awaits_authorization() {
        let hold = s.hold.ok_or(Refusal::MissingHold(order_id))?;
        if hold.is_live() {
            return Ok(confirm(s, order_id, hold.id, payment_intent_id, capture_before));
        }
        // Expiry won the race (or is due and has not run yet): one legal end state, the
        // seats released and the authorization cancelled.
        if hold.status == HoldStatus::Active {
            steps.push(Step::ExpireHold);
        }
        steps.extend(cancel_late_authorization(payment_intent_id));
    } else if matches!(s.order, OrderStatus::Expired | OrderStatus::Failed) {
        steps.extend(cancel_late_authorization(payment_intent_id));
    }
    // confirming / paid / ticketed / canceled / refunding / refunded: already handled.
    Ok(steps)
}

/// Invariant 2: confirmed only with a live hold and an authorized payment. The payment
/// records `requires_capture` and the capture deadline in one write: the provider's when it
/// stated one, else the default validity unless one is recorded already (case C09).
fn confirm(
    s: &Snapshot,
    order_id: OrderId,
    hold_id: HoldId,
    payment_intent_id: &str,
    capture_before: Option<DateTime<Utc>>,
) -> Vec<Step> {
    vec![
        Step::MoveHold(HoldStatus::Confirmed),
        move_order(OrderStatus::Confirming),
        Step::MirrorPayment(PaymentUpdate {
            capture_before: capture_before.map_or(CaptureDeadline::DefaultIfUnknown, CaptureDeadline::Known),
            ..PaymentUpdate::status(PaymentIntentStatus::RequiresCapture)
        }),
    ]
    .into_iter()
    .chain(
        confirmed(s.capture_request, order_id, hold_id, payment_intent_id, s.amount_minor)
            .into_iter()
            .map(Step::Emit),
    )
    .collect()
}

/// The facts a confirmation writes, in order: `OrderConfirmed`, which is the capture request
/// of `amount_minor` (the order's total) for `payment_intent_id` with
/// [`CaptureRequest::InConfirmationFact`], or is followed by a `CaptureRequested` with
/// [`CaptureRequest::Command`].
pub fn confirmed(
    form: CaptureRequest,
    order_id: OrderId,
    hold_id: HoldId,
    payment_intent_id: &str,
    amount_minor: i64,
) -> Vec<PurchaseEvent> {
    let capture = RequestedCapture { payment_intent_id: payment_intent_id.to_owned(), amount_minor };
    match form {
        CaptureRequest::InConfirmationFact => {
            vec![PurchaseEvent::OrderConfirmed { order_id, hold_id, capture: Some(capture) }]
        }
        CaptureRequest::Command => vec![
            PurchaseEvent::OrderConfirmed { order_id, hold_id, capture: None },
            PurchaseEvent::CaptureRequested {
                order_id,
                payment_intent_id: capture.payment_intent_id,
                amount_minor: capture.amount_minor,
            },
        ],
    }
}

/// Compensation of a late authorization (invariant 6): cancel it; the order ends `canceled`.
fn cancel_late_authorization(payment_intent_id: &str) -> Vec<Step> {
    vec![
        cancel(payment_intent_id, reason::AUTHORIZATION_AFTER_EXPIRY),
        Step::MoveOrder {
            to: OrderStatus::Canceled,
            reason: Some(reason::AUTHORIZATION_AFTER_EXPIRY.into()),
        },
        Step::Count("boxoffice_late_authorizations_total"),
    ]
}

/// Forward, on PaymentCaptured: the order is paid; issue its tickets. Compensation: Money captured for an order
/// that no longer owns seats is refunded.
fn captured(
    s: &Snapshot,
    order_id: OrderId,
    payment_intent_id: &str,
    amount: i64,
) -> Result<Vec<Step>, Refusal> {
    if s.intent == IntentMatch::Other {
        // Money captured on a PaymentIntent that is not the order's (a stray authorization
        // captured elsewhere, e.g. from the dashboard): it pays for nothing, so it is
        // refunded and the order is left as it is (invariant 6).
        return Ok(vec![
            Step::Incident {
                kind: reason::NOT_CURRENT_PAYMENT_INTENT,
                details: serde_json::json!({
                    "payment_intent_id": payment_intent_id,
                    "order_status": s.order.as_str(),
                    "amount_captured_minor": amount,
                }),
            },
            Step::Emit(PurchaseEvent::RefundRequested {
                order_id,
                payment_intent_id: payment_intent_id.to_owned(),
                amount_minor: amount,
                reason: reason::NOT_CURRENT_PAYMENT_INTENT.into(),
            }),
        ]);
    }
    let mut steps = vec![Step::MirrorPayment(PaymentUpdate {
        amount_captured_minor: Some(amount),
        ..PaymentUpdate::status(PaymentIntentStatus::Succeeded)
    })];
    match s.order {
        OrderStatus::Confirming => {
            let hold = s.hold.ok_or(Refusal::MissingHold(order_id))?;
            steps.push(move_order(OrderStatus::Paid));
            steps.push(Step::Emit(PurchaseEvent::TicketIssueRequested { order_id, hold_id: hold.id }));
        }
        o if o.awaits_authorization()
            || matches!(o, OrderStatus::Expired | OrderStatus::Failed | OrderStatus::Canceled) =>
        {
            steps.extend(refund_capture(s, order_id, payment_intent_id, amount));
        }
        // paid / ticketed / refunding / refunded: a duplicate fact.
        _ => {}
    }
    Ok(steps)
}

/// Compensation of a capture after release (invariant 6): an incident, the hold expired if
/// it is still active, the order → `refunding`, and the refund requested.
fn refund_capture(s: &Snapshot, order_id: OrderId, payment_intent_id: &str, amount: i64) -> Vec<Step> {
    let mut steps = vec![Step::Incident {
        kind: reason::CAPTURE_AFTER_RELEASE,
        details: serde_json::json!({
            "payment_intent_id": payment_intent_id,
            "order_status": s.order.as_str(),
            "amount_captured_minor": amount,
        }),
    }];
    if s.hold.is_some_and(|h| h.status == HoldStatus::Active) {
        steps.push(Step::ExpireHold);
    }
    steps.push(Step::MoveOrder {
        to: OrderStatus::Refunding,
        reason: Some(reason::CAPTURE_AFTER_RELEASE.into()),
    });
    steps.push(Step::Emit(PurchaseEvent::RefundRequested {
        order_id,
        payment_intent_id: payment_intent_id.to_owned(),
        amount_minor: amount,
        reason: reason::CAPTURE_AFTER_RELEASE.into(),
    }));
    steps
}

/// Compensation, on CaptureFailed: the confirmed order cannot be paid; release its seats and cancel the
/// authorization.
fn capture_failed(s: &Snapshot, payment_intent_id: &str, why: &str) -> Vec<Step> {
    if s.order != OrderStatus::Confirming {
        return vec![];
    }
    let mut steps = release_hold(s);
    steps.push(Step::MoveOrder { to: OrderStatus::Failed, reason: Some(why.to_owned()) });
    steps.push(cancel(payment_intent_id, reason::CAPTURE_FAILED));
    steps
}

/// Compensation, on PaymentCanceled: the authorization lapsed or was cancelled before capture (case C09);
/// a confirmed order fails and gives its seats back.
fn canceled(s: &Snapshot) -> Vec<Step> {
    if s.intent == IntentMatch::Other {
        // A stray authorization's cancel (the saga asks for it): the order's own PaymentIntent
        // is still what pays it, so its hold and status are not about this.
        return vec![];
    }
    let mut steps = vec![Step::MirrorPayment(PaymentUpdate::status(PaymentIntentStatus::Canceled))];
    if s.order == OrderStatus::Confirming {
        steps.extend(release_hold(s));
        steps.push(fail(reason::AUTHORIZATION_CANCELED));
        steps.push(Step::Count("boxoffice_authorizations_lost_before_capture_total"));
    } else if s.order.awaits_authorization() && s.intent == IntentMatch::Current {
        // The buyer's only PaymentIntent was cancelled at the provider: nobody can pay this
        // order any more, so its seats go back now rather than at the hold's expiry.
        if s.hold.is_some_and(|h| h.status == HoldStatus::Active) {
            steps.push(Step::ExpireHold);
        }
        steps.push(Step::MoveOrder {
            to: OrderStatus::Canceled,
            reason: Some(reason::AUTHORIZATION_CANCELED.into()),
        });
    }
    steps
}

/// Forward, on PaymentRefunded: the refund compensation completed. A refund nobody here asked for (case
/// C14): in full, the ticketed order is `refunded` and its tickets void; in part, it is
/// recorded and reported, and the tickets stay valid.
fn refunded(s: &Snapshot, amount: i64) -> Vec<Step> {
    if s.intent == IntentMatch::Other {
        // The refund of a PaymentIntent that is not the order's (a stray capture's): the
        // order's own payment, status and tickets are not about it.
        return vec![];
    }
    let mut steps = vec![Step::MirrorPayment(PaymentUpdate {
        amount_refunded_minor: Some(amount),
        ..PaymentUpdate::status(PaymentIntentStatus::Succeeded)
    })];
    match s.order {
        OrderStatus::Refunding => steps.push(move_order(OrderStatus::Refunded)),
        OrderStatus::Ticketed if amount >= s.amount_minor => steps.extend([
            Step::MoveOrder { to: OrderStatus::Refunded, reason: Some(reason::REFUNDED_AT_PROVIDER.into()) },
            Step::VoidTickets { reason: reason::REFUNDED_AT_PROVIDER },
        ]),
        OrderStatus::Ticketed | OrderStatus::Paid => steps.push(Step::Incident {
            kind: reason::PARTIAL_REFUND,
            details: serde_json::json!({ "amount_refunded_minor": amount, "amount_minor": s.amount_minor }),
        }),
        _ => {}
    }
    steps
}

/// Case C15, on PaymentDisputed: the dispute is mirrored; once opened an incident, and the
/// tickets flagged (or voided, per the event's policy); lost, the order is `refunded` and its
/// tickets void (nothing is resold); won, the tickets are valid again.
fn disputed(s: &Snapshot, dispute_id: &str, status: &str) -> Vec<Step> {
    let mut steps =
        vec![Step::MirrorDispute { dispute_id: dispute_id.to_owned(), status: status.to_owned() }];
    if s.order != OrderStatus::Ticketed {
        if s.order != OrderStatus::Refunded {
            steps.push(Step::Incident {
                kind: reason::DISPUTE_OPENED,
                details: serde_json::json!({ "dispute_id": dispute_id, "status": status, "order_status": s.order.as_str() }),
            });
        }
        return steps;
    }
    match DisputeOutcome::of(status) {
        DisputeOutcome::Open => {
            steps.push(Step::Incident {
                kind: reason::DISPUTE_OPENED,
                details: serde_json::json!({ "dispute_id": dispute_id, "status": status }),
            });
            steps.push(match s.dispute_policy {
                DisputePolicy::Keep => Step::FlagTicketsDisputed,
                DisputePolicy::Void => Step::VoidTickets { reason: reason::DISPUTE_OPENED },
            });
        }
        DisputeOutcome::Lost => steps.extend([
            Step::MoveOrder { to: OrderStatus::Refunded, reason: Some(reason::DISPUTE_LOST.into()) },
            Step::VoidTickets { reason: reason::DISPUTE_LOST },
            Step::Incident {
                kind: reason::DISPUTE_LOST,
                details: serde_json::json!({ "dispute_id": dispute_id }),
            },
        ]),
        DisputeOutcome::Won => steps.push(Step::RestoreDisputedTickets),
    }
    steps
}

fn release_hold(s: &Snapshot) -> Vec<Step> {
    s.hold.map(|_| Step::MoveHold(HoldStatus::Released)).into_iter().collect()
}

fn move_order(to: OrderStatus) -> Step {
    Step::MoveOrder { to, reason: None }
}

fn fail(why: &'static str) -> Step {
    Step::MoveOrder { to: OrderStatus::Failed, reason: Some(why.into()) }
}

fn cancel(payment_intent_id: &str, reason: &'static str) -> Step {
    Step::CancelAuthorization { payment_intent_id: payment_intent_id.to_owned(), reason }
}

#[cfg(test)]
mod tests;
