//! Saga transitions applied through the consumer runner's `handle_once` on a real database:
//! the design's named tests (duplicate event applied once, authorization after expiry
//! compensated), case C07 (one fact, many deliveries, racing), case C04 (late authorization
//! after the seat was resold) and case C03 (expiry racing authorization under row locks).

use crate::helpers::barrier;
use boxoffice_bus::consumer::{handle_once, Disposition};
use boxoffice_domain::{Envelope, EventId, OrderId, PurchaseEvent, SeatId, UserId};
use boxoffice_store::holds::{self, HoldReceipt, ReserveRequest};
use boxoffice_store::venue::{self, VenueSpec};
use boxoffice_workers::saga::Saga;
use boxoffice_workers::tickets::TicketWorker;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::time::Duration;
use uuid::Uuid;

struct Ledger {
    pool: PgPool,
    event: EventId,
    seats: Vec<Uuid>,
}

async fn ledger(opts: PgConnectOptions) -> Ledger {
    let pool = boxoffice_store::connect(opts, 24, 10_000).await.unwrap();
    let (event, _) =
        venue::seed(&pool, "Saga Event", &VenueSpec::small(1, 4, 10), chrono::Utc::now(), "cell-1")
            .await
            .unwrap();
    let seats = sqlx::query_scalar("SELECT id FROM seats WHERE event_id = $1 ORDER BY label")
        .bind(event.0)
        .fetch_all(&pool)
        .await
        .unwrap();
    Ledger { pool, event, seats }
}

impl Ledger {
    /// A new buyer's hold request for `seats`.
    fn request(&self, seats: &[Uuid], ttl: Duration) -> ReserveRequest {
        ReserveRequest {
            user_id: UserId::new(),
            event_id: self.event,
            seat_ids: seats.iter().map(|s| SeatId(*s)).collect(),
            idempotency_key: Uuid::new_v4().to_string(),
            correlation_id: Uuid::new_v4(),
            ttl,
            payable_within: None,
            cell: "cell-1".into(),
            directory_epoch: 1,
            authorization_request: boxoffice_domain::saga::AuthorizationRequest::InHoldFact,
        }
    }

    async fn hold(&self, seats: &[Uuid], ttl: Duration) -> HoldReceipt {
        holds::reserve(&self.pool, &self.request(seats, ttl)).await.unwrap().receipt().clone()
    }

    /// Runs a hold request for `seats` in a task of its own.
    fn spawn_request(
        &self,
        seats: &[Uuid],
    ) -> tokio::task::JoinHandle<Result<holds::ReserveOutcome, holds::ReserveError>> {
        let (pool, req) = (self.pool.clone(), self.request(seats, Duration::from_secs(60)));
        tokio::spawn(async move { holds::reserve(&pool, &req).await })
    }

    /// Puts the holds of `orders` past their expiry, with no protection left.
    async fn lapse_unprotected(&self, orders: &[OrderId]) {
        sqlx::query(
            "UPDATE holds SET expires_at = clock_timestamp() - interval '1 second', authorized_until = NULL,
                    payable_by = NULL, provider_check_until = NULL
              WHERE order_id = ANY($1)",
        )
        .bind(orders.iter().map(|o| o.0).collect::<Vec<_>>())
        .execute(&self.pool)
        .await
        .unwrap();
    }

    /// Records a PaymentIntent for the order as the payment worker would.
    async fn payment(&self, order: OrderId) -> String {
        let pi = format!("pi_test_{}", Uuid::new_v4().simple());
        boxoffice_store::payments::insert_created(
            &self.pool,
            order,
            &pi,
            Some("secret"),
            "requires_payment_method",
            1,
            "usd",
        )
        .await
        .unwrap();
        pi
    }

