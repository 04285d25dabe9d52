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
//!
//! # Periodic sweeps
//!
//! A statement a worker repeats on a timer reads what is due through an index, never the
//! whole table, however large the table has grown: the expiry worker's sweeps of lapsed holds
//! (`holds::expire_due`, `holds::check_lapsing`, every 250 ms) and its prunes of the inbox,
//! of expired idempotency keys, of webhook events without an order id, of re-fetches whose
//! last claim is an hour old (`stripe_events::prune_refetches`) and of re-fetch budgets whose
//! window ended (`stripe_events::prune_refetch_budgets`, `stripe_events::prune_follow_ups`),
//! and its settling
//! of capture claims (`stripe_events::settle_capture_claims`; every 10 s), the
//! relay's moves of published outbox rows and its prunes of the order history (every 30 s),
//! and the release controller's hold signals that count what is due (`signals`). Each states
//! the time it compares with as `now()` (the transaction's start, a stable value), not
//! `clock_timestamp()`: PostgreSQL cannot use a volatile value as an index condition, so a
//! `clock_timestamp()` bound turns the index range into a scan of every row. Where an exact
//! verdict needs the clock (a hold's lapse, [`holds::LAPSED`]), it filters the rows the range
//! found. A prune takes its batch in the index's order (`ORDER BY` the time, `LIMIT`), so the
//! plan is an index scan that stops at the batch, whatever the table's statistics say or
//! however large the backlog, and deletes by the ctids it found (`ctid = ANY (ARRAY(…))`), so
//! no join can read the table again. The expiry worker's capture-deadline sweep
//! (`holds::lock_lapsing_authorizations`) reads the orders awaiting their capture, a state an
//! order passes through in seconds, and locks only the holds of those it takes. The
//! integration test `sweeps::every_periodic_sweep_reads_only_what_is_due` counts the rows
//! each one reads beside thousands that are not due.
//!
//! # Lookups by keys
//!
//! The purchase path's statements that read the rows of an array of keys (a consumer's batch,
//! a run of facts, the status streams' read, the provider check's sweep:
//! `payments::prechecks`, `payments::get_all`, `orders::views`, `outbox::not_committed`,
//! `holds::lock_all_for_orders`, `holds::lock_all_with_orders`, `holds::check_lapsing`) look
//! each key up on its own: `unnest` of the keys, then per table a `LATERAL` subquery that a
//! `LIMIT` (or a row lock) keeps PostgreSQL from flattening into a join, or a scalar subquery
//! (`outbox::not_committed`), evaluated once per key, by its index unless the plan was made
//! while the table's statistics said it was a page or so (below). Every session keeps one
//! generic plan per statement (`db_plan_cache_mode`) until the table's statistics change;
//! PostgreSQL plans an array
//! parameter as ten keys, and ten keys joined to a table of a few thousand rows cost less by a
//! hash join over the whole table, a plan that then reads every row at every size until the
//! next `ANALYZE`. A statement about one re-fetch names its key beside the `ctid` it found
//! (`stripe_events::finish_refetch`, `stripe_events::drop_pending_refetch`), for the same
//! reason. A session that plans a lookup of a table whose statistics say it is empty, while
//! it is a page or so, reads it whole even for one key, so `venue::seed` and the bench analyze
//! the tables an onsale fills only once they hold rows ([`analyze_filled`]). The integration
//! tests `sweeps::lookups_by_keys_read_only_their_keys_whatever_size_the_plan_saw` and
//! `sweeps::lookups_by_keys_planned_on_a_new_ledger_read_only_their_keys` plan the consumers'
//! and the re-fetches' statements above (not `holds::check_lapsing`) on a ledger of a thousand
//! rows a table, and on a new ledger (a venue just seeded and three orders), and count what
//! each reads of orders, holds, payments, the inbox, the outbox, the order history and the
//! re-fetches once five thousand rows more were added to each.

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

pub use error::{is_overload, is_retryable, IllegalTransition, StoreError};

use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::time::Duration;

