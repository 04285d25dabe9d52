//! An order's timeline for operators (design §16): the ledger's story of the order
//! ([`boxoffice_store::timeline`]) beside what the payment provider says now about every
//! PaymentIntent it names. Served as `GET /admin/orders/{id}/timeline` and printed by
//! `boxoffice timeline`. Reads only; never a client secret (the provider's answer is reduced
//! to ids, amounts and statuses before it leaves here).

use boxoffice_payments::PaymentGateway;
use boxoffice_store::timeline::{self, Slo, Timeline};
use serde::Serialize;
use std::time::Duration;
use uuid::Uuid;

/// How long the provider may take per PaymentIntent before the timeline gives up on it.
pub const PROVIDER_TIMEOUT: Duration = Duration::from_secs(3);

/// At most this many PaymentIntents are looked up at the provider per timeline.
pub const PROVIDER_MAX_INTENTS: usize = 8;

/// The provider's view of one PaymentIntent.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ProviderIntent {
    /// `pi_…`
    pub id: String,
    /// The provider's status now (`requires_capture`, `succeeded`, `canceled`, …); `None`
    /// when it could not be read (`error` says why).
    pub status: Option<String>,
    /// Amount, captured amount and still-capturable amount, minor units.
    pub amount: Option<i64>,
    /// See `amount`.
    pub amount_received: Option<i64>,
    /// See `amount`.
    pub amount_capturable: Option<i64>,
    /// Why it was canceled, when it was.
    pub cancellation_reason: Option<String>,
    /// The order its metadata names.
    pub metadata_order_id: Option<String>,
    /// Whether the ledger records the same status (only for the order's current intent).
    pub agrees_with_ledger: Option<bool>,
    /// Why it could not be read.
    pub error: Option<String>,
}

/// The timeline with the provider's side.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct OrderTimeline {
    /// The ledger's story.
    #[serde(flatten)]
    pub timeline: Timeline,
    /// The provider's view of each PaymentIntent the facts name; empty when no provider
    /// was asked.
    pub provider: Vec<ProviderIntent>,
    /// Whether the provider was asked.
    pub provider_checked: bool,
}

/// Reads order `order`'s timeline and, with a `gateway`, the provider's view of its
/// PaymentIntents (each bounded by [`PROVIDER_TIMEOUT`]; a failure is reported in the entry,
/// never as an error). `None` when the ledger has no such order.
///
/// # Errors
/// Database errors.
pub async fn read(
    pool: &sqlx::PgPool,
    gateway: Option<&dyn PaymentGateway>,
    order: Uuid,
    slo: Slo,
) -> Result<Option<OrderTimeline>, sqlx::Error> {
    let Some(timeline) = timeline::read(pool, order, &boxoffice_domain::consumers::ALL, slo).await? else {
        return Ok(None);
    };
    let mut provider = Vec::new();
    if let Some(gw) = gateway {
        for id in timeline.payment_intents.iter().take(PROVIDER_MAX_INTENTS) {
            let current = timeline.order.payment_intent_id.as_deref() == Some(id.as_str());
            let entry = match tokio::time::timeout(PROVIDER_TIMEOUT, gw.retrieve_payment_intent(id)).await {
                Ok(Ok(pi)) => {
                    let status = pi.status.as_str().to_owned();
                    ProviderIntent {
                        id: id.clone(),
                        agrees_with_ledger: current
                            .then(|| timeline.order.payment_status.as_deref() == Some(status.as_str())),
                        status: Some(status),
                        amount: Some(pi.amount),
                        amount_received: Some(pi.amount_received),
                        amount_capturable: Some(pi.amount_capturable),
                        cancellation_reason: pi.cancellation_reason.clone(),
                        metadata_order_id: pi.metadata.get("order_id").cloned(),
                        error: None,
                    }
                }
                Ok(Err(e)) => unread(id, e.to_string()),
                Err(_) => unread(id, format!("no answer within {} s", PROVIDER_TIMEOUT.as_secs())),
            };
            provider.push(entry);
        }
    }
    Ok(Some(OrderTimeline { timeline, provider, provider_checked: gateway.is_some() }))
}

/// Query of `GET /admin/orders/{order_id}/timeline`.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct TimelineQuery {
    /// Ask the payment provider about each PaymentIntent (default true).
    pub provider: Option<bool>,
}

/// `GET /admin/orders/{order_id}/timeline` (operator token) → the order's [`OrderTimeline`].
#[utoipa::path(get, path = "/admin/orders/{order_id}/timeline", tag = "operator",
    params(("order_id" = Uuid, Path, description = "Order id"), TimelineQuery),
    security(("admin" = [])),
    responses(
        (status = 200, description = "The order's story: its state now, every step (one ledger transaction) with its actor, status changes, facts, webhooks and incidents, the provider's view of its PaymentIntents and the steps slower than their SLO", body = OrderTimeline),
        (status = 400, description = "`invalid_path` (the order id is not a UUID) or `invalid_query`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 401, description = "`unauthenticated`: no or wrong operator token", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 404, description = "`not_found`: no such order in this ledger", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 429, description = "`rate_limited` or `too_many_in_flight`; `Retry-After`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 503, description = "`unavailable`: the database is unavailable; `Retry-After`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
    ))]
pub async fn order_timeline(
    axum::extract::State(st): axum::extract::State<crate::state::AppState>,
    _operator: crate::admin::Operator,
    crate::auth::IdPath(order): crate::auth::IdPath<Uuid>,
    query: Result<axum::extract::Query<TimelineQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<axum::response::Response, crate::problem::Problem> {
    use axum::response::IntoResponse;
    let axum::extract::Query(q) =
        query.map_err(|e| crate::problem::Problem::bad_request("invalid_query", e.body_text()))?;
    let gw = if q.provider.unwrap_or(true) { st.payment_gateway.as_deref() } else { None };
    match read(&st.pool, gw, order, Slo::default())
        .await
        .map_err(|e| crate::problem::Problem::database(&e))?
    {
        Some(t) => Ok(axum::Json(t).into_response()),
        None => Err(crate::problem::Problem::not_found("order")),
    }
}

fn unread(id: &str, error: String) -> ProviderIntent {
    ProviderIntent {
        id: id.to_owned(),
        status: None,
        amount: None,
        amount_received: None,
        amount_capturable: None,
        cancellation_reason: None,
        metadata_order_id: None,
        agrees_with_ledger: None,
        error: Some(error),
    }
}
