//! `boxoffice-drills drill failover` as a process: a short seeded warm-region failover on one
//! machine (design §15, §17). The promotion must reject the old region epoch everywhere — at
//! the new primary and at the returning old primary — and the promoted region's audit must
//! be clean after the drain; RPO and RTO are reported.

use std::process::Command;

#[test]
fn a_regional_promotion_rejects_the_old_epoch_and_loses_only_the_unreplicated_window() {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let out = Command::new(env!("CARGO_BIN_EXE_boxoffice-drills"))
        .args(["drill", "failover", "--json", "--seed", "1", "--buyers", "4"])
        .args(["--before-cut", "6s", "--lag-window", "3s", "--after", "3s", "--drain-timeout", "90s"])
        .env("BOXOFFICE_DATABASE_URL", url)
        .env_remove("BOXOFFICE_KAFKA_BROKERS")
        .output()
        .expect("running boxoffice-drills drill failover");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "failover drill failed ({}):\n{stdout}\n{stderr}", out.status);
    let r: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}:\n{stdout}\n{stderr}"));
    for key in [
        "rpo_commits_lost",
        "rpo_seconds",
        "rto_seconds",
        "old_epoch_writes_accepted",
        "zombie_writes_accepted",
        "republished",
        "duplicates_absorbed",
        "violations",
    ] {
        assert!(r.get(key).is_some_and(|v| !v.is_null()), "no {key} in {r}");
    }
    assert_eq!(r["old_epoch_writes_accepted"], 0, "{r}");
    assert_eq!(r["zombie_writes_accepted"], 0, "{r}");
    assert!(r["zombie_attempts"].as_u64().unwrap_or(0) > 0, "the zombie was tried: {r}");
    assert_eq!(r["zombie_fenced_in_its_ledger"], true, "{r}");
    assert_eq!(r["violations"], 0, "{r}");
    assert_eq!(r["drained"], true, "{r}");
    assert_eq!((r["old_epoch"].as_i64(), r["new_epoch"].as_i64()), (Some(1), Some(2)), "{r}");
    assert!(r["holds_acknowledged"].as_u64().unwrap_or(0) > 0, "buyers bought: {r}");
    assert!(r["rto_seconds"].as_f64().unwrap_or(0.0) > 0.0, "the synthetic check passed: {r}");
    assert!(r["rpo_wal_bytes"].as_i64().unwrap_or(0) > 0, "the cut left WAL behind: {r}");
    assert!(r["republished"].as_u64().unwrap_or(0) > 0, "{r}");
}
