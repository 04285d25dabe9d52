//! Case C19: the hold's lifetime under our own lag. A buyer who sees a client secret has the
//! whole payment window whatever the hold's TTL; an authorization the provider reports while
//! the hold is live survives a saga that lags past the TTL (neither the expiry worker nor a
//! competing buyer takes the seats); a claim the provider refutes protects nothing. Real
//! PostgreSQL, broker and simulator; the clock that matters is the database's, awaited.

use crate::helpers::{eventually, problem, Buyer, TestApp};
use boxoffice::runtime::Role;
use boxoffice_store::venue::VenueSpec;
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::time::Duration;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

async fn held(app: &TestApp, b: &Buyer, seat: Uuid, key: &str) -> Uuid {
    let r = app.hold(b, &app.admission_token(b), key, &[seat]).await;
    assert_eq!(r.status(), 202);
    r.json::<serde_json::Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap()
}

/// Two buyers, each with a payable hold on one of the first two seats: the one who will pay
/// and the one who will walk away. Returns `(payer, paid order, walked order)`.
async fn payer_and_walker(app: &TestApp, s: &[Uuid]) -> (Buyer, Uuid, Uuid) {
    let (payer, walker) = (app.buyer(), app.buyer());
    let paid = held(app, &payer, s[0], "pay").await;
    let walked = held(app, &walker, s[1], "walk").await;
    app.await_order(&payer, paid, WAIT, |v| v.get("client_secret").is_some()).await;
    app.await_order(&walker, walked, WAIT, |v| v.get("client_secret").is_some()).await;
    (payer, paid, walked)
}

/// `(status, seconds from payable_at to expires_at, seconds past created_at + ttl now)`.
async fn hold_times(app: &TestApp, order: Uuid) -> (String, f64, f64) {
    sqlx::query_as(
        "SELECT status,
                EXTRACT(EPOCH FROM expires_at - payable_at)::float8,
                EXTRACT(EPOCH FROM clock_timestamp() - created_at)::float8 - $2
           FROM holds WHERE order_id = $1",
    )
    .bind(order)
    .bind(app.cfg.hold_ttl_ms as f64 / 1_000.0)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

async fn hold_status(app: &TestApp, order: Uuid) -> String {
    sqlx::query_scalar("SELECT status FROM holds WHERE order_id = $1")
        .bind(order)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// Waits until the database clock is `secs` past the hold's end (its `expires_at` and any
/// protection), so the expiry worker (every 50 ms here) has had every chance to take it.
async fn past_hold_end(app: &TestApp, order: Uuid, column: &str, secs: f64) {
    let pool = app.pool.clone();
    let sql = format!(
        "SELECT clock_timestamp() > {column} + make_interval(secs => $2) FROM holds WHERE order_id = $1"
    );
    eventually(WAIT, "the database clock passed the hold's end", || {
        let (pool, sql) = (pool.clone(), sql.clone());
        async move { sqlx::query_scalar::<_, bool>(&sql).bind(order).bind(secs).fetch_one(&pool).await.unwrap() }
    })
    .await;
}

/// Waits until the hold of `order` is in `status`.
async fn await_hold_status(app: &TestApp, order: Uuid, status: &str, what: &str) {
    eventually(WAIT, what, || async { hold_status(app, order).await == status }).await;
}

async fn outcomes(app: &TestApp) -> boxoffice_store::outcomes::Outcomes {
    boxoffice_store::outcomes::read(&app.pool, Some(app.event), app.cfg.hold_policy().payment_window)
        .await
        .unwrap()
}

/// Every role, a 1 s TTL, a 1.5 s payment window and a provider check that waits up to
/// 10 min: a payable hold reaches its end in seconds, and rule 3's answer ends the wait.
async fn with_provider_check(opts: PgConnectOptions) -> TestApp {
    TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| {
        c.hold_ttl_ms = 1_000;
        c.payment_window_ms = Some(1_500);
        c.hold_provider_check_ms = 600_000;
    })
    .await
}

/// The provider checks (rule 3's re-fetches) asked for `orders`.
async fn provider_checks(app: &TestApp, orders: &[Uuid]) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE event_type = 'PaymentIntentRefreshRequested'
            AND payload->'payload'->>'reason' = $1 AND message_key = ANY($2)",
    )
    .bind(boxoffice_store::holds::PROVIDER_CHECK_REASON)
    .bind(orders.iter().map(Uuid::to_string).collect::<Vec<_>>())
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

