//! The binary's commands: migrate, serve, seed-venue, audit, reconcile, tickets resell, dlq,
//! outbox parked / retry, topics create and admission-keygen. Each returns the process exit code or an error with context.

use crate::audit;
use crate::config::Config;
use crate::reconcile::{self, Window};
use crate::runtime::{self, Role};
use anyhow::Context;
use boxoffice_payments::StripeClient;
use boxoffice_store::venue::{self, VenueSpec};
use secrecy::ExposeSecret;
use sqlx::migrate::MigrateDatabase;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// Creates the database if it does not exist and applies every migration (idempotent).
pub async fn migrate_db(cfg: &Config) -> anyhow::Result<PgPool> {
    let url = cfg.database_url.expose_secret();
    if !sqlx::Postgres::database_exists(url).await.context("connecting to PostgreSQL")? {
        sqlx::Postgres::create_database(url).await.context("creating the database")?;
    }
    let dropped = boxoffice_store::migrate(cfg.pg_options()?).await.context("applying migrations")?;
    for index in dropped {
        tracing::warn!(index, "an index a failed migration left invalid was dropped and built again");
    }
    let pool = boxoffice_store::connect(cfg.pg_options()?, cfg.db_max_connections, cfg.db_acquire_timeout_ms)
        .await?;
    Ok(pool)
}

/// `boxoffice migrate`: database migrations, then topics when a broker is configured.
pub async fn migrate(cfg: &Config) -> anyhow::Result<()> {
    migrate_db(cfg).await?;
    tracing::info!("migrations applied");
    if let Some(k) = cfg.kafka() {
        let created = boxoffice_bus::topics::create_all(&k).await?;
        tracing::info!(?created, partitions = k.partitions, "topics ready");
    }
    Ok(())
}

/// `boxoffice topics create`.
pub async fn topics_create(cfg: &Config) -> anyhow::Result<()> {
    let k = cfg.kafka().context("set BOXOFFICE_KAFKA_BROKERS to create topics")?;
    let created = boxoffice_bus::topics::create_all(&k).await?;
    println!("created: {created:?} (existing topics left as they are)");
    Ok(())
}

/// `boxoffice serve --roles …`: runs until SIGTERM / ctrl-c, then shuts down gracefully. In
/// development it first logs one warning per built-in development secret in use (see
/// [`Config::development_warnings`]).
pub async fn serve(cfg: &Config, roles: &[Role]) -> anyhow::Result<()> {
    // Production refused these at load time; development runs with them, said once each.
    for (setting, problem) in cfg.development_warnings() {
        tracing::warn!(setting, env = cfg.env.as_str(), "{setting}: {problem}; production refuses it");
    }
    let shutdown = CancellationToken::new();
    let running = runtime::start(cfg, roles, cfg.pg_options()?, shutdown.clone()).await?;
    if let Some(addr) = running.api_addr {
        tracing::info!(%addr, "api listening");
    }
    tracing::info!(?roles, "roles started");
    wait_for_signal().await;
    tracing::info!("shutting down");
    shutdown.cancel();
    running.join().await;
    Ok(())
}

/// Resolves on SIGTERM or ctrl-c.
pub async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("signal handler");
        tokio::select! { _ = ctrl_c => {}, _ = term.recv() => {} }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// A small venue size, `SECTIONS,ROWS,SEATS` on the command line (`seed-venue --small`,
/// the onsale drill's `--small-venue`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VenueSize {
    /// Sections.
    pub sections: u32,
    /// Rows per section.
    pub rows: u32,
    /// Seats per row.
    pub seats_per_row: u32,
}

impl VenueSize {
    /// The venue of this size.
    pub fn spec(self) -> VenueSpec {
        VenueSpec::small(self.sections, self.rows, self.seats_per_row)
    }
}

