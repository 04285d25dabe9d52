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
    let r = app.hold(&b, &app.admission_token(&b), "k", &[seat]).await;
    let order: Uuid =
        r.json::<serde_json::Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap();
    let pi = "pi_webhook_test";
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
