//! Events and their reserved-seating venues: idempotent seeding and the (possibly stale)
//! availability map. The map is a hint for buyers; only the hold transaction decides.

use boxoffice_domain::EventId;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

/// Namespace for deterministic event and seat ids, so seeding twice changes nothing.
const VENUE_NAMESPACE: Uuid = Uuid::from_u128(0x2b9c_71e4_0d55_4c1a_8e3f_5a6b_7c8d_9e0f);

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

/// The deterministic id of the event called `name`.
pub fn event_id_for(name: &str) -> EventId {
    EventId(Uuid::new_v5(&VENUE_NAMESPACE, name.as_bytes()))
}

/// Creates event `name` (id [`event_id_for`]) with every seat of `venue`, or does nothing for
/// what already exists. Returns the event id and the number of seats the event has.
pub async fn seed(
    pool: &PgPool,
    name: &str,
    venue: &VenueSpec,
    starts_at: DateTime<Utc>,
    purchase_cell: &str,
) -> Result<(EventId, i64), sqlx::Error> {
    let event = event_id_for(name);
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO events (id, name, venue, starts_at, purchase_cell) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (id) DO NOTHING",
    )
    .bind(event.0)
    .bind(name)
    .bind(&venue.name)
    .bind(starts_at)
    .bind(purchase_cell)
    .execute(&mut *tx)
    .await?;
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
    // venue's seats by hash instead of by key.
    sqlx::query("ANALYZE seats, hold_seats, holds, orders, tickets").execute(pool).await?;
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
                CASE WHEN t.seat_id IS NOT NULL THEN 'sold'
                     WHEN hs.seat_id IS NOT NULL THEN 'held'
                     ELSE 'available' END AS status
           FROM seats s
           LEFT JOIN tickets t ON t.seat_id = s.id
           LEFT JOIN hold_seats hs ON hs.seat_id = s.id AND hs.released_at IS NULL
          WHERE s.event_id = $1
          ORDER BY s.section, length(s.row_label), s.row_label, s.seat_number",
    )
    .bind(event.0)
    .fetch_all(pool)
    .await
    .map(Some)
}