    async fn status(&self, order: OrderId) -> String {
        sqlx::query_scalar("SELECT status FROM orders WHERE id = $1")
            .bind(order.0)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn hold_status(&self, order: OrderId) -> String {
        sqlx::query_scalar("SELECT status FROM holds WHERE order_id = $1")
            .bind(order.0)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn outbox(&self, event_type: &str, order: OrderId) -> i64 {
        crate::helpers::outbox_count(&self.pool, event_type, order.0).await
    }

    async fn capture_requests(&self, order: OrderId) -> i64 {
        crate::helpers::capture_requests(&self.pool, order.0).await
    }

    async fn active_rows(&self, seat: Uuid) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM hold_seats WHERE seat_id = $1 AND released_at IS NULL")
            .bind(seat)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn lapse(&self, order: OrderId) {
        sqlx::query("UPDATE holds SET expires_at = now() - interval '1 second' WHERE order_id = $1")
            .bind(order.0)
            .execute(&self.pool)
            .await
            .unwrap();
    }
}

/// The saga's `handle_once` on `env` as read from the bus, `env` being a fact this ledger
/// committed ([`crate::helpers::committed`]).
async fn saga_once(pool: &PgPool, env: &Envelope) -> Result<Disposition, boxoffice_bus::HandlerError> {
    crate::helpers::committed(pool, env).await;
    handle_once(pool, &Saga::default(), env).await
}

fn authorized(order: OrderId, pi: &str) -> Envelope {
    Envelope::new(
        order,
        &PurchaseEvent::PaymentAuthorized {
            order_id: order,
            payment_intent_id: pi.to_owned(),
            amount_capturable_minor: 100,
            capture_before: None,
        },
        Uuid::new_v4(),
        None,
    )
}

/// Design §17: the same Kafka message delivered twice has one effect.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn duplicate_kafka_event_is_applied_once(_: PgPoolOptions, opts: PgConnectOptions) {
    let l = ledger(opts).await;
    let r = l.hold(&l.seats[..2], Duration::from_secs(60)).await;
    let pi = l.payment(r.order_id).await;
    let env = authorized(r.order_id, &pi);
    assert_eq!(saga_once(&l.pool, &env).await.unwrap(), Disposition::Applied);
    assert_eq!(saga_once(&l.pool, &env).await.unwrap(), Disposition::Duplicate);
    assert_eq!(l.capture_requests(r.order_id).await, 1);
    assert_eq!(l.outbox("OrderConfirmed", r.order_id).await, 1);
    assert_eq!(l.status(r.order_id).await, "confirming");
    assert_eq!(l.hold_status(r.order_id).await, "confirmed");
}

/// A forged message that borrows the id of a real fact still on its way (read first: from
/// another partition, or while the real one waits in a retry topic) — a copy of its type
/// with another payload, or a fact of another type — is parked as `unknown_fact` and leaves
/// no inbox row, so the real fact is applied when it comes, not taken for a duplicate; each
/// delivery of a forged message is an incident. Alone and in a member's group transaction
/// (`handle_group`).
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_forged_copy_read_first_leaves_its_borrowed_id_to_the_real_fact(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let l = ledger(opts).await;
    let followers = boxoffice_bus::Followers::none();
    for (k, grouped) in [false, true].into_iter().enumerate() {
        let once = |env: Envelope| {
            let (pool, followers) = (l.pool.clone(), &followers);
            async move {
                if grouped {
                    let mut out = boxoffice_bus::consumer::handle_group(
                        &pool,
                        &Saga::default(),
                        followers,
                        &[vec![env]],
                    )
                    .await
                    .unwrap();
                    out.remove(0).unwrap()[0].unwrap()
                } else {
                    handle_once(&pool, &Saga::default(), &env).await.unwrap()
                }
            }
        };
        let r = l.hold(&l.seats[k..=k], Duration::from_secs(60)).await;
        let pi = l.payment(r.order_id).await;
        let real = authorized(r.order_id, &pi);
        crate::helpers::committed(&l.pool, &real).await;
        let mut forged = authorized(r.order_id, "pi_forged");
        forged.event_id = real.event_id;
        // And one of another type the saga would apply as a no-op (a hold's fact as an older
        // writer's, for an order already held), which would otherwise take the id's inbox row.
        let mut other = Envelope::new(
            r.order_id,
            &PurchaseEvent::HoldCreated {
                order_id: r.order_id,
                hold_id: r.hold_id,
                event_id: r.event_id,
                seat_ids: r.seat_ids.clone(),
                expires_at: r.expires_at,
                amount_minor: r.amount_minor,
                currency: r.currency.clone(),
                authorization_requested: false,
                is_authorization_request: false,
            },
            Uuid::new_v4(),
            None,
        );
        other.event_id = real.event_id;
        for copy in [&forged, &forged, &other] {
            assert_eq!(once(copy.clone()).await, Disposition::Unknown);
        }
        let incidents: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM incidents WHERE kind = 'unknown_fact' AND detail->>'event_id' = $1",
        )
        .bind(real.event_id.to_string())
        .fetch_one(&l.pool)
        .await
        .unwrap();
        assert_eq!(incidents, 3, "grouped {grouped}: each delivery of a copy is an incident");
        assert_eq!(l.status(r.order_id).await, "held", "grouped {grouped}: the copy changed nothing");
        assert_eq!(once(real.clone()).await, Disposition::Applied, "grouped {grouped}: the real fact");
        assert_eq!(once(real).await, Disposition::Duplicate);
        assert_eq!(l.status(r.order_id).await, "confirming");
        assert_eq!(l.capture_requests(r.order_id).await, 1);
    }
}

