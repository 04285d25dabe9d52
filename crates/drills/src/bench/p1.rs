//! P1: hold transactions per second and their latency at increasing concurrency, next to
//! pgbench's TPC-B tps on the same PostgreSQL in the same run (the physical-limit anchor).
//!
//! The hold is `boxoffice_store::holds::reserve`, the transaction behind
//! `POST /events/{id}/holds`, called in-process from N tasks on a pool of N connections.
//! Each attempt asks for two seats dealt from a shuffled deck of the venue (so attempts do
//! not collide by accident); a share of attempts (`--p1-conflict-share`) adds a seat dealt
//! out earlier, and must be refused (409 `seat_unavailable`). Afterwards the ledger is
//! checked for invariant 1: no seat with more than one unreleased hold or more than one
//! ticket, and exactly one hold row per successful call.
//!
//! What bounds P1 is read off each level's [`TxCost`], for the holds and for pgbench beside
//! them: PostgreSQL's CPU, the client's CPU (the bench process, or pgbench) and the WAL
//! written, per transaction; and off where the hold's connections were while it ran
//! ([`BackendShare`], `pg_stat_activity` sampled every [`SAMPLE_EVERY`]): running, waiting
//! for a lock or for the disk, or waiting for the client between statements.

use super::{BenchArgs, BenchDb, Deck};
use anyhow::Context;
use boxoffice::config::Config;
use boxoffice_domain::{EventId, SeatId, UserId};
use boxoffice_harness::stats::{self, histogram, quantiles_ms};
use boxoffice_store::holds::{self, ReserveError, ReserveRequest};
use boxoffice_store::venue::{self, VenueSpec};
use rand::Rng;
use serde::Serialize;
use sqlx::postgres::PgConnectOptions;
use sqlx::PgPool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Seats per P1 hold attempt.
const SEATS_PER_ATTEMPT: usize = 2;

/// One concurrency level.
#[derive(Debug, Clone, Serialize)]
pub struct P1Level {
    /// Concurrent hold transactions (and pgbench clients).
    pub concurrency: usize,
    /// Measured seconds of the hold run.
    pub seconds: f64,
    /// Calls of `reserve`.
    pub attempts: u64,
    /// Holds created.
    pub holds: u64,
    /// Refusals because a seat was taken (409 `seat_unavailable`).
    pub conflicts_409: u64,
    /// Any other error (database, pool timeout).
    pub errors: u64,
    /// Holds created per second.
    pub holds_per_s: f64,
    /// Hold transactions per second, refusals included (each is a full transaction).
    pub transactions_per_s: f64,
    /// Latency of one `reserve` call (retries included), ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Largest, ms.
    pub max_ms: f64,
    /// pgbench TPC-B tps at the same client count (None when pgbench could not run).
    pub pgbench_tps: Option<f64>,
    /// `holds_per_s / pgbench_tps`.
    pub ratio: Option<f64>,
    /// Where the CPU went during the hold run.
    pub cpu: super::CpuUse,
    /// What one hold transaction cost: the window's cost over holds and 409 refusals (errors
    /// and `reserve`'s own retries cost too, but are not counted as transactions).
    pub hold_cost: Option<TxCost>,
    /// What one pgbench TPC-B transaction cost at the same client count.
    pub pgbench_cost: Option<TxCost>,
    /// Where the hold's connections were during the run, most frequent first (shares of
    /// every sample of every connection; empty when `pg_stat_activity` could not be read).
    pub backends: Vec<BackendShare>,
}

/// How often the hold's connections are sampled in `pg_stat_activity`.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(50);

/// A share of the samples of the hold's connections in one state.
#[derive(Debug, Clone, Serialize)]
pub struct BackendShare {
    /// `running` (in a statement, not waiting), `waiting for the client` (inside a
    /// transaction, between statements — or after a failed one, until the rollback: the round
    /// trip and the client's own work),
    /// `between transactions` (idle in the pool), or `wait_event_type:wait_event` of a
    /// statement that waits (`Lock:transactionid`, `LWLock:WALWrite`, `IO:WALSync`, …).
    pub state: String,
    /// Share of the samples, 0–1.
    pub share: f64,
}

