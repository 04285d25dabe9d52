//! P3: end-to-end ticketed orders per second. The product runs as one `boxoffice serve`
//! process with every role (here with `admission_direct`), the Stripe simulator and the
//! broker as processes of their own ([`super::procs`]; the broker is the configured one when
//! `kafka_brokers` names one, else a `nisshi` process, else, without nisshi, an in-process
//! mock cluster), so the CPU of the product, of PostgreSQL and of the harness (this process,
//! the simulator, the broker) are measured apart. An open-loop generator
//! sends buyers at stepped arrival rates (the ramp, then the sustained step): each buyer is
//! admitted (`POST /events/{id}/admission`), holds its own seats
//! (`POST /events/{id}/holds`, seats dealt from a shuffled deck so buyers do not collide),
//! waits for its PaymentIntent on its order's event stream (`GET /orders/{id}/events`, polling
//! `GET /orders/{id}` when the stream is refused) and confirms it at the simulator as
//! Stripe.js would (every request through [`boxoffice_harness::client`]); the saga, payment
//! worker and ticket worker take it from there.
//!
//! Before the first arrival it measures the product at rest ([`P3AtRest`]): what its timers
//! cost with no buyer, per second.
//!
//! Every 500 ms a sampler records ticketed orders, the outbox backlog's oldest age and the
//! consumer lag of the saga, payment and ticket groups (committed offsets vs high
//! watermarks on the purchase topic). Hold latencies are kept per second for the chart and
//! for the recommended release rate R.
//!
//! The cost of an order is measured over the sustained step, from its first arrival until
//! every order is final and the outbox is empty, and divided by the orders ticketed in that
//! window: CPU-ms of the product, of PostgreSQL and of the harness
//! ([`super::procs::CpuMsPerOrder`]), and PostgreSQL's transactions, statements, round
//! trips, statement execution time and WAL bytes per order ([`super::procs::PgPerOrder`];
//! statements need `pg_stat_statements`).

use super::{BenchArgs, BenchDb, Deck};
use anyhow::Context;
use boxoffice::config::Config;
use boxoffice::runtime;
use boxoffice_domain::UserId;
use boxoffice_harness::client::{self, Admission, BuyerClient, HoldReceipt, OrderView};
use boxoffice_harness::drain::Drain;
use boxoffice_harness::stats::{self, histogram, percentile, quantiles_ms};
use boxoffice_store::{outbox, venue};
use reqwest::StatusCode;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// Sampling period of the time series.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);

/// One sample of the system's state.
#[derive(Debug, Clone, Serialize)]
pub struct P3Sample {
    /// Seconds since the first arrival.
    pub t_s: f64,
    /// Buyer arrival rate offered at that moment, per second (0 after the last step).
    pub offered_rate: f64,
    /// Holds created so far.
    pub holds: u64,
    /// Orders ticketed so far.
    pub ticketed: i64,
    /// Unpublished outbox rows.
    pub outbox_unpublished: i64,
    /// Age of the oldest unpublished outbox row, ms.
    pub outbox_age_ms: i64,
    /// Largest consumer lag among the saga, payment and ticket groups, messages.
    pub max_lag: i64,
}

/// One second of holds.
#[derive(Debug, Clone, Serialize)]
pub struct P3Second {
    /// Second since the first arrival.
    pub t_s: u64,
    /// Offered arrival rate, per second.
    pub offered_rate: f64,
    /// Holds sent in this second and created.
    pub holds: u64,
    /// p99 latency of those holds, ms.
    pub hold_p99_ms: f64,
}

/// One arrival-rate step.
#[derive(Debug, Clone, Serialize)]
pub struct P3Step {
    /// Offered buyer arrivals per second.
    pub rate: f64,
    /// Start, seconds since the first arrival.
    pub start_s: f64,
    /// Length, seconds.
    pub seconds: f64,
    /// Whether this is the sustained step (the last one).
    pub sustained: bool,
    /// Holds created per second by buyers arriving in this step.
    pub holds_per_s: f64,
    /// Hold latency p50 / p99, ms.
    pub hold_p50_ms: f64,
    /// Hold latency p99, ms.
    pub hold_p99_ms: f64,
    /// Orders ticketed per second during the step's steady part (after its first quarter,
    /// at most 10 s, so the pipeline is full).
    pub ticketed_per_s: f64,
    /// p99 of the sampled outbox ages, ms.
    pub outbox_age_p99_ms: f64,
    /// Largest sampled consumer lag, messages.
    pub max_lag: i64,
    /// Holds and tickets kept up with arrivals: holds/s ≥ 90 % and ticketed/s ≥ 80 % of the
    /// offered rate (ticketing trails holds by the saga's latency).
    pub keeps_up: bool,
    /// Kept up and every figure under its threshold: a candidate for R.
    pub within_thresholds: bool,
}

