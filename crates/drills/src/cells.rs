//! `boxoffice-drills cells`: the purchase-cell outage drill (design §13). Two cells sell one
//! event each at the same time; cell 2 loses its database for a while; cell 1 must not notice,
//! and cell 2 must come back whole.
//!
//! Owns the run: three fresh databases on the configured PostgreSQL server
//! (`boxoffice_cells_<tag>_cell1`, `_cell2` and the `_control` directory), a TCP kill switch
//! in front of the server through which cell 2 (and only cell 2) reaches its ledger, one
//! in-process deployment of every role per cell ([`boxoffice_harness::deploy`]) sharing one
//! broker (embedded unless configured; each cell has its own topic prefix) and each with its
//! own Stripe simulator, the simulated buyers of both cells arriving at a constant rate, and
//! the seeded outage ([`outage`]): the switch cuts every connection of cell 2 and refuses new
//! ones, then forwards again.
//!
//! Protects the isolation of cells: an outage of one cell's ledger costs that cell only.
//! After the buyers, each cell drains and is audited ([`boxoffice::audit::run`]: ledger, its
//! simulator, its dead letters); the throughput and hold latency before, during and after the
//! outage are read from each cell's ledger and from the buyers' hold samples. The run passes
//! (exit 0) when cell 1 ticketed at least 80 % of its pre-outage rate during the outage, cell 2
//! took holds and ticketed orders after the restore and drained, and both audits are clean;
//! exit 1 otherwise, 2 when a check could not run.

use anyhow::Context;
use boxoffice::config::{CellSettings, Config};
use boxoffice::runtime::{self, Role};
use boxoffice_harness::buyers::{self, BuyerStats, HoldTimeline};
use boxoffice_harness::deploy::{self, Deployment};
use boxoffice_harness::drain::Drain;
use boxoffice_harness::killswitch::KillSwitch;
use boxoffice_harness::stats;
use boxoffice_store::{directory, venue};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use secrecy::SecretString;
use serde::Serialize;
use serde_json::json;
use sqlx::migrate::MigrateDatabase;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgPool};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Options of `boxoffice-drills cells`.
#[derive(Debug, Clone, clap::Args)]
pub struct CellsArgs {
    /// Seed of the outage's start and of the buyers' choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// How long buyers arrive (`60s`, `2m`).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Buyers arriving per second in each cell.
    #[arg(long, default_value_t = 8.0)]
    pub rate: f64,
    /// How long cell 2's database is cut off (default: a third of `--duration`).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub outage: Option<Duration>,
    /// Hold time to live (abandoned holds must expire within the run).
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub hold_ttl: Duration,
    /// Bound on the wait for every order to be final, every cancel recorded and the
    /// outbox empty, per cell.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// Print the report as JSON on stdout (the log goes to stderr either way).
    #[arg(long)]
    pub json: bool,
    /// Keep the three databases afterwards.
    #[arg(long)]
    pub keep: bool,
}

/// The cells of the drill; the second one loses its database.
pub const CELLS: [&str; 2] = ["cell-1", "cell-2"];

/// When cell 2's database is cut off, from the start of the buyers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outage {
    /// Offset of the cut.
    pub start: Duration,
    /// How long it lasts.
    pub length: Duration,
}

impl Outage {
    /// When the database is reachable again.
    pub fn end(&self) -> Duration {
        self.start + self.length
    }
}

