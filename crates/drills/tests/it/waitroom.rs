//! The waiting room through the HTTP API (design §3, case C12): join, poll, release, the
//! admission token a released ticket receives, rate buckets, the per-user position limit,
//! key rotation, revocation at the hold endpoint, and Redis going down. Only the API role
//! runs; each test has its own Redis key prefix on the shared test Redis (or its own
//! `redis-server` when it kills Redis).

use crate::helpers::{eventually, problem, Buyer, TestApp};
use boxoffice::config::{AdmissionPublicKey, Config};
use boxoffice::runtime::{self, Role};
use boxoffice_admission::{AdmissionClaims, AdmissionSigningKey, AdmissionTokens};
use boxoffice_domain::EventId;
use boxoffice_harness::client::BuyerClient;
use boxoffice_store::venue::{self, VenueSpec};
use boxoffice_waitroom::Waitroom;
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

async fn app(opts: PgConnectOptions, tweak: impl FnOnce(&mut Config)) -> TestApp {
    TestApp::spawn_with(opts, &[Role::Api], VenueSpec::small(1, 2, 10), |c| {
        c.admission_direct = false;
        c.rate_limit_ip_per_s = 0.0;
        c.rate_limit_user_per_s = 0.0;
        tweak(c);
    })
    .await
}

/// The release controller at a fixed `rate` per second (min = initial = max), ticking every
/// 100 ms: for tests about the queue, not the controller's law.
fn pin_release_rate(c: &mut Config, rate: f64) {
    c.release_max_per_s = rate;
    c.release_initial_per_s = rate;
    c.release_min_per_s = rate;
    c.release_tick_ms = 100;
}

fn room(app: &TestApp) -> Waitroom {
    runtime::waitroom(&app.cfg).unwrap()
}

/// The buyer's requests against `api` (the app's, or another API process on its database).
fn client(app: &TestApp, api: &str) -> BuyerClient {
    BuyerClient::new(app.http.clone(), api)
}

async fn join(app: &TestApp, api: &str, b: &Buyer, event: Uuid) -> reqwest::Response {
    client(app, api).join_queue(&b.bearer(), event).send().await.unwrap()
}

async fn poll(app: &TestApp, api: &str, b: &Buyer, ticket: &str) -> reqwest::Response {
    let ticket = ticket.parse().expect("a queue ticket id");
    client(app, api).poll_queue(&b.bearer(), ticket).send().await.unwrap()
}

/// Joins and returns the ticket.
async fn queued(app: &TestApp, b: &Buyer) -> String {
    let r = join(app, &app.api, b, app.event).await;
    assert_eq!(r.status(), 201);
    r.json::<Value>().await.unwrap()["ticket"].as_str().unwrap().to_owned()
}

/// Joins, releases the head of the queue (this buyer, in tests that queue one buyer at a
/// time) and polls until the admission token arrives.
async fn admitted(app: &TestApp, b: &Buyer) -> (String, String) {
    let ticket = queued(app, b).await;
    room(app).release(EventId(app.event), 1, None).await.unwrap();
    let v: Value = poll(app, &app.api, b, &ticket).await.json().await.unwrap();
    assert_eq!(v["state"], "admitted", "{v}");
    (ticket, v["admission_token"].as_str().unwrap().to_owned())
}

async fn hold(app: &TestApp, api: &str, b: &Buyer, token: &str, key: &str, seat: Uuid) -> reqwest::Response {
    client(app, api).hold(&b.bearer(), app.event, token, key, &[seat]).send().await.unwrap()
}

