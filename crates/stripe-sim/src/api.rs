//! Stripe's wire conventions shared by every route: form parameters with bracket syntax and
//! the error envelope (<https://docs.stripe.com/api/errors>).
//!
//! Invariant: every error the simulator returns has Stripe's shape
//! `{"error": {"type", "code"?, "decline_code"?, "message", "param"?, "doc_url"?, …}}` and
//! says whether Stripe would store it for idempotent replay (it does not store validation
//! failures, 404s or conflicts: <https://docs.stripe.com/api/idempotent_requests>).

use std::collections::BTreeMap;

use axum::http::StatusCode;
use serde_json::{json, Map, Value};

/// Stripe's metadata limits (<https://docs.stripe.com/api/metadata>).
const METADATA_MAX_KEYS: usize = 50;
const METADATA_MAX_KEY_LEN: usize = 40;
const METADATA_MAX_VALUE_LEN: usize = 500;

/// A Stripe-shaped error response.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    /// The object under `"error"`.
    pub error: Map<String, Value>,
    /// Whether an idempotent retry should replay this answer (false: the request never
    /// started executing, so a retry with the same key runs afresh).
    pub replayable: bool,
}

impl ApiError {
    pub fn new(status: StatusCode, error_type: &str, code: Option<&str>, message: impl Into<String>) -> Self {
        let mut error = Map::new();
        error.insert("type".into(), error_type.into());
        if let Some(code) = code {
            error.insert("code".into(), code.into());
            error.insert(
                "doc_url".into(),
                format!("https://stripe.com/docs/error-codes/{}", code.replace('_', "-")).into(),
            );
        }
        error.insert("message".into(), message.into().into());
        Self { status, error, replayable: true }
    }

    /// Adds a field to the error object (`param`, `payment_intent`, `decline_code`, …).
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.error.insert(key.into(), value.into());
        self
    }

    /// Marks the error as "never started executing": not stored for idempotent replay.
    pub fn not_replayable(mut self) -> Self {
        self.replayable = false;
        self
    }

    /// 400 `invalid_request_error` about one parameter, not replayable.
    pub fn invalid(code: Option<&str>, param: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", code, message)
            .with("param", param)
            .not_replayable()
    }

    pub fn missing(param: &str) -> Self {
        Self::invalid(Some("parameter_missing"), param, format!("Missing required param: {param}."))
    }

    pub fn invalid_integer(param: &str) -> Self {
        Self::invalid(
            Some("parameter_invalid_integer"),
            param,
            format!("Invalid integer: {param} must be a positive integer."),
        )
    }

    /// 404 `resource_missing` (e.g. `No such payment_intent: 'pi_x'`).
    pub fn no_such(kind: &str, id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("resource_missing"),
            format!("No such {kind}: '{id}'"),
        )
        .with("param", "id")
        .not_replayable()
    }

    /// 400 `payment_intent_unexpected_state`, carrying the intent as Stripe does.
    pub fn unexpected_state(pi: Value, action: &str, status: &str) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("payment_intent_unexpected_state"),
            format!("This PaymentIntent could not be {action} because it has a status of {status}."),
        )
        .with("payment_intent", pi)
    }

    /// 401 for a missing, malformed or wrong-kind API key.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", None, message).not_replayable()
    }

    /// 500 `api_error`, as Stripe answers when something broke on its side.
    pub fn internal() -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            None,
            "An unknown error occurred (simulated).",
        )
        .not_replayable()
    }

    /// The response body `{"error": {...}}`.
    pub fn body(&self) -> Vec<u8> {
        serde_json::to_vec(&json!({ "error": self.error })).expect("JSON values serialize")
    }
}

/// Decoded `application/x-www-form-urlencoded` parameters, in request order.
#[derive(Clone, Debug, Default)]
pub(crate) struct Params(Vec<(String, String)>);

