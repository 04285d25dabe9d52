//! The bench report: every number and time series as `report.json`, the summary table with
//! targets as `report.md`, and `chart.png` (P3's offered rate, holds/s and hold p99 over
//! time, plotted with `plotters`). Also owns the rule for the recommended release rate R
//! ([`recommend`]).

use super::p1::P1Result;
use super::p2::{P2Result, P2_P99_BOUND_MS};
use super::p3::P3Result;
use super::p4::P4Result;
use super::BenchArgs;
use anyhow::Context;
use boxoffice::config::Config;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Targets on the reference 2-core machine with everything on it (design §12, performance
/// goals P1–P4).
pub mod targets {
    /// P1: hold tps ≥ this × pgbench TPC-B tps at the best client count.
    pub const P1_RATIO: f64 = 0.8;
    /// P2: attempts/s at p99 < 20 ms.
    pub const P2_ATTEMPTS_PER_S: f64 = 10_000.0;
    /// P3: ticketed orders/s sustained for the 60 s step with the thresholds held.
    pub const P3_TICKETED_PER_S: f64 = 300.0;
    /// P3: CPU-ms per ticketed order of the product's role process plus PostgreSQL.
    pub const P3_CPU_MS_PER_ORDER: f64 = 4.0;
    /// P4: events/s into the broker.
    pub const P4_EVENTS_PER_S: f64 = 10_000.0;
}

/// The PostgreSQL settings [`Machine::postgres_settings`] records: memory, WAL and checkpoints,
/// durability, and the bench's own instruments (`pg_stat_statements`, function tracking).
pub const SERVER_SETTINGS: [&str; 15] = [
    "shared_buffers",
    "wal_buffers",
    "wal_level",
    "max_wal_size",
    "checkpoint_timeout",
    "full_page_writes",
    "wal_compression",
    "synchronous_commit",
    "fsync",
    "max_connections",
    "autovacuum",
    "shared_preload_libraries",
    "track_functions",
    "pg_stat_statements.track_planning",
    "huge_pages",
];

/// Where and on what the bench ran.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// Logical CPUs.
    pub cores: usize,
    /// `SELECT version()` of the PostgreSQL server.
    pub postgres: String,
    /// The server's settings that bear on what a transaction costs it ([`SERVER_SETTINGS`]),
    /// by name, as `current_setting` shows them (`"128MB"`, `"on"`), read from `pg_settings`.
    /// Figures measured on servers set up differently are no comparison.
    pub postgres_settings: std::collections::BTreeMap<String, String>,
    /// Those of [`SERVER_SETTINGS`] not read: the server does not have them
    /// (`pg_stat_statements.*` without the module loaded), or does not show them to the
    /// bench's role (`shared_preload_libraries` needs `pg_read_all_settings`), or could not
    /// be asked at all (then every name).
    pub postgres_settings_unread: Vec<String>,
    /// `uname -sr`-like kernel string.
    pub os: String,
    /// Start of the run, RFC 3339.
    pub started_at: String,
    /// Kafka broker used by P3 and P4.
    pub broker: String,
    /// 1-minute load average at the start (other work on the machine makes numbers pessimistic).
    pub load_average_1m: Option<f64>,
    /// Busy processes the bench itself ran beside everything (`--steal-cpu`).
    pub steal_cpu: usize,
}

/// One row of the summary table.
#[derive(Debug, Clone, Serialize)]
pub struct TargetRow {
    /// `P1`…`P4`.
    pub phase: String,
    /// What is measured.
    pub metric: String,
    /// The target, as text.
    pub target: String,
    /// The measured value, as text.
    pub measured: String,
    /// Whether the target was met (None when the phase did not run or could not be compared).
    pub met: Option<bool>,
}

/// The recommended release rate and how it was found.
#[derive(Debug, Clone, Serialize)]
pub struct Recommendation {
    /// Buyers admitted per second (0 when no step stayed within the thresholds).
    pub r_per_s: f64,
    /// The rule, in words.
    pub rule: String,
    /// Hold p99 threshold, ms.
    pub max_hold_p99_ms: f64,
    /// Outbox age p99 threshold, ms.
    pub max_outbox_age_ms: f64,
    /// Consumer lag threshold, messages.
    pub max_lag: i64,
    /// P1's ceiling: the best holds/s of a level whose p99 is under the threshold.
    pub p1_hold_ceiling_per_s: Option<f64>,
}

