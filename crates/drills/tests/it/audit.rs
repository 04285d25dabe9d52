//! `boxoffice audit` against the provider and the dead-letter topic, and `boxoffice
//! reconcile`: the whole system runs (every role, the real broker, the in-process Stripe
//! simulator), then money is made to move behind the ledger's back — a second captured
//! PaymentIntent for one order, webhooks that never arrive, a capture made directly at the
//! provider, payment rows altered or deleted — and the audit must see it, reconcile must
//! name the fact that closes it, and `--fix` must close it through the saga.

use crate::helpers::{eventually, test_brokers, Buyer, TestApp};
use boxoffice::audit::{self, AuditReport, Check};
use boxoffice::commands::audit_options;
use boxoffice::reconcile::{self, DriftKind, Window};
use boxoffice::runtime::Role;
use boxoffice_payments::PaymentGateway;
use boxoffice_store::venue::VenueSpec;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::ConnectOptions;
use std::time::Duration;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(90);

/// Every check, as `boxoffice audit` runs them with the app's configuration.
async fn run_audit(app: &TestApp) -> AuditReport {
    let opts = audit_options(&app.cfg, 600_000, None, None, false).unwrap();
    audit::run(&app.pool, &opts).await.unwrap()
}

/// Reconciles the last hour, fixing or not.
async fn run_reconcile(app: &TestApp, fix: bool) -> reconcile::Report {
    let window = Window::parse("1h", None, chrono::Utc::now()).unwrap();
    reconcile::run(&app.pool, &app.stripe(), window, fix).await.unwrap()
}

fn provider(r: &AuditReport) -> &audit::ProviderViolations {
    &r.provider.ran().unwrap_or_else(|| panic!("provider checks ran: {:?}", r.provider)).violations
}

/// A hold on `seat` for a new buyer; its order id.
async fn hold(app: &TestApp, seat: Uuid, key: &str) -> (Buyer, Uuid) {
    let b = app.buyer();
    let r = app.hold(&b, &app.admission_token(&b), key, &[seat]).await;
    assert_eq!(r.status(), 202);
    let order = r.json::<serde_json::Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap();
    (b, order)
}

async fn buy(app: &TestApp, seat: Uuid, key: &str) -> (Uuid, String) {
    let (b, order) = hold(app, seat, key).await;
    app.pay(&b, order, "pm_card_visa").await.expect("authorized");
    let v = app.await_order(&b, order, WAIT, |v| v["status"] == "ticketed").await;
    (order, v["payment_intent_id"].as_str().unwrap().to_owned())
}

/// Waits until the outbox is empty.
async fn drained(app: &TestApp) {
    let pool = app.pool.clone();
    eventually(WAIT, "the outbox drained", || {
        let pool = pool.clone();
        async move { boxoffice_store::outbox::backlog(&pool).await.unwrap().unpublished == 0 }
    })
    .await;
}

/// Waits until every order is final and the outbox is empty.
async fn settle(app: &TestApp) {
    let pool = app.pool.clone();
    eventually(WAIT, "every order final and the outbox drained", || {
        let pool = pool.clone();
        async move {
            let open: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM orders
                  WHERE status NOT IN ('ticketed', 'expired', 'failed', 'canceled', 'refunded')",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            open == 0 && boxoffice_store::outbox::backlog(&pool).await.unwrap().unpublished == 0
        }
    })
    .await;
}

