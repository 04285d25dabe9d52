//! Test helpers on top of `boxoffice-harness`: a [`TestApp`] is the harness's in-process
//! deployment (roles on a per-test database, API on port 0, an in-process Stripe simulator
//! whose webhooks reach that API, per-test Kafka topics under a unique prefix on the shared
//! broker) plus the seeded event, with the buyer's requests of the harness's client and small
//! polling and assertion helpers. Also where the tests find the product binary.

use boxoffice::config::Config;
use boxoffice::runtime::{self, Role};
use boxoffice_domain::{EventId, UserId};
use boxoffice_harness::client::BuyerClient;
use boxoffice_harness::deploy::{self, Deployment};
use boxoffice_store::venue::{self, VenueSpec};
use boxoffice_stripe_sim::StripeSim;
use serde_json::Value;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgPool};
use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The product binary, `boxoffice`: cargo builds only this package's binaries for its tests
/// (`boxoffice-drills`), so the product's is found next to it in the same target directory,
/// where `scripts/test` builds it first (see the crate docs).
pub fn product_bin() -> PathBuf {
    let path = std::path::Path::new(env!("CARGO_BIN_EXE_boxoffice-drills")).with_file_name("boxoffice");
    assert!(
        path.is_file(),
        "{} is missing: build every binary first (`cargo build --workspace --bins --tests`; scripts/test does)",
        path.display()
    );
    path
}

/// Bootstrap servers of the test broker; the suite needs one (scripts/test starts it).
pub fn test_brokers() -> String {
    std::env::var("BOXOFFICE_TEST_KAFKA_BROKERS")
        .expect("BOXOFFICE_TEST_KAFKA_BROKERS must name the test broker: run the suite with scripts/test")
}

/// The shared test Redis (`BOXOFFICE_TEST_REDIS_URL`, default `redis://127.0.0.1:6379`);
/// every test uses its own key prefix on it.
pub fn test_redis_url() -> String {
    std::env::var("BOXOFFICE_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

pub struct TestApp {
    pub pool: PgPool,
    pub cfg: Config,
    pub api: String,
    pub http: reqwest::Client,
    pub sim: StripeSim,
    pub event: Uuid,
    client: BuyerClient,
    deployment: Option<Deployment>,
    opts: PgConnectOptions,
    late: Vec<(CancellationToken, runtime::Running)>,
}

pub struct Buyer {
    pub user: Uuid,
    pub token: String,
}

impl Buyer {
    /// The `authorization` header value, `Bearer …`.
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.token)
    }
}

impl TestApp {
    /// Roles `roles` on a fresh database seeded with `venue`. Kafka (topics with a unique
    /// prefix on the test broker) is configured only when a role needs it.
    pub async fn spawn(opts: PgConnectOptions, roles: &[Role], venue_spec: VenueSpec) -> TestApp {
        Self::spawn_with(opts, roles, venue_spec, |_| {}).await
    }

    pub async fn spawn_with(
        opts: PgConnectOptions,
        roles: &[Role],
        venue_spec: VenueSpec,
        tweak: impl FnOnce(&mut Config),
    ) -> TestApp {
        let pool = boxoffice_store::connect(opts.clone(), 8, 10_000).await.expect("pool");
        let mut cfg = Config {
            http_bind: "127.0.0.1:0".into(),
            consumers_per_role: 1,
            kafka_partitions: 3,
            expiry_interval_ms: 50,
            redis_url: test_redis_url().into(),
            redis_key_prefix: format!("t{}:", Uuid::new_v4().simple()),
            admission_direct: true,
            release_max_per_s: 0.0,
            // Tests poll orders and seat maps from one host far faster than a buyer would;
            // the tests of the buckets turn them on.
            rate_limit_purchase_ip_per_s: 0.0,
            http_max_in_flight_per_ip: 0,
            rate_limit_purchase_user_per_s: 0.0,
            rate_limit_seats_ip_per_s: 0.0,
            ..Config::default()
        };
        if roles.iter().any(|r| r.needs_kafka()) {
            cfg.kafka_brokers = Some(test_brokers());
            cfg.kafka_topic_prefix = format!("t{}.", Uuid::new_v4().simple());
        }
        tweak(&mut cfg);
        let (event, _) =
            venue::seed(&pool, "Test Event", &venue_spec, chrono::Utc::now(), &cfg.purchase_cell)
                .await
                .expect("seed");
        let deployment = Deployment::start(
            cfg,
            deploy::Options {
                webhook_initial_backoff_ms: Some(20),
                ready_timeout: Duration::from_secs(30),
                ..deploy::Options::new(roles, opts.clone())
            },
        )
        .await
        .expect("roles start and consumer groups get their partitions");
        let api = deployment.api_url().unwrap_or_default();
        let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
        TestApp {
            pool,
            cfg: deployment.cfg.clone(),
            client: BuyerClient::new(http.clone(), &api),
            api,
            http,
            sim: deployment.sim.clone().expect("the in-process simulator"),
            event: event.0,
            deployment: Some(deployment),
            opts,
            late: Vec::new(),
        }
    }

