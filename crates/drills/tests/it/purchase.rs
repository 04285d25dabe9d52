//! The whole purchase path through every role, against the real broker and the Stripe
//! simulator: hold → PaymentIntent → buyer confirms → authorization webhook → confirm →
//! capture → tickets; the decline-then-expire branch; and a relay that republishes after a
//! crash (duplicate delivery, one effect).

use crate::helpers::{eventually, TestApp};
use boxoffice::runtime::Role;
use boxoffice_domain::saga::AuthorizationRequest;
use boxoffice_domain::{Envelope, OrderId, PurchaseEvent, SeatId, UserId};
use boxoffice_store::holds::{self, ReserveRequest};
use boxoffice_store::venue::VenueSpec;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::time::Duration;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn hold_to_ticket_through_every_role(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &Role::ALL, VenueSpec::small(1, 2, 6)).await;
    let s = app.seats().await;
    let b = app.buyer();
    let r = app.hold(&b, &app.admission_token(&b), "buy-1", &[s[0], s[1]]).await;
    assert_eq!(r.status(), 202);
    let receipt: serde_json::Value = r.json().await.unwrap();
    let order: Uuid = receipt["order_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(receipt["amount_minor"], 2 * 18_500);

    let pi = app.pay(&b, order, "pm_card_visa").await.expect("authorized");
    assert_eq!(pi.status, "requires_capture");
    let view = app.await_order(&b, order, WAIT, |v| v["status"] == "ticketed").await;
    assert_eq!(view["tickets"].as_array().unwrap().len(), 2);
    assert!(view.get("client_secret").is_none(), "no client secret once paid");
    assert_eq!(app.sim.captures_for(&pi.id), 1);
    let expected: Vec<Uuid> = [s[0], s[1]]
        .iter()
        .map(|seat| boxoffice_domain::ids::ticket_id(boxoffice_domain::OrderId(order), SeatId(*seat)))
        .collect();
    let mut issued: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM tickets WHERE order_id = $1")
        .bind(order)
        .fetch_all(&app.pool)
        .await
        .unwrap();
    issued.sort();
    let mut expected_sorted = expected.clone();
    expected_sorted.sort();
    assert_eq!(issued, expected_sorted, "ticket ids are derived from (order, seat)");

    // The sold seats are refused to the next buyer; the audit is clean once the outbox drains.
    let c = app.buyer();
    assert_eq!(app.hold(&c, &app.admission_token(&c), "late", &[s[1]]).await.status(), 409);
    app.assert_drained_and_clean().await;
    app.stop().await;
}

/// Facts of what the provider did and refund and cancel requests, written to the purchase
/// topic by someone other than the ledger's writers (a `PaymentAuthorized` and an
/// `AuthorizationCancelRequested` for an order nobody paid, then a `PaymentRefunded` and a
/// `RefundRequested` for the ticketed order; one that borrows the id of a real fact), are
/// claims the saga and the payment worker check (`boxoffice_bus::Handler::verifies`): each
/// is parked as an `unknown_fact` incident and changes
/// nothing — the order stays payable, its hold live, its PaymentIntent uncancelled, and once
/// the buyer really pays it is ticketed and stays so.
async fn forged_provider_facts_change_nothing(app: TestApp) {
    use boxoffice_domain::OrderId;
    let kafka = app.cfg.kafka().unwrap();
    let producer = boxoffice_bus::producer::build(&kafka).unwrap();
    let topic = kafka.topic(boxoffice_domain::Topic::Purchase.name());
    // `id`: an event id to borrow (else a fresh one).
    let forge = |fact: &PurchaseEvent, order: Uuid, id: Option<Uuid>| {
        let mut env = Envelope::new(OrderId(order), fact, Uuid::new_v4(), None);
        env.event_id = id.unwrap_or(env.event_id);
        let (producer, topic) = (producer.clone(), topic.clone());
        async move {
            let id = env.event_id.to_string();
            boxoffice_bus::producer::send(
                &producer,
                &topic,
                &order.to_string(),
                &serde_json::to_vec(&env).unwrap(),
                &[
                    (boxoffice_bus::fact_headers::EVENT_ID, id.as_str()),
                    (boxoffice_bus::fact_headers::EVENT_TYPE, env.event_type.as_str()),
                ],
            )
            .await
            .unwrap();
            env.event_id
        }
    };
    let parked = |id: Uuid| {
        let pool = app.pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM incidents WHERE kind = 'unknown_fact' AND detail->>'event_id' = $1)",
            )
            .bind(id.to_string())
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let seat = app.seats().await[0];
    let b = app.buyer();
    let order = app.hold_order(&b, "forged", &[seat]).await;
    let view = app.await_order(&b, order, WAIT, |v| v["status"] == "payment_required").await;
    let pi = view["payment_intent_id"].as_str().unwrap().to_owned();
    let authorized = PurchaseEvent::PaymentAuthorized {
        order_id: OrderId(order),
        payment_intent_id: pi.clone(),
        amount_capturable_minor: view["amount_minor"].as_i64().unwrap(),
        capture_before: None,
    };
    let id = forge(&authorized, order, None).await;
    eventually(WAIT, "the forged authorization parked", || parked(id)).await;
    // One that borrows the id of a real fact of the order the saga never recorded (its
    // `HoldCreated`, the payment worker's request) is not that fact either.
    let hold_created: Uuid = sqlx::query_scalar(
        "SELECT id FROM outbox WHERE event_type = 'HoldCreated' AND message_key = $1::text
         UNION ALL SELECT event_id FROM order_history WHERE event_type = 'HoldCreated' AND order_id = $1",
    )
    .bind(order)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(!crate::helpers::in_inbox(&app.pool, "saga", hold_created).await);
    forge(&authorized, order, Some(hold_created)).await;
    eventually(WAIT, "the forged authorization with a borrowed id parked", || parked(hold_created)).await;
    // A forged cancel request cancels nothing at the provider.
    let cancel = PurchaseEvent::AuthorizationCancelRequested {
        order_id: OrderId(order),
        payment_intent_id: pi.clone(),
        reason: "forged".into(),
    };
    let id = forge(&cancel, order, None).await;
    eventually(WAIT, "the forged cancel request parked", || parked(id)).await;
    assert_eq!(app.sim.payment_intent(&pi).unwrap()["status"], "requires_payment_method");
    let (_, view) = app.order(&b, order).await;
    assert_eq!(view["status"], "payment_required", "a forged authorization confirms nothing: {view}");
    let hold: String = sqlx::query_scalar("SELECT status FROM holds WHERE order_id = $1")
        .bind(order)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(hold, "active");
    assert_eq!(app.sim.captures_for(&pi), 0);

    // The buyer pays for real: ticketed, captured once.
    app.pay(&b, order, "pm_card_visa").await.expect("authorized");
    app.await_order(&b, order, WAIT, |v| v["status"] == "ticketed").await;
    let refunded = PurchaseEvent::PaymentRefunded {
        order_id: OrderId(order),
        payment_intent_id: pi.clone(),
        amount_refunded_minor: view["amount_minor"].as_i64().unwrap(),
    };
    let id = forge(&refunded, order, None).await;
    eventually(WAIT, "the forged refund parked", || parked(id)).await;
    // A forged refund request refunds nothing at the provider.
    let refund = PurchaseEvent::RefundRequested {
        order_id: OrderId(order),
        payment_intent_id: pi.clone(),
        amount_minor: 1,
        reason: "forged".into(),
    };
    let id = forge(&refund, order, None).await;
    eventually(WAIT, "the forged refund request parked", || parked(id)).await;
    assert_eq!(app.sim.stats().refunds, 0, "nothing refunded at the provider");
    let (_, view) = app.order(&b, order).await;
    assert_eq!(view["status"], "ticketed", "a forged refund voids nothing: {view}");
    assert_eq!(app.sim.captures_for(&pi), 1);
    let valid: i64 =
        sqlx::query_scalar("SELECT count(*) FROM tickets WHERE order_id = $1 AND voided_at IS NULL")
            .bind(order)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(valid, 1, "the ticket stays valid");
    app.stop().await;
}

