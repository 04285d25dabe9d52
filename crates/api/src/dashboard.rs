//! The operator's onsale view (design §16): the figures of `GET /admin/onsale`, and the
//! Prometheus gauges of the latest audit and of the dead-letter topic.
//!
//! What it shows and where each figure comes from:
//!
//! | figure | source | exact? |
//! |---|---|---|
//! | R, its action and reasons, when and why it last moved, every signal | the release leader's `release_status` row, written once per tick | exact as of the row's `updated_at` (`stale` once older than [`RELEASE_STALE_AFTER`]) |
//! | per event: its share of R, queue length, admitted/s | the same row (`event_rates`), from the leader's releases | exact as of the tick; admitted/s over the leader's last 10 s |
//! | per event: holds/s, ticketed/s | orders and tickets created in the last [`WINDOW_S`] s (ledger, index range scans) | exact over the window (database clock) |
//! | per event: conflicts/s (409 `seat_unavailable`) | counted in each API process, flushed to Redis once a second into per-second counters ([`Dashboard::count_conflict`]), summed over the last [`WINDOW_S`] complete seconds | approximate: a count is filed under the second of its flush (≤ 1 s late), a flush that fails loses its counts, process clocks differ; `null` when Redis cannot answer |
//! | per event totals: holds, seats held now, tickets, seats | ledger, index-only counts of the event's rows | exact |
//! | oldest unpublished outbox row, unpublished rows, expiry delay, active holds | ledger (the release controller's probe queries) | exact |
//! | consumer lag, max and by group/partition | the leader's last lag probe (`release_status`) | exact as of the tick; `null` without a broker or controller |
//! | DLQ depth | high − low watermark of the dead-letter topic's partitions, read every [`GAUGE_REFRESH`] by this process | exact as of its `checked_at`; `null` without a broker |
//! | last audit: counts by invariant, when | the latest `audit_runs` row (`boxoffice audit`) | exact; `null` counts were not checked |
//!
//! Cost: one rendering per process per [`CACHE_TTL`] whatever the number of operators
//! (single-flight, like the seat map), each a handful of bounded, index-backed queries (at
//! most [`MAX_EVENTS`] events) and one `MGET` per event.
//!
//! Gauges, refreshed every [`GAUGE_REFRESH`] by each API process from the ledger and the
//! broker: `boxoffice_audit_violations{invariant}` (the latest run's count per invariant;
//! NaN when that run did not check it), `boxoffice_audit_last_run_timestamp_seconds` (when
//! it finished, Unix seconds), `boxoffice_reconcile_drift{kind}` and
//! `boxoffice_reconcile_last_run_timestamp_seconds` (the latest `boxoffice reconcile` run's
//! unresolved drift per kind, from `reconcile_runs`) and `boxoffice_dlq_depth` (messages in the
//! dead-letter topic; absent without a broker). A failed refresh keeps the previous values and is counted in
//! `boxoffice_dashboard_refresh_errors_total{source}`.

use crate::problem::Problem;
use crate::state::AppState;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use boxoffice_domain::EventId;
use boxoffice_store::operator;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The window of every per-second rate, seconds.
pub const WINDOW_S: i64 = 10;
/// Events whose window closed (or opens) within this long are still shown, minutes; so are
/// those with a hold this recent.
pub const RECENT_MIN: i64 = 15;
/// Most events shown (those with recent holds first).
pub const MAX_EVENTS: i64 = 50;
/// How long one rendering is served.
pub const CACHE_TTL: Duration = Duration::from_secs(1);
/// How often the conflict counts are flushed to Redis.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// How often the gauges (audit, DLQ depth) are refreshed.
pub const GAUGE_REFRESH: Duration = Duration::from_secs(15);
/// A `release_status` row older than this is shown as stale (no leader is ticking).
pub const RELEASE_STALE_AFTER: Duration = Duration::from_secs(5);
/// The Redis counter of 409 `seat_unavailable` answers.
pub const CONFLICTS: &str = "conflicts";

/// The dashboard's shared state (cheap to clone).
#[derive(Clone)]
pub struct Dashboard {
    inner: Arc<Inner>,
}

struct Inner {
    /// Conflicts per event since the last flush.
    conflicts: Mutex<HashMap<Uuid, u64>>,
    /// The last rendering.
    cache: moka::future::Cache<(), Bytes>,
    /// The last dead-letter reading, (depth, when); `None` before the first or after a
    /// failed one.
    dlq: RwLock<Option<(i64, DateTime<Utc>)>>,
}

