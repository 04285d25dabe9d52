//! The HTTP edge under abuse, on 127.0.0.1 only and with bounded loops: half-sent requests
//! are cut off at the header-read timeout while `/healthz` keeps answering; requests beyond
//! the concurrency limit and connections beyond the connection limit get 503 problem+json
//! with `Retry-After`; stalled bodies get 408, slow requests 503; rate buckets on holds,
//! orders and the seat map (per IP through `X-Forwarded-For`, IPv6 by /64, per user, and the
//! in-process fallback with Redis gone); the per-event seat-map cache with junk ids; and
//! revocations that survive a Redis restart (and fail closed on a Redis that answers wrongly).

use crate::helpers::{eventually, problem, Buyer, TestApp};
use crate::waitroom::{free_port, PrivateRedis};
use boxoffice::runtime::{self, Role};
use boxoffice_domain::{EventId, UserId};
use boxoffice_store::venue::VenueSpec;
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use uuid::Uuid;

async fn api_only(opts: PgConnectOptions, tweak: impl FnOnce(&mut boxoffice::config::Config)) -> TestApp {
    TestApp::spawn_with(opts, &[Role::Api], VenueSpec::small(1, 2, 10), tweak).await
}

fn addr(app: &TestApp) -> String {
    app.api.trim_start_matches("http://").to_owned()
}