/// C07: the same authorization fact in ten different messages (webhook + re-fetch paths),
/// all racing: one transition, one OrderConfirmed, one capture request.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c07_concurrent_copies_of_one_fact_transition_once(_: PgPoolOptions, opts: PgConnectOptions) {
    let l = ledger(opts).await;
    let r = l.hold(&l.seats[..1], Duration::from_secs(60)).await;
    let pi = l.payment(r.order_id).await;
    let gate = barrier(10);
    let mut tasks = vec![];
    for _ in 0..10 {
        let (pool, env, gate) = (l.pool.clone(), authorized(r.order_id, &pi), gate.clone());
        tasks.push(tokio::spawn(async move {
            gate.wait().await;
            saga_once(&pool, &env).await
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap(), Disposition::Applied);
    }
    assert_eq!(l.outbox("OrderConfirmed", r.order_id).await, 1);
    assert_eq!(l.capture_requests(r.order_id).await, 1);
    assert_eq!(l.status(r.order_id).await, "confirming");
}

/// Design §17: an authorization after the hold expired is compensated, never attached.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn authorization_after_expiry_is_compensated(_: PgPoolOptions, opts: PgConnectOptions) {
    let l = ledger(opts).await;
    let seat = l.seats[0];
    let r = l.hold(&[seat], Duration::from_secs(60)).await;
    let pi = l.payment(r.order_id).await;
    l.lapse(r.order_id).await;
    assert_eq!(holds::expire_due(&l.pool, 100).await.unwrap().0, 1);
    assert_eq!(l.status(r.order_id).await, "expired");

    saga_once(&l.pool, &authorized(r.order_id, &pi)).await.unwrap();
    assert_eq!(l.status(r.order_id).await, "canceled");
    assert_eq!(l.outbox("AuthorizationCancelRequested", r.order_id).await, 1);
    assert_eq!(l.capture_requests(r.order_id).await, 0);
    assert_eq!(l.active_rows(seat).await, 0);
}

/// A decline whose message arrives after the cancellation (published late, as after a relay
/// crashed; found by `boxoffice-drills chaos --seed 2`) must not move the cancelled
/// payment back to `requires_payment_method`: the ledger would disagree with the provider.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn late_decline_does_not_reopen_a_cancelled_payment(_: PgPoolOptions, opts: PgConnectOptions) {
    let l = ledger(opts).await;
    let r = l.hold(&l.seats[..1], Duration::from_secs(60)).await;
    let pi = l.payment(r.order_id).await;
    let fact = |e: PurchaseEvent| Envelope::new(r.order_id, &e, Uuid::new_v4(), None);
    let declined = fact(PurchaseEvent::PaymentFailed {
        order_id: r.order_id,
        payment_intent_id: pi.clone(),
        reason: "generic_decline".into(),
    });
    let canceled =
        fact(PurchaseEvent::PaymentCanceled { order_id: r.order_id, payment_intent_id: pi.clone() });
    let payment = || async {
        sqlx::query_as::<_, (String, Option<String>)>(
            "SELECT status, last_error_code FROM payments WHERE payment_intent_id = $1",
        )
        .bind(&pi)
        .fetch_one(&l.pool)
        .await
        .unwrap()
    };
    assert_eq!(saga_once(&l.pool, &canceled).await.unwrap(), Disposition::Applied);
    assert_eq!(saga_once(&l.pool, &declined).await.unwrap(), Disposition::Applied);
    assert_eq!(payment().await, ("canceled".to_owned(), None));

    // In order, a decline is recorded while the payment is pending.
    let r2 = l.hold(&l.seats[1..2], Duration::from_secs(60)).await;
    let pi2 = l.payment(r2.order_id).await;
    let declined2 = Envelope::new(
        r2.order_id,
        &PurchaseEvent::PaymentFailed {
            order_id: r2.order_id,
            payment_intent_id: pi2.clone(),
            reason: "card_declined".into(),
        },
        Uuid::new_v4(),
        None,
    );
    saga_once(&l.pool, &declined2).await.unwrap();
    let (status, code): (String, Option<String>) =
        sqlx::query_as("SELECT status, last_error_code FROM payments WHERE payment_intent_id = $1")
            .bind(&pi2)
            .fetch_one(&l.pool)
            .await
            .unwrap();
    assert_eq!((status.as_str(), code.as_deref()), ("requires_payment_method", Some("card_declined")));
}

