//! `boxoffice cells list | assign | move`: the operator's side of purchase cells (design §13).
//!
//! Owns the order of a move, which is what keeps an event sold by one ledger at a time
//! (invariant 1 across cells): record the move in the directory, freeze the event in the
//! source cell, wait out every transaction that may have read it as sellable, wait for its
//! open orders to settle, copy the event and its seats (each sold seat marked with the cell
//! whose ledger sold it) into the target at the next directory epoch, still frozen, mark the
//! source `moved`, activate the target, and only then point the directory at the target. Every step is idempotent and a
//! move that stopped half-way resumes when run again; one that cannot settle in time is
//! undone (the source sells again). The store owns each step's SQL
//! ([`boxoffice_store::cells`], [`boxoffice_store::directory`]).

use crate::config::Config;
use anyhow::{bail, Context};
use boxoffice_domain::EventId;
use boxoffice_store::cells::{self, CellState};
use boxoffice_store::directory;
use secrecy::ExposeSecret;
use sqlx::migrate::MigrateDatabase;
use sqlx::PgPool;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// The control database's pool. With `create` (`cells assign`, the directory's first write)
/// a missing database is created and the migrations are applied; otherwise a missing
/// database is an error, so a read or a move against a mistyped or lost control database
/// never puts an empty directory where the router would read it.
pub async fn control_pool(cfg: &Config, create: bool) -> anyhow::Result<PgPool> {
    let url = cfg.control_database_url.as_ref().context("control_database_url is not set")?;
    let url = url.expose_secret();
    if !sqlx::Postgres::database_exists(url).await.context("connecting to the control database")? {
        if !create {
            bail!("the control database does not exist (cells assign creates it)");
        }
        sqlx::Postgres::create_database(url).await.context("creating the control database")?;
    }
    let opts: sqlx::postgres::PgConnectOptions = url.parse().context("invalid control_database_url")?;
    let pool =
        boxoffice_store::connect(opts.application_name("boxoffice-control"), 2, cfg.db_acquire_timeout_ms)
            .await?;
    if create {
        directory::CONTROL_MIGRATOR.run(&pool).await.context("applying the control database's migrations")?;
    }
    Ok(pool)
}

/// A small pool on cell `name`'s ledger (migrated beforehand: `boxoffice --cell C migrate`).
pub async fn cell_pool(cfg: &Config, name: &str) -> anyhow::Result<PgPool> {
    let c = cfg.for_cell(name)?;
    boxoffice_store::connect(c.pg_options()?, 2, c.db_acquire_timeout_ms)
        .await
        .with_context(|| format!("connecting to cell {name}'s database"))
}

/// `cells list`: every directory entry, then each configured cell's events as its own ledger
/// sees them (a mismatch shows a move under way or to be resumed).
pub async fn list(cfg: &Config, json: bool) -> anyhow::Result<i32> {
    let control = control_pool(cfg, false).await?;
    let entries = directory::list(&control).await?;
    let mut ledgers = Vec::new();
    for name in cfg.cell_names() {
        let events = match cell_pool(cfg, name).await {
            Ok(pool) => cells::events(&pool).await.map_err(anyhow::Error::from),
            Err(e) => Err(e),
        };
        ledgers.push((name.to_owned(), events));
    }
    if json {
        let cells: Vec<serde_json::Value> = ledgers
            .iter()
            .map(|(name, events)| match events {
                Ok(ev) => serde_json::json!({
                    "cell": name,
                    "events": ev.iter().map(|(id, n, p)| serde_json::json!({
                        "event_id": id, "name": n, "purchase_cell": p.cell,
                        "directory_epoch": p.directory_epoch, "state": p.state.as_str(),
                    })).collect::<Vec<_>>(),
                }),
                Err(e) => serde_json::json!({ "cell": name, "error": format!("{e:#}") }),
            })
            .collect();
        println!("{}", serde_json::json!({ "directory": entries, "cells": cells }));
        return Ok(0);
    }
    println!("directory ({} events):", entries.len());
    for e in &entries {
        let moving = e.moving_to.as_deref().map(|t| format!(" → {t}")).unwrap_or_default();
        println!("  {}  {}  epoch {}  {}{moving}", e.event_id, e.cell, e.directory_epoch, e.state);
    }
    for (name, events) in &ledgers {
        match events {
            Ok(ev) => {
                println!("cell {name} ({} events in its ledger):", ev.len());
                for (id, n, p) in ev {
                    println!("  {id}  {n:?}  {}  epoch {}  {}", p.cell, p.directory_epoch, p.state.as_str());
                }
            }
            Err(e) => println!("cell {name}: unreachable ({e:#})"),
        }
    }
    Ok(0)
}

