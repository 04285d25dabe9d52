//! HTTP surface: Stripe's `/v1` routes and the unauthenticated `/_sim` control routes.
//!
//! Owns the request pipeline every `/v1` call goes through: authenticate (`Bearer sk_test_…`,
//! or `pk_test_…` where Stripe.js may call), parse the form, claim the idempotency key, apply
//! latency, run the state transition under the ledger lock, queue its events, store the
//! answer for replay, then answer, unless an injected fault fails or drops the answer.
//! Handlers are thin: transitions live in `state.rs`.
//!
//! Invariant: the idempotent result is stored in the same synchronous step that applied the
//! mutation (no await between), so a retry after a dropped or failed answer always sees the
//! applied result and never applies it twice.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::api::{ApiError, Params};
use crate::faults::{AfterApply, RequestFaults, FAULT_HEADER};
use crate::idempotency::{Begin, Stored};
use crate::state::{new_id, Caller, Ctx, State as Ledger, API_VERSION};
use crate::{Faults, StripeSim};

/// Stripe caps idempotency keys at 255 characters.
const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

pub(crate) fn router(sim: StripeSim) -> Router {
    Router::new()
        .route("/v1/payment_intents", post(create_payment_intent).get(list_payment_intents))
        .route("/v1/payment_intents/{id}", get(retrieve_payment_intent))
        .route("/v1/payment_intents/{id}/confirm", post(confirm_payment_intent))
        .route("/v1/payment_intents/{id}/capture", post(capture_payment_intent))
        .route("/v1/payment_intents/{id}/cancel", post(cancel_payment_intent))
        .route("/v1/charges/{id}", get(retrieve_charge))
        .route("/v1/refunds", post(create_refund))
        .route("/v1/refunds/{id}", get(retrieve_refund))
        .route("/v1/disputes", get(list_disputes))
        .route("/v1/disputes/{id}", get(retrieve_dispute))
        .route_layer(axum::middleware::from_fn_with_state(sim.clone(), count_in_flight))
        .route("/_sim/faults", post(set_faults).get(get_faults))
        .route("/_sim/disputes", post(open_dispute))
        .route("/_sim/disputes/{id}/close", post(close_dispute))
        .route("/_sim/clock/advance", post(advance_clock))
        .route("/_sim/stats", get(stats))
        .fallback(unknown_route)
        .with_state(sim)
}

/// Counts a `/v1` request as in progress while it runs (`SimStats::peak_requests_in_flight`).
async fn count_in_flight(
    State(sim): State<StripeSim>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let _counted = crate::InFlight::start(&sim);
    next.run(req).await
}

/// Which keys an endpoint accepts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keys {
    SecretOnly,
    /// Also a publishable key, which must then present the intent's client secret.
    AllowPublishable,
}

async fn create_payment_intent(
    State(sim): State<StripeSim>,
    headers: HeaderMap,
    uri: Uri,
    body: Bytes,
) -> Response {
    mutate(&sim, &headers, &uri, &body, Keys::SecretOnly, |st, ctx| st.create_payment_intent(ctx)).await
}

async fn confirm_payment_intent(
    State(sim): State<StripeSim>,
    Path(id): Path<String>,
    headers: HeaderMap,
    uri: Uri,
    body: Bytes,
) -> Response {
    mutate(&sim, &headers, &uri, &body, Keys::AllowPublishable, |st, ctx| st.confirm(&id, ctx)).await
}

async fn capture_payment_intent(
    State(sim): State<StripeSim>,
    Path(id): Path<String>,
    headers: HeaderMap,
    uri: Uri,
    body: Bytes,
) -> Response {
    mutate(&sim, &headers, &uri, &body, Keys::SecretOnly, |st, ctx| st.capture(&id, ctx)).await
}

async fn cancel_payment_intent(
    State(sim): State<StripeSim>,
    Path(id): Path<String>,
    headers: HeaderMap,
    uri: Uri,
    body: Bytes,
) -> Response {
    mutate(&sim, &headers, &uri, &body, Keys::SecretOnly, |st, ctx| st.cancel(&id, ctx)).await
}

async fn create_refund(State(sim): State<StripeSim>, headers: HeaderMap, uri: Uri, body: Bytes) -> Response {
    mutate(&sim, &headers, &uri, &body, Keys::SecretOnly, |st, ctx| st.refund(ctx)).await
}

async fn retrieve_payment_intent(
    State(sim): State<StripeSim>,
    Path(id): Path<String>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    read(&sim, &headers, q, Keys::AllowPublishable, |st, ctx| st.retrieve_payment_intent(&id, ctx)).await
}

async fn list_payment_intents(
    State(sim): State<StripeSim>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    read(&sim, &headers, q, Keys::SecretOnly, |st, ctx| st.list_payment_intents(ctx)).await
}

