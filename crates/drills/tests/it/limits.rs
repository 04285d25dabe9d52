//! Rules the event stores in the ledger and the hold transaction enforces: per-buyer limits
//! (case C13) and the sales window (case C18). Races release their requests together through
//! a barrier.

use crate::helpers::{barrier, eventually, problem, Buyer, TestApp};
use boxoffice::config::Config;
use boxoffice::runtime::{self, Role};
use boxoffice_domain::EventId;
use boxoffice_harness::client::BuyerClient;
use boxoffice_store::venue::{self, SalesWindow, VenueSpec};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::time::Duration;
use uuid::Uuid;

async fn api(opts: PgConnectOptions) -> TestApp {
    TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 10, 10)).await
}

async fn limits(app: &TestApp, max_seats: i32, max_active_holds: i32) {
    assert!(venue::set_buyer_limits(&app.pool, EventId(app.event), max_seats, max_active_holds)
        .await
        .unwrap());
}

/// Seats of `buyer` in the ledger: unreleased rows of their live holds, plus tickets.
async fn seats_of(app: &TestApp, b: &Buyer) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM orders o JOIN holds h ON h.order_id = o.id
                   JOIN hold_seats hs ON hs.hold_id = h.id AND hs.released_at IS NULL
                  WHERE o.user_id = $1 AND h.status IN ('active', 'confirmed'))
              + (SELECT count(*) FROM tickets t JOIN orders o ON o.id = t.order_id WHERE o.user_id = $1)",
    )
    .bind(b.user)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

/// C13, one at a time: 1-seat holds with fresh keys stop at the event's seat cap with 409
/// `buyer_limit_reached` naming the limit; another buyer is unaffected.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c13_one_seat_at_a_time_stops_at_the_cap(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = api(opts).await;
    limits(&app, 8, 20).await;
    let seats = app.seats().await;
    let b = app.buyer();
    let adm = app.admission_token(&b);
    let mut statuses = vec![];
    for (i, seat) in seats.iter().take(20).enumerate() {
        let (status, code, body) = problem(app.hold(&b, &adm, &format!("k{i}"), &[*seat]).await).await;
        statuses.push(status);
        if status == 409 {
            assert_eq!(code, "buyer_limit_reached");
            assert_eq!(
                (body["limit"].as_str(), body["max"].as_i64(), body["current"].as_i64()),
                (Some("max_seats_per_buyer"), Some(8), Some(8))
            );
        }
    }
    assert_eq!(statuses.iter().filter(|s| **s == 202).count(), 8, "{statuses:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 409).count(), 12, "{statuses:?}");
    assert_eq!(seats_of(&app, &b).await, 8);

    // A replay of an accepted request still answers its original receipt (invariant 3).
    let (status, _, _) = problem(app.hold(&b, &adm, "k0", &[seats[0]]).await).await;
    assert_eq!(status, 202);

    let other = app.buyer();
    let r = app.hold(&other, &app.admission_token(&other), "other", &seats[30..38]).await;
    assert_eq!(r.status(), 202, "another buyer is unaffected");
    app.stop().await;
}

/// C13, concurrently: ten 8-seat requests from one buyer with ten keys, released together —
/// exactly one is held whatever the limits' mix, never more than 8 seats.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c13_concurrent_holds_of_one_buyer_never_pass_the_cap(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = api(opts).await;
    let seats = app.seats().await;
    for (round, max_active) in [(0usize, 1), (1, 10)] {
        limits(&app, 8, max_active).await;
        let b = app.buyer();
        let adm = app.admission_token(&b);
        let n = 10;
        let gate = barrier(n);
        let client = BuyerClient::new(app.http.clone(), app.api.clone());
        let mut tasks = vec![];
        for i in 0..n {
            let (gate, client, bearer, adm, event) =
                (gate.clone(), client.clone(), b.bearer(), adm.clone(), app.event);
            // Disjoint seats: only the buyer's cap can refuse them.
            let mine: Vec<Uuid> = seats[(i * 8)..(i * 8 + 8)].to_vec();
            tasks.push(tokio::spawn(async move {
                gate.wait().await;
                let r =
                    client.hold(&bearer, event, &adm, &format!("r{round}-{i}"), &mine).send().await.unwrap();
                problem(r).await
            }));
        }
        let mut outcomes = vec![];
        for t in tasks {
            let (status, code, _) = t.await.unwrap();
            outcomes.push((status, code));
        }
        assert_eq!(outcomes.iter().filter(|o| o.0 == 202).count(), 1, "{outcomes:?}");
        assert!(
            outcomes.iter().all(|o| o.0 == 202 || (o.0 == 409 && o.1 == "buyer_limit_reached")),
            "{outcomes:?}"
        );
        assert_eq!(seats_of(&app, &b).await, 8);
        // Release this round's seats for the next one.
        sqlx::query("UPDATE holds SET expires_at = now() - interval '1 second', payable_by = NULL, provider_check_until = NULL")
            .execute(&app.pool)
            .await
            .unwrap();
        boxoffice_store::holds::expire_due(&app.pool, 100).await.unwrap();
    }
    app.stop().await;
}