/// Samples the hold's connections (`application_name` [`HOLD_APPLICATION`]) in
/// `pg_stat_activity` every [`SAMPLE_EVERY`] until `stop`, one statement on `pool` a sample;
/// returns each state's share, most frequent first.
async fn sample_backends(pool: PgPool, stop: tokio_util::sync::CancellationToken) -> Vec<BackendShare> {
    let mut counts: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let rows: Result<Vec<(String, i64)>, _> = sqlx::query_as(
            "SELECT CASE WHEN state LIKE 'idle in transaction%' THEN 'waiting for the client'
                         WHEN state = 'idle' THEN 'between transactions'
                         WHEN wait_event_type IS NULL THEN 'running'
                         ELSE wait_event_type || ':' || wait_event END, count(*)
               FROM pg_stat_activity
              WHERE datname = current_database() AND backend_type = 'client backend'
                AND pid <> pg_backend_pid() AND application_name = $1
              GROUP BY 1",
        )
        .bind(HOLD_APPLICATION)
        .fetch_all(&pool)
        .await;
        // A sample that fails is left out.
        match rows {
            Ok(rows) => rows.into_iter().for_each(|(state, n)| *counts.entry(state).or_default() += n as u64),
            Err(e) => tracing::debug!(error = %e, "cannot sample pg_stat_activity"),
        }
    }
    let total = counts.values().sum::<u64>().max(1) as f64;
    let mut shares: Vec<BackendShare> =
        counts.into_iter().map(|(state, n)| BackendShare { state, share: n as f64 / total }).collect();
    shares.sort_by(|a, b| b.share.total_cmp(&a.share).then_with(|| a.state.cmp(&b.state)));
    shares
}

/// The `application_name` of the hold's connections, by which they are sampled.
const HOLD_APPLICATION: &str = "boxoffice-bench-p1";

/// What one transaction cost in a measured window: its share of PostgreSQL's CPU, of the
/// client's CPU and of the WAL written.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct TxCost {
    /// Transactions in the window: hold transactions (created or refused 409), or pgbench's
    /// processed transactions.
    pub transactions: u64,
    /// PostgreSQL's CPU per transaction, ms: every process of the server (backends, WAL
    /// writer, checkpointer), backends that exited in the window included (see
    /// `CpuUse::postgres_cores`). The hold's window includes the `VACUUM (ANALYZE)` the bench
    /// runs every 5 s when autovacuum is off; pgbench's, its own start-up `VACUUM` of its
    /// small tables.
    pub postgres_cpu_ms: f64,
    /// The client's CPU per transaction, ms: the bench process (the hold code, sqlx, its
    /// tasks) for holds; pgbench for TPC-B, with the bench process waiting for it.
    pub client_cpu_ms: f64,
    /// WAL written per transaction, bytes (`pg_current_wal_lsn()` before and after: the whole
    /// server, so whatever else writes to it counts too; full-page images included, so the
    /// window after a checkpoint pays for the first change of each page).
    pub wal_bytes: f64,
}

impl TxCost {
    /// `cpu` and `wal_bytes` of a window spread over `transactions`; None without any, when
    /// the WAL position could not be read, or when no CPU could be read (no `/proc`).
    fn of(cpu: &super::CpuUse, client_cores: f64, wal_bytes: Option<i64>, transactions: u64) -> Option<Self> {
        let n = transactions as f64;
        let wal_bytes = wal_bytes? as f64;
        let measured = cpu.postgres_cores > 0.0 || client_cores > 0.0;
        (transactions > 0 && measured).then(|| Self {
            transactions,
            postgres_cpu_ms: cpu.postgres_cores * cpu.seconds * 1_000.0 / n,
            client_cpu_ms: client_cores * cpu.seconds * 1_000.0 / n,
            wal_bytes: wal_bytes / n,
        })
    }
}

/// The server's WAL insert position, bytes from its start; None if it cannot be read.
async fn wal_position(pool: &PgPool) -> Option<i64> {
    sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
        .fetch_one(pool)
        .await
        .map_err(|e| tracing::debug!(error = %e, "cannot read the WAL position"))
        .ok()
}

/// Bytes of WAL between two positions.
fn wal_between(before: Option<i64>, after: Option<i64>) -> Option<i64> {
    Some(after? - before?)
}

/// P1's result.
#[derive(Debug, Clone, Serialize)]
pub struct P1Result {
    /// Seats of the venue the holds were taken from.
    pub venue_seats: usize,
    /// Every level, in the order run.
    pub levels: Vec<P1Level>,
    /// The level with the most holds per second.
    pub best_concurrency: usize,
    /// Its holds per second.
    pub best_holds_per_s: f64,
    /// The best pgbench tps over all levels.
    pub best_pgbench_tps: Option<f64>,
    /// `best_holds_per_s / best_pgbench_tps` (the target is `report::targets::P1_RATIO`).
    pub best_ratio: Option<f64>,
    /// Seats with more than one unreleased hold or more than one ticket (must be 0).
    pub oversold_seats: i64,
    /// Hold rows in the ledger minus successful calls (must be 0).
    pub hold_count_mismatch: i64,
    /// Why pgbench did not run, if it did not.
    pub pgbench_error: Option<String>,
}

