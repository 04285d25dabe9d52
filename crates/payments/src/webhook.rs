//! Stripe webhook signatures: [`verify`] for the receiving route, [`sign`] for the simulator.
//!
//! Scheme (<https://docs.stripe.com/webhooks#verify-manually>): the `Stripe-Signature` header
//! is `t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>`, possibly with several
//! `v1=` entries (secret rotation) and other schemes (`v0=`) that are ignored.
//!
//! Invariant: an [`Event`] is only produced from a body whose signature matched (compared in
//! constant time) and whose timestamp is within the tolerance; the body is parsed only after
//! that. Verify against the raw bytes as received: never re-serialize before verifying. Errors
//! never carry the body or the signature.

use std::fmt;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// Stripe's default tolerance between the signed timestamp and now, seconds.
pub const DEFAULT_TOLERANCE_S: i64 = 300;

/// The header name Stripe signs with.
pub const SIGNATURE_HEADER: &str = "Stripe-Signature";

type HmacSha256 = Hmac<Sha256>;

/// A Stripe Event (<https://docs.stripe.com/api/events/object>).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct Event {
    /// `evt_…`: the deduplication key for the `stripe_events` inbox (design §10).
    pub id: String,
    /// e.g. `payment_intent.amount_capturable_updated`, `payment_intent.succeeded`,
    /// `payment_intent.payment_failed`, `payment_intent.canceled`, `charge.refunded`.
    pub r#type: String,
    /// Unix seconds when the event was created (not when it was delivered).
    pub created: i64,
    /// The object the event is about.
    pub data: EventData,
    /// False for test-mode events.
    pub livemode: bool,
    /// API version the payload was rendered with, e.g. `2024-06-20`.
    pub api_version: Option<String>,
    /// Number of endpoints still waiting for this event.
    #[serde(default)]
    pub pending_webhooks: i64,
    /// The API request that caused the event (`null` for automatic transitions).
    #[serde(default)]
    pub request: Option<EventRequest>,
}

/// The object an [`Event`] is about. `Debug` shows only the object's kind and id, since the
/// object may hold a client secret or personal data.
#[derive(Clone, Deserialize, Serialize, PartialEq)]
pub struct EventData {
    /// The full object after the change: a PaymentIntent, Charge, Refund, …
    pub object: serde_json::Value,
    /// For `*.updated` events: the changed fields' previous values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_attributes: Option<serde_json::Value>,
}

impl EventData {
    /// Decodes `object` as a typed Stripe object, e.g. [`crate::PaymentIntent`].
    pub fn object_as<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        T::deserialize(&self.object)
    }
}

impl fmt::Debug for EventData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let field = |k: &str| self.object.get(k).and_then(|v| v.as_str()).unwrap_or("?").to_owned();
        f.debug_struct("EventData")
            .field("object", &format_args!("{}({})", field("object"), field("id")))
            .finish_non_exhaustive()
    }
}

/// `Event.request`: the id and idempotency key of the API request behind the event.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct EventRequest {
    /// `req_…`
    pub id: Option<String>,
    /// The `Idempotency-Key` the request carried, if any.
    pub idempotency_key: Option<String>,
}

/// Why a webhook was rejected. Answer 400 for all of them; Stripe will retry.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// The `Stripe-Signature` header was empty or absent.
    #[error("missing Stripe-Signature header")]
    MissingHeader,
    /// The header has no `t=` timestamp, no `v1=` signature, or an unparseable timestamp.
    #[error("malformed Stripe-Signature header")]
    BadHeader,
    /// No `v1=` signature matches the body under this secret.
    #[error("no Stripe-Signature v1 entry matches the payload")]
    NoMatchingSignature,
    /// Signature valid but `|now - t| > tolerance` (replay protection).
    #[error("signature timestamp {timestamp} is outside the tolerance at {now}")]
    TimestampOutsideTolerance {
        /// The header's `t=` value, unix seconds.
        timestamp: i64,
        /// The `now_unix` passed to [`verify`].
        now: i64,
    },
    /// Signature valid but the body is not a Stripe Event.
    #[error("webhook body is not a Stripe event")]
    BadPayload(#[source] serde_json::Error),
}

