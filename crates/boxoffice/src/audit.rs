//! `boxoffice audit`: every invariant check, over the ledger, the payment provider and the
//! dead-letter topic, as one report (text or JSON) with an exit code. The onsale report runs
//! the same checks.
//!
//! Owns which checks run and how they are reported. The ledger checks are
//! [`boxoffice_store::audit`]'s; the provider checks compare Stripe's PaymentIntents in a
//! window with the ledger ([`crate::reconcile::scan`]) and add what only the provider can
//! show: more than one capture for one order (invariant 6: a buyer charged twice) and
//! authorizations still uncaptured and uncancelled past their capture deadline; the
//! dead-letter check counts messages some consumer could not apply (invariant 5: a fact
//! published but never applied).
//!
//! Each run is recorded in the ledger's `audit_runs` ([`record`]: every count by name, which
//! checks ran, the totals); the operator's dashboard and the API's `boxoffice_audit_*`
//! gauges show the latest. A run that cannot be recorded (a read-only replica) still
//! reports and exits as usual, with a warning.
//!
//! A check that cannot run is never reported as zero: without a Stripe API base or a broker
//! it says "not checked", and when the provider or broker fails it says so and the exit
//! code is 2 (1 wins when a check that did run found a violation).

use crate::reconcile::{self, DriftKind, Window};
use boxoffice_bus::KafkaConfig;
use boxoffice_payments::{PaymentIntentStatus, StripeClient};
use boxoffice_store::audit::{Totals, Violations};
use serde::Serialize;
use serde_json::json;
use sqlx::PgPool;
use std::collections::HashMap;
use std::time::Duration;
use uuid::Uuid;

/// How far back `boxoffice audit` lists PaymentIntents by default: longer than a card
/// authorization lives (7 days), so every authorization that can still be captured or must
/// have been released is in view.
pub const DEFAULT_PROVIDER_WINDOW: &str = "8d";

/// The outcome of one check that may not have run.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "status", content = "detail", rename_all = "snake_case")]
pub enum Check<T> {
    /// The check ran; its findings.
    Ran(T),
    /// The check was not configured to run; why.
    NotChecked(String),
    /// The check was configured but failed to run; the error.
    Failed(String),
}

impl<T> Check<T> {
    /// The findings when the check ran.
    pub fn ran(&self) -> Option<&T> {
        match self {
            Check::Ran(t) => Some(t),
            _ => None,
        }
    }
}

/// What the provider checks found. Counts of PaymentIntents unless said otherwise.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ProviderViolations {
    /// Orders with more than one PaymentIntent that captured money (`succeeded` or
    /// `amount_received > 0`): the buyer was charged more than once.
    pub multiple_captures_at_provider: i64,
    /// Intents the provider still holds in `requires_capture` although their capture deadline
    /// has passed (the ledger's `capture_before` by the database clock, or the charge's
    /// `capture_before`): neither captured nor released.
    pub uncaptured_past_deadline_at_provider: i64,
    /// Provider/ledger drift per kind ([`DriftKind`]), every kind present (0 when none).
    pub drift: Vec<(DriftKind, i64)>,
}

impl ProviderViolations {
    /// Sum of all counts.
    pub fn total(&self) -> i64 {
        self.multiple_captures_at_provider
            + self.uncaptured_past_deadline_at_provider
            + self.drift.iter().filter(|(k, _)| k.is_violation()).map(|(_, n)| n).sum::<i64>()
    }

    /// The count of one drift kind.
    pub fn drift_count(&self, kind: DriftKind) -> i64 {
        self.drift.iter().find(|(k, _)| *k == kind).map_or(0, |(_, n)| *n)
    }
}

/// The provider checks' findings and what they covered.
#[derive(Debug, Clone, Serialize)]
pub struct ProviderFindings {
    /// The PaymentIntent creation window listed.
    pub window: Window,
    /// PaymentIntents compared with the ledger.
    pub intents_checked: usize,
    /// The counts.
    pub violations: ProviderViolations,
}

/// Every check's result.
#[derive(Debug, Clone)]
pub struct AuditReport {
    /// The ledger checks (always run).
    pub ledger: Violations,
    /// The provider checks.
    pub provider: Check<ProviderFindings>,
    /// Messages in the dead-letter topic (`ticketing.purchase.dlq.v1`), whatever their event.
    pub dead_letters: Check<i64>,
    /// Business totals.
    pub totals: Totals,
}

impl AuditReport {
    /// Sum of every count of the checks that ran.
    pub fn total(&self) -> i64 {
        self.ledger.total()
            + self.provider.ran().map_or(0, |p| p.violations.total())
            + self.dead_letters.ran().copied().unwrap_or(0)
    }

