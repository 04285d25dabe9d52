//! `boxoffice`: the product binary, every role and the operator's commands. See `boxoffice
//! --help`. Load generation, benchmarks, the chaos drill and the Stripe simulator's server
//! live in `boxoffice-drills` (crate `crates/drills`).

use boxoffice::commands;
use boxoffice::config::{Config, Environment};
use boxoffice::runtime::Role;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "boxoffice", version, about = "Event-driven reserved-seat ticketing backend")]
struct Cli {
    /// TOML configuration file (defaults, then this file, then BOXOFFICE_* variables).
    #[arg(long, global = true, env = "BOXOFFICE_CONFIG")]
    config: Option<PathBuf>,
    /// Run against this purchase cell only (an entry of `cells`): its database, topics,
    /// consumer groups and Redis keys, and no other cell's (e.g. `serve --cell cell-2`).
    #[arg(long, global = true, env = "BOXOFFICE_CELL")]
    cell: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create the database if needed, apply migrations, and create topics when a broker is configured.
    Migrate,
    /// Run roles until SIGTERM / ctrl-c.
    Serve {
        /// Comma-separated roles: api, relay, saga, payments, expiry, tickets, and router (the
        /// purchase-cell router, see the README's "Purchase cells").
        #[arg(long, value_delimiter = ',', default_value = "api,relay,saga,payments,expiry,tickets")]
        roles: Vec<Role>,
    },
    /// Create an event with a reserved-seating venue (idempotent).
    SeedVenue {
        /// Event name, unique; seeding the same name again keeps the event, its venue and
        /// seats (the id is random and printed), and applies the window and limit options
        /// given.
        #[arg(long, default_value = "Arena Onsale")]
        name: String,
        /// A small venue `SECTIONS,ROWS,SEATS` instead of the 18,000-seat arena.
        #[arg(long)]
        small: Option<commands::VenueSize>,
        /// When sales open, RFC 3339 (a new event: now).
        #[arg(long)]
        opens_at: Option<chrono::DateTime<chrono::Utc>>,
        /// When sales close, RFC 3339 (a new event: never).
        #[arg(long)]
        closes_at: Option<chrono::DateTime<chrono::Utc>>,
        /// Seats one buyer may have across active holds, live orders and tickets (a new
        /// event: 8).
        #[arg(long)]
        max_seats_per_buyer: Option<i32>,
        /// Active holds one buyer may have at once (a new event: 1).
        #[arg(long)]
        max_active_holds_per_buyer: Option<i32>,
    },
    /// Check every invariant against the ledger, the payment provider (when a Stripe API base
    /// is configured) and the dead-letter topic (when a broker is configured); exit 1 on any
    /// violation, 2 when a configured check could not run.
    Audit {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Orders in a non-final state longer than this count as stuck, ms.
        #[arg(long, default_value_t = 600_000)]
        stuck_after_ms: i64,
        /// Restrict the ledger and provider checks to one event.
        #[arg(long)]
        event: Option<uuid::Uuid>,
        /// Provider checks cover PaymentIntents created since then: RFC 3339 or a duration
        /// before now (`2h`, `7d`). Default: 8 days, longer than an authorization lives.
        #[arg(long)]
        since: Option<String>,
        /// Do not call the payment provider (its checks are reported as not checked).
        #[arg(long)]
        skip_provider: bool,
    },
    /// Compare the provider's PaymentIntents created in a window with the ledger and print
    /// the drift; with --fix, write the facts that close it to the outbox. Exit 1 when drift
    /// remains, 2 when the provider or the ledger could not be read.
    Reconcile {
        /// Start of the window: RFC 3339 (`2025-03-01T12:00:00Z`) or a duration before now
        /// (`90m`, `2h`, `1d`).
        #[arg(long)]
        since: String,
        /// End of the window (same forms); default now.
        #[arg(long)]
        until: Option<String>,
        /// Write the closing facts (PaymentAuthorized, PaymentCaptured, PaymentCanceled,
        /// PaymentRefunded) to the outbox, one transaction per PaymentIntent; and, first,
        /// resolve the early webhooks left pending beside their payment row, of any age (the
        /// window does not bound these), asking for a re-fetch of their PaymentIntents.
        #[arg(long)]
        fix: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print one order's story: every fact, status change, webhook and incident, step by step
    /// with who ran each, the provider's view of its PaymentIntents and the steps slower
    /// than their SLO. Exit 1 when the ledger has no such order.
    Timeline {
        /// The order id.
        order: uuid::Uuid,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Do not ask the payment provider.
        #[arg(long)]
        skip_provider: bool,
        /// A fact published later than this after its commit is marked, ms.
        #[arg(long, default_value_t = 1_000)]
        publish_slo_ms: i64,
        /// A fact applied later than this after its commit is marked, ms.
        #[arg(long, default_value_t = 2_000)]
        step_slo_ms: i64,
    },
    /// Print a buyer bearer token signed with the HS256 `user_jwt_secret` (development only;
    /// production tokens come from the identity provider).
    UserToken {
        /// The user id (default: a new random one).
        #[arg(long)]
        user: Option<uuid::Uuid>,
        /// Lifetime, seconds.
        #[arg(long, default_value_t = 3_600)]
        ttl_s: i64,
    },
    /// The waiting room (Redis): schedule an onsale's opening, release, inspect, revoke.
    Waitroom {
        #[command(subcommand)]
        action: WaitroomAction,
    },
    /// Write a new Ed25519 admission-token key pair: `<out>/<kid>.pem` (private, mode 0600)
    /// and `<out>/<kid>.pub.pem` (public, for `admission_public_keys` during a rotation).
    AdmissionKeygen {
        /// The new key's id.
        #[arg(long)]
        kid: String,
        /// Directory to write the two files into.
        #[arg(long, default_value = ".")]
        out: std::path::PathBuf,
    },
    /// Tickets: put a voided ticket's seats back on sale.
    Tickets {
        #[command(subcommand)]
        action: TicketsAction,
    },
    /// Dead letters: list them, or re-inject them into their source topic after a fix.
    Dlq {
        #[command(subcommand)]
        action: DlqAction,
    },
    /// Outbox rows the producer refused (parked): list them, or have the relay try them again
    /// after a fix.
    Outbox {
        #[command(subcommand)]
        action: OutboxAction,
    },
    /// Topic management.
    Topics {
        #[command(subcommand)]
        action: TopicsAction,
    },
    /// Purchase cells: the event directory (control database) and moves between cells.
    Cells {
        #[command(subcommand)]
        action: CellsAction,
    },
    /// Warm-region failover (design §15): the region epoch, the witness, the runbook.
    Region {
        #[command(subcommand)]
        action: RegionAction,
    },
}

#[derive(Subcommand)]
enum RegionAction {
    /// Create the witness database (`witness_database_url`) and name this configuration's
    /// region and epoch as the one that writes, unless one is named already.
    Init,
    /// Print the ledger's epoch record and lease, replication role and lag (bytes, seconds),
    /// and the witness's authority and live leases. Exit 0 when this configuration may write,
    /// 1 when it may not, 2 when the ledger or the witness could not be read.
    Status {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run from the region taking over: name it at the witness at the next epoch (the old
    /// region's leases stop renewing), fence the old primary when reachable
    /// (`region_peer_database_url`: epoch bumped, application role read-only, sessions
    /// terminated), and record this replica's recovery point.
    Fence {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// After `fence`: wait until the old leases have lapsed plus the skew margin, promote this
    /// replica, fence its ledger at the new epoch; start the services with the printed epoch.
    Promote {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Mark every outbox row created since the recovery point (or `--since`) minus
    /// `region_republish_margin_ms` unpublished: the relay republishes them and the inboxes
    /// absorb the duplicates.
    Republish {
        /// RFC 3339 or a duration before now (`10m`); default: the recovery point the fence
        /// recorded.
        #[arg(long)]
        since: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum CellsAction {
    /// Print the directory and each cell's own view of its events.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Put a new event (seeded in the cell: `boxoffice --cell C seed-venue`) in the directory,
    /// in the cell named by `--cell` (required here).
    Assign {
        /// The event.
        #[arg(long)]
        event: uuid::Uuid,
    },
    /// Move an event to another cell: freeze it (new holds get 503 `event_moving`), wait for
    /// its open orders to settle, copy it, bump the directory epoch, sell it there.
    Move {
        /// The event.
        #[arg(long)]
        event: uuid::Uuid,
        /// The target cell.
        #[arg(long)]
        to: String,
        /// Longest wait for the event's open orders to settle; past it the move is undone.
        #[arg(long, default_value = "15m", value_parser = humantime::parse_duration)]
        settle_timeout: std::time::Duration,
    },
}

#[derive(Subcommand)]
enum TicketsAction {
    /// Put the seats of an order's voided tickets (full refund, lost dispute) back on sale; the
    /// tickets stay void. Refused while a ticket of the order is valid. Exit 1 when nothing was
    /// released.
    Resell {
        /// The order.
        #[arg(long)]
        order: uuid::Uuid,
    },
}

#[derive(Subcommand)]
enum DlqAction {
    /// Print every dead letter (id = partition:offset, consumer, error code, source).
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Re-inject dead letters into their source topic (all, or the given ids); consumers'
    /// inboxes make this safe to repeat.
    Replay {
        /// `partition:offset` ids from `dlq list`.
        #[arg(long = "id")]
        ids: Vec<String>,
    },
}

#[derive(Subcommand)]
enum OutboxAction {
    /// Print every parked row (event id, order, type, when it was refused and why, with the
    /// message's size, its next try, the other facts of its order waiting with it); exit 1
    /// when there is one, 2 when they could not be read.
    Parked {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Have the relay try parked orders again now (those of the given event ids, or --all),
    /// once their cause is fixed; a row refused again is parked again. Exit 1 when an id named
    /// is not a parked row (each such id is printed), 2 on error.
    Retry {
        /// An event id from `outbox parked`; repeat `--id` for several.
        #[arg(long = "id", required_unless_present = "all", conflicts_with = "all")]
        ids: Vec<uuid::Uuid>,
        /// Every parked row.
        #[arg(long)]
        all: bool,
    },
}

#[derive(Subcommand)]
enum WaitroomAction {
    /// Open the event's onsale at `--opens-at`: joins before then wait in a pre-queue that is
    /// shuffled into the queue at the opening (without it, the queue is first-come-first-served).
    Schedule {
        /// The event.
        #[arg(long)]
        event: uuid::Uuid,
        /// Opening time, RFC 3339 (e.g. 2026-06-01T10:00:00Z): written to the waiting room
        /// first (it refuses once the queue has opened), then to the ledger (the hold
        /// transaction's authority, from which joins rewrite a forgotten schedule).
        #[arg(long)]
        opens_at: chrono::DateTime<chrono::Utc>,
        /// Closing time, RFC 3339; none by default.
        #[arg(long)]
        closes_at: Option<chrono::DateTime<chrono::Utc>>,
        /// Seed of the pre-queue draw (reproducible order); default: a random secret.
        #[arg(long)]
        seed: Option<String>,
    },
    /// Admit the next N live positions of the event now.
    Release {
        /// The event.
        #[arg(long)]
        event: uuid::Uuid,
        /// How many.
        #[arg(long)]
        n: u32,
    },
    /// Print the event's queue counts.
    Stats {
        /// The event.
        #[arg(long)]
        event: uuid::Uuid,
    },
    /// Revoke an admission token by its jti until its expiry (unix seconds): recorded in
    /// PostgreSQL, then in Redis. Exit 1 if either failed (re-run it: it is idempotent).
    Revoke {
        /// The token's jti (its queue ticket).
        #[arg(long)]
        jti: uuid::Uuid,
        /// The token's exp, unix seconds.
        #[arg(long)]
        until: i64,
    },
}

#[derive(Subcommand)]
enum TopicsAction {
    /// Create every topic with the configured partition count (existing ones are left alone).
    Create,
}

async fn waitroom(cfg: &Config, action: WaitroomAction) -> anyhow::Result<()> {
    let room = boxoffice::runtime::waitroom(cfg)?;
    let event = |e: uuid::Uuid| boxoffice_domain::EventId(e);
    match action {
        WaitroomAction::Schedule { event: e, opens_at, closes_at, seed } => {
            // The waiting room first: it refuses once the queue has opened, and then nothing
            // may change (a later opening in the ledger would admit the queue early).
            let pool = commands::migrate_db(cfg).await?;
            if !boxoffice_store::venue::event_exists(&pool, event(e)).await? {
                anyhow::bail!("no event {e}");
            }
            room.schedule(event(e), opens_at, seed.as_deref()).await?;
            let window = boxoffice_store::venue::SalesWindow { opens_at: Some(opens_at), closes_at };
            boxoffice_store::venue::schedule_sales(&pool, event(e), window).await?;
            println!("event {e} opens at {opens_at}");
        }
        WaitroomAction::Release { event: e, n } => {
            let r = room.release(event(e), n, None).await?;
            println!(
                "admitted {}, lapsed {}, queued {}, pre-queued {}, admitted slots running {}",
                r.admitted.len(),
                r.abandoned,
                r.queued,
                r.pre_queued,
                r.admitted_live
            );
        }
        WaitroomAction::Stats { event: e } => {
            let s = room.stats(event(e)).await?;
            println!(
                "queued {}, pre-queued {}, admitted slots running {}",
                s.queued, s.pre_queued, s.admitted_live
            );
        }
        WaitroomAction::Revoke { jti, until } => {
            let pool = boxoffice_store::connect(cfg.pg_options()?, 1, cfg.db_acquire_timeout_ms).await?;
            boxoffice_api::revocation::revoke(&pool, &room, jti, until).await?;
            println!("revoked {jti} until {until}");
        }
    }
    Ok(())
}

fn print<T: serde::Serialize + std::fmt::Debug>(json: bool, v: &T) {
    if json {
        println!("{}", serde_json::to_string_pretty(v).expect("serializes"));
    } else {
        println!("{v:#?}");
    }
}

async fn region(cfg: &Config, action: RegionAction) -> anyhow::Result<i32> {
    use boxoffice::region as r;
    match action {
        RegionAction::Init => {
            let a = r::init(cfg).await?;
            println!("the witness names region {} at epoch {} (since {})", a.region, a.epoch, a.changed_at);
            Ok(0)
        }
        RegionAction::Status { json } => match r::status(cfg).await {
            Ok(s) => {
                if json {
                    print(true, &s);
                } else {
                    print!("{}", r::render_status(&s));
                }
                Ok(if s.writable { 0 } else { 1 })
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                Ok(2)
            }
        },
        RegionAction::Fence { json } => {
            let f = r::fence(cfg).await?;
            print(json, &f);
            if !json {
                println!(
                    "region {} holds epoch {}; promotion may proceed in {} ms: run `region promote`",
                    f.authority.region, f.authority.epoch, f.ms_until_clear
                );
            }
            Ok(0)
        }
        RegionAction::Promote { json } => {
            let p = r::promote(cfg).await?;
            print(json, &p);
            if !json {
                println!(
                    "start this region's services with BOXOFFICE_REGION={} BOXOFFICE_REGION_EPOCH={}, then `region republish`",
                    p.writer.region, p.writer.epoch
                );
            }
            Ok(0)
        }
        RegionAction::Republish { since, json } => {
            let since = since
                .as_deref()
                .map(|s| boxoffice::reconcile::parse_instant(s, chrono::Utc::now()))
                .transpose()?;
            let rep = r::republish(cfg, since).await?;
            print(json, &rep);
            Ok(0)
        }
    }
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    if let Command::AdmissionKeygen { kid, out } = &cli.command {
        // Needs no configuration: keys are made before there is a production one.
        match commands::admission_keygen(kid, out) {
            Ok(()) => std::process::exit(0),
            Err(e) => {
                eprintln!("error: {e:#}");
                std::process::exit(1);
            }
        }
    }
    // Every command of the product binary holds the configuration to production's rules
    // unless `env` / BOXOFFICE_ENV says development: a refusal exits 2, naming each setting.
    let cfg = match Config::load(cli.config.as_deref(), Environment::Production) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    };
    // `--cell`: this process is one cell's, holding that cell's database URL and no other
    // (the `cells` commands are the operator's across cells and read every one).
    let cfg = match (&cli.cell, &cli.command) {
        // `cells assign --cell C`: the operator's command, whose argument is the cell.
        (_, Command::Cells { action: CellsAction::Assign { .. } }) => cfg,
        (Some(cell), Command::Cells { .. }) => {
            eprintln!("error: --cell {cell}: the cells commands work across cells; drop --cell");
            std::process::exit(2);
        }
        (Some(cell), _) => match cfg.for_cell(cell) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("error: {e:#}");
                std::process::exit(2);
            }
        },
        (None, _) => cfg,
    };
    let role_names: Vec<&str> = match &cli.command {
        Command::Serve { roles } => roles.iter().map(|r| r.name()).collect(),
        _ => Vec::new(),
    };
    boxoffice::telemetry::init(&cfg, "info,sqlx=warn,rdkafka=warn", &role_names);
    let result: anyhow::Result<i32> = match cli.command {
        Command::Migrate => commands::migrate(&cfg).await.map(|_| 0),
        Command::Serve { roles } => commands::serve(&cfg, &roles).await.map(|_| 0),
        Command::SeedVenue {
            name,
            small,
            opens_at,
            closes_at,
            max_seats_per_buyer,
            max_active_holds_per_buyer,
        } => {
            let rules =
                commands::EventRules { opens_at, closes_at, max_seats_per_buyer, max_active_holds_per_buyer };
            commands::seed_venue(&cfg, &name, small, &rules).await.map(|_| 0)
        }
        Command::Audit { json, stuck_after_ms, event, since, skip_provider } => {
            match commands::audit_options(&cfg, stuck_after_ms, event, since.as_deref(), skip_provider) {
                Ok(opts) => commands::audit(&cfg, json, &opts).await,
                Err(e) => Err(e),
            }
        }
        Command::Timeline { order, json, skip_provider, publish_slo_ms, step_slo_ms } => {
            let slo = boxoffice_store::timeline::Slo { publish_ms: publish_slo_ms, step_ms: step_slo_ms };
            commands::timeline(&cfg, order, json, skip_provider, slo).await
        }
        Command::Reconcile { since, until, fix, json } => {
            commands::reconcile(&cfg, &since, until.as_deref(), fix, json).await
        }
        Command::Tickets { action: TicketsAction::Resell { order } } => {
            commands::tickets_resell(&cfg, boxoffice_domain::OrderId(order)).await
        }
        Command::Topics { action: TopicsAction::Create } => commands::topics_create(&cfg).await.map(|_| 0),
        Command::Dlq { action: DlqAction::List { json } } => commands::dlq_list(&cfg, json).await.map(|_| 0),
        Command::Dlq { action: DlqAction::Replay { ids } } => {
            commands::dlq_replay(&cfg, &ids).await.map(|_| 0)
        }
        // Exit 1 means "parked rows exist": a failure to read them is 2.
        Command::Outbox { action: OutboxAction::Parked { json } } => {
            commands::outbox_parked(&cfg, json).await.or_else(|e| {
                eprintln!("error: {e:#}");
                Ok(2)
            })
        }
        // Exit 1 means "an id is not parked": a failure is 2.
        Command::Outbox { action: OutboxAction::Retry { ids, all } } => {
            commands::outbox_retry(&cfg, &ids, all).await.or_else(|e| {
                eprintln!("error: {e:#}");
                Ok(2)
            })
        }
        Command::Waitroom { action } => waitroom(&cfg, action).await.map(|_| 0),
        Command::Cells { action: CellsAction::List { json } } => boxoffice::cells::list(&cfg, json).await,
        Command::Cells { action: CellsAction::Assign { event } } => match &cli.cell {
            Some(cell) => boxoffice::cells::assign(&cfg, event, cell).await,
            None => Err(anyhow::anyhow!("cells assign needs --cell C: the cell that sells the event")),
        },
        Command::Cells { action: CellsAction::Move { event, to, settle_timeout } } => {
            boxoffice::cells::move_event(&cfg, event, &to, settle_timeout).await.map(|r| {
                println!(
                    "event {} moved {} → {} at directory epoch {}: {} seats ({} sold stay with their orders), no holds for {} ms",
                    r.event_id, r.from, r.to, r.directory_epoch, r.seats, r.sold_seats, r.frozen_ms
                );
                0
            })
        }
        Command::Region { action } => region(&cfg, action).await,
        Command::AdmissionKeygen { .. } => unreachable!("handled before the configuration is loaded"),
        Command::UserToken { user, ttl_s } if cfg.env == Environment::Development => {
            let user = boxoffice_domain::UserId(user.unwrap_or_else(uuid::Uuid::new_v4));
            println!("{}", boxoffice::runtime::user_tokens(&cfg).issue(user, ttl_s));
            Ok(0)
        }
        Command::UserToken { .. } => Err(anyhow::anyhow!(
            "user-token mints HS256 development tokens, which production refuses: set BOXOFFICE_ENV=development"
        )),
    };
    // The last spans (a graceful stop's included) before the process exits.
    boxoffice::telemetry::shutdown().await;
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
