//! Buyers' outcomes as the ledger records them (case C19): why each hold that did not become
//! a ticket ended, told apart by whose fault it was, and how long the two waits a buyer
//! cannot shorten took (hold → payable, authorization → confirmation). Read by the onsale
//! report; `expired_never_payable` and `lost_after_authorization` are invariant-style checks
//! (the system's lag, not the buyer, cost the seats), and the onsale fails when either is
//! above 0.
//!
//! Read-only snapshot queries over holds, orders, payments and `stripe_events`.

use serde::Serialize;
use sqlx::PgPool;
use std::time::Duration;
use uuid::Uuid;

/// How the holds of an event (or every event) ended, and the buyer's waits.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Outcomes {
    /// Holds that expired unpaid after the buyer had the payment window and neither paid nor
    /// had a card declined: the buyer walked away.
    pub expired_abandoned: i64,
    /// Holds that expired after the buyer's card was declined (and no other card authorized).
    pub expired_declined: i64,
    /// Holds that expired without the buyer ever getting the payment window: no PaymentIntent
    /// recorded before the hold ended, or recorded with less than the window left (our fault).
    pub expired_never_payable: i64,
    /// Orders that never got their tickets although the provider reported an authorization
    /// of their current PaymentIntent before their hold ended (our fault): the hold was
    /// protected as authorized and the order still ended, or the saga cancelled the
    /// authorization as late (`authorization_after_expiry`, an authorization it verified)
    /// although its `payment_intent.amount_capturable_updated` webhook arrived in time. A
    /// webhook claim the provider refuted counts for nothing.
    pub lost_after_authorization: i64,
    /// Hold → payable (PaymentIntent recorded), ms.
    pub hold_to_payable_ms: Percentiles,
    /// Authorization reported → hold confirmed by the saga, ms.
    pub authorization_to_confirmation_ms: Percentiles,
}

/// p50 and p99 in ms; `None` without samples.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Samples.
    pub count: i64,
    /// Median, ms.
    pub p50: Option<f64>,
    /// 99th percentile, ms.
    pub p99: Option<f64>,
}

/// Reads the outcomes of `event` (every event when `None`), with `payment_window` the window
/// buyers are owed (a PaymentIntent recorded with less than that left, minus one second of
/// clock tolerance, counts as never payable).
pub async fn read(
    pool: &PgPool,
    event: Option<Uuid>,
    payment_window: Duration,
) -> Result<Outcomes, sqlx::Error> {
    let window_s = (payment_window.as_secs_f64() - 1.0).max(0.0);
    let (abandoned, declined, never_payable): (i64, i64, i64) = sqlx::query_as(
        "WITH ended AS (
             SELECT h.payable_at, h.expires_at, p.last_error_code,
                    (h.payable_at IS NULL OR h.payable_at > h.expires_at - make_interval(secs => $2)) AS never_payable
               FROM holds h JOIN orders o ON o.id = h.order_id
               LEFT JOIN payments p ON p.order_id = o.id
              WHERE h.status = 'expired' AND ($1::uuid IS NULL OR o.event_id = $1))
         SELECT count(*) FILTER (WHERE NOT never_payable AND last_error_code IS NULL),
                count(*) FILTER (WHERE NOT never_payable AND last_error_code IS NOT NULL),
                count(*) FILTER (WHERE never_payable)
           FROM ended",
    )
    .bind(event)
    .bind(window_s)
    .fetch_one(pool)
    .await?;
    let lost: i64 = sqlx::query_scalar(concat!(
        "SELECT count(*) FROM orders o
           JOIN holds h ON h.order_id = o.id
           JOIN payments p ON p.order_id = o.id
          WHERE o.status IN ('expired', 'failed', 'canceled', 'refunding', 'refunded')
            AND ($1::uuid IS NULL OR o.event_id = $1)
            AND NOT EXISTS (SELECT 1 FROM tickets t WHERE t.order_id = o.id)
            AND (h.authorization_reported_at IS NOT NULL
                 OR (o.failure_reason = 'authorization_after_expiry'
                     AND EXISTS (SELECT 1 FROM stripe_events e
                                  WHERE e.order_id = o.id AND e.payment_intent_id = p.payment_intent_id
                                    AND e.type = 'payment_intent.amount_capturable_updated'
                                    AND e.received_at < ",
        crate::holds::hold_end!("h."),
        ")))",
    ))
    .bind(event)
    .fetch_one(pool)
    .await?;
    let hold_to_payable = percentiles(
        pool,
        "SELECT EXTRACT(EPOCH FROM h.payable_at - h.created_at) * 1000 AS ms
           FROM holds h JOIN orders o ON o.id = h.order_id
          WHERE h.payable_at IS NOT NULL AND ($1::uuid IS NULL OR o.event_id = $1)",
        event,
    )
    .await?;
    let authorization_to_confirmation = percentiles(
        pool,
        "SELECT EXTRACT(EPOCH FROM h.confirmed_at - h.authorization_reported_at) * 1000 AS ms
           FROM holds h JOIN orders o ON o.id = h.order_id
          WHERE h.confirmed_at IS NOT NULL AND h.authorization_reported_at IS NOT NULL
            AND ($1::uuid IS NULL OR o.event_id = $1)",
        event,
    )
    .await?;
    Ok(Outcomes {
        expired_abandoned: abandoned,
        expired_declined: declined,
        expired_never_payable: never_payable,
        lost_after_authorization: lost,
        hold_to_payable_ms: hold_to_payable,
        authorization_to_confirmation_ms: authorization_to_confirmation,
    })
}

/// p50/p99 of the `ms` column of `samples` (bound to `$1` = event).
async fn percentiles(pool: &PgPool, samples: &str, event: Option<Uuid>) -> Result<Percentiles, sqlx::Error> {
    let sql = format!(
        "SELECT count(*), percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::float8,
                percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::float8
           FROM ({samples}) s"
    );
    let (count, p50, p99): (i64, Option<f64>, Option<f64>) =
        sqlx::query_as(&sql).bind(event).fetch_one(pool).await?;
    Ok(Percentiles { count, p50, p99 })
}
