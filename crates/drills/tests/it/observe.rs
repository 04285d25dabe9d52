//! Design §16 for buyers and operators: the live order stream (`GET /orders/{id}/events`)
//! and the order timeline (`boxoffice_api::timeline`, `boxoffice timeline`).

use crate::helpers::{eventually, problem, Buyer, TestApp};
use boxoffice::runtime::Role;
use boxoffice_harness::client::{take_sse_events, SseEvent};
use boxoffice_harness::drain::Drain;
use boxoffice_store::timeline::{Actor, Slo};
use boxoffice_store::venue::VenueSpec;
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::time::{Duration, Instant};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

/// An open order stream: its events as they arrive, and whether a heartbeat was seen.
struct Stream {
    resp: reqwest::Response,
    buf: String,
    ready: std::collections::VecDeque<SseEvent>,
    heartbeats: usize,
}

impl Stream {
    async fn open(app: &TestApp, b: &Buyer, order: Uuid) -> reqwest::Response {
        reqwest::Client::new()
            .get(format!("{}/orders/{order}/events", app.api))
            .header("authorization", b.bearer())
            .header("accept", "text/event-stream")
            .send()
            .await
            .expect("request")
    }

    async fn new(app: &TestApp, b: &Buyer, order: Uuid) -> Stream {
        let resp = Self::open(app, b, order).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        assert_eq!(resp.headers()["cache-control"], "no-store");
        Stream { resp, buf: String::new(), ready: Default::default(), heartbeats: 0 }
    }

    /// The next event, or `None` when the server closed the stream.
    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            self.ready.extend(take_sse_events(&mut self.buf));
            if let Some(ev) = self.ready.pop_front() {
                return Some(ev);
            }
            let chunk = tokio::time::timeout(WAIT, self.resp.chunk()).await.expect("the stream went silent");
            let text = String::from_utf8_lossy(&chunk.expect("stream read")?).into_owned();
            self.heartbeats += text.lines().filter(|l| l.starts_with(':')).count();
            self.buf.push_str(&text);
        }
    }

    /// Events until one satisfies `pred` (returned), failing at the stream's end.
    async fn until(&mut self, seen: &mut Vec<Value>, pred: impl Fn(&Value) -> bool) -> Value {
        loop {
            let ev = self.next().await.expect("the stream ended early");
            assert_eq!(ev.event, "order", "{ev:?}");
            let v: Value = serde_json::from_str(&ev.data).unwrap();
            seen.push(v.clone());
            if pred(&v) {
                return v;
            }
        }
    }
}

async fn hold_one(app: &TestApp, b: &Buyer, seat: Uuid, key: &str) -> Uuid {
    let r = app.hold(b, &app.admission_token(b), key, &[seat]).await;
    assert_eq!(r.status(), 202);
    r.json::<Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap()
}

#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn an_order_stream_pushes_each_change_and_ends_at_the_final_state(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    // Re-reads without a notification come every 30 s: anything faster was pushed.
    let app = TestApp::spawn(opts, &Role::ALL, VenueSpec::small(1, 1, 4)).await;
    let s = app.seats().await;
    let b = app.buyer();
    let order = hold_one(&app, &b, s[0], "stream-1").await;
    let mut stream = Stream::new(&app, &b, order).await;
    let mut seen = Vec::new();
    let payable = stream.until(&mut seen, |v| v.get("client_secret").is_some()).await;
    assert_eq!(payable["order_id"], order.to_string());
    let paid_at = Instant::now();
    let pi = app.pay(&b, order, "pm_card_visa").await.expect("authorized");
    let ticketed = stream.until(&mut seen, |v| v["status"] == "ticketed").await;
    assert!(
        paid_at.elapsed() < Duration::from_secs(20),
        "ticketed {:?} after payment: pushed, not found by the 30 s re-read",
        paid_at.elapsed()
    );
    assert_eq!(ticketed["tickets"].as_array().unwrap().len(), 1);
    assert!(ticketed.get("client_secret").is_none(), "no client secret once paid");
    assert_eq!(ticketed["payment_intent_id"], pi.id);
    // Every event differs from the one before it (changes, not repeats), and the client
    // secret was only ever sent while payment was pending.
    for w in seen.windows(2) {
        assert_ne!(w[0], w[1]);
    }
    for v in &seen {
        if v.get("client_secret").is_some() {
            assert!(["held", "payment_required"].contains(&v["status"].as_str().unwrap()), "{v}");
        }
    }
    // A clean close: `event: end`, then the server ends the response.
    let end = stream.next().await.expect("an end event");
    assert_eq!(end.event, "end");
    assert!(stream.next().await.is_none(), "the stream closes after the final state");
    assert!(seen.len() <= 8, "one event per change, not per poll: {seen:?}");

    // A stream opened on a final order sends it and closes at once.
    let mut again = Stream::new(&app, &b, order).await;
    let ev = again.next().await.unwrap();
    assert_eq!(serde_json::from_str::<Value>(&ev.data).unwrap()["status"], "ticketed");
    assert_eq!(again.next().await.unwrap().event, "end");
    assert!(again.next().await.is_none());
    app.stop().await;
}