/// The value of the Prometheus sample whose line starts with `series` (0 when absent).
async fn metric(app: &TestApp, series: &str) -> f64 {
    let text = app.http.get(format!("{}/metrics", app.api)).send().await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.starts_with(series) && l[series.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A connection that sent a webhook request head (a dummy signature, `Content-Length: 1000`)
/// and one byte of its body, and then stalls.
async fn stalled_webhook(app: &TestApp) -> TcpStream {
    let mut s = TcpStream::connect(addr(app)).await.unwrap();
    s.write_all(b"POST /webhooks/stripe HTTP/1.1\r\nHost: x\r\nStripe-Signature: t=1,v1=00\r\nContent-Length: 1000\r\n\r\n{")
        .await
        .unwrap();
    s
}

/// A connection that sent the head of buyer `b`'s hold request (a new Idempotency-Key, the
/// admission token if any, `Content-Length: 100`) and the start of its body, and then stalls.
async fn stalled_hold(app: &TestApp, b: &crate::helpers::Buyer, admission: Option<&str>) -> TcpStream {
    let head = format!(
        "POST /events/{}/holds HTTP/1.1\r\nHost: x\r\nAuthorization: {}\r\nIdempotency-Key: {}\r\n{}\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"seat_ids\":",
        app.event,
        b.bearer(),
        Uuid::new_v4(),
        admission.map(|a| format!("X-Admission-Token: {a}\r\n")).unwrap_or_default(),
    );
    let mut s = TcpStream::connect(addr(app)).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s
}

/// Reads from `s` until the peer closes or `limit` passes; the bytes read.
async fn read_to_close(s: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    tokio::time::timeout(limit, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .ok()?;
    Some(got)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// 1,500 connections each send part of a request (half a request line, a request line
/// without headers, headers without the blank line) and stop. Each is closed by the server
/// within the configured header-read timeout (plus scheduling slack on a busy machine),
/// none before it, and `/healthz` answers throughout. Prints connections held, time to
/// close and `/healthz` latency.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn edge_half_open_connections_are_closed_while_healthz_answers(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    const CONNECTIONS: usize = 1_500;
    // Long enough that every connection is still open when the gauge is read, however slowly
    // a loaded machine opens them (at 1.5 s, one in 1,500 had been closed already once).
    const TIMEOUT_MS: u64 = 3_000;
    let app = api_only(opts, |c| c.http_header_read_timeout_ms = TIMEOUT_MS).await;
    let target = addr(&app);
    let partials: [&[u8]; 3] =
        [b"GET /heal", b"GET /healthz HTTP/1.1\r\n", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: 1"];
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..CONNECTIONS {
        let mut s = TcpStream::connect(&target).await.expect("connect");
        s.write_all(partials[i % partials.len()]).await.unwrap();
        let sent = Instant::now();
        clients.spawn(async move {
            let answer = read_to_close(&mut s, Duration::from_secs(30)).await;
            (answer, sent.elapsed())
        });
    }
    let held = metric(&app, "boxoffice_http_connections").await;

    // /healthz meanwhile, every 10 ms until every half-open connection is gone (bounded).
    let stop = tokio_util::sync::CancellationToken::new();
    let healthz = {
        let (http, url, stop) = (app.http.clone(), format!("{}/healthz", app.api), stop.clone());
        tokio::spawn(async move {
            let mut lat = Vec::new();
            let deadline = Instant::now() + Duration::from_millis(TIMEOUT_MS) + Duration::from_secs(10);
            let mut statuses = Vec::new();
            while !stop.is_cancelled() && Instant::now() < deadline && lat.len() < 2_000 {
                let t = Instant::now();
                let r = http.get(&url).send().await.map(|r| r.status().as_u16()).unwrap_or(0);
                lat.push(t.elapsed());
                statuses.push(r);
                tokio::time::sleep(Duration::from_millis(10)).await;
                if t.elapsed() > Duration::from_secs(30) {
                    break;
                }
            }
            (lat, statuses)
        })
    };
    let mut closes = Vec::new();
    let mut never_closed = 0;
    while let Some(r) = clients.join_next().await {
        match r.unwrap() {
            (Some(_), elapsed) => closes.push(elapsed),
            (None, _) => never_closed += 1,
        }
    }
    stop.cancel();
    let (lat, statuses) = healthz.await.unwrap();
    closes.sort();
    let mut lat_sorted = lat.clone();
    lat_sorted.sort();
    eprintln!(
        "slow clients: {CONNECTIONS} half-open connections, {held} connections held by the server at peak; \
         closed {} (never: {never_closed}) after min {:?} / p50 {:?} / p99 {:?} / max {:?} (header timeout {TIMEOUT_MS} ms); \
         /healthz meanwhile: {} requests, p50 {:?} / p99 {:?} / max {:?}, non-200: {}",
        closes.len(),
        closes.first(),
        closes.get(closes.len() / 2),
        closes.get(closes.len() * 99 / 100),
        closes.last(),
        lat.len(),
        lat_sorted.get(lat_sorted.len() / 2),
        lat_sorted.get(lat_sorted.len() * 99 / 100),
        lat_sorted.last(),
        statuses.iter().filter(|s| **s != 200).count(),
    );
    assert!(held >= CONNECTIONS as f64, "the server held every connection before the timeout: {held}");
    assert_eq!(never_closed, 0, "every half-open connection is closed");
    let timeout = Duration::from_millis(TIMEOUT_MS);
    assert!(closes[0] >= timeout.mul_f64(0.8), "none closed before the timeout: {:?}", closes[0]);
    assert!(
        *closes.last().unwrap() <= timeout + Duration::from_secs(4),
        "all closed within the timeout (+ slack): {:?}",
        closes.last()
    );
    assert!(lat.len() >= 20, "healthz was polled throughout");
    assert!(statuses.iter().all(|s| *s == 200), "healthz answered 200 throughout: {statuses:?}");
    assert!(
        percentile(&lat_sorted, 0.99) < Duration::from_secs(1),
        "healthz p99 {:?}",
        percentile(&lat_sorted, 0.99)
    );
    app.stop().await;
}

/// Two requests whose bodies stall hold the two request slots: the next request is shed at
/// once (503 `overloaded`, `Retry-After`, problem+json) — but `/healthz`, which reads
/// nothing, still answers 200, so a load balancer does not take a busy process for a dead
/// one — and the stalled ones end with 408 `request_body_timeout` after the body-read
/// timeout; then requests are served again.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn edge_sheds_beyond_the_concurrency_limit_and_times_out_stalled_bodies(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = api_only(opts, |c| {
        c.http_max_concurrent_requests = 2;
        c.http_request_body_timeout_ms = 1_000;
    })
    .await;
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(addr(&app)).await.unwrap();
        s.write_all(
            b"POST /webhooks/stripe HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"id\":",
        )
        .await
        .unwrap();
        stalled.push(s);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = app.http.get(format!("{}/openapi.json", app.api)).send().await.unwrap();
    assert!(r.headers().contains_key("retry-after"), "{:?}", r.headers());
    let (status, code, _) = problem(r).await;
    assert_eq!((status, code.as_str()), (503, "overloaded"));
    let r = app.http.get(format!("{}/healthz", app.api)).send().await.unwrap();
    assert_eq!(r.status(), 200, "alive while the process sheds");
    assert_eq!(r.text().await.unwrap(), "ok");
    for mut s in stalled {
        let answer = read_to_close(&mut s, Duration::from_secs(10)).await.expect("answered");
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains("application/problem+json") && text.contains("request_body_timeout"), "{text}");
    }
    eventually(Duration::from_secs(5), "served again", || async {
        app.http.get(format!("{}/healthz", app.api)).send().await.is_ok_and(|r| r.status() == 200)
    })
    .await;
    // Counted by the limit that shed it: the process's, not a route class's bulkhead.
    assert!(metric(&app, "boxoffice_http_requests_shed_total{bulkhead=\"process\"}").await >= 1.0);
    assert_eq!(metric(&app, "boxoffice_http_requests_shed_total{bulkhead=\"webhooks\"}").await, 0.0);
    app.stop().await;
}