/// Through a member's group transaction (`consumer_group_commit`).
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn forged_provider_facts_are_parked_in_a_group_transaction(_: PgPoolOptions, opts: PgConnectOptions) {
    let app =
        TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| c.consumer_group_commit = true)
            .await;
    forged_provider_facts_change_nothing(app).await;
}

/// Through a lane's own transaction of one fact.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn forged_provider_facts_are_parked_alone(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| {
        c.consumer_group_commit = false;
        c.consumer_batch_max = 1;
    })
    .await;
    forged_provider_facts_change_nothing(app).await;
}

/// With `consumer_group_commit` (`boxoffice_bus::consumer`, "Group commit"), purchases made
/// at once through every role are each ticketed, each charged once, and the ledger is clean
/// once the outbox drains.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn purchases_at_once_are_ticketed_through_members_that_commit_together(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app =
        TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 2, 6), |c| c.consumer_group_commit = true)
            .await;
    let seats = app.seats().await;
    let a = &app;
    let bought = futures::future::join_all(seats.iter().take(8).enumerate().map(|(i, seat)| async move {
        let b = a.buyer();
        let order = a.hold_order(&b, &format!("together-{i}"), &[*seat]).await;
        let pi = a.pay(&b, order, "pm_card_visa").await.expect("authorized");
        a.await_order(&b, order, WAIT, |v| v["status"] == "ticketed").await;
        (order, pi.id)
    }))
    .await;
    for (order, pi) in &bought {
        assert_eq!(app.sim.captures_for(pi), 1, "order {order}: captured once");
    }
    let tickets: i64 = sqlx::query_scalar("SELECT count(*) FROM tickets").fetch_one(&app.pool).await.unwrap();
    assert_eq!(tickets, 8, "one ticket per seat bought");
    app.assert_drained_and_clean().await;
    app.stop().await;
}

#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn declined_card_then_hold_expiry_releases_seats_and_cancels(_: PgPoolOptions, opts: PgConnectOptions) {
    let app =
        TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| c.hold_ttl_ms = 8_000).await;
    let s = app.seats().await;
    let b = app.buyer();
    let r = app.hold(&b, &app.admission_token(&b), "decline", &[s[2]]).await;
    let order: Uuid =
        r.json::<serde_json::Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap();
    let err = app.pay(&b, order, "pm_card_chargeDeclined").await.expect_err("declined");
    assert_eq!(err.status(), Some(402));
    let view = app.await_order(&b, order, WAIT, |v| v["status"] == "expired").await;
    let pi = view["payment_intent_id"].as_str().unwrap().to_owned();
    let sim = app.sim.clone();
    eventually(WAIT, "PaymentIntent cancelled at the provider", || {
        let sim = sim.clone();
        let pi = pi.clone();
        async move { sim.payment_intent(&pi).map(|p| p["status"] == "canceled").unwrap_or(false) }
    })
    .await;
    let c = app.buyer();
    assert_eq!(app.hold(&c, &app.admission_token(&c), "next", &[s[2]]).await.status(), 202);
    app.stop().await;
}

/// Design §17 / C11: the relay crashes after the broker acknowledged but before it marked
/// the row; the relay that leads next publishes the message again, and the saga applies it
/// once.
/// The fact is a `HoldCreated` as a writer from before `saga::hold_created` wrote it (without
/// its authorization request), on which the saga emits `PaymentAuthorizationRequested` while
/// the order is `held`: applied twice, it would emit two.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn republished_message_is_applied_once(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &[Role::Relay, Role::Saga], VenueSpec::small(1, 1, 4)).await;
    let seat = app.seats().await[0];
    let receipt = hold_directly(&app, seat).await;
    let order = receipt.order_id.0;
    let pool = app.pool.clone();
    let requested = move |pool: sqlx::PgPool| async move {
        crate::helpers::outbox_count(&pool, "PaymentAuthorizationRequested", order).await
    };
    assert_eq!(requested(pool.clone()).await, 0, "the hold's own HoldCreated is its request");
    let older = Envelope::new(
        receipt.order_id,
        &PurchaseEvent::HoldCreated {
            order_id: receipt.order_id,
            hold_id: receipt.hold_id,
            event_id: receipt.event_id,
            seat_ids: receipt.seat_ids.clone(),
            expires_at: receipt.expires_at,
            amount_minor: receipt.amount_minor,
            currency: receipt.currency.clone(),
            authorization_requested: false,
            is_authorization_request: false,
        },
        Uuid::new_v4(),
        None,
    );
    let mut tx = app.pool.begin().await.unwrap();
    boxoffice_store::outbox::insert(&mut tx, boxoffice_domain::Topic::Purchase, &older).await.unwrap();
    tx.commit().await.unwrap();
    eventually(WAIT, "saga applied the older HoldCreated", || {
        let f = requested(pool.clone());
        async move { f.await == 1 }
    })
    .await;

    // The relay's first publication is marked (else the reset below could come before the
    // mark, which would then count the only publication).
    let p1 = app.pool.clone();
    eventually(WAIT, "the older HoldCreated marked published", || published(p1.clone(), older.event_id))
        .await;
    // The crash: the row is unpublished, as a relay that died before marking it leaves it.
    sqlx::query("UPDATE outbox SET published_at = NULL WHERE id = $1")
        .bind(older.event_id)
        .execute(&app.pool)
        .await
        .unwrap();
    // A later fact for the same order (same partition, so consumed after the duplicate).
    write_intent_created(&app.pool, receipt.order_id, "pi_marker").await;
    let p2 = app.pool.clone();
    eventually(WAIT, "marker applied", || {
        let p2 = p2.clone();
        async move {
            sqlx::query_scalar::<_, String>("SELECT status FROM orders WHERE id = $1")
                .bind(order)
                .fetch_one(&p2)
                .await
                .unwrap()
                == "payment_required"
        }
    })
    .await;
    let republished: i32 = sqlx::query_scalar("SELECT publish_attempts FROM outbox WHERE id = $1")
        .bind(older.event_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(republished, 2, "the row was published a second time");
    assert_eq!(requested(app.pool.clone()).await, 1, "the duplicate had no second effect");
    app.stop().await;
}

