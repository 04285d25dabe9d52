//! Stripe's idempotent-request rules (<https://docs.stripe.com/api/idempotent_requests>).
//!
//! Owns the table keyed by (API key, `Idempotency-Key`). The first request with a key claims
//! it; when it finishes, its exact status and body are stored and every later request with the
//! same key, path and parameters gets them back with `Idempotent-Replayed: true`. The same key
//! with another path or other parameters is a 400 `idempotency_error`; a request arriving while
//! the first is still executing is a 409 `idempotency_key_in_use`.
//!
//! Invariant: at most one request per key executes its mutation. A claim that ends without a
//! stored result (validation failure, dropped future) releases the key so a retry runs afresh.
//! Results stay for the simulator's lifetime (Stripe keeps them 24 hours).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use axum::body::Bytes;
use axum::http::StatusCode;

use crate::api::ApiError;

/// A stored answer: replayed byte for byte.
#[derive(Clone, Debug)]
pub(crate) struct Stored {
    pub status: StatusCode,
    pub body: Bytes,
}

struct Entry {
    path: String,
    params: Vec<(String, String)>,
    /// `None` while the first request is executing.
    result: Option<Stored>,
}

type Table = Arc<Mutex<HashMap<(String, String), Entry>>>;

#[derive(Default)]
pub(crate) struct IdempotencyStore {
    table: Table,
}

/// Outcome of presenting a key.
pub(crate) enum Begin {
    /// First use: execute, then [`Claim::complete`] or [`Claim::release`].
    Execute(Claim),
    Replay(Stored),
    Reject(ApiError),
}

/// The right to execute under a key. Dropping it without completing releases the key.
pub(crate) struct Claim {
    table: Table,
    key: (String, String),
    finished: bool,
}

impl IdempotencyStore {
    pub fn begin(
        &self,
        api_key: &str,
        idempotency_key: &str,
        path: &str,
        params: Vec<(String, String)>,
    ) -> Begin {
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let key = (api_key.to_owned(), idempotency_key.to_owned());
        match table.get(&key) {
            None => {
                table.insert(key.clone(), Entry { path: path.to_owned(), params, result: None });
                Begin::Execute(Claim { table: self.table.clone(), key, finished: false })
            }
            Some(e) if e.path != path || e.params != params => Begin::Reject(
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "idempotency_error",
                    None,
                    format!(
                        "Keys for idempotent requests can only be used with the same parameters they were first used with. \
                         Try using a key other than '{idempotency_key}' if you meant to execute a different request."
                    ),
                )
                .not_replayable(),
            ),
            Some(Entry { result: Some(stored), .. }) => Begin::Replay(stored.clone()),
            Some(Entry { result: None, .. }) => Begin::Reject(
                ApiError::new(
                    StatusCode::CONFLICT,
                    "idempotency_error",
                    Some("idempotency_key_in_use"),
                    format!(
                        "There is currently another in-progress request using this Idempotent Key (that probably means you \
                         submitted twice, and the other request is still going through): {idempotency_key}. Please try again later."
                    ),
                )
                .not_replayable(),
            ),
        }
    }
}

impl Claim {
    /// Stores the answer for replay.
    pub fn complete(mut self, stored: Stored) {
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(e) = table.get_mut(&self.key) {
            e.result = Some(stored);
        }
        self.finished = true;
    }

    /// Forgets the key: the request never started executing.
    pub fn release(self) {}
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.finished {
            self.table.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(v: &str) -> Vec<(String, String)> {
        vec![("amount".into(), v.into())]
    }

    #[test]
    fn claim_replay_conflict_and_release() {
        let store = IdempotencyStore::default();
        let Begin::Execute(claim) = store.begin("sk", "k", "/p", params("1")) else {
            panic!("first use executes")
        };
        assert!(
            matches!(store.begin("sk", "k", "/p", params("1")), Begin::Reject(e) if e.status == StatusCode::CONFLICT)
        );
        assert!(
            matches!(store.begin("sk2", "k", "/p", params("1")), Begin::Execute(_)),
            "keys are per API key"
        );
        claim.complete(Stored { status: StatusCode::PAYMENT_REQUIRED, body: Bytes::from_static(b"x") });
        assert!(
            matches!(store.begin("sk", "k", "/p", params("1")), Begin::Replay(s) if s.status == StatusCode::PAYMENT_REQUIRED)
        );
        assert!(
            matches!(store.begin("sk", "k", "/p", params("2")), Begin::Reject(e) if e.status == StatusCode::BAD_REQUEST)
        );
        assert!(
            matches!(store.begin("sk", "k", "/q", params("1")), Begin::Reject(e) if e.status == StatusCode::BAD_REQUEST)
        );

        let Begin::Execute(claim) = store.begin("sk", "j", "/p", params("1")) else { panic!() };
        claim.release();
        assert!(matches!(store.begin("sk", "j", "/p", params("1")), Begin::Execute(_)));
    }
}
