//! Route table and handlers. Handlers authenticate, validate and delegate to the ledger;
//! they contain no SQL.

use crate::auth::{ApiJson, IdPath, IdempotencyKey, User};
use crate::problem::{ErrorChain, Problem};
use crate::state::AppState;
use crate::webhooks;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use boxoffice_admission::AdmissionError;
use boxoffice_domain::{EventId, OrderId, SeatId};
use boxoffice_store::holds::{self, ReserveOutcome, ReserveRequest};
use boxoffice_store::{orders, venue};
use serde::Deserialize;
use serde_json::json;
use std::time::Instant;
use uuid::Uuid;

/// Webhook requests in flight per process; more are shed at once with 503 `overloaded` (Stripe
/// redelivers). Far above Stripe's delivery concurrency, far below `http_max_concurrent_requests`.
pub const WEBHOOK_MAX_CONCURRENT: usize = 64;

/// `/readyz` requests in flight per process; more are shed at once with 503 `overloaded`.
/// A probe takes an API pool connection and may wait up to 1.5 s on the broker, so a crowd
/// of probes must not take the buyers' connections.
pub const OPS_MAX_CONCURRENT: usize = 8;

/// Operations requests (`/readyz`, `/metrics`, `/openapi.json`) in flight per client address,
/// counted together; more get 429 `too_many_in_flight`.
pub const OPS_MAX_IN_FLIGHT_PER_IP: usize = 4;

/// The queue routes' 503s that mean the waiting room could not answer (Redis unavailable or
/// too slow, the queue's bulkhead full): their refusal streaks pause the waiting room's lapse
/// clock (`boxoffice_waitroom::Waitroom::note_refused`). Not `unavailable` (the database) nor
/// `event_moving`, which say nothing about whether a poll could be answered.
pub const QUEUE_REFUSALS: &[&str] = &["waitroom_unavailable", "overloaded"];