/// Design §7: one relay at a time publishes. While another session holds the outbox's lock
/// (a leader in another process), the process's relay stands by and publishes nothing; when
/// that session ends (the leader crashed), the relay takes the lock and publishes what the
/// leader left.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_standing_by_relay_publishes_once_the_leaders_session_ends(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use sqlx::{ConnectOptions, Connection};
    let mut leader = opts.connect().await.unwrap();
    assert!(boxoffice_store::outbox::try_relay_lock(&mut leader).await.unwrap());
    let app = TestApp::spawn(opts, &[Role::Relay], VenueSpec::small(1, 1, 4)).await;
    let fact = write_intent_created(&app.pool, OrderId(Uuid::new_v4()), "pi_standby").await;
    let committed: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(&app.pool).await.unwrap();
    // The relay's session has tried the lock since the row committed (a standby's only
    // statement), so it has had its chance to publish it.
    let pool = app.pool.clone();
    eventually(WAIT, "the relay tried the lock after the commit", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND application_name = 'boxoffice-relay'
                    AND state = 'idle' AND query LIKE 'SELECT pg_try_advisory_lock%' AND query_start > $1",
            )
            .bind(committed)
            .fetch_one(&pool)
            .await
            .unwrap()
                == 1
        }
    })
    .await;
    assert!(!published(app.pool.clone(), fact.event_id).await, "a relay without the lock published");
    leader.close().await.unwrap();
    let pool = app.pool.clone();
    eventually(WAIT, "published once the leader's session ended", || published(pool.clone(), fact.event_id))
        .await;
    app.stop().await;
}