/// The whole flow: join (201, then 200 with the same ticket), poll, release, the token on
/// the next poll, a hold with it, its HTTP retry recovering the order, leaving (which
/// revokes the token), and the metrics.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn waitroom_join_poll_release_and_hold(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = app(opts, |c| c.release_max_per_s = 0.0).await;
    let s = app.seats().await;
    let (a, b) = (app.buyer(), app.buyer());
    let r = join(&app, &app.api, &a, app.event).await;
    assert_eq!(r.status(), 201);
    let location = r.headers()["location"].to_str().unwrap().to_owned();
    let v: Value = r.json().await.unwrap();
    let ticket = v["ticket"].as_str().unwrap().to_owned();
    assert_eq!(location, format!("/queue/{ticket}"));
    assert_eq!((v["state"].as_str(), v["position"].as_u64()), (Some("queued"), Some(1)));
    assert!(v["admission_token"].is_null());
    let again = join(&app, &app.api, &a, app.event).await;
    assert_eq!(again.status(), 200, "a repeated join returns the same position");
    assert_eq!(again.json::<Value>().await.unwrap()["ticket"].as_str(), Some(ticket.as_str()));
    let tb = queued(&app, &b).await;
    assert_eq!(poll(&app, &app.api, &b, &tb).await.json::<Value>().await.unwrap()["position"], 2);
    let (status, code, _) = problem(poll(&app, &app.api, &b, &ticket).await).await;
    assert_eq!((status, code.as_str()), (404, "queue_ticket_not_found"), "only the holder may poll");
    let (status, _, _) = problem(join(&app, &app.api, &a, Uuid::new_v4()).await).await;
    assert_eq!(status, 404, "no queue for an unknown event");
    let r = app
        .http
        .post(format!("{}/events/{}/admission", app.api, app.event))
        .bearer_auth(&a.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404, "no direct admission without admission_direct");

    let released = room(&app).release(EventId(app.event), 1, None).await.unwrap();
    assert_eq!(released.admitted.len(), 1);
    let r = poll(&app, &app.api, &a, &ticket).await;
    assert_eq!(r.headers()["cache-control"], "no-store");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["state"], "admitted");
    let token = v["admission_token"].as_str().unwrap().to_owned();
    let v2: Value = poll(&app, &app.api, &a, &ticket).await.json().await.unwrap();
    assert_eq!(v2["admission_token"].as_str(), Some(token.as_str()), "one slot, one token");
    let claims = runtime::admission_tokens(&app.cfg)
        .unwrap()
        .verify(&token, boxoffice_domain::UserId(a.user), EventId(app.event))
        .unwrap();
    assert_eq!(claims.jti.to_string(), ticket);
    let expires: chrono::DateTime<chrono::Utc> = v["admission_expires_at"].as_str().unwrap().parse().unwrap();
    assert_eq!(claims.exp, expires.timestamp());
    assert!(claims.exp <= chrono::Utc::now().timestamp() + app.cfg.admission_ttl_s, "exp within the slot");
    assert_eq!(poll(&app, &app.api, &b, &tb).await.json::<Value>().await.unwrap()["position"], 1);

    let first = hold(&app, &app.api, &a, &token, "k1", s[0]).await;
    assert_eq!(first.status(), 202);
    let order = first.json::<Value>().await.unwrap()["order_id"].clone();
    let retry = hold(&app, &app.api, &a, &token, "k1", s[0]).await;
    assert_eq!(retry.status(), 202, "the token is not consumed");
    assert_eq!(retry.json::<Value>().await.unwrap()["order_id"], order);

    let r =
        app.http.delete(format!("{}/queue/{ticket}", app.api)).bearer_auth(&a.token).send().await.unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(problem(poll(&app, &app.api, &a, &ticket).await).await.0, 404);
    let (status, code, _) = problem(hold(&app, &app.api, &a, &token, "k2", s[1]).await).await;
    assert_eq!((status, code.as_str()), (403, "admission_token_revoked"), "leaving revokes the slot's token");

    let metrics = app.http.get(format!("{}/metrics", app.api)).send().await.unwrap().text().await.unwrap();
    for m in [
        "boxoffice_waitroom_joins_total",
        "boxoffice_waitroom_admitted_total",
        "boxoffice_waitroom_queue_length",
    ] {
        assert!(metrics.contains(m), "{m} missing from /metrics");
    }
    app.stop().await;
}

