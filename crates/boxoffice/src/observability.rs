//! Checks of the alerts and dashboard kept as code in `deploy/observability/` (design §16).
//!
//! What they protect: an alert that reads a metric the product no longer exports never
//! fires, and nobody notices until the incident it was for. So every `boxoffice_*` name in
//! the rules and the dashboard must be one the product's sources export (a renamed metric
//! fails here), every label value the rules match on (release signal, audit invariant,
//! reconcile drift kind) must be one the code emits, every alert carries its severity,
//! summary, description and runbook, each of the nine signals has an alert, and every alert
//! has a promtool unit test that fires it and one that does not.
//!
//! `promtool` (`BOXOFFICE_PROMTOOL`, else the one on `PATH`) checks the rules and runs their
//! unit tests; without it that test only says so, unless `BOXOFFICE_REQUIRE_PROMTOOL=1`
//! (`scripts/test` sets it and installs promtool), where a missing promtool fails. The other
//! checks need nothing installed.

use crate::reconcile::DriftKind;
use boxoffice_workers::release::Signal;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Metrics the rules read that other work in progress adds to the product; each must move
/// out of this list once its exporter lands (then a rename of it fails like any other).
const PENDING: &[&str] = &[];

/// The nine signals of design §16, then the business boundary and the release controller
/// the controller's own rules watch, then the HTTP edge's shed and refused requests: each
/// with the alerts that cover it.
const SIGNALS: &[(&str, &[&str])] = &[
    (
        "1 hold endpoint p99 and conflict rate",
        &["BoxofficeHoldLatencyHigh", "BoxofficeSeatConflictRateHigh", "BoxofficeHoldErrors"],
    ),
    (
        "2 PostgreSQL lock wait / deadlock / connections",
        &[
            "BoxofficeLockWaitsHigh",
            "BoxofficeDeadlocks",
            "BoxofficeConnectionSaturation",
            "BoxofficeCommitLatencyHigh",
            "BoxofficeHoldRetriesExhausted",
        ],
    ),
    (
        "3 oldest unpublished outbox row",
        &[
            "BoxofficeOutboxLagging",
            "BoxofficeOutboxStalled",
            "BoxofficeOutboxParked",
            "BoxofficeRelayErrors",
        ],
    ),
    (
        "4 consumer lag by partition",
        &[
            "BoxofficeConsumerLagHigh",
            "BoxofficeConsumerStalled",
            "BoxofficeConsumerErrors",
            "BoxofficeConsumerNoPartitions",
        ],
    ),
    (
        "5 expired hold processing delay",
        &["BoxofficeExpiryDelayHigh", "BoxofficeExpiryBacklog", "BoxofficeExpiryErrors"],
    ),
    ("6 DLQ depth", &["BoxofficeDeadLetters", "BoxofficeDlqNotEmpty"]),
    (
        "7 Stripe/local status mismatch",
        &[
            "BoxofficeReconcileDrift",
            "BoxofficeReconcileNotRun",
            "BoxofficePaymentIncidents",
            "BoxofficePaymentCommandsRefused",
            "BoxofficeStripeWebhooksRejected",
            "BoxofficeWebhookClaimsLeftToReconciliation",
        ],
    ),
    (
        "8 ticket uniqueness violation",
        &[
            "BoxofficeTicketUniquenessViolated",
            "BoxofficeDoubleActiveHolds",
            "BoxofficeAuditMoneyViolation",
            "BoxofficeAuditBacklog",
            "BoxofficeAuditNotRun",
            "BoxofficeHoldUniqueIndexRejection",
        ],
    ),
    (
        "9 cross-region replication lag",
        &[
            "BoxofficeReplicationLagHigh",
            "BoxofficeReplicationLagRising",
            "BoxofficeReplicationLagBytesHigh",
            "BoxofficeReplicaBehind",
            "BoxofficeRegionLeaseLapsed",
            "BoxofficeRegionLeaseRenewalLagging",
            "BoxofficeRegionFencedWrites",
        ],
    ),
    (
        "business boundary and the release controller",
        &[
            "BoxofficePayableDelayHigh",
            "BoxofficeAuthorizationWaitHigh",
            "BoxofficeNeverPayableShareHigh",
            "BoxofficeActiveHoldsHigh",
            "BoxofficeReleaseProbeFailing",
            "BoxofficeReleaseNoLeader",
        ],
    ),
    ("the HTTP edge: shed and refused requests", &["BoxofficeRequestsShed", "BoxofficeWaitingRoomRefusing"]),
];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    groups: Vec<Group>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Group {
    name: String,
    rules: Vec<Rule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    alert: String,
    expr: String,
    #[serde(rename = "for")]
    _for: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
struct TestFile {
    rule_files: Vec<String>,
    tests: Vec<TestGroup>,
}

#[derive(Debug, Deserialize)]
struct TestGroup {
    #[serde(default)]
    alert_rule_test: Vec<AlertTest>,
}

#[derive(Debug, Deserialize)]
struct AlertTest {
    alertname: String,
    #[serde(default)]
    exp_alerts: Vec<serde_norway::Value>,
}

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/observability")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn alerts() -> Vec<(String, Rule)> {
    let file: RuleFile = serde_norway::from_str(&read(&dir().join("alerts.yml"))).expect("alerts.yml parses");
    file.groups.into_iter().flat_map(|g| g.rules.into_iter().map(move |r| (g.name.clone(), r))).collect()
}

