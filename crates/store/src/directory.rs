//! The event directory (design §13), in the control database that belongs to no cell:
//! `event → cell, directory_epoch, state (active | moving)`. The router and the operator's
//! `cells` commands read and write it; no cell process ever connects to it, and nothing on the
//! hold path waits for it (a cell's own ledger says whether it sells an event,
//! [`crate::cells`]).
//!
//! Protects the single seller of an event: the epoch only grows (a move bumps it by one under
//! the row's lock, [`finish_move`]), and a move in progress is recorded ([`begin_move`]) so an
//! interrupted move is resumed, not started twice towards two cells.

use chrono::{DateTime, Utc};
use sqlx::migrate::Migrator;
use sqlx::PgPool;
use uuid::Uuid;

/// The control database's migrations (`boxoffice cells` applies them).
pub static CONTROL_MIGRATOR: Migrator = sqlx::migrate!("./control_migrations");

/// One event's entry.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, serde::Serialize)]
pub struct Entry {
    /// The event.
    pub event_id: Uuid,
    /// The cell that sells it.
    pub cell: String,
    /// Bumped by one on every move; admission tokens carry it.
    pub directory_epoch: i64,
    /// `active` or `moving`.
    pub state: String,
    /// The target of a move under way.
    pub moving_to: Option<String>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
}

/// Why a directory change was refused.
#[derive(Debug, thiserror::Error)]
pub enum DirectoryError {
    /// The event is already assigned to another cell (use a move).
    #[error("event {event} is already assigned to {cell}")]
    AssignedElsewhere {
        /// The event.
        event: Uuid,
        /// Its cell.
        cell: String,
    },
    /// The event has no entry.
    #[error("event {0} is not in the directory")]
    Unknown(Uuid),
    /// Another move of the event is under way towards a different cell.
    #[error("event {event} is already moving to {to}")]
    MovingElsewhere {
        /// The event.
        event: Uuid,
        /// The other move's target.
        to: String,
    },
    /// The database failed.
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Every entry, by event id.
pub async fn list(pool: &PgPool) -> Result<Vec<Entry>, sqlx::Error> {
    sqlx::query_as(
        "SELECT event_id, cell, directory_epoch, state, moving_to, updated_at FROM event_directory ORDER BY event_id",
    )
    .fetch_all(pool)
    .await
}

/// One entry.
pub async fn get(pool: &PgPool, event: Uuid) -> Result<Option<Entry>, sqlx::Error> {
    sqlx::query_as(
        "SELECT event_id, cell, directory_epoch, state, moving_to, updated_at FROM event_directory WHERE event_id = $1",
    )
    .bind(event)
    .fetch_optional(pool)
    .await
}

/// Assigns a new event to `cell` at `epoch` (the epoch its cell's ledger has). Idempotent for
/// the same cell; refused for an event assigned elsewhere.
pub async fn assign(pool: &PgPool, event: Uuid, cell: &str, epoch: i64) -> Result<Entry, DirectoryError> {
    sqlx::query(
        "INSERT INTO event_directory (event_id, cell, directory_epoch, state) VALUES ($1, $2, $3, 'active')
         ON CONFLICT (event_id) DO NOTHING",
    )
    .bind(event)
    .bind(cell)
    .bind(epoch)
    .execute(pool)
    .await?;
    let entry = get(pool, event).await?.ok_or(DirectoryError::Unknown(event))?;
    if entry.cell != cell {
        return Err(DirectoryError::AssignedElsewhere { event, cell: entry.cell });
    }
    Ok(entry)
}

/// Records a move of `event` to `to` (state `moving`); resumes one already recorded towards
/// the same cell. Returns the entry as it was before the move finishes.
pub async fn begin_move(pool: &PgPool, event: Uuid, to: &str) -> Result<Entry, DirectoryError> {
    let mut tx = pool.begin().await?;
    let entry: Entry = sqlx::query_as(
        "SELECT event_id, cell, directory_epoch, state, moving_to, updated_at
           FROM event_directory WHERE event_id = $1 FOR UPDATE",
    )
    .bind(event)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or(DirectoryError::Unknown(event))?;
    match entry.moving_to.as_deref() {
        Some(other) if other != to => {
            return Err(DirectoryError::MovingElsewhere { event, to: other.to_owned() });
        }
        Some(_) => {}
        None => {
            sqlx::query(
                "UPDATE event_directory SET state = 'moving', moving_to = $2, updated_at = now() WHERE event_id = $1",
            )
            .bind(event)
            .bind(to)
            .execute(&mut *tx)
            .await?;
        }
    }
    tx.commit().await?;
    Ok(entry)
}

/// Gives a recorded move up: the entry is `active` at its cell again.
pub async fn abandon_move(pool: &PgPool, event: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE event_directory SET state = 'active', moving_to = NULL, updated_at = now()
          WHERE event_id = $1 AND state = 'moving'",
    )
    .bind(event)
    .execute(pool)
    .await?;
    Ok(())
}

/// Finishes a recorded move: the event belongs to its target at `epoch` (the epoch the
/// target's ledger was written with, one above the entry's).
pub async fn finish_move(pool: &PgPool, event: Uuid, epoch: i64) -> Result<Entry, DirectoryError> {
    sqlx::query(
        "UPDATE event_directory SET cell = moving_to, directory_epoch = $2, state = 'active', moving_to = NULL,
                updated_at = now()
          WHERE event_id = $1 AND state = 'moving' AND directory_epoch < $2",
    )
    .bind(event)
    .bind(epoch)
    .execute(pool)
    .await?;
    get(pool, event).await?.ok_or(DirectoryError::Unknown(event))
}
