//! Events and their reserved-seating venues: idempotent seeding, the sales window, and the
//! (possibly stale) availability map. The map is a hint for buyers; only the hold transaction
//! decides. The sales window (`sales_open_at`, `sales_close_at`) is the ledger's: the hold
//! transaction checks it, and the waiting room only caches it (case C18).

use boxoffice_domain::EventId;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

/// One block of seats with a single price level.
#[derive(Debug, Clone)]
pub struct SectionSpec {
    /// Section name without prefix, e.g. `104` (labels read `S104-R12-S7`).
    pub name: String,
    /// Rows in the section, numbered from 1.
    pub rows: u32,
    /// Seats per row, numbered from 1.
    pub seats_per_row: u32,
    /// Price level per row: `(level name, price in minor units)`.
    pub price_for_row: fn(u32) -> (&'static str, i64),
}

/// A venue layout.
#[derive(Debug, Clone)]
pub struct VenueSpec {
    /// Venue name.
    pub name: String,
    /// Sections.
    pub sections: Vec<SectionSpec>,
    /// Lower-case ISO 4217 currency of all prices.
    pub currency: String,
}

fn lower_bowl(row: u32) -> (&'static str, i64) {
    if row <= 8 {
        ("P1", 18_500)
    } else {
        ("P2", 12_000)
    }
}

fn upper_bowl(row: u32) -> (&'static str, i64) {
    if row <= 6 {
        ("P3", 7_900)
    } else {
        ("P4", 4_900)
    }
}

impl VenueSpec {
    /// The default arena: 24 lower-bowl sections (101–124) of 20 rows × 20 seats and 28
    /// upper-bowl sections (201–228) of 15 rows × 20 seats: 18,000 seats, four price levels
    /// (185.00, 120.00, 79.00, 49.00 USD).
    pub fn arena() -> Self {
        let mut sections = Vec::new();
        for s in 101..=124 {
            sections.push(SectionSpec {
                name: s.to_string(),
                rows: 20,
                seats_per_row: 20,
                price_for_row: lower_bowl,
            });
        }
        for s in 201..=228 {
            sections.push(SectionSpec {
                name: s.to_string(),
                rows: 15,
                seats_per_row: 20,
                price_for_row: upper_bowl,
            });
        }
        Self { name: "Harbour Arena".into(), sections, currency: "usd".into() }
    }

    /// A small venue for tests and demos: `sections` × `rows` × `seats_per_row`.
    pub fn small(sections: u32, rows: u32, seats_per_row: u32) -> Self {
        Self {
            name: "Studio".into(),
            sections: (1..=sections)
                .map(|s| SectionSpec {
                    name: (100 + s).to_string(),
                    rows,
                    seats_per_row,
                    price_for_row: lower_bowl,
                })
                .collect(),
            currency: "usd".into(),
        }
    }

