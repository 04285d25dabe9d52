//! `boxoffice timeline ORDER_ID`: one order's story as text for an operator (or JSON), from
//! [`boxoffice_api::timeline`]: the order now, each step (one ledger transaction) with who ran
//! it and what it changed, the provider's view of every PaymentIntent, and the steps slower
//! than their SLO. It reads; it never writes and never prints a client secret.

use boxoffice_api::timeline::OrderTimeline;
use boxoffice_store::timeline::{Actor, Step};
use chrono::{DateTime, Utc};
use std::fmt::Write;

/// Renders `t` as the text `boxoffice timeline` prints.
pub fn render(t: &OrderTimeline) -> String {
    let mut out = String::new();
    let o = &t.timeline.order;
    let start = o.created_at;
    let _ = writeln!(out, "order {}  {}{}", o.id, printable(&o.status), reason(&o.failure_reason));
    let _ = writeln!(
        out,
        "  buyer {}  event {}  {} {}  correlation {}",
        o.user_id,
        o.event_id,
        o.amount_minor,
        printable(&o.currency),
        o.correlation_id
    );
    if let (Some(h), Some(s)) = (o.hold_id, &o.hold_status) {
        let until =
            o.hold_expires_at.map(|e| format!(" until {}", e.format("%H:%M:%S%.3f"))).unwrap_or_default();
        let _ = writeln!(out, "  hold {h}  {}{until}", printable(s));
    }
    if let (Some(pi), Some(s)) = (&o.payment_intent_id, &o.payment_status) {
        let _ = writeln!(
            out,
            "  payment {}  {}  captured {}  refunded {}",
            printable(pi),
            printable(s),
            o.amount_captured_minor.unwrap_or(0),
            o.amount_refunded_minor.unwrap_or(0)
        );
    }
    if o.tickets > 0 {
        let _ = writeln!(out, "  tickets {} ({} void)", o.tickets, o.tickets_voided);
    }
    let _ = writeln!(out, "\nsteps (one ledger transaction each; +time since the hold request):");
    for s in &t.timeline.steps {
        step(&mut out, s, start);
    }
    let _ = writeln!(out, "\nprovider:");
    if !t.provider_checked {
        let _ = writeln!(out, "  not asked (no Stripe API base configured, or --skip-provider)");
    } else if t.provider.is_empty() {
        let _ = writeln!(out, "  no PaymentIntent");
    }
    for p in &t.provider {
        match (&p.status, &p.error) {
            (Some(status), _) => {
                let agrees = match p.agrees_with_ledger {
                    Some(true) => "  (ledger agrees)",
                    Some(false) => "  (LEDGER DISAGREES)",
                    None => "  (not the order's current intent)",
                };
                let cancel = p
                    .cancellation_reason
                    .as_deref()
                    .map(|r| format!("  canceled: {}", printable(r)))
                    .unwrap_or_default();
                let _ = writeln!(
                    out,
                    "  {}  {}  amount {}  received {}  capturable {}{cancel}{agrees}",
                    printable(&p.id),
                    printable(status),
                    p.amount.unwrap_or(0),
                    p.amount_received.unwrap_or(0),
                    p.amount_capturable.unwrap_or(0)
                );
            }
            (None, e) => {
                let _ = writeln!(
                    out,
                    "  {}  unreadable: {}",
                    printable(&p.id),
                    e.as_deref().map(printable).unwrap_or_else(|| "?".into())
                );
            }
        }
    }
    let slo = t.timeline.slo;
    let _ = writeln!(
        out,
        "\ngaps (SLO: published within {} ms, applied within {} ms of commit):",
        slo.publish_ms, slo.step_ms
    );
    if t.timeline.gaps.is_empty() {
        let _ = writeln!(out, "  none");
    }
    for g in &t.timeline.gaps {
        let who = g.consumer.as_deref().map(|c| format!(" by {c}")).unwrap_or_default();
        let what = match g.kind {
            "publish" => "published",
            "apply" => "applied",
            _ => "still unpublished after",
        };
        let _ = writeln!(
            out,
            "  SLOW {} {}{who}: {what} {} ms (SLO {} ms)",
            printable(&g.event_type),
            short(&g.event_id.to_string()),
            g.took_ms,
            g.slo_ms
        );
    }
    out
}