    /// Starts `roles` now, beside the running ones, on the same configuration (a worker that
    /// was lagging, or down, catches up); [`TestApp::stop`] stops them too.
    pub async fn start_roles(&mut self, roles: &[Role]) {
        let sd = CancellationToken::new();
        let running =
            runtime::start(&self.cfg, roles, self.opts.clone(), sd.clone()).await.expect("roles start");
        assert!(running.wait_ready(Duration::from_secs(30)).await, "consumer groups got their partitions");
        self.late.push((sd, running));
    }

    /// Stops the roles [`TestApp::start_roles`] started (a worker goes down and lags).
    pub async fn stop_late_roles(&mut self) {
        for (sd, running) in self.late.drain(..) {
            sd.cancel();
            running.join().await;
        }
    }

    /// The release controller's status (the API role with `release_max_per_s` > 0).
    pub fn release_status(&self) -> tokio::sync::watch::Receiver<boxoffice_workers::release::Status> {
        self.deployment.as_ref().and_then(|d| d.release_status()).expect("the release controller runs")
    }

    /// Stops every role and waits for them.
    pub async fn stop(mut self) {
        for (sd, running) in self.late.drain(..) {
            sd.cancel();
            running.join().await;
        }
        if let Some(d) = self.deployment.take() {
            d.stop().await;
        }
    }

    pub fn buyer(&self) -> Buyer {
        let user = Uuid::new_v4();
        Buyer { user, token: runtime::user_tokens(&self.cfg).issue(UserId(user), 3_600) }
    }

    /// Seat ids of the event in label order (`S101-R1-S1`, …).
    pub async fn seats(&self) -> Vec<Uuid> {
        sqlx::query_scalar(
            "SELECT id FROM seats WHERE event_id = $1 ORDER BY section, length(row_label), row_label, seat_number",
        )
        .bind(self.event)
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }

    pub fn admission_token(&self, b: &Buyer) -> String {
        runtime::admission_tokens(&self.cfg)
            .expect("admission keys")
            .issue(UserId(b.user), EventId(self.event), 1, 600)
            .0
    }

    pub async fn hold(&self, b: &Buyer, admission: &str, key: &str, seats: &[Uuid]) -> reqwest::Response {
        self.client.hold(&b.bearer(), self.event, admission, key, seats).send().await.expect("request")
    }

    /// A hold of `seats` by `b` under Idempotency-Key `key`, with a fresh admission token;
    /// asserts the 202 and returns the new order's id.
    pub async fn hold_order(&self, b: &Buyer, key: &str, seats: &[Uuid]) -> Uuid {
        let r = self.hold(b, &self.admission_token(b), key, seats).await;
        assert_eq!(r.status(), 202);
        r.json::<Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap()
    }

