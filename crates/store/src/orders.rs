//! Orders: row locks and status writes for the saga, and the owner's read model for
//! `GET /orders/{id}`.
//!
//! [`transition`] (one locked order) and [`expire_unpaid`] (the expiry's set-wise move) are
//! the only writers of `orders.status`; both refuse moves that
//! [`OrderStatus::can_transition_to`] does not list (invariant 2).

use crate::{StoreError, Tx};
use boxoffice_domain::{HoldStatus, OrderId, OrderStatus, PaymentIntentStatus, UserId};
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

/// An order row as locked by the saga.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OrderRow {
    /// Order id.
    pub id: Uuid,
    /// Owner.
    pub user_id: Uuid,
    /// Event.
    pub event_id: Uuid,
    /// Stored status; [`transition`] keeps it current.
    #[sqlx(try_from = "String")]
    pub status: OrderStatus,
    /// Total in minor units.
    pub amount_minor: i64,
    /// Currency.
    pub currency: String,
    /// The buyer journey's correlation id.
    pub correlation_id: Uuid,
}

impl OrderRow {
    /// The status.
    pub fn status(&self) -> OrderStatus {
        self.status
    }
}

/// Locks order `id` (`FOR UPDATE`). Callers lock the hold first.
pub async fn lock(tx: &mut Tx<'_>, id: OrderId) -> Result<Option<OrderRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, user_id, event_id, status, amount_minor, currency, correlation_id
           FROM orders WHERE id = $1 FOR UPDATE",
    )
    .bind(id.0)
    .fetch_optional(&mut **tx)
    .await
}

/// The rows of `ids` that exist (no locks), for reconciliation: a PaymentIntent names its
/// order in metadata, and the ledger may or may not know it.
pub async fn by_ids(pool: &PgPool, ids: &[Uuid]) -> Result<Vec<OrderRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, user_id, event_id, status, amount_minor, currency, correlation_id
           FROM orders WHERE id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(pool)
    .await
}

/// Moves the locked `order` to `to` if [`OrderStatus::can_transition_to`] allows it from its
/// current status; records `reason` as `failure_reason` when given; bumps `version` and
/// updates `order.status`. Returns the previous status.
///
/// Errors: [`StoreError::IllegalTransition`] for a move the table does not list (nothing is
/// written), [`StoreError::Corrupt`] if the row changed under the caller's lock.
pub async fn transition(
    tx: &mut Tx<'_>,
    order: &mut OrderRow,
    to: OrderStatus,
    reason: Option<&str>,
) -> Result<OrderStatus, StoreError> {
    let from = order.status;
    if !from.can_transition_to(to) {
        return Err(crate::IllegalTransition::order(from, to).into());
    }
    let r = sqlx::query(
        "UPDATE orders SET status = $2, failure_reason = COALESCE($3, failure_reason),
                version = version + 1, updated_at = clock_timestamp()
          WHERE id = $1 AND status = $4",
    )
    .bind(order.id)
    .bind(to.as_str())
    .bind(reason)
    .bind(from.as_str())
    .execute(&mut **tx)
    .await?;
    if r.rows_affected() != 1 {
        return Err(StoreError::Corrupt(format!("order {} left {from} under its row lock", order.id)));
    }
    order.status = to;
    metrics::counter!("boxoffice_order_transitions_total", "to" => to.as_str()).increment(1);
    Ok(from)
}

