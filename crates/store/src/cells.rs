//! A cell's side of purchase cells (design §13): which cell sells each event of this ledger,
//! at which directory epoch, and the steps of moving an event out of or into this ledger.
//!
//! Protects invariant 1 across cells: an event is sold by exactly one ledger at a time. The
//! hold transaction refuses an event whose row here is not `active` for this cell at the
//! admission token's epoch (`holds::reserve`, [`Placement::admits`]). A move
//! [`freeze`]s the event (no new holds), waits until every transaction that could have read
//! it as `active` has ended ([`wait_for_transactions_before`]) and every open order has
//! settled, [`export`]s the event and its seats — marking each seat sold by this ledger, or by
//! an earlier one, as `sold_in_cell` — [`import`]s them into the target's ledger at the new
//! epoch as `frozen`, marks the source [`mark_moved`], and only then [`activate`]s the target:
//! at no instant do two ledgers sell the event. Orders, payments and tickets never
//! leave their cell.

use crate::Tx;
use boxoffice_domain::EventId;
use chrono::{DateTime, Utc};
use sqlx::PgPool;
use std::time::Duration;
use uuid::Uuid;

/// What this ledger may do with an event (`events.cell_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CellState {
    /// This ledger sells the event.
    Active,
    /// A move is under way: no new holds, open orders settle.
    Frozen,
    /// Another cell sells the event now.
    Moved,
}

impl CellState {
    /// The stored value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Frozen => "frozen",
            Self::Moved => "moved",
        }
    }
}

impl TryFrom<String> for CellState {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "active" => Ok(Self::Active),
            "frozen" => Ok(Self::Frozen),
            "moved" => Ok(Self::Moved),
            _ => Err(format!("unknown cell state {s:?}")),
        }
    }
}

/// The columns of `events` a [`Placement`] is read from, named as its fields.
macro_rules! placement_columns {
    () => {
        "purchase_cell AS cell, directory_epoch, cell_state AS state"
    };
}

/// Where an event is sold, as this ledger knows it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Placement {
    /// The cell that sells the event (`events.purchase_cell`): this one while `active` or
    /// `frozen`, the target once `moved`.
    pub cell: String,
    /// The directory epoch of that placement (`events.directory_epoch`).
    pub directory_epoch: i64,
    /// What this ledger may do.
    #[sqlx(try_from = "String")]
    pub state: CellState,
}

/// Why a placement refuses a hold: the hold transaction's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The event is sold by another cell (`cell`, at `directory_epoch`). → 409
    /// `event_in_another_cell`
    ElsewhereCell {
        /// The cell that sells it.
        cell: String,
        /// At which epoch.
        directory_epoch: i64,
    },
    /// The token was minted at another directory epoch than the event's here. → 409
    /// `admission_token_stale_epoch`
    StaleEpoch {
        /// The event's epoch in this ledger.
        directory_epoch: i64,
    },
    /// A move is under way. → 503 `event_moving`
    Moving,
}

impl Placement {
    /// Whether a hold for `cell` at `epoch` (the admission token's) may be taken here.
    pub fn admits(&self, cell: &str, epoch: i64) -> Result<(), Refusal> {
        match self.state {
            CellState::Moved => {
                Err(Refusal::ElsewhereCell { cell: self.cell.clone(), directory_epoch: self.directory_epoch })
            }
            _ if self.cell != cell => {
                Err(Refusal::ElsewhereCell { cell: self.cell.clone(), directory_epoch: self.directory_epoch })
            }
            _ if self.directory_epoch != epoch => {
                Err(Refusal::StaleEpoch { directory_epoch: self.directory_epoch })
            }
            CellState::Frozen => Err(Refusal::Moving),
            CellState::Active => Ok(()),
        }
    }
}

/// The event's placement here; `None` when this ledger has no such event.
pub async fn placement(pool: &PgPool, event: EventId) -> Result<Option<Placement>, sqlx::Error> {
    sqlx::query_as(concat!("SELECT ", placement_columns!(), " FROM events WHERE id = $1"))
        .bind(event.0)
        .fetch_optional(pool)
        .await
}