/// The outage of a run: it starts at a seeded point in 0.3–0.4 of `duration` and lasts
/// `length` (default a third of `duration`).
pub fn outage(seed: u64, duration: Duration, length: Option<Duration>) -> Outage {
    let at: f64 = StdRng::seed_from_u64(seed).gen_range(0.3..=0.4);
    let start = Duration::from_millis((duration.as_millis() as f64 * at) as u64);
    Outage { start, length: length.unwrap_or(duration / 3) }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The run's log on stderr, `t=12.3s …` from the drill's start.
struct Log {
    started: Instant,
}

impl Log {
    fn note(&self, line: impl AsRef<str>) {
        eprintln!("t={:.1}s {}", self.started.elapsed().as_secs_f64(), line.as_ref());
    }
}

/// The databases of a run.
struct Names {
    cells: [String; 2],
    control: String,
}

impl Names {
    fn all(&self) -> [&str; 3] {
        [&self.cells[0], &self.cells[1], &self.control]
    }
}

/// Runs `boxoffice-drills cells`; returns the exit code (0: cell 1 kept its rate, cell 2
/// recovered and both audits are clean; 1: not so; 2: a check could not run, or the run
/// itself failed: the error is printed). Errors only on invalid options.
pub async fn run(cfg: Config, args: CellsArgs) -> anyhow::Result<i32> {
    anyhow::ensure!(args.duration >= Duration::from_secs(10), "--duration must be at least 10s");
    anyhow::ensure!(args.rate > 0.0 && args.rate.is_finite(), "--rate must be a finite number > 0");
    anyhow::ensure!(args.hold_ttl >= Duration::from_secs(1), "--hold-ttl must be at least 1s");
    let out = outage(args.seed, args.duration, args.outage);
    anyhow::ensure!(!out.length.is_zero(), "--outage must be above zero");
    anyhow::ensure!(
        out.end() + Duration::from_secs(2) <= args.duration,
        "the outage ({:?} from {:?}) must end at least 2s before --duration ({:?})",
        out.length,
        out.start,
        args.duration
    );
    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let names = Names {
        cells: [format!("boxoffice_cells_{tag}_cell1"), format!("boxoffice_cells_{tag}_cell2")],
        control: format!("boxoffice_cells_{tag}_control"),
    };
    let log = Log { started: Instant::now() };
    let outcome = tokio::select! {
        r = drill(&cfg, &args, out, &tag, &names, &log) => r,
        _ = boxoffice::commands::wait_for_signal() => Err(anyhow::anyhow!("interrupted")),
    };
    if args.keep {
        log.note(format!("kept databases {}", names.all().join(", ")));
    } else {
        for name in names.all() {
            if let Err(e) = drop_database(&cfg, name).await {
                eprintln!("warning: dropping database {name}: {e:#}");
            }
        }
    }
    outcome.or_else(|e| {
        eprintln!("error: the cells drill could not complete: {e:#}");
        Ok(2)
    })
}

/// A connection to the server's maintenance database `postgres`.
async fn admin_connection(cfg: &Config) -> anyhow::Result<sqlx::PgConnection> {
    let opts = cfg.pg_options()?.database("postgres");
    sqlx::PgConnection::connect_with(&opts).await.context("connecting to the postgres database")
}

async fn drop_database(cfg: &Config, name: &str) -> anyhow::Result<()> {
    let mut conn = admin_connection(cfg).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).execute(&mut conn).await?;
    Ok(())
}

/// Creates `url`'s database and applies `migrator`; returns a small pool on it.
async fn create_migrated(
    url: &str,
    opts: PgConnectOptions,
    migrator: &sqlx::migrate::Migrator,
) -> anyhow::Result<PgPool> {
    sqlx::Postgres::create_database(url).await.context("creating the database")?;
    let pool = boxoffice_store::connect(opts.application_name("boxoffice-drills-cells"), 3, 30_000).await?;
    migrator.run(&pool).await.context("applying migrations")?;
    Ok(pool)
}

/// One cell of the run, once deployed.
struct Cell {
    name: &'static str,
    cfg: Config,
    /// The drill's own pool on the cell's ledger (through the kill switch for cell 2).
    pool: PgPool,
    event: uuid::Uuid,
    deployment: Deployment,
    timeline: HoldTimeline,
}

/// Throughput and hold latency of one cell over one window.
#[derive(Debug, Clone, Serialize)]
pub struct WindowStats {
    /// Holds created in the window (ledger), per second.
    pub holds_per_s: f64,
    /// Orders whose tickets were issued in the window (ledger), per second.
    pub ticketed_per_s: f64,
    /// p99 of the buyers' hold latency over the holds answered in the window, ms (`None`
    /// without any).
    pub hold_p99_ms: Option<f64>,
    /// Holds created in the window.
    pub holds: i64,
    /// Orders ticketed in the window.
    pub ticketed_orders: i64,
    /// Hold latency samples in the window.
    pub hold_samples: usize,
}

/// How soon a cell sold again once the outage ended (from its ledger), seconds after the
/// restore; `None` when it did not.
#[derive(Debug, Clone, Serialize)]
pub struct Recovery {
    /// The first hold created after the restore.
    pub first_hold_s: Option<f64>,
    /// The first ticket issued for a hold created after the restore.
    pub first_ticket_s: Option<f64>,
}

