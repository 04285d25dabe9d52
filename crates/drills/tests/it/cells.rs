//! Purchase cells (design §13): a token for the wrong cell or from before a move is refused
//! where the seats are, a move keeps sold seats sold, a cell's process never connects to
//! another cell's database, and the router keeps routing with its last map while the control
//! database is down (and refuses webhooks from outside the allowed networks unread).

use crate::helpers::{eventually, problem, product_bin, Extra, TestApp};
use boxoffice::config::{CellSettings, Config};
use boxoffice::runtime::{self, Role};
use boxoffice_domain::{EventId, UserId};
use boxoffice_store::cells::CellState;
use boxoffice_store::venue::VenueSpec;
use secrecy::ExposeSecret;
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// `POST path` with an empty body over a bare connection, the path exactly as given; the
/// whole answer.
async fn raw_post(addr: std::net::SocketAddr, path: &str, bearer: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: router\r\nAuthorization: {bearer}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    c.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    c.read_to_end(&mut out).await.unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// Cell 2's API (`cell-2`, then `tweak`) on `db`, migrated first, beside cell 1's `app1`.
async fn cell_two(app1: &TestApp, db: &Extra, spec: VenueSpec, tweak: impl FnOnce(&mut Config)) -> TestApp {
    let migrate = Config { database_url: db.url().into(), ..app1.cfg.clone() };
    boxoffice::commands::migrate_db(&migrate).await.unwrap().close().await;
    TestApp::spawn_with(db.opts(), &[Role::Api], spec, |c| {
        c.purchase_cell = "cell-2".into();
        tweak(c);
    })
    .await
}

fn cell(name: &str, url: String, api: Option<String>) -> CellSettings {
    CellSettings {
        name: name.into(),
        database_url: url.into(),
        kafka_topic_prefix: format!("{name}.{}.", Uuid::new_v4().simple()),
        redis_key_prefix: format!("{name}:{}:", Uuid::new_v4().simple()),
        api_url: api,
    }
}

/// The operator's configuration over both cells and the control database.
fn across(base: &Config, c1: String, c2: String, control: String, apis: [Option<String>; 2]) -> Config {
    let [a1, a2] = apis;
    Config {
        cells: vec![cell("cell-1", c1, a1), cell("cell-2", c2, a2)],
        control_database_url: Some(control.into()),
        ..base.clone()
    }
}

async fn admit(app: &TestApp, b: &crate::helpers::Buyer, event: Uuid) -> (u16, Value) {
    let r = app
        .http
        .post(format!("{}/events/{event}/admission", app.api))
        .header("authorization", b.bearer())
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

async fn hold_at(
    app: &TestApp,
    b: &crate::helpers::Buyer,
    event: Uuid,
    token: &str,
    seat: Uuid,
) -> (u16, String, Value) {
    let r = app
        .http
        .post(format!("{}/events/{event}/holds", app.api))
        .header("authorization", b.bearer())
        .header("x-admission-token", token)
        .header("idempotency-key", Uuid::new_v4().to_string())
        .json(&serde_json::json!({ "seat_ids": [seat] }))
        .send()
        .await
        .unwrap();
    problem(r).await
}

/// A new buyer of `app`'s event, admitted and holding its seat number `seat` at the cell
/// itself (not through a router), and the order id.
async fn held_at_the_cell(app: &TestApp, seat: usize) -> (crate::helpers::Buyer, String) {
    let b = app.buyer();
    let (_, token) = admit(app, &b, app.event).await;
    let seat = app.seats().await[seat];
    let (s, _, held) = hold_at(app, &b, app.event, token["admission_token"].as_str().unwrap(), seat).await;
    assert_eq!(s, 202, "{held}");
    let order = held["order_id"].as_str().unwrap().to_owned();
    (b, order)
}

/// Cell 1 sells an event, which then moves to cell 2 while a hold is open: the move freezes
/// it (new holds 503 `event_moving`), waits for the hold to settle, and copies it at epoch 2.
/// Afterwards a token minted before the move is refused by both cells (409 in the old one,
/// 403 wrong cell in the new one), a cell-2 token for epoch 1 is 409 stale, a seat cell 1
/// sold stays sold in cell 2, and a new admission from cell 2 buys.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_move_fences_tokens_minted_before_it_and_keeps_sold_seats_sold(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let c2 = Extra::create(&opts, "c2").await;
    let control = Extra::create(&opts, "ctl").await;
    let spec = VenueSpec::small(1, 1, 6);
    let app1 = TestApp::spawn_with(opts.clone(), &[Role::Api, Role::Expiry], spec.clone(), |c| {
        c.hold_ttl_ms = 1_000;
        c.hold_ceiling_ms = Some(2_000);
    })
    .await;
    let app2 = cell_two(&app1, &c2, VenueSpec::small(1, 1, 1), |_| {}).await;
    let ops = across(&app1.cfg, opts.to_url_lossy().to_string(), c2.url(), control.url(), [None, None]);
    let event = app1.event;
    // Names are unique per ledger: cell 2 already has a "Test Event".
    sqlx::query("UPDATE events SET name = 'Moving Event' WHERE id = $1")
        .bind(event)
        .execute(&app1.pool)
        .await
        .unwrap();
    assert_eq!(boxoffice::cells::assign(&ops, event, "cell-1").await.unwrap(), 0);
    let seats = app1.seats().await;

    // Before the move: cell 1 admits at epoch 1 and holds; cell 2 does not have the event.
    let x = app1.buyer();
    let (s, body) = admit(&app1, &x, event).await;
    assert_eq!((s, body["purchase_cell"].as_str()), (201, Some("cell-1")));
    let old_token = body["admission_token"].as_str().unwrap().to_owned();
    assert_eq!(hold_at(&app1, &x, event, &old_token, seats[0]).await.0, 202);
    // A seat cell 1 sold for good (its order and ticket stay in cell 1's ledger).
    let sold_order = Uuid::new_v4();
    sqlx::query("INSERT INTO orders (id, user_id, event_id, status, amount_minor, currency, correlation_id) VALUES ($1, $2, $3, 'ticketed', 100, 'usd', $1)")
        .bind(sold_order).bind(Uuid::new_v4()).bind(event).execute(&app1.pool).await.unwrap();
    sqlx::query("INSERT INTO tickets (id, order_id, seat_id, event_id) VALUES ($1, $2, $3, $4)")
        .bind(Uuid::new_v4())
        .bind(sold_order)
        .bind(seats[1])
        .bind(event)
        .execute(&app1.pool)
        .await
        .unwrap();

    // The move waits for the open hold; meanwhile cell 1 takes no new hold.
    let mover = {
        let ops = ops.clone();
        tokio::spawn(async move {
            boxoffice::cells::move_event(&ops, event, "cell-2", Duration::from_secs(30)).await
        })
    };
    eventually(Duration::from_secs(10), "the source cell froze the event", || async {
        boxoffice_store::cells::placement(&app1.pool, EventId(event)).await.unwrap().unwrap().state
            != CellState::Active
    })
    .await;
    let y = app1.buyer();
    let y_token = app1.admission_token(&y);
    let (s, code, _) = hold_at(&app1, &y, event, &y_token, seats[2]).await;
    assert!(
        (s, code.as_str()) == (503, "event_moving") || (s, code.as_str()) == (409, "event_in_another_cell"),
        "a hold during the move: {s} {code}"
    );
    let report = mover.await.unwrap().expect("the move finishes once the hold has lapsed");
    assert_eq!((report.from.as_str(), report.to.as_str(), report.directory_epoch), ("cell-1", "cell-2", 2));
    assert_eq!((report.seats, report.sold_seats), (6, 1));
    let entry =
        boxoffice_store::directory::get(&boxoffice::cells::control_pool(&ops, false).await.unwrap(), event)
            .await
            .unwrap()
            .unwrap();
    assert_eq!((entry.cell.as_str(), entry.directory_epoch, entry.state.as_str()), ("cell-2", 2, "active"));
    // No order left cell 1.
    let orders_in_2: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE event_id = $1")
        .bind(event)
        .fetch_one(&app2.pool)
        .await
        .unwrap();
    assert_eq!(orders_in_2, 0);

    // The token minted before the move: 409 in the old cell (it names the new one) …
    let (s, code, body) = hold_at(&app1, &x, event, &old_token, seats[3]).await;
    assert_eq!(
        (s, code.as_str(), body["purchase_cell"].as_str()),
        (409, "event_in_another_cell", Some("cell-2"))
    );
    // … and 403 wrong cell in the new one.
    let (s, code, _) = hold_at(&app2, &x, event, &old_token, seats[3]).await;
    assert_eq!((s, code.as_str()), (403, "admission_token_wrong_cell"));
    // A cell-2 token of an earlier epoch (minted before an earlier move) is stale.
    let stale = runtime::admission_tokens(&app2.cfg).unwrap().issue(UserId(x.user), EventId(event), 1, 600).0;
    let (s, code, body) = hold_at(&app2, &x, event, &stale, seats[3]).await;
    assert_eq!(
        (s, code.as_str(), body["directory_epoch"].as_i64()),
        (409, "admission_token_stale_epoch", Some(2))
    );
    // A new admission from cell 2 is at epoch 2 and buys; cell 1's sold seat stays sold there.
    let (s, body) = admit(&app2, &x, event).await;
    assert_eq!((s, body["purchase_cell"].as_str()), (201, Some("cell-2")));
    let new_token = body["admission_token"].as_str().unwrap().to_owned();
    let (s, code, _) = hold_at(&app2, &x, event, &new_token, seats[1]).await;
    assert_eq!((s, code.as_str()), (409, "seat_unavailable"));
    assert_eq!(hold_at(&app2, &x, event, &new_token, seats[3]).await.0, 202);
    // The new cell's token is the wrong cell's in the old one.
    let (s, code, _) = hold_at(&app1, &x, event, &new_token, seats[4]).await;
    assert_eq!((s, code.as_str()), (403, "admission_token_wrong_cell"));
    // Cell 1's admissions for the event now point at cell 2.
    eventually(Duration::from_secs(5), "cell 1's event cache sees the move", || async {
        admit(&app1, &x, event).await.0 == 409
    })
    .await;
    let seat_map: Value = app2
        .http
        .get(format!("{}/events/{event}/seats", app2.api))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let status_of = |id: Uuid| {
        seat_map["seats"].as_array().unwrap().iter().find(|s| s["seat_id"] == id.to_string()).unwrap()
            ["status"]
            .clone()
    };
    assert_eq!(status_of(seats[1]), "sold");

    app1.stop().await;
    app2.stop().await;
    c2.drop().await;
    control.drop().await;
}

/// `boxoffice serve --cell cell-1` with both cells configured connects to cell 1's database
/// and never to cell 2's; `Config::for_cell` keeps no other cell's URL nor the control
/// database's.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_cell_process_never_connects_to_another_cells_database(_: PgPoolOptions, opts: PgConnectOptions) {
    let c2 = Extra::create(&opts, "c2").await;
    let control = Extra::create(&opts, "ctl").await;
    let c1_url = opts.to_url_lossy().to_string();
    let ops = across(&Config::default(), c1_url.clone(), c2.url(), control.url(), [None, None]);
    let one = ops.for_cell("cell-1").unwrap();
    assert_eq!(one.database_url.expose_secret(), c1_url);
    assert!(one.cells.is_empty() && one.control_database_url.is_none());
    assert_eq!(one.purchase_cell, "cell-1");
    assert!(ops.for_cell("cell-3").is_err());

    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let file = std::env::temp_dir().join(format!("boxoffice-cells-{}.toml", Uuid::new_v4().simple()));
    let toml = format!(
        "control_database_url = {:?}\nhttp_bind = \"127.0.0.1:{port}\"\nrelease_max_per_s = 0.0\n\
         [[cells]]\nname = \"cell-1\"\ndatabase_url = {:?}\nkafka_topic_prefix = \"c1.\"\nredis_key_prefix = \"c1:{}:\"\n\
         [[cells]]\nname = \"cell-2\"\ndatabase_url = {:?}\nkafka_topic_prefix = \"c2.\"\nredis_key_prefix = \"c2:{}:\"\n",
        control.url(),
        c1_url,
        Uuid::new_v4().simple(),
        c2.url(),
        Uuid::new_v4().simple()
    );
    std::fs::write(&file, toml).unwrap();
    let mut child = tokio::process::Command::new(product_bin())
        .args(["serve", "--cell", "cell-1", "--roles", "api,expiry"])
        .env("BOXOFFICE_CONFIG", &file)
        .env("BOXOFFICE_ENV", "development")
        .env("BOXOFFICE_REDIS_URL", crate::helpers::test_redis_url())
        .env_remove("BOXOFFICE_DATABASE_URL")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let http = reqwest::Client::new();
    let api = format!("http://127.0.0.1:{port}");
    eventually(Duration::from_secs(30), "the cell-1 process answers", || async {
        http.get(format!("{api}/readyz")).send().await.is_ok_and(|r| r.status().is_success())
    })
    .await;
    // Work that needs the ledger: an unknown event's seat map.
    let r = http.get(format!("{api}/events/{}/seats", Uuid::new_v4())).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let mut admin = opts.clone().database("postgres").connect().await.unwrap();
    let sessions = |db: String| {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name LIKE 'boxoffice-%'",
        )
        .bind(db)
    };
    let own_db = opts.get_database().unwrap().to_owned();
    eventually(Duration::from_secs(10), "the process holds connections to cell 1's database", || async {
        let mut c = opts.clone().database("postgres").connect().await.unwrap();
        sessions(own_db.clone()).fetch_one(&mut c).await.unwrap() > 0
    })
    .await;
    // The expiry sweeps every 250 ms: a second's worth of its connections, and none to cell 2.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(sessions(c2.name.clone()).fetch_one(&mut admin).await.unwrap(), 0);
    assert_eq!(sessions(control.name.clone()).fetch_one(&mut admin).await.unwrap(), 0);
    admin.close().await.unwrap();
    child.kill().await.unwrap();
    let _ = std::fs::remove_file(&file);
    c2.drop().await;
    control.drop().await;
}