fn dashboard() -> serde_json::Value {
    let path = dir().join("grafana/boxoffice-onsale.json");
    serde_json::from_str(&read(&path)).expect("the dashboard parses as JSON")
}

/// Every panel, those inside collapsed rows included.
fn panels(d: &serde_json::Value) -> Vec<&serde_json::Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        out.push(p);
        if let Some(inner) = p["panels"].as_array() {
            out.extend(inner);
        }
    }
    out
}

/// The PromQL of every dashboard query.
fn dashboard_exprs(d: &serde_json::Value) -> Vec<String> {
    panels(d)
        .into_iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .map(|t| t["expr"].as_str().expect("every target has an expr").to_owned())
        .collect()
}

/// `boxoffice_*` identifiers in a PromQL expression (metric names; nothing else in these
/// files starts so).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let b = expr.as_bytes();
    let ident = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_';
    let mut i = 0;
    while let Some(at) = expr[i..].find("boxoffice_") {
        let start = i + at;
        let mut end = start;
        while end < b.len() && ident(b[end]) {
            end += 1;
        }
        if start == 0 || !(ident(b[start - 1]) || b[start - 1] == b':') {
            out.insert(expr[start..end].to_owned());
        }
        i = end;
    }
    out
}

/// Metric names the product exports: every `"boxoffice_…"` string literal in the product's
/// library and binary sources outside their test modules (the macros take literals, and the
/// saga's counted steps name theirs the same way), with `_count` and `_sum` for the names
/// recorded as histograms (rendered as summaries). Tools and tests (drills, harness, the
/// Stripe simulator, this module) do not count.
fn exported() -> BTreeSet<String> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    let mut stack = Vec::new();
    for c in std::fs::read_dir(&crates).expect("crates/") {
        let c = c.expect("entry").path();
        let name = c.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        if !["drills", "harness", "stripe-sim"].contains(&name.as_str()) {
            stack.push(c.join("src"));
        }
    }
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs")
                && !p.ends_with("boxoffice/src/observability.rs")
            {
                files.push(p);
            }
        }
    }
    assert!(files.len() > 20, "found the product's sources under {}", crates.display());
    let mut names = BTreeSet::new();
    for f in files {
        let text = read(&f);
        let text = text.split("\n#[cfg(test)]\nmod ").next().unwrap_or_default();
        let mut rest = text;
        while let Some(at) = rest.find("\"boxoffice_") {
            let before = rest[..at].trim_end();
            let lit = &rest[at + 1..];
            let len = lit
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(lit.len());
            if lit[len..].starts_with('"') {
                let name = &lit[..len];
                names.insert(name.to_owned());
                if before.ends_with("histogram!(") {
                    names.insert(format!("{name}_count"));
                    names.insert(format!("{name}_sum"));
                }
            }
            rest = &lit[len..];
        }
    }
    names
}