/// A leader whose session the server ends (an administrator's `pg_terminate_backend`, a
/// restart, a failover of the database) knows it lost the lock with it: it gives the lead up
/// as `session_lost`, opens a new session, takes the lock again and publishes what was
/// written meanwhile.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_leader_whose_session_is_ended_takes_the_lock_again_and_publishes(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let metrics = boxoffice::runtime::metrics_handle().expect("the process's metrics recorder");
    let app = TestApp::spawn(opts, &[Role::Relay], VenueSpec::small(1, 1, 4)).await;
    let holder = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i32>(
            "SELECT a.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
              WHERE l.locktype = 'advisory' AND l.granted AND l.classid = $1::oid AND l.objid = $2::oid
                AND a.datname = current_database() AND a.application_name = 'boxoffice-relay'",
        )
        .bind(boxoffice_store::outbox::RELAY_LOCK.0 as i64)
        .bind(boxoffice_store::outbox::RELAY_LOCK.1 as i64)
        .fetch_optional(&pool)
        .await
        .unwrap()
    };
    let pool = app.pool.clone();
    eventually(WAIT, "the relay leads", || {
        let pool = pool.clone();
        async move { holder(pool).await.is_some() }
    })
    .await;
    let first = holder(app.pool.clone()).await.unwrap();
    let lost = || {
        metrics
            .render()
            .lines()
            .find_map(|l| l.strip_prefix("boxoffice_relay_gave_up_total{reason=\"session_lost\"} "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let lost_before = lost();
    let ended: bool =
        sqlx::query_scalar("SELECT pg_terminate_backend($1)").bind(first).fetch_one(&app.pool).await.unwrap();
    assert!(ended);
    let fact = write_intent_created(&app.pool, OrderId(Uuid::new_v4()), "pi_after_kill").await;
    let pool = app.pool.clone();
    eventually(WAIT, "published by the relay's new session", || published(pool.clone(), fact.event_id)).await;
    let second = holder(app.pool.clone()).await.expect("the relay holds the lock again");
    assert_ne!(second, first, "the lock is held by a new session");
    assert!(lost() > lost_before, "the lost lead was counted:\n{}", metrics.render());
    app.stop().await;
}

/// A leader that reaches PostgreSQL but publishes nothing (every batch fails: its broker,
/// its producer or its configuration) gives the lock up after `relay::GIVE_UP_AFTER` batches,
/// so that another relay can take it; once the fault is gone, it leads and publishes again.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_leader_that_publishes_nothing_gives_the_lock_up(_: PgPoolOptions, opts: PgConnectOptions) {
    use boxoffice_store::outbox;
    use sqlx::{ConnectOptions, Connection};
    boxoffice_faults::set("relay.before_publish", "return").unwrap();
    let app = TestApp::spawn(opts.clone(), &[Role::Relay], VenueSpec::small(1, 1, 4)).await;
    let fact = write_intent_created(&app.pool, OrderId(Uuid::new_v4()), "pi_stalled").await;
    eventually(WAIT, "the relay leads and fails", || async {
        boxoffice_faults::fired("relay.before_publish") >= 1
    })
    .await;
    // Another relay (the connection `other`) gets the lock once the leader has given it up.
    let mut other = opts.connect().await.unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while !outbox::try_relay_lock(&mut other).await.unwrap() {
        assert!(std::time::Instant::now() < deadline, "the failing leader kept the lock");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let failed = boxoffice_faults::fired("relay.before_publish");
    assert!(
        failed >= u64::from(boxoffice_workers::relay::GIVE_UP_AFTER),
        "gave up after {failed} failed batches"
    );
    assert!(!published(app.pool.clone(), fact.event_id).await);
    boxoffice_faults::clear("relay.before_publish");
    other.close().await.unwrap();
    let pool = app.pool.clone();
    eventually(WAIT, "published once the fault is gone", || published(pool.clone(), fact.event_id)).await;
    app.stop().await;
}

/// A fact the producer refuses outright (larger than a message may be) holds back only its
/// own order: the order's later fact stays unpublished behind it, another order's fact is
/// published, and the leader keeps the lock however many batches read the refused row again
/// (a refusal is no broker failure: it counts towards no give-up). The refused row is tried
/// by every batch here (`relay_refused_retry_s = 0`), so the refusal repeats.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_refused_fact_holds_back_only_its_own_order(_: PgPoolOptions, opts: PgConnectOptions) {
    use sqlx::ConnectOptions;
    let metrics = boxoffice::runtime::metrics_handle().expect("the process's metrics recorder");
    let app = TestApp::spawn_with(opts.clone(), &[Role::Relay], VenueSpec::small(1, 1, 4), |c| {
        c.relay_refused_retry_s = 0
    })
    .await;
    let (stuck, other) = (OrderId(Uuid::new_v4()), OrderId(Uuid::new_v4()));
    let oversized = write_oversized(&app.pool, stuck).await;
    let behind = write_intent_created(&app.pool, stuck, "pi_behind").await;
    let fine = write_intent_created(&app.pool, other, "pi_fine").await;
    let pool = app.pool.clone();
    eventually(WAIT, "the other order's fact published", || published(pool.clone(), fine.event_id)).await;
    // Batches enough to have given the lock up, had refusals counted.
    let threshold = u64::from(boxoffice_workers::relay::GIVE_UP_AFTER) + 1;
    eventually(WAIT, "the refused row read again and again", || {
        let text = metrics.render();
        async move {
            text.lines()
                .find_map(|l| l.strip_prefix("boxoffice_outbox_refused_total "))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .is_some_and(|n| n >= threshold as f64)
        }
    })
    .await;
    let text = metrics.render();
    assert!(!text.contains("boxoffice_relay_gave_up_total"), "the leader gave the lock up:\n{text}");
    let mut standby = opts.connect().await.unwrap();
    assert!(
        !boxoffice_store::outbox::try_relay_lock(&mut standby).await.unwrap(),
        "the leader lost the lock"
    );
    assert!(!published(app.pool.clone(), oversized).await);
    assert!(
        !published(app.pool.clone(), behind.event_id).await,
        "a later fact of the order went ahead of it"
    );
    app.stop().await;
}

/// Refused facts are parked, and no number of them stops the outbox (a relay batch holds
/// two here; three of three orders are refused, older than anything else): each is parked on
/// its first refusal, with the producer's error, and read no more; the facts of other orders
/// are published past them, the later fact of a refused order waits behind it, and the
/// backlog counts the parked rows apart. `outbox::retry_parked` has the next batch try one
/// again, and it is parked again.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn refused_facts_are_parked_and_the_rest_of_the_outbox_flows(_: PgPoolOptions, opts: PgConnectOptions) {
    use boxoffice_store::outbox;
    let app =
        TestApp::spawn_with(opts, &[Role::Relay], VenueSpec::small(1, 1, 4), |c| c.relay_batch = 2).await;
    let orders: Vec<OrderId> = (0..3).map(|_| OrderId(Uuid::new_v4())).collect();
    let mut refused = Vec::new();
    for o in &orders {
        refused.push(write_oversized(&app.pool, *o).await);
    }
    let behind = write_intent_created(&app.pool, orders[0], "pi_behind").await;
    let fine = write_intent_created(&app.pool, OrderId(Uuid::new_v4()), "pi_fine").await;
    // The relay marks a batch's delivered rows, then parks its refused ones: await both.
    let pool = app.pool.clone();
    eventually(WAIT, "another order's fact published past three refused rows, and those parked", || {
        published_and_parked(pool.clone(), fine.event_id, 3)
    })
    .await;
    let parked = outbox::parked(&app.pool).await.unwrap();
    assert_eq!(
        parked.iter().map(|p| p.id).collect::<Vec<_>>(),
        refused,
        "each refused row parked, oldest first"
    );
    for p in &parked {
        let why = p.refusal.as_deref().unwrap_or_default();
        assert!(why.contains("MessageSizeTooLarge"), "the producer's error recorded: {why}");
        assert!(why.ends_with(" bytes)"), "the message's size recorded: {why}");
        assert!(p.retry_at.is_some_and(|t| t > p.refused_at), "{p:?}");
        let expect_behind = i64::from(p.message_key == orders[0].0.to_string());
        assert_eq!(p.held_back, expect_behind, "{p:?}");
    }
    assert!(!published(app.pool.clone(), behind.event_id).await, "a later fact went ahead of a parked one");
    let b = outbox::backlog(&app.pool).await.unwrap();
    assert_eq!((b.unpublished, b.parked), (0, 4), "the parked rows and the one behind, apart: {b:?}");
    // A parked row is not read again: a fact written now is published, and no refusal is
    // recorded anew.
    let later = write_intent_created(&app.pool, OrderId(Uuid::new_v4()), "pi_later").await;
    let pool = app.pool.clone();
    eventually(WAIT, "a later fact published", || published(pool.clone(), later.event_id)).await;
    let again = outbox::parked(&app.pool).await.unwrap();
    assert_eq!(
        again.iter().map(|p| p.refused_at).collect::<Vec<_>>(),
        parked.iter().map(|p| p.refused_at).collect::<Vec<_>>(),
        "a parked row was tried again before its retry was due"
    );
    // Released, it is tried by the next batch, refused and parked again.
    assert_eq!(outbox::retry_parked(&app.pool, outbox::Release::Rows(&[refused[1]])).await.unwrap(), 1);
    let (pool, was, released) = (app.pool.clone(), parked[1].refused_at, refused[1]);
    eventually(WAIT, "the released row tried and parked again", || {
        let pool = pool.clone();
        async move {
            outbox::parked(&pool).await.unwrap().iter().any(|p| p.id == released && p.refused_at > was)
        }
    })
    .await;
    assert_eq!(outbox::parked(&app.pool).await.unwrap().len(), 3);
    // Its cause fixed (here: the fact made smaller) and released, the first is published, and
    // the fact that waited behind it leaves after it.
    sqlx::query("UPDATE outbox SET payload = jsonb_build_object('pad', 'x') WHERE id = $1")
        .bind(refused[0])
        .execute(&app.pool)
        .await
        .unwrap();
    assert_eq!(outbox::retry_parked(&app.pool, outbox::Release::Rows(&[refused[0]])).await.unwrap(), 1);
    let pool = app.pool.clone();
    eventually(WAIT, "the fact behind it published", || published(pool.clone(), behind.event_id)).await;
    assert!(published(app.pool.clone(), refused[0]).await);
    let (cleared, attempts): (bool, i32) =
        sqlx::query_as("SELECT refused_at IS NULL, publish_attempts FROM outbox WHERE id = $1")
            .bind(refused[0])
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(cleared && attempts == 1, "published once and parked no more");
    assert_eq!(outbox::backlog(&app.pool).await.unwrap().parked, 2);
    app.stop().await;
}

