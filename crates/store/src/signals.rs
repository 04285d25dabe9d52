//! The ledger's load signals read by the waiting room's release controller (design §3): one
//! small query each, on the controller's own connection, plus the leader lock that lets one
//! controller per purchase cell release buyers. Reads only, apart from the one-row commit
//! probe (`release_probe`).
//!
//! The hold signals read the active holds through `hold_expiry_idx`: [`expiry_delay_ms`] and
//! [`never_payable_share`] only the range of it they count (`expires_at` against `now()`,
//! which the index can take; see "Periodic sweeps" in the crate docs), [`payable_delay_p99_ms`]
//! and [`authorization_wait_ms`] every active hold, as many as the onsale holds at once.

use sqlx::PgConnection;
use std::time::Instant;

/// Upserts this cell's row of `release_probe` and returns the commit latency in ms: what one
/// small write costs the database right now.
pub async fn commit_latency_ms(c: &mut PgConnection, cell: &str) -> Result<f64, sqlx::Error> {
    let t = Instant::now();
    sqlx::query(
        "INSERT INTO release_probe (cell, beat_at, beats) VALUES ($1, clock_timestamp(), 1)
         ON CONFLICT (cell) DO UPDATE SET beat_at = excluded.beat_at, beats = release_probe.beats + 1",
    )
    .bind(cell)
    .execute(&mut *c)
    .await?;
    Ok(t.elapsed().as_secs_f64() * 1_000.0)
}

/// Sessions of this database waiting on a lock now.
pub async fn lock_waits(c: &mut PgConnection) -> Result<f64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*)::float8 FROM pg_stat_activity
          WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(&mut *c)
    .await
}

/// Deadlocks this database has detected since its statistics were reset (a running total).
pub async fn deadlocks_total(c: &mut PgConnection) -> Result<f64, sqlx::Error> {
    sqlx::query_scalar("SELECT deadlocks::float8 FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(&mut *c)
        .await
}

/// Client connections of the whole server over `max_connections` (0–1).
pub async fn connection_saturation(c: &mut PgConnection) -> Result<f64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')::float8
                / current_setting('max_connections')::float8",
    )
    .fetch_one(&mut *c)
    .await
}

/// Holds in status `active`.
pub async fn active_holds(c: &mut PgConnection) -> Result<f64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*)::float8 FROM holds WHERE status = 'active'").fetch_one(&mut *c).await
}

/// How long the oldest lapsed, still active hold has waited for the expiry worker, ms (0 when
/// none).
pub async fn expiry_delay_ms(c: &mut PgConnection) -> Result<f64, sqlx::Error> {
    sqlx::query_scalar(concat!(
        "SELECT COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(",
        crate::holds::hold_end!(""),
        ")) * 1000, 0)::float8
           FROM holds WHERE status = 'active' AND expires_at < now() AND ",
        crate::holds::hold_end!(""),
        " < clock_timestamp()",
    ))
    .fetch_one(&mut *c)
    .await
}

/// p99 over the active holds created in the last `window_s` seconds of the time from hold
/// to payable (`payable_at`; a hold not payable yet counts its age so far), ms: how long
/// buyers wait for a client secret right now (0 when none).
pub async fn payable_delay_p99_ms(c: &mut PgConnection, window_s: f64) -> Result<f64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT COALESCE(percentile_cont(0.99) WITHIN GROUP (
                   ORDER BY EXTRACT(EPOCH FROM COALESCE(payable_at, clock_timestamp()) - created_at)), 0)::float8 * 1000
           FROM holds
          WHERE status = 'active' AND created_at > clock_timestamp() - make_interval(secs => $1)",
    )
    .bind(window_s)
    .fetch_one(&mut *c)
    .await
}

/// How long the oldest authorization reported in time has waited for the saga to confirm
/// its hold, ms (0 when none): the lag between authorization and confirmation.
pub async fn authorization_wait_ms(c: &mut PgConnection) -> Result<f64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(authorization_reported_at)) * 1000, 0)::float8
           FROM holds WHERE status = 'active' AND authorization_reported_at IS NOT NULL",
    )
    .fetch_one(&mut *c)
    .await
}

/// Of the active holds that lapse within `horizon_s` seconds (or have lapsed) without a
/// reported authorization, the share never made payable: holds about to expire unpaid that
/// the buyer could not pay (our lag, not theirs). The denominator is at least 10, so one stray
/// hold in a quiet period does not read as a crisis. 0–1.
pub async fn never_payable_share(c: &mut PgConnection, horizon_s: f64) -> Result<f64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT (count(*) FILTER (WHERE payable_at IS NULL))::float8 / GREATEST(count(*), 10)::float8
           FROM holds
          WHERE status = 'active' AND authorized_until IS NULL
            AND expires_at < now() + make_interval(secs => $1)",
    )
    .bind(horizon_s)
    .fetch_one(&mut *c)
    .await
}

/// Tries the session advisory lock that makes this connection the release leader of `cell`.
pub async fn try_leader_lock(c: &mut PgConnection, cell: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext('boxoffice.release'), hashtext($1))")
        .bind(cell)
        .fetch_one(&mut *c)
        .await
}
