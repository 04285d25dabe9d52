//! `boxoffice-drills drill failover`: the warm-region failover drill (design §15, §17) on one
//! machine.
//!
//! Owns the drill's sequence and its counting; the runbook itself is the product's
//! ([`boxoffice::region`]). What it builds: a primary PostgreSQL cluster and an asynchronous
//! streaming replica ([`crate::pgcluster::PgPair`], removed afterwards), a witness database
//! beside the configured one, an embedded Kafka-protocol broker per region with a mirror
//! from the primary's purchase topic to the DR one (a broker replicated separately from the
//! database), one Stripe simulator (the provider is global), every role in the primary region,
//! and buyers that hold and pay through whichever region the traffic switch names.
//!
//! The sequence: buyers buy; at a seeded moment replication is cut (lag builds while the
//! primary keeps committing); then the primary region fails (its roles stop, its server stops
//! immediately). The drill runs the runbook — `fence`, `promote`, the DR roles at the new
//! epoch, `republish`, a synthetic hold paid through a signed webhook, `reconcile --fix` —
//! then restarts the old primary and its API as a zombie with the old epoch and drives
//! buyers and a signed webhook at it, and an old-epoch API at the new primary. Last it drains
//! the DR region and audits it.
//!
//! Protects, and measures, the single writing region: RPO is counted from a client-side
//! ledger of acknowledged holds (those the promoted ledger does not have), RTO from the fence
//! to the first synthetic order authorized in the new region; writes accepted under the old
//! epoch after the fence are counted at the API and in both ledgers (outbox rows stamped with
//! the old epoch, created after the fence). Exit 0 only when no old-epoch write was accepted
//! anywhere and the audit is clean; 1 otherwise; 2 when the drill could not run.

use crate::pgcluster::PgPair;
use anyhow::Context;
use boxoffice::config::Config;
use boxoffice::runtime::Role;
use boxoffice_domain::{EventId, UserId};
use boxoffice_harness::client::{confirm_payment, BuyerClient, HoldReceipt, OrderView};
use boxoffice_harness::deploy::{self, Deployment};
use boxoffice_harness::drain::Drain;
use boxoffice_store::venue::{self, VenueSpec};
use boxoffice_stripe_sim::StripeSim;
use chrono::{DateTime, Utc};
use clap::Args;
use rand::{Rng, SeedableRng};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Serialize;
use sqlx::{ConnectOptions, PgPool};
use std::collections::HashSet;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// `drill failover` options.
#[derive(Args, Debug, Clone)]
pub struct FailoverArgs {
    /// Seed of the cut's moment and of the buyers' choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Concurrent buyers.
    #[arg(long, default_value_t = 6)]
    pub buyers: usize,
    /// Buying before replication is cut (± 20 %, seeded).
    #[arg(long, default_value = "8s", value_parser = humantime::parse_duration)]
    pub before_cut: Duration,
    /// Buying while replication is cut, before the primary region fails.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub lag_window: Duration,
    /// Buying in the promoted region, with the zombie up, before the drain.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub after: Duration,
    /// Bound on the drain of the promoted region.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// Print the report as JSON on stdout (the log goes to stderr).
    #[arg(long)]
    pub json: bool,
}

/// The drill's findings (`--json`).
#[derive(Debug, Default, Clone, Serialize)]
pub struct FailoverReport {
    /// Holds acknowledged (202) by the primary region.
    pub holds_acknowledged: usize,
    /// Of those, the ones the promoted ledger does not have: the RPO, counted.
    pub rpo_commits_lost: usize,
    /// WAL bytes the replica was behind when the primary failed.
    pub rpo_wal_bytes: i64,
    /// Seconds between the last hold the primary acknowledged and the replica's last
    /// replayed commit (the recovery point).
    pub rpo_seconds: f64,
    /// From the fence to the first synthetic hold in the new region whose payment a signed
    /// webhook moved forward, s.
    pub rto_seconds: f64,
    /// How long promotion waited for the old leases to lapse, ms.
    pub lease_wait_ms: i64,
    /// The fenced and the new epoch.
    pub old_epoch: i64,
    /// See `old_epoch`.
    pub new_epoch: i64,
    /// Old-epoch writes accepted by the new primary after the fence (API answers plus outbox
    /// rows of the old epoch created after the fence): must be 0.
    pub old_epoch_writes_accepted: usize,
    /// Writes accepted by the returning old primary after the fence (holds and webhooks
    /// answered 2xx, plus its outbox rows created after the fence): must be 0.
    pub zombie_writes_accepted: usize,
    /// Attempts made at the zombie (holds and webhooks).
    pub zombie_attempts: usize,
    /// Whether the second fence, with the old primary reachable, fenced its ledger too.
    pub zombie_fenced_in_its_ledger: bool,
    /// Outbox rows `region republish` marked for publishing again.
    pub republished: u64,
    /// Deliveries the promoted region's inboxes absorbed as duplicates.
    pub duplicates_absorbed: u64,
    /// Facts on the DR broker (mirrored) whose outbox rows the promoted ledger does not
    /// have: parked as `orphan_fact` incidents.
    pub orphan_events: i64,
    /// Republished rows the mirror never carried (committed, missing from the DR broker).
    pub missed_by_mirror: usize,
    /// Facts the mirror carried whose outbox rows the promoted ledger does not have
    /// (committed by the old primary after the recovery point).
    pub mirrored_outside_cut: usize,
    /// PaymentIntents `reconcile --fix` acted on (facts and compensations written).
    pub pis_reconciled: usize,
    /// Lost orders whose PaymentIntents were cancelled or refunded.
    pub lost_orders_compensated: i64,
    /// Whether the promoted region drained (every order final, every cancel recorded, outbox empty).
    pub drained: bool,
    /// The audit's violation total after the drain (`None`: it could not run).
    pub violations: Option<i64>,
    /// What happened, in order.
    pub notes: Vec<String>,
}