/// Everything `boxoffice-drills bench` measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The machine.
    pub machine: Machine,
    /// Whether `--quick` shortened everything (numbers then mean nothing).
    pub quick: bool,
    /// P1, when run.
    pub p1: Option<P1Result>,
    /// P2, when run.
    pub p2: Option<P2Result>,
    /// P3, when run.
    pub p3: Option<P3Result>,
    /// P4, when run.
    pub p4: Option<P4Result>,
    /// Targets and results.
    pub targets: Vec<TargetRow>,
    /// R, when P3 ran.
    pub recommendation: Option<Recommendation>,
}

impl Report {
    /// An empty report with the machine facts.
    pub async fn new(cfg: &Config, args: &BenchArgs, broker: &str) -> Self {
        let server = async {
            let mut c =
                sqlx::ConnectOptions::connect(&cfg.pg_options().ok()?.database("postgres")).await.ok()?;
            let version = sqlx::query_scalar::<_, String>("SELECT version()").fetch_one(&mut c).await.ok()?;
            // `pg_settings` lists only what the role may see, so one hidden setting (or one this
            // server does not have) leaves out that one alone, where `current_setting` of it
            // would fail the whole statement.
            let settings: Vec<(String, String)> =
                sqlx::query_as("SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY($1)")
                    .bind(SERVER_SETTINGS)
                    .fetch_all(&mut c)
                    .await
                    .unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "could not read the server's settings");
                        Vec::new()
                    });
            Some((version, settings.into_iter().collect()))
        }
        .await;
        let (postgres, postgres_settings): (String, std::collections::BTreeMap<String, String>) =
            server.unwrap_or_else(|| ("unknown".into(), Default::default()));
        let postgres_settings_unread = SERVER_SETTINGS
            .iter()
            .filter(|name| !postgres_settings.contains_key(**name))
            .map(|name| name.to_string())
            .collect();
        let os = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|r| format!("{} {}", std::env::consts::OS, r.trim()))
            .unwrap_or_else(|_| std::env::consts::OS.into());
        let load_average_1m = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|l| l.split_whitespace().next()?.parse().ok());
        Self {
            machine: Machine {
                cores: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
                postgres,
                postgres_settings,
                postgres_settings_unread,
                os,
                started_at: chrono::Utc::now().to_rfc3339(),
                broker: broker.into(),
                load_average_1m,
                steal_cpu: args.steal_cpu,
            },
            quick: args.quick,
            p1: None,
            p2: None,
            p3: None,
            p4: None,
            targets: Vec::new(),
            recommendation: None,
        }
    }

    /// Fills the target rows and the recommendation from the phases' results.
    pub fn finish(&mut self, args: &BenchArgs) {
        let mut rows = Vec::new();
        if let Some(p1) = &self.p1 {
            rows.push(TargetRow {
                phase: "P1".into(),
                metric: "hold tps vs pgbench TPC-B tps (best levels)".into(),
                target: format!("≥ {:.1} × pgbench, zero oversell", targets::P1_RATIO),
                measured: format!(
                    "{:.0} holds/s (c={}) vs {} tps: ratio {}; oversold seats {}",
                    p1.best_holds_per_s,
                    p1.best_concurrency,
                    p1.best_pgbench_tps.map(|t| format!("{t:.0}")).unwrap_or_else(|| "n/a".into()),
                    p1.best_ratio.map(|r| format!("{r:.2}")).unwrap_or_else(|| "n/a".into()),
                    p1.oversold_seats
                ),
                met: p1.best_ratio.map(|r| r >= targets::P1_RATIO && p1.oversold_seats == 0),
            });
        }
        if let Some(p2) = &self.p2 {
            let best = p2.best_http.as_ref();
            rows.push(TargetRow {
                phase: "P2".into(),
                metric: "waiting-room join+poll attempts/s (HTTP)".into(),
                target: format!("≥ {:.0}/s at p99 < {P2_P99_BOUND_MS:.0} ms", targets::P2_ATTEMPTS_PER_S),
                measured: best
                    .map(|b| {
                        format!("{:.0}/s at p99 {:.1} ms (c={})", b.attempts_per_s, b.p99_ms, b.concurrency)
                    })
                    .unwrap_or_else(|| "n/a".into()),
                met: best
                    .map(|b| b.attempts_per_s >= targets::P2_ATTEMPTS_PER_S && b.p99_ms < P2_P99_BOUND_MS),
            });
            if let Some(b) = &p2.best_library {
                rows.push(TargetRow {
                    phase: "P2".into(),
                    metric: "same, library calls to Redis (no HTTP)".into(),
                    target: "(diagnostic)".into(),
                    measured: format!(
                        "{:.0}/s at p99 {:.1} ms (c={})",
                        b.attempts_per_s, b.p99_ms, b.concurrency
                    ),
                    met: None,
                });
            }
        }
        if let Some(p3) = &self.p3 {
            let s = p3.steps.iter().find(|s| s.sustained);
            rows.push(TargetRow {
                phase: "P3".into(),
                metric: "ticketed orders/s sustained".into(),
                target: format!("≥ {:.0}/s for the sustained step, thresholds held", targets::P3_TICKETED_PER_S),
                measured: s
                    .map(|s| {
                        format!(
                            "{:.0}/s at {:.0} arrivals/s for {:.0} s; hold p99 {:.0} ms; outbox age p99 {:.0} ms; max lag {}",
                            s.ticketed_per_s, s.rate, s.seconds, s.hold_p99_ms, s.outbox_age_p99_ms, s.max_lag
                        )
                    })
                    .unwrap_or_else(|| "n/a".into()),
                met: s.map(|s| s.ticketed_per_s >= targets::P3_TICKETED_PER_S && s.within_thresholds),
            });
            if let Some(c) = &p3.cpu_ms_per_order {
                let pg = p3.postgres_per_order.as_ref();
                let statements = pg
                    .and_then(|p| p.statements.zip(p.round_trips))
                    .map(|(st, rt)| format!(", {st:.0} statements / {rt:.0} round trips"))
                    .unwrap_or_default();
                rows.push(TargetRow {
                    phase: "P3".into(),
                    metric: "CPU-ms per ticketed order, product + PostgreSQL".into(),
                    target: format!("≤ {:.0}", targets::P3_CPU_MS_PER_ORDER),
                    measured: format!(
                        "{:.1} (product {:.1}, PostgreSQL {:.1}; harness {:.1} apart){}{}",
                        c.product + c.postgres,
                        c.product,
                        c.postgres,
                        c.harness,
                        pg.map(|p| format!("; {:.1} transactions", p.transactions)).unwrap_or_default(),
                        statements
                    ),
                    met: Some(c.product + c.postgres <= targets::P3_CPU_MS_PER_ORDER),
                });
            }
        }
        if let Some(p4) = &self.p4 {
            rows.push(TargetRow {
                phase: "P4".into(),
                metric: "relay publish events/s".into(),
                target: format!("≥ {:.0}/s", targets::P4_EVENTS_PER_S),
                measured: format!(
                    "{:.0}/s ({} events in {:.2} s)",
                    p4.events_per_s, p4.events, p4.drain_seconds
                ),
                met: Some(p4.drained && p4.events_per_s >= targets::P4_EVENTS_PER_S),
            });
        }
        self.targets = rows;
        self.recommendation = self.p3.as_ref().map(|p3| recommend(p3, self.p1.as_ref(), args));
    }
}