/// Verifies a webhook and parses its Event.
///
/// `payload` is the raw request body, `signature_header` the `Stripe-Signature` value,
/// `secret` the endpoint's `whsec_…` secret (used as-is as the HMAC key, as Stripe does),
/// `tolerance_s` the allowed `|now_unix - t|` in seconds (use [`DEFAULT_TOLERANCE_S`]; there is
/// no value that disables the check). Checks, in order: header shape, signature (any `v1`
/// entry, constant-time), timestamp, JSON shape.
pub fn verify(
    payload: &[u8],
    signature_header: &str,
    secret: &str,
    tolerance_s: i64,
    now_unix: i64,
) -> Result<Event, WebhookError> {
    if signature_header.trim().is_empty() {
        return Err(WebhookError::MissingHeader);
    }
    let mut timestamp: Option<&str> = None;
    let mut signatures = Vec::new();
    for item in signature_header.split(',') {
        match item.trim().split_once('=') {
            Some(("t", t)) if timestamp.is_none() => timestamp = Some(t),
            Some(("v1", sig)) => signatures.push(sig),
            _ => {}
        }
    }
    let ts_str = timestamp.ok_or(WebhookError::BadHeader)?;
    let ts: i64 = ts_str.parse().map_err(|_| WebhookError::BadHeader)?;
    if signatures.is_empty() {
        return Err(WebhookError::BadHeader);
    }
    let mac = mac_for(payload, secret, ts_str);
    let matched = signatures
        .iter()
        .filter_map(|sig| hex::decode(sig).ok())
        .any(|sig| mac.clone().verify_slice(&sig).is_ok());
    if !matched {
        return Err(WebhookError::NoMatchingSignature);
    }
    if now_unix.abs_diff(ts) > tolerance_s.max(0).unsigned_abs() {
        return Err(WebhookError::TimestampOutsideTolerance { timestamp: ts, now: now_unix });
    }
    serde_json::from_slice(payload).map_err(WebhookError::BadPayload)
}

/// The `Stripe-Signature` header value for `payload` signed at `timestamp` (unix seconds):
/// `t=<timestamp>,v1=<64 lowercase hex chars>`.
pub fn sign(payload: &[u8], secret: &str, timestamp: i64) -> String {
    let ts = timestamp.to_string();
    let sig = hex::encode(mac_for(payload, secret, &ts).finalize().into_bytes());
    format!("t={ts},v1={sig}")
}

/// HMAC-SHA256 over `"<t>.<payload>"`, with `t` exactly as it appears in the header.
fn mac_for(payload: &[u8], secret: &str, t: &str) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(secret.as_bytes()).expect("HMAC accepts any key length");
    mac.update(t.as_bytes());
    mac.update(b".");
    mac.update(payload);
    mac
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "whsec_test";
    const BODY: &[u8] = br#"{"id":"evt_1","object":"event","type":"payment_intent.succeeded","created":1700000000,"data":{"object":{"object":"payment_intent","id":"pi_1","client_secret":"pi_1_secret_zzz"}},"livemode":false,"api_version":"2024-06-20"}"#;

    #[test]
    fn roundtrip_and_debug_hides_object() {
        let header = sign(BODY, SECRET, 1_700_000_000);
        let ev = verify(BODY, &header, SECRET, DEFAULT_TOLERANCE_S, 1_700_000_100).unwrap();
        assert_eq!(ev.id, "evt_1");
        assert_eq!(ev.r#type, "payment_intent.succeeded");
        let dbg = format!("{ev:?}");
        assert!(dbg.contains("payment_intent(pi_1)") && !dbg.contains("zzz"), "{dbg}");
    }

    #[test]
    fn known_vector() {
        // HMAC-SHA256(key "whsec_test", "1.{}"), computed with Python's hmac module.
        let header = sign(b"{}", SECRET, 1);
        assert_eq!(header, "t=1,v1=7500d5d4be4b3ef07af1fe56f7d522d135cdaa7530de557e67cc1049c52de094");
        assert!(
            verify(b"{}", &header, SECRET, 10, 1).is_err_and(|e| matches!(e, WebhookError::BadPayload(_)))
        );
    }

    #[test]
    fn accepts_any_matching_v1_among_several() {
        let good = sign(BODY, SECRET, 100);
        let v1 = good.split_once(",v1=").unwrap().1;
        let header = format!("t=100,v0=abc,v1={},v1={v1}", "00".repeat(32));
        assert!(verify(BODY, &header, SECRET, 300, 100).is_ok());
    }

    #[test]
    fn rejections() {
        let header = sign(BODY, SECRET, 1000);
        let mut tampered = BODY.to_vec();
        tampered[10] ^= 1;
        assert!(matches!(
            verify(&tampered, &header, SECRET, 300, 1000),
            Err(WebhookError::NoMatchingSignature)
        ));
        assert!(matches!(
            verify(BODY, &header, "whsec_other", 300, 1000),
            Err(WebhookError::NoMatchingSignature)
        ));
        assert!(matches!(
            verify(BODY, &header, SECRET, 300, 1301),
            Err(WebhookError::TimestampOutsideTolerance { timestamp: 1000, now: 1301 })
        ));
        assert!(matches!(
            verify(BODY, &header, SECRET, 300, 699),
            Err(WebhookError::TimestampOutsideTolerance { .. })
        ));
        assert!(matches!(verify(BODY, "", SECRET, 300, 1000), Err(WebhookError::MissingHeader)));
        assert!(matches!(verify(BODY, "t=1000", SECRET, 300, 1000), Err(WebhookError::BadHeader)));
        assert!(matches!(verify(BODY, "v1=00", SECRET, 300, 1000), Err(WebhookError::BadHeader)));
        assert!(matches!(verify(BODY, "t=x,v1=00", SECRET, 300, 1000), Err(WebhookError::BadHeader)));
        // Re-signing with a new timestamp but the old signature fails.
        let replayed = header.replace("t=1000", "t=2000");
        assert!(matches!(verify(BODY, &replayed, SECRET, 300, 2000), Err(WebhookError::NoMatchingSignature)));
    }
}