/// Webhook bodies are read before their signature can be checked, so slow unauthenticated
/// senders are bounded by the webhook route's own bulkhead: more stalled webhook requests than
/// it admits are shed at once, and `/healthz` keeps its share of the process-wide limit.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn stalled_webhook_bodies_cannot_take_every_request_slot(_: PgPoolOptions, opts: PgConnectOptions) {
    let bulkhead = boxoffice_api::routes::WEBHOOK_MAX_CONCURRENT;
    let app = api_only(opts, |c| {
        c.http_max_concurrent_requests = bulkhead + 8;
        c.http_request_body_timeout_ms = 10_000;
        c.http_request_timeout_ms = 15_000;
        // The bulkhead itself (one sender here; the per-sender bound has its own test).
        c.webhook_max_in_flight_per_ip = 0;
        c.webhook_timeout_ms = 15_000;
    })
    .await;
    let mut stalled = Vec::new();
    for _ in 0..bulkhead + 16 {
        stalled.push(stalled_webhook(&app).await);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..5 {
        let r = app.http.get(format!("{}/healthz", app.api)).send().await.unwrap();
        assert_eq!(r.status(), 200, "the webhook flood took the health check's slot");
    }
    // The 16 beyond the bulkhead were shed, each counted under the name of the limit that
    // shed it: the webhook bulkhead's, but for any the process-wide limit shed first.
    let by_bulkhead = metric(&app, "boxoffice_http_requests_shed_total{bulkhead=\"webhooks\"}").await;
    let by_process = metric(&app, "boxoffice_http_requests_shed_total{bulkhead=\"process\"}").await;
    assert_eq!(by_bulkhead + by_process, 16.0, "every request beyond the bulkhead was shed");
    assert!(by_bulkhead >= 8.0, "shed by the webhook bulkhead: {by_bulkhead}");
    drop(stalled);
    app.stop().await;
}

/// Admitted buyers whose hold bodies stall take at most `holds_max_concurrent_requests` of
/// the process's slots: the next hold is 503 `overloaded` at once (counted under the holds
/// bulkhead), while the seat map, an order's status and `/healthz` are still served.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn stalled_hold_bodies_take_only_the_holds_share_of_the_slots(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = api_only(opts, |c| {
        c.http_max_concurrent_requests = 8;
        c.holds_max_concurrent_requests = 3;
        // The bulkhead itself (one address here; the per-address bound has its own test).
        c.http_max_in_flight_per_ip = 0;
        c.http_request_body_timeout_ms = 15_000;
        c.http_request_timeout_ms = 20_000;
    })
    .await;
    let mut stalled = Vec::new();
    for _ in 0..3 {
        let b = app.buyer();
        stalled.push(stalled_hold(&app, &b, Some(&app.admission_token(&b))).await);
    }
    // Once the three hold the bulkhead, a fourth admitted buyer's hold is shed at once (its
    // body names no seat, so a hold let through would change nothing: 422).
    let shed = eventually(Duration::from_secs(10), "a fourth hold is shed", || async {
        let b = app.buyer();
        let r = app
            .http
            .post(format!("{}/events/{}/holds", app.api, app.event))
            .header("authorization", b.bearer())
            .header("idempotency-key", Uuid::new_v4().to_string())
            .header("x-admission-token", app.admission_token(&b))
            .json(&serde_json::json!({ "seat_ids": [] }))
            .send()
            .await
            .unwrap();
        r.status() == 503 && r.headers().contains_key("retry-after") && problem(r).await.1 == "overloaded"
    });
    shed.await;
    let r = app.http.get(format!("{}/events/{}/seats", app.api, app.event)).send().await.unwrap();
    assert_eq!(r.status(), 200, "the seat map is served");
    let (status, _) = app.order(&app.buyer(), Uuid::new_v4()).await;
    assert_eq!(status, 404, "an order's status is served");
    let r = app.http.get(format!("{}/healthz", app.api)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(metric(&app, "boxoffice_http_requests_shed_total{bulkhead=\"holds\"}").await >= 1.0);
    assert_eq!(metric(&app, "boxoffice_http_requests_shed_total{bulkhead=\"process\"}").await, 0.0);
    drop(stalled);
    app.stop().await;
}