/// The event's sales window and placement in one read; `None` when this ledger has no such
/// event (the API's event cache).
pub async fn event_info(
    pool: &PgPool,
    event: EventId,
) -> Result<Option<(crate::venue::SalesWindow, Placement)>, sqlx::Error> {
    #[derive(sqlx::FromRow)]
    struct Row {
        sales_open_at: Option<DateTime<Utc>>,
        sales_close_at: Option<DateTime<Utc>>,
        #[sqlx(flatten)]
        placement: Placement,
    }
    let row: Option<Row> = sqlx::query_as(concat!(
        "SELECT sales_open_at, sales_close_at, ",
        placement_columns!(),
        " FROM events WHERE id = $1"
    ))
    .bind(event.0)
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|r| {
        (crate::venue::SalesWindow { opens_at: r.sales_open_at, closes_at: r.sales_close_at }, r.placement)
    }))
}

/// Every event of this ledger with its placement, by name.
pub async fn events(pool: &PgPool) -> Result<Vec<(Uuid, String, Placement)>, sqlx::Error> {
    #[derive(sqlx::FromRow)]
    struct Row {
        id: Uuid,
        name: String,
        #[sqlx(flatten)]
        placement: Placement,
    }
    let rows: Vec<Row> =
        sqlx::query_as(concat!("SELECT id, name, ", placement_columns!(), " FROM events ORDER BY name"))
            .fetch_all(pool)
            .await?;
    Ok(rows.into_iter().map(|r| (r.id, r.name, r.placement)).collect())
}

/// Step 1 of a move out: no new holds for `event` here (`frozen`). Idempotent; `None` when
/// this ledger does not sell the event for `cell` (unknown, or already moved). Returns the
/// database time read after the freeze committed, for [`wait_for_transactions_before`]: a
/// transaction that began later sees the freeze.
pub async fn freeze(pool: &PgPool, event: EventId, cell: &str) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    let frozen = sqlx::query(
        "UPDATE events SET cell_state = 'frozen'
          WHERE id = $1 AND purchase_cell = $2 AND cell_state IN ('active', 'frozen')",
    )
    .bind(event.0)
    .bind(cell)
    .execute(pool)
    .await?;
    if frozen.rows_affected() == 0 {
        return Ok(None);
    }
    sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(pool).await.map(Some)
}

/// Whether the move's database role can see the transaction start of every other connection
/// in `pg_stat_activity` (superuser or `pg_read_all_stats`): without it
/// [`wait_for_transactions_before`] would find nothing to wait for.
pub async fn sees_every_transaction(pool: &PgPool) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
             OR pg_has_role(current_user, 'pg_read_all_stats', 'MEMBER')",
    )
    .fetch_one(pool)
    .await
}

/// Undoes [`freeze`] (a move that gave up): the event is sold here again.
pub async fn unfreeze(pool: &PgPool, event: EventId) -> Result<bool, sqlx::Error> {
    let r = sqlx::query("UPDATE events SET cell_state = 'active' WHERE id = $1 AND cell_state = 'frozen'")
        .bind(event.0)
        .execute(pool)
        .await?;
    Ok(r.rows_affected() == 1)
}

