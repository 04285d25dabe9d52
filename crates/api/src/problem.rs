//! RFC 9457 problem details: the single way errors leave the API, and the single mapping from
//! domain and storage errors to HTTP status codes. The client sees a stable `code` and a
//! human `detail`; internal causes are logged with their source chain and never sent.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use boxoffice_store::cells::Refusal;
use boxoffice_store::holds::ReserveError;
use serde_json::{json, Value};

/// `Retry-After` of `waitroom_unavailable`, seconds, drawn per answer: a queue's crowd that
/// is told one number comes back together and meets the same overload. Far inside the time
/// an unpolled position survives (`waitroom_abandon_after_ms`, 120 s by default).
pub const WAITROOM_RETRY_AFTER_S: std::ops::RangeInclusive<u64> = 2..=6;

/// The problem `code` of a problem+json response, in its extensions, for middleware that
/// tells refusals apart without reading the body (e.g. [`crate::edge::RefusalBackoff`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProblemCode(pub &'static str);

/// A problem+json response.
#[derive(Debug)]
pub struct Problem {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable machine-readable code; the `type` URI is `urn:boxoffice:problem:{code}`.
    pub code: &'static str,
    /// Short summary, the same for every occurrence of `code`.
    pub title: &'static str,
    /// Occurrence-specific explanation, safe to show to the client.
    pub detail: String,
    /// Extension members merged into the body.
    pub extra: Option<Value>,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u64>,
}

impl Problem {
    /// A problem with no extensions.
    pub fn new(
        status: StatusCode,
        code: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Self { status, code, title, detail: detail.into(), extra: None, retry_after: None }
    }

    /// Adds extension members.
    pub fn with(mut self, extra: Value) -> Self {
        self.extra = Some(extra);
        self
    }

    /// 400 for malformed requests.
    pub fn bad_request(code: &'static str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, "Bad request", detail)
    }