/// A clean system audits clean; a second PaymentIntent captured for a ticketed order, made
/// directly at the provider, is `multiple_captures_at_provider = 1` (and an intent the ledger
/// does not know), a message in the dead-letter topic is counted, and `boxoffice audit`
/// exits 1 and says so in its JSON.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn second_capture_at_the_provider_and_dead_letters_fail_the_audit(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let url = opts.to_url_lossy().to_string();
    let app = TestApp::spawn(opts, &Role::ALL, VenueSpec::small(1, 1, 4)).await;
    let s = app.seats().await;
    let (order, _) = buy(&app, s[0], "dc-1").await;
    settle(&app).await;
    let clean = run_audit(&app).await;
    assert_eq!((clean.total(), clean.exit_code()), (0, 0), "{}", audit::render(&clean));
    assert_eq!(provider(&clean).multiple_captures_at_provider, 0);
    assert_eq!(clean.provider.ran().unwrap().intents_checked, 1);
    assert!(matches!(clean.dead_letters, Check::Ran(0)), "{:?}", clean.dead_letters);

    // The buyer is charged a second time for the same order, behind the ledger's back (no
    // webhook tells the saga, which would cancel a stray authorization before its capture).
    app.sim.set_webhook_url(None);
    let extra = app.authorize_at_provider(order, 18_500, "second-charge").await;
    app.stripe().capture_payment_intent(&extra, "second-capture").await.unwrap();
    // And one message some consumer gave up on.
    let kafka = app.cfg.kafka().unwrap();
    let producer = boxoffice_bus::producer::build(&kafka).unwrap();
    let dlq = kafka.topic(boxoffice_domain::Topic::DeadLetter.name());
    let letter = serde_json::json!({"consumer": "saga", "error_code": "unknown_order", "attempts": 1});
    boxoffice_bus::producer::send(&producer, &dlq, &order.to_string(), letter.to_string().as_bytes(), &[])
        .await
        .unwrap();

    let r = run_audit(&app).await;
    let p = provider(&r);
    assert_eq!(p.multiple_captures_at_provider, 1, "{}", audit::render(&r));
    assert_eq!(p.drift_count(DriftKind::IntentMissingInLedger), 1);
    assert_eq!(p.total(), 2, "nothing else: {p:?}");
    assert!(matches!(r.dead_letters, Check::Ran(1)), "{:?}", r.dead_letters);
    assert_eq!(r.ledger.total(), 0, "the ledger alone cannot see any of it");
    assert_eq!(r.exit_code(), 1);

    // The command as an operator runs it.
    let out = tokio::task::spawn_blocking({
        let (base, prefix) = (app.cfg.stripe_api_base.clone(), app.cfg.kafka_topic_prefix.clone());
        move || {
            std::process::Command::new(crate::helpers::product_bin())
                .args(["audit", "--json"])
                .env("BOXOFFICE_ENV", "development")
                .env("BOXOFFICE_DATABASE_URL", url)
                .env("BOXOFFICE_STRIPE_API_BASE", base)
                .env("BOXOFFICE_KAFKA_BROKERS", test_brokers())
                .env("BOXOFFICE_KAFKA_TOPIC_PREFIX", prefix)
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(j["violations"]["multiple_captures_at_provider"], 1, "{j}");
    assert_eq!(j["violations"]["dead_letters"], 1);
    assert_eq!(j["violations"]["oversold"], 0);
    assert_eq!(j["checks"]["provider"]["status"], "ran");
    assert_eq!(j["checks"]["dead_letters"]["status"], "ran");
    app.stop().await;
}

/// The ledger misses facts the provider has: an authorization whose webhooks never arrived,
/// and a capture made directly at the provider. Audit reports the drift; reconcile names
/// the facts and writes nothing without `--fix`; with `--fix` the saga takes it from there
/// (the first order is captured and ticketed, the second, captured without a confirmed
/// hold, is refunded) and afterwards reconcile and audit are clean.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn reconcile_fix_closes_drift_through_the_saga(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &Role::ALL, VenueSpec::small(1, 1, 4)).await;
    let s = app.seats().await;
    app.sim.set_webhook_url(None);
    let (b1, lost) = hold(&app, s[0], "lost-webhooks").await;
    let (b2, behind) = hold(&app, s[1], "captured-behind").await;
    app.pay(&b1, lost, "pm_card_visa").await.expect("authorized");
    let pi2 = app.pay(&b2, behind, "pm_card_visa").await.expect("authorized").id;
    app.stripe().capture_payment_intent(&pi2, "out-of-band").await.unwrap();
    for (b, o) in [(&b1, lost), (&b2, behind)] {
        app.await_order(b, o, WAIT, |v| v["status"] == "payment_required").await;
    }
    drained(&app).await;
    for (b, o) in [(&b1, lost), (&b2, behind)] {
        assert_eq!(app.order(b, o).await.1["status"], "payment_required", "the ledger never heard");
    }

    let r = run_audit(&app).await;
    let p = provider(&r);
    assert_eq!(p.drift_count(DriftKind::AuthorizationNotInLedger), 1, "{}", audit::render(&r));
    assert_eq!(p.drift_count(DriftKind::CaptureNotInLedger), 1);
    assert_eq!(p.total(), 2, "{p:?}");
    assert_eq!(r.exit_code(), 1);

    let dry = run_reconcile(&app, false).await;
    let mut found: Vec<(Uuid, DriftKind, Option<&str>, bool)> =
        dry.drift.iter().map(|d| (d.order_id.unwrap(), d.kind, d.fact_name(), d.fixed)).collect();
    found.sort();
    let mut want = vec![
        (lost, DriftKind::AuthorizationNotInLedger, Some("PaymentAuthorized"), false),
        (behind, DriftKind::CaptureNotInLedger, Some("PaymentCaptured"), false),
    ];
    want.sort();
    assert_eq!(found, want, "{}", reconcile::render(&dry));
    assert_eq!((dry.unresolved, dry.exit_code()), (2, 1));
    assert_eq!(app.outbox_count("PaymentAuthorized", lost).await, 0, "a dry run writes nothing");
    assert_eq!(app.outbox_count("PaymentCaptured", behind).await, 0);

    let fixed = run_reconcile(&app, true).await;
    assert_eq!((fixed.facts_emitted, fixed.unresolved, fixed.exit_code()), (2, 0, 0));
    assert!(fixed.drift.iter().all(|d| d.fixed));
    assert_eq!(app.outbox_count("PaymentAuthorized", lost).await, 1);

    let v = app.await_order(&b1, lost, WAIT, |v| v["status"] == "ticketed").await;
    assert_eq!(app.sim.captures_for(v["payment_intent_id"].as_str().unwrap()), 1);
    app.await_order(&b2, behind, WAIT, |v| v["status"] == "refunded").await;
    assert_eq!(app.sim.payment_intent(&pi2).unwrap()["status"], "succeeded");
    settle(&app).await;

    let again = run_reconcile(&app, false).await;
    assert!(again.drift.is_empty(), "{}", reconcile::render(&again));
    assert_eq!(again.exit_code(), 0);
    let r = run_audit(&app).await;
    assert_eq!((r.total(), r.exit_code()), (0, 0), "{}", audit::render(&r));
    app.stop().await;
}

/// Payment rows changed behind the saga's back: one set back to uncaptured, one deleted.
/// `--fix` restores the first through a PaymentCaptured fact; the deleted row has no fact
/// that closes it, so reconcile keeps reporting it and exits non-zero even with `--fix`.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn altered_rows_are_fixed_and_deleted_rows_need_an_operator(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &Role::ALL, VenueSpec::small(1, 1, 4)).await;
    let s = app.seats().await;
    let (altered, _) = buy(&app, s[0], "alter").await;
    let (deleted, deleted_pi) = buy(&app, s[1], "delete").await;
    settle(&app).await;
    sqlx::query(
        "UPDATE payments SET status = 'requires_capture', amount_captured_minor = 0 WHERE order_id = $1",
    )
    .bind(altered)
    .execute(&app.pool)
    .await
    .unwrap();
    sqlx::query("DELETE FROM payments WHERE order_id = $1").bind(deleted).execute(&app.pool).await.unwrap();

    let r = run_audit(&app).await;
    assert_eq!(r.ledger.tickets_without_capture, 2, "{}", audit::render(&r));
    let p = provider(&r);
    assert_eq!(p.drift_count(DriftKind::CaptureNotInLedger), 1);
    assert_eq!(p.drift_count(DriftKind::IntentMissingInLedger), 1);
    assert_eq!(p.multiple_captures_at_provider, 0);

    let fixed = run_reconcile(&app, true).await;
    assert_eq!(
        (fixed.facts_emitted, fixed.unresolved, fixed.exit_code()),
        (1, 1, 1),
        "{}",
        reconcile::render(&fixed)
    );
    let open = fixed.drift.iter().find(|d| !d.fixed).unwrap();
    assert_eq!(
        (open.kind, open.payment_intent_id.as_str(), open.fact.is_none()),
        (DriftKind::IntentMissingInLedger, deleted_pi.as_str(), true)
    );
    assert!(reconcile::render(&fixed).contains("needs an operator"));

    let pool = app.pool.clone();
    eventually(WAIT, "the saga recorded the capture again", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT amount_captured_minor FROM payments WHERE order_id = $1")
                .bind(altered)
                .fetch_one(&pool)
                .await
                .unwrap()
                == 18_500
        }
    })
    .await;
    settle(&app).await;
    let r = run_audit(&app).await;
    let p = provider(&r);
    assert_eq!(p.drift_count(DriftKind::CaptureNotInLedger), 0, "{}", audit::render(&r));
    assert_eq!(p.drift_count(DriftKind::IntentMissingInLedger), 1, "still reported");
    assert_eq!(r.ledger.tickets_without_capture, 1);
    assert_eq!(r.exit_code(), 1);
    app.stop().await;
}

