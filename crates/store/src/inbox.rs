//! The consumer inbox (design §8): `(consumer, event_id)` recorded in the same transaction as
//! the consumer's effect, so a redelivered message is a no-op (invariant 4). Also the janitor
//! for rows whose message can no longer be redelivered, and for expired idempotency keys.

use crate::Tx;
use uuid::Uuid;

/// Records `event_id` for `consumer`; `true` on first delivery, `false` for a duplicate.
/// Must run in the transaction that applies the effect.
pub async fn record(tx: &mut Tx<'_>, consumer: &str, event_id: Uuid) -> Result<bool, sqlx::Error> {
    let r = sqlx::query("INSERT INTO inbox (consumer, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING")
        .bind(consumer)
        .bind(event_id)
        .execute(&mut **tx)
        .await?;
    Ok(r.rows_affected() == 1)
}

/// Records every id of `event_ids` for `consumer` in one statement; returns the ids recorded
/// now (first deliveries), without those already in the inbox. An id given twice is returned
/// once: the caller applies one effect per returned id (not per message). Must run in the
/// transaction that applies those effects.
pub async fn record_all(
    tx: &mut Tx<'_>,
    consumer: &str,
    event_ids: &[Uuid],
) -> Result<std::collections::HashSet<Uuid>, sqlx::Error> {
    match event_ids {
        [] => Ok(Default::default()),
        [one] => Ok(if record(tx, consumer, *one).await? { [*one].into() } else { Default::default() }),
        many => {
            let fresh: Vec<Uuid> = sqlx::query_scalar(
                "INSERT INTO inbox (consumer, event_id) SELECT $1, unnest($2::uuid[])
                 ON CONFLICT DO NOTHING RETURNING event_id",
            )
            .bind(consumer)
            .bind(many)
            .fetch_all(&mut **tx)
            .await?;
            Ok(fresh.into_iter().collect())
        }
    }
}

/// Takes `event_ids` out of `consumer`'s inbox in `tx` (one statement; none for no ids): for
/// messages recorded in this transaction and then refused without an effect (a fact the
/// ledger did not commit, which may borrow the id of a real one still on its way), so the
/// id stays free for the message the ledger did write.
pub async fn forget_all(tx: &mut Tx<'_>, consumer: &str, event_ids: &[Uuid]) -> Result<(), sqlx::Error> {
    if event_ids.is_empty() {
        return Ok(());
    }
    sqlx::query("DELETE FROM inbox WHERE consumer = $1 AND event_id = ANY($2::uuid[])")
        .bind(consumer)
        .bind(event_ids)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Whether `consumer` already applied `event_id` (outside any transaction: a pre-check that
/// spares a remote call for a known duplicate; [`record`] stays the guard).
pub async fn seen(pool: &sqlx::PgPool, consumer: &str, event_id: Uuid) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM inbox WHERE consumer = $1 AND event_id = $2)")
        .bind(consumer)
        .bind(event_id)
        .fetch_one(pool)
        .await
}

/// Deletes up to `limit` inbox rows older than `retention_s` seconds. Keep the retention
/// longer than the topic's, so no message that can still be redelivered loses its row.
///
/// Reads only the rows it deletes, through `inbox_processed_idx` (migration 0026): the age is
/// measured from `now()`, the transaction's start, which an index can take, not from the
/// volatile `clock_timestamp()`, which would make each pass read the whole inbox (see
/// "Periodic sweeps" in the crate docs).
pub async fn prune(pool: &sqlx::PgPool, retention_s: i64, limit: i64) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(
        "DELETE FROM inbox WHERE ctid = ANY (ARRAY(
            SELECT ctid FROM inbox
             WHERE processed_at < now() - make_interval(secs => $1::double precision)
             ORDER BY processed_at LIMIT $2))",
    )
    .bind(retention_s as f64)
    .bind(limit)
    .execute(pool)
    .await?;
    Ok(r.rows_affected())
}

/// Deletes up to `limit` idempotency keys past their `expires_at` (24 h after the request),
/// found through `idempotency_expiry_idx` (expired by `now()`, which the index can take; see
/// "Periodic sweeps" in the crate docs).
pub async fn prune_idempotency_keys(pool: &sqlx::PgPool, limit: i64) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(
        "DELETE FROM idempotency_keys WHERE ctid = ANY (ARRAY(
            SELECT ctid FROM idempotency_keys WHERE expires_at < now() ORDER BY expires_at LIMIT $1))",
    )
    .bind(limit)
    .execute(pool)
    .await?;
    Ok(r.rows_affected())
}
