//! The region epoch of this ledger (design §15, §17): who may write it, the fence that moves
//! it, the lease mirror that stops a returning old primary, and the figures of a failover
//! (replication lag, the recovery point, republishing the outbox).
//!
//! Protects every invariant across a regional failover: at any instant one region's
//! processes can commit purchase writes. The check itself lives in the database
//! (migration 0013): the first write statement of each transaction to a purchase table runs
//! `region_fence_check()` in full (later ones find the transaction-local mark it leaves),
//! which takes the fence's advisory lock ([`FENCE_LOCK`]) shared (migration 0018; the hold
//! transaction takes it in its first statement, before its seat locks, whatever the session
//! declares) and compares the session's declared epoch
//! (`boxoffice.region_epoch`, set in the connection's startup options by
//! [`writer_options`]) with the record, and refuses with SQLSTATE [`FENCED`]; when the
//! region's lease has lapsed by this database's clock it refuses with [`LEASE_LAPSED`]. A
//! transaction is thereby checked on its first write, under a lock held to its commit, with
//! no extra round trip and whatever code path it came from. [`fence`] takes the same lock
//! exclusive before bumping the record: it waits only for transactions already past their first
//! write (and holds past their first statement), new writers queue behind it, and every
//! commit under the old epoch lies before the WAL position it records. (A bare `UPDATE` would
//! wait for a row lock that a stream of new share-lockers can keep it from ever getting.) A
//! writer that locked rows before its first write and queued behind the fence can be what a
//! writer past it waits for (a hold reclaiming a lapsed hold the expiry or the saga has
//! locked): PostgreSQL sees the cycle through the fence's queue and lets the queued writer go
//! first after `deadlock_timeout`, a stall of the fence, not an error.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnectOptions;
use sqlx::PgPool;
use uuid::Uuid;

/// The fence's lock: a transaction-scoped advisory lock on this key pair (`'BXF1'`, 1), taken
/// shared by every purchase writer on its first write (the `region_fence_check` trigger,
/// migration 0018), and by the hold transaction in its first statement, and held to its
/// commit, and exclusive by [`fence`]. Readers of
/// `region_epoch` take no part in it, so a long read (a report, a backup) never holds a fence
/// up.
pub const FENCE_LOCK: (i32, i32) = (1_113_081_393, 1);

/// SQLSTATE of a write whose session epoch is not the ledger's.
pub const FENCED: &str = "BXF01";
/// SQLSTATE of a write after the region's lease lapsed.
pub const LEASE_LAPSED: &str = "BXF02";

/// Why the ledger refused a write: the distinct error every purchase path maps (HTTP 503
/// `region_fenced`; a transient failure for workers, which retry until they are stopped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The session's epoch is not the ledger's (a fenced writer, or one started too early).
    Fenced,
    /// The region's lease from the witness lapsed.
    LeaseLapsed,
}

/// Whether `e` is the ledger refusing a fenced writer.
pub fn refusal(e: &sqlx::Error) -> Option<Refusal> {
    match e {
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some(FENCED) => Some(Refusal::Fenced),
            Some(LEASE_LAPSED) => Some(Refusal::LeaseLapsed),
            _ => None,
        },
        _ => None,
    }
}

/// A writer's identity: its region's name and the epoch it writes at.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Writer {
    /// The region's name, e.g. `eu-west-1`.
    pub region: String,
    /// The epoch (≥ 1).
    pub epoch: i64,
}

/// `opts` with the writer's region and epoch declared on every session, so the fence trigger
/// checks them and the outbox stamps them on every fact.
pub fn writer_options(opts: PgConnectOptions, writer: &Writer) -> PgConnectOptions {
    let epoch = writer.epoch.to_string();
    opts.options([("boxoffice.region", writer.region.as_str()), ("boxoffice.region_epoch", epoch.as_str())])
}

/// The ledger's epoch record.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, serde::Serialize)]
pub struct EpochRecord {
    /// The region that may write.
    pub region: String,
    /// Its epoch.
    pub epoch: i64,
    /// When the record last changed.
    pub changed_at: DateTime<Utc>,
    /// Who changed it (`fence` / `promote` and the operator's host).
    pub changed_by: Option<String>,
    /// WAL insert position taken under the fence's lock (text form, e.g. `0/3000148`).
    pub fence_lsn: Option<String>,
}

/// Reads the epoch record.
pub async fn record<'e>(ex: impl sqlx::PgExecutor<'e>) -> Result<EpochRecord, sqlx::Error> {
    sqlx::query_as(
        "SELECT region, epoch, changed_at, changed_by, fence_lsn::text AS fence_lsn FROM region_epoch",
    )
    .fetch_one(ex)
    .await
}

