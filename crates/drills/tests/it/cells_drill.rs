//! `boxoffice-drills cells` as a process (the compiled binary): a short seeded run of two
//! purchase cells with cell 2's database cut off for 8 s. Cell 1 must keep its ticketing rate
//! through the outage, cell 2 must recover, and both audits must be clean.

use std::process::Command;
use std::time::Instant;

#[test]
fn a_cell_outage_costs_only_that_cell() {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_boxoffice-drills"))
        .args(["cells", "--json", "--duration", "30s", "--outage", "8s", "--hold-ttl", "8s"])
        .args(["--rate", "6", "--seed", "1", "--drain-timeout", "60s"])
        .env("BOXOFFICE_DATABASE_URL", url)
        .env_remove("BOXOFFICE_KAFKA_BROKERS")
        .output()
        .expect("running boxoffice-drills cells");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "cells drill failed ({}):\n{stdout}\n{stderr}", out.status);
    let r: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}:\n{stdout}\n{stderr}"));
    let ratio = r["cell1_rate_ratio_during_outage"].as_f64().unwrap_or_else(|| panic!("ratio in {r}"));
    assert!(ratio >= 0.8, "cell-1 slowed down during cell-2's outage: {r}");
    assert_eq!(r["cell2_recovered"], true, "{r}");
    assert_eq!(r["violations"], 0, "{r}");
    assert_eq!(r["outage"]["duration_s"], 8.0, "{r}");
    let start = r["outage"]["start_s"].as_f64().expect("outage start");
    assert!((9.0..=12.0).contains(&start), "{r}");
    for cell in ["cell-1", "cell-2"] {
        for window in ["before", "during", "after"] {
            let w = &r["cells"][cell][window];
            for key in ["holds_per_s", "ticketed_per_s", "hold_p99_ms"] {
                assert!(w.get(key).is_some(), "{cell} {window} has no {key}: {r}");
            }
        }
        assert_eq!(r["cells"][cell]["drained"], true, "{cell}: {r}");
        assert_eq!(r["cells"][cell]["violations"], 0, "{cell}: {r}");
        assert_eq!(r["cells"][cell]["checks"]["provider"]["status"], "ran", "{cell}: {r}");
        assert_eq!(r["cells"][cell]["checks"]["dead_letters"]["status"], "ran", "{cell}: {r}");
    }
    // Cell 1 sells on while cell 2 takes (next to) no holds: its database is gone.
    let holds_per_s = |cell: &str, w: &str| r["cells"][cell][w]["holds_per_s"].as_f64().unwrap_or(0.0);
    assert!(holds_per_s("cell-1", "during") > 0.0, "{r}");
    assert!(holds_per_s("cell-2", "during") < 0.25 * holds_per_s("cell-2", "before"), "{r}");
    assert!(r["outage"]["connections_cut"].as_u64().unwrap_or(0) >= 1, "{r}");
    assert!(r["cells"]["cell-2"]["recovery"]["first_ticket_s"].is_f64(), "{r}");
    eprintln!("cells drill took {:.1}s", started.elapsed().as_secs_f64());
}
