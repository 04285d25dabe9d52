//! `boxoffice-drills`: the onsale load generator, the capacity bench, the chaos drill and the
//! Stripe simulator's server, apart from the product binary. See `boxoffice-drills --help`.

use boxoffice::config::{Config, Environment};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "boxoffice-drills",
    version,
    about = "Load generation, capacity bench, chaos drill and Stripe simulator for boxoffice"
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
    /// Run the Stripe simulator.
    StripeSim {
        /// Listen address.
        #[arg(long, default_value = "127.0.0.1:12111")]
        bind: String,
        /// Where to deliver signed webhooks, e.g. http://127.0.0.1:8080/webhooks/stripe.
        #[arg(long)]
        webhook_url: Option<String>,
    },
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
    let quiet = !matches!(cli.command, Command::StripeSim { .. });
    boxoffice::runtime::init_logging(
        &cfg,
        if quiet { "warn,sqlx=error" } else { "info,sqlx=warn,rdkafka=warn" },
    );
    let result: anyhow::Result<i32> = match cli.command {
        Command::Onsale(args) => boxoffice_drills::onsale::run(cfg, args).await,
        Command::Bench(args) => boxoffice_drills::bench::run(cfg, args).await,
        Command::Chaos(args) => boxoffice_drills::chaos::run(cfg, args).await,
        Command::StripeSim { bind, webhook_url } => {
            boxoffice_drills::stripe_sim::serve(&cfg, &bind, webhook_url).await.map(|_| 0)
        }
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