/// Rule 1: the PaymentIntent recorded pushes the hold's end to at least the payment window
/// (4 s here, with a 1 s TTL); the buyer pays after the TTL has long passed and is ticketed.
/// A buyer who walks away still loses the hold, when the window ends.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c19_the_payment_window_outlives_the_ttl(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| {
        c.hold_ttl_ms = 1_000;
        c.payment_window_ms = Some(4_000);
        c.hold_ceiling_ms = Some(10_000);
    })
    .await;
    let s = app.seats().await;
    let (payer, paid, walked) = payer_and_walker(&app, &s).await;
    let (status, window_s, _) = hold_times(&app, paid).await;
    assert_eq!(status, "active");
    assert!(window_s >= 3.99, "payable with {window_s} s left, the window is 4 s");

    // Well past the TTL (1 s after it), the hold is still the buyer's.
    past_hold_end(&app, paid, "created_at", 2.0).await;
    assert_eq!(hold_status(&app, paid).await, "active", "the TTL alone does not end a payable hold");
    app.pay(&payer, paid, "pm_card_visa").await.expect("authorized");
    app.await_order(&payer, paid, WAIT, |v| v["status"] == "ticketed").await;

    // The buyer who never pays loses the hold once the window is over.
    await_hold_status(&app, walked, "expired", "the abandoned hold expired").await;
    let o = outcomes(&app).await;
    assert_eq!(
        (o.expired_abandoned, o.expired_never_payable, o.lost_after_authorization),
        (1, 0, 0),
        "{o:?}"
    );
    assert_eq!(o.hold_to_payable_ms.count, 2);
    app.assert_drained_and_clean().await;
    app.stop().await;
}

/// Rule 2: the saga goes down once the order is payable, and the buyer pays; the
/// authorization webhook protects the hold. Long past the hold's `expires_at` the expiry worker (which does expire another,
/// abandoned hold meanwhile) leaves it alone and a competing buyer gets 409; when the saga
/// comes back, the order is confirmed and ticketed. Nothing is lost after authorization.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c19_an_authorization_reported_in_time_survives_a_lagging_saga(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let mut app = TestApp::spawn_with(
        opts,
        &[Role::Api, Role::Relay, Role::Payments, Role::Expiry, Role::Tickets],
        VenueSpec::small(1, 1, 4),
        |c| {
            c.hold_ttl_ms = 1_000;
            c.payment_window_ms = Some(1_500);
            c.hold_ceiling_ms = Some(3_000);
            c.authorization_settle_ms = 120_000;
        },
    )
    .await;
    app.start_roles(&[Role::Saga]).await;
    let s = app.seats().await;
    let rival = app.buyer();
    let (payer, paid, walked) = payer_and_walker(&app, &s).await;
    app.stop_late_roles().await;
    app.pay(&payer, paid, "pm_card_visa").await.expect("authorized");
    let pool = app.pool.clone();
    eventually(WAIT, "the authorization webhook protected the hold", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT authorization_reported_at IS NOT NULL AND authorized_until > expires_at FROM holds WHERE order_id = $1",
            )
            .bind(paid)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    })
    .await;

    // The abandoned hold expires (the expiry worker runs); the protected one does not, long
    // after its own expires_at, and its seat is not for anyone else.
    await_hold_status(&app, walked, "expired", "the abandoned hold expired").await;
    past_hold_end(&app, paid, "expires_at", 1.0).await;
    assert_eq!(hold_status(&app, paid).await, "active", "the expiry worker left the authorized hold alone");
    let (status, code, _) =
        problem(app.hold(&rival, &app.admission_token(&rival), "rival", &[s[0]]).await).await;
    assert_eq!((status, code.as_str()), (409, "seat_unavailable"));

    // The saga comes back and settles it.
    app.start_roles(&[Role::Saga]).await;
    app.await_order(&payer, paid, WAIT, |v| v["status"] == "ticketed").await;
    let o = outcomes(&app).await;
    assert_eq!((o.lost_after_authorization, o.expired_never_payable), (0, 0), "{o:?}");
    assert_eq!(o.authorization_to_confirmation_ms.count, 1);
    assert!(
        o.authorization_to_confirmation_ms.p50.unwrap() >= 1_000.0,
        "{o:?}: the saga lagged past the TTL"
    );
    app.assert_drained_and_clean().await;
    app.stop().await;
}