/// Every migration, embedded in the binary (`boxoffice migrate` applies them, through
/// [`migrate`]).
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The indexes the migrations build `CONCURRENTLY` (outside a transaction, so that writers
/// go on meanwhile). A build that fails (cancelled, a lock wait timed out, a crash) leaves
/// its index behind, invalid, and its migration unrecorded; [`migrate`] drops such an index
/// before it runs the migration again.
pub const CONCURRENT_INDEXES: &[&str] = &[
    "outbox_parked_idx",
    "stripe_events_pending_received_idx",
    "inbox_processed_idx",
    "outbox_published_idx",
    "stripe_events_unclaimed_idx",
    "stripe_events_ordered_idx",
];

/// A migration's lock waits at most this long, ms: an `ALTER TABLE` queued behind a long
/// query of a live table would hold up every writer queued behind it. The migration fails
/// instead, and `boxoffice migrate` can be run again.
pub const MIGRATION_LOCK_TIMEOUT_MS: u32 = 5_000;

/// The session advisory lock that makes one [`migrate`] at a time run on a database (the key
/// pair `'BXM1'`, 1).
pub const MIGRATE_LOCK: (i32, i32) = (1_113_083_185, 1);

/// Applies [`MIGRATOR`] on a connection of its own, made from `options` with no
/// `statement_timeout` (an index built `CONCURRENTLY` on a large table takes what it takes)
/// and a `lock_timeout` of [`MIGRATION_LOCK_TIMEOUT_MS`], one migrator at a time
/// ([`MIGRATE_LOCK`], tried every 250 ms for as long as another holds it, said once at info;
/// a migrator of a build without it takes only sqlx's own lock). First drops each index of
/// [`CONCURRENT_INDEXES`] that a failed build left invalid, so that its migration builds it
/// again. Returns the indexes dropped.
///
/// # Errors
/// The connection's, the drop's or the migrator's.
pub async fn migrate(options: PgConnectOptions) -> Result<Vec<String>, sqlx::migrate::MigrateError> {
    use sqlx::{ConnectOptions, Connection};
    let options = options.options([
        ("statement_timeout", "0".to_owned()),
        ("idle_in_transaction_session_timeout", "0".to_owned()),
        ("lock_timeout", MIGRATION_LOCK_TIMEOUT_MS.to_string()),
    ]);
    let mut c = options.connect().await?;
    let outcome = async {
        // Waits for another migrator by trying, between statements: a session waiting inside
        // a statement holds a snapshot, which the other's `CREATE INDEX CONCURRENTLY` would
        // wait for while this one waits for its lock (a deadlock PostgreSQL breaks by
        // cancelling the build).
        let mut told = false;
        while !sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_lock($1, $2)")
            .bind(MIGRATE_LOCK.0)
            .bind(MIGRATE_LOCK.1)
            .fetch_one(&mut c)
            .await?
        {
            if !std::mem::replace(&mut told, true) {
                tracing::info!("another migrator holds this database's migration lock: waiting for it");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let invalid: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_index i
               JOIN pg_class c ON c.oid = i.indexrelid
              WHERE NOT i.indisvalid AND c.relname = ANY($1)
                AND c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())",
        )
        .bind(CONCURRENT_INDEXES)
        .fetch_all(&mut c)
        .await?;
        for name in &invalid {
            // A name of CONCURRENT_INDEXES, quoted.
            sqlx::query(&format!("DROP INDEX CONCURRENTLY IF EXISTS \"{name}\"")).execute(&mut c).await?;
        }
        MIGRATOR.run_direct(&mut c).await?;
        Ok(invalid)
    }
    .await;
    // Closing the session gives the advisory lock up.
    let _ = c.close().await;
    outcome
}

/// A transaction on the ledger.
pub type Tx<'a> = sqlx::Transaction<'a, sqlx::Postgres>;

/// `ANALYZE`s each of `tables` that holds a row and leaves an empty one as it is ("Lookups by
/// keys" above): an empty table analyzed is recorded as empty, and a session that plans a
/// lookup of it while it is a page or so reads it whole even for one key, a plan it keeps
/// while the table fills, until the next `ANALYZE`. A table never analyzed is planned as ten
/// pages at least (PostgreSQL 14 and later), where one key is cheaper by its index. `tables`
/// are names of this crate's tables (not quoted). Returns the tables analyzed.
///
/// # Errors
/// The database's.
pub async fn analyze_filled(pool: &PgPool, tables: &[&str]) -> Result<Vec<String>, sqlx::Error> {
    let mut analyzed = Vec::new();
    for table in tables {
        let filled: bool =
            sqlx::query_scalar(&format!("SELECT EXISTS (SELECT 1 FROM {table})")).fetch_one(pool).await?;
        if filled {
            sqlx::query(&format!("ANALYZE {table}")).execute(pool).await?;
            analyzed.push((*table).to_owned());
        }
    }
    Ok(analyzed)
}

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
