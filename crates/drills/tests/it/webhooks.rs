//! Stripe webhook ingress (case C08): signature first, dedupe on Stripe's event id, the outbox
//! continuation (a re-fetch of the claimed PaymentIntent) in the same transaction, 2xx only
//! after commit.

use crate::helpers::{barrier, problem, TestApp};
use boxoffice::runtime::Role;
use boxoffice_store::venue::VenueSpec;
use secrecy::ExposeSecret;
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::time::Duration;
use uuid::Uuid;

fn event_body(evt: &str, order: Uuid, pi: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "id": evt, "object": "event", "type": "payment_intent.amount_capturable_updated",
        "created": chrono::Utc::now().timestamp(), "livemode": false, "api_version": "2024-06-20",
        "pending_webhooks": 1, "request": null,
        "data": {"object": {"id": pi, "object": "payment_intent", "status": "requires_capture", "amount": 18500,
                 "amount_capturable": 18500, "amount_received": 0, "currency": "usd", "capture_method": "manual",
                 "metadata": {"order_id": order.to_string()}}}
    }))
    .unwrap()
}

/// C08: the same event id ten times (concurrent and after completion) → one stripe_events
/// row, one outbox continuation, 2xx every time; a bad signature → 400 and nothing written.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c08_duplicate_webhooks_have_one_effect(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let seat = app.seats().await[0];
    let b = app.buyer();
    let pi = "pi_webhook_test";
    let order = held_with_payment_intent(&app, &b, seat, pi).await;
    let secret = app.cfg.stripe_webhook_secret.expose_secret().to_owned();
    let body = event_body("evt_dup_1", order, pi);
    let url = format!("{}/webhooks/stripe", app.api);
    let send = |body: Vec<u8>, sig: String| {
        app.http
            .post(&url)
            .header("Stripe-Signature", sig)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };

    // A forged signature and a missing one write nothing.
    let forged = boxoffice_payments::webhook::sign(&body, "whsec_not_ours", chrono::Utc::now().timestamp());
    let (status, code, _) = problem(send(body.clone(), forged).await.unwrap()).await;
    assert_eq!((status, code.as_str()), (400, "invalid_signature"));
    // Signed with our secret, but not a Stripe event: malformed, not a bad signature.
    let junk = b"{\"not\": \"an event\"}".to_vec();
    let sig = boxoffice_payments::webhook::sign(&junk, &secret, chrono::Utc::now().timestamp());
    let (status, code, _) = problem(send(junk, sig).await.unwrap()).await;
    assert_eq!((status, code.as_str()), (400, "malformed_event"));
    assert_eq!(problem(app.http.post(&url).body(body.clone()).send().await.unwrap()).await.0, 400);
    let mut tampered = body.clone();
    let pos = tampered.iter().position(|c| *c == b'8').unwrap();
    tampered[pos] = b'9';
    let sig = boxoffice_payments::webhook::sign(&body, &secret, chrono::Utc::now().timestamp());
    assert_eq!(problem(send(tampered, sig).await.unwrap()).await.0, 400);
    assert_eq!(app.count("SELECT count(*) FROM stripe_events").await, 0);

    // Six concurrent deliveries, then four after the first ones finished.
    let gate = barrier(6);
    let mut tasks = vec![];
    for _ in 0..6 {
        let (gate, http, url, body) = (gate.clone(), app.http.clone(), url.clone(), body.clone());
        let sig = boxoffice_payments::webhook::sign(&body, &secret, chrono::Utc::now().timestamp());
        tasks.push(tokio::spawn(async move {
            gate.wait().await;
            http.post(url).header("Stripe-Signature", sig).body(body).send().await.unwrap().status().as_u16()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    for _ in 0..4 {
        let sig = boxoffice_payments::webhook::sign(&body, &secret, chrono::Utc::now().timestamp());
        assert_eq!(send(body.clone(), sig).await.unwrap().status(), 200);
    }
    assert_eq!(app.count("SELECT count(*) FROM stripe_events WHERE stripe_event_id = 'evt_dup_1'").await, 1);
    assert_eq!(app.outbox_count("PaymentIntentRefreshRequested", order).await, 1);
    assert_eq!(app.outbox_count("PaymentAuthorized", order).await, 0, "a claim is checked, not believed");
    // Nothing changes for the owner until the provider confirms (case C16).
    let (_, view) = app.order(&b, order).await;
    assert_eq!(view["status"], "held");
    assert!(view.get("client_secret").is_some());
    app.stop().await;
}

/// Events of another integration's PaymentIntents on the same Stripe account (no payment row,
/// no order in their metadata) are recorded pending and acknowledged, deduplicated while
/// Stripe may still redeliver them, and deleted by the expiry worker once older than
/// `webhook_event_retention_s`; a younger one, and an old one whose PaymentIntent boxoffice
/// records for an order, are kept.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn events_of_another_integration_are_deduplicated_then_pruned(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let mut app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let secret = app.cfg.stripe_webhook_secret.expose_secret().to_owned();
    let url = format!("{}/webhooks/stripe", app.api);
    let foreign = |evt: &str, pi: &str| {
        serde_json::to_vec(&json!({
            "id": evt, "object": "event", "type": "payment_intent.succeeded",
            "created": chrono::Utc::now().timestamp(), "livemode": false, "api_version": "2024-06-20",
            "pending_webhooks": 1, "request": null,
            "data": {"object": {"id": pi, "object": "payment_intent", "status": "succeeded", "amount": 900,
                     "amount_received": 900, "currency": "usd", "metadata": {"shop_order": "A-17"}}}
        }))
        .unwrap()
    };
    let deliver = |body: Vec<u8>| {
        let sig = boxoffice_payments::webhook::sign(&body, &secret, chrono::Utc::now().timestamp());
        app.http.post(&url).header("Stripe-Signature", sig).body(body).send()
    };
    for evt in ["evt_other_old", "evt_other_old", "evt_other_young"] {
        assert_eq!(deliver(foreign(evt, &format!("pi_{evt}"))).await.unwrap().status(), 200);
    }
    // One of ours that arrived without its order, before its payment row (then written).
    let seat = app.seats().await[0];
    let b = app.buyer();
    let r = app.hold(&b, &app.admission_token(&b), "k", &[seat]).await;
    let order: Uuid =
        r.json::<serde_json::Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(deliver(foreign("evt_ours_early", "pi_ours")).await.unwrap().status(), 200);
    let pending = "SELECT count(*) FROM stripe_events WHERE pending AND order_id IS NULL";
    assert_eq!(app.count(pending).await, 3, "one row per event id, each pending");
    sqlx::query(
        "INSERT INTO payments (order_id, payment_intent_id, status, amount_minor, currency)
         VALUES ($1, 'pi_ours', 'succeeded', 900, 'usd')",
    )
    .bind(order)
    .execute(&app.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE stripe_events SET received_at = now() - interval '8 days'
          WHERE stripe_event_id IN ('evt_other_old', 'evt_ours_early')",
    )
    .execute(&app.pool)
    .await
    .unwrap();

    app.start_roles(&[Role::Expiry]).await;
    crate::helpers::eventually(
        Duration::from_secs(30),
        "the expiry worker prunes the old foreign event",
        || async {
            app.count("SELECT count(*) FROM stripe_events WHERE stripe_event_id = 'evt_other_old'").await == 0
        },
    )
    .await;
    let left: Vec<String> = sqlx::query_scalar("SELECT stripe_event_id FROM stripe_events ORDER BY 1")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(left, ["evt_other_young", "evt_ours_early"]);
    app.stop().await;
}

/// A capture claimed while the saga's capture request is outstanding (order `confirming`,
/// payment `requires_capture`: usually the capture's own webhook ahead of the payment
/// worker's record of the answer) is kept as a capture claim, with no re-fetch command. The
/// expiry worker settles the claims past their grace: one whose capture the ledger has
/// recorded since asks no one; one whose capture it still does not record (the capture
/// command dead-lettered, say) asks the provider (a re-fetch with `capture_outstanding`); a
/// younger claim waits. A redelivery keeps no second claim, and the audit counts the claims
/// left past its own grace.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_capture_claimed_while_outstanding_is_settled_by_the_ledger_or_asked_of_the_provider(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let mut app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let seats = app.seats().await;
    let secret = app.cfg.stripe_webhook_secret.expose_secret().to_owned();
    let url = format!("{}/webhooks/stripe", app.api);
    let deliver = |body: Vec<u8>| {
        let sig = boxoffice_payments::webhook::sign(&body, &secret, chrono::Utc::now().timestamp());
        app.http.post(&url).header("Stripe-Signature", sig).body(body).send()
    };
    let mut orders = Vec::new();
    for (seat, pi) in seats.iter().zip(["pi_cap_recorded", "pi_cap_lost", "pi_cap_young"]) {
        let order = held_with_payment_intent(&app, &app.buyer(), *seat, pi).await;
        let amount: i64 = sqlx::query_scalar("SELECT amount_minor FROM orders WHERE id = $1")
            .bind(order)
            .fetch_one(&app.pool)
            .await
            .unwrap();
        for sql in [
            "UPDATE payments SET status = 'requires_capture', amount_minor = $2 WHERE order_id = $1",
            "UPDATE orders SET status = 'payment_required' WHERE id = $1 AND $2 > 0",
            "UPDATE orders SET status = 'confirming' WHERE id = $1 AND $2 > 0",
        ] {
            sqlx::query(sql).bind(order).bind(amount).execute(&app.pool).await.unwrap();
        }
        let body = serde_json::to_vec(&json!({
            "id": format!("evt_{pi}"), "object": "event", "type": "payment_intent.succeeded",
            "created": chrono::Utc::now().timestamp(), "livemode": false, "api_version": "2024-06-20",
            "pending_webhooks": 1, "request": null,
            "data": {"object": {"id": pi, "object": "payment_intent", "status": "succeeded", "amount": amount,
                     "amount_received": amount, "amount_capturable": 0, "currency": "usd",
                     "capture_method": "manual", "metadata": {"order_id": order.to_string()}}}
        }))
        .unwrap();
        // Delivered twice: the second is a duplicate.
        for _ in 0..2 {
            assert_eq!(deliver(body.clone()).await.unwrap().status(), 200);
        }
        orders.push((order, amount));
    }
    let claims = "SELECT count(*) FROM capture_claims";
    assert_eq!(app.count(claims).await, 3, "one claim per event");
    for (order, _) in &orders {
        assert_eq!(app.outbox_count("PaymentIntentRefreshRequested", *order).await, 0, "no re-fetch yet");
    }
    // The first one's capture is recorded meanwhile (the payment worker's answer); the first
    // two claims are past every grace.
    sqlx::query("UPDATE payments SET status = 'succeeded', amount_captured_minor = $2 WHERE order_id = $1")
        .bind(orders[0].0)
        .bind(orders[0].1)
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE capture_claims SET received_at = now() - interval '61 seconds' WHERE order_id <> $1")
        .bind(orders[2].0)
        .execute(&app.pool)
        .await
        .unwrap();
    let pool = app.pool.clone();
    let unsettled = || async {
        boxoffice_store::audit::violations(&pool, 600_000, None).await.unwrap().unsettled_capture_claims
    };
    assert_eq!(unsettled().await, 2);

    app.start_roles(&[Role::Expiry]).await;
    crate::helpers::eventually(
        Duration::from_secs(30),
        "the claims past their grace are settled",
        || async { app.count(claims).await == 1 },
    )
    .await;
    let left: Uuid =
        sqlx::query_scalar("SELECT order_id FROM capture_claims").fetch_one(&app.pool).await.unwrap();
    assert_eq!(left, orders[2].0, "the young claim waits");
    assert_eq!(unsettled().await, 0);
    let reasons = |order: Uuid| {
        sqlx::query_scalar::<_, String>(
            "SELECT payload->'payload'->>'reason' FROM outbox
              WHERE message_key = $1::text AND event_type = 'PaymentIntentRefreshRequested'",
        )
        .bind(order)
        .fetch_all(&app.pool)
    };
    assert_eq!(reasons(orders[0].0).await.unwrap(), Vec::<String>::new(), "recorded: nothing asked");
    assert_eq!(
        reasons(orders[1].0).await.unwrap(),
        ["capture_outstanding"],
        "unrecorded: the provider is asked"
    );
    assert_eq!(reasons(orders[2].0).await.unwrap(), Vec::<String>::new());
    app.stop().await;
}

/// `b`'s order for `seat`, held, and its PaymentIntent `pi` recorded as created.
async fn held_with_payment_intent(app: &TestApp, b: &crate::helpers::Buyer, seat: Uuid, pi: &str) -> Uuid {
    let r = app.hold(b, &app.admission_token(b), &format!("k-{pi}"), &[seat]).await;
    let order: Uuid =
        r.json::<serde_json::Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap();
    boxoffice_store::payments::insert_created(
        &app.pool,
        boxoffice_domain::OrderId(order),
        pi,
        Some("s"),
        "requires_payment_method",
        18500,
        "usd",
    )
    .await
    .unwrap();
    order
}

/// An authorization claim for `order`'s PaymentIntent `pi`, as the ingress gets it once its
/// signature verified.
fn claim(evt: &str, order: Uuid, pi: &str) -> boxoffice_payments::webhook::Event {
    serde_json::from_slice(&event_body(evt, order, pi)).unwrap()
}

/// Group commit of webhook ingress: events that wait while a transaction is in flight are
/// recorded together in the next one, one event per order; a redelivery among them is a
/// duplicate with no effect; and an event whose statement fails fails alone: its batch is
/// rolled back within the batch's lock timeout, the others are recorded together again, and
/// the failing one alone, with the usual timeouts. An event whose metadata names no order
/// shares a transaction with no other.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn webhook_events_that_wait_commit_together_and_a_failing_one_fails_alone(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use boxoffice_api::webhooks::{IngestError, Ingested, Ingress};
    let app = TestApp::spawn(opts.clone(), &[Role::Api], VenueSpec::small(1, 1, 8)).await;
    let seats = app.seats().await;
    let mut orders = Vec::new();
    for (i, seat) in seats.iter().take(6).enumerate() {
        orders.push(held_with_payment_intent(&app, &app.buyer(), *seat, &format!("pi_group_{i}")).await);
    }
    let evt = |i: usize| claim(&format!("evt_group_{i}"), orders[i], &format!("pi_group_{i}"));
    // One connection: one committer, whose statements give up after 1.5 s.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(opts.clone().options([("statement_timeout", "1500")]))
        .await
        .unwrap();
    let ingress = Ingress::start(pool.clone(), app.cfg.hold_policy(), 32, Duration::from_secs(30));

    // The holds of orders 0 and 3 are locked: an authorization claim protects its hold, so
    // their events' statements wait. Order 0's event is in flight, and meanwhile five more
    // arrive: orders 1 to 4, and order 1's again (a redelivery).
    let (blocker, first) = in_flight_behind_a_lock(&app, &ingress, &[orders[0], orders[3]], evt(0)).await;
    let batch = arrive_while_in_flight(&ingress, vec![evt(1), evt(1), evt(2), evt(3), evt(4)]).await;
    assert!(matches!(first.await.unwrap(), Err(IngestError::Db(_))), "order 0's statement timed out");
    // The batch of five met order 3's locked hold: rolled back, the other four recorded
    // together, then order 3's alone (it waits again, up to the statement timeout).
    let outcomes: Vec<_> = futures::future::join_all(batch).await.into_iter().map(|r| r.unwrap()).collect();
    let ok: Vec<_> = outcomes.iter().filter_map(|o| o.as_ref().ok().copied()).collect();
    assert_eq!(
        ok.iter().filter(|o| **o == Ingested::Refresh).count(),
        3,
        "orders 1, 2 and 4 recorded: {outcomes:?}"
    );
    assert_eq!(ok.iter().filter(|o| **o == Ingested::Duplicate).count(), 1, "{outcomes:?}");
    assert_eq!(outcomes.iter().filter(|o| matches!(o, Err(IngestError::Db(_)))).count(), 1, "{outcomes:?}");
    let xacts = |ids: Vec<String>| {
        let pool = app.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT xact::text FROM stripe_events WHERE stripe_event_id = ANY($1) ORDER BY stripe_event_id",
            )
            .bind(ids)
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    let ids = |is: &[usize]| is.iter().map(|i| format!("evt_group_{i}")).collect::<Vec<_>>();
    let split = xacts(ids(&[0, 1, 2, 3, 4])).await;
    assert_eq!(split.len(), 3, "orders 0 and 3 recorded nothing: {split:?}");
    assert_eq!(
        split.iter().collect::<std::collections::HashSet<_>>().len(),
        1,
        "the rest of the failed batch in one transaction: {split:?}"
    );
    for (i, order) in orders.iter().enumerate().take(5) {
        let want = if i == 0 || i == 3 { 0 } else { 1 };
        assert_eq!(app.outbox_count("PaymentIntentRefreshRequested", *order).await, want, "order {i}");
    }
    blocker.rollback().await.unwrap();

    // Now order 5's hold is locked while its event is in flight, and Stripe redelivers the
    // events of orders 0 and 3 and order 2's again, and sends a second claim about order 0:
    // they wait, then commit together, but for the second event of order 0, which goes into
    // the next transaction, where the re-fetch the first asked for covers it.
    let (blocker, fifth) = in_flight_behind_a_lock(&app, &ingress, &[orders[5]], evt(5)).await;
    let again = claim("evt_group_0_again", orders[0], "pi_group_0");
    let batch = arrive_while_in_flight(&ingress, vec![evt(3), evt(2), evt(0), again]).await;
    blocker.rollback().await.unwrap();
    assert_eq!(fifth.await.unwrap().unwrap(), Ingested::Refresh);
    let outcomes: Vec<_> =
        futures::future::join_all(batch).await.into_iter().map(|r| r.unwrap().unwrap()).collect();
    assert_eq!(outcomes, [Ingested::Refresh, Ingested::Duplicate, Ingested::Refresh, Ingested::Coalesced]);
    let together = xacts(ids(&[0, 3])).await;
    assert_eq!(together.len(), 2);
    assert_eq!(together[0], together[1], "orders 0 and 3 recorded in one transaction");
    assert_ne!(xacts(ids(&[5])).await, vec![together[0].clone()], "after the one in flight");
    let second = xacts(vec!["evt_group_0_again".into()]).await;
    assert_eq!(second.len(), 1);
    assert_ne!(second[0], together[0], "one event per order in a transaction");
    for (i, order) in orders.iter().enumerate() {
        assert_eq!(app.outbox_count("PaymentIntentRefreshRequested", *order).await, 1, "order {i}");
    }

    // An event whose metadata names no order is about order 4 only through its PaymentIntent,
    // and another names order 4 with a stray PaymentIntent: both wait behind one in flight,
    // and the first is recorded in a transaction of its own, not with the second (the first
    // is covered by the re-fetch of its PaymentIntent asked for before; the stray one asks
    // its own).
    let (blocker, late) = in_flight_behind_a_lock(
        &app,
        &ingress,
        &[orders[5]],
        claim("evt_group_5_late", orders[5], "pi_group_5"),
    )
    .await;
    let mut unnamed = serde_json::from_slice::<serde_json::Value>(&event_body(
        "evt_group_4_unnamed",
        orders[4],
        "pi_group_4",
    ))
    .unwrap();
    unnamed["data"]["object"]["metadata"] = json!({});
    let unnamed: boxoffice_payments::webhook::Event = serde_json::from_value(unnamed).unwrap();
    let stray = claim("evt_group_4_stray", orders[4], "pi_stray_4");
    let batch = arrive_while_in_flight(&ingress, vec![unnamed, stray]).await;
    blocker.rollback().await.unwrap();
    late.await.unwrap().unwrap();
    let outcomes: Vec<_> =
        futures::future::join_all(batch).await.into_iter().map(|r| r.unwrap().unwrap()).collect();
    assert_eq!(outcomes, [Ingested::Coalesced, Ingested::Refresh]);
    let apart = xacts(vec!["evt_group_4_stray".into(), "evt_group_4_unnamed".into()]).await;
    assert_eq!(apart.len(), 2);
    assert_ne!(apart[0], apart[1], "an event named by its PaymentIntent alone has a transaction of its own");
    assert_eq!(app.outbox_count("PaymentIntentRefreshRequested", orders[4]).await, 2);
    // The committer's connection is closed before the test's database is dropped.
    drop(ingress);
    pool.close().await;
    app.stop().await;
}

