//! Fault injection at every boundary (design §17), in the spirit of omicron's saga tests:
//! for every fault point, fail there once, let the system recover, and check that the
//! purchase converges with every invariant intact; then apply every step a second time
//! and check nothing changes. Also: the retry ladder (in place → retry-5s → retry-1m → dead
//! letter) and a ticket issuance that keeps failing, which must never release the seats.

use crate::helpers::{eventually, Buyer, TestApp};
use boxoffice::runtime::Role;
use boxoffice_bus::consumer::{handle_once, Disposition, Handler};
use boxoffice_domain::{Envelope, PurchaseEvent};
use boxoffice_store::venue::VenueSpec;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

/// Holds one seat (retrying a 503 with the same Idempotency-Key, as a client must), pays,
/// and waits for the tickets. Returns the order id and the PaymentIntent id.
async fn buy_one(app: &TestApp, b: &Buyer, seat: Uuid, key: &str) -> (Uuid, String) {
    let token = app.admission_token(b);
    let mut receipt = None;
    for _ in 0..5 {
        let r = app.hold(b, &token, key, &[seat]).await;
        match r.status().as_u16() {
            202 | 200 => {
                receipt = Some(r.json::<serde_json::Value>().await.unwrap());
                break;
            }
            503 => continue, // an injected fault around the hold commit: retry, same key
            s => panic!("hold answered {s}: {}", r.text().await.unwrap_or_default()),
        }
    }
    let receipt = receipt.expect("the hold succeeded within 5 attempts");
    let order: Uuid = receipt["order_id"].as_str().unwrap().parse().unwrap();
    let pi = app.pay(b, order, "pm_card_visa").await.expect("authorized");
    app.await_order(b, order, WAIT, |v| v["status"] == "ticketed").await;
    (order, pi.id)
}

/// Every fault point fails once during a purchase; every purchase still ends ticketed with
/// exactly one capture, and the ledger passes the audit. Then every step of every order is
/// applied again under a new message id (a duplicate the inbox cannot catch) and nothing
/// changes: no new command, no second capture, no extra ticket.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn every_boundary_fails_once_and_every_purchase_converges(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &Role::ALL, VenueSpec::small(1, 4, 8)).await;
    let seats = app.seats().await;
    assert!(seats.len() >= boxoffice_faults::POINTS.len());
    let mut orders = Vec::new();
    for (i, point) in boxoffice_faults::POINTS.iter().enumerate() {
        boxoffice_faults::set(point, "1*return").unwrap();
        let b = app.buyer();
        let (order, pi) = buy_one(&app, &b, seats[i], &format!("fault-{i}")).await;
        // Webhook points only fire when Stripe delivers; wait for the delivery to be retried.
        let p = point.to_string();
        eventually(WAIT, &format!("fault point {p} fired"), || {
            let p = p.clone();
            async move { boxoffice_faults::fired(&p) == 1 }
        })
        .await;
        boxoffice_faults::clear(point);
        assert_eq!(app.sim.captures_for(&pi), 1, "one capture despite a fault at {point}");
        orders.push((order, pi));
    }
    app.assert_drained_and_clean().await;
    let tickets = app.count("SELECT count(*) FROM tickets").await;
    assert_eq!(tickets, orders.len() as i64, "one ticket per order's seat");

    // Every step twice: replay each order's history through its consumers with fresh ids.
    let outbox_before = app.count("SELECT count(*) FROM outbox").await;
    let statuses_before: Vec<(Uuid, String)> =
        sqlx::query_as("SELECT id, status FROM orders ORDER BY id").fetch_all(&app.pool).await.unwrap();
    let gateway: Arc<dyn boxoffice_payments::PaymentGateway> = Arc::new(app.stripe());
    let payments =
        boxoffice_workers::payment::PaymentWorker::new(gateway, app.pool.clone(), app.cfg.hold_policy());
    let history: Vec<serde_json::Value> =
        sqlx::query_scalar("SELECT payload FROM outbox ORDER BY created_at, id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    let mut replayed = 0;
    for payload in history {
        let mut env: Envelope = serde_json::from_value(payload).unwrap();
        env.event_id = Uuid::new_v4();
        // A copy nobody applied: not even the consumers that followed it through.
        env.applied_by.clear();
        // As a fact this ledger committed: the saga checks that of a provider fact.
        crate::helpers::committed(&app.pool, &env).await;
        for d in [
            handle_once(&app.pool, &boxoffice_workers::saga::Saga::default(), &env).await.unwrap(),
            handle_once(&app.pool, &payments, &env).await.unwrap(),
            handle_once(&app.pool, &boxoffice_workers::tickets::TicketWorker, &env).await.unwrap(),
        ] {
            if d == Disposition::Applied {
                replayed += 1;
            }
        }
    }
    assert!(replayed > orders.len() * 5, "the whole history was re-applied ({replayed} steps)");
    assert_eq!(
        app.count("SELECT count(*) FROM outbox").await,
        outbox_before,
        "no step emitted anything twice"
    );
    let statuses_after: Vec<(Uuid, String)> =
        sqlx::query_as("SELECT id, status FROM orders ORDER BY id").fetch_all(&app.pool).await.unwrap();
    assert_eq!(statuses_before, statuses_after);
    assert_eq!(app.count("SELECT count(*) FROM tickets").await, tickets);
    for (_, pi) in &orders {
        assert_eq!(app.sim.captures_for(pi), 1);
    }
    let v = boxoffice_store::audit::violations(&app.pool, 600_000, None).await.unwrap();
    assert_eq!(v.total(), 0, "{v:?}");
    app.stop().await;
}

