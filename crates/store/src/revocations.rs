//! Revoked admission tokens (`admission_revocations`), the ledger's copy of the waiting
//! room's revocation set: Redis answers the hot path, this table survives a Redis restart.
//! A revocation is written here before it is written to Redis, so whatever Redis has lost,
//! the ledger still knows (see `boxoffice_api::revocation` for how the two are read).
//!
//! A row means "the token `jti` is refused until `revoked_until`" (the token's `exp`: it is
//! refused afterwards anyway). Rows past it are pruned by [`prune_expired`]. Every function
//! is a single statement; errors are the database's (`sqlx::Error`, retryable or not as
//! [`crate::is_retryable`] says).

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

/// Records that `jti` is revoked until `until`. Idempotent: revoking again keeps the later
/// of the two ends.
pub async fn record(pool: &PgPool, jti: Uuid, until: DateTime<Utc>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO admission_revocations (jti, revoked_until) VALUES ($1, $2)
         ON CONFLICT (jti) DO UPDATE
           SET revoked_until = GREATEST(admission_revocations.revoked_until, EXCLUDED.revoked_until)",
    )
    .bind(jti)
    .bind(until)
    .execute(pool)
    .await?;
    Ok(())
}

/// Whether `jti` is revoked now (by the database clock).
pub async fn is_revoked(pool: &PgPool, jti: Uuid) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM admission_revocations WHERE jti = $1 AND revoked_until > now())",
    )
    .bind(jti)
    .fetch_one(pool)
    .await
}

/// Every revocation still in force, `(jti, revoked_until)`, to re-seed Redis with.
pub async fn unexpired(pool: &PgPool) -> Result<Vec<(Uuid, DateTime<Utc>)>, sqlx::Error> {
    sqlx::query_as("SELECT jti, revoked_until FROM admission_revocations WHERE revoked_until > now()")
        .fetch_all(pool)
        .await
}

/// Deletes revocations whose token has expired; returns how many.
pub async fn prune_expired(pool: &PgPool) -> Result<u64, sqlx::Error> {
    let r =
        sqlx::query("DELETE FROM admission_revocations WHERE revoked_until <= now()").execute(pool).await?;
    Ok(r.rows_affected())
}