    pub async fn order(&self, b: &Buyer, order: Uuid) -> (u16, Value) {
        let r = self.client.order(&b.bearer(), order).send().await.expect("request");
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// Polls the order until `pred` holds (or panics after `timeout`).
    pub async fn await_order(
        &self,
        b: &Buyer,
        order: Uuid,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let (_, v) = self.order(b, order).await;
            if pred(&v) {
                return v;
            }
            assert!(Instant::now() < deadline, "order {order} never satisfied the condition; last: {v}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Pays the order's PaymentIntent as a browser would (publishable key + client secret).
    pub async fn pay(
        &self,
        b: &Buyer,
        order: Uuid,
        payment_method: &str,
    ) -> Result<boxoffice_payments::PaymentIntent, boxoffice_payments::StripeError> {
        let v =
            self.await_order(b, order, Duration::from_secs(30), |v| v.get("client_secret").is_some()).await;
        self.stripe()
            .confirm_with_client_secret(
                &self.cfg.stripe_publishable_key,
                v["payment_intent_id"].as_str().unwrap(),
                v["client_secret"].as_str().unwrap(),
                payment_method,
            )
            .await
    }

    /// Posts webhook `body` to the app's `/webhooks/stripe`, signed now with the app's signing
    /// secret as Stripe (or whoever holds the secret) would; the answer's status.
    pub async fn deliver_webhook(&self, body: Vec<u8>) -> reqwest::StatusCode {
        let secret = secrecy::ExposeSecret::expose_secret(&self.cfg.stripe_webhook_secret).to_owned();
        let sig = boxoffice_payments::webhook::sign(&body, &secret, chrono::Utc::now().timestamp());
        self.http
            .post(format!("{}/webhooks/stripe", self.api))
            .header("Stripe-Signature", sig)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap()
            .status()
    }

    /// A Stripe client of the app's configuration (the in-process simulator, the secret key),
    /// with a 10 s timeout.
    pub fn stripe(&self) -> boxoffice_payments::StripeClient {
        boxoffice_payments::StripeClient::new(boxoffice_payments::StripeConfig {
            api_base: self.cfg.stripe_api_base.clone(),
            secret_key: self.cfg.stripe_secret_key.clone(),
            timeout_ms: 10_000,
        })
        .unwrap()
    }

    /// A PaymentIntent for `order` made straight at the provider, authorized by a good card.
    pub async fn authorize_at_provider(&self, order: Uuid, amount: i64, key: &str) -> String {
        use boxoffice_payments::PaymentGateway;
        let s = self.stripe();
        let req = boxoffice_payments::CreatePaymentIntent {
            amount_minor: amount,
            currency: "usd".into(),
            metadata: vec![("order_id".into(), order.to_string())],
        };
        let pi = s.create_payment_intent(&req, key).await.unwrap();
        let pi = s
            .confirm_with_client_secret(
                &self.cfg.stripe_publishable_key,
                &pi.id,
                pi.client_secret.as_deref().unwrap(),
                "pm_card_visa",
            )
            .await
            .unwrap();
        assert_eq!(pi.status, "requires_capture");
        pi.id
    }

    /// Refunds `amount` (all that remains when `None`) of `pi` directly at the provider, as
    /// an operator does from the dashboard.
    pub async fn refund_at_provider(&self, pi: &str, amount: Option<i64>) {
        let mut form = vec![("payment_intent", pi.to_owned())];
        if let Some(a) = amount {
            form.push(("amount", a.to_string()));
        }
        let r = self
            .http
            .post(format!("{}/v1/refunds", self.cfg.stripe_api_base))
            .bearer_auth(secrecy::ExposeSecret::expose_secret(&self.cfg.stripe_secret_key))
            .header("Idempotency-Key", Uuid::new_v4().to_string())
            .form(&form)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "refund at the provider: {}", r.text().await.unwrap());
    }

    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.unwrap()
    }

    /// Outbox rows of `event_type` for `order`.
    pub async fn outbox_count(&self, event_type: &str, order: Uuid) -> i64 {
        outbox_count(&self.pool, event_type, order).await
    }

    /// Waits for the outbox to drain, then asserts every ledger invariant check is zero.
    pub async fn assert_drained_and_clean(&self) {
        let pool = self.pool.clone();
        eventually(Duration::from_secs(60), "outbox drained", || {
            let pool = pool.clone();
            async move { boxoffice_store::outbox::backlog(&pool).await.unwrap().unpublished == 0 }
        })
        .await;
        let v = boxoffice_store::audit::violations(&self.pool, 600_000, None).await.unwrap();
        assert_eq!(v.total(), 0, "{v:?}");
    }
}

/// `env` as a fact this ledger committed and the relay published and pruned: its row in
/// `order_history` (the purchase path's consumers act on a fact read from the bus only when
/// this ledger committed it: `boxoffice_bus::Handler::verifies`). Nothing is
/// published and the outbox is unchanged; written once however often this is called.
pub async fn committed(pool: &PgPool, env: &boxoffice_domain::Envelope) {
    sqlx::query(
        "INSERT INTO order_history (event_id, order_id, topic, event_type, payload, created_at, published_at)
         VALUES ($1, $2, $3, $4, $5, now(), now())
         ON CONFLICT (event_id) DO NOTHING",
    )
    .bind(env.event_id)
    .bind(env.aggregate_id)
    .bind(boxoffice_domain::Topic::Purchase.name())
    .bind(&env.event_type)
    .bind(sqlx::types::Json(env))
    .execute(pool)
    .await
    .unwrap();
}

/// Outbox rows of `event_type` for `order`.
pub async fn outbox_count(pool: &PgPool, event_type: &str, order: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox WHERE event_type = $1 AND message_key = $2")
        .bind(event_type)
        .bind(order.to_string())
        .fetch_one(pool)
        .await
        .unwrap()
}

/// How many capture requests the outbox holds for `order`, in either form
/// (`boxoffice_domain::saga::CaptureRequest`): a `CaptureRequested`, or an `OrderConfirmed`
/// that is the request (its payload names the capture).
pub async fn capture_requests(pool: &PgPool, order: Uuid) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE message_key = $1
            AND (event_type = 'CaptureRequested' OR (event_type = 'OrderConfirmed' AND payload->'payload' ? 'capture'))",
    )
    .bind(order.to_string())
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Whether consumer `consumer` has applied fact `event_id` (its inbox row).
pub async fn in_inbox(pool: &PgPool, consumer: &str, event_id: Uuid) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM inbox WHERE consumer = $1 AND event_id = $2)")
        .bind(consumer)
        .bind(event_id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Awaits `cond` (re-evaluated every 25 ms) for at most `timeout`.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Awaits (at most 30 s) one backend of this test's database waiting for a lock while it
/// runs a statement whose text is `LIKE pattern`.
pub async fn await_lock_wait(pool: &PgPool, pattern: &str, what: &str) {
    let waiting = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE $1",
        )
        .bind(pattern)
        .fetch_one(pool)
        .await
        .unwrap()
            == 1
    };
    eventually(Duration::from_secs(30), what, waiting).await;
}