    /// 1 on any violation; else 2 when a configured check failed to run; else 0.
    pub fn exit_code(&self) -> i32 {
        if self.total() > 0 {
            1
        } else if matches!(self.provider, Check::Failed(_)) || matches!(self.dead_letters, Check::Failed(_)) {
            2
        } else {
            0
        }
    }

    /// Every violation count by name, `null` for checks that did not run.
    pub fn violations_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(&self.ledger).expect("counts serialize");
        let m = v.as_object_mut().expect("a struct");
        let p = self.provider.ran().map(|p| &p.violations);
        m.insert("multiple_captures_at_provider".into(), json!(p.map(|p| p.multiple_captures_at_provider)));
        m.insert(
            "uncaptured_past_deadline_at_provider".into(),
            json!(p.map(|p| p.uncaptured_past_deadline_at_provider)),
        );
        for kind in DriftKind::ALL.into_iter().filter(|k| k.is_violation()) {
            m.insert(format!("drift_{}", kind.name()), json!(p.map(|p| p.drift_count(kind))));
        }
        m.insert("dead_letters".into(), json!(self.dead_letters.ran()));
        v
    }

    /// The JSON form: `violations` (flat counts, `null` when not checked), `checks` (which
    /// ran, over what, or why not) and `totals`.
    pub fn to_json(&self) -> serde_json::Value {
        let provider = match &self.provider {
            Check::Ran(p) => Check::Ran(json!({"window": p.window, "intents_checked": p.intents_checked})),
            Check::NotChecked(s) => Check::NotChecked(s.clone()),
            Check::Failed(s) => Check::Failed(s.clone()),
        };
        json!({
            "violations": self.violations_json(),
            "checks": {
                "ledger": {"status": "ran"},
                "provider": provider,
                "dead_letters": self.dead_letters,
            },
            "totals": self.totals,
            "notices": {
                "unconfirmed_intents_missing_in_ledger": self.provider.ran()
                    .map(|p| p.violations.drift_count(DriftKind::UnconfirmedIntentMissingInLedger)),
            },
        })
    }
}

/// What to check.
#[derive(Debug, Clone)]
pub struct AuditOptions {
    /// Orders in a non-final state longer than this are stuck, ms.
    pub stuck_after_ms: i64,
    /// Restrict the ledger and provider checks to one event.
    pub event: Option<Uuid>,
    /// The provider and the PaymentIntent window to compare, or why the provider checks do
    /// not run.
    pub provider: Result<(StripeClient, Window), String>,
    /// The broker holding the dead-letter topic, or why the check does not run.
    pub kafka: Result<KafkaConfig, String>,
    /// Bound on reading the dead-letter topic.
    pub dlq_timeout: Duration,
}

/// Runs every check (see the module doc). Errors only when the ledger cannot be read; a
/// provider or broker failure is reported as [`Check::Failed`].
pub async fn run(pool: &PgPool, opts: &AuditOptions) -> anyhow::Result<AuditReport> {
    let ledger = boxoffice_store::audit::violations(pool, opts.stuck_after_ms, opts.event).await?;
    let totals = boxoffice_store::audit::totals(pool, opts.event).await?;
    let provider = match &opts.provider {
        Err(why) => Check::NotChecked(why.clone()),
        Ok((stripe, window)) => match provider_checks(pool, stripe, *window, opts.event).await {
            Ok(f) => Check::Ran(f),
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "provider checks failed");
                Check::Failed(format!("{e:#}"))
            }
        },
    };
    let dead_letters = match &opts.kafka {
        Err(why) => Check::NotChecked(why.clone()),
        Ok(k) => match boxoffice_bus::dlq::list(k, opts.dlq_timeout).await {
            Ok(letters) => Check::Ran(letters.len() as i64),
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "reading the dead-letter topic failed");
                Check::Failed(format!("{e:#}"))
            }
        },
    };
    Ok(AuditReport { ledger, provider, dead_letters, totals })
}

/// Records `report` (a run begun at `started_at` with `opts`) in `audit_runs`; returns the
/// run's id.
///
/// # Errors
/// When the ledger refuses the write.
pub async fn record(
    pool: &PgPool,
    started_at: chrono::DateTime<chrono::Utc>,
    opts: &AuditOptions,
    report: &AuditReport,
) -> Result<i64, sqlx::Error> {
    let json = report.to_json();
    let run = boxoffice_store::operator::NewAuditRun {
        started_at,
        event_id: opts.event,
        violations: report.violations_json(),
        total: report.total(),
        exit_code: report.exit_code(),
        checks: json["checks"].clone(),
        totals: json["totals"].clone(),
    };
    boxoffice_store::operator::record_audit_run(pool, &run).await
}

