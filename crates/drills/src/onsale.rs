//! `boxoffice-drills onsale`, the main job: a real onsale driven through the HTTP API as
//! buyers would. It migrates, seeds a fresh arena event (or uses `--event`), starts every role
//! in-process ([`boxoffice_harness::deploy`], with an embedded Kafka-protocol broker when none
//! is configured, and the Stripe simulator) unless `--api-url` points at a running
//! deployment, drives the simulated buyers ([`boxoffice_harness::buyers`]), waits for the saga
//! to drain, runs the audit (ledger, the run's PaymentIntents at the provider, dead letters)
//! and prints the report. The exit code is non-zero when any invariant check is non-zero or
//! could not run, or when a buyer lost seats to the system's lag (`expired_never_payable`,
//! `lost_after_authorization`, case C19); the report's `result` (`ok`, `lost_to_lag`,
//! `violations`, `incomplete`) and `exit_code` (0, 1, 1, 2) say which. The database is the
//! configuration's (`BOXOFFICE_DATABASE_URL`).

use anyhow::Context;
use boxoffice::commands::{self, VenueSize};
use boxoffice::config::Config;
use boxoffice::runtime::{self, Role};
use boxoffice_harness::buyers;
use boxoffice_harness::deploy::{self, Deployment};
use boxoffice_harness::drain::Drain;
use boxoffice_harness::queue;
use boxoffice_store::{outbox, venue};
use serde_json::json;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Options of `boxoffice-drills onsale`.
#[derive(Debug, Clone, clap::Args)]
pub struct OnsaleArgs {
    /// Simulated buyers.
    #[arg(long, default_value_t = 20_000)]
    pub buyers: usize,
    /// Sell this existing event instead of seeding a fresh arena.
    #[arg(long)]
    pub event: Option<uuid::Uuid>,
    /// Drive a running deployment at this URL instead of starting the roles in-process (its
    /// own release controller admits the queue; with `--direct-admission` it needs
    /// `admission_direct`).
    #[arg(long)]
    pub api_url: Option<String>,
    /// Skip the waiting room: buyers take `POST /events/{id}/admission` (measures the
    /// purchase path alone).
    #[arg(long)]
    pub direct_admission: bool,
    /// Join + poll attempts per second against the waiting room, open loop (attempt `k` is
    /// sent at `k / rate` s whatever the server's speed; new buyers join in slots no due poll
    /// needs, so `--arrival-rate` is ignored). 0 = buyers join at `--arrival-rate` and poll
    /// when the server's `poll_after_ms` says.
    #[arg(long, default_value_t = 0.0)]
    pub attempt_rate: f64,
    /// Ceiling of the in-process deployment's release controller, buyers admitted per
    /// second (R starts lower and adapts to the database's signals below this).
    #[arg(long, default_value_t = 80.0)]
    pub release_rate: f64,
    /// Kafka bootstrap servers (default: BOXOFFICE_KAFKA_BROKERS, else an embedded broker).
    #[arg(long)]
    pub kafka_brokers: Option<String>,
    /// Stripe API base of a running simulator (default: one started in-process).
    #[arg(long)]
    pub stripe_api_base: Option<String>,
    /// Hold time to live for this run, ms (short, so abandoned holds expire within the run).
    /// Applies to the in-process deployment; with `--api-url` the deployment's own
    /// `BOXOFFICE_HOLD_TTL_MS` decides.
    #[arg(long, default_value_t = 60_000)]
    pub hold_ttl_ms: u64,
    /// Share of buyers whose card is declined.
    #[arg(long, default_value_t = 0.05)]
    pub decline_share: f64,
    /// Share of buyers who never pay (their holds expire).
    #[arg(long, default_value_t = 0.05)]
    pub abandon_share: f64,
    /// Most adjacent seats one buyer asks for (1–8).
    #[arg(long, default_value_t = 4)]
    pub max_seats: usize,
    /// Buyers arriving (joining the queue, or holding with `--direct-admission`) per second,
    /// open loop; 0 = every buyer at once.
    #[arg(long, default_value_t = 100.0)]
    pub arrival_rate: f64,
    /// Concurrent HTTP requests the generator keeps in flight.
    #[arg(long, default_value_t = 64)]
    pub max_in_flight: usize,
    /// Seed for buyers' choices.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// A small venue `SECTIONS,ROWS,SEATS` instead of the 18,000-seat arena.
    #[arg(long)]
    pub small_venue: Option<VenueSize>,
    /// How long to wait for the saga to drain after the last buyer, seconds.
    #[arg(long, default_value_t = 300)]
    pub drain_timeout_s: u64,
    /// Also write the report as JSON to this path.
    #[arg(long)]
    pub report_json: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Busy processes outside boxoffice for the whole run (a reproducible noisy neighbour,
    /// each spinning one CPU).
    #[arg(long, default_value_t = 0)]
    pub steal_cpu: usize,
    /// A paying buyer confirms up to this many ms (uniformly) after first seeing the client
    /// secret.
    #[arg(long, default_value_t = 0)]
    pub pay_within_ms: u64,
    /// How buyers follow their orders: `stream` (`GET /orders/{id}/events`, Server-Sent
    /// Events pushed from the ledger's changes) or `poll` (`GET /orders/{id}` every second,
    /// backing off to 4 s).
    #[arg(long, default_value = "stream", value_parser = ["stream", "poll"])]
    pub order_status: String,
    /// Purchase cells (design §13): N ≥ 2 sells N fresh events at once, one per cell, each
    /// cell with its own database, topics, Redis keys, roles and audit; buyers and rates are
    /// split evenly; the report shows each cell and the totals.
    #[arg(long, default_value_t = 1)]
    pub cells: usize,
    /// The cells' databases, one per cell in order (repeatable; default: `{database}_cell{i}`
    /// beside the configured database).
    #[arg(long = "cell-database-url")]
    pub cell_database_urls: Vec<String>,
}

/// Runs the onsale; returns the exit code (0 when every invariant check is 0). With
/// `--cells N` (N ≥ 2), N onsales at once, one event per purchase cell, each cell with its own
/// database, topics, Redis keys, roles, release controller and audit ([`run_cells`]).
pub async fn run(cfg: Config, args: OnsaleArgs) -> anyhow::Result<i32> {
    check_args(&args)?;
    if args.cells > 1 {
        return run_cells(cfg, args).await;
    }
    let one = run_one(cfg, &args, None).await?;
    print_report(&one.report, &one.audited, one.verdict);
    if let Some(path) = &args.report_json {
        std::fs::write(path, serde_json::to_vec_pretty(&one.report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(one.verdict.exit_code())
}

fn check_args(args: &OnsaleArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.buyers > 0, "--buyers must be at least 1");
    anyhow::ensure!((1..=16).contains(&args.cells), "--cells must be 1..=16");
    anyhow::ensure!(
        args.cells == 1 || (args.api_url.is_none() && args.event.is_none()),
        "--cells runs every cell in-process with a fresh event each: drop --api-url and --event"
    );
    anyhow::ensure!(
        args.cell_database_urls.is_empty() || args.cell_database_urls.len() == args.cells,
        "--cell-database-url: give one per cell ({}), or none",
        args.cells
    );
    anyhow::ensure!((1..=8).contains(&args.max_seats), "--max-seats must be 1..=8");
    anyhow::ensure!(
        args.attempt_rate >= 0.0 && args.attempt_rate.is_finite(),
        "--attempt-rate must be a finite number >= 0"
    );
    anyhow::ensure!(
        args.release_rate > 0.0 && args.release_rate.is_finite(),
        "--release-rate must be a finite number > 0"
    );
    Ok(())
}

/// One cell's onsale: its report, its audit and its outcome.
struct CellOutcome {
    report: serde_json::Value,
    audited: boxoffice::audit::AuditReport,
    verdict: Verdict,
}

/// An onsale's outcome, worst last: the report's `result` key (with `exit_code`) and its
/// closing line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Verdict {
    /// Every invariant check ran and is 0, and no buyer lost seats to the system's lag: exit 0.
    Ok,
    /// Every invariant holds, but buyers lost seats to the system's lag
    /// (`expired_never_payable` or `lost_after_authorization` > 0): exit 1.
    LostToLag,
    /// An invariant check is non-zero: exit 1.
    Violations,
    /// A check could not run (the provider's or the dead letters'): exit 2.
    Incomplete,
}

impl Verdict {
    /// From the audit's exit code (0, 1 or 2) and the orders lost to the system's lag.
    fn of(audit_code: i32, lost_to_lag: i64) -> Self {
        match (audit_code, lost_to_lag) {
            (0, 0) => Verdict::Ok,
            (0, _) => Verdict::LostToLag,
            (1, _) => Verdict::Violations,
            _ => Verdict::Incomplete,
        }
    }

    /// The process's exit code.
    fn exit_code(self) -> i32 {
        match self {
            Verdict::Ok => 0,
            Verdict::LostToLag | Verdict::Violations => 1,
            Verdict::Incomplete => 2,
        }
    }

    /// The report's `result` value.
    fn key(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::LostToLag => "lost_to_lag",
            Verdict::Violations => "violations",
            Verdict::Incomplete => "incomplete",
        }
    }

    /// The text report's closing line.
    fn line(self) -> &'static str {
        match self {
            Verdict::Ok => "OK — every invariant holds, and no buyer lost seats to the system's lag",
            Verdict::LostToLag => {
                "FAILED — buyers lost seats to the system's lag (never payable / lost after authorization)"
            }
            Verdict::Violations => "FAILED — invariant violations above",
            Verdict::Incomplete => "INCOMPLETE — a check could not run (see above)",
        }
    }