/// The whole API.
pub fn router(state: AppState) -> Router {
    let limit = state.settings.max_body_bytes;
    use axum::middleware::from_fn_with_state as buckets;
    let hops = state.settings.trusted_proxy_hops;
    let buyer_in_flight =
        crate::edge::PerClientInFlight::new("buyer", state.settings.max_in_flight_per_ip, hops);
    let in_flight = |l: &std::sync::Arc<crate::edge::PerClientInFlight>| {
        axum::middleware::from_fn_with_state(l.clone(), crate::edge::limit_in_flight)
    };
    // Outermost first: the per-client bound, the widening of the queue's 503s while they
    // keep coming (a sixth of the lapse time at most, so a buyer who polls when told keeps
    // its position through three of them at the cap), the queue's bulkhead (a share of the
    // process's slots, so a crowd waiting on a slow Redis — its buckets included — cannot
    // take every slot), then the rate buckets.
    // A streak past its first second of answers the waiting room could not give (Redis
    // unavailable, the queue's bulkhead full) is also a pause of its lapse clock, so the
    // buyers it refused keep their positions for that time.
    let waitroom = state.waitroom.clone();
    let refusals = std::sync::Arc::new(
        crate::edge::RefusalBackoff::new("queue", state.waitroom.config().abandon_after_ms / 6 / 1_000)
            .noting(QUEUE_REFUSALS, move |from, to| waitroom.note_refused(from, to)),
    );
    let queue = Router::new()
        .route("/events/{event_id}/queue", post(crate::queue::join))
        .route("/queue/{ticket}", get(crate::queue::status).delete(crate::queue::leave))
        .route_layer(buckets(state.clone(), crate::limits::queue))
        .route_layer(crate::edge::bulkhead("queue", state.settings.queue_max_concurrent))
        .route_layer(axum::middleware::map_response_with_state(refusals, crate::edge::widen_retry_after))
        .route_layer(in_flight(&buyer_in_flight));
    let mut purchase = Router::new();
    if state.settings.admission_direct {
        purchase = purchase.route("/events/{event_id}/admission", post(admit));
    }
    // Holds have a bulkhead of their own (a share of the process's slots): their bodies are
    // read after the tokens are checked, but admitted buyers with slow bodies must not take
    // the slots of the seat map, order status, the queue and webhooks.
    let holds = Router::new()
        .route("/events/{event_id}/holds", post(create_hold))
        .route_layer(crate::edge::bulkhead("holds", state.settings.holds_max_concurrent));
    let purchase = purchase
        .merge(holds)
        .route("/orders/{order_id}", get(get_order))
        .route("/orders/{order_id}/events", get(crate::order_stream::order_events))
        .route_layer(buckets(state.clone(), crate::limits::purchase))
        .route_layer(in_flight(&buyer_in_flight));
    let catalog = Router::new()
        .route("/events/{event_id}/seats", get(seat_map))
        .route_layer(buckets(state.clone(), crate::limits::seats))
        .route_layer(in_flight(&buyer_in_flight));
    // A bulkhead for webhook ingress: its bodies are read before the signature can be
    // checked, so slow senders are bounded here, apart from the process-wide limit, and can
    // never take every slot (`/healthz` included): outermost first, the allowed networks,
    // a few requests in flight per sender, a short whole-request timeout, and the bulkhead.
    let webhook_in_flight =
        crate::edge::PerClientInFlight::new("webhook", state.settings.webhook_max_in_flight_per_ip, hops);
    let webhooks = Router::new()
        .route("/webhooks/stripe", post(stripe_webhook))
        .route_layer(crate::edge::bulkhead("webhooks", WEBHOOK_MAX_CONCURRENT))
        .route_layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            state.settings.webhook_timeout,
        ))
        .route_layer(in_flight(&webhook_in_flight))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), webhook_source));
    // Probes, scrapes and the API's description: a few in flight per client address, all
    // three together, so that no crowd of them takes the process's slots.
    let ops_in_flight = crate::edge::PerClientInFlight::new("ops", OPS_MAX_IN_FLIGHT_PER_IP, hops);
    // `/readyz` waits on the pool and the broker: a bulkhead of its own, so slow probes can
    // neither take the buyers' connections nor shed the metrics scrape.
    let probes = Router::new()
        .route("/readyz", get(readyz))
        .route_layer(crate::edge::bulkhead("ops", OPS_MAX_CONCURRENT))
        .route_layer(in_flight(&ops_in_flight));
    let ops = Router::new()
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi_document))
        .route_layer(in_flight(&ops_in_flight))
        .merge(probes);
    Router::new()
        .merge(queue)
        .merge(purchase)
        .merge(catalog)
        .merge(webhooks)
        .merge(ops)
        .merge(crate::admin::routes(&state))
        .route("/healthz", get(|| async { "ok" }))
        .fallback(|| async { Problem::not_found("route") })
        .method_not_allowed_fallback(|| async {
            Problem::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "Method not allowed",
                "this route does not accept that method",
            )
        })
        .layer(DefaultBodyLimit::max(limit))
        // A declared `Content-Length` over the limit is refused at once (413, made
        // problem+json by the edge), before a byte of the body is read: otherwise the request
        // holds its slot and bulkhead until the body passes the limit or a timeout answers 503.
        .layer(tower_http::limit::RequestBodyLimitLayer::new(limit))
        .layer(
            tower_http::trace::TraceLayer::new_for_http()
                .make_span_with(crate::spans::RequestSpan::new(&state.settings.labels))
                .on_response(crate::spans::record_status)
                .on_failure(log_failure),
        )
        .with_state(state)
}

/// Logs a failed response: 503s (shed, timed out, a dependency away) are answers the edge
/// gives on purpose under load and are counted by their own metrics, so they are logged at
/// `debug` (at `error` they would flood the log exactly when the process is short of CPU);
/// every other failure at `error`.
fn log_failure(
    class: tower_http::classify::ServerErrorsFailureClass,
    latency: std::time::Duration,
    _span: &tracing::Span,
) {
    use tower_http::classify::ServerErrorsFailureClass as C;
    let latency_ms = latency.as_millis() as u64;
    match class {
        C::StatusCode(StatusCode::SERVICE_UNAVAILABLE) => {
            tracing::debug!(classification = %class, latency_ms, "response failed")
        }
        _ => tracing::error!(classification = %class, latency_ms, "response failed"),
    }
}

/// `POST /events/{event_id}/admission` → 201 `{admission_token, expires_at, purchase_cell}`:
/// admission at once, without the queue. Served only with `admission_direct` (development,
/// tests, the in-process onsale); in production buyers come through `POST
/// /events/{event_id}/queue`.
#[utoipa::path(post, path = "/events/{event_id}/admission", tag = "purchase",
    params(("event_id" = Uuid, Path, description = "Event id")),
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Admitted (only when the deployment enables `admission_direct`; otherwise 404)", body = crate::openapi::Admission),
        (status = 400, description = "`invalid_path`: the event id is not a UUID", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 401, description = "`unauthenticated`: no or invalid bearer token", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 404, description = "`not_found`: no such event (or the deployment does not serve this route)", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 409, description = "`event_in_another_cell`: another purchase cell sells the event (`purchase_cell`)", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 429, description = "`rate_limited` (per IP or per user, named in `scope`), or `too_many_in_flight` (this client address has `max_in_flight` requests in progress); `Retry-After` in seconds", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 503, description = "`unavailable`: the database is unavailable; `event_moving`: the event is moving to another purchase cell; `Retry-After`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
    ))]