/// C04: hold A expires, B holds and is ticketed for the same seat, then A's authorization
/// arrives: A is cancelled and visible as such; B's order and ticket are untouched.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c04_late_authorization_after_resale(_: PgPoolOptions, opts: PgConnectOptions) {
    let l = ledger(opts).await;
    let seat = l.seats[3];
    let a = l.hold(&[seat], Duration::from_secs(60)).await;
    let a_pi = l.payment(a.order_id).await;
    l.lapse(a.order_id).await;

    // B's hold reclaims the lapsed seat inside its own transaction.
    let b = l.hold(&[seat], Duration::from_secs(60)).await;
    assert_eq!(l.status(a.order_id).await, "expired");
    let b_pi = l.payment(b.order_id).await;
    saga_once(&l.pool, &authorized(b.order_id, &b_pi)).await.unwrap();
    let captured = Envelope::new(
        b.order_id,
        &PurchaseEvent::PaymentCaptured {
            order_id: b.order_id,
            payment_intent_id: b_pi.clone(),
            amount_captured_minor: 100,
        },
        Uuid::new_v4(),
        None,
    );
    saga_once(&l.pool, &captured).await.unwrap();
    let issue = Envelope::new(
        b.order_id,
        &PurchaseEvent::TicketIssueRequested { order_id: b.order_id, hold_id: b.hold_id },
        Uuid::new_v4(),
        None,
    );
    crate::helpers::committed(&l.pool, &issue).await;
    handle_once(&l.pool, &TicketWorker, &issue).await.unwrap();
    assert_eq!(l.status(b.order_id).await, "ticketed");

    saga_once(&l.pool, &authorized(a.order_id, &a_pi)).await.unwrap();
    assert_eq!(l.status(a.order_id).await, "canceled");
    assert_eq!(l.outbox("AuthorizationCancelRequested", a.order_id).await, 1);
    let cancel: serde_json::Value = sqlx::query_scalar(
        "SELECT payload FROM outbox WHERE event_type = 'AuthorizationCancelRequested' AND message_key = $1",
    )
    .bind(a.order_id.to_string())
    .fetch_one(&l.pool)
    .await
    .unwrap();
    assert_eq!(cancel["payload"]["payment_intent_id"], a_pi);
    assert_eq!(l.status(b.order_id).await, "ticketed");
    let owner: Uuid = sqlx::query_scalar("SELECT order_id FROM tickets WHERE seat_id = $1")
        .bind(seat)
        .fetch_one(&l.pool)
        .await
        .unwrap();
    assert_eq!(owner, b.order_id.0);
    let audit = boxoffice_store::audit::violations(&l.pool, 600_000, None).await.unwrap();
    assert_eq!((audit.oversold, audit.double_active_holds), (0, 0));
}

