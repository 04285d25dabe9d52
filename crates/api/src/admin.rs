//! The operator's routes under `/admin` (design §16), and who may use them.
//!
//! Until operator identity exists, an operator is whoever presents the configured
//! `admin_token` as `Authorization: Bearer <admin_token>` ([`Operator`]). The token is
//! compared in constant time (SHA-256 of both sides, compared with `subtle`), never logged
//! and never echoed; a missing or wrong token is a 401 `unauthenticated` problem with
//! `WWW-Authenticate: Bearer realm="boxoffice-admin"`, counted in
//! `boxoffice_admin_auth_refused_total{reason}` (`missing`, `mismatch`).
//!
//! Routes ([`routes`], full paths, merged into the API's router):
//! - `GET /admin/` — the onsale dashboard: one static HTML page with its script and style
//!   (`/admin/dashboard.js`, `/admin/dashboard.css`, `/admin/favicon.svg`), embedded in the
//!   binary. It carries no
//!   data: it asks for the token (or reads it from the URL fragment `#token=…`, which never
//!   reaches the server), keeps it in `sessionStorage` and polls `/admin/onsale`. `GET
//!   /admin` redirects there.
//! - `GET /admin/onsale` ([`Operator`]) — the dashboard's figures ([`crate::dashboard`]).
//!
//! Every `/admin` route sits behind its own per-IP rate bucket (route class `admin` in
//! [`crate::limits`], taken before the token is checked, so guessing is as slow as the
//! bucket) and a per-client in-flight bound (`admin_max_in_flight_per_ip`). Every answer
//! carries `Content-Security-Policy: default-src 'self'; frame-ancestors 'none'` (no inline
//! script or style anywhere), `X-Content-Type-Options: nosniff`, `X-Frame-Options: DENY` and
//! `Referrer-Policy: no-referrer`; data and refusals are `Cache-Control: no-store`.
//!
//! New operator routes go into [`routes`] with [`Operator`] as an argument of their handler:
//! they then get the bucket, the bound and the headers with no further wiring.

use crate::problem::Problem;
use crate::state::AppState;
use axum::extract::{FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;
use secrecy::ExposeSecret;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The dashboard page: markup only; script and style are separate files (the CSP forbids
/// inline ones).
pub const DASHBOARD_HTML: &str = include_str!("../assets/admin/index.html");
/// The dashboard's script (vanilla JS, no build step).
pub const DASHBOARD_JS: &str = include_str!("../assets/admin/dashboard.js");
/// The dashboard's style.
pub const DASHBOARD_CSS: &str = include_str!("../assets/admin/dashboard.css");
/// The dashboard's icon (so the browser's `/favicon.ico` guess is never needed).
pub const DASHBOARD_ICON: &str = include_str!("../assets/admin/favicon.svg");

/// The `Content-Security-Policy` of every `/admin` answer.
pub const CSP: &str =
    "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'; object-src 'none'";

/// An authenticated operator: the request carried `Authorization: Bearer <admin_token>`.
///
/// Use it as a handler argument on any `/admin` route; the handler then runs only for the
/// operator. Rejection: 401 `unauthenticated` problem+json (`WWW-Authenticate: Bearer`,
/// `Cache-Control: no-store`) when the header is missing, not a Bearer token, or not the
/// configured token (an empty configured token refuses everyone). The comparison takes the
/// same time whatever the presented token; neither token is ever logged.
#[derive(Debug, Clone, Copy)]
pub struct Operator;

impl FromRequestParts<AppState> for Operator {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let presented = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim);
        let Some(presented) = presented else {
            return Err(refuse("missing", "an Authorization: Bearer <admin token> header is required"));
        };
        if token_matches(state.settings.admin_token.expose_secret(), presented) {
            Ok(Operator)
        } else {
            Err(refuse("mismatch", "the bearer token is not the operator token"))
        }
    }
}

/// Whether `presented` is `configured`, in time independent of both (digests compared in
/// constant time); an empty `configured` matches nothing.
fn token_matches(configured: &str, presented: &str) -> bool {
    let (a, b) = (Sha256::digest(configured.as_bytes()), Sha256::digest(presented.as_bytes()));
    !configured.is_empty() && bool::from(a.as_slice().ct_eq(b.as_slice()))
}

fn refuse(reason: &'static str, detail: &str) -> Response {
    metrics::counter!("boxoffice_admin_auth_refused_total", "reason" => reason).increment(1);
    tracing::info!(reason, "operator request refused");
    let mut r = Problem::new(StatusCode::UNAUTHORIZED, "unauthenticated", "Authentication required", detail)
        .into_response();
    r.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"boxoffice-admin\""));
    r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// Every `/admin` route, with its rate bucket, in-flight bound and security headers (see
/// the module docs). Full paths: merge the result into the API's router.
pub fn routes(state: &AppState) -> Router<AppState> {
    let in_flight = crate::edge::PerClientInFlight::new(
        "admin",
        state.settings.admin_max_in_flight_per_ip,
        state.settings.trusted_proxy_hops,
    );
    Router::new()
        .route("/admin", get(|| async { Redirect::permanent("/admin/") }))
        .route("/admin/", get(page))
        .route("/admin/dashboard.js", get(script))
        .route("/admin/dashboard.css", get(style))
        .route("/admin/favicon.svg", get(|| async { asset("image/svg+xml", DASHBOARD_ICON) }))
        .route("/admin/onsale", get(crate::dashboard::onsale))
        .route("/admin/orders/{order_id}/timeline", get(crate::timeline::order_timeline))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), crate::limits::admin))
        .route_layer(axum::middleware::from_fn_with_state(in_flight, crate::edge::limit_in_flight))
        .route_layer(axum::middleware::from_fn(security_headers))
}

async fn page() -> Response {
    asset("text/html; charset=utf-8", DASHBOARD_HTML)
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", DASHBOARD_JS)
}

async fn style() -> Response {
    asset("text/css; charset=utf-8", DASHBOARD_CSS)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

/// The headers of every `/admin` answer, the refusals of the bucket and the bound included;
/// `Cache-Control: no-store` unless the handler set its own.
async fn security_headers(req: Request, next: Next) -> Response {
    let mut r = next.run(req).await;
    let h = r.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.entry(header::CACHE_CONTROL).or_insert(HeaderValue::from_static("no-store"));
    r
}

#[cfg(test)]
mod tests {
    use super::token_matches;

    #[test]
    fn only_the_configured_token_matches() {
        let t = "0123456789abcdef0123456789abcdef";
        assert!(token_matches(t, t));
        assert!(!token_matches(t, "0123456789abcdef0123456789abcdeF"));
        assert!(!token_matches(t, ""));
        assert!(!token_matches(t, &format!("{t}x")));
        assert!(!token_matches("", ""), "an empty configured token matches nothing");
    }
}
