//! The local mirror of each order's Stripe PaymentIntent (design §10).
//!
//! One payment row per order (`order_id` primary key, `payment_intent_id` unique). The
//! client secret is stored for the owner's status endpoint only and is cleared once payment
//! is no longer pending; it never leaves this table except through that endpoint.
//!
//! `payments.status` mirrors the provider's PaymentIntent status. Its writers are
//! [`transition`], [`record_decline`] and [`mirror_authorized`], one statement each, all
//! filtered by [`PaymentIntentStatus::can_transition_to`]: the mirror never leaves a final
//! status (`canceled`, `succeeded`) for another, as Stripe never does.

use crate::{IllegalTransition, StoreError};
use boxoffice_domain::{
    CaptureDeadline, HoldId, HoldStatus, OrderId, OrderStatus, PaymentIntentStatus, PaymentUpdate,
};
use chrono::{DateTime, Utc};
use sqlx::{Executor, PgPool, Postgres};
use uuid::Uuid;

/// A payment row.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct PaymentRow {
    /// Order.
    pub order_id: Uuid,
    /// Stripe PaymentIntent id (`pi_…`).
    pub payment_intent_id: String,
    /// Last known PaymentIntent status.
    #[sqlx(try_from = "String")]
    pub status: PaymentIntentStatus,
    /// Authorized amount, minor units.
    pub amount_minor: i64,
    /// Currency.
    pub currency: String,
    /// Captured so far, minor units.
    pub amount_captured_minor: i64,
    /// Refunded so far, minor units.
    pub amount_refunded_minor: i64,
    /// Stripe's capture deadline for the authorization, when known.
    pub capture_before: Option<DateTime<Utc>>,
    /// Stripe's error code of the last failed operation (a decline), when any.
    pub last_error_code: Option<String>,
    /// The dispute of the charge the ledger mirrors (`dp_…`), when any.
    pub dispute_id: Option<String>,
    /// The provider's last word on a dispute of the charge (`needs_response`, `won`, `lost`, …).
    pub dispute_status: Option<String>,
}

/// A payment row with what reconciliation against the provider needs about it and its
/// order (read without locks: a snapshot, compared with a snapshot of the provider).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct LedgerPayment {
    /// The payment row.
    #[sqlx(flatten)]
    pub payment: PaymentRow,
    /// The order's event.
    pub event_id: Uuid,
    /// The order's status.
    #[sqlx(try_from = "String")]
    pub order_status: OrderStatus,
    /// The buyer journey's correlation id (copied onto facts emitted for the order).
    pub correlation_id: Uuid,
    /// When the row was written.
    pub created_at: DateTime<Utc>,
    /// Whether `capture_before` has passed by the database clock (false when unknown).
    pub deadline_passed: bool,
}

const LEDGER_PAYMENT_SELECT: &str =
    "SELECT p.order_id, p.payment_intent_id, p.status, p.amount_minor, p.currency,
        p.amount_captured_minor, p.amount_refunded_minor, p.capture_before, p.last_error_code,
        p.dispute_id, p.dispute_status,
        o.event_id, o.status AS order_status, o.correlation_id, p.created_at,
        COALESCE(p.capture_before < clock_timestamp(), false) AS deadline_passed
   FROM payments p JOIN orders o ON o.id = p.order_id";

/// The ledger's payments for PaymentIntents `ids` (unknown ids are simply absent).
pub async fn ledger_for_intents(pool: &PgPool, ids: &[String]) -> Result<Vec<LedgerPayment>, sqlx::Error> {
    sqlx::query_as(&format!("{LEDGER_PAYMENT_SELECT} WHERE p.payment_intent_id = ANY($1)"))
        .bind(ids)
        .fetch_all(pool)
        .await
}

