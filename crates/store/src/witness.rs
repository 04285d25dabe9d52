//! The region witness (design §15), in a database outside every region: which region may
//! write at which epoch (`region_authority`), and the leases its processes hold
//! (`region_leases`).
//!
//! Protects the single writing region when the old primary comes back: an epoch check inside
//! a database fences only that database's writers, so every purchase process also renews a
//! lease here ([`renew`]) and stops writing when it cannot within the lease's TTL. A renewal
//! succeeds only for the authority's region and epoch, under a share lock on the authority
//! row; [`fence`] takes that row for update (waiting for renewals in flight), moves the
//! authority, and sets `writers_clear_at` to when every lease of an older epoch has lapsed
//! plus a skew margin. Promotion waits for that instant by this database's clock.

use chrono::{DateTime, Utc};
use sqlx::migrate::Migrator;
use sqlx::PgPool;

use crate::region::Writer;

/// The witness database's migrations (`boxoffice region init` applies them).
pub static WITNESS_MIGRATOR: Migrator = sqlx::migrate!("./witness_migrations");

/// The authority record.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize)]
pub struct Authority {
    /// The region that may write.
    pub region: String,
    /// Its epoch.
    pub epoch: i64,
    /// Last change.
    pub changed_at: DateTime<Utc>,
    /// Who changed it.
    pub changed_by: Option<String>,
    /// After a fence: when every older lease has lapsed, plus the skew margin.
    pub writers_clear_at: Option<DateTime<Utc>>,
    /// After a fence: the replica's last replayed WAL position.
    pub recovery_lsn: Option<String>,
    /// After a fence: commit time of the replica's last replayed transaction.
    pub recovery_point_at: Option<DateTime<Utc>>,
    /// After a fence that reached the old primary: its WAL position.
    pub old_primary_lsn: Option<String>,
}

const AUTHORITY: &str = "SELECT region, epoch, changed_at, changed_by, writers_clear_at,
        recovery_lsn::text AS recovery_lsn, recovery_point_at, old_primary_lsn::text AS old_primary_lsn
   FROM region_authority";

/// Reads the authority, if the witness was initialised.
pub async fn authority(pool: &PgPool) -> Result<Option<Authority>, sqlx::Error> {
    sqlx::query_as(AUTHORITY).fetch_optional(pool).await
}

/// Initialises the authority to `writer` when there is none; returns the authority either way
/// (never overwrites one: a fence moves it).
pub async fn init(pool: &PgPool, writer: &Writer, by: &str) -> Result<Authority, sqlx::Error> {
    sqlx::query(
        "INSERT INTO region_authority (region, epoch, changed_by) VALUES ($1, $2, $3)
         ON CONFLICT (singleton) DO NOTHING",
    )
    .bind(&writer.region)
    .bind(writer.epoch)
    .bind(by)
    .execute(pool)
    .await?;
    Ok(authority(pool).await?.expect("just initialised"))
}

/// Renews `holder`'s lease for `ttl_ms` when `writer` is the authority. `Ok(None)` when it is
/// not (fenced, or the witness not initialised): the caller must stop writing.
pub async fn renew(
    pool: &PgPool,
    holder: &str,
    writer: &Writer,
    ttl_ms: i64,
) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    sqlx::query_scalar(
        "WITH a AS (SELECT region, epoch FROM region_authority FOR SHARE)
         INSERT INTO region_leases (holder, region, epoch, renewed_at, expires_at)
         SELECT $1, a.region, a.epoch, clock_timestamp(),
                clock_timestamp() + make_interval(secs => $4::double precision / 1000.0)
           FROM a WHERE a.region = $2 AND a.epoch = $3
         ON CONFLICT (holder) DO UPDATE
            SET region = EXCLUDED.region, epoch = EXCLUDED.epoch,
                renewed_at = EXCLUDED.renewed_at, expires_at = EXCLUDED.expires_at
         RETURNING expires_at",
    )
    .bind(holder)
    .bind(&writer.region)
    .bind(writer.epoch)
    .bind(ttl_ms as f64)
    .fetch_optional(pool)
    .await
}