/// One client address keeps requests open (bodies that never finish): past
/// `http_max_in_flight_per_ip` its next buyer request is 429 `too_many_in_flight` at once,
/// `/healthz` is untouched, and a hold without a valid admission is refused before its body
/// is read. Webhook senders have their own, smaller bound, and a webhook body that does not
/// arrive whole within `webhook_timeout_ms` is 503 `request_timeout`.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn slow_clients_are_bounded_per_address_and_per_webhook_sender(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = api_only(opts, |c| {
        c.http_max_in_flight_per_ip = 4;
        c.webhook_max_in_flight_per_ip = 2;
        c.webhook_timeout_ms = 800;
        c.http_request_body_timeout_ms = 10_000;
        c.http_request_timeout_ms = 15_000;
    })
    .await;
    let b = app.buyer();
    // No admission: refused at once, the body never sent.
    let mut s = stalled_hold(&app, &b, None).await;
    let answer = read_to_close(&mut s, Duration::from_secs(3)).await.expect("answered before the body");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 403") && text.contains("admission_token"), "{text}");

    // Four admitted holds whose bodies never finish take this address's places.
    let token = app.admission_token(&b);
    let mut stalled = Vec::new();
    for _ in 0..4 {
        stalled.push(stalled_hold(&app, &b, Some(&token)).await);
    }
    let order = format!("{}/orders/{}", app.api, Uuid::new_v4());
    eventually(Duration::from_secs(10), "the fifth request is refused", || async {
        app.http.get(&order).header("authorization", b.bearer()).send().await.unwrap().status() == 429
    })
    .await;
    let r = app.http.get(&order).header("authorization", b.bearer()).send().await.unwrap();
    assert!(r.headers().contains_key("retry-after"));
    let (status, code, body) = problem(r).await;
    assert_eq!((status, code.as_str(), body["max_in_flight"].as_u64()), (429, "too_many_in_flight", Some(4)));
    assert_eq!(app.http.get(format!("{}/healthz", app.api)).send().await.unwrap().status(), 200);
    assert!(metric(&app, "boxoffice_http_in_flight_refused_total{class=\"buyer\"}").await >= 1.0);
    drop(stalled);
    eventually(Duration::from_secs(10), "the address is served again", || async {
        app.http.get(&order).header("authorization", b.bearer()).send().await.unwrap().status() == 404
    })
    .await;

    // Webhooks: two stalled senders' bodies take the places; the third is refused; the two
    // end with 503 at the webhook timeout.
    let mut stalled = Vec::new();
    for _ in 0..2 {
        stalled.push(stalled_webhook(&app).await);
    }
    let started = Instant::now();
    let hook = format!("{}/webhooks/stripe", app.api);
    eventually(Duration::from_secs(10), "the third webhook sender request is refused", || async {
        app.http.post(&hook).header("stripe-signature", "t=1,v1=00").body("{}").send().await.unwrap().status()
            == 429
    })
    .await;
    for mut s in stalled {
        let answer = read_to_close(&mut s, Duration::from_secs(10)).await.expect("answered");
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 503") && text.contains("request_timeout"), "{text}");
    }
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    app.stop().await;
}