/// A row whose stored envelope the relay cannot read (JSON nested deeper than serde_json
/// reads; no writer stores one, but the ledger is not the relay's to trust) is parked with
/// why, with the later fact of its order behind it, and the facts of other orders are
/// published past it: one such row does not stop the relay. The order's timeline shows the
/// row, and an incident detail nested as deep, as unreadable instead of failing.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn an_unreadable_outbox_row_is_parked_and_the_rest_of_the_outbox_flows(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use boxoffice_store::outbox;
    let app = TestApp::spawn(opts, &[Role::Api, Role::Relay], VenueSpec::small(1, 1, 4)).await;
    let seats = app.seats().await;
    let order = OrderId(app.hold_order(&app.buyer(), "unreadable", &seats[..1]).await);
    let deep = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO outbox (id, topic, message_key, event_type, payload)
         VALUES ($1, $2, $3, 'PaymentIntentCreated', (repeat('[', 200) || repeat(']', 200))::jsonb)",
    )
    .bind(deep)
    .bind(boxoffice_domain::Topic::Purchase.name())
    .bind(order.0.to_string())
    .execute(&app.pool)
    .await
    .unwrap();
    let behind = write_intent_created(&app.pool, order, "pi_behind").await;
    let fine = write_intent_created(&app.pool, OrderId(Uuid::new_v4()), "pi_fine").await;
    let pool = app.pool.clone();
    eventually(WAIT, "another order's fact published past the unreadable row, and that parked", || {
        published_and_parked(pool.clone(), fine.event_id, 1)
    })
    .await;
    let parked = outbox::parked(&app.pool).await.unwrap();
    assert_eq!(parked.iter().map(|p| p.id).collect::<Vec<_>>(), [deep]);
    let why = parked[0].refusal.as_deref().unwrap_or_default();
    assert!(why.starts_with("unreadable envelope: recursion limit exceeded"), "{why}");
    assert_eq!(parked[0].held_back, 1, "its order's later fact waits behind it");
    assert!(!published(app.pool.clone(), behind.event_id).await);
    // The order's timeline reads it, and says it is unreadable; an incident's detail too.
    sqlx::query(
        "INSERT INTO incidents (order_id, kind, detail)
         VALUES ($1, 'forged', ('{\"a\": ' || repeat('[', 200) || repeat(']', 200) || '}')::jsonb)",
    )
    .bind(order.0)
    .execute(&app.pool)
    .await
    .unwrap();
    let t =
        boxoffice_api::timeline::read(&app.pool, None, order.0, Default::default()).await.unwrap().unwrap();
    let shown = t.timeline.steps.iter().flat_map(|s| &s.facts).find(|f| f.event_id == deep);
    let shown = shown.expect("the unreadable row is in the timeline");
    let said = shown.payload["unreadable_envelope"].as_str().unwrap_or_default();
    assert!(said.starts_with("recursion limit exceeded"), "{:?}", shown.payload);
    assert!(shown.refusal.as_deref().is_some_and(|r| r.starts_with("unreadable envelope")));
    let incident = t.timeline.steps.iter().flat_map(|s| &s.incidents).find(|i| i.kind == "forged");
    let detail = &incident.expect("the incident is in the timeline").detail;
    assert!(
        detail["unreadable_detail"].as_str().is_some_and(|d| d.starts_with("recursion limit")),
        "{detail}"
    );
    app.stop().await;
}

/// A parked order is read whole or not at all, and a few due orders at a time
/// (`outbox::pending_batch`, `park_refused`, `retry_parked`, on the ledger alone): of twelve
/// orders due at once, a batch reads ten, and the other two once those are parked again; an
/// order's parked rows share one retry, so a row parked later does not keep the order due
/// (and its slot taken) while an earlier one waits; released, the order's facts are read in
/// the order they were written.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn parked_orders_are_read_whole_and_a_few_at_a_time(pool: sqlx::PgPool) {
    use boxoffice_store::outbox::{self, Release, DUE_PARKED_PER_BATCH};
    use std::collections::BTreeSet;
    let mut c = pool.acquire().await.unwrap();
    let keys =
        |rows: &[outbox::OutboxRow]| rows.iter().map(|r| r.message_key.clone()).collect::<BTreeSet<_>>();
    let mut facts = Vec::new();
    for _ in 0..12 {
        facts.push(write_intent_created(&pool, OrderId(Uuid::new_v4()), "pi_parked").await);
    }
    let refused: Vec<(Uuid, String)> = facts.iter().map(|f| (f.event_id, "too large".to_owned())).collect();
    assert_eq!(outbox::park_refused(&mut c, &refused, 0).await.unwrap(), 12);
    let first = outbox::pending_batch(&mut c, 500).await.unwrap();
    assert_eq!(keys(&first).len(), DUE_PARKED_PER_BATCH as usize, "a few due orders per batch");
    let again: Vec<(Uuid, String)> = first.iter().map(|r| (r.id, "too large".to_owned())).collect();
    outbox::park_refused(&mut c, &again, 300).await.unwrap();
    let second = outbox::pending_batch(&mut c, 500).await.unwrap();
    assert_eq!(second.len(), 2);
    assert!(keys(&second).is_disjoint(&keys(&first)), "the orders not read yet come next");
    outbox::park_refused(&mut c, &second.iter().map(|r| (r.id, "x".to_owned())).collect::<Vec<_>>(), 300)
        .await
        .unwrap();
    assert!(outbox::pending_batch(&mut c, 500).await.unwrap().is_empty(), "every order parked");

    // One order, three facts; its third refused (due at once), then its first (in 300 s).
    let order = OrderId(Uuid::new_v4());
    let x1 = write_intent_created(&pool, order, "pi_x1").await;
    let x2 = write_intent_created(&pool, order, "pi_x2").await;
    let x3 = write_intent_created(&pool, order, "pi_x3").await;
    outbox::park_refused(&mut c, &[(x3.event_id, "too large".into())], 0).await.unwrap();
    outbox::park_refused(&mut c, &[(x1.event_id, "too large".into())], 300).await.unwrap();
    let retry: Vec<Option<chrono::DateTime<chrono::Utc>>> =
        sqlx::query_scalar("SELECT retry_at FROM outbox WHERE id = ANY($1) ORDER BY created_at")
            .bind([x1.event_id, x3.event_id])
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(
        retry[0].is_some() && retry[0] == retry[1],
        "the order's parked rows share their retry: {retry:?}"
    );
    assert!(outbox::pending_batch(&mut c, 500).await.unwrap().is_empty(), "the order waits whole");
    let parked = outbox::parked(&pool).await.unwrap();
    let x1_row = parked.iter().find(|p| p.id == x1.event_id).unwrap();
    assert_eq!(x1_row.held_back, 2, "{x1_row:?}");
    assert_eq!(outbox::backlog(&pool).await.unwrap().parked, 15);
    assert_eq!(outbox::retry_parked(&pool, Release::Rows(&[x3.event_id])).await.unwrap(), 2);
    let released = outbox::pending_batch(&mut c, 500).await.unwrap();
    assert_eq!(
        released.iter().map(|r| r.id).collect::<Vec<_>>(),
        [x1.event_id, x2.event_id, x3.event_id],
        "the order read whole, in the order its facts were written"
    );
}