    /// Sets `result` and `exit_code` in `report`.
    fn record(self, report: &mut serde_json::Value) {
        if let Some(r) = report.as_object_mut() {
            r.insert("result".into(), json!(self.key()));
            r.insert("exit_code".into(), json!(self.exit_code()));
        }
    }
}

/// `--cells N`: the cells `cell-1` … `cell-N`, on the databases given by
/// `--cell-database-url` or beside the configured one (`{database}_cell{i}` on the same
/// server), with topic prefix `{prefix}cell{i}.` on one broker and Redis prefix
/// `{prefix}cell{i}:`, run at once with `--buyers / N` buyers each (and 1/N of the arrival
/// and attempt rates). Cells on one PostgreSQL server share its connections
/// ([`share_one_server`], by the server holding the most cells). The report has every cell's own report and their totals; the exit
/// code is the worst cell's.
pub async fn run_cells(mut cfg: Config, args: OnsaleArgs) -> anyhow::Result<i32> {
    let base: sqlx::postgres::PgConnectOptions = cfg.pg_options()?;
    let base_db = base.get_database().unwrap_or("boxoffice").to_owned();
    let mut cells = Vec::new();
    for i in 1..=args.cells {
        let url = match args.cell_database_urls.get(i - 1) {
            Some(u) => u.clone(),
            None => sqlx::ConnectOptions::to_url_lossy(&base.clone().database(&format!("{base_db}_cell{i}")))
                .to_string(),
        };
        cells.push(boxoffice::config::CellSettings {
            name: format!("cell-{i}"),
            database_url: url.into(),
            kafka_topic_prefix: format!("{}cell{i}.", cfg.kafka_topic_prefix),
            redis_key_prefix: format!("{}cell{i}:", cfg.redis_key_prefix),
            api_url: None,
        });
    }
    // Cells on one server share its connections: size every cell for the most crowded one.
    let mut per_server = std::collections::HashMap::new();
    for c in &cells {
        let o: sqlx::postgres::PgConnectOptions =
            secrecy::ExposeSecret::expose_secret(&c.database_url).parse().context("--cell-database-url")?;
        *per_server.entry((o.get_host().to_owned(), o.get_port())).or_insert(0usize) += 1;
    }
    cfg.cells = cells;
    let crowd = per_server.values().copied().max().unwrap_or(1);
    if crowd > 1 {
        share_one_server(&mut cfg, crowd);
    }
    cfg.hold_ttl_ms = args.hold_ttl_ms;
    cfg.validate()?;
    if let Some(b) = &args.kafka_brokers {
        cfg.kafka_brokers = Some(b.clone());
    }
    let broker = deploy::embedded_broker_unless_configured(&mut cfg)?;
    let per_cell = args.buyers.div_ceil(args.cells);
    let runs = cfg.cell_names().into_iter().enumerate().map(|(i, name)| {
        let cell_cfg = cfg.for_cell(name);
        let cell_args = OnsaleArgs {
            buyers: per_cell,
            seed: args.seed + i as u64,
            no_progress: true,
            report_json: None,
            cells: 1,
            arrival_rate: args.arrival_rate / args.cells as f64,
            attempt_rate: args.attempt_rate / args.cells as f64,
            ..args.clone()
        };
        let broker = broker.as_ref();
        async move {
            let outcome = match cell_cfg {
                Ok(c) => run_one(c, &cell_args, broker).await,
                Err(e) => Err(e),
            };
            (name.to_owned(), outcome)
        }
    });
    let results = futures::future::join_all(runs).await;
    let mut reports = serde_json::Map::new();
    let mut worst = Verdict::Ok;
    let mut totals = serde_json::Map::new();
    for (name, outcome) in results {
        let one = outcome.with_context(|| format!("cell {name}"))?;
        println!("\n== {name}");
        print_report(&one.report, &one.audited, one.verdict);
        worst = worst.max(one.verdict);
        let violations = json!(one.audited.total());
        let e = totals.entry("violations".to_owned()).or_insert(json!(0));
        *e = json!(e.as_i64().unwrap_or(0) + violations.as_i64().unwrap_or(0));
        for key in TOTALLED {
            let v = one.report.get(*key).and_then(serde_json::Value::as_f64);
            let e = totals.entry((*key).to_owned()).or_insert(json!(0));
            *e = match (e.as_f64(), v) {
                (Some(a), Some(b)) if (a + b).fract() == 0.0 => json!((a + b) as i64),
                (Some(a), Some(b)) => json!(a + b),
                _ => serde_json::Value::Null,
            };
        }
        reports.insert(name, one.report);
    }
    println!("\n== totals over {} cells", args.cells);
    for (k, v) in &totals {
        println!("  {k:<26} {v}");
    }
    println!("result: {}", worst.line());
    let mut report = json!({ "cells": reports, "totals": totals });
    worst.record(&mut report);
    let code = worst.exit_code();
    if let Some(path) = &args.report_json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(code)
}