/// The ledger's payments written in `[since, until]` (either end open), optionally only for
/// orders of `event`.
pub async fn ledger_created_between(
    pool: &PgPool,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    event: Option<Uuid>,
) -> Result<Vec<LedgerPayment>, sqlx::Error> {
    sqlx::query_as(&format!(
        "{LEDGER_PAYMENT_SELECT}
          WHERE ($1::timestamptz IS NULL OR p.created_at >= $1)
            AND ($2::timestamptz IS NULL OR p.created_at <= $2)
            AND ($3::uuid IS NULL OR o.event_id = $3)"
    ))
    .bind(since)
    .bind(until)
    .bind(event)
    .fetch_all(pool)
    .await
}

/// The payment of `order`, if a PaymentIntent was recorded.
pub async fn get<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    order: OrderId,
) -> Result<Option<PaymentRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT order_id, payment_intent_id, status, amount_minor, currency, amount_captured_minor,
                amount_refunded_minor, capture_before, last_error_code, dispute_id, dispute_status
           FROM payments WHERE order_id = $1",
    )
    .bind(order.0)
    .fetch_optional(ex)
    .await
}

/// The payment rows of `orders` that are recorded, in one statement (no locks; read after
/// the orders are locked, as [`get`] is, so a row is the latest committed one). At most one
/// row per order (`payments.order_id` is the key).
pub async fn get_all<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    orders: &[OrderId],
) -> Result<Vec<PaymentRow>, sqlx::Error> {
    if orders.is_empty() {
        return Ok(Vec::new());
    }
    let mut ids: Vec<Uuid> = orders.iter().map(|o| o.0).collect();
    ids.sort();
    ids.dedup();
    sqlx::query_as(
        "SELECT p.order_id, p.payment_intent_id, p.status, p.amount_minor, p.currency, p.amount_captured_minor,
                p.amount_refunded_minor, p.capture_before, p.last_error_code, p.dispute_id, p.dispute_status
           FROM unnest($1::uuid[]) AS k(order_id)
          CROSS JOIN LATERAL (SELECT * FROM payments p WHERE p.order_id = k.order_id LIMIT 1) p",
    )
    .bind(&ids)
    .fetch_all(ex)
    .await
}

/// An order as webhook ingress judges a claim about it: its total, correlation id and status,
/// and its payment row when one is recorded.
#[derive(Debug, Clone)]
pub struct OrderPayment {
    /// The order's total, minor units.
    pub amount_minor: i64,
    /// The buyer journey's correlation id.
    pub correlation_id: Uuid,
    /// The order's status.
    pub status: OrderStatus,
    /// Its payment row (`None` until the payment worker records the PaymentIntent).
    pub payment: Option<PaymentRow>,
}

/// The columns [`order_payment`] reads after a leading boolean (orders `o`, payments `p`).
macro_rules! order_payment_columns {
    () => {
        "o.amount_minor, o.correlation_id, o.status,
         p.payment_intent_id, p.status, p.amount_minor, p.currency, p.amount_captured_minor,
         p.amount_refunded_minor, p.capture_before, p.last_error_code, p.dispute_id, p.dispute_status"
    };
}

/// Order `order` and its payment row in one statement, without locks; `None` when the ledger
/// has no such order.
pub async fn order_with_payment<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    order: OrderId,
) -> Result<Option<OrderPayment>, StoreError> {
    let row: Option<OrderPaymentRow> = sqlx::query_as(concat!(
        "SELECT true, ",
        order_payment_columns!(),
        " FROM orders o LEFT JOIN payments p ON p.order_id = o.id WHERE o.id = $1"
    ))
    .bind(order.0)
    .fetch_optional(ex)
    .await?;
    Ok(row.map(|r| order_payment(order, r)).transpose()?.flatten())
}

