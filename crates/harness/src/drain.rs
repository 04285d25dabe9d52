//! The drain loop: after the last buyer, wait until the pipeline is idle — every order of
//! the event final, every outbox row published, and every expired, failed or canceled
//! order showing its PaymentIntent canceled in the ledger (such an order is final before
//! the payment worker records the provider's cancel), all read in one snapshot
//! (`boxoffice_store::audit::progress`) — or a deadline passes. The onsale and the bench wait for it before reading
//! their results, the chaos drill before its audit, the bench's relay phase (outbox only)
//! to time the relay.
//!
//! It only reads: a drain that times out changes nothing and says how much was left. A
//! failed read is returned, unless the caller asked to ride it out (the chaos drill's
//! database may refuse connections for a moment after an outage); then the last error is
//! reported with the result.

use sqlx::PgPool;
use std::fmt;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// What a drain waits for, how often it looks and how it treats a failed read.
#[derive(Debug, Clone, Copy)]
pub struct Drain {
    /// The event whose orders must all be final and whose expired, failed or canceled
    /// orders' PaymentIntents must all be recorded canceled; `None`: only the outbox must be
    /// empty.
    pub event: Option<Uuid>,
    /// Give up after this long.
    pub timeout: Duration,
    /// Pause between two reads.
    pub interval: Duration,
    /// Keep reading after a failed read instead of returning its error.
    pub retry_errors: bool,
}

/// Where a drain ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Drained {
    /// Every order was final, every cancel recorded and the outbox empty before the
    /// deadline.
    pub done: bool,
    /// Orders of the event not final at the last successful read.
    pub open_orders: i64,
    /// Expired, failed or canceled orders of the event whose PaymentIntent the ledger does
    /// not show canceled yet, at the last successful read; `None` when not counted (no
    /// event, or `open_orders` or `unpublished` not 0 at that read).
    pub pending_cancels: Option<i64>,
    /// Unpublished outbox rows at the last successful read.
    pub unpublished: i64,
    /// The most recent failed read, when `retry_errors` rode one out.
    pub last_error: Option<String>,
}

impl fmt::Display for Drained {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.done {
            write!(f, "drained: every order final, every cancel recorded, outbox empty")
        } else {
            let cancels = self.pending_cancels.map_or_else(|| "not counted".to_string(), |n| n.to_string());
            write!(
                f,
                "drain timed out: {} open orders, cancels pending {cancels}, {} unpublished outbox rows",
                self.open_orders, self.unpublished
            )
        }
    }
}

impl Drain {
    /// Waits for `event`'s orders, its cancels and the outbox, reading every 200 ms; read
    /// errors are returned.
    pub fn orders_of(event: Uuid, timeout: Duration) -> Self {
        Self { event: Some(event), timeout, interval: Duration::from_millis(200), retry_errors: false }
    }

    /// Waits for the outbox alone, reading every `interval`; read errors are returned.
    pub fn outbox(timeout: Duration, interval: Duration) -> Self {
        Self { event: None, timeout, interval, retry_errors: false }
    }

    /// The same drain, reading every `interval`.
    pub fn every(self, interval: Duration) -> Self {
        Self { interval, ..self }
    }

    /// The same drain, riding out failed reads until the deadline.
    pub fn retrying_errors(self) -> Self {
        Self { retry_errors: true, ..self }
    }

    /// Polls until drained or the deadline. Errors only on a failed read without
    /// `retry_errors`.
    pub async fn run(&self, pool: &PgPool) -> Result<Drained, sqlx::Error> {
        let deadline = Instant::now() + self.timeout;
        let mut state = Drained::default();
        loop {
            match boxoffice_store::audit::progress(pool, self.event).await {
                Ok(p) => {
                    state.open_orders = p.open_orders;
                    state.pending_cancels = p.pending_cancels;
                    state.unpublished = p.unpublished;
                    if p.idle() {
                        state.done = true;
                        return Ok(state);
                    }
                }
                Err(e) if self.retry_errors => state.last_error = Some(format!("{e:#}")),
                Err(e) => return Err(e),
            }
            if Instant::now() >= deadline {
                return Ok(state);
            }
            tokio::time::sleep(self.interval).await;
        }
    }
}