/// What [`fence`] did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Fenced {
    /// The record before.
    pub from: Writer,
    /// The record after.
    pub to: Writer,
    /// Every commit of an older epoch lies before this WAL position.
    pub fence_lsn: String,
    /// How long the fence waited for in-flight writers, ms.
    pub waited_ms: i64,
}

/// Why a fence was refused.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// Epochs only grow: the ledger is already at `current` ≥ the requested one.
    #[error("the ledger is already at epoch {current} (region {region}); a fence must raise it")]
    NotNewer {
        /// The ledger's epoch.
        current: i64,
        /// The ledger's region.
        region: String,
    },
    /// The database failed (a replica answers read-only: promote it first).
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Moves the ledger to `to` (epoch strictly greater than the record's): takes [`FENCE_LOCK`]
/// exclusive (waiting for writers already past their first write, which hold it shared; new
/// ones queue), records
/// the WAL insert position and updates the record, in one transaction. Idempotent for the same
/// `to`: a fence already at `to` returns the recorded position without waiting.
///
/// A writer past its first write may wait for a row lock held by a writer queued behind the
/// fence: PostgreSQL breaks that cycle by aborting one of the three, and when it is the fence,
/// the fence is tried again (up to five times).
pub async fn fence(pool: &PgPool, to: &Writer, by: &str) -> Result<Fenced, FenceError> {
    let mut attempt = 0;
    loop {
        match fence_once(pool, to, by).await {
            Err(FenceError::Db(e)) if crate::is_retryable(&e) && attempt < 4 => attempt += 1,
            other => return other,
        }
    }
}

async fn fence_once(pool: &PgPool, to: &Writer, by: &str) -> Result<Fenced, FenceError> {
    let mut tx = pool.begin().await?;
    let started = std::time::Instant::now();
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2)")
        .bind(FENCE_LOCK.0)
        .bind(FENCE_LOCK.1)
        .execute(&mut *tx)
        .await?;
    let waited_ms = started.elapsed().as_millis() as i64;
    let current = record(&mut *tx).await?;
    let from = Writer { region: current.region.clone(), epoch: current.epoch };
    if current.epoch == to.epoch && current.region == to.region {
        tx.rollback().await?;
        return Ok(Fenced {
            from: from.clone(),
            to: from,
            fence_lsn: current.fence_lsn.unwrap_or_default(),
            waited_ms,
        });
    }
    if current.epoch >= to.epoch {
        return Err(FenceError::NotNewer { current: current.epoch, region: current.region });
    }
    let (fence_lsn,): (String,) = sqlx::query_as(
        "UPDATE region_epoch
            SET region = $1, epoch = $2, changed_at = clock_timestamp(), changed_by = $3,
                fence_lsn = pg_current_wal_insert_lsn()
         RETURNING fence_lsn::text",
    )
    .bind(&to.region)
    .bind(to.epoch)
    .bind(by)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Fenced { from, to: to.clone(), fence_lsn, waited_ms })
}

/// Refuses every later session of the application's role on this database: sets
/// `default_transaction_read_only` for the connected role in this database and terminates
/// the role's other sessions. Used by the fence on an old primary that is still reachable.
/// Returns how many sessions were terminated.
pub async fn make_read_only(pool: &PgPool) -> Result<i64, sqlx::Error> {
    let (role, db): (String, String) =
        sqlx::query_as("SELECT current_user::text, current_database()::text").fetch_one(pool).await?;
    sqlx::query(&format!(
        "ALTER ROLE {} IN DATABASE {} SET default_transaction_read_only = on",
        quote_ident(&role),
        quote_ident(&db)
    ))
    .execute(pool)
    .await?;
    let (n,): (i64,) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
           FROM pg_stat_activity
          WHERE datname = current_database() AND usename = current_user AND pid <> pg_backend_pid()
            AND backend_type = 'client backend'",
    )
    .fetch_one(pool)
    .await?;
    Ok(n)
}

/// Undoes [`make_read_only`] for the connected role in this database (the promoted replica
/// inherited it when the old primary was fenced while it still streamed).
pub async fn clear_read_only(pool: &PgPool) -> Result<(), sqlx::Error> {
    let (role, db): (String, String) =
        sqlx::query_as("SELECT current_user::text, current_database()::text").fetch_one(pool).await?;
    sqlx::query(&format!(
        "ALTER ROLE {} IN DATABASE {} RESET default_transaction_read_only",
        quote_ident(&role),
        quote_ident(&db)
    ))
    .execute(pool)
    .await?;
    Ok(())
}

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// This database's clock now: read before a renewal is sent, so the mirrored lease is bounded
/// by an instant that precedes the witness's grant.
pub async fn clock(pool: &PgPool) -> Result<DateTime<Utc>, sqlx::Error> {
    sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(pool).await
}