/// The recommended release rate R: the largest P3 ramp rate whose step kept up (holds/s
/// ≥ 90 % and ticketed orders/s ≥ 80 % of the rate) with hold p99 ≤ `--max-hold-p99-ms`,
/// outbox age p99 ≤ `--max-outbox-age-ms` and consumer lag ≤ `--max-lag`; when the 60 s
/// sustained step at that rate broke a threshold (a backlog that grows slowly shows only in
/// the longer step), the largest passing ramp rate below it. P1's best holds/s under the
/// same p99 bound is reported next to it as the hold transaction's own ceiling.
pub fn recommend(p3: &P3Result, p1: Option<&P1Result>, args: &BenchArgs) -> Recommendation {
    let failed_sustained = p3.steps.iter().find(|s| s.sustained && !s.within_thresholds).map(|s| s.rate);
    let r = p3
        .steps
        .iter()
        .filter(|s| !s.sustained && s.within_thresholds)
        .filter(|s| failed_sustained.is_none_or(|f| s.rate < f))
        .map(|s| s.rate)
        .fold(0.0, f64::max);
    let p1_hold_ceiling_per_s = p1.and_then(|p| {
        p.levels
            .iter()
            .filter(|l| l.p99_ms <= args.max_hold_p99_ms)
            .map(|l| l.holds_per_s)
            .max_by(|a, b| a.total_cmp(b))
    });
    Recommendation {
        r_per_s: r,
        rule: format!(
            "R = the largest P3 ramp rate whose step kept up (holds/s ≥ 90 % and ticketed/s ≥ 80 % of the rate) with hold \
             p99 ≤ {} ms, outbox age p99 ≤ {} ms and consumer lag ≤ {} messages, and below the sustained step's rate if \
             that {} s step broke a threshold; configure it as release_max_per_s, the release controller's ceiling",
            args.max_hold_p99_ms, args.max_outbox_age_ms, args.max_lag, args.p3_seconds
        ),
        max_hold_p99_ms: args.max_hold_p99_ms,
        max_outbox_age_ms: args.max_outbox_age_ms,
        max_lag: args.max_lag,
        p1_hold_ceiling_per_s,
    }
}