/// A signed authorization claim the provider refutes (the PaymentIntent was never paid):
/// the protection it set is cleared by the re-fetch and the hold ends with its window.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c19_a_refuted_authorization_claim_protects_nothing(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| {
        c.hold_ttl_ms = 1_000;
        c.payment_window_ms = Some(1_500);
        c.authorization_settle_ms = 600_000;
    })
    .await;
    let s = app.seats().await;
    let b = app.buyer();
    let order = held(&app, &b, s[0], "claim").await;
    let v = app.await_order(&b, order, WAIT, |v| v.get("client_secret").is_some()).await;
    let pi = v["payment_intent_id"].as_str().unwrap().to_owned();
    let amount: i64 = sqlx::query_scalar("SELECT amount_minor FROM orders WHERE id = $1")
        .bind(order)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let body = serde_json::to_vec(&json!({
        "id": "evt_forged_authorization", "object": "event", "type": "payment_intent.amount_capturable_updated",
        "created": chrono::Utc::now().timestamp(), "livemode": false, "api_version": "2024-06-20",
        "pending_webhooks": 1, "request": null,
        "data": {"object": {"id": pi, "object": "payment_intent", "status": "requires_capture", "amount": amount,
                 "amount_capturable": amount, "amount_received": 0, "currency": "usd", "capture_method": "manual",
                 "metadata": {"order_id": order.to_string()}}}
    }))
    .unwrap();
    assert_eq!(app.deliver_webhook(body).await, 200);
    let pool = app.pool.clone();
    eventually(WAIT, "the refuted claim's hold expired", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT status = 'expired' AND authorized_until IS NULL FROM holds WHERE order_id = $1",
            )
            .bind(order)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    })
    .await;
    app.await_order(&b, order, WAIT, |v| v["status"] == "expired").await;
    let o = outcomes(&app).await;
    assert_eq!((o.lost_after_authorization, o.expired_abandoned), (0, 1), "{o:?}");
    app.assert_drained_and_clean().await;
    app.stop().await;
}

/// Rule 1's other half: a hold the pipeline never makes payable (no payment worker runs)
/// does not lapse at its TTL, the buyer never having had a chance, but at the ceiling; and
/// the outcome report counts it as never payable (our fault).
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c19_a_hold_never_made_payable_waits_for_the_ceiling(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn_with(opts, &[Role::Api, Role::Expiry], VenueSpec::small(1, 1, 4), |c| {
        c.hold_ttl_ms = 1_000;
        c.payment_window_ms = Some(900);
        c.hold_ceiling_ms = Some(3_000);
    })
    .await;
    let s = app.seats().await;
    let b = app.buyer();
    let order = held(&app, &b, s[0], "never").await;
    past_hold_end(&app, order, "expires_at", 1.0).await;
    assert_eq!(hold_status(&app, order).await, "active", "not payable yet: the TTL alone does not end it");
    past_hold_end(&app, order, "payable_by", 0.0).await;
    await_hold_status(&app, order, "expired", "the hold expired at the ceiling").await;
    let o = outcomes(&app).await;
    assert_eq!((o.expired_never_payable, o.expired_abandoned), (1, 0), "{o:?}");
    app.stop().await;
}