/// With `webhook_allowed_networks`, a webhook from elsewhere is 403 `webhook_source_refused`
/// before its body is read (a body that never arrives is answered at once).
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn webhooks_from_outside_the_allowed_networks_are_refused_unread(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app =
        api_only(opts, |c| c.webhook_allowed_networks = vec!["10.0.0.0/8".into(), "192.0.2.7".into()]).await;
    let mut s = stalled_webhook(&app).await;
    let answer = read_to_close(&mut s, Duration::from_secs(3)).await.expect("answered before the body");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 403") && text.contains("webhook_source_refused"), "{text}");
    assert!(boxoffice::config::Config {
        webhook_allowed_networks: vec!["10.0.0.0/33".into()],
        ..Default::default()
    }
    .validate()
    .is_err());
    app.stop().await;
}

/// A request still running at the request timeout (its body trickles in, each chunk within
/// the body-read timeout) is answered 503 `request_timeout` with `Retry-After`.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn edge_request_timeout_answers_503_problem(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = api_only(opts, |c| {
        c.http_request_timeout_ms = 1_500;
        c.http_request_body_timeout_ms = 1_000;
    })
    .await;
    let mut s = TcpStream::connect(addr(&app)).await.unwrap();
    s.write_all(b"POST /webhooks/stripe HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
        .await
        .unwrap();
    let (mut rd, mut wr) = s.into_split();
    let trickle = tokio::spawn(async move {
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            if wr.write_all(b" ").await.is_err() {
                break;
            }
        }
    });
    let started = Instant::now();
    let mut answer = vec![0u8; 4096];
    let n =
        tokio::time::timeout(Duration::from_secs(10), rd.read(&mut answer)).await.expect("answered").unwrap();
    let text = String::from_utf8_lossy(&answer[..n]).to_lowercase();
    trickle.abort();
    assert!(text.starts_with("http/1.1 503"), "{text}");
    assert!(text.contains("retry-after") && text.contains("request_timeout"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    app.stop().await;
}

/// Connections beyond `http_max_connections` are answered 503 `overloaded` (problem+json,
/// `Retry-After`, `Connection: close`) instead of waiting.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn edge_connections_beyond_the_limit_get_503(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = api_only(opts, |c| {
        c.http_max_connections = 4;
        // Order streams may hold at most half of the connections.
        c.order_stream_max = 2;
        c.order_stream_max_per_user = 1;
        c.order_stream_max_per_ip = 1;
        c.http_header_read_timeout_ms = 2_000;
    })
    .await;
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(addr(&app)).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut s = TcpStream::connect(addr(&app)).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let answer = read_to_close(&mut s, Duration::from_secs(5)).await.expect("answered and closed");
    let text = String::from_utf8_lossy(&answer).to_lowercase();
    assert!(text.starts_with("http/1.1 503"), "{text}");
    assert!(text.contains("connection: close") && text.contains("retry-after"), "{text}");
    assert!(text.contains("application/problem+json") && text.contains("overloaded"), "{text}");
    drop(idle);
    eventually(Duration::from_secs(10), "served again once the idle ones are gone", || async {
        app.http.get(format!("{}/healthz", app.api)).send().await.is_ok_and(|r| r.status() == 200)
    })
    .await;
    app.stop().await;
}

async fn seats_from(app: &TestApp, xff: &str) -> reqwest::Response {
    app.http
        .get(format!("{}/events/{}/seats", app.api, app.event))
        .header("x-forwarded-for", xff)
        .send()
        .await
        .unwrap()
}

async fn assert_limited(r: reqwest::Response, scope: &str, what: &str) {
    assert!(r.headers().contains_key("retry-after"), "{what}: {:?}", r.headers());
    let (status, code, body) = problem(r).await;
    assert_eq!((status, code.as_str(), body["scope"].as_str()), (429, "rate_limited", Some(scope)), "{what}");
}