/// Why the witness refused a fence.
#[derive(Debug, thiserror::Error)]
pub enum WitnessError {
    /// The witness has no authority record (`boxoffice region init`).
    #[error("the witness has no authority record; run `boxoffice region init` against it")]
    Uninitialised,
    /// The authority already is at or past the requested epoch for another region.
    #[error("the witness is at epoch {epoch} for region {region}: a fence must raise the epoch")]
    NotNewer {
        /// The authority's epoch.
        epoch: i64,
        /// The authority's region.
        region: String,
    },
    /// The database failed.
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Moves the authority to `to` (epoch exactly one above the current one, or already there:
/// idempotent) and sets `writers_clear_at` = the latest expiry of any lease of an older epoch
/// (or now) + `skew_ms`. Returns the new authority.
pub async fn fence(pool: &PgPool, to: &Writer, skew_ms: i64, by: &str) -> Result<Authority, WitnessError> {
    let mut tx = pool.begin().await?;
    let current: Option<(String, i64)> =
        sqlx::query_as("SELECT region, epoch FROM region_authority FOR UPDATE")
            .fetch_optional(&mut *tx)
            .await?;
    let Some((region, epoch)) = current else { return Err(WitnessError::Uninitialised) };
    if region == to.region && epoch == to.epoch {
        tx.rollback().await?;
        return Ok(authority(pool).await?.expect("exists"));
    }
    if epoch >= to.epoch {
        return Err(WitnessError::NotNewer { epoch, region });
    }
    sqlx::query(
        "UPDATE region_authority
            SET region = $1, epoch = $2, changed_at = clock_timestamp(), changed_by = $3,
                recovery_lsn = NULL, recovery_point_at = NULL, old_primary_lsn = NULL,
                writers_clear_at = GREATEST(clock_timestamp(),
                    (SELECT max(expires_at) FROM region_leases WHERE epoch < $2))
                    + make_interval(secs => $4::double precision / 1000.0)",
    )
    .bind(&to.region)
    .bind(to.epoch)
    .bind(by)
    .bind(skew_ms as f64)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(authority(pool).await?.expect("exists"))
}

/// Records the recovery point read off the replica, and the old primary's position when the
/// fence could reach it.
pub async fn record_recovery_point(
    pool: &PgPool,
    recovery_lsn: &str,
    recovery_point_at: Option<DateTime<Utc>>,
    old_primary_lsn: Option<&str>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE region_authority
            SET recovery_lsn = $1::pg_lsn, recovery_point_at = $2,
                old_primary_lsn = COALESCE($3::pg_lsn, old_primary_lsn)",
    )
    .bind(recovery_lsn)
    .bind(recovery_point_at)
    .bind(old_primary_lsn)
    .execute(pool)
    .await?;
    Ok(())
}

/// Milliseconds until `writers_clear_at` by the witness's clock (0 when passed or unset).
pub async fn ms_until_clear(pool: &PgPool) -> Result<i64, sqlx::Error> {
    let ms: Option<f64> = sqlx::query_scalar(
        "SELECT GREATEST(0, EXTRACT(EPOCH FROM writers_clear_at - clock_timestamp()) * 1000)::float8
           FROM region_authority",
    )
    .fetch_optional(pool)
    .await?
    .flatten();
    Ok(ms.unwrap_or(0.0).ceil() as i64)
}

/// Leases still unexpired, by holder: `(holder, region, epoch, expires_at)`.
pub async fn live_leases(pool: &PgPool) -> Result<Vec<(String, String, i64, DateTime<Utc>)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT holder, region, epoch, expires_at FROM region_leases
          WHERE expires_at > clock_timestamp() ORDER BY holder",
    )
    .fetch_all(pool)
    .await
}