/// A stray authorization — a PaymentIntent authorized at the provider naming an order whose
/// payment row records another — whose webhook was left to reconciliation, the order's
/// claims about objects it does not record having spent their re-fetch budget on forgeries:
/// nothing cancels it until reconcile, which names `PaymentAuthorized` as the fact that closes
/// it and writes nothing without `--fix`; with `--fix` the saga cancels it at the provider
/// (invariant 6), and the order's own purchase goes on.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_stray_authorization_left_to_reconciliation_is_cancelled_through_the_saga(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = TestApp::spawn(opts, &Role::ALL, VenueSpec::small(1, 1, 4)).await;
    let seat = app.seats().await[0];
    let (b, order) = hold(&app, seat, "stray").await;
    app.await_order(&b, order, WAIT, |v| v["status"] == "payment_required").await;
    // Forged authorization claims, each naming a new PaymentIntent under the order, spend its
    // budget.
    for i in 0..boxoffice_store::stripe_events::UNCOVERED_REFETCHES_PER_ORDER {
        let body = serde_json::to_vec(&serde_json::json!({
            "id": format!("evt_forged_{i}"), "object": "event", "type": "payment_intent.amount_capturable_updated",
            "created": chrono::Utc::now().timestamp(), "livemode": false, "api_version": "2024-06-20",
            "pending_webhooks": 1, "request": null,
            "data": {"object": {"id": format!("pi_forged_{i}"), "object": "payment_intent", "status": "requires_capture",
                     "amount": 18500, "amount_capturable": 18500, "amount_received": 0, "currency": "usd",
                     "capture_method": "manual", "metadata": {"order_id": order.to_string()}}}
        }))
        .unwrap();
        assert_eq!(app.deliver_webhook(body).await, 200);
    }
    // A real stray authorization: its genuine webhook is recorded and left to reconciliation.
    let stray = app.authorize_at_provider(order, 18_500, "stray-auth").await;
    let pool = app.pool.clone();
    eventually(WAIT, "the stray authorization's webhook recorded", || {
        let (pool, stray) = (pool.clone(), stray.clone());
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM stripe_events
                  WHERE payment_intent_id = $1 AND type = 'payment_intent.amount_capturable_updated'",
            )
            .bind(stray)
            .fetch_one(&pool)
            .await
            .unwrap()
                == 1
        }
    })
    .await;
    drained(&app).await;
    assert_eq!(app.sim.payment_intent(&stray).unwrap()["status"], "requires_capture", "nobody checked it");

    let dry = run_reconcile(&app, false).await;
    let named: Vec<_> = dry
        .drift
        .iter()
        .filter(|d| d.payment_intent_id == stray)
        .map(|d| (d.kind, d.order_id, d.fact_name(), d.fixed))
        .collect();
    assert_eq!(
        named,
        [(DriftKind::IntentMissingInLedger, Some(order), Some("PaymentAuthorized"), false)],
        "{}",
        reconcile::render(&dry)
    );
    assert_eq!(app.outbox_count("PaymentAuthorized", order).await, 0, "a dry run writes nothing");
    let fixed = run_reconcile(&app, true).await;
    assert_eq!(fixed.facts_emitted, 1, "{}", reconcile::render(&fixed));
    let sim = &app.sim;
    eventually(WAIT, "the saga cancelled the stray authorization", || async {
        sim.payment_intent(&stray).unwrap()["status"] == "canceled"
    })
    .await;

    // The buyer's own purchase goes on, and nothing is left that holds money.
    app.pay(&b, order, "pm_card_visa").await.expect("authorized");
    app.await_order(&b, order, WAIT, |v| v["status"] == "ticketed").await;
    settle(&app).await;
    let again = run_reconcile(&app, false).await;
    assert!(again.drift.is_empty(), "the cancelled stray is no drift: {}", reconcile::render(&again));
    assert_eq!(again.exit_code(), 0);
    app.stop().await;
}