/// P3's result.
#[derive(Debug, Clone, Serialize)]
pub struct P3Result {
    /// Seats of the venue.
    pub venue_seats: usize,
    /// Buyers started.
    pub buyers: u64,
    /// Holds created.
    pub holds: u64,
    /// PaymentIntents confirmed at the simulator.
    pub confirmed: u64,
    /// Buyers that failed a step (error answers, timeouts).
    pub buyer_errors: u64,
    /// Orders ticketed by the end (after the drain).
    pub ticketed: i64,
    /// Whether every order reached a final state and the outbox emptied before the deadline.
    pub drained: bool,
    /// Seconds from the last arrival to drained.
    pub drain_seconds: f64,
    /// The steps, the sustained one last.
    pub steps: Vec<P3Step>,
    /// Samples every 500 ms.
    pub samples: Vec<P3Sample>,
    /// Per-second holds and hold p99.
    pub seconds: Vec<P3Second>,
    /// p99 of all outbox age samples taken while buyers arrived, ms.
    pub outbox_age_p99_ms: f64,
    /// Largest consumer lag sampled, messages.
    pub max_lag: i64,
    /// The broker used.
    pub broker: String,
    /// Orders ticketed per second in the sustained step's steady part (the figure P3's
    /// target is about); 0 when it ticketed none.
    pub sustained_ticketed_per_s: f64,
    /// Where the CPU went from the sustained step's first arrival until drained.
    pub sustained_cpu: super::procs::ProcessCpu,
    /// Orders ticketed in that window (the divisor of the per-order figures).
    pub sustained_ticketed: i64,
    /// What PostgreSQL did per ticketed order in that window.
    pub postgres_per_order: Option<super::procs::PgPerOrder>,
    /// Whether the bench ran `VACUUM (ANALYZE)` on the purchase tables every 5 s because the server's
    /// autovacuum is off (without fresh statistics the planner keeps the plans it chose for
    /// the empty tables of a fresh database: sequential scans; without vacuum the outbox's
    /// claimed, published and pruned row versions pile up under its indexes).
    pub analyzed_every_5s: bool,
    /// CPU milliseconds per ticketed order of the sustained step (from its first arrival
    /// until drained): the product's role process, PostgreSQL, and the harness (generator,
    /// simulator, broker).
    pub cpu_ms_per_order: Option<super::procs::CpuMsPerOrder>,
    /// `cpu_ms_per_order.harness` by part: the load generator, the Stripe simulator and the
    /// broker (report.json `p3.harness_cpu_ms_per_order`).
    pub harness_cpu_ms_per_order: Option<super::procs::HarnessMsPerOrder>,
    /// The product at rest before the first arrival; None with `--p3-rest-seconds 0`.
    pub at_rest: Option<P3AtRest>,
}

/// The product at rest: every role running and no buyer, measured before P3's first arrival
/// and before the bench's own sampler and `VACUUM (ANALYZE)` start, so the window holds the
/// product's timers alone (the release controller's probes, the relay's and the expiry
/// worker's polls, the consumers' fetches). What an idle deployment costs per second; at
/// `r` ticketed orders per second it adds these figures ÷ `r` to each order's
/// (report.json `p3.at_rest`).
#[derive(Debug, Clone, Serialize)]
pub struct P3AtRest {
    /// Length of the window, seconds (`--p3-rest-seconds`, after 2 s for start-up to settle).
    pub seconds: f64,
    /// CPU-ms per second of the product, PostgreSQL and the harness (the generator, idle
    /// here, the simulator and the broker).
    pub cpu_ms_per_s: super::procs::CpuMsPerSecond,
    /// Share of all cores busy, percent.
    pub machine_busy_pct: f64,
    /// What PostgreSQL did for the bench's database per second.
    pub postgres: super::procs::PgAtRest,
}