/// Waits until no transaction of this database that began before `t` is still running
/// (polling `pg_stat_activity`; needs the same role or `pg_read_all_stats`): a hold
/// transaction reads the event's placement without a row lock, so one that read it as
/// `active` before the freeze may still commit; after this, none can. `false` at `timeout`.
pub async fn wait_for_transactions_before(
    pool: &PgPool,
    t: DateTime<Utc>,
    timeout: Duration,
) -> Result<bool, sqlx::Error> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let running: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start < $1",
        )
        .bind(t)
        .fetch_one(pool)
        .await?;
        if running == 0 {
            return Ok(true);
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An event and its seats as copied from one cell's ledger to another's.
#[derive(Debug, Clone)]
pub struct EventExport {
    /// The event row (`id`, `name`, `venue`, `starts_at`, limits, window, dispute policy).
    pub event: ExportedEvent,
    /// Every seat, with the cell whose ledger owns its sale (`None`: on sale).
    pub seats: Vec<ExportedSeat>,
}

/// The event row of an [`EventExport`].
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ExportedEvent {
    /// Event id (the same in every cell).
    pub id: Uuid,
    /// Unique name.
    pub name: String,
    /// Venue name.
    pub venue: String,
    /// When the event starts.
    pub starts_at: DateTime<Utc>,
    /// `max_seats_per_buyer`.
    pub max_seats_per_buyer: i32,
    /// `max_active_holds_per_buyer`.
    pub max_active_holds_per_buyer: i32,
    /// Sales window start.
    pub sales_open_at: Option<DateTime<Utc>>,
    /// Sales window end.
    pub sales_close_at: Option<DateTime<Utc>>,
    /// `dispute_policy`.
    pub dispute_policy: String,
}

/// A seat of an [`EventExport`].
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ExportedSeat {
    /// Seat id (the same in every cell).
    pub id: Uuid,
    /// Label.
    pub label: String,
    /// Section.
    pub section: String,
    /// Row.
    pub row_label: String,
    /// Number in the row.
    pub seat_number: i32,
    /// Price level.
    pub price_level: String,
    /// Price, minor units.
    pub price_minor: i64,
    /// Currency.
    pub currency: String,
    /// The cell whose ledger holds the seat's sale, if sold: this one when a ticket or an
    /// unreleased hold here holds it, else the one it was already marked with.
    pub owner_cell: Option<String>,
}

/// Reads `event` and its seats for a move out of `cell` (after the freeze and the settle).
pub async fn export(pool: &PgPool, event: EventId, cell: &str) -> Result<Option<EventExport>, sqlx::Error> {
    let row: Option<ExportedEvent> = sqlx::query_as(
        "SELECT id, name, venue, starts_at, max_seats_per_buyer, max_active_holds_per_buyer,
                sales_open_at, sales_close_at, dispute_policy
           FROM events WHERE id = $1",
    )
    .bind(event.0)
    .fetch_optional(pool)
    .await?;
    let Some(event_row) = row else { return Ok(None) };
    let seats: Vec<ExportedSeat> = sqlx::query_as(
        "SELECT s.id, s.label, s.section, s.row_label, s.seat_number, s.price_level, s.price_minor, s.currency,
                CASE WHEN EXISTS (SELECT 1 FROM tickets t WHERE t.seat_id = s.id AND t.seat_released_at IS NULL)
                       OR EXISTS (SELECT 1 FROM hold_seats hs WHERE hs.seat_id = s.id AND hs.released_at IS NULL)
                     THEN $2 ELSE s.sold_in_cell END AS owner_cell
           FROM seats s WHERE s.event_id = $1 ORDER BY s.id",
    )
    .bind(event.0)
    .bind(cell)
    .fetch_all(pool)
    .await?;
    Ok(Some(EventExport { event: event_row, seats }))
}

/// Writes an exported event into this ledger (the target's) as `frozen` for `cell` at
/// `epoch`, in one transaction: it sells nothing until [`activate`], which a move runs only
/// after the source is marked [`mark_moved`], so at no instant do two ledgers sell the event.
/// Idempotent, and safe for an event that was sold here before
/// (moved away and back): a seat whose sale this ledger holds keeps it; any other seat takes
/// the export's owner. Refuses (`false`) when this ledger already has the event at a later
/// epoch, or already sells it; errors (unique `events_name_uq`) when another event of this ledger has its name.
pub async fn import(
    pool: &PgPool,
    export: &EventExport,
    cell: &str,
    epoch: i64,
) -> Result<bool, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let e = &export.event;
    let written = sqlx::query(
        "INSERT INTO events (id, name, venue, starts_at, purchase_cell, max_seats_per_buyer,
                             max_active_holds_per_buyer, sales_open_at, sales_close_at, dispute_policy,
                             directory_epoch, cell_state)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 'frozen')
         ON CONFLICT (id) DO UPDATE SET purchase_cell = excluded.purchase_cell,
                max_seats_per_buyer = excluded.max_seats_per_buyer,
                max_active_holds_per_buyer = excluded.max_active_holds_per_buyer,
                sales_open_at = excluded.sales_open_at, sales_close_at = excluded.sales_close_at,
                dispute_policy = excluded.dispute_policy, directory_epoch = excluded.directory_epoch,
                cell_state = 'frozen'
          WHERE events.directory_epoch < excluded.directory_epoch
             OR (events.directory_epoch = excluded.directory_epoch AND events.cell_state = 'frozen'
                 AND events.purchase_cell = excluded.purchase_cell)",
    )
    .bind(e.id)
    .bind(&e.name)
    .bind(&e.venue)
    .bind(e.starts_at)
    .bind(cell)
    .bind(e.max_seats_per_buyer)
    .bind(e.max_active_holds_per_buyer)
    .bind(e.sales_open_at)
    .bind(e.sales_close_at)
    .bind(&e.dispute_policy)
    .bind(epoch)
    .execute(&mut *tx)
    .await?;
    if written.rows_affected() == 0 {
        return Ok(false);
    }
    import_seats(&mut tx, export, cell).await?;
    tx.commit().await?;
    Ok(true)
}