impl FailoverReport {
    /// 0 when no old-epoch write was accepted anywhere, the drain finished and the audit is
    /// clean; 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        let ok = self.old_epoch_writes_accepted == 0
            && self.zombie_writes_accepted == 0
            && self.drained
            && self.violations == Some(0);
        i32::from(!ok)
    }
}

struct Log {
    started: Instant,
    notes: Mutex<Vec<String>>,
}

impl Log {
    fn note(&self, line: impl Into<String>) {
        let line = format!("t={:.1}s {}", self.started.elapsed().as_secs_f64(), line.into());
        eprintln!("{line}");
        self.notes.lock().unwrap().push(line);
    }
}

/// Holds the buyers had acknowledged, by region.
#[derive(Default)]
struct ClientLedger {
    /// (order, acknowledged at, by the primary region)
    holds: Mutex<Vec<(Uuid, DateTime<Utc>, bool)>>,
}

/// Runs the drill; the exit code of [`FailoverReport::exit_code`], or 2 when it could not run.
pub async fn run(cfg: Config, args: FailoverArgs) -> anyhow::Result<i32> {
    let log = Arc::new(Log { started: Instant::now(), notes: Mutex::default() });
    let pair = match PgPair::create("bo_failover").await {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: the PostgreSQL pair could not be created: {e:#}");
            return Ok(2);
        }
    };
    log.note(format!(
        "primary {} on {}, replica {} on {}",
        pair.primary.name, pair.primary.port, pair.replica.name, pair.replica.port
    ));
    let witness = format!("bo_failover_witness_{}", std::process::id());
    let outcome = drill(&cfg, &args, &pair, &witness, &log).await;
    let _ = drop_database(&cfg, &witness).await;
    if let Err(e) = pair.remove().await {
        eprintln!("warning: removing the PostgreSQL pair: {e:#}");
    }
    let mut report = match outcome {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: the drill could not run: {e:#}");
            return Ok(2);
        }
    };
    report.notes = log.notes.lock().unwrap().clone();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(report.exit_code())
}

async fn drop_database(cfg: &Config, name: &str) -> anyhow::Result<()> {
    let pool = boxoffice_store::connect(cfg.pg_options()?.database("postgres"), 1, 10_000).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).execute(&pool).await?;
    Ok(())
}

/// The drill's base configuration for both regions: short leases and statement timeout so
/// the drill runs in about a minute, every buyer limit off but the per-buyer seat rules.
fn region_config(cfg: &Config, region: &str, db: String, witness: String, peer: Option<String>) -> Config {
    Config {
        region: region.into(),
        database_url: db.into(),
        witness_database_url: Some(witness.into()),
        region_peer_database_url: peer.map(Into::into),
        region_lease_ttl_ms: 2_000,
        region_lease_renew_ms: 500,
        region_lease_skew_ms: 2_000,
        db_statement_timeout_ms: 2_000,
        region_republish_margin_ms: 5_000,
        http_bind: "127.0.0.1:0".into(),
        consumers_per_role: 1,
        kafka_partitions: 3,
        expiry_interval_ms: 200,
        hold_ttl_ms: 30_000,
        admission_direct: true,
        release_max_per_s: 0.0,
        rate_limit_purchase_ip_per_s: 0.0,
        rate_limit_purchase_user_per_s: 0.0,
        rate_limit_seats_ip_per_s: 0.0,
        http_max_in_flight_per_ip: 0,
        redis_key_prefix: format!("failover{}:", Uuid::new_v4().simple()),
        kafka_topic_prefix: String::new(),
        ..cfg.clone()
    }
}

