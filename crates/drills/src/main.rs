//! `boxoffice-drills`: the onsale load generator, the capacity bench, the chaos and cell-outage
//! drills and the Stripe simulator's server, apart from the product binary. See
//! `boxoffice-drills --help`.

use boxoffice::config::{Config, Environment};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "boxoffice-drills",
    version,
    about = "Load generation, capacity bench, chaos and cell-outage drills and Stripe simulator for boxoffice"
)]
struct Cli {
    /// TOML configuration file (defaults, then this file, then BOXOFFICE_* variables): the
    /// same configuration the product binary reads.
    #[arg(long, global = true, env = "BOXOFFICE_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a whole onsale with simulated buyers and print the report (the main job).
    Onsale(boxoffice_drills::onsale::OnsaleArgs),
    /// Measure capacity (design §12): hold tps vs pgbench (P1), waiting-room attempts/s (P2),
    /// end-to-end ticketed orders/s (P3), relay events/s (P4); recommend the release rate R.
    /// Writes report.json, report.md and chart.png.
    Bench(boxoffice_drills::bench::BenchArgs),
    /// Run an onsale with every role as its own process (two of each) under a seeded schedule
    /// of crashes and outages (kill -9, broker and PostgreSQL restarts, Stripe faults,
    /// duplicate webhooks), then drain and audit; exit 1 on any violation.
    Chaos(boxoffice_drills::chaos::ChaosArgs),
    /// Run two purchase cells side by side (design §13) and cut one off its database for a
    /// while behind a TCP kill switch: the other must keep selling at its rate, the cut one
    /// must recover, and both audits must be clean; exit 1 otherwise, 2 when a check could
    /// not run.
    Cells(boxoffice_drills::cells::CellsArgs),
    /// The drills that build their own infrastructure (`drill failover`).
    Drill {
        #[command(subcommand)]
        which: DrillKind,
    },
    /// Run the Stripe simulator.
    StripeSim {
        /// Listen address.
        #[arg(long, default_value = "127.0.0.1:12111")]
        bind: String,
        /// Where to deliver signed webhooks, e.g. http://127.0.0.1:8080/webhooks/stripe.
        #[arg(long)]
        webhook_url: Option<String>,
    },
    /// Run an OTLP/gRPC receiver that counts and discards spans (the far end for measuring
    /// the cost of tracing: point a run's `BOXOFFICE_OTLP_ENDPOINT` at the endpoint it
    /// prints); prints the spans received when stopped (Ctrl-C / SIGTERM).
    OtlpSink,
}

#[derive(Subcommand)]
enum DrillKind {
    /// Warm-region failover (design §15): a primary PostgreSQL cluster and a streaming replica
    /// made for the run, a broker per region, buyers buying; replication is cut, the primary
    /// region fails, the runbook (`region fence`, `promote`, `republish`, synthetic checks,
    /// `reconcile`) promotes the DR region, and the old primary returns as a zombie. Reports
    /// RPO (acknowledged holds lost, WAL bytes and seconds behind), RTO, old-epoch writes
    /// accepted and the audit; exit 1 when an old-epoch write was accepted or the audit is not
    /// clean, 2 when the drill could not run. Needs root (pg_createcluster).
    Failover(boxoffice_drills::failover::FailoverArgs),
}

/// `otlp-sink`: see [`Command::OtlpSink`].
async fn otlp_sink() -> anyhow::Result<i32> {
    let mut sink = fake_opentelemetry_collector::FakeCollectorServer::start()
        .await
        .map_err(|e| anyhow::anyhow!("starting the OTLP receiver: {e}"))?;
    println!("endpoint {}", sink.endpoint());
    let mut received = 0usize;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            spans = sink.exported_spans(1, std::time::Duration::from_millis(200)) => received += spans.len(),
        }
    }
    received += sink.exported_spans(0, std::time::Duration::ZERO).await.len();
    println!("spans {received}");
    Ok(0)
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    // The drills run in development unless `env` / BOXOFFICE_ENV says otherwise.
    let cfg = match Config::load(cli.config.as_deref(), Environment::Development) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    };
    // sqlx reports slow statements at WARN; the drills stay quiet so their reports are readable.
    // The cells drill's cut-off cell answers every buyer request with a logged 503 on purpose.
    let filter = match cli.command {
        Command::StripeSim { .. } => "info,sqlx=warn,rdkafka=warn",
        Command::Cells(_) => "warn,sqlx=error,boxoffice_api::problem=error",
        // The fenced region refuses every write on purpose, each refusal logged.
        Command::Drill { .. } => "error,boxoffice_drills=info",
        _ => "warn,sqlx=error",
    };
    boxoffice::runtime::init_logging(&cfg, filter);
    let result: anyhow::Result<i32> = match cli.command {
        Command::Onsale(args) => boxoffice_drills::onsale::run(cfg, args).await,
        Command::Bench(mut args) => {
            args.config_file = cli.config.clone();
            boxoffice_drills::bench::run(cfg, args).await
        }
        Command::Chaos(args) => boxoffice_drills::chaos::run(cfg, args).await,
        Command::Cells(args) => boxoffice_drills::cells::run(cfg, args).await,
        Command::Drill { which: DrillKind::Failover(args) } => {
            boxoffice_drills::failover::run(cfg, args).await
        }
        Command::StripeSim { bind, webhook_url } => {
            boxoffice_drills::stripe_sim::serve(&cfg, &bind, webhook_url).await.map(|_| 0)
        }
        Command::OtlpSink => otlp_sink().await,
    };
    boxoffice::telemetry::shutdown().await;
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