/// Time given to a just-started product before the at-rest window opens: its pools' first
/// connections and the consumers' first fetches are start-up, not rest.
const REST_SETTLE: Duration = Duration::from_secs(2);

/// Measures the product at rest for `seconds` (see [`P3AtRest`]).
async fn at_rest(pool: &sqlx::PgPool, pids: &super::procs::Pids, seconds: u64) -> anyhow::Result<P3AtRest> {
    let statements = super::procs::PgCounters::enable(pool).await.is_ok();
    tokio::time::sleep(REST_SETTLE).await;
    let pg_before = super::procs::PgCounters::read(pool, statements).await?;
    let cpu_before = super::procs::CpuMark::now(pids);
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let cpu = cpu_before.until(&super::procs::CpuMark::now(pids));
    let pg_after = super::procs::PgCounters::read(pool, statements).await?;
    Ok(P3AtRest {
        seconds: cpu.seconds,
        cpu_ms_per_s: super::procs::CpuMsPerSecond::of(&cpu),
        machine_busy_pct: cpu.machine_busy_pct,
        postgres: pg_before.at_rest(&pg_after, cpu.seconds),
    })
}

/// The most buyers the run can start: the ramp, then the sustained step at its explicit rate
/// or at most the largest ramp rate.
pub fn max_buyers(args: &BenchArgs) -> usize {
    let ramp: f64 = args.p3_ramp.iter().map(|r| (r * args.p3_step_seconds as f64).ceil()).sum();
    let top = args.p3_ramp.iter().copied().fold(0.0, f64::max);
    let sustained = if args.p3_attempt_rate > 0.0 { args.p3_attempt_rate } else { top };
    (ramp + (sustained * args.p3_seconds as f64).ceil()) as usize
}

/// Runs P3 on a fresh database (dropped afterwards), fresh topics and a fresh Redis prefix.
///
/// `programs.nisshi`: start a broker process (`cfg`'s broker is then not used); else
/// `embedded`, when given, is the in-process broker `cfg` points at; else `cfg` names an
/// external broker.
pub async fn run(
    cfg: &Config,
    args: &BenchArgs,
    programs: &super::procs::Programs,
    embedded: Option<&boxoffice_bus::embedded::EmbeddedBroker>,
) -> anyhow::Result<P3Result> {
    let (db, pool) = BenchDb::migrated(cfg, "p3", 8).await?;
    let result = run_on(cfg, args, programs, embedded, &db, &pool).await;
    pool.close().await;
    db.drop_db().await;
    result
}

/// Shared by the buyer tasks.
struct Ctx {
    client: BuyerClient,
    stripe: String,
    publishable: String,
    event: uuid::Uuid,
    users: boxoffice_admission::UserTokens,
    in_flight: Semaphore,
    started: Instant,
    holds: AtomicU64,
    confirmed: AtomicU64,
    errors: AtomicU64,
    /// Hold latency histograms (µs) by the second the hold was sent.
    per_second: Mutex<Vec<hdrhistogram::Histogram<u64>>>,
}