/// What the drill found in one cell.
struct CellResult {
    stats: BuyerStats,
    drained: bool,
    audit: Option<boxoffice::audit::AuditReport>,
    /// Before, during, after the outage, and the recovery.
    windows: Option<([WindowStats; 3], Recovery)>,
}

async fn drill(
    base: &Config,
    args: &CellsArgs,
    out: Outage,
    tag: &str,
    names: &Names,
    log: &Log,
) -> anyhow::Result<i32> {
    let run_started = chrono::Utc::now();
    let server = base.pg_options()?;
    anyhow::ensure!(
        server.get_socket().is_none(),
        "the drill needs PostgreSQL over TCP (database_url names a socket)"
    );
    let upstream = tokio::net::lookup_host((server.get_host(), server.get_port()))
        .await
        .context("resolving the database host")?
        .next()
        .context("the database host resolves to nothing")?;
    let switch = KillSwitch::start(upstream).await?;
    // The switch forwards until the drill returns, whichever way.
    let _switch_stops = switch.stop_guard();
    let direct = |db: &str| server.clone().database(db);
    let url = |o: PgConnectOptions| o.to_url_lossy().to_string();
    let cell_opts =
        [direct(&names.cells[0]), direct(&names.cells[1]).host("127.0.0.1").port(switch.addr().port())];

    let mut cfg = base.clone();
    cfg.hold_ttl_ms = args.hold_ttl.as_millis() as u64;
    cfg.admission_direct = true;
    cfg.release_max_per_s = 0.0;
    // Every buyer sends its own X-Forwarded-For; the per-IP buckets then see buyers.
    cfg.http_trusted_proxy_hops = 1;
    cfg.kafka_partitions = 4;
    cfg.consumer_lanes = 2;
    // Messages that failed during the outage come back within the run; a leading relay cut
    // off from PostgreSQL keeps the outbox's lock for the shortest valid lease.
    cfg.consumer_retry_1m_delay_ms = 15_000;
    cfg.relay_lease_ms = 31_000;
    // Two all-roles deployments on one server: 20 connections each at most in the pools, plus
    // the release controller's and the relay's own sessions.
    (cfg.db_pool_api, cfg.db_pool_webhooks, cfg.db_pool_relay) = (6, 2, 2);
    (cfg.db_pool_saga, cfg.db_pool_payments, cfg.db_pool_tickets, cfg.db_pool_expiry) = (3, 3, 3, 1);
    let embedded = deploy::embedded_broker_unless_configured(&mut cfg)?;
    let topic_prefix = |n: usize| match embedded {
        Some(_) => format!("{}cell{n}.", base.kafka_topic_prefix),
        None => format!("{}cells_{tag}.cell{n}.", base.kafka_topic_prefix),
    };
    cfg.cells = (0..2)
        .map(|i| CellSettings {
            name: CELLS[i].to_owned(),
            database_url: SecretString::from(url(cell_opts[i].clone())),
            kafka_topic_prefix: topic_prefix(i + 1),
            redis_key_prefix: format!("{}cells_{tag}:cell{}:", base.redis_key_prefix, i + 1),
            api_url: None,
        })
        .collect();
    cfg.control_database_url = Some(SecretString::from(url(direct(&names.control))));
    cfg.validate()?;
    log.note(format!(
        "databases {}, {}, {}; cell-2 reaches PostgreSQL ({upstream}) through the kill switch on {}; broker {}",
        names.cells[0],
        names.cells[1],
        names.control,
        switch.addr(),
        match &embedded {
            Some(_) => "embedded".to_owned(),
            None => cfg.kafka_brokers.clone().unwrap_or_default(),
        }
    ));

    let control_url = url(direct(&names.control));
    let control = create_migrated(&control_url, direct(&names.control), &directory::CONTROL_MIGRATOR)
        .await
        .context("control database")?;
    let mut cells = Vec::new();
    for (i, name) in CELLS.into_iter().enumerate() {
        let cell_cfg = cfg.for_cell(name)?;
        let pool =
            create_migrated(&url(direct(&names.cells[i])), cell_opts[i].clone(), &boxoffice_store::MIGRATOR)
                .await
                .with_context(|| format!("{name}'s database"))?;
        let spec = venue::VenueSpec::small(20, 20, 20);
        let (event, seats) = venue::seed(
            &pool,
            &format!("Cells drill {tag} {name}"),
            &spec,
            chrono::Utc::now() + chrono::Duration::days(30),
            name,
        )
        .await?;
        let placement = boxoffice_store::cells::placement(&pool, event).await?.context("the seeded event")?;
        let entry = directory::assign(&control, event.0, name, placement.directory_epoch).await?;
        log.note(format!(
            "{name}: event {} with {seats} seats, directory epoch {}",
            event.0, entry.directory_epoch
        ));
        cells.push((name, cell_cfg, pool, event.0));
    }
    control.close().await;

    let started = futures::future::join_all(cells.iter().map(|(_, c, _, _)| async {
        let opts = deploy::Options {
            embedded: embedded.as_ref(),
            ..deploy::Options::new(&Role::ALL, c.pg_options()?)
        };
        Deployment::start(c.clone(), opts).await
    }))
    .await;
    let mut deployments = Vec::new();
    let mut failed = None;
    for (d, (name, ..)) in started.into_iter().zip(&cells) {
        match d {
            Ok(d) => deployments.push(d),
            Err(e) => failed = Some(e.context(format!("starting {name}"))),
        }
    }
    if let Some(e) = failed {
        for d in deployments {
            d.stop().await;
        }
        return Err(e);
    }
    let cells: Vec<Cell> = cells
        .into_iter()
        .zip(deployments)
        .map(|((name, cfg, pool, event), deployment)| Cell {
            name,
            cfg,
            pool,
            event,
            deployment,
            timeline: HoldTimeline::default(),
        })
        .collect();
    for c in &cells {
        log.note(format!(
            "{}: every role running, api {}, stripe simulator {}",
            c.name,
            c.deployment.api_url().unwrap_or_default(),
            c.deployment.cfg.stripe_api_base
        ));
    }

    let buyer_configs = cells
        .iter()
        .enumerate()
        .map(|(i, c)| buyer_config(c, args, out, i as u64))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let origin = Instant::now();
    let origin_utc = chrono::Utc::now();
    log.note(format!(
        "buyers: {:.1}/s per cell for {:.0}s; cell-2's database cut at t+{:.1}s for {:.1}s",
        args.rate,
        args.duration.as_secs_f64(),
        out.start.as_secs_f64(),
        out.length.as_secs_f64()
    ));
    let mut drives = buyer_configs.into_iter().map(buyers::drive);
    let (d1, d2) = (drives.next().expect("two cells"), drives.next().expect("two cells"));
    let (s1, s2, ()) = tokio::join!(d1, d2, cut(&switch, origin, out, log));
    let stats = [s1.context("cell-1's buyers")?, s2.context("cell-2's buyers")?];
    for (c, s) in cells.iter().zip(&stats) {
        log.note(format!(
            "{}: buyers done: {} holds, {} ticketed, {} expired, {} timed out, {} http errors (retried)",
            c.name, s.holds, s.ticketed_orders, s.expired, s.timed_out, s.http_errors
        ));
    }

    let audits =
        futures::future::join_all(cells.iter().map(|c| drain_and_audit(c, args, run_started, log))).await;
    let mut results = Vec::new();
    for ((c, s), (drained, audit)) in cells.iter().zip(stats).zip(audits) {
        let windows = match read_windows(c, origin, origin_utc, out, args.duration).await {
            Ok(w) => Some(w),
            Err(e) => {
                log.note(format!("{}: reading the ledger's windows failed: {e:#}", c.name));
                None
            }
        };
        results.push(CellResult { stats: s, drained, audit, windows });
    }
    let (cut_n, refused_n) = (switch.cut_count(), switch.refused_count());
    for c in cells {
        c.pool.close().await;
        c.deployment.stop().await;
    }
    drop(embedded);
    Ok(report(args, out, names, &results, (cut_n, refused_n), log))
}