/// Runs P1 on a fresh database and drops it afterwards.
pub async fn run(cfg: &Config, args: &BenchArgs) -> anyhow::Result<P1Result> {
    let (db, pool) = BenchDb::migrated(cfg, "p1", 4).await?;
    let result = run_on(cfg, args, &db, &pool).await;
    pool.close().await;
    db.drop_db().await;
    result
}

async fn run_on(cfg: &Config, args: &BenchArgs, db: &BenchDb, pool: &PgPool) -> anyhow::Result<P1Result> {
    // Enough seats that the deck never runs out: a generous 4,000 holds/s per level.
    let per_level = 4_000 * args.p1_seconds as usize * SEATS_PER_ATTEMPT;
    let needed = (per_level * args.p1_concurrency.len()).clamp(2_000, 400_000);
    let rows = 40u32;
    let seats_per_row = 50u32;
    let sections = (needed as u32).div_ceil(rows * seats_per_row);
    let spec = VenueSpec::small(sections, rows, seats_per_row);
    let name = format!("Bench P1 {}", uuid::Uuid::new_v4());
    let (event, _) =
        venue::seed(pool, &name, &spec, chrono::Utc::now() + chrono::Duration::days(30), &cfg.purchase_cell)
            .await?;
    let deck = Arc::new(Deck::load(pool, event.0).await?);
    eprintln!("   venue: {} seats", deck.len());
    if args.p1_region_fence == "off" {
        let n = boxoffice_store::region::drop_fence_triggers(pool).await?;
        eprintln!("   region fence: off ({n} triggers dropped in this database)");
    }

    let pgbench = PgBench::prepare(cfg, args.pgbench_scale).await;
    let mut pgbench_error = pgbench.as_ref().err().map(|e| format!("{e:#}"));
    let mut levels = Vec::new();
    let mut total_holds = 0;
    for &n in &args.p1_concurrency {
        // Fresh statistics for each level, and while it runs as autovacuum would keep them
        // (the tables grow by thousands of holds per level; it may be off).
        // Only those that hold rows (`analyze_filled`): the first level's are empty.
        boxoffice_store::analyze_filled(pool, super::PURCHASE_TABLES).await?;
        let autovacuum = super::Autovacuum::start(pool).await;
        let wal_before = wal_position(pool).await;
        let level = hold_level(pool, db.opts.clone(), event, deck.clone(), n, args).await;
        let wal_after = wal_position(pool).await;
        autovacuum.stop().await;
        let mut level = level?;
        level.hold_cost = TxCost::of(
            &level.cpu,
            level.cpu.boxoffice_cores,
            wal_between(wal_before, wal_after),
            level.holds + level.conflicts_409,
        );
        total_holds += level.holds;
        if let Ok(pg) = &pgbench {
            let wal_before = wal_position(pool).await;
            let cpu_before = super::CpuSnap::now();
            let run = pg.run(n, args.p1_seconds).await;
            let cpu = cpu_before.until(&super::CpuSnap::now());
            let wal_after = wal_position(pool).await;
            match run {
                Ok(out) => {
                    level.pgbench_tps = Some(out.tps);
                    level.ratio = Some(level.holds_per_s / out.tps);
                    // pgbench is this process's child: its CPU is counted once it was waited for.
                    level.pgbench_cost = out.transactions.and_then(|t| {
                        TxCost::of(&cpu, cpu.boxoffice_cores, wal_between(wal_before, wal_after), t)
                    });
                }
                Err(e) => pgbench_error = Some(format!("{e:#}")),
            }
        }
        eprintln!(
            "   c={:<3} holds/s {:>8.1}  p50 {:>6.1} ms  p99 {:>7.1} ms  409s {:<5} errors {:<4} pgbench tps {}",
            n,
            level.holds_per_s,
            level.p50_ms,
            level.p99_ms,
            level.conflicts_409,
            level.errors,
            level.pgbench_tps.map(|t| format!("{t:.1}")).unwrap_or_else(|| "-".into())
        );
        levels.push(level);
        if deck.exhausted(SEATS_PER_ATTEMPT) {
            eprintln!("   the venue ran out of seats: stopping P1 here");
            break;
        }
    }
    if let Ok(pg) = pgbench {
        pg.drop_db().await;
    }

    let oversold_seats: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM (SELECT seat_id FROM hold_seats WHERE released_at IS NULL
                                         GROUP BY seat_id HAVING count(*) > 1) h)
              + (SELECT count(*) FROM (SELECT seat_id FROM tickets GROUP BY seat_id HAVING count(*) > 1) t)",
    )
    .fetch_one(pool)
    .await?;
    let hold_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM holds").fetch_one(pool).await?;
    let best =
        levels.iter().max_by(|a, b| a.holds_per_s.total_cmp(&b.holds_per_s)).context("no P1 level ran")?;
    let best_pgbench_tps = levels.iter().filter_map(|l| l.pgbench_tps).max_by(|a, b| a.total_cmp(b));
    Ok(P1Result {
        venue_seats: deck.len(),
        best_concurrency: best.concurrency,
        best_holds_per_s: best.holds_per_s,
        best_ratio: best_pgbench_tps.map(|t| best.holds_per_s / t),
        best_pgbench_tps,
        oversold_seats,
        hold_count_mismatch: hold_rows - total_holds as i64,
        pgbench_error,
        levels,
    })
}