async fn run_on(
    cfg: &Config,
    args: &BenchArgs,
    programs: &super::procs::Programs,
    embedded: Option<&boxoffice_bus::embedded::EmbeddedBroker>,
    db: &BenchDb,
    pool: &sqlx::PgPool,
) -> anyhow::Result<P3Result> {
    let buyers_total = max_buyers(args);
    let needed = buyers_total * args.p3_seats + 100;
    let (rows, per_row) = (40u32, 50u32);
    let spec = venue::VenueSpec::small((needed as u32).div_ceil(rows * per_row), rows, per_row);
    let name = format!("Bench P3 {}", uuid::Uuid::new_v4());
    let (event, _) =
        venue::seed(pool, &name, &spec, chrono::Utc::now() + chrono::Duration::days(30), &cfg.purchase_cell)
            .await?;
    let deck = Deck::load(pool, event.0).await?;
    eprintln!("   venue: {} seats for {} buyers", deck.len(), buyers_total);

    let mut cfg = cfg.clone();
    super::fresh_topic_prefix(&mut cfg);
    cfg.redis_key_prefix = format!("bench{}:", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    cfg.admission_direct = true;
    cfg.release_max_per_s = 0.0;
    cfg.rate_limit_ip_per_s = 0.0;
    cfg.rate_limit_user_per_s = 0.0;
    cfg.rate_limit_purchase_ip_per_s = 0.0;
    cfg.http_max_in_flight_per_ip = 0;
    cfg.rate_limit_purchase_user_per_s = 0.0;
    cfg.rate_limit_seats_ip_per_s = 0.0;
    cfg.hold_ttl_ms = 600_000;
    // Every buyer streams its order from the same address.
    cfg.order_stream_max_per_ip = cfg.order_stream_max;
    // The simulator sends every webhook from one address, where Stripe uses several.
    cfg.webhook_max_in_flight_per_ip = boxoffice_stripe_sim::MAX_CONCURRENT_DELIVERIES;
    let broker = match (&programs.nisshi, embedded) {
        (Some(_), _) => "nisshi process".to_owned(),
        (None, Some(_)) => "in-process mock cluster (counted in the harness)".to_owned(),
        (None, None) => "external (its CPU counts as other)".to_owned(),
    };
    let dir = args.out.join("p3-processes");
    let db_url = sqlx::ConnectOptions::to_url_lossy(&db.opts).to_string();
    let procs = super::procs::P3Processes::start(&mut cfg, programs, &db_url, embedded, &dir).await?;
    eprintln!("   product, simulator and broker ({broker}) running; logs in {}", dir.display());
    let rest = if args.p3_rest_seconds > 0 {
        eprintln!("   the product at rest for {} s", args.p3_rest_seconds);
        match at_rest(pool, &procs.pids(), args.p3_rest_seconds).await {
            Ok(r) => Some(r),
            Err(e) => {
                procs.stop().await;
                return Err(e.context("measuring the product at rest"));
            }
        }
    } else {
        None
    };
    let outcome = drive(&cfg, args, event.0, deck, procs.api_addr, pool, &procs.pids()).await;
    procs.stop().await;
    if let Err(e) = super::p2::delete_keys(&cfg).await {
        tracing::warn!(error = %format!("{e:#}"), "could not delete the bench's Redis keys");
    }
    outcome.map(|mut r| {
        r.broker = broker;
        r.at_rest = rest;
        r
    })
}

async fn drive(
    cfg: &Config,
    args: &BenchArgs,
    event: uuid::Uuid,
    deck: Deck,
    addr: std::net::SocketAddr,
    pool: &sqlx::PgPool,
    pids: &super::procs::Pids,
) -> anyhow::Result<P3Result> {
    let ctx = Arc::new(Ctx {
        client: BuyerClient::new(
            reqwest::Client::builder()
                .pool_max_idle_per_host(args.p3_max_in_flight)
                .timeout(Duration::from_secs(30))
                .build()?,
            format!("http://{addr}"),
        ),
        stripe: cfg.stripe_api_base.clone(),
        publishable: cfg.stripe_publishable_key.clone(),
        event,
        users: runtime::user_tokens(cfg),
        in_flight: Semaphore::new(args.p3_max_in_flight),
        started: Instant::now(),
        holds: AtomicU64::new(0),
        confirmed: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        per_second: Mutex::new(Vec::new()),
    });
    let lag = boxoffice_workers::release::ConsumerLagProbe::new(
        &cfg.kafka().context("no broker")?,
        &boxoffice_workers::release::LAG_CONSUMERS,
    )?;
    // Steps as run: (rate, start s, seconds).
    let steps_run = Arc::new(Mutex::new(Vec::<(f64, f64, f64)>::new()));
    let rate_at = {
        let steps_run = steps_run.clone();
        move |t: f64| {
            let steps = steps_run.lock().expect("steps lock");
            steps.iter().find(|(_, start, secs)| t >= *start && t < start + secs).map(|s| s.0).unwrap_or(0.0)
        }
    };

    // With autovacuum off nothing refreshes the statistics of the fresh tables or reclaims
    // their dead row versions: the bench does what autovacuum would.
    let autovacuum = super::Autovacuum::start(pool).await;
    let analyze = autovacuum.running();
    if analyze {
        eprintln!(
            "   autovacuum is off on this server: running VACUUM (ANALYZE) on the purchase tables every 5 s"
        );
    }

    // Sampler.
    let samples = Arc::new(Mutex::new(Vec::<P3Sample>::new()));
    let stop_sampling = CancellationToken::new();
    let sampler = {
        let (ctx, samples, stop, pool, rate_at) =
            (ctx.clone(), samples.clone(), stop_sampling.clone(), pool.clone(), rate_at.clone());
        let lag = Arc::new(lag);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(SAMPLE_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !stop.is_cancelled() {
                tokio::select! { _ = stop.cancelled() => break, _ = every.tick() => {} }
                let t_s = ctx.started.elapsed().as_secs_f64();
                let ticketed: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM orders WHERE event_id = $1 AND status = 'ticketed'",
                )
                .bind(ctx.event)
                .fetch_one(&pool)
                .await
                .unwrap_or(-1);
                let backlog = outbox::backlog(&pool).await.unwrap_or_default();
                let l = lag.clone();
                // A group's whole backlog (summed over partitions); -1 when unreadable.
                let max_lag = tokio::task::spawn_blocking(move || l.read(Duration::from_secs(2)))
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .map_or(-1, |l| l.max_group_total);
                samples.lock().expect("samples lock").push(P3Sample {
                    t_s,
                    offered_rate: rate_at(t_s),
                    holds: ctx.holds.load(Ordering::Relaxed),
                    ticketed,
                    outbox_unpublished: backlog.unpublished,
                    outbox_age_ms: backlog.oldest_age_ms,
                    max_lag,
                });
            }
        })
    };

    // The ramp, a drain, then the sustained step (at the largest ramp rate within the
    // thresholds, else the smallest, unless --p3-attempt-rate is given): the drain keeps the
    // ramp's overload out of the sustained step. The ramp stops after the first step that did
    // not keep up: a faster one would only pile more backlog onto the drain.
    let deck = Arc::new(deck);
    let mut stats = Stats::default();
    let mut at = 0.0f64;
    let ramp: Vec<f64> = args.p3_ramp.clone();
    let step_s = args.p3_step_seconds as f64;
    let drain_timeout = Duration::from_secs(if args.quick { 60 } else { 180 });
    let mut plan: Vec<(f64, f64, f64, bool)> = Vec::new();
    let mut ramp_buyers = tokio::task::JoinSet::new();
    for rate in &ramp {
        let planned = (*rate, at, step_s, false);
        at += step_s;
        plan.push(planned);
        steps_run.lock().expect("steps lock").push((planned.0, planned.1, planned.2));
        let (ctx2, deck2, seats) = (ctx.clone(), deck.clone(), args.p3_seats);
        ramp_buyers.spawn(async move { arrivals(&ctx2, &[planned], &deck2, seats).await });
        // At the step's end (plus a second for the last sample), judge it.
        tokio::time::sleep_until((ctx.started + Duration::from_secs_f64(at + 1.0)).into()).await;
        let hists = ctx.per_second.lock().expect("per-second lock").clone();
        let samples_now = samples.lock().expect("samples lock").clone();
        if !step(args, planned.0, planned.1, planned.2, false, &hists, &samples_now).keeps_up {
            eprintln!("   ramp step {:.0}/s fell behind: the ramp stops there", planned.0);
            break;
        }
        // The next step starts where this one ended.
        at = ctx.started.elapsed().as_secs_f64().ceil();
    }
    while let Some(started) = ramp_buyers.join_next().await {
        stats.started += started.unwrap_or(0);
    }
    let ramp_drained = drain(pool, event, drain_timeout).await?;
    let sustained_rate = if args.p3_attempt_rate > 0.0 {
        args.p3_attempt_rate
    } else {
        let hists = ctx.per_second.lock().expect("per-second lock").clone();
        let samples_now = samples.lock().expect("samples lock").clone();
        plan.iter()
            .filter(|(rate, start, secs, _)| {
                step(args, *rate, *start, *secs, false, &hists, &samples_now).within_thresholds
            })
            .map(|p| p.0)
            .fold(ramp.iter().copied().fold(f64::INFINITY, f64::min), f64::max)
    };
    let start = ctx.started.elapsed().as_secs_f64().ceil() + 1.0;
    let sustained = (sustained_rate, start, args.p3_seconds as f64, true);
    steps_run.lock().expect("steps lock").push((sustained.0, sustained.1, sustained.2));
    plan.push(sustained);
    eprintln!("   sustained step: {sustained_rate:.0} arrivals/s for {} s", args.p3_seconds);
    let statements = match super::procs::PgCounters::enable(pool).await {
        Ok(()) => true,
        Err(why) => {
            eprintln!("   no statement counts: {why}");
            false
        }
    };
    let ticketed_before = ticketed_count(pool, event).await?;
    let pg_before = super::procs::PgCounters::read(pool, statements).await?;
    let cpu_before = super::procs::CpuMark::now(pids);
    stats.started += arrivals(&ctx, &plan[plan.len() - 1..], &deck, args.p3_seats).await;
    let arrivals_done = Instant::now();
    // Drained even when the ramp was not: the window ends when the sustained step's orders do.
    let drained = drain(pool, event, drain_timeout).await? && ramp_drained;
    let sustained_cpu = cpu_before.until(&super::procs::CpuMark::now(pids));
    let pg_after = super::procs::PgCounters::read(pool, statements).await?;
    let sustained_ticketed = ticketed_count(pool, event).await? - ticketed_before;
    let drain_seconds = arrivals_done.elapsed().as_secs_f64();
    let plan_end = start + args.p3_seconds as f64;
    let started_buyers = stats.started;
    stop_sampling.cancel();
    let _ = sampler.await;
    autovacuum.stop().await;
    let ticketed = ticketed_count(pool, event).await?;

    let samples = samples.lock().expect("samples lock").clone();
    let hists = ctx.per_second.lock().expect("per-second lock").clone();
    let seconds: Vec<P3Second> = hists
        .iter()
        .enumerate()
        .map(|(t, h)| P3Second {
            t_s: t as u64,
            offered_rate: rate_at(t as f64 + 0.5),
            holds: h.len(),
            hold_p99_ms: quantiles_ms(h).1,
        })
        .collect();
    let steps: Vec<P3Step> = plan
        .iter()
        .map(|(rate, start, secs, sus)| step(args, *rate, *start, *secs, *sus, &hists, &samples))
        .collect();
    let during: Vec<f64> = samples
        .iter()
        .filter(|s| rate_at(s.t_s) > 0.0 && s.t_s <= plan_end)
        .map(|s| s.outbox_age_ms as f64)
        .collect();
    Ok(P3Result {
        venue_seats: deck.len(),
        buyers: started_buyers,
        holds: ctx.holds.load(Ordering::Relaxed),
        confirmed: ctx.confirmed.load(Ordering::Relaxed),
        buyer_errors: ctx.errors.load(Ordering::Relaxed),
        ticketed,
        drained,
        drain_seconds,
        outbox_age_p99_ms: percentile(&during, 0.99),
        max_lag: samples.iter().map(|s| s.max_lag).max().unwrap_or(0),
        samples,
        seconds,
        broker: String::new(),
        analyzed_every_5s: analyze,
        sustained_ticketed_per_s: steps.iter().find(|s| s.sustained).map_or(0.0, |s| s.ticketed_per_s),
        cpu_ms_per_order: super::procs::CpuMsPerOrder::of(&sustained_cpu, sustained_ticketed),
        harness_cpu_ms_per_order: super::procs::HarnessMsPerOrder::of(&sustained_cpu, sustained_ticketed),
        at_rest: None,
        postgres_per_order: pg_before.per_order(&pg_after, sustained_ticketed),
        sustained_ticketed,
        sustained_cpu,
        steps,
    })
}

