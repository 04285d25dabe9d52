//! `boxoffice-drills bench`: the capacity measurements of design §12 in one run on one machine,
//! written to `report.json`, `report.md` and `chart.png` in the output directory.
//!
//! - P1 ([`p1`]): the hold transaction (the same `holds::reserve` the API's
//!   `POST /events/{id}/holds` runs) from N concurrent tasks per concurrency level, next to
//!   pgbench's TPC-B tps on the same PostgreSQL (the physical-limit anchor), then the
//!   zero-oversell check (invariant 1: one active hold / one ticket per seat).
//! - P2 ([`p2`]): waiting-room join + poll through the HTTP API (and the library calls
//!   directly, to show which layer bounds it).
//! - P3 ([`p3`]): end-to-end ticketed orders per second with every role in one
//!   `boxoffice serve` process and the simulator and broker in processes of their own
//!   ([`procs`]), at stepped buyer arrival rates, with outbox age and consumer lag sampled
//!   every 500 ms, and the CPU-ms, transactions, statements and round trips per ticketed order.
//! - P4 ([`p4`]): relay publish throughput (outbox rows → broker).
//!
//! Owns its databases: each phase that writes gets a fresh database named
//! `boxoffice_bench_*` next to `database_url`'s, dropped at the end, so a bench never touches
//! a deployment's ledger; Redis keys use a unique prefix and are deleted afterwards; Kafka
//! topics use a unique prefix (P3 on a `nisshi` process, P4 on an embedded broker, unless
//! `BOXOFFICE_KAFKA_BROKERS` or `--kafka-brokers` names one). The recommended release rate R (design §3, §12) is the
//! largest P3 arrival rate whose hold p99, outbox age p99 and consumer lag stay under the
//! thresholds while the system keeps up (see [`report::recommend`]).

pub mod p1;
pub mod p2;
pub mod p3;
pub mod p4;
pub mod procs;
pub mod report;

