//! Stripe object shapes that boxoffice reads and the request shapes it sends.
//!
//! Invariant: a [`PaymentIntent`]'s `client_secret` is never printed by `Debug`; it is only
//! reachable as a field, for the order-status endpoint that hands it to the order's owner.
//! Unknown fields Stripe adds are ignored; fields we model but Stripe may omit default.

use std::collections::HashMap;
use std::fmt;

pub use boxoffice_domain::PaymentIntentStatus;
use serde::{Deserialize, Serialize};

/// Parameters of `POST /v1/payment_intents` (<https://docs.stripe.com/api/payment_intents/create>).
///
/// The client always adds `capture_method=manual` and `automatic_payment_methods[enabled]=true`
/// (design §9–10: authorize at checkout, capture when the order is confirmed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreatePaymentIntent {
    /// Amount in the currency's minor unit (cents for `usd`, yen for `jpy`); must be > 0.
    pub amount_minor: i64,
    /// Three-letter ISO 4217 code, lowercase as Stripe returns it (`"usd"`).
    pub currency: String,
    /// Sent as `metadata[key]=value`; Stripe allows 50 keys, keys ≤ 40 chars, values ≤ 500.
    pub metadata: Vec<(String, String)>,
}

/// A Stripe PaymentIntent (<https://docs.stripe.com/api/payment_intents/object>).
///
/// Amounts are integer minor units. `Debug` redacts `client_secret`.
#[derive(Clone, Deserialize, Serialize, PartialEq)]
pub struct PaymentIntent {
    /// `pi_…`
    pub id: String,
    /// The lifecycle status; a value this build does not know is kept as `Unknown`.
    pub status: PaymentIntentStatus,
    /// Amount intended to be collected, minor units.
    pub amount: i64,
    /// Amount that can still be captured (non-zero only in `requires_capture`), minor units.
    pub amount_capturable: i64,
    /// Amount captured, minor units.
    pub amount_received: i64,
    /// Lowercase ISO 4217 code.
    pub currency: String,
    /// `automatic`, `automatic_async` or `manual`.
    pub capture_method: String,
    /// `pi_…_secret_…`: lets a browser confirm with a publishable key. Secret: never log it.
    pub client_secret: Option<String>,
    /// Our `metadata[k]=v` pairs (order and hold ids).
    #[serde(default)]
    pub metadata: HashMap<String, String>,
    /// Unix seconds.
    pub created: i64,
    /// `ch_…` of the most recent charge attempt, if any.
    pub latest_charge: Option<String>,
    /// Stripe's error object from the last failed confirmation (card decline etc.).
    pub last_payment_error: Option<serde_json::Value>,
    /// e.g. `automatic` (authorization expired), `requested_by_customer`, `abandoned`.
    pub cancellation_reason: Option<String>,
    /// Unix seconds when canceled.
    #[serde(default)]
    pub canceled_at: Option<i64>,
    /// `pm_…` attached to the intent, if any.
    #[serde(default)]
    pub payment_method: Option<String>,
    /// False for test-mode keys (and always in the simulator).
    #[serde(default)]
    pub livemode: bool,
}

impl fmt::Debug for PaymentIntent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PaymentIntent")
            .field("id", &self.id)
            .field("status", &self.status)
            .field("amount", &self.amount)
            .field("amount_capturable", &self.amount_capturable)
            .field("amount_received", &self.amount_received)
            .field("currency", &self.currency)
            .field("capture_method", &self.capture_method)
            .field("client_secret", &self.client_secret.as_ref().map(|_| "[redacted]"))
            .field("metadata", &self.metadata)
            .field("created", &self.created)
            .field("latest_charge", &self.latest_charge)
            .field("last_payment_error", &self.last_payment_error)
            .field("cancellation_reason", &self.cancellation_reason)
            .field("canceled_at", &self.canceled_at)
            .field("payment_method", &self.payment_method)
            .field("livemode", &self.livemode)
            .finish()
    }
}