/// A message no consumer can apply (undecodable, or naming an order that does not exist)
/// goes to the dead-letter topic with its source coordinates, and the partition moves on. One
/// that is no envelope at all is dead-lettered once, by the saga's group, not once per group
/// that reads the topic (the ticket worker's acknowledges it), and its letter keeps the first
/// `UNREADABLE_ORIGINAL_MAX` bytes of it.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn poison_messages_are_dead_lettered_and_the_partition_moves_on(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
    use rdkafka::Message;

    let app =
        TestApp::spawn(opts, &[Role::Relay, Role::Saga, Role::Tickets], VenueSpec::small(1, 1, 4)).await;
    let kafka = app.cfg.kafka().unwrap();
    let producer = boxoffice_bus::producer::build(&kafka).unwrap();
    let topic = kafka.topic(boxoffice_domain::Topic::Purchase.name());
    let ghost = boxoffice_domain::OrderId::new();
    let orphan = Envelope::new(
        ghost,
        &PurchaseEvent::PaymentIntentCreated {
            order_id: ghost,
            payment_intent_id: "pi_ghost".into(),
            status: "requires_payment_method".into(),
        },
        Uuid::new_v4(),
        None,
    );
    // All on one key, so they share a partition and lane with the real order's event below.
    let key = "poison-key";
    let junk = [b"{not an envelope".as_slice(), &[b'x'; 10_000]].concat();
    boxoffice_bus::producer::send(&producer, &topic, key, &junk, &[]).await.unwrap();
    // A fact this ledger committed (the saga checks that of a provider fact), whose order is gone.
    crate::helpers::committed(&app.pool, &orphan).await;
    boxoffice_bus::producer::send(&producer, &topic, key, &serde_json::to_vec(&orphan).unwrap(), &[])
        .await
        .unwrap();
    // A healthy event behind them on the same partition is still applied.
    let seat = app.seats().await[0];
    let receipt = hold_directly(&app, seat).await;
    let hold_created: serde_json::Value = sqlx::query_scalar(
        "SELECT payload FROM outbox WHERE event_type = 'HoldCreated' AND message_key = $1",
    )
    .bind(receipt.order_id.to_string())
    .fetch_one(&app.pool)
    .await
    .unwrap();
    // As an older writer's (without its request), so the saga emits one.
    let mut copy = hold_created.clone();
    let copy_id = Uuid::new_v4();
    copy["event_id"] = serde_json::json!(copy_id);
    copy["payload"]["authorization_requested"] = serde_json::json!(false);
    copy["payload"]["is_authorization_request"] = serde_json::json!(false);
    crate::helpers::committed(&app.pool, &serde_json::from_value(copy.clone()).unwrap()).await;
    boxoffice_bus::producer::send(&producer, &topic, key, &serde_json::to_vec(&copy).unwrap(), &[])
        .await
        .unwrap();
    let pool = app.pool.clone();
    let order = receipt.order_id.0;
    eventually(WAIT, "the healthy message behind the poison was applied", || {
        let pool = pool.clone();
        async move { crate::helpers::in_inbox(&pool, "saga", copy_id).await }
    })
    .await;
    // Its request is the saga's only one (the hold's own HoldCreated is the request).
    assert_eq!(crate::helpers::outbox_count(&app.pool, "PaymentAuthorizationRequested", order).await, 1);

    let dlq: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &kafka.brokers)
        .set("group.id", format!("{}dlq-reader", kafka.prefix))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    dlq.subscribe(&[&kafka.topic(boxoffice_domain::Topic::DeadLetter.name())]).unwrap();
    let mut letters = Vec::new();
    while letters.len() < 2 {
        let m = tokio::time::timeout(WAIT, dlq.recv()).await.expect("dead letters arrive").unwrap();
        letters.push(serde_json::from_slice::<serde_json::Value>(m.payload().unwrap()).unwrap());
    }
    let codes: Vec<&str> = letters.iter().map(|l| l["error_code"].as_str().unwrap()).collect();
    assert_eq!(codes, ["bad_envelope", "unknown_order"], "{letters:?}");
    for l in &letters {
        assert_eq!(l["consumer"], "saga");
        assert_eq!(l["source_topic"], "ticketing.purchase.v1");
        assert!(l["source_offset"].as_i64().unwrap() >= 0);
        assert!(l["original"].is_string(), "enough context to replay");
    }
    assert_eq!(letters[1]["event_id"], serde_json::json!(orphan.event_id));
    let kept = letters[0]["original"].as_str().unwrap();
    assert_eq!(kept.len(), boxoffice_bus::consumer::UNREADABLE_ORIGINAL_MAX);
    assert!(kept.starts_with("{not an envelope"));
    assert_eq!(letters[0]["original_bytes"], serde_json::json!(junk.len()));

    // The ticket worker's group has moved past the junk too (its offset is committed only
    // after any dead letter of its own is durable): it wrote none.
    let junk_at = rdkafka::topic_partition_list::TopicPartitionList::from_topic_map(
        &[(
            (topic.clone(), letters[0]["source_partition"].as_i64().unwrap() as i32),
            rdkafka::Offset::Beginning,
        )]
        .into_iter()
        .collect(),
    )
    .unwrap();
    let junk_offset = letters[0]["source_offset"].as_i64().unwrap();
    let tickets_group: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &kafka.brokers)
        .set("group.id", kafka.group("tickets"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    eventually(WAIT, "the ticket worker's group committed past the junk", || {
        let committed = tickets_group.committed_offsets(junk_at.clone(), Duration::from_secs(5)).unwrap();
        let past = committed
            .elements()
            .iter()
            .any(|e| matches!(e.offset(), rdkafka::Offset::Offset(o) if o > junk_offset));
        async move { past }
    })
    .await;

    // The operator's view lists the same letters; after the fault is fixed (the order now
    // exists), replaying the letter applies it once.
    let listed = boxoffice_bus::dlq::list(&kafka, WAIT).await.unwrap();
    assert_eq!(listed.len(), 2);
    sqlx::query(
        "INSERT INTO orders (id, user_id, event_id, status, amount_minor, currency, correlation_id)
         VALUES ($1, $2, $3, 'held', 100, 'usd', $4)",
    )
    .bind(ghost.0)
    .bind(Uuid::new_v4())
    .bind(app.event)
    .bind(Uuid::new_v4())
    .execute(&app.pool)
    .await
    .unwrap();
    let unknown: Vec<_> = listed.into_iter().filter(|l| l.record["error_code"] == "unknown_order").collect();
    assert_eq!(boxoffice_bus::dlq::replay(&kafka, &producer, &unknown).await.unwrap(), 1);
    let pool = app.pool.clone();
    eventually(WAIT, "the replayed letter was applied", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>("SELECT status FROM orders WHERE id = $1")
                .bind(ghost.0)
                .fetch_one(&pool)
                .await
                .unwrap()
                == "payment_required"
        }
    })
    .await;
    app.stop().await;
}