async fn drill(
    cfg: &Config,
    args: &FailoverArgs,
    pair: &PgPair,
    witness_db: &str,
    log: &Arc<Log>,
) -> anyhow::Result<FailoverReport> {
    let mut report = FailoverReport::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let main_opts = cfg.pg_options()?;
    let witness_url = main_opts.clone().database(witness_db).to_url_lossy().to_string();
    let primary_url = pair.primary.url("boxoffice");
    let replica_url = pair.replica.url("boxoffice");
    let mut cfg_a =
        region_config(cfg, "primary", primary_url.clone(), witness_url.clone(), Some(replica_url.clone()));
    let mut cfg_b =
        region_config(cfg, "dr", replica_url.clone(), witness_url.clone(), Some(primary_url.clone()));
    cfg_a.region_epoch = 1;

    // Brokers, one per region, and the simulator both regions call.
    let broker_a = boxoffice_bus::embedded::EmbeddedBroker::start(1)?;
    let broker_b = boxoffice_bus::embedded::EmbeddedBroker::start(1)?;
    cfg_a.kafka_brokers = Some(broker_a.bootstrap_servers());
    cfg_b.kafka_brokers = Some(broker_b.bootstrap_servers());
    let sim_shutdown = CancellationToken::new();
    let sim = StripeSim::new(deploy::sim_config(&cfg_a));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let stripe_base = format!("http://{}", l.local_addr()?);
    tokio::spawn(sim.clone().serve(l, sim_shutdown.clone()));
    cfg_a.stripe_api_base = stripe_base.clone();
    cfg_b.stripe_api_base = stripe_base.clone();

    // The primary's ledger (replicated to the DR replica), the witness, the event.
    let ledger_a = boxoffice::commands::migrate_db(&cfg_a).await.context("migrating the primary")?;
    boxoffice::region::init(&cfg_a).await.context("initialising the witness")?;
    let (event, seats_n) = venue::seed(
        &ledger_a,
        "Failover Drill",
        &VenueSpec::small(4, 20, 25),
        Utc::now(),
        &cfg_a.purchase_cell,
    )
    .await?;
    let seats: Arc<Vec<Uuid>> = Arc::new(
        sqlx::query_scalar("SELECT id FROM seats WHERE event_id = $1 ORDER BY id")
            .bind(event.0)
            .fetch_all(&ledger_a)
            .await?,
    );
    log.note(format!("event {} with {seats_n} seats; witness names primary at epoch 1", event.0));
    let run_started = Utc::now();

    let opts_a = || deploy::Options {
        stripe_api_base: Some(stripe_base.clone()),
        embedded: Some(&broker_a),
        ..deploy::Options::new(&Role::ALL, main_like(&primary_url))
    };
    let region_a = Deployment::start(cfg_a.clone(), opts_a()).await.context("starting the primary region")?;
    let api_a = region_a.api_url().context("api")?;
    sim.set_webhook_url(Some(format!("{api_a}/webhooks/stripe")));
    log.note(format!("primary region up at {api_a}"));

    // The broker mirror A → B (the purchase topic), recording what it carried.
    let mirror_stop = CancellationToken::new();
    let mirrored = Arc::new(Mutex::new(HashSet::<Uuid>::new()));
    let mirror = tokio::spawn(mirror_topic(
        cfg_a.clone(),
        cfg_b.clone(),
        &broker_b,
        mirrored.clone(),
        mirror_stop.clone(),
    )?);

    // Buyers, through whichever region the traffic switch names.
    let target = Arc::new(RwLock::new((api_a.clone(), true)));
    let ledger = Arc::new(ClientLedger::default());
    let buyers_stop = CancellationToken::new();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
    let mut buyers = Vec::new();
    for i in 0..args.buyers {
        buyers.push(tokio::spawn(buyer(
            i as u64 ^ args.seed.rotate_left(17),
            cfg_a.clone(),
            http.clone(),
            event.0,
            seats.clone(),
            target.clone(),
            ledger.clone(),
            buyers_stop.clone(),
        )));
    }

    let before = args.before_cut.mul_f64(rng.gen_range(0.8..1.2));
    tokio::time::sleep(before).await;
    let cut = pair.cut_replication();
    log.note(format!(
        "replication cut after {:.1}s of buying ({cut} relay connection(s) reset)",
        before.as_secs_f64()
    ));
    tokio::time::sleep(args.lag_window).await;

    // The primary region fails.
    let positions = pair.wal_positions().await?;
    report.rpo_wal_bytes = positions.bytes.unwrap_or(0).max(0);
    *target.write().unwrap() = (String::new(), false);
    region_a.stop().await;
    pair.primary.stop_immediate().await?;
    // The broker's replication runs on its own: it carries what the primary's broker held a
    // little longer than the database's did (facts of commits the replica never got).
    tokio::time::sleep(Duration::from_secs(2)).await;
    mirror_stop.cancel();
    let _ = mirror.await;
    let last_ack_a = ledger.holds.lock().unwrap().iter().filter(|h| h.2).map(|h| h.1).max();
    log.note(format!(
        "primary region failed: {} WAL bytes not replicated, {} holds acknowledged there, {} facts mirrored",
        report.rpo_wal_bytes,
        ledger.holds.lock().unwrap().len(),
        mirrored.lock().unwrap().len()
    ));

    // The runbook, from the DR region.
    let fence_started = Instant::now();
    let fence_at = Utc::now();
    let fenced = boxoffice::region::fence(&cfg_b).await.context("region fence")?;
    report.old_epoch = 1;
    report.new_epoch = fenced.authority.epoch;
    log.note(format!(
        "fence: witness names dr at epoch {}; old primary {}; recovery point {} ({:?}); promotion in {} ms",
        fenced.authority.epoch,
        if fenced.old_primary_fenced {
            "fenced".into()
        } else {
            fenced.old_primary_note.clone().unwrap_or_default()
        },
        fenced.recovery_lsn,
        fenced.recovery_point_at,
        fenced.ms_until_clear
    ));
    if let (Some(last), Some(point)) = (last_ack_a, fenced.recovery_point_at) {
        report.rpo_seconds = ((last - point).num_milliseconds() as f64 / 1000.0).max(0.0);
    }
    let promoted = boxoffice::region::promote(&cfg_b).await.context("region promote")?;
    report.lease_wait_ms = promoted.waited_for_leases_ms;
    log.note(format!(
        "promote: replica promoted after waiting {} ms for old leases; ledger at epoch {}",
        promoted.waited_for_leases_ms, promoted.writer.epoch
    ));
    cfg_b.region_epoch = promoted.writer.epoch;
    // A writer's pool at the new epoch (reconcile writes facts through it).
    let ledger_b = boxoffice_store::connect(cfg_b.pg_options()?, 4, 10_000).await?;

    let dup_before = duplicates_counted();
    let region_b = Deployment::start(
        cfg_b.clone(),
        deploy::Options {
            stripe_api_base: Some(stripe_base.clone()),
            embedded: Some(&broker_b),
            ..deploy::Options::new(&Role::ALL, main_like(&replica_url))
        },
    )
    .await
    .context("starting the DR region")?;
    let api_b = region_b.api_url().context("api")?;
    let republished = boxoffice::region::republish(&cfg_b, None).await.context("region republish")?;
    report.republished = republished.republished;
    let republished_ids: Vec<Uuid> = sqlx::query_scalar(
        "SELECT id FROM outbox WHERE created_at >= $1 AND region_epoch IS DISTINCT FROM $2",
    )
    .bind(republished.since)
    .bind(cfg_b.region_epoch)
    .fetch_all(&ledger_b)
    .await?;
    {
        let m = mirrored.lock().unwrap();
        report.missed_by_mirror = republished_ids.iter().filter(|id| !m.contains(id)).count();
    }
    let carried: Vec<Uuid> = mirrored.lock().unwrap().iter().copied().collect();
    let in_cut: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE id = ANY($1)")
        .bind(&carried)
        .fetch_one(&ledger_b)
        .await?;
    report.mirrored_outside_cut = carried.len().saturating_sub(in_cut as usize);
    log.note(format!(
        "DR region up at {api_b} with epoch {}; {} outbox rows republished since {}",
        cfg_b.region_epoch, report.republished, republished.since
    ));

    // Synthetic hold + signed webhook, then the traffic switch.
    sim.set_webhook_url(Some(format!("{api_b}/webhooks/stripe")));
    let synthetic = synthetic_purchase(&cfg_b, &http, &api_b, event.0, &seats, &mut rng).await;
    match synthetic {
        Ok(()) => {
            report.rto_seconds = fence_started.elapsed().as_secs_f64();
            log.note(format!("synthetic hold and webhook passed: RTO {:.1}s", report.rto_seconds));
        }
        Err(e) => log.note(format!("synthetic check failed: {e:#}")),
    }
    *target.write().unwrap() = (api_b.clone(), false);

    // Reconcile the PaymentIntents around the cutover.
    match reconcile(&cfg_b, &ledger_b, run_started).await {
        Ok(n) => {
            report.pis_reconciled = n;
            log.note(format!("reconcile --fix acted on {n} PaymentIntents"));
        }
        Err(e) => log.note(format!("reconcile failed: {e:#}")),
    }

    // The zombie: the old primary returns with its old-epoch API; and an old-epoch API at
    // the new primary.
    pair.primary.start().await?;
    let zombie = Deployment::start(
        cfg_a.clone(),
        deploy::Options {
            stripe_api_base: Some(stripe_base.clone()),
            embedded: Some(&broker_a),
            ..deploy::Options::new(&[Role::Api, Role::Expiry], main_like(&primary_url))
        },
    )
    .await
    .context("starting the zombie")?;
    // No witness: only the new primary's epoch record stands between it and the ledger.
    let stale = Deployment::start(
        Config { kafka_brokers: None, witness_database_url: None, ..cfg_a.clone() },
        deploy::Options {
            stripe_api_base: Some(stripe_base.clone()),
            ..deploy::Options::new(&[Role::Api], main_like(&replica_url))
        },
    )
    .await
    .context("starting an old-epoch API at the new primary")?;
    let (zombie_api, stale_api) = (zombie.api_url().context("api")?, stale.api_url().context("api")?);
    log.note(format!(
        "zombie up at {zombie_api} (epoch 1, old primary); old-epoch API at the new primary {stale_api}"
    ));
    let mut zombie_accepted = 0;
    let mut stale_accepted = 0;
    let deadline = Instant::now() + args.after;
    while Instant::now() < deadline {
        let seat = seats[rng.gen_range(0..seats.len())];
        report.zombie_attempts += 2;
        if attempt_hold(&cfg_a, &http, &zombie_api, event.0, seat).await == Some(202) {
            zombie_accepted += 1;
        }
        if attempt_webhook(&cfg_a, &http, &zombie_api).await.is_some_and(|s| (200..300).contains(&s)) {
            zombie_accepted += 1;
        }
        if attempt_hold(&cfg_a, &http, &stale_api, event.0, seat).await == Some(202) {
            stale_accepted += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // With the old primary reachable, the fence fences its ledger too.
    match boxoffice::region::fence(&cfg_b).await {
        Ok(f) => {
            report.zombie_fenced_in_its_ledger = f.old_primary_fenced;
            log.note(format!(
                "fence again: old primary fenced in its ledger: {}, {} sessions terminated",
                f.old_primary_fenced, f.old_primary_sessions_terminated
            ));
        }
        Err(e) => log.note(format!("second fence failed: {e:#}")),
    }
    let seat = seats[rng.gen_range(0..seats.len())];
    report.zombie_attempts += 1;
    if attempt_hold(&cfg_a, &http, &zombie_api, event.0, seat).await == Some(202) {
        zombie_accepted += 1;
    }
    zombie.stop().await;
    stale.stop().await;
    let zombie_rows =
        rows_after(&pair.primary.connect_options("boxoffice"), fence_at, None).await.unwrap_or_else(|e| {
            log.note(format!("could not read the zombie's ledger: {e:#}"));
            usize::MAX / 2
        });
    let stale_rows = rows_after(&main_like(&replica_url), fence_at, Some(cfg_b.region_epoch)).await?;
    report.zombie_writes_accepted = zombie_accepted + zombie_rows;
    report.old_epoch_writes_accepted = stale_accepted + stale_rows;
    log.note(format!(
        "zombie: {} of {} attempts accepted, {zombie_rows} ledger rows after the fence; new primary: {stale_accepted} old-epoch holds accepted, {stale_rows} old-epoch rows",
        zombie_accepted, report.zombie_attempts
    ));

    // Drain and audit the promoted region.
    buyers_stop.cancel();
    for b in buyers {
        let _ = b.await;
    }
    {
        let holds = ledger.holds.lock().unwrap().clone();
        let acked_a: Vec<Uuid> = holds.iter().filter(|h| h.2).map(|h| h.0).collect();
        report.holds_acknowledged = acked_a.len();
        let present: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM orders WHERE id = ANY($1)")
            .bind(&acked_a)
            .fetch_all(&ledger_b)
            .await?;
        report.rpo_commits_lost = acked_a.len() - present.len();
    }
    let drained = Drain::orders_of(event.0, args.drain_timeout)
        .every(Duration::from_millis(250))
        .retrying_errors()
        .run(&ledger_b)
        .await?;
    report.drained = drained.done;
    log.note(format!("DR region: {drained}"));
    // A second reconcile after the drain: compensations written by the first are settled.
    if let Err(e) = reconcile(&cfg_b, &ledger_b, run_started).await {
        log.note(format!("second reconcile failed: {e:#}"));
    }
    let _ = Drain::outbox(Duration::from_secs(30), Duration::from_millis(250)).run(&ledger_b).await;
    report.duplicates_absorbed = duplicates_counted().saturating_sub(dup_before);
    report.orphan_events = count(
        &ledger_b,
        "SELECT count(DISTINCT detail->>'event_id') FROM incidents WHERE kind = 'orphan_fact'",
    )
    .await?;
    report.lost_orders_compensated =
        count(&ledger_b, "SELECT count(*) FROM incidents WHERE kind = 'lost_order_compensated'").await?;
    report.violations = audit(&cfg_b, &ledger_b, event, run_started, log).await;
    region_b.stop().await;
    sim_shutdown.cancel();
    ledger_a.close().await;
    ledger_b.close().await;
    Ok(report)
}

/// Connection options of a drill cluster's database without TLS.
fn main_like(url: &str) -> sqlx::postgres::PgConnectOptions {
    let o: sqlx::postgres::PgConnectOptions = url.parse().expect("the pair's URLs parse");
    o.ssl_mode(sqlx::postgres::PgSslMode::Disable)
}

async fn count(pool: &PgPool, sql: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(sql).fetch_one(pool).await?)
}

/// Outbox rows created after `at` under an epoch other than `current` (`None`: any epoch).
async fn rows_after(
    opts: &sqlx::postgres::PgConnectOptions,
    at: DateTime<Utc>,
    current: Option<i64>,
) -> anyhow::Result<usize> {
    let pool = boxoffice_store::connect(opts.clone(), 1, 10_000).await?;
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE created_at > $1 AND ($2::int8 IS NULL OR region_epoch IS DISTINCT FROM $2)",
    )
    .bind(at)
    .bind(current)
    .fetch_one(&pool)
    .await?;
    pool.close().await;
    Ok(n as usize)
}