    /// 403 `sales_not_open`: the event's sales window (in the ledger) has not opened, or the
    /// event was never scheduled; `opens_at` when known.
    pub fn sales_not_open(opens_at: Option<chrono::DateTime<chrono::Utc>>) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "sales_not_open",
            "Sales not open",
            match opens_at {
                Some(t) => format!("sales for this event open at {}", t.to_rfc3339()),
                None => "sales for this event are not scheduled".to_owned(),
            },
        )
        .with(json!({ "opens_at": opens_at }))
    }

    /// 403 `sales_closed`: the event's sales window has closed.
    pub fn sales_closed() -> Self {
        Self::new(StatusCode::FORBIDDEN, "sales_closed", "Sales closed", "sales for this event have closed")
    }

    /// Why this cell does not sell the event now (design §13): 409 `event_in_another_cell`
    /// (with `purchase_cell` and `directory_epoch`: get a new admission there), 409
    /// `admission_token_stale_epoch` (minted before a move: get a new admission), 503
    /// `event_moving` (a move is under way; `Retry-After`).
    pub fn placement(r: Refusal) -> Self {
        match r {
            Refusal::ElsewhereCell { cell, directory_epoch } => Self::new(
                StatusCode::CONFLICT,
                "event_in_another_cell",
                "Event sold by another purchase cell",
                format!("this event is sold by purchase cell {cell}; join its waiting room there"),
            )
            .with(json!({ "purchase_cell": cell, "directory_epoch": directory_epoch })),
            Refusal::StaleEpoch { directory_epoch } => Self::new(
                StatusCode::CONFLICT,
                "admission_token_stale_epoch",
                "Admission token from before a move",
                "the admission token was minted before the event moved; get a new admission",
            )
            .with(json!({ "directory_epoch": directory_epoch })),
            Refusal::Moving => {
                let mut p = Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "event_moving",
                    "Event moving",
                    "the event is moving to another purchase cell; retry after Retry-After",
                );
                p.retry_after = Some(5);
                p
            }
        }
    }

    /// 404.
    pub fn not_found(what: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", "Not found", format!("{what} not found"))
    }

    /// 503 with `Retry-After`, logging the cause.
    pub fn unavailable(cause: &dyn std::error::Error) -> Self {
        tracing::warn!(error = %ErrorChain(cause), "dependency unavailable");
        let mut p = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "Service unavailable",
            "a dependency is unavailable; retry with the same Idempotency-Key",
        );
        p.retry_after = Some(1);
        p
    }

    /// 503 `unavailable` for an order stream that cannot start (`why`: the view reader has
    /// stopped, the order's read failed or was not answered in time): the client reconnects
    /// after `Retry-After`. Counted in `boxoffice_order_stream_refused_total{reason}`, logged
    /// at debug only, since clients choose how often it happens.
    pub fn stream_unavailable(why: &'static str) -> Self {
        metrics::counter!("boxoffice_order_stream_refused_total", "reason" => why).increment(1);
        tracing::debug!(reason = why, "order stream refused");
        let mut p = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "Service unavailable",
            format!("the order could not be read now ({}); reconnect later", why.replace('_', " ")),
        );
        p.retry_after = Some(1);
        p
    }

    /// 503 `region_fenced`: this region's ledger refused the write because another region
    /// writes now (or this region's lease lapsed); the client retries, and the traffic switch
    /// sends it to the region that writes. Nothing was written.
    pub fn region_fenced(refusal: boxoffice_store::region::Refusal) -> Self {
        // Counted, not logged per request: a fenced region answers every buyer this way.
        metrics::counter!("boxoffice_region_fenced_total", "refusal" => format!("{refusal:?}")).increment(1);
        tracing::debug!(?refusal, "write refused by the region fence");
        let mut p = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "region_fenced",
            "Region fenced",
            "this region does not take writes now; retry with the same Idempotency-Key",
        );
        p.retry_after = Some(5);
        p
    }

    /// 500, logging the cause.
    pub fn internal(cause: &dyn std::error::Error) -> Self {
        tracing::error!(error = %ErrorChain(cause), "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal error",
            "an internal error occurred",
        )
    }

    /// 500 or 503 for a database error, depending on whether it is transient: a region
    /// fence's refusal is 503 `region_fenced`; a statement the server gave up for want of
    /// time or room ([`boxoffice_store::is_overload`]: its `statement_timeout`, too many
    /// connections, …) is 503 `unavailable` with `Retry-After` drawn from 1–3 s, so the
    /// requests it refused together do not come back together (the code is the database's,
    /// not the edge's `overloaded`: the waiting room's refusal clock counts only the latter,
    /// `crate::routes::QUEUE_REFUSALS`); the other transient errors are 503 `unavailable`;
    /// the rest 500.
    pub fn database(e: &sqlx::Error) -> Self {
        if let Some(refusal) = boxoffice_store::region::refusal(e) {
            return Self::region_fenced(refusal);
        }
        if boxoffice_store::is_overload(e) {
            tracing::warn!(error = %ErrorChain(e), "database overloaded");
            return Self::shed(
                "unavailable",
                "Service unavailable",
                "the database is overloaded; nothing was done: retry after the Retry-After delay",
            );
        }
        if boxoffice_store::is_retryable(e) {
            Self::unavailable(e)
        } else {
            Self::internal(e)
        }
    }
}

/// Displays an error with its whole source chain.
pub struct ErrorChain<'a>(pub &'a dyn std::error::Error);

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut s = self.0.source();
        while let Some(e) = s {
            write!(f, ": {e}")?;
            s = e.source();
        }
        Ok(())
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut body = json!({
            "type": format!("urn:boxoffice:problem:{}", self.code),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
            "code": self.code,
        });
        if let (Some(Value::Object(extra)), Value::Object(b)) = (self.extra, &mut body) {
            b.extend(extra);
        }
        let mut resp = (self.status, body.to_string()).into_response();
        resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(s) = self.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp.extensions_mut().insert(ProblemCode(self.code));
        resp
    }
}