/// A transient failure that outlasts the in-place attempts moves through the retry topics
/// and succeeds there; one that never stops failing is dead-lettered with its origin and
/// attempt count — and while ticket issuance fails, the seats stay confirmed (sold), never
/// released. After the fix, `dlq replay` finishes the order.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn transient_failures_climb_the_retry_topics_then_dead_letter(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| {
        c.consumer_inline_attempts = 2;
        c.consumer_retry_5s_delay_ms = 300;
        c.consumer_retry_1m_delay_ms = 600;
        c.consumer_max_attempts = 5;
    })
    .await;
    let seats = app.seats().await;

    // Three failures: two in place, one on retry-5s; the retry-1m attempt succeeds.
    boxoffice_faults::set("tickets.before_commit", "3*return").unwrap();
    let b = app.buyer();
    let (order, _) = buy_one(&app, &b, seats[0], "retry-ladder").await;
    assert_eq!(boxoffice_faults::fired("tickets.before_commit"), 3);
    assert_eq!(app.count("SELECT count(*) FROM tickets").await, 1);
    let kafka = app.cfg.kafka().unwrap();
    assert!(
        boxoffice_bus::dlq::list(&kafka, Duration::from_secs(5)).await.unwrap().is_empty(),
        "order {order} recovered without a dead letter"
    );

    // Failing for good: five attempts, then the dead-letter topic; the order stays paid and
    // its seat confirmed.
    boxoffice_faults::set("tickets.before_commit", "return").unwrap();
    let c = app.buyer();
    let r = app.hold(&c, &app.admission_token(&c), "stuck", &[seats[1]]).await;
    let stuck: Uuid =
        r.json::<serde_json::Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap();
    app.pay(&c, stuck, "pm_card_visa").await.expect("authorized");
    app.await_order(&c, stuck, WAIT, |v| v["status"] == "paid").await;
    let mut letters = Vec::new();
    let deadline = std::time::Instant::now() + WAIT;
    while letters.is_empty() {
        assert!(std::time::Instant::now() < deadline, "no dead letter arrived");
        letters = boxoffice_bus::dlq::list(&kafka, Duration::from_secs(5)).await.unwrap();
    }
    assert_eq!(letters.len(), 1, "{letters:?}");
    let rec = &letters[0].record;
    assert_eq!(rec["consumer"], "tickets");
    assert_eq!(rec["error_code"], "retries_exhausted");
    assert_eq!(rec["attempts"], 5);
    assert_eq!(rec["event_type"], "TicketIssueRequested");
    assert_eq!(rec["source_topic"], "ticketing.purchase.v1", "the origin, not the retry topic");
    assert!(rec["source_offset"].as_i64().unwrap() >= 0);
    assert_eq!(letters[0].key, stuck.to_string());
    let hold_status: String = sqlx::query_scalar("SELECT status FROM holds WHERE order_id = $1")
        .bind(stuck)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(hold_status, "confirmed", "a failing ticket issuance never releases the seats");
    let other = app.buyer();
    assert_eq!(app.hold(&other, &app.admission_token(&other), "steal", &[seats[1]]).await.status(), 409);

    // The fix, then the replay: issued once.
    boxoffice_faults::clear("tickets.before_commit");
    let producer = boxoffice_bus::producer::build(&kafka).unwrap();
    assert_eq!(boxoffice_bus::dlq::replay(&kafka, &producer, &letters).await.unwrap(), 1);
    app.await_order(&c, stuck, WAIT, |v| v["status"] == "ticketed").await;
    assert_eq!(app.count("SELECT count(*) FROM tickets").await, 2);
    app.assert_drained_and_clean().await;
    app.stop().await;
}

fn signed(app: &TestApp, body: &serde_json::Value) -> (Vec<u8>, String) {
    use secrecy::ExposeSecret;
    let bytes = serde_json::to_vec(body).unwrap();
    let sig = boxoffice_payments::webhook::sign(
        &bytes,
        app.cfg.stripe_webhook_secret.expose_secret(),
        chrono::Utc::now().timestamp(),
    );
    (bytes, sig)
}