/// The lapsed-hold compensation's set-wise move: orders `ids` (locked by the caller) still
/// waiting for an authorization → `expired` with reason `reason`. Only rows in a status the
/// table lets reach `expired` are written. Returns the ids moved.
pub async fn expire_unpaid(tx: &mut Tx<'_>, ids: &[Uuid], reason: &str) -> Result<Vec<Uuid>, sqlx::Error> {
    if ids.is_empty() {
        return Ok(vec![]);
    }
    let sources: Vec<&str> =
        OrderStatus::sources_of(OrderStatus::Expired).iter().map(|s| s.as_str()).collect();
    let moved: Vec<Uuid> = sqlx::query_scalar(
        "UPDATE orders SET status = 'expired', failure_reason = $3, version = version + 1,
                updated_at = clock_timestamp()
          WHERE id = ANY($1) AND status = ANY($2)
          RETURNING id",
    )
    .bind(ids)
    .bind(&sources)
    .bind(reason)
    .fetch_all(&mut **tx)
    .await?;
    if !moved.is_empty() {
        metrics::counter!("boxoffice_order_transitions_total", "to" => OrderStatus::Expired.as_str())
            .increment(moved.len() as u64);
    }
    Ok(moved)
}

/// Locks orders `ids` in id order (`FOR UPDATE`; the lock order after their holds).
pub async fn lock_many(tx: &mut Tx<'_>, ids: &[Uuid]) -> Result<Vec<OrderRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, user_id, event_id, status, amount_minor, currency, correlation_id
           FROM orders WHERE id = ANY($1) ORDER BY id FOR UPDATE",
    )
    .bind(ids)
    .fetch_all(&mut **tx)
    .await
}

/// The order's total (minor units) and correlation id, or `None` when it does not exist:
/// what webhook ingress compares a Stripe amount with and copies onto the fact it records.
pub async fn amount_and_correlation<'e, E: sqlx::Executor<'e, Database = sqlx::Postgres>>(
    ex: E,
    id: OrderId,
) -> Result<Option<(i64, Uuid)>, sqlx::Error> {
    sqlx::query_as("SELECT amount_minor, correlation_id FROM orders WHERE id = $1")
        .bind(id.0)
        .fetch_optional(ex)
        .await
}

/// A ticket as shown to its owner.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TicketView {
    /// Stable ticket id (uuid v5 of order and seat).
    pub ticket_id: Uuid,
    /// Seat id.
    pub seat_id: Uuid,
    /// Seat label, e.g. `S104-R12-S7`.
    pub seat_label: String,
    /// When it was issued.
    pub issued_at: DateTime<Utc>,
    /// When it was voided (its money went back); a void ticket admits nobody.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub voided_at: Option<DateTime<Utc>>,
}

/// The owner's view of an order (`GET /orders/{id}`).
// Its `Debug` (below) leaves the client secret out.
#[derive(Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OrderView {
    /// Order id.
    pub order_id: Uuid,
    /// Event id.
    pub event_id: Uuid,
    /// Client-visible workflow state.
    pub status: OrderStatus,
    /// Why the order failed, expired or was canceled, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// Total in minor units.
    pub amount_minor: i64,
    /// Lower-case ISO 4217 currency.
    pub currency: String,
    /// Hold id.
    pub hold_id: Option<Uuid>,
    /// Hold status.
    pub hold_status: Option<HoldStatus>,
    /// When the hold lapses unless payment is authorized.
    pub hold_expires_at: Option<DateTime<Utc>>,
    /// Seats of the hold, sorted by label.
    pub seats: Vec<SeatRef>,
    /// The Stripe PaymentIntent id, once created.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payment_intent_id: Option<String>,
    /// The PaymentIntent client secret: only while payment is pending, only to the owner.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_secret: Option<String>,
    /// Tickets, once issued.
    pub tickets: Vec<TicketView>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Last status change.
    pub updated_at: DateTime<Utc>,
}

impl std::fmt::Debug for OrderView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrderView")
            .field("order_id", &self.order_id)
            .field("event_id", &self.event_id)
            .field("status", &self.status)
            .field("failure_reason", &self.failure_reason)
            .field("hold_status", &self.hold_status)
            .field("payment_intent_id", &self.payment_intent_id)
            .field("client_secret", &self.client_secret.as_ref().map(|_| "[redacted]"))
            .field("seats", &self.seats.len())
            .field("tickets", &self.tickets.len())
            .finish_non_exhaustive()
    }
}