/// The API role's release controller admits queued buyers (its rate pinned at 20/s: the
/// adaptive law has its own tests in `release::`).
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn waitroom_release_controller_admits_queued_buyers(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = app(opts, |c| pin_release_rate(c, 20.0)).await;
    let buyers: Vec<Buyer> = (0..3).map(|_| app.buyer()).collect();
    let mut tickets = Vec::new();
    for b in &buyers {
        tickets.push(queued(&app, b).await);
    }
    eventually(Duration::from_secs(10), "every queued buyer admitted", || async {
        let mut all = true;
        for (b, t) in buyers.iter().zip(&tickets) {
            let v: Value = poll(&app, &app.api, b, t).await.json().await.unwrap();
            all &= v["state"] == "admitted" && v["admission_token"].is_string();
        }
        all
    })
    .await;
    app.stop().await;
}

/// Over a bucket → 429 problem+json with `Retry-After`, per user and per IP.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn waitroom_rate_buckets_answer_429_with_retry_after(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = app(opts, |c| {
        c.rate_limit_ip_per_s = 0.1;
        c.rate_limit_ip_burst = 3;
        c.rate_limit_user_per_s = 0.1;
        c.rate_limit_user_burst = 2;
    })
    .await;
    let (a, b) = (app.buyer(), app.buyer());
    assert_eq!(join(&app, &app.api, &a, app.event).await.status(), 201);
    assert_eq!(join(&app, &app.api, &a, app.event).await.status(), 200);
    let r = join(&app, &app.api, &a, app.event).await;
    let retry_after: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    let (status, code, body) = problem(r).await;
    assert_eq!((status, code.as_str(), body["scope"].as_str()), (429, "rate_limited", Some("user")));
    assert!((1..=10).contains(&retry_after), "{retry_after}");
    // The IP bucket (burst 3) was drained by a's three requests: b is refused by IP.
    let r = join(&app, &app.api, &b, app.event).await;
    assert!(r.headers().contains_key("retry-after"));
    let (status, code, body) = problem(r).await;
    assert_eq!((status, code.as_str(), body["scope"].as_str()), (429, "rate_limited", Some("ip")));
    let metrics = app.http.get(format!("{}/metrics", app.api)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("boxoffice_rate_limited_total"));
    app.stop().await;
}

/// A user may hold `waitroom_max_positions_per_user` live positions across events.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn waitroom_limits_positions_per_user(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = app(opts, |c| c.waitroom_max_positions_per_user = 1).await;
    let (other, _) =
        venue::seed(&app.pool, "Second Event", &VenueSpec::small(1, 1, 2), chrono::Utc::now(), "cell-1")
            .await
            .unwrap();
    let a = app.buyer();
    let ticket = queued(&app, &a).await;
    let (status, code, body) = problem(join(&app, &app.api, &a, other.0).await).await;
    assert_eq!((status, code.as_str(), body["limit"].as_u64()), (409, "queue_position_limit", Some(1)));
    let r =
        app.http.delete(format!("{}/queue/{ticket}", app.api)).bearer_auth(&a.token).send().await.unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(join(&app, &app.api, &a, other.0).await.status(), 201, "a freed position can be used");
    app.stop().await;
}