/// A Stripe Dispute (<https://docs.stripe.com/api/disputes/object>): the cardholder's bank
/// contests a captured charge.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct Dispute {
    /// `dp_…`
    pub id: String,
    /// `warning_needs_response`, `warning_under_review`, `warning_closed`, `needs_response`,
    /// `under_review`, `won` or `lost`.
    pub status: String,
    /// Disputed amount, minor units.
    pub amount: i64,
    /// `ch_…` disputed.
    pub charge: String,
    /// `pi_…` of the charge.
    #[serde(default)]
    pub payment_intent: Option<String>,
    /// Why the cardholder disputes (`fraudulent`, `product_not_received`, …).
    #[serde(default)]
    pub reason: Option<String>,
}

/// A Stripe Refund (<https://docs.stripe.com/api/refunds/object>).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct Refund {
    /// `re_…`
    pub id: String,
    /// `pending`, `requires_action`, `succeeded`, `failed` or `canceled`.
    pub status: String,
    /// Refunded amount, minor units.
    pub amount: i64,
    /// `pi_…` the refund belongs to.
    pub payment_intent: Option<String>,
    /// `ch_…` that was refunded.
    #[serde(default)]
    pub charge: Option<String>,
    /// Lowercase ISO 4217 code.
    #[serde(default)]
    pub currency: String,
    /// Our `metadata[k]=v` pairs.
    #[serde(default)]
    pub metadata: HashMap<String, String>,
    /// Unix seconds.
    #[serde(default)]
    pub created: i64,
    /// `duplicate`, `fraudulent`, `requested_by_customer` or `null`.
    #[serde(default)]
    pub reason: Option<String>,
}

/// A Stripe Charge, the fields reconciliation reads
/// (<https://docs.stripe.com/api/charges/object>). Amounts are minor units.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct Charge {
    /// `ch_…`
    pub id: String,
    /// Amount of the charge attempt, minor units.
    #[serde(default)]
    pub amount: i64,
    /// Amount captured, minor units (0 while only authorized).
    #[serde(default)]
    pub amount_captured: i64,
    /// Amount refunded, minor units. For an authorization that was canceled or lapsed,
    /// Stripe reports the released amount here too; only a captured charge's refunds are
    /// money returned.
    #[serde(default)]
    pub amount_refunded: i64,
    /// Whether the charge was captured.
    #[serde(default)]
    pub captured: bool,
    /// `succeeded`, `pending` or `failed`.
    #[serde(default)]
    pub status: String,
    /// Card details; carries the authorization's capture deadline.
    #[serde(default)]
    pub payment_method_details: Option<PaymentMethodDetails>,
    /// Whether the cardholder's bank ever disputed the charge.
    #[serde(default)]
    pub disputed: bool,
}

/// `charge.payment_method_details`, the part we read.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct PaymentMethodDetails {
    /// Present for card payments.
    #[serde(default)]
    pub card: Option<CardDetails>,
}

/// `charge.payment_method_details.card`, the part we read.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct CardDetails {
    /// Unix seconds after which an uncaptured authorization can no longer be captured.
    #[serde(default)]
    pub capture_before: Option<i64>,
}

impl Charge {
    /// The authorization's capture deadline (unix seconds), when Stripe reports one.
    pub fn capture_before(&self) -> Option<i64> {
        self.payment_method_details.as_ref()?.card.as_ref()?.capture_before
    }
}

/// A PaymentIntent listed with its latest charge expanded
/// (`expand[]=data.latest_charge`, <https://docs.stripe.com/expand>): the intent as the
/// other calls return it (`latest_charge` holds the charge id) plus the charge object.
#[derive(Clone, Debug, PartialEq)]
pub struct IntentWithCharge {
    /// The PaymentIntent.
    pub intent: PaymentIntent,
    /// Its latest charge, `None` before the first confirmation attempt.
    pub charge: Option<Charge>,
}

impl IntentWithCharge {
    /// Money refunded to the buyer, minor units: the charge's `amount_refunded` once it was
    /// captured, 0 otherwise (a released authorization is not a refund).
    pub fn amount_refunded(&self) -> i64 {
        match &self.charge {
            Some(c) if c.captured || self.intent.amount_received > 0 => c.amount_refunded,
            _ => 0,
        }
    }

    /// The order this intent was created for (`metadata.order_id`), unparsed.
    pub fn order_id(&self) -> Option<&str> {
        self.intent.metadata.get("order_id").map(String::as_str)
    }
}