impl Default for Dashboard {
    fn default() -> Self {
        Self {
            inner: Arc::new(Inner {
                conflicts: Mutex::default(),
                cache: moka::future::Cache::builder().max_capacity(1).time_to_live(CACHE_TTL).build(),
                dlq: RwLock::new(None),
            }),
        }
    }
}

impl std::fmt::Debug for Dashboard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dashboard").finish_non_exhaustive()
    }
}

impl Dashboard {
    /// Counts one 409 `seat_unavailable` answer for `event` (flushed within [`FLUSH_EVERY`]).
    pub fn count_conflict(&self, event: EventId) {
        *self
            .inner
            .conflicts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(event.0)
            .or_default() += 1;
    }

    fn take_conflicts(&self) -> Vec<(EventId, u64)> {
        let mut m = self.inner.conflicts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        m.drain().map(|(e, n)| (EventId(e), n)).collect()
    }

    fn dlq(&self) -> Option<(i64, DateTime<Utc>)> {
        *self.inner.dlq.read().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_dlq(&self, r: Option<(i64, DateTime<Utc>)>) {
        *self.inner.dlq.write().unwrap_or_else(std::sync::PoisonError::into_inner) = r;
    }
}

/// `GET /admin/onsale` answer: the operator's view of the cell's onsales.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OnsaleView {
    /// When this view was rendered (served for up to 1 s).
    pub generated_at: DateTime<Utc>,
    /// The purchase cell this API serves.
    pub cell: String,
    /// The window of every `…_per_s` figure, seconds.
    pub window_s: i64,
    /// The release controller's last tick; `null` when no controller has led this cell.
    pub release: Option<OnsaleRelease>,
    /// Events on sale, opening or closed within 15 minutes, or with a hold that recent
    /// (those first); at most 50.
    pub events: Vec<OnsaleEvent>,
    /// Cell-wide health.
    pub cell_signals: OnsaleCell,
    /// The latest `boxoffice audit` run; `null` when none was recorded.
    pub audit: Option<OnsaleAudit>,
}

/// The release controller's rate R and why it is what it is.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OnsaleRelease {
    /// R, positions admitted per second (the cell's, shared by the queued events).
    pub rate_per_s: f64,
    /// The controller's floor.
    pub min_per_s: f64,
    /// Its ceiling.
    pub max_per_s: f64,
    /// The last tick's action: `increase`, `hold` or `decrease`.
    pub action: String,
    /// The signals behind it (over their threshold or failed for a decrease, in their soft
    /// zone for a hold).
    pub reasons: Vec<String>,
    /// When R last changed value.
    pub moved_at: Option<DateTime<Utc>>,
    /// That tick's action.
    pub moved_action: Option<String>,
    /// That tick's reasons (why R last moved).
    pub moved_reasons: Vec<String>,
    /// When the leader wrote this (once per tick).
    pub updated_at: DateTime<Utc>,
    /// When the current leader took the cell's lock.
    pub leader_since: DateTime<Utc>,
    /// True when `updated_at` is more than 5 s old: no controller is ticking.
    pub stale: bool,
    /// Every input of the control law.
    pub signals: Vec<OnsaleSignal>,
}

/// One input of the release controller's law.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OnsaleSignal {
    /// `pg_commit_ms`, `outbox_age_ms`, `consumer_lag`, …
    pub name: String,
    /// The reading, in the signal's unit; `null` when the probe failed or is off.
    pub value: Option<f64>,
    /// Its threshold.
    pub threshold: f64,
    /// `ok`, `soft` (above the soft fraction: R holds), `over` (R falls), `failed`, `off`.
    pub state: String,
}

