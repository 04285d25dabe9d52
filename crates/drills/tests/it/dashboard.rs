//! The operator's onsale dashboard (`/admin`, design §16).
//!
//! - Only the operator token opens `/admin/onsale` (401 problem+json otherwise); the static
//!   page is served with its security headers and carries no data; the `/admin` bucket bites.
//! - A small onsale (every role in-process, buyers through the waiting room and the release
//!   controller) watched by headless Chromium driven by Playwright
//!   (`crates/drills/tests/browser/dashboard.mjs`, `playwright-core` pinned there and installed
//!   by `scripts/test`'s `ensure_browser_tools`): the page shows R, a ticket count above 0 and
//!   then a higher one; its screenshot goes to `target/artifacts/dashboard.png`. Then
//!   `/admin/onsale` has the documented shape with the onsale's tickets, and `boxoffice audit`
//!   records its run, which the view and the `boxoffice_audit_*` gauges show.
//!
//! A missing browser, node or Playwright fails the test with what to install; it never skips.

use crate::helpers::{problem, product_bin, test_redis_url, TestApp};
use boxoffice::config::Config;
use boxoffice::runtime::{self, Role};
use boxoffice_harness::deploy::{self, Deployment};
use boxoffice_harness::{buyers, queue};
use boxoffice_store::venue::{self, VenueSpec};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::ConnectOptions;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncBufReadExt;
use uuid::Uuid;

fn admin_token() -> String {
    format!("op-{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple())
}

/// What the browser test needs, each with how to get it.
struct Browser {
    node: PathBuf,
    chromium: PathBuf,
    playwright: PathBuf,
}

fn browser_tools() -> Browser {
    let env_or = |k: &str, d: PathBuf| std::env::var_os(k).map(PathBuf::from).unwrap_or(d);
    let home = PathBuf::from(std::env::var_os("HOME").unwrap_or_default());
    let node = env_or("BOXOFFICE_NODE", PathBuf::from("node"));
    let chromium = env_or("BOXOFFICE_CHROMIUM", PathBuf::from("/usr/bin/chromium"));
    // Where scripts/lib.sh installs the pinned version.
    let pinned: Value = serde_json::from_str(include_str!("../browser/package.json")).unwrap();
    let version = pinned["dependencies"]["playwright-core"].as_str().unwrap();
    let playwright =
        env_or("BOXOFFICE_PLAYWRIGHT_DIR", home.join(format!(".cache/boxoffice/playwright-{version}")));
    let node_ok =
        std::process::Command::new(&node).arg("--version").output().is_ok_and(|o| o.status.success());
    assert!(node_ok, "node (20 or later) is required for the dashboard's browser test: install Node.js, or set BOXOFFICE_NODE");
    assert!(
        chromium.is_file(),
        "{} is missing: install Debian's `chromium` (scripts/test's ensure_browser_tools does), or set BOXOFFICE_CHROMIUM",
        chromium.display()
    );
    let pw = playwright.join("node_modules/playwright-core/package.json");
    assert!(
        pw.is_file(),
        "{} is missing: run scripts/test (ensure_browser_tools runs `npm ci` of crates/drills/tests/browser), or set BOXOFFICE_PLAYWRIGHT_DIR",
        pw.display()
    );
    Browser { node, chromium, playwright }
}

/// The browser's next stdout line, within 2 minutes (`None`: it ended or went quiet).
async fn next_line(
    lines: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
) -> Option<String> {
    tokio::time::timeout(Duration::from_secs(120), lines.next_line()).await.ok()?.ok()?
}

/// `target/artifacts` (under `CARGO_TARGET_DIR` when set).
fn artifacts_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target")));
    let dir = target.join("artifacts");
    std::fs::create_dir_all(&dir).unwrap();
    dir.canonicalize().unwrap()
}

async fn onsale(http: &reqwest::Client, api: &str, token: &str) -> Value {
    let r = http.get(format!("{api}/admin/onsale")).bearer_auth(token).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["cache-control"], "no-store");
    r.json().await.unwrap()
}

/// The documented top-level shape of `GET /admin/onsale`.
fn assert_shape(v: &Value) {
    for k in ["generated_at", "cell", "window_s", "release", "events", "cell_signals", "audit"] {
        assert!(v.get(k).is_some(), "{k} missing in {v}");
    }
    let cs = &v["cell_signals"];
    for k in [
        "outbox_oldest_age_ms",
        "outbox_unpublished",
        "outbox_parked",
        "expiry_delay_ms",
        "active_holds",
        "consumer_lag",
        "dlq_depth",
    ] {
        assert!(cs.get(k).is_some(), "cell_signals.{k} missing in {cs}");
    }
    for e in v["events"].as_array().unwrap() {
        for k in [
            "event_id",
            "name",
            "on_sale",
            "release_per_s",
            "queue",
            "holds_per_s",
            "conflicts_per_s",
            "ticketed_per_s",
            "totals",
        ] {
            assert!(e.get(k).is_some(), "events[].{k} missing in {e}");
        }
        for k in ["holds", "seats_held", "tickets", "seats"] {
            assert!(e["totals"][k].is_i64(), "events[].totals.{k} in {e}");
        }
    }
}