/// C03 / design §17: expiry and authorization race under the row locks; every order ends in
/// exactly one legal state.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c03_expiry_racing_authorization_picks_one_legal_state(_: PgPoolOptions, opts: PgConnectOptions) {
    let l = ledger(opts).await;
    let mut orders = vec![];
    for seat in &l.seats[..20] {
        // Lapsing right around the race.
        let r = l.hold(&[*seat], Duration::from_millis(1_000)).await;
        let pi = l.payment(r.order_id).await;
        orders.push((r, pi, *seat));
    }
    sqlx::query("UPDATE holds SET expires_at = clock_timestamp() + (random() * interval '40 milliseconds') - interval '20 milliseconds'")
        .execute(&l.pool)
        .await
        .unwrap();
    let gate = barrier(orders.len() + 2);
    let mut tasks = vec![];
    for (r, pi, _) in &orders {
        let (pool, env, gate) = (l.pool.clone(), authorized(r.order_id, pi), gate.clone());
        tasks.push(tokio::spawn(async move {
            gate.wait().await;
            saga_once(&pool, &env).await.map(|_| ())
        }));
    }
    for _ in 0..2 {
        let (pool, gate) = (l.pool.clone(), gate.clone());
        tasks.push(tokio::spawn(async move {
            gate.wait().await;
            for _ in 0..5 {
                holds::expire_due(&pool, 50).await.map_err(boxoffice_bus::HandlerError::from)?;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Ok(())
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let (mut confirmed, mut compensated) = (0, 0);
    for (r, _, seat) in &orders {
        let (status, hold) = (l.status(r.order_id).await, l.hold_status(r.order_id).await);
        let cancels = l.outbox("AuthorizationCancelRequested", r.order_id).await;
        let captures = l.capture_requests(r.order_id).await;
        match (status.as_str(), hold.as_str()) {
            ("confirming", "confirmed") => {
                confirmed += 1;
                assert_eq!((cancels, captures, l.active_rows(*seat).await), (0, 1, 1));
            }
            ("canceled", "expired") => {
                compensated += 1;
                assert_eq!((cancels, captures, l.active_rows(*seat).await), (1, 0, 0));
            }
            other => panic!("illegal end state {other:?} for {}", r.order_id),
        }
    }
    assert_eq!(confirmed + compensated, orders.len());
}

/// C09: a confirmed order whose authorization is near Stripe's capture deadline and still not
/// captured is released on purpose (seats free, order failed, authorization cancelled,
/// incident recorded) instead of lapsing silently; an authorization that Stripe cancels
/// before capture releases the seats too; a deadline the provider states is the one recorded.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c09_capture_deadline_releases_or_cancels_deliberately(_: PgPoolOptions, opts: PgConnectOptions) {
    let l = ledger(opts).await;
    let (s1, s2) = (l.seats[5], l.seats[6]);
    let near = l.hold(&[s1], Duration::from_secs(60)).await;
    let near_pi = l.payment(near.order_id).await;
    saga_once(&l.pool, &authorized(near.order_id, &near_pi)).await.unwrap();
    assert_eq!(l.status(near.order_id).await, "confirming");
    let deadline: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT capture_before FROM payments WHERE order_id = $1")
            .bind(near.order_id.0)
            .fetch_one(&l.pool)
            .await
            .unwrap();
    assert!(
        deadline.unwrap() > chrono::Utc::now() + chrono::Duration::days(6),
        "a default deadline is tracked"
    );
    // Far from the deadline nothing happens; within the margin the order is released.
    assert_eq!(boxoffice_workers::saga::release_lapsing_authorizations(&l.pool, 3_600, 10).await.unwrap(), 0);
    sqlx::query("UPDATE payments SET capture_before = now() + interval '30 minutes' WHERE order_id = $1")
        .bind(near.order_id.0)
        .execute(&l.pool)
        .await
        .unwrap();
    assert_eq!(boxoffice_workers::saga::release_lapsing_authorizations(&l.pool, 3_600, 10).await.unwrap(), 1);
    assert_eq!(
        boxoffice_workers::saga::release_lapsing_authorizations(&l.pool, 3_600, 10).await.unwrap(),
        0,
        "once"
    );
    assert_eq!(l.status(near.order_id).await, "failed");
    assert_eq!(l.active_rows(s1).await, 0);
    assert_eq!(l.outbox("AuthorizationCancelRequested", near.order_id).await, 1);
    let incidents: i64 = sqlx::query_scalar("SELECT count(*) FROM incidents WHERE kind = 'capture_deadline'")
        .fetch_one(&l.pool)
        .await
        .unwrap();
    assert_eq!(incidents, 1);

    // Stripe cancels an authorization that was never captured: the seats are released.
    let lapsed = l.hold(&[s2], Duration::from_secs(60)).await;
    let lapsed_pi = l.payment(lapsed.order_id).await;
    saga_once(&l.pool, &authorized(lapsed.order_id, &lapsed_pi)).await.unwrap();
    let canceled = Envelope::new(
        lapsed.order_id,
        &PurchaseEvent::PaymentCanceled { order_id: lapsed.order_id, payment_intent_id: lapsed_pi },
        Uuid::new_v4(),
        None,
    );
    saga_once(&l.pool, &canceled).await.unwrap();
    assert_eq!(l.status(lapsed.order_id).await, "failed");
    assert_eq!(l.active_rows(s2).await, 0);

    // A deadline the provider stated is the one recorded, not the default (to the µs).
    let stated = l.hold(&[l.seats[7]], Duration::from_secs(60)).await;
    let stated_pi = l.payment(stated.order_id).await;
    let at = chrono::DateTime::from_timestamp(chrono::Utc::now().timestamp() + 2 * 86_400, 0).unwrap();
    let fact = Envelope::new(
        stated.order_id,
        &PurchaseEvent::PaymentAuthorized {
            order_id: stated.order_id,
            payment_intent_id: stated_pi,
            amount_capturable_minor: 100,
            capture_before: Some(at),
        },
        Uuid::new_v4(),
        None,
    );
    saga_once(&l.pool, &fact).await.unwrap();
    assert_eq!(l.status(stated.order_id).await, "confirming");
    let (status, recorded): (String, Option<chrono::DateTime<chrono::Utc>>) =
        sqlx::query_as("SELECT status, capture_before FROM payments WHERE order_id = $1")
            .bind(stated.order_id.0)
            .fetch_one(&l.pool)
            .await
            .unwrap();
    assert_eq!((status.as_str(), recorded), ("requires_capture", Some(at)));
    let v = boxoffice_store::audit::violations(&l.pool, 600_000, None).await.unwrap();
    assert_eq!(v.total(), v.unpublished_outbox, "{v:?}");
}

/// The janitor drops inbox rows past their retention and expired idempotency keys, and
/// nothing newer.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn janitor_prunes_only_what_can_no_longer_matter(_: PgPoolOptions, opts: PgConnectOptions) {
    let l = ledger(opts).await;
    l.hold(&l.seats[..1], Duration::from_secs(60)).await; // a fresh idempotency key
    sqlx::query("INSERT INTO inbox (consumer, event_id, processed_at) VALUES ('saga', $1, now() - interval '8 days'), ('saga', $2, now())")
        .bind(Uuid::new_v4())
        .bind(Uuid::new_v4())
        .execute(&l.pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO idempotency_keys (user_id, idempotency_key, request_hash, expires_at) VALUES ($1, 'old', 'h', now() - interval '1 hour')")
        .bind(Uuid::new_v4())
        .execute(&l.pool)
        .await
        .unwrap();
    assert_eq!(boxoffice_store::inbox::prune(&l.pool, 7 * 86_400, 100).await.unwrap(), 1);
    assert_eq!(boxoffice_store::inbox::prune_idempotency_keys(&l.pool, 100).await.unwrap(), 1);
    let left: (i64, i64) =
        sqlx::query_as("SELECT (SELECT count(*) FROM inbox), (SELECT count(*) FROM idempotency_keys)")
            .fetch_one(&l.pool)
            .await
            .unwrap();
    assert_eq!(left, (1, 1));
}

/// A shared batch locks the holds and orders of all its facts in one statement
/// (`Handler::lock_rows`), and each hold's lapse is judged when its row is locked, not when the
/// statement began: an order whose hold ends while the batch waits for another order's row
/// is compensated (its authorization cancelled, its seat given back), never confirmed
/// (invariant 2), and the other order is confirmed.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_saga_batch_judges_each_hold_when_it_locks_it(_: PgPoolOptions, opts: PgConnectOptions) {
    use boxoffice_bus::consumer::handle_batch;
    use boxoffice_bus::Followers;
    let l = ledger(opts).await;
    let mut receipts = [
        l.hold(&l.seats[..1], Duration::from_secs(60)).await,
        l.hold(&l.seats[1..2], Duration::from_secs(60)).await,
    ];
    receipts.sort_by_key(|r| r.order_id);
    let (first, second) = (receipts[0].order_id, receipts[1].order_id);
    let second_seat: Uuid = sqlx::query_scalar(
        "SELECT hs.seat_id FROM hold_seats hs JOIN holds h ON h.id = hs.hold_id WHERE h.order_id = $1",
    )
    .bind(second.0)
    .fetch_one(&l.pool)
    .await
    .unwrap();
    let (pi_first, pi_second) = (l.payment(first).await, l.payment(second).await);
    // The second order's hold ends a second from now, with nothing to extend it.
    sqlx::query(
        "UPDATE holds SET expires_at = clock_timestamp() + interval '1 second', authorized_until = NULL,
                payable_by = NULL, provider_check_until = NULL
          WHERE order_id = $1",
    )
    .bind(second.0)
    .execute(&l.pool)
    .await
    .unwrap();
    // Another transaction holds the first order's hold, so the batch's lock waits there.
    let blocker = crate::helpers::hold_lock_elsewhere(&l.pool, first.0).await;
    let envs = vec![authorized(second, &pi_second), authorized(first, &pi_first)];
    for env in &envs {
        crate::helpers::committed(&l.pool, env).await;
    }
    let batch = {
        let (pool, envs) = (l.pool.clone(), envs.clone());
        tokio::spawn(async move { handle_batch(&pool, &Saga::default(), &Followers::none(), &envs).await })
    };
    crate::helpers::await_lock_wait(
        &l.pool,
        "%FOR UPDATE OF h, o%",
        "the batch's lock waits for the first order",
    )
    .await;
    let ended = || async {
        sqlx::query_scalar::<_, bool>("SELECT expires_at < clock_timestamp() FROM holds WHERE order_id = $1")
            .bind(second.0)
            .fetch_one(&l.pool)
            .await
            .unwrap()
    };
    crate::helpers::eventually(Duration::from_secs(30), "the second order's hold has ended", ended).await;
    assert!(!batch.is_finished(), "the batch waited for the first order's hold");
    blocker.commit().await.unwrap();
    let out = batch.await.unwrap().unwrap();
    assert_eq!(out, vec![Some(Disposition::Applied), Some(Disposition::Applied)]);

    assert_eq!(l.status(first).await, "confirming");
    assert_eq!(l.hold_status(first).await, "confirmed");
    assert_eq!(l.capture_requests(first).await, 1);
    // Its hold ended while the batch waited: compensated, its seat given back.
    assert_eq!(l.status(second).await, "canceled");
    assert_eq!(l.hold_status(second).await, "expired");
    assert_eq!(l.capture_requests(second).await, 0);
    assert_eq!(l.outbox("AuthorizationCancelRequested", second).await, 1);
    assert_eq!(l.active_rows(second_seat).await, 0);
}

/// The hold transaction reclaims the lapsed holds of a seat request in ascending order id,
/// each hold and then its order, the sequence a saga batch locks the same rows in
/// (`holds::lock_all_with_orders`). Two lapsed holds whose hold ids sort the other way round
/// from their order ids: while the request waits for the lower order's hold, the other hold is
/// still free: the request never holds a higher order's rows while it waits for a lower one's,
/// so it cannot close a cycle with a saga batch. Once the wait ends, both holds are reclaimed
/// and the request is held.
///
/// One process mints an order's id and its hold's one after the other, both time-ordered, so
/// its pairs sort alike; two processes minting within one millisecond, or holds written while
/// ids were random, make pairs that do not. The test makes one: the first hold is given a new
/// id, later than the second's.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_hold_reclaims_lapsed_holds_in_order_id_order(_: PgPoolOptions, opts: PgConnectOptions) {
    let l = ledger(opts).await;
    let (low_seat, high_seat) = (l.seats[0], l.seats[1]);
    let mut low = l.hold(&[low_seat], Duration::from_secs(60)).await;
    let high = l.hold(&[high_seat], Duration::from_secs(60)).await;
    assert!(low.order_id < high.order_id && low.hold_id < high.hold_id, "minted in this order");
    let renamed = boxoffice_domain::ids::time_ordered();
    let mut tx = l.pool.begin().await.unwrap();
    // The hold's seat rows name it by id (a foreign key without ON UPDATE): both move at once,
    // with the foreign keys' triggers off for this transaction.
    sqlx::query("SET LOCAL session_replication_role = replica").execute(&mut *tx).await.unwrap();
    for sql in
        ["UPDATE hold_seats SET hold_id = $2 WHERE hold_id = $1", "UPDATE holds SET id = $2 WHERE id = $1"]
    {
        let r = sqlx::query(sql).bind(low.hold_id.0).bind(renamed).execute(&mut *tx).await.unwrap();
        assert_eq!(r.rows_affected(), 1, "{sql}");
    }
    tx.commit().await.unwrap();
    low.hold_id = boxoffice_domain::HoldId(renamed);
    assert!(low.hold_id > high.hold_id, "the lower order's hold sorts last by hold id");
    l.lapse_unprotected(&[low.order_id, high.order_id]).await;
    let blocker = crate::helpers::hold_lock_elsewhere(&l.pool, low.order_id.0).await;
    let request = l.spawn_request(&[high_seat, low_seat]);
    crate::helpers::await_lock_wait(&l.pool, "%FROM holds%", "the request waits for a lapsed hold").await;
    let free = crate::helpers::try_lock_hold(&l.pool, high.order_id.0).await;
    assert!(free.is_ok(), "the higher order's hold was locked before the lower's: {free:?}");
    assert!(!request.is_finished(), "the request waited for the lower order's hold");
    blocker.commit().await.unwrap();
    let outcome = request.await.unwrap().unwrap();
    assert!(matches!(outcome, holds::ReserveOutcome::Created(_)), "{outcome:?}");
    assert_eq!(l.hold_status(low.order_id).await, "expired");
    assert_eq!(l.hold_status(high.order_id).await, "expired");
}

/// A ticket issue for two orders in one transaction (a shared consumer batch) takes its seats'
/// foreign-key share locks order by order, not in seat order, while hold requests lock seats
/// in seat order. Neither waits for the other:
/// - a request naming a seat the batch has ticketed and a lower one it has not yet is refused
///   at once (both seats are taken); with its seat locks `FOR UPDATE` it locked the lower seat
///   and waited for the batch, whose next ticket then waited for it: a deadlock;
/// - the batch tickets a seat that a request has locked while that request waits for another
///   seat (locked by a third hold request), and commits before the request moves on.
///
/// The batch does what the ticket worker does for each order: the confirmed hold gives its
/// seats back (`holds::transition_returning_seats`), then the tickets take them.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_hold_request_and_a_ticket_batch_never_wait_for_each_other(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let l = ledger(opts).await;
    let mut s = l.seats[..3].to_vec();
    s.sort();
    let (lowest, middle, highest) = (s[0], s[1], s[2]);
    let first = l.hold(&[highest], Duration::from_secs(60)).await;
    let second = l.hold(&[lowest], Duration::from_secs(60)).await;
    let mut batch = l.pool.begin().await.unwrap();
    let seats = release_for_tickets(&mut batch, first.hold_id).await;
    assert_eq!(seats.ids(), &[highest][..]);
    boxoffice_store::tickets::issue(&mut batch, first.order_id, &seats, l.event.0).await.unwrap();

    let request = l.spawn_request(&[lowest, highest]);
    let outcome = tokio::time::timeout(Duration::from_secs(30), request)
        .await
        .expect("the hold request waited for the ticket batch")
        .unwrap();
    assert!(
        matches!(outcome, Err(holds::ReserveError::SeatUnavailable { .. })),
        "both seats are taken: {outcome:?}"
    );

    // Another hold request holds the middle seat; a request for the lowest and the middle
    // locks the lowest and waits.
    let mut other = l.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM seats WHERE id = $1 FOR NO KEY UPDATE")
        .bind(middle)
        .execute(&mut *other)
        .await
        .unwrap();
    let waiting = l.spawn_request(&[lowest, middle]);
    crate::helpers::await_lock_wait(&l.pool, "%FROM seats%", "the request waits for the middle seat").await;
    tokio::time::timeout(Duration::from_secs(30), async {
        let seats = release_for_tickets(&mut batch, second.hold_id).await;
        boxoffice_store::tickets::issue(&mut batch, second.order_id, &seats, l.event.0).await
    })
    .await
    .expect("the ticket batch waited for the hold request's seat lock")
    .unwrap();
    batch.commit().await.unwrap();
    assert!(!waiting.is_finished(), "the request was still waiting when the batch committed");
    other.rollback().await.unwrap();
    let outcome = waiting.await.unwrap();
    assert!(
        matches!(outcome, Err(holds::ReserveError::SeatUnavailable { .. })),
        "the lowest seat is ticketed: {outcome:?}"
    );
    let tickets: i64 = sqlx::query_scalar("SELECT count(*) FROM tickets WHERE seat_id = ANY($1)")
        .bind(vec![lowest, highest])
        .fetch_one(&l.pool)
        .await
        .unwrap();
    assert_eq!(tickets, 2, "the batch issued both orders' tickets");
}