/// One event's onsale.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OnsaleEvent {
    /// Event id.
    pub event_id: Uuid,
    /// Its name.
    pub name: String,
    /// Whether its sales window is open now.
    pub on_sale: bool,
    /// Opening of the window.
    pub sales_open_at: Option<DateTime<Utc>>,
    /// End of the window (`null`: open-ended).
    pub sales_close_at: Option<DateTime<Utc>>,
    /// `active`, or `frozen` while it moves to another cell.
    pub cell_state: String,
    /// Its share of R, positions per second; `null` when it has no queue.
    pub release_per_s: Option<f64>,
    /// Its waiting room as of the controller's last tick; `null` when it has no queue.
    pub queue: Option<OnsaleQueue>,
    /// Holds created per second (one order each).
    pub holds_per_s: f64,
    /// 409 `seat_unavailable` answers per second (approximate; `null` when Redis cannot answer).
    pub conflicts_per_s: Option<f64>,
    /// Tickets issued per second (one per seat).
    pub ticketed_per_s: f64,
    /// Running totals.
    pub totals: OnsaleTotals,
}

/// An event's waiting room, as the release controller last saw it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OnsaleQueue {
    /// Live positions queued.
    pub queued: u64,
    /// Entries in the pre-queue (before the opening).
    pub pre_queued: u64,
    /// Admission slots running.
    pub admitted_live: u64,
    /// Positions admitted per second over the last 10 s.
    pub admitted_per_s: f64,
    /// Positions admitted since the current leader took over.
    pub admitted_total: u64,
}

/// An event's running totals (ledger).
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OnsaleTotals {
    /// Holds ever created (orders, whatever became of them).
    pub holds: i64,
    /// Seats under an active hold now.
    pub seats_held: i64,
    /// Tickets issued (voided ones included).
    pub tickets: i64,
    /// Seats of the event.
    pub seats: i64,
}

/// Cell-wide signals.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OnsaleCell {
    /// Age of the oldest unpublished outbox row, ms (0 when none): facts not reaching Kafka.
    pub outbox_oldest_age_ms: i64,
    /// Unpublished outbox rows the relay will publish.
    pub outbox_unpublished: i64,
    /// Unpublished outbox rows of orders parked for a fact the producer refused (`boxoffice
    /// outbox parked`): facts that will not reach Kafka until a retry succeeds.
    pub outbox_parked: i64,
    /// How far the oldest lapsed, still active hold is past its end, ms: seats unavailable
    /// past their TTL.
    pub expiry_delay_ms: f64,
    /// Holds active now.
    pub active_holds: f64,
    /// Consumer lag of the purchase topic as of the controller's last tick; `null` without
    /// a broker or a controller.
    pub consumer_lag: Option<OnsaleLag>,
    /// Messages in the dead-letter topic; `null` without a broker (or before the first
    /// reading).
    pub dlq_depth: Option<i64>,
    /// When the DLQ depth was read.
    pub dlq_checked_at: Option<DateTime<Utc>>,
}

/// Consumer lag, messages.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OnsaleLag {
    /// Max over groups and partitions.
    pub max: f64,
    /// Every (group, partition) behind, largest first.
    pub by_partition: Vec<OnsalePartitionLag>,
}

/// One group's lag on one partition.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OnsalePartitionLag {
    /// The consumer group.
    pub group: String,
    /// The partition of the purchase topic.
    pub partition: i32,
    /// Messages behind.
    pub lag: i64,
}

/// The latest audit run.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OnsaleAudit {
    /// Its id.
    pub id: i64,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// When it finished.
    pub finished_at: DateTime<Utc>,
    /// The event it was restricted to; `null`: the whole ledger.
    pub event_id: Option<Uuid>,
    /// 0 clean, 1 a violation, 2 a check could not run.
    pub exit_code: i32,
    /// Sum of the counts.
    pub total: i64,
    /// Every invariant's count by name; `null`: not checked by that run.
    pub violations: BTreeMap<String, Option<i64>>,
}

/// `GET /admin/onsale` → 200 [`OnsaleView`] (`Cache-Control: no-store`).
#[utoipa::path(get, path = "/admin/onsale", tag = "operator",
    security(("admin" = [])),
    responses(
        (status = 200, description = "The cell's onsales: R and why, queues, rates, totals, cell health and the last audit (rendered at most once a second)", body = OnsaleView),
        (status = 401, description = "`unauthenticated`: no bearer token, or not the operator token", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 429, description = "`rate_limited` (the `/admin` per-IP bucket, `scope` = `ip`) or `too_many_in_flight`; `Retry-After` in seconds", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 503, description = "`unavailable`: the database is unavailable; `Retry-After`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
    ))]