/// Inbox duplicates counted by this process's consumers so far.
fn duplicates_counted() -> u64 {
    let Some(h) = boxoffice::runtime::metrics_handle() else { return 0 };
    h.render()
        .lines()
        .filter(|l| l.starts_with("boxoffice_consumer_messages_total") && l.contains("outcome=\"Duplicate\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Copies every message of the primary's purchase topic to the DR broker (key, payload,
/// headers), recording event ids, until `stop`.
fn mirror_topic(
    a: Config,
    b: Config,
    broker_b: &boxoffice_bus::embedded::EmbeddedBroker,
    carried: Arc<Mutex<HashSet<Uuid>>>,
    stop: CancellationToken,
) -> anyhow::Result<impl std::future::Future<Output = ()>> {
    let ka = a.kafka().context("broker a")?;
    let kb = b.kafka().context("broker b")?;
    broker_b.create_topics(&kb)?;
    let consumer: StreamConsumer = ka
        .client_config()
        .set("group.id", "boxoffice-drill-mirror")
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "true")
        .create()?;
    let topic = ka.topic(boxoffice_domain::Topic::Purchase.name());
    consumer.subscribe(&[&topic])?;
    let producer: FutureProducer = kb.client_config().set("linger.ms", "1").create()?;
    let to = kb.topic(boxoffice_domain::Topic::Purchase.name());
    Ok(async move {
        loop {
            let msg = tokio::select! {
                _ = stop.cancelled() => break,
                m = consumer.recv() => m,
            };
            let Ok(msg) = msg else { continue };
            let mut rec = FutureRecord::<[u8], [u8]>::to(&to);
            if let Some(k) = msg.key() {
                rec = rec.key(k);
            }
            if let Some(p) = msg.payload() {
                rec = rec.payload(p);
            }
            if let Some(h) = msg.headers() {
                let owned = h.detach();
                if let Some(id) = owned
                    .iter()
                    .find(|h| h.key == boxoffice_bus::fact_headers::EVENT_ID)
                    .and_then(|h| h.value)
                    .and_then(|v| std::str::from_utf8(v).ok())
                    .and_then(|s| s.parse().ok())
                {
                    carried.lock().unwrap().insert(id);
                }
                rec = rec.headers(owned);
            }
            // Not awaited one by one: the mirror keeps up with the relay, as a replicator does.
            while let Err((_, r)) = producer.send_result(rec) {
                rec = r;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let _ = tokio::task::spawn_blocking(move || {
            rdkafka::producer::Producer::flush(&producer, Duration::from_secs(5))
        })
        .await;
    })
}

/// One buyer: hold a random seat, pay it, again, through the region `target` names (none
/// while the switch is between regions), recording every acknowledged hold.
#[allow(clippy::too_many_arguments)]
async fn buyer(
    seed: u64,
    cfg: Config,
    http: reqwest::Client,
    event: Uuid,
    seats: Arc<Vec<Uuid>>,
    target: Arc<RwLock<(String, bool)>>,
    ledger: Arc<ClientLedger>,
    stop: CancellationToken,
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let tokens = boxoffice::runtime::user_tokens(&cfg);
    let admission = match boxoffice::runtime::admission_tokens(&cfg) {
        Ok(a) => a,
        Err(_) => return,
    };
    while !stop.is_cancelled() {
        let (api, primary) = target.read().unwrap().clone();
        if api.is_empty() {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let user = UserId(Uuid::new_v4());
        let bearer = format!("Bearer {}", tokens.issue(user, 3_600));
        let adm = admission.issue(user, EventId(event), 1, 600).0;
        let client = BuyerClient::new(http.clone(), &api);
        let seat = seats[rng.gen_range(0..seats.len())];
        let r = client.hold(&bearer, event, &adm, &Uuid::new_v4().to_string(), &[seat]).send().await;
        let Ok(r) = r else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        if r.status().as_u16() != 202 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let Ok(receipt) = r.json::<HoldReceipt>().await else { continue };
        ledger.holds.lock().unwrap().push((receipt.order_id, Utc::now(), primary));
        // Pay once the PaymentIntent exists; a buyer whose region fails meanwhile walks away.
        let _ = pay(&cfg, &http, &client, &bearer, receipt.order_id, Duration::from_secs(8)).await;
    }
}

async fn pay(
    cfg: &Config,
    http: &reqwest::Client,
    client: &BuyerClient,
    bearer: &str,
    order: Uuid,
    within: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        anyhow::ensure!(Instant::now() < deadline, "no client secret in time");
        if let Ok(r) = client.order(bearer, order).send().await {
            if let Ok(v) = r.json::<OrderView>().await {
                if let (Some(pi), Some(secret)) = (&v.payment_intent_id, &v.client_secret) {
                    confirm_payment(
                        http,
                        &cfg.stripe_api_base,
                        &cfg.stripe_publishable_key,
                        pi,
                        secret,
                        "pm_card_visa",
                        &format!("confirm:{order}"),
                    )
                    .send()
                    .await?;
                    return Ok(());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The runbook's synthetic check: a hold in the new region, paid, until a signed webhook has
/// moved its payment forward (`authorized` or later).
async fn synthetic_purchase(
    cfg: &Config,
    http: &reqwest::Client,
    api: &str,
    event: Uuid,
    seats: &[Uuid],
    rng: &mut rand::rngs::StdRng,
) -> anyhow::Result<()> {
    let tokens = boxoffice::runtime::user_tokens(cfg);
    let admission = boxoffice::runtime::admission_tokens(cfg)?;
    let client = BuyerClient::new(http.clone(), api);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        anyhow::ensure!(Instant::now() < deadline, "no synthetic order was authorized within 60 s");
        let user = UserId(Uuid::new_v4());
        let bearer = format!("Bearer {}", tokens.issue(user, 3_600));
        let adm = admission.issue(user, EventId(event), 1, 600).0;
        let seat = seats[rng.gen_range(0..seats.len())];
        let r = client.hold(&bearer, event, &adm, &Uuid::new_v4().to_string(), &[seat]).send().await?;
        if r.status().as_u16() != 202 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let order = r.json::<HoldReceipt>().await?.order_id;
        pay(cfg, http, &client, &bearer, order, Duration::from_secs(20)).await?;
        loop {
            anyhow::ensure!(Instant::now() < deadline, "the synthetic order was not authorized within 60 s");
            let v: OrderView = client.order(&bearer, order).send().await?.json().await?;
            if ["authorized", "confirming", "paid", "ticketed"].contains(&v.status.as_str()) {
                return Ok(());
            }
            anyhow::ensure!(!v.is_final(), "the synthetic order ended {}", v.status);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// One hold at `api`; its status, `None` when the request failed.
async fn attempt_hold(
    cfg: &Config,
    http: &reqwest::Client,
    api: &str,
    event: Uuid,
    seat: Uuid,
) -> Option<u16> {
    let user = UserId(Uuid::new_v4());
    let bearer = format!("Bearer {}", boxoffice::runtime::user_tokens(cfg).issue(user, 3_600));
    let adm = boxoffice::runtime::admission_tokens(cfg).ok()?.issue(user, EventId(event), 1, 600).0;
    let r = BuyerClient::new(http.clone(), api)
        .hold(&bearer, event, &adm, &Uuid::new_v4().to_string(), &[seat])
        .send()
        .await;
    r.ok().map(|r| r.status().as_u16())
}

/// One correctly signed Stripe webhook at `api` (an authorization claim for a PaymentIntent
/// of no order); its status.
async fn attempt_webhook(cfg: &Config, http: &reqwest::Client, api: &str) -> Option<u16> {
    use secrecy::ExposeSecret;
    let now = Utc::now().timestamp();
    let body = serde_json::json!({
        "id": format!("evt_drill_{}", Uuid::new_v4().simple()),
        "object": "event",
        "type": "payment_intent.amount_capturable_updated",
        "created": now,
        "livemode": false,
        "data": { "object": {
            "id": format!("pi_drill_{}", Uuid::new_v4().simple()),
            "object": "payment_intent",
            "status": "requires_capture",
            "amount": 1000, "amount_capturable": 1000, "amount_received": 0,
            "currency": "usd", "metadata": {}
        }}
    })
    .to_string();
    let sig =
        boxoffice_payments::webhook::sign(body.as_bytes(), cfg.stripe_webhook_secret.expose_secret(), now);
    let r = http
        .post(format!("{api}/webhooks/stripe"))
        .header("stripe-signature", sig)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await;
    r.ok().map(|r| r.status().as_u16())
}

/// `reconcile --fix` over the run's PaymentIntents; how many PaymentIntents it acted on.
async fn reconcile(cfg: &Config, pool: &PgPool, since: DateTime<Utc>) -> anyhow::Result<usize> {
    let stripe = boxoffice_payments::StripeClient::new(boxoffice_payments::StripeConfig {
        api_base: cfg.stripe_api_base.clone(),
        secret_key: cfg.stripe_secret_key.clone(),
        timeout_ms: cfg.stripe_timeout_ms,
    })?;
    let window = boxoffice::reconcile::Window { since: since - chrono::Duration::minutes(1), until: None };
    let r = boxoffice::reconcile::run(pool, &stripe, window, true).await?;
    Ok(r.drift.iter().filter(|d| d.fixed).map(|d| d.payment_intent_id.clone()).collect::<HashSet<_>>().len())
}

async fn audit(cfg: &Config, pool: &PgPool, event: EventId, since: DateTime<Utc>, log: &Log) -> Option<i64> {
    let provider = boxoffice_payments::StripeClient::new(boxoffice_payments::StripeConfig {
        api_base: cfg.stripe_api_base.clone(),
        secret_key: cfg.stripe_secret_key.clone(),
        timeout_ms: cfg.stripe_timeout_ms,
    })
    .ok()?;
    let opts = boxoffice::audit::AuditOptions {
        stuck_after_ms: 0,
        event: Some(event.0),
        provider: Ok((
            provider,
            boxoffice::reconcile::Window { since: since - chrono::Duration::minutes(1), until: None },
        )),
        kafka: cfg.kafka().ok_or_else(|| "no broker configured".to_owned()),
        dlq_timeout: Duration::from_secs(30),
    };
    match boxoffice::audit::run(pool, &opts).await {
        Ok(r) => {
            log.note(format!("audit: {} violation(s)", r.total()));
            if r.total() > 0 {
                eprint!("{}", boxoffice::audit::render(&r));
            }
            Some(r.total())
        }
        Err(e) => {
            log.note(format!("the audit could not run: {e:#}"));
            None
        }
    }
}

/// The text report.
pub fn render(r: &FailoverReport) -> String {
    format!(
        "failover drill\n  RPO: {} of {} acknowledged holds lost, {} WAL bytes behind, {:.1} s behind\n  RTO: {:.1} s (fence to the first synthetic order authorized; {} ms waiting for old leases)\n  epochs: {} -> {}\n  old-epoch writes accepted: {} (new primary), {} (zombie, of {} attempts; fenced in its ledger: {})\n  republished {}, duplicates absorbed {}, orphan events {}, missed by the mirror {}\n  PaymentIntents reconciled {}, lost orders compensated {}\n  drained: {}, audit violations: {}\n",
        r.rpo_commits_lost, r.holds_acknowledged, r.rpo_wal_bytes, r.rpo_seconds,
        r.rto_seconds, r.lease_wait_ms, r.old_epoch, r.new_epoch,
        r.old_epoch_writes_accepted, r.zombie_writes_accepted, r.zombie_attempts, r.zombie_fenced_in_its_ledger,
        r.republished, r.duplicates_absorbed, r.orphan_events, r.missed_by_mirror,
        r.pis_reconciled, r.lost_orders_compensated,
        r.drained, r.violations.map_or("not checked".into(), |v| v.to_string()),
    )
}