impl std::str::FromStr for VenueSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let v: Vec<u32> = s
            .split(',')
            .map(|p| p.trim().parse::<u32>().map_err(|e| format!("{p:?}: {e}")))
            .collect::<Result<_, _>>()?;
        match v.as_slice() {
            [a, b, c] if *a > 0 && *b > 0 && *c > 0 => Ok(Self { sections: *a, rows: *b, seats_per_row: *c }),
            _ => Err("expected SECTIONS,ROWS,SEATS, three positive numbers".into()),
        }
    }
}

/// `boxoffice seed-venue`: creates the event and its venue — `small`, or the 18,000-seat
/// arena — (idempotent); prints the event id.
pub async fn seed_venue(
    cfg: &Config,
    name: &str,
    small: Option<VenueSize>,
    rules: &EventRules,
) -> anyhow::Result<uuid::Uuid> {
    let pool = migrate_db(cfg).await?;
    let spec = small.map_or_else(VenueSpec::arena, VenueSize::spec);
    let starts = chrono::Utc::now() + chrono::Duration::days(30);
    let (event, seats) = venue::seed(&pool, name, &spec, starts, &cfg.purchase_cell).await?;
    if rules.opens_at.is_some() || rules.closes_at.is_some() {
        let window = venue::SalesWindow {
            opens_at: Some(rules.opens_at.unwrap_or_else(chrono::Utc::now)),
            closes_at: rules.closes_at,
        };
        venue::schedule_sales(&pool, event, window).await.context("setting the sales window")?;
    }
    if rules.max_seats_per_buyer.is_some() || rules.max_active_holds_per_buyer.is_some() {
        let (seats_cap, holds_cap) = venue::buyer_limits(&pool, event).await?;
        venue::set_buyer_limits(
            &pool,
            event,
            rules.max_seats_per_buyer.unwrap_or(seats_cap),
            rules.max_active_holds_per_buyer.unwrap_or(holds_cap),
        )
        .await
        .context("setting the buyer limits")?;
    }
    let venue_name = venue::venue_name(&pool, event).await?.unwrap_or_default();
    let (seats_cap, holds_cap) = venue::buyer_limits(&pool, event).await?;
    if venue_name != spec.name {
        eprintln!(
            "event \"{name}\" exists already: its venue and seats are kept ({venue_name}, not {})",
            spec.name
        );
    }
    println!(
        "event {event} \"{name}\" at {venue_name}: {seats} seats; at most {seats_cap} seats and {holds_cap} active hold(s) per buyer"
    );
    Ok(event.0)
}

/// What `seed-venue` may set on the event beside its seats; `None` keeps what the event has
/// (a new event: on sale from now, open-ended, 8 seats and 1 active hold per buyer).
#[derive(Debug, Clone, Default)]
pub struct EventRules {
    /// When sales open (RFC 3339).
    pub opens_at: Option<chrono::DateTime<chrono::Utc>>,
    /// When sales close.
    pub closes_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Seats one buyer may have across active holds, live orders and tickets.
    pub max_seats_per_buyer: Option<i32>,
    /// Active holds one buyer may have at once.
    pub max_active_holds_per_buyer: Option<i32>,
}

/// The [`audit::AuditOptions`] of `cfg`: the provider checks run when a Stripe API base is
/// configured and `skip_provider` is false, over PaymentIntents created since `since` (an
/// RFC 3339 timestamp or a duration before now, default
/// [`audit::DEFAULT_PROVIDER_WINDOW`]); the dead-letter check runs when a broker is
/// configured.
pub fn audit_options(
    cfg: &Config,
    stuck_after_ms: i64,
    event: Option<uuid::Uuid>,
    since: Option<&str>,
    skip_provider: bool,
) -> anyhow::Result<audit::AuditOptions> {
    let provider = match (cfg.stripe(), skip_provider) {
        (_, true) => Err("--skip-provider".to_owned()),
        (None, _) => Err("no Stripe API base configured".to_owned()),
        (Some(s), false) => {
            let window =
                Window::parse(since.unwrap_or(audit::DEFAULT_PROVIDER_WINDOW), None, chrono::Utc::now())?;
            Ok((StripeClient::new(s)?.with_max_in_flight(cfg.stripe_max_in_flight), window))
        }
    };
    Ok(audit::AuditOptions {
        stuck_after_ms,
        event,
        provider,
        kafka: cfg.kafka().ok_or_else(|| "no broker configured".to_owned()),
        dlq_timeout: std::time::Duration::from_secs(30),
    })
}