/// The values a rule matches label `label` against: `label="a"`, `label!="a"` and the
/// alternatives of `label=~"a|b"` / `label!~"a|b"`.
fn label_values(expr: &str, label: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find(label) {
        let after = &rest[at + label.len()..];
        let preceded = rest[..at].chars().next_back().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let op = ["=~\"", "!~\"", "!=\"", "=\""].into_iter().find(|op| after.starts_with(op));
        if let (false, Some(op)) = (preceded, op) {
            let value = &after[op.len()..];
            let end = value.find('"').expect("a closed label value");
            out.extend(value[..end].split('|').map(str::to_owned));
        }
        rest = after;
    }
    out
}

#[test]
fn every_alert_is_labelled_annotated_and_named_once() {
    let rules = alerts();
    assert!(rules.len() >= 9, "{} alerts", rules.len());
    let mut seen = BTreeSet::new();
    for (group, r) in &rules {
        assert!(seen.insert(r.alert.clone()), "{} is defined twice", r.alert);
        assert!(r.alert.starts_with("Boxoffice"), "{}: alert names start with Boxoffice", r.alert);
        assert!(group.starts_with("boxoffice-"), "{group}: group names start with boxoffice-");
        let severity = r.labels.get("severity").map(String::as_str);
        assert!(
            matches!(severity, Some("critical" | "warning" | "info")),
            "{}: severity is critical, warning or info, not {severity:?}",
            r.alert
        );
        for key in ["summary", "description", "runbook"] {
            let v = r.annotations.get(key).map(|s| s.trim()).unwrap_or_default();
            assert!(!v.is_empty(), "{}: annotation {key} is missing", r.alert);
            assert!(!v.contains('\n'), "{}: annotation {key} is one line", r.alert);
        }
        let runbook = &r.annotations["runbook"];
        assert!(runbook.len() >= 40, "{}: the runbook says what to look at and do: {runbook:?}", r.alert);
        assert!(!r.expr.trim().is_empty(), "{}: expr", r.alert);
    }
}

#[test]
fn rules_and_dashboard_read_only_metrics_the_product_exports() {
    let exported = exported();
    // The scan itself must see the well-known ones, or it proves nothing.
    for name in
        ["boxoffice_consumer_lag", "boxoffice_hold_seconds_count", "boxoffice_late_authorizations_total"]
    {
        assert!(exported.contains(name), "the source scan misses {name}");
    }
    let known = |m: &str| exported.contains(m) || PENDING.contains(&m);
    let mut unknown = Vec::new();
    let mut in_alerts = BTreeSet::new();
    for (_, r) in alerts() {
        for m in metric_names(&r.expr) {
            if !known(&m) {
                unknown.push(format!("alert {}: {m}", r.alert));
            }
            in_alerts.insert(m);
        }
    }
    let d = dashboard();
    let mut in_dashboard = BTreeSet::new();
    for e in dashboard_exprs(&d) {
        for m in metric_names(&e) {
            if !known(&m) {
                unknown.push(format!("dashboard: {m}"));
            }
            in_dashboard.insert(m);
        }
    }
    assert!(
        unknown.is_empty(),
        "metrics no product source exports (renamed? add to PENDING only if in progress):\n{}",
        unknown.join("\n")
    );
    let undrawn: Vec<_> = in_alerts.difference(&in_dashboard).collect();
    assert!(undrawn.is_empty(), "metrics alerted on but on no dashboard panel: {undrawn:?}");
}

