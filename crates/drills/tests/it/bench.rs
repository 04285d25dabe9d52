//! `boxoffice-drills bench` as a smoke test: every phase with `--quick` sizes against the test
//! PostgreSQL, Redis and broker. Asserts the report files exist and hold every phase, that
//! P1 found no oversold seat and lost no hold, and that P3 and P4 drained; never speed.

use crate::helpers::{product_bin, test_brokers, test_redis_url};
use boxoffice::config::Config;
use boxoffice_drills::bench::{self, report, BenchArgs};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::ConnectOptions;

#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn quick_bench_reports_every_phase_without_oversell(_: PgPoolOptions, opts: PgConnectOptions) {
    let out = std::env::temp_dir().join(format!("boxoffice-bench-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&out).unwrap();
    // A setting only the file names: P3's product process must read the same file.
    let file = out.join("bench.toml");
    std::fs::write(&file, "log_format = \"json\"\n").unwrap();
    let cfg = Config {
        database_url: opts.to_url_lossy().to_string().into(),
        kafka_brokers: Some(test_brokers()),
        kafka_partitions: 4,
        redis_url: test_redis_url().into(),
        log_format: "json".into(),
        ..Config::default()
    };
    let args = BenchArgs {
        config_file: Some(file),
        quick: true,
        out: out.clone(),
        boxoffice_bin: Some(product_bin()),
        drills_bin: Some(env!("CARGO_BIN_EXE_boxoffice-drills").into()),
        ..BenchArgs::defaults()
    }
    .resolved();
    let r = bench::run_phases(cfg, &args).await.expect("bench runs");
    let files = report::write(&r, &out).expect("report written");
    assert_eq!(files.len(), 3, "report.json, report.md, chart.png: {files:?}");
    for f in &files {
        assert!(std::fs::metadata(f).expect("file exists").len() > 0, "{} is empty", f.display());
    }

    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    for phase in ["p1", "p2", "p3", "p4"] {
        assert!(json[phase].is_object(), "report.json lacks {phase}");
    }
    let p1 = r.p1.as_ref().unwrap();
    assert_eq!(p1.levels.len(), 2);
    assert!(p1.levels.iter().all(|l| l.holds > 0), "every P1 level created holds: {:?}", p1.levels);
    assert_eq!(p1.oversold_seats, 0, "invariant 1: no seat held or sold twice");
    assert_eq!(p1.hold_count_mismatch, 0, "one hold row per successful hold transaction");
    assert!(p1.levels.iter().all(|l| l.pgbench_tps.is_some()), "pgbench ran: {:?}", p1.pgbench_error);
    assert!(json["p1"]["best_ratio"].is_number(), "report.json key p1.best_ratio");
    let p2 = r.p2.as_ref().unwrap();
    assert!(p2.levels.iter().any(|l| l.path == "http" && l.attempts > 0));
    assert!(p2.levels.iter().any(|l| l.path == "library" && l.attempts > 0));
    let p3 = r.p3.as_ref().unwrap();
    assert!(p3.drained, "every P3 order reached a final state and the outbox emptied");
    assert!(
        p3.holds > 0 && p3.ticketed == p3.confirmed as i64,
        "{} ticketed of {} paid",
        p3.ticketed,
        p3.confirmed
    );
    assert_eq!(p3.steps.len(), 2, "one ramp step and the sustained step");
    let product_log = std::fs::read_to_string(out.join("p3-processes/product.log")).unwrap();
    assert!(
        !product_log.is_empty() && product_log.lines().all(|l| l.starts_with('{')),
        "the product logs JSON as the bench's file says: {}",
        &product_log[..product_log.len().min(400)]
    );
    // The product ran as a process of its own: its CPU, PostgreSQL's and the harness's are
    // read apart, per ticketed order of the sustained step.
    assert!(p3.sustained_ticketed > 0, "the sustained step ticketed orders");
    let cpu = p3.cpu_ms_per_order.expect("CPU-ms per ticketed order");
    assert!(cpu.product > 0.0 && cpu.postgres > 0.0 && cpu.harness > 0.0, "{cpu:?}");
    assert!(
        json["p3"]["cpu_ms_per_order"]["product"].is_number(),
        "report.json key p3.cpu_ms_per_order.product"
    );
    // The harness by part. This bench uses an external broker (the test's), so no process
    // of the harness is the broker's: its part is 0 and its CPU counts as other; the
    // generator samples and drives the run, so it is never idle.
    let parts = p3.harness_cpu_ms_per_order.expect("the harness's CPU-ms per ticketed order by part");
    assert_eq!(parts.broker, 0.0, "an external broker is no part of the harness: {parts:?}");
    assert!(parts.generator > 0.0, "{parts:?}");
    assert!(p3.broker.starts_with("external"), "{}", p3.broker);
    assert_eq!(json["p3"]["harness_cpu_ms_per_order"]["broker"].as_f64(), Some(0.0));
    assert!(json["p3"]["sustained_ticketed_per_s"].is_number());
    let pg = p3.postgres_per_order.as_ref().expect("PostgreSQL per order");
    assert!(pg.transactions >= 5.0, "a ticketed order takes several transactions: {pg:?}");
    assert!(pg.wal_bytes > 1_000.0, "a ticketed order writes its rows to the WAL: {pg:?}");
    let preloaded: String = {
        let mut c = opts.connect().await.unwrap();
        sqlx::query_scalar("SELECT current_setting('shared_preload_libraries')")
            .fetch_one(&mut c)
            .await
            .unwrap()
    };
    if preloaded.contains("pg_stat_statements") {
        let (st, rt) = (pg.statements.unwrap(), pg.round_trips.unwrap());
        assert!(st >= 10.0 && rt > st, "statements {st}, round trips {rt}");
        assert!(pg.exec_ms.is_some_and(|ms| ms > 0.0), "{pg:?}");
        assert!(!pg.top.is_empty());
    } else {
        assert!(pg.statements.is_none() && pg.statements_unavailable.is_some());
    }
    // The product at rest, before the first arrival: its timers' statements alone.
    let rest = p3.at_rest.as_ref().expect("the product at rest");
    assert!(rest.seconds >= 1.0, "{rest:?}");
    assert!(rest.postgres.transactions_per_s > 0.0, "the product's timers run statements at rest: {rest:?}");
    assert!(json["p3"]["at_rest"]["cpu_ms_per_s"]["product"].is_number());
    if preloaded.contains("pg_stat_statements") {
        assert!(rest.postgres.round_trips_per_s.is_some_and(|rt| rt > 0.0) && !rest.postgres.top.is_empty());
    }
    assert!(r.recommendation.is_some());
    let p4 = r.p4.as_ref().unwrap();
    assert!(p4.drained && p4.events == 2_000);

    // The server's settings that bear on the cost are recorded beside the figures, as the
    // server states them.
    assert_eq!(
        json["machine"]["postgres_settings"]["shared_preload_libraries"].as_str(),
        Some(preloaded.as_str())
    );
    // Every setting the server has (the test's role sees them all): all of them, but the
    // module's when it is not loaded, and those are named as not read.
    let unread: Vec<&str> = if preloaded.contains("pg_stat_statements") {
        Vec::new()
    } else {
        report::SERVER_SETTINGS.iter().copied().filter(|s| s.starts_with("pg_stat_statements.")).collect()
    };
    assert_eq!(r.machine.postgres_settings_unread, unread);
    assert_eq!(
        r.machine.postgres_settings.len() + unread.len(),
        report::SERVER_SETTINGS.len(),
        "every setting read: {:?}",
        r.machine.postgres_settings
    );

    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("`shared_buffers` "), "report.md names the server's settings");
    for phase in ["| P1 |", "| P2 |", "| P3 |", "| P4 |", "Recommended R", "At rest before the first arrival"]
    {
        assert!(md.contains(phase), "report.md lacks {phase}");
    }
    std::fs::remove_dir_all(&out).unwrap();
}