/// Tickets take only the seats a hold's release gave back, for that hold's order: a move that
/// keeps the seats (active → confirmed) gives back none, and issuing from it, or issuing the
/// released seats to another order, is refused with nothing written.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn tickets_are_issued_only_for_seats_a_release_gave_back(_: PgPoolOptions, opts: PgConnectOptions) {
    let l = ledger(opts).await;
    let receipt = l.hold(&l.seats[..2], Duration::from_secs(60)).await;
    let mut tx = l.pool.begin().await.unwrap();
    let mut row = holds::lock(&mut tx, receipt.hold_id).await.unwrap().unwrap();
    let (_, kept) =
        holds::transition_returning_seats(&mut tx, &mut row, boxoffice_domain::HoldStatus::Confirmed)
            .await
            .unwrap();
    assert!(kept.ids().is_empty(), "a confirmation keeps the seats: {kept:?}");
    let refused = boxoffice_store::tickets::issue(&mut tx, receipt.order_id, &kept, l.event.0).await;
    assert!(matches!(refused, Err(boxoffice_store::StoreError::Corrupt(_))), "{refused:?}");
    let (_, freed) =
        holds::transition_returning_seats(&mut tx, &mut row, boxoffice_domain::HoldStatus::Released)
            .await
            .unwrap();
    let mut held = l.seats[..2].to_vec();
    held.sort();
    assert_eq!(freed.ids(), &held[..], "every seat of the hold, ascending");
    let other = boxoffice_store::tickets::issue(&mut tx, OrderId(Uuid::new_v4()), &freed, l.event.0).await;
    assert!(
        matches!(other, Err(boxoffice_store::StoreError::Corrupt(_))),
        "another order's seats: {other:?}"
    );
    let ids = boxoffice_store::tickets::issue(&mut tx, receipt.order_id, &freed, l.event.0).await.unwrap();
    tx.commit().await.unwrap();
    let tickets: Vec<Uuid> =
        sqlx::query_scalar("SELECT id FROM tickets WHERE order_id = $1 ORDER BY seat_id")
            .bind(receipt.order_id.0)
            .fetch_all(&l.pool)
            .await
            .unwrap();
    assert_eq!(tickets, ids, "one ticket per released seat, in seat order");
}