/// `boxoffice audit`: runs every check (ledger, provider, dead letters) and prints them as
/// text or JSON. Exit code 1 on any violation, 2 when a configured check could not run, else
/// 0. The run is recorded in `audit_runs` ([`audit::record`]); a failed write is a warning.
pub async fn audit(cfg: &Config, json: bool, opts: &audit::AuditOptions) -> anyhow::Result<i32> {
    let pool = boxoffice_store::connect(cfg.pg_options()?, 4, cfg.db_acquire_timeout_ms).await?;
    let started_at = chrono::Utc::now();
    let report = audit::run(&pool, opts).await?;
    if let Err(e) = audit::record(&pool, started_at, opts, &report).await {
        tracing::warn!(error = %e, "the audit run could not be recorded in audit_runs");
        eprintln!("warning: this run was not recorded in the ledger's audit_runs: {e}");
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&report.to_json())?);
    } else {
        print!("{}", audit::render(&report));
        println!("totals: {}", serde_json::to_string(&report.totals)?);
    }
    Ok(report.exit_code())
}

/// `boxoffice timeline ORDER_ID`: prints the order's story ([`crate::timeline::render`]) or
/// its JSON; the provider is asked unless `skip_provider` or no Stripe API base is
/// configured. Exit code 1 when the ledger has no such order.
pub async fn timeline(
    cfg: &Config,
    order: uuid::Uuid,
    json: bool,
    skip_provider: bool,
    slo: boxoffice_store::timeline::Slo,
) -> anyhow::Result<i32> {
    let pool = boxoffice_store::connect(cfg.pg_options()?, 2, cfg.db_acquire_timeout_ms).await?;
    let stripe = match (cfg.stripe(), skip_provider) {
        (Some(s), false) => Some(StripeClient::new(s)?.with_max_in_flight(cfg.stripe_max_in_flight)),
        _ => None,
    };
    let gw = stripe.as_ref().map(|s| s as &dyn boxoffice_payments::PaymentGateway);
    let Some(t) = boxoffice_api::timeline::read(&pool, gw, order, slo).await? else {
        eprintln!("no order {order} in this ledger");
        return Ok(1);
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&t)?);
    } else {
        print!("{}", crate::timeline::render(&t));
    }
    Ok(0)
}

/// `boxoffice reconcile`: compares the provider's PaymentIntents created in the window
/// (`since` / `until`: RFC 3339 or a duration before now) with the ledger and prints the
/// drift; with `fix`, writes the facts that close it to the outbox. Exit code 1 when drift
/// remains unfixed, 2 when the provider or the ledger could not be read. Errors when no
/// Stripe API base is configured.
pub async fn reconcile(
    cfg: &Config,
    since: &str,
    until: Option<&str>,
    fix: bool,
    json: bool,
) -> anyhow::Result<i32> {
    let stripe = cfg.stripe().context("set BOXOFFICE_STRIPE_API_BASE to reconcile with the provider")?;
    let stripe = StripeClient::new(stripe)?.with_max_in_flight(cfg.stripe_max_in_flight);
    let window = Window::parse(since, until, chrono::Utc::now())?;
    let pool = boxoffice_store::connect(cfg.pg_options()?, 4, cfg.db_acquire_timeout_ms).await?;
    let report = match reconcile::run(&pool, &stripe, window, fix).await {
        Ok(r) => r,
        Err(e) => {
            // Like `audit`: 2 is "the check could not run", 1 stays "drift remains".
            eprintln!("reconcile could not run: {e:#}");
            return Ok(2);
        }
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", reconcile::render(&report));
    }
    Ok(report.exit_code())
}