type Ingest =
    tokio::task::JoinHandle<Result<boxoffice_api::webhooks::Ingested, boxoffice_api::webhooks::IngestError>>;

/// Locks the holds of `orders` in a transaction of the caller's and hands `event` to
/// `ingress`; returns once its statement waits for one of those locks.
async fn in_flight_behind_a_lock(
    app: &TestApp,
    ingress: &boxoffice_api::webhooks::Ingress,
    orders: &[Uuid],
    event: boxoffice_payments::webhook::Event,
) -> (sqlx::Transaction<'static, sqlx::Postgres>, Ingest) {
    let mut blocker = app.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM holds WHERE order_id = ANY($1) FOR UPDATE")
        .bind(orders)
        .execute(&mut *blocker)
        .await
        .unwrap();
    let ingest = tokio::spawn({
        let ingress = ingress.clone();
        async move { ingress.ingest(event).await }
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while app
        .count("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'")
        .await
        == 0
    {
        assert!(std::time::Instant::now() < deadline, "the event in flight waits for a locked hold");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (blocker, ingest)
}

/// Hands `events` to `ingress` while its only committer is busy; returns once all of them
/// wait for it.
async fn arrive_while_in_flight(
    ingress: &boxoffice_api::webhooks::Ingress,
    events: Vec<boxoffice_payments::webhook::Event>,
) -> Vec<Ingest> {
    let n = events.len();
    let handles = events
        .into_iter()
        .map(|e| {
            let ingress = ingress.clone();
            tokio::spawn(async move { ingress.ingest(e).await })
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while ingress.waiting() < n {
        assert!(std::time::Instant::now() < deadline, "{n} events wait for the committer");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    handles
}

/// A real PaymentIntent at the provider for `order` (18,500 minor units, created under
/// idempotency key `key`), recorded as the order's, not yet paid.
async fn payable_at_provider(app: &TestApp, order: Uuid, key: &str) -> boxoffice_payments::PaymentIntent {
    use boxoffice_payments::PaymentGateway;
    let req = boxoffice_payments::CreatePaymentIntent {
        amount_minor: 18500,
        currency: "usd".into(),
        metadata: vec![("order_id".into(), order.to_string())],
    };
    let pi = app.stripe().create_payment_intent(&req, key).await.unwrap();
    let secret = pi.client_secret.as_deref();
    let order = boxoffice_domain::OrderId(order);
    boxoffice_store::payments::insert_created(
        &app.pool,
        order,
        &pi.id,
        secret,
        "requires_payment_method",
        18500,
        "usd",
    )
    .await
    .unwrap();
    pi
}

/// The buyer confirms `pi` with a good card at the provider, as a browser would.
async fn pay_at_provider(app: &TestApp, pi: &boxoffice_payments::PaymentIntent) {
    let secret = pi.client_secret.as_deref().unwrap();
    let key = &app.cfg.stripe_publishable_key;
    app.stripe().confirm_with_client_secret(key, &pi.id, secret, "pm_card_visa").await.unwrap();
}

/// A `payment_intent.succeeded` claim for `order`'s PaymentIntent `pi`, signed with `secret`,
/// as Stripe (or whoever holds the secret) would send it.
fn signed_succeeded(evt: &str, order: Uuid, pi: &str, secret: &str) -> (Vec<u8>, String) {
    let body = serde_json::to_vec(&json!({
        "id": evt, "object": "event", "type": "payment_intent.succeeded",
        "created": chrono::Utc::now().timestamp(), "livemode": false, "api_version": "2024-06-20",
        "pending_webhooks": 1, "request": null,
        "data": {"object": {"id": pi, "object": "payment_intent", "status": "succeeded", "amount": 18500,
                 "amount_received": 18500, "currency": "usd", "capture_method": "manual",
                 "metadata": {"order_id": order.to_string()}}}
    }))
    .unwrap();
    let sig = boxoffice_payments::webhook::sign(&body, secret, chrono::Utc::now().timestamp());
    (body, sig)
}

/// Claims about one PaymentIntent share one re-fetch (migration 0033): of twelve distinct
/// signed claims that arrive before the payment worker makes the first one's re-fetch, eleven
/// ask nothing; the worker's re-fetch covers them all and ends the pending re-fetch, so the
/// next claim asks again. With the signing secret, forged event ids cost no provider call
/// each.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn claims_about_one_payment_intent_share_one_refetch(_: PgPoolOptions, opts: PgConnectOptions) {
    let mut app =
        TestApp::spawn(opts, &[Role::Api, Role::Relay, Role::Saga], VenueSpec::small(1, 1, 4)).await;
    let seat = app.seats().await[0];
    let b = app.buyer();
    // A real PaymentIntent at the provider, recorded for the order, not yet paid.
    let order = app.hold_order(&b, "k-share", &[seat]).await;
    let pi = payable_at_provider(&app, order, "share-1").await;
    let secret = app.cfg.stripe_webhook_secret.expose_secret().to_owned();
    let url = format!("{}/webhooks/stripe", app.api);
    let deliver = |evt: String| {
        let (body, sig) = signed_succeeded(&evt, order, &pi.id, &secret);
        app.http.post(&url).header("Stripe-Signature", sig).body(body).send()
    };
    let claims = "SELECT coalesce(sum(claims), 0)::bigint FROM payment_intent_refetches";

    // Twelve distinct claims, six of them at once: one re-fetch asked, twelve claims counted.
    let gate = barrier(6);
    let mut tasks = vec![];
    for i in 0..6 {
        let (gate, send) = (gate.clone(), deliver(format!("evt_share_{i}")));
        tasks.push(tokio::spawn(async move {
            gate.wait().await;
            send.await.unwrap().status().as_u16()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    for i in 6..12 {
        assert_eq!(deliver(format!("evt_share_{i}")).await.unwrap().status(), 200);
    }
    assert_eq!(app.count("SELECT count(*) FROM stripe_events").await, 12, "every claim is recorded");
    assert_eq!(app.outbox_count("PaymentIntentRefreshRequested", order).await, 1, "one re-fetch for all");
    assert_eq!(app.count(claims).await, 12);

    // The buyer pays; the payment worker makes the one re-fetch, which finds the
    // authorization, and ends the pending re-fetch: no claim came while it ran.
    pay_at_provider(&app, &pi).await;
    app.start_roles(&[Role::Payments]).await;
    crate::helpers::eventually(Duration::from_secs(30), "the re-fetch reports the authorization", || async {
        app.outbox_count("PaymentAuthorized", order).await == 1
    })
    .await;
    assert_eq!(
        app.count("SELECT count(*) FROM payment_intent_refetches WHERE asked_at > '-infinity'").await,
        0,
        "in the same transaction"
    );
    assert_eq!(
        app.count(
            "SELECT count(*) FROM outbox WHERE event_type = 'PaymentIntentRefreshRequested'
                AND payload->'payload'->>'reason' = 'claimed_during_refetch'"
        )
        .await,
        0
    );

    // A claim after it asks again: the provider is asked after this claim too.
    let (body, _) = signed_succeeded("evt_share_after", order, &pi.id, &secret);
    let mut v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    v["type"] = json!("payment_intent.canceled");
    v["data"]["object"]["status"] = json!("canceled");
    let body = serde_json::to_vec(&v).unwrap();
    let sig = boxoffice_payments::webhook::sign(&body, &secret, chrono::Utc::now().timestamp());
    assert_eq!(
        app.http.post(&url).header("Stripe-Signature", sig).body(body).send().await.unwrap().status(),
        200
    );
    assert_eq!(app.outbox_count("PaymentIntentRefreshRequested", order).await, 2);
    app.stop().await;
}

/// The rule that ends a pending re-fetch (`stripe_events::finish_refetch`): claims counted
/// before the payment worker read the ledger (before its provider call) are covered and the
/// re-fetch is marked made; a claim counted after that read, or one still in flight, makes the
/// worker ask once more; a re-fetch pending for another order covers nothing (a claim can name
/// another buyer's PaymentIntent under its own order); a pending re-fetch older than
/// `REFETCH_COALESCE_S` no longer holds back a claim; the claims about one PaymentIntent and
/// order ask for at most `REFETCHES_PER_PAYMENT_INTENT` re-fetches a window, the worker's
/// follow-ups at most `FOLLOW_UPS_PER_PAYMENT_INTENT` (migration 0036), and a window that
/// ended begins a new one; rows are pruned an hour after their last claim, follow-up budgets
/// when their window ended.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_claim_counted_while_a_refetch_runs_asks_for_one_more(pool: sqlx::PgPool) {
    use boxoffice_store::stripe_events::{
        ask_refetch, finish_refetch, prune_follow_ups, prune_refetches, spend_follow_up,
        RefetchAsk::{Ask, Coalesced, OverBudget},
        FOLLOW_UPS_PER_PAYMENT_INTENT, REFETCHES_PER_PAYMENT_INTENT, REFETCH_BUDGET_WINDOW_S,
        REFETCH_RETENTION_S,
    };
    let order = boxoffice_domain::OrderId(Uuid::new_v4());
    let other = boxoffice_domain::OrderId(Uuid::new_v4());
    let claim_for = |pi: &'static str, order| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let ask = ask_refetch(&mut tx, pi, order).await.unwrap();
            tx.commit().await.unwrap();
            ask
        }
    };
    let claim = |pi: &'static str| claim_for(pi, order);
    let read = || async {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>("SELECT statement_timestamp()")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let finish_for = |pi: &'static str, order, at| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let more = finish_refetch(&mut tx, pi, order, at).await.unwrap();
            tx.commit().await.unwrap();
            more
        }
    };
    let finish = |pi: &'static str, at| finish_for(pi, order, at);
    let pending = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM payment_intent_refetches WHERE asked_at > '-infinity'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let age = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query(sql).execute(&pool).await.unwrap();
        }
    };

    // Two claims, then the worker's read: both covered, the re-fetch is made.
    assert_eq!(claim("pi_a").await, Ask, "the first claim asks");
    assert_eq!(claim("pi_a").await, Coalesced, "the second is covered by the pending re-fetch");
    assert_eq!(claim("pi_b").await, Ask, "another PaymentIntent has its own");
    let read_at = read().await;
    assert!(!finish("pi_a", read_at).await);
    assert_eq!(pending().await, 1, "pi_b's is still pending");
    assert!(!finish("pi_missing", read_at).await, "a re-fetch no claim asked for");
    assert!(!finish("pi_a", read().await).await, "a re-fetch made is not pending");

    // A claim counted after the worker's read: one more re-fetch, and the row stays pending.
    assert_eq!(claim("pi_a").await, Ask, "after the re-fetch was made, a claim asks again");
    let read_at = read().await;
    assert_eq!(claim("pi_a").await, Coalesced);
    assert!(finish("pi_a", read_at).await, "the claim after the read is not covered");
    let read_at = read().await;
    assert!(!finish("pi_a", read_at).await, "the next re-fetch covers it");

    // A claim naming the PaymentIntent under another order is not covered by this order's
    // pending re-fetch, nor does it cover this order's claims; each re-fetch ends its own.
    assert_eq!(claim_for("pi_c", other).await, Ask, "another order's claim asks for its own");
    assert_eq!(claim("pi_c").await, Ask, "the buyer's claim is not covered by a re-fetch for another order");
    let read_at = read().await;
    assert!(!finish_for("pi_c", other, read_at).await);
    assert_eq!(
        sqlx::query_scalar::<_, uuid::Uuid>(
            "SELECT order_id FROM payment_intent_refetches WHERE payment_intent_id = 'pi_c' AND asked_at > '-infinity'"
        )
        .fetch_all(&pool)
        .await
        .unwrap(),
        [order.0],
        "the other order's re-fetch ends only its own"
    );
    assert!(!finish("pi_c", read_at).await);

    // A claim in flight (its transaction open) when the re-fetch ends: one more.
    assert_eq!(claim("pi_a").await, Ask);
    let mut inflight = pool.begin().await.unwrap();
    assert_eq!(ask_refetch(&mut inflight, "pi_a", order).await.unwrap(), Coalesced);
    let read_at = read().await;
    assert!(finish("pi_a", read_at).await, "a locked row is skipped, not waited for, and reported");
    inflight.commit().await.unwrap();

    // A pending re-fetch asked longer ago than REFETCH_COALESCE_S holds back nothing.
    age("UPDATE payment_intent_refetches SET asked_at = asked_at - interval '31 seconds'").await;
    assert_eq!(claim("pi_a").await, Ask, "an old ask is asked again");
    assert_eq!(claim("pi_a").await, Coalesced, "and covers what follows");

    // The claims' budget: pi_a has asked 4 of its re-fetches (pi_d none); claims sent each
    // time a re-fetch ended ask for the rest, and then for none.
    let asked: i32 = sqlx::query_scalar(
        "SELECT asks FROM payment_intent_refetches WHERE payment_intent_id = 'pi_a' AND order_id = $1",
    )
    .bind(order.0)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(asked, 4);
    for _ in asked..REFETCHES_PER_PAYMENT_INTENT {
        assert!(!finish("pi_a", read().await).await);
        assert_eq!(claim("pi_a").await, Ask);
    }
    assert!(!finish("pi_a", read().await).await);
    assert_eq!(claim("pi_a").await, OverBudget, "past the budget, a claim asks nothing");
    assert_eq!(pending().await, 1, "and leaves nothing pending (pi_b's still is)");
    assert_eq!(claim_for("pi_a", other).await, Ask, "another order's claims have their own budget");
    // A window that ended begins a new one.
    age("UPDATE payment_intent_refetches SET window_started_at = window_started_at - interval '1 hour'")
        .await;
    assert_eq!(claim("pi_a").await, Ask, "a new window");

    // The follow-ups' budget, the payment worker's own.
    let follow_up = |pi: &'static str| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let ok = spend_follow_up(&mut tx, pi, order).await.unwrap();
            tx.commit().await.unwrap();
            ok
        }
    };
    for _ in 0..FOLLOW_UPS_PER_PAYMENT_INTENT {
        assert!(follow_up("pi_a").await);
    }
    assert!(!follow_up("pi_a").await, "past the follow-ups' budget");
    assert!(follow_up("pi_b").await, "another PaymentIntent's are its own");
    age("UPDATE payment_intent_follow_ups SET window_started_at = window_started_at - interval '1 hour'")
        .await;
    assert!(follow_up("pi_a").await, "a new window");
    assert_eq!(
        prune_follow_ups(&pool, REFETCH_BUDGET_WINDOW_S, 100).await.unwrap(),
        1,
        "pi_b's window ended"
    );

    // Rows whose last claim is older than the retention are pruned; younger ones stay.
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM payment_intent_refetches").fetch_one(&pool).await.unwrap();
    age("UPDATE payment_intent_refetches SET last_claim_at = now() - interval '2 hours' WHERE payment_intent_id = 'pi_b'").await;
    assert_eq!(prune_refetches(&pool, REFETCH_RETENTION_S, 100).await.unwrap(), 1);
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM payment_intent_refetches")
            .fetch_one(&pool)
            .await
            .unwrap(),
        rows - 1
    );
}