#[derive(Default)]
struct Counts {
    attempts: AtomicU64,
    holds: AtomicU64,
    conflicts: AtomicU64,
    errors: AtomicU64,
}

/// One level: `n` tasks calling `reserve` for `args.p1_seconds` on a pool of `n` connections
/// of `opts`, sampled in `pg_stat_activity` through `sampling` (another pool) once every
/// connection is open.
async fn hold_level(
    sampling: &PgPool,
    opts: PgConnectOptions,
    event: EventId,
    deck: Arc<Deck>,
    n: usize,
    args: &BenchArgs,
) -> anyhow::Result<P1Level> {
    let pool = boxoffice_store::connect(opts.application_name(HOLD_APPLICATION), n as u32, 30_000).await?;
    // Open every connection before the clock starts.
    let warm: Vec<_> = futures::future::join_all((0..n).map(|_| pool.acquire())).await;
    drop(warm);
    let stop_sampling = tokio_util::sync::CancellationToken::new();
    let sampler = tokio::spawn(sample_backends(sampling.clone(), stop_sampling.clone()));
    let counts = Arc::new(Counts::default());
    let hist = Arc::new(Mutex::new(histogram()));
    let cpu_before = super::CpuSnap::now();
    let started = Instant::now();
    let until = started + Duration::from_secs(args.p1_seconds);
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (pool, deck, counts, hist) = (pool.clone(), deck.clone(), counts.clone(), hist.clone());
            let conflict_share = args.p1_conflict_share;
            tokio::spawn(async move {
                let mut local = histogram();
                while Instant::now() < until {
                    let Some(mut seats) = deck.deal(SEATS_PER_ATTEMPT) else { break };
                    {
                        let mut rng = rand::thread_rng();
                        if rng.gen_bool(conflict_share) {
                            if let Some(taken) = deck.dealt(&mut rng) {
                                seats[0] = taken;
                            }
                        }
                    }
                    let req = ReserveRequest {
                        user_id: UserId(uuid::Uuid::new_v4()),
                        event_id: event,
                        seat_ids: seats.into_iter().map(SeatId).collect(),
                        idempotency_key: uuid::Uuid::new_v4().to_string(),
                        correlation_id: uuid::Uuid::new_v4(),
                        ttl: Duration::from_secs(3_600),
                        payable_within: None,
                        cell: "cell-1".into(),
                        directory_epoch: 1,
                        authorization_request: boxoffice_domain::saga::AuthorizationRequest::default(),
                    };
                    let t = Instant::now();
                    let r = holds::reserve(&pool, &req).await;
                    stats::record(&mut local, t.elapsed());
                    counts.attempts.fetch_add(1, Ordering::Relaxed);
                    let c = match r {
                        Ok(_) => &counts.holds,
                        Err(ReserveError::SeatUnavailable { .. }) => &counts.conflicts,
                        Err(e) => {
                            tracing::debug!(error = %e, "bench hold failed");
                            &counts.errors
                        }
                    };
                    c.fetch_add(1, Ordering::Relaxed);
                }
                let _ = hist.lock().expect("histogram lock").add(&local);
            })
        })
        .collect();
    for t in tasks {
        t.await.context("a P1 task panicked")?;
    }
    let secs = started.elapsed().as_secs_f64();
    let cpu = cpu_before.until(&super::CpuSnap::now());
    stop_sampling.cancel();
    let backends = sampler.await.unwrap_or_default();
    pool.close().await;
    let h = hist.lock().expect("histogram lock");
    let (p50_ms, p99_ms, max_ms) = quantiles_ms(&h);
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    Ok(P1Level {
        concurrency: n,
        seconds: secs,
        attempts: get(&counts.attempts),
        holds: get(&counts.holds),
        conflicts_409: get(&counts.conflicts),
        errors: get(&counts.errors),
        holds_per_s: get(&counts.holds) as f64 / secs,
        transactions_per_s: (get(&counts.holds) + get(&counts.conflicts)) as f64 / secs,
        p50_ms,
        p99_ms,
        max_ms,
        pgbench_tps: None,
        ratio: None,
        cpu,
        hold_cost: None,
        pgbench_cost: None,
        backends,
    })
}

