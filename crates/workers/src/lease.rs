//! The region lease renewer (design §15): keeps this process's lease from the witness alive,
//! mirrors each grant into the ledger, and closes the process's [`LeaseGate`] when renewals
//! stop succeeding.
//!
//! Protects the single writing region. Every `renew` period the renewer asks the witness to
//! extend `holder`'s lease for the writer's region and epoch; the witness grants it only to
//! the region and epoch it names as the authority. A grant extends the gate to *send time +
//! TTL* (never later than the witness's own expiry of the grant) and mirrors the same bound
//! into the ledger by that database's clock, read before the renewal was sent
//! ([`region::mirror_lease`]), where the fence
//! trigger refuses writes past it (SQLSTATE BXF02). A refusal or an unreachable witness
//! extends nothing: after at most one TTL the process writes nothing more, however long its
//! database stays reachable — which is what keeps a returning old primary from selling.

use boxoffice_store::region::{self, LeaseGate, Writer};
use boxoffice_store::witness;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Renewer settings.
#[derive(Debug, Clone)]
pub struct LeaseSettings {
    /// This process's name at the witness (unique per process).
    pub holder: String,
    /// The region and epoch it writes at.
    pub writer: Writer,
    /// Lease TTL.
    pub ttl: Duration,
    /// Renewal period (at most a third of the TTL).
    pub renew: Duration,
}

/// What one renewal did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// Granted and mirrored into the ledger.
    Granted,
    /// The witness names another region or epoch: this writer is fenced.
    Refused,
}

/// Renews once: reads the ledger's clock, asks the witness, and on a grant extends `gate` to
/// send time + TTL and mirrors the lease into `ledger` as ledger time before sending + TTL.
/// Errors: the witness or the ledger could not be reached (nothing extended in the ledger;
/// the gate may have been extended when only the mirror failed).
pub async fn renew_once(
    witness_pool: &PgPool,
    ledger: &PgPool,
    gate: &LeaseGate,
    s: &LeaseSettings,
) -> anyhow::Result<Renewal> {
    // The ledger's clock first: the mirror is bounded by an instant before the grant.
    let sent_at = region::clock(ledger).await?;
    let sent = Instant::now();
    let granted = witness::renew(witness_pool, &s.holder, &s.writer, s.ttl.as_millis() as i64).await?;
    if granted.is_none() {
        return Ok(Renewal::Refused);
    }
    gate.extend(sent, s.ttl);
    region::mirror_lease(ledger, &s.writer, sent_at, s.ttl.as_millis() as i64).await?;
    Ok(Renewal::Granted)
}

/// Runs the renewer until `shutdown`. Exports `boxoffice_region_lease_valid` (1/0) and
/// `boxoffice_region_lease_remaining_ms`, and every 5 s this ledger's replication lag:
/// `boxoffice_region_replication_lag_bytes{replica}` and
/// `boxoffice_region_replication_lag_seconds{replica}` on a primary (per replica it streams
/// to), `boxoffice_region_replica_lag_seconds` on a replica (the age of its last replayed
/// commit).
pub async fn run(
    witness_pool: PgPool,
    ledger: PgPool,
    gate: Arc<LeaseGate>,
    s: LeaseSettings,
    shutdown: CancellationToken,
) {
    let mut was_valid = gate.is_valid();
    let mut last_lag = Instant::now() - Duration::from_secs(60);
    while !shutdown.is_cancelled() {
        if last_lag.elapsed() >= Duration::from_secs(5) {
            last_lag = Instant::now();
            export_replication_lag(&ledger).await;
        }
        match renew_once(&witness_pool, &ledger, &gate, &s).await {
            Ok(Renewal::Granted) => {}
            Ok(Renewal::Refused) => {
                tracing::warn!(region = %s.writer.region, epoch = s.writer.epoch,
                    "the witness refused this region's lease: another region or epoch writes now");
            }
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "region lease renewal failed"),
        }
        let valid = gate.is_valid();
        metrics::gauge!("boxoffice_region_lease_valid").set(if valid { 1.0 } else { 0.0 });
        metrics::gauge!("boxoffice_region_lease_remaining_ms").set(gate.remaining_ms() as f64);
        if valid != was_valid {
            if valid {
                tracing::info!(region = %s.writer.region, epoch = s.writer.epoch, "region lease held: writing");
            } else {
                tracing::error!(region = %s.writer.region, epoch = s.writer.epoch, "region lease lapsed: not writing");
            }
            was_valid = valid;
        }
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(s.renew) => {}
        }
    }
}

/// The ledger's replication figures as gauges (a failed read is logged and skipped).
async fn export_replication_lag(ledger: &PgPool) {
    match region::replication(ledger).await {
        Ok(r) if r.role == "replica" => {
            metrics::gauge!("boxoffice_region_replica_lag_seconds").set(r.lag_seconds.unwrap_or(0.0));
        }
        Ok(r) => {
            for replica in r.replicas {
                metrics::gauge!("boxoffice_region_replication_lag_bytes", "replica" => replica.name.clone())
                    .set(replica.lag_bytes as f64);
                metrics::gauge!("boxoffice_region_replication_lag_seconds", "replica" => replica.name)
                    .set(replica.lag_seconds.unwrap_or(0.0));
            }
        }
        Err(e) => tracing::debug!(error = %e, "reading replication lag failed"),
    }
}
