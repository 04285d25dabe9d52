//! One buyer's purchase is one trace (design §16): every role runs as its own `boxoffice
//! serve` process exporting to a fake OTLP collector in this test, and the spans about the
//! order — the hold, every relay publish, every consumer (saga, payments, tickets), both
//! webhooks — share the trace the buyer's hold request named in its `traceparent` header.
//! Without an endpoint, nothing carries a trace context.

use crate::helpers::{eventually, product_bin, test_brokers, test_redis_url, TestApp};
use boxoffice::config::Config;
use boxoffice::runtime::{self, Role};
use boxoffice_domain::UserId;
use boxoffice_harness::client::BuyerClient;
use boxoffice_store::venue::{self, VenueSpec};
use boxoffice_stripe_sim::StripeSim;
use fake_opentelemetry_collector::{ExportedSpan, FakeCollectorServer};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::collections::{BTreeSet, HashSet};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

fn database_url(database: &str) -> String {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL names the test server");
    let (server, _) = base.rsplit_once('/').expect("DATABASE_URL has a path");
    format!("{server}/{database}")
}

/// The collector's spans, drained continuously (its channel is small: an undrained collector
/// would stall the exporters' requests).
fn drain(mut collector: FakeCollectorServer, stop: CancellationToken) -> Arc<Mutex<Vec<ExportedSpan>>> {
    let spans = Arc::new(Mutex::new(Vec::new()));
    let sink = spans.clone();
    tokio::spawn(async move {
        while !stop.is_cancelled() {
            let got = collector.exported_spans(1, Duration::from_millis(100)).await;
            sink.lock().unwrap().extend(got);
        }
        collector.abort();
    });
    spans
}

/// Attribute `key` of `span` as text: the collector renders values with `Debug`
/// (`Some(AnyValue { value: Some(StringValue("…")) })`, `IntValue(7)`).
fn attr(span: &ExportedSpan, key: &str) -> Option<String> {
    let raw = span.attributes.get(key)?;
    for (open, close) in [("StringValue(\"", "\")"), ("IntValue(", ")"), ("BoolValue(", ")")] {
        if let Some(start) = raw.find(open) {
            let rest = &raw[start + open.len()..];
            return rest.find(close).map(|end| rest[..end].to_owned());
        }
    }
    Some(raw.clone())
}

