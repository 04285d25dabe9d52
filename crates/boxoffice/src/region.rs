//! `boxoffice region init | status | fence | promote | republish`: the warm-region failover
//! runbook as commands (design §15).
//!
//! Owns the runbook's order, which is what keeps one region writing at a time (every
//! invariant, across regions):
//!
//! 1. `fence`, run by the region taking over: moves the witness's authority to this region at
//!    the next epoch (the old region's processes can no longer renew their lease and stop
//!    writing within its TTL); fences the old primary's ledger too when it is reachable
//!    (epoch bumped under the EXCLUSIVE lock, the application role read-only there, its
//!    sessions terminated); records this replica's recovery point at the witness.
//! 2. `promote`: waits until every lease of the old epoch has lapsed plus the skew margin
//!    (the witness's `writers_clear_at`, by the witness's clock), promotes this replica and
//!    fences its ledger at the new epoch. The services then start with that epoch.
//! 3. `republish`: marks every outbox row created since the recovery point minus the margin
//!    unpublished, so the relay sends it to this region's broker; the inboxes absorb what
//!    was applied already. Then the synthetic hold and webhook checks, then `reconcile`.
//!
//! Each step is idempotent: re-running a fence or a promotion that stopped half-way resumes
//! it. The SQL lives in the store ([`boxoffice_store::region`], [`boxoffice_store::witness`]).

use crate::config::Config;
use anyhow::{bail, Context};
use boxoffice_store::region::{self, Writer};
use boxoffice_store::witness::{self, Authority};
use chrono::{DateTime, Utc};
use secrecy::ExposeSecret;
use serde::Serialize;
use sqlx::migrate::MigrateDatabase;
use sqlx::postgres::PgConnectOptions;
use sqlx::PgPool;
use std::time::Duration;

/// The witness's pool. With `create` (`region init`) a missing database is created and its
/// migrations applied; otherwise a missing database is an error (a mistyped witness must not
/// look like an empty one).
pub async fn witness_pool(cfg: &Config, create: bool) -> anyhow::Result<PgPool> {
    let url = cfg.witness_database_url.as_ref().context("witness_database_url is not set")?;
    let url = url.expose_secret();
    if !sqlx::Postgres::database_exists(url).await.context("connecting to the witness database")? {
        if !create {
            bail!("the witness database does not exist (region init creates it)");
        }
        sqlx::Postgres::create_database(url).await.context("creating the witness database")?;
    }
    let opts: PgConnectOptions = url.parse().context("invalid witness_database_url")?;
    let pool =
        boxoffice_store::connect(opts.application_name("boxoffice-region"), 2, cfg.db_acquire_timeout_ms)
            .await?;
    if create {
        witness::WITNESS_MIGRATOR.run(&pool).await.context("applying the witness's migrations")?;
    }
    Ok(pool)
}

/// A small pool on this region's ledger for the runbook. Its sessions declare no epoch (the
/// runbook reads and moves the epoch record, which no fence guards) and are read-write
/// whatever the role's default: a fence of the old primary sets that default there, and it
/// replicates to a replica still streaming from it.
async fn ledger_pool(cfg: &Config) -> anyhow::Result<PgPool> {
    let opts: PgConnectOptions = cfg.database_url.expose_secret().parse().context("invalid database_url")?;
    let opts = opts.options([("default_transaction_read_only", "off")]);
    boxoffice_store::connect(opts.application_name("boxoffice-region"), 2, cfg.db_acquire_timeout_ms)
        .await
        .context("connecting to this region's database")
}

fn by() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "unknown-host".into());
    format!("boxoffice region on {host} (pid {})", std::process::id())
}

/// `region init`: creates the witness (database, migrations) and names this configuration's
/// region and epoch as the authority, unless one is named already (never overwritten).
pub async fn init(cfg: &Config) -> anyhow::Result<Authority> {
    let pool = witness_pool(cfg, true).await?;
    Ok(witness::init(&pool, &cfg.writer(), &by()).await?)
}

