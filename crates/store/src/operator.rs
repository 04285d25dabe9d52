//! What the operator's onsale dashboard reads and the few rows it depends on (design §16):
//! the release controller's last tick per cell (`release_status`, written by the leader once
//! per tick), the results of `boxoffice audit` runs (`audit_runs`), and the per-event
//! activity of the purchase tables.
//!
//! Every read is bounded and index-backed: per-event rates are counts over a short window of
//! `order_event_created_idx` / `ticket_event_issued_idx`, totals are index-only counts of one
//! event's rows, the events listed are capped, the latest audit run is one probe of
//! `audit_runs_finished_idx`. Nothing here locks a purchase row.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::types::Json;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

/// Audit runs older than this are pruned when a new one is recorded, days.
pub const AUDIT_RETENTION_DAYS: i64 = 90;

/// The release controller's last tick, as the leader records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
pub struct ReleaseStatus {
    /// The purchase cell.
    pub cell: String,
    /// R, positions per second.
    pub rate_per_s: f64,
    /// This tick's action: `increase`, `hold` or `decrease`.
    pub action: String,
    /// The signals behind this tick's action (over or failed for a decrease, soft for a hold;
    /// empty for an increase).
    pub reasons: Vec<String>,
    /// When R last changed value.
    pub moved_at: Option<DateTime<Utc>>,
    /// The action of that tick.
    pub moved_action: Option<String>,
    /// Its reasons.
    pub moved_reasons: Vec<String>,
    /// Every signal: `{"signals": [{name, value, threshold, state}], "consumer_lag_by_partition": [...]}`.
    pub signals: Json<serde_json::Value>,
    /// The events with a queue this tick: `{event id: {rate_per_s, queued, pre_queued,
    /// admitted_live, admitted_per_s, admitted_total}}`.
    pub event_rates: Json<serde_json::Value>,
    /// The controller's floor, positions per second.
    pub min_per_s: f64,
    /// Its ceiling.
    pub max_per_s: f64,
    /// When this leader took the cell's lock.
    pub leader_since: DateTime<Utc>,
    /// When the row was written (the leader's clock).
    pub updated_at: DateTime<Utc>,
}

/// Writes the cell's row (one upsert per controller tick, on the controller's connection).
pub async fn record_release_status(c: &mut PgConnection, s: &ReleaseStatus) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO release_status (cell, rate_per_s, action, reasons, moved_at, moved_action, moved_reasons,
                                     signals, event_rates, min_per_s, max_per_s, leader_since, updated_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
         ON CONFLICT (cell) DO UPDATE SET
             rate_per_s = excluded.rate_per_s, action = excluded.action, reasons = excluded.reasons,
             moved_at = excluded.moved_at, moved_action = excluded.moved_action,
             moved_reasons = excluded.moved_reasons, signals = excluded.signals,
             event_rates = excluded.event_rates, min_per_s = excluded.min_per_s,
             max_per_s = excluded.max_per_s, leader_since = excluded.leader_since,
             updated_at = excluded.updated_at",
    )
    .bind(&s.cell)
    .bind(s.rate_per_s)
    .bind(&s.action)
    .bind(&s.reasons)
    .bind(s.moved_at)
    .bind(&s.moved_action)
    .bind(&s.moved_reasons)
    .bind(&s.signals)
    .bind(&s.event_rates)
    .bind(s.min_per_s)
    .bind(s.max_per_s)
    .bind(s.leader_since)
    .bind(s.updated_at)
    .execute(&mut *c)
    .await?;
    Ok(())
}

/// The cell's last recorded tick (`None`: no controller has led this cell).
pub async fn release_status(pool: &PgPool, cell: &str) -> Result<Option<ReleaseStatus>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM release_status WHERE cell = $1").bind(cell).fetch_optional(pool).await
}

/// One audit run to record.
#[derive(Debug, Clone, Serialize)]
pub struct NewAuditRun {
    /// When the run began.
    pub started_at: DateTime<Utc>,
    /// The event it was restricted to, if any.
    pub event_id: Option<Uuid>,
    /// Every violation count by name (`null`: not checked).
    pub violations: serde_json::Value,
    /// Sum of the counts of the checks that ran.
    pub total: i64,
    /// The run's exit code (0 clean, 1 violation, 2 a check could not run).
    pub exit_code: i32,
    /// Which checks ran, over what, or why not.
    pub checks: serde_json::Value,
    /// Business totals.
    pub totals: serde_json::Value,
}