/// C13, after paying: tickets count toward the cap, so a buyer who bought 3 of 8 may hold 5
/// more and not 6.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c13_tickets_count_toward_the_cap(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &Role::ALL, VenueSpec::small(1, 2, 10)).await;
    let seats = app.seats().await;
    let b = app.buyer();
    let adm = app.admission_token(&b);
    let r = app.hold(&b, &adm, "first", &seats[0..3]).await;
    assert_eq!(r.status(), 202);
    let order: Uuid = r.json::<Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap();
    app.pay(&b, order, "pm_card_visa").await.unwrap();
    app.await_order(&b, order, Duration::from_secs(60), |v| v["status"] == "ticketed").await;
    let (status, code, body) = problem(app.hold(&b, &adm, "second", &seats[3..9]).await).await;
    assert_eq!((status, code.as_str(), body["current"].as_i64()), (409, "buyer_limit_reached", Some(3)));
    let r = app.hold(&b, &adm, "third", &seats[3..8]).await;
    assert_eq!(r.status(), 202);
    assert_eq!(seats_of(&app, &b).await, 8);
    app.stop().await;
}

async fn join(app: &TestApp, b: &Buyer) -> (u16, Value) {
    let r = BuyerClient::new(app.http.clone(), app.api.clone())
        .join_queue(&b.bearer(), app.event)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// Forgets everything the waiting room keeps for this test, as a Redis restart does (it
/// keeps nothing on disk).
async fn forget_redis(cfg: &Config) {
    let client = redis::Client::open(secrecy::ExposeSecret::expose_secret(&cfg.redis_url)).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> =
        redis::cmd("KEYS").arg(format!("{}*", cfg.redis_key_prefix)).query_async(&mut c).await.unwrap();
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL").arg(&keys).query_async(&mut c).await.unwrap();
    }
}

/// C18: the opening is the ledger's. Before it nobody holds a seat and joins go to the
/// pre-queue, also after Redis forgot the schedule; an unscheduled event sells nothing; after
/// the closing joins and holds are refused.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c18_the_sales_window_is_the_ledgers(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn_with(opts, &[Role::Api], VenueSpec::small(1, 2, 10), |c| {
        c.admission_direct = false;
        c.rate_limit_ip_per_s = 0.0;
        c.rate_limit_user_per_s = 0.0;
    })
    .await;
    let event = EventId(app.event);
    let seat = app.seats().await[0];
    let opens_at = chrono::Utc::now() + chrono::Duration::hours(1);
    venue::schedule_sales(&app.pool, event, SalesWindow { opens_at: Some(opens_at), closes_at: None })
        .await
        .unwrap();

    // A hold before the opening, even with a valid admission token.
    let b = app.buyer();
    let (status, code, body) = problem(app.hold(&b, &app.admission_token(&b), "early", &[seat]).await).await;
    assert_eq!((status, code.as_str()), (403, "sales_not_open"));
    assert!(body["opens_at"].is_string());

    // Joins before the opening are pre-queued, and stay so after Redis forgets everything.
    let (status, v) = join(&app, &b).await;
    assert_eq!((status, v["state"].as_str()), (201, Some("pre_queue")), "{v}");
    forget_redis(&app.cfg).await;
    let late = app.buyer();
    let (status, v) = join(&app, &late).await;
    assert_eq!((status, v["state"].as_str()), (201, Some("pre_queue")), "{v}");
    let room = runtime::waitroom(&app.cfg).unwrap();
    assert_eq!(
        room.release(event, 10, None).await.unwrap().admitted.len(),
        0,
        "nobody is admitted before the opening"
    );
    assert_eq!(app.count("SELECT count(*) FROM orders").await, 0);

    // Never scheduled: not on sale at all.
    venue::schedule_sales(&app.pool, event, SalesWindow { opens_at: None, closes_at: None }).await.unwrap();
    let c = app.buyer();
    let (status, code, _) =
        problem(app.hold(&c, &app.admission_token(&c), "unscheduled", &[seat]).await).await;
    assert_eq!((status, code.as_str()), (403, "sales_not_open"));

    // Closed: holds at once; joins once the API's cached window has expired.
    let past = chrono::Utc::now() - chrono::Duration::minutes(1);
    venue::schedule_sales(
        &app.pool,
        event,
        SalesWindow { opens_at: Some(past - chrono::Duration::hours(1)), closes_at: Some(past) },
    )
    .await
    .unwrap();
    let (status, code, _) = problem(app.hold(&c, &app.admission_token(&c), "closed", &[seat]).await).await;
    assert_eq!((status, code.as_str()), (403, "sales_closed"));
    let d = app.buyer();
    let client = BuyerClient::new(app.http.clone(), app.api.clone());
    eventually(Duration::from_secs(10), "joins refused after the closing", || {
        let (client, bearer, event) = (client.clone(), d.bearer(), app.event);
        async move {
            let r = client.join_queue(&bearer, event).send().await.unwrap();
            let (status, code, _) = problem(r).await;
            (status, code.as_str()) == (403, "sales_closed")
        }
    })
    .await;
    assert_eq!(app.count("SELECT count(*) FROM orders").await, 0);
    app.stop().await;
}