/// Cells on one PostgreSQL server share its `max_connections`: each cell's processes get
/// 1/`n` of the default connection budget (role pools, consumer lanes and the bookkeeping
/// pool), so `n` cells together stay within one all-roles process's budget.
fn share_one_server(cfg: &mut Config, n: usize) {
    let n32 = n as u32;
    let part = |v: u32| (v / n32).max(1);
    cfg.consumer_lanes = (cfg.consumer_lanes / n).max(1);
    let consumer_pool = (cfg.consumer_lanes * cfg.consumers_per_role) as u32 + 1;
    cfg.db_pool_api = part(cfg.db_pool_api);
    cfg.db_pool_webhooks = part(cfg.db_pool_webhooks);
    cfg.db_pool_relay = part(cfg.db_pool_relay);
    cfg.db_pool_expiry = part(cfg.db_pool_expiry);
    cfg.db_pool_saga = consumer_pool;
    cfg.db_pool_payments = consumer_pool;
    cfg.db_pool_tickets = consumer_pool;
    cfg.db_max_connections = part(cfg.db_max_connections).max(2);
}

/// The report keys `--cells` adds up over the cells, besides `violations` (every count of
/// every cell's audit; each cell's own counts by name are in its report).
const TOTALLED: &[&str] = &[
    "buyers",
    "holds",
    "ticketed_orders",
    "tickets",
    "seats_sold",
    "venue_seats",
    "holds_per_s",
    "expired_never_payable",
    "lost_after_authorization",
];