/// What `region status` shows.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// This configuration's writer (region, epoch).
    pub configured: Writer,
    /// The ledger's epoch record.
    pub ledger: region::EpochRecord,
    /// The ledger's lease mirror `(region, epoch, valid_until)`, if any.
    pub lease: Option<(String, i64, DateTime<Utc>)>,
    /// Replication: role, positions, lag.
    pub replication: region::Replication,
    /// The witness's authority, when a witness is configured and reachable.
    pub witness: Option<Authority>,
    /// Live leases at the witness.
    pub leases: Vec<(String, String, i64, DateTime<Utc>)>,
    /// Whether this configuration may write now: the ledger and the witness name it.
    pub writable: bool,
}

/// `region status`.
pub async fn status(cfg: &Config) -> anyhow::Result<Status> {
    let ledger = ledger_pool(cfg).await?;
    let record = region::record(&ledger).await?;
    let lease = region::lease(&ledger).await?;
    let replication = region::replication(&ledger).await?;
    let (witness, leases) = match &cfg.witness_database_url {
        Some(_) => {
            let w = witness_pool(cfg, false).await?;
            (witness::authority(&w).await?, witness::live_leases(&w).await?)
        }
        None => (None, Vec::new()),
    };
    let configured = cfg.writer();
    let writable = replication.role == "primary"
        && record.epoch == configured.epoch
        && witness.as_ref().is_none_or(|a| a.region == configured.region && a.epoch == configured.epoch);
    Ok(Status { configured, ledger: record, lease, replication, witness, leases, writable })
}

/// The text form of [`Status`].
pub fn render_status(s: &Status) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let at = |t: &DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let _ = writeln!(out, "configured: region {} at epoch {}", s.configured.region, s.configured.epoch);
    let _ = writeln!(
        out,
        "ledger: region {} at epoch {} (since {}{}), fence LSN {}",
        s.ledger.region,
        s.ledger.epoch,
        at(&s.ledger.changed_at),
        s.ledger.changed_by.as_ref().map(|b| format!(", by {b}")).unwrap_or_default(),
        s.ledger.fence_lsn.as_deref().unwrap_or("-")
    );
    match &s.lease {
        Some((region, epoch, until)) => {
            let _ =
                writeln!(out, "lease mirror: region {region} at epoch {epoch}, valid until {}", at(until));
        }
        None => out.push_str("lease mirror: none (no witness has granted one here)\n"),
    }
    let r = &s.replication;
    let _ = writeln!(out, "replication: {} at {}", r.role, r.lsn);
    if r.role == "replica" {
        let _ = writeln!(
            out,
            "  received {}, last replayed commit {}, {} behind",
            r.receive_lsn.as_deref().unwrap_or("-"),
            r.last_replayed_commit_at.as_ref().map(at).unwrap_or_else(|| "-".into()),
            r.lag_seconds.map(|l| format!("{l:.1} s")).unwrap_or_else(|| "-".into())
        );
    }
    for x in &r.replicas {
        let _ = writeln!(
            out,
            "  replica {}: {}, {} bytes behind, {}",
            x.name,
            x.state,
            x.lag_bytes,
            x.lag_seconds.map(|l| format!("{l:.1} s replay lag")).unwrap_or_else(|| "replay lag -".into())
        );
    }
    match &s.witness {
        Some(a) => {
            let _ = writeln!(
                out,
                "witness: region {} at epoch {} (since {}), writers clear at {}, recovery point {} {}",
                a.region,
                a.epoch,
                at(&a.changed_at),
                a.writers_clear_at.as_ref().map(at).unwrap_or_else(|| "-".into()),
                a.recovery_lsn.as_deref().unwrap_or("-"),
                a.recovery_point_at.as_ref().map(at).unwrap_or_default()
            );
            let _ = writeln!(out, "live leases: {}", s.leases.len());
        }
        None => out.push_str("witness: not configured\n"),
    }
    let _ = writeln!(out, "writable: {}", if s.writable { "yes" } else { "no" });
    out
}