impl Params {
    /// Parses a form body or query string.
    pub fn parse(raw: &[u8]) -> Result<Self, ApiError> {
        serde_urlencoded::from_bytes(raw).map(Params).map_err(|_| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                None,
                "Invalid form-encoded body.",
            )
            .not_replayable()
        })
    }

    /// The order-independent form Stripe compares idempotent retries by.
    pub fn fingerprint(&self) -> Vec<(String, String)> {
        let mut v = self.0.clone();
        v.sort();
        v
    }

    /// Rejects parameters the endpoint does not know (`parameter_unknown`); `allowed` entries
    /// ending in `[` accept any `name[...]` key (e.g. `metadata[`).
    pub fn only(&self, allowed: &[&str]) -> Result<(), ApiError> {
        for (k, _) in &self.0 {
            let ok = allowed.iter().any(|a| {
                if a.ends_with('[') {
                    k.starts_with(a) && k.ends_with(']')
                } else {
                    k == a
                }
            });
            if !ok {
                return Err(ApiError::invalid(
                    Some("parameter_unknown"),
                    k,
                    format!("Received unknown parameter: {k}"),
                ));
            }
        }
        Ok(())
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// Every `(key, value)` whose key starts with `prefix`, in request order (e.g. `expand[`
    /// for `expand[]=…` and `expand[0]=…`).
    pub fn prefixed<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        self.0.iter().filter(move |(k, _)| k.starts_with(prefix)).map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// A required, non-empty string parameter.
    pub fn require(&self, key: &str) -> Result<&str, ApiError> {
        self.get(key).filter(|v| !v.is_empty()).ok_or_else(|| ApiError::missing(key))
    }

    /// An optional integer parameter; present but not an integer → `parameter_invalid_integer`.
    pub fn int(&self, key: &str) -> Result<Option<i64>, ApiError> {
        self.get(key).map(|v| v.parse::<i64>().map_err(|_| ApiError::invalid_integer(key))).transpose()
    }

    /// An optional strictly positive integer (amounts in minor units).
    pub fn positive_int(&self, key: &str) -> Result<Option<i64>, ApiError> {
        match self.int(key)? {
            Some(n) if n <= 0 => Err(ApiError::invalid_integer(key)),
            other => Ok(other),
        }
    }

    /// An optional boolean (`true`/`false`).
    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        self.get(key)
            .map(|v| match v {
                "true" => Ok(true),
                "false" => Ok(false),
                _ => Err(ApiError::invalid(
                    Some("parameter_invalid_boolean"),
                    key,
                    format!("Invalid boolean: {v}"),
                )),
            })
            .transpose()
    }

    /// `metadata[key]=value` pairs, validated against Stripe's limits.
    pub fn metadata(&self) -> Result<BTreeMap<String, String>, ApiError> {
        let mut out = BTreeMap::new();
        for (k, v) in &self.0 {
            let Some(key) = k.strip_prefix("metadata[").and_then(|k| k.strip_suffix(']')) else {
                continue;
            };
            if key.is_empty() || key.len() > METADATA_MAX_KEY_LEN || v.len() > METADATA_MAX_VALUE_LEN {
                return Err(ApiError::invalid(
                    None,
                    k,
                    "Metadata keys must be 1-40 characters and values at most 500.",
                ));
            }
            out.insert(key.to_owned(), v.clone());
        }
        if out.len() > METADATA_MAX_KEYS {
            return Err(ApiError::invalid(None, "metadata", "Metadata can have at most 50 keys."));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_decode_brackets_and_validate() {
        let p = Params::parse(
            b"amount=100&metadata%5Border_id%5D=o+1&metadata[x]=y&automatic_payment_methods[enabled]=true",
        )
        .unwrap();
        assert_eq!(p.positive_int("amount").unwrap(), Some(100));
        assert_eq!(p.metadata().unwrap().get("order_id").map(String::as_str), Some("o 1"));
        assert!(p.only(&["amount", "metadata[", "automatic_payment_methods[enabled]"]).is_ok());
        assert_eq!(p.only(&["amount"]).unwrap_err().error["code"], "parameter_unknown");
        let neg = Params::parse(b"amount=-5").unwrap();
        assert_eq!(neg.positive_int("amount").unwrap_err().error["code"], "parameter_invalid_integer");
        assert_eq!(neg.require("currency").unwrap_err().error["code"], "parameter_missing");
    }
}