/// Writes report.json, report.md and (when P3 ran) chart.png into `dir`; returns the paths.
pub fn write(report: &Report, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let json = dir.join("report.json");
    std::fs::write(&json, serde_json::to_vec_pretty(report)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let md = dir.join("report.md");
    std::fs::write(&md, markdown(report)).with_context(|| format!("writing {}", md.display()))?;
    let mut files = vec![json, md];
    if let Some(p3) = &report.p3 {
        let png = dir.join("chart.png");
        chart(p3, report.recommendation.as_ref(), &png)?;
        files.push(png);
    }
    Ok(files)
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map(|v| format!("{v:.digits$}")).unwrap_or_else(|| "–".into())
}

/// The Markdown report.
pub fn markdown(r: &Report) -> String {
    let mut s = String::new();
    let m = &r.machine;
    let _ = writeln!(s, "# boxoffice bench\n");
    let _ = writeln!(
        s,
        "{} cores, {}, {}; broker: {}; started {}{}{}.{}\n",
        m.cores,
        m.postgres.split(" on ").next().unwrap_or(&m.postgres),
        m.os,
        m.broker,
        m.started_at,
        m.load_average_1m.map(|l| format!(", load average {l:.2} at start")).unwrap_or_default(),
        if m.steal_cpu > 0 {
            format!(", {} busy process(es) stealing CPU throughout", m.steal_cpu)
        } else {
            String::new()
        },
        if r.quick { " **--quick: smoke-test durations, the numbers mean nothing.**" } else { "" }
    );
    if !m.postgres_settings.is_empty() || !m.postgres_settings_unread.is_empty() {
        let settings: Vec<String> = m.postgres_settings.iter().map(|(k, v)| format!("`{k}` {v}")).collect();
        let unread: Vec<String> = m.postgres_settings_unread.iter().map(|k| format!("`{k}`")).collect();
        let _ = writeln!(
            s,
            "PostgreSQL's settings: {}{}.\n",
            if settings.is_empty() { "none read".to_owned() } else { settings.join(", ") },
            if unread.is_empty() { String::new() } else { format!("; not read: {}", unread.join(", ")) }
        );
    }
    let _ = writeln!(s, "| Phase | Metric | Target | Measured | Met |\n|---|---|---|---|---|");
    for t in &r.targets {
        let met = match t.met {
            Some(true) => "met",
            Some(false) => "**missed**",
            None => "–",
        };
        let _ = writeln!(s, "| {} | {} | {} | {} | {} |", t.phase, t.metric, t.target, t.measured, met);
    }
    if let Some(rec) = &r.recommendation {
        let _ = writeln!(
            s,
            "\n**Recommended R: {:.0} buyers admitted per second.** {}.{}\n",
            rec.r_per_s,
            rec.rule,
            rec.p1_hold_ceiling_per_s
                .map(|c| format!(
                    " The hold transaction alone (P1) reaches {c:.0} holds/s within the hold p99 bound."
                ))
                .unwrap_or_default()
        );
    }
    if let Some(p1) = &r.p1 {
        let _ = writeln!(s, "\n## P1: hold transaction vs pgbench TPC-B\n");
        let _ = writeln!(
            s,
            "| Concurrency | Holds/s | Tx/s (incl. 409) | p50 ms | p99 ms | 409s | Errors | pgbench tps | Ratio | Machine busy | PostgreSQL cores |\n|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for l in &p1.levels {
            let _ = writeln!(
                s,
                "| {} | {:.0} | {:.0} | {:.1} | {:.1} | {} | {} | {} | {} | {:.0} % | {:.2} |",
                l.concurrency,
                l.holds_per_s,
                l.transactions_per_s,
                l.p50_ms,
                l.p99_ms,
                l.conflicts_409,
                l.errors,
                opt(l.pgbench_tps, 0),
                opt(l.ratio, 2),
                l.cpu.machine_busy_pct,
                l.cpu.postgres_cores
            );
        }
        let _ = writeln!(
            s,
            "\nWhat one transaction cost (PostgreSQL's CPU and the client's, CPU-ms; WAL, bytes): the hold transaction (holds and 409s) beside pgbench's TPC-B at the same client count.\n\n| Concurrency | Hold: PostgreSQL | Hold: client | Hold: WAL | TPC-B: PostgreSQL | TPC-B: client (pgbench) | TPC-B: WAL |\n|---|---|---|---|---|---|---|"
        );
        for l in &p1.levels {
            let cost = |c: Option<super::p1::TxCost>| match c {
                Some(c) => format!("{:.3} | {:.3} | {:.0}", c.postgres_cpu_ms, c.client_cpu_ms, c.wal_bytes),
                None => "n/a | n/a | n/a".into(),
            };
            let _ = writeln!(s, "| {} | {} | {} |", l.concurrency, cost(l.hold_cost), cost(l.pgbench_cost));
        }
        let _ = writeln!(
            s,
            "\nWhere the hold's connections were (`pg_stat_activity`, sampled every {} ms; the five most frequent states):\n",
            super::p1::SAMPLE_EVERY.as_millis()
        );
        for l in p1.levels.iter().filter(|l| !l.backends.is_empty()) {
            let states: Vec<String> =
                l.backends.iter().take(5).map(|b| format!("{} {:.0} %", b.state, b.share * 100.0)).collect();
            let _ = writeln!(s, "- c={}: {}", l.concurrency, states.join(", "));
        }
        if let Some(b) = p1.levels.iter().find(|l| l.concurrency == p1.best_concurrency) {
            let _ = writeln!(
                s,
                "\nCPU at the best level (c={}): machine {:.0} % busy; PostgreSQL {:.2} cores, the bench process {:.2}, other {:.2}.",
                b.concurrency, b.cpu.machine_busy_pct, b.cpu.postgres_cores, b.cpu.boxoffice_cores, b.cpu.other_cores
            );
        }
        let _ = writeln!(
            s,
            "\nOversold seats (more than one unreleased hold or ticket): **{}**; hold rows minus successful calls: {}.{}",
            p1.oversold_seats,
            p1.hold_count_mismatch,
            p1.pgbench_error.as_ref().map(|e| format!(" pgbench: {e}.")).unwrap_or_default()
        );
    }
    if let Some(p2) = &r.p2 {
        let _ = writeln!(s, "\n## P2: waiting room join + poll\n");
        let _ = writeln!(
            s,
            "| Path | Concurrency | Attempts/s | p50 ms | p99 ms | Errors | Machine busy | boxoffice cores | Other cores (Redis, other work) |\n|---|---|---|---|---|---|---|---|---|"
        );
        for l in &p2.levels {
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {:.2} | {:.2} | {} | {:.0} % | {:.2} | {:.2} |",
                l.path,
                l.concurrency,
                l.attempts_per_s,
                l.p50_ms,
                l.p99_ms,
                super::p2::errors_text(l),
                l.cpu.machine_busy_pct,
                l.cpu.boxoffice_cores,
                l.cpu.other_cores
            );
        }
    }
    if let Some(p3) = &r.p3 {
        let _ = writeln!(s, "\n## P3: end-to-end\n");
        let _ = writeln!(
            s,
            "| Arrivals/s | Seconds | Holds/s | Hold p50 ms | Hold p99 ms | Ticketed/s | Outbox age p99 ms | Max lag | Kept up | Within thresholds |\n|---|---|---|---|---|---|---|---|---|---|"
        );
        for st in &p3.steps {
            let _ = writeln!(
                s,
                "| {:.0}{} | {:.0} | {:.0} | {:.1} | {:.1} | {:.0} | {:.0} | {} | {} | {} |",
                st.rate,
                if st.sustained { " (sustained)" } else { "" },
                st.seconds,
                st.holds_per_s,
                st.hold_p50_ms,
                st.hold_p99_ms,
                st.ticketed_per_s,
                st.outbox_age_p99_ms,
                st.max_lag,
                if st.keeps_up { "yes" } else { "no" },
                if st.within_thresholds { "yes" } else { "no" }
            );
        }
        let _ = writeln!(
            s,
            "\n{} buyers, {} holds, {} payments confirmed, {} ticketed, {} buyer errors; drained: {} ({:.1} s after the last arrival).\n\n![P3 over time](chart.png)",
            p3.buyers, p3.holds, p3.confirmed, p3.ticketed, p3.buyer_errors, p3.drained, p3.drain_seconds
        );
        let c = &p3.sustained_cpu;
        let _ = writeln!(
            s,
            "\nCPU from the sustained step's first arrival until drained ({:.0} s, {} orders ticketed): machine {:.0} % busy; \
             the product (`boxoffice serve`, every role) {:.2} cores, PostgreSQL {:.2}, the harness (generator, simulator, \
             broker: {}) {:.2}, other {:.2}.{}",
            c.seconds,
            p3.sustained_ticketed,
            c.machine_busy_pct,
            c.product_cores,
            c.postgres_cores,
            p3.broker,
            c.harness_cores,
            c.other_cores,
            p3.cpu_ms_per_order
                .map(|m| format!(
                    " Per ticketed order: {:.2} CPU-ms in the product, {:.2} in PostgreSQL, {:.2} in the harness{}.",
                    m.product,
                    m.postgres,
                    m.harness,
                    p3.harness_cpu_ms_per_order
                        .map(|h| format!(
                            " (generator {:.2}, simulator {:.2}, broker {:.2})",
                            h.generator, h.simulator, h.broker
                        ))
                        .unwrap_or_default()
                ))
                .unwrap_or_default()
        );
        if let Some(rest) = &p3.at_rest {
            let c = &rest.cpu_ms_per_s;
            let pg = &rest.postgres;
            let _ = writeln!(
                s,
                "\nAt rest before the first arrival ({:.0} s, every role running, no buyer): machine {:.1} % busy; \
                 CPU-ms per second: the product {:.1}, PostgreSQL {:.1}, the harness {:.1} (of it the broker {:.1}); \
                 PostgreSQL per second: {:.1} transactions{}, {:.0} bytes of WAL.",
                rest.seconds,
                rest.machine_busy_pct,
                c.product,
                c.postgres,
                c.harness,
                c.broker,
                pg.transactions_per_s,
                match (pg.statements_per_s, pg.round_trips_per_s) {
                    (Some(st), Some(rt)) => format!(", {st:.1} statements, {rt:.1} round trips"),
                    _ => String::new(),
                },
                pg.wal_bytes_per_s
            );
            if !pg.top.is_empty() {
                let _ = writeln!(s, "\n| Calls/s at rest | Exec ms/s | Statement |\n|---|---|---|");
                for t in pg.top.iter().take(12) {
                    let _ = writeln!(
                        s,
                        "| {:.2} | {:.3} | `{}` |",
                        t.calls_per_s,
                        t.exec_ms_per_s,
                        t.query.replace('|', "\\|")
                    );
                }
            }
        }
        if let Some(pg) = &p3.postgres_per_order {
            let _ = writeln!(
                s,
                "\nPostgreSQL per ticketed order: {:.1} transactions{}; {:.0} bytes of WAL (the whole server's).",
                pg.transactions,
                match (pg.statements, pg.round_trips, &pg.statements_unavailable) {
                    (Some(st), Some(rt), _) => format!(
                        ", {st:.1} statements, {rt:.1} round trips (pg_stat_statements; besides them PostgreSQL ran {:.1} \
                         statements of the region lease's check at commit), {:.2} ms of statement execution",
                        pg.commit_trigger_statements.unwrap_or(0.0),
                        pg.exec_ms.unwrap_or(0.0)
                    ),
                    (_, _, Some(why)) => format!("; statements not counted: {why}"),
                    _ => String::new(),
                },
                pg.wal_bytes
            );
            if !pg.top.is_empty() {
                let _ = writeln!(s, "\n| Calls/order | Exec ms/order | Statement |\n|---|---|---|");
                for t in &pg.top {
                    let _ = writeln!(
                        s,
                        "| {:.2} | {:.3} | `{}`{} |",
                        t.calls_per_order,
                        t.exec_ms_per_order,
                        t.query.replace('|', "\\|"),
                        if super::procs::is_commit_trigger(&t.query) {
                            " (at commit, not a round trip)"
                        } else {
                            ""
                        }
                    );
                }
            }
        }
        if p3.analyzed_every_5s {
            let _ = writeln!(
                s,
                "\nThe server's autovacuum is off: the bench ran VACUUM (ANALYZE) on the purchase tables every 5 s, as autovacuum would."
            );
        }
    }
    if let Some(p4) = &r.p4 {
        let _ = writeln!(s, "\n## P4: relay publish\n");
        let _ = writeln!(
            s,
            "{} outbox rows (filled in {:.1} s) published in {:.2} s by one relay with batches of {}: **{:.0} events/s**; drained: {}.",
            p4.events, p4.fill_seconds, p4.drain_seconds, p4.relay_batch, p4.events_per_s, p4.drained
        );
    }
    s
}