/// Polls the buyer's view of `order` until `pred` holds (panics after [`WAIT`]).
async fn await_order(buyer: &BuyerClient, bearer: &str, order: Uuid, pred: fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let v: Value = buyer.order(bearer, order).send().await.unwrap().json().await.unwrap();
        if pred(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "order {order} never got there; last: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn one_purchase_is_one_trace_across_every_role_process(_: PgPoolOptions, opts: PgConnectOptions) {
    let database = opts.get_database().expect("a per-test database").to_owned();
    let pool = boxoffice_store::connect(opts, 4, 10_000).await.unwrap();
    let stop_drain = CancellationToken::new();
    let collector = FakeCollectorServer::start().await.expect("the fake collector starts");
    let endpoint = collector.endpoint();
    let spans = drain(collector, stop_drain.clone());

    let cfg = Config {
        kafka_brokers: Some(test_brokers()),
        kafka_topic_prefix: format!("t{}.", Uuid::new_v4().simple()),
        kafka_partitions: 3,
        ..Config::default()
    };
    boxoffice_bus::topics::create_all(&cfg.kafka().unwrap()).await.expect("topics");
    let (event, _) =
        venue::seed(&pool, "Traced Event", &VenueSpec::small(1, 1, 4), chrono::Utc::now(), "cell-1")
            .await
            .unwrap();
    let sd = CancellationToken::new();
    let mut sim_cfg = boxoffice_harness::deploy::sim_config(&cfg);
    sim_cfg.webhook_initial_backoff_ms = 20;
    let sim = StripeSim::new(sim_cfg);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stripe = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(sim.clone().serve(l, sd.clone()));
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let api = format!("http://127.0.0.1:{port}");
    sim.set_webhook_url(Some(format!("{api}/webhooks/stripe")));

    let dir = std::env::temp_dir().join(format!("boxoffice-tracing-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let redis_prefix = format!("trace{}:", Uuid::new_v4().simple());
    let roles = [Role::Api, Role::Relay, Role::Saga, Role::Payments, Role::Tickets];
    let mut children = Vec::new();
    for role in roles {
        let log = std::fs::File::create(dir.join(format!("{}.log", role.name()))).unwrap();
        let child = tokio::process::Command::new(product_bin())
            .args(["serve", "--roles", role.name()])
            .env("BOXOFFICE_ENV", "development")
            .env("BOXOFFICE_DATABASE_URL", database_url(&database))
            .env("BOXOFFICE_HTTP_BIND", format!("127.0.0.1:{port}"))
            .env("BOXOFFICE_KAFKA_BROKERS", test_brokers())
            .env("BOXOFFICE_KAFKA_TOPIC_PREFIX", &cfg.kafka_topic_prefix)
            .env("BOXOFFICE_KAFKA_PARTITIONS", "3")
            .env("BOXOFFICE_STRIPE_API_BASE", &stripe)
            .env("BOXOFFICE_REDIS_URL", test_redis_url())
            .env("BOXOFFICE_REDIS_KEY_PREFIX", &redis_prefix)
            .env("BOXOFFICE_RELEASE_MAX_PER_S", "0")
            .env("BOXOFFICE_ADMISSION_DIRECT", "true")
            .env("BOXOFFICE_RATE_LIMIT_PURCHASE_IP_PER_S", "0")
            .env("BOXOFFICE_RATE_LIMIT_PURCHASE_USER_PER_S", "0")
            .env("BOXOFFICE_HTTP_MAX_IN_FLIGHT_PER_IP", "0")
            .env("BOXOFFICE_OTLP_ENDPOINT", &endpoint)
            // Export every 100 ms instead of every 5 s: the assertions come sooner.
            .env("OTEL_BSP_SCHEDULE_DELAY", "100")
            .env("BOXOFFICE_LOG", "warn")
            .env("BOXOFFICE_LOG_FORMAT", "json")
            .env_remove("BOXOFFICE_CONFIG")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("boxoffice serve starts");
        children.push((role, child));
    }
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let healthz = format!("{api}/healthz");
    eventually(WAIT, "the API process answers", || {
        let (http, url) = (http.clone(), healthz.clone());
        async move { http.get(url).send().await.is_ok_and(|r| r.status().is_success()) }
    })
    .await;

    // The buyer's own trace: every span of the purchase must end up in it.
    let trace_id = Uuid::new_v4().simple().to_string();
    let client_span = &Uuid::new_v4().simple().to_string()[..16];
    let seats: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM seats WHERE event_id = $1 ORDER BY id LIMIT 2")
        .bind(event.0)
        .fetch_all(&pool)
        .await
        .unwrap();
    let user = Uuid::new_v4();
    let bearer = format!("Bearer {}", runtime::user_tokens(&cfg).issue(UserId(user), 3_600));
    let admission = runtime::admission_tokens(&cfg).unwrap().issue(UserId(user), event, 1, 600).0;
    let buyer = BuyerClient::new(http.clone(), &api);
    let r = buyer
        .hold(&bearer, event.0, &admission, "traced-1", &seats)
        .header("traceparent", format!("00-{trace_id}-{client_span}-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202, "{:?}", r.text().await);
    let receipt: Value = r.json().await.unwrap();
    let order: Uuid = receipt["order_id"].as_str().unwrap().parse().unwrap();

    let v = await_order(&buyer, &bearer, order, |v| v.get("client_secret").is_some()).await;
    let client_secret = v["client_secret"].as_str().unwrap().to_owned();
    let stripe_client = boxoffice_payments::StripeClient::new(boxoffice_payments::StripeConfig {
        api_base: stripe.clone(),
        secret_key: cfg.stripe_secret_key.clone(),
        timeout_ms: 10_000,
    })
    .unwrap();
    let pi = stripe_client
        .confirm_with_client_secret(
            &cfg.stripe_publishable_key,
            v["payment_intent_id"].as_str().unwrap(),
            &client_secret,
            "pm_card_visa",
        )
        .await
        .expect("authorized");
    let v = await_order(&buyer, &bearer, order, |v| v["status"] == "ticketed").await;
    assert_eq!(v["tickets"].as_array().unwrap().len(), 2, "{v}");
    assert!(sim.wait_webhooks_idle(WAIT).await, "the simulator delivered its webhooks");

    // The relay stops below: first let it publish what the last webhook's fact started.
    let deadline = Instant::now() + WAIT;
    loop {
        let unpublished: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox WHERE message_key = $1 AND published_at IS NULL")
                .bind(order.to_string())
                .fetch_one(&pool)
                .await
                .unwrap();
        if unpublished == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the order's facts were not all published");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }

    // Every fact of the order stored a context of the buyer's trace (those published, each
    // of which has a publish span below; a saga step may still be adding one).
    let stored: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT traceparent FROM outbox WHERE message_key = $1 AND published_at IS NOT NULL",
    )
    .bind(order.to_string())
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(stored.len() >= 8, "{stored:?}");
    for t in &stored {
        assert!(t.as_deref().is_some_and(|t| t.starts_with(&format!("00-{trace_id}-"))), "{stored:?}");
    }
    // The intent carries the context of the fact that asked for it, which the webhooks join.
    let intent = sim.payment_intent(&pi.id).expect("the intent");
    let requested: String = sqlx::query_scalar(
        "SELECT traceparent FROM outbox WHERE message_key = $1 AND event_type = 'HoldCreated'",
    )
    .bind(order.to_string())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(intent["metadata"]["traceparent"], requested.as_str(), "{intent}");

    // A graceful stop flushes each process's last spans.
    for (_, child) in &children {
        let pid = child.id().expect("running") as i32;
        // SAFETY: a plain signal to a child this test started and still owns.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    for (role, child) in &mut children {
        let status = tokio::time::timeout(WAIT, child.wait()).await.expect("stops").unwrap();
        assert!(status.success(), "{} exited with {status}; logs in {}", role.name(), dir.display());
    }

    let order_s = order.to_string();
    let wanted = |spans: &[ExportedSpan]| {
        let about: Vec<&ExportedSpan> =
            spans.iter().filter(|s| attr(s, "order.id").as_ref() == Some(&order_s)).collect();
        let groups: BTreeSet<String> =
            about.iter().filter_map(|s| attr(s, "messaging.consumer.group.name")).collect();
        let has = |name: &str| about.iter().any(|s| s.name == name);
        has("hold")
            && has("publish ticketing.purchase.v1")
            && has("webhook payment_intent.amount_capturable_updated")
            && has("webhook payment_intent.succeeded")
            && ["saga", "payments", "tickets"]
                .iter()
                .all(|c| groups.contains(&format!("{}ticketing-{c}", cfg.kafka_topic_prefix)))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !wanted(&spans.lock().unwrap()) {
        if Instant::now() > deadline {
            let got = spans.lock().unwrap();
            let seen: BTreeSet<(String, Option<String>, Option<String>)> = got
                .iter()
                .map(|s| {
                    let a = |k: &str| attr(s, k);
                    (s.name.clone(), a("order.id"), a("messaging.consumer.group.name"))
                })
                .collect();
            panic!("not every role's spans about order {order} arrived; {} spans: {seen:#?}", got.len());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_drain.cancel();
    let spans = spans.lock().unwrap().clone();
    let about: Vec<&ExportedSpan> =
        spans.iter().filter(|s| attr(s, "order.id").as_ref() == Some(&order_s)).collect();
    let traces: HashSet<&str> = about.iter().map(|s| s.trace_id.as_str()).collect();
    assert_eq!(
        traces,
        HashSet::from([trace_id.as_str()]),
        "one trace, the buyer's: {:#?}",
        about.iter().map(|s| (&s.name, &s.trace_id)).collect::<Vec<_>>()
    );
    // The hold's request span is the buyer's span's child, and the hold span its child.
    let request = spans
        .iter()
        .find(|s| s.trace_id == trace_id && s.parent_span_id == client_span)
        .expect("the request span joined the client's trace");
    assert_eq!(request.kind, "SPAN_KIND_SERVER");
    let hold = about.iter().find(|s| s.name == "hold").unwrap();
    assert_eq!(hold.parent_span_id, request.span_id);
    for key in ["correlation_id", "purchase_cell", "region"] {
        assert!(hold.attributes.contains_key(key), "hold span lacks {key}: {hold:?}");
    }
    // Consumer spans: the messaging attributes and the fact's ids.
    let consumers: Vec<&&ExportedSpan> =
        about.iter().filter(|s| s.kind == "SPAN_KIND_CONSUMER" && s.name.starts_with("process ")).collect();
    assert!(consumers.len() >= 6, "{consumers:#?}");
    for s in &consumers {
        assert_eq!(attr(s, "messaging.system").as_deref(), Some("kafka"), "{s:?}");
        for key in [
            "messaging.destination.name",
            "messaging.destination.partition.id",
            "messaging.kafka.message.offset",
            "messaging.consumer.group.name",
            "correlation_id",
            "event_id",
            "event_type",
            "region",
            "purchase_cell",
        ] {
            assert!(s.attributes.contains_key(key), "consumer span lacks {key}: {s:?}");
        }
        assert!(s.parent_span_id.len() == 16 && s.parent_span_id != "0000000000000000", "{s:?}");
    }
    assert!(consumers.iter().any(|s| s.attributes.contains_key("causation_id")), "{consumers:#?}");
    let publishes = about.iter().filter(|s| s.kind == "SPAN_KIND_PRODUCER").count();
    assert!(publishes >= stored.len(), "one publish span per fact: {publishes} < {}", stored.len());
    // No secret reaches a span.
    let dump = format!("{spans:?}");
    for s in [&admission, &bearer, &client_secret] {
        assert!(!dump.contains(s.as_str()), "a secret reached a span");
    }
    assert!(!dump.contains("_secret_"), "a client secret reached a span");
    sd.cancel();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without `otlp_endpoint` the outbox stores no trace context and the messages carry none.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn without_an_endpoint_outbox_rows_have_no_traceparent(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    assert!(!boxoffice_trace::enabled());
    let s = app.seats().await;
    let b = app.buyer();
    let r = app.hold(&b, &app.admission_token(&b), "untraced-1", &[s[0]]).await;
    assert_eq!(r.status(), 202);
    assert!(app.count("SELECT count(*) FROM outbox").await > 0);
    assert_eq!(app.count("SELECT count(*) FROM outbox WHERE traceparent IS NOT NULL").await, 0);
    app.stop().await;
}