/// Records a Stripe event about `order` (`stripe_events`, deduplicated on Stripe's id) and
/// reads [`order_with_payment`] in the same statement: whether the event is new, and the
/// order (`None` when the ledger has no such order). `crate::stripe_events::record_with_order`.
pub(crate) async fn record_event_with_order(
    tx: &mut crate::Tx<'_>,
    stripe_event_id: &str,
    event_type: &str,
    payment_intent_id: Option<&str>,
    order: OrderId,
) -> Result<(bool, Option<OrderPayment>), StoreError> {
    let row: OrderPaymentRow = sqlx::query_as(concat!(
        "WITH recorded AS (
            INSERT INTO stripe_events (stripe_event_id, type, payment_intent_id, order_id)
            VALUES ($2, $3, $4, $1) ON CONFLICT (stripe_event_id) DO NOTHING RETURNING 1)
         SELECT EXISTS (SELECT 1 FROM recorded), ",
        order_payment_columns!(),
        " FROM (SELECT 1) one LEFT JOIN orders o ON o.id = $1 LEFT JOIN payments p ON p.order_id = o.id"
    ))
    .bind(order.0)
    .bind(stripe_event_id)
    .bind(event_type)
    .bind(payment_intent_id)
    .fetch_one(&mut **tx)
    .await?;
    let new = row.0;
    Ok((new, order_payment(order, row)?))
}

