//! The expiry worker (design §11): releases holds whose time ran out, in bounded
//! `FOR UPDATE SKIP LOCKED` batches so several workers share the work without claiming the
//! same hold and without a lock storm after a pause. Expiry is durable data plus a repeatable
//! query — never an in-process timer. Before a payable hold with no authorization in the
//! ledger lapses, it asks the provider about the hold's PaymentIntent (rule 3 of
//! `boxoffice_domain::hold`), so a late webhook never costs a buyer who paid in time. Every
//! 10 s it also prunes the inbox, idempotency keys, webhook events without an order id
//! (`boxoffice_store::stripe_events::prune_unclaimed`), the rows of re-fetches whose last
//! claim is an hour old (`boxoffice_store::stripe_events::prune_refetches`) and the re-fetch
//! budgets whose window ended (`boxoffice_store::stripe_events::prune_refetch_budgets`,
//! `prune_follow_ups`), releases authorizations near their
//! capture deadline (case C09), resolves early webhooks that missed their payment row's
//! resolve (`boxoffice_store::stripe_events::resolve_stranded`), and settles capture claims
//! past their grace (`boxoffice_store::stripe_events::settle_capture_claims`: a re-fetch for
//! each capture a webhook claimed that the ledger still does not record). The hold sweeps, the
//! prunes and the webhook sweeps read what is due through an index ("Periodic sweeps" in
//! `boxoffice_store`); the capture-deadline sweep reads the orders awaiting their capture
//! (`confirming`, a state an order passes through in seconds).

use sqlx::PgPool;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Expiry tuning.
#[derive(Debug, Clone)]
pub struct ExpirySettings {
    /// Holds expired per transaction.
    pub batch: i64,
    /// Pause between sweeps when nothing is due, ms.
    pub interval_ms: u64,
    /// Authorizations still uncaptured this many seconds before Stripe's capture deadline
    /// are released on purpose (case C09).
    pub capture_deadline_margin_s: i64,
    /// Inbox rows older than this many seconds are pruned (keep it above the topic's
    /// retention).
    pub inbox_retention_s: i64,
    /// Webhook events recorded without an order id are pruned after this many seconds
    /// (at least `boxoffice_store::stripe_events::MIN_UNCLAIMED_RETENTION_S`).
    pub webhook_event_retention_s: i64,
}

impl Default for ExpirySettings {
    fn default() -> Self {
        Self {
            batch: 500,
            interval_ms: 250,
            capture_deadline_margin_s: 86_400,
            inbox_retention_s: 7 * 86_400,
            webhook_event_retention_s: boxoffice_store::stripe_events::UNCLAIMED_RETENTION_S,
        }
    }
}

