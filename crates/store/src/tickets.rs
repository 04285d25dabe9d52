//! Ticket issuance (design §11): one ticket per held seat, id derived from (order, seat), so a
//! replay inserts nothing new (invariant 1: `ticket_seat_uq` makes a second ticket for a seat
//! impossible whatever the path); voiding, which marks a ticket and never deletes it, so the
//! seat stays taken (case C14); and an operator's explicit return of a voided ticket's seat to
//! sale, after which the seat can be held and ticketed again (the index is partial on
//! `seat_released_at IS NULL`: one ticket that holds a seat, however many voided ones released it).

use crate::holds::ReleasedSeats;
use crate::{StoreError, Tx};
use boxoffice_domain::{ids::ticket_id, OrderId, SeatId};
use uuid::Uuid;

/// Inserts the tickets of the seats `order`'s hold gave back ([`ReleasedSeats`], from
/// [`crate::holds::transition_returning_seats`]) for `order` (insert-or-nothing) and returns
/// their ticket ids, in ascending seat id. Errors, nothing written: [`StoreError::Corrupt`]
/// when the set is empty (the move kept the seats, or the hold had none) or is another
/// order's hold's; a unique violation on `ticket_seat_uq` only if another order holds a
/// ticket for one of these seats — an invariant breach the caller must surface.
pub async fn issue(
    tx: &mut Tx<'_>,
    order: OrderId,
    seats: &ReleasedSeats,
    event: Uuid,
) -> Result<Vec<Uuid>, StoreError> {
    if seats.order() != order {
        return Err(StoreError::Corrupt(format!(
            "order {order}: the seats to ticket are order {}'s",
            seats.order()
        )));
    }
    let seats = seats.ids();
    if seats.is_empty() {
        return Err(StoreError::Corrupt(format!("order {order}: its hold gave back no seats to ticket")));
    }
    let ids: Vec<Uuid> = seats.iter().map(|s| ticket_id(order, SeatId(*s))).collect();
    sqlx::query(
        "INSERT INTO tickets (id, order_id, seat_id, event_id)
         SELECT unnest($1::uuid[]), $2, unnest($3::uuid[]), $4
         ON CONFLICT (order_id, seat_id) DO NOTHING",
    )
    .bind(&ids)
    .bind(order.0)
    .bind(seats)
    .bind(event)
    .execute(&mut **tx)
    .await?;
    Ok(ids)
}

/// Voids the valid tickets of `order` with `reason` (`voided_at` set, never deleted; the seat
/// stays taken). Returns the ids voided now (empty on a replay).
pub async fn void(tx: &mut Tx<'_>, order: OrderId, reason: &str) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE tickets SET voided_at = clock_timestamp(), void_reason = $2
          WHERE order_id = $1 AND voided_at IS NULL
         RETURNING id",
    )
    .bind(order.0)
    .bind(reason)
    .fetch_all(&mut **tx)
    .await
}

/// Flags the valid tickets of `order` as disputed (they stay valid). Returns how many.
pub async fn flag_disputed(tx: &mut Tx<'_>, order: OrderId) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE tickets SET disputed_at = COALESCE(disputed_at, clock_timestamp())
          WHERE order_id = $1 AND voided_at IS NULL",
    )
    .bind(order.0)
    .execute(&mut **tx)
    .await?;
    Ok(r.rows_affected())
}

/// A dispute of `order` was won: clears the disputed flag, and makes valid again the tickets
/// voided with `voided_for` (the reason an open dispute voids them) whose seat was not put
/// back on sale meanwhile. Returns how many tickets changed.
pub async fn restore_disputed(tx: &mut Tx<'_>, order: OrderId, voided_for: &str) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE tickets SET disputed_at = NULL,
                voided_at = CASE WHEN void_reason = $2 AND seat_released_at IS NULL THEN NULL ELSE voided_at END,
                void_reason = CASE WHEN void_reason = $2 AND seat_released_at IS NULL THEN NULL ELSE void_reason END
          WHERE order_id = $1 AND (disputed_at IS NOT NULL OR void_reason = $2)",
    )
    .bind(order.0)
    .bind(voided_for)
    .execute(&mut **tx)
    .await?;
    Ok(r.rows_affected())
}

/// What [`release_for_resale`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resale {
    /// The voided tickets' seats are on sale again: `(ticket id, seat id)` of each, now.
    Released(Vec<(Uuid, SeatId)>),
    /// The order has valid tickets: nothing is released (void them first; a refund does).
    TicketsStillValid,
    /// Nothing left to release: no voided ticket, or every seat already released.
    Nothing,
}

/// An operator's explicit choice (case C14): puts the seats of `order`'s voided tickets back
/// on sale. Each ticket row stays, voided, with `seat_released_at`; the order's hold lets go of
/// those seats, so a new hold can take them and the seat map shows them available. Refused
/// while any ticket of the order is still valid. Runs under the order's row lock, so it
/// serialises with the saga's voiding and a won dispute's restore.
pub async fn release_for_resale(tx: &mut Tx<'_>, order: OrderId) -> Result<Resale, sqlx::Error> {
    sqlx::query("SELECT 1 FROM orders WHERE id = $1 FOR UPDATE").bind(order.0).execute(&mut **tx).await?;
    let valid: i64 =
        sqlx::query_scalar("SELECT count(*) FROM tickets WHERE order_id = $1 AND voided_at IS NULL")
            .bind(order.0)
            .fetch_one(&mut **tx)
            .await?;
    if valid > 0 {
        return Ok(Resale::TicketsStillValid);
    }
    let released: Vec<(Uuid, Uuid)> = sqlx::query_as(
        "UPDATE tickets SET seat_released_at = clock_timestamp()
          WHERE order_id = $1 AND voided_at IS NOT NULL AND seat_released_at IS NULL
         RETURNING id, seat_id",
    )
    .bind(order.0)
    .fetch_all(&mut **tx)
    .await?;
    if released.is_empty() {
        return Ok(Resale::Nothing);
    }
    let seats: Vec<Uuid> = released.iter().map(|r| r.1).collect();
    sqlx::query(
        "UPDATE hold_seats hs SET released_at = clock_timestamp()
           FROM holds h
          WHERE h.id = hs.hold_id AND h.order_id = $1 AND hs.seat_id = ANY($2) AND hs.released_at IS NULL",
    )
    .bind(order.0)
    .bind(&seats)
    .execute(&mut **tx)
    .await?;
    Ok(Resale::Released(released.into_iter().map(|(t, s)| (t, SeatId(s))).collect()))
}
