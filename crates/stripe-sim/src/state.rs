//! The simulator's ledger: PaymentIntents, charges and refunds, and their state machine.
//!
//! Owns every object and every transition (create, confirm, capture, cancel, refund,
//! authorization expiry), and the events each transition emits. Transitions follow Stripe's
//! PaymentIntent lifecycle (<https://docs.stripe.com/payments/paymentintents/lifecycle>) and
//! manual capture rules (<https://docs.stripe.com/payments/place-a-hold-on-a-payment-method>):
//! an authorization must be captured before its charge's `capture_before` (7 days for cards),
//! after which the intent is canceled with `cancellation_reason = "automatic"`.
//!
//! Invariants: money moves at most once per transition (capture only from `requires_capture`,
//! refunds never exceed what was captured); every transition emits its events into the outbox
//! under the same lock, so no change is visible without its event queued. Callers drain the
//! outbox with [`State::take_events`] after each operation.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rand::distributions::Alphanumeric;
use rand::Rng;
use serde_json::{json, Value};

use crate::api::{ApiError, Params};
use axum::http::StatusCode;

/// The API version our objects and events are rendered in.
pub(crate) const API_VERSION: &str = "2024-06-20";
/// Card authorizations stay capturable for 7 days.
pub(crate) const AUTHORIZATION_WINDOW_S: i64 = 7 * 24 * 3600;
/// Stripe's page size bounds for list endpoints.
const LIST_MAX_LIMIT: i64 = 100;
const LIST_DEFAULT_LIMIT: i64 = 10;

/// A random Stripe-style id: `prefix_` + 24 alphanumerics.
pub(crate) fn new_id(prefix: &str) -> String {
    let suffix: String = rand::thread_rng().sample_iter(&Alphanumeric).take(24).map(char::from).collect();
    format!("{prefix}_{suffix}")
}

/// The API key a request was made with.
#[derive(Clone, Debug)]
pub(crate) enum Caller {
    Secret(String),
    Publishable(String),
}

impl Caller {
    pub fn key(&self) -> &str {
        match self {
            Caller::Secret(k) | Caller::Publishable(k) => k,
        }
    }
}

/// Everything an operation knows about the request that triggered it.
pub(crate) struct Ctx {
    pub caller: Caller,
    pub params: Params,
    pub now: i64,
    /// `req_…`, echoed as `Request-Id` and in `event.request.id`.
    pub request_id: String,
    pub idempotency_key: Option<String>,
}

/// Test payment methods (<https://docs.stripe.com/testing#cards>).
enum TestCard {
    Approve { brand: &'static str, last4: &'static str },
    Decline { decline_code: &'static str, message: &'static str },
}

fn test_card(pm: &str) -> Option<TestCard> {
    Some(match pm {
        "pm_card_visa" => TestCard::Approve { brand: "visa", last4: "4242" },
        "pm_card_mastercard" => TestCard::Approve { brand: "mastercard", last4: "4444" },
        "pm_card_chargeDeclined" => {
            TestCard::Decline { decline_code: "generic_decline", message: "Your card was declined." }
        }
        "pm_card_chargeDeclinedInsufficientFunds" => TestCard::Decline {
            decline_code: "insufficient_funds",
            message: "Your card has insufficient funds.",
        },
        _ => return None,
    })
}

struct PaymentIntent {
    id: String,
    client_secret: String,
    amount: i64,
    amount_capturable: i64,
    amount_received: i64,
    currency: String,
    capture_method: String,
    status: &'static str,
    metadata: BTreeMap<String, String>,
    created: i64,
    latest_charge: Option<String>,
    last_payment_error: Option<Value>,
    cancellation_reason: Option<String>,
    canceled_at: Option<i64>,
    payment_method: Option<String>,
    automatic_payment_methods: bool,
    description: Option<String>,
}

impl PaymentIntent {
    fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "object": "payment_intent",
            "amount": self.amount,
            "amount_capturable": self.amount_capturable,
            "amount_received": self.amount_received,
            "automatic_payment_methods": self.automatic_payment_methods.then(|| json!({"allow_redirects": "always", "enabled": true})),
            "canceled_at": self.canceled_at,
            "cancellation_reason": self.cancellation_reason,
            "capture_method": self.capture_method,
            "client_secret": self.client_secret,
            "confirmation_method": "automatic",
            "created": self.created,
            "currency": self.currency,
            "description": self.description,
            "last_payment_error": self.last_payment_error,
            "latest_charge": self.latest_charge,
            "livemode": false,
            "metadata": self.metadata,
            "next_action": null,
            "payment_method": self.payment_method,
            "payment_method_types": ["card"],
            "status": self.status,
        })
    }

    fn is_confirmable(&self) -> bool {
        matches!(self.status, "requires_payment_method" | "requires_confirmation" | "requires_action")
    }
}