/// The provider half: one reconciliation scan, then the counts only the provider shows.
async fn provider_checks(
    pool: &PgPool,
    stripe: &StripeClient,
    window: Window,
    event: Option<Uuid>,
) -> anyhow::Result<ProviderFindings> {
    let scan = reconcile::scan(pool, stripe, window, event).await?;
    let now = chrono::Utc::now().timestamp();
    let mut captures_per_order: HashMap<&str, i64> = HashMap::new();
    let mut past_deadline = 0;
    for i in &scan.intents {
        let pi = &i.intent;
        if pi.status == PaymentIntentStatus::Succeeded || pi.amount_received > 0 {
            *captures_per_order.entry(i.order_id().unwrap_or_default()).or_default() += 1;
        }
        if pi.status == PaymentIntentStatus::RequiresCapture {
            let local = scan.ledger.get(&pi.id).is_some_and(|l| l.deadline_passed);
            let provider = i.charge.as_ref().and_then(|c| c.capture_before()).is_some_and(|t| t < now);
            past_deadline += i64::from(local || provider);
        }
    }
    let mut drift: Vec<(DriftKind, i64)> = DriftKind::ALL.iter().map(|k| (*k, 0)).collect();
    for d in &scan.drift {
        if let Some(slot) = drift.iter_mut().find(|(k, _)| *k == d.kind) {
            slot.1 += 1;
        }
    }
    Ok(ProviderFindings {
        window,
        intents_checked: scan.intents.len(),
        violations: ProviderViolations {
            multiple_captures_at_provider: captures_per_order.values().filter(|n| **n > 1).count() as i64,
            uncaptured_past_deadline_at_provider: past_deadline,
            drift,
        },
    })
}

/// The text form: one line per check with its count (or why it was not checked), then
/// what the provider and dead-letter checks covered.
pub fn render(r: &AuditReport) -> String {
    let v = &r.ledger;
    let mut rows: Vec<(String, Option<i64>)> = vec![
        ("oversold seats".into(), Some(v.oversold)),
        ("seats with more than one active hold".into(), Some(v.double_active_holds)),
        ("tickets without captured payment".into(), Some(v.tickets_without_capture)),
        ("captured payments without ticket or refund".into(), Some(v.captured_without_ticket_or_refund)),
        ("valid tickets of a refunded payment".into(), Some(v.tickets_valid_after_refund)),
        ("authorizations past their capture deadline".into(), Some(v.uncaptured_past_deadline)),
        ("orders stuck in a non-final state".into(), Some(v.stuck_orders)),
        ("unpublished outbox rows (older than 5 s)".into(), Some(v.unpublished_outbox)),
        ("pending webhooks with a payment row (older than 30 s)".into(), Some(v.stranded_webhooks)),
        ("unsettled capture claims (older than 60 s)".into(), Some(v.unsettled_capture_claims)),
    ];
    let p = r.provider.ran().map(|p| &p.violations);
    rows.push((
        "orders captured more than once at provider".into(),
        p.map(|p| p.multiple_captures_at_provider),
    ));
    rows.push((
        "provider authorizations past their deadline".into(),
        p.map(|p| p.uncaptured_past_deadline_at_provider),
    ));
    for kind in DriftKind::ALL.into_iter().filter(|k| k.is_violation()) {
        rows.push((format!("drift: {}", kind.name()), p.map(|p| p.drift_count(kind))));
    }
    rows.push(("dead letters".into(), r.dead_letters.ran().copied()));
    let mut out = String::from("invariant checks\n");
    // One column for the counts, however long the longest check's name.
    let width = rows.iter().map(|(name, _)| name.chars().count()).max().unwrap_or(0).max(46);
    for (name, n) in rows {
        let (count, verdict) = match n {
            Some(0) => ("0".to_owned(), "ok"),
            Some(n) => (n.to_string(), "VIOLATION"),
            None => ("-".to_owned(), "not checked"),
        };
        out.push_str(&format!("  {name:<width$} {count:>6}  {verdict}\n"));
    }
    if let Some(n) = p.map(|p| p.drift_count(DriftKind::UnconfirmedIntentMissingInLedger)).filter(|n| *n > 0)
    {
        out.push_str(&format!(
            "  notice: {n} unconfirmed PaymentIntent(s) at the provider the ledger never recorded \
             (no money can move: see `boxoffice reconcile`)\n"
        ));
    }
    out.push_str("  checks: ledger ran");
    match &r.provider {
        Check::Ran(p) => out.push_str(&format!(
            "; provider ran ({} PaymentIntents created since {})",
            p.intents_checked,
            p.window.since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        )),
        Check::NotChecked(why) => out.push_str(&format!("; provider not checked ({why})")),
        Check::Failed(e) => out.push_str(&format!("; provider check FAILED ({e})")),
    }
    match &r.dead_letters {
        Check::Ran(_) => out.push_str("; dead letters ran\n"),
        Check::NotChecked(why) => out.push_str(&format!("; dead letters not checked ({why})\n")),
        Check::Failed(e) => out.push_str(&format!("; dead letters check FAILED ({e})\n")),
    }
    out
}