/// Holds, order status and the seat map have buckets of their own: per client IP (the entry
/// the one trusted proxy appended to `X-Forwarded-For`; IPv6 by /64) and per user. With
/// Redis gone they are still limited, by the in-process fallback, and still served.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn buckets_cover_holds_orders_and_the_seat_map_even_with_redis_down(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let mut redis = PrivateRedis::start(free_port()).await;
    let url = redis.url();
    let app = api_only(opts, |c| {
        c.redis_url = url.into();
        c.http_trusted_proxy_hops = 1;
        c.rate_limit_seats_ip_per_s = 0.01;
        c.rate_limit_seats_ip_burst = 2;
        c.rate_limit_purchase_ip_per_s = 0.01;
        c.rate_limit_purchase_ip_burst = 3;
        c.rate_limit_purchase_user_per_s = 0.01;
        c.rate_limit_purchase_user_burst = 2;
    })
    .await;
    // Seat map, per IP.
    assert_eq!(seats_from(&app, "203.0.113.1").await.status(), 200);
    assert_eq!(seats_from(&app, "6.6.6.6, 203.0.113.1").await.status(), 200, "the forged entry is ignored");
    assert_limited(seats_from(&app, "7.7.7.7, 203.0.113.1").await, "ip", "third seat map from one IP").await;
    assert_eq!(seats_from(&app, "203.0.113.2").await.status(), 200, "another IP has its own bucket");
    assert_eq!(seats_from(&app, "garbage").await.status(), 200, "garbage counts against the socket");
    // IPv6 clients share their /64.
    assert_eq!(seats_from(&app, "2001:db8:1:2::1").await.status(), 200);
    assert_eq!(seats_from(&app, "[2001:db8:1:2:ffff::9]:443").await.status(), 200);
    assert_limited(seats_from(&app, "2001:db8:1:2:abcd::1").await, "ip", "same /64").await;
    assert_eq!(seats_from(&app, "2001:db8:1:3::1").await.status(), 200, "another /64");

    // Order status, per user (each request from its own IP).
    let a = app.buyer();
    let order = |b: &Buyer, ip: String| {
        app.http
            .get(format!("{}/orders/{}", app.api, Uuid::new_v4()))
            .bearer_auth(&b.token)
            .header("x-forwarded-for", ip)
            .send()
    };
    assert_eq!(order(&a, "198.51.100.1".into()).await.unwrap().status(), 404);
    assert_eq!(order(&a, "198.51.100.2".into()).await.unwrap().status(), 404);
    assert_limited(order(&a, "198.51.100.3".into()).await.unwrap(), "user", "third order poll of one user")
        .await;

    // Holds, per IP (each request by its own user).
    let hold = |b: &Buyer| {
        app.http
            .post(format!("{}/events/{}/holds", app.api, app.event))
            .bearer_auth(&b.token)
            .header("x-forwarded-for", "192.0.2.77")
            .header("idempotency-key", "k")
            .header("x-admission-token", "not-a-token")
            .json(&serde_json::json!({"seat_ids": [Uuid::new_v4()]}))
            .send()
    };
    for _ in 0..3 {
        assert_eq!(hold(&app.buyer()).await.unwrap().status(), 403, "through the buckets to the token check");
    }
    assert_limited(hold(&app.buyer()).await.unwrap(), "ip", "fourth hold from one IP").await;

    // Redis gone: still served, still limited (per process).
    redis.kill();
    assert_eq!(seats_from(&app, "203.0.113.50").await.status(), 200);
    assert_eq!(seats_from(&app, "203.0.113.50").await.status(), 200);
    assert_limited(seats_from(&app, "203.0.113.50").await, "ip", "fallback limiter").await;
    let b = app.buyer();
    assert_eq!(order(&b, "198.51.100.9".into()).await.unwrap().status(), 404, "order status without Redis");
    assert!(metric(&app, "boxoffice_rate_limit_fallback_total").await >= 3.0);
    app.stop().await;
}

