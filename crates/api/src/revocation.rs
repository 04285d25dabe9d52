//! Admission-token revocation: where a revocation is written and how the hold endpoint reads
//! it.
//!
//! **Two copies.** PostgreSQL (`boxoffice_store::revocations`) is the record; Redis's
//! revocation set is the fast copy the hot path reads. Every revocation goes to PostgreSQL
//! first and to Redis second, so Redis can lack a revocation but PostgreSQL never does.
//!
//! **The hot path stays one Redis call.** [`Revocations::check`] sends one `MGET` of the
//! token's key and a seed marker ([`boxoffice_waitroom::Waitroom::revocation_state`]). The
//! marker says "this Redis holds every unexpired revocation of the ledger"; it is written by
//! a re-seed from PostgreSQL and vanishes with everything else when Redis restarts or is
//! flushed. So:
//! - key present → revoked (403 `admission_token_revoked`);
//! - key absent, marker present → not revoked (one Redis call, no PostgreSQL);
//! - key absent, marker absent (a Redis that restarted, or a deployment never seeded) → the
//!   answer comes from PostgreSQL (one indexed lookup), and this process starts re-seeding
//!   Redis in the background (one at a time), after which misses are trusted again;
//! - Redis **unavailable** (timeout, refused/reset/closed connection, still loading) → the
//!   answer comes from PostgreSQL; for [`crate::limits::SKIP_REDIS_AFTER_FAILURE`] after
//!   such a failure Redis is not asked at all, so a Redis that stops answering does not add
//!   `redis_timeout_ms` to every hold (the first check after that window finds a restarted
//!   Redis unseeded and starts the re-seed);
//! - any **other** Redis error (a wrong password, an unexpected answer) → fail closed: 503
//!   `revocation_check_failed` with `Retry-After`, because a Redis that answers wrongly might
//!   also be hiding a revocation.
//!
//! Why re-seed rather than ask PostgreSQL on every miss: misses are the common case (almost
//! no token is revoked), so asking PostgreSQL on each would add a query to every hold; the
//! marker confines PostgreSQL reads to the moments Redis cannot vouch for its own set.
//! PostgreSQL itself failing makes the check a 503 (the hold transaction would fail too).
//!
//! One gap is left to the writer: a revocation recorded in PostgreSQL whose Redis write
//! failed while Redis kept its data (and its marker). [`revoke`] reports that as an error
//! (the operator re-runs it; it is idempotent), and leaving the queue writes Redis in the
//! same script that ends the position, so neither reports success with Redis behind.
//!
//! Metrics: `boxoffice_admission_revocation_ledger_checks_total{reason}` (`redis_unavailable`,
//! `redis_unseeded`), `boxoffice_admission_revocation_failed_closed_total`,
//! `boxoffice_admission_revocation_reseeds_total{outcome}`.

use crate::problem::{ErrorChain, Problem};
use axum::http::StatusCode;
use boxoffice_admission::AdmissionError;
use boxoffice_store::revocations as ledger;
use boxoffice_waitroom::{Waitroom, WaitroomError};
use chrono::{DateTime, Utc};
use sqlx::PgPool;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use uuid::Uuid;