async fn retrieve_charge(
    State(sim): State<StripeSim>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    read(&sim, &headers, None, Keys::SecretOnly, |st, _| st.charge(&id)).await
}

async fn retrieve_refund(
    State(sim): State<StripeSim>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    read(&sim, &headers, None, Keys::SecretOnly, |st, _| st.refund_by_id(&id)).await
}

async fn list_disputes(State(sim): State<StripeSim>, headers: HeaderMap, RawQuery(q): RawQuery) -> Response {
    read(&sim, &headers, q, Keys::SecretOnly, |st, ctx| st.list_disputes(ctx)).await
}

async fn retrieve_dispute(
    State(sim): State<StripeSim>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    read(&sim, &headers, None, Keys::SecretOnly, |st, _| st.dispute(&id)).await
}

async fn unknown_route(method: Method, uri: Uri) -> Response {
    let err = ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        None,
        format!("Unrecognized request URL ({method}: {}).", uri.path()),
    );
    respond(err.status, err.body().into(), &new_id("req"), None, false)
}

/// The pipeline of every mutating `/v1` request (see the module doc).
async fn mutate<F>(
    sim: &StripeSim,
    headers: &HeaderMap,
    uri: &Uri,
    body: &[u8],
    keys: Keys,
    op: F,
) -> Response
where
    F: FnOnce(&mut Ledger, &Ctx) -> Result<Value, ApiError>,
{
    let request_id = new_id("req");
    let fail = |e: ApiError| respond(e.status, e.body().into(), &request_id, None, false);
    let caller = match authenticate(headers, keys) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let req_faults = match fault_header(headers) {
        Ok(f) => f,
        Err(e) => return fail(e),
    };
    let params = match Params::parse(body) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let idempotency_key = match headers.get("idempotency-key").map(|v| v.to_str()) {
        None => None,
        Some(Ok(k)) if !k.is_empty() && k.len() <= MAX_IDEMPOTENCY_KEY_LEN => Some(k.to_owned()),
        Some(_) => {
            return fail(ApiError::invalid(
                None,
                "Idempotency-Key",
                "Idempotency-Key must be 1-255 visible ASCII characters.",
            ))
        }
    };
    let claim = match &idempotency_key {
        None => None,
        Some(key) => {
            match sim.shared.idempotency.begin(caller.key(), key, uri.path(), params.fingerprint()) {
                Begin::Execute(claim) => Some(claim),
                Begin::Replay(stored) => {
                    sim.count_replay();
                    return respond(stored.status, stored.body, &request_id, Some(key), true);
                }
                Begin::Reject(e) => return respond(e.status, e.body().into(), &request_id, Some(key), false),
            }
        }
    };
    let latency_ms = sim.with_fault_state(|f| f.latency_ms(req_faults));
    if latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(latency_ms)).await;
    }

    let ctx = Ctx { caller, params, now: sim.now(), request_id, idempotency_key };
    let result = sim.with_ledger(ctx.now, |st| op(st, &ctx));
    let (status, body, replayable) = match result {
        Ok(v) => (StatusCode::OK, Bytes::from(serde_json::to_vec(&v).expect("JSON values serialize")), true),
        Err(e) => (e.status, Bytes::from(e.body()), e.replayable),
    };
    if let Some(claim) = claim {
        if replayable {
            claim.complete(Stored { status, body: body.clone() });
        } else {
            claim.release();
        }
    }

    let key = ctx.idempotency_key.as_deref();
    match sim.with_fault_state(|f| f.after_apply(req_faults)) {
        AfterApply::Answer => respond(status, body, &ctx.request_id, key, false),
        AfterApply::Fail500 => {
            tracing::info!(request.id = %ctx.request_id, path = %uri.path(), "fault: answering 500 after apply");
            let e = ApiError::internal();
            respond(e.status, e.body().into(), &ctx.request_id, key, false)
        }
        AfterApply::DropResponse => {
            tracing::info!(request.id = %ctx.request_id, path = %uri.path(), "fault: dropping response after apply");
            // Never answer; the client times out and hangs up. Released at shutdown so
            // graceful shutdown does not wait on us forever.
            sim.shared.hangup.cancelled().await;
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
    }
}

