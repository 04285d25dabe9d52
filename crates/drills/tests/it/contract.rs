//! The contract matches the server: Schemathesis (`st run … --checks all`, the version
//! `scripts/lib.sh` pins and installs) against the product binary `boxoffice serve --roles
//! api` on a fresh database, with no payment provider. Two bounded runs (`--max-examples`,
//! a fixed seed, and a wall-clock limit on each): one with every parameter generated, one
//! with the seeded event's id in every `event_id` so the operations behind it are reached
//! too. Any failure of any check fails the test with Schemathesis's report.
//!
//! One documented exception: a schema-valid webhook without a valid `Stripe-Signature` (an
//! HMAC of the body under the endpoint secret, which no schema can state) is refused with
//! 400 `invalid_signature`, so `positive_data_acceptance` accepts 400 for that operation.

use crate::helpers::{eventually, product_bin, test_redis_url};
use boxoffice::runtime;
use boxoffice_domain::UserId;
use boxoffice_store::venue::{self, VenueSpec};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Examples per operation and run: enough to find every undeclared status of the baseline
/// in a few seconds; the whole test stays well under a minute on 2 cores.
const MAX_EXAMPLES: &str = "25";
/// Wall-clock bound of one `st run`.
const RUN_LIMIT: Duration = Duration::from_secs(240);

/// The pinned `st` (`BOXOFFICE_SCHEMATHESIS_BIN`, else the venv `scripts/lib.sh` installs).
fn st_bin() -> PathBuf {
    let path = std::env::var_os("BOXOFFICE_SCHEMATHESIS_BIN").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/boxoffice/venv/bin/st")
    });
    assert!(
        path.is_file(),
        "{} is missing: scripts/test installs Schemathesis (ensure_schemathesis)",
        path.display()
    );
    path
}

/// `DATABASE_URL` (the suite's server) pointed at `database`.
fn database_url(database: &str) -> String {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL names the test server");
    let (server, _) = base.rsplit_once('/').expect("DATABASE_URL has a path");
    format!("{server}/{database}")
}

const WEBHOOK_EXCEPTION: &str = r#"
[[operations]]
include-path = "/webhooks/stripe"
# The Stripe-Signature is an HMAC of the body under the endpoint secret: no schema can state
# it, so a schema-valid request is refused with 400 `invalid_signature`.
checks.positive_data_acceptance.expected-statuses = [200, 400]
"#;

