//! The buyer's HTTP client: every request a buyer sends to the boxoffice API (seat map,
//! direct admission, waiting-room join and poll, hold, order status) and, as Stripe.js does,
//! to the payment provider (confirming a PaymentIntent with the publishable key), with the
//! shapes of the answers buyers act on. The onsale's buyers, the bench and the integration
//! tests all speak to the API through it, so a path or a header is written once.
//!
//! It builds requests and nothing more: sending, retrying, timing and asserting stay with
//! the caller, because each needs its own (the onsale's buyers retry with the same
//! Idempotency-Key, the bench times holds under its own permit, tests read raw answers).
//! `authorization` arguments are the whole header value, `Bearer …`.

use reqwest::RequestBuilder;
use serde::Deserialize;
use uuid::Uuid;

/// Order states after which nothing changes any more.
pub const FINAL_STATES: [&str; 5] = ["ticketed", "expired", "failed", "canceled", "refunded"];

/// Requests of one buyer-facing API deployment, on a shared connection pool.
#[derive(Clone, Debug)]
pub struct BuyerClient {
    /// The shared HTTP client (its pool, timeouts).
    pub http: reqwest::Client,
    api_url: String,
}

impl BuyerClient {
    /// A client of the API at `api_url` (e.g. `http://127.0.0.1:8080`; a trailing `/` is
    /// dropped).
    pub fn new(http: reqwest::Client, api_url: impl Into<String>) -> Self {
        let api_url = api_url.into().trim_end_matches('/').to_owned();
        Self { http, api_url }
    }

    /// The API base URL, without trailing slash.
    pub fn api_url(&self) -> &str {
        &self.api_url
    }

    /// `GET /events/{event}/seats`: the seat map (body: [`crate::seatpick::SeatMapBody`]).
    pub fn seat_map(&self, event: Uuid) -> RequestBuilder {
        self.http.get(format!("{}/events/{event}/seats", self.api_url))
    }

    /// `POST /events/{event}/admission`: an admission token at once, on deployments with
    /// `admission_direct` (201, body: [`Admission`]).
    pub fn admit(&self, authorization: &str, event: Uuid) -> RequestBuilder {
        self.http
            .post(format!("{}/events/{event}/admission", self.api_url))
            .header("authorization", authorization)
    }

    /// `POST /events/{event}/queue`: joins the waiting room (200/201, body: [`QueueView`]).
    pub fn join_queue(&self, authorization: &str, event: Uuid) -> RequestBuilder {
        self.http
            .post(format!("{}/events/{event}/queue", self.api_url))
            .header("authorization", authorization)
    }

    /// `GET /queue/{ticket}`: the position's state, with the admission token once admitted
    /// (body: [`QueueView`]; 404 when the position lapsed).
    pub fn poll_queue(&self, authorization: &str, ticket: Uuid) -> RequestBuilder {
        self.http.get(format!("{}/queue/{ticket}", self.api_url)).header("authorization", authorization)
    }

    /// `POST /events/{event}/holds` for `seats` (202, body: [`HoldReceipt`]; 409 problem
    /// `seat_unavailable` or `idempotency_key_in_use`, body: [`Problem`]).
    pub fn hold(
        &self,
        authorization: &str,
        event: Uuid,
        admission_token: &str,
        idempotency_key: &str,
        seats: &[Uuid],
    ) -> RequestBuilder {
        self.http
            .post(format!("{}/events/{event}/holds", self.api_url))
            .header("authorization", authorization)
            .header("idempotency-key", idempotency_key)
            .header("x-admission-token", admission_token)
            .json(&serde_json::json!({ "seat_ids": seats }))
    }

    /// `GET /orders/{order}`: the order's state (body: [`OrderView`]).
    pub fn order(&self, authorization: &str, order: Uuid) -> RequestBuilder {
        self.http.get(format!("{}/orders/{order}", self.api_url)).header("authorization", authorization)
    }

    /// `GET /orders/{id}/events` (Server-Sent Events) on `http`, a client without a total
    /// timeout (the stream lives until the order is final).
    pub fn order_events(&self, http: &reqwest::Client, authorization: &str, order: Uuid) -> RequestBuilder {
        http.get(format!("{}/orders/{order}/events", self.api_url))
            .header("authorization", authorization)
            .header("accept", "text/event-stream")
    }
}