/// Mirrors a lease the witness granted into this ledger: writes are refused once
/// `valid_until` = `sent_at` + `ttl_ms` has passed by this database's clock, where `sent_at`
/// is this database's [`clock`] read before the renewal was sent (so the mirror never outlives
/// the witness's grant, however late this write lands). The lease only moves forward for the
/// same writer; a new writer replaces it.
pub async fn mirror_lease(
    pool: &PgPool,
    writer: &Writer,
    sent_at: DateTime<Utc>,
    ttl_ms: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO region_lease (singleton, required, region, epoch, valid_until)
         VALUES (true, true, $1, $2, $3::timestamptz + make_interval(secs => $4::double precision / 1000.0))
         ON CONFLICT (singleton) DO UPDATE
            SET required = true, region = EXCLUDED.region, epoch = EXCLUDED.epoch,
                valid_until = CASE WHEN region_lease.region = EXCLUDED.region AND region_lease.epoch = EXCLUDED.epoch
                                   THEN GREATEST(region_lease.valid_until, EXCLUDED.valid_until)
                                   ELSE EXCLUDED.valid_until END",
    )
    .bind(&writer.region)
    .bind(writer.epoch)
    .bind(sent_at)
    .bind(ttl_ms.max(0) as f64)
    .execute(pool)
    .await?;
    Ok(())
}

/// The lease mirror: `(region, epoch, valid_until)`, if any process ever renewed one here.
pub async fn lease<'e>(
    ex: impl sqlx::PgExecutor<'e>,
) -> Result<Option<(String, i64, DateTime<Utc>)>, sqlx::Error> {
    sqlx::query_as("SELECT region, epoch, valid_until FROM region_lease WHERE required")
        .fetch_optional(ex)
        .await
}

/// Where this server stands in replication.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Replication {
    /// `primary` or `replica` (in recovery).
    pub role: &'static str,
    /// On a primary: its current WAL position; on a replica: the last position replayed.
    pub lsn: String,
    /// On a replica: the last position received from the primary.
    pub receive_lsn: Option<String>,
    /// On a replica: commit time of the last transaction replayed (the recovery point).
    pub last_replayed_commit_at: Option<DateTime<Utc>>,
    /// On a replica: seconds since that commit (meaningful while the primary commits).
    pub lag_seconds: Option<f64>,
    /// On a primary: one entry per replica it streams to.
    pub replicas: Vec<ReplicaLag>,
}

/// A replica as its primary sees it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct ReplicaLag {
    /// `application_name` of the replica's WAL receiver.
    pub name: String,
    /// `streaming`, `catchup`, ….
    pub state: String,
    /// WAL bytes written here and not yet replayed there.
    pub lag_bytes: i64,
    /// `replay_lag` in seconds, when reported.
    pub lag_seconds: Option<f64>,
}

/// Reads [`Replication`] (needs `pg_monitor` or superuser for the replicas' figures).
pub async fn replication(pool: &PgPool) -> Result<Replication, sqlx::Error> {
    let (in_recovery,): (bool,) = sqlx::query_as("SELECT pg_is_in_recovery()").fetch_one(pool).await?;
    if in_recovery {
        let (lsn, receive_lsn, at, lag): (
            Option<String>,
            Option<String>,
            Option<DateTime<Utc>>,
            Option<f64>,
        ) = sqlx::query_as(
            "SELECT pg_last_wal_replay_lsn()::text, pg_last_wal_receive_lsn()::text,
                        pg_last_xact_replay_timestamp(),
                        EXTRACT(EPOCH FROM clock_timestamp() - pg_last_xact_replay_timestamp())::float8",
        )
        .fetch_one(pool)
        .await?;
        return Ok(Replication {
            role: "replica",
            lsn: lsn.unwrap_or_default(),
            receive_lsn,
            last_replayed_commit_at: at,
            lag_seconds: lag,
            replicas: Vec::new(),
        });
    }
    let (lsn,): (String,) = sqlx::query_as("SELECT pg_current_wal_lsn()::text").fetch_one(pool).await?;
    let replicas = sqlx::query_as(
        "SELECT application_name AS name, state,
                COALESCE(pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn), 0)::int8 AS lag_bytes,
                EXTRACT(EPOCH FROM replay_lag)::float8 AS lag_seconds
           FROM pg_stat_replication ORDER BY application_name",
    )
    .fetch_all(pool)
    .await?;
    Ok(Replication {
        role: "primary",
        lsn,
        receive_lsn: None,
        last_replayed_commit_at: None,
        lag_seconds: None,
        replicas,
    })
}

/// Bytes between two WAL positions (`a - b`).
pub async fn lsn_diff(pool: &PgPool, a: &str, b: &str) -> Result<i64, sqlx::Error> {
    let (d,): (f64,) = sqlx::query_as("SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::float8")
        .bind(a)
        .bind(b)
        .fetch_one(pool)
        .await?;
    Ok(d as i64)
}