async fn admit(
    State(st): State<AppState>,
    user: User,
    IdPath(event): IdPath<Uuid>,
) -> Result<Response, Problem> {
    let epoch = crate::queue::minting_epoch(&st, event).await?;
    let (token, claims) = st.admission.issue(user.0, EventId(event), epoch, st.settings.admission_ttl_s);
    let expires_at = chrono::DateTime::from_timestamp(claims.exp, 0).unwrap_or_else(chrono::Utc::now);
    Ok((
        StatusCode::CREATED,
        Json(crate::openapi::Admission {
            admission_token: token,
            expires_at,
            purchase_cell: claims.purchase_cell,
        }),
    )
        .into_response())
}

/// Body of `POST /events/{event_id}/holds`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HoldBody {
    /// 1–8 seat ids of the event.
    #[schema(min_items = 1, max_items = 8)]
    pub seat_ids: Vec<SeatId>,
}

/// `POST /events/{event_id}/holds` → 202 + `Location: /orders/{id}` with the hold receipt;
/// the same key and body again → the original 202; errors as problem+json.
#[utoipa::path(post, path = "/events/{event_id}/holds", tag = "purchase",
    params(
        ("event_id" = Uuid, Path, description = "Event id"),
        ("Idempotency-Key" = String, Header, min_length = 1, max_length = 255, pattern = "^[!-~]+$",
            description = "1–255 visible ASCII characters (`!` to `~`); the same user + key + body returns the original order"),
        ("X-Admission-Token" = String, Header, description = "Admission token for this user, event and purchase cell"),
    ),
    request_body = HoldBody,
    security(("bearer" = [])),
    responses(
        (status = 202, description = "Seats held; `Location: /orders/{order_id}`. A replay carries `Idempotent-Replayed: true`.", body = boxoffice_store::holds::HoldReceipt),
        (status = 400, description = "`invalid_path` (the event id is not a UUID), `idempotency_key_missing`, `idempotency_key_invalid`, `malformed_json` or `unreadable_body`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 401, description = "`unauthenticated`: no or invalid bearer token", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 403, description = "`admission_token_missing`, `_malformed`, `_expired`, `_wrong_user`, `_wrong_event`, `_wrong_cell`, `_bad_signature`, `_unknown_kid` or `_revoked` (the admission token; instead of `_expired` or `_revoked`, the buyer's own earlier hold with the same Idempotency-Key and seats is answered 202, as a retry); `sales_not_open` (with `opens_at`) or `sales_closed`: outside the event's sales window", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 404, description = "`not_found`: no such event (whatever the admission token says)", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 408, description = "`request_body_timeout`: the body stalled; nothing was held", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 409, description = "`seat_unavailable` (nothing was held), `buyer_limit_reached` (the event's `max_seats_per_buyer` or `max_active_holds_per_buyer`, named in `limit`), `idempotency_key_conflict` or `idempotency_key_in_use` (`Retry-After`); `event_in_another_cell` (another purchase cell sells the event, named in `purchase_cell`) or `admission_token_stale_epoch` (the token was minted before the event moved): get a new admission", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 413, description = "`body_too_large`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 415, description = "`unsupported_media_type`: the body must be `application/json`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 422, description = "`seat_count` (outside 1–8), `unknown_seats` (not this event's), or `invalid_body` (a body of the wrong shape)", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 429, description = "`rate_limited` (per IP or per user, named in `scope`), or `too_many_in_flight` (this client address has `max_in_flight` requests in progress); `Retry-After` in seconds", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 503, description = "`unavailable` (the database), `overloaded` (this process has `holds_max_concurrent_requests` hold requests in progress), `fault_injected`, `revocation_check_failed` (Redis answered with an error), `event_moving` (the event is moving to another purchase cell) or `region_fenced` (this region does not write now, design §15); retry with the same Idempotency-Key after `Retry-After`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
    ))]
