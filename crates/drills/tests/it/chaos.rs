//! `boxoffice-drills chaos` as a process (the compiled binary, which starts the product
//! binary's role processes): two short seeded runs side by side, each with every role as two
//! processes, its own broker and Stripe simulator, killed and restarted on schedule. Both
//! must end with every audit count at 0 and tickets sold.

use std::process::Command;

fn chaos_run(seed: u64) -> std::process::Output {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    Command::new(env!("CARGO_BIN_EXE_boxoffice-drills"))
        .args(["chaos", "--json", "--duration", "20s", "--buyers", "40", "--hold-ttl", "15s"])
        .args(["--seed", &seed.to_string()])
        .env("BOXOFFICE_DATABASE_URL", url)
        .env("BOXOFFICE_BIN", crate::helpers::product_bin())
        .output()
        .expect("running boxoffice-drills chaos")
}

#[test]
fn seeded_chaos_runs_keep_every_invariant() {
    let runs: Vec<_> = [1u64, 2].map(|seed| std::thread::spawn(move || (seed, chaos_run(seed)))).into();
    // Both runs end (and clean up after themselves) before anything is asserted.
    let outputs: Vec<_> = runs.into_iter().map(|r| r.join().expect("chaos thread")).collect();
    for (seed, out) in outputs {
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let r: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("seed {seed}: {e} ({}):\n{stdout}\n{stderr}", out.status));
        // What failed first: a long report is cut in the middle by test output limits.
        let nonzero: serde_json::Map<_, _> = r["violations"]
            .as_object()
            .map(|v| v.iter().filter(|(_, n)| **n != 0).map(|(k, n)| (k.clone(), n.clone())).collect())
            .unwrap_or_default();
        assert!(
            out.status.success(),
            "seed {seed}: chaos failed ({}): nonzero violations {}, drained {}, last events {}\n{stdout}\n{stderr}",
            out.status,
            serde_json::Value::Object(nonzero),
            r["drained"],
            r["events"].as_array().map(|e| serde_json::json!(&e[e.len().saturating_sub(4)..])).unwrap_or_default(),
        );
        let injected = &r["injected"];
        assert!(injected["kill"].as_u64().unwrap_or(0) >= 1, "seed {seed}: no kill in {injected}");
        assert!(
            injected["broker_restart"].as_u64().unwrap_or(0) >= 1,
            "seed {seed}: no broker restart in {injected}"
        );
        assert!(injected["terminate_backends"].as_u64().unwrap_or(0) >= 1, "seed {seed}: {injected}");
        assert!(injected["stripe_fault_window"].as_u64().unwrap_or(0) >= 1, "seed {seed}: {injected}");
        assert!(
            injected["restart"].as_u64().unwrap_or(0) >= 1,
            "seed {seed}: nothing was restarted: {injected}"
        );
        let violations = r["violations"].as_object().expect("violations");
        assert!(violations.len() >= 10, "seed {seed}: {r}");
        for (name, n) in violations {
            assert_eq!(n, 0, "seed {seed}: {name} in {r}");
        }
        assert_eq!(r["violations_total"], 0);
        assert_eq!(r["checks"]["provider"]["status"], "ran", "seed {seed}: {r}");
        assert_eq!(r["checks"]["dead_letters"]["status"], "ran", "seed {seed}: {r}");
        assert_eq!(r["drained"], true, "seed {seed}: {r}");
        assert!(r["tickets"].as_i64().unwrap_or(0) > 0, "seed {seed}: no ticket sold: {r}");
        assert_eq!(r["tickets"], r["seats_sold"], "seed {seed}: {r}");
    }
}