/// Rule 3: the provider's webhooks never arrive (every delivery is lost), and the buyer pays
/// in time. At the hold's end the expiry worker asks the provider instead of releasing it,
/// finds the authorization, and the order is ticketed rather than cancelled. A buyer who
/// walked away is asked about too and lapses with the answer, long before the wait (10 min
/// here) would have run out.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c19_a_silent_authorization_is_found_before_the_hold_lapses(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = with_provider_check(opts).await;
    app.sim.set_webhook_url(None);
    let s = app.seats().await;
    let (payer, paid, walked) = payer_and_walker(&app, &s).await;
    app.pay(&payer, paid, "pm_card_visa").await.expect("authorized at the provider");

    app.await_order(&payer, paid, WAIT, |v| v["status"] == "ticketed").await;
    await_hold_status(&app, walked, "expired", "the abandoned hold lapsed with the provider's answer").await;
    assert_eq!(provider_checks(&app, &[paid, walked]).await, 2, "one provider check per hold at its end");
    let o = outcomes(&app).await;
    assert_eq!(
        (o.lost_after_authorization, o.expired_abandoned, o.expired_never_payable),
        (0, 1, 0),
        "{o:?}"
    );
    app.assert_drained_and_clean().await;
    app.stop().await;
}

/// Rule 2 against a slow provider: the hold's own provider check (rule 3) reads its
/// PaymentIntent unpaid, and while that answer is on its way back (3 s) the buyer pays and the
/// authorization webhook protects the hold. The older answer, recorded after the claim, must
/// neither clear the protection nor end the provider check: the re-fetch asked once more finds
/// the authorization, and the buyer is ticketed.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c19_an_answer_older_than_an_authorization_claim_leaves_the_hold_protected(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use boxoffice_stripe_sim::Faults;
    let app = with_provider_check(opts).await;
    let s = app.seats().await;
    let b = app.buyer();
    let order = held(&app, &b, s[0], "slow-answer").await;
    app.await_order(&b, order, WAIT, |v| v.get("client_secret").is_some()).await;
    let reads = app.sim.stats().reads;
    app.sim.set_faults(Faults { answer_delay_ms: 3_000, ..Faults::default() });
    let sim = &app.sim;
    eventually(WAIT, "the hold's provider check read the PaymentIntent", || async {
        sim.stats().reads > reads
    })
    .await;
    app.sim.set_faults(Faults::default());
    app.pay(&b, order, "pm_card_visa").await.expect("authorized at the provider");

    app.await_order(&b, order, WAIT, |v| v["status"] == "ticketed").await;
    assert_eq!(provider_checks(&app, &[order]).await, 1, "the slow answer was the hold's provider check");
    let o = outcomes(&app).await;
    assert_eq!(o.lost_after_authorization, 0, "{o:?}");
    app.assert_drained_and_clean().await;
    app.stop().await;
}

/// Waits until the database clock is past `t` by more than 10 ms.
async fn clock_past(pool: &sqlx::PgPool, t: chrono::DateTime<chrono::Utc>) {
    eventually(WAIT, "the database clock moved on", || async {
        sqlx::query_scalar::<_, bool>("SELECT clock_timestamp() > $1 + interval '10 ms'")
            .bind(t)
            .fetch_one(pool)
            .await
            .unwrap()
    })
    .await;
}