/// `cells assign --event E --cell C`: a new event, seeded in C's ledger (`boxoffice --cell C
/// seed-venue`), enters the directory at the epoch C's ledger has for it.
pub async fn assign(cfg: &Config, event: Uuid, cell: &str) -> anyhow::Result<i32> {
    let pool = cell_pool(cfg, cell).await?;
    let Some(p) = cells::placement(&pool, EventId(event)).await? else {
        bail!("cell {cell} has no event {event}: seed it there first (boxoffice --cell {cell} seed-venue)");
    };
    if p.cell != cell || p.state != CellState::Active {
        bail!(
            "cell {cell}'s ledger says event {event} is {} for {} (epoch {})",
            p.state.as_str(),
            p.cell,
            p.directory_epoch
        );
    }
    let control = control_pool(cfg, true).await?;
    let entry = directory::assign(&control, event, cell, p.directory_epoch).await?;
    println!("event {event} → {} at directory epoch {}", entry.cell, entry.directory_epoch);
    Ok(0)
}

/// What a finished move did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MoveReport {
    /// The event.
    pub event_id: Uuid,
    /// Source cell.
    pub from: String,
    /// Target cell.
    pub to: String,
    /// The directory epoch the target sells at.
    pub directory_epoch: i64,
    /// Seats copied, and how many of them were already sold (their orders stay behind).
    pub seats: usize,
    /// Seats marked sold in the target.
    pub sold_seats: usize,
    /// How long the event took no holds, ms (frozen to moved).
    pub frozen_ms: u64,
}

/// `cells move --event E --to C`: see the module doc for the order. `settle_timeout` bounds
/// the wait for open orders; past it the move is undone and this errors.
pub async fn move_event(
    cfg: &Config,
    event: Uuid,
    to: &str,
    settle_timeout: Duration,
) -> anyhow::Result<MoveReport> {
    cfg.for_cell(to)?;
    let control = control_pool(cfg, false).await?;
    let entry =
        directory::get(&control, event).await?.context("the event is not in the directory (cells assign)")?;
    if entry.cell == to && entry.moving_to.is_none() {
        bail!("event {event} is already sold by {to}");
    }
    let entry = directory::begin_move(&control, event, to).await?;
    let from = entry.cell.clone();
    let epoch = entry.directory_epoch + 1;
    let source = cell_pool(cfg, &from).await?;
    let target = cell_pool(cfg, to).await?;
    let frozen = Instant::now();
    let placement =
        cells::placement(&source, EventId(event)).await?.context("the source cell has no such event")?;
    let (seats, sold_seats) = if placement.state == CellState::Moved {
        // Resumed after the source was marked: the target's activation and the directory are
        // left.
        if placement.cell != to || placement.directory_epoch != epoch {
            bail!(
                "the source says the event moved to {} at epoch {}",
                placement.cell,
                placement.directory_epoch
            );
        }
        (0, 0)
    } else {
        if !cells::sees_every_transaction(&source).await? {
            bail!("the move's role cannot see other sessions' transactions in {from}: grant it pg_read_all_stats");
        }
        let at = cells::freeze(&source, EventId(event), &from)
            .await?
            .context("the source cell does not sell the event")?;
        tracing::info!(%event, %from, %to, "frozen: no new holds in the source cell");
        if !cells::wait_for_transactions_before(&source, at, Duration::from_secs(60)).await? {
            give_up(&source, &control, event).await;
            bail!("transactions older than the freeze still run in {from} after 60 s; move undone");
        }
        let deadline = Instant::now() + settle_timeout;
        loop {
            let open = boxoffice_store::orders::open_in_event(&source, event).await?;
            if open == 0 {
                break;
            }
            if Instant::now() >= deadline {
                give_up(&source, &control, event).await;
                bail!("{open} orders of the event were still open in {from} after {settle_timeout:?}; move undone");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let export = cells::export(&source, EventId(event), &from).await?.context("the event vanished")?;
        // Imported frozen: until the source is marked moved only the source may sell, and it
        // is frozen, so giving up before that leaves no second seller.
        if !cells::import(&target, &export, to, epoch).await? {
            bail!("cell {to} already sells the event or has it at a later epoch; directory untouched");
        }
        cells::mark_moved(&source, EventId(event), to, epoch).await?;
        let sold = export.seats.iter().filter(|s| s.owner_cell.is_some()).count();
        (export.seats.len(), sold)
    };
    if !cells::activate(&target, EventId(event), to, epoch).await? {
        bail!("cell {to} has no copy of the event at epoch {epoch} to activate");
    }
    let entry = directory::finish_move(&control, event, epoch).await?;
    Ok(MoveReport {
        event_id: event,
        from,
        to: entry.cell,
        directory_epoch: entry.directory_epoch,
        seats,
        sold_seats,
        frozen_ms: frozen.elapsed().as_millis() as u64,
    })
}

/// Undoes the freeze and the directory's record of a move that could not finish.
async fn give_up(source: &PgPool, control: &PgPool, event: Uuid) {
    if let Err(e) = cells::unfreeze(source, EventId(event)).await {
        tracing::error!(error = %e, %event, "could not unfreeze the event in its source cell: run the move again or unfreeze by hand");
    }
    if let Err(e) = directory::abandon_move(control, event).await {
        tracing::error!(error = %e, %event, "could not clear the directory's move record");
    }
}