/// C12 with a token from the queue: each bad token is a 403 with its own reason, a revoked
/// jti is refused at the hold endpoint, and the good token's HTTP retry recovers the order.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn waitroom_c12_every_bad_admission_token_has_its_reason(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = app(opts, |_| {}).await;
    let s = app.seats().await;
    let (a, b) = (app.buyer(), app.buyer());
    let (_, good) = admitted(&app, &a).await;
    let ring = runtime::admission_tokens(&app.cfg).unwrap();
    let claims = ring.verify(&good, boxoffice_domain::UserId(a.user), EventId(app.event)).unwrap();
    let with = |f: &dyn Fn(&mut AdmissionClaims)| {
        let mut c = claims.clone();
        f(&mut c);
        ring.sign(&c)
    };
    let mut tampered = good.clone().into_bytes();
    let i = tampered.len() - 10;
    tampered[i] = if tampered[i] == b'A' { b'B' } else { b'A' };
    let signed_by = |kid: &str, seed: u8| {
        AdmissionTokens::new(&AdmissionSigningKey::from_seed(kid, [seed; 32]), &[], "cell-1")
            .unwrap()
            .sign(&claims)
    };
    let (_, b_token) = admitted(&app, &b).await;
    let b_claims = ring.verify(&b_token, boxoffice_domain::UserId(b.user), EventId(app.event)).unwrap();
    room(&app).revoke(b_claims.jti, b_claims.exp).await.unwrap();
    let cases: Vec<(&Buyer, String, &str)> = vec![
        (&a, with(&|c| c.exp = chrono::Utc::now().timestamp() - 1), "admission_token_expired"),
        (&a, with(&|c| c.event_id = Uuid::new_v4()), "admission_token_wrong_event"),
        (&a, with(&|c| c.sub = Uuid::new_v4()), "admission_token_wrong_user"),
        (&a, String::from_utf8(tampered).unwrap(), "admission_token_bad_signature"),
        (&a, signed_by(&app.cfg.admission_kid, 9), "admission_token_bad_signature"),
        (&a, signed_by("retired-key", 9), "admission_token_unknown_kid"),
        (&a, with(&|c| c.purchase_cell = "cell-2".into()), "admission_token_wrong_cell"),
        (&a, "not-a-token".into(), "admission_token_malformed"),
        (&b, b_token.clone(), "admission_token_revoked"),
    ];
    for (i, (buyer, token, want)) in cases.iter().enumerate() {
        let (status, code, _) =
            problem(hold(&app, &app.api, buyer, token, &format!("bad{i}"), s[0]).await).await;
        assert_eq!((status, code.as_str()), (403, *want), "case {i}");
    }
    assert_eq!(app.count("SELECT count(*) FROM orders").await, 0, "no bad token wrote anything");
    let first = hold(&app, &app.api, &a, &good, "real", s[0]).await;
    assert_eq!(first.status(), 202);
    let order = first.json::<Value>().await.unwrap()["order_id"].clone();
    let retry = hold(&app, &app.api, &a, &good, "real", s[0]).await;
    assert_eq!(retry.status(), 202, "admission is time-bounded, not consumed");
    assert_eq!(retry.json::<Value>().await.unwrap()["order_id"], order);
    app.stop().await;
}

/// Starts another API process on the same database and Redis prefix with `cfg`.
async fn another_api(cfg: Config, opts: &PgConnectOptions, sd: &CancellationToken) -> String {
    let running = runtime::start(&cfg, &[Role::Api], opts.clone(), sd.clone()).await.unwrap();
    format!("http://{}", running.api_addr.unwrap())
}

/// Rotation: the next key signs while the old one still verifies, so tokens issued before
/// keep working until they expire; once the old key is removed they are `unknown_kid`.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn waitroom_key_rotation_keeps_old_tokens_until_the_key_is_removed(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let k1 = AdmissionSigningKey::from_seed("k1", [1; 32]);
    let k2 = AdmissionSigningKey::from_seed("k2", [2; 32]);
    let app = app(opts.clone(), |c| {
        c.admission_kid = "k1".into();
        c.admission_private_key = k1.to_pkcs8_pem().into();
    })
    .await;
    let s = app.seats().await;
    let a = app.buyer();
    let (_, old) = admitted(&app, &a).await;
    let sd = CancellationToken::new();
    let rotated = Config {
        admission_kid: "k2".into(),
        admission_private_key: k2.to_pkcs8_pem().into(),
        admission_public_keys: vec![AdmissionPublicKey {
            kid: "k1".into(),
            public_key: k1.verifying_key().to_pem(),
        }],
        ..app.cfg.clone()
    };
    let api2 = another_api(rotated.clone(), &opts, &sd).await;
    assert_eq!(
        hold(&app, &api2, &a, &old, "old-on-rotated", s[0]).await.status(),
        202,
        "k1 tokens still verify"
    );
    // A buyer admitted after the rotation gets a k2 token from the rotated process.
    let b = app.buyer();
    let tb = join(&app, &api2, &b, app.event).await.json::<Value>().await.unwrap()["ticket"]
        .as_str()
        .unwrap()
        .to_owned();
    room(&app).release(EventId(app.event), 1, None).await.unwrap();
    let new = poll(&app, &api2, &b, &tb).await.json::<Value>().await.unwrap()["admission_token"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(jsonwebtoken::decode_header(&new).unwrap().kid.as_deref(), Some("k2"));
    let retired = Config { admission_public_keys: Vec::new(), ..rotated };
    let api3 = another_api(retired, &opts, &sd).await;
    let (status, code, _) = problem(hold(&app, &api3, &a, &old, "old-on-retired", s[1]).await).await;
    assert_eq!((status, code.as_str()), (403, "admission_token_unknown_kid"));
    assert_eq!(hold(&app, &api3, &b, &new, "new-on-retired", s[1]).await.status(), 202);
    sd.cancel();
    app.stop().await;
}