/// Rule 2's clock for a webhook claim: a claim repeated later extends no protection (it counts
/// from the first claim no re-fetch has refuted), the provider's own report counts from now,
/// and once a re-fetch refuted the claim, the next claim starts afresh.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c19_repeated_authorization_claims_extend_no_protection(_: PgPoolOptions, opts: PgConnectOptions) {
    use boxoffice_store::holds::{self, Report};
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let seat = app.seats().await[0];
    let b = app.buyer();
    let order = held(&app, &b, seat, "claims").await;
    let policy = app.cfg.hold_policy();
    let protect = |report: Report| {
        let (pool, policy) = (app.pool.clone(), policy);
        async move {
            let mut tx = pool.begin().await.unwrap();
            assert!(holds::protect_authorized(&mut tx, boxoffice_domain::OrderId(order), &policy, report)
                .await
                .unwrap());
            tx.commit().await.unwrap();
        }
    };
    let until = || async {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
            "SELECT authorized_until FROM holds WHERE order_id = $1",
        )
        .bind(order)
        .fetch_one(&app.pool)
        .await
        .unwrap()
    };
    protect(Report::Claim).await;
    let first = until().await;
    clock_past(&app.pool, first - chrono::Duration::from_std(policy.settle).unwrap()).await;
    protect(Report::Claim).await;
    assert_eq!(until().await, first, "a repeated claim extends nothing");
    protect(Report::Provider { capture_before: None }).await;
    let confirmed = until().await;
    assert!(confirmed > first, "the provider's report counts from now");

    let mut tx = app.pool.begin().await.unwrap();
    assert!(holds::clear_protection(&mut tx, boxoffice_domain::OrderId(order)).await.unwrap());
    tx.commit().await.unwrap();
    clock_past(&app.pool, confirmed - chrono::Duration::from_std(policy.settle).unwrap()).await;
    protect(Report::Claim).await;
    assert!(until().await > confirmed, "a claim after a refutation starts afresh");
    app.stop().await;
}

/// An abandoned hold's order is final (`expired`) before its PaymentIntent is canceled: the
/// cancel is a fact the payment worker acts on, calling the provider and then recording the
/// answer. With the payment worker down, the drain that every drill and the bench run before
/// their audit must not call the pipeline idle (the provider and the ledger would disagree
/// the moment the worker's cancel lands); once the worker is back, it drains with the cancel
/// recorded and the ledger checks clean.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn an_expired_orders_pending_cancel_holds_the_drain(_: PgPoolOptions, opts: PgConnectOptions) {
    use boxoffice_harness::drain::Drain;
    // The payment window (4 s) outlasts stopping the payment worker, so the cancel is asked
    // of a worker that is down.
    let mut app = TestApp::spawn_with(
        opts,
        &[Role::Api, Role::Relay, Role::Saga, Role::Expiry, Role::Tickets],
        VenueSpec::small(1, 1, 4),
        |c| {
            c.hold_ttl_ms = 1_000;
            c.payment_window_ms = Some(4_000);
            c.hold_ceiling_ms = Some(6_000);
            c.hold_provider_check_ms = 0;
        },
    )
    .await;
    app.start_roles(&[Role::Payments]).await;
    let s = app.seats().await;
    let walker = app.buyer();
    let walked = held(&app, &walker, s[0], "walk").await;
    app.await_order(&walker, walked, WAIT, |v| v.get("client_secret").is_some()).await;
    app.stop_late_roles().await;
    assert_eq!(hold_status(&app, walked).await, "active", "the worker stopped before the hold ended");

    app.await_order(&walker, walked, WAIT, |v| v["status"] == "expired").await;
    let cancel_published = || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT published_at IS NOT NULL FROM outbox
              WHERE event_type = 'AuthorizationCancelRequested' AND message_key = $1",
        )
        .bind(walked.to_string())
        .fetch_optional(&app.pool)
        .await
        .unwrap()
            == Some(true)
    };
    eventually(WAIT, "the cancel request was published", cancel_published).await;
    let waiting = Drain::orders_of(app.event, Duration::ZERO).run(&app.pool).await.unwrap();
    assert_eq!(
        (waiting.done, waiting.open_orders, waiting.pending_cancels, waiting.unpublished),
        (false, 0, Some(1), 0),
        "every order final and the outbox empty, but the cancel is not done: {waiting}"
    );

    app.start_roles(&[Role::Payments]).await;
    let drained = Drain::orders_of(app.event, WAIT).run(&app.pool).await.unwrap();
    assert!(drained.done, "{drained}");
    let status: String = sqlx::query_scalar("SELECT status FROM payments WHERE order_id = $1")
        .bind(walked)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(status, "canceled", "the drain ended with the cancel mirrored");
    app.assert_drained_and_clean().await;
    app.stop().await;
}