/// The pipeline of every read-only `/v1` request: auth, latency, lookup.
async fn read<F>(sim: &StripeSim, headers: &HeaderMap, query: Option<String>, keys: Keys, op: F) -> Response
where
    F: FnOnce(&mut Ledger, &Ctx) -> Result<Value, ApiError>,
{
    let request_id = new_id("req");
    let parsed = (|| {
        let caller = authenticate(headers, keys)?;
        let req_faults = fault_header(headers)?;
        let params = Params::parse(query.as_deref().unwrap_or("").as_bytes())?;
        Ok::<_, ApiError>((caller, req_faults, params))
    })();
    let (caller, req_faults, params) = match parsed {
        Ok(p) => p,
        Err(e) => return respond(e.status, e.body().into(), &request_id, None, false),
    };
    let latency_ms = sim.with_fault_state(|f| f.latency_ms(req_faults));
    if latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(latency_ms)).await;
    }
    let ctx = Ctx { caller, params, now: sim.now(), request_id, idempotency_key: None };
    let result = sim.with_ledger(ctx.now, |st| op(st, &ctx));
    sim.count_read();
    let answer_delay_ms = sim.with_fault_state(|f| f.faults.answer_delay_ms);
    if answer_delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(answer_delay_ms)).await;
    }
    match result {
        Ok(v) => respond(
            StatusCode::OK,
            serde_json::to_vec(&v).expect("JSON values serialize").into(),
            &ctx.request_id,
            None,
            false,
        ),
        Err(e) => respond(e.status, e.body().into(), &ctx.request_id, None, false),
    }
}

/// `Authorization: Bearer <key>`; test-mode keys only.
fn authenticate(headers: &HeaderMap, keys: Keys) -> Result<Caller, ApiError> {
    let value = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).unwrap_or("");
    let Some(key) = value.strip_prefix("Bearer ").or_else(|| value.strip_prefix("bearer ")).map(str::trim)
    else {
        return Err(ApiError::unauthorized(
            "You did not provide an API key. You need to provide your API key in the Authorization header, \
             using Bearer auth (e.g. 'Authorization: Bearer YOUR_SECRET_KEY').",
        ));
    };
    let has_body = |prefix: &str| key.len() > prefix.len() && key.starts_with(prefix);
    if has_body("sk_test_") {
        Ok(Caller::Secret(key.to_owned()))
    } else if has_body("pk_test_") && keys == Keys::AllowPublishable {
        Ok(Caller::Publishable(key.to_owned()))
    } else if has_body("pk_test_") {
        Err(ApiError::unauthorized(
            "This API call cannot be made with a publishable API key. Please use a secret API key.",
        ))
    } else {
        // Stripe echoes a redacted key; we echo only its kind.
        let kind = key.get(..8).filter(|p| p.ends_with('_')).unwrap_or("");
        Err(ApiError::unauthorized(format!("Invalid API Key provided: {kind}****")))
    }
}

fn fault_header(headers: &HeaderMap) -> Result<RequestFaults, ApiError> {
    let value = headers.get(FAULT_HEADER).map(|v| v.to_str().unwrap_or("<non-ascii>"));
    RequestFaults::parse(value).map_err(|m| ApiError::invalid(None, FAULT_HEADER, m))
}

/// A JSON answer with Stripe's response headers.
fn respond(
    status: StatusCode,
    body: Bytes,
    request_id: &str,
    idempotency_key: Option<&str>,
    replayed: bool,
) -> Response {
    let mut resp = (status, body).into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    h.insert("stripe-version", HeaderValue::from_static(API_VERSION));
    if let Ok(v) = HeaderValue::from_str(request_id) {
        h.insert("request-id", v);
    }
    if let Some(v) = idempotency_key.and_then(|k| HeaderValue::from_str(k).ok()) {
        h.insert("idempotency-key", v);
    }
    if replayed {
        h.insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    resp
}

async fn set_faults(State(sim): State<StripeSim>, Json(faults): Json<Faults>) -> Json<Faults> {
    sim.set_faults(faults.clone());
    Json(faults)
}

async fn get_faults(State(sim): State<StripeSim>) -> Json<Faults> {
    Json(sim.faults())
}

#[derive(Deserialize)]
struct Advance {
    seconds: i64,
}

async fn advance_clock(State(sim): State<StripeSim>, Json(a): Json<Advance>) -> Json<Value> {
    sim.advance_clock(a.seconds);
    Json(json!({ "now": sim.now() }))
}

#[derive(serde::Deserialize)]
struct OpenDispute {
    payment_intent: String,
}

/// Test control: the cardholder's bank disputes the captured charge of a PaymentIntent.
async fn open_dispute(State(sim): State<StripeSim>, Json(d): Json<OpenDispute>) -> Response {
    match sim.open_dispute(&d.payment_intent) {
        Ok(id) => Json(json!({ "id": id })).into_response(),
        Err(e) => (StatusCode::BAD_REQUEST, e).into_response(),
    }
}

#[derive(serde::Deserialize)]
struct CloseDispute {
    won: bool,
}

/// Test control: a dispute closes, won or lost.
async fn close_dispute(
    State(sim): State<StripeSim>,
    Path(id): Path<String>,
    Json(c): Json<CloseDispute>,
) -> Response {
    match sim.close_dispute(&id, c.won) {
        Ok(()) => Json(json!({ "id": id, "status": if c.won { "won" } else { "lost" } })).into_response(),
        Err(e) => (StatusCode::BAD_REQUEST, e).into_response(),
    }
}

async fn stats(State(sim): State<StripeSim>) -> Json<crate::SimStats> {
    Json(sim.stats())
}