async fn st_run(dir: &std::path::Path, config: &str, api: &str, bearer: &str, name: &str) -> (bool, String) {
    let cfg = dir.join(format!("{name}.toml"));
    std::fs::write(&cfg, config).unwrap();
    let mut cmd = tokio::process::Command::new(st_bin());
    // One worker: with two, hypothesis describes filter lambdas from two threads at once, and
    // this machine's CPython 3.11 `ast` once raised "AST constructor recursion depth mismatch"
    // inside the tool under load: a run error of the tool's own, not a finding about the API.
    cmd.current_dir(dir)
        .arg("--no-color")
        .arg("--config-file")
        .arg(&cfg)
        .args(["run", &format!("{api}/openapi.json"), "--checks", "all", "--max-examples", MAX_EXAMPLES])
        .args(["--seed", "7", "--generation-database", "none", "--request-timeout", "10", "--workers", "1"])
        .args(["-H", &format!("Authorization: Bearer {bearer}")])
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let started = Instant::now();
    let out = tokio::time::timeout(RUN_LIMIT, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("st run ({name}) did not finish within {RUN_LIMIT:?}"))
        .expect("st runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + "\n" + &String::from_utf8_lossy(&out.stderr);
    eprintln!("schemathesis ({name}) exit {:?} in {:?}", out.status.code(), started.elapsed());
    (out.status.success(), text)
}

/// Schemathesis's closing summary: from its `SUMMARY` banner to the closing line.
fn summary(text: &str) -> String {
    let mut out = Vec::new();
    for line in text.lines().skip_while(|l| !l.contains("SUMMARY")).skip(1) {
        if !line.trim().is_empty() {
            out.push(line);
        }
        if line.starts_with('=') {
            break;
        }
    }
    out.join("\n")
}

/// Every status the server returns is declared with its problem codes, every constraint the
/// server enforces is in the schema, and every response matches it: Schemathesis with all
/// checks finds nothing.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn schemathesis_finds_no_contract_violation(_: PgPoolOptions, opts: PgConnectOptions) {
    let st = st_bin();
    let database = opts.get_database().expect("a per-test database").to_owned();
    let pool = boxoffice_store::connect(opts, 2, 10_000).await.unwrap();
    let (event, _) =
        venue::seed(&pool, "Contract Event", &VenueSpec::small(1, 2, 5), chrono::Utc::now(), "cell-1")
            .await
            .unwrap();
    let dir = std::env::temp_dir().join(format!("boxoffice-contract-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let api = format!("http://127.0.0.1:{port}");
    let log = std::fs::File::create(dir.join("serve.log")).unwrap();
    let generous = "100000";
    let mut server = tokio::process::Command::new(product_bin())
        .args(["serve", "--roles", "api"])
        .env("BOXOFFICE_ENV", "development")
        .env("BOXOFFICE_DATABASE_URL", database_url(&database))
        .env("BOXOFFICE_HTTP_BIND", format!("127.0.0.1:{port}"))
        .env("BOXOFFICE_REDIS_URL", test_redis_url())
        .env("BOXOFFICE_REDIS_KEY_PREFIX", format!("contract{}:", Uuid::new_v4().simple()))
        .env("BOXOFFICE_RELEASE_MAX_PER_S", "0")
        .env("BOXOFFICE_ADMISSION_DIRECT", "true")
        .env("BOXOFFICE_STRIPE_API_BASE", "")
        // The buckets stay on (their 429 is part of the contract) but wide enough for the
        // generator to reach the handlers.
        .env("BOXOFFICE_RATE_LIMIT_IP_PER_S", generous)
        .env("BOXOFFICE_RATE_LIMIT_IP_BURST", generous)
        .env("BOXOFFICE_RATE_LIMIT_USER_PER_S", generous)
        .env("BOXOFFICE_RATE_LIMIT_USER_BURST", generous)
        .env("BOXOFFICE_RATE_LIMIT_PURCHASE_IP_PER_S", generous)
        .env("BOXOFFICE_RATE_LIMIT_PURCHASE_IP_BURST", generous)
        .env("BOXOFFICE_RATE_LIMIT_PURCHASE_USER_PER_S", generous)
        .env("BOXOFFICE_RATE_LIMIT_PURCHASE_USER_BURST", generous)
        .env("BOXOFFICE_RATE_LIMIT_SEATS_IP_PER_S", generous)
        .env("BOXOFFICE_RATE_LIMIT_SEATS_IP_BURST", generous)
        .env("BOXOFFICE_RATE_LIMIT_ADMIN_IP_PER_S", generous)
        .env("BOXOFFICE_RATE_LIMIT_ADMIN_IP_BURST", generous)
        .env("BOXOFFICE_LOG", "warn")
        .env_remove("BOXOFFICE_CONFIG")
        .env_remove("BOXOFFICE_KAFKA_BROKERS")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .expect("boxoffice serve starts");
    let http = reqwest::Client::new();
    eventually(Duration::from_secs(30), "boxoffice serve answers /healthz", || async {
        http.get(format!("{api}/healthz")).send().await.is_ok_and(|r| r.status() == 200)
    })
    .await;
    let bearer =
        runtime::user_tokens(&boxoffice::config::Config::default()).issue(UserId(Uuid::new_v4()), 3_600);
    eprintln!("schemathesis: {}", st.display());

    let generated = st_run(&dir, WEBHOOK_EXCEPTION, &api, &bearer, "generated").await;
    let with_event = format!("parameters = {{ event_id = \"{}\" }}\n{WEBHOOK_EXCEPTION}", event.0);
    let seeded = st_run(&dir, &with_event, &api, &bearer, "seeded-event").await;
    let _ = server.kill().await;
    for (name, (ok, text)) in [("generated", &generated), ("seeded-event", &seeded)] {
        eprintln!("--- schemathesis ({name}) ---\n{}", summary(text));
        if !ok {
            let log = std::fs::read_to_string(dir.join("serve.log")).unwrap_or_default();
            panic!("schemathesis ({name}) found contract violations:\n{text}\n--- server log ---\n{log}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