/// A seat reference in an order view.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SeatRef {
    /// Seat id.
    pub seat_id: Uuid,
    /// Label.
    pub label: String,
    /// Price in minor units.
    pub price_minor: i64,
}

#[derive(sqlx::FromRow)]
struct ViewRow {
    id: Uuid,
    user_id: Uuid,
    event_id: Uuid,
    status: String,
    failure_reason: Option<String>,
    amount_minor: i64,
    currency: String,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    hold_id: Option<Uuid>,
    hold_status: Option<String>,
    hold_expires_at: Option<DateTime<Utc>>,
    payment_intent_id: Option<String>,
    client_secret: Option<String>,
    payment_status: Option<String>,
    seats: sqlx::types::Json<Vec<SeatRefRow>>,
    tickets: sqlx::types::Json<Vec<TicketRow>>,
}

#[derive(serde::Deserialize)]
struct SeatRefRow {
    seat_id: Uuid,
    label: String,
    price_minor: i64,
}

#[derive(serde::Deserialize)]
struct TicketRow {
    ticket_id: Uuid,
    seat_id: Uuid,
    seat_label: String,
    issued_at: DateTime<Utc>,
    voided_at: Option<DateTime<Utc>>,
}

/// The order view's columns, from `orders o` (the `FROM` item given, then the filter given)
/// joined to its hold `h` and payment `p`, with the seats and tickets aggregated; one place
/// for `GET /orders/{id}` and the status streams. Each joined row is read by its key
/// (`LATERAL … LIMIT 1`, see "Lookups by keys" in the crate's documentation).
macro_rules! view_select {
    ($orders:literal, $filter:literal) => {
        concat!(
            r#"SELECT o.id, o.user_id, o.event_id, o.status, o.failure_reason, o.amount_minor, o.currency,
                o.created_at, o.updated_at, h.id AS hold_id, h.status AS hold_status,
                h.expires_at AS hold_expires_at, p.payment_intent_id, p.client_secret,
                p.status AS payment_status,
                COALESCE((SELECT json_agg(json_build_object('seat_id', s.id, 'label', s.label, 'price_minor', s.price_minor)
                                          ORDER BY s.label)
                            FROM hold_seats hs JOIN seats s ON s.id = hs.seat_id WHERE hs.hold_id = h.id), '[]') AS seats,
                COALESCE((SELECT json_agg(json_build_object('ticket_id', t.id, 'seat_id', t.seat_id, 'seat_label', s.label,
                                                            'issued_at', t.issued_at, 'voided_at', t.voided_at)
                                          ORDER BY s.label)
                            FROM tickets t JOIN seats s ON s.id = t.seat_id WHERE t.order_id = o.id), '[]') AS tickets
           FROM "#,
        $orders,
        r#"
           LEFT JOIN LATERAL (SELECT * FROM holds h WHERE h.order_id = o.id LIMIT 1) h ON true
           LEFT JOIN LATERAL (SELECT * FROM payments p WHERE p.order_id = o.id LIMIT 1) p ON true "#,
            $filter
        )
    };
}

/// Reads the order for its owner in one statement; `None` when it does not exist *or*
/// belongs to someone else (the API answers 404 for both, so order ids cannot be probed).
pub async fn view(pool: &PgPool, id: OrderId, owner: UserId) -> Result<Option<OrderView>, StoreError> {
    let row: Option<ViewRow> = sqlx::query_as(view_select!("orders o", "WHERE o.id = $1 AND o.user_id = $2"))
        .bind(id.0)
        .bind(owner.0)
        .fetch_optional(pool)
        .await?;
    let Some(r) = row else { return Ok(None) };
    debug_assert_eq!(r.user_id, owner.0);
    r.into_view().map(Some)
}