struct Charge {
    id: String,
    payment_intent: String,
    amount: i64,
    amount_captured: i64,
    amount_refunded: i64,
    captured: bool,
    currency: String,
    created: i64,
    failure: Option<(&'static str, &'static str)>,
    payment_method: String,
    brand: &'static str,
    last4: &'static str,
    capture_before: Option<i64>,
    metadata: BTreeMap<String, String>,
    /// Whether a dispute was ever opened against the charge (Stripe's `disputed`).
    disputed: bool,
}

impl Charge {
    fn to_json(&self) -> Value {
        let card = json!({
            "brand": self.brand,
            "last4": self.last4,
            "exp_month": 12,
            "exp_year": 2034,
            "funding": "credit",
            "capture_before": self.capture_before,
        });
        json!({
            "id": self.id,
            "object": "charge",
            "amount": self.amount,
            "amount_captured": self.amount_captured,
            "amount_refunded": self.amount_refunded,
            "captured": self.captured,
            "created": self.created,
            "disputed": self.disputed,
            "currency": self.currency,
            "failure_code": self.failure.map(|_| "card_declined"),
            "failure_message": self.failure.map(|(_, m)| m),
            "livemode": false,
            "metadata": self.metadata,
            "outcome": {
                "type": if self.failure.is_some() { "issuer_declined" } else { "authorized" },
                "reason": self.failure.map(|(d, _)| d),
            },
            "paid": self.failure.is_none(),
            "payment_intent": self.payment_intent,
            "payment_method": self.payment_method,
            "payment_method_details": { "type": "card", "card": card },
            "refunded": self.amount_refunded > 0
                && self.amount_refunded >= if self.captured { self.amount_captured } else { self.amount },
            "status": if self.failure.is_some() { "failed" } else { "succeeded" },
        })
    }
}

struct Refund {
    id: String,
    amount: i64,
    charge: String,
    payment_intent: String,
    currency: String,
    created: i64,
    metadata: BTreeMap<String, String>,
    reason: Option<String>,
}

impl Refund {
    fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "object": "refund",
            "amount": self.amount,
            "charge": self.charge,
            "created": self.created,
            "currency": self.currency,
            "metadata": self.metadata,
            "payment_intent": self.payment_intent,
            "reason": self.reason,
            "status": "succeeded",
        })
    }
}

/// A Dispute (<https://docs.stripe.com/api/disputes/object>): a chargeback the cardholder's
/// bank opened against a captured charge.
struct Dispute {
    id: String,
    amount: i64,
    charge: String,
    payment_intent: String,
    currency: String,
    created: i64,
    /// `needs_response` while open; `won` or `lost` once closed.
    status: &'static str,
}

impl Dispute {
    fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "object": "dispute",
            "amount": self.amount,
            "charge": self.charge,
            "created": self.created,
            "currency": self.currency,
            "livemode": false,
            "payment_intent": self.payment_intent,
            "reason": "fraudulent",
            "status": self.status,
        })
    }
}

/// Operation counters, read by `StripeSim::stats`.
#[derive(Default)]
pub(crate) struct Counters {
    pub payment_intents_created: u64,
    pub confirmations_succeeded: u64,
    pub confirmations_declined: u64,
    pub captures_applied: u64,
    pub cancels: u64,
    pub authorizations_expired: u64,
    pub refunds: u64,
    pub events_emitted: u64,
    pub captures_per_payment_intent: HashMap<String, u32>,
}

/// All objects plus the event outbox. Guarded by one mutex; never held across an await.
#[derive(Default)]
pub(crate) struct State {
    payment_intents: HashMap<String, PaymentIntent>,
    /// Creation order, for newest-first listing.
    pi_order: Vec<String>,
    charges: HashMap<String, Charge>,
    refunds: HashMap<String, Refund>,
    disputes: HashMap<String, Dispute>,
    /// `(capture_before, pi id)` of every intent in `requires_capture`.
    expiries: BTreeSet<(i64, String)>,
    outbox: Vec<Value>,
    pub counters: Counters,
}