/// A claim that names another buyer's PaymentIntent under an order of its sender's (signed
/// with a leaked secret) asks for a re-fetch for that order, which the provider refutes; it
/// covers none of the buyer's own claims. The buyer's genuine authorization asks for its own
/// re-fetch, made for the buyer's order, and the saga acts on it (migration 0034).
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_claim_naming_another_orders_payment_intent_covers_none_of_its_claims(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let mut app =
        TestApp::spawn(opts, &[Role::Api, Role::Relay, Role::Saga], VenueSpec::small(1, 1, 4)).await;
    let seats = app.seats().await;
    let (attacker, buyer) = (app.buyer(), app.buyer());
    let theirs = app.hold_order(&attacker, "k-attacker", &[seats[0]]).await;
    let order = app.hold_order(&buyer, "k-buyer", &[seats[1]]).await;
    let pi = payable_at_provider(&app, order, "cover-1").await;
    let secret = app.cfg.stripe_webhook_secret.expose_secret().to_owned();
    let url = format!("{}/webhooks/stripe", app.api);
    let deliver = |body: Vec<u8>| {
        let sig = boxoffice_payments::webhook::sign(&body, &secret, chrono::Utc::now().timestamp());
        app.http.post(&url).header("Stripe-Signature", sig).body(body).send()
    };
    // The cover: authorization claims naming the buyer's PaymentIntent under the attacker's
    // order (checked: a stray authorization is cancelled once confirmed).
    for i in 0..3 {
        let r = deliver(event_body(&format!("evt_cover_{i}"), theirs, &pi.id)).await.unwrap();
        assert_eq!(r.status(), 200);
    }
    assert_eq!(app.outbox_count("PaymentIntentRefreshRequested", theirs).await, 1);
    // The buyer pays; the provider's genuine webhook asks for the buyer's own re-fetch.
    pay_at_provider(&app, &pi).await;
    assert_eq!(deliver(event_body("evt_genuine", order, &pi.id)).await.unwrap().status(), 200);
    assert_eq!(
        app.outbox_count("PaymentIntentRefreshRequested", order).await,
        1,
        "the buyer's claim is not covered by the re-fetch asked for the attacker's order"
    );
    app.start_roles(&[Role::Payments]).await;
    crate::helpers::eventually(Duration::from_secs(30), "the buyer's authorization is acted on", || async {
        app.outbox_count("PaymentAuthorized", order).await == 1
    })
    .await;
    assert_eq!(app.outbox_count("PaymentAuthorized", theirs).await, 0);
    app.stop().await;
}