fn step(
    args: &BenchArgs,
    rate: f64,
    start: f64,
    secs: f64,
    sustained: bool,
    hists: &[hdrhistogram::Histogram<u64>],
    samples: &[P3Sample],
) -> P3Step {
    let mut h = histogram();
    let (from, to) = (start.floor() as usize, (start + secs).ceil() as usize);
    for sec in hists.iter().take(to).skip(from) {
        let _ = h.add(sec);
    }
    let holds_per_s = h.len() as f64 / secs;
    let (p50, p99, _) = quantiles_ms(&h);
    let in_step: Vec<&P3Sample> =
        samples.iter().filter(|s| s.t_s >= start && s.t_s <= start + secs).collect();
    let warm = start + (secs / 4.0).min(10.0);
    let steady: Vec<&&P3Sample> = in_step.iter().filter(|s| s.t_s >= warm && s.ticketed >= 0).collect();
    let ticketed_per_s = match (steady.first(), steady.last()) {
        (Some(a), Some(b)) if b.t_s > a.t_s => (b.ticketed - a.ticketed) as f64 / (b.t_s - a.t_s),
        _ => 0.0,
    };
    let ages: Vec<f64> = in_step.iter().map(|s| s.outbox_age_ms as f64).collect();
    let outbox_age_p99_ms = percentile(&ages, 0.99);
    let max_lag = in_step.iter().map(|s| s.max_lag).max().unwrap_or(0);
    let keeps_up = holds_per_s >= 0.9 * rate && ticketed_per_s >= 0.8 * rate;
    let within_thresholds = keeps_up
        && p99 <= args.max_hold_p99_ms
        && outbox_age_p99_ms <= args.max_outbox_age_ms
        && max_lag <= args.max_lag;
    P3Step {
        rate,
        start_s: start,
        seconds: secs,
        sustained,
        holds_per_s,
        hold_p50_ms: p50,
        hold_p99_ms: p99,
        ticketed_per_s,
        outbox_age_p99_ms,
        max_lag,
        keeps_up,
        within_thresholds,
    }
}

