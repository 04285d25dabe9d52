//! The consumer inbox (design §8): `(consumer, event_id)` recorded in the same transaction as
//! the consumer's effect, so a redelivered message is a no-op (invariant 4).

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