async fn run_one(
    mut cfg: Config,
    args: &OnsaleArgs,
    shared_broker: Option<&boxoffice_bus::embedded::EmbeddedBroker>,
) -> anyhow::Result<CellOutcome> {
    cfg.hold_ttl_ms = args.hold_ttl_ms;
    // The simulator sends every webhook from one address, where Stripe uses several.
    cfg.webhook_max_in_flight_per_ip = boxoffice_stripe_sim::MAX_CONCURRENT_DELIVERIES;
    cfg.validate()?;
    if let Some(b) = &args.kafka_brokers {
        cfg.kafka_brokers = Some(b.clone());
    }
    let pool = commands::migrate_db(&cfg).await?;

    let event = match args.event {
        Some(e) => e,
        None => {
            let spec = args.small_venue.map_or_else(venue::VenueSpec::arena, VenueSize::spec);
            let name = format!("Arena Onsale {}", chrono::Utc::now().format("%Y-%m-%d %H:%M:%S%.3f"));
            let (id, seats) = venue::seed(
                &pool,
                &name,
                &spec,
                chrono::Utc::now() + chrono::Duration::days(30),
                &cfg.purchase_cell,
            )
            .await?;
            eprintln!("seeded \"{name}\" ({id}) at {}: {seats} seats", spec.name);
            id.0
        }
    };

    // In-process deployment unless --api-url is given.
    let embedded = match (&args.api_url, shared_broker) {
        (Some(_), _) | (None, Some(_)) => None,
        (None, None) => deploy::embedded_broker_unless_configured(&mut cfg)?,
    };
    if embedded.is_some() {
        eprintln!("embedded Kafka-protocol broker at {}", cfg.kafka_brokers.as_deref().unwrap_or_default());
    }
    let mut deployment = None;
    let (api_url, stripe_base) = match &args.api_url {
        Some(url) => (
            url.trim_end_matches('/').to_owned(),
            args.stripe_api_base.clone().unwrap_or(cfg.stripe_api_base.clone()),
        ),
        None => {
            // Buyers come through the waiting room unless told otherwise; the release
            // controller admits them at its adaptive rate R, at most the release rate. Every
            // simulated buyer connects from this host, so each sends its own client address
            // in X-Forwarded-For and this deployment trusts it: the per-IP bucket then sees a
            // crowd, not one abusive host.
            cfg.admission_direct = args.direct_admission;
            cfg.release_max_per_s = if args.direct_admission { 0.0 } else { args.release_rate };
            cfg.release_initial_per_s = cfg.release_initial_per_s.min(args.release_rate);
            cfg.release_min_per_s = cfg.release_min_per_s.min(cfg.release_initial_per_s);
            cfg.http_trusted_proxy_hops = 1;
            let opts = deploy::Options {
                stripe_api_base: args.stripe_api_base.clone(),
                embedded: embedded.as_ref().or(shared_broker),
                ..deploy::Options::new(&Role::ALL, cfg.pg_options()?)
            };
            let d = Deployment::start(cfg.clone(), opts).await?;
            let api = d.api_url().context("api did not start")?;
            let stripe_base = d.cfg.stripe_api_base.clone();
            cfg = d.cfg.clone();
            deployment = Some(d);
            (api, stripe_base)
        }
    };

    // Sample the outbox age while the onsale runs.
    let max_outbox_age = Arc::new(AtomicI64::new(0));
    let sampler = {
        let (pool, max, sd) = (pool.clone(), max_outbox_age.clone(), CancellationToken::new());
        let h = tokio::spawn({
            let sd = sd.clone();
            async move {
                while !sd.is_cancelled() {
                    if let Ok(b) = outbox::backlog(&pool).await {
                        max.fetch_max(b.oldest_age_ms, Ordering::Relaxed);
                    }
                    tokio::select! { _ = sd.cancelled() => {}, _ = tokio::time::sleep(Duration::from_millis(200)) => {} }
                }
            }
        });
        (h, sd)
    };

    // Sample the release controller's R from the API's /metrics while buyers queue.
    let release_samples = Arc::new(std::sync::Mutex::new(Vec::<f64>::new()));
    let signal_max = Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::<String, f64>::new()));
    let release_sampler = {
        let (samples, maxima, sd, url) = (
            release_samples.clone(),
            signal_max.clone(),
            CancellationToken::new(),
            format!("{api_url}/metrics"),
        );
        let h = tokio::spawn({
            let sd = sd.clone();
            async move {
                let http = reqwest::Client::new();
                while !sd.is_cancelled() {
                    if let Some(m) = scrape_release(&http, &url).await {
                        samples.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(m.rate);
                        let mut maxima = maxima.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        for (s, v) in m.signals {
                            let e = maxima.entry(s).or_insert(v);
                            *e = e.max(v);
                        }
                    }
                    tokio::select! { _ = sd.cancelled() => {}, _ = tokio::time::sleep(Duration::from_secs(1)) => {} }
                }
            }
        });
        (h, sd)
    };

    let users = runtime::user_tokens(&cfg);
    let stealers =
        boxoffice_harness::noise::CpuStealers::start(args.steal_cpu).context("starting --steal-cpu")?;
    if !stealers.is_empty() {
        eprintln!("{} busy process(es) stealing CPU for the whole run", stealers.len());
    }
    let started = Instant::now();
    // The provider checks cover every PaymentIntent this run can have created.
    let provider_window = boxoffice::reconcile::Window {
        since: chrono::Utc::now() - chrono::Duration::minutes(1),
        until: None,
    };
    let provider = boxoffice_payments::StripeClient::new(boxoffice_payments::StripeConfig {
        api_base: stripe_base.clone(),
        secret_key: cfg.stripe_secret_key.clone(),
        timeout_ms: cfg.stripe_timeout_ms,
    })?;
    let stats = buyers::drive(buyers::BuyerConfig {
        api_url: api_url.clone(),
        stripe_api_base: stripe_base,
        stripe_publishable_key: cfg.stripe_publishable_key.clone(),
        event_id: event,
        buyers: args.buyers,
        max_in_flight: args.max_in_flight,
        decline_share: args.decline_share,
        abandon_share: args.abandon_share,
        max_seats: args.max_seats,
        hold_attempts: 5,
        poll_interval_ms: 1_000,
        order_status: if args.order_status == "poll" {
            buyers::OrderStatusMode::Poll
        } else {
            buyers::OrderStatusMode::Stream
        },
        final_timeout_ms: (args.hold_ttl_ms + 120_000).max(180_000),
        seed: args.seed,
        user_token: Arc::new(move |u| users.issue(boxoffice_domain::UserId(u), 3_600)),
        progress: !args.no_progress,
        arrival_rate: args.arrival_rate,
        pay_within_ms: args.pay_within_ms,
        hold_timeline: None,
        admission: if args.direct_admission {
            buyers::AdmissionRoute::Direct
        } else {
            buyers::AdmissionRoute::Queue(queue::QueuePacing {
                attempt_rate: args.attempt_rate,
                arrival_rate: args.arrival_rate,
                max_in_flight: 4_096,
            })
        },
    })
    .await?;

    let drained = Drain::orders_of(event, Duration::from_secs(args.drain_timeout_s)).run(&pool).await?;
    if !drained.done {
        eprintln!("{drained}");
    }
    let drained = drained.done;
    let elapsed = started.elapsed();
    drop(stealers);
    sampler.1.cancel();
    let _ = sampler.0.await;
    release_sampler.1.cancel();
    let _ = release_sampler.0.await;
    let release = {
        let samples = release_samples.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let decreases = scrape_release(&reqwest::Client::new(), &format!("{api_url}/metrics"))
            .await
            .map(|m| m.decreases)
            .unwrap_or_default();
        let signal_max = signal_max.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        (!samples.is_empty()).then(|| {
            json!({
                "samples": samples.len(),
                "min_per_s": samples.iter().copied().fold(f64::INFINITY, f64::min),
                "max_per_s": samples.iter().copied().fold(0.0, f64::max),
                "mean_per_s": samples.iter().sum::<f64>() / samples.len() as f64,
                "decreases": decreases,
                "signal_max": signal_max,
            })
        })
    };
    let outcomes =
        boxoffice_store::outcomes::read(&pool, Some(event), cfg.hold_policy().payment_window).await?;

    let audit_opts = boxoffice::audit::AuditOptions {
        stuck_after_ms: 0,
        event: Some(event),
        provider: Ok((provider, provider_window)),
        kafka: cfg.kafka().ok_or_else(|| "no broker configured".to_owned()),
        dlq_timeout: Duration::from_secs(30),
    };
    let audit_started = chrono::Utc::now();
    let audited = boxoffice::audit::run(&pool, &audit_opts).await?;
    // Recorded like `boxoffice audit`'s: the dashboard shows the onsale's own audit.
    if let Err(e) = boxoffice::audit::record(&pool, audit_started, &audit_opts, &audited).await {
        eprintln!("warning: the audit was not recorded in audit_runs: {e}");
    }
    let venue_seats: i64 = sqlx::query_scalar("SELECT count(*) FROM seats WHERE event_id = $1")
        .bind(event)
        .fetch_one(&pool)
        .await?;
    let totals = &audited.totals;
    let mut report = json!({
        "event_id": event,
        "buyers": stats.buyers,
        "hold_attempts": stats.hold_attempts,
        "holds": stats.holds,
        "conflicts_409": stats.conflicts_409,
        "sold_out_buyers": stats.sold_out,
        "gave_up_buyers": stats.gave_up,
        "authorized": stats.authorized,
        "declined": stats.declined,
        "abandoned": stats.abandoned,
        "expired": stats.expired,
        "captured": totals.captured,
        "ticketed_orders": totals.orders_by_status.get("ticketed").copied().unwrap_or(0),
        "tickets": totals.tickets,
        "seats_sold": totals.seats_sold,
        "refunds": totals.refunds,
        "incidents": totals.incidents,
        "http_errors": stats.http_errors,
        "buyers_timed_out": stats.timed_out,
        "orders_by_status": totals.orders_by_status,
        "hold_p50_ms": stats.hold_latency_ms.p50,
        "hold_p95_ms": stats.hold_latency_ms.p95,
        "hold_p99_ms": stats.hold_latency_ms.p99,
        "hold_to_ticket_p50_ms": stats.hold_to_ticket_ms.p50,
        "hold_to_ticket_p95_ms": stats.hold_to_ticket_ms.p95,
        "hold_to_ticket_p99_ms": stats.hold_to_ticket_ms.p99,
        "holds_per_s": stats.holds_per_s,
        "max_outbox_age_ms": max_outbox_age.load(Ordering::Relaxed),
        "status_reads": {
            "mode": args.order_status,
            "polls": stats.status_polls,
            "streams": stats.status_streams,
            "stream_events": stats.status_stream_events,
            "stream_fallbacks": stats.status_stream_fallbacks,
            "polls_replaced": stats.status_polls_replaced,
            // Requests a 1 s poller would have made, less the ones made (streams opened and
            // polls after a failed stream).
            "saved": stats.status_polls_replaced.saturating_sub(stats.status_streams + stats.status_polls),
        },
        "waiting_room": stats.queue,
        "release_controller": release,
        "drained": drained,
        "elapsed_s": elapsed.as_secs_f64(),
    });
    // Whose fault each lost hold was (case C19), and the waits buyers cannot shorten.
    if let Some(r) = report.as_object_mut() {
        r.extend([
            ("expired_abandoned".to_owned(), json!(outcomes.expired_abandoned)),
            ("expired_declined".to_owned(), json!(outcomes.expired_declined)),
            ("expired_never_payable".to_owned(), json!(outcomes.expired_never_payable)),
            ("lost_after_authorization".to_owned(), json!(outcomes.lost_after_authorization)),
            ("hold_to_payable_p50_ms".to_owned(), json!(outcomes.hold_to_payable_ms.p50)),
            ("hold_to_payable_p99_ms".to_owned(), json!(outcomes.hold_to_payable_ms.p99)),
            (
                "authorization_to_confirmation_p50_ms".to_owned(),
                json!(outcomes.authorization_to_confirmation_ms.p50),
            ),
            (
                "authorization_to_confirmation_p99_ms".to_owned(),
                json!(outcomes.authorization_to_confirmation_ms.p99),
            ),
            ("payment_window_ms".to_owned(), json!(cfg.hold_policy().payment_window.as_millis() as u64)),
            ("steal_cpu".to_owned(), json!(args.steal_cpu)),
            ("venue_seats".to_owned(), json!(venue_seats)),
        ]);
    }
    // Every invariant count by name (null when its check did not run), and which checks ran.
    if let (Some(r), serde_json::Value::Object(counts)) = (report.as_object_mut(), audited.violations_json())
    {
        r.extend(counts);
        r.insert("checks".into(), audited.to_json()["checks"].clone());
    }
    if let Some(d) = deployment {
        d.stop().await;
    }
    if let Some(r) = report.as_object_mut() {
        r.insert("purchase_cell".into(), json!(cfg.purchase_cell));
    }
    // Buyers who lost seats to our lag fail the run like an invariant.
    let verdict =
        Verdict::of(audited.exit_code(), outcomes.expired_never_payable + outcomes.lost_after_authorization);
    verdict.record(&mut report);
    Ok(CellOutcome { report, audited, verdict })
}