#[test]
fn label_values_the_rules_match_are_ones_the_code_emits() {
    let signals: BTreeSet<String> = Signal::ALL.iter().map(|s| s.name().to_owned()).collect();
    let kinds: BTreeSet<String> = DriftKind::ALL.iter().map(|k| k.name().to_owned()).collect();
    let invariants: BTreeSet<String> =
        match serde_json::to_value(boxoffice_store::audit::Violations::default()) {
            Ok(serde_json::Value::Object(m)) => m.keys().cloned().collect(),
            other => panic!("Violations serializes as an object: {other:?}"),
        };
    let d = dashboard();
    let exprs = alerts()
        .into_iter()
        .map(|(_, r)| (r.alert, r.expr))
        .chain(dashboard_exprs(&d).into_iter().map(|e| ("dashboard".to_owned(), e)));
    for (name, expr) in exprs {
        let release = expr.contains("boxoffice_release_");
        for (label, allowed) in [("signal", &signals), ("invariant", &invariants), ("kind", &kinds)] {
            if label == "signal" && !release {
                continue;
            }
            if label == "kind" && !expr.contains("boxoffice_reconcile_drift") {
                continue;
            }
            for v in label_values(&expr, label) {
                assert!(allowed.contains(&v), "{name}: {label}=\"{v}\" is not one of {allowed:?}");
            }
        }
        if expr.contains("boxoffice_payment_commands_skipped_total") && expr.contains("reason!~") {
            // The routine skips, the payment worker's one list of them, and no other.
            let routine: BTreeSet<String> =
                boxoffice_workers::payment::ROUTINE_SKIPS.iter().map(|r| r.to_string()).collect();
            assert_eq!(label_values(&expr, "reason"), routine, "{name}");
        }
        if expr.contains("boxoffice_release_decreases_total") {
            for v in label_values(&expr, "reason") {
                assert!(signals.contains(&v), "{name}: reason=\"{v}\" is not a release signal");
            }
        }
    }
}

#[test]
fn each_of_the_nine_signals_has_an_alert() {
    let defined: BTreeSet<String> = alerts().into_iter().map(|(_, r)| r.alert).collect();
    assert!(SIGNALS.iter().filter(|(s, _)| s.starts_with(char::is_numeric)).count() == 9);
    let mut mapped = BTreeSet::new();
    for (signal, names) in SIGNALS {
        assert!(!names.is_empty(), "signal {signal} has no alert");
        for n in *names {
            assert!(defined.contains(*n), "signal {signal}: alert {n} is not in alerts.yml");
            assert!(mapped.insert(n.to_string()), "{n} is mapped twice");
        }
    }
    let unmapped: Vec<_> = defined.difference(&mapped).collect();
    assert!(unmapped.is_empty(), "alerts mapped to no signal in SIGNALS: {unmapped:?}");
}

#[test]
fn every_alert_has_a_test_that_fires_it_and_one_that_does_not() {
    let tests: TestFile =
        serde_norway::from_str(&read(&dir().join("alerts.test.yml"))).expect("alerts.test.yml parses");
    assert_eq!(tests.rule_files, ["alerts.yml"]);
    let mut fires = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for t in tests.tests.iter().flat_map(|g| &g.alert_rule_test) {
        let bucket = if t.exp_alerts.is_empty() { &mut quiet } else { &mut fires };
        bucket.insert(t.alertname.clone());
    }
    for (_, r) in alerts() {
        assert!(fires.contains(&r.alert), "{}: no promtool test fires it", r.alert);
        assert!(quiet.contains(&r.alert), "{}: no promtool test where it stays quiet", r.alert);
    }
}