impl<'de> Deserialize<'de> for IntentWithCharge {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        /// `latest_charge` is an id when not expanded and an object when expanded.
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Expandable {
            Object(Box<Charge>),
            Id(String),
        }
        #[derive(Deserialize)]
        struct Raw {
            #[serde(flatten)]
            intent: PaymentIntent,
            latest_charge: Option<Expandable>,
        }
        let Raw { mut intent, latest_charge } = Raw::deserialize(d)?;
        let charge = match latest_charge {
            Some(Expandable::Object(c)) => {
                intent.latest_charge = Some(c.id.clone());
                Some(*c)
            }
            Some(Expandable::Id(id)) => {
                intent.latest_charge = Some(id);
                None
            }
            None => None,
        };
        Ok(Self { intent, charge })
    }
}

/// A `created` window for list calls: `created[gte]` / `created[lte]`, unix seconds, both
/// inclusive, either open.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CreatedWindow {
    /// Oldest creation time included, unix seconds.
    pub gte: Option<i64>,
    /// Newest creation time included, unix seconds.
    pub lte: Option<i64>,
}

impl CreatedWindow {
    /// The query of one list page: the window, `limit`, and `starting_after` (the last id of
    /// the previous page, newest-first order) after the first page.
    pub(crate) fn page_query(&self, limit: u32, starting_after: Option<&str>) -> Vec<(String, String)> {
        let mut q = Vec::with_capacity(4);
        if let Some(t) = self.gte {
            q.push(("created[gte]".to_owned(), t.to_string()));
        }
        if let Some(t) = self.lte {
            q.push(("created[lte]".to_owned(), t.to_string()));
        }
        q.push(("limit".to_owned(), limit.to_string()));
        if let Some(id) = starting_after {
            q.push(("starting_after".to_owned(), id.to_owned()));
        }
        q
    }
}

/// Stripe's list envelope (<https://docs.stripe.com/api/pagination>).
#[derive(Deserialize)]
pub(crate) struct List<T> {
    pub data: Vec<T>,
    pub has_more: bool,
}

/// Appends `metadata[key]=value` pairs in Stripe's bracket syntax.
pub(crate) fn push_metadata(form: &mut Vec<(String, String)>, metadata: &[(String, String)]) {
    form.extend(metadata.iter().map(|(k, v)| (format!("metadata[{k}]"), v.clone())));
}

impl CreatePaymentIntent {
    /// The form body of `POST /v1/payment_intents`.
    pub(crate) fn to_form(&self) -> Vec<(String, String)> {
        let mut form = vec![
            ("amount".to_owned(), self.amount_minor.to_string()),
            ("currency".to_owned(), self.currency.clone()),
            ("capture_method".to_owned(), "manual".to_owned()),
            ("automatic_payment_methods[enabled]".to_owned(), "true".to_owned()),
        ];
        push_metadata(&mut form, &self.metadata);
        form
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_form_uses_bracket_syntax() {
        let req = CreatePaymentIntent {
            amount_minor: 4200,
            currency: "usd".into(),
            metadata: vec![("order_id".into(), "o 1&2".into())],
        };
        let body = serde_urlencoded::to_string(req.to_form()).unwrap();
        assert_eq!(
            body,
            "amount=4200&currency=usd&capture_method=manual&automatic_payment_methods%5Benabled%5D=true&metadata%5Border_id%5D=o+1%262"
        );
    }

    #[test]
    fn debug_redacts_client_secret() {
        let pi: PaymentIntent = serde_json::from_value(serde_json::json!({
            "id": "pi_1", "object": "payment_intent", "status": "requires_payment_method",
            "amount": 100, "amount_capturable": 0, "amount_received": 0, "currency": "usd",
            "capture_method": "manual", "client_secret": "pi_1_secret_abc", "metadata": {},
            "created": 1, "latest_charge": null, "last_payment_error": null,
            "cancellation_reason": null, "unknown_future_field": 7
        }))
        .unwrap();
        let dbg = format!("{pi:?}");
        assert!(!dbg.contains("secret_abc"), "{dbg}");
        assert!(dbg.contains("[redacted]"));
    }
}
