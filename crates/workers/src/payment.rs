//! The payment worker (design §10): every call to the payment provider happens here, outside
//! any database transaction, each with a stable idempotency key so a replayed command repeats
//! the same logical operation instead of a new one (invariant 4):
//!
//! | command                        | Stripe call                         | idempotency key          |
//! |--------------------------------|-------------------------------------|--------------------------|
//! | PaymentAuthorizationRequested, or HoldCreated written as the request | create PaymentIntent (manual capture)| `authorize:{event_id}`  |
//! | CaptureRequested, or OrderConfirmed written as the request | capture | `capture:{order_id}` |
//! | AuthorizationCancelRequested   | cancel                               | `cancel:{payment_intent_id}` |
//! | RefundRequested                | refund                               | `refund:{payment_intent_id}` |
//! | PaymentIntentRefreshRequested  | retrieve PaymentIntent (+ its charge) | (read-only)            |
//! | DisputeRefreshRequested        | retrieve Dispute                     | (read-only)              |
//!
//! The PaymentIntent's metadata carries the order, hold, cell, the fact's region and epoch and
//! the fact's stored `traceparent` (design §16), all taken from the fact, so every retry of
//! `authorize:{event_id}` sends identical parameters, as Stripe requires of one key.
//!
//! Before any call, each command's pre-check reads the ledger outside any transaction:
//! whether the command is in this consumer's inbox (then no call), and the order, its hold
//! and its payment row — for a lane's batch, one statement for all its commands
//! ([`payments::prechecks`]). An authorization request creates a PaymentIntent only for an
//! order still `held` without one, and only for the order's own amount, currency and hold. The
//! inbox row the effect's transaction inserts stays the guard against a duplicate that got
//! past it.
//!
//! The provider's answer is then recorded (payment row + the resulting fact in the outbox) in
//! the consumer's inbox transaction — with those of the other commands of its lane's batch
//! when several were queued (`boxoffice_bus::consumer`, "Batches": their calls are made
//! concurrently, one per order, before that transaction begins). If the worker crashes after the provider succeeded but
//! before that commit, the replay sends the same key and gets the same answer. Where an
//! answer writes the payment row (a new PaymentIntent, a capture, a cancel), the order's hold
//! is locked first, the ledger's lock order; a batch locks the holds of all its commands (a
//! re-fetch may write the hold, and a refund or re-fetch may emit a fact the saga follows) in
//! one statement at the start of its transaction, in ascending order id (`Handler::lock_rows`),
//! and the payment rows of its re-fetches' orders in one more, which each re-fetch compares
//! the provider's answer with.
//!
//! Capture is only sent for an order whose hold is confirmed (case C06), for its total, and
//! only for the PaymentIntent its payment row records (without a row: one the provider made
//! for the order, read before the call); a cancel that finds the money already captured
//! turns into a refund (invariant 6). A refund the provider refuses because the charge was
//! already refunded in full (from the dashboard, say) is recorded as done; `PaymentRefunded`
//! always reports the charge's whole refunded amount, read back from the provider after the
//! refund, as a re-fetch reports it.
//!
//! The hold's lifetime rules (case C19, `boxoffice_domain::hold`) are applied here in the
//! same transaction as what the provider said: recording a new PaymentIntent opens the
//! buyer's payment window, and a re-fetch that finds the order's current PaymentIntent
//! authorized protects its live hold until the saga confirms it (one that finds it not
//! authorized clears a protection a webhook claim set, and ends the hold's provider check,
//! unless a claim was counted since its read: the buyer may have paid during the call, so
//! the protection stands until the re-fetch it asks once more has spoken; with the
//! follow-ups' budget spent, no re-fetch will, and the claims protect nothing).
//!
//! A PaymentIntent re-fetch stands for every webhook claim about that PaymentIntent, made for
//! its order, counted before its pre-check read the ledger (such claims share one pending
//! re-fetch, migrations 0033 and 0034):
//! the transaction that records what the provider said ends that pending re-fetch, and asks
//! for one more (`claimed_during_refetch`) when a claim was counted at or after the read, or
//! is in flight then (`boxoffice_store::stripe_events::finish_refetch`), within a budget of
//! follow-ups per PaymentIntent and order (`stripe_events::spend_follow_up`); past it, those
//! claims are left to the hold's provider check and to reconciliation.

use async_trait::async_trait;
use boxoffice_bus::{Handler, HandlerError};
use boxoffice_domain::events::refresh_reason;
use boxoffice_domain::{
    Envelope, EventKind, HoldPolicy, HoldStatus, OrderId, OrderStatus, PaymentUpdate, PurchaseEvent,
};
use boxoffice_payments::{
    CreatePaymentIntent, PaymentGateway, PaymentIntent, PaymentIntentStatus, StripeError,
};
use boxoffice_store::{holds, payments, stripe_events, Tx};
use sqlx::PgPool;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Consumer name (inbox key, consumer group `ticketing-payments`).
pub const NAME: &str = boxoffice_domain::consumers::PAYMENTS;

/// The payment consumer.
#[derive(Clone)]
pub struct PaymentWorker {
    gateway: Arc<dyn PaymentGateway>,
    pool: PgPool,
    policy: HoldPolicy,
    cell: Option<String>,
}

impl PaymentWorker {
    /// A worker calling `gateway`; `pool` is used for read-only pre-checks outside the
    /// transaction; `policy` is the hold's lifetime rules it applies when an order becomes
    /// payable and when the provider reports an authorization (case C19). Exports
    /// `boxoffice_payment_commands_skipped_total` of every [`SKIP_REASONS`] at 0 (a count
    /// already there is left as it is).
    pub fn new(gateway: Arc<dyn PaymentGateway>, pool: PgPool, policy: HoldPolicy) -> Self {
        for reason in SKIP_REASONS {
            metrics::counter!("boxoffice_payment_commands_skipped_total", "reason" => reason).increment(0);
        }
        Self { gateway, pool, policy, cell: None }
    }

    /// Writes `cell` as `metadata.purchase_cell` on every PaymentIntent it creates, so the
    /// router sends the intent's webhooks to this cell (design §13).
    pub fn in_cell(mut self, cell: impl Into<String>) -> Self {
        self.cell = Some(cell.into());
        self
    }
}