#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn woken_streams_are_answered_from_one_read(_: PgPoolOptions, opts: PgConnectOptions) {
    use boxoffice_api::order_stream::{
        read_views, Admitted, OrderStreams, Refused, StreamSettings, ViewRead,
    };
    // The orders come from the purchase path (the API alone: nothing else moves them); a hub
    // and its view reader are driven here directly, the reader started after the streams so
    // that its reads can be counted.
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let s = app.seats().await;
    let buyers: Vec<_> = (0..3).map(|_| app.buyer()).collect();
    let mut orders = Vec::new();
    for (i, b) in buyers.iter().enumerate() {
        orders.push(hold_one(&app, b, s[i], &format!("one-read-{i}")).await);
    }
    let hub = OrderStreams::new(StreamSettings::default());
    let admit = |user: Uuid, order: Uuid| hub.admit(user, "192.0.2.1".into(), order).expect("admitted");
    // Four streams of three orders (the first buyer has two), a stranger's stream of the first
    // order, and one of an order that does not exist.
    let mut streams: Vec<_> = buyers.iter().zip(&orders).map(|(b, o)| (admit(b.user, *o), *o)).collect();
    streams.push((admit(buyers[0].user, orders[0]), orders[0]));
    let mut stranger = admit(buyers[1].user, orders[0]);
    let mut ghost = admit(buyers[0].user, Uuid::new_v4());
    let stop = tokio_util::sync::CancellationToken::new();
    let reader = tokio::spawn(read_views(app.pool.clone(), hub.clone(), stop.clone()));

    async fn next(st: &mut Admitted) -> ViewRead {
        tokio::time::timeout(WAIT, st.next_view()).await.expect("a view").expect("reader running")
    }
    async fn owned_view(st: &mut Admitted, order: Uuid) {
        match next(st).await {
            ViewRead::Order(Some(v)) => assert_eq!(v.order_id, order),
            other => panic!("expected the order, got {other:?}"),
        }
    }
    for (st, order) in &mut streams {
        owned_view(st, *order).await;
    }
    assert!(matches!(next(&mut stranger).await, ViewRead::Order(None)), "someone else's order reads as none");
    assert!(matches!(next(&mut ghost).await, ViewRead::Order(None)), "no such order reads as none");
    assert_eq!(hub.reads(), 1, "the first views of six streams come from one read");

    // A notification naming the three orders, one nobody here watches and junk: one more read,
    // and every stream of the three gets a view (the stranger's: none).
    let unwatched = Uuid::new_v4().to_string();
    let named: Vec<String> = orders.iter().map(Uuid::to_string).collect();
    let woken = hub.notify(named.iter().map(String::as_str).chain([unwatched.as_str(), "junk"]));
    assert_eq!(woken, 3);
    for (st, order) in &mut streams {
        owned_view(st, *order).await;
    }
    assert!(matches!(next(&mut stranger).await, ViewRead::Order(None)));
    assert_eq!(hub.reads(), 2, "one read for every woken stream");

    // A stream's re-read marks only its own order: one read, one view, the other streams wait.
    hub.reread(orders[1]);
    let (st, order) = &mut streams[1];
    owned_view(st, *order).await;
    assert_eq!(hub.reads(), 3);
    assert!(
        !streams[0].0.has_new_view() && !streams[2].0.has_new_view(),
        "only the re-read order was handed a view"
    );

    // A row this build cannot read (a status a newer build wrote) fails alone: its streams are
    // handed a failure, the other orders of the same read their views, and it is not read
    // again until it is marked again.
    let status: String = sqlx::query_scalar("SELECT status FROM orders WHERE id = $1")
        .bind(orders[2])
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let saved_check: String = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'orders_status_check'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    sqlx::query("ALTER TABLE orders DROP CONSTRAINT orders_status_check").execute(&app.pool).await.unwrap();
    sqlx::query("UPDATE orders SET status = 'from_a_newer_build' WHERE id = $1")
        .bind(orders[2])
        .execute(&app.pool)
        .await
        .unwrap();
    hub.notify(named.iter().map(String::as_str));
    for (st, order) in &mut streams {
        if *order == orders[2] {
            assert!(matches!(next(st).await, ViewRead::Failed));
        } else {
            owned_view(st, *order).await;
        }
    }
    assert_eq!(hub.reads(), 4, "one read for the three");
    // The bad row is not marked again: the next read (of the first order) does not include it.
    hub.reread(orders[0]);
    owned_view(&mut streams[0].0, orders[0]).await;
    assert_eq!(hub.reads(), 5);
    assert!(!streams[2].0.has_new_view(), "a row this build cannot read is not read again unasked");

    // One reader per hub: a second one returns at once and reads nothing.
    tokio::time::timeout(WAIT, read_views(app.pool.clone(), hub.clone(), stop.clone()))
        .await
        .expect("a second reader returns at once");
    hub.reread(orders[1]);
    owned_view(&mut streams[1].0, orders[1]).await;
    assert_eq!(hub.reads(), 6);

    // When the reader ends, its streams end and new ones are refused, instead of waiting.
    stop.cancel();
    reader.await.unwrap();
    assert!(streams[0].0.next_view().await.is_err(), "an open stream ends with its reader");
    assert_eq!(hub.admit(buyers[0].user, "192.0.2.1".into(), orders[0]).unwrap_err(), Refused::Stopped);
    assert!(hub.reader_stopped());
    // Closed streams give their places back.
    drop((streams, stranger, ghost));
    assert_eq!(hub.open(), 0);
    sqlx::query("UPDATE orders SET status = $2 WHERE id = $1")
        .bind(orders[2])
        .bind(status)
        .execute(&app.pool)
        .await
        .unwrap();
    let check: String = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'orders_status_check'",
    )
    .fetch_optional(&app.pool)
    .await
    .unwrap()
    .unwrap_or_default();
    assert!(check.is_empty(), "dropped above");
    sqlx::query(&format!("ALTER TABLE orders ADD CONSTRAINT orders_status_check {saved_check}"))
        .execute(&app.pool)
        .await
        .unwrap();
    app.stop().await;
}