use anyhow::Context;
use boxoffice::config::Config;
use boxoffice_harness::deploy;
use rand::seq::SliceRandom;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgPool};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Options of `boxoffice-drills bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// The configuration file the bench was given (`--config` / `BOXOFFICE_CONFIG`), set by
    /// the caller: P3's product and simulator processes are started with the same file.
    #[arg(skip)]
    pub config_file: Option<PathBuf>,
    /// Directory for report.json, report.md and chart.png.
    #[arg(long, default_value = "bench-report")]
    pub out: PathBuf,
    /// Phases to run, comma-separated: p1, p2, p3, p4.
    #[arg(long, value_delimiter = ',', default_value = "p1,p2,p3,p4")]
    pub phases: Vec<Phase>,
    /// P1 concurrency levels (concurrent hold transactions; pgbench clients).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    pub p1_concurrency: Vec<usize>,
    /// Seconds per P1 level (holds, then pgbench, each this long).
    #[arg(long, default_value_t = 8)]
    pub p1_seconds: u64,
    /// Share of P1 hold attempts that ask for a seat already dealt out (they should get 409).
    #[arg(long, default_value_t = 0.05)]
    pub p1_conflict_share: f64,
    /// `off` drops the region fence's triggers in P1's throwaway database, to measure what the
    /// epoch check costs the hold transaction (compare with a run at `on`, the default). The
    /// hold's own shared take of the fence's lock, in its first statement, stays.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub p1_region_fence: String,
    /// pgbench scale factor (`pgbench -i -s`).
    #[arg(long, default_value_t = 10)]
    pub pgbench_scale: u32,
    /// P2 concurrency levels (concurrent simulated clients, each joining then polling).
    #[arg(long, value_delimiter = ',', default_value = "4,16,64")]
    pub p2_concurrency: Vec<usize>,
    /// Seconds per P2 level.
    #[arg(long, default_value_t = 8)]
    pub p2_seconds: u64,
    /// P3 ramp: buyer arrival rates (per second) tried for `--p3-step-seconds` each before
    /// the sustained step, stopping after the first step that does not keep up.
    #[arg(long, value_delimiter = ',', default_value = "50,100,150,200,250,300")]
    pub p3_ramp: Vec<f64>,
    /// Seconds per P3 ramp step.
    #[arg(long, default_value_t = 10)]
    pub p3_step_seconds: u64,
    /// P3 sustained buyer arrival rate, per second; 0 (default) picks the largest ramp rate
    /// within the thresholds (R), else the smallest ramp rate. The sustained step starts
    /// after the ramp has drained.
    #[arg(long, default_value_t = 0.0)]
    pub p3_attempt_rate: f64,
    /// Seconds of the sustained P3 step.
    #[arg(long, default_value_t = 60)]
    pub p3_seconds: u64,
    /// Seats per P3 buyer.
    #[arg(long, default_value_t = 2)]
    pub p3_seats: usize,
    /// Seconds P3 measures the product at rest (every role running, no buyer) before its
    /// first arrival (report.json `p3.at_rest`); 0 skips it.
    #[arg(long, default_value_t = 20)]
    pub p3_rest_seconds: u64,
    /// Concurrent HTTP requests the P3 generator keeps in flight at most.
    #[arg(long, default_value_t = 512)]
    pub p3_max_in_flight: usize,
    /// Outbox rows P4 fills and the relay drains.
    #[arg(long, default_value_t = 200_000)]
    pub p4_events: usize,
    /// Threshold for R: hold latency p99, ms.
    #[arg(long, default_value_t = 250.0)]
    pub max_hold_p99_ms: f64,
    /// Threshold for R: outbox age p99, ms.
    #[arg(long, default_value_t = 1_000.0)]
    pub max_outbox_age_ms: f64,
    /// Threshold for R: largest consumer lag, messages (summed over partitions of a group).
    #[arg(long, default_value_t = 5_000)]
    pub max_lag: i64,
    /// Kafka bootstrap servers (default: BOXOFFICE_KAFKA_BROKERS, else P3 starts a nisshi
    /// process and P4 an embedded broker).
    #[arg(long)]
    pub kafka_brokers: Option<String>,
    /// The product binary P3 runs (`boxoffice serve`); default: `boxoffice` next to this
    /// binary.
    #[arg(long, env = "BOXOFFICE_BIN")]
    pub boxoffice_bin: Option<PathBuf>,
    /// The drills binary P3 runs the Stripe simulator with; default: this binary.
    #[arg(long, env = "BOXOFFICE_DRILLS_BIN")]
    pub drills_bin: Option<PathBuf>,
    /// The nisshi broker P3 starts when no broker is configured; default: `nisshi` on PATH,
    /// else `~/.cargo/bin/nisshi`; without one P3 uses an in-process mock cluster.
    #[arg(long, env = "BOXOFFICE_NISSHI_BIN")]
    pub nisshi: Option<PathBuf>,
    /// Busy processes outside boxoffice for the whole bench (a reproducible noisy neighbour,
    /// each spinning one CPU; recorded in the report).
    #[arg(long, default_value_t = 0)]
    pub steal_cpu: usize,
    /// Short durations and small sizes: a smoke test of the whole bench (numbers meaningless).
    /// Replaces the levels, ramp, durations and sizes given by the other options.
    #[arg(long)]
    pub quick: bool,
}

/// A bench phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Hold transactions vs pgbench.
    P1,
    /// Waiting room join + poll.
    P2,
    /// End-to-end ticketed orders.
    P3,
    /// Relay publish.
    P4,
}

impl std::str::FromStr for Phase {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "p1" => Ok(Phase::P1),
            "p2" => Ok(Phase::P2),
            "p3" => Ok(Phase::P3),
            "p4" => Ok(Phase::P4),
            other => Err(format!("unknown phase {other:?} (p1, p2, p3, p4)")),
        }
    }
}

impl BenchArgs {
    /// The documented defaults (what `boxoffice-drills bench` runs without flags).
    pub fn defaults() -> Self {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            args: BenchArgs,
        }
        Wrap::parse_from(["bench"]).args
    }

    /// Applies `--quick`: every phase in seconds, with tiny sizes.
    pub fn resolved(mut self) -> Self {
        if self.quick {
            self.p1_concurrency = vec![1, 4];
            self.p1_seconds = 1;
            self.pgbench_scale = 1;
            self.p2_concurrency = vec![8];
            self.p2_seconds = 1;
            self.p3_ramp = vec![10.0];
            self.p3_step_seconds = 2;
            self.p3_attempt_rate = 20.0;
            self.p3_seconds = 3;
            self.p3_rest_seconds = 2;
            self.p3_max_in_flight = 64;
            self.p4_events = 2_000;
        }
        self
    }

    /// The programs P3 starts; `broker_configured`: a broker is named, so no nisshi.
    pub fn programs(&self, broker_configured: bool) -> anyhow::Result<procs::Programs> {
        let exe = std::env::current_exe().context("locating this binary")?;
        Ok(procs::Programs {
            config: self.config_file.clone(),
            boxoffice: crate::chaos::find_boxoffice(self.boxoffice_bin.as_deref(), &exe)?,
            drills: self.drills_bin.clone().unwrap_or(exe),
            nisshi: match (broker_configured, &self.nisshi) {
                (true, _) => None,
                // Named: it must exist.
                (false, Some(given)) => Some(crate::chaos::find_nisshi(Some(given))?),
                (false, None) => crate::chaos::find_nisshi(None).ok(),
            },
        })
    }

    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(!self.phases.is_empty(), "--phases is empty");
        anyhow::ensure!(
            !self.p1_concurrency.is_empty() && self.p1_concurrency.iter().all(|c| (1..=90).contains(c)),
            "--p1-concurrency levels must be 1..=90 (PostgreSQL's max_connections bounds them)"
        );
        anyhow::ensure!(self.p2_concurrency.iter().all(|c| *c >= 1), "--p2-concurrency levels must be ≥ 1");
        anyhow::ensure!(
            !self.p3_ramp.is_empty()
                && self.p3_ramp.iter().all(|r| r.is_finite() && *r > 0.0)
                && self.p3_attempt_rate.is_finite()
                && self.p3_attempt_rate >= 0.0,
            "--p3-ramp rates must be positive and --p3-attempt-rate ≥ 0"
        );
        anyhow::ensure!((1..=8).contains(&self.p3_seats), "--p3-seats must be 1..=8");
        anyhow::ensure!((0.0..=1.0).contains(&self.p1_conflict_share), "--p1-conflict-share must be 0..=1");
        anyhow::ensure!(
            self.p1_seconds >= 1 && self.p2_seconds >= 1 && self.p3_seconds >= 1,
            "durations ≥ 1 s"
        );
        Ok(())
    }
}

/// A database created for the bench and dropped by [`BenchDb::drop_db`].
pub struct BenchDb {
    /// Its name.
    pub name: String,
    /// Connect options pointing at it.
    pub opts: PgConnectOptions,
    admin: PgConnectOptions,
}

impl BenchDb {
    /// Creates `boxoffice_bench_{tag}_{random}` on the server of `cfg.database_url`.
    pub async fn create(cfg: &Config, tag: &str) -> anyhow::Result<Self> {
        let base = cfg.pg_options()?;
        let admin = base.clone().database("postgres");
        let name = format!("boxoffice_bench_{tag}_{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let mut conn = admin.connect().await.context("connecting to PostgreSQL")?;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .context("creating the bench database")?;
        Ok(Self { opts: base.database(&name), name, admin })
    }

    /// Creates the database and applies every migration; returns it and a pool of `max`.
    pub async fn migrated(cfg: &Config, tag: &str, max: u32) -> anyhow::Result<(Self, PgPool)> {
        let db = Self::create(cfg, tag).await?;
        let pool = boxoffice_store::connect(db.opts.clone(), max, 30_000).await?;
        boxoffice_store::MIGRATOR.run(&pool).await.context("applying migrations")?;
        Ok((db, pool))
    }

    /// Drops the database (closing other sessions first).
    pub async fn drop_db(self) {
        let r = async {
            let mut conn = self.admin.connect().await?;
            sqlx::query(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name))
                .execute(&mut conn)
                .await
        }
        .await;
        if let Err(e) = r {
            tracing::warn!(db = %self.name, error = %e, "could not drop the bench database");
        }
    }
}

/// The tables the purchase path writes, every one of them, which the bench keeps vacuumed and
/// analyzed when the server's autovacuum is off ([`Autovacuum`]): a table left out keeps the
/// plans each session made for it when it was empty, as no deployment does.
pub const PURCHASE_TABLES: &[&str] = &[
    "orders",
    "holds",
    "hold_seats",
    "payments",
    "tickets",
    "outbox",
    "inbox",
    "idempotency_keys",
    "stripe_events",
    "payment_intent_refetches",
    "payment_intent_follow_ups",
    "order_refetch_budget",
    "capture_claims",
    "order_transitions",
    "order_history",
    "incidents",
];

/// What autovacuum would do for the bench's database while a phase runs, on a server whose
/// autovacuum is off: `VACUUM (ANALYZE)` of [`PURCHASE_TABLES`] every 5 s, in a task of its
/// own. Without it the planner keeps the plans it chose for the empty tables of a fresh
/// database (sequential scans, or index choices for no rows) while they grow, and dead row
/// versions pile up under the indexes: the phase would measure a database no deployment runs.
pub struct Autovacuum {
    stop: tokio_util::sync::CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Autovacuum {
    /// Starts the emulation when the server's autovacuum is off; does nothing otherwise.
    pub async fn start(pool: &sqlx::PgPool) -> Self {
        let stop = tokio_util::sync::CancellationToken::new();
        if autovacuum_on(pool).await {
            return Self { stop, task: None };
        }
        let (pool, token) = (pool.clone(), stop.clone());
        let task = tokio::spawn(async move {
            loop {
                tokio::select! { _ = token.cancelled() => break, _ = tokio::time::sleep(std::time::Duration::from_secs(5)) => {} }
                if let Err(e) = sqlx::query(&format!("VACUUM (ANALYZE) {}", PURCHASE_TABLES.join(", ")))
                    .execute(&pool)
                    .await
                {
                    tracing::warn!(error = %e, "VACUUM (ANALYZE) failed");
                }
            }
        });
        Self { stop, task: Some(task) }
    }

    /// Whether the emulation runs (the server's autovacuum is off).
    pub fn running(&self) -> bool {
        self.task.is_some()
    }

    /// Stops the emulation, after the pass in progress.
    pub async fn stop(self) {
        self.stop.cancel();
        if let Some(t) = self.task {
            let _ = t.await;
        }
    }
}

/// Whether the server runs autovacuum (and with it the automatic ANALYZE).
pub async fn autovacuum_on(pool: &sqlx::PgPool) -> bool {
    sqlx::query_scalar::<_, String>("SHOW autovacuum")
        .fetch_one(pool)
        .await
        .map(|v| v == "on")
        .unwrap_or(true)
}

/// `boxoffice-drills bench`: runs the phases, writes the report files, prints the Markdown table.
/// Returns the exit code: 0, or 1 when P1 found oversold seats.
pub async fn run(cfg: Config, args: BenchArgs) -> anyhow::Result<i32> {
    let args = args.resolved();
    let report = run_phases(cfg, &args).await?;
    let files = report::write(&report, &args.out)?;
    println!("{}", report::markdown(&report));
    for f in files {
        eprintln!("wrote {}", f.display());
    }
    Ok(if report.p1.as_ref().is_some_and(|p| p.oversold_seats != 0) { 1 } else { 0 })
}

/// Runs the selected phases and returns the report (nothing written).
pub async fn run_phases(mut cfg: Config, args: &BenchArgs) -> anyhow::Result<report::Report> {
    args.validate()?;
    if let Some(b) = &args.kafka_brokers {
        cfg.kafka_brokers = Some(b.clone());
    }
    let p3 = args.phases.contains(&Phase::P3);
    let programs = if p3 { Some(args.programs(cfg.kafka_brokers.is_some())?) } else { None };
    let p3_nisshi = programs.as_ref().is_some_and(|p| p.nisshi.is_some());
    let embedded = if args.phases.contains(&Phase::P4) || (p3 && !p3_nisshi) {
        deploy::embedded_broker_unless_configured(&mut cfg)?
    } else {
        None
    };
    let broker_kind = match (p3_nisshi, embedded.is_some()) {
        (true, true) => "P3: a nisshi process; P4: embedded (librdkafka mock cluster)",
        (true, false) if cfg.kafka_brokers.is_none() => "P3: a nisshi process",
        (false, true) => "embedded (librdkafka mock cluster)",
        _ => "external",
    };
    let stealers = boxoffice_harness::noise::CpuStealers::start(args.steal_cpu)?;
    if !stealers.is_empty() {
        eprintln!("{} busy process(es) stealing CPU for the whole bench", stealers.len());
    }
    let mut report = report::Report::new(&cfg, args, broker_kind).await;
    find_postmaster(&cfg).await;
    let step = |name: &str| eprintln!("== {name}");
    if args.phases.contains(&Phase::P1) {
        step("P1: hold transactions vs pgbench TPC-B");
        report.p1 = Some(p1::run(&cfg, args).await?);
    }
    if args.phases.contains(&Phase::P2) {
        step("P2: waiting room join + poll");
        report.p2 = Some(p2::run(&cfg, args).await?);
    }
    if args.phases.contains(&Phase::P3) {
        step("P3: end-to-end ticketed orders");
        let programs = programs.as_ref().context("P3's programs")?;
        let embedded = if programs.nisshi.is_some() { None } else { embedded.as_ref() };
        report.p3 = Some(p3::run(&cfg, args, programs, embedded).await?);
    }
    if args.phases.contains(&Phase::P4) {
        step("P4: relay publish");
        report.p4 = Some(p4::run(&cfg, args, embedded.as_ref()).await?);
    }
    drop(stealers);
    report.finish(args);
    Ok(report)
}

/// A new unique Kafka topic prefix for one phase (its topics are created by whoever starts
/// the roles).
pub(crate) fn fresh_topic_prefix(cfg: &mut Config) {
    cfg.kafka_topic_prefix = format!("bench{}.", &uuid::Uuid::new_v4().simple().to_string()[..8]);
}

/// An event's seats in random order, each dealt out once (so the bench's holds do not collide
/// by accident).
pub(crate) struct Deck {
    seats: Vec<uuid::Uuid>,
    next: AtomicUsize,
}

impl Deck {
    /// Every seat of `event`, shuffled.
    pub(crate) async fn load(pool: &PgPool, event: uuid::Uuid) -> Result<Self, sqlx::Error> {
        let mut seats: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM seats WHERE event_id = $1")
            .bind(event)
            .fetch_all(pool)
            .await?;
        seats.shuffle(&mut rand::thread_rng());
        Ok(Self { seats, next: AtomicUsize::new(0) })
    }

    /// How many seats the deck holds.
    pub(crate) fn len(&self) -> usize {
        self.seats.len()
    }

    /// `n` fresh seats, or None when the deck is spent.
    pub(crate) fn deal(&self, n: usize) -> Option<Vec<uuid::Uuid>> {
        let at = self.next.fetch_add(n, Ordering::Relaxed);
        self.seats.get(at..at + n).map(<[_]>::to_vec)
    }

    /// A seat dealt out before (for a deliberate conflict).
    pub(crate) fn dealt(&self, rng: &mut impl rand::Rng) -> Option<uuid::Uuid> {
        let upto = self.next.load(Ordering::Relaxed).min(self.seats.len());
        (upto > 0).then(|| self.seats[rng.gen_range(0..upto)])
    }

    /// Whether fewer than `n` seats are left.
    pub(crate) fn exhausted(&self, n: usize) -> bool {
        self.next.load(Ordering::Relaxed) + n > self.seats.len()
    }
}

/// Where the CPU went during a measured window (Linux `/proc`; zeros elsewhere): the basis
/// of "what bounds it" when a target is missed.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct CpuUse {
    /// Window length, seconds.
    pub seconds: f64,
    /// Share of all cores busy (not idle or waiting for IO), percent.
    pub machine_busy_pct: f64,
    /// Cores used by this process (the bench's generator and every in-process role) and by
    /// the children it waited for in the window (pgbench in P1).
    pub boxoffice_cores: f64,
    /// Cores used by the bench's PostgreSQL server (its postmaster and every process of it,
    /// backends that exited in the window included; every process named `postgres` when the
    /// server's postmaster is not on this machine).
    pub postgres_cores: f64,
    /// Cores used by everything else (Redis, a broker, other work on the machine).
    pub other_cores: f64,
}

/// CPU counters at one instant, in clock ticks (USER_HZ, 100 per second on Linux).
#[derive(Debug, Clone, Copy)]
pub(crate) struct CpuSnap {
    at: std::time::Instant,
    own: u64,
    postgres: u64,
    busy: u64,
}

const TICKS_PER_S: f64 = 100.0;

impl CpuSnap {
    /// Reads the counters now.
    pub(crate) fn now() -> Self {
        let mut postgres = 0;
        let postmaster = POSTMASTER.get().copied();
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for e in dir.flatten() {
                let name = e.file_name();
                let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
                    continue;
                };
                // A backend that exits (a closed connection, pgbench's) leaves its ticks to the
                // postmaster's children's count once it is waited for.
                if let Some(p) = proc_stat(&format!("/proc/{pid}/stat")) {
                    let counts = match postmaster {
                        Some(pm) => pid == pm || p.ppid == pm,
                        None => p.comm == "postgres",
                    };
                    if counts {
                        postgres += p.own + p.children;
                    }
                }
            }
        }
        let busy = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| {
                let v: Vec<u64> =
                    s.lines().next()?.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
                // user nice system idle iowait irq softirq steal
                let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
                Some(v.iter().take(8).sum::<u64>() - idle)
            })
            .unwrap_or(0);
        Self {
            at: std::time::Instant::now(),
            // With the children this process waited for (pgbench in P1).
            own: proc_stat("/proc/self/stat").map(|p| p.own + p.children).unwrap_or(0),
            postgres,
            busy,
        }
    }

    /// The use between `self` (earlier) and `later`.
    pub(crate) fn until(&self, later: &CpuSnap) -> CpuUse {
        let seconds = (later.at - self.at).as_secs_f64().max(1e-3);
        let cores = |a: u64, b: u64| b.saturating_sub(a) as f64 / TICKS_PER_S / seconds;
        let busy = cores(self.busy, later.busy);
        let own = cores(self.own, later.own);
        let pg = cores(self.postgres, later.postgres);
        let n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64;
        CpuUse {
            seconds,
            machine_busy_pct: 100.0 * busy / n,
            boxoffice_cores: own,
            postgres_cores: pg,
            other_cores: (busy - own - pg).max(0.0),
        }
    }
}

/// `(comm, utime + stime)` of a `/proc/<pid>/stat` file.
fn proc_ticks(path: &str) -> Option<(String, u64)> {
    proc_stat(path).map(|p| (p.comm, p.own))
}

/// What `/proc/<pid>/stat` says of a process.
struct ProcStat {
    comm: String,
    /// Parent process id.
    ppid: u32,
    /// Its own ticks: utime + stime.
    own: u64,
    /// Its children's that exited and were waited for: cutime + cstime.
    children: u64,
}

fn proc_stat(path: &str) -> Option<ProcStat> {
    let s = std::fs::read_to_string(path).ok()?;
    let (open, close) = (s.find('(')?, s.rfind(')')?);
    let comm = s[open + 1..close].to_owned();
    let rest: Vec<&str> = s[close + 1..].split_whitespace().collect();
    // rest[0] is field 3 (state), rest[1] field 4 (ppid); utime, stime, cutime and cstime are
    // fields 14 to 17.
    let field = |i: usize| rest.get(i).and_then(|f| f.parse::<u64>().ok());
    Some(ProcStat {
        comm,
        ppid: u32::try_from(field(1)?).ok()?,
        own: field(11)? + field(12)?,
        children: field(13)? + field(14)?,
    })
}

/// The postmaster of the bench's PostgreSQL server, when it runs on this machine
/// ([`find_postmaster`]): PostgreSQL's CPU is then that server's alone. Unset, every process
/// named `postgres` counts (every server on the machine).
static POSTMASTER: std::sync::OnceLock<u32> = std::sync::OnceLock::new();

/// Finds the postmaster of `cfg`'s server: the parent of a backend of ours, if both are
/// processes named `postgres` on this machine.
async fn find_postmaster(cfg: &Config) {
    let found = async {
        let mut c = sqlx::ConnectOptions::connect(&cfg.pg_options().ok()?.database("postgres")).await.ok()?;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut c).await.ok()?;
        let backend = proc_stat(&format!("/proc/{pid}/stat")).filter(|p| p.comm == "postgres")?;
        proc_stat(&format!("/proc/{}/stat", backend.ppid)).filter(|p| p.comm == "postgres")?;
        Some(backend.ppid)
    }
    .await;
    match found {
        Some(pid) => {
            let _ = POSTMASTER.set(pid);
            eprintln!("   PostgreSQL's CPU: the server of postmaster {pid}");
        }
        None => eprintln!(
            "   PostgreSQL's CPU: every process named postgres (the server's postmaster not found here)"
        ),
    }
}