/// A hold made straight through the ledger (no API role running), its `HoldCreated` the
/// authorization request.
async fn hold_directly(app: &TestApp, seat: Uuid) -> holds::HoldReceipt {
    hold_directly_as(app, seat, AuthorizationRequest::InHoldFact).await
}

/// [`hold_directly`], asking for the authorization in `form`.
async fn hold_directly_as(app: &TestApp, seat: Uuid, form: AuthorizationRequest) -> holds::HoldReceipt {
    let req = ReserveRequest {
        user_id: UserId::new(),
        event_id: boxoffice_domain::EventId(app.event),
        seat_ids: vec![SeatId(seat)],
        idempotency_key: "k".into(),
        correlation_id: Uuid::new_v4(),
        ttl: Duration::from_secs(600),
        payable_within: None,
        cell: "cell-1".into(),
        directory_epoch: 1,
        authorization_request: form,
    };
    holds::reserve(&app.pool, &req).await.unwrap().receipt().clone()
}

/// The business signals of design §16 are exported on `/metrics`: hold latency, outbox
/// backlog and age, and consumer lag per partition.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn metrics_export_the_business_signals(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &[Role::Api, Role::Relay, Role::Saga], VenueSpec::small(1, 1, 4)).await;
    let s = app.seats().await;
    let b = app.buyer();
    assert_eq!(app.hold(&b, &app.admission_token(&b), "m", &[s[0]]).await.status(), 202);
    let (http, url) = (app.http.clone(), format!("{}/metrics", app.api));
    eventually(WAIT, "metrics exported", || {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let text = http.get(url).send().await.unwrap().text().await.unwrap();
            [
                "boxoffice_hold_seconds",
                "boxoffice_outbox_oldest_unpublished_age_ms",
                "boxoffice_consumer_lag{",
            ]
            .iter()
            .all(|m| text.contains(m))
        }
    })
    .await;
    app.stop().await;
}

/// A hold asks for its order's authorization once, in either form. With
/// `hold_fact_requests_authorization = false` (a rolling upgrade from a build whose payment
/// worker does not act on a `HoldCreated`) the API's hold writes the command beside its
/// `HoldCreated`, and the payment worker acts on the command alone; in the default form the
/// hold writes no command and the payment worker acts on the `HoldCreated`. The saga runs
/// too and requests nothing for either. Each order gets one PaymentIntent.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_hold_asks_for_its_authorization_once_in_either_form(_: PgPoolOptions, opts: PgConnectOptions) {
    let roles = [Role::Api, Role::Relay, Role::Saga, Role::Payments];
    let app = TestApp::spawn_with(opts, &roles, VenueSpec::small(1, 1, 4), |c| {
        c.hold_fact_requests_authorization = false;
    })
    .await;
    let seats = app.seats().await;
    let b = app.buyer();
    let r = app.hold(&b, &app.admission_token(&b), "upgrade", &[seats[0]]).await;
    assert_eq!(r.status(), 202);
    let command_form: Uuid =
        r.json::<serde_json::Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap();
    let in_fact = hold_directly_as(&app, seats[1], AuthorizationRequest::InHoldFact).await.order_id.0;
    let pool = app.pool.clone();
    eventually(WAIT, "both orders' PaymentIntents recorded", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM payments WHERE order_id = ANY($1)")
                .bind([command_form, in_fact])
                .fetch_one(&pool)
                .await
                .unwrap()
                == 2
        }
    })
    .await;
    assert_eq!(app.sim.stats().payment_intents_created, 2, "one intent per order");
    assert_eq!(app.outbox_count("PaymentAuthorizationRequested", command_form).await, 1);
    assert_eq!(app.outbox_count("PaymentAuthorizationRequested", in_fact).await, 0, "no command");
    // What the payment worker applied: the command for the first order, the fact for the second.
    let applied = |order: Uuid| {
        let pool = app.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT o.event_type FROM inbox i JOIN outbox o ON o.id = i.event_id
                  WHERE i.consumer = 'payments' AND o.message_key = $1::text",
            )
            .bind(order)
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(applied(command_form).await, ["PaymentAuthorizationRequested"]);
    assert_eq!(applied(in_fact).await, ["HoldCreated"]);
    app.stop().await;
}

/// A confirmation asks for its capture once, in either form. With
/// `confirmation_fact_requests_capture = false` (a rolling upgrade from a build whose payment
/// worker does not act on an `OrderConfirmed`) the saga writes a `CaptureRequested` after an
/// `OrderConfirmed` that is not the request, and the payment worker acts on the command alone;
/// in the default form (every other purchase test) the `OrderConfirmed` is the request. A
/// capture request of the other form arriving for the same order afterwards (a replay, a
/// mixed fleet) captures nothing more: the hold is no longer `confirming`'s, and the provider
/// key is the order's either way.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_confirmation_asks_for_its_capture_once_in_either_form(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| {
        c.confirmation_fact_requests_capture = false;
    })
    .await;
    let seat = app.seats().await[0];
    let b = app.buyer();
    let order = app.hold_order(&b, "upgrade", &[seat]).await;
    let pi = app.pay(&b, order, "pm_card_visa").await.expect("authorized");
    app.await_order(&b, order, WAIT, |v| v["status"] == "ticketed").await;
    assert_eq!(app.sim.captures_for(&pi.id), 1);
    assert_eq!(app.outbox_count("OrderConfirmed", order).await, 1);
    assert_eq!(app.outbox_count("CaptureRequested", order).await, 1, "the command beside the fact");
    assert_eq!(crate::helpers::capture_requests(&app.pool, order).await, 1, "the fact is not a request");
    let applied: Vec<String> = sqlx::query_scalar(
        "SELECT o.event_type FROM inbox i JOIN outbox o ON o.id = i.event_id
          WHERE i.consumer = 'payments' AND o.message_key = $1::text AND o.event_type IN ('OrderConfirmed', 'CaptureRequested')",
    )
    .bind(order)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(applied, ["CaptureRequested"], "the payment worker acted on the command");

    // The default form's request for the same order, delivered late: nothing is captured again.
    let confirmed: Envelope = sqlx::query_scalar::<_, serde_json::Value>(
        "SELECT payload FROM outbox WHERE event_type = 'OrderConfirmed' AND message_key = $1::text",
    )
    .bind(order)
    .fetch_one(&app.pool)
    .await
    .map(|v| serde_json::from_value(v).unwrap())
    .unwrap();
    let hold_id = match confirmed.decode().unwrap() {
        PurchaseEvent::OrderConfirmed { hold_id, capture: None, .. } => hold_id,
        other => panic!("{other:?}"),
    };
    let request = confirmed.follow(&PurchaseEvent::OrderConfirmed {
        order_id: OrderId(order),
        hold_id,
        capture: Some(boxoffice_domain::RequestedCapture {
            payment_intent_id: pi.id.clone(),
            amount_minor: 18_500,
        }),
    });
    let worker = boxoffice_workers::payment::PaymentWorker::new(
        std::sync::Arc::new(app.stripe()),
        app.pool.clone(),
        app.cfg.hold_policy(),
    );
    crate::helpers::committed(&app.pool, &request).await;
    // A copy that borrows the request's id for another amount, read first, is refused before
    // any call and leaves the id to the real request (it would otherwise be skipped as
    // `amount_differs_from_order` and take the request's inbox row).
    let mut forged = confirmed.follow(&PurchaseEvent::OrderConfirmed {
        order_id: OrderId(order),
        hold_id,
        capture: Some(boxoffice_domain::RequestedCapture {
            payment_intent_id: pi.id.clone(),
            amount_minor: 18_501,
        }),
    });
    forged.event_id = request.event_id;
    assert_eq!(
        boxoffice_bus::consumer::handle_once(&app.pool, &worker, &forged).await.unwrap(),
        boxoffice_bus::consumer::Disposition::Unknown
    );
    assert_eq!(app.sim.captures_for(&pi.id), 1, "nothing more captured for the forged copy");
    assert_eq!(
        boxoffice_bus::consumer::handle_once(&app.pool, &worker, &request).await.unwrap(),
        boxoffice_bus::consumer::Disposition::Applied
    );
    assert_eq!(app.sim.captures_for(&pi.id), 1, "one capture at the provider");
    app.assert_drained_and_clean().await;
    app.stop().await;
}