/// A view read that fails as a whole is tried again with its orders in smaller reads (halved
/// down to one order, doubled back with each read that succeeds): with the first two reads of
/// four orders failing (four, then two), every stream still gets its own order, in statements
/// of one, two and one; the next read of all four is one statement again. A row that cannot be
/// decoded (a missing value) fails alone, and the other orders of its statement are read.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_failed_view_read_is_split_and_every_stream_still_gets_its_view(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use boxoffice_api::order_stream::{read_views, Admitted, OrderStreams, StreamSettings, ViewRead};
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let s = app.seats().await;
    let buyers: Vec<_> = (0..4).map(|_| app.buyer()).collect();
    let mut orders = Vec::new();
    for (i, b) in buyers.iter().enumerate() {
        orders.push(hold_one(&app, b, s[i], &format!("split-{i}")).await);
    }
    let hub = OrderStreams::new(StreamSettings::default());
    let mut streams: Vec<_> = buyers
        .iter()
        .zip(&orders)
        .map(|(b, o)| (hub.admit(b.user, "192.0.2.1".into(), *o).expect("admitted"), *o))
        .collect();
    boxoffice_faults::set("order_stream.read", "2*return").unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let reader = tokio::spawn(read_views(app.pool.clone(), hub.clone(), stop.clone()));

    /// The stream's next view that is not a failure (a failed read hands its streams a
    /// failure; they stay open and wait for the next view).
    async fn own_view(st: &mut Admitted, order: Uuid) {
        loop {
            match tokio::time::timeout(WAIT, st.next_view()).await.expect("a view").expect("reader running") {
                ViewRead::Failed => continue,
                ViewRead::Order(Some(v)) => return assert_eq!(v.order_id, order),
                other => panic!("expected the order, got {other:?}"),
            }
        }
    }
    for (st, order) in &mut streams {
        own_view(st, *order).await;
    }
    assert_eq!(boxoffice_faults::fired("order_stream.read"), 2);
    assert_eq!(hub.reads(), 3, "reads of 4 and 2 orders failed, then statements of 1, 2 and 1");
    boxoffice_faults::clear("order_stream.read");

    // Good reads doubled the size back: the four orders are one statement again.
    let named: Vec<String> = orders.iter().map(Uuid::to_string).collect();
    assert_eq!(hub.notify(named.iter().map(String::as_str)), 4);
    for (st, order) in &mut streams {
        own_view(st, *order).await;
    }
    assert_eq!(hub.reads(), 4);

    // A row with a value missing (written by hand here; the schema forbids it) cannot be
    // decoded: its streams are handed a failure, the other three orders of the same statement
    // their views.
    let currency: String = sqlx::query_scalar("SELECT currency FROM orders WHERE id = $1")
        .bind(orders[3])
        .fetch_one(&app.pool)
        .await
        .unwrap();
    sqlx::query("ALTER TABLE orders ALTER COLUMN currency DROP NOT NULL").execute(&app.pool).await.unwrap();
    sqlx::query("UPDATE orders SET currency = NULL WHERE id = $1")
        .bind(orders[3])
        .execute(&app.pool)
        .await
        .unwrap();
    assert_eq!(hub.notify(named.iter().map(String::as_str)), 4);
    for (st, order) in &mut streams {
        if *order == orders[3] {
            let read =
                tokio::time::timeout(WAIT, st.next_view()).await.expect("a view").expect("reader running");
            assert!(matches!(read, ViewRead::Failed), "an undecodable row fails: {read:?}");
        } else {
            own_view(st, *order).await;
        }
    }
    assert_eq!(hub.reads(), 5, "one statement for the four");
    sqlx::query("UPDATE orders SET currency = $2 WHERE id = $1")
        .bind(orders[3])
        .bind(currency)
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query("ALTER TABLE orders ALTER COLUMN currency SET NOT NULL").execute(&app.pool).await.unwrap();
    stop.cancel();
    reader.await.unwrap();
    app.stop().await;
}