async fn deliver(app: &TestApp, body: &serde_json::Value) -> serde_json::Value {
    let (bytes, sig) = signed(app, body);
    let r = app
        .http
        .post(format!("{}/webhooks/stripe", app.api))
        .header("Stripe-Signature", sig)
        .header("content-type", "application/json")
        .body(bytes)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

fn pi_event(
    id: &str,
    kind: &str,
    pi: &str,
    status: &str,
    amount_capturable: i64,
    order: Option<Uuid>,
) -> serde_json::Value {
    let metadata = match order {
        Some(o) => serde_json::json!({"order_id": o.to_string()}),
        None => serde_json::json!({}),
    };
    serde_json::json!({
        "id": id, "object": "event", "type": kind, "created": chrono::Utc::now().timestamp(),
        "livemode": false, "api_version": "2024-06-20", "pending_webhooks": 1, "request": null,
        "data": {"object": {"id": pi, "object": "payment_intent", "status": status, "amount": 18500,
                 "amount_capturable": amount_capturable, "amount_received": 0, "currency": "usd",
                 "capture_method": "manual", "metadata": metadata}}
    })
}

/// Re-fetches of `order`'s PaymentIntent requested with `reason`.
async fn refreshes(app: &TestApp, order: Uuid, reason: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE event_type = 'PaymentIntentRefreshRequested' AND message_key = $1
            AND payload -> 'payload' ->> 'reason' = $2",
    )
    .bind(order.to_string())
    .bind(reason)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

/// Re-fetches of `order`'s PaymentIntent requested with `reason` that the payment worker has
/// applied.
pub async fn refreshes_applied(pool: &sqlx::PgPool, order: Uuid, reason: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM inbox i JOIN outbox o ON o.id = i.event_id
          WHERE i.consumer = 'payments' AND o.event_type = 'PaymentIntentRefreshRequested'
            AND o.message_key = $1 AND o.payload -> 'payload' ->> 'reason' = $2",
    )
    .bind(order.to_string())
    .bind(reason)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Whether every claim about `order`'s PaymentIntent `pi` has been checked with the provider:
/// no re-fetch of it is pending (`payment_intent_refetches`: the last re-fetch read the ledger
/// after the last claim was counted, and marked the row made), and the payment worker applied every
/// `PaymentIntentRefreshRequested` of the order.
pub async fn claims_checked(pool: &sqlx::PgPool, order: Uuid, pi: &str) -> bool {
    sqlx::query_scalar(
        "SELECT NOT EXISTS (SELECT 1 FROM payment_intent_refetches WHERE payment_intent_id = $2 AND asked_at > '-infinity')
            AND NOT EXISTS (SELECT 1 FROM outbox o
                             WHERE o.message_key = $1 AND o.event_type = 'PaymentIntentRefreshRequested'
                               AND NOT EXISTS (SELECT 1 FROM inbox i
                                                WHERE i.consumer = 'payments' AND i.event_id = o.id))",
    )
    .bind(order.to_string())
    .bind(pi)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A webhook that disagrees with the ledger is not acted on: the PaymentIntent is re-fetched
/// and Stripe's answer decides. A forged-looking "authorized for 1 cent" does not confirm
/// the order; a "canceled" for a captured payment does not release a sold seat.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn disagreeing_webhooks_are_resolved_by_asking_stripe(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &Role::ALL, VenueSpec::small(1, 1, 4)).await;
    let seat = app.seats().await[0];
    let b = app.buyer();
    let r = app.hold(&b, &app.admission_token(&b), "disagree", &[seat]).await;
    let order: Uuid =
        r.json::<serde_json::Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap();
    let v = app.await_order(&b, order, WAIT, |v| v.get("payment_intent_id").is_some()).await;
    let pi = v["payment_intent_id"].as_str().unwrap().to_owned();

    // The amount disagrees (and Stripe has not authorized anything yet).
    let wrong = pi_event(
        "evt_wrong_amount",
        "payment_intent.amount_capturable_updated",
        &pi,
        "requires_capture",
        1,
        Some(order),
    );
    deliver(&app, &wrong).await;
    let pool = app.pool.clone();
    assert_eq!(refreshes(&app, order, "amount_mismatch").await, 1);
    eventually(WAIT, "the refresh asked Stripe", || {
        let pool = pool.clone();
        async move { refreshes_applied(&pool, order, "amount_mismatch").await == 1 }
    })
    .await;
    assert_eq!(app.outbox_count("PaymentAuthorized", order).await, 0, "the webhook's claim was not trusted");
    let (_, view) = app.order(&b, order).await;
    assert_eq!(view["status"], "payment_required");

    // The real authorization goes through; then a "canceled" contradicting the capture.
    app.pay(&b, order, "pm_card_visa").await.expect("authorized");
    app.await_order(&b, order, WAIT, |v| v["status"] == "ticketed").await;
    app.assert_drained_and_clean().await;
    let captured_before = app.outbox_count("PaymentCaptured", order).await;
    let contradiction =
        pi_event("evt_contradiction", "payment_intent.canceled", &pi, "canceled", 0, Some(order));
    deliver(&app, &contradiction).await;
    assert_eq!(refreshes(&app, order, "status_contradicts_ledger").await, 1);
    eventually(WAIT, "the second refresh was applied", || {
        let pool = pool.clone();
        async move { refreshes_applied(&pool, order, "status_contradicts_ledger").await == 1 }
    })
    .await;
    assert_eq!(
        app.outbox_count("PaymentCaptured", order).await,
        captured_before,
        "Stripe's answer is no news"
    );
    assert_eq!(app.outbox_count("PaymentCanceled", order).await, 0);
    app.assert_drained_and_clean().await;
    let (_, view) = app.order(&b, order).await;
    assert_eq!(view["status"], "ticketed", "a contradicting webhook does not unsell a seat");

    // A webhook about another PaymentIntent of the order (not its current one) is ignored.
    let stale = serde_json::json!({
        "id": "evt_stale", "object": "event", "type": "payment_intent.succeeded",
        "created": chrono::Utc::now().timestamp(), "livemode": false, "api_version": "2024-06-20",
        "pending_webhooks": 1, "request": null,
        "data": {"object": {"id": "pi_someone_elses", "object": "payment_intent", "status": "succeeded",
                 "amount": 18500, "amount_capturable": 0, "amount_received": 18500, "currency": "usd",
                 "capture_method": "manual", "metadata": {"order_id": order.to_string()}}}
    });
    let outbox_before = app.count("SELECT count(*) FROM outbox").await;
    deliver(&app, &stale).await;
    assert_eq!(app.count("SELECT count(*) FROM outbox").await, outbox_before);
    app.stop().await;
}

/// What the payment worker's `prepare` makes of `event` alone (its pre-check read first, as
/// the runner reads it), with no transaction after it: the test plays the worker by hand.
async fn prepare_alone(
    pool: &sqlx::PgPool,
    worker: &boxoffice_workers::payment::PaymentWorker,
    env: Envelope,
    event: PurchaseEvent,
) -> boxoffice_workers::payment::Prepared {
    let pre = boxoffice_store::payments::prechecks(pool, "payments", &[(event.order_id(), env.event_id)])
        .await
        .unwrap()
        .remove(0);
    worker.prepare(&env, &event, pre).await.unwrap()
}

/// An authorization request is a claim checked against the ledger: one for another amount
/// or currency than its order's, or naming another hold (forged, or corrupt), creates no
/// PaymentIntent, whatever its form; the hold's own `HoldCreated` then gets the order its
/// intent.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn an_authorization_request_for_another_amount_creates_no_intent(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    // Only the API runs: the test plays the payment worker by hand.
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let seat = app.seats().await[0];
    let b = app.buyer();
    assert_eq!(app.hold(&b, &app.admission_token(&b), "claim", &[seat]).await.status(), 202);
    let hold_created: Envelope = serde_json::from_value(
        sqlx::query_scalar("SELECT payload FROM outbox WHERE event_type = 'HoldCreated'")
            .fetch_one(&app.pool)
            .await
            .unwrap(),
    )
    .unwrap();
    let real = hold_created.decode().unwrap();
    let ask = real.authorization_request().expect("the hold's fact is its request");
    let worker = boxoffice_workers::payment::PaymentWorker::new(
        Arc::new(app.stripe()),
        app.pool.clone(),
        app.cfg.hold_policy(),
    );
    let prepare = |env: Envelope, event: PurchaseEvent| prepare_alone(&app.pool, &worker, env, event);
    let mut forged = Vec::new();
    let other_hold = boxoffice_domain::HoldId::new();
    for (amount_minor, currency, hold_id, why) in [
        (ask.amount_minor - 1, "usd", ask.hold_id, "amount_differs_from_order"),
        (ask.amount_minor, "eur", ask.hold_id, "amount_differs_from_order"),
        (ask.amount_minor, "usd", other_hold, "hold_differs_from_order"),
    ] {
        forged.push((
            PurchaseEvent::PaymentAuthorizationRequested {
                order_id: ask.order_id,
                hold_id,
                amount_minor,
                currency: currency.into(),
            },
            why,
        ));
        let mut copy = real.clone();
        if let PurchaseEvent::HoldCreated { hold_id: h, amount_minor: a, currency: c, .. } = &mut copy {
            (*h, *a, *c) = (hold_id, amount_minor, currency.into());
        }
        forged.push((copy, why));
    }
    for (event, why) in forged {
        let env = hold_created.follow(&event);
        let prepared = prepare(env, event.clone()).await;
        assert!(
            matches!(prepared, boxoffice_workers::payment::Prepared::Skipped(w) if w == why),
            "{event:?}: {prepared:?}"
        );
    }
    assert_eq!(app.sim.stats().payment_intents_created, 0, "no intent for a claim the ledger contradicts");
    let prepared = prepare(hold_created.clone(), real).await;
    assert!(matches!(prepared, boxoffice_workers::payment::Prepared::Intent(_)), "{prepared:?}");
    assert_eq!(app.sim.stats().payment_intents_created, 1);
    app.stop().await;
}