/// An authorization past its capture deadline that nobody captured or released: the ledger
/// check sees it while the ledger says `requires_capture`; the provider check still sees it
/// after the ledger was (wrongly) marked canceled, because the money is still held at the
/// provider; once the provider cancels it, both are clean. Without a broker the dead-letter
/// check says "not checked" instead of 0.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn authorization_past_its_deadline_is_seen_on_both_sides(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    app.sim.set_webhook_url(None);
    let seat = app.seats().await[0];
    let (_, order) = hold(&app, seat, "deadline").await;
    // No relay runs here: the hold's own events are not what this test is about.
    sqlx::query("UPDATE outbox SET published_at = now()").execute(&app.pool).await.unwrap();
    let pi = app.authorize_at_provider(order, 18_500, "deadline-auth").await;
    let oid = boxoffice_domain::OrderId(order);
    boxoffice_store::payments::insert_created(&app.pool, oid, &pi, None, "requires_capture", 18_500, "usd")
        .await
        .unwrap();
    boxoffice_store::payments::set_capture_before(
        &app.pool,
        &pi,
        chrono::Utc::now() - chrono::Duration::hours(1),
    )
    .await
    .unwrap();

    let r = run_audit(&app).await;
    assert_eq!(r.ledger.uncaptured_past_deadline, 1, "{}", audit::render(&r));
    assert_eq!(provider(&r).uncaptured_past_deadline_at_provider, 1);
    assert_eq!(provider(&r).total(), 1, "the two sides agree otherwise");
    assert!(
        matches!(&r.dead_letters, Check::NotChecked(why) if why.contains("no broker")),
        "{:?}",
        r.dead_letters
    );
    assert!(audit::render(&r).contains("not checked"));
    assert_eq!(r.to_json()["violations"]["dead_letters"], serde_json::Value::Null);
    assert_eq!(r.exit_code(), 1);

    sqlx::query("UPDATE payments SET status = 'canceled' WHERE order_id = $1")
        .bind(order)
        .execute(&app.pool)
        .await
        .unwrap();
    let r = run_audit(&app).await;
    assert_eq!(r.ledger.uncaptured_past_deadline, 0);
    assert_eq!(provider(&r).uncaptured_past_deadline_at_provider, 1, "still held at the provider");
    assert_eq!(r.exit_code(), 1);

    app.stripe().cancel_payment_intent(&pi, "deadline-cancel").await.unwrap();
    let r = run_audit(&app).await;
    assert_eq!((r.total(), r.exit_code()), (0, 0), "{}", audit::render(&r));
    // Skipping the provider is reported, not silently clean.
    let skipped = audit_options(&app.cfg, 600_000, None, None, true).unwrap();
    let r = audit::run(&app.pool, &skipped).await.unwrap();
    assert!(matches!(r.provider, Check::NotChecked(_)));
    assert_eq!(r.to_json()["checks"]["provider"]["status"], "not_checked");
    app.stop().await;
}