/// The buyers of cell `i`: its API, its simulator, its event, direct admission, a constant
/// arrival rate, and a per-buyer deadline that outlasts the outage.
fn buyer_config(c: &Cell, args: &CellsArgs, out: Outage, i: u64) -> anyhow::Result<buyers::BuyerConfig> {
    let users = runtime::user_tokens(&c.cfg);
    let api_url = c.deployment.api_url().context("the api did not start")?;
    let mut bc = buyers::BuyerConfig::new(
        api_url,
        c.deployment.cfg.stripe_api_base.clone(),
        c.cfg.stripe_publishable_key.clone(),
        c.event,
        Arc::new(move |u| users.issue(boxoffice_domain::UserId(u), 3_600)),
    );
    bc.buyers = ((args.rate * args.duration.as_secs_f64()).ceil() as usize).max(1);
    bc.arrival_rate = args.rate;
    bc.max_in_flight = 64;
    bc.poll_interval_ms = 500;
    bc.final_timeout_ms = (args.hold_ttl + out.length).as_millis() as u64 + 60_000;
    bc.seed = args.seed ^ (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    bc.admission = buyers::AdmissionRoute::Direct;
    bc.hold_timeline = Some(c.timeline.clone());
    Ok(bc)
}

/// Trips the kill switch at the outage's start and restores it at its end.
async fn cut(switch: &KillSwitch, origin: Instant, out: Outage, log: &Log) {
    tokio::time::sleep_until((origin + out.start).into()).await;
    let live = switch.trip();
    log.note(format!("kill switch tripped: cell-2's database unreachable ({live} connection(s) cut)"));
    tokio::time::sleep_until((origin + out.end()).into()).await;
    switch.restore();
    log.note(format!(
        "kill switch restored: cell-2's database reachable again ({} connection attempt(s) refused meanwhile)",
        switch.refused_count()
    ));
}

/// Every order of the cell's event final, its cancels recorded and its outbox
/// empty (riding out refused connections), then the audit over its ledger, its simulator and its dead letters.
async fn drain_and_audit(
    c: &Cell,
    args: &CellsArgs,
    run_started: chrono::DateTime<chrono::Utc>,
    log: &Log,
) -> (bool, Option<boxoffice::audit::AuditReport>) {
    let drained = Drain::orders_of(c.event, args.drain_timeout)
        .every(Duration::from_millis(250))
        .retrying_errors()
        .run(&c.pool)
        .await
        .unwrap_or_default();
    log.note(format!("{}: {drained}", c.name));
    if let (false, Some(e)) = (drained.done, &drained.last_error) {
        log.note(format!("{}: last drain check failed: {e}", c.name));
    }
    let provider = boxoffice_payments::StripeClient::new(boxoffice_payments::StripeConfig {
        api_base: c.deployment.cfg.stripe_api_base.clone(),
        secret_key: c.cfg.stripe_secret_key.clone(),
        timeout_ms: c.cfg.stripe_timeout_ms,
    });
    let provider = match provider {
        Ok(p) => p,
        Err(e) => {
            log.note(format!("{}: no provider client: {e:#}", c.name));
            return (drained.done, None);
        }
    };
    let window =
        boxoffice::reconcile::Window { since: run_started - chrono::Duration::minutes(1), until: None };
    let opts = boxoffice::audit::AuditOptions {
        stuck_after_ms: 0,
        event: Some(c.event),
        provider: Ok((provider, window)),
        kafka: c.cfg.kafka().ok_or_else(|| "no broker configured".to_owned()),
        dlq_timeout: Duration::from_secs(30),
    };
    let mut audited = boxoffice::audit::run(&c.pool, &opts).await;
    for _ in 0..5 {
        let Err(e) = &audited else { break };
        log.note(format!("{}: the audit could not read the ledger, retrying: {e:#}", c.name));
        tokio::time::sleep(Duration::from_secs(2)).await;
        audited = boxoffice::audit::run(&c.pool, &opts).await;
    }
    match audited {
        Ok(r) => {
            log.note(format!("{}: audit: {} violation(s), exit code {}", c.name, r.total(), r.exit_code()));
            (drained.done, Some(r))
        }
        Err(e) => {
            log.note(format!("{}: the audit could not run: {e:#}", c.name));
            (drained.done, None)
        }
    }
}

/// The three windows of a cell (holds and ticketed orders from its ledger, hold p99 from its
/// buyers' samples) and how soon it sold again after the restore.
async fn read_windows(
    c: &Cell,
    origin: Instant,
    origin_utc: chrono::DateTime<chrono::Utc>,
    out: Outage,
    duration: Duration,
) -> anyhow::Result<([WindowStats; 3], Recovery)> {
    let bounds = [(Duration::ZERO, out.start), (out.start, out.end()), (out.end(), duration)];
    let samples = lock(&c.timeline).clone();
    let mut windows = Vec::new();
    for (from, until) in bounds {
        let at = |d: Duration| origin_utc + chrono::Duration::from_std(d).unwrap_or_default();
        // Drill-only counting over the ledger.
        let (holds, ticketed): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM holds h JOIN orders o ON o.id = h.order_id
                      WHERE o.event_id = $1 AND h.created_at >= $2 AND h.created_at < $3),
                    (SELECT count(DISTINCT order_id) FROM tickets
                      WHERE event_id = $1 AND issued_at >= $2 AND issued_at < $3)",
        )
        .bind(c.event)
        .bind(at(from))
        .bind(at(until))
        .fetch_one(&c.pool)
        .await?;
        let latencies: Vec<f64> = samples
            .iter()
            .filter(|(t, _)| *t >= origin + from && *t < origin + until)
            .map(|(_, l)| l.as_secs_f64() * 1_000.0)
            .collect();
        let secs = (until - from).as_secs_f64().max(1e-3);
        windows.push(WindowStats {
            holds_per_s: holds as f64 / secs,
            ticketed_per_s: ticketed as f64 / secs,
            hold_p99_ms: (!latencies.is_empty()).then(|| stats::percentile(&latencies, 0.99)),
            holds,
            ticketed_orders: ticketed,
            hold_samples: latencies.len(),
        });
    }
    let windows: [WindowStats; 3] = windows.try_into().map_err(|_| anyhow::anyhow!("three windows"))?;
    let restored = origin_utc + chrono::Duration::from_std(out.end()).unwrap_or_default();
    let (hold, ticket): (Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT extract(epoch FROM (SELECT min(h.created_at) FROM holds h JOIN orders o ON o.id = h.order_id
                                     WHERE o.event_id = $1 AND h.created_at >= $2) - $2)::float8,
                extract(epoch FROM (SELECT min(t.issued_at) FROM tickets t JOIN holds h USING (order_id)
                                     WHERE t.event_id = $1 AND h.created_at >= $2) - $2)::float8",
    )
    .bind(c.event)
    .bind(restored)
    .fetch_one(&c.pool)
    .await?;
    Ok((windows, Recovery { first_hold_s: hold, first_ticket_s: ticket }))
}