/// Refusals are 401 problem+json with a Bearer challenge; the page is static, carries no
/// data and sends its security headers; the `/admin` bucket limits a client.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn admin_routes_need_the_operator_token(_: PgPoolOptions, opts: PgConnectOptions) {
    let token = admin_token();
    let app = TestApp::spawn_with(opts, &[Role::Api], VenueSpec::small(1, 2, 5), |c| {
        c.admin_token = token.clone().into();
        c.rate_limit_admin_ip_per_s = 0.01;
        c.rate_limit_admin_ip_burst = 12;
    })
    .await;
    let url = format!("{}/admin/onsale", app.api);
    let buyer = app.buyer();
    for (what, auth) in [
        ("no header", None),
        ("a wrong token", Some(format!("Bearer {}", admin_token()))),
        ("a buyer's token", Some(buyer.bearer())),
        ("another scheme", Some(format!("Basic {token}"))),
    ] {
        let mut req = app.http.get(&url);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.headers()["www-authenticate"], "Bearer realm=\"boxoffice-admin\"", "{what}");
        assert_eq!(r.headers()["cache-control"], "no-store", "{what}");
        let (status, code, body) = problem(r).await;
        assert_eq!((status, code.as_str()), (401, "unauthenticated"), "{what}: {body}");
        assert!(!body.to_string().contains(&token), "the token is never echoed");
    }

    let v = onsale(&app.http, &app.api, &token).await;
    assert_shape(&v);
    assert!(v["release"].is_null(), "no controller runs here: {v}");
    let ev = v["events"].as_array().unwrap().iter().find(|e| e["event_id"] == app.event.to_string());
    let ev = ev.unwrap_or_else(|| panic!("the seeded event is on sale: {v}"));
    assert_eq!(ev["totals"]["seats"], 10);
    assert_eq!(ev["totals"]["tickets"], 0);

    let page = app.http.get(format!("{}/admin/", app.api)).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let h = page.headers().clone();
    let csp = h["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("default-src 'self'") && csp.contains("frame-ancestors 'none'"), "{csp}");
    assert_eq!(h["x-content-type-options"], "nosniff");
    assert!(h["content-type"].to_str().unwrap().starts_with("text/html"));
    let html = page.text().await.unwrap();
    assert!(!html.contains(&app.event.to_string()), "the page carries no data");
    assert!(html.matches("<script").count() == html.matches("<script src=").count(), "no inline script");
    assert!(!html.contains("style="), "no inline style");
    let js = app.http.get(format!("{}/admin/dashboard.js", app.api)).send().await.unwrap();
    assert!(js.headers()["content-type"].to_str().unwrap().starts_with("text/javascript"));
    let moved = app.http.get(format!("{}/admin", app.api)).send().await.unwrap();
    assert_eq!(moved.url().path(), "/admin/", "GET /admin redirects to the page");

    // 4 refusals + 4 reads so far out of a burst of 12 that refills once in 100 s.
    let mut limited = None;
    for _ in 0..12 {
        let r = app.http.get(&url).bearer_auth(&token).send().await.unwrap();
        if r.status() == 429 {
            limited = Some(problem(r).await);
            break;
        }
    }
    let (_, code, body) = limited.expect("the /admin bucket limits a client");
    assert_eq!(code, "rate_limited", "{body}");
    app.stop().await;
}