/// What `region fence` did.
#[derive(Debug, Clone, Serialize)]
pub struct FenceReport {
    /// The authority after the fence (this region, the new epoch).
    pub authority: Authority,
    /// Whether the old primary's ledger was reached and fenced too.
    pub old_primary_fenced: bool,
    /// Sessions of the application role terminated there.
    pub old_primary_sessions_terminated: i64,
    /// Why the old primary was not fenced (unset, unreachable, …), when it was not.
    pub old_primary_note: Option<String>,
    /// This replica's last replayed WAL position (the recovery point).
    pub recovery_lsn: String,
    /// Commit time of its last replayed transaction.
    pub recovery_point_at: Option<DateTime<Utc>>,
    /// WAL bytes the replica is behind the old primary, when the old primary was reached.
    pub lag_bytes: Option<i64>,
    /// Milliseconds until promotion may proceed (`writers_clear_at`).
    pub ms_until_clear: i64,
}

/// `region fence`, run with the configuration of the region taking over (its `region`, its
/// replica as `database_url`, the old primary as `region_peer_database_url`).
///
/// # Errors
/// Without a witness; when the witness names this region at an epoch this fence did not set
/// and no old region is left to fence (nothing to do), or cannot be reached.
pub async fn fence(cfg: &Config) -> anyhow::Result<FenceReport> {
    let w = witness_pool(cfg, false).await?;
    let current = witness::authority(&w).await?.context("the witness has no authority (region init)")?;
    // Only a replica takes over. A primary may re-run the fence it already won (to reach the
    // old primary once it answers); any other primary is a returning old one, whose ledger
    // misses everything written since it was fenced: it must be rebuilt as a replica.
    let ledger = ledger_pool(cfg).await?;
    let (in_recovery,): (bool,) = sqlx::query_as("SELECT pg_is_in_recovery()").fetch_one(&ledger).await?;
    if !in_recovery {
        let mine = region::record(&ledger).await?;
        if current.region == cfg.region && mine.epoch < current.epoch {
            bail!(
                "this region's database is already promoted but its ledger is still at epoch {}: \
                 finish with `region promote`",
                mine.epoch
            );
        }
        if !(current.region == cfg.region && mine.region == cfg.region && mine.epoch == current.epoch) {
            bail!(
                "this region's database is a primary at epoch {} ({}) while the witness names {} at epoch {}: \
                 a fence takes over from a replica; rebuild this database as a replica of the writing region",
                mine.epoch,
                mine.region,
                current.region,
                current.epoch
            );
        }
    }
    let to = if current.region == cfg.region {
        // Re-run of a fence towards this region: resume, never bump twice.
        Writer { region: cfg.region.clone(), epoch: current.epoch }
    } else {
        Writer { region: cfg.region.clone(), epoch: current.epoch + 1 }
    };
    let authority = witness::fence(&w, &to, cfg.region_lease_skew_ms as i64, &by()).await?;
    tracing::info!(region = %to.region, epoch = to.epoch, "witness fenced");

    let (mut old_primary_fenced, mut terminated, mut note, mut old_lsn) = (false, 0, None, None);
    match &cfg.region_peer_database_url {
        None => {
            note = Some("region_peer_database_url is not set: the lease alone fences the old primary".into())
        }
        Some(url) => match fence_peer(url.expose_secret(), &to).await {
            Ok((n, lsn)) => {
                old_primary_fenced = true;
                terminated = n;
                old_lsn = Some(lsn);
            }
            Err(e) => {
                note = Some(format!("not reached ({e:#}): the lease alone fences it"));
            }
        },
    }

    let rep = region::replication(&ledger).await?;
    let lag_bytes = match &old_lsn {
        Some(old) => Some(region::lsn_diff(&ledger, old, &rep.lsn).await?.max(0)),
        None => None,
    };
    if rep.role == "replica" {
        witness::record_recovery_point(&w, &rep.lsn, rep.last_replayed_commit_at, old_lsn.as_deref()).await?;
    }
    let authority = witness::authority(&w).await?.unwrap_or(authority);
    Ok(FenceReport {
        recovery_lsn: authority.recovery_lsn.clone().unwrap_or(rep.lsn),
        recovery_point_at: authority.recovery_point_at.or(rep.last_replayed_commit_at),
        authority,
        old_primary_fenced,
        old_primary_sessions_terminated: terminated,
        old_primary_note: note,
        lag_bytes,
        ms_until_clear: witness::ms_until_clear(&w).await?,
    })
}