/// pgbench on its own initialized database.
struct PgBench {
    bin: String,
    db: BenchDb,
    conn_args: Vec<String>,
}

impl PgBench {
    async fn prepare(cfg: &Config, scale: u32) -> anyhow::Result<Self> {
        let bin = find_pgbench().context("pgbench not found (install postgresql-client)")?;
        let db = BenchDb::create(cfg, "pgbench").await?;
        let o = &db.opts;
        let conn_args = vec![
            "-h".to_owned(),
            o.get_host().to_owned(),
            "-p".to_owned(),
            o.get_port().to_string(),
            "-U".to_owned(),
            o.get_username().to_owned(),
        ];
        let me = Self { bin, db, conn_args };
        let mut a = me.conn_args.clone();
        a.extend(["-i".into(), "-q".into(), "-s".into(), scale.to_string(), me.db.name.clone()]);
        if let Err(e) = me.exec(a).await {
            me.drop_db().await;
            return Err(e.context("pgbench -i"));
        }
        Ok(me)
    }

    /// TPC-B (pgbench's default script) with `clients` clients for `secs`.
    async fn run(&self, clients: usize, secs: u64) -> anyhow::Result<PgBenchRun> {
        let mut a = self.conn_args.clone();
        let threads = clients.min(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2));
        a.extend([
            "-c".into(),
            clients.to_string(),
            "-j".into(),
            threads.to_string(),
            "-T".into(),
            secs.to_string(),
            self.db.name.clone(),
        ]);
        let out = self.exec(a).await?;
        let tps = parse_tps(&out).with_context(|| format!("no tps in pgbench output: {out}"))?;
        Ok(PgBenchRun { tps, transactions: parse_transactions(&out) })
    }

    async fn exec(&self, args: Vec<String>) -> anyhow::Result<String> {
        let bin = self.bin.clone();
        let out = tokio::task::spawn_blocking(move || std::process::Command::new(bin).args(args).output())
            .await?
            .context("running pgbench")?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        anyhow::ensure!(
            out.status.success(),
            "pgbench failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or_default()
        );
        Ok(text)
    }

    async fn drop_db(self) {
        self.db.drop_db().await;
    }
}

fn find_pgbench() -> Option<String> {
    let on_path =
        std::process::Command::new("pgbench").arg("--version").output().is_ok_and(|o| o.status.success());
    if on_path {
        return Some("pgbench".into());
    }
    let mut found: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|d| d.ok().map(|d| d.path().join("bin/pgbench")))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found.pop().map(|p| p.display().to_string())
}

/// What one pgbench run reported.
struct PgBenchRun {
    tps: f64,
    /// `number of transactions actually processed`, when printed.
    transactions: Option<u64>,
}

/// The transactions of a pgbench report: `number of transactions actually processed: 38123`
/// (a run with `-t` prints `38123/38123`; the first number counts).
pub fn parse_transactions(out: &str) -> Option<u64> {
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("number of transactions actually processed: "))
        .filter_map(|rest| rest.split(['/', ' ']).next()?.parse::<u64>().ok())
        .next_back()
}

/// The tps of a pgbench report: `tps = 1234.5 (without initial connection time)`.
pub fn parse_tps(out: &str) -> Option<f64> {
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("tps = "))
        .filter_map(|rest| rest.split_whitespace().next()?.parse::<f64>().ok())
        .next_back()
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_pgbench_tps() {
        let out = "latency average = 3.1 ms\ntps = 2570.412345 (without initial connection time)\n";
        assert_eq!(super::parse_tps(out), Some(2570.412345));
        assert_eq!(super::parse_tps("nothing"), None);
    }

    #[test]
    fn parses_pgbench_transactions() {
        let out = "number of clients: 8\nnumber of transactions actually processed: 38123\ntps = 1.0\n";
        assert_eq!(super::parse_transactions(out), Some(38123));
        let fixed = "number of transactions actually processed: 800/800\n";
        assert_eq!(super::parse_transactions(fixed), Some(800));
        assert_eq!(super::parse_transactions("tps = 1.0"), None);
    }
}