/// Why a revocation could not be written.
#[derive(Debug, thiserror::Error)]
pub enum RevokeError {
    /// PostgreSQL refused or failed: nothing was revoked.
    #[error("recording the revocation in the ledger failed")]
    Ledger(#[source] sqlx::Error),
    /// Recorded in PostgreSQL, but Redis did not take it: checks may still accept the token
    /// until Redis has it (re-run the revocation) or is re-seeded.
    #[error("the revocation is recorded in the ledger but Redis did not take it")]
    Redis(#[source] WaitroomError),
}

/// Revokes the admission token `jti` until `until_exp` (unix seconds, its `exp`): PostgreSQL
/// first, then Redis.
///
/// # Errors
/// [`RevokeError::Ledger`] (nothing changed) or [`RevokeError::Redis`] (recorded, not yet in
/// Redis).
pub async fn revoke(pool: &PgPool, room: &Waitroom, jti: Uuid, until_exp: i64) -> Result<(), RevokeError> {
    let until = DateTime::from_timestamp(until_exp, 0).unwrap_or_else(Utc::now);
    ledger::record(pool, jti, until).await.map_err(RevokeError::Ledger)?;
    room.revoke(jti, until_exp).await.map_err(RevokeError::Redis)
}

/// Why re-seeding Redis from the ledger failed (the ledger keeps answering meanwhile).
#[derive(Debug, thiserror::Error)]
pub enum ReseedError {
    /// Reading (or pruning) the ledger failed.
    #[error("reading the revocation ledger failed")]
    Ledger(#[from] sqlx::Error),
    /// Writing to Redis failed.
    #[error("writing the revocation set to Redis failed")]
    Redis(#[from] WaitroomError),
}

/// The hold endpoint's revocation check (see the module doc); cheap to clone.
#[derive(Clone)]
pub struct Revocations {
    pool: PgPool,
    room: Waitroom,
    seeding: Arc<AtomicBool>,
}

impl Revocations {
    /// A checker reading `room` and, when Redis cannot vouch for its set, `pool`.
    pub fn new(pool: PgPool, room: Waitroom) -> Self {
        Self { pool, room, seeding: Arc::default() }
    }

    /// `Ok` when `jti` is not revoked.
    ///
    /// # Errors
    /// 403 `admission_token_revoked`; 503 `revocation_check_failed` when Redis answered with
    /// an error other than unavailability; 503 (or 500) when PostgreSQL had to answer and
    /// could not.
    pub async fn check(&self, jti: Uuid) -> Result<(), Problem> {
        if self.room.recently_unavailable(crate::limits::SKIP_REDIS_AFTER_FAILURE) {
            return self.ask_ledger(jti, "redis_unavailable").await;
        }
        match self.room.revocation_state(jti).await {
            Ok(s) if s.revoked => Err(AdmissionError::Revoked.into()),
            Ok(s) if s.seeded => Ok(()),
            Ok(_) => {
                self.reseed_in_background();
                self.ask_ledger(jti, "redis_unseeded").await
            }
            Err(e) if e.is_unavailable() => self.ask_ledger(jti, "redis_unavailable").await,
            Err(e) => {
                metrics::counter!("boxoffice_admission_revocation_failed_closed_total").increment(1);
                tracing::error!(error = %ErrorChain(&e), "revocation check failed closed");
                let mut p = Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "revocation_check_failed",
                    "Admission check unavailable",
                    "whether the admission token was revoked cannot be checked right now; retry shortly",
                );
                p.retry_after = Some(2);
                Err(p)
            }
        }
    }

    async fn ask_ledger(&self, jti: Uuid, reason: &'static str) -> Result<(), Problem> {
        metrics::counter!("boxoffice_admission_revocation_ledger_checks_total", "reason" => reason)
            .increment(1);
        if ledger::is_revoked(&self.pool, jti).await? {
            Err(AdmissionError::Revoked.into())
        } else {
            Ok(())
        }
    }

    /// Starts [`Revocations::reseed`] unless this process already runs one.
    fn reseed_in_background(&self) {
        if self.seeding.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            let outcome = match this.reseed().await {
                Ok(true) => "seeded",
                Ok(false) => "superseded",
                Err(e) => {
                    tracing::warn!(error = %ErrorChain(&e), "re-seeding Redis's revocation set failed; the ledger answers meanwhile");
                    "failed"
                }
            };
            metrics::counter!("boxoffice_admission_revocation_reseeds_total", "outcome" => outcome)
                .increment(1);
            this.seeding.store(false, Ordering::Release);
        });
    }

    /// Copies every unexpired revocation from PostgreSQL into Redis and marks the set seeded
    /// (pruning expired rows on the way). `Ok(false)` when Redis restarted during the copy
    /// (the next miss starts over).
    ///
    /// # Errors
    /// [`ReseedError::Ledger`] or [`ReseedError::Redis`]; nothing is marked seeded then.
    pub async fn reseed(&self) -> Result<bool, ReseedError> {
        let pruned = ledger::prune_expired(&self.pool).await?;
        let rows = ledger::unexpired(&self.pool).await?;
        let entries: Vec<(Uuid, i64)> = rows.iter().map(|(j, until)| (*j, until.timestamp() + 1)).collect();
        let marked = self.room.seed_revocations(&entries).await?;
        tracing::info!(
            revocations = entries.len(),
            pruned,
            marked,
            "re-seeded Redis's revocation set from the ledger"
        );
        Ok(marked)
    }
}