pub(crate) async fn onsale(
    State(st): State<AppState>,
    _: crate::admin::Operator,
) -> Result<Response, Problem> {
    let body =
        st.dashboard.inner.cache.try_get_with((), render(&st)).await.map_err(|e| Problem::database(&e))?;
    Ok(([(header::CONTENT_TYPE, "application/json"), (header::CACHE_CONTROL, "no-store")], body)
        .into_response())
}

async fn render(st: &AppState) -> Result<Bytes, sqlx::Error> {
    let view = view(st).await?;
    Ok(Bytes::from(serde_json::to_vec(&view).expect("the onsale view serializes")))
}

/// Builds the view from the ledger, Redis and this process's readings.
pub async fn view(st: &AppState) -> Result<OnsaleView, sqlx::Error> {
    let cell = st.admission.cell().to_owned();
    let now = Utc::now();
    let status = operator::release_status(&st.pool, &cell).await?;
    let events = operator::dashboard_events(&st.pool, RECENT_MIN, MAX_EVENTS).await?;
    let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
    let activity: HashMap<Uuid, operator::EventActivity> =
        operator::event_activity(&st.pool, &ids, WINDOW_S as f64)
            .await?
            .into_iter()
            .map(|a| (a.id, a))
            .collect();
    let figures = operator::cell_figures(&st.pool).await?;
    let audit = operator::latest_audit_run(&st.pool).await?;

    let queues: HashMap<Uuid, (f64, OnsaleQueue)> = status
        .as_ref()
        .and_then(|s| s.event_rates.0.as_object().cloned())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(k, v)| {
            let id: Uuid = k.parse().ok()?;
            let rate = v.get("rate_per_s").and_then(serde_json::Value::as_f64).unwrap_or(0.0);
            Some((id, (rate, serde_json::from_value(v).ok()?)))
        })
        .collect();
    let this_second = now.timestamp();
    let conflicts = futures::future::join_all(
        ids.iter()
            .map(|id| st.waitroom.count_over(EventId(*id), CONFLICTS, this_second - WINDOW_S, this_second)),
    )
    .await;
    let per_s = |n: i64| n as f64 / WINDOW_S as f64;
    let events = events
        .into_iter()
        .zip(conflicts)
        .map(|(e, conflicts)| {
            let a = activity.get(&e.id).copied().unwrap_or_default();
            let q = queues.get(&e.id);
            OnsaleEvent {
                event_id: e.id,
                name: e.name,
                on_sale: e.on_sale,
                sales_open_at: e.sales_open_at,
                sales_close_at: e.sales_close_at,
                cell_state: e.cell_state,
                release_per_s: q.map(|q| q.0),
                queue: q.map(|q| q.1.clone()),
                holds_per_s: per_s(a.holds_in_window),
                conflicts_per_s: conflicts.ok().map(|n| n as f64 / WINDOW_S as f64),
                ticketed_per_s: per_s(a.tickets_in_window),
                totals: OnsaleTotals {
                    holds: a.holds_total,
                    seats_held: a.seats_held,
                    tickets: a.tickets_total,
                    seats: a.seats_total,
                },
            }
        })
        .collect();

    let signals: Vec<OnsaleSignal> = status
        .as_ref()
        .and_then(|s| s.signals.0.get("signals").cloned())
        .and_then(|v| serde_json::from_value(v).ok())
        .unwrap_or_default();
    let consumer_lag =
        signals.iter().find(|s| s.name == "consumer_lag").and_then(|s| s.value).map(|max| OnsaleLag {
            max,
            by_partition: status
                .as_ref()
                .and_then(|s| s.signals.0.get("consumer_lag_by_partition").cloned())
                .and_then(|v| serde_json::from_value(v).ok())
                .unwrap_or_default(),
        });
    let dlq = st.dashboard.dlq();
    let release = status.map(|s| OnsaleRelease {
        stale: (now - s.updated_at).to_std().unwrap_or_default() > RELEASE_STALE_AFTER,
        rate_per_s: s.rate_per_s,
        min_per_s: s.min_per_s,
        max_per_s: s.max_per_s,
        action: s.action,
        reasons: s.reasons,
        moved_at: s.moved_at,
        moved_action: s.moved_action,
        moved_reasons: s.moved_reasons,
        updated_at: s.updated_at,
        leader_since: s.leader_since,
        signals,
    });
    Ok(OnsaleView {
        generated_at: now,
        cell,
        window_s: WINDOW_S,
        release,
        events,
        cell_signals: OnsaleCell {
            outbox_oldest_age_ms: figures.outbox_oldest_age_ms,
            outbox_unpublished: figures.outbox_unpublished,
            outbox_parked: figures.outbox_parked,
            expiry_delay_ms: figures.expiry_delay_ms,
            active_holds: figures.active_holds,
            consumer_lag,
            dlq_depth: dlq.map(|d| d.0),
            dlq_checked_at: dlq.map(|d| d.1),
        },
        audit: audit.map(audit_view),
    })
}