impl State {
    /// Events emitted since the last call, in emission order.
    pub fn take_events(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.outbox)
    }

    fn emit(&mut self, event_type: &str, object: Value, now: i64, ctx: Option<&Ctx>) {
        let request = ctx.map(|c| json!({ "id": c.request_id, "idempotency_key": c.idempotency_key }));
        self.outbox.push(json!({
            "id": new_id("evt"),
            "object": "event",
            "api_version": API_VERSION,
            "created": now,
            "data": { "object": object },
            "livemode": false,
            "pending_webhooks": 1,
            "request": request.unwrap_or(json!({ "id": null, "idempotency_key": null })),
            "type": event_type,
        }));
        self.counters.events_emitted += 1;
    }

    /// Cancels every authorization whose `capture_before` is at or before `now`, emitting
    /// `payment_intent.canceled` (Stripe does this when an uncaptured authorization lapses).
    pub fn expire_due(&mut self, now: i64) {
        while let Some((deadline, id)) = self.expiries.first().cloned() {
            if deadline > now {
                break;
            }
            self.expiries.pop_first();
            let Some(pi) = self.payment_intents.get_mut(&id) else {
                continue;
            };
            if pi.status != "requires_capture" {
                continue;
            }
            pi.status = "canceled";
            pi.cancellation_reason = Some("automatic".into());
            pi.canceled_at = Some(deadline);
            pi.amount_capturable = 0;
            if let Some(ch) = pi.latest_charge.as_ref().and_then(|c| self.charges.get_mut(c)) {
                ch.amount_refunded = ch.amount;
            }
            let obj = pi.to_json();
            self.counters.authorizations_expired += 1;
            self.emit("payment_intent.canceled", obj, now, None);
        }
    }

    /// `POST /v1/payment_intents`.
    pub fn create_payment_intent(&mut self, ctx: &Ctx) -> Result<Value, ApiError> {
        let p = &ctx.params;
        p.only(&[
            "amount",
            "currency",
            "capture_method",
            "metadata[",
            "automatic_payment_methods[enabled]",
            "payment_method",
            "confirm",
            "description",
        ])?;
        let amount = p.int("amount")?.ok_or_else(|| ApiError::missing("amount"))?;
        if amount < 1 {
            return Err(ApiError::invalid_integer("amount"));
        }
        let currency = p.require("currency")?.to_ascii_lowercase();
        if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_lowercase()) {
            return Err(ApiError::invalid(None, "currency", format!("Invalid currency: {currency}.")));
        }
        let capture_method = p.get("capture_method").unwrap_or("automatic");
        if !matches!(capture_method, "automatic" | "automatic_async" | "manual") {
            return Err(ApiError::invalid(
                None,
                "capture_method",
                "Invalid capture_method: must be one of automatic, automatic_async, or manual",
            ));
        }
        let metadata = p.metadata()?;
        let automatic = p.bool("automatic_payment_methods[enabled]")?.unwrap_or(false);
        let confirm = p.bool("confirm")?.unwrap_or(false);
        let payment_method = p.get("payment_method").map(str::to_owned);
        if confirm && payment_method.is_none() {
            return Err(ApiError::missing("payment_method"));
        }
        let id = new_id("pi");
        let pi = PaymentIntent {
            client_secret: format!("{id}_secret_{}", &new_id("s")[2..]),
            id: id.clone(),
            amount,
            amount_capturable: 0,
            amount_received: 0,
            currency,
            capture_method: capture_method.to_owned(),
            status: if payment_method.is_some() {
                "requires_confirmation"
            } else {
                "requires_payment_method"
            },
            metadata,
            created: ctx.now,
            latest_charge: None,
            last_payment_error: None,
            cancellation_reason: None,
            canceled_at: None,
            payment_method,
            automatic_payment_methods: automatic,
            description: p.get("description").map(str::to_owned),
        };
        let obj = pi.to_json();
        self.payment_intents.insert(id.clone(), pi);
        self.pi_order.push(id.clone());
        self.counters.payment_intents_created += 1;
        self.emit("payment_intent.created", obj.clone(), ctx.now, Some(ctx));
        if confirm {
            return self.authorize(&id, ctx);
        }
        Ok(obj)
    }

    /// `GET /v1/payment_intents/{id}`; a publishable key must present the client secret.
    pub fn retrieve_payment_intent(&mut self, id: &str, ctx: &Ctx) -> Result<Value, ApiError> {
        ctx.params.only(&["client_secret"])?;
        let pi = self.payment_intents.get(id).ok_or_else(|| ApiError::no_such("payment_intent", id))?;
        check_client_secret(pi, ctx)?;
        Ok(pi.to_json())
    }

    /// `POST /v1/payment_intents/{id}/confirm`.
    pub fn confirm(&mut self, id: &str, ctx: &Ctx) -> Result<Value, ApiError> {
        ctx.params.only(&["payment_method", "client_secret"])?;
        self.authorize(id, ctx)
    }

    /// Confirmation proper, shared with `create` + `confirm=true`: runs the test card and
    /// moves the intent to `requires_capture`/`succeeded`, or back to
    /// `requires_payment_method` with a 402 on decline.
    fn authorize(&mut self, id: &str, ctx: &Ctx) -> Result<Value, ApiError> {
        let p = &ctx.params;
        let now = ctx.now;
        let pi = pi_mut(&mut self.payment_intents, id)?;
        check_client_secret(pi, ctx)?;
        if !pi.is_confirmable() {
            return Err(ApiError::unexpected_state(pi.to_json(), "confirmed", pi.status));
        }
        let Some(pm) = p.get("payment_method").map(str::to_owned).or_else(|| pi.payment_method.clone())
        else {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("payment_intent_unexpected_state"),
                "You cannot confirm this PaymentIntent because it's missing a payment method.",
            )
            .with("payment_intent", pi.to_json()));
        };
        let Some(card) = test_card(&pm) else {
            return Err(ApiError::invalid(
                Some("resource_missing"),
                "payment_method",
                format!("No such PaymentMethod: '{pm}'"),
            ));
        };
        let charge_id = new_id("ch");
        let mut charge = Charge {
            id: charge_id.clone(),
            payment_intent: pi.id.clone(),
            amount: pi.amount,
            amount_captured: 0,
            amount_refunded: 0,
            captured: false,
            currency: pi.currency.clone(),
            created: now,
            failure: None,
            payment_method: pm.clone(),
            brand: "visa",
            last4: "0002",
            capture_before: None,
            disputed: false,
            metadata: pi.metadata.clone(),
        };
        pi.latest_charge = Some(charge_id.clone());
        match card {
            TestCard::Decline { decline_code, message } => {
                charge.failure = Some((decline_code, message));
                let error = json!({
                    "type": "card_error",
                    "code": "card_declined",
                    "decline_code": decline_code,
                    "message": message,
                    "charge": charge_id,
                    "payment_method": { "id": pm, "object": "payment_method", "type": "card" },
                });
                pi.status = "requires_payment_method";
                pi.payment_method = None;
                pi.last_payment_error = Some(error);
                let obj = pi.to_json();
                self.charges.insert(charge_id.clone(), charge);
                self.counters.confirmations_declined += 1;
                self.emit("payment_intent.payment_failed", obj.clone(), now, Some(ctx));
                Err(ApiError::new(StatusCode::PAYMENT_REQUIRED, "card_error", Some("card_declined"), message)
                    .with("decline_code", decline_code)
                    .with("charge", charge_id)
                    .with("payment_intent", obj))
            }
            TestCard::Approve { brand, last4 } => {
                (charge.brand, charge.last4) = (brand, last4);
                pi.payment_method = Some(pm);
                pi.last_payment_error = None;
                let event = if pi.capture_method == "manual" {
                    pi.status = "requires_capture";
                    pi.amount_capturable = pi.amount;
                    let deadline = now + AUTHORIZATION_WINDOW_S;
                    charge.capture_before = Some(deadline);
                    self.expiries.insert((deadline, pi.id.clone()));
                    "payment_intent.amount_capturable_updated"
                } else {
                    pi.status = "succeeded";
                    pi.amount_received = pi.amount;
                    charge.captured = true;
                    charge.amount_captured = charge.amount;
                    "payment_intent.succeeded"
                };
                let obj = pi.to_json();
                self.charges.insert(charge_id, charge);
                self.counters.confirmations_succeeded += 1;
                self.emit(event, obj.clone(), now, Some(ctx));
                Ok(obj)
            }
        }
    }

    /// `POST /v1/payment_intents/{id}/capture`.
    pub fn capture(&mut self, id: &str, ctx: &Ctx) -> Result<Value, ApiError> {
        ctx.params.only(&["amount_to_capture", "metadata["])?;
        let amount_to_capture = ctx.params.positive_int("amount_to_capture")?;
        let pi = pi_mut(&mut self.payment_intents, id)?;
        if pi.status != "requires_capture" {
            return Err(ApiError::unexpected_state(pi.to_json(), "captured", pi.status));
        }
        let amount = amount_to_capture.unwrap_or(pi.amount_capturable);
        if amount > pi.amount_capturable {
            return Err(ApiError::invalid(
                Some("amount_too_large"),
                "amount_to_capture",
                "The amount to capture is greater than the amount capturable.",
            ));
        }
        pi.metadata.extend(ctx.params.metadata()?);
        pi.status = "succeeded";
        pi.amount_received = amount;
        pi.amount_capturable = 0;
        let obj = pi.to_json();
        if let Some(ch) = pi.latest_charge.as_ref().and_then(|c| self.charges.get_mut(c)) {
            self.expiries.remove(&(ch.capture_before.unwrap_or_default(), id.to_owned()));
            ch.captured = true;
            ch.amount_captured = amount;
        }
        self.counters.captures_applied += 1;
        *self.counters.captures_per_payment_intent.entry(id.to_owned()).or_default() += 1;
        self.emit("payment_intent.succeeded", obj.clone(), ctx.now, Some(ctx));
        Ok(obj)
    }

    /// `POST /v1/payment_intents/{id}/cancel`.
    pub fn cancel(&mut self, id: &str, ctx: &Ctx) -> Result<Value, ApiError> {
        ctx.params.only(&["cancellation_reason"])?;
        let reason = ctx.params.get("cancellation_reason");
        if let Some(r) = reason {
            if !matches!(r, "duplicate" | "fraudulent" | "requested_by_customer" | "abandoned") {
                return Err(ApiError::invalid(
                    None,
                    "cancellation_reason",
                    format!("Invalid cancellation_reason: {r}"),
                ));
            }
        }
        let pi = pi_mut(&mut self.payment_intents, id)?;
        if !(pi.is_confirmable() || pi.status == "requires_capture") {
            return Err(ApiError::unexpected_state(pi.to_json(), "canceled", pi.status));
        }
        let was_authorized = pi.status == "requires_capture";
        pi.status = "canceled";
        pi.cancellation_reason = reason.map(str::to_owned);
        pi.canceled_at = Some(ctx.now);
        pi.amount_capturable = 0;
        let obj = pi.to_json();
        if let Some(ch) =
            pi.latest_charge.as_ref().and_then(|c| self.charges.get_mut(c)).filter(|_| was_authorized)
        {
            self.expiries.remove(&(ch.capture_before.unwrap_or_default(), id.to_owned()));
            ch.amount_refunded = ch.amount;
        }
        self.counters.cancels += 1;
        self.emit("payment_intent.canceled", obj.clone(), ctx.now, Some(ctx));
        Ok(obj)
    }

    /// `POST /v1/refunds` (by `payment_intent` or `charge`).
    pub fn refund(&mut self, ctx: &Ctx) -> Result<Value, ApiError> {
        let p = &ctx.params;
        p.only(&["payment_intent", "charge", "amount", "metadata[", "reason"])?;
        let amount = p.positive_int("amount")?;
        let metadata = p.metadata()?;
        let reason = p.get("reason").map(str::to_owned);
        let pi_id = match (p.get("payment_intent"), p.get("charge")) {
            (Some(pi), _) => pi.to_owned(),
            (None, Some(ch)) => {
                self.charges.get(ch).ok_or_else(|| ApiError::no_such("charge", ch))?.payment_intent.clone()
            }
            (None, None) => return Err(ApiError::missing("payment_intent")),
        };
        let pi =
            self.payment_intents.get(&pi_id).ok_or_else(|| ApiError::no_such("payment_intent", &pi_id))?;
        if pi.status != "succeeded" {
            return Err(ApiError::unexpected_state(pi.to_json(), "refunded", pi.status));
        }
        let charge_id = pi.latest_charge.clone().unwrap_or_default();
        let ch = self.charges.get_mut(&charge_id).ok_or_else(|| ApiError::no_such("charge", &charge_id))?;
        let remaining = ch.amount_captured - ch.amount_refunded;
        if remaining <= 0 {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("charge_already_refunded"),
                format!("Charge {charge_id} has already been refunded."),
            ));
        }
        let amount = amount.unwrap_or(remaining);
        if amount > remaining {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("amount_too_large"),
                format!(
                    "Refund amount ({amount}) is greater than unrefunded amount on charge ({remaining})."
                ),
            )
            .with("param", "amount"));
        }
        ch.amount_refunded += amount;
        let charge_obj = ch.to_json();
        let refund = Refund {
            id: new_id("re"),
            amount,
            charge: charge_id,
            payment_intent: pi_id,
            currency: ch.currency.clone(),
            created: ctx.now,
            metadata,
            reason,
        };
        let obj = refund.to_json();
        self.refunds.insert(refund.id.clone(), refund);
        self.counters.refunds += 1;
        self.emit("charge.refunded", charge_obj, ctx.now, Some(ctx));
        self.emit("refund.created", obj.clone(), ctx.now, Some(ctx));
        Ok(obj)
    }

    /// Test control: the cardholder's bank disputes the captured charge of `payment_intent`
    /// (`needs_response`), emitting `charge.dispute.created`. Returns the dispute.
    pub fn open_dispute(&mut self, payment_intent: &str, now: i64) -> Result<Value, ApiError> {
        let pi = self
            .payment_intents
            .get(payment_intent)
            .ok_or_else(|| ApiError::no_such("payment_intent", payment_intent))?;
        if pi.status != "succeeded" {
            return Err(ApiError::unexpected_state(pi.to_json(), "disputed", pi.status));
        }
        let charge_id = pi.latest_charge.clone().unwrap_or_default();
        let ch = self.charges.get_mut(&charge_id).ok_or_else(|| ApiError::no_such("charge", &charge_id))?;
        ch.disputed = true;
        let d = Dispute {
            id: new_id("dp"),
            amount: ch.amount_captured,
            charge: charge_id,
            payment_intent: payment_intent.to_owned(),
            currency: ch.currency.clone(),
            created: now,
            status: "needs_response",
        };
        let obj = d.to_json();
        self.disputes.insert(d.id.clone(), d);
        self.emit("charge.dispute.created", obj.clone(), now, None);
        Ok(obj)
    }

    /// Test control: dispute `id` closes `won` or lost, emitting `charge.dispute.closed`.
    pub fn close_dispute(&mut self, id: &str, won: bool, now: i64) -> Result<Value, ApiError> {
        let d = self.disputes.get_mut(id).ok_or_else(|| ApiError::no_such("dispute", id))?;
        d.status = if won { "won" } else { "lost" };
        let obj = d.to_json();
        self.emit("charge.dispute.closed", obj.clone(), now, None);
        Ok(obj)
    }

    /// `GET /v1/disputes/{id}`.
    pub fn dispute(&self, id: &str) -> Result<Value, ApiError> {
        self.disputes.get(id).map(Dispute::to_json).ok_or_else(|| ApiError::no_such("dispute", id))
    }

    /// `GET /v1/disputes`: newest first, filtered by `payment_intent` (and `charge`), at most
    /// `limit` (1..=100, default 10) (<https://docs.stripe.com/api/disputes/list>).
    pub fn list_disputes(&self, ctx: &Ctx) -> Result<Value, ApiError> {
        let p = &ctx.params;
        p.only(&["payment_intent", "charge", "limit"])?;
        let limit = p.int("limit")?.unwrap_or(LIST_DEFAULT_LIMIT);
        if !(1..=LIST_MAX_LIMIT).contains(&limit) {
            return Err(ApiError::invalid_integer("limit"));
        }
        let (pi, charge) = (p.get("payment_intent"), p.get("charge"));
        let mut matching: Vec<&Dispute> = self
            .disputes
            .values()
            .filter(|d| pi.is_none_or(|x| d.payment_intent == x) && charge.is_none_or(|x| d.charge == x))
            .collect();
        matching.sort_by(|a, b| b.created.cmp(&a.created).then_with(|| b.id.cmp(&a.id)));
        let has_more = matching.len() > limit as usize;
        let data: Vec<Value> = matching.into_iter().take(limit as usize).map(Dispute::to_json).collect();
        Ok(json!({ "object": "list", "data": data, "has_more": has_more, "url": "/v1/disputes" }))
    }

    /// `GET /v1/payment_intents`: newest first, filtered by `created[gt|gte|lt|lte]`, paged by
    /// `limit` (1..=100, default 10) and `starting_after` (<https://docs.stripe.com/api/pagination>);
    /// `expand[]=data.latest_charge` renders each intent's latest charge as an object instead
    /// of its id (<https://docs.stripe.com/expand>), the only expansion supported.
    pub fn list_payment_intents(&self, ctx: &Ctx) -> Result<Value, ApiError> {
        let p = &ctx.params;
        p.only(&[
            "created[gt]",
            "created[gte]",
            "created[lt]",
            "created[lte]",
            "limit",
            "starting_after",
            "expand[",
        ])?;
        let mut expand_charge = false;
        for (key, path) in p.prefixed("expand[") {
            if path != "data.latest_charge" {
                return Err(ApiError::invalid(
                    None,
                    key,
                    format!("This property cannot be expanded ({path})."),
                ));
            }
            expand_charge = true;
        }
        let limit = p.int("limit")?.unwrap_or(LIST_DEFAULT_LIMIT);
        if !(1..=LIST_MAX_LIMIT).contains(&limit) {
            return Err(ApiError::invalid_integer("limit"));
        }
        let (gt, gte, lt, lte) =
            (p.int("created[gt]")?, p.int("created[gte]")?, p.int("created[lt]")?, p.int("created[lte]")?);
        let newest_first = self.pi_order.iter().rev();
        let mut candidates: Box<dyn Iterator<Item = &String>> = Box::new(newest_first);
        if let Some(after) = p.get("starting_after") {
            if !self.payment_intents.contains_key(after) {
                return Err(ApiError::invalid(
                    Some("resource_missing"),
                    "starting_after",
                    format!("No such payment_intent: '{after}'"),
                ));
            }
            candidates = Box::new(candidates.skip_while(move |id| id.as_str() != after).skip(1));
        }
        let mut matching = candidates.map(|id| &self.payment_intents[id]).filter(|pi| {
            gt.is_none_or(|t| pi.created > t)
                && gte.is_none_or(|t| pi.created >= t)
                && lt.is_none_or(|t| pi.created < t)
                && lte.is_none_or(|t| pi.created <= t)
        });
        let render = |pi: &PaymentIntent| {
            let mut v = pi.to_json();
            if let Some(ch) =
                pi.latest_charge.as_ref().and_then(|c| self.charges.get(c)).filter(|_| expand_charge)
            {
                v["latest_charge"] = ch.to_json();
            }
            v
        };
        let data: Vec<Value> = matching.by_ref().take(limit as usize).map(render).collect();
        let has_more = matching.next().is_some();
        Ok(json!({ "object": "list", "data": data, "has_more": has_more, "url": "/v1/payment_intents" }))
    }

    /// `GET /v1/charges/{id}`.
    pub fn charge(&self, id: &str) -> Result<Value, ApiError> {
        self.charges.get(id).map(Charge::to_json).ok_or_else(|| ApiError::no_such("charge", id))
    }

    /// `GET /v1/refunds/{id}`.
    pub fn refund_by_id(&self, id: &str) -> Result<Value, ApiError> {
        self.refunds.get(id).map(Refund::to_json).ok_or_else(|| ApiError::no_such("refund", id))
    }

    /// The intent's JSON, for `StripeSim::payment_intent`.
    pub fn payment_intent_json(&self, id: &str) -> Option<Value> {
        self.payment_intents.get(id).map(PaymentIntent::to_json)
    }
}

/// Field-level lookup, so the intent can be mutated while other maps are touched.
fn pi_mut<'a>(
    pis: &'a mut HashMap<String, PaymentIntent>,
    id: &str,
) -> Result<&'a mut PaymentIntent, ApiError> {
    pis.get_mut(id).ok_or_else(|| ApiError::no_such("payment_intent", id))
}

/// A publishable key may only touch an intent whose client secret it presents; a secret key
/// that presents one must present the right one.
fn check_client_secret(pi: &PaymentIntent, ctx: &Ctx) -> Result<(), ApiError> {
    match (ctx.params.get("client_secret"), &ctx.caller) {
        (Some(given), _) if given == pi.client_secret => Ok(()),
        (None, Caller::Secret(_)) => Ok(()),
        (None, Caller::Publishable(_)) => Err(ApiError::missing("client_secret")),
        (Some(_), _) => Err(ApiError::invalid(
            Some("payment_intent_invalid_parameter"),
            "client_secret",
            "The client_secret provided does not match the client_secret associated with the PaymentIntent.",
        )),
    }
}