/// Fences the old primary's ledger when it answers within a few seconds: epoch bumped, the
/// application role read-only there, its sessions terminated. Returns (sessions terminated,
/// its WAL position).
async fn fence_peer(url: &str, to: &Writer) -> anyhow::Result<(i64, String)> {
    let opts: PgConnectOptions = url.parse().context("invalid region_peer_database_url")?;
    // One attempt, bounded: a refused connection fails at once, a silent network in 3 s.
    let opts = opts.application_name("boxoffice-region-fence");
    let probe: sqlx::PgConnection =
        tokio::time::timeout(Duration::from_secs(3), sqlx::Connection::connect_with(&opts))
            .await
            .map_err(|_| anyhow::anyhow!("no answer within 3 s"))??;
    drop(probe);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(3))
        .connect_with(opts)
        .await?;
    let (in_recovery,): (bool,) = sqlx::query_as("SELECT pg_is_in_recovery()").fetch_one(&pool).await?;
    if in_recovery {
        bail!("the peer is a replica, not the old primary");
    }
    match region::fence(&pool, to, &by()).await {
        Ok(f) => {
            tracing::info!(from = f.from.epoch, to = f.to.epoch, lsn = %f.fence_lsn, "old primary fenced")
        }
        // Already at a newer epoch: a later fence got there first; still make it read-only.
        Err(region::FenceError::NotNewer { current, .. }) if current >= to.epoch => {}
        Err(e) => return Err(e.into()),
    }
    let (lsn,): (String,) = sqlx::query_as("SELECT pg_current_wal_lsn()::text").fetch_one(&pool).await?;
    let n = region::make_read_only(&pool).await?;
    Ok((n, lsn))
}

/// What `region promote` did.
#[derive(Debug, Clone, Serialize)]
pub struct PromoteReport {
    /// The region and epoch the services must start with.
    pub writer: Writer,
    /// Whether this call promoted the replica (false: it was promoted already).
    pub promoted: bool,
    /// How long it waited for the old leases to lapse, ms.
    pub waited_for_leases_ms: i64,
    /// The ledger's fence position at the new epoch.
    pub fence_lsn: String,
}

