//! Stripe calls under faults and the compensations of the saga: a provider that applies a
//! call and then fails or never answers (the retry with the same idempotency key sees the
//! applied result: one capture), a capture that arrives after the order was released (case
//! C05: incident, refund with a stable key, visible status), and a capture command for a hold
//! that is not confirmed (case C06: nothing is sent).

use crate::helpers::{eventually, TestApp};
use boxoffice::runtime::Role;
use boxoffice_bus::consumer::handle_once;
use boxoffice_domain::{Envelope, OrderId, PurchaseEvent};
use boxoffice_store::venue::VenueSpec;
use boxoffice_stripe_sim::Faults;
use boxoffice_workers::saga::Saga;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::time::Duration;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(90);

async fn order_of(resp: reqwest::Response) -> Uuid {
    assert_eq!(resp.status(), 202);
    resp.json::<serde_json::Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap()
}

/// A payment worker calling the app's simulator.
fn payment_worker(app: &TestApp) -> boxoffice_workers::payment::PaymentWorker {
    boxoffice_workers::payment::PaymentWorker::new(
        std::sync::Arc::new(app.stripe()),
        app.pool.clone(),
        app.cfg.hold_policy(),
    )
}

/// A PaymentIntent of 1,000 for `order`, authorized and captured straight at the provider
/// (keys derived from `key`).
async fn captured_at_provider(app: &TestApp, order: Uuid, key: &str) -> String {
    use boxoffice_payments::PaymentGateway;
    let pi = app.authorize_at_provider(order, 1_000, &format!("{key}:{order}")).await;
    app.stripe().capture_payment_intent(&pi, &format!("{key}:capture")).await.unwrap();
    pi
}

/// The saga's `RefundRequested` of all 1,000 captured on `pi` for `order`.
fn refund_command(order: Uuid, pi: &str) -> Envelope {
    let order_id = OrderId(order);
    Envelope::new(
        order_id,
        &PurchaseEvent::RefundRequested {
            order_id,
            payment_intent_id: pi.to_owned(),
            amount_minor: 1_000,
            reason: "capture_after_release".into(),
        },
        Uuid::new_v4(),
        None,
    )
}

/// What the provider says is refunded on `pi`'s charge, minor units.
async fn refunded_on_charge(app: &TestApp, pi: &str) -> i64 {
    use boxoffice_payments::PaymentGateway;
    let stripe = app.stripe();
    let intent = stripe.retrieve_payment_intent(pi).await.unwrap();
    stripe.retrieve_charge(intent.latest_charge.as_deref().unwrap()).await.unwrap().amount_refunded
}

/// Design §17 "capture retry uses one Stripe operation": every mutating Stripe call is applied
/// and then answered with a 500 (or not answered at all); the payment worker retries with
/// the same keys and the order still ends ticketed with exactly one capture.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn provider_failing_after_apply_still_captures_once(_: PgPoolOptions, opts: PgConnectOptions) {
    let app =
        TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 6), |c| c.stripe_timeout_ms = 1_000)
            .await;
    let s = app.seats().await;
    for (i, faults) in [
        // Webhooks are held back so that the worker's own retry, not the capture webhook,
        // is what learns the outcome.
        Faults { fail_after_apply_rate: 1.0, webhook_delay_ms: 3_000, ..Faults::default() },
        Faults { drop_response_rate: 1.0, webhook_delay_ms: 3_000, ..Faults::default() },
    ]
    .into_iter()
    .enumerate()
    {
        app.sim.set_faults(Faults::default());
        let b = app.buyer();
        let order = order_of(app.hold(&b, &app.admission_token(&b), &format!("k{i}"), &[s[i]]).await).await;
        app.await_order(&b, order, WAIT, |v| v.get("client_secret").is_some()).await;
        let replays_before = app.sim.stats().idempotent_replays;
        app.sim.set_faults(faults.clone());
        // The buyer's confirm is hit too: it is applied (the authorization webhook follows)
        // even though the browser sees an error or a timeout.
        let _ = tokio::time::timeout(Duration::from_secs(3), app.pay(&b, order, "pm_card_visa")).await;
        let view = app.await_order(&b, order, WAIT, |v| v["status"] == "ticketed").await;
        let pi = view["payment_intent_id"].as_str().unwrap();
        assert_eq!(app.sim.captures_for(pi), 1, "one capture under {faults:?}");
        // The worker's retry used the same key and was answered from Stripe's idempotency
        // store rather than captured again.
        let sim = app.sim.clone();
        eventually(WAIT, "the payment worker retried its capture with the same key", || {
            let sim = sim.clone();
            async move { sim.stats().idempotent_replays > replays_before }
        })
        .await;
        assert_eq!(app.sim.captures_for(pi), 1);
    }
    app.sim.set_faults(Faults::default());
    assert_eq!(app.count("SELECT count(*) FROM payments").await, 2);
    app.stop().await;
}