fn print_report(r: &serde_json::Value, audited: &boxoffice::audit::AuditReport, verdict: Verdict) {
    let g = |k: &str| r.get(k).cloned().unwrap_or_default();
    println!();
    println!("boxoffice onsale report");
    println!("  event                      {}", g("event_id").as_str().unwrap_or_default());
    println!("  elapsed                    {:.1} s", g("elapsed_s").as_f64().unwrap_or(0.0));
    for k in [
        "buyers",
        "hold_attempts",
        "holds",
        "conflicts_409",
        "sold_out_buyers",
        "gave_up_buyers",
        "authorized",
        "declined",
        "abandoned",
        "expired",
        "captured",
        "ticketed_orders",
        "tickets",
        "seats_sold",
        "refunds",
        "incidents",
        "http_errors",
        "buyers_timed_out",
    ] {
        println!("  {:<26} {}", k, g(k));
    }
    println!("  holds/s                    {:.1}", g("holds_per_s").as_f64().unwrap_or(0.0));
    println!(
        "  hold latency ms            p50 {:.1}  p95 {:.1}  p99 {:.1}",
        g("hold_p50_ms").as_f64().unwrap_or(0.0),
        g("hold_p95_ms").as_f64().unwrap_or(0.0),
        g("hold_p99_ms").as_f64().unwrap_or(0.0)
    );
    println!(
        "  hold→ticket ms             p50 {:.0}  p95 {:.0}  p99 {:.0}",
        g("hold_to_ticket_p50_ms").as_f64().unwrap_or(0.0),
        g("hold_to_ticket_p95_ms").as_f64().unwrap_or(0.0),
        g("hold_to_ticket_p99_ms").as_f64().unwrap_or(0.0)
    );
    println!("  largest outbox age         {} ms", g("max_outbox_age_ms"));
    if let Some(sr) = r.get("status_reads").filter(|v| !v.is_null()) {
        let n = |k: &str| sr.get(k).cloned().unwrap_or_default();
        println!(
            "  order status reads         {} streams ({} events, {} fell back), {} polls; a 1 s poller: {} (saved {})",
            n("streams"),
            n("stream_events"),
            n("stream_fallbacks"),
            n("polls"),
            n("polls_replaced"),
            n("saved")
        );
    }
    if let Some(q) = r.get("waiting_room").filter(|q| !q.is_null()) {
        let n = |k: &str| q.get(k).cloned().unwrap_or_default();
        let p = |k: &str, s: &str| q.get(k).and_then(|v| v.get(s)).and_then(|v| v.as_f64()).unwrap_or(0.0);
        println!(
            "  waiting room               joins {}  polls {}  admitted {}  lapsed {}  gave up {}  rejected {}",
            n("joins"),
            n("polls"),
            n("admitted"),
            n("lapsed"),
            n("gave_up"),
            n("rejected")
        );
        println!(
            "  join+poll attempts         {:.0}/s  p50 {:.1}  p99 {:.1} ms  (429s {}, 503s {}, errors {}, late slots {})",
            n("attempts_per_s").as_f64().unwrap_or(0.0),
            p("attempt_latency_ms", "p50"),
            p("attempt_latency_ms", "p99"),
            n("rate_limited_429"),
            n("unavailable_503"),
            n("errors"),
            n("late_slots")
        );
        println!(
            "  queue wait ms              p50 {:.0}  p99 {:.0}  (largest position {})",
            p("queue_wait_ms", "p50"),
            p("queue_wait_ms", "p99"),
            n("max_position")
        );
        if n("idle_slots").as_u64().unwrap_or(0) > 0 {
            println!(
                "  open-loop slots idle       {} (no poll due and every buyer already joined)",
                n("idle_slots")
            );
        }
    }
    if let Some(c) = r.get("release_controller").filter(|c| !c.is_null()) {
        let f = |k: &str| c.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
        let decreases = c
            .get("decreases")
            .and_then(|d| d.as_object())
            .filter(|d| !d.is_empty())
            .map(|d| {
                d.iter()
                    .map(|(k, v)| format!("{k} {:.0}", v.as_f64().unwrap_or(0.0)))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_else(|| "none".into());
        println!(
            "  release rate R             min {:.0}  mean {:.0}  max {:.0} /s  (decreases: {decreases})",
            f("min_per_s"),
            f("mean_per_s"),
            f("max_per_s")
        );
        if let Some(m) = c.get("signal_max").and_then(|m| m.as_object()).filter(|m| !m.is_empty()) {
            let peaks: Vec<String> =
                m.iter().map(|(k, v)| format!("{k} {}", peak(v.as_f64().unwrap_or(0.0)))).collect();
            println!("  release signals, peak      {}", peaks.join(", "));
        }
    }
    println!(
        "  expired holds              abandoned {}  declined {}  never payable {}",
        g("expired_abandoned"),
        g("expired_declined"),
        g("expired_never_payable")
    );
    println!("  lost after authorization   {}", g("lost_after_authorization"));
    println!(
        "  hold→payable ms            p50 {:.0}  p99 {:.0}  (payment window {} ms)",
        g("hold_to_payable_p50_ms").as_f64().unwrap_or(0.0),
        g("hold_to_payable_p99_ms").as_f64().unwrap_or(0.0),
        g("payment_window_ms")
    );
    println!(
        "  authorization→confirm ms   p50 {:.0}  p99 {:.0}",
        g("authorization_to_confirmation_p50_ms").as_f64().unwrap_or(0.0),
        g("authorization_to_confirmation_p99_ms").as_f64().unwrap_or(0.0)
    );
    println!("  orders by status           {}", g("orders_by_status"));
    let (sold, seats) = (g("seats_sold").as_i64().unwrap_or(0), g("venue_seats").as_i64().unwrap_or(0));
    if sold < seats {
        // Why seats stayed unsold, from what the run counted (a run that leaves only a few
        // single seats no multi-seat buyer fits has sold out all the same).
        let q = r.get("waiting_room").cloned().unwrap_or_default();
        let n = |k: &str| q.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
        println!(
            "  unsold seats               {} of {seats}: {} queued buyers gave up after {} failed attempts in a row ({} waiting-room 503s {}, {} lapsed \
             positions), {} were rejected by the queue, {} gave up picking seats, {} holds expired (abandoned {}, declined {}, never payable {})",
            seats - sold,
            n("gave_up"),
            queue::MAX_FAILURES,
            n("unavailable_503"),
            q.get("unavailable_503_by_code").map(|v| v.to_string()).unwrap_or_default(),
            n("lapsed"),
            n("rejected"),
            g("gave_up_buyers"),
            g("expired"),
            g("expired_abandoned"),
            g("expired_declined"),
            g("expired_never_payable")
        );
    }
    print!("{}", boxoffice::audit::render(audited));
    println!("result: {}", verdict.line());
}

/// Reads the release controller's current R (`boxoffice_release_rate_per_s`, summed over
/// cells) and its decreases by reason (`boxoffice_release_decreases_total`) from a
/// Prometheus text page; `None` when the page cannot be read or has no R (the controller is
/// off or not leading in that process).
async fn scrape_release(http: &reqwest::Client, url: &str) -> Option<ReleaseMetrics> {
    let text = http.get(url).timeout(Duration::from_secs(2)).send().await.ok()?.text().await.ok()?;
    parse_release_metrics(&text)
}

/// What the API's `/metrics` says about the release controller.
#[derive(Debug, Default, PartialEq)]
struct ReleaseMetrics {
    /// R, summed over cells.
    rate: f64,
    /// Decreases by reason, since start.
    decreases: std::collections::BTreeMap<String, f64>,
    /// The latest reading of each signal (`boxoffice_release_signal{signal}`, max over cells).
    signals: std::collections::BTreeMap<String, f64>,
}

fn label<'a>(series: &'a str, name: &str) -> Option<&'a str> {
    series.split_once(&format!("{name}=\"")).and_then(|(_, rest)| rest.split_once('"')).map(|(v, _)| v)
}