/// Junk event ids flood the seat map: every id reaches the ledger at most once per cache
/// age (misses are cached too, each id renders alone), and the real event's map is served
/// meanwhile.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn seat_map_junk_ids_read_the_ledger_once_per_id_while_the_real_map_is_served(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    const IDS: usize = 25;
    const PER_ID: usize = 12;
    let app = api_only(opts, |_| {}).await;
    let before = metric(&app, "boxoffice_seat_map_renders_total{outcome=\"unknown\"}").await;
    let junk: Vec<Uuid> = (0..IDS).map(|_| Uuid::new_v4()).collect();
    let gate = crate::helpers::barrier(IDS * PER_ID + 1);
    let started = Instant::now();
    let mut flood = tokio::task::JoinSet::new();
    for id in junk.iter().flat_map(|id| std::iter::repeat_n(*id, PER_ID)) {
        let (http, url, gate) = (app.http.clone(), format!("{}/events/{id}/seats", app.api), gate.clone());
        flood.spawn(async move {
            gate.wait().await;
            http.get(url).send().await.map(|r| r.status().as_u16()).unwrap_or(0)
        });
    }
    gate.wait().await;
    let mut real = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        let r = app.http.get(format!("{}/events/{}/seats", app.api, app.event)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["seats"].as_array().map(Vec::len), Some(20));
        real.push(t.elapsed());
    }
    let mut statuses = Vec::new();
    while let Some(s) = flood.join_next().await {
        statuses.push(s.unwrap());
    }
    let elapsed = started.elapsed();
    assert!(statuses.iter().all(|s| *s == 404), "every junk id is a 404: {statuses:?}");
    let renders = metric(&app, "boxoffice_seat_map_renders_total{outcome=\"unknown\"}").await - before;
    // At most one read per id and cache age (1 s) that the flood lasted.
    let ages = 1 + elapsed.as_millis() as usize / 1_000;
    eprintln!(
        "seat map: {} junk requests over {IDS} ids in {elapsed:?} → {renders} ledger reads; real map max {:?}",
        IDS * PER_ID,
        real.iter().max()
    );
    assert!(renders >= IDS as f64 && renders <= (IDS * ages) as f64, "{renders} reads for {IDS} ids");
    assert!(*real.iter().max().unwrap() < Duration::from_secs(2), "{real:?}");
    app.stop().await;
}