/// Promotes this replica (`pg_promote`, waiting up to `wait_s` seconds). Returns false when
/// the server was not in recovery (already promoted: idempotent).
pub async fn promote(pool: &PgPool, wait_s: i32) -> Result<bool, sqlx::Error> {
    let (in_recovery,): (bool,) = sqlx::query_as("SELECT pg_is_in_recovery()").fetch_one(pool).await?;
    if !in_recovery {
        return Ok(false);
    }
    let (done,): (bool,) = sqlx::query_as("SELECT pg_promote(true, $1)").bind(wait_s).fetch_one(pool).await?;
    if !done {
        return Err(sqlx::Error::Protocol(format!("pg_promote did not finish within {wait_s} s")));
    }
    Ok(true)
}

/// Marks every outbox row created at or after `since` unpublished again, whatever its
/// `published_at`, so the relay publishes it once more to this region's broker; the
/// consumers' inbox absorbs what they had already applied. Returns how many rows.
///
/// The outbox is the one stream consistent with this ledger's cut; published rows are kept
/// `relay_outbox_retention_s`, which must exceed the worst replication lag plus the
/// republish margin (`Config::validate`).
pub async fn republish(pool: &PgPool, since: DateTime<Utc>) -> Result<u64, sqlx::Error> {
    let r = sqlx::query("UPDATE outbox SET published_at = NULL WHERE created_at >= $1")
        .bind(since)
        .execute(pool)
        .await?;
    Ok(r.rows_affected())
}

/// Whether the fact `event_id` is in this ledger's outbox: a fact stamped with an older epoch
/// is inside this ledger's cut (committed before the recovery point, so its effects are
/// here) exactly when its outbox row is. One that is not was committed by a fenced writer
/// after the cut, or by a zombie: an orphan, never applied.
pub async fn fact_in_cut(tx: &mut crate::Tx<'_>, event_id: Uuid) -> Result<bool, sqlx::Error> {
    let (found,): (bool,) = sqlx::query_as("SELECT EXISTS (SELECT 1 FROM outbox WHERE id = $1)")
        .bind(event_id)
        .fetch_one(&mut **tx)
        .await?;
    Ok(found)
}

/// This process's view of its region lease: writable until an instant on the monotonic clock,
/// moved forward by each renewal the witness grants (`boxoffice_workers::lease`). Read on the
/// hold and webhook paths and by `/readyz`, so a process that lost its lease answers 503 at
/// once and leaves the load balancer's rotation; the ledger's mirror (BXF02) refuses the
/// writes of a path that does not read it.
#[derive(Debug)]
pub struct LeaseGate {
    origin: std::time::Instant,
    /// Milliseconds after `origin` until which the lease holds (0: never granted).
    valid_until_ms: std::sync::atomic::AtomicU64,
}

impl Default for LeaseGate {
    fn default() -> Self {
        Self { origin: std::time::Instant::now(), valid_until_ms: std::sync::atomic::AtomicU64::new(0) }
    }
}

impl LeaseGate {
    /// Whether the lease holds now.
    pub fn is_valid(&self) -> bool {
        (self.origin.elapsed().as_millis() as u64)
            < self.valid_until_ms.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Extends the lease to `sent + ttl`, where `sent` is when the granted renewal was sent
    /// (so the process stops no later than the witness's own expiry of the grant). Never
    /// moves it back.
    pub fn extend(&self, sent: std::time::Instant, ttl: std::time::Duration) {
        let until = (sent.saturating_duration_since(self.origin) + ttl).as_millis() as u64;
        self.valid_until_ms.fetch_max(until, std::sync::atomic::Ordering::AcqRel);
    }

    /// Milliseconds the lease still holds (0 when lapsed).
    pub fn remaining_ms(&self) -> u64 {
        self.valid_until_ms
            .load(std::sync::atomic::Ordering::Acquire)
            .saturating_sub(self.origin.elapsed().as_millis() as u64)
    }
}

/// Drops every region fence trigger of this database; returns how many. Only the capacity
/// bench calls it, on its throwaway database, to measure what the check costs.
pub async fn drop_fence_triggers(pool: &PgPool) -> Result<i64, sqlx::Error> {
    let names: Vec<(String, String)> = sqlx::query_as(
        "SELECT tgname::text, tgrelid::regclass::text FROM pg_trigger WHERE tgname LIKE '%\\_region\\_fence' OR tgname LIKE '%\\_region\\_lease\\_at\\_commit'",
    )
    .fetch_all(pool)
    .await?;
    for (t, rel) in &names {
        sqlx::query(&format!("DROP TRIGGER {} ON {}", quote_ident(t), rel)).execute(pool).await?;
    }
    Ok(names.len() as i64)
}