async fn order_status(app: &TestApp, order: Uuid) -> String {
    sqlx::query_scalar("SELECT status FROM orders WHERE id = $1")
        .bind(order)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

async fn valid_tickets(app: &TestApp, order: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM tickets WHERE order_id = $1 AND voided_at IS NULL")
        .bind(order)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// C14: a ticketed order refunded in full from the provider's dashboard ends `refunded` with
/// its tickets void (kept, marked) and a `TicketsVoided` fact; a partial refund is recorded
/// and reported, and the tickets stay valid; the audit is clean afterwards. A ledger whose
/// tickets stayed valid after a full refund is a violation that `reconcile --fix` closes.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c14_a_refund_at_the_provider_voids_the_tickets(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &Role::ALL, VenueSpec::small(1, 1, 4)).await;
    let s = app.seats().await;
    let (full, full_pi) = buy(&app, s[0], "full").await;
    let (part, part_pi) = buy(&app, s[1], "part").await;
    settle(&app).await;

    app.refund_at_provider(&full_pi, None).await;
    app.refund_at_provider(&part_pi, Some(5_000)).await;
    let pool = app.pool.clone();
    eventually(WAIT, "the full refund voided the tickets", || {
        let pool = pool.clone();
        async move { crate::helpers::outbox_count(&pool, "TicketsVoided", full).await == 1 }
    })
    .await;
    eventually(WAIT, "the partial refund was recorded", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT amount_refunded_minor FROM payments WHERE order_id = $1")
                .bind(part)
                .fetch_one(&pool)
                .await
                .unwrap()
                == 5_000
        }
    })
    .await;
    settle(&app).await;
    assert_eq!((order_status(&app, full).await.as_str(), valid_tickets(&app, full).await), ("refunded", 0));
    assert_eq!(
        app.count("SELECT count(*) FROM tickets WHERE void_reason = 'refunded_at_provider'").await,
        1,
        "kept, marked"
    );
    assert_eq!((order_status(&app, part).await.as_str(), valid_tickets(&app, part).await), ("ticketed", 1));
    assert_eq!(app.count("SELECT count(*) FROM incidents WHERE kind = 'partial_refund'").await, 1);
    let r = run_audit(&app).await;
    assert_eq!((r.total(), r.exit_code()), (0, 0), "{}", audit::render(&r));

    // A ledger that recorded the refund but kept the tickets valid (as before voiding existed).
    sqlx::query("UPDATE tickets SET voided_at = NULL, void_reason = NULL WHERE order_id = $1")
        .bind(full)
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE orders SET status = 'ticketed' WHERE id = $1")
        .bind(full)
        .execute(&app.pool)
        .await
        .unwrap();
    let r = run_audit(&app).await;
    assert_eq!(r.ledger.tickets_valid_after_refund, 1, "{}", audit::render(&r));
    assert_eq!(provider(&r).drift_count(DriftKind::TicketsValidAfterRefund), 1);
    assert_eq!(r.exit_code(), 1);
    let fixed = run_reconcile(&app, true).await;
    assert_eq!(fixed.facts_emitted, 1, "{}", reconcile::render(&fixed));
    eventually(WAIT, "the saga voided the tickets again", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM tickets WHERE order_id = $1 AND voided_at IS NULL",
            )
            .bind(full)
            .fetch_one(&pool)
            .await
            .unwrap()
                == 0
        }
    })
    .await;
    settle(&app).await;
    assert_eq!(order_status(&app, full).await, "refunded");
    let r = run_audit(&app).await;
    assert_eq!((r.total(), r.exit_code()), (0, 0), "{}", audit::render(&r));
    app.stop().await;
}

