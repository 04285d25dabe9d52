//! The drain loop: after the last buyer, wait until the pipeline is idle — every order of
//! the event final (`boxoffice_store::orders::open_in_event`), every outbox row published,
//! and every order that ended without a sale showing its PaymentIntent canceled in the
//! ledger (`boxoffice_store::payments::cancels_pending_in_event`: an expired or failed
//! order is final before the payment worker records the provider's cancel) — or a deadline
//! passes. The onsale and the bench wait for it before reading
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
    /// The event whose orders must all be final and whose ended orders' PaymentIntents must
    /// all be recorded canceled; `None`: only the outbox must be empty.
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
    /// Orders of the event that ended without a sale and whose PaymentIntent the ledger does
    /// not show canceled yet, at the last successful read (counted only once `open_orders`
    /// and `unpublished` are 0; 0 before).
    pub pending_cancels: i64,
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
            write!(
                f,
                "drain timed out: {} open orders, {} cancels pending, {} unpublished outbox rows",
                self.open_orders, self.pending_cancels, self.unpublished
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
            match self.read(pool).await {
                Ok((open, pending_cancels, unpublished)) => {
                    state.open_orders = open;
                    state.pending_cancels = pending_cancels;
                    state.unpublished = unpublished;
                    if open == 0 && pending_cancels == 0 && unpublished == 0 {
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

    /// `(open orders of the event, its cancels pending, unpublished outbox rows)`. The
    /// cancels are only counted once the other two are 0 (before that they do not
    /// decide anything, and the drain would read every payment of the onsale each time).
    async fn read(&self, pool: &PgPool) -> Result<(i64, i64, i64), sqlx::Error> {
        let Some(event) = self.event else {
            return Ok((0, 0, boxoffice_store::outbox::backlog(pool).await?.unpublished));
        };
        let open = boxoffice_store::orders::open_in_event(pool, event).await?;
        let unpublished = boxoffice_store::outbox::backlog(pool).await?.unpublished;
        let pending = if open == 0 && unpublished == 0 {
            boxoffice_store::payments::cancels_pending_in_event(pool, event).await?
        } else {
            0
        };
        Ok((open, pending, unpublished))
    }
}