fn step(out: &mut String, s: &Step, start: DateTime<Utc>) {
    let actor = match &s.actor {
        Actor::BuyerRequest => "buyer's hold request (api)".to_owned(),
        Actor::Consumer { consumer, applied, applied_type } => {
            format!(
                "{}, applying {} {}",
                printable(consumer),
                printable(applied_type),
                short(&applied.to_string())
            )
        }
        Actor::Webhook { stripe_event_id, r#type } => {
            format!("webhook {} {}", printable(r#type), printable(stripe_event_id))
        }
        Actor::Sweep { wrote } => format!("sweep or operator command ({})", printable(wrote)),
    };
    let _ = writeln!(out, "  {} {:>9}  {actor}", s.at.format("%H:%M:%S%.3f"), offset(start, s.at));
    for tr in &s.transitions {
        let _ = writeln!(
            out,
            "      order {} → {}{}",
            printable(&tr.from),
            printable(&tr.to),
            reason(&tr.reason)
        );
    }
    for w in &s.webhooks {
        let pending = match (w.pending, w.resolved_at) {
            (true, Some(r)) => {
                format!("  (early: waited for the payment row until {})", r.format("%H:%M:%S%.3f"))
            }
            (true, None) => "  (early: waiting for the payment row)".to_owned(),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "      recorded webhook {} {}{pending}",
            printable(&w.r#type),
            printable(&w.stripe_event_id)
        );
    }
    for f in &s.facts {
        let published = match f.published_at {
            Some(p) => format!(
                "published +{} ms{}",
                (p - f.committed_at).num_milliseconds(),
                f.refusal
                    .as_deref()
                    .map(|r| format!(" (parked before: {})", printable(r)))
                    .unwrap_or_default()
            ),
            None => match (f.refused_at, &f.refusal) {
                (Some(at), why) => format!(
                    "NOT PUBLISHED: parked, refused at {} ({}); boxoffice outbox parked",
                    at.format("%H:%M:%S%.3f"),
                    why.as_deref().map(printable).unwrap_or_else(|| "-".into())
                ),
                (None, _) => "NOT PUBLISHED".to_owned(),
            },
        };
        let cause =
            f.causation_id.map(|c| format!(", caused by {}", short(&c.to_string()))).unwrap_or_default();
        let region = match (&f.region, f.region_epoch) {
            (Some(r), Some(e)) => format!(", {} epoch {e}", printable(r)),
            _ => String::new(),
        };
        let trace = f.trace_id.as_deref().map(|t| format!(", trace {t}")).unwrap_or_default();
        let _ = writeln!(
            out,
            "      → {} {}  {}{cause}{region}{trace}  {published}",
            printable(&f.event_type),
            short(&f.event_id.to_string()),
            summary(&f.payload)
        );
        for a in &f.applied_by {
            if a.in_writing_transaction {
                let _ = writeln!(out, "          applied by {} in this transaction", printable(&a.consumer));
            } else {
                let _ = writeln!(
                    out,
                    "          applied by {} +{} ms",
                    printable(&a.consumer),
                    (a.at - f.committed_at).num_milliseconds()
                );
            }
        }
    }
    for i in &s.incidents {
        let _ =
            writeln!(out, "      ! incident {}  {}", printable(&i.kind), printable(&i.detail.to_string()));
    }
}

/// The longest string value (or field name) [`summary`] prints whole, bytes.
const SUMMARY_VALUE_MAX: usize = 120;

/// The most fields of one object [`summary`] prints; the rest are counted.
const SUMMARY_FIELDS_MAX: usize = 16;

/// The payload's telling fields on one line (ids, amounts, statuses, reasons); a nested
/// object's fields as `field.inner=value` (an `OrderConfirmed`'s `capture`), anything deeper
/// by its size. Bounded whatever the payload: at most [`SUMMARY_FIELDS_MAX`] fields per
/// object, strings cut at [`SUMMARY_VALUE_MAX`] bytes, control characters escaped (a
/// payload cannot print lines of its own).
fn summary(payload: &serde_json::Value) -> String {
    let Some(m) = payload.as_object() else { return String::new() };
    let mut parts = Vec::new();
    fields(m, "", &mut parts, |k, v, parts| match v {
        serde_json::Value::Object(inner) => fields(inner, &format!("{k}."), parts, |ik, iv, parts| {
            parts.push(format!("{ik}={}", value(iv)));
        }),
        _ => parts.push(format!("{k}={}", value(v))),
    });
    parts.join(" ")
}

/// Hands the first [`SUMMARY_FIELDS_MAX`] fields of `m` but `order_id` to `each` with their
/// printable names (after `prefix`), and counts the rest.
fn fields(
    m: &serde_json::Map<String, serde_json::Value>,
    prefix: &str,
    parts: &mut Vec<String>,
    each: impl Fn(&str, &serde_json::Value, &mut Vec<String>),
) {
    let shown: Vec<_> = m.iter().filter(|(k, _)| k.as_str() != "order_id").collect();
    for (k, v) in shown.iter().take(SUMMARY_FIELDS_MAX) {
        each(&format!("{prefix}{}", printable(k)), v, parts);
    }
    if shown.len() > SUMMARY_FIELDS_MAX {
        parts.push(format!("{prefix}… ({} more field(s))", shown.len() - SUMMARY_FIELDS_MAX));
    }
}

/// One payload value as [`summary`] prints it: a string printable, an array or object by
/// its size.
fn value(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => printable(s),
        serde_json::Value::Array(a) => format!("[{} item(s)]", a.len()),
        serde_json::Value::Object(o) => format!("{{{} field(s)}}", o.len()),
        other => other.to_string(),
    }
}

/// Whether `c` could move or hide what a terminal shows: a control character, or one of
/// Unicode's invisible format characters (zero-width, bidirectional overrides and isolates,
/// line and paragraph separators, the byte-order mark, the soft hyphen).
fn unsafe_to_print(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{ad}' | '\u{61c}' | '\u{180e}' | '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}'
            | '\u{2060}'..='\u{206f}' | '\u{feff}' | '\u{fff9}'..='\u{fffb}')
}

