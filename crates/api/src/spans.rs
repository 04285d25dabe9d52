//! The API's spans (design §16): the request span every route runs in, and the span a Stripe
//! webhook's ingestion runs in.
//!
//! **Requests.** With tracing on, the request span is a server span whose parent is the
//! request's W3C `traceparent` header when it has a valid one (a client or proxy joins its
//! own trace), with the method, a path in which no secret appears (a queue ticket is
//! replaced by `{ticket}`), the status, `region` and `purchase_cell`. With tracing off it is
//! the debug-level span tower-http makes by default, so the fmt layer skips it at `info`. The
//! hold handler's own span (`routes::create_hold`) is its child and carries `order.id`,
//! `correlation_id`, `event.id`, `region` and `purchase_cell`; the facts the hold commits to
//! the outbox store its context, which is how the trace reaches the relay and the consumers.
//!
//! **Webhooks.** Stripe's requests carry no trace of ours, and no statement may be added to
//! the webhook path to look one up, so the trace travels through Stripe: the payment worker
//! writes the fact's stored `traceparent` into the PaymentIntent's metadata (identical on
//! every retry of `authorize:{event_id}`, see `boxoffice_workers::payment`), Stripe copies
//! the metadata into every event about the intent (and the simulator into its charges), and
//! [`webhook_span`] takes `data.object.metadata.traceparent` of the verified event as its
//! parent, linking back to the request span. The facts the webhook commits therefore stay in
//! the order's trace. Events that carry no such metadata (intents created before tracing was
//! on, disputes) start a trace of their own. Nothing of the body but the event's type and
//! ids and the order id goes on the span: never a client secret, card data, or the body.

use boxoffice_payments::webhook::Event;
use boxoffice_trace::Labels;
use http::{Request, Response};
use std::time::Duration;
use tracing::field::Empty;
use tracing::Span;

/// tower-http's `MakeSpan` for every route (see the module doc).
#[derive(Clone, Debug)]
pub struct RequestSpan {
    labels: Labels,
}

impl RequestSpan {
    /// Request spans labelled with `labels`.
    pub fn new(labels: &Labels) -> Self {
        Self { labels: labels.clone() }
    }
}

impl<B> tower_http::trace::MakeSpan<B> for RequestSpan {
    fn make_span(&mut self, req: &Request<B>) -> Span {
        if !boxoffice_trace::enabled() {
            return tracing::debug_span!("request", method = %req.method(), uri = %public_path(req.uri().path()), version = ?req.version());
        }
        let path = public_path(req.uri().path());
        let span = tracing::info_span!("request",
            otel.name = %format_args!("{} {}", req.method(), path),
            otel.kind = "server",
            otel.status_code = Empty,
            http.request.method = %req.method(),
            url.path = %path,
            http.response.status_code = Empty,
            region = %self.labels.region,
            purchase_cell = %self.labels.purchase_cell,
        );
        let parent = req.headers().get(boxoffice_trace::TRACEPARENT).and_then(|v| v.to_str().ok());
        boxoffice_trace::set_parent(&span, parent);
        span
    }
}

/// Records the response status on the request span (tower-http's `OnResponse`).
pub fn record_status<B>(res: &Response<B>, _latency: Duration, span: &Span) {
    span.record("http.response.status_code", res.status().as_u16());
    if res.status().is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
}

/// `path` with the queue ticket (a bearer capability for a queue position) replaced by
/// `{ticket}`; every other path of the API holds only ids.
pub fn public_path(path: &str) -> std::borrow::Cow<'_, str> {
    match path.strip_prefix("/queue/") {
        Some(rest) if !rest.is_empty() => "/queue/{ticket}".into(),
        _ => path.into(),
    }
}

/// The span a verified webhook's ingestion runs in: joined to the order's trace through the
/// PaymentIntent's `metadata.traceparent` and linked to the current (request) span. Holds the
/// event's type and id, the PaymentIntent and the order when the metadata names them.
pub fn webhook_span(event: &Event, labels: &Labels) -> Span {
    let object = &event.data.object;
    let meta = |k: &str| object.get("metadata").and_then(|m| m.get(k)).and_then(|v| v.as_str());
    let pi = match event.r#type.starts_with("payment_intent.") {
        true => object.get("id"),
        false => object.get("payment_intent"),
    }
    .and_then(|v| v.as_str());
    let span = tracing::info_span!("stripe.webhook",
        otel.name = %format_args!("webhook {}", event.r#type),
        otel.kind = "consumer",
        stripe.event_id = %event.id,
        stripe.event_type = %event.r#type,
        stripe.payment_intent = pi,
        order.id = meta("order_id"),
        correlation_id = Empty,
        region = %labels.region,
        purchase_cell = %labels.purchase_cell,
    );
    if boxoffice_trace::enabled() {
        let request = boxoffice_trace::current_traceparent();
        boxoffice_trace::set_parent(&span, meta(boxoffice_trace::TRACEPARENT));
        boxoffice_trace::add_link(&span, request.as_deref());
    }
    span
}

#[cfg(test)]
mod tests {
    use super::public_path;

    #[test]
    fn queue_tickets_never_reach_a_span() {
        assert_eq!(public_path("/queue/qt_secret-ticket"), "/queue/{ticket}");
        assert_eq!(public_path("/events/1/holds"), "/events/1/holds");
        assert_eq!(public_path("/queue/"), "/queue/");
    }
}