fn parse_release_metrics(text: &str) -> Option<ReleaseMetrics> {
    let mut rate = None;
    let mut m = ReleaseMetrics::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else { continue };
        let Ok(value) = value.parse::<f64>() else { continue };
        if series == "boxoffice_release_rate_per_s" || series.starts_with("boxoffice_release_rate_per_s{") {
            *rate.get_or_insert(0.0) += value;
        } else if series.starts_with("boxoffice_release_decreases_total{") {
            let reason = label(series, "reason").unwrap_or("unknown");
            *m.decreases.entry(reason.to_owned()).or_insert(0.0) += value;
        } else if series.starts_with("boxoffice_release_signal{") {
            if let Some(s) = label(series, "signal") {
                let e = m.signals.entry(s.to_owned()).or_insert(value);
                *e = e.max(value);
            }
        }
    }
    rate.map(|r| ReleaseMetrics { rate: r, ..m })
}

/// A release signal's peak as the text report prints it: a ratio (below 10, e.g.
/// `connection_saturation`, whose threshold is 0.9) with two decimals, anything larger (ms,
/// counts) whole.
fn peak(v: f64) -> String {
    if v.abs() < 10.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.0}")
    }
}

#[cfg(test)]
mod tests {
    use super::Verdict;

    #[test]
    fn a_ratio_peak_keeps_its_decimals_and_a_larger_one_is_whole() {
        assert_eq!(super::peak(0.59), "0.59", "below connection_saturation's 0.9, not 1");
        assert_eq!(super::peak(39.4), "39");
    }