/// `region promote`, after `region fence`: waits for `writers_clear_at`, promotes this
/// replica, fences its ledger at the witness's epoch.
///
/// # Errors
/// When the witness does not name this region (run `region fence` first).
pub async fn promote(cfg: &Config) -> anyhow::Result<PromoteReport> {
    let w = witness_pool(cfg, false).await?;
    let a = witness::authority(&w).await?.context("the witness has no authority (region init)")?;
    if a.region != cfg.region {
        bail!(
            "the witness names region {} at epoch {}: run `region fence` from {} first",
            a.region,
            a.epoch,
            cfg.region
        );
    }
    let started = std::time::Instant::now();
    loop {
        let ms = witness::ms_until_clear(&w).await?;
        if ms == 0 {
            break;
        }
        tracing::info!(ms, "waiting for the old region's leases to lapse");
        tokio::time::sleep(Duration::from_millis(ms.min(1_000) as u64)).await;
    }
    let waited_for_leases_ms = started.elapsed().as_millis() as i64;
    let ledger = ledger_pool(cfg).await?;
    let (in_recovery,): (bool,) = sqlx::query_as("SELECT pg_is_in_recovery()").fetch_one(&ledger).await?;
    if !in_recovery {
        // Already promoted (a promotion resumed): only this region's own ledger, one epoch
        // behind at most (promoted, not yet fenced) or already at the witness's epoch.
        let mine = region::record(&ledger).await?;
        if !(mine.epoch == a.epoch || (mine.epoch + 1 == a.epoch && fenced_from_here(&a, &mine))) {
            bail!(
                "this region's database is a primary at epoch {} ({}), not a replica: promotion takes a replica",
                mine.epoch,
                mine.region
            );
        }
    }
    let promoted = region::promote(&ledger, 60).await?;
    // The old primary's fence may have made the application role read-only there while this
    // replica still streamed: that setting replicated, and must not follow us.
    region::clear_read_only(&ledger).await?;
    let writer = Writer { region: a.region.clone(), epoch: a.epoch };
    let fence_lsn = match region::fence(&ledger, &writer, &by()).await {
        Ok(f) => f.fence_lsn,
        Err(region::FenceError::NotNewer { current, region }) => {
            bail!("this ledger is at epoch {current} of region {region}, past the witness's {}", a.epoch)
        }
        Err(e) => return Err(e.into()),
    };
    Ok(PromoteReport { writer, promoted, waited_for_leases_ms, fence_lsn })
}

/// Whether the witness recorded, at its fence, a recovery point this promoted ledger was the
/// replica of (its epoch record is the one the witness moved from): a promotion that stopped
/// between `pg_promote` and fencing the ledger.
fn fenced_from_here(a: &Authority, mine: &region::EpochRecord) -> bool {
    a.recovery_lsn.is_some() && mine.region != a.region
}

/// What `region republish` did.
#[derive(Debug, Clone, Serialize)]
pub struct RepublishReport {
    /// Rows created at or after this instant were marked unpublished.
    pub since: DateTime<Utc>,
    /// How many.
    pub republished: u64,
}

/// `region republish [--since T]`: from `T` (default: the witness's recovery point) minus
/// `region_republish_margin_ms`.
///
/// # Errors
/// Without `--since` when the witness recorded no recovery point; when this configuration's
/// epoch is not the ledger's (the ledger refuses the write, BXF01).
pub async fn republish(cfg: &Config, since: Option<DateTime<Utc>>) -> anyhow::Result<RepublishReport> {
    let point = match since {
        Some(t) => t,
        None => {
            let w = witness_pool(cfg, false).await?;
            let a = witness::authority(&w).await?.context("the witness has no authority")?;
            a.recovery_point_at.context("the witness recorded no recovery point: pass --since")?
        }
    };
    let since = point - chrono::Duration::milliseconds(cfg.region_republish_margin_ms as i64);
    // A writer's session: the ledger checks this configuration's epoch and lease.
    let pool = boxoffice_store::connect(cfg.pg_options()?, 1, cfg.db_acquire_timeout_ms).await?;
    if cfg.witness_database_url.is_some() {
        let w = witness_pool(cfg, false).await?;
        let gate = region::LeaseGate::default();
        let s = boxoffice_workers::lease::LeaseSettings {
            holder: format!("{}-republish-{}", cfg.region, std::process::id()),
            writer: cfg.writer(),
            ttl: Duration::from_millis(cfg.region_lease_ttl_ms),
            renew: Duration::from_millis(cfg.region_lease_renew_ms),
        };
        if boxoffice_workers::lease::renew_once(&w, &pool, &gate, &s).await?
            != boxoffice_workers::lease::Renewal::Granted
        {
            bail!("the witness does not name region {} at epoch {}", cfg.region, cfg.region_epoch);
        }
    }
    let republished = region::republish(&pool, since).await?;
    Ok(RepublishReport { since, republished })
}