/// The ticket worker's release, on a hold of the test's: locked, confirmed, then released,
/// handing back its seats.
async fn release_for_tickets(
    tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    hold: boxoffice_domain::HoldId,
) -> holds::ReleasedSeats {
    let mut row = holds::lock(tx, hold).await.unwrap().expect("the hold exists");
    holds::transition(tx, &mut row, boxoffice_domain::HoldStatus::Confirmed).await.unwrap();
    holds::transition_returning_seats(tx, &mut row, boxoffice_domain::HoldStatus::Released).await.unwrap().1
}

/// A request that finds its seat's hold lapsed, and waits for that hold's lock while another
/// transaction (the expiry sweep, another request reclaiming the same multi-seat hold)
/// expires it, gets the seat: the expired hold gave it back. Before, the reclaim counted
/// "no longer active" as "taken" and refused with 409 a seat that was free.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_hold_expired_meanwhile_by_another_gives_its_seat_to_the_waiting_request(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let l = ledger(opts).await;
    let lapsed = l.hold(&l.seats[..2], Duration::from_secs(60)).await;
    l.lapse_unprotected(&[lapsed.order_id]).await;
    let mut sweep = crate::helpers::hold_lock_elsewhere(&l.pool, lapsed.order_id.0).await;

    let request = l.spawn_request(&l.seats[..1]);
    crate::helpers::await_lock_wait(&l.pool, "%FROM holds%", "the request waits for the lapsed hold").await;
    let row = holds::lock(&mut sweep, lapsed.hold_id).await.unwrap().unwrap();
    assert!(
        holds::expire_locked(&mut sweep, &row).await.unwrap(),
        "the sweep expires the lapsed hold's order"
    );
    sweep.commit().await.unwrap();

    let outcome = request.await.unwrap().unwrap();
    assert!(matches!(outcome, holds::ReserveOutcome::Created(_)), "the seat was free: {outcome:?}");
    assert_eq!(l.hold_status(lapsed.order_id).await, "expired");
    // The other seat of the expired hold is free too.
    l.hold(&l.seats[1..2], Duration::from_secs(60)).await;
}
