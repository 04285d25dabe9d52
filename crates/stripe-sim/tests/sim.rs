//! End-to-end: the production `StripeClient` against the simulator over real HTTP, with a tiny
//! webhook receiver verifying every delivery. No sleeps: tests await channels, barriers and
//! `wait_webhooks_idle`, each bounded by a timeout.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use boxoffice_payments::webhook::{self, Event, WebhookError, DEFAULT_TOLERANCE_S};
use boxoffice_payments::{
    CreatePaymentIntent, CreatedWindow, PaymentGateway, PaymentIntent, StripeClient, StripeConfig,
    StripeError,
};
use boxoffice_stripe_sim::{Faults, SimConfig, StripeSim};
use secrecy::SecretString;
use serde_json::Value;
use tokio::sync::{mpsc, Barrier};
use tokio_util::sync::CancellationToken;

const SECRET_KEY: &str = "sk_test_boxoffice";
const PUBLISHABLE_KEY: &str = "pk_test_boxoffice";
const WHSEC: &str = "whsec_test_sim";
const WAIT: Duration = Duration::from_secs(10);

/// One webhook POST as received: raw body and signature header.
struct Delivery {
    body: Bytes,
    signature: String,
}

impl Delivery {
    fn verify(&self) -> Result<Event, WebhookError> {
        webhook::verify(&self.body, &self.signature, WHSEC, DEFAULT_TOLERANCE_S, unix_now())
    }
}

struct Harness {
    sim: StripeSim,
    base: String,
    client: StripeClient,
    deliveries: mpsc::UnboundedReceiver<Delivery>,
    /// The receiver answers 500 to this many deliveries before accepting.
    reject_next: Arc<AtomicU32>,
    shutdown: CancellationToken,
    served: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

fn unix_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64
}

fn client(base: &str, timeout_ms: u64) -> StripeClient {
    StripeClient::new(StripeConfig {
        api_base: base.into(),
        secret_key: SecretString::from(SECRET_KEY),
        timeout_ms,
    })
    .unwrap()
}

async fn start() -> Harness {
    let shutdown = CancellationToken::new();
    let (tx, deliveries) = mpsc::unbounded_channel();
    let reject_next = Arc::new(AtomicU32::new(0));
    let reject = reject_next.clone();
    let receiver = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: HeaderMap, body: Bytes| {
            let (tx, reject) = (tx.clone(), reject.clone());
            async move {
                if reject.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
                    return StatusCode::INTERNAL_SERVER_ERROR;
                }
                let signature = headers
                    .get("stripe-signature")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let _ = tx.send(Delivery { body, signature });
                StatusCode::OK
            }
        }),
    );
    let hook_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_addr = hook_listener.local_addr().unwrap();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        axum::serve(hook_listener, receiver).with_graceful_shutdown(stop.cancelled_owned()).await.unwrap();
    });

    let sim = StripeSim::new(SimConfig {
        webhook_url: Some(format!("http://{hook_addr}/hook")),
        webhook_secret: WHSEC.into(),
        webhook_initial_backoff_ms: 10,
        ..SimConfig::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let served = tokio::spawn(sim.clone().serve(listener, shutdown.clone()));
    Harness { served, client: client(&base, 5_000), sim, base, deliveries, reject_next, shutdown }
}

impl Harness {
    async fn create(&self, amount: i64, key: &str) -> PaymentIntent {
        let req = CreatePaymentIntent {
            amount_minor: amount,
            currency: "usd".into(),
            metadata: vec![("order_id".into(), format!("ord_{key}"))],
        };
        self.client.create_payment_intent(&req, key).await.unwrap()
    }

    async fn confirm(&self, pi: &PaymentIntent, pm: &str) -> Result<PaymentIntent, StripeError> {
        let secret = pi.client_secret.as_deref().unwrap();
        self.client.confirm_with_client_secret(PUBLISHABLE_KEY, &pi.id, secret, pm).await
    }

    async fn authorized(&self, key: &str) -> PaymentIntent {
        let pi = self.create(2500, key).await;
        let pi = self.confirm(&pi, "pm_card_visa").await.unwrap();
        assert_eq!(pi.status, "requires_capture");
        pi
    }

    /// The next verified event of `event_type` about `object_id`, skipping others.
    async fn event(&mut self, event_type: &str, object_id: &str) -> Event {
        loop {
            let d =
                tokio::time::timeout(WAIT, self.deliveries.recv()).await.expect("webhook in time").unwrap();
            let ev = d.verify().expect("simulator signs correctly");
            if ev.r#type == event_type && ev.data.object["id"] == object_id {
                return ev;
            }
        }
    }

    fn raw(&self, method: reqwest::Method, path: &str, key: Option<&str>) -> reqwest::RequestBuilder {
        let mut req = reqwest::Client::new().request(method, format!("{}{path}", self.base));
        if let Some(key) = key {
            req = req.bearer_auth(key);
        }
        req
    }
}