/// `boxoffice tickets resell --order O`: an operator's explicit choice to put the seats of the
/// order's voided tickets back on sale (case C14: never by default). In one transaction: the
/// store releases them ([`boxoffice_store::tickets::release_for_resale`]) and a
/// `SeatsReturnedToSale` fact goes to the outbox under the order's correlation id. Refused
/// (nothing written) while a ticket of the order is valid. Errors: unknown order, database.
pub async fn resell(
    pool: &PgPool,
    order: boxoffice_domain::OrderId,
) -> anyhow::Result<boxoffice_store::tickets::Resale> {
    use boxoffice_store::tickets::{self, Resale};
    let mut tx = pool.begin().await?;
    let Some((_, correlation)) = boxoffice_store::orders::amount_and_correlation(&mut *tx, order).await?
    else {
        anyhow::bail!("no order {}", order.0);
    };
    let outcome = tickets::release_for_resale(&mut tx, order).await?;
    if let Resale::Released(released) = &outcome {
        let fact = boxoffice_domain::PurchaseEvent::SeatsReturnedToSale {
            order_id: order,
            ticket_ids: released.iter().map(|r| r.0).collect(),
            seat_ids: released.iter().map(|r| r.1 .0).collect(),
        };
        boxoffice_store::outbox::insert_all(
            &mut tx,
            &[boxoffice_domain::Envelope::new(order, &fact, correlation, None)],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(outcome)
}

/// `boxoffice tickets resell`: [`resell`], printed; exit 1 when nothing was released.
pub async fn tickets_resell(cfg: &Config, order: boxoffice_domain::OrderId) -> anyhow::Result<i32> {
    use boxoffice_store::tickets::Resale;
    let pool = boxoffice_store::connect(cfg.pg_options()?, 1, cfg.db_acquire_timeout_ms).await?;
    Ok(match resell(&pool, order).await? {
        Resale::Released(seats) => {
            println!("order {}: {} seat(s) back on sale", order.0, seats.len());
            0
        }
        Resale::TicketsStillValid => {
            eprintln!("order {} has valid tickets; nothing released", order.0);
            1
        }
        Resale::Nothing => {
            eprintln!("order {} has no voided ticket whose seat is still taken", order.0);
            1
        }
    })
}

/// `boxoffice outbox parked`: every parked outbox row ([`boxoffice_store::outbox::parked`]),
/// as text or JSON. Exit code 1 when there is one (a fact that is not reaching Kafka), else 0;
/// an error is exit code 2 (the binary's `main` maps it).
pub async fn outbox_parked(cfg: &Config, json: bool) -> anyhow::Result<i32> {
    let pool = boxoffice_store::connect(cfg.pg_options()?, 1, cfg.db_acquire_timeout_ms).await?;
    let rows = boxoffice_store::outbox::parked(&pool).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("{} parked outbox row(s)", rows.len());
        for r in &rows {
            println!(
                "  {} order={} type={} created={} refused={} retry_at={} held_back={} refusal={}",
                r.id,
                r.message_key,
                r.event_type,
                r.created_at.to_rfc3339(),
                r.refused_at.to_rfc3339(),
                r.retry_at.map(|t| t.to_rfc3339()).unwrap_or_else(|| "-".into()),
                r.held_back,
                r.refusal.as_deref().unwrap_or("-"),
            );
        }
    }
    Ok(i32::from(!rows.is_empty()))
}

/// `boxoffice outbox retry --id EVENT_ID ... | --all`: [`boxoffice_store::outbox::retry_parked`];
/// exit code 1 when an id named is not a parked row (the orders of the others are made due
/// all the same).
pub async fn outbox_retry(cfg: &Config, ids: &[uuid::Uuid], all: bool) -> anyhow::Result<i32> {
    use boxoffice_store::outbox::Release;
    anyhow::ensure!(all == ids.is_empty(), "name the rows with --id, or --all for every parked row");
    let pool = boxoffice_store::connect(cfg.pg_options()?, 1, cfg.db_acquire_timeout_ms).await?;
    let mut ids = ids.to_vec();
    ids.sort_unstable();
    ids.dedup();
    let which = if all { Release::All } else { Release::Rows(&ids) };
    let parked = boxoffice_store::outbox::parked_among(&pool, &ids).await?;
    let unknown: Vec<&uuid::Uuid> = ids.iter().filter(|id| !parked.contains(id)).collect();
    for id in &unknown {
        eprintln!("{id}: not a parked outbox row");
    }
    let n = boxoffice_store::outbox::retry_parked(&pool, which).await?;
    println!(
        "{n} parked row(s) due now: the relay tries up to {} parked orders per batch",
        boxoffice_store::outbox::DUE_PARKED_PER_BATCH
    );
    Ok(i32::from(!unknown.is_empty()))
}

/// `boxoffice dlq list`.
pub async fn dlq_list(cfg: &Config, json: bool) -> anyhow::Result<()> {
    let k = cfg.kafka().context("set BOXOFFICE_KAFKA_BROKERS to read dead letters")?;
    let letters = boxoffice_bus::dlq::list(&k, std::time::Duration::from_secs(30)).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&letters)?);
        return Ok(());
    }
    println!("{} dead letter(s)", letters.len());
    for l in &letters {
        let r = &l.record;
        println!(
            "  {:<10} consumer={} code={} event_type={} order={} source={}:{}:{} attempts={}",
            l.id,
            r["consumer"].as_str().unwrap_or("?"),
            r["error_code"].as_str().unwrap_or("?"),
            r["event_type"].as_str().unwrap_or("-"),
            l.key,
            r["source_topic"].as_str().unwrap_or("?"),
            r["source_partition"],
            r["source_offset"],
            r["attempts"],
        );
    }
    Ok(())
}