#[tracing::instrument(name = "hold", skip_all, fields(
    event.id = %event,
    order.id = tracing::field::Empty,
    correlation_id = tracing::field::Empty,
    region = %st.settings.labels.region,
    purchase_cell = %st.settings.labels.purchase_cell,
))]
async fn create_hold(
    State(st): State<AppState>,
    user: User,
    IdPath(event): IdPath<Uuid>,
    key: IdempotencyKey,
    headers: HeaderMap,
    req: axum::extract::Request,
) -> Result<Response, Problem> {
    use axum::extract::FromRequest;
    let started = Instant::now();
    if !st.may_write() {
        return Err(Problem::region_fenced(boxoffice_store::region::Refusal::LeaseLapsed));
    }
    // An unknown event is a 404 whatever the token says (from the event cache: no query
    // per request).
    crate::queue::event_info(&st, event).await?;
    let token =
        headers.get("x-admission-token").and_then(|v| v.to_str().ok()).ok_or(AdmissionError::Missing)?;
    let admitted = match st.admission.verify(token, user.0, EventId(event)) {
        Ok(claims) => st.revocations.check(claims.jti).await.map(|()| claims),
        Err(e) => Err(Problem::from(e)),
    };
    let claims = match admitted {
        Ok(claims) => claims,
        // A token refused as expired (any validly signed one: expiry is judged before whom
        // and what it is for) or revoked places no hold, but the buyer's own key gets its
        // answer back (invariant 3): the key is this user's, its hash binds event and seats.
        Err(refused) if LAPSED_ADMISSION.iter().any(|e| e.code() == refused.code) => {
            let Ok(ApiJson(body)) = ApiJson::<HoldBody>::from_request(req, &st).await else {
                return Err(refused);
            };
            let Some(receipt) =
                holds::replay(&st.pool, user.0, EventId(event), &body.seat_ids, &key.0).await?
            else {
                return Err(refused);
            };
            metrics::histogram!("boxoffice_hold_seconds", "outcome" => "replayed")
                .record(started.elapsed().as_secs_f64());
            return Ok(hold_response(&ReserveOutcome::Replayed(receipt)));
        }
        Err(refused) => return Err(refused),
    };
    // The body last: a request without a valid admission is refused before it is read (but
    // for a possible retry, above).
    let ApiJson(body) = ApiJson::<HoldBody>::from_request(req, &st).await?;
    let correlation_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(Uuid::new_v4);
    tracing::Span::current().record("correlation_id", tracing::field::display(correlation_id));
    let req = ReserveRequest {
        user_id: user.0,
        event_id: EventId(event),
        seat_ids: body.seat_ids,
        idempotency_key: key.0,
        correlation_id,
        ttl: st.settings.hold_policy.ttl,
        payable_within: Some(st.settings.hold_policy.ceiling),
        cell: st.admission.cell().to_owned(),
        directory_epoch: claims.directory_epoch,
        authorization_request: st.settings.authorization_request,
    };
    let outcome = holds::reserve(&st.pool, &req).await;
    let label = match &outcome {
        Ok(ReserveOutcome::Created(_)) => "created",
        Ok(ReserveOutcome::Replayed(_)) => "replayed",
        Err(holds::ReserveError::SeatUnavailable { .. }) => {
            st.dashboard.count_conflict(EventId(event));
            "seat_unavailable"
        }
        Err(_) => "error",
    };
    metrics::histogram!("boxoffice_hold_seconds", "outcome" => label).record(started.elapsed().as_secs_f64());
    Ok(hold_response(&outcome?))
}

/// Admission refusals after which a hold request may still be a retry of the buyer's own
/// hold: answered from the buyer's idempotency key when it holds this request's answer,
/// refused as before when not.
const LAPSED_ADMISSION: [AdmissionError; 2] = [AdmissionError::Expired, AdmissionError::Revoked];