type OrderPaymentRow = (
    bool,
    Option<i64>,
    Option<Uuid>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<String>,
    Option<i64>,
    Option<i64>,
    Option<DateTime<Utc>>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// The order and its payment of an [`OrderPaymentRow`]; `None` without an order.
fn order_payment(order: OrderId, r: OrderPaymentRow) -> Result<Option<OrderPayment>, StoreError> {
    let (Some(amount_minor), Some(correlation_id), Some(status)) = (r.1, r.2, r.3) else { return Ok(None) };
    Ok(Some(OrderPayment {
        amount_minor,
        correlation_id,
        status: OrderStatus::try_from(status).map_err(|e| StoreError::Corrupt(e.to_string()))?,
        payment: payment_of(order, (r.4, r.5, r.6, r.7, r.8, r.9, r.10, r.11, r.12, r.13)),
    }))
}

/// What the ledger says about one payment command before its provider call: whether the
/// consumer applied the command already, and the order, hold and payment it is about.
/// Read outside any transaction ([`prechecks`]); [`crate::inbox::record`] in the effect's
/// transaction stays the guard against a duplicate.
#[derive(Debug, Clone, Default)]
pub struct Precheck {
    /// The command's event id is in the consumer's inbox: applied already, call no one.
    pub applied: bool,
    /// The order's status; `None` without the order.
    pub order_status: Option<OrderStatus>,
    /// Its hold's status; `None` without a hold.
    pub hold_status: Option<HoldStatus>,
    /// Its payment row; `None` before a PaymentIntent is recorded.
    pub payment: Option<PaymentRow>,
    /// An order or hold status this build does not know (a newer writer's, during a rolling
    /// deploy), as stored; `order_status` / `hold_status` are then `None`.
    pub unknown_status: Option<String>,
    /// The order's total (minor units) and lower-case currency, what its PaymentIntent must
    /// ask for; `None` without the order.
    pub order_amount: Option<(i64, String)>,
    /// The order's hold, the one its PaymentIntent names; `None` without a hold.
    pub hold_id: Option<HoldId>,
    /// The ledger's time of the read (`statement_timestamp()`), before any provider call the
    /// command makes: a webhook claim counted before it is covered by a re-fetch that follows
    /// ([`crate::stripe_events::finish_refetch`]).
    pub read_at: DateTime<Utc>,
}

/// The [`Precheck`] of each `(order, event id)` of `commands` for `consumer`, in one
/// statement whatever their number (a lane's batch of payment commands, or one alone),
/// outside any transaction, in the order given. An order or hold status this build does not
/// know (a newer writer's, during a rolling deploy) is reported in
/// [`Precheck::unknown_status`], not as an error: a command that decides on it fails alone
/// (and stays replayable), while the batch's others, and a cancel or refund, which does not
/// look at it, go on. Errors: the read's.
pub async fn prechecks(
    pool: &PgPool,
    consumer: &str,
    commands: &[(OrderId, Uuid)],
) -> Result<Vec<Precheck>, StoreError> {
    let (orders, events): (Vec<Uuid>, Vec<Uuid>) = commands.iter().map(|(o, e)| (o.0, *e)).unzip();
    let rows: Vec<PrecheckRow> = sqlx::query_as(
        "SELECT i.applied IS NOT NULL AS applied,
                o.status AS order_status, h.status AS hold_status,
                p.payment_intent_id, p.status AS payment_status, p.amount_minor, p.currency,
                p.amount_captured_minor, p.amount_refunded_minor, p.capture_before, p.last_error_code,
                p.dispute_id, p.dispute_status,
                o.amount_minor AS order_amount_minor, o.currency AS order_currency, h.id AS hold_id,
                statement_timestamp() AS read_at
           FROM unnest($2::uuid[], $3::uuid[]) WITH ORDINALITY AS c (order_id, event_id, k)
           LEFT JOIN LATERAL (SELECT true AS applied FROM inbox i
                               WHERE i.consumer = $1 AND i.event_id = c.event_id LIMIT 1) i ON true
           LEFT JOIN LATERAL (SELECT * FROM orders o WHERE o.id = c.order_id LIMIT 1) o ON true
           LEFT JOIN LATERAL (SELECT * FROM holds h WHERE h.order_id = c.order_id LIMIT 1) h ON true
           LEFT JOIN LATERAL (SELECT * FROM payments p WHERE p.order_id = c.order_id LIMIT 1) p ON true
          ORDER BY c.k",
    )
    .bind(consumer)
    .bind(&orders)
    .bind(&events)
    .fetch_all(pool)
    .await?;
    if rows.len() != commands.len() {
        return Err(StoreError::Corrupt(format!(
            "{} pre-checks read for {} commands",
            rows.len(),
            commands.len()
        )));
    }
    Ok(rows
        .into_iter()
        .zip(&orders)
        .map(|(r, order)| {
            let order_status = r.order_status.map(OrderStatus::try_from).transpose();
            let hold_status = r.hold_status.map(HoldStatus::try_from).transpose();
            Precheck {
                applied: r.applied,
                unknown_status: order_status
                    .as_ref()
                    .err()
                    .or(hold_status.as_ref().err())
                    .map(|e| e.0.clone()),
                order_status: order_status.ok().flatten(),
                hold_status: hold_status.ok().flatten(),
                payment: payment_of(
                    OrderId(*order),
                    (
                        r.payment_intent_id,
                        r.payment_status,
                        r.amount_minor,
                        r.currency,
                        r.amount_captured_minor,
                        r.amount_refunded_minor,
                        r.capture_before,
                        r.last_error_code,
                        r.dispute_id,
                        r.dispute_status,
                    ),
                ),
                order_amount: r.order_amount_minor.zip(r.order_currency),
                hold_id: r.hold_id.map(HoldId),
                read_at: r.read_at,
            }
        })
        .collect())
}

/// One command's pre-check as read: whether it is in the inbox, the order's and hold's
/// statuses, the payment row's columns (all `None` without a row, see [`MaybePayment`]), the
/// order's amount and currency, its hold's id, and the read's time.
#[derive(sqlx::FromRow)]
struct PrecheckRow {
    applied: bool,
    order_status: Option<String>,
    hold_status: Option<String>,
    payment_intent_id: Option<String>,
    payment_status: Option<String>,
    amount_minor: Option<i64>,
    currency: Option<String>,
    amount_captured_minor: Option<i64>,
    amount_refunded_minor: Option<i64>,
    capture_before: Option<DateTime<Utc>>,
    last_error_code: Option<String>,
    dispute_id: Option<String>,
    dispute_status: Option<String>,
    order_amount_minor: Option<i64>,
    order_currency: Option<String>,
    hold_id: Option<Uuid>,
    read_at: DateTime<Utc>,
}

/// A payment row's columns read through an outer join (all `None` without a row):
/// PaymentIntent id, status, amount, currency, captured, refunded, capture deadline, last
/// error code, dispute id, dispute status.
type MaybePayment = (
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<String>,
    Option<i64>,
    Option<i64>,
    Option<DateTime<Utc>>,
    Option<String>,
    Option<String>,
    Option<String>,
);

fn payment_of(order: OrderId, r: MaybePayment) -> Option<PaymentRow> {
    match (r.0, r.1) {
        (Some(payment_intent_id), Some(status)) => Some(PaymentRow {
            order_id: order.0,
            payment_intent_id,
            status: PaymentIntentStatus::from(status),
            amount_minor: r.2.unwrap_or_default(),
            currency: r.3.unwrap_or_default(),
            amount_captured_minor: r.4.unwrap_or_default(),
            amount_refunded_minor: r.5.unwrap_or_default(),
            capture_before: r.6,
            last_error_code: r.7,
            dispute_id: r.8,
            dispute_status: r.9,
        }),
        _ => None,
    }
}

/// The order that owns PaymentIntent `pi`.
pub async fn order_for_intent<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    pi: &str,
) -> Result<Option<OrderId>, sqlx::Error> {
    let id: Option<Uuid> = sqlx::query_scalar("SELECT order_id FROM payments WHERE payment_intent_id = $1")
        .bind(pi)
        .fetch_optional(ex)
        .await?;
    Ok(id.map(OrderId))
}