/// The moment the drain now waits out, as the audit sees it: the payment worker's cancel
/// succeeds at the provider and the worker fails before its transaction begins (fault point
/// `payments.after_remote`; a crash or a lost connection there does the same), so the ledger
/// still shows the PaymentIntent uncanceled until a retry records it. Once the provider's
/// webhook of the cancel is in and its re-fetch command published (the re-fetch fails at the
/// same fault), every order is final (one ticketed, one expired) and the outbox empty, and
/// the audit counts `cancel_not_in_ledger`: a drain that stopped there would fail a healthy
/// run. The drain counts the expired order alone (not the ticketed one), and once the retry
/// lands it ends with the audit clean against the provider and no dead letter.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn an_audit_before_a_cancel_is_committed_sees_drift_the_drain_waits_out(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use boxoffice::audit;
    use boxoffice::reconcile::DriftKind;
    use boxoffice_harness::drain::Drain;
    // The payment window (10 s) outlasts the payer's purchase, so the fault is armed before
    // the walker's hold ends.
    // Retries while the fault is armed come 2 s, then 5 s apart (not a minute), so the one
    // after it is cleared lands well within the drain's wait, and the eight attempts outlast
    // the audit (about 25 s) before the command could be dead-lettered.
    let app = TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| {
        c.hold_ttl_ms = 1_000;
        c.payment_window_ms = Some(10_000);
        c.hold_ceiling_ms = Some(15_000);
        c.hold_provider_check_ms = 0;
        c.consumer_retry_5s_delay_ms = 2_000;
        c.consumer_retry_1m_delay_ms = 5_000;
    })
    .await;
    let s = app.seats().await;
    let (payer, paid, walked) = payer_and_walker(&app, &s).await;
    app.pay(&payer, paid, "pm_card_visa").await.expect("authorized");
    app.await_order(&payer, paid, WAIT, |v| v["status"] == "ticketed").await;
    boxoffice_faults::set("payments.after_remote", "return").unwrap();
    assert_eq!(hold_status(&app, walked).await, "active", "the fault is armed before the hold ends");

    let pool = app.pool.clone();
    eventually(WAIT, "the walker's order expired", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>("SELECT status FROM orders WHERE id = $1")
                .bind(walked)
                .fetch_one(&pool)
                .await
                .unwrap()
                == "expired"
        }
    })
    .await;
    // The walker's PaymentIntent canceled at the provider while the ledger does not say so:
    // only the armed fault keeps them apart (the payer's intent was captured before).
    let pi: String = sqlx::query_scalar("SELECT payment_intent_id FROM payments WHERE order_id = $1")
        .bind(walked)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    eventually(WAIT, "the cancel reached the provider", || async {
        app.sim.payment_intent(&pi).is_some_and(|v| v["status"] == "canceled")
    })
    .await;
    let recorded: String = sqlx::query_scalar("SELECT status FROM payments WHERE order_id = $1")
        .bind(walked)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_ne!(recorded, "canceled", "the fault holds the cancel's record back");
    assert!(boxoffice_faults::fired("payments.after_remote") >= 1);
    // The provider's `payment_intent.canceled` webhook arrives on its own schedule and
    // commits a re-fetch command to the outbox. Both reads below are single snapshots, so
    // the webhook must be in and its command published first (the re-fetch itself fails at
    // the armed fault, like the cancel's retries).
    eventually(WAIT, "the cancel's webhook was recorded", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM stripe_events WHERE payment_intent_id = $1 AND type = 'payment_intent.canceled')",
        )
        .bind(&pi)
        .fetch_one(&app.pool)
        .await
        .unwrap()
    })
    .await;
    assert!(app.sim.wait_webhooks_idle(WAIT).await, "the simulator's webhooks were delivered");
    let published = Drain::outbox(WAIT, Duration::from_millis(50)).run(&app.pool).await.unwrap();
    assert!(published.done, "{published}");
    let opts = boxoffice::commands::audit_options(&app.cfg, 600_000, None, None, false).unwrap();
    let early = audit::run(&app.pool, &opts).await.unwrap();
    let waiting = Drain::orders_of(app.event, Duration::ZERO).run(&app.pool).await.unwrap();
    boxoffice_faults::clear("payments.after_remote");
    let drift = early
        .provider
        .ran()
        .expect("provider checks ran")
        .violations
        .drift_count(DriftKind::CancelNotInLedger);
    assert_eq!((drift, early.total()), (1, 1), "{}", audit::render(&early));
    assert_eq!(
        (waiting.done, waiting.open_orders, waiting.pending_cancels, waiting.unpublished),
        (false, 0, Some(1), 0),
        "the expired order alone: {waiting}"
    );

    let drained = Drain::orders_of(app.event, WAIT).run(&app.pool).await.unwrap();
    assert!(drained.done, "{drained}");
    let after = audit::run(&app.pool, &opts).await.unwrap();
    assert_eq!((after.total(), after.exit_code()), (0, 0), "{}", audit::render(&after));
    app.stop().await;
}