/// Reads, in one statement, the view of each `(order, user)` pair whose order belongs to that
/// user: what the status streams of one process send after a notification
/// (`boxoffice_api::order_stream`). A pair whose order does not exist or is someone else's is
/// absent, as [`view`] answers `None`. Each row is decoded and its statuses parsed on its own,
/// so a row this build cannot read — a status it does not know, a value missing or of another
/// type ([`StoreError::Corrupt`]) — fails alone.
///
/// # Errors
/// The database's, for the whole statement (and a row whose order or user id cannot be read,
/// which the primary key and `NOT NULL` rule out).
pub async fn views(
    pool: &PgPool,
    pairs: &[(OrderId, UserId)],
) -> Result<Vec<(OrderId, UserId, Result<OrderView, StoreError>)>, sqlx::Error> {
    use sqlx::{FromRow, Row};
    let (orders, users): (Vec<Uuid>, Vec<Uuid>) = pairs.iter().map(|(o, u)| (o.0, u.0)).unzip();
    let rows = sqlx::query(view_select!(
        "unnest($1::uuid[], $2::uuid[]) AS w(order_id, user_id)
           CROSS JOIN LATERAL (SELECT * FROM orders o WHERE o.id = w.order_id AND o.user_id = w.user_id LIMIT 1) o",
        ""
    ))
    .bind(&orders)
    .bind(&users)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|row| {
            let (order, user) = (OrderId(row.try_get("id")?), UserId(row.try_get("user_id")?));
            let view = ViewRow::from_row(row)
                .map_err(|e| StoreError::Corrupt(format!("order {order}: {e}")))
                .and_then(ViewRow::into_view);
            Ok((order, user, view))
        })
        .collect()
}

impl ViewRow {
    /// The view of this row: the status the buyer sees, the client secret only while payment
    /// is pending.
    fn into_view(self) -> Result<OrderView, StoreError> {
        let r = self;
        let corrupt = |e: boxoffice_domain::status::UnknownStatus| StoreError::Corrupt(e.to_string());
        let mut status = OrderStatus::try_from(r.status).map_err(corrupt)?;
        let hold_status = r.hold_status.map(HoldStatus::try_from).transpose().map_err(corrupt)?;
        let payment_status = r.payment_status.map(PaymentIntentStatus::from);
        if status.awaits_authorization() && payment_status == Some(PaymentIntentStatus::RequiresCapture) {
            status = OrderStatus::Authorized;
        }
        let payment_pending = matches!(status, OrderStatus::PaymentRequired | OrderStatus::Held)
            && payment_status.as_ref().is_some_and(PaymentIntentStatus::awaits_buyer);
        Ok(OrderView {
            order_id: r.id,
            event_id: r.event_id,
            status,
            failure_reason: r.failure_reason,
            amount_minor: r.amount_minor,
            currency: r.currency,
            hold_id: r.hold_id,
            hold_status,
            hold_expires_at: r.hold_expires_at,
            seats: r
                .seats
                .0
                .into_iter()
                .map(|s| SeatRef { seat_id: s.seat_id, label: s.label, price_minor: s.price_minor })
                .collect(),
            payment_intent_id: r.payment_intent_id,
            client_secret: if payment_pending { r.client_secret } else { None },
            tickets: r
                .tickets
                .0
                .into_iter()
                .map(|t| TicketView {
                    ticket_id: t.ticket_id,
                    seat_id: t.seat_id,
                    seat_label: t.seat_label,
                    issued_at: t.issued_at,
                    voided_at: t.voided_at,
                })
                .collect(),
            created_at: r.created_at,
            updated_at: r.updated_at,
        })
    }
}

/// Orders of `event` not yet in a final state (`ticketed`, `expired`, `failed`, `canceled`,
/// `refunded`): what a drain waits for.
pub async fn open_in_event(pool: &PgPool, event: Uuid) -> Result<i64, sqlx::Error> {
    let finals: Vec<&str> = OrderStatus::ALL.iter().filter(|s| s.is_final()).map(|s| s.as_str()).collect();
    sqlx::query_scalar("SELECT count(*) FROM orders WHERE event_id = $1 AND NOT (status = ANY($2))")
        .bind(event)
        .bind(&finals)
        .fetch_one(pool)
        .await
}