/// 202 with the hold's receipt and `Location`; `Idempotent-Replayed: true` on a replay.
fn hold_response(outcome: &ReserveOutcome) -> Response {
    let receipt = outcome.receipt();
    tracing::Span::current().record("order.id", tracing::field::display(receipt.order_id));
    let mut resp = (StatusCode::ACCEPTED, Json(receipt)).into_response();
    let location = format!("/orders/{}", receipt.order_id);
    resp.headers_mut().insert(header::LOCATION, HeaderValue::from_str(&location).expect("uuid path"));
    if matches!(outcome, ReserveOutcome::Replayed(_)) {
        resp.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    resp
}

/// `GET /orders/{order_id}` → 200 order view, 404 when missing or not the caller's.
#[utoipa::path(get, path = "/orders/{order_id}", tag = "purchase",
    params(("order_id" = Uuid, Path, description = "Order id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The order's workflow state; `client_secret` only while payment is pending", body = boxoffice_store::orders::OrderView),
        (status = 400, description = "`invalid_path`: the order id is not a UUID", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 401, description = "`unauthenticated`: no or invalid bearer token", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 404, description = "`not_found`: no such order, or not the caller's", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 429, description = "`rate_limited` (per IP or per user, named in `scope`), or `too_many_in_flight` (this client address has `max_in_flight` requests in progress); `Retry-After` in seconds", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 503, description = "`unavailable`: the database is unavailable; `Retry-After`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
    ))]
async fn get_order(
    State(st): State<AppState>,
    user: User,
    IdPath(order): IdPath<Uuid>,
) -> Result<Response, Problem> {
    match orders::view(&st.pool, OrderId(order), user.0).await? {
        Some(v) => {
            let mut resp = Json(v).into_response();
            // Carries the client secret while payment is pending: never cache.
            resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            Ok(resp)
        }
        None => Err(Problem::not_found("order")),
    }
}

/// `GET /events/{event_id}/seats` → `{event_id, generated_at, seats: [...]}`; rendered at most
/// once per `seat_map_max_age_ms` per event. A hint: only the hold transaction decides.
#[utoipa::path(get, path = "/events/{event_id}/seats", tag = "catalog",
    params(("event_id" = Uuid, Path, description = "Event id")),
    responses(
        (status = 200, description = "Availability map, at most 1 s stale (a hint, never a promise)", body = crate::openapi::SeatMap),
        (status = 400, description = "`invalid_path`: the event id is not a UUID", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 404, description = "`not_found`: no such event", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 429, description = "`rate_limited` (per IP, `scope` = `ip`), or `too_many_in_flight`; `Retry-After` in seconds", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 503, description = "`unavailable`: the database is unavailable; `Retry-After`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
    ))]
async fn seat_map(State(st): State<AppState>, IdPath(event): IdPath<Uuid>) -> Result<Response, Problem> {
    // Per event and single-flight: concurrent misses for one id wait for one render, other
    // ids render beside it; an unknown id is cached as `None` like a map, so junk ids reach
    // the ledger at most once per id and max age.
    let body = st
        .seat_maps
        .try_get_with(event, render_seat_map(&st, event))
        .await
        .map_err(|e| Problem::database(&e))?;
    let Some(body) = body else {
        return Err(Problem::not_found("event"));
    };
    Ok(([(header::CONTENT_TYPE, "application/json"), (header::CACHE_CONTROL, "max-age=1")], body)
        .into_response())
}

/// One read of the ledger for `event`'s map (`None`: no such event), serialized once.
/// Counted in `boxoffice_seat_map_renders_total{outcome}` (`found`, `unknown`).
async fn render_seat_map(st: &AppState, event: Uuid) -> Result<Option<Bytes>, sqlx::Error> {
    let seats = venue::seat_map(&st.pool, EventId(event)).await?;
    let outcome = if seats.is_some() { "found" } else { "unknown" };
    metrics::counter!("boxoffice_seat_map_renders_total", "outcome" => outcome).increment(1);
    Ok(seats.map(|seats| {
        Bytes::from(
            serde_json::to_vec(&crate::openapi::SeatMap {
                event_id: event,
                generated_at: chrono::Utc::now(),
                seats,
            })
            .expect("seat map serializes"),
        )
    }))
}

/// `POST /webhooks/stripe`: 400 on a missing/bad signature (nothing written), 200 once the
/// event and its continuation are committed, 503 if the database is unavailable (Stripe
/// retries).
#[utoipa::path(post, path = "/webhooks/stripe", tag = "webhooks",
    params(("Stripe-Signature" = String, Header, description = "t=<unix>,v1=<hex HMAC-SHA256 of \"t.body\">")),
    request_body(content = String, description = "A Stripe Event, raw JSON", content_type = "application/json"),
    responses(
        (status = 200, description = "Recorded (or a known duplicate)", body = crate::openapi::WebhookAck),
        (status = 400, description = "`invalid_signature` (missing or not verifying; nothing written), `malformed_event` (signed, but not a Stripe event, or naming no usable id; nothing written) or `unreadable_body`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 403, description = "`webhook_source_refused`: not from `webhook_allowed_networks`; nothing read or written", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 408, description = "`request_body_timeout`: the body stalled longer than the edge's `body_read_timeout` between two chunks, within `webhook_timeout_ms`; nothing written", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 429, description = "`too_many_in_flight`: this sender has `webhook_max_in_flight_per_ip` requests in progress; nothing written", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 413, description = "`body_too_large`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 503, description = "`unavailable`, `region_fenced` (this region does not write now, design §15), `fault_injected`, or `request_timeout` (the request, its body included, ran past `webhook_timeout_ms`: a body that stalls then ends here when `webhook_timeout_ms` is the shorter): nothing committed; Stripe retries", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
    ))]