/// A capture request is a claim checked against the ledger too: one naming another
/// PaymentIntent than the order's recorded one, or another amount than the order's (forged or
/// corrupt; capturing another buyer's intent under this order's key would take their money)
/// captures nothing, in either form; the confirmation's own `OrderConfirmed` then captures the
/// order's intent. An order confirmed without a recorded payment row (one lost with a fenced
/// region's commits, the saga having confirmed on the provider's word) is captured when the
/// provider says the intent was made for it, and not otherwise.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_capture_request_for_another_payment_intent_captures_nothing(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use boxoffice_workers::payment::Prepared;
    // Only the API runs: the test plays the payment worker and the saga by hand.
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let seats = app.seats().await;
    let b = app.buyer();
    let recorded = app.hold_order(&b, "capture-claim", &[seats[0]]).await;
    let fact = |event_type: &'static str, order: Uuid| {
        let pool = app.pool.clone();
        async move {
            let payload: serde_json::Value =
                sqlx::query_scalar("SELECT payload FROM outbox WHERE event_type = $1 AND message_key = $2")
                    .bind(event_type)
                    .bind(order.to_string())
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            serde_json::from_value::<Envelope>(payload).unwrap()
        }
    };
    let worker = boxoffice_workers::payment::PaymentWorker::new(
        Arc::new(app.stripe()),
        app.pool.clone(),
        app.cfg.hold_policy(),
    );
    let prepare = |env: Envelope, event: PurchaseEvent| prepare_alone(&app.pool, &worker, env, event);
    let saga = boxoffice_workers::saga::Saga::default();
    let authorized = |cause: &Envelope, order: Uuid, pi: &str| {
        cause.follow(&PurchaseEvent::PaymentAuthorized {
            order_id: boxoffice_domain::OrderId(order),
            payment_intent_id: pi.to_owned(),
            amount_capturable_minor: 18_500,
            capture_before: None,
        })
    };
    // A request of the confirmation's with its PaymentIntent, or its amount, replaced.
    let forge = |real: &PurchaseEvent, pi: &str, amount: i64| {
        let mut forged = real.clone();
        if let PurchaseEvent::OrderConfirmed { capture: Some(c), .. } = &mut forged {
            (c.payment_intent_id, c.amount_minor) = (pi.to_owned(), amount);
        }
        let ask = real.capture_request().unwrap();
        let command = PurchaseEvent::CaptureRequested {
            order_id: ask.order_id,
            payment_intent_id: pi.to_owned(),
            amount_minor: amount,
        };
        [forged, command]
    };

    // The order with its payment row: the payment worker records the intent, the saga
    // moves the order on, the buyer pays, and the saga confirms.
    let held = fact("HoldCreated", recorded).await;
    assert_eq!(handle_once(&app.pool, &worker, &held).await.unwrap(), Disposition::Applied);
    let created = fact("PaymentIntentCreated", recorded).await;
    assert_eq!(handle_once(&app.pool, &saga, &created).await.unwrap(), Disposition::Applied);
    let pi = app.pay(&b, recorded, "pm_card_visa").await.expect("authorized").id;
    let auth = authorized(&created, recorded, &pi);
    crate::helpers::committed(&app.pool, &auth).await;
    assert_eq!(handle_once(&app.pool, &saga, &auth).await.unwrap(), Disposition::Applied);
    let confirmed = fact("OrderConfirmed", recorded).await;
    let real = confirmed.decode().unwrap();
    assert_eq!(
        real.capture_request().expect("the confirmation is the capture request").payment_intent_id,
        pi
    );

    // Another buyer's authorized PaymentIntent at the provider.
    let other = app.authorize_at_provider(Uuid::new_v4(), 18_500, "another-buyer").await;
    let forged = forge(&real, &other, 18_500).into_iter().map(|e| (e, "payment_intent_differs_from_order"));
    let amounts = forge(&real, &pi, 1).into_iter().map(|e| (e, "amount_differs_from_order"));
    for (event, why) in forged.chain(amounts) {
        let prepared = prepare(confirmed.follow(&event), event.clone()).await;
        assert!(matches!(prepared, Prepared::Skipped(w) if w == why), "{event:?}: {prepared:?}");
    }
    assert_eq!(app.sim.captures_for(&other), 0, "no capture of another buyer's authorization");
    assert_eq!(app.sim.captures_for(&pi), 0);
    assert_eq!(handle_once(&app.pool, &worker, &confirmed).await.unwrap(), Disposition::Applied);
    assert_eq!(app.sim.captures_for(&pi), 1, "the order's own request captures its intent");

    // An order without a payment row, confirmed on an authorization of an intent made for it.
    let unrecorded = app.hold_order(&app.buyer(), "capture-unrecorded", &[seats[1]]).await;
    let its_own = app.authorize_at_provider(unrecorded, 18_500, "its-own").await;
    let auth = authorized(&fact("HoldCreated", unrecorded).await, unrecorded, &its_own);
    crate::helpers::committed(&app.pool, &auth).await;
    assert_eq!(handle_once(&app.pool, &saga, &auth).await.unwrap(), Disposition::Applied);
    let confirmed = fact("OrderConfirmed", unrecorded).await;
    let real = confirmed.decode().unwrap();
    assert!(real.capture_request().is_some(), "confirmed: {real:?}");
    for stranger in [other.as_str(), "pi_nobody_made"] {
        for event in forge(&real, stranger, 18_500) {
            let prepared = prepare(confirmed.follow(&event), event.clone()).await;
            assert!(
                matches!(prepared, Prepared::Skipped("payment_intent_differs_from_order")),
                "{event:?}: {prepared:?}"
            );
        }
    }
    assert_eq!(handle_once(&app.pool, &worker, &confirmed).await.unwrap(), Disposition::Applied);
    assert_eq!(app.sim.captures_for(&its_own), 1, "the provider made it for this order");
    assert_eq!(app.sim.captures_for(&other), 0);
    app.stop().await;
}