/// Why `prepare` sent nothing for a command already in this consumer's inbox (its
/// transaction then finds the inbox row and changes nothing).
const ALREADY_APPLIED: &str = "already_applied";

/// Why the re-fetch of a capture claimed while the capture was outstanding called no one:
/// the capture's answer is in the ledger by now.
const CAPTURE_RECORDED: &str = "capture_recorded";

/// Why an authorization request created nothing: its order is not `held` without a payment
/// row (a second request for one order: an older writer's, a replayed or forged one).
const NOT_AWAITING_PAYMENT_INTENT: &str = "order_not_awaiting_payment_intent";
/// Why an authorization request created nothing, or a capture request called no one: it
/// asks for another amount (or currency) than its order's.
const AMOUNT_DIFFERS_FROM_ORDER: &str = "amount_differs_from_order";
/// Why an authorization request created nothing: it names another hold than its order's.
const HOLD_DIFFERS_FROM_ORDER: &str = "hold_differs_from_order";
/// Why a capture request called no one: the order's hold is not confirmed.
const HOLD_NOT_CONFIRMED: &str = "hold_not_confirmed";
/// Why a capture request called no one: it names another PaymentIntent than the order's
/// recorded one, or, without a recorded one, one the provider does not know or made for
/// another order (a forged or corrupt request; capturing it would take another buyer's money).
const INTENT_DIFFERS_FROM_ORDER: &str = "payment_intent_differs_from_order";
/// Why a message reached `prepare` without being a payment command.
const NOT_A_PAYMENT_COMMAND: &str = "not_a_payment_command";

/// Every reason `boxoffice_payment_commands_skipped_total` is counted by. [`PaymentWorker::new`]
/// exports each at 0, so the first skip of a reason is an increase a rate or `increase()`
/// sees (a series that appears at 1 shows none).
pub const SKIP_REASONS: [&str; 8] = [
    CAPTURE_RECORDED,
    ALREADY_APPLIED,
    NOT_AWAITING_PAYMENT_INTENT,
    AMOUNT_DIFFERS_FROM_ORDER,
    HOLD_DIFFERS_FROM_ORDER,
    HOLD_NOT_CONFIRMED,
    INTENT_DIFFERS_FROM_ORDER,
    NOT_A_PAYMENT_COMMAND,
];

/// The reasons of `boxoffice_payment_commands_skipped_total` that are routine: a capture's
/// own webhook ahead of the worker's record of it ([`CAPTURE_RECORDED`]: the capture-claim
/// sweep's re-fetch racing the record, or an older webhook writer's re-fetch sent at once)
/// and a redelivery ([`ALREADY_APPLIED`]). Any other skip is a
/// command the ledger no longer wants (a stale, replayed or forged one, or a bug): logged at
/// warn, and alerted on (`BoxofficePaymentCommandsRefused` in deploy/observability).
pub const ROUTINE_SKIPS: [&str; 2] = [CAPTURE_RECORDED, ALREADY_APPLIED];

/// The commands this worker carries out (its consumer routes on these, and on the
/// [`REQUESTING_FACTS`] written as requests).
pub const COMMANDS: [EventKind; 6] = [
    EventKind::PaymentAuthorizationRequested,
    EventKind::CaptureRequested,
    EventKind::AuthorizationCancelRequested,
    EventKind::RefundRequested,
    EventKind::PaymentIntentRefreshRequested,
    EventKind::DisputeRefreshRequested,
];

/// The facts this worker acts on when they are written as a request
/// ([`PurchaseEvent::authorization_request`], [`PurchaseEvent::capture_request`]).
pub const REQUESTING_FACTS: [EventKind; 2] = [EventKind::HoldCreated, EventKind::OrderConfirmed];