/// Claims naming an object the ledger does not record for their order (a PaymentIntent that
/// is not the order's, a dispute) each name one of their own, which no pending re-fetch
/// covers: per order, [`UNCOVERED_REFETCHES_PER_ORDER`] of them an hour ask for a re-fetch,
/// and the rest are recorded and left to reconciliation (migration 0035). The order's own
/// PaymentIntent is still checked whatever the budget says, another order's budget is its
/// own, a window that ended begins a new one, and budgets whose window ended are pruned.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn claims_naming_new_objects_spend_their_orders_refetch_budget(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use boxoffice_api::webhooks::{Ingested, Ingress};
    use boxoffice_store::stripe_events::{
        prune_refetch_budgets, UNCOVERED_REFETCHES_PER_ORDER, UNCOVERED_REFETCH_WINDOW_S,
    };
    let budget = UNCOVERED_REFETCHES_PER_ORDER as usize;
    let mut app =
        TestApp::spawn(opts, &[Role::Api, Role::Relay, Role::Saga], VenueSpec::small(1, 1, 4)).await;
    let seats = app.seats().await;
    let (b, other_buyer) = (app.buyer(), app.buyer());
    let order = app.hold_order(&b, "k-budget", &[seats[0]]).await;
    let other = app.hold_order(&other_buyer, "k-budget-other", &[seats[1]]).await;
    let pi = payable_at_provider(&app, order, "budget-1").await;
    let ingress = Ingress::start(app.pool.clone(), app.cfg.hold_policy(), 32, Duration::from_secs(30));
    let refetches = |o: Uuid| {
        let app = &app;
        async move {
            app.outbox_count("PaymentIntentRefreshRequested", o).await
                + app.outbox_count("DisputeRefreshRequested", o).await
        }
    };

    // Authorization claims each naming a new PaymentIntent under the order: the budget's
    // worth ask for a re-fetch (each a provider call), the rest are left to reconciliation.
    let mut outcomes = Vec::new();
    for i in 0..budget + 6 {
        outcomes.push(
            ingress.ingest(claim(&format!("evt_stray_{i}"), order, &format!("pi_stray_{i}"))).await.unwrap(),
        );
    }
    let mut expected = vec![Ingested::Refresh; budget];
    expected.extend([Ingested::LeftToReconciliation; 6]);
    assert_eq!(outcomes, expected);
    assert_eq!(refetches(order).await, budget as i64);
    assert_eq!(
        app.count("SELECT count(*) FROM stripe_events").await,
        budget as i64 + 6,
        "every claim is recorded"
    );
    assert_eq!(
        app.count("SELECT count(*) FROM payment_intent_refetches").await,
        budget as i64,
        "none pending for the rest"
    );
    // A dispute claim is one of a kind too.
    let dispute: boxoffice_payments::webhook::Event = serde_json::from_value(json!({
        "id": "evt_dispute_1", "object": "event", "type": "charge.dispute.created",
        "created": chrono::Utc::now().timestamp(), "livemode": false, "api_version": "2024-06-20",
        "pending_webhooks": 1, "request": null,
        "data": {"object": {"id": "dp_forged", "object": "dispute", "payment_intent": pi.id, "status": "needs_response",
                 "amount": 18500, "currency": "usd", "metadata": {"order_id": order.to_string()}}}
    }))
    .unwrap();
    assert_eq!(ingress.ingest(dispute).await.unwrap(), Ingested::LeftToReconciliation);
    // Another order's budget is its own.
    assert_eq!(
        ingress.ingest(claim("evt_other_stray", other, "pi_other_stray")).await.unwrap(),
        Ingested::Refresh
    );

    // The buyer pays: the genuine claim about the order's own PaymentIntent is checked and
    // acted on, whatever the order's budget says.
    pay_at_provider(&app, &pi).await;
    assert_eq!(ingress.ingest(claim("evt_genuine", order, &pi.id)).await.unwrap(), Ingested::Refresh);
    app.start_roles(&[Role::Payments]).await;
    crate::helpers::eventually(Duration::from_secs(30), "the buyer's authorization is acted on", || async {
        app.outbox_count("PaymentAuthorized", order).await == 1
    })
    .await;

    // A window that ended begins a new one; budgets whose window ended are pruned.
    let age = format!("now() - make_interval(secs => {})", UNCOVERED_REFETCH_WINDOW_S + 60);
    sqlx::query(&format!("UPDATE order_refetch_budget SET window_started_at = {age} WHERE order_id = $1"))
        .bind(order)
        .execute(&app.pool)
        .await
        .unwrap();
    assert_eq!(
        ingress.ingest(claim("evt_stray_later", order, "pi_stray_later")).await.unwrap(),
        Ingested::Refresh
    );
    sqlx::query(&format!("UPDATE order_refetch_budget SET window_started_at = {age} WHERE order_id = $1"))
        .bind(other)
        .execute(&app.pool)
        .await
        .unwrap();
    assert_eq!(prune_refetch_budgets(&app.pool, UNCOVERED_REFETCH_WINDOW_S, 100).await.unwrap(), 1);
    assert_eq!(
        app.count(&format!("SELECT count(*) FROM order_refetch_budget WHERE order_id = '{order}'")).await,
        1,
        "a budget in its window stays"
    );
    app.stop().await;
}