/// An order held by a fresh buyer and, at the simulator, a PaymentIntent for its amount that
/// no payment row names yet (created without our metadata, with idempotency key
/// `{key}:{order}`): the setting of an early webhook. Only the API runs, with the
/// simulator's own webhooks off, so the test plays the payment worker and Stripe's webhooks
/// by hand.
struct UnrecordedIntent {
    app: TestApp,
    order: Uuid,
    hold_created: Envelope,
    intent: boxoffice_payments::PaymentIntent,
    amount_minor: i64,
}

async fn unrecorded_intent(opts: PgConnectOptions, key: &str) -> UnrecordedIntent {
    use boxoffice_payments::PaymentGateway;
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    app.sim.set_webhook_url(None);
    let seat = app.seats().await[0];
    let b = app.buyer();
    let r = app.hold(&b, &app.admission_token(&b), key, &[seat]).await;
    let order: Uuid =
        r.json::<serde_json::Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap();
    let hold_created: serde_json::Value =
        sqlx::query_scalar("SELECT payload FROM outbox WHERE event_type = 'HoldCreated'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    let hold_created: Envelope = serde_json::from_value(hold_created).unwrap();
    let PurchaseEvent::HoldCreated { amount_minor, currency, .. } = hold_created.decode().unwrap() else {
        panic!("not a HoldCreated")
    };
    let intent = app
        .stripe()
        .create_payment_intent(
            &boxoffice_payments::CreatePaymentIntent { amount_minor, currency, metadata: vec![] },
            &format!("{key}:{order}"),
        )
        .await
        .unwrap();
    UnrecordedIntent { app, order, hold_created, intent, amount_minor }
}

impl UnrecordedIntent {
    /// The buyer pays: the simulator authorizes the PaymentIntent.
    async fn authorize(&self) {
        self.app
            .stripe()
            .confirm_with_client_secret(
                &self.app.cfg.stripe_publishable_key,
                &self.intent.id,
                self.intent.client_secret.as_deref().unwrap(),
                "pm_card_visa",
            )
            .await
            .unwrap();
    }

    /// The payment worker's commit of the payment row, as after a slow authorize call: the
    /// hold's `HoldCreated` (its authorization request) applied with the PaymentIntent
    /// created, and what it emits written to the outbox in its transaction, as the consumer
    /// runner does.
    async fn record_payment_row(&self, worker: &boxoffice_workers::payment::PaymentWorker) {
        let event = self.hold_created.decode().unwrap();
        let mut tx = self.app.pool.begin().await.unwrap();
        let follows = worker
            .apply(
                &mut tx,
                &self.hold_created,
                &event,
                boxoffice_workers::payment::Prepared::Intent(self.intent.clone()),
                Default::default(),
            )
            .await
            .unwrap();
        boxoffice_store::outbox::insert_all(&mut tx, &follows).await.unwrap();
        tx.commit().await.unwrap();
    }

    /// The order's one `PaymentIntentRefreshRequested` in the outbox.
    async fn the_refresh(&self) -> Envelope {
        let refresh: serde_json::Value = sqlx::query_scalar(
            "SELECT payload FROM outbox WHERE event_type = 'PaymentIntentRefreshRequested' AND message_key = $1",
        )
        .bind(self.order.to_string())
        .fetch_one(&self.app.pool)
        .await
        .unwrap();
        serde_json::from_value(refresh).unwrap()
    }

    /// The payment worker of this test's API, on its pool.
    fn worker(&self) -> boxoffice_workers::payment::PaymentWorker {
        boxoffice_workers::payment::PaymentWorker::new(
            Arc::new(self.app.stripe()),
            self.app.pool.clone(),
            self.app.cfg.hold_policy(),
        )
    }
}

/// A webhook for a PaymentIntent the ledger does not know yet, naming no order, is kept as
/// pending; when the payment worker commits the payment row, the fact is re-derived from
/// Stripe (a refresh), so the early webhook is not lost.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn early_webhook_is_kept_and_rederived_from_stripe(_: PgPoolOptions, opts: PgConnectOptions) {
    // The simulator's own webhooks are off, so the one early webhook below is the only report
    // of this authorization (a real one arriving after the payment row would be applied
    // directly).
    let early = unrecorded_intent(opts, "early").await;
    let UnrecordedIntent { app, order, intent: created, amount_minor, .. } = &early;
    let order = *order;

    // Stripe authorizes the PaymentIntent and its webhook arrives before any payment row
    // names it.
    let webhook = pi_event(
        "evt_early",
        "payment_intent.amount_capturable_updated",
        &created.id,
        "requires_capture",
        *amount_minor,
        None,
    );
    let ack = deliver(app, &webhook).await;
    assert_eq!(ack["duplicate"], false);
    let pending: bool =
        sqlx::query_scalar("SELECT pending FROM stripe_events WHERE stripe_event_id = 'evt_early'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(pending, "kept, not dropped");
    early.authorize().await;

    // The payment worker's commit of the payment row resolves it.
    let worker = early.worker();
    early.record_payment_row(&worker).await;
    let (pending, owner): (bool, Option<Uuid>) =
        sqlx::query_as("SELECT pending, order_id FROM stripe_events WHERE stripe_event_id = 'evt_early'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(!pending);
    assert_eq!(owner, Some(order));
    let refresh = early.the_refresh().await;
    assert_eq!(handle_once(&app.pool, &worker, &refresh).await.unwrap(), Disposition::Applied);
    assert_eq!(
        app.outbox_count("PaymentAuthorized", order).await,
        1,
        "the authorization the early webhook reported, re-derived from Stripe"
    );
    // It carries the charge's own capture deadline (the simulator's card window: 7 days), so
    // the saga stores Stripe's date rather than assuming one.
    let authorized: serde_json::Value = sqlx::query_scalar(
        "SELECT payload FROM outbox WHERE event_type = 'PaymentAuthorized' AND message_key = $1",
    )
    .bind(order.to_string())
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let authorized: Envelope = serde_json::from_value(authorized).unwrap();
    let PurchaseEvent::PaymentAuthorized { capture_before: Some(deadline), .. } =
        authorized.decode().unwrap()
    else {
        panic!("PaymentAuthorized without the charge's capture_before")
    };
    let days = (deadline - chrono::Utc::now()).num_hours() as f64 / 24.0;
    assert!((6.9..=7.01).contains(&days), "capture_before {deadline} is {days} days out");
    early.app.stop().await;
}

/// The race an early webhook can lose: its transaction read no payment row, and committed its
/// pending event after the payment row's statement had taken its snapshot, so that statement
/// did not resolve it. Both rows are then committed and the event stays pending; the expiry
/// worker's sweep finds it, resolves it once and asks for the re-fetch, so the authorization
/// it reported reaches the saga without waiting for the hold's provider check. Meanwhile the
/// audit counts it once it is older than its grace; one older than the sweep's window is
/// counted by the audit until `reconcile --fix` resolves it.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn an_early_webhook_that_commits_after_the_payment_row_misses_it_is_swept(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use boxoffice_store::{audit, payments, stripe_events};
    let early = unrecorded_intent(opts, "stranded").await;
    let UnrecordedIntent { app, order, intent: created, .. } = &early;
    let order = *order;
    early.authorize().await;

    // The webhook's transaction, as ingress runs it for an event that names no order: it
    // finds no payment row, records the event and marks it pending, and does not commit yet.
    let mut webhook = app.pool.begin().await.unwrap();
    assert_eq!(payments::order_for_intent(&mut *webhook, &created.id).await.unwrap(), None);
    assert!(stripe_events::record(
        &mut webhook,
        "evt_stranded",
        "payment_intent.amount_capturable_updated",
        Some(&created.id),
        None
    )
    .await
    .unwrap());
    stripe_events::mark_pending(&mut webhook, "evt_stranded").await.unwrap();
    // The payment worker records the payment row and commits; its resolve cannot see the
    // webhook's uncommitted row.
    let worker = early.worker();
    early.record_payment_row(&worker).await;
    webhook.commit().await.unwrap();
    let pending = || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT pending FROM stripe_events WHERE stripe_event_id = 'evt_stranded'",
        )
        .fetch_one(&app.pool)
        .await
        .unwrap()
    };
    assert!(pending().await, "the race: the payment row's statement did not resolve the event");
    assert_eq!(refreshes(app, order, "early_webhook").await, 0);

    // The audit counts it once it is older than its grace, not before.
    let stranded = || async { audit::violations(&app.pool, 600_000, None).await.unwrap().stranded_webhooks };
    assert_eq!(stranded().await, 0, "within the grace");
    sqlx::query("UPDATE stripe_events SET received_at = received_at - make_interval(secs => $1)")
        .bind((audit::STRANDED_GRACE_MS / 1000 + 1) as f64)
        .execute(&app.pool)
        .await
        .unwrap();
    assert_eq!(stranded().await, 1);

    // The expiry worker's sweep resolves it for the order and asks for the re-fetch, once.
    let stop = tokio_util::sync::CancellationToken::new();
    let expiry = tokio::spawn(boxoffice_workers::expiry::run(
        app.pool.clone(),
        boxoffice_workers::expiry::ExpirySettings::default(),
        stop.clone(),
    ));
    eventually(Duration::from_secs(30), "the sweep resolves the stranded event", || async {
        !pending().await
    })
    .await;
    stop.cancel();
    expiry.await.unwrap();
    let owner: Option<Uuid> =
        sqlx::query_scalar("SELECT order_id FROM stripe_events WHERE stripe_event_id = 'evt_stranded'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(owner, Some(order));
    assert_eq!(refreshes(app, order, "early_webhook").await, 1);
    let window = Some(stripe_events::STRANDED_WINDOW_S);
    assert_eq!(stripe_events::resolve_stranded(&app.pool, 100, window).await.unwrap(), 0, "resolved once");
    assert_eq!(stranded().await, 0);

    // The re-fetch finds the authorization the webhook reported.
    let refresh = early.the_refresh().await;
    assert_eq!(handle_once(&app.pool, &worker, &refresh).await.unwrap(), Disposition::Applied);
    assert_eq!(app.outbox_count("PaymentAuthorized", order).await, 1);

    // One a month old, far outside the sweep's window, is left to the audit, which has no age
    // bound.
    sqlx::query(
        "INSERT INTO stripe_events (stripe_event_id, type, payment_intent_id, pending, received_at)
         VALUES ('evt_old', 'payment_intent.amount_capturable_updated', $1, true,
                 now() - make_interval(secs => $2))",
    )
    .bind(&created.id)
    .bind(30.0 * 86_400.0)
    .execute(&app.pool)
    .await
    .unwrap();
    assert_eq!(stripe_events::resolve_stranded(&app.pool, 100, window).await.unwrap(), 0);
    assert_eq!(stranded().await, 1);
    // `reconcile --fix` resolves it, whatever its age.
    let since = boxoffice::reconcile::Window::parse("1h", None, chrono::Utc::now()).unwrap();
    let fixed = boxoffice::reconcile::run(&app.pool, &app.stripe(), since, true).await.unwrap();
    assert_eq!(fixed.stranded_webhooks_refetched, 1, "{}", boxoffice::reconcile::render(&fixed));
    assert_eq!(stranded().await, 0);
    assert_eq!(refreshes(app, order, "early_webhook").await, 2);
    early.app.stop().await;
}