async fn import_seats(tx: &mut Tx<'_>, export: &EventExport, cell: &str) -> Result<(), sqlx::Error> {
    for chunk in export.seats.chunks(2_000) {
        let col = |f: fn(&ExportedSeat) -> String| chunk.iter().map(f).collect::<Vec<_>>();
        let ids: Vec<Uuid> = chunk.iter().map(|s| s.id).collect();
        let numbers: Vec<i32> = chunk.iter().map(|s| s.seat_number).collect();
        let prices: Vec<i64> = chunk.iter().map(|s| s.price_minor).collect();
        // The seat's owner as seen from here: NULL when it is this ledger (its own rows say so).
        let owners: Vec<Option<String>> =
            chunk.iter().map(|s| s.owner_cell.clone().filter(|c| c != cell)).collect();
        sqlx::query(
            "INSERT INTO seats (id, event_id, label, section, row_label, seat_number, price_level,
                                price_minor, currency, sold_in_cell)
             SELECT u.id, $1, u.label, u.section, u.row_label, u.seat_number, u.price_level,
                    u.price_minor, u.currency, u.owner
               FROM unnest($2::uuid[], $3::text[], $4::text[], $5::text[], $6::int[], $7::text[],
                           $8::bigint[], $9::text[], $10::text[])
                    AS u(id, label, section, row_label, seat_number, price_level, price_minor, currency, owner)
             ON CONFLICT (id) DO UPDATE SET sold_in_cell = excluded.sold_in_cell",
        )
        .bind(export.event.id)
        .bind(&ids)
        .bind(col(|s| s.label.clone()))
        .bind(col(|s| s.section.clone()))
        .bind(col(|s| s.row_label.clone()))
        .bind(&numbers)
        .bind(col(|s| s.price_level.clone()))
        .bind(&prices)
        .bind(col(|s| s.currency.clone()))
        .bind(&owners)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

/// The last step of a move in, after the source is marked moved: this ledger sells `event`
/// for `cell` at `epoch`. Idempotent (`true` once active).
pub async fn activate(pool: &PgPool, event: EventId, cell: &str, epoch: i64) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE events SET cell_state = 'active'
          WHERE id = $1 AND purchase_cell = $2 AND directory_epoch = $3 AND cell_state IN ('frozen', 'active')",
    )
    .bind(event.0)
    .bind(cell)
    .bind(epoch)
    .execute(pool)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// The step of a move out after the target holds its frozen copy: this ledger no longer
/// sells `event`; `to` does at `epoch`.
pub async fn mark_moved(pool: &PgPool, event: EventId, to: &str, epoch: i64) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE events SET cell_state = 'moved', purchase_cell = $2, directory_epoch = $3
          WHERE id = $1 AND directory_epoch <= $3",
    )
    .bind(event.0)
    .bind(to)
    .bind(epoch)
    .execute(pool)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// The purchase cells this ledger sells for (`events.purchase_cell` of its events not moved
/// away): what PaymentIntent metadata must name for the intent to be this ledger's.
pub async fn own_cells(pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT DISTINCT purchase_cell FROM events WHERE cell_state <> 'moved'")
        .fetch_all(pool)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(cell: &str, epoch: i64, state: CellState) -> Placement {
        Placement { cell: cell.into(), directory_epoch: epoch, state }
    }

    #[test]
    fn a_placement_admits_only_its_cell_at_its_epoch_while_active() {
        assert_eq!(p("c1", 2, CellState::Active).admits("c1", 2), Ok(()));
        assert_eq!(
            p("c1", 2, CellState::Active).admits("c1", 1),
            Err(Refusal::StaleEpoch { directory_epoch: 2 })
        );
        assert_eq!(
            p("c1", 2, CellState::Active).admits("c2", 2),
            Err(Refusal::ElsewhereCell { cell: "c1".into(), directory_epoch: 2 })
        );
        assert_eq!(p("c1", 2, CellState::Frozen).admits("c1", 2), Err(Refusal::Moving));
        assert_eq!(
            p("c2", 3, CellState::Moved).admits("c2", 3),
            Err(Refusal::ElsewhereCell { cell: "c2".into(), directory_epoch: 3 })
        );
    }
}