/// C15: a ticketed order's charge is disputed, then the dispute closes lost: an incident on
/// creation and the tickets flagged (the event keeps them valid by default); on the lost
/// dispute the tickets are void and the order `refunded`; nothing is resold. With the event's
/// policy `void`, an open dispute voids the tickets and a won one makes them valid again.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c15_a_lost_dispute_voids_the_tickets(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &Role::ALL, VenueSpec::small(1, 1, 4)).await;
    let s = app.seats().await;
    let (lost, lost_pi) = buy(&app, s[0], "lost").await;
    settle(&app).await;
    let pool = app.pool.clone();
    let ticket_flags = |order: Uuid| {
        let pool = pool.clone();
        async move {
            sqlx::query_as::<_, (bool, bool)>(
                "SELECT voided_at IS NOT NULL, disputed_at IS NOT NULL FROM tickets WHERE order_id = $1",
            )
            .bind(order)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };

    let dispute = app.sim.open_dispute(&lost_pi).unwrap();
    eventually(WAIT, "the open dispute flagged the tickets", || async {
        ticket_flags(lost).await == (false, true)
    })
    .await;
    assert_eq!(app.count("SELECT count(*) FROM incidents WHERE kind = 'dispute_opened'").await, 1);
    assert_eq!(order_status(&app, lost).await, "ticketed");
    app.sim.close_dispute(&dispute, false).unwrap();
    eventually(WAIT, "the lost dispute voided the tickets", || async { ticket_flags(lost).await.0 }).await;
    settle(&app).await;
    assert_eq!(order_status(&app, lost).await, "refunded");
    assert_eq!(app.outbox_count("TicketsVoided", lost).await, 1);
    assert_eq!(
        app.count("SELECT count(*) FROM tickets WHERE void_reason = 'dispute_lost'").await,
        1,
        "kept, marked"
    );
    let r = run_audit(&app).await;
    assert_eq!((r.total(), r.exit_code()), (0, 0), "{}", audit::render(&r));
    // The ledger mirrors the lost dispute but the tickets stayed valid: a violation that
    // `reconcile --fix` closes. Then the closing webhook never arrived (the ledger still says
    // `needs_response`): reconcile asks the provider and closes that too.
    for ledger_dispute_status in ["lost", "needs_response"] {
        sqlx::query("UPDATE tickets SET voided_at = NULL, void_reason = NULL WHERE order_id = $1")
            .bind(lost)
            .execute(&app.pool)
            .await
            .unwrap();
        sqlx::query("UPDATE orders SET status = 'ticketed' WHERE id = $1")
            .bind(lost)
            .execute(&app.pool)
            .await
            .unwrap();
        sqlx::query("UPDATE payments SET dispute_status = $2 WHERE order_id = $1")
            .bind(lost)
            .bind(ledger_dispute_status)
            .execute(&app.pool)
            .await
            .unwrap();
        let r = run_audit(&app).await;
        let kind = if ledger_dispute_status == "lost" {
            assert_eq!(r.ledger.tickets_valid_after_refund, 1, "{}", audit::render(&r));
            DriftKind::TicketsValidAfterDisputeLost
        } else {
            DriftKind::DisputeNotInLedger
        };
        assert_eq!(provider(&r).drift_count(kind), 1, "{}", audit::render(&r));
        assert_eq!(r.exit_code(), 1);
        let fixed = run_reconcile(&app, true).await;
        assert!(fixed.facts_emitted >= 1, "{}", reconcile::render(&fixed));
        eventually(WAIT, "the saga voided the tickets of the lost dispute", || async {
            ticket_flags(lost).await.0
        })
        .await;
        settle(&app).await;
        assert_eq!(order_status(&app, lost).await, "refunded");
        let r = run_audit(&app).await;
        assert_eq!((r.total(), r.exit_code()), (0, 0), "{}", audit::render(&r));
    }
    // The seat is not back on sale.
    let b = app.buyer();
    let (status, code, _) =
        crate::helpers::problem(app.hold(&b, &app.admission_token(&b), "resale", &[s[0]]).await).await;
    assert_eq!((status, code.as_str()), (409, "seat_unavailable"));

    // Only an operator's explicit choice puts it back on sale; the voided ticket stays.
    use boxoffice_store::tickets::Resale;
    match boxoffice::commands::resell(&app.pool, boxoffice_domain::OrderId(lost)).await.unwrap() {
        Resale::Released(seats) => assert_eq!(seats.len(), 1),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        boxoffice::commands::resell(&app.pool, boxoffice_domain::OrderId(lost)).await.unwrap(),
        Resale::Nothing,
        "a second resell changes nothing"
    );
    assert_eq!(app.outbox_count("SeatsReturnedToSale", lost).await, 1);
    let (resold, _) = buy(&app, s[0], "resold").await;
    settle(&app).await;
    assert_eq!(
        (order_status(&app, resold).await.as_str(), valid_tickets(&app, resold).await),
        ("ticketed", 1)
    );
    assert_eq!(
        app.count("SELECT count(*) FROM tickets WHERE void_reason = 'dispute_lost' AND seat_released_at IS NOT NULL").await,
        1,
        "the voided ticket is kept"
    );
    let r = run_audit(&app).await;
    assert_eq!((r.total(), r.exit_code()), (0, 0), "{}", audit::render(&r));

    // The event voids tickets under an open dispute; a won dispute restores them.
    assert!(boxoffice_store::venue::set_dispute_policy(
        &app.pool,
        boxoffice_domain::EventId(app.event),
        "void"
    )
    .await
    .unwrap());
    let (won, won_pi) = buy(&app, s[1], "won").await;
    settle(&app).await;
    let dispute = app.sim.open_dispute(&won_pi).unwrap();
    eventually(WAIT, "the open dispute voided the tickets", || async { ticket_flags(won).await.0 }).await;
    app.sim.close_dispute(&dispute, true).unwrap();
    eventually(WAIT, "the won dispute restored the tickets", || async {
        ticket_flags(won).await == (false, false)
    })
    .await;
    settle(&app).await;
    assert_eq!(order_status(&app, won).await, "ticketed");
    let r = run_audit(&app).await;
    assert_eq!((r.total(), r.exit_code()), (0, 0), "{}", audit::render(&r));
    app.stop().await;
}