/// A signed claim for each handled event type about an order whose PaymentIntent the provider
/// still reports as `requires_payment_method` (case C16).
fn forged_claims(order: Uuid, pi: &str, round: &str) -> Vec<serde_json::Value> {
    let mut claims: Vec<serde_json::Value> = [
        ("payment_intent.amount_capturable_updated", "requires_capture", 18_500),
        ("payment_intent.succeeded", "succeeded", 0),
        ("payment_intent.payment_failed", "requires_payment_method", 0),
        ("payment_intent.canceled", "canceled", 0),
    ]
    .into_iter()
    .map(|(kind, status, capturable)| {
        let mut e = pi_event(
            &format!("evt_forged_{round}_{}", kind.replace('.', "_")),
            kind,
            pi,
            status,
            capturable,
            Some(order),
        );
        if kind == "payment_intent.succeeded" {
            e["data"]["object"]["amount_received"] = 18_500.into();
        }
        if kind == "payment_intent.payment_failed" {
            e["data"]["object"]["last_payment_error"] =
                serde_json::json!({"code": "card_declined", "decline_code": "stolen_card"});
        }
        e
    })
    .collect();
    claims.push(serde_json::json!({
        "id": format!("evt_forged_{round}_refund"), "object": "event", "type": "charge.refunded",
        "created": chrono::Utc::now().timestamp(), "livemode": false, "api_version": "2024-06-20",
        "data": {"object": {"id": "ch_forged", "object": "charge", "payment_intent": pi, "amount": 18_500,
                 "amount_captured": 18_500, "amount_refunded": 18_500, "refunded": true, "currency": "usd",
                 "metadata": {"order_id": order.to_string()}}}
    }));
    claims
}