/// A role that may not see every setting (`shared_preload_libraries` needs
/// `pg_read_all_settings`, as on a managed server) still gets the report's other settings;
/// the hidden one is named as not read.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_setting_hidden_from_the_role_is_named_and_the_others_are_read(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let role = format!("bo_bench_{}", uuid::Uuid::new_v4().simple());
    let mut admin = opts.connect().await.unwrap();
    sqlx::query(&format!("CREATE ROLE {role} LOGIN")).execute(&mut admin).await.unwrap();
    let as_role = opts.clone().username(&role);
    let cfg = Config { database_url: as_role.to_url_lossy().to_string().into(), ..Config::default() };
    let r = report::Report::new(&cfg, &BenchArgs::defaults().resolved(), "none").await;
    sqlx::query(&format!("DROP ROLE {role}")).execute(&mut admin).await.unwrap();
    let m = &r.machine;
    assert!(m.postgres_settings_unread.iter().any(|s| s == "shared_preload_libraries"), "{m:?}");
    assert!(!m.postgres_settings.contains_key("shared_preload_libraries"));
    assert!(
        m.postgres_settings.contains_key("shared_buffers") && m.postgres_settings.contains_key("fsync"),
        "{m:?}"
    );
    assert_eq!(m.postgres_settings.len() + m.postgres_settings_unread.len(), report::SERVER_SETTINGS.len());
    assert!(
        report::markdown(&r).contains("not read: `shared_preload_libraries`"),
        "{}",
        report::markdown(&r)
    );
}