/// Runs until `shutdown`.
pub async fn run(pool: PgPool, settings: ExpirySettings, shutdown: CancellationToken) {
    let mut failures = 0u32;
    let mut last_deadline_sweep = std::time::Instant::now() - Duration::from_secs(60);
    while !shutdown.is_cancelled() {
        if last_deadline_sweep.elapsed() >= Duration::from_secs(10) {
            last_deadline_sweep = std::time::Instant::now();
            if let Err(e) = prune(&pool, &settings).await {
                tracing::warn!(error = %e, "pruning inbox / idempotency keys / unclaimed webhook events failed");
            }
            match crate::saga::release_lapsing_authorizations(&pool, settings.capture_deadline_margin_s, 100)
                .await
            {
                Ok(0) => {}
                Ok(n) => tracing::warn!(released = n, "authorizations near their capture deadline released"),
                Err(e) => tracing::warn!(error = %e, "capture-deadline sweep failed"),
            }
            // Webhooks that overtook their payment row and missed its statement's resolve.
            match boxoffice_store::stripe_events::resolve_stranded(
                &pool,
                100,
                Some(boxoffice_store::stripe_events::STRANDED_WINDOW_S),
            )
            .await
            {
                Ok(0) => {}
                Ok(n) => tracing::info!(refetches = n, "stranded early webhooks resolved"),
                Err(e) => tracing::warn!(error = %e, "sweep of stranded early webhooks failed"),
            }
            settle_capture_claims(&pool).await;
        }
        // Rule 3 of the hold's lifetime: a payable hold at its end is checked with the
        // provider before it lapses (the re-fetch answers through the payment worker).
        match boxoffice_store::holds::check_lapsing(&pool, settings.batch).await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(checks = n, "provider checks asked for lapsing holds"),
            Err(e) => tracing::warn!(error = %e, "provider checks of lapsing holds failed"),
        }
        let pause = match boxoffice_store::holds::expire_due(&pool, settings.batch).await {
            Ok((n, delay_ms)) => {
                failures = 0;
                if n > 0 {
                    metrics::histogram!("boxoffice_expiry_delay_seconds").record(delay_ms as f64 / 1000.0);
                    tracing::debug!(expired = n, expiry.delay_ms = delay_ms, "holds expired");
                }
                if n as i64 >= settings.batch {
                    Duration::ZERO
                } else {
                    Duration::from_millis(settings.interval_ms)
                }
            }
            Err(e) => {
                failures += 1;
                metrics::counter!("boxoffice_expiry_errors_total").increment(1);
                tracing::warn!(error = %e, failures, "expiry sweep failed");
                crate::backoff(failures, 100, 5_000)
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(pause) => {}
        }
    }
    tracing::info!("expiry worker stopped");
}

/// The most capture claims one pass settles, and the most passes per sweep: most ticketed
/// orders leave a claim, so a sweep every 10 s at 1,000 orders/s settles up to 10,000, half
/// of what the passes allow.
const CAPTURE_CLAIMS_PER_PASS: i64 = 2_000;
const CAPTURE_CLAIM_PASSES: usize = 10;

/// Settles the capture claims past their grace
/// ([`boxoffice_store::stripe_events::settle_capture_claims`]), pass after pass while a pass
/// is full, at most [`CAPTURE_CLAIM_PASSES`].
async fn settle_capture_claims(pool: &PgPool) {
    use boxoffice_store::stripe_events::{settle_capture_claims, CAPTURE_CLAIM_GRACE_S};
    for _ in 0..CAPTURE_CLAIM_PASSES {
        match settle_capture_claims(pool, CAPTURE_CLAIM_GRACE_S, CAPTURE_CLAIMS_PER_PASS).await {
            Ok(s) => {
                if s.refetches > 0 {
                    tracing::info!(
                        refetches = s.refetches,
                        "capture claims still unrecorded: re-fetches asked"
                    );
                }
                if (s.settled as i64) < CAPTURE_CLAIMS_PER_PASS {
                    return;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "sweep of capture claims failed");
                return;
            }
        }
    }
}

/// Janitor work that rides along the expiry sweep: old inbox rows, expired idempotency keys,
/// old webhook events without an order id and the rows of re-fetches that never ended, in
/// bounded batches.
async fn prune(pool: &PgPool, settings: &ExpirySettings) -> Result<(), sqlx::Error> {
    use boxoffice_store::stripe_events;
    boxoffice_store::inbox::prune(pool, settings.inbox_retention_s, 10_000).await?;
    boxoffice_store::inbox::prune_idempotency_keys(pool, 10_000).await?;
    stripe_events::prune_unclaimed(pool, settings.webhook_event_retention_s, 10_000).await?;
    stripe_events::prune_refetches(pool, stripe_events::REFETCH_RETENTION_S, 10_000).await?;
    stripe_events::prune_refetch_budgets(pool, stripe_events::UNCOVERED_REFETCH_WINDOW_S, 10_000).await?;
    stripe_events::prune_follow_ups(pool, stripe_events::REFETCH_BUDGET_WINDOW_S, 10_000).await?;
    Ok(())
}