/// A small onsale on the in-process deployment, watched in headless Chromium; then the
/// figures, the audit record and the gauges.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn dashboard_shows_a_live_onsale_in_chromium(_: PgPoolOptions, opts: PgConnectOptions) {
    let tools = browser_tools();
    let token = admin_token();
    let pool = boxoffice_store::connect(opts.clone(), 4, 10_000).await.unwrap();
    let mut cfg = Config {
        consumers_per_role: 1,
        kafka_partitions: 3,
        expiry_interval_ms: 100,
        hold_ttl_ms: 20_000,
        redis_url: test_redis_url().into(),
        redis_key_prefix: format!("t{}:", Uuid::new_v4().simple()),
        purchase_cell: format!("cell-{}", Uuid::new_v4().simple()),
        admin_token: token.clone().into(),
        admission_direct: false,
        release_max_per_s: 30.0,
        release_min_per_s: 2.0,
        release_initial_per_s: 5.0,
        release_step_per_s: 5.0,
        release_tick_ms: 250,
        waitroom_poll_interval_ms: 500,
        http_trusted_proxy_hops: 1,
        http_max_in_flight_per_ip: 0,
        rate_limit_ip_per_s: 0.0,
        rate_limit_user_per_s: 0.0,
        rate_limit_purchase_ip_per_s: 0.0,
        rate_limit_purchase_user_per_s: 0.0,
        rate_limit_seats_ip_per_s: 0.0,
        ..Config::default()
    };
    // The in-process broker of the onsale drill: this test needs no broker of the suite's.
    let broker = deploy::embedded_broker_unless_configured(&mut cfg).unwrap();
    let (event, _) = venue::seed(
        &pool,
        "Dashboard Arena",
        &VenueSpec::small(2, 10, 10),
        chrono::Utc::now(),
        &cfg.purchase_cell,
    )
    .await
    .unwrap();
    let d = Deployment::start(
        cfg,
        deploy::Options {
            embedded: broker.as_ref(),
            webhook_initial_backoff_ms: Some(20),
            ..deploy::Options::new(&Role::ALL, opts.clone())
        },
    )
    .await
    .expect("every role starts");
    let api = d.api_url().unwrap();
    let cfg = d.cfg.clone();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();

    // The browser first: it connects before any buyer, so it sees the count grow.
    let shot = artifacts_dir().join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    let profile = std::env::temp_dir().join(format!("boxoffice-chromium-{}", Uuid::new_v4().simple()));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/browser/dashboard.mjs");
    let mut browser = tokio::process::Command::new(&tools.node)
        .arg(script)
        .env("DASHBOARD_URL", format!("{api}/admin/#token={token}"))
        .env("SCREENSHOT", &shot)
        .env("BOXOFFICE_CHROMIUM", &tools.chromium)
        .env("BOXOFFICE_PLAYWRIGHT_DIR", &tools.playwright)
        .env("USER_DATA_DIR", &profile)
        .env("WAIT_MS", "90000")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("node starts");
    let mut lines = tokio::io::BufReader::new(browser.stdout.take().unwrap()).lines();
    let mut milestones: Vec<Value> = Vec::new();
    let ready: Value = match next_line(&mut lines).await {
        Some(l) => serde_json::from_str(&l).unwrap_or(Value::String(l)),
        None => {
            let out = browser.wait_with_output().await.unwrap();
            panic!("the browser never showed the live page:\n{}", String::from_utf8_lossy(&out.stderr));
        }
    };
    assert!(ready["ready"]["rate"].as_f64().is_some_and(|r| r > 0.0), "R on the page: {ready}");
    assert_eq!(ready["ready"]["fragment_left"], "", "the token is dropped from the address bar");
    milestones.push(ready);

    let users = runtime::user_tokens(&cfg);
    let drive = tokio::spawn(buyers::drive(buyers::BuyerConfig {
        api_url: api.clone(),
        stripe_api_base: cfg.stripe_api_base.clone(),
        stripe_publishable_key: cfg.stripe_publishable_key.clone(),
        event_id: event.0,
        buyers: 150,
        max_in_flight: 32,
        decline_share: 0.05,
        abandon_share: 0.0,
        max_seats: 2,
        hold_attempts: 3,
        poll_interval_ms: 250,
        order_status: buyers::OrderStatusMode::Stream,
        final_timeout_ms: 90_000,
        seed: 11,
        user_token: Arc::new(move |u| users.issue(boxoffice_domain::UserId(u), 3_600)),
        progress: false,
        arrival_rate: 15.0,
        pay_within_ms: 0,
        hold_timeline: None,
        admission: buyers::AdmissionRoute::Queue(queue::QueuePacing {
            attempt_rate: 0.0,
            arrival_rate: 15.0,
            max_in_flight: 256,
        }),
    }));
    while let Some(l) = next_line(&mut lines).await {
        milestones.push(serde_json::from_str(&l).unwrap_or(Value::String(l)));
    }
    let out = browser.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "the browser run failed ({}):\n{stderr}\nmilestones: {milestones:?}",
        out.status
    );
    let done = milestones.iter().find_map(|m| m.get("done")).unwrap_or_else(|| panic!("{milestones:?}"));
    let (first, later) = (done["first"].as_i64().unwrap(), done["later"].as_i64().unwrap());
    assert!(first > 0 && later > first, "{done}");
    assert!(done["rate"].as_f64().is_some_and(|r| r > 0.0), "{done}");
    assert_eq!(done["errors"], serde_json::json!([]), "no script error on the page");
    assert!(shot.is_file(), "{} written", shot.display());
    eprintln!("dashboard screenshot: {}", shot.display());
    let _ = std::fs::remove_dir_all(&profile);

    let stats = drive.await.unwrap().expect("the buyers ran");
    assert!(stats.holds > 0, "{stats:?}");
    let drained = boxoffice_harness::drain::Drain::orders_of(event.0, Duration::from_secs(90))
        .run(&pool)
        .await
        .unwrap();
    assert!(drained.done, "{drained}");

    // The figures after the onsale: its tickets, R and its reasons, the cell's signals.
    let v = onsale(&http, &api, &token).await;
    assert_shape(&v);
    let ev = v["events"].as_array().unwrap().iter().find(|e| e["event_id"] == event.0.to_string()).cloned();
    let ev = ev.unwrap_or_else(|| panic!("the onsale's event: {v}"));
    let tickets: i64 = sqlx::query_scalar("SELECT count(*) FROM tickets WHERE event_id = $1")
        .bind(event.0)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(tickets > 0);
    assert_eq!(ev["totals"]["tickets"], tickets, "{ev}");
    assert!(ev["totals"]["holds"].as_i64().unwrap() >= stats.holds as i64, "{ev}");
    assert_eq!(ev["totals"]["seats"], 200);
    let r = &v["release"];
    assert!(r["rate_per_s"].as_f64().is_some_and(|x| (2.0..=30.0).contains(&x)), "{r}");
    assert!(["increase", "hold", "decrease"].contains(&r["action"].as_str().unwrap()), "{r}");
    assert_eq!(r["stale"], false, "{r}");
    assert_eq!(r["signals"].as_array().unwrap().len(), boxoffice_workers::release::SIGNALS, "{r}");
    assert!(v["cell_signals"]["consumer_lag"]["max"].is_number(), "the broker's lag probe answers: {v}");

    // `boxoffice audit` records its run; the view and the gauges show it.
    assert!(v["audit"].is_null(), "nothing audited yet: {}", v["audit"]);
    let url = opts.to_url_lossy().to_string();
    let audit = tokio::process::Command::new(product_bin())
        .args(["audit", "--json", "--skip-provider", "--event", &event.0.to_string()])
        .env("BOXOFFICE_ENV", "development")
        .env("BOXOFFICE_DATABASE_URL", &url)
        .env("BOXOFFICE_KAFKA_BROKERS", cfg.kafka_brokers.clone().unwrap())
        .env("BOXOFFICE_KAFKA_TOPIC_PREFIX", &cfg.kafka_topic_prefix)
        .env("BOXOFFICE_PURCHASE_CELL", &cfg.purchase_cell)
        .env_remove("BOXOFFICE_CONFIG")
        .output()
        .await
        .unwrap();
    let report: Value = serde_json::from_slice(&audit.stdout).unwrap_or_else(|e| {
        panic!(
            "audit --json ({e}): {}\n{}",
            String::from_utf8_lossy(&audit.stdout),
            String::from_utf8_lossy(&audit.stderr)
        )
    });
    assert_eq!(audit.status.code(), Some(0), "{report}");
    let (id, finished): (i64, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("SELECT id, finished_at FROM audit_runs WHERE event_id = $1 ORDER BY id DESC LIMIT 1")
            .bind(event.0)
            .fetch_one(&pool)
            .await
            .expect("the run is recorded");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let seen = loop {
        let seen = onsale(&http, &api, &token).await["audit"].clone();
        if seen["id"] == id {
            break seen;
        }
        assert!(std::time::Instant::now() < deadline, "the view never showed audit run {id}: {seen}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(seen["violations"]["oversold"], 0, "{seen}");
    assert_eq!(seen["violations"]["dead_letters"], 0, "{seen}");
    assert!(
        seen["violations"]["multiple_captures_at_provider"].is_null(),
        "skipped provider: not checked: {seen}"
    );
    assert_eq!(seen["violations"], report["violations"], "the record is the report's");
    let gauge = |text: &str, prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit_once(' '))
            .and_then(|(_, v)| v.parse::<f64>().ok())
    };
    // Refreshed every 15 s.
    let deadline = std::time::Instant::now() + Duration::from_secs(25);
    let metrics = loop {
        let metrics = http.get(format!("{api}/metrics")).send().await.unwrap().text().await.unwrap();
        let at = gauge(&metrics, "boxoffice_audit_last_run_timestamp_seconds");
        if at.is_some_and(|t| (t - finished.timestamp_millis() as f64 / 1_000.0).abs() < 0.01) {
            break metrics;
        }
        assert!(std::time::Instant::now() < deadline, "the audit gauges never showed run {id}: {at:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(gauge(&metrics, "boxoffice_audit_violations{invariant=\"oversold\"}"), Some(0.0), "{metrics}");
    assert_eq!(gauge(&metrics, "boxoffice_dlq_depth"), Some(0.0), "{metrics}");
    d.stop().await;
}
