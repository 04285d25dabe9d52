//! The main job end to end: `boxoffice-drills onsale` as a process (the compiled binary) on
//! its own database against the test broker, buyers coming through the waiting room, checking
//! the report's invariants.

use crate::helpers::test_brokers;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::ConnectOptions;
use std::process::Command;

#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn small_onsale_through_the_binary_has_no_violations(_: PgPoolOptions, opts: PgConnectOptions) {
    let url = opts.to_url_lossy().to_string();
    let dir = std::env::temp_dir().join(format!("boxoffice-e2e-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let report = dir.join("report.json");
    let out = tokio::task::spawn_blocking({
        let report = report.clone();
        move || {
            Command::new(env!("CARGO_BIN_EXE_boxoffice-drills"))
                .args([
                    "onsale",
                    "--buyers",
                    "400",
                    "--small-venue",
                    "2,10,20",
                    "--hold-ttl-ms",
                    "15000",
                    "--arrival-rate",
                    "200",
                    "--release-rate",
                    "150",
                    "--no-progress",
                ])
                .arg("--report-json")
                .arg(&report)
                .env("BOXOFFICE_DATABASE_URL", url)
                .env("BOXOFFICE_KAFKA_BROKERS", test_brokers())
                .env("BOXOFFICE_KAFKA_TOPIC_PREFIX", format!("e2e{}.", uuid::Uuid::new_v4().simple()))
                .env("BOXOFFICE_KAFKA_PARTITIONS", "4")
                .env("BOXOFFICE_REDIS_KEY_PREFIX", format!("e2e{}:", uuid::Uuid::new_v4().simple()))
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "onsale failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    for key in [
        "oversold",
        "double_active_holds",
        "tickets_without_capture",
        "captured_without_ticket_or_refund",
        "uncaptured_past_deadline",
        "stuck_orders",
        "unpublished_outbox",
        "stranded_webhooks",
        "multiple_captures_at_provider",
        "uncaptured_past_deadline_at_provider",
        "drift_intent_missing_in_ledger",
        "drift_payment_missing_at_provider",
        "drift_authorization_not_in_ledger",
        "drift_capture_not_in_ledger",
        "drift_cancel_not_in_ledger",
        "drift_refund_not_in_ledger",
        "drift_ledger_disagrees_with_provider",
        "dead_letters",
    ] {
        assert_eq!(r[key], 0, "{key} in {r}");
    }
    assert_eq!(r["checks"]["provider"]["status"], "ran", "{r}");
    assert_eq!(r["checks"]["dead_letters"]["status"], "ran", "{r}");
    assert!(r["tickets"].as_i64().unwrap() > 0, "{r}");
    assert!(r["ticketed_orders"].as_i64().unwrap() > 0);
    assert_eq!(r["seats_sold"], r["tickets"]);
    assert!(r["expired"].as_i64().unwrap() > 0, "abandoned holds expired within the run: {r}");
    assert!(stdout.contains("every invariant holds"));
    assert_eq!((&r["result"], &r["exit_code"]), (&serde_json::json!("ok"), &serde_json::json!(0)), "{r}");
    // Every buyer came through the waiting room: joined, and was admitted by the release loop.
    let q = &r["waiting_room"];
    assert_eq!(q["admitted"], 400, "{q}");
    assert!(q["joins"].as_u64().unwrap() >= 400, "{q}");
    assert_eq!((&q["gave_up"], &q["rejected"]), (&0.into(), &0.into()), "{q}");
    // The release controller admitted them, at a rate the report read from /metrics.
    let rc = &r["release_controller"];
    assert!(rc["max_per_s"].as_f64().unwrap() > 0.0 && rc["samples"].as_u64().unwrap() > 0, "{rc}");
    // Buyers followed their orders by stream, and that saved status reads.
    let sr = &r["status_reads"];
    assert_eq!(sr["mode"], "stream", "{sr}");
    assert!(sr["streams"].as_u64().unwrap() >= r["holds"].as_u64().unwrap(), "{sr}");
    assert!(sr["saved"].as_u64().unwrap() > 0, "{sr}");
    assert!(sr["polls"].as_u64().unwrap() < sr["polls_replaced"].as_u64().unwrap() / 2, "{sr}");

    // `boxoffice timeline` tells the story of a ticketed order and of a compensated one.
    let pool = sqlx::PgPool::connect_with(opts.clone()).await.unwrap();
    let ticketed: uuid::Uuid = sqlx::query_scalar("SELECT id FROM orders WHERE status = 'ticketed' LIMIT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    let compensated: uuid::Uuid = sqlx::query_scalar(
        "SELECT o.id FROM orders o WHERE o.status = 'expired'
            AND EXISTS (SELECT 1 FROM outbox x WHERE x.message_key = o.id::text AND x.event_type = 'PaymentCanceled')
          LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .expect("an expired order whose authorization was cancelled");
    let story = |order: uuid::Uuid| {
        let out = Command::new(crate::helpers::product_bin())
            .args(["timeline", &order.to_string(), "--skip-provider"])
            .env("BOXOFFICE_ENV", "development")
            .env("BOXOFFICE_DATABASE_URL", opts.to_url_lossy().to_string())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let t = story(ticketed);
    for want in [
        "ticketed",
        "buyer's hold request (api)",
        "→ HoldCreated",
        "payments, applying HoldCreated",
        "webhook payment_intent.amount_capturable_updated",
        "order payment_required → confirming",
        "order paid → ticketed",
        "payments, applying OrderConfirmed",
        "applied by tickets in this transaction",
        "→ TicketIssued",
        "gaps (SLO",
    ] {
        assert!(t.contains(want), "{want:?} in\n{t}");
    }
    println!("{t}");
    let t = story(compensated);
    for want in [
        "expired",
        "sweep or operator command (HoldExpired)",
        "→ AuthorizationCancelRequested",
        "→ PaymentCanceled",
    ] {
        assert!(t.contains(want), "{want:?} in\n{t}");
    }
    println!("{t}");
    println!("status_reads: {sr}");
    let missing = Command::new(crate::helpers::product_bin())
        .args(["timeline", &uuid::Uuid::new_v4().to_string()])
        .env("BOXOFFICE_ENV", "development")
        .env("BOXOFFICE_DATABASE_URL", opts.to_url_lossy().to_string())
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(1), "an unknown order exits 1");
    let _ = std::fs::remove_dir_all(dir);
}
