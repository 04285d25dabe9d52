//! The error type of every Stripe call, and the one place that decides retryable vs permanent.
//!
//! Invariant: no variant carries a request or response body, so printing an error can never
//! leak a client secret; `Api` keeps only the fields of Stripe's `error` object that are safe
//! to log (type, code, decline code, message).

/// A failed Stripe call.
///
/// Shapes follow Stripe's error object (<https://docs.stripe.com/api/errors>): an HTTP status
/// plus `{"error": {"type", "code", "decline_code", "message", ...}}`.
#[derive(Debug, thiserror::Error)]
pub enum StripeError {
    /// Stripe answered with a non-2xx status and (usually) an `error` object.
    ///
    /// `error_type` is Stripe's `type` (`card_error`, `invalid_request_error`,
    /// `idempotency_error`, `api_error`, ...); `code` e.g. `card_declined`,
    /// `payment_intent_unexpected_state`, `idempotency_key_in_use`, `resource_missing`;
    /// `decline_code` e.g. `generic_decline`, `insufficient_funds` (card errors only).
    #[error("stripe returned {status} {error_type}{}: {message}", code.as_deref().map(|c| format!(" ({c})")).unwrap_or_default())]
    Api {
        /// HTTP status (400, 401, 402, 404, 409, 429, 5xx).
        status: u16,
        /// Stripe's `error.type`; `api_error` when the body was not Stripe's JSON.
        error_type: String,
        /// Stripe's `error.code`, if any.
        code: Option<String>,
        /// Stripe's `error.decline_code` (card errors only).
        decline_code: Option<String>,
        /// Stripe's human-readable `error.message` (never contains secrets).
        message: String,
    },
    /// No complete answer: connect error, timeout, connection reset or body cut off.
    /// The request may or may not have been applied; retry with the same idempotency key.
    #[error("stripe transport error")]
    Transport(#[source] reqwest::Error),
    /// A 2xx answer whose body is not the expected object. Not retryable: a retry with the
    /// same idempotency key replays the same body.
    #[error("cannot decode stripe response")]
    Decode(#[source] serde_json::Error),
    /// Invalid client configuration or arguments (bad base URL, wrong key kind, zero
    /// timeout); detected before anything is sent.
    #[error("stripe client configuration: {0}")]
    Config(String),
}

impl StripeError {
    /// Whether retrying the same call with the same idempotency key may succeed.
    ///
    /// True for transport failures, 429 (rate limit / `lock_timeout`), 409 (Stripe's
    /// `idempotency_key_in_use`: the first request with this key is still running) and any
    /// 5xx (Stripe's advice: <https://docs.stripe.com/error-low-level#idempotency>). Everything
    /// else (card declines, invalid state, bad parameters, auth, decode) is permanent.
    pub fn is_retryable(&self) -> bool {
        match self {
            StripeError::Transport(_) => true,
            StripeError::Api { status, .. } => *status == 409 || *status == 429 || *status >= 500,
            StripeError::Decode(_) | StripeError::Config(_) => false,
        }
    }

    /// Stripe's error `code` (e.g. `card_declined`), if this is an API error that has one.
    pub fn code(&self) -> Option<&str> {
        match self {
            StripeError::Api { code, .. } => code.as_deref(),
            _ => None,
        }
    }

    /// Stripe's `decline_code` (e.g. `generic_decline`), present on card declines only.
    pub fn decline_code(&self) -> Option<&str> {
        match self {
            StripeError::Api { decline_code, .. } => decline_code.as_deref(),
            _ => None,
        }
    }

    /// The HTTP status of an API error; `None` when Stripe gave no answer.
    pub fn status(&self) -> Option<u16> {
        match self {
            StripeError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Builds [`StripeError::Api`] from a non-2xx response body. A body that is not Stripe's
    /// error JSON (e.g. a proxy's HTML page) becomes `error_type = "api_error"` with a generic
    /// message; the body itself is never copied.
    pub(crate) fn from_response(status: u16, body: &[u8]) -> Self {
        #[derive(serde::Deserialize)]
        struct Envelope {
            error: Body,
        }
        #[derive(serde::Deserialize)]
        struct Body {
            #[serde(rename = "type")]
            error_type: Option<String>,
            code: Option<String>,
            decline_code: Option<String>,
            message: Option<String>,
        }
        match serde_json::from_slice::<Envelope>(body) {
            Ok(Envelope { error }) => StripeError::Api {
                status,
                error_type: error.error_type.unwrap_or_else(|| "api_error".into()),
                code: error.code,
                decline_code: error.decline_code,
                message: error.message.unwrap_or_default(),
            },
            Err(_) => StripeError::Api {
                status,
                error_type: "api_error".into(),
                code: None,
                decline_code: None,
                message: format!("non-Stripe error body ({} bytes)", body.len()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_card_error_and_classifies() {
        let body = br#"{"error":{"type":"card_error","code":"card_declined","decline_code":"generic_decline","message":"Your card was declined.","payment_intent":{"client_secret":"pi_1_secret_x"}}}"#;
        let e = StripeError::from_response(402, body);
        assert_eq!(e.code(), Some("card_declined"));
        assert_eq!(e.decline_code(), Some("generic_decline"));
        assert!(!e.is_retryable());
        assert!(!format!("{e} {e:?}").contains("secret"));
    }

    #[test]
    fn retryable_statuses() {
        for (s, r) in [(409, true), (429, true), (500, true), (503, true), (400, false), (404, false)] {
            assert_eq!(StripeError::from_response(s, b"<html>").is_retryable(), r, "{s}");
        }
    }
}