/// `s` with the characters that could move or hide what a terminal shows escaped (`\n`,
/// `\u{1b}`, `\u{202e}`, …) and, when longer than [`SUMMARY_VALUE_MAX`] bytes (a parked fact
/// is one too large for the bus), by its start and size. Every text the ledger or the
/// provider supplies is printed through it.
fn printable(s: &str) -> String {
    let escaped: String = s
        .chars()
        .take(SUMMARY_VALUE_MAX + 1)
        .flat_map(|c| if unsafe_to_print(c) { c.escape_default().collect() } else { vec![c] })
        .collect();
    if escaped.len() <= SUMMARY_VALUE_MAX {
        return escaped;
    }
    let mut end = SUMMARY_VALUE_MAX;
    while !escaped.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &escaped[..end], s.len())
}

fn reason(r: &Option<String>) -> String {
    r.as_deref().map(|r| format!(" ({})", printable(r))).unwrap_or_default()
}

/// The last 8 characters of an id, how the text timeline names facts: the random end of a
/// UUIDv7 (its first 8 are the creation time, the same for every fact within about a minute).
fn short(id: &str) -> &str {
    id.get(id.len().saturating_sub(8)..).unwrap_or(id)
}

fn offset(start: DateTime<Utc>, at: DateTime<Utc>) -> String {
    let ms = (at - start).num_milliseconds();
    if ms.abs() < 10_000 {
        format!("+{ms} ms")
    } else {
        format!("+{:.1} s", ms as f64 / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn facts_minted_together_have_distinct_short_names() {
        let ids: Vec<String> = (0..100).map(|_| boxoffice_domain::ids::time_ordered().to_string()).collect();
        let short: std::collections::HashSet<&str> = ids.iter().map(|id| super::short(id)).collect();
        assert_eq!(short.len(), ids.len(), "{ids:?}");
        assert_eq!(super::short("0193a1b2-0000-7000-8000-00000000abcd"), "0000abcd");
    }

    #[test]
    fn a_nested_payload_field_is_printed_by_its_parts() {
        let payload = serde_json::json!({
            "order_id": "o",
            "hold_id": "h",
            "capture": { "amount_minor": 18500, "payment_intent_id": "pi_1" },
            "seat_ids": ["a", "b"],
        });
        assert_eq!(
            super::summary(&payload),
            "capture.amount_minor=18500 capture.payment_intent_id=pi_1 hold_id=h seat_ids=[2 item(s)]"
        );
    }

    #[test]
    fn a_hostile_payload_prints_one_bounded_line() {
        let many: serde_json::Map<String, serde_json::Value> =
            (0..5_000).map(|i| (format!("k{i:04}"), serde_json::json!(i))).collect();
        let payload = serde_json::json!({
            "capture": {
                "payment_intent_id": "pi_1\n  19:30:00.000 +1 ms webhook evt_FAKE\u{1b}[2J",
                "deep": { "n": { "n": { "blob": "x".repeat(50_000) } } },
            },
            "reason": "y".repeat(50_000),
            "many": many,
        });
        let line = super::summary(&payload);
        assert!(!line.chars().any(char::is_control), "{line}");
        assert!(line.contains(r"capture.payment_intent_id=pi_1\n  19:30:00.000"), "{line}");
        assert!(line.contains("capture.deep={1 field(s)}"), "{line}");
        assert!(line.contains("many.… (4984 more field(s))"), "{line}");
        assert!(line.contains("… (50000 bytes)"), "{line}");
        assert!(line.len() < 2_000, "{} bytes", line.len());
    }

    /// What the ledger supplies besides a payload (a fact's type, its refusal and region, an
    /// incident's kind and detail) is printed escaped and bounded too: no forged line, no
    /// terminal sequence, no hidden bidirectional text.
    #[test]
    fn a_steps_ledger_text_cannot_forge_lines() {
        use boxoffice_store::timeline::{Actor, Fact, Incident, Step};
        let now = chrono::Utc::now();
        let evil = "Evil\u{1b}[31mRED\nFAKE: order ticketed\u{202e}\u{2028}";
        let fact = Fact {
            event_id: uuid::Uuid::nil(),
            event_type: evil.into(),
            committed_at: now,
            published_at: None,
            refused_at: Some(now),
            refusal: Some(evil.into()),
            causation_id: None,
            region: Some(evil.into()),
            region_epoch: Some(1),
            trace_id: None,
            payload: serde_json::json!({ "unreadable_envelope": evil }),
            applied_by: vec![],
            source: "outbox",
        };
        let deep = format!("{}{}", "[".repeat(100), "]".repeat(100));
        let step = Step {
            at: now,
            xact: "1".into(),
            actor: Actor::Sweep { wrote: evil.into() },
            transitions: vec![],
            facts: vec![fact],
            webhooks: vec![],
            incidents: vec![Incident {
                kind: evil.into(),
                detail: serde_json::json!({ "why": "z".repeat(1_000_000), "deep": serde_json::from_str::<serde_json::Value>(&deep).unwrap() }),
                at: now,
            }],
        };
        let mut out = String::new();
        super::step(&mut out, &step, now);
        assert_eq!(out.lines().count(), 3, "{out}");
        assert!(!out.chars().filter(|c| *c != '\n').any(super::unsafe_to_print), "{out}");
        assert!(out.contains(r"Evil\u{1b}[31mRED\nFAKE: order ticketed\u{202e}\u{2028}"), "{out}");
        assert!(out.len() < 4_000, "{} bytes", out.len());
    }
}