/// C06: a capture command for an order whose hold is not confirmed sends nothing to Stripe.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c06_no_capture_without_a_confirmed_hold(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(
        opts,
        &[Role::Api, Role::Relay, Role::Saga, Role::Payments],
        VenueSpec::small(1, 1, 4),
    )
    .await;
    let s = app.seats().await;
    let b = app.buyer();
    let order = order_of(app.hold(&b, &app.admission_token(&b), "c06", &[s[0]]).await).await;
    let view = app.await_order(&b, order, WAIT, |v| v.get("payment_intent_id").is_some()).await;
    let pi = view["payment_intent_id"].as_str().unwrap().to_owned();
    // The buyer authorizes at the provider, but no webhook reaches us, so the hold stays
    // merely active; then a (stray or replayed) capture command arrives.
    app.sim.set_webhook_url(None);
    app.pay(&b, order, "pm_card_visa").await.expect("authorized");
    let cmd = Envelope::new(
        OrderId(order),
        &PurchaseEvent::CaptureRequested {
            order_id: OrderId(order),
            payment_intent_id: pi.clone(),
            amount_minor: 18_500,
        },
        Uuid::new_v4(),
        None,
    );
    let mut tx = app.pool.begin().await.unwrap();
    boxoffice_store::outbox::insert(&mut tx, boxoffice_domain::Topic::Purchase, &cmd).await.unwrap();
    tx.commit().await.unwrap();
    let pool = app.pool.clone();
    eventually(WAIT, "the payment worker consumed the command", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM inbox WHERE consumer = 'payments' AND event_id = $1)",
            )
            .bind(cmd.event_id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    })
    .await;
    assert_eq!(app.sim.captures_for(&pi), 0, "no capture without a confirmed hold");
    assert_eq!(app.sim.payment_intent(&pi).unwrap()["status"], "requires_capture");
    app.stop().await;
}

/// C05: the money is captured after the order was released locally. The saga records an
/// incident, moves the order to refunding and asks for a refund with `refund:{payment_intent_id}`;
/// the refund fact ends it refunded; repeats of the late capture change nothing more.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c05_capture_after_release_is_refunded(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let s = app.seats().await;
    let b = app.buyer();
    let order = order_of(app.hold(&b, &app.admission_token(&b), "c05", &[s[0]]).await).await;
    let oid = OrderId(order);
    let pi = "pi_late_capture";
    boxoffice_store::payments::insert_created(
        &app.pool,
        oid,
        pi,
        None,
        "requires_payment_method",
        18_500,
        "usd",
    )
    .await
    .unwrap();
    sqlx::query("UPDATE holds SET expires_at = now() - interval '1 second', payable_by = NULL, provider_check_until = NULL")
        .execute(&app.pool)
        .await
        .unwrap();
    boxoffice_store::holds::expire_due(&app.pool, 10).await.unwrap();

    // The late capture is first claimed by a signed webhook: acknowledged 2xx, never a 4xx,
    // and not believed — it only asks the provider (case C16).
    let body = serde_json::to_vec(&serde_json::json!({
        "id": "evt_late_capture", "object": "event", "type": "payment_intent.succeeded",
        "created": chrono::Utc::now().timestamp(), "livemode": false, "api_version": "2024-06-20",
        "data": {"object": {"id": pi, "object": "payment_intent", "status": "succeeded", "amount": 18500,
                 "amount_capturable": 0, "amount_received": 18500, "currency": "usd",
                 "metadata": {"order_id": order.to_string()}}}
    }))
    .unwrap();
    assert_eq!(app.deliver_webhook(body).await, 200);
    assert_eq!(app.outbox_count("PaymentIntentRefreshRequested", order).await, 1);
    assert_eq!(app.outbox_count("PaymentCaptured", order).await, 0, "a claim is not a fact");
    // The provider confirms the capture (what the re-fetch reports).
    let fact = Envelope::new(
        oid,
        &PurchaseEvent::PaymentCaptured {
            order_id: oid,
            payment_intent_id: pi.into(),
            amount_captured_minor: 18_500,
        },
        Uuid::new_v4(),
        None,
    );
    crate::helpers::committed(&app.pool, &fact).await;
    handle_once(&app.pool, &Saga::default(), &fact).await.unwrap();
    // The same fact again (e.g. from the capture response path) does nothing more.
    let mut again = fact.clone();
    again.event_id = Uuid::new_v4();
    crate::helpers::committed(&app.pool, &again).await;
    handle_once(&app.pool, &Saga::default(), &again).await.unwrap();

    let (_, view) = app.order(&b, order).await;
    assert_eq!(view["status"], "refunding");
    assert_eq!(app.outbox_count("RefundRequested", order).await, 1);
    assert_eq!(app.count("SELECT count(*) FROM incidents WHERE kind = 'capture_after_release'").await, 1);
    let refunded = Envelope::new(
        oid,
        &PurchaseEvent::PaymentRefunded {
            order_id: oid,
            payment_intent_id: pi.into(),
            amount_refunded_minor: 18_500,
        },
        Uuid::new_v4(),
        None,
    );
    crate::helpers::committed(&app.pool, &refunded).await;
    handle_once(&app.pool, &Saga::default(), &refunded).await.unwrap();
    let (_, view) = app.order(&b, order).await;
    assert_eq!(view["status"], "refunded");
    let v = boxoffice_store::audit::violations(&app.pool, 600_000, None).await.unwrap();
    assert_eq!((v.oversold, v.captured_without_ticket_or_refund, v.tickets_without_capture), (0, 0, 0));
    app.stop().await;
}