/// The insert-or-nothing of a new PaymentIntent's payment row: order `$1`, PaymentIntent `$2`,
/// client secret `$3`, status `$4`, amount `$5`, currency `$6`.
const INSERT_CREATED: &str =
    "INSERT INTO payments (order_id, payment_intent_id, client_secret, status, amount_minor, currency)
     VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (order_id) DO NOTHING";

/// Records a newly created PaymentIntent. Idempotent: a replay (same order, same intent)
/// leaves the row as it is and returns `false`. The purchase path records it with
/// [`record_created`], which runs the same insert.
pub async fn insert_created<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    order: OrderId,
    payment_intent_id: &str,
    client_secret: Option<&str>,
    status: impl Into<PaymentIntentStatus>,
    amount_minor: i64,
    currency: &str,
) -> Result<bool, sqlx::Error> {
    let status: PaymentIntentStatus = status.into();
    let r = sqlx::query(INSERT_CREATED)
        .bind(order.0)
        .bind(payment_intent_id)
        .bind(client_secret)
        .bind(status.as_str())
        .bind(amount_minor)
        .bind(currency)
        .execute(ex)
        .await?;
    Ok(r.rows_affected() == 1)
}

/// What [`record_created`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Created {
    /// The payment row was there already (a replay): nothing written.
    Replayed,
    /// The payment row is new, the order's payment window is open, and this many webhooks
    /// that arrived before the row were resolved (their facts are to be re-derived from
    /// Stripe).
    Recorded {
        /// Pending `stripe_events` rows of the PaymentIntent resolved for the order.
        early_webhooks: i64,
    },
}

/// Records a newly created PaymentIntent for `order`, whose hold the caller has locked, in one
/// statement: the payment row ([`insert_created`]'s insert-or-nothing), and only when it is
/// new, rule 1 of [`boxoffice_domain::hold`] on the hold (the payment window opens,
/// `crate::holds::open_payment_window`) and the webhooks that overtook the row resolved
/// (`crate::stripe_events::resolve_pending`). Once per order: a replay writes nothing.
#[allow(clippy::too_many_arguments)]
pub async fn record_created(
    tx: &mut crate::Tx<'_>,
    order: OrderId,
    payment_intent_id: &str,
    client_secret: Option<&str>,
    status: impl Into<PaymentIntentStatus>,
    amount_minor: i64,
    currency: &str,
    policy: &boxoffice_domain::HoldPolicy,
) -> Result<Created, sqlx::Error> {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "WITH inserted AS ({INSERT_CREATED} RETURNING order_id),
             opened AS ({window} RETURNING order_id),
             resolved AS ({resolve} RETURNING stripe_event_id)
             SELECT EXISTS (SELECT FROM inserted), (SELECT count(*) FROM resolved)",
            window = crate::holds::open_payment_window("(SELECT order_id FROM inserted)", "$7", "$8", "$9"),
            // Only for a new row: a replay resolves nothing.
            resolve = crate::stripe_events::resolve_pending("$2", "(SELECT order_id FROM inserted)"),
        )
    });
    let status: PaymentIntentStatus = status.into();
    let (inserted, early_webhooks): (bool, i64) = sqlx::query_as(SQL.as_str())
        .bind(order.0)
        .bind(payment_intent_id)
        .bind(client_secret)
        .bind(status.as_str())
        .bind(amount_minor)
        .bind(currency)
        .bind(policy.payment_window.as_secs_f64())
        .bind(policy.ceiling.as_secs_f64())
        .bind(policy.provider_check.as_secs_f64())
        .fetch_one(&mut **tx)
        .await?;
    Ok(if inserted { Created::Recorded { early_webhooks } } else { Created::Replayed })
}