/// A second `PaymentAuthorizationRequested` for one order (an older saga's beside the hold
/// transaction's, or a replayed or forged one with a new event id, hence a new idempotency
/// key) creates no second PaymentIntent: the order already has its payment row.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_second_authorization_request_creates_no_second_intent(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &[Role::Relay, Role::Payments], VenueSpec::small(1, 1, 4)).await;
    // This process's metrics (each test runs in a process of its own): the recorder its start
    // installed before any role ran.
    let metrics = boxoffice::runtime::metrics_handle().expect("the process's metrics recorder");
    let seat = app.seats().await[0];
    let receipt = hold_directly(&app, seat).await;
    let order = receipt.order_id.0;
    let pool = app.pool.clone();
    eventually(WAIT, "the order's PaymentIntent recorded", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM payments WHERE order_id = $1")
                .bind(order)
                .fetch_one(&pool)
                .await
                .unwrap()
                == 1
        }
    })
    .await;
    assert_eq!(app.sim.stats().payment_intents_created, 1);
    let again = Envelope::new(
        receipt.order_id,
        &PurchaseEvent::PaymentAuthorizationRequested {
            order_id: receipt.order_id,
            hold_id: receipt.hold_id,
            amount_minor: receipt.amount_minor,
            currency: receipt.currency.clone(),
        },
        Uuid::new_v4(),
        None,
    );
    let mut tx = app.pool.begin().await.unwrap();
    boxoffice_store::outbox::insert(&mut tx, boxoffice_domain::Topic::Purchase, &again).await.unwrap();
    tx.commit().await.unwrap();
    let (pool, id) = (app.pool.clone(), again.event_id);
    eventually(WAIT, "the payment worker took the second request", || {
        let pool = pool.clone();
        async move { crate::helpers::in_inbox(&pool, "payments", id).await }
    })
    .await;
    assert_eq!(app.sim.stats().payment_intents_created, 1, "no second intent");
    assert_eq!(app.outbox_count("PaymentIntentCreated", order).await, 1);
    // The skip is counted by its reason.
    let skipped = "boxoffice_payment_commands_skipped_total{reason=\"order_not_awaiting_payment_intent\"} 1";
    assert!(metrics.render().lines().any(|l| l == skipped), "{skipped} in:\n{}", metrics.render());
    // Every other reason is exported at 0 from the worker's start, so an alert's
    // `increase()` sees the first skip of any of them.
    for reason in
        boxoffice_workers::payment::SKIP_REASONS.iter().filter(|r| **r != "order_not_awaiting_payment_intent")
    {
        let zero = format!("boxoffice_payment_commands_skipped_total{{reason=\"{reason}\"}} 0");
        assert!(metrics.render().lines().any(|l| l == zero), "{zero} in:\n{}", metrics.render());
    }
    app.stop().await;
}

/// Commits a `PaymentIntentCreated` for `order` to the outbox, as its writer would.
async fn write_intent_created(pool: &sqlx::PgPool, order: OrderId, payment_intent_id: &str) -> Envelope {
    let fact = Envelope::new(
        order,
        &PurchaseEvent::PaymentIntentCreated {
            order_id: order,
            payment_intent_id: payment_intent_id.into(),
            status: "requires_payment_method".into(),
        },
        Uuid::new_v4(),
        None,
    );
    let mut tx = pool.begin().await.unwrap();
    boxoffice_store::outbox::insert(&mut tx, boxoffice_domain::Topic::Purchase, &fact).await.unwrap();
    tx.commit().await.unwrap();
    fact
}

/// Commits an outbox row for `order` larger than the producer lets a message be (its
/// `message.max.bytes`, 1,000,000 by default); returns its id.
async fn write_oversized(pool: &sqlx::PgPool, order: OrderId) -> Uuid {
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO outbox (id, topic, message_key, event_type, payload)
         VALUES ($1, $2, $3, 'PaymentIntentCreated', jsonb_build_object('pad', repeat('x', 1100000)))",
    )
    .bind(id)
    .bind(boxoffice_domain::Topic::Purchase.name())
    .bind(order.0.to_string())
    .execute(pool)
    .await
    .unwrap();
    id
}

/// Whether the outbox row of fact `event_id` is marked published.
/// Whether `event_id` is published and `parked` rows are parked: a relay batch marks its
/// delivered rows before it parks its refused ones, in two statements, so a test that sees
/// one awaits the other too.
async fn published_and_parked(pool: sqlx::PgPool, event_id: Uuid, parked: usize) -> bool {
    published(pool.clone(), event_id).await
        && boxoffice_store::outbox::parked(&pool).await.unwrap().len() == parked
}

async fn published(pool: sqlx::PgPool, event_id: Uuid) -> bool {
    sqlx::query_scalar("SELECT published_at IS NOT NULL FROM outbox WHERE id = $1")
        .bind(event_id)
        .fetch_one(&pool)
        .await
        .unwrap()
}