#[test]
fn the_dashboard_has_a_datasource_variable_and_templated_cell_and_event() {
    let d = dashboard();
    assert!(d["schemaVersion"].as_u64().is_some_and(|v| v >= 38), "schemaVersion {}", d["schemaVersion"]);
    assert!(d["uid"].as_str().is_some_and(|u| !u.is_empty()));
    let vars = d["templating"]["list"].as_array().expect("templating.list");
    let var =
        |name: &str| vars.iter().find(|v| v["name"] == name).unwrap_or_else(|| panic!("variable {name}"));
    assert_eq!(var("datasource")["type"], "datasource");
    assert_eq!(var("datasource")["query"], "prometheus");
    for (name, metric) in
        [("cell", "boxoffice_release_rate_per_s"), ("event", "boxoffice_waitroom_queue_length")]
    {
        let q = var(name)["query"]["query"].as_str().unwrap_or_default();
        assert_eq!(q, format!("label_values({metric}, {name})"), "variable {name}");
        assert_eq!(var(name)["datasource"]["uid"], "${datasource}");
    }
    let mut ids = BTreeSet::new();
    for p in panels(&d) {
        assert!(ids.insert(p["id"].as_u64().expect("panel id")), "panel id {} twice", p["id"]);
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "panel {}", p["title"]);
        let targets = p["targets"].as_array().map(Vec::as_slice).unwrap_or_default();
        assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        for t in targets {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "panel {}", p["title"]);
        }
    }
    let exprs = dashboard_exprs(&d).join("\n");
    assert!(exprs.contains("$cell") && exprs.contains("$event"), "the cell and event variables are used");
}

/// The promtool to use, or `None` (with the reason printed) when it is absent and not required.
fn promtool() -> Option<String> {
    let bin = std::env::var("BOXOFFICE_PROMTOOL").unwrap_or_else(|_| "promtool".to_owned());
    let required = std::env::var("BOXOFFICE_REQUIRE_PROMTOOL").is_ok_and(|v| v == "1");
    match Command::new(&bin).arg("--version").output() {
        Ok(o) if o.status.success() => Some(bin),
        other => {
            let why = match other {
                Ok(o) => format!("exited {}", o.status),
                Err(e) => e.to_string(),
            };
            assert!(!required, "BOXOFFICE_REQUIRE_PROMTOOL=1 but {bin} --version failed: {why}");
            eprintln!("promtool not found ({bin}: {why}): rule checks and unit tests skipped");
            None
        }
    }
}

fn run(bin: &str, args: &[&str], cwd: &Path) {
    let o = Command::new(bin).args(args).current_dir(cwd).output().expect("promtool runs");
    assert!(
        o.status.success(),
        "{bin} {} failed ({}):\n{}{}",
        args.join(" "),
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn promtool_checks_the_rules_runs_their_tests_and_parses_the_dashboard_queries() {
    let Some(bin) = promtool() else { return };
    let dir = dir();
    run(&bin, &["check", "rules", "alerts.yml"], &dir);
    run(&bin, &["test", "rules", "alerts.test.yml"], &dir);
    // The dashboard's queries as recording rules, so promtool parses each one (Grafana's
    // variables replaced by what "All" sends).
    let d = dashboard();
    let rules: Vec<String> = dashboard_exprs(&d)
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let e = e.replace("$cell", ".*").replace("$event", ".*");
            format!(
                "      - record: dashboard_query_{i}\n        expr: {}\n",
                serde_json::to_string(&e).expect("json")
            )
        })
        .collect();
    let tmp = std::env::temp_dir().join(format!("boxoffice-dashboard-rules-{}.yml", std::process::id()));
    std::fs::write(&tmp, format!("groups:\n  - name: dashboard\n    rules:\n{}", rules.concat()))
        .expect("write");
    let path = tmp.to_str().expect("utf-8 temp path").to_owned();
    let result = std::panic::catch_unwind(|| run(&bin, &["check", "rules", &path], &dir));
    let _ = std::fs::remove_file(&tmp);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

#[test]
fn helpers_find_names_and_label_values() {
    let e = r#"max by (cell) (boxoffice_release_signal{signal="lock_waits"} and on (cell) (boxoffice_release_leader == 1)) > x:boxoffice_y"#;
    assert_eq!(
        metric_names(e).into_iter().collect::<Vec<_>>(),
        ["boxoffice_release_leader", "boxoffice_release_signal"]
    );
    assert_eq!(label_values(e, "signal").into_iter().collect::<Vec<_>>(), ["lock_waits"]);
    let e = r#"m{kind!~"a|b", xkind="c", kind="d"}"#;
    assert_eq!(label_values(e, "kind").into_iter().collect::<Vec<_>>(), ["a", "b", "d"]);
}