impl From<ReserveError> for Problem {
    fn from(e: ReserveError) -> Self {
        match e {
            ReserveError::SeatUnavailable { seat_ids } => Problem::new(
                StatusCode::CONFLICT,
                "seat_unavailable",
                "Seat unavailable",
                "at least one requested seat is held or sold; nothing was held",
            )
            .with(json!({ "unavailable_seat_ids": seat_ids })),
            ReserveError::IdempotencyConflict => Problem::new(
                StatusCode::CONFLICT,
                "idempotency_key_conflict",
                "Idempotency-Key reused",
                "this Idempotency-Key was already used with a different request body",
            ),
            ReserveError::InProgress => {
                let mut p = Problem::new(
                    StatusCode::CONFLICT,
                    "idempotency_key_in_use",
                    "Request in progress",
                    "a request with this Idempotency-Key is still being processed; retry shortly",
                );
                p.retry_after = Some(1);
                p
            }
            ReserveError::UnknownSeats { seat_ids } => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "unknown_seats",
                "Unknown seats",
                "some seat ids do not belong to this event",
            )
            .with(json!({ "unknown_seat_ids": seat_ids })),
            ReserveError::EventNotFound => Problem::not_found("event"),
            ReserveError::SeatCount(n) => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "seat_count",
                "Invalid seat count",
                format!("a hold takes 1 to 8 distinct seats, got {n}"),
            ),
            ReserveError::BuyerLimit { limit, max, has } => Problem::new(
                StatusCode::CONFLICT,
                "buyer_limit_reached",
                "Buyer limit reached",
                format!("this event allows {max} per buyer ({limit}); you have {has}"),
            )
            .with(json!({ "limit": limit.as_str(), "max": max, "current": has })),
            ReserveError::SalesNotOpen { opens_at } => Problem::sales_not_open(opens_at),
            ReserveError::SalesClosed => Problem::sales_closed(),
            ReserveError::EventInAnotherCell { cell, directory_epoch } => {
                Problem::placement(Refusal::ElsewhereCell { cell, directory_epoch })
            }
            ReserveError::StaleDirectoryEpoch { directory_epoch } => {
                Problem::placement(Refusal::StaleEpoch { directory_epoch })
            }
            ReserveError::EventMoving => Problem::placement(Refusal::Moving),
            ReserveError::Db(e) => Problem::database(&e),
            ReserveError::Fault(f) => f.into(),
            ReserveError::Ledger(e) => e.into(),
        }
    }
}

impl From<boxoffice_store::StoreError> for Problem {
    fn from(e: boxoffice_store::StoreError) -> Self {
        match &e {
            boxoffice_store::StoreError::Db(db) => Problem::database(db),
            _ => Problem::internal(&e),
        }
    }
}

impl From<crate::webhooks::IngestError> for Problem {
    fn from(e: crate::webhooks::IngestError) -> Self {
        match e {
            crate::webhooks::IngestError::Db(db) => Problem::database(&db),
            crate::webhooks::IngestError::Fault(f) => f.into(),
            crate::webhooks::IngestError::Ledger(e) => e.into(),
            crate::webhooks::IngestError::Malformed(what) => {
                Problem::bad_request("malformed_event", format!("the event's {what} is not a Stripe id"))
            }
            crate::webhooks::IngestError::Stopped => {
                Problem::unavailable(&crate::webhooks::IngestError::Stopped)
            }
        }
    }
}

impl From<boxoffice_faults::Injected> for Problem {
    fn from(e: boxoffice_faults::Injected) -> Self {
        let mut p = Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "fault_injected",
            "Service unavailable",
            format!("{e}; retry with the same Idempotency-Key"),
        );
        p.retry_after = Some(1);
        p
    }
}

impl From<sqlx::Error> for Problem {
    fn from(e: sqlx::Error) -> Self {
        Problem::database(&e)
    }
}

impl From<boxoffice_admission::AdmissionError> for Problem {
    fn from(e: boxoffice_admission::AdmissionError) -> Self {
        Problem::new(StatusCode::FORBIDDEN, e.code(), "Admission refused", e.to_string())
    }
}