/// Claims about an order's own PaymentIntent, forged with the signing secret, cost a bounded
/// number of re-fetches however they are sent (migration 0036): a steady stream that keeps
/// arriving while each re-fetch runs gets the first claim's re-fetch and
/// [`FOLLOW_UPS_PER_PAYMENT_INTENT`] follow-ups, then none; claims sent each time a re-fetch
/// has been made ask for the rest of [`REFETCHES_PER_PAYMENT_INTENT`], then none. Every claim
/// is answered 200, the flooded order is not authorized by them, and another buyer's purchase
/// meanwhile is ticketed.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_stream_of_claims_about_an_orders_own_payment_intent_costs_a_bounded_number_of_refetches(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use boxoffice_store::stripe_events::{FOLLOW_UPS_PER_PAYMENT_INTENT, REFETCHES_PER_PAYMENT_INTENT};
    use boxoffice_stripe_sim::Faults;
    let app = TestApp::spawn(opts, &Role::ALL, VenueSpec::small(1, 1, 4)).await;
    let seats = app.seats().await;
    let (victim, other) = (app.buyer(), app.buyer());
    let order = app.hold_order(&victim, "k-flooded", &[seats[0]]).await;
    let v =
        app.await_order(&victim, order, Duration::from_secs(30), |v| v.get("client_secret").is_some()).await;
    let pi = v["payment_intent_id"].as_str().unwrap().to_owned();
    let refetches = || app.outbox_count("PaymentIntentRefreshRequested", order);
    let follow_ups = format!(
        "SELECT count(*) FROM outbox WHERE message_key = '{order}' AND event_type = 'PaymentIntentRefreshRequested'
            AND payload->'payload'->>'reason' = 'claimed_during_refetch'"
    );
    let spent = format!(
        "SELECT coalesce(max(made), 0)::bigint FROM payment_intent_follow_ups WHERE order_id = '{order}'"
    );
    let follow_ups_spent = || app.count(&spent);

    // A steady stream: each re-fetch's call takes at least 100 ms, and claims keep arriving
    // meanwhile, until the payment worker has refused a follow-up.
    app.sim.set_faults(Faults { answer_delay_ms: 100, ..Faults::default() });
    let mut sent = 0;
    while follow_ups_spent().await <= i64::from(FOLLOW_UPS_PER_PAYMENT_INTENT) {
        assert!(sent < 5_000, "the follow-ups never ran out");
        assert_eq!(app.deliver_webhook(event_body(&format!("evt_stream_{sent}"), order, &pi)).await, 200);
        sent += 1;
    }
    app.sim.set_faults(Faults::default());
    let asked = refetches().await - app.count(&follow_ups).await;
    assert_eq!(
        (app.count(&follow_ups).await, asked.min(2)),
        (i64::from(FOLLOW_UPS_PER_PAYMENT_INTENT), asked),
        "the follow-ups' budget, and the first claim's re-fetch (and one more, if a claim came after \
         the refused follow-up ended the pending re-fetch), of {sent} claims"
    );

    // Claims sent each time a re-fetch has been made (here: marked made) ask for the rest of
    // the claims' budget, then for none; past it they protect nothing.
    for i in 0..REFETCHES_PER_PAYMENT_INTENT + 3 {
        sqlx::query("UPDATE payment_intent_refetches SET asked_at = '-infinity' WHERE order_id = $1")
            .bind(order)
            .execute(&app.pool)
            .await
            .unwrap();
        assert_eq!(app.deliver_webhook(event_body(&format!("evt_after_{i}"), order, &pi)).await, 200);
    }
    assert_eq!(
        refetches().await,
        i64::from(REFETCHES_PER_PAYMENT_INTENT + FOLLOW_UPS_PER_PAYMENT_INTENT),
        "the claims' budget and the follow-ups'"
    );

    // Another buyer's purchase goes through meanwhile; the flooded order is not authorized.
    let theirs = app.hold_order(&other, "k-other", &[seats[1]]).await;
    app.pay(&other, theirs, "pm_card_visa").await.expect("authorized at the provider");
    app.await_order(&other, theirs, Duration::from_secs(30), |v| v["status"] == "ticketed").await;
    let unmade = format!(
        "SELECT count(*) FROM outbox o WHERE o.message_key = '{order}' AND o.event_type = 'PaymentIntentRefreshRequested'
            AND NOT EXISTS (SELECT 1 FROM inbox i WHERE i.consumer = 'payments' AND i.event_id = o.id)"
    );
    crate::helpers::eventually(Duration::from_secs(30), "every re-fetch asked was made", || async {
        app.count(&unmade).await == 0
    })
    .await;
    assert_eq!(
        refetches().await,
        i64::from(REFETCHES_PER_PAYMENT_INTENT + FOLLOW_UPS_PER_PAYMENT_INTENT),
        "and no follow-up after them"
    );
    assert_eq!(app.outbox_count("PaymentAuthorized", order).await, 0);
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) FROM holds WHERE order_id = '{order}' AND authorized_until IS NOT NULL"
        ))
        .await,
        0,
        "no claim left standing protects the unpaid hold"
    );
    app.stop().await;
}
