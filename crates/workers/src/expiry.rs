//! The expiry worker (design §11): releases holds whose time ran out, in bounded
//! `FOR UPDATE SKIP LOCKED` batches so several workers share the work without claiming the
//! same hold and without a lock storm after a pause. Expiry is durable data plus a repeatable
//! query — never an in-process timer.

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
}

impl Default for ExpirySettings {
    fn default() -> Self {
        Self { batch: 500, interval_ms: 250 }
    }
}

/// Runs until `shutdown`.
pub async fn run(pool: PgPool, settings: ExpirySettings, shutdown: CancellationToken) {
    let mut failures = 0u32;
    while !shutdown.is_cancelled() {
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