    #[test]
    fn the_verdict_follows_the_audit_and_the_orders_lost_to_lag() {
        let cases = [
            ((0, 0), Verdict::Ok, "ok", 0),
            ((0, 2), Verdict::LostToLag, "lost_to_lag", 1),
            ((1, 0), Verdict::Violations, "violations", 1),
            ((1, 2), Verdict::Violations, "violations", 1),
            ((2, 0), Verdict::Incomplete, "incomplete", 2),
            ((2, 2), Verdict::Incomplete, "incomplete", 2),
        ];
        for ((audit, lost), verdict, key, code) in cases {
            let v = Verdict::of(audit, lost);
            assert_eq!((v, v.key(), v.exit_code()), (verdict, key, code), "audit {audit}, lost {lost}");
            let mut report = serde_json::json!({});
            v.record(&mut report);
            assert_eq!(report, serde_json::json!({"result": key, "exit_code": code}));
        }
        // The cells' verdict is the worst cell's.
        assert_eq!(Verdict::Ok.max(Verdict::LostToLag).max(Verdict::Ok), Verdict::LostToLag);
        assert_eq!(Verdict::Violations.max(Verdict::Incomplete), Verdict::Incomplete);
    }

    #[test]
    fn release_metrics_are_read_from_the_prometheus_page() {
        let page = "# TYPE boxoffice_release_rate_per_s gauge\n\
            boxoffice_release_rate_per_s{cell=\"cell-1\"} 42.5\n\
            boxoffice_release_decreases_total{cell=\"cell-1\",reason=\"outbox_age_ms\",cause=\"over_threshold\"} 3\n\
            boxoffice_release_decreases_total{cell=\"cell-1\",reason=\"outbox_age_ms\",cause=\"probe_failed\"} 1\n\
            boxoffice_release_decreases_total{cell=\"cell-1\",reason=\"lock_waits\",cause=\"over_threshold\"} 2\n\
            boxoffice_release_signal{cell=\"cell-1\",signal=\"payable_delay_ms\"} 812.5\n\
            boxoffice_release_rate_per_s_other 9\n";
        let m = super::parse_release_metrics(page).unwrap();
        assert_eq!(m.rate, 42.5);
        assert_eq!(m.decreases.get("outbox_age_ms"), Some(&4.0));
        assert_eq!(m.decreases.get("lock_waits"), Some(&2.0));
        assert_eq!(m.signals.get("payable_delay_ms"), Some(&812.5));
        assert!(super::parse_release_metrics("boxoffice_other 1\n").is_none());
    }
}