/// `POST {stripe_api_base}/v1/payment_intents/{payment_intent}/confirm` with the publishable
/// key and the order's client secret, as Stripe.js does (200; 402 when the card is
/// declined). The idempotency key makes a retried confirmation one confirmation.
pub fn confirm_payment(
    http: &reqwest::Client,
    stripe_api_base: &str,
    publishable_key: &str,
    payment_intent: &str,
    client_secret: &str,
    payment_method: &str,
    idempotency_key: &str,
) -> RequestBuilder {
    http.post(format!("{stripe_api_base}/v1/payment_intents/{payment_intent}/confirm"))
        .bearer_auth(publishable_key)
        .header("idempotency-key", idempotency_key)
        .form(&[("payment_method", payment_method), ("client_secret", client_secret)])
}

/// Answer of `POST /events/{id}/admission`.
#[derive(Debug, Deserialize)]
pub struct Admission {
    /// The token for `X-Admission-Token`.
    pub admission_token: String,
}

/// Answer of a successful hold (202).
#[derive(Debug, Deserialize)]
pub struct HoldReceipt {
    /// The new order.
    pub order_id: Uuid,
    /// When the hold lapses unless paid.
    pub expires_at: chrono::DateTime<chrono::Utc>,
}

/// The members of `GET /orders/{id}` buyers act on.
#[derive(Debug, Deserialize)]
pub struct OrderView {
    /// Client-visible state (`held`, `payment_required`, …, see [`FINAL_STATES`]).
    pub status: String,
    /// The PaymentIntent to confirm, once created.
    pub payment_intent_id: Option<String>,
    /// Its client secret, while the order is payable.
    pub client_secret: Option<String>,
}

/// One Server-Sent Event: its `event:` name (default `message`) and its `data:` lines joined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field.
    pub event: String,
    /// The `data:` lines, joined by `\n`.
    pub data: String,
}

/// Takes the complete events (those ended by a blank line) off the front of `buf`; comments
/// (heartbeats) and `id:` / `retry:` fields are dropped.
pub fn take_sse_events(buf: &mut String) -> Vec<SseEvent> {
    let mut out = Vec::new();
    while let Some(end) = buf.find("\n\n") {
        let block: String = buf.drain(..end + 2).collect();
        let (mut event, mut data) = (String::from("message"), Vec::new());
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                event = v.trim_start().to_owned();
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push(v.strip_prefix(' ').unwrap_or(v).to_owned());
            }
        }
        if !data.is_empty() {
            out.push(SseEvent { event, data: data.join("\n") });
        }
    }
    out
}

impl OrderView {
    /// Whether the order reached a state that never changes again.
    pub fn is_final(&self) -> bool {
        FINAL_STATES.contains(&self.status.as_str())
    }
}

/// The members of a problem+json error body buyers act on.
#[derive(Debug, Deserialize, Default)]
pub struct Problem {
    /// The stable error code, e.g. `seat_unavailable`.
    pub code: Option<String>,
    /// With `seat_unavailable`: the seats already taken.
    #[serde(default)]
    pub unavailable_seat_ids: Vec<Uuid>,
}

impl Problem {
    /// Parses a problem+json body; an unparsable body yields an empty problem.
    pub fn parse(body: &[u8]) -> Self {
        serde_json::from_slice(body).unwrap_or_default()
    }
}

/// Answer of a waiting-room join or poll (the members buyers read).
#[derive(Debug, Deserialize)]
pub struct QueueView {
    /// The position's ticket.
    pub ticket: Uuid,
    /// `pre_queue`, `queued` or `admitted`.
    pub state: String,
    /// 1-based position while queued.
    pub position: Option<u64>,
    /// When to poll next, ms.
    pub poll_after_ms: u64,
    /// The admission token, once admitted.
    pub admission_token: Option<String>,
}

/// A per-buyer client address for `X-Forwarded-For` (`10.x.y.z` from the buyer's index),
/// so a deployment that trusts the header sees a crowd rather than one host.
pub fn forwarded_for(buyer: usize) -> String {
    format!("10.{}.{}.{}", (buyer >> 16) & 0xff, (buyer >> 8) & 0xff, buyer & 0xff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complete_events_are_taken_and_heartbeats_and_partial_ones_stay() {
        let mut buf = String::from(
            ": heartbeat\n\nevent: order\nid: 1\nretry: 2000\ndata: {\"a\":1}\n\nevent: end\ndata: final\n\nevent: order\ndata: {\"b\"",
        );
        let evs = take_sse_events(&mut buf);
        assert_eq!(
            evs,
            [
                SseEvent { event: "order".into(), data: "{\"a\":1}".into() },
                SseEvent { event: "end".into(), data: "final".into() },
            ]
        );
        assert_eq!(buf, "event: order\ndata: {\"b\"", "the partial event waits for the rest");
    }
}