    /// Number of seats.
    pub fn seat_count(&self) -> usize {
        self.sections.iter().map(|s| (s.rows * s.seats_per_row) as usize).sum()
    }
}

/// Creates event `name` with every seat of `venue`; an event of that name that exists already
/// is left exactly as it is, seats included, whatever `venue` says (events are unique by
/// name; a new event gets a random id, so ids cannot be guessed from names). A new event is
/// on sale from now with no closing time; [`schedule_sales`] changes that. Returns the event
/// id and the number of seats the event has.
pub async fn seed(
    pool: &PgPool,
    name: &str,
    venue: &VenueSpec,
    starts_at: DateTime<Utc>,
    purchase_cell: &str,
) -> Result<(EventId, i64), sqlx::Error> {
    let mut tx = pool.begin().await?;
    let created: Option<Uuid> = sqlx::query_scalar(
        "INSERT INTO events (id, name, venue, starts_at, purchase_cell, sales_open_at)
         VALUES (gen_random_uuid(), $1, $2, $3, $4, clock_timestamp())
         ON CONFLICT (name) DO NOTHING RETURNING id",
    )
    .bind(name)
    .bind(&venue.name)
    .bind(starts_at)
    .bind(purchase_cell)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(id) = created else {
        // The event exists: its seats are what they are (a venue is never re-seated).
        let (id, count): (Uuid, i64) = sqlx::query_as(
            "SELECT e.id, (SELECT count(*) FROM seats s WHERE s.event_id = e.id) FROM events e WHERE e.name = $1",
        )
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        return Ok((EventId(id), count));
    };
    let event = EventId(id);
    let mut batch = SeatBatch::default();
    for sec in &venue.sections {
        for row in 1..=sec.rows {
            let (level, price) = (sec.price_for_row)(row);
            for n in 1..=sec.seats_per_row {
                let label = format!("S{}-R{}-S{}", sec.name, row, n);
                batch.ids.push(Uuid::new_v5(&event.0, label.as_bytes()));
                batch.labels.push(label);
                batch.sections.push(format!("S{}", sec.name));
                batch.rows.push(format!("R{row}"));
                batch.numbers.push(n as i32);
                batch.levels.push(level.to_owned());
                batch.prices.push(price);
                if batch.ids.len() >= 5_000 {
                    batch.flush(&mut tx, event, &venue.currency).await?;
                }
            }
        }
    }
    batch.flush(&mut tx, event, &venue.currency).await?;
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM seats WHERE event_id = $1")
        .bind(event.0)
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    // Fresh statistics before an onsale: without them the planner may join a whole new
    // venue's seats by hash instead of by key. The tables an onsale fills only once they hold
    // rows ([`crate::analyze_filled`]).
    sqlx::query("ANALYZE seats").execute(pool).await?;
    crate::analyze_filled(pool, &["hold_seats", "holds", "orders", "tickets"]).await?;
    Ok((event, count))
}

#[derive(Default)]
struct SeatBatch {
    ids: Vec<Uuid>,
    labels: Vec<String>,
    sections: Vec<String>,
    rows: Vec<String>,
    numbers: Vec<i32>,
    levels: Vec<String>,
    prices: Vec<i64>,
}

impl SeatBatch {
    async fn flush(
        &mut self,
        tx: &mut crate::Tx<'_>,
        event: EventId,
        currency: &str,
    ) -> Result<(), sqlx::Error> {
        if self.ids.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO seats (id, event_id, label, section, row_label, seat_number, price_level, price_minor, currency)
             SELECT u.id, $1, u.label, u.section, u.row_label, u.n, u.level, u.price, $2
               FROM unnest($3::uuid[], $4::text[], $5::text[], $6::text[], $7::int[], $8::text[], $9::bigint[])
                    AS u(id, label, section, row_label, n, level, price)
             ON CONFLICT DO NOTHING",
        )
        .bind(event.0)
        .bind(currency)
        .bind(&self.ids)
        .bind(&self.labels)
        .bind(&self.sections)
        .bind(&self.rows)
        .bind(&self.numbers)
        .bind(&self.levels)
        .bind(&self.prices)
        .execute(&mut **tx)
        .await?;
        *self = SeatBatch::default();
        Ok(())
    }
}

/// An event's sales window: when buyers may hold seats (`None` opening: not scheduled, not on
/// sale; `None` closing: open-ended).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SalesWindow {
    /// When sales open.
    pub opens_at: Option<DateTime<Utc>>,
    /// When sales close.
    pub closes_at: Option<DateTime<Utc>>,
}

impl SalesWindow {
    /// Whether sales are open at `now`.
    pub fn is_open_at(&self, now: DateTime<Utc>) -> bool {
        self.opens_at.is_some_and(|o| o <= now) && self.closes_at.is_none_or(|c| c > now)
    }
}

/// Sets the sales window of `event`. Returns `false` when the event does not exist.
///
/// Errors: a check violation when `closes_at` is not after `opens_at`.
pub async fn schedule_sales(pool: &PgPool, event: EventId, window: SalesWindow) -> Result<bool, sqlx::Error> {
    let r = sqlx::query("UPDATE events SET sales_open_at = $2, sales_close_at = $3 WHERE id = $1")
        .bind(event.0)
        .bind(window.opens_at)
        .bind(window.closes_at)
        .execute(pool)
        .await?;
    Ok(r.rows_affected() == 1)
}

/// The sales window of `event` and the database clock's now, or `None` when the event does
/// not exist.
pub async fn sales_window(
    pool: &PgPool,
    event: EventId,
) -> Result<Option<(SalesWindow, DateTime<Utc>)>, sqlx::Error> {
    type Row = (Option<DateTime<Utc>>, Option<DateTime<Utc>>, DateTime<Utc>);
    let row: Option<Row> =
        sqlx::query_as("SELECT sales_open_at, sales_close_at, clock_timestamp() FROM events WHERE id = $1")
            .bind(event.0)
            .fetch_optional(pool)
            .await?;
    Ok(row.map(|(opens_at, closes_at, now)| (SalesWindow { opens_at, closes_at }, now)))
}