/// The verdict, the report (JSON or text on stdout) and the exit code.
fn report(
    args: &CellsArgs,
    out: Outage,
    names: &Names,
    results: &[CellResult],
    (cut_n, refused_n): (u64, u64),
    log: &Log,
) -> i32 {
    let [r1, r2] = [&results[0], &results[1]];
    let ratio = r1.windows.as_ref().map(|([before, during, _], _)| {
        if before.ticketed_per_s > 0.0 {
            during.ticketed_per_s / before.ticketed_per_s
        } else {
            0.0
        }
    });
    let clean = |r: &CellResult| r.audit.as_ref().is_some_and(|a| a.exit_code() == 0);
    let recovered =
        r2.windows.as_ref().is_some_and(|([_, _, after], _)| after.holds > 0 && after.ticketed_orders > 0)
            && r2.drained
            && clean(r2);
    let violations: i64 = results.iter().filter_map(|r| r.audit.as_ref()).map(|a| a.total()).sum();
    // A check that did not run: an audit that failed or could not read its provider or
    // broker, or a ledger whose windows could not be read.
    let incomplete =
        results.iter().any(|r| r.windows.is_none() || r.audit.as_ref().is_none_or(|a| a.exit_code() == 2));
    let code = if violations > 0 {
        1
    } else if incomplete {
        2
    } else if ratio.is_some_and(|r| r >= 0.8) && recovered {
        0
    } else {
        1
    };
    let window_json = |w: &Option<([WindowStats; 3], Recovery)>| match w {
        Some(([b, d, a], rec)) => json!({"before": b, "during": d, "after": a, "recovery": rec}),
        None => json!(null),
    };
    let mut cells = serde_json::Map::new();
    for (name, r) in CELLS.iter().zip(results) {
        let mut v = window_json(&r.windows);
        if let Some(m) = v.as_object_mut() {
            let s = &r.stats;
            m.insert(
                "buyers".into(),
                json!({
                    "buyers": s.buyers, "holds": s.holds, "ticketed_orders": s.ticketed_orders,
                    "expired": s.expired, "declined": s.declined, "abandoned": s.abandoned,
                    "timed_out": s.timed_out, "http_errors": s.http_errors,
                    "hold_p99_ms": s.hold_latency_ms.p99,
                }),
            );
            m.insert("drained".into(), json!(r.drained));
            m.insert("violations".into(), json!(r.audit.as_ref().map(|a| a.total())));
            m.insert("audit_exit_code".into(), json!(r.audit.as_ref().map(|a| a.exit_code())));
            m.insert(
                "checks".into(),
                r.audit.as_ref().map_or(json!(null), |a| a.to_json()["checks"].clone()),
            );
        }
        cells.insert((*name).to_owned(), v);
    }
    let doc = json!({
        "seed": args.seed,
        "duration_s": args.duration.as_secs_f64(),
        "rate_per_s": args.rate,
        "hold_ttl_s": args.hold_ttl.as_secs_f64(),
        "outage": {
            "start_s": out.start.as_secs_f64(),
            "duration_s": out.length.as_secs_f64(),
            "connections_cut": cut_n,
            "connections_refused": refused_n,
        },
        "databases": names.all(),
        "cells": cells,
        "cell1_rate_ratio_during_outage": ratio,
        "cell2_recovered": recovered,
        "violations": violations,
        "exit_code": code,
        "elapsed_s": log.started.elapsed().as_secs_f64(),
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
        return code;
    }
    println!();
    println!(
        "boxoffice cells drill: seed {}, {:.0}s of buyers at {}/s per cell, cell-2's database cut at t={:.1}s for {:.1}s",
        args.seed,
        args.duration.as_secs_f64(),
        args.rate,
        out.start.as_secs_f64(),
        out.length.as_secs_f64()
    );
    println!("  {:<8} {:<7} {:>8} {:>11} {:>12}", "cell", "window", "holds/s", "ticketed/s", "hold p99 ms");
    for (name, r) in CELLS.iter().zip(results) {
        match &r.windows {
            Some((ws, _)) => {
                for (label, w) in ["before", "during", "after"].iter().zip(ws) {
                    let p99 = w.hold_p99_ms.map_or("-".to_owned(), |p| format!("{p:.1}"));
                    println!(
                        "  {:<8} {:<7} {:>8.2} {:>11.2} {:>12}",
                        name, label, w.holds_per_s, w.ticketed_per_s, p99
                    );
                }
            }
            None => println!("  {name:<8} (the ledger could not be read)"),
        }
    }
    for (name, r) in CELLS.iter().zip(results) {
        let s = &r.stats;
        println!(
            "  {name}: {} buyers, {} holds, {} ticketed, {} timed out, {} http errors; drained {}",
            s.buyers, s.holds, s.ticketed_orders, s.timed_out, s.http_errors, r.drained
        );
        if let Some((_, rec)) = &r.windows {
            let s = |v: Option<f64>| v.map_or("never".to_owned(), |v| format!("{v:.1}s"));
            println!(
                "  {name}: after the restore, first hold {}, first ticket {}",
                s(rec.first_hold_s),
                s(rec.first_ticket_s)
            );
        }
        match &r.audit {
            Some(a) => print!("{}", boxoffice::audit::render(a)),
            None => println!("  {name}: the audit could not run"),
        }
    }
    println!(
        "  cell-1 ticketed/s during ÷ before: {} (at least 0.80)",
        ratio.map_or("-".to_owned(), |r| format!("{r:.2}"))
    );
    println!("  cell-2 recovered: {recovered}");
    println!("  violations: {violations}");
    println!(
        "result: {}",
        match code {
            0 => "OK — cell 1 kept selling through cell 2's outage, cell 2 recovered, every invariant holds",
            2 => "INCOMPLETE — a check could not run (see above)",
            _ => "FAILED — see above",
        }
    );
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_outage_is_a_function_of_the_seed_inside_its_band() {
        let d = Duration::from_secs(60);
        assert_eq!(outage(1, d, None), outage(1, d, None));
        for seed in 0..100 {
            let o = outage(seed, d, None);
            assert!((18_000..=24_000).contains(&(o.start.as_millis() as u64)), "{o:?}");
            assert_eq!(o.length, Duration::from_secs(20));
        }
        assert_eq!(outage(1, d, Some(Duration::from_secs(5))).length, Duration::from_secs(5));
    }
}