/// Writes `update` to the payment of PaymentIntent `pi` when its stored status is one of
/// `from` (known statuses; a stored status this build does not know is always accepted):
/// status, amounts and error code where given, the capture deadline as
/// [`PaymentUpdate::capture_before`] says, and the client secret cleared once the buyer
/// no longer has anything to confirm. Returns whether a row was written (`false`: no such
/// row, or a status outside `from`).
async fn write_status<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    pi: &str,
    update: &PaymentUpdate,
    from: &[PaymentIntentStatus],
) -> Result<bool, sqlx::Error> {
    let from: Vec<&str> = from.iter().map(PaymentIntentStatus::as_str).collect();
    let known: Vec<&str> = PaymentIntentStatus::KNOWN.iter().map(PaymentIntentStatus::as_str).collect();
    let keep_secret: Vec<&str> = PaymentIntentStatus::KNOWN
        .iter()
        .filter(|s| s.awaits_buyer())
        .map(PaymentIntentStatus::as_str)
        .collect();
    let r = sqlx::query(
        "UPDATE payments SET status = $2,
                amount_captured_minor = COALESCE($3, amount_captured_minor),
                amount_refunded_minor = COALESCE($4, amount_refunded_minor),
                last_error_code = COALESCE($5, last_error_code),
                client_secret = CASE WHEN $2 = ANY($6) THEN client_secret ELSE NULL END,
                capture_before = COALESCE($9, capture_before,
                    CASE WHEN $10 THEN clock_timestamp() + make_interval(days => $11) END),
                updated_at = clock_timestamp()
          WHERE payment_intent_id = $1 AND (status = ANY($7) OR NOT (status = ANY($8)))",
    )
    .bind(pi)
    .bind(update.status.as_str())
    .bind(update.amount_captured_minor)
    .bind(update.amount_refunded_minor)
    .bind(update.last_error_code.as_deref())
    .bind(&keep_secret)
    .bind(&from)
    .bind(&known)
    .bind(match update.capture_before {
        CaptureDeadline::Known(t) => Some(t),
        CaptureDeadline::Keep | CaptureDeadline::DefaultIfUnknown => None,
    })
    .bind(update.capture_before == CaptureDeadline::DefaultIfUnknown)
    .bind(DEFAULT_AUTHORIZATION_VALIDITY_DAYS)
    .execute(ex)
    .await?;
    Ok(r.rows_affected() > 0)
}

/// Mirrors `update` on the payment of PaymentIntent `pi` if the transition table allows the
/// move from its stored status. Returns `Ok(false)` when no payment records `pi` (a fact that
/// overtook the payment worker's commit changes nothing).
///
/// Errors: [`StoreError::IllegalTransition`] when the stored status is final and differs
/// (nothing is written).
pub async fn transition(
    tx: &mut crate::Tx<'_>,
    pi: &str,
    update: &PaymentUpdate,
) -> Result<bool, StoreError> {
    let from = PaymentIntentStatus::sources_of(&update.status);
    if write_status(&mut **tx, pi, update, &from).await? {
        return Ok(true);
    }
    let stored: Option<String> =
        sqlx::query_scalar("SELECT status FROM payments WHERE payment_intent_id = $1")
            .bind(pi)
            .fetch_optional(&mut **tx)
            .await?;
    match stored.map(PaymentIntentStatus::from) {
        None => Ok(false),
        Some(stored) => Err(IllegalTransition::payment(&stored, &update.status).into()),
    }
}