/// Draws P3's offered rate, holds/s and hold p99 per second into `path` (PNG).
pub fn chart(p3: &P3Result, rec: Option<&Recommendation>, path: &Path) -> anyhow::Result<()> {
    use plotters::prelude::*;
    register_font();
    let root = BitMapBackend::new(path, (1200, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(perr)?;
    let secs = &p3.seconds;
    let t_max = (secs.len().max(1)) as f64;
    let y_max = secs
        .iter()
        .map(|s| s.offered_rate.max(s.holds as f64))
        .chain(p3.samples.windows(2).map(|w| ticketed_rate(&w[0], &w[1])))
        .fold(10.0, f64::max)
        * 1.1;
    let p99_max = secs.iter().map(|s| s.hold_p99_ms).fold(10.0, f64::max) * 1.1;
    let title = match rec {
        Some(r) => format!("P3: arrivals, holds/s, ticketed/s and hold p99 (R = {:.0}/s)", r.r_per_s),
        None => "P3: arrivals, holds/s, ticketed/s and hold p99".into(),
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .right_y_label_area_size(60)
        .build_cartesian_2d(0f64..t_max, 0f64..y_max)
        .map_err(perr)?
        .set_secondary_coord(0f64..t_max, 0f64..p99_max);
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("per second")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(perr)?;
    chart
        .configure_secondary_axes()
        .y_desc("hold p99, ms")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(perr)?;
    chart
        .draw_series(LineSeries::new(
            secs.iter().map(|s| (s.t_s as f64, s.offered_rate)),
            RGBColor(150, 150, 150).stroke_width(6),
        ))
        .map_err(perr)?
        .label("offered arrivals/s (R)")
        .legend(|(x, y)| {
            PathElement::new(vec![(x, y), (x + 20, y)], RGBColor(150, 150, 150).stroke_width(6))
        });
    chart
        .draw_series(LineSeries::new(
            secs.iter().map(|s| (s.t_s as f64, s.holds as f64)),
            BLUE.stroke_width(2),
        ))
        .map_err(perr)?
        .label("holds/s")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    chart
        .draw_series(LineSeries::new(
            p3.samples.windows(2).map(|w| (w[1].t_s, ticketed_rate(&w[0], &w[1]))),
            GREEN.stroke_width(2),
        ))
        .map_err(perr)?
        .label("ticketed/s")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], GREEN.stroke_width(2)));
    chart
        .draw_secondary_series(LineSeries::new(
            secs.iter().map(|s| (s.t_s as f64, s.hold_p99_ms)),
            RED.stroke_width(2),
        ))
        .map_err(perr)?
        .label("hold p99, ms (right axis)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(perr)?;
    root.present().map_err(perr)?;
    Ok(())
}

fn perr<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing the chart: {e}")
}

fn ticketed_rate(a: &super::p3::P3Sample, b: &super::p3::P3Sample) -> f64 {
    if b.t_s > a.t_s && a.ticketed >= 0 && b.ticketed >= 0 {
        (b.ticketed - a.ticketed) as f64 / (b.t_s - a.t_s)
    } else {
        0.0
    }
}

/// Registers a system TrueType font as plotters' `sans-serif` (the `ab_glyph` text backend
/// has no fonts of its own). Without one the chart still renders, without text.
fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        const CANDIDATES: [&str; 3] = [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        ];
        for p in CANDIDATES {
            if let Ok(bytes) = std::fs::read(p) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, bytes)
                    .is_ok()
                {
                    return;
                }
            }
        }
        tracing::warn!("no DejaVuSans.ttf found: the chart has no text (install fonts-dejavu-core)");
    });
}