async fn stripe_webhook(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Response, Problem> {
    let body = body.map_err(crate::problem::body_rejection)?;
    let sig = headers.get("stripe-signature").and_then(|v| v.to_str().ok()).unwrap_or("");
    let event = boxoffice_payments::webhook::verify(
        &body,
        sig,
        secrecy::ExposeSecret::expose_secret(&st.settings.webhook_secret),
        st.settings.webhook_tolerance_s,
        chrono::Utc::now().timestamp(),
    )
    .map_err(|e| {
        tracing::warn!(error = %ErrorChain(&e), "webhook rejected");
        if let boxoffice_payments::webhook::WebhookError::BadPayload(_) = e {
            // Signed with our secret, yet not a Stripe Event: the sender holds the secret.
            metrics::counter!("boxoffice_stripe_webhooks_total", "outcome" => "malformed_event").increment(1);
            return Problem::bad_request("malformed_event", "the signed body is not a Stripe event");
        }
        metrics::counter!("boxoffice_stripe_webhooks_total", "outcome" => "bad_signature").increment(1);
        Problem::bad_request("invalid_signature", "the Stripe-Signature header does not verify")
    })?;
    // Verified first (a forged body learns nothing about the region), then refused with a
    // 503 Stripe retries until the traffic switch sends it to the region that writes.
    if !st.may_write() {
        return Err(Problem::region_fenced(boxoffice_store::region::Refusal::LeaseLapsed));
    }
    let span = crate::spans::webhook_span(&event, &st.settings.labels);
    let outcome = tracing::Instrument::instrument(st.webhooks.ingest(event), span).await?;
    Ok(Json(crate::openapi::WebhookAck {
        received: true,
        duplicate: outcome == webhooks::Ingested::Duplicate,
    })
    .into_response())
}

/// Webhook ingress only from `webhook_allowed_networks` (when any is configured): others get
/// 403 `webhook_source_refused` before their body is read.
async fn webhook_source(
    State(st): State<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let peer = req.extensions().get::<axum::extract::ConnectInfo<std::net::SocketAddr>>().map(|c| c.0.ip());
    if let Some(refused) = crate::edge::webhook_source_refusal(
        &st.settings.webhook_allowed_networks,
        peer,
        req.headers(),
        st.settings.trusted_proxy_hops,
    ) {
        return refused.into_response();
    }
    next.run(req).await
}

/// `GET /readyz`: 200 when the database answers (and the producer reaches a broker, when
/// this process runs one, its region lease holds, when a witness is configured, and its order
/// streams' view reader has not stopped); 503 otherwise.
async fn readyz(State(st): State<AppState>) -> Response {
    let db = boxoffice_store::ping(&st.pool).await;
    let broker = match &st.producer {
        Some(p) => {
            let p = p.clone();
            tokio::task::spawn_blocking(move || boxoffice_bus::producer::healthy(&p)).await.unwrap_or(false)
        }
        None => true,
    };
    let lease = st.may_write();
    let streams = !st.order_streams.reader_stopped();
    let status =
        if db && broker && lease && streams { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(json!({"database": db, "broker": broker, "region_lease": lease, "order_streams": streams})))
        .into_response()
}

/// The OpenAPI document, built once per process.
async fn openapi_document() -> Json<&'static utoipa::openapi::OpenApi> {
    static DOCUMENT: std::sync::OnceLock<utoipa::openapi::OpenApi> = std::sync::OnceLock::new();
    Json(DOCUMENT.get_or_init(crate::openapi::document))
}

/// `GET /metrics`: Prometheus text exposition.
async fn metrics(State(st): State<AppState>) -> Response {
    match &st.metrics {
        Some(h) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], h.render()).into_response(),
        None => Problem::not_found("metrics").into_response(),
    }
}