/// Invariant 6 with two PaymentIntents of one order: an authorization cancelled for the order
/// and then another one (a stale intent authorized for the same order) must both be
/// cancelled at the provider: each cancel is its own operation under its own idempotency
/// key, so the second is not refused as a reuse of the first's key with other parameters.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn two_authorizations_of_one_order_are_both_cancelled(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let seats = app.seats().await;
    let b = app.buyer();
    let order = order_of(app.hold(&b, &app.admission_token(&b), "two-pi", &seats[..1]).await).await;
    let mut intents = Vec::new();
    for i in 0..2 {
        intents.push(app.authorize_at_provider(order, 1_000, &format!("two-pi:{i}:{order}")).await);
    }
    let worker = payment_worker(&app);
    let hold_created = Envelope::new(
        OrderId(order),
        &PurchaseEvent::OrderConfirmed {
            order_id: OrderId(order),
            hold_id: boxoffice_domain::HoldId(Uuid::new_v4()),
            capture: None,
        },
        Uuid::new_v4(),
        None,
    );
    for pi in &intents {
        let cmd = hold_created.follow(&PurchaseEvent::AuthorizationCancelRequested {
            order_id: OrderId(order),
            payment_intent_id: pi.clone(),
            reason: "stale_authorization".into(),
        });
        crate::helpers::committed(&app.pool, &cmd).await;
        handle_once(&app.pool, &worker, &cmd).await.unwrap();
    }
    for pi in &intents {
        let status = app.sim.payment_intent(pi).unwrap()["status"].clone();
        assert_eq!(status, "canceled", "{pi}: the buyer's funds released");
    }
    app.stop().await;
}

/// Invariant 6 when the provider refunded first: a refund the saga asks for (here of a late
/// capture) of a charge an operator already refunded in full from the dashboard is recorded
/// as done — `PaymentRefunded`, no second refund, not a dead letter — and after a partial
/// refund there, the refund returns the rest and the fact reports the charge's whole refunded
/// amount (what a re-fetch would report), not only this refund's.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_refund_the_provider_already_made_is_recorded_once(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let seats = app.seats().await;
    let worker = payment_worker(&app);
    // (refunded at the provider first, what the fact must report, refunds made in all)
    let cases = [(None, 1_000, 1), (Some(400), 1_000, 2)];
    for (i, (at_provider, reported, refunds)) in cases.into_iter().enumerate() {
        let b = app.buyer();
        let key = format!("refunded-first-{i}");
        let order = order_of(app.hold(&b, &app.admission_token(&b), &key, &seats[i..=i]).await).await;
        let oid = OrderId(order);
        let pi = captured_at_provider(&app, order, &key).await;
        boxoffice_store::payments::insert_created(&app.pool, oid, &pi, None, "succeeded", 1_000, "usd")
            .await
            .unwrap();
        let before = app.sim.stats().refunds;
        app.refund_at_provider(&pi, at_provider).await;

        let cmd = refund_command(order, &pi);
        crate::helpers::committed(&app.pool, &cmd).await;
        handle_once(&app.pool, &worker, &cmd).await.expect("recorded, not dead-lettered");
        let amounts: Vec<i64> = sqlx::query_scalar(
            "SELECT (payload->'payload'->>'amount_refunded_minor')::bigint FROM outbox
              WHERE event_type = 'PaymentRefunded' AND message_key = $1",
        )
        .bind(order.to_string())
        .fetch_all(&app.pool)
        .await
        .unwrap();
        assert_eq!(amounts, vec![reported], "case {i}: one fact with the charge's whole refunded amount");
        assert_eq!(refunded_on_charge(&app, &pi).await, 1_000, "case {i}: refunded in full, never more");
        assert_eq!(
            app.sim.stats().refunds - before,
            refunds,
            "case {i}: refunds made, the operator's included"
        );
        // The same command again is a duplicate: no call, no second fact.
        handle_once(&app.pool, &worker, &cmd).await.unwrap();
        assert_eq!(app.outbox_count("PaymentRefunded", order).await, 1, "case {i}");
    }
    app.stop().await;
}