/// The router sends each event's buyers to its cell from the directory, finds an order's
/// cell by asking, and keeps routing known events with its last map while the control
/// database is gone; an event it never saw is then 503 `directory_unavailable`.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn the_router_serves_its_last_map_while_the_control_database_is_down(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let c2 = Extra::create(&opts, "c2").await;
    let control = Extra::create(&opts, "ctl").await;
    let spec = VenueSpec::small(1, 1, 4);
    // Cell 1 serves one order stream at a time: a full cell, for the streams below.
    let app1 =
        TestApp::spawn_with(opts.clone(), &[Role::Api], spec.clone(), |c| c.order_stream_max = 1).await;
    // Cell 2 takes webhooks from nobody here (its client is the router): a webhook the router
    // sent there by mistake would get its 403, not cell 1's answer.
    let app2 = cell_two(&app1, &c2, spec, |c| c.webhook_allowed_networks = vec!["192.0.2.0/24".into()]).await;
    let mut ops = across(
        &app1.cfg,
        opts.to_url_lossy().to_string(),
        c2.url(),
        control.url(),
        [Some(app1.api.clone()), Some(app2.api.clone())],
    );
    boxoffice::cells::assign(&ops, app1.event, "cell-1").await.unwrap();
    boxoffice::cells::assign(&ops, app2.event, "cell-2").await.unwrap();
    ops.router_bind = "127.0.0.1:0".into();
    ops.router_refresh_ms = 100;
    // The router's own stream bounds (its configuration is cell 1's with the cells added).
    ops.order_stream_max = 16;
    ops.order_stream_max_per_ip = 2;
    // Webhooks from one network only, which this test's own address is not in; one proxy in
    // front of the router, whose `X-Forwarded-For` entry names the client (without the
    // header, the client is the peer).
    ops.webhook_allowed_networks = vec!["192.0.2.0/24".into()];
    ops.router_trusted_proxy_hops = Some(1);
    let sd = CancellationToken::new();
    let running = runtime::start(&ops, &[Role::Router], opts.clone(), sd.clone()).await.unwrap();
    let router = format!("http://{}", running.router_addr.unwrap());
    let http = reqwest::Client::new();
    let seat_map = |event: Uuid| {
        let (http, router) = (http.clone(), router.clone());
        async move {
            let r = http.get(format!("{router}/events/{event}/seats")).send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    for event in [app1.event, app2.event] {
        let (s, body) = seat_map(event).await;
        assert_eq!((s, body["event_id"].as_str()), (200, Some(event.to_string().as_str())));
    }
    // A purchase through the router lands in cell 2; its order is found there by asking.
    let b = app2.buyer();
    let admitted: Value = http
        .post(format!("{router}/events/{}/admission", app2.event))
        .header("authorization", b.bearer())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(admitted["purchase_cell"], "cell-2");
    let seat = app2.seats().await[0];
    let held: Value = http
        .post(format!("{router}/events/{}/holds", app2.event))
        .header("authorization", b.bearer())
        .header("x-admission-token", admitted["admission_token"].as_str().unwrap())
        .header("idempotency-key", "k1")
        .json(&serde_json::json!({ "seat_ids": [seat] }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let order = held["order_id"].as_str().expect("a hold through the router").to_owned();
    let r = http
        .get(format!("{router}/orders/{order}"))
        .header("authorization", b.bearer())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // The order's live status streams through the router as the cell sends it: the order is
    // `held` for good here (no worker runs), so its stream never ends by itself.
    let open_stream = |order: String, bearer: String| {
        let (http, router) = (http.clone(), router.clone());
        async move {
            http.get(format!("{router}/orders/{order}/events"))
                .header("authorization", bearer)
                .send()
                .await
                .unwrap()
        }
    };
    let first_event = |mut stream: reqwest::Response| async move {
        if stream.status() != 200 {
            panic!("{}: {}", stream.status(), stream.text().await.unwrap_or_default());
        }
        assert_eq!(stream.headers()["content-type"], "text/event-stream");
        let seen = tokio::time::timeout(Duration::from_secs(10), async {
            let mut seen = String::new();
            while !seen.split_once("event: order").is_some_and(|(_, event)| event.contains("\n\n")) {
                let chunk = stream.chunk().await.expect("the stream goes on").expect("and has not ended");
                seen.push_str(&String::from_utf8_lossy(&chunk));
            }
            seen
        })
        .await
        .expect("the first event arrives while the stream is open, not when it ends");
        (stream, seen)
    };
    let (first, seen) = first_event(open_stream(order.clone(), b.bearer()).await).await;
    assert!(seen.contains(&order) && seen.contains("\"held\""), "{seen}");
    // Cell 1's one stream, of an order of its own, makes it full.
    let (b1, order1) = held_at_the_cell(&app1, 0).await;
    let (second, _) = first_event(open_stream(order1.clone(), b1.bearer()).await).await;
    // A new cell-2 order the router has never seen: its stream is located by the order's plain
    // read, so full cell 1's refusal never answers for it.
    let (b2, order2) = held_at_the_cell(&app2, 1).await;
    // The router's own bound: two streams per client address here, and this is the third.
    let (status, code, body) = problem(open_stream(order2.clone(), b2.bearer()).await).await;
    assert_eq!(
        (status, code.as_str(), &body["scope"]),
        (429, "too_many_streams", &serde_json::json!("ip")),
        "{body}"
    );
    drop(first);
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    let stream = loop {
        let r = open_stream(order2.clone(), b2.bearer()).await;
        if r.status() == 200 {
            break r;
        }
        // Only the router's own bound refuses, until the closed stream's place is free: full
        // cell 1, which does not own the order, never answers for cell 2.
        let (status, code, body) = problem(r).await;
        assert_eq!(
            (status, code.as_str(), &body["scope"]),
            (429, "too_many_streams", &serde_json::json!("ip")),
            "{body}"
        );
        assert!(std::time::Instant::now() < deadline, "the closed stream's place was never freed");
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    let (_, seen) = first_event(stream).await;
    assert!(seen.contains(&order2), "{seen}");
    drop(second);
    let r = http
        .get(format!("{router}/orders/{}", Uuid::new_v4()))
        .header("authorization", b.bearer())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let unknown = Uuid::new_v4();
    assert_eq!(seat_map(unknown).await.0, 404);
    // What is forwarded is what was routed: no dot segments or encoded separators, and an
    // order path fans out reads only.
    for path in [
        format!("/orders/{order}/../../events/{}/admission", app1.event),
        format!("/orders/{order}/%2e%2e/%2E%2E/metrics"),
        format!("/events/{}/..%2fseats", app1.event),
    ] {
        // Sent as written: an HTTP client would resolve the dot segments first.
        let answer = raw_post(running.router_addr.unwrap(), &path, &b.bearer()).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{path}: {answer}");
        assert!(answer.contains("\"invalid_path\""), "{path}: {answer}");
    }
    let r = http
        .post(format!("{router}/orders/{order}"))
        .header("authorization", b.bearer())
        .send()
        .await
        .unwrap();
    assert_eq!(problem(r).await.0, 405);
    // A webhook from outside `webhook_allowed_networks` is refused before its body is read:
    // its head promises a body that never comes, and the answer comes at once.
    let answer = tokio::time::timeout(Duration::from_secs(3), async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut c = tokio::net::TcpStream::connect(running.router_addr.unwrap()).await.unwrap();
        c.write_all(
            b"POST /webhooks/stripe HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n\
              Stripe-Signature: t=1,v1=00\r\nContent-Length: 4096\r\nConnection: close\r\n\r\n",
        )
        .await
        .unwrap();
        let mut out = Vec::new();
        c.read_to_end(&mut out).await.unwrap();
        String::from_utf8_lossy(&out).into_owned()
    })
    .await
    .expect("answered before the body");
    assert!(answer.starts_with("HTTP/1.1 403") && answer.contains("webhook_source_refused"), "{answer}");
    // The client the proxy names decides: an allowed one is forwarded to the cell the event's
    // object names, cell 1 (whose answer, here to a signature that does not verify, is
    // relayed); one the client wrote itself, left of the proxy's entry, does not count.
    let webhook = |forwarded_for: &'static str| {
        let (http, router) = (http.clone(), router.clone());
        async move {
            let r = http
                .post(format!("{router}/webhooks/stripe"))
                .header("x-forwarded-for", forwarded_for)
                .header("stripe-signature", "t=1,v1=00")
                .json(&serde_json::json!({
                    "id": "evt_routed", "type": "payment_intent.succeeded",
                    "data": {"object": {"id": "pi_routed", "metadata": {"purchase_cell": "cell-1"}}}
                }))
                .send()
                .await
                .unwrap();
            let (status, code, _) = problem(r).await;
            (status, code)
        }
    };
    assert_eq!(webhook("192.0.2.9").await, (400, "invalid_signature".to_owned()));
    assert_eq!(webhook("192.0.2.9, 203.0.113.5").await, (403, "webhook_source_refused".to_owned()));

    // The control database goes away: the router keeps its map.
    control.drop().await;
    let status = || async {
        http.get(format!("{router}/routerz")).send().await.unwrap().json::<Value>().await.unwrap()
    };
    eventually(Duration::from_secs(10), "the router notices the directory is unreadable", || async {
        status().await["stale"] == true
    })
    .await;
    for event in [app1.event, app2.event] {
        assert_eq!(seat_map(event).await.0, 200, "a known event is still routed");
    }
    // The router's own health and metrics, for its load balancer and its operator.
    assert_eq!(http.get(format!("{router}/healthz")).send().await.unwrap().status(), 200);
    let page = http.get(format!("{router}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(page.contains("boxoffice_router_directory_age_seconds"), "{page}");
    let r = http.get(format!("{router}/events/{unknown}/seats")).send().await.unwrap();
    let (s, code, _) = problem(r).await;
    assert_eq!((s, code.as_str()), (503, "directory_unavailable"));
    sd.cancel();
    running.join().await;
    app1.stop().await;
    app2.stop().await;
    c2.drop().await;
}

/// Each cell's release controller reads its own ledger: an hour-old unpublished outbox row in
/// cell 2 brings cell 2's R to its floor while cell 1's stays at its ceiling, with no
/// decrease at all.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn one_cells_pressure_never_lowers_another_cells_release_rate(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use boxoffice_workers::release::Status;
    const MAX: f64 = 40.0;
    const MIN: f64 = 2.0;
    let c2 = Extra::create(&opts, "c2").await;
    let tune = |cell: &'static str| {
        move |c: &mut Config| {
            c.purchase_cell = cell.into();
            c.admission_direct = false;
            c.release_max_per_s = MAX;
            c.release_min_per_s = MIN;
            c.release_initial_per_s = MIN;
            c.release_step_per_s = 10.0;
            c.release_decrease_factor = 0.5;
            c.release_tick_ms = 100;
            c.release_probe_timeout_ms = 2_000;
            c.release_threshold_pg_commit_ms = 2_000.0;
            c.release_threshold_lock_waits = 1e6;
            c.release_threshold_deadlocks = 1e6;
            c.release_threshold_connection_saturation = 10.0;
            c.release_threshold_outbox_age_ms = 2_000.0;
            c.release_threshold_active_holds = 1e6;
            c.release_threshold_expiry_delay_ms = 1e9;
        }
    };
    let app1 =
        TestApp::spawn_with(opts.clone(), &[Role::Api], VenueSpec::small(1, 1, 4), tune("cell-1")).await;
    let app2 = cell_two(&app1, &c2, VenueSpec::small(1, 1, 4), tune("cell-2")).await;
    let (s1, s2) = (app1.release_status(), app2.release_status());
    let at = |rx: &tokio::sync::watch::Receiver<Status>, what: &'static str, pred: fn(&Status) -> bool| {
        let rx = rx.clone();
        async move { eventually(Duration::from_secs(20), what, || std::future::ready(pred(&rx.borrow()))).await }
    };
    at(&s1, "cell 1 at its ceiling", |s| s.leader && s.rate_per_s == MAX).await;
    at(&s2, "cell 2 at its ceiling", |s| s.leader && s.rate_per_s == MAX).await;
    sqlx::query(
        "INSERT INTO outbox (id, topic, message_key, event_type, payload, created_at)
         VALUES ($1, 'ticketing.purchase.v1', $1::text, 'HoldCreated', '{}', now() - interval '1 hour')",
    )
    .bind(Uuid::new_v4())
    .execute(&app2.pool)
    .await
    .unwrap();
    at(&s2, "cell 2 at its floor", |s| s.rate_per_s == MIN).await;
    let ticks = s1.borrow().ticks;
    eventually(Duration::from_secs(10), "cell 1 ran ticks after cell 2 fell", || {
        std::future::ready(s1.borrow().ticks >= ticks + 5)
    })
    .await;
    let s = s1.borrow().clone();
    assert_eq!(s.rate_per_s, MAX, "cell 1's R: {:?}", s.decision);
    assert!(s.decreases.is_empty(), "cell 1 decreased for {:?}", s.decreases);
    app1.stop().await;
    app2.stop().await;
    c2.drop().await;
}

/// `boxoffice-drills onsale --cells 2` sells two events at once, one per cell, each on its own
/// database with its own roles and audit, and reports each cell and the totals.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn the_onsale_sells_two_cells_at_once_with_every_invariant_per_cell(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let c2 = Extra::create(&opts, "c2").await;
    let report = std::env::temp_dir().join(format!("boxoffice-cells-{}.json", Uuid::new_v4().simple()));
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_boxoffice-drills"))
        .args([
            "onsale",
            "--cells",
            "2",
            "--buyers",
            "200",
            "--small-venue",
            "1,10,20",
            "--hold-ttl-ms",
            "15000",
        ])
        .args(["--arrival-rate", "100", "--release-rate", "100", "--no-progress"])
        .arg("--cell-database-url")
        .arg(opts.to_url_lossy().to_string())
        .arg("--cell-database-url")
        .arg(c2.url())
        .arg("--report-json")
        .arg(&report)
        .env("BOXOFFICE_KAFKA_BROKERS", crate::helpers::test_brokers())
        .env("BOXOFFICE_KAFKA_TOPIC_PREFIX", format!("cells{}.", Uuid::new_v4().simple()))
        .env("BOXOFFICE_KAFKA_PARTITIONS", "2")
        .env("BOXOFFICE_CONSUMER_LANES", "4")
        .env("BOXOFFICE_REDIS_KEY_PREFIX", format!("cells{}:", Uuid::new_v4().simple()))
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "onsale --cells 2 failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let _ = std::fs::remove_file(&report);
    let mut events = std::collections::HashSet::new();
    for cell in ["cell-1", "cell-2"] {
        let c = &r["cells"][cell];
        assert_eq!(c["purchase_cell"], cell, "{r}");
        for key in [
            "oversold",
            "double_active_holds",
            "tickets_without_capture",
            "captured_without_ticket_or_refund",
            "stuck_orders",
            "dead_letters",
        ] {
            assert_eq!(c[key], 0, "{cell} {key}");
        }
        assert_eq!(c["checks"]["provider"]["status"], "ran", "{cell}");
        assert!(c["ticketed_orders"].as_i64().unwrap() > 0, "{cell} sold: {c}");
        assert_eq!(c["waiting_room"]["admitted"], 100, "{cell}: {}", c["waiting_room"]);
        events.insert(c["event_id"].as_str().unwrap().to_owned());
    }
    assert_eq!(events.len(), 2, "one event per cell");
    let t = &r["totals"];
    assert_eq!(t["violations"], 0, "{t}");
    assert_eq!((&r["result"], &r["exit_code"]), (&serde_json::json!("ok"), &serde_json::json!(0)), "{r}");
    assert_eq!(t["buyers"], 200, "{t}");
    assert_eq!(
        t["tickets"].as_i64(),
        Some(
            r["cells"]["cell-1"]["tickets"].as_i64().unwrap()
                + r["cells"]["cell-2"]["tickets"].as_i64().unwrap()
        )
    );
    // Each cell's ledger has its own event only.
    let mut c = c2.opts().connect().await.unwrap();
    let events_in_2: i64 = sqlx::query_scalar("SELECT count(*) FROM events").fetch_one(&mut c).await.unwrap();
    assert_eq!(events_in_2, 1);
    c.close().await.unwrap();
    c2.drop().await;
}