/// What the provider said, carried from `prepare` to `apply`.
#[derive(Debug, Clone)]
pub enum Prepared {
    /// Nothing was sent (the order no longer needs the operation).
    Skipped(&'static str),
    /// The PaymentIntent after the call.
    Intent(PaymentIntent),
    /// A capture refused permanently.
    CaptureRefused { payment_intent_id: String, reason: String, intent: Option<PaymentIntent> },
    /// The provider contradicts the claim that asked for a re-fetch (the PaymentIntent does
    /// not exist, or belongs to another order): nothing is acted on; an incident is recorded.
    /// `read_at`: a PaymentIntent re-fetch's pre-check time ([`payments::Precheck::read_at`]),
    /// which ends its pending row; `None` for a dispute's.
    Refuted { payment_intent_id: String, why: &'static str, read_at: Option<chrono::DateTime<chrono::Utc>> },
    /// A dispute as Stripe reports it now (a refresh), about the order's PaymentIntent.
    ObservedDispute { dispute: boxoffice_payments::Dispute },
    /// A refund went through, now or before (a refund refused because the charge was already
    /// refunded in full); `amount_minor` is everything refunded on the charge, minor units.
    Refunded { payment_intent_id: String, amount_minor: i64 },
    /// The PaymentIntent as Stripe reports it now (a refresh), with its charge's refunded
    /// amount in minor units.
    Observed {
        /// The PaymentIntent.
        intent: PaymentIntent,
        /// Refunded on its charge, minor units.
        amount_refunded_minor: i64,
        /// While authorized: the charge's capture deadline (`payment_method_details.card.
        /// capture_before`), when Stripe states one.
        capture_before: Option<chrono::DateTime<chrono::Utc>>,
        /// The pre-check's time ([`payments::Precheck::read_at`]), before the provider was
        /// asked: claims counted before it are covered ([`stripe_events::finish_refetch`]).
        read_at: chrono::DateTime<chrono::Utc>,
    },
}

impl PaymentWorker {
    /// The order's PaymentIntent for authorization request `ask` (a command, or a
    /// `HoldCreated` that is the request), under `authorize:{event_id}` of `env`.
    async fn create_intent(
        &self,
        env: &Envelope,
        ask: boxoffice_domain::AuthorizationAsk<'_>,
        pre: &payments::Precheck,
    ) -> Result<Prepared, HandlerError> {
        let boxoffice_domain::AuthorizationAsk { order_id, hold_id, amount_minor, currency } = ask;
        // Only an order still waiting for its PaymentIntent (`held`, no payment row)
        // gets one: an order has at most one payment row, so an intent created for an
        // order that has one could never be recorded (a second authorization request
        // for one order — an older writer's, a replayed or forged one — creates
        // nothing).
        if pre.order_status != Some(OrderStatus::Held) || pre.payment.is_some() {
            return Ok(Prepared::Skipped(NOT_AWAITING_PAYMENT_INTENT));
        }
        // A message is a claim: the amount asked for is the order's, as the hold transaction
        // wrote it (a forged or corrupt request for another amount creates nothing) ...
        if pre.order_amount.as_ref().is_none_or(|(amount, cur)| *amount != amount_minor || cur != currency) {
            return Ok(Prepared::Skipped(AMOUNT_DIFFERS_FROM_ORDER));
        }
        // ... and the hold it names is the order's (the intent's metadata carries it to the
        // provider's dashboard and to reconciliation).
        if pre.hold_id != Some(hold_id) {
            return Ok(Prepared::Skipped(HOLD_DIFFERS_FROM_ORDER));
        }
        let req = CreatePaymentIntent {
            amount_minor,
            currency: currency.to_owned(),
            metadata: [("order_id".into(), order_id.to_string()), ("hold_id".into(), hold_id.to_string())]
                .into_iter()
                .chain(self.cell.clone().map(|c| ("purchase_cell".into(), c)))
                // The fact's region and epoch, not this worker's: a request replayed by
                // the promoted region after a failover must send the same parameters
                // under the same idempotency key, and reconciliation finds intents
                // requested by a fenced writer by them (design §15).
                .chain(env.region.clone().map(|r| ("region".into(), r)))
                .chain(env.region_epoch.map(|e| ("region_epoch".into(), e.to_string())))
                // The fact's stored trace context, byte for byte (never this worker's
                // span, which differs on every retry under this same idempotency key):
                // the intent's webhooks join the purchase's trace from it (design §16).
                .chain(env.traceparent.clone().map(|t| (boxoffice_trace::TRACEPARENT.into(), t)))
                .collect(),
        };
        let pi = self
            .gateway
            .create_payment_intent(&req, &format!("authorize:{}", env.event_id))
            .await
            .map_err(stripe_err)?;
        Ok(Prepared::Intent(pi))
    }

    /// A re-fetch of PaymentIntent `payment_intent_id`, claimed to be `order`'s, with what its
    /// charge adds; refuted when the provider does not know it or it is someone else's.
    async fn refresh_intent(
        &self,
        order: OrderId,
        payment_intent_id: &str,
        reason: &str,
        recorded: Option<payments::PaymentRow>,
        read_at: chrono::DateTime<chrono::Utc>,
    ) -> Result<Prepared, HandlerError> {
        let g = &*self.gateway;
        // `recorded`: the ledger's payment row, read before the provider is asked (it is
        // written once, by the intent's creation).
        // A capture claimed while the saga's capture was outstanding, recorded since from
        // the provider's answer to the capture call: nothing to ask.
        if reason == refresh_reason::CAPTURE_OUTSTANDING
            && recorded.as_ref().is_some_and(|p| {
                boxoffice_domain::events::capture_claim_recorded(
                    &p.payment_intent_id,
                    &p.status,
                    payment_intent_id,
                )
            })
        {
            return Ok(Prepared::Skipped(CAPTURE_RECORDED));
        }
        let pi = match g.retrieve_payment_intent(payment_intent_id).await {
            Ok(pi) => pi,
            Err(e) if e.status() == Some(404) => {
                return Ok(Prepared::Refuted {
                    payment_intent_id: payment_intent_id.to_owned(),
                    why: "unknown_payment_intent",
                    read_at: Some(read_at),
                })
            }
            Err(e) => return Err(stripe_err(e)),
        };
        // The intent must be the order's: the one the ledger recorded for it, or one whose
        // metadata (the provider's copy) names it and that the ledger records for no other
        // order; otherwise the claim is about someone else's money.
        let recorded_here = recorded.is_some_and(|p| p.payment_intent_id == pi.id);
        let mut ours = recorded_here || pi.metadata.get("order_id") == Some(&order.to_string());
        if ours && !recorded_here {
            // Metadata can be edited at the provider: an intent the ledger records for
            // another order is that order's, whatever its metadata says now.
            ours = payments::order_for_intent(&self.pool, &pi.id).await?.is_none_or(|owner| owner == order);
        }
        if !ours {
            return Ok(Prepared::Refuted {
                payment_intent_id: payment_intent_id.to_owned(),
                why: "payment_intent_of_another_order",
                read_at: Some(read_at),
            });
        }
        // The charge holds what the PaymentIntent does not: refunds, and the authorization's
        // real capture deadline (Stripe: "Place a hold on a payment method", `capture_before`),
        // which the saga stores instead of the default.
        let (refunded, capture_before) = match (&pi.status, &pi.latest_charge) {
            (PaymentIntentStatus::Succeeded, Some(charge)) => {
                (g.retrieve_charge(charge).await.map_err(stripe_err)?.amount_refunded, None)
            }
            (PaymentIntentStatus::RequiresCapture, Some(charge)) => {
                let c = g.retrieve_charge(charge).await.map_err(stripe_err)?;
                (0, c.capture_before().and_then(|t| chrono::DateTime::from_timestamp(t, 0)))
            }
            _ => (0, None),
        };
        Ok(Prepared::Observed { intent: pi, amount_refunded_minor: refunded, capture_before, read_at })
    }

    /// A re-fetch of dispute `dispute_id`, claimed to be of `order`'s recorded PaymentIntent
    /// `payment_intent_id`; refuted when the provider does not know it or it is another's.
    async fn refresh_dispute(
        &self,
        payment_intent_id: &str,
        dispute_id: &str,
        recorded: Option<payments::PaymentRow>,
    ) -> Result<Prepared, HandlerError> {
        let refuted = |why| {
            Ok(Prepared::Refuted { payment_intent_id: payment_intent_id.to_owned(), why, read_at: None })
        };
        // Only a dispute of the PaymentIntent the ledger records for the order is acted on:
        // a claim naming another is refuted without a call.
        if recorded.as_ref().is_none_or(|p| p.payment_intent_id != payment_intent_id) {
            return refuted("dispute_of_another_payment");
        }
        let dispute = match self.gateway.retrieve_dispute(dispute_id).await {
            Ok(d) => d,
            Err(e) if e.status() == Some(404) => return refuted("unknown_dispute"),
            Err(e) => return Err(stripe_err(e)),
        };
        if dispute.payment_intent.as_deref() != Some(payment_intent_id) {
            return refuted("dispute_of_another_payment");
        }
        Ok(Prepared::ObservedDispute { dispute })
    }
}

/// The captured (`amount_received`) and refunded (its charge's `amount_refunded`) amounts of
/// PaymentIntent `id` at the provider, minor units; (0, 0) for an intent never captured.
async fn refunded_so_far(g: &dyn PaymentGateway, id: &str) -> Result<(i64, i64), HandlerError> {
    let pi = g.retrieve_payment_intent(id).await.map_err(stripe_err)?;
    match (&pi.status, &pi.latest_charge) {
        (PaymentIntentStatus::Succeeded, Some(charge)) => {
            let charge = g.retrieve_charge(charge).await.map_err(stripe_err)?;
            Ok((pi.amount_received, charge.amount_refunded))
        }
        _ => Ok((pi.amount_received, 0)),
    }
}

fn stripe_err(e: StripeError) -> HandlerError {
    if e.is_retryable() {
        HandlerError::Transient(e.into())
    } else {
        HandlerError::permanent("stripe_rejected", e)
    }
}

#[async_trait]
impl Handler for PaymentWorker {
    type Prepared = Prepared;

    fn name(&self) -> &'static str {
        NAME
    }

    fn calls_out(&self) -> bool {
        true
    }

    /// A message on the purchase topic that is no envelope is the saga's group's to
    /// dead-letter (one copy, not one per group).
    fn dead_letters_unreadable(&self) -> bool {
        false
    }

    /// Every command is acted on only when this ledger wrote it (the hold, the saga, the
    /// webhooks, the sweeps, `reconcile --fix`): one on the bus that it did not is parked as an
    /// `unknown_fact` incident before any call, so a message written to the topic by anyone
    /// else refunds, cancels and captures nothing, and one that borrows a real command's id
    /// (to be refused and take its inbox row) leaves that id to the real command.
    fn verifies(&self, _event: &PurchaseEvent) -> bool {
        true
    }

    fn applied(&self, pre: &payments::Precheck) -> Option<bool> {
        Some(pre.applied)
    }

    fn wants(&self, kind: EventKind) -> bool {
        COMMANDS.contains(&kind) || REQUESTING_FACTS.contains(&kind)
    }

    /// Every command; a `HoldCreated` only when it is its order's authorization request, an
    /// `OrderConfirmed` only when it is its order's capture request (one written beside a
    /// `PaymentAuthorizationRequested` or `CaptureRequested` is acted on through the command).
    fn acts_on(&self, event: &PurchaseEvent) -> bool {
        match event {
            PurchaseEvent::HoldCreated { .. } => event.authorization_request().is_some(),
            PurchaseEvent::OrderConfirmed { .. } => event.capture_request().is_some(),
            _ => true,
        }
    }

    type Precheck = payments::Precheck;

    /// Every command's pre-check, for a lane's whole batch in one statement
    /// ([`payments::prechecks`]): whether it is in the inbox already, and the order, hold and
    /// payment it is about.
    async fn precheck(
        &self,
        run: &[(&Envelope, &PurchaseEvent)],
    ) -> Result<Vec<payments::Precheck>, HandlerError> {
        let commands: Vec<(OrderId, uuid::Uuid)> =
            run.iter().map(|(env, event)| (event.order_id(), env.event_id)).collect();
        Ok(payments::prechecks(&self.pool, NAME, &commands).await?)
    }

    async fn prepare(
        &self,
        env: &Envelope,
        event: &PurchaseEvent,
        pre: payments::Precheck,
    ) -> Result<Prepared, HandlerError> {
        let g = &*self.gateway;
        // Every command's pre-check read the inbox before any remote call
        // (`Handler::applied`): the runner prepares no known duplicate; this guards a direct
        // call.
        if pre.applied {
            return Ok(Prepared::Skipped(ALREADY_APPLIED));
        }
        // A command that decides on the order's or hold's status fails alone on a status this
        // build does not know (a newer writer's): retried, then dead-lettered without an inbox
        // row, so the upgraded worker can be given it again; never skipped as done.
        let authorization = event.authorization_request();
        let capture = event.capture_request();
        let decides_on_status = authorization.is_some() || capture.is_some();
        if let Some(status) = pre.unknown_status.as_ref().filter(|_| decides_on_status) {
            return Err(HandlerError::permanent(
                "corrupt_row",
                anyhow::anyhow!("order {} has a status this build does not know: {status}", event.order_id()),
            ));
        }
        if let Some(ask) = authorization {
            return self.create_intent(env, ask, &pre).await;
        }
        if let Some(boxoffice_domain::CaptureAsk { order_id, payment_intent_id, amount_minor }) = capture {
            // Case C06: never capture without a confirmed hold.
            if (pre.order_status, pre.hold_status)
                != (Some(OrderStatus::Confirming), Some(HoldStatus::Confirmed))
            {
                return Ok(Prepared::Skipped(HOLD_NOT_CONFIRMED));
            }
            // A message is a claim: the amount is the order's total (the capture takes the
            // whole authorization, so another amount is a forged or corrupt request) ...
            if pre.order_amount.as_ref().is_none_or(|(amount, _)| *amount != amount_minor) {
                return Ok(Prepared::Skipped(AMOUNT_DIFFERS_FROM_ORDER));
            }
            // ... and the PaymentIntent is the order's: the one its payment row records, or,
            // where the ledger has none (lost with a fenced region's unreplicated commits,
            // design §15, while the saga confirmed the order on the provider's word), one the
            // provider says was made for this order.
            match &pre.payment {
                Some(p) if p.payment_intent_id != payment_intent_id => {
                    return Ok(Prepared::Skipped(INTENT_DIFFERS_FROM_ORDER));
                }
                Some(_) => {}
                None => match g.retrieve_payment_intent(payment_intent_id).await {
                    Ok(pi) if pi.metadata.get("order_id") == Some(&order_id.to_string()) => {}
                    Ok(_) => return Ok(Prepared::Skipped(INTENT_DIFFERS_FROM_ORDER)),
                    Err(e) if e.status() == Some(404) => {
                        return Ok(Prepared::Skipped(INTENT_DIFFERS_FROM_ORDER))
                    }
                    Err(e) => return Err(stripe_err(e)),
                },
            }
            // One key per order, whichever message asked (a `CaptureRequested` or an
            // `OrderConfirmed` that is the request): two requests of one order are one capture.
            return match g.capture_payment_intent(payment_intent_id, &format!("capture:{order_id}")).await {
                Ok(pi) => Ok(Prepared::Intent(pi)),
                Err(e) if !e.is_retryable() && matches!(e, StripeError::Api { .. }) => {
                    // Already captured or no longer capturable: ask Stripe what is true.
                    let pi = g.retrieve_payment_intent(payment_intent_id).await.map_err(stripe_err)?;
                    if pi.status == PaymentIntentStatus::Succeeded {
                        Ok(Prepared::Intent(pi))
                    } else {
                        Ok(Prepared::CaptureRefused {
                            payment_intent_id: payment_intent_id.to_owned(),
                            reason: e.code().unwrap_or("capture_failed").to_owned(),
                            intent: Some(pi),
                        })
                    }
                }
                Err(e) => Err(stripe_err(e)),
            };
        }
        match event {
            PurchaseEvent::AuthorizationCancelRequested { payment_intent_id, .. } => {
                // One key per PaymentIntent, not per order: an order may have a stale
                // authorization to cancel besides its own, and a key reused with another
                // intent is refused by Stripe (invariant 6).
                match g.cancel_payment_intent(payment_intent_id, &format!("cancel:{payment_intent_id}")).await
                {
                    Ok(pi) => Ok(Prepared::Intent(pi)),
                    Err(e) if !e.is_retryable() && matches!(e, StripeError::Api { .. }) => {
                        let pi = g.retrieve_payment_intent(payment_intent_id).await.map_err(stripe_err)?;
                        Ok(Prepared::Intent(pi))
                    }
                    Err(e) => Err(stripe_err(e)),
                }
            }
            PurchaseEvent::RefundRequested { order_id, payment_intent_id, .. } => {
                // One key per PaymentIntent, as for a cancel: an order may have a stray
                // capture to refund besides its own. A refund first sent under another key
                // and retried under this one finds the charge refunded: recorded as done.
                let meta = vec![("order_id".to_owned(), order_id.to_string())];
                let (refused, this_refund) = match g
                    .create_refund(payment_intent_id, &meta, &format!("refund:{payment_intent_id}"))
                    .await
                {
                    Ok(refund) => (None, refund.amount),
                    // Already refunded (from the dashboard, or by a refund under another
                    // key) or not refundable: ask Stripe what is true.
                    Err(e) if !e.is_retryable() && matches!(e, StripeError::Api { .. }) => (Some(e), 0),
                    Err(e) => return Err(stripe_err(e)),
                };
                // What the fact reports is the charge's whole refunded amount, as a re-fetch
                // reports it, not this refund's: after a partial refund at the provider this
                // refund returns only the rest.
                let (received, refunded) = refunded_so_far(g, payment_intent_id).await?;
                match refused {
                    Some(e) if refunded == 0 || refunded < received => Err(stripe_err(e)),
                    _ => Ok(Prepared::Refunded {
                        payment_intent_id: payment_intent_id.clone(),
                        amount_minor: refunded.max(this_refund),
                    }),
                }
            }
            PurchaseEvent::PaymentIntentRefreshRequested { order_id, payment_intent_id, reason } => {
                self.refresh_intent(*order_id, payment_intent_id, reason, pre.payment, pre.read_at).await
            }
            PurchaseEvent::DisputeRefreshRequested { payment_intent_id, dispute_id, .. } => {
                self.refresh_dispute(payment_intent_id, dispute_id, pre.payment).await
            }
            _ => Ok(Prepared::Skipped(NOT_A_PAYMENT_COMMAND)),
        }
    }

    /// What [`Handler::lock_rows`] did for the command: whether its order's hold is locked in
    /// the transaction already, and a re-fetch's payment row as read then ([`Locked`]).
    type Rows = Locked;

    /// The holds locked in one statement in ascending order id
    /// ([`holds::lock_all_for_orders`]), before any effect of `run`: the first lock each
    /// effect takes, as [`holds::lock_for_order`] would one by one. A lock is kept to the
    /// commit, so a second command of an order finds it held too.
    ///
    /// Which holds: those of the commands that write the payment row after their provider
    /// call (an authorization request, a capture, a cancel), and, when `run` holds more than
    /// one command (a batch, one command per order), those of every command. A PaymentIntent
    /// re-fetch may write its order's hold (case C19), and a refund or a re-fetch of either
    /// kind may emit a fact the saga follows (`PaymentRefunded`, `PaymentDisputed`, …), which
    /// locks the hold and the order: locked up front, those locks keep the batch's ascending
    /// order id, where taken by the effect they would come after the locks of higher order
    /// ids. A refund or re-fetch processed alone has no other order's lock to keep in order:
    /// its effect locks what it writes.
    ///
    /// Then, in one more statement, the payment rows of the re-fetches' orders
    /// ([`payments::get_all`]), which their effects compare the provider's answer with: read
    /// after the holds' locks, as each effect would read its own, and changed by no other
    /// effect of `run` (one command per order; a second command of an order reads its own).
    async fn lock_rows(
        &self,
        tx: &mut Tx<'_>,
        run: &[(&Envelope, &PurchaseEvent)],
    ) -> Result<Vec<Locked>, HandlerError> {
        let batch = run.len() > 1;
        let locks = |event: &PurchaseEvent| {
            batch
                || event.authorization_request().is_some()
                || event.capture_request().is_some()
                || matches!(event, PurchaseEvent::AuthorizationCancelRequested { .. })
        };
        let mut orders: Vec<OrderId> =
            run.iter().filter(|(_, event)| locks(event)).map(|(_, event)| event.order_id()).collect();
        orders.sort();
        orders.dedup();
        let locked: HashSet<uuid::Uuid> =
            holds::lock_all_for_orders(tx, &orders).await?.into_iter().collect();
        let refetches = |event: &PurchaseEvent| {
            matches!(
                event,
                PurchaseEvent::PaymentIntentRefreshRequested { .. }
                    | PurchaseEvent::DisputeRefreshRequested { .. }
            )
        };
        let mut once = HashSet::new();
        let first: Vec<bool> = run.iter().map(|(_, event)| once.insert(event.order_id())).collect();
        let reading: Vec<OrderId> = run
            .iter()
            .zip(&first)
            .filter(|((_, event), first)| **first && refetches(event))
            .map(|((_, event), _)| event.order_id())
            .collect();
        let mut payments: HashMap<uuid::Uuid, payments::PaymentRow> =
            payments::get_all(&mut **tx, &reading).await?.into_iter().map(|p| (p.order_id, p)).collect();
        Ok(run
            .iter()
            .zip(first)
            .map(|((_, event), first)| Locked {
                hold: locks(event) && locked.contains(&event.order_id().0),
                payment: (first && refetches(event)).then(|| payments.remove(&event.order_id().0)),
            })
            .collect())
    }

    async fn apply(
        &self,
        tx: &mut Tx<'_>,
        env: &Envelope,
        event: &PurchaseEvent,
        prepared: Prepared,
        rows: Locked,
    ) -> Result<Vec<Envelope>, HandlerError> {
        let order_id = event.order_id();
        let hold_locked = rows.hold;
        let mut emit = Vec::new();
        // An authorization request's new PaymentIntent (a command, or a `HoldCreated` that is
        // the request).
        if let (Some(ask), Prepared::Intent(pi)) = (event.authorization_request(), &prepared) {
            let facts =
                record_created(tx, order_id, hold_locked, pi, ask.amount_minor, ask.currency, &self.policy)
                    .await?;
            return Ok(facts.iter().map(|e| env.follow(e)).collect());
        }
        match (event, prepared) {
            (_, Prepared::Refuted { payment_intent_id, why, read_at }) => {
                record_refuted(tx, order_id, &payment_intent_id, why).await?;
                if let Some(read_at) = read_at {
                    emit.extend(end_refetch(tx, order_id, &payment_intent_id, read_at).await?.follow_up());
                }
            }
            (_, Prepared::Skipped(why)) => {
                metrics::counter!("boxoffice_payment_commands_skipped_total", "reason" => why).increment(1);
                if ROUTINE_SKIPS.contains(&why) {
                    tracing::debug!(order.id = %order_id, event.type = %env.event_type, reason = why, "payment command skipped");
                } else {
                    tracing::warn!(order.id = %order_id, event.type = %env.event_type, reason = why, "payment command skipped");
                }
            }
            (event, Prepared::Intent(pi))
                if event.capture_request().is_some()
                    || matches!(event, PurchaseEvent::AuthorizationCancelRequested { .. }) =>
            {
                emit.extend(facts_from_intent(tx, order_id, hold_locked, &pi).await?);
            }
            (event, Prepared::CaptureRefused { payment_intent_id, reason, intent })
                if event.capture_request().is_some() =>
            {
                // The hold first, as everywhere this worker writes the payment row: the saga
                // may follow CaptureFailed through here and lock the hold and the order next.
                lock_hold(tx, order_id, hold_locked).await?;
                if let Some(pi) = &intent {
                    let update = PaymentUpdate {
                        last_error_code: Some(reason.clone()),
                        ..PaymentUpdate::status(pi.status.clone())
                    };
                    payments::transition(tx, &pi.id, &update).await?;
                }
                emit.push(PurchaseEvent::CaptureFailed { order_id, payment_intent_id, reason });
            }
            (
                PurchaseEvent::RefundRequested { .. },
                Prepared::Refunded { payment_intent_id, amount_minor },
            ) if payments::get(&mut **tx, order_id).await?.is_none() => {
                lost_order_compensated(tx, order_id, &payment_intent_id, format!("refunded {amount_minor}"))
                    .await?;
            }
            (
                PurchaseEvent::RefundRequested { .. },
                Prepared::Refunded { payment_intent_id, amount_minor },
            ) => {
                emit.push(PurchaseEvent::PaymentRefunded {
                    order_id,
                    payment_intent_id,
                    amount_refunded_minor: amount_minor,
                });
            }
            (
                PurchaseEvent::PaymentIntentRefreshRequested { reason, payment_intent_id, .. },
                Prepared::Observed { intent: pi, amount_refunded_minor, capture_before, read_at },
            ) => {
                tracing::info!(order.id = %order_id, payment_intent.status = %pi.status, reason = %reason,
                    "PaymentIntent re-fetched");
                metrics::counter!("boxoffice_payment_intent_refreshes_total").increment(1);
                // Claims counted since this re-fetch read the ledger (before its call) may report
                // what its answer predates: they get one more re-fetch, within its budget.
                let ended = end_refetch(tx, order_id, payment_intent_id, read_at).await?;
                let local = rows.payment_or_read(tx, order_id).await?;
                if local.as_ref().is_some_and(|p| p.payment_intent_id == pi.id) {
                    // Case C19: the provider's word on the order's current PaymentIntent
                    // decides whether its live hold waits for the saga.
                    match pi.status {
                        PaymentIntentStatus::RequiresCapture => {
                            holds::protect_authorized(
                                tx,
                                order_id,
                                &self.policy,
                                holds::Report::Provider { capture_before },
                            )
                            .await?;
                        }
                        PaymentIntentStatus::Succeeded => {}
                        // Not authorized when the provider was read, but an authorization
                        // claimed since may be newer than this answer (the buyer paid during
                        // the call): its protection, and rule 3's wait, stand until the
                        // re-fetch asked once more has spoken.
                        _ if matches!(ended, Ended::FollowUp(_)) => {}
                        // Every claim covered by this answer; or claims past the follow-ups'
                        // budget, which no re-fetch will check, so they protect nothing (as a
                        // claim past the claims' budget does not).
                        _ => {
                            holds::clear_protection(tx, order_id).await?;
                            // Rule 3: not authorized, so a hold waiting for this answer lapses.
                            holds::end_provider_check(tx, order_id).await?;
                        }
                    }
                }
                emit.extend(
                    observed_facts(order_id, &pi, amount_refunded_minor, capture_before)
                        .into_iter()
                        .filter(|f| is_news(local.as_ref(), f)),
                );
                emit.extend(ended.follow_up());
            }
            (
                PurchaseEvent::DisputeRefreshRequested { payment_intent_id, .. },
                Prepared::ObservedDispute { dispute },
            ) => {
                let local = rows.payment_or_read(tx, order_id).await?;
                if local.and_then(|p| p.dispute_status).as_deref() != Some(dispute.status.as_str()) {
                    emit.push(PurchaseEvent::PaymentDisputed {
                        order_id,
                        payment_intent_id: payment_intent_id.clone(),
                        dispute_id: dispute.id,
                        status: dispute.status,
                    });
                }
            }
            (e, p) => {
                return Err(HandlerError::permanent("unexpected_outcome", anyhow::anyhow!("{e:?} -> {p:?}")));
            }
        }
        Ok(emit.iter().map(|e| env.follow(e)).collect())
    }
}

/// What [`PaymentWorker`]'s `lock_rows` did for one command, for its `apply`. The default
/// (nothing locked, nothing read) makes `apply` lock and read what it needs itself.
#[derive(Debug, Default)]
pub struct Locked {
    /// Whether the order's hold is locked in the transaction already; `false`: `apply` locks
    /// it itself where it writes.
    hold: bool,
    /// For a re-fetch, its order's payment row as read after the locks (`Some(None)`: no
    /// row recorded); `None`: not read, `apply` reads it.
    payment: Option<Option<payments::PaymentRow>>,
}

impl Locked {
    /// The order's payment row: as `lock_rows` read it, else read now in `tx`.
    async fn payment_or_read(
        self,
        tx: &mut Tx<'_>,
        order_id: OrderId,
    ) -> Result<Option<payments::PaymentRow>, sqlx::Error> {
        match self.payment {
            Some(read) => Ok(read),
            None => payments::get(&mut **tx, order_id).await,
        }
    }
}

/// Records a newly created PaymentIntent and emits `PaymentIntentCreated` (once); webhooks that
/// overtook the row were kept as pending, and are re-derived from Stripe rather than lost.
async fn record_created(
    tx: &mut Tx<'_>,
    order_id: OrderId,
    hold_locked: bool,
    pi: &PaymentIntent,
    amount_minor: i64,
    currency: &str,
    policy: &HoldPolicy,
) -> Result<Vec<PurchaseEvent>, HandlerError> {
    // The hold first (the saga's lock order: hold, then order; the payment row's foreign key
    // share-locks the order).
    lock_hold(tx, order_id, hold_locked).await?;
    // The payment row, and when it is new the payment window (case C19: payable from this
    // commit on, the buyer is owed the whole window) and the webhooks that overtook it, in
    // one statement.
    let created = payments::record_created(
        tx,
        order_id,
        &pi.id,
        pi.client_secret.as_deref(),
        pi.status.clone(),
        amount_minor,
        currency,
        policy,
    )
    .await?;
    let mut emit = vec![];
    if let payments::Created::Recorded { early_webhooks } = created {
        emit.push(PurchaseEvent::PaymentIntentCreated {
            order_id,
            payment_intent_id: pi.id.clone(),
            status: pi.status.clone(),
        });
        if early_webhooks > 0 {
            emit.push(PurchaseEvent::PaymentIntentRefreshRequested {
                order_id,
                payment_intent_id: pi.id.clone(),
                reason: boxoffice_domain::events::refresh_reason::EARLY_WEBHOOK.into(),
            });
        }
    }
    Ok(emit)
}

/// The provider contradicts a claim: nothing is acted on; an incident and a metric say so.
async fn record_refuted(
    tx: &mut Tx<'_>,
    order_id: OrderId,
    payment_intent_id: &str,
    why: &'static str,
) -> Result<(), HandlerError> {
    tracing::warn!(order.id = %order_id, stripe.payment_intent = %payment_intent_id, reason = why,
        "the provider refutes a webhook's claim; nothing acted on");
    metrics::counter!("boxoffice_webhook_claims_refuted_total", "reason" => why).increment(1);
    stripe_events::incident(
        tx,
        Some(order_id),
        "webhook_claim_refuted",
        serde_json::json!({ "payment_intent_id": payment_intent_id, "reason": why }),
    )
    .await?;
    Ok(())
}

/// How a re-fetch ended its pending re-fetch ([`end_refetch`]).
enum Ended {
    /// Every claim it stands for arrived before its read (or none is pending).
    Covered,
    /// Claims were counted at or after its read: one more re-fetch is asked
    /// ([`refresh_reason::CLAIMED_DURING_REFETCH`]).
    FollowUp(PurchaseEvent),
    /// Claims were counted at or after its read, but the follow-ups' budget
    /// ([`stripe_events::FOLLOW_UPS_PER_PAYMENT_INTENT`]) is spent: no re-fetch will check
    /// them, so they protect nothing (an authorization among them is found by the hold's
    /// provider check at its end, or by reconciliation).
    ClaimsLeft,
}

impl Ended {
    /// The follow-up re-fetch to emit, if any.
    fn follow_up(self) -> Option<PurchaseEvent> {
        match self {
            Ended::FollowUp(e) => Some(e),
            Ended::Covered | Ended::ClaimsLeft => None,
        }
    }
}

/// Ends the pending re-fetch of PaymentIntent `payment_intent_id` for order `order_id`
/// (migrations 0033, 0034, 0036) in the transaction that records what the provider said about
/// it, whose pre-check read the ledger at `read_at`: when webhook claims were counted at or
/// after that time, which this re-fetch may predate ([`stripe_events::finish_refetch`]), one
/// more `PaymentIntentRefreshRequested` (reason [`refresh_reason::CLAIMED_DURING_REFETCH`])
/// within the follow-ups' budget ([`stripe_events::spend_follow_up`]), else none.
async fn end_refetch(
    tx: &mut Tx<'_>,
    order_id: OrderId,
    payment_intent_id: &str,
    read_at: chrono::DateTime<chrono::Utc>,
) -> Result<Ended, sqlx::Error> {
    if !stripe_events::finish_refetch(tx, payment_intent_id, order_id, read_at).await? {
        return Ok(Ended::Covered);
    }
    if !stripe_events::spend_follow_up(tx, payment_intent_id, order_id).await? {
        // Nothing pending any more: a later claim asks within the claims' budget, or is left
        // and protects nothing, instead of counting on a re-fetch that will not come.
        stripe_events::drop_pending_refetch(tx, payment_intent_id, order_id).await?;
        return Ok(Ended::ClaimsLeft);
    }
    Ok(Ended::FollowUp(PurchaseEvent::PaymentIntentRefreshRequested {
        order_id,
        payment_intent_id: payment_intent_id.to_owned(),
        reason: refresh_reason::CLAIMED_DURING_REFETCH.to_owned(),
    }))
}

/// Locks the hold of `order` unless `locked` says the command's `lock_rows` did.
async fn lock_hold(tx: &mut Tx<'_>, order_id: OrderId, locked: bool) -> Result<(), sqlx::Error> {
    if !locked {
        holds::lock_for_order(tx, order_id).await?;
    }
    Ok(())
}

/// Turns the provider's view of a PaymentIntent into the fact the saga needs.
async fn facts_from_intent(
    tx: &mut Tx<'_>,
    order_id: OrderId,
    hold_locked: bool,
    pi: &PaymentIntent,
) -> Result<Vec<PurchaseEvent>, HandlerError> {
    // The hold first, the ledger's lock order (hold, order, payment): the saga may follow
    // this fact through in this transaction (boxoffice_bus::follow) and lock the hold next.
    lock_hold(tx, order_id, hold_locked).await?;
    if !payments::transition(tx, &pi.id, &PaymentUpdate::status(pi.status.clone())).await?
        && payments::get(&mut **tx, order_id).await?.is_none()
    {
        lost_order_compensated(tx, order_id, &pi.id, pi.status.to_string()).await?;
        return Ok(vec![]);
    }
    Ok(match pi.status {
        PaymentIntentStatus::Succeeded => vec![PurchaseEvent::PaymentCaptured {
            order_id,
            payment_intent_id: pi.id.clone(),
            amount_captured_minor: pi.amount_received,
        }],
        PaymentIntentStatus::Canceled => {
            vec![PurchaseEvent::PaymentCanceled { order_id, payment_intent_id: pi.id.clone() }]
        }
        _ => vec![],
    })
}

/// A compensation carried out for an order this ledger does not have (reconciliation found a
/// PaymentIntent a fenced region writer requested for an order lost in a failover, design
/// §15): no fact follows (no saga step exists for it), an incident records it.
async fn lost_order_compensated(
    tx: &mut Tx<'_>,
    order_id: OrderId,
    payment_intent_id: &str,
    outcome: String,
) -> Result<(), HandlerError> {
    tracing::warn!(order.id = %order_id, stripe.payment_intent = %payment_intent_id, %outcome,
        "compensated the PaymentIntent of an order this ledger does not have");
    stripe_events::incident(
        tx,
        Some(order_id),
        "lost_order_compensated",
        serde_json::json!({ "payment_intent_id": payment_intent_id, "outcome": outcome }),
    )
    .await?;
    Ok(())
}

/// Whether `fact`, observed at the provider, tells the ledger something its payment row does
/// not record yet. A re-fetch reports only news, so a replayed refresh (or one that raced the
/// fact it was asked to check) adds nothing to the outbox. Facts about a PaymentIntent that
/// is not the recorded one are always news (the saga cancels a stray authorization).
pub fn is_news(local: Option<&payments::PaymentRow>, fact: &PurchaseEvent) -> bool {
    let Some(p) = local.filter(|p| Some(p.payment_intent_id.as_str()) == fact.payment_intent_id()) else {
        return true;
    };
    match fact {
        PurchaseEvent::PaymentAuthorized { .. } => p.status.is_unsettled(),
        PurchaseEvent::PaymentCaptured { amount_captured_minor, .. } => {
            p.status != PaymentIntentStatus::Succeeded || p.amount_captured_minor < *amount_captured_minor
        }
        PurchaseEvent::PaymentRefunded { amount_refunded_minor, .. } => {
            p.amount_refunded_minor < *amount_refunded_minor
        }
        PurchaseEvent::PaymentCanceled { .. } => p.status != PaymentIntentStatus::Canceled,
        PurchaseEvent::PaymentFailed { reason, .. } => {
            p.status.is_unsettled() && p.last_error_code.as_deref() != Some(reason.as_str())
        }
        _ => true,
    }
}

/// Every fact a re-fetched PaymentIntent states, for the saga to act on (it ignores facts
/// the order has moved past). Amounts in minor units; `capture_before` is the authorization's
/// deadline from its charge, carried on `PaymentAuthorized` (the saga otherwise assumes
/// Stripe's default window).
pub fn observed_facts(
    order_id: OrderId,
    pi: &PaymentIntent,
    amount_refunded_minor: i64,
    capture_before: Option<chrono::DateTime<chrono::Utc>>,
) -> Vec<PurchaseEvent> {
    let payment_intent_id = pi.id.clone();
    match pi.status {
        PaymentIntentStatus::RequiresCapture => vec![PurchaseEvent::PaymentAuthorized {
            order_id,
            payment_intent_id,
            amount_capturable_minor: pi.amount_capturable,
            capture_before,
        }],
        PaymentIntentStatus::Succeeded => {
            let mut v = vec![PurchaseEvent::PaymentCaptured {
                order_id,
                payment_intent_id: payment_intent_id.clone(),
                amount_captured_minor: pi.amount_received,
            }];
            if amount_refunded_minor > 0 {
                v.push(PurchaseEvent::PaymentRefunded { order_id, payment_intent_id, amount_refunded_minor });
            }
            v
        }
        PaymentIntentStatus::Canceled => vec![PurchaseEvent::PaymentCanceled { order_id, payment_intent_id }],
        // A declined confirmation; a PaymentIntent nobody tried to pay yet states nothing.
        PaymentIntentStatus::RequiresPaymentMethod => pi
            .last_payment_error
            .as_ref()
            .map(|e| PurchaseEvent::PaymentFailed {
                order_id,
                payment_intent_id,
                reason: e
                    .get("decline_code")
                    .or_else(|| e.get("code"))
                    .and_then(|v| v.as_str())
                    .unwrap_or("payment_failed")
                    .to_owned(),
            })
            .into_iter()
            .collect(),
        _ => vec![],
    }
}