/// C16: forged-but-signed claims of every handled type, for an unpaid order and then for a
/// ticketed one, change nothing — not the order, not its hold, not its payment row — until the
/// provider confirms; each is answered 2xx once its re-fetch is durable (its own, or the
/// pending one of its PaymentIntent that covers it), and the provider's answer is what the
/// saga acts on.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c16_forged_signed_claims_change_nothing_until_the_provider_confirms(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = TestApp::spawn(opts, &Role::ALL, VenueSpec::small(1, 1, 4)).await;
    let seat = app.seats().await[0];
    let b = app.buyer();
    let r = app.hold(&b, &app.admission_token(&b), "c16", &[seat]).await;
    let order: Uuid =
        r.json::<serde_json::Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap();
    let before = app
        .await_order(&b, order, WAIT, |v| {
            v["status"] == "payment_required" && v.get("client_secret").is_some()
        })
        .await;
    let pi = before["payment_intent_id"].as_str().unwrap().to_owned();
    let ledger = |pool: sqlx::PgPool| async move {
        sqlx::query_as::<_, (String, String, chrono::DateTime<chrono::Utc>, String, i64, i64)>(
            "SELECT o.status, h.status, h.expires_at, p.status, p.amount_captured_minor, p.amount_refunded_minor
               FROM orders o JOIN holds h ON h.order_id = o.id JOIN payments p ON p.order_id = o.id WHERE o.id = $1",
        )
        .bind(order)
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let unpaid = ledger(app.pool.clone()).await;
    assert_eq!(
        (unpaid.0.as_str(), unpaid.1.as_str(), unpaid.3.as_str()),
        ("payment_required", "active", "requires_payment_method")
    );

    let claims = forged_claims(order, &pi, "unpaid");
    for claim in &claims {
        deliver(&app, claim).await;
    }
    let pool = app.pool.clone();
    let n = claims.len() as i64;
    let all_checked = || {
        let (pool, pi) = (pool.clone(), pi.clone());
        async move { claims_checked(&pool, order, &pi).await }
    };
    eventually(WAIT, "every claim was checked with the provider", all_checked).await;
    let asked = app.outbox_count("PaymentIntentRefreshRequested", order).await;
    assert!((1..=n).contains(&asked), "claims share pending re-fetches: {asked} for {n} claims");
    assert_eq!(
        ledger(app.pool.clone()).await,
        unpaid,
        "nothing moved on a claim the provider does not confirm"
    );
    for fact in [
        "PaymentAuthorized",
        "PaymentCaptured",
        "PaymentFailed",
        "PaymentCanceled",
        "PaymentRefunded",
        "HoldExpired",
    ] {
        assert_eq!(app.outbox_count(fact, order).await, 0, "{fact}");
    }
    let (_, view) = app.order(&b, order).await;
    assert_eq!(
        (view["status"].as_str(), view["client_secret"].is_string()),
        (Some("payment_required"), true)
    );

    // The buyer pays for real: the provider's answer is acted on.
    app.pay(&b, order, "pm_card_visa").await.expect("authorized");
    app.await_order(&b, order, WAIT, |v| v["status"] == "ticketed").await;
    app.assert_drained_and_clean().await;
    let ticketed = ledger(app.pool.clone()).await;
    let asked_before = app.outbox_count("PaymentIntentRefreshRequested", order).await;

    // The same lies about the ticketed order: no refund, no cancel, no voided ticket. The
    // ledger already knows the authorization and the capture; the decline and the cancel
    // contradict it and the refund is news: three claims to check, one to three re-fetches.
    let claims = forged_claims(order, &pi, "ticketed");
    for claim in &claims {
        deliver(&app, claim).await;
    }
    eventually(WAIT, "every claim about the ticketed order was checked", all_checked).await;
    let asked = app.outbox_count("PaymentIntentRefreshRequested", order).await - asked_before;
    assert!((1..=3).contains(&asked), "{asked} re-fetches for three claims");
    app.assert_drained_and_clean().await;
    assert_eq!(ledger(app.pool.clone()).await, ticketed);
    assert_eq!(app.count("SELECT count(*) FROM tickets WHERE voided_at IS NULL").await, 1);
    for fact in ["PaymentCanceled", "PaymentRefunded", "RefundRequested", "TicketsVoided"] {
        assert_eq!(app.outbox_count(fact, order).await, 0, "{fact}");
    }
    app.stop().await;
}