/// Records a declined confirmation (`requires_payment_method` with the decline code) for
/// PaymentIntent `pi`, but only while the payment is unsettled
/// (`requires_payment_method`, `requires_confirmation`, `requires_action`, `processing`):
/// Stripe lets a buyer retry another card after a decline, so a decline never follows
/// authorization, capture or cancellation. A decline fact that arrives late (published again
/// after a relay crashed before marking it, or retried after a failed delivery) must not move
/// a settled payment back to pending.
/// Returns whether the row changed.
pub async fn record_decline<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    pi: &str,
    decline_code: &str,
) -> Result<bool, sqlx::Error> {
    let update = PaymentUpdate {
        last_error_code: Some(decline_code.to_owned()),
        ..PaymentUpdate::status(PaymentIntentStatus::RequiresPaymentMethod)
    };
    let from: Vec<PaymentIntentStatus> =
        PaymentIntentStatus::KNOWN.into_iter().filter(PaymentIntentStatus::is_unsettled).collect();
    write_status(ex, pi, &update, &from).await
}

/// Mirrors a reported authorization (`requires_capture`) for the status endpoint while the
/// payment still waits for the buyer; the order itself is moved only by the saga. Returns
/// whether the row changed.
pub async fn mirror_authorized<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    pi: &str,
) -> Result<bool, sqlx::Error> {
    let from: Vec<PaymentIntentStatus> =
        PaymentIntentStatus::KNOWN.into_iter().filter(PaymentIntentStatus::awaits_buyer).collect();
    write_status(ex, pi, &PaymentUpdate::status(PaymentIntentStatus::RequiresCapture), &from).await
}

/// Records the provider's view of dispute `dispute_id` of PaymentIntent `pi`'s charge.
pub async fn mirror_dispute<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    pi: &str,
    dispute_id: &str,
    status: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE payments SET dispute_id = $2, dispute_status = $3, updated_at = clock_timestamp()
          WHERE payment_intent_id = $1",
    )
    .bind(pi)
    .bind(dispute_id)
    .bind(status)
    .execute(ex)
    .await?;
    Ok(())
}

/// Records Stripe's capture deadline for the authorization.
pub async fn set_capture_before<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    pi: &str,
    capture_before: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE payments SET capture_before = $2 WHERE payment_intent_id = $1")
        .bind(pi)
        .bind(capture_before)
        .execute(ex)
        .await?;
    Ok(())
}

/// Marks the payment of `order` as having a cancel requested. Returns the PaymentIntent id
/// the first time (the caller emits AuthorizationCancelRequested), `None` if a cancel was
/// already requested or no payment is recorded. One cancel with key `cancel:{payment_intent_id}`
/// covers the intent whatever its state when it runs (invariant 6).
pub async fn request_cancel<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    order: OrderId,
) -> Result<Option<String>, sqlx::Error> {
    Ok(request_cancel_many(ex, &[order.0]).await?.into_iter().next().map(|(_, pi)| pi))
}

/// [`request_cancel`] for several orders at once: `(order_id, payment_intent_id)` of each
/// payment marked now (not settled, no cancel requested before).
pub async fn request_cancel_many<'e, E: Executor<'e, Database = Postgres>>(
    ex: E,
    orders: &[uuid::Uuid],
) -> Result<Vec<(uuid::Uuid, String)>, sqlx::Error> {
    let settled: Vec<&str> =
        PaymentIntentStatus::KNOWN.iter().filter(|s| s.is_final()).map(PaymentIntentStatus::as_str).collect();
    sqlx::query_as(
        "UPDATE payments SET cancel_requested_at = clock_timestamp()
          WHERE order_id = ANY($1) AND cancel_requested_at IS NULL AND NOT (status = ANY($2))
          RETURNING order_id, payment_intent_id",
    )
    .bind(orders)
    .bind(&settled)
    .fetch_all(ex)
    .await
}

/// How long Stripe keeps an online card authorization capturable when it does not say
/// (<https://docs.stripe.com/payments/place-a-hold-on-a-payment-method>: 7 days).
pub const DEFAULT_AUTHORIZATION_VALIDITY_DAYS: i32 = 7;