/// What an open dispute does to `event`'s tickets (`events.dispute_policy`: `keep` or `void`).
pub async fn dispute_policy<'e, E: sqlx::Executor<'e, Database = sqlx::Postgres>>(
    ex: E,
    event: Uuid,
) -> Result<String, sqlx::Error> {
    sqlx::query_scalar("SELECT dispute_policy FROM events WHERE id = $1").bind(event).fetch_one(ex).await
}

/// Sets what an open dispute does to `event`'s tickets (`keep` or `void`). Returns `false`
/// when the event does not exist.
pub async fn set_dispute_policy(pool: &PgPool, event: EventId, policy: &str) -> Result<bool, sqlx::Error> {
    let r = sqlx::query("UPDATE events SET dispute_policy = $2 WHERE id = $1")
        .bind(event.0)
        .bind(policy)
        .execute(pool)
        .await?;
    Ok(r.rows_affected() == 1)
}

/// The per-buyer limits of `event`: `(max_seats_per_buyer, max_active_holds_per_buyer)`.
pub async fn buyer_limits(pool: &PgPool, event: EventId) -> Result<(i32, i32), sqlx::Error> {
    sqlx::query_as("SELECT max_seats_per_buyer, max_active_holds_per_buyer FROM events WHERE id = $1")
        .bind(event.0)
        .fetch_one(pool)
        .await
}

/// Sets the per-buyer limits of `event` (both > 0). Returns `false` when the event does not
/// exist.
pub async fn set_buyer_limits(
    pool: &PgPool,
    event: EventId,
    max_seats: i32,
    max_active_holds: i32,
) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE events SET max_seats_per_buyer = $2, max_active_holds_per_buyer = $3 WHERE id = $1",
    )
    .bind(event.0)
    .bind(max_seats)
    .bind(max_active_holds)
    .execute(pool)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// One seat on the availability map.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SeatAvailability {
    /// Seat id (what a hold request names).
    pub seat_id: Uuid,
    /// `S104-R12-S7`.
    pub label: String,
    /// `S104`.
    pub section: String,
    /// `R12`.
    #[sqlx(rename = "row_label")]
    pub row: String,
    /// Seat number within the row; adjacent seats differ by one.
    pub number: i32,
    /// Price level name.
    pub price_level: String,
    /// Price in minor units.
    pub price_minor: i64,
    /// Currency.
    pub currency: String,
    /// `available`, `held` or `sold`.
    pub status: String,
}

/// The name of event `event`'s venue (`None`: no such event).
pub async fn venue_name(pool: &PgPool, event: EventId) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT venue FROM events WHERE id = $1").bind(event.0).fetch_optional(pool).await
}

/// Whether event `event` exists.
pub async fn event_exists(pool: &PgPool, event: EventId) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM events WHERE id = $1)")
        .bind(event.0)
        .fetch_one(pool)
        .await
}

/// The availability of every seat of `event`, ordered by section, row and number; `None`
/// if the event does not exist.
pub async fn seat_map(pool: &PgPool, event: EventId) -> Result<Option<Vec<SeatAvailability>>, sqlx::Error> {
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM events WHERE id = $1)")
        .bind(event.0)
        .fetch_one(pool)
        .await?;
    if !exists {
        return Ok(None);
    }
    sqlx::query_as(
        "SELECT s.id AS seat_id, s.label, s.section, s.row_label, s.seat_number AS number, s.price_level,
                s.price_minor, s.currency,
                CASE WHEN t.seat_id IS NOT NULL OR s.sold_in_cell IS NOT NULL THEN 'sold'
                     WHEN hs.seat_id IS NOT NULL THEN 'held'
                     ELSE 'available' END AS status
           FROM seats s
           LEFT JOIN tickets t ON t.seat_id = s.id AND t.seat_released_at IS NULL
           LEFT JOIN hold_seats hs ON hs.seat_id = s.id AND hs.released_at IS NULL
          WHERE s.event_id = $1
          ORDER BY s.section, length(s.row_label), s.row_label, s.seat_number",
    )
    .bind(event.0)
    .fetch_all(pool)
    .await
    .map(Some)
}