/// A revoked token stays revoked when Redis restarts empty (the ledger answers until Redis
/// is re-seeded from it) and while Redis is down; unrevoked tokens keep buying; leaving the
/// queue records its revocation in the ledger too.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn revocations_survive_a_redis_restart(_: PgPoolOptions, opts: PgConnectOptions) {
    let port = free_port();
    let mut redis = PrivateRedis::start(port).await;
    let url = redis.url();
    let app = api_only(opts, |c| {
        c.redis_url = url.into();
        c.admission_direct = false;
        c.rate_limit_ip_per_s = 0.0;
        c.rate_limit_user_per_s = 0.0;
    })
    .await;
    let seats = app.seats().await;
    let room = runtime::waitroom(&app.cfg).unwrap();
    let ring = runtime::admission_tokens(&app.cfg).unwrap();
    let (a, b, c) = (app.buyer(), app.buyer(), app.buyer());
    let issue = |u: &Buyer| ring.issue(UserId(u.user), EventId(app.event), 1, 600);
    let ((revoked, claims), (good, _)) = (issue(&a), issue(&b));
    boxoffice_api::revocation::revoke(&app.pool, &room, claims.jti, claims.exp).await.unwrap();
    // c leaves the queue during its admission slot: that revokes its token.
    let join: Value = app
        .http
        .post(format!("{}/events/{}/queue", app.api, app.event))
        .bearer_auth(&c.token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ticket = join["ticket"].as_str().unwrap().to_owned();
    room.release(EventId(app.event), 1, None).await.unwrap();
    let polled: Value = app
        .http
        .get(format!("{}/queue/{ticket}", app.api))
        .bearer_auth(&c.token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let left_token = polled["admission_token"].as_str().expect("admitted").to_owned();
    let r =
        app.http.delete(format!("{}/queue/{ticket}", app.api)).bearer_auth(&c.token).send().await.unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(app.count("SELECT count(*) FROM admission_revocations").await, 2, "both in the ledger");

    let hold = |who: &Buyer, token: &str, key: &str, seat: Uuid| {
        app.http
            .post(format!("{}/events/{}/holds", app.api, app.event))
            .bearer_auth(&who.token)
            .header("idempotency-key", key)
            .header("x-admission-token", token)
            .json(&serde_json::json!({"seat_ids": [seat]}))
            .send()
    };
    let refused = |r: reqwest::Response| async move {
        let (status, code, _) = problem(r).await;
        assert_eq!((status, code.as_str()), (403, "admission_token_revoked"));
    };
    refused(hold(&a, &revoked, "a1", seats[0]).await.unwrap()).await;
    refused(hold(&c, &left_token, "c1", seats[0]).await.unwrap()).await;

    // Redis restarts empty.
    redis.kill();
    let _redis = PrivateRedis::start(port).await;
    eventually(Duration::from_secs(10), "Redis answers again", || async { room.clock_ms().await.is_ok() })
        .await;
    assert!(!room.revocation_state(claims.jti).await.unwrap().revoked, "the restarted Redis forgot it");
    refused(hold(&a, &revoked, "a2", seats[0]).await.unwrap()).await;
    refused(hold(&c, &left_token, "c2", seats[0]).await.unwrap()).await;
    assert_eq!(hold(&b, &good, "b1", seats[1]).await.unwrap().status(), 202, "an unrevoked token buys");
    // The next check that reaches Redis (past the skip window after its failure) finds the
    // seed marker gone and re-seeds it from the ledger.
    let mut attempt = 0;
    let (seat0, jti) = (seats[0], claims.jti);
    let (hold_ref, room_ref, revoked_ref, a_ref) = (&hold, &room, &revoked, &a);
    eventually(Duration::from_secs(15), "Redis re-seeded from the ledger", || {
        attempt += 1;
        let key = format!("a-reseed-{attempt}");
        async move {
            let r = hold_ref(a_ref, revoked_ref, &key, seat0).await.unwrap();
            assert_eq!(r.status(), 403);
            room_ref.revocation_state(jti).await.is_ok_and(|s| s.revoked && s.seeded)
        }
    })
    .await;
    refused(hold(&a, &revoked, "a3", seats[0]).await.unwrap()).await;
    let metrics = app.http.get(format!("{}/metrics", app.api)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("boxoffice_admission_revocation_ledger_checks_total{reason=\"redis_unseeded\"}"));
    assert!(metrics.contains("boxoffice_admission_revocation_reseeds_total{outcome=\"seeded\"}"));

    // Redis down: the ledger still refuses the revoked token.
    drop(_redis);
    refused(hold(&a, &revoked, "a4", seats[0]).await.unwrap()).await;
    assert_eq!(app.count("SELECT count(*) FROM orders").await, 1, "only b's hold wrote anything");
    app.stop().await;
}

/// A Redis that answers with an error other than unavailability (here: it wants a password
/// the deployment does not send) fails the revocation check closed: 503, nothing held.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn revocation_check_fails_closed_on_a_redis_error(_: PgPoolOptions, opts: PgConnectOptions) {
    let redis = PrivateRedis::start_with(free_port(), &["--requirepass", "not-given"]).await;
    let url = redis.url();
    let app = api_only(opts, |c| c.redis_url = url.into()).await;
    let seats = app.seats().await;
    let a = app.buyer();
    let token = app.admission_token(&a);
    let r = app.hold(&a, &token, "k", &seats[..1]).await;
    assert!(r.headers().contains_key("retry-after"));
    let (status, code, _) = problem(r).await;
    assert_eq!((status, code.as_str()), (503, "revocation_check_failed"));
    assert_eq!(app.count("SELECT count(*) FROM orders").await, 0);
    app.stop().await;
}

/// A request that declares a body over `max_body_bytes` is answered 413 `body_too_large` at
/// once, on every route that takes a body, before any of it is sent: it neither waits for the
/// body (a slot held until a timeout's 503) nor reads it.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_declared_body_over_the_limit_is_refused_before_it_is_read(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = api_only(opts, |c| {
        c.http_request_timeout_ms = 30_000;
        c.http_request_body_timeout_ms = 30_000;
    })
    .await;
    let b = app.buyer();
    for (path, auth) in [
        ("/webhooks/stripe".to_owned(), String::new()),
        (
            format!("/events/{}/holds", app.event),
            format!("Authorization: {}\r\nIdempotency-Key: k\r\n", b.bearer()),
        ),
    ] {
        let mut s = TcpStream::connect(addr(&app)).await.unwrap();
        s.write_all(
            format!(
                "POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        let mut answer = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut answer))
            .await
            .expect("answered before the body was sent")
            .unwrap();
        let text = String::from_utf8_lossy(&answer[..n]).to_lowercase();
        assert!(text.starts_with("http/1.1 413"), "{path}: {text}");
        assert!(
            text.contains("application/problem+json") && text.contains("body_too_large"),
            "{path}: {text}"
        );
    }
    app.stop().await;
}