#[derive(Default)]
struct Stats {
    started: u64,
}

/// Starts the buyers of `steps` (rate, start s, seconds, _) at their open-loop arrival times,
/// each with its own seats, and waits for all of them; returns how many started.
async fn arrivals(ctx: &Arc<Ctx>, steps: &[(f64, f64, f64, bool)], deck: &Deck, seats_each: usize) -> u64 {
    let mut buyers = tokio::task::JoinSet::new();
    let mut started = 0;
    for (rate, start, secs, _) in steps {
        let n = (rate * secs).ceil() as usize;
        for i in 0..n {
            let when = ctx.started + Duration::from_secs_f64(start + i as f64 / rate);
            let Some(seats) = deck.deal(seats_each) else { break };
            let ctx = ctx.clone();
            started += 1;
            buyers.spawn(async move {
                tokio::time::sleep_until(when.into()).await;
                if buyer(&ctx, seats).await.is_none() {
                    ctx.errors.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    }
    while buyers.join_next().await.is_some() {}
    started
}

/// One buyer's journey up to its confirmed payment; None on any unexpected answer.
async fn buyer(ctx: &Ctx, seats: Vec<uuid::Uuid>) -> Option<()> {
    let bearer = format!("Bearer {}", ctx.users.issue(UserId(uuid::Uuid::new_v4()), 3_600));
    let (s, body) = send(ctx, ctx.client.admit(&bearer, ctx.event)).await?;
    if s != StatusCode::CREATED {
        return None;
    }
    let admission: Admission = serde_json::from_slice(&body).ok()?;
    let key = uuid::Uuid::new_v4().to_string();
    let permit = ctx.in_flight.acquire().await.ok()?;
    let sent = Instant::now();
    let r =
        ctx.client.hold(&bearer, ctx.event, &admission.admission_token, &key, &seats).send().await.ok()?;
    let status = r.status();
    let bytes = r.bytes().await.ok()?;
    let took = sent.elapsed();
    drop(permit);
    if status != StatusCode::ACCEPTED {
        return None;
    }
    let second = (sent - ctx.started).as_secs() as usize;
    {
        let mut per = ctx.per_second.lock().expect("per-second lock");
        while per.len() <= second {
            per.push(histogram());
        }
        stats::record(&mut per[second], took);
    }
    ctx.holds.fetch_add(1, Ordering::Relaxed);
    let receipt: HoldReceipt = serde_json::from_slice(&bytes).ok()?;

    // Wait for the PaymentIntent the saga asks the payment worker to create.
    let (pi, secret) = match stream_payment_intent(ctx, &bearer, receipt.order_id).await {
        Waited::Ready(pi, secret) => (pi, secret),
        Waited::Gone => return None,
        Waited::NoStream => poll_payment_intent(ctx, &bearer, receipt.order_id).await?,
    };
    let confirm = client::confirm_payment(
        &ctx.client.http,
        &ctx.stripe,
        &ctx.publishable,
        &pi,
        &secret,
        "pm_card_visa",
        &format!("confirm:{}", receipt.order_id),
    );
    let (s, _) = send(ctx, confirm).await?;
    if s != StatusCode::OK {
        return None;
    }
    ctx.confirmed.fetch_add(1, Ordering::Relaxed);
    Some(())
}

/// How waiting for the PaymentIntent on the order's event stream ended.
enum Waited {
    /// The PaymentIntent and its client secret.
    Ready(String, String),
    /// The order reached a final state first.
    Gone,
    /// The stream was refused or broke: poll instead.
    NoStream,
}

/// Reads `GET /orders/{id}/events` until the order carries its PaymentIntent's client secret
/// (pushed when the PaymentIntent's fact is published), as the onsale's buyers do.
async fn stream_payment_intent(ctx: &Ctx, bearer: &str, order: uuid::Uuid) -> Waited {
    let Ok(_permit) = ctx.in_flight.acquire().await else { return Waited::NoStream };
    let Ok(mut resp) = ctx.client.order_events(&ctx.client.http, bearer, order).send().await else {
        return Waited::NoStream;
    };
    if resp.status() != StatusCode::OK {
        return Waited::NoStream;
    }
    let mut buf = String::new();
    while let Ok(Some(bytes)) = resp.chunk().await {
        buf.push_str(&String::from_utf8_lossy(&bytes));
        for ev in client::take_sse_events(&mut buf) {
            if ev.event != "order" {
                continue;
            }
            let Ok(v) = serde_json::from_str::<OrderView>(&ev.data) else { return Waited::NoStream };
            if v.is_final() {
                return Waited::Gone;
            }
            if let (Some(pi), Some(secret)) = (v.payment_intent_id, v.client_secret) {
                return Waited::Ready(pi, secret);
            }
        }
    }
    Waited::NoStream
}

/// Polls `GET /orders/{id}` (200 ms, backing off ×1.5 to 1 s) until the order carries its
/// PaymentIntent's client secret; None when it ends first or after 120 s.
async fn poll_payment_intent(ctx: &Ctx, bearer: &str, order: uuid::Uuid) -> Option<(String, String)> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut wait = Duration::from_millis(200);
    loop {
        tokio::time::sleep(wait).await;
        wait = (wait * 3 / 2).min(Duration::from_secs(1));
        let (s, body) = send(ctx, ctx.client.order(bearer, order)).await?;
        if s == StatusCode::OK {
            let v: OrderView = serde_json::from_slice(&body).ok()?;
            if v.is_final() {
                return None;
            }
            if let (Some(pi), Some(secret)) = (v.payment_intent_id, v.client_secret) {
                return Some((pi, secret));
            }
        }
        if Instant::now() >= deadline {
            return None;
        }
    }
}

/// Sends under an in-flight permit and reads the body.
async fn send(ctx: &Ctx, req: reqwest::RequestBuilder) -> Option<(StatusCode, Vec<u8>)> {
    let _permit = ctx.in_flight.acquire().await.ok()?;
    let r = req.send().await.ok()?;
    let s = r.status();
    Some((s, r.bytes().await.ok()?.to_vec()))
}

/// Waits for every order of `event` to be final, its cancels recorded and the
/// outbox empty; `false` at `timeout`.
async fn drain(pool: &sqlx::PgPool, event: uuid::Uuid, timeout: Duration) -> anyhow::Result<bool> {
    let drained = Drain::orders_of(event, timeout).run(pool).await?;
    if !drained.done {
        eprintln!("{drained}");
    }
    Ok(drained.done)
}

/// Orders of `event` ticketed so far.
async fn ticketed_count(pool: &sqlx::PgPool, event: uuid::Uuid) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM orders WHERE event_id = $1 AND status = 'ticketed'")
        .bind(event)
        .fetch_one(pool)
        .await
}