/// A recorded audit run.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct AuditRun {
    /// Its id (increasing).
    pub id: i64,
    /// When it began.
    pub started_at: DateTime<Utc>,
    /// When it was recorded (database clock).
    pub finished_at: DateTime<Utc>,
    /// The event it was restricted to, if any.
    pub event_id: Option<Uuid>,
    /// Every violation count by name (`null`: not checked).
    pub violations: Json<serde_json::Value>,
    /// Sum of the counts.
    pub total: i64,
    /// Its exit code.
    pub exit_code: i32,
    /// Which checks ran.
    pub checks: Json<serde_json::Value>,
    /// Business totals.
    pub totals: Json<serde_json::Value>,
}

/// Records `run` and prunes runs older than [`AUDIT_RETENTION_DAYS`]; returns its id.
pub async fn record_audit_run(pool: &PgPool, run: &NewAuditRun) -> Result<i64, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let id = sqlx::query_scalar(
        "INSERT INTO audit_runs (started_at, event_id, violations, total, exit_code, checks, totals)
         VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id",
    )
    .bind(run.started_at)
    .bind(run.event_id)
    .bind(Json(&run.violations))
    .bind(run.total)
    .bind(run.exit_code)
    .bind(Json(&run.checks))
    .bind(Json(&run.totals))
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query(
        "DELETE FROM audit_runs WHERE finished_at < clock_timestamp() - make_interval(days => $1::int)",
    )
    .bind(AUDIT_RETENTION_DAYS as i32)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(id)
}

/// A completed `boxoffice reconcile` run (migration 0017).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct ReconcileRun {
    /// When it finished.
    pub finished_at: DateTime<Utc>,
    /// The drift it left unresolved, per kind (every kind, 0 when none).
    pub unresolved: Json<std::collections::BTreeMap<String, i64>>,
    /// Drift it closed (`--fix`).
    pub fixed: i64,
}

/// Records a completed reconcile run over `since..until` and prunes runs older than the
/// audit runs' retention, in one transaction.
///
/// # Errors
/// Database errors.
pub async fn record_reconcile_run(
    pool: &PgPool,
    since: DateTime<Utc>,
    until: Option<DateTime<Utc>>,
    unresolved: &std::collections::BTreeMap<String, i64>,
    fixed: i64,
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO reconcile_runs (since, until, unresolved, fixed) VALUES ($1, $2, $3, $4)")
        .bind(since)
        .bind(until)
        .bind(Json(unresolved))
        .bind(fixed)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "DELETE FROM reconcile_runs WHERE finished_at < clock_timestamp() - make_interval(days => $1::int)",
    )
    .bind(AUDIT_RETENTION_DAYS as i32)
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// The most recent reconcile run (`None`: never reconciled).
///
/// # Errors
/// Database errors.
pub async fn latest_reconcile_run(pool: &PgPool) -> Result<Option<ReconcileRun>, sqlx::Error> {
    sqlx::query_as(
        "SELECT finished_at, unresolved, fixed FROM reconcile_runs ORDER BY finished_at DESC LIMIT 1",
    )
    .fetch_optional(pool)
    .await
}

/// The most recent audit run (`None`: never audited).
pub async fn latest_audit_run(pool: &PgPool) -> Result<Option<AuditRun>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM audit_runs ORDER BY finished_at DESC LIMIT 1").fetch_optional(pool).await
}

/// An event the dashboard shows.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct DashboardEvent {
    /// Event id.
    pub id: Uuid,
    /// Its name.
    pub name: String,
    /// Its sales window (`None` opening: not on sale).
    pub sales_open_at: Option<DateTime<Utc>>,
    /// End of the window (`None`: open-ended).
    pub sales_close_at: Option<DateTime<Utc>>,
    /// Whether the window is open now (database clock).
    pub on_sale: bool,
    /// `active`, `frozen` (moving) or `moved`.
    pub cell_state: String,
    /// Whether it had a hold in the last `recent_min` minutes.
    pub recent_activity: bool,
}