fn api_error(e: &StripeError) -> (u16, &str, Option<&str>) {
    match e {
        StripeError::Api { status, error_type, code, .. } => (*status, error_type.as_str(), code.as_deref()),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn authorize_capture_refund_with_webhooks() {
    let mut h = start().await;
    let pi = h.create(4200, "authorize:evt_1").await;
    assert_eq!(
        (pi.status.as_str(), pi.amount, pi.capture_method.as_str()),
        ("requires_payment_method", 4200, "manual")
    );
    assert!(pi.client_secret.as_deref().unwrap().starts_with(&format!("{}_secret_", pi.id)));
    assert_eq!(pi.metadata["order_id"], "ord_authorize:evt_1");

    let pi = h.confirm(&pi, "pm_card_visa").await.unwrap();
    assert_eq!((pi.status.as_str(), pi.amount_capturable), ("requires_capture", 4200));
    let charge_id = pi.latest_charge.clone().expect("authorization creates a charge");
    let ev = h.event("payment_intent.amount_capturable_updated", &pi.id).await;
    let typed: PaymentIntent = ev.data.object_as().unwrap();
    assert_eq!(
        (typed.status.as_str(), ev.livemode, ev.api_version.as_deref()),
        ("requires_capture", false, Some("2024-06-20"))
    );
    assert!(ev.id.starts_with("evt_"));

    let pi = h.client.capture_payment_intent(&pi.id, "capture:ord_1").await.unwrap();
    assert_eq!((pi.status.as_str(), pi.amount_received, pi.amount_capturable), ("succeeded", 4200, 0));
    h.event("payment_intent.succeeded", &pi.id).await;

    let meta = vec![("order_id".to_owned(), "ord_1".to_owned())];
    let refund = h.client.create_refund(&pi.id, &meta, "refund:ord_1").await.unwrap();
    assert_eq!((refund.status.as_str(), refund.amount), ("succeeded", 4200));
    assert_eq!(refund.payment_intent.as_deref(), Some(pi.id.as_str()));
    assert_eq!(refund.metadata["order_id"], "ord_1");
    let charge = h.event("charge.refunded", &charge_id).await.data.object;
    assert_eq!(charge["payment_intent"], pi.id.as_str());
    assert_eq!((charge["refunded"].as_bool(), charge["amount_refunded"].as_i64()), (Some(true), Some(4200)));
    assert_eq!(
        charge["metadata"]["order_id"], "ord_authorize:evt_1",
        "charge metadata is copied from the intent"
    );
    h.event("refund.created", &refund.id).await;

    let again = h.client.create_refund(&pi.id, &meta, "refund:ord_1:again").await.unwrap_err();
    assert_eq!(again.code(), Some("charge_already_refunded"));
    let stats = h.sim.stats();
    assert_eq!((stats.payment_intents_created, stats.captures_applied, stats.refunds), (1, 1, 1));
    assert_eq!(h.client.retrieve_payment_intent(&pi.id).await.unwrap().status, "succeeded");
}

#[tokio::test]
async fn declined_card_is_402_with_payment_failed_webhook() {
    let mut h = start().await;
    let pi = h.create(1000, "authorize:evt_decline").await;
    let err = h.confirm(&pi, "pm_card_chargeDeclined").await.unwrap_err();
    assert_eq!(api_error(&err), (402, "card_error", Some("card_declined")));
    assert_eq!(err.decline_code(), Some("generic_decline"));
    assert!(!err.is_retryable());
    assert!(!format!("{err} {err:?}").contains("_secret_"), "errors never carry the client secret");

    let ev = h.event("payment_intent.payment_failed", &pi.id).await;
    assert_eq!(ev.data.object["last_payment_error"]["decline_code"], "generic_decline");
    let now = h.client.retrieve_payment_intent(&pi.id).await.unwrap();
    assert_eq!(now.status, "requires_payment_method");
    assert!(now.last_payment_error.is_some());

    // The buyer retries with another card.
    let pi = h.confirm(&pi, "pm_card_mastercard").await.unwrap();
    assert_eq!(pi.status, "requires_capture");
    assert_eq!(h.sim.stats().confirmations_declined, 1);
}

#[tokio::test]
async fn idempotent_replay_mismatch_and_unsaved_validation_errors() {
    let h = start().await;
    let a = h.create(1500, "authorize:evt_same").await;
    let b = h.create(1500, "authorize:evt_same").await;
    assert_eq!(a.id, b.id);
    assert_eq!(h.sim.stats().payment_intents_created, 1);

    let hr = &h;
    let post = |key: &'static str, body: &'static str| async move {
        let resp = hr
            .raw(reqwest::Method::POST, "/v1/payment_intents", Some(SECRET_KEY))
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body(body)
            .send()
            .await
            .unwrap();
        let replayed = resp.headers().get("idempotent-replayed").map(|v| v.to_str().unwrap().to_owned());
        (resp.status(), replayed, resp.bytes().await.unwrap())
    };
    let first = post("raw-1", "amount=700&currency=usd&metadata[order_id]=o7").await;
    let second = post("raw-1", "metadata[order_id]=o7&currency=usd&amount=700").await;
    assert_eq!((first.0, first.1.as_deref()), (StatusCode::OK, None));
    assert_eq!((second.0, second.1.as_deref()), (StatusCode::OK, Some("true")));
    assert_eq!(first.2, second.2, "a replay is byte-identical");

    let req = CreatePaymentIntent { amount_minor: 9999, currency: "usd".into(), metadata: vec![] };
    let err = h.client.create_payment_intent(&req, "authorize:evt_same").await.unwrap_err();
    assert_eq!(api_error(&err), (400, "idempotency_error", None));

    // Validation failures are not stored: the same key may be reused with fixed parameters.
    let bad = post("raw-2", "currency=usd").await;
    let v: Value = serde_json::from_slice(&bad.2).unwrap();
    assert_eq!((bad.0, v["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("parameter_missing")));
    assert_eq!(post("raw-2", "amount=5&currency=usd").await.0, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_captures_with_one_key_capture_once() {
    let h = start().await;
    let pi = h.authorized("authorize:evt_race").await;
    // Hold the first capture long enough for the others to collide with it.
    h.sim.set_faults(Faults { latency_ms: 300, ..Faults::default() });
    let barrier = Arc::new(Barrier::new(10));
    let tasks: Vec<_> = (0..10)
        .map(|_| {
            let (client, barrier, id) = (h.client.clone(), barrier.clone(), pi.id.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                client.capture_payment_intent(&id, "capture:ord_race").await
            })
        })
        .collect();
    let (mut ok, mut in_use) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok(pi) => {
                assert_eq!(pi.status, "succeeded");
                ok += 1;
            }
            Err(e) => {
                assert_eq!(api_error(&e), (409, "idempotency_error", Some("idempotency_key_in_use")));
                assert!(e.is_retryable());
                in_use += 1;
            }
        }
    }
    assert!(ok >= 1 && in_use >= 1 && ok + in_use == 10, "ok={ok} in_use={in_use}");
    h.sim.set_faults(Faults::default());
    let retried = h.client.capture_payment_intent(&pi.id, "capture:ord_race").await.unwrap();
    assert_eq!(retried.status, "succeeded");
    assert_eq!(h.sim.captures_for(&pi.id), 1);
    assert_eq!(h.sim.stats().captures_applied, 1);
}

#[tokio::test]
async fn failed_or_dropped_answers_are_replayed_on_retry() {
    let h = start().await;

    // 500 after the capture was applied: the retry sees the applied result.
    let pi = h.authorized("authorize:evt_fail").await;
    h.sim.set_faults(Faults { fail_after_apply_rate: 1.0, ..Faults::default() });
    let err = h.client.capture_payment_intent(&pi.id, "capture:ord_fail").await.unwrap_err();
    assert_eq!(api_error(&err), (500, "api_error", None));
    assert!(err.is_retryable());
    assert_eq!(h.sim.payment_intent(&pi.id).unwrap()["status"], "succeeded", "the mutation was applied");
    h.sim.set_faults(Faults::default());
    let pi = h.client.capture_payment_intent(&pi.id, "capture:ord_fail").await.unwrap();
    assert_eq!((pi.status.as_str(), h.sim.captures_for(&pi.id)), ("succeeded", 1));

    // No answer at all: the client times out, the retry is replayed.
    let pi = h.authorized("authorize:evt_drop").await;
    h.sim.set_faults(Faults { drop_response_rate: 1.0, ..Faults::default() });
    let err = client(&h.base, 300).capture_payment_intent(&pi.id, "capture:ord_drop").await.unwrap_err();
    assert!(matches!(err, StripeError::Transport(_)) && err.is_retryable(), "{err:?}");
    h.sim.set_faults(Faults::default());
    let pi = h.client.capture_payment_intent(&pi.id, "capture:ord_drop").await.unwrap();
    assert_eq!((pi.status.as_str(), h.sim.captures_for(&pi.id)), ("succeeded", 1));

    // The per-request header does the same for one request only.
    let pi = h.authorized("authorize:evt_header").await;
    let resp = h
        .raw(reqwest::Method::POST, &format!("/v1/payment_intents/{}/cancel", pi.id), Some(SECRET_KEY))
        .header("Idempotency-Key", "cancel:ord_header")
        .header("X-Sim-Fault", "fail-after-apply")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let pi = h.client.cancel_payment_intent(&pi.id, "cancel:ord_header").await.unwrap();
    assert_eq!(pi.status, "canceled");
    let stats = h.sim.stats();
    assert_eq!((stats.captures_applied, stats.cancels, stats.idempotent_replays), (2, 1, 3));
}

#[tokio::test]
async fn webhooks_are_signed_retried_duplicated_and_tamper_evident() {
    let mut h = start().await;
    h.reject_next.store(1, Ordering::SeqCst);
    h.sim.set_faults(Faults { webhook_duplicates: 2, ..Faults::default() });
    let pi = h.create(800, "authorize:evt_dup").await;
    assert!(h.sim.wait_webhooks_idle(WAIT).await);

    let mut got = Vec::new();
    while let Ok(d) = h.deliveries.try_recv() {
        got.push(d);
    }
    assert_eq!(got.len(), 3, "one event plus two duplicates");
    let events: Vec<Event> = got.iter().map(|d| d.verify().unwrap()).collect();
    assert!(events.iter().all(|e| e.id == events[0].id && e.r#type == "payment_intent.created"));
    assert_eq!(events[0].data.object["id"], pi.id.as_str());
    let req = events[0].request.as_ref().unwrap();
    assert_eq!(req.idempotency_key.as_deref(), Some("authorize:evt_dup"));
    let stats = h.sim.stats();
    assert_eq!(
        (stats.webhook_deliveries_attempted, stats.webhook_deliveries_succeeded),
        (4, 3),
        "one rejected, retried"
    );

    let d = &got[0];
    let tampered = String::from_utf8(d.body.to_vec()).unwrap().replace("\"amount\": 800", "\"amount\": 8");
    assert_ne!(tampered.as_bytes(), &d.body[..]);
    let err = webhook::verify(tampered.as_bytes(), &d.signature, WHSEC, DEFAULT_TOLERANCE_S, unix_now())
        .unwrap_err();
    assert!(matches!(err, WebhookError::NoMatchingSignature), "{err:?}");
    let err =
        webhook::verify(&d.body, &d.signature, "whsec_wrong", DEFAULT_TOLERANCE_S, unix_now()).unwrap_err();
    assert!(matches!(err, WebhookError::NoMatchingSignature));
    let err =
        webhook::verify(&d.body, &d.signature, WHSEC, DEFAULT_TOLERANCE_S, unix_now() + 3600).unwrap_err();
    assert!(matches!(err, WebhookError::TimestampOutsideTolerance { .. }));

    // Reordered, delayed batches still deliver every event exactly once (no duplicates now).
    h.sim.set_faults(Faults { webhook_reorder: true, webhook_delay_ms: 50, seed: 3, ..Faults::default() });
    let mut ids = HashSet::new();
    for i in 0..5 {
        ids.insert(h.create(100 + i, &format!("authorize:evt_reorder_{i}")).await.id);
    }
    assert!(h.sim.wait_webhooks_idle(WAIT).await);
    let mut seen = HashSet::new();
    while let Ok(d) = h.deliveries.try_recv() {
        let ev = d.verify().unwrap();
        assert!(seen.insert(ev.data.object["id"].as_str().unwrap().to_owned()));
    }
    assert_eq!(seen, ids);
}

#[tokio::test]
async fn cancel_after_capture_is_unexpected_state() {
    let mut h = start().await;
    let pi = h.authorized("authorize:evt_cc").await;
    h.client.capture_payment_intent(&pi.id, "capture:ord_cc").await.unwrap();
    let err = h.client.cancel_payment_intent(&pi.id, "cancel:ord_cc").await.unwrap_err();
    assert_eq!(api_error(&err), (400, "invalid_request_error", Some("payment_intent_unexpected_state")));
    assert!(!err.is_retryable());

    let other = h.authorized("authorize:evt_cc2").await;
    let canceled = h.client.cancel_payment_intent(&other.id, "cancel:ord_cc2").await.unwrap();
    assert_eq!((canceled.status.as_str(), canceled.amount_capturable), ("canceled", 0));
    h.event("payment_intent.canceled", &other.id).await;
    let err = h.client.capture_payment_intent(&other.id, "capture:ord_cc2").await.unwrap_err();
    assert_eq!(err.code(), Some("payment_intent_unexpected_state"));
}

#[tokio::test]
async fn expired_authorization_cannot_be_captured() {
    let mut h = start().await;
    let pi = h.authorized("authorize:evt_exp").await;
    let charge: Value = h
        .raw(
            reqwest::Method::GET,
            &format!("/v1/charges/{}", pi.latest_charge.as_deref().unwrap()),
            Some(SECRET_KEY),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let capture_before = charge["payment_method_details"]["card"]["capture_before"].as_i64().unwrap();
    assert_eq!(capture_before, charge["created"].as_i64().unwrap() + 7 * 24 * 3600);
    assert_eq!(charge["captured"], false);

    // Through the control endpoint, as ops would.
    let resp = h
        .raw(reqwest::Method::POST, "/_sim/clock/advance", None)
        .json(&serde_json::json!({ "seconds": 7 * 24 * 3600 + 1 }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let ev = h.event("payment_intent.canceled", &pi.id).await;
    assert_eq!(ev.data.object["cancellation_reason"], "automatic");
    assert!(ev.request.as_ref().is_some_and(|r| r.id.is_none()), "automatic transitions have no request");

    let err = h.client.capture_payment_intent(&pi.id, "capture:ord_exp").await.unwrap_err();
    assert_eq!(api_error(&err), (400, "invalid_request_error", Some("payment_intent_unexpected_state")));
    let now = h.client.retrieve_payment_intent(&pi.id).await.unwrap();
    assert_eq!((now.status.as_str(), now.cancellation_reason.as_deref()), ("canceled", Some("automatic")));
    let stats: Value =
        h.raw(reqwest::Method::GET, "/_sim/stats", None).send().await.unwrap().json().await.unwrap();
    assert_eq!(
        (stats["authorizations_expired"].as_u64(), stats["captures_applied"].as_u64()),
        (Some(1), Some(0))
    );
}

#[tokio::test]
async fn auth_and_parameter_errors_have_stripe_shapes() {
    let h = start().await;
    let pi = h.create(300, "authorize:evt_auth").await;
    let status_and_error = |resp: reqwest::Response| async move {
        let status = resp.status();
        let v: Value = resp.json().await.unwrap();
        (
            status,
            v["error"]["type"].as_str().unwrap().to_owned(),
            v["error"]["code"].as_str().map(str::to_owned),
        )
    };

    let none =
        h.raw(reqwest::Method::GET, &format!("/v1/payment_intents/{}", pi.id), None).send().await.unwrap();
    assert_eq!(
        status_and_error(none).await,
        (StatusCode::UNAUTHORIZED, "invalid_request_error".into(), None)
    );
    let pk = h.raw(reqwest::Method::POST, "/v1/payment_intents", Some(PUBLISHABLE_KEY)).send().await.unwrap();
    assert_eq!(pk.status(), StatusCode::UNAUTHORIZED);
    let live = StripeClient::new(StripeConfig {
        api_base: h.base.clone(),
        secret_key: SecretString::from("sk_live_nope"),
        timeout_ms: 5_000,
    })
    .unwrap();
    assert_eq!(live.retrieve_payment_intent(&pi.id).await.unwrap_err().status(), Some(401));

    let wrong =
        h.client.confirm_with_client_secret(PUBLISHABLE_KEY, &pi.id, "pi_x_secret_y", "pm_card_visa").await;
    assert_eq!(api_error(&wrong.unwrap_err()).0, 400);
    let missing = h.client.retrieve_payment_intent("pi_doesnotexist").await.unwrap_err();
    assert_eq!(api_error(&missing), (404, "invalid_request_error", Some("resource_missing")));

    for (body, code) in [
        ("currency=usd", Some("parameter_missing")),
        ("amount=-5&currency=usd", Some("parameter_invalid_integer")),
        ("amount=ten&currency=usd", Some("parameter_invalid_integer")),
        ("amount=5&currency=dollars", None),
        ("amount=5&currency=usd&colour=red", Some("parameter_unknown")),
    ] {
        let resp = h
            .raw(reqwest::Method::POST, "/v1/payment_intents", Some(SECRET_KEY))
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body(body)
            .send()
            .await
            .unwrap();
        let (status, ty, got) = status_and_error(resp).await;
        assert_eq!(
            (status, ty.as_str(), got.as_deref()),
            (StatusCode::BAD_REQUEST, "invalid_request_error", code),
            "{body}"
        );
    }
}

#[tokio::test]
async fn list_auto_paginates_newest_first() {
    let h = start().await;
    h.sim.set_webhook_url(None);
    let since = h.sim.now();
    let mut created = Vec::new();
    for i in 0..102 {
        created.push(h.create(100, &format!("authorize:evt_list_{i}")).await.id);
    }
    let listed = h.client.list_payment_intents(since).await.unwrap();
    let ids: Vec<String> = listed.into_iter().map(|pi| pi.id).collect();
    created.reverse();
    assert_eq!(ids, created);
    assert!(h.client.list_payment_intents(h.sim.now() + 1000).await.unwrap().is_empty());
}

/// The window is inclusive at both ends and paging with `starting_after` (pages of 100)
/// returns every intent in it exactly once, each with its latest charge expanded.
#[tokio::test]
async fn list_window_pages_through_everything_with_charges() {
    let h = start().await;
    h.sim.set_webhook_url(None);
    // Three bursts one simulated hour apart: before, inside and after the window.
    let mut inside = Vec::new();
    let (mut from, mut to) = (0, 0);
    for (burst, n) in [(0, 3), (1, 205), (2, 4)] {
        if burst == 1 {
            from = h.sim.now();
        }
        for i in 0..n {
            let pi = h.create(100 + i, &format!("authorize:evt_w{burst}_{i}")).await;
            if burst == 1 {
                inside.push(pi.id);
            }
        }
        if burst == 1 {
            to = h.sim.now();
        }
        h.sim.advance_clock(3_600);
    }
    let authorized = h.authorized("authorize:evt_w_auth").await;
    let window = CreatedWindow { gte: Some(from), lte: Some(to) };
    let listed = h.client.list_payment_intents_with_charges(window).await.unwrap();
    let ids: Vec<&str> = listed.iter().map(|l| l.intent.id.as_str()).collect();
    let want: Vec<&str> = inside.iter().rev().map(String::as_str).collect();
    assert_eq!(ids, want, "newest first, each once, nothing outside the window");
    assert!(listed.iter().all(|l| l.charge.is_none()), "never confirmed: no charge yet");

    let open = CreatedWindow { gte: Some(to + 1), lte: None };
    let listed = h.client.list_payment_intents_with_charges(open).await.unwrap();
    assert_eq!(listed.len(), 5);
    let auth = listed.iter().find(|l| l.intent.id == authorized.id).unwrap();
    let charge = auth.charge.as_ref().expect("expanded");
    assert_eq!(Some(&charge.id), authorized.latest_charge.as_ref());
    assert_eq!((charge.captured, auth.amount_refunded()), (false, 0));
    assert!(charge.capture_before().unwrap() > h.sim.now());

    let resp = h
        .raw(reqwest::Method::GET, "/v1/payment_intents?expand[]=data.customer", Some(SECRET_KEY))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn shutdown_releases_dropped_responses_and_returns() {
    let mut h = start().await;
    let pi = h.authorized("authorize:evt_shutdown").await;
    h.sim.set_faults(Faults { drop_response_rate: 1.0, ..Faults::default() });
    let (client, id) = (h.client.clone(), pi.id.clone());
    let pending =
        tokio::spawn(async move { client.capture_payment_intent(&id, "capture:ord_shutdown").await });
    // The capture was applied (its event is out) and its answer is being withheld.
    h.event("payment_intent.succeeded", &pi.id).await;
    h.shutdown.cancel();
    let served = tokio::time::timeout(WAIT, &mut h.served).await.expect("serve returns after cancel");
    assert!(served.unwrap().is_ok());
    let answer = tokio::time::timeout(WAIT, pending).await.expect("held request released").unwrap();
    assert!(answer.unwrap_err().is_retryable());
}

#[tokio::test]
async fn create_with_confirm_true_authorizes_in_one_call() {
    let h = start().await;
    let resp = h
        .raw(reqwest::Method::POST, "/v1/payment_intents", Some(SECRET_KEY))
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body("amount=900&currency=USD&capture_method=manual&payment_method=pm_card_visa&confirm=true")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let pi: PaymentIntent = resp.json().await.unwrap();
    assert_eq!(
        (pi.status.as_str(), pi.currency.as_str(), pi.amount_capturable),
        ("requires_capture", "usd", 900)
    );
    assert_eq!(pi.payment_method.as_deref(), Some("pm_card_visa"));
}