impl From<boxoffice_waitroom::WaitroomError> for Problem {
    fn from(e: boxoffice_waitroom::WaitroomError) -> Self {
        use boxoffice_waitroom::WaitroomError as W;
        match e {
            W::Unavailable(_) | W::Timeout(_) => {
                // Already counted and logged once per outage by the waiting room.
                let mut p = Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "waitroom_unavailable",
                    "Waiting room unavailable",
                    "the waiting room is unavailable; retry shortly (admitted buyers can still hold seats)",
                );
                p.retry_after = Some(rand::Rng::gen_range(&mut rand::thread_rng(), WAITROOM_RETRY_AFTER_S));
                p
            }
            W::PositionLimit { held, limit } => Problem::new(
                StatusCode::CONFLICT,
                "queue_position_limit",
                "Too many queue positions",
                format!("you already hold {held} queue positions (limit {limit}); leave one first"),
            )
            .with(json!({ "limit": limit })),
            W::UnknownTicket => Problem::new(
                StatusCode::NOT_FOUND,
                "queue_ticket_not_found",
                "Queue ticket not found",
                "no such queue ticket: unknown, not yours, left, lapsed after polling stopped, or its admission slot ended",
            ),
            W::AlreadyOpen => Problem::new(
                StatusCode::CONFLICT,
                "queue_already_open",
                "Queue already open",
                "the event's queue has already opened",
            ),
            W::Redis(_) => Problem::internal(&e),
        }
    }
}

impl Problem {
    /// 503 `overloaded` with `Retry-After` drawn from 1–3 s (shed clients must not come back
    /// together): the edge's concurrency or connection limit, or a route class's bulkhead,
    /// is reached; nothing was done.
    pub fn overloaded() -> Self {
        Self::shed(
            "overloaded",
            "Server overloaded",
            "too many requests are in progress; nothing was done, retry after the Retry-After delay",
        )
    }

    /// A 503 with `Retry-After` drawn from 1–3 s, so the clients refused together do not come
    /// back together.
    fn shed(code: &'static str, title: &'static str, detail: &'static str) -> Self {
        let mut p = Problem::new(StatusCode::SERVICE_UNAVAILABLE, code, title, detail);
        p.retry_after = Some(rand::Rng::gen_range(&mut rand::thread_rng(), 1..=3));
        p
    }

    /// 429 `too_many_in_flight`: this client address already has `max` requests in progress
    /// on this route class ([`crate::edge::PerClientInFlight`]).
    pub fn too_many_in_flight(max: usize) -> Self {
        let mut p = Problem::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_in_flight",
            "Too many requests in progress",
            format!("this client already has {max} requests in progress; finish them, then retry"),
        )
        .with(json!({ "scope": "ip", "max_in_flight": max }));
        p.retry_after = Some(1);
        p
    }

    /// 429 `too_many_streams`: this user (`scope` = `user`), this client address (`ip`) or
    /// this process (`process`) has
    /// as many order streams open as allowed ([`crate::order_stream`]).
    pub fn too_many_streams(scope: &'static str, max: usize) -> Self {
        let detail = if scope == "user" {
            format!("this user already has {max} order streams open; close one, then retry")
        } else if scope == "ip" {
            format!("this client address already has {max} order streams open; close one, then retry")
        } else {
            "this server has as many order streams open as it serves; retry after the Retry-After delay"
                .to_owned()
        };
        let mut p =
            Problem::new(StatusCode::TOO_MANY_REQUESTS, "too_many_streams", "Too many order streams", detail)
                .with(json!({ "scope": scope, "max_streams": max }));
        p.retry_after = Some(5);
        p
    }

    /// 408 `request_body_timeout`: the request body stalled longer than the edge allows.
    pub fn body_timeout() -> Self {
        Problem::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_body_timeout",
            "Request body timeout",
            "the request body was not received in time; nothing was done",
        )
    }

    /// 429 with `Retry-After` (whole seconds, rounded up) for an exhausted rate bucket.
    pub fn rate_limited(scope: &'static str, retry_after_ms: u64) -> Self {
        let mut p = Problem::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            "Too many requests",
            format!("too many requests from this {scope}; retry after the Retry-After delay"),
        )
        .with(json!({ "scope": scope }));
        p.retry_after = Some(retry_after_ms.div_ceil(1000).max(1));
        p
    }
}