/// A `redis-server` of this test's own, killed mid-run (the shared one is never touched).
pub(crate) struct PrivateRedis {
    child: std::process::Child,
    port: u16,
}

impl PrivateRedis {
    pub(crate) async fn start(port: u16) -> Self {
        Self::start_with(port, &[]).await
    }

    /// With extra `redis-server` arguments (e.g. `--requirepass`).
    pub(crate) async fn start_with(port: u16, extra: &[&str]) -> Self {
        let child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server must be installed (scripts/test installs it)");
        eventually(Duration::from_secs(10), "the private redis-server accepts connections", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok()
        })
        .await;
        Self { child, port }
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops (`SIGSTOP`) or resumes (`SIGCONT`) the server: while stopped, connections are
    /// accepted by the kernel and every call times out; nothing is lost.
    pub(crate) fn signal(&self, sig: &str) {
        let ok = std::process::Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .expect("kill(1) runs")
            .success();
        assert!(ok, "kill {sig} the private redis-server");
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

async fn seat_state(app: &TestApp) -> Vec<(Uuid, Option<Uuid>)> {
    sqlx::query_as(
        "SELECT s.id, hs.hold_id FROM seats s LEFT JOIN hold_seats hs ON hs.seat_id = s.id AND hs.released_at IS NULL
          WHERE s.event_id = $1 ORDER BY s.id",
    )
    .bind(app.event)
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

/// Redis is a shield, not a ledger: with Redis gone, joins and polls are 503 with
/// `Retry-After` and no seat changes, while a buyer already admitted still holds (the
/// revocation check asks the ledger instead and is counted). Redis back → joins work again.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn waitroom_redis_down_answers_503_and_changes_no_seat(_: PgPoolOptions, opts: PgConnectOptions) {
    let port = free_port();
    let mut redis = PrivateRedis::start(port).await;
    let url = redis.url();
    let app = app(opts, |c| {
        c.redis_url = url.into();
        c.rate_limit_ip_per_s = 100.0;
        c.rate_limit_user_per_s = 100.0;
    })
    .await;
    let s = app.seats().await;
    let (a, b, c) = (app.buyer(), app.buyer(), app.buyer());
    let (_, token) = admitted(&app, &a).await;
    let tb = queued(&app, &b).await;
    let before = seat_state(&app).await;

    redis.kill();
    let started = std::time::Instant::now();
    let r = join(&app, &app.api, &c, app.event).await;
    assert!(r.headers().contains_key("retry-after"));
    let (status, code, _) = problem(r).await;
    assert_eq!((status, code.as_str()), (503, "waitroom_unavailable"));
    let r = poll(&app, &app.api, &b, &tb).await;
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(problem(r).await.0, 503);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a dead Redis is a fast 503: {:?}",
        started.elapsed()
    );
    assert_eq!(seat_state(&app).await, before, "no seat changed because Redis went away");
    assert_eq!(app.count("SELECT count(*) FROM orders").await, 0);

    let r = hold(&app, &app.api, &a, &token, "while-redis-down", s[0]).await;
    assert_eq!(r.status(), 202, "an admitted buyer still holds");
    let metrics = app.http.get(format!("{}/metrics", app.api)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("boxoffice_admission_revocation_ledger_checks_total"));
    assert!(metrics.contains("boxoffice_waitroom_redis_errors_total"));
    let after = seat_state(&app).await;
    let changed: Vec<_> = before.iter().zip(&after).filter(|(x, y)| x != y).map(|(x, _)| x.0).collect();
    assert_eq!(changed, vec![s[0]], "only the seat the admitted buyer held changed");

    // Refused for seconds on end, the crowd is told to come back later than 2–6 s, but
    // never later than a sixth of the lapse time (20 s here), so polls keep the position.
    let mut said = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let r = poll(&app, &app.api, &b, &tb).await;
        let secs: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
        assert_eq!(problem(r).await.1, "waitroom_unavailable");
        said.push(secs);
        if secs > *boxoffice_api::problem::WAITROOM_RETRY_AFTER_S.end() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no 503 was widened: {said:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(said.iter().all(|s| (1..=20).contains(s)), "within the cap: {said:?}");
    let metrics = app.http.get(format!("{}/metrics", app.api)).send().await.unwrap().text().await.unwrap();
    assert!(
        metrics.lines().any(|l| l.starts_with("boxoffice_http_retry_after_widened_total{routes=\"queue\"} ")),
        "widened answers are counted"
    );
    assert_eq!(seat_state(&app).await, after, "no seat changed while the crowd was refused");

    let _redis = PrivateRedis::start(port).await;
    eventually(Duration::from_secs(15), "joins work again once Redis is back", || async {
        join(&app, &app.api, &c, app.event).await.status() == 201
    })
    .await;
    app.stop().await;
}

/// A Redis stalled for longer than the lapse time (its process stopped: every call times
/// out, nothing is lost) lapses no position whose holder was polling before it: the stall
/// is a pause of the lapse clock, recorded by the first call after it.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn waitroom_a_stall_of_redis_longer_than_the_lapse_time_keeps_positions(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let port = free_port();
    let redis = PrivateRedis::start(port).await;
    let url = redis.url();
    let abandon = Duration::from_millis(18_000); // the shortest `validate` allows
    let app = app(opts, |c| {
        c.redis_url = url.into();
        c.waitroom_abandon_after_ms = abandon.as_millis() as u64;
        c.waitroom_poll_interval_ms = 6_000;
    })
    .await;
    let (first, second) = (app.buyer(), app.buyer());
    let (t1, t2) = (queued(&app, &first).await, queued(&app, &second).await);
    let mut conn =
        redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let clock = format!("{}wr:lapse-clock", app.cfg.redis_key_prefix);

    // Quiet for longer than a stall gap (no join, poll or release step: the release
    // controller is off here), the waiting room is no stall: the API's clock tick keeps the
    // clock seen.
    tokio::time::sleep(boxoffice_waitroom::STALL_GAP + Duration::from_secs(1)).await;
    assert_eq!(poll(&app, &app.api, &first, &t1).await.status(), 200);
    let spans: Option<String> =
        redis::cmd("HGET").arg(&clock).arg("spans").query_async(&mut conn).await.unwrap();
    assert_eq!(spans, None, "no pause recorded while Redis answered");

    // A short stall, under the stall gap: the API refuses polls for seconds, and the part of
    // its refusal streak past the first second reaches the lapse clock as a pause with the
    // first call after it.
    redis.signal("-STOP");
    let short = std::time::Instant::now();
    while short.elapsed() < Duration::from_millis(2_500) {
        assert_eq!(poll(&app, &app.api, &first, &t1).await.status(), 503);
    }
    redis.signal("-CONT");
    eventually(Duration::from_secs(15), "polls are answered again", || async {
        poll(&app, &app.api, &first, &t1).await.status() == 200
    })
    .await;
    // Sent with the next queue call or, within a second, the clock's tick.
    eventually(Duration::from_secs(5), "the refusals are recorded as a pause", || async {
        let spans: Option<String> =
            redis::cmd("HGET").arg(&clock).arg("spans").query_async(&mut conn.clone()).await.unwrap();
        let paused_ms: i64 = spans
            .iter()
            .flat_map(|s| s.split(','))
            .filter_map(|span| span.split_once(':'))
            .map(|(a, b)| b.parse::<i64>().unwrap() - a.parse::<i64>().unwrap())
            .sum();
        paused_ms >= 1_000
    })
    .await;

    // A stall longer than the lapse time.
    redis.signal("-STOP");
    let stalled_at = tokio::time::Instant::now();
    let (status, code, _) = problem(poll(&app, &app.api, &first, &t1).await).await;
    assert_eq!((status, code.as_str()), (503, "waitroom_unavailable"), "refused during the stall");
    // The stall itself is the scenario: it outlasts the lapse time.
    tokio::time::sleep_until(stalled_at + abandon + Duration::from_secs(1)).await;
    redis.signal("-CONT");
    let deadline = stalled_at + abandon + Duration::from_secs(16);
    let r = loop {
        let r = poll(&app, &app.api, &second, &t2).await;
        if r.status() != 503 {
            break r;
        }
        assert!(tokio::time::Instant::now() < deadline, "polls are answered again once Redis resumes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(r.status(), 200, "the position outlived the stall");
    let v: Value = r.json().await.unwrap();
    assert_eq!((&v["state"], &v["position"]), (&"queued".into(), &2.into()), "{v}");
    let v: Value = poll(&app, &app.api, &first, &t1).await.json().await.unwrap();
    assert_eq!((&v["state"], &v["position"]), (&"queued".into(), &1.into()), "{v}");
    // The grace is on the API's /metrics once its clock tick has seen the stall.
    eventually(Duration::from_secs(5), "the grace is exported", || async {
        let metrics =
            app.http.get(format!("{}/metrics", app.api)).send().await.unwrap().text().await.unwrap();
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("boxoffice_waitroom_lapse_grace_seconds "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .is_some_and(|grace| grace > abandon.as_secs_f64())
    })
    .await;
    app.stop().await;
}

/// The onsale's waiting-room phase, open loop and paced by the server: every buyer joins,
/// keeps its position by polling, and leaves with a valid admission token of its own user
/// for this event; the release controller is the only way in.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn onsale_buyers_queue_until_released_open_loop_and_paced(_: PgPoolOptions, opts: PgConnectOptions) {
    use boxoffice_harness::queue::{self, QueuePacing};
    let app = app(opts, |c| {
        // R pinned at 50/s: this test is about the buyers' side, not the controller's law.
        pin_release_rate(c, 50.0);
        c.waitroom_poll_interval_ms = 200;
        c.waitroom_abandon_after_ms = 20_000; // `validate` asks for at least 18 s
    })
    .await;
    let tokens = app.cfg.admission_tokens().unwrap();
    for pacing in [
        QueuePacing { attempt_rate: 400.0, arrival_rate: 0.0, max_in_flight: 64 },
        QueuePacing { attempt_rate: 0.0, arrival_rate: 200.0, max_in_flight: 64 },
    ] {
        let buyers: Vec<_> = (0..60).map(|_| app.buyer()).collect();
        // And one whose join is rejected for good (401): it is counted as rejected, not as a
        // buyer who gave up.
        let mut bearers: Vec<_> = buyers.iter().map(|b| format!("Bearer {}", b.token).into()).collect();
        bearers.push("Bearer not-a-token".to_owned().into());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let client = BuyerClient::new(app.http.clone(), &app.api);
        let stats = queue::run(client, app.event, bearers, pacing.clone(), tx).await.unwrap();
        let mut seen = std::collections::HashSet::new();
        while let Some(a) = rx.recv().await {
            // Bound to this buyer's user and this event, or verify refuses it.
            let claims = tokens
                .verify(&a.token, boxoffice_domain::UserId(buyers[a.idx].user), EventId(app.event))
                .unwrap();
            assert!(seen.insert(claims.jti), "one ticket per buyer: {pacing:?}");
        }
        assert_eq!(seen.len(), 60, "{pacing:?}: {stats:?}");
        assert_eq!(stats.admitted, 60, "{stats:?}");
        assert_eq!(
            (stats.gave_up, stats.rejected, stats.errors, stats.unavailable_503),
            (0, 1, 1, 0),
            "{stats:?}"
        );
        // Released at 50/s, 60 buyers cannot all be admitted on their join: some polled.
        assert!(stats.polls > 0 && stats.joins >= 60, "{stats:?}");
        assert!(stats.max_position > 1, "a queue formed: {stats:?}");
        assert_eq!(room(&app).stats(EventId(app.event)).await.unwrap().queued, 0);
    }
    app.stop().await;
}