/// Invariant 6 with two captured PaymentIntents of one order (its own, and a stray
/// authorization captured from the dashboard): each refund is its own operation under its own
/// idempotency key, so the second is not refused as a reuse of the first's key with other
/// parameters, and both charges end refunded in full.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn two_captures_of_one_order_are_both_refunded(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let seats = app.seats().await;
    let b = app.buyer();
    let order = order_of(app.hold(&b, &app.admission_token(&b), "two-captures", &seats[..1]).await).await;
    let oid = OrderId(order);
    let mut intents = Vec::new();
    for i in 0..2 {
        intents.push(captured_at_provider(&app, order, &format!("two-captures:{i}")).await);
    }
    boxoffice_store::payments::insert_created(&app.pool, oid, &intents[0], None, "succeeded", 1_000, "usd")
        .await
        .unwrap();
    let worker = payment_worker(&app);
    for pi in &intents {
        let cmd = refund_command(order, pi);
        crate::helpers::committed(&app.pool, &cmd).await;
        handle_once(&app.pool, &worker, &cmd).await.expect("refunded");
    }
    for pi in &intents {
        assert_eq!(refunded_on_charge(&app, pi).await, 1_000, "{pi}: the buyer's money returned");
    }
    assert_eq!(app.sim.stats().refunds, 2);
    app.stop().await;
}

/// A claim about another order's money is refuted even when the provider's metadata agrees
/// with it: buyer B's captured PaymentIntent, its metadata naming order A (as anyone with
/// access to the provider account could edit it), re-fetched for A is refuted with an
/// incident, and nothing is refunded or emitted for A; B's payment is untouched.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn an_intent_the_ledger_records_for_another_order_is_refuted(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let seats = app.seats().await;
    let mut orders = Vec::new();
    for (i, key) in ["a", "b"].into_iter().enumerate() {
        let b = app.buyer();
        orders.push(order_of(app.hold(&b, &app.admission_token(&b), key, &seats[i..=i]).await).await);
    }
    let (a, b) = (orders[0], orders[1]);
    // B's payment, whose metadata names A.
    let pi = captured_at_provider(&app, a, "relabelled").await;
    boxoffice_store::payments::insert_created(&app.pool, OrderId(b), &pi, None, "succeeded", 1_000, "usd")
        .await
        .unwrap();
    let refresh = Envelope::new(
        OrderId(a),
        &PurchaseEvent::PaymentIntentRefreshRequested {
            order_id: OrderId(a),
            payment_intent_id: pi.clone(),
            reason: "webhook_claim".into(),
        },
        Uuid::new_v4(),
        None,
    );
    crate::helpers::committed(&app.pool, &refresh).await;
    handle_once(&app.pool, &payment_worker(&app), &refresh).await.unwrap();
    assert_eq!(
        app.count(
            "SELECT count(*) FROM incidents WHERE kind = 'webhook_claim_refuted'
                AND detail->>'reason' = 'payment_intent_of_another_order'"
        )
        .await,
        1
    );
    for fact in ["PaymentAuthorized", "PaymentCaptured", "PaymentCanceled", "PaymentRefunded"] {
        assert_eq!(app.outbox_count(fact, a).await, 0, "nothing reported for A: {fact}");
    }
    assert_eq!(refunded_on_charge(&app, &pi).await, 0, "B's payment untouched");
    app.stop().await;
}