/// A move stopped after the target has its copy, then undone: the copy was imported frozen,
/// so the source sells again and the target still sells nothing (no second seller), and a
/// later move resumes over the copy and finishes.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn an_undone_move_never_leaves_two_cells_selling(_: PgPoolOptions, opts: PgConnectOptions) {
    use boxoffice_store::cells;
    let c2 = Extra::create(&opts, "c2").await;
    let control = Extra::create(&opts, "ctl").await;
    let app1 = TestApp::spawn(opts.clone(), &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let app2 = cell_two(&app1, &c2, VenueSpec::small(1, 1, 1), |_| {}).await;
    let ops = across(&app1.cfg, opts.to_url_lossy().to_string(), c2.url(), control.url(), [None, None]);
    let event = app1.event;
    sqlx::query("UPDATE events SET name = 'Moving Event' WHERE id = $1")
        .bind(event)
        .execute(&app1.pool)
        .await
        .unwrap();
    boxoffice::cells::assign(&ops, event, "cell-1").await.unwrap();
    let seats = app1.seats().await;
    // The first attempt got as far as the target's copy, then stopped.
    let control_pool = boxoffice::cells::control_pool(&ops, false).await.unwrap();
    boxoffice_store::directory::begin_move(&control_pool, event, "cell-2").await.unwrap();
    cells::freeze(&app1.pool, EventId(event), "cell-1").await.unwrap().unwrap();
    let export = cells::export(&app1.pool, EventId(event), "cell-1").await.unwrap().unwrap();
    assert!(cells::import(&app2.pool, &export, "cell-2", 2).await.unwrap());
    let b = app2.buyer();
    let (s, body) = admit(&app2, &b, event).await;
    assert_eq!((s, body["code"].as_str()), (503, Some("event_moving")), "the copy is not on sale");
    let token2 =
        runtime::admission_tokens(&app2.cfg).unwrap().issue(UserId(b.user), EventId(event), 2, 600).0;
    let (s, code, _) = hold_at(&app2, &b, event, &token2, seats[0]).await;
    assert_eq!((s, code.as_str()), (503, "event_moving"));
    // Undone (what a move that cannot settle does): the source sells again, the copy does not.
    assert!(cells::unfreeze(&app1.pool, EventId(event)).await.unwrap());
    boxoffice_store::directory::abandon_move(&control_pool, event).await.unwrap();
    let a = app1.buyer();
    let token1 = app1.admission_token(&a);
    assert_eq!(hold_at(&app1, &a, event, &token1, seats[0]).await.0, 202);
    let (s, code, _) = hold_at(&app2, &b, event, &token2, seats[0]).await;
    assert_eq!((s, code.as_str()), (503, "event_moving"), "still one seller");
    // The held seat's order is open: a move now waits for it, so it is settled by hand here.
    sqlx::query("UPDATE holds SET expires_at = now() - interval '1 s', payable_by = NULL, provider_check_until = NULL")
        .execute(&app1.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE orders SET status = 'expired'").execute(&app1.pool).await.unwrap();
    sqlx::query("UPDATE holds SET status = 'expired'").execute(&app1.pool).await.unwrap();
    sqlx::query("UPDATE hold_seats SET released_at = now()").execute(&app1.pool).await.unwrap();
    let report = boxoffice::cells::move_event(&ops, event, "cell-2", Duration::from_secs(10)).await.unwrap();
    assert_eq!(report.directory_epoch, 2);
    assert_eq!(cells::placement(&app2.pool, EventId(event)).await.unwrap().unwrap().state, CellState::Active);
    assert_eq!(cells::placement(&app1.pool, EventId(event)).await.unwrap().unwrap().state, CellState::Moved);
    assert_eq!(hold_at(&app2, &b, event, &token2, seats[1]).await.0, 202);
    app1.stop().await;
    app2.stop().await;
    c2.drop().await;
    control.drop().await;
}