/// `boxoffice dlq replay [--id P:O ...]`.
pub async fn dlq_replay(cfg: &Config, ids: &[String]) -> anyhow::Result<()> {
    let k = cfg.kafka().context("set BOXOFFICE_KAFKA_BROKERS to replay dead letters")?;
    let letters = boxoffice_bus::dlq::list(&k, std::time::Duration::from_secs(30)).await?;
    let chosen: Vec<_> = letters.into_iter().filter(|l| ids.is_empty() || ids.contains(&l.id)).collect();
    if let Some(missing) = ids.iter().find(|id| !chosen.iter().any(|l| &l.id == *id)) {
        anyhow::bail!("no dead letter with id {missing}");
    }
    let producer = boxoffice_bus::producer::build(&k)?;
    let n = boxoffice_bus::dlq::replay(&k, &producer, &chosen).await?;
    println!("re-injected {n} message(s)");
    Ok(())
}

/// Writes a fresh Ed25519 key pair for admission tokens: `<out>/<kid>.pem` (PKCS#8, created
/// with mode 0600 and never printed) and `<out>/<kid>.pub.pem` (SPKI).
pub fn admission_keygen(kid: &str, out: &std::path::Path) -> anyhow::Result<()> {
    use std::io::Write;
    let key = boxoffice_admission::AdmissionSigningKey::generate(kid);
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let private = out.join(format!("{kid}.pem"));
    let public = out.join(format!("{kid}.pub.pem"));
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    opts.open(&private)
        .and_then(|mut f| f.write_all(key.to_pkcs8_pem().as_bytes()))
        .with_context(|| format!("writing {}", private.display()))?;
    std::fs::write(&public, key.verifying_key().to_pem())
        .with_context(|| format!("writing {}", public.display()))?;
    println!(
        "private key: {} (BOXOFFICE_ADMISSION_PRIVATE_KEY, BOXOFFICE_ADMISSION_KID={kid})",
        private.display()
    );
    println!("public key:  {} (admission_public_keys while rotating)", public.display());
    Ok(())
}