#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn order_streams_belong_to_the_owner_are_capped_per_user_and_beat(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| {
        c.order_stream_max_per_user = 2;
        c.order_stream_max_per_ip = 3;
        c.order_stream_heartbeat_s = 1;
    })
    .await;
    let s = app.seats().await;
    let b = app.buyer();
    let order = hold_one(&app, &b, s[0], "cap-1").await;

    // Another buyer, an unknown order, no token: the answers of GET /orders/{id}.
    let other = app.buyer();
    let (status, code, _) = problem(Stream::open(&app, &other, order).await).await;
    assert_eq!((status, code.as_str()), (404, "not_found"));
    let (status, _, _) = problem(Stream::open(&app, &b, Uuid::new_v4()).await).await;
    assert_eq!(status, 404);
    let anonymous = reqwest::get(format!("{}/orders/{order}/events", app.api)).await.unwrap();
    assert_eq!(anonymous.status(), 401);
    let junk = reqwest::Client::new()
        .get(format!("{}/orders/not-a-uuid/events", app.api))
        .header("authorization", b.bearer())
        .send()
        .await
        .unwrap();
    assert_eq!(junk.status(), 400);

    // Two streams per user; the third is refused with problem+json; closing one frees a slot.
    let mut first = Stream::new(&app, &b, order).await;
    let second = Stream::new(&app, &b, order).await;
    let refused = Stream::open(&app, &b, order).await;
    assert_eq!(refused.headers()["retry-after"], "5");
    let (status, code, body) = problem(refused).await;
    assert_eq!((status, code.as_str()), (429, "too_many_streams"), "{body}");
    assert_eq!(body["scope"], "user");
    // Another user is not affected by this user's streams.
    let order_c = hold_one(&app, &other, s[1], "cap-2").await;
    let _theirs = Stream::new(&app, &other, order_c).await;
    drop(second);
    let (api, bearer) = (app.api.clone(), b.bearer());
    eventually(WAIT, "a closed stream frees its slot", || {
        let (api, bearer) = (api.clone(), bearer.clone());
        async move {
            let r = reqwest::Client::new()
                .get(format!("{api}/orders/{order}/events"))
                .header("authorization", bearer)
                .send()
                .await
                .unwrap();
            r.status() == 200
        }
    })
    .await;

    // One client address (every buyer here is 127.0.0.1): 3 streams at most, whoever opens them.
    let third = app.buyer();
    let order_t = hold_one(&app, &third, s[2], "cap-3").await;
    let _t1 = Stream::new(&app, &third, order_t).await;
    let refused = Stream::open(&app, &third, order_t).await;
    let (status, code, body) = problem(refused).await;
    assert_eq!(
        (status, code.as_str(), body["scope"].as_str()),
        (429, "too_many_streams", Some("ip")),
        "{body}"
    );

    // An idle stream beats: the order does not change (nobody pays), yet comments arrive.
    first.until(&mut Vec::new(), |v| v.get("client_secret").is_some()).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while first.heartbeats < 2 {
        assert!(Instant::now() < deadline, "no heartbeat on an idle stream");
        let chunk = tokio::time::timeout(Duration::from_secs(10), first.resp.chunk()).await.unwrap().unwrap();
        let text = String::from_utf8_lossy(&chunk.expect("open")).into_owned();
        first.heartbeats += text.lines().filter(|l| l.starts_with(':')).count();
    }
    app.stop().await;
}