/// A transaction of its own that holds `order`'s hold (`FOR UPDATE`) until it ends: what a
/// concurrent writer would hold.
pub async fn hold_lock_elsewhere(pool: &PgPool, order: Uuid) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM holds WHERE order_id = $1 FOR UPDATE")
        .bind(order)
        .execute(&mut *blocker)
        .await
        .unwrap();
    blocker
}

/// Locks `order`'s hold without waiting (`FOR UPDATE NOWAIT`) and lets it go: the error when
/// another transaction holds it.
pub async fn try_lock_hold(pool: &PgPool, order: Uuid) -> Result<(), sqlx::Error> {
    let mut probe = pool.begin().await?;
    let locked = sqlx::query("SELECT 1 FROM holds WHERE order_id = $1 FOR UPDATE NOWAIT")
        .bind(order)
        .execute(&mut *probe)
        .await;
    probe.rollback().await?;
    locked.map(|_| ())
}

/// `n` racers released together.
pub fn barrier(n: usize) -> std::sync::Arc<tokio::sync::Barrier> {
    std::sync::Arc::new(tokio::sync::Barrier::new(n))
}

pub async fn problem(resp: reqwest::Response) -> (u16, String, Value) {
    let status = resp.status().as_u16();
    let ct = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    assert!(
        status < 400 || ct.starts_with("application/problem+json"),
        "error {status} is not problem+json: {ct}"
    );
    (status, body["code"].as_str().unwrap_or("").to_owned(), body)
}

/// A database beside the test's own (`bo_x_{random}_{suffix}`: the test database's name
/// is already as long as PostgreSQL's 63-byte identifiers), dropped by [`Extra::drop`].
pub struct Extra {
    admin: PgConnectOptions,
    pub name: String,
}

impl Extra {
    pub async fn create(opts: &PgConnectOptions, suffix: &str) -> Extra {
        let name = format!("bo_x_{}_{suffix}", &Uuid::new_v4().simple().to_string()[..12]);
        let admin = opts.clone().database("postgres");
        let mut c = admin.connect().await.unwrap();
        sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
            .execute(&mut c)
            .await
            .unwrap();
        sqlx::query(&format!("CREATE DATABASE \"{name}\"")).execute(&mut c).await.unwrap();
        Extra { admin, name }
    }

    pub fn opts(&self) -> PgConnectOptions {
        self.admin.clone().database(&self.name)
    }

    pub fn url(&self) -> String {
        self.opts().to_url_lossy().to_string()
    }

    pub async fn drop(self) {
        let mut c = self.admin.connect().await.unwrap();
        sqlx::query(&format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name))
            .execute(&mut c)
            .await
            .unwrap();
    }
}