/// Whether `e` (or any error in its source chain) is the edge's request-body read timeout.
pub fn is_body_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        cur = err.source();
    }
    false
}

/// A body that could not be read (`Bytes` rejection) as a problem: 408 when the edge's body
/// read timeout cut it off, 413 past the size limit, else 400.
pub fn body_rejection(r: axum::extract::rejection::BytesRejection) -> Problem {
    use axum::extract::rejection::BytesRejection as R;
    match &r {
        R::FailedToBufferBody(f) if is_body_timeout(f) => Problem::body_timeout(),
        _ if r.status() == StatusCode::PAYLOAD_TOO_LARGE => Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            "Request body too large",
            r.body_text(),
        ),
        _ => Problem::bad_request("unreadable_body", r.body_text()),
    }
}

/// Gives every error answer a problem+json body: answers made by layers and extractors
/// outside the handlers (the edge's request timeout, axum's own rejections) carry no body or
/// plain text. An error whose content type is already `application/problem+json` passes
/// untouched; so does every success. The status and the other headers (`Allow` on a 405)
/// are kept.
///
/// The only bare 503 the stack produces is the edge's request timeout
/// (`tower_http::timeout::TimeoutLayer`), so a bare 503 becomes `request_timeout`.
pub fn ensure_problem(resp: Response) -> Response {
    let status = resp.status();
    let is_problem = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
    if !(status.is_client_error() || status.is_server_error()) || is_problem {
        return resp;
    }
    let (mut parts, _) = resp.into_parts();
    let mut p = match status {
        StatusCode::SERVICE_UNAVAILABLE => {
            let mut p = Problem::new(
                status,
                "request_timeout",
                "Request timeout",
                "the request did not complete in time; retry it (a request that carries an Idempotency-Key, with the same key)",
            );
            p.retry_after = Some(1);
            p
        }
        StatusCode::REQUEST_TIMEOUT => Problem::body_timeout(),
        StatusCode::NOT_FOUND => Problem::not_found("route"),
        StatusCode::METHOD_NOT_ALLOWED => Problem::new(
            status,
            "method_not_allowed",
            "Method not allowed",
            "this route does not accept that method",
        ),
        StatusCode::PAYLOAD_TOO_LARGE => {
            Problem::new(status, "body_too_large", "Request body too large", "the request body is too large")
        }
        s if s.is_server_error() => {
            Problem::new(s, "internal", "Internal error", "an internal error occurred")
        }
        s => Problem::new(s, "bad_request", "Bad request", "the request could not be processed"),
    };
    p.status = status;
    let fresh = p.into_response();
    parts.headers.remove(header::CONTENT_LENGTH);
    let (fresh_parts, body) = fresh.into_parts();
    for (name, value) in &fresh_parts.headers {
        parts.headers.insert(name.clone(), value.clone());
    }
    Response::from_parts(parts, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_error_answers_get_a_problem_body_and_keep_their_headers() {
        let bare = Response::builder()
            .status(StatusCode::METHOD_NOT_ALLOWED)
            .header(header::ALLOW, "GET")
            .header(header::CONTENT_TYPE, "text/plain")
            .body(axum::body::Body::from("nope"))
            .unwrap();
        let r = ensure_problem(bare);
        assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(r.headers()[header::ALLOW], "GET");
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/problem+json");
        let timeout = ensure_problem(
            Response::builder()
                .status(StatusCode::SERVICE_UNAVAILABLE)
                .body(axum::body::Body::empty())
                .unwrap(),
        );
        assert_eq!(timeout.headers()[header::CONTENT_TYPE], "application/problem+json");
        assert_eq!(timeout.headers()[header::RETRY_AFTER], "1");
        let ok = ensure_problem(Response::new(axum::body::Body::from("fine")));
        assert!(ok.headers().get(header::CONTENT_TYPE).is_none(), "successes pass untouched");
        let problem = Problem::overloaded().into_response();
        let same = ensure_problem(problem);
        let secs: u64 = same.headers()[header::RETRY_AFTER].to_str().unwrap().parse().unwrap();
        assert!((1..=3).contains(&secs), "the problem's own Retry-After is kept: {secs}");
    }
}
