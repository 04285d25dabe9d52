//! The PostgreSQL ledger: migrations plus one module per aggregate.
//!
//! PostgreSQL is the authority for seat ownership (invariant 1, the partial unique index
//! `hold_seat_active_uq` and `ticket_seat_uq`), for order state (invariant 2, row locks taken
//! in the fixed order *seats → hold → order*), for idempotent HTTP requests (invariant 3),
//! for consumer dedupe (invariant 4, `inbox` / `stripe_events`) and for the transactional
//! outbox (invariant 5). No function here makes a network call inside a transaction.
//!
//! Lock order, everywhere: seat rows (ascending id) before hold rows before order rows, and
//! holds and orders of several orders in ascending order id. The hold transaction takes all
//! three (its seats `FOR NO KEY UPDATE`), after the region fence's lock (shared) and the
//! buyer's advisory lock, and its idempotency key's index entry last; the saga, expiry,
//! payment and ticket workers take hold → order. Keeping one order means two of them can wait
//! on each other but never deadlock. A seat is locked after holds and orders in two places,
//! each by a foreign key's `FOR KEY SHARE`: the hold transaction's insert of its hold's seat
//! rows (on seats it has locked already), and a ticket's insert, whose lock conflicts with no
//! seat lock any transaction here takes (`holds::lock_buyer_and_seats`), so it never waits.

pub mod audit;
pub mod cells;
pub mod directory;
pub mod error;
pub mod holds;
pub mod inbox;
pub mod operator;
pub mod orders;
pub mod outbox;
pub mod outcomes;
pub mod payments;
pub mod region;
pub mod revocations;
pub mod signals;
pub mod stripe_events;
pub mod tickets;
pub mod timeline;
pub mod venue;
pub mod witness;

pub use error::{is_retryable, IllegalTransition, StoreError};

use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::time::Duration;

/// Every migration, embedded in the binary (`boxoffice migrate` applies them).
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// A transaction on the ledger.
pub type Tx<'a> = sqlx::Transaction<'a, sqlx::Postgres>;

/// A round trip to the database (readiness probes).
pub async fn ping(pool: &PgPool) -> bool {
    sqlx::query("SELECT 1").execute(pool).await.is_ok()
}

/// Opens a pool of at most `max_connections` with a bounded acquire wait (`acquire_timeout_ms`)
/// so that an overloaded database answers 503 instead of queueing requests forever.
pub async fn connect(
    options: PgConnectOptions,
    max_connections: u32,
    acquire_timeout_ms: u64,
) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .min_connections(0)
        .acquire_timeout(Duration::from_millis(acquire_timeout_ms))
        .connect_with(options)
        .await
}