fn audit_view(a: operator::AuditRun) -> OnsaleAudit {
    let violations = a
        .violations
        .0
        .as_object()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.as_i64())).collect())
        .unwrap_or_default();
    OnsaleAudit {
        id: a.id,
        started_at: a.started_at,
        finished_at: a.finished_at,
        event_id: a.event_id,
        exit_code: a.exit_code,
        total: a.total,
        violations,
    }
}

/// The dashboard's background work in one task, until `shutdown`: flushes this process's
/// conflict counts to Redis every [`FLUSH_EVERY`] and refreshes the audit and DLQ gauges
/// every [`GAUGE_REFRESH`] (the DLQ from `kafka`'s dead-letter topic when given). Every
/// API process runs one.
pub fn spawn(
    st: AppState,
    kafka: Option<boxoffice_bus::KafkaConfig>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut flush = tokio::time::interval(FLUSH_EVERY);
        flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut gauges = tokio::time::interval(GAUGE_REFRESH);
        gauges.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = flush.tick() => flush_conflicts(&st).await,
                _ = gauges.tick() => refresh_gauges(&st, kafka.as_ref()).await,
            }
        }
        flush_conflicts(&st).await;
    })
}

async fn flush_conflicts(st: &AppState) {
    let counts = st.dashboard.take_conflicts();
    if counts.is_empty() {
        return;
    }
    if let Err(e) = st.waitroom.add_counts(CONFLICTS, Utc::now().timestamp(), &counts).await {
        metrics::counter!("boxoffice_dashboard_refresh_errors_total", "source" => "conflict_flush")
            .increment(1);
        tracing::debug!(error = %e, "dashboard: conflict counts lost (Redis)");
    }
}

async fn refresh_gauges(st: &AppState, kafka: Option<&boxoffice_bus::KafkaConfig>) {
    match operator::latest_audit_run(&st.pool).await {
        Ok(Some(run)) => {
            metrics::gauge!("boxoffice_audit_last_run_timestamp_seconds")
                .set(run.finished_at.timestamp_millis() as f64 / 1_000.0);
            for (invariant, n) in audit_view(run).violations {
                metrics::gauge!("boxoffice_audit_violations", "invariant" => invariant)
                    .set(n.map_or(f64::NAN, |n| n as f64));
            }
        }
        Ok(None) => {}
        Err(e) => {
            metrics::counter!("boxoffice_dashboard_refresh_errors_total", "source" => "audit").increment(1);
            tracing::debug!(error = %e, "dashboard: cannot read the latest audit run");
        }
    }
    match operator::latest_reconcile_run(&st.pool).await {
        Ok(Some(run)) => {
            metrics::gauge!("boxoffice_reconcile_last_run_timestamp_seconds")
                .set(run.finished_at.timestamp_millis() as f64 / 1_000.0);
            for (kind, n) in run.unresolved.0 {
                metrics::gauge!("boxoffice_reconcile_drift", "kind" => kind).set(n as f64);
            }
        }
        Ok(None) => {}
        Err(e) => {
            metrics::counter!("boxoffice_dashboard_refresh_errors_total", "source" => "reconcile")
                .increment(1);
            tracing::debug!(error = %e, "dashboard: cannot read the latest reconcile run");
        }
    }
    if let Some(k) = kafka {
        match boxoffice_bus::dlq::depth(k, Duration::from_secs(5)).await {
            Ok(depth) => {
                metrics::gauge!("boxoffice_dlq_depth").set(depth as f64);
                st.dashboard.set_dlq(Some((depth, Utc::now())));
            }
            Err(e) => {
                metrics::counter!("boxoffice_dashboard_refresh_errors_total", "source" => "dlq").increment(1);
                tracing::debug!(error = format!("{e:#}"), "dashboard: cannot read the dead-letter depth");
                st.dashboard.set_dlq(None);
            }
        }
    }
}
