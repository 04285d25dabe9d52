//! The OpenAPI 3.1 description of the HTTP API, generated from the handlers and the types they
//! exchange (utoipa), served at `GET /openapi.json` and committed as `openapi.json` (a test
//! keeps the two equal). Owns only documentation: no behaviour depends on it.

use serde::Serialize;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi, ToSchema};

/// An RFC 9457 problem details body (`application/problem+json`), as every error is sent.
#[derive(Serialize, ToSchema)]
pub struct ProblemDocument {
    /// `urn:boxoffice:problem:{code}`.
    #[serde(rename = "type")]
    pub type_: String,
    /// Short summary, the same for every occurrence of `code`.
    pub title: String,
    /// HTTP status code.
    pub status: u16,
    /// What happened this time, safe to show.
    pub detail: String,
    /// Stable machine-readable reason, e.g. `seat_unavailable`, `admission_token_expired`.
    pub code: String,
}

/// `POST /events/{event_id}/admission` answer.
#[derive(Serialize, ToSchema)]
pub struct Admission {
    /// Signed admission token for `X-Admission-Token`; not consumed by use.
    pub admission_token: String,
    /// End of the admission slot (RFC 3339).
    pub expires_at: chrono::DateTime<chrono::Utc>,
    /// The purchase cell serving the event.
    pub purchase_cell: String,
}

/// `GET /events/{event_id}/seats` answer.
#[derive(Serialize, ToSchema)]
pub struct SeatMap {
    /// Event id.
    pub event_id: uuid::Uuid,
    /// When this map was rendered.
    pub generated_at: chrono::DateTime<chrono::Utc>,
    /// Every seat, by section, row and number.
    pub seats: Vec<boxoffice_store::venue::SeatAvailability>,
}

/// `POST /webhooks/stripe` answer.
#[derive(Serialize, ToSchema)]
pub struct WebhookAck {
    /// Always true.
    pub received: bool,
    /// True when the Stripe event id was seen before (nothing was written).
    pub duplicate: bool,
}

/// What every operation can answer because of the HTTP edge (`crate::edge`), whatever its
/// handler does: 503 `overloaded` (the concurrency or connection limit) and 503
/// `request_timeout`; and the `Retry-After` header (seconds) on every 429 and 503.
struct EdgeResponses;

impl Modify for EdgeResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{header::HeaderBuilder, ContentBuilder, Ref, RefOr, ResponseBuilder};
        let retry_after = || {
            HeaderBuilder::new()
                .schema(
                    utoipa::openapi::ObjectBuilder::new()
                        .schema_type(utoipa::openapi::Type::Integer)
                        .minimum(Some(1)),
                )
                .description(Some("Seconds to wait before retrying"))
                .build()
        };
        for item in openapi.paths.paths.values_mut() {
            let ops = [&mut item.get, &mut item.post, &mut item.put, &mut item.delete, &mut item.patch];
            for op in ops.into_iter().flatten() {
                let responses = &mut op.responses.responses;
                let edge = "; from the edge: `overloaded` (too many requests or connections in flight; nothing was done) or `request_timeout` (the request ran past its time limit)";
                match responses.get_mut("503") {
                    Some(RefOr::T(r)) => r.description.push_str(edge),
                    _ => {
                        let r = ResponseBuilder::new()
                            .description(format!("Unavailable{edge}; `Retry-After`"))
                            .content(
                                "application/problem+json",
                                ContentBuilder::new()
                                    .schema(Some(Ref::from_schema_name("ProblemDocument")))
                                    .build(),
                            )
                            .build();
                        responses.insert("503".into(), RefOr::T(r));
                    }
                }
                for status in ["429", "503"] {
                    if let Some(RefOr::T(r)) = responses.get_mut(status) {
                        r.headers.insert("Retry-After".into(), retry_after());
                    }
                }
            }
        }
    }
}

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("JWT")
                    .description(Some(
                        "A buyer token from the identity provider: RS256, ES256 or EdDSA, verified with \
                         the provider's JWKS key named by `kid`, with the configured `iss` and `aud`, \
                         `exp` and `iat` (at most the configured lifetime apart). HS256 tokens are \
                         accepted in development only. A refused token is a 401 `unauthenticated` \
                         problem whose `detail` names the reason.",
                    ))
                    .build(),
            ),
        );
        components.add_security_scheme(
            "admin",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "The operator token (`admin_token`, `BOXOFFICE_ADMIN_TOKEN`), as \
                         `Authorization: Bearer <admin_token>`; compared in constant time. A missing or \
                         wrong token is a 401 `unauthenticated` problem.",
                    ))
                    .build(),
            ),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "boxoffice", description = "Reserved-seat ticketing: waiting room, admission, holds, order status, Stripe webhooks."),
    paths(
        crate::queue::join,
        crate::queue::status,
        crate::queue::leave,
        crate::routes::admit,
        crate::routes::create_hold,
        crate::routes::get_order,
        crate::order_stream::order_events,
        crate::routes::seat_map,
        crate::routes::stripe_webhook,
        crate::dashboard::onsale,
        crate::timeline::order_timeline,
    ),
    modifiers(&BearerAuth, &EdgeResponses),
    tags(
        (name = "waiting room", description = "Queue positions, polling and admission tokens"),
        (name = "purchase", description = "Admission, holds and order status"),
        (name = "catalog", description = "Availability (cached hints)"),
        (name = "webhooks", description = "Provider callbacks"),
        (name = "operator", description = "The operator's onsale view and order timelines (operator token only)"),
    )
)]
struct ApiDoc;

/// The OpenAPI document, with a fixed version so the committed copy is stable.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.info.version = "1".into();
    doc
}

#[cfg(test)]
mod tests {
    /// The committed `openapi.json` is what the code generates. Regenerate with
    /// `BOXOFFICE_WRITE_OPENAPI=1 cargo test -p boxoffice-api openapi`.
    #[test]
    fn committed_openapi_matches_the_code() {
        let generated = serde_json::to_string_pretty(&super::document()).unwrap() + "\n";
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../openapi.json");
        if std::env::var_os("BOXOFFICE_WRITE_OPENAPI").is_some() {
            std::fs::write(path, &generated).unwrap();
        }
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(committed == generated, "openapi.json is stale: regenerate it (see this test's doc)");
    }
}