#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn the_timeline_tells_who_moved_a_ticketed_and_a_compensated_order(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app =
        TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| c.hold_ttl_ms = 6_000).await;
    let s = app.seats().await;
    let b = app.buyer();
    let sold = hold_one(&app, &b, s[0], "tl-1").await;
    app.pay(&b, sold, "pm_card_visa").await.expect("authorized");
    app.await_order(&b, sold, WAIT, |v| v["status"] == "ticketed").await;
    // Declined, never paid: the hold lapses and the PaymentIntent is cancelled (compensation).
    let c = app.buyer();
    let lapsed = hold_one(&app, &c, s[1], "tl-2").await;
    app.pay(&c, lapsed, "pm_card_chargeDeclined").await.expect_err("declined");
    app.await_order(&c, lapsed, WAIT, |v| v["status"] == "expired").await;
    let pool = app.pool.clone();
    eventually(WAIT, "the cancellation is recorded", || {
        let pool = pool.clone();
        async move {
            crate::helpers::outbox_count(&pool, "PaymentCanceled", lapsed).await == 1
                && boxoffice_store::outbox::backlog(&pool).await.unwrap().unpublished == 0
        }
    })
    .await;
    // The provider's webhook of the cancel arrives on its own schedule and may commit a
    // re-fetch command after the wait above; the timeline below is read twice and compared,
    // so every webhook must be in and its command published first.
    assert!(app.sim.wait_webhooks_idle(WAIT).await, "the simulator's webhooks were delivered");
    let published = Drain::outbox(WAIT, Duration::from_millis(50)).run(&pool).await.unwrap();
    assert!(published.done, "{published}");
    let gw = boxoffice_payments::StripeClient::new(boxoffice_payments::StripeConfig {
        api_base: app.cfg.stripe_api_base.clone(),
        secret_key: app.cfg.stripe_secret_key.clone(),
        timeout_ms: 5_000,
    })
    .unwrap();
    let gw: &dyn boxoffice_payments::PaymentGateway = &gw;

    let t = boxoffice_api::timeline::read(&app.pool, Some(gw), sold, Slo::default()).await.unwrap().unwrap();
    let actors: Vec<&Actor> = t.timeline.steps.iter().map(|s| &s.actor).collect();
    assert_eq!(actors[0], &Actor::BuyerRequest, "{actors:?}");
    // Each status change, the step's actor (the consumer whose transaction made it) and the
    // consumers that followed that transaction's facts through in it (boxoffice_bus::follow):
    // one process runs every role, so the saga's and the ticket worker's steps ride in the
    // payment worker's transactions.
    let moves: Vec<(String, String, String, Vec<String>)> = t
        .timeline
        .steps
        .iter()
        .flat_map(|s| {
            let by = match &s.actor {
                Actor::Consumer { consumer, applied_type, .. } => format!("{consumer}:{applied_type}"),
                other => format!("{other:?}"),
            };
            let followed: Vec<String> = s
                .facts
                .iter()
                .flat_map(|f| {
                    f.applied_by
                        .iter()
                        .filter(|a| a.in_writing_transaction)
                        .map(move |a| format!("{}:{}", a.consumer, f.event_type))
                })
                .collect();
            s.transitions.iter().map(move |t| (t.from.clone(), t.to.clone(), by.clone(), followed.clone()))
        })
        .collect();
    let capture = vec!["saga:PaymentCaptured".to_owned(), "tickets:TicketIssueRequested".to_owned()];
    let expected = vec![
        (
            "held".into(),
            "payment_required".into(),
            "payments:HoldCreated".into(),
            vec!["saga:PaymentIntentCreated".to_owned()],
        ),
        (
            "payment_required".into(),
            "confirming".into(),
            "payments:PaymentIntentRefreshRequested".into(),
            vec!["saga:PaymentAuthorized".to_owned()],
        ),
        ("confirming".into(), "paid".into(), "payments:OrderConfirmed".into(), capture.clone()),
        ("paid".into(), "ticketed".into(), "payments:OrderConfirmed".into(), capture),
    ];
    assert_eq!(moves, expected, "each status change, who made it and who followed it through");
    // Every fact is in a step after the step that wrote its cause, and was applied.
    let mut written = std::collections::HashSet::new();
    for st in &t.timeline.steps {
        if let Actor::Consumer { applied, .. } = &st.actor {
            assert!(written.contains(applied), "a step applied a fact not yet written: {st:?}");
        }
        for f in &st.facts {
            if let Some(c) = f.causation_id {
                assert!(written.contains(&c), "{} before its cause", f.event_type);
            }
            written.insert(f.event_id);
        }
    }
    assert!(t.timeline.steps.iter().any(|s| matches!(&s.actor, Actor::Webhook { .. })), "webhooks are steps");
    assert_eq!(t.provider.len(), 1);
    assert_eq!(t.provider[0].status.as_deref(), Some("succeeded"));
    assert_eq!(t.provider[0].agrees_with_ledger, Some(true));
    assert_eq!(t.provider[0].metadata_order_id.as_deref(), Some(sold.to_string().as_str()));

    let t =
        boxoffice_api::timeline::read(&app.pool, Some(gw), lapsed, Slo::default()).await.unwrap().unwrap();
    let types: Vec<&str> =
        t.timeline.steps.iter().flat_map(|s| s.facts.iter().map(|f| f.event_type.as_str())).collect();
    for want in [
        "HoldCreated",
        "PaymentIntentCreated",
        "HoldExpired",
        "AuthorizationCancelRequested",
        "PaymentCanceled",
    ] {
        assert!(types.contains(&want), "{want} in {types:?}");
    }
    let expiry =
        t.timeline.steps.iter().find(|s| s.facts.iter().any(|f| f.event_type == "HoldExpired")).unwrap();
    assert!(matches!(&expiry.actor, Actor::Sweep { .. }), "the expiry sweep: {:?}", expiry.actor);
    assert!(expiry.transitions.iter().any(|t| t.to == "expired"), "{expiry:?}");
    assert_eq!(t.provider[0].status.as_deref(), Some("canceled"));
    assert_eq!(t.provider[0].agrees_with_ledger, Some(true));

    // Facts the relay's prune moved out of the outbox are still in the story.
    let moved = boxoffice_store::outbox::prune_published(&app.pool, -60, 10_000).await.unwrap();
    assert!(moved >= 10, "{moved}");
    assert_eq!(app.count("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL").await, 0);
    let after =
        boxoffice_api::timeline::read(&app.pool, None, lapsed, Slo::default()).await.unwrap().unwrap();
    let again: Vec<&str> =
        after.timeline.steps.iter().flat_map(|s| s.facts.iter().map(|f| f.event_type.as_str())).collect();
    assert_eq!(again, types, "the order history keeps what the outbox pruned");
    assert!(after.timeline.steps.iter().flat_map(|s| &s.facts).all(|f| f.source == "order_history"));
    assert!(!after.provider_checked);
    app.stop().await;
}