/// The events of this ledger whose sales window is open now, opens or closed within
/// `recent_min` minutes, those with a hold in the last `recent_min` minutes first, then by
/// opening (latest first); at most `limit`. One pass over `events` (one row per show) with
/// one index probe each for recent holds.
pub async fn dashboard_events(
    pool: &PgPool,
    recent_min: i64,
    limit: i64,
) -> Result<Vec<DashboardEvent>, sqlx::Error> {
    sqlx::query_as(
        "SELECT e.id, e.name, e.sales_open_at, e.sales_close_at, e.cell_state,
                (e.sales_open_at <= now() AND (e.sales_close_at IS NULL OR e.sales_close_at > now())) AS on_sale,
                EXISTS (SELECT 1 FROM orders o WHERE o.event_id = e.id
                          AND o.created_at > now() - make_interval(mins => $1::int)) AS recent_activity
           FROM events e
          WHERE e.sales_open_at IS NOT NULL AND e.cell_state <> 'moved'
            AND e.sales_open_at <= now() + make_interval(mins => $1::int)
            AND (e.sales_close_at IS NULL OR e.sales_close_at > now() - make_interval(mins => $1::int))
          ORDER BY recent_activity DESC, e.sales_open_at DESC, e.id
          LIMIT $2",
    )
    .bind(recent_min as i32)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// One event's activity: counts over the last `window_s` seconds, and totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, sqlx::FromRow)]
pub struct EventActivity {
    /// Event id.
    pub id: Uuid,
    /// Holds created (one order each) in the window.
    pub holds_in_window: i64,
    /// Tickets issued (one per seat) in the window.
    pub tickets_in_window: i64,
    /// Holds ever created for the event (orders, whatever became of them).
    pub holds_total: i64,
    /// Seats under an active hold now.
    pub seats_held: i64,
    /// Tickets issued, voided ones included.
    pub tickets_total: i64,
    /// Seats of the event.
    pub seats_total: i64,
}

/// The activity of `events` over the last `window_s` seconds (database clock), one row per
/// event found. Index range scans per event: orders by (event, created_at), tickets by
/// (event, issued_at), seats by event; the seats held join only the active holds.
pub async fn event_activity(
    pool: &PgPool,
    events: &[Uuid],
    window_s: f64,
) -> Result<Vec<EventActivity>, sqlx::Error> {
    sqlx::query_as(
        "SELECT e.id,
                (SELECT count(*) FROM orders o WHERE o.event_id = e.id
                   AND o.created_at > now() - make_interval(secs => $2)) AS holds_in_window,
                (SELECT count(*) FROM tickets t WHERE t.event_id = e.id
                   AND t.issued_at > now() - make_interval(secs => $2)) AS tickets_in_window,
                (SELECT count(*) FROM orders o WHERE o.event_id = e.id) AS holds_total,
                (SELECT count(*) FROM holds h JOIN orders o ON o.id = h.order_id
                   JOIN hold_seats hs ON hs.hold_id = h.id AND hs.released_at IS NULL
                  WHERE h.status = 'active' AND o.event_id = e.id) AS seats_held,
                (SELECT count(*) FROM tickets t WHERE t.event_id = e.id) AS tickets_total,
                (SELECT count(*) FROM seats s WHERE s.event_id = e.id) AS seats_total
           FROM unnest($1::uuid[]) AS e(id)",
    )
    .bind(events)
    .bind(window_s)
    .fetch_all(pool)
    .await
}

/// Cell-wide figures the ledger answers directly.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct CellFigures {
    /// Unpublished outbox rows the relay will publish (the rows of parked orders excepted).
    pub outbox_unpublished: i64,
    /// Age of the oldest one, ms (0 when none).
    pub outbox_oldest_age_ms: i64,
    /// Unpublished rows of parked orders ([`crate::outbox::park_refused`]).
    pub outbox_parked: i64,
    /// How far the oldest lapsed, still active hold is past its end, ms (0 when none).
    pub expiry_delay_ms: f64,
    /// Holds in status `active`.
    pub active_holds: f64,
}

/// Reads [`CellFigures`] (the same queries as the release controller's probes).
pub async fn cell_figures(pool: &PgPool) -> Result<CellFigures, sqlx::Error> {
    let mut c = pool.acquire().await?;
    let backlog = crate::outbox::backlog(&mut *c).await?;
    Ok(CellFigures {
        outbox_unpublished: backlog.unpublished,
        outbox_oldest_age_ms: backlog.oldest_age_ms,
        outbox_parked: backlog.parked,
        expiry_delay_ms: crate::signals::expiry_delay_ms(&mut c).await?,
        active_holds: crate::signals::active_holds(&mut c).await?,
    })
}