/// A buyer whose PaymentIntent's claims already spent their re-fetch budget (eight declined
/// cards in the hour, or forged claims) pays: the authorization's webhook asks no re-fetch and
/// so protects nothing, and the hold's own provider check (rule 3, not budgeted) finds the
/// authorization at the hold's end; the buyer is ticketed. A claim no re-fetch will check
/// must not protect the hold: that would also keep the hold from its provider check, and
/// the buyer's seats would lapse, unverified, when the protection ran out.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c19_a_buyer_past_the_claims_budget_is_found_by_the_provider_check(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| {
        c.hold_ttl_ms = 1_000;
        c.payment_window_ms = Some(4_000);
        c.hold_provider_check_ms = 600_000;
    })
    .await;
    let s = app.seats().await;
    let b = app.buyer();
    let order = held(&app, &b, s[0], "past-budget").await;
    let v = app.await_order(&b, order, WAIT, |v| v.get("client_secret").is_some()).await;
    let pi = v["payment_intent_id"].as_str().unwrap().to_owned();
    // The claims about this PaymentIntent asked for their whole budget this hour, the last
    // re-fetch made.
    sqlx::query(
        "INSERT INTO payment_intent_refetches (payment_intent_id, order_id, asked_at, last_claim_at, window_started_at, asks)
         VALUES ($1, $2, '-infinity', now(), now(), $3)",
    )
    .bind(&pi)
    .bind(order)
    .bind(boxoffice_store::stripe_events::REFETCHES_PER_PAYMENT_INTENT)
    .execute(&app.pool)
    .await
    .unwrap();
    app.pay(&b, order, "pm_card_visa").await.expect("authorized at the provider");

    app.await_order(&b, order, WAIT, |v| v["status"] == "ticketed").await;
    assert_eq!(provider_checks(&app, &[order]).await, 1, "found by the hold's provider check");
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) FROM outbox WHERE message_key = '{order}' AND event_type = 'PaymentIntentRefreshRequested'"
        ))
        .await,
        1,
        "the authorization's webhook asked no re-fetch"
    );
    let o = outcomes(&app).await;
    assert_eq!(o.lost_after_authorization, 0, "{o:?}");
    app.assert_drained_and_clean().await;
    app.stop().await;
}
