//! Request extractors for identity and request metadata: the bearer user (401 when absent or
//! refused by [`boxoffice_admission::UserTokens`], with the reason as the problem's detail),
//! the `Idempotency-Key` (400 when absent or malformed) and JSON bodies whose rejections
//! become problem+json (400 syntax, 408 body read timeout, 413 size, 415 content type, 422 shape).

use crate::problem::Problem;
use crate::state::AppState;
use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use boxoffice_domain::UserId;
use serde::de::DeserializeOwned;

/// The authenticated buyer (`Authorization: Bearer <JWT>`).
#[derive(Debug, Clone, Copy)]
pub struct User(pub UserId);

impl FromRequestParts<AppState> for User {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let unauthorized = |detail: &str| {
            Problem::new(StatusCode::UNAUTHORIZED, "unauthenticated", "Authentication required", detail)
        };
        let header = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| unauthorized("an Authorization: Bearer token is required"))?;
        let token = header
            .strip_prefix("Bearer ")
            .ok_or_else(|| unauthorized("the Authorization header must use the Bearer scheme"))?;
        // Each refusal's own reason (expired, wrong issuer or audience, unknown key, an
        // algorithm not accepted here, ...) is the detail; an unknown `kid` first re-reads
        // the identity provider's keys (rate-limited).
        state.users.authenticate(token.trim()).await.map(User).map_err(|e| unauthorized(&e.to_string()))
    }
}

/// The `Idempotency-Key` header: 1–255 visible ASCII characters.
#[derive(Debug, Clone)]
pub struct IdempotencyKey(pub String);

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let v = parts.headers.get("idempotency-key").ok_or_else(|| {
            Problem::bad_request("idempotency_key_missing", "an Idempotency-Key header is required")
        })?;
        let s = v
            .to_str()
            .ok()
            .filter(|s| !s.is_empty() && s.len() <= 255 && s.bytes().all(|b| b.is_ascii_graphic()))
            .ok_or_else(|| {
                Problem::bad_request(
                    "idempotency_key_invalid",
                    "the Idempotency-Key must be 1-255 visible ASCII characters",
                )
            })?;
        Ok(IdempotencyKey(s.to_owned()))
    }
}

/// A JSON body whose rejections are problem+json.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(ApiJson(v)),
            Err(rejection) => Err(json_problem(rejection)),
        }
    }
}

fn json_problem(r: JsonRejection) -> Problem {
    if let JsonRejection::BytesRejection(b) = r {
        return crate::problem::body_rejection(b);
    }
    let detail = r.body_text();
    match r.status() {
        StatusCode::PAYLOAD_TOO_LARGE => {
            Problem::new(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", "Request body too large", detail)
        }
        StatusCode::UNSUPPORTED_MEDIA_TYPE => Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "Unsupported media type",
            "the body must be application/json",
        ),
        StatusCode::UNPROCESSABLE_ENTITY => {
            Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_body", "Invalid request body", detail)
        }
        _ => Problem::bad_request("malformed_json", detail),
    }
}

/// A path parameter parsed as a UUID-based id; a malformed id is a 400 problem.
pub struct IdPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for IdPath<T> {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(v)| IdPath(v))
            .map_err(|e: PathRejection| Problem::bad_request("invalid_path", e.body_text()))
    }
}
