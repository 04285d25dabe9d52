//! One order's story (design §16, "the business timeline"): every fact it produced, every
//! status change, every webhook and incident, grouped into the transactions that made them
//! and put in causal order, with each step's actor and the steps slower than their SLO.
//!
//! It owns no rule of the purchase path and writes nothing: it reads what the ledger already
//! keeps, by the order's id, through indexes only —
//! - facts: the outbox (recent) and `order_history` (what the relay's prune moved there);
//! - consumption: `inbox` rows of those facts (kept `inbox_retention_s`, 7 days by default);
//! - status changes: `order_transitions` (a row trigger on `orders`, migration 0015);
//! - webhooks: `stripe_events`; compensations and drift: `incidents`.
//!
//! **Steps.** Every one of those rows carries the id of the transaction that wrote it
//! (`xact`, `pg_current_xact_id()`). Rows of one transaction are one step; its actor is
//! exact, not guessed: the consumer whose inbox row is in that transaction (and the fact it
//! applied; the inbox rows of consumers that followed the transaction's own facts through
//! in it, `boxoffice_bus::follow`, mark those facts as applied in the writing transaction and
//! name no actor), else the webhook recorded in it, else the buyer's hold request (the step that
//! wrote `HoldCreated`), else a sweep or operator command (expiry, `reconcile --fix`,
//! `tickets resell`) named by what it wrote.
//!
//! **Gaps.** A fact published later than [`Slo::publish_ms`] after its commit, a step that
//! applied a fact later than [`Slo::step_ms`] after that fact was committed, and a fact still
//! unpublished after `publish_ms` are marked. The buyer's own time (between the PaymentIntent
//! and the authorization) is no step of ours and is never marked.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use std::collections::{BTreeMap, HashMap};
use uuid::Uuid;

/// The SLOs a timeline marks gaps against, in milliseconds.
#[derive(Debug, Clone, Copy, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Slo {
    /// Commit → published on the bus (the relay); default 1,000.
    pub publish_ms: i64,
    /// A fact's commit → the step that applied it (relay + bus + consumer, remote calls
    /// included); default 2,000.
    pub step_ms: i64,
}

impl Default for Slo {
    fn default() -> Self {
        Self { publish_ms: 1_000, step_ms: 2_000 }
    }
}

/// The order as it stands now.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OrderNow {
    /// Order id.
    pub id: Uuid,
    /// The buyer.
    pub user_id: Uuid,
    /// The event.
    pub event_id: Uuid,
    /// `orders.status`.
    pub status: String,
    /// Why it failed, expired, was canceled or refunded.
    pub failure_reason: Option<String>,
    /// Amount in minor units.
    pub amount_minor: i64,
    /// ISO currency.
    pub currency: String,
    /// The buyer journey's correlation id.
    pub correlation_id: Uuid,
    /// When the hold request created it.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// The hold's id.
    pub hold_id: Option<Uuid>,
    /// The hold's status.
    pub hold_status: Option<String>,
    /// When the hold lapses (or lapsed).
    pub hold_expires_at: Option<DateTime<Utc>>,
    /// The order's current PaymentIntent.
    pub payment_intent_id: Option<String>,
    /// The ledger's view of that PaymentIntent's status.
    pub payment_status: Option<String>,
    /// Captured, minor units.
    pub amount_captured_minor: Option<i64>,
    /// Refunded, minor units.
    pub amount_refunded_minor: Option<i64>,
    /// Tickets issued (voided ones included).
    pub tickets: i64,
    /// Of which voided.
    pub tickets_voided: i64,
}

/// One fact of the order.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Fact {
    /// The envelope's `event_id`.
    pub event_id: Uuid,
    /// `HoldCreated`, `PaymentAuthorized`, …
    pub event_type: String,
    /// Commit time (the outbox row's `created_at`).
    pub committed_at: DateTime<Utc>,
    /// When the relay published it (`None`: not yet).
    pub published_at: Option<DateTime<Utc>>,
    /// When the producer last refused it, if it is parked (unpublished; the order's other
    /// facts wait with it: `boxoffice outbox parked`); cleared once it is published.
    pub refused_at: Option<DateTime<Utc>>,
    /// The producer's last error for it, kept once it is published.
    pub refusal: Option<String>,
    /// The fact that caused it (`None`: a request, a webhook or a sweep).
    pub causation_id: Option<Uuid>,
    /// The region and epoch whose ledger committed it.
    pub region: Option<String>,
    /// See `region`.
    pub region_epoch: Option<i64>,
    /// The W3C trace id of the span that committed it, when tracing was on.
    pub trace_id: Option<String>,
    /// The type-specific payload (ids, amounts, reasons; never a client secret).
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub payload: serde_json::Value,
    /// Each consumer that applied it, and when.
    pub applied_by: Vec<Applied>,
    /// `outbox` or `order_history`.
    pub source: &'static str,
}

/// A consumer's application of a fact (its inbox row).
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Applied {
    /// `saga`, `payments`, `tickets`.
    pub consumer: String,
    /// When its transaction began.
    pub at: DateTime<Utc>,
    /// Whether it applied the fact in the very transaction that committed it, following it
    /// through (`boxoffice_bus::follow`): then `at` is that transaction's start, before the
    /// fact's commit, and the step is the writer's.
    pub in_writing_transaction: bool,
}

/// A status change of the order.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Transition {
    /// Status before.
    pub from: String,
    /// Status after.
    pub to: String,
    /// The failure reason set by this change, if any.
    pub reason: Option<String>,
    /// When.
    pub at: DateTime<Utc>,
}

/// A webhook recorded for the order.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Webhook {
    /// Stripe's `evt_…` id.
    pub stripe_event_id: String,
    /// Stripe's event type.
    pub r#type: String,
    /// The PaymentIntent it names.
    pub payment_intent_id: Option<String>,
    /// When it arrived.
    pub received_at: DateTime<Utc>,
    /// Whether it waited for the payment row, and when that resolved it.
    pub pending: bool,
    /// See `pending`.
    pub resolved_at: Option<DateTime<Utc>>,
}

/// An incident recorded for the order (money moved without a fulfilment, drift, …).
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Incident {
    /// e.g. `lost_order_compensated`, `capture_after_release`.
    pub kind: String,
    /// Its detail.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub detail: serde_json::Value,
    /// When.
    pub at: DateTime<Utc>,
}

/// Who ran a step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Actor {
    /// The buyer's hold request (the API).
    BuyerRequest,
    /// A consumer applying a fact.
    Consumer {
        /// The consumer (`saga`, `payments`, `tickets`).
        consumer: String,
        /// The fact it applied.
        applied: Uuid,
        /// That fact's type.
        applied_type: String,
    },
    /// Webhook ingress recording a Stripe event.
    Webhook {
        /// Stripe's `evt_…` id.
        stripe_event_id: String,
        /// Stripe's event type.
        r#type: String,
    },
    /// A sweep or an operator command (hold expiry, `reconcile --fix`, `tickets resell`).
    Sweep {
        /// What it wrote, e.g. `HoldExpired`.
        wrote: String,
    },
}

/// One transaction's part in the story.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Step {
    /// When it began (its earliest row).
    pub at: DateTime<Utc>,
    /// The transaction id (`xid8` as text).
    pub xact: String,
    /// Who ran it.
    pub actor: Actor,
    /// Its status changes.
    pub transitions: Vec<Transition>,
    /// The facts it committed.
    pub facts: Vec<Fact>,
    /// The webhooks it recorded.
    pub webhooks: Vec<Webhook>,
    /// The incidents it recorded.
    pub incidents: Vec<Incident>,
}

/// A step slower than its SLO.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Gap {
    /// `publish` (commit → bus), `apply` (commit → applied by a consumer) or `unpublished`.
    pub kind: &'static str,
    /// The fact concerned.
    pub event_id: Uuid,
    /// Its type.
    pub event_type: String,
    /// The consumer, for `apply`.
    pub consumer: Option<String>,
    /// How long it took (or has waited), ms.
    pub took_ms: i64,
    /// The SLO it missed, ms.
    pub slo_ms: i64,
}

/// The whole story.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Timeline {
    /// The order now.
    pub order: OrderNow,
    /// Its steps, in causal order.
    pub steps: Vec<Step>,
    /// The steps slower than their SLO.
    pub gaps: Vec<Gap>,
    /// The SLOs used.
    pub slo: Slo,
    /// Every PaymentIntent the facts name (the current one first).
    pub payment_intents: Vec<String>,
}

#[derive(sqlx::FromRow)]
struct FactRow {
    id: Uuid,
    event_type: String,
    /// The stored envelope as text, parsed here: a row nested deeper than the JSON parser
    /// reads (one the relay parks as unreadable) is shown as such, not an error.
    payload: String,
    created_at: DateTime<Utc>,
    published_at: Option<DateTime<Utc>>,
    refused_at: Option<DateTime<Utc>>,
    refusal: Option<String>,
    region: Option<String>,
    region_epoch: Option<i64>,
    traceparent: Option<String>,
    xact: Option<String>,
    source: String,
}

/// Reads order `order`'s timeline; `None` when the ledger has no such order. `consumers`
/// are the inbox consumer names to look up (the inbox is keyed by consumer first).
///
/// # Errors
/// Database errors.
#[allow(clippy::type_complexity)]
pub async fn read(
    pool: &PgPool,
    order: Uuid,
    consumers: &[&str],
    slo: Slo,
) -> Result<Option<Timeline>, sqlx::Error> {
    let now: Option<OrderNow> = sqlx::query_as(
        "SELECT o.id, o.user_id, o.event_id, o.status, o.failure_reason, o.amount_minor, o.currency,
                o.correlation_id, o.created_at, o.updated_at,
                h.id AS hold_id, h.status AS hold_status, h.expires_at AS hold_expires_at,
                p.payment_intent_id, p.status AS payment_status, p.amount_captured_minor,
                p.amount_refunded_minor,
                (SELECT count(*) FROM tickets t WHERE t.order_id = o.id) AS tickets,
                (SELECT count(*) FROM tickets t WHERE t.order_id = o.id AND t.voided_at IS NOT NULL) AS tickets_voided
           FROM orders o
           LEFT JOIN holds h ON h.order_id = o.id
           LEFT JOIN payments p ON p.order_id = o.id
          WHERE o.id = $1",
    )
    .bind(order)
    .fetch_optional(pool)
    .await?;
    let Some(now) = now else { return Ok(None) };
    let facts: Vec<FactRow> = sqlx::query_as(
        "SELECT id, event_type, payload::text AS payload, created_at, published_at, refused_at, refusal,
                region, region_epoch, traceparent, xact::text AS xact, 'outbox' AS source
           FROM outbox WHERE message_key = $1::text
         UNION ALL
         SELECT event_id, event_type, payload::text, created_at, published_at, NULL, NULL, region, region_epoch,
                traceparent, xact::text, 'order_history'
           FROM order_history WHERE order_id = $1
          ORDER BY created_at",
    )
    .bind(order)
    .fetch_all(pool)
    .await?;
    let ids: Vec<Uuid> = facts.iter().map(|f| f.id).collect();
    let inbox: Vec<(String, Uuid, DateTime<Utc>, Option<String>)> = sqlx::query_as(
        "SELECT consumer, event_id, processed_at, xact::text FROM inbox
          WHERE consumer = ANY($1) AND event_id = ANY($2)",
    )
    .bind(consumers)
    .bind(&ids)
    .fetch_all(pool)
    .await?;
    let transitions: Vec<(String, String, Option<String>, DateTime<Utc>, String)> = sqlx::query_as(
        "SELECT from_status, to_status, reason, at, xact::text FROM order_transitions
          WHERE order_id = $1 ORDER BY at",
    )
    .bind(order)
    .fetch_all(pool)
    .await?;
    let webhooks: Vec<(
        String,
        String,
        Option<String>,
        DateTime<Utc>,
        bool,
        Option<DateTime<Utc>>,
        Option<String>,
    )> = sqlx::query_as(
        "SELECT stripe_event_id, type, payment_intent_id, received_at, pending, resolved_at, xact::text
               FROM stripe_events WHERE order_id = $1 ORDER BY received_at",
    )
    .bind(order)
    .fetch_all(pool)
    .await?;
    // The detail as text, parsed here, as the facts' envelopes are.
    let incidents: Vec<(String, String, DateTime<Utc>, Option<String>)> =
        sqlx::query_as(
            "SELECT kind, detail::text, created_at, xact::text FROM incidents WHERE order_id = $1 ORDER BY created_at",
        )
        .bind(order)
        .fetch_all(pool)
        .await?;

    let mut applied: HashMap<Uuid, Vec<Applied>> = HashMap::new();
    let mut steps: BTreeMap<String, StepBuilder> = BTreeMap::new();
    let type_of: HashMap<Uuid, (String, Option<String>)> =
        facts.iter().map(|f| (f.id, (f.event_type.clone(), f.xact.clone()))).collect();
    for (consumer, event_id, at, xact) in &inbox {
        let (event_type, fact_xact) = &type_of[event_id];
        // A fact applied in the transaction that wrote it was followed through: the step is
        // the writer's, and its actor the consumer that applied a fact committed before it.
        let followed = xact.is_some() && fact_xact == xact;
        applied.entry(*event_id).or_default().push(Applied {
            consumer: consumer.clone(),
            at: *at,
            in_writing_transaction: followed,
        });
        let s = steps.entry(xact_key(xact, "inbox", event_id)).or_default();
        s.touch(*at);
        if !followed {
            s.consumer.get_or_insert((consumer.clone(), *event_id, event_type.clone()));
        }
    }
    let mut all_facts = Vec::with_capacity(facts.len());
    for f in facts {
        let payload: serde_json::Value = serde_json::from_str(&f.payload)
            .unwrap_or_else(|e| serde_json::json!({ "payload": { "unreadable_envelope": e.to_string() } }));
        let inner = payload.get("payload").cloned().unwrap_or(serde_json::Value::Null);
        let causation_id =
            payload.get("causation_id").and_then(|v| v.as_str()).and_then(|s| s.parse::<Uuid>().ok());
        let mut applied_by = applied.remove(&f.id).unwrap_or_default();
        applied_by.sort_by_key(|a| a.at);
        let fact = Fact {
            event_id: f.id,
            event_type: f.event_type,
            committed_at: f.created_at,
            published_at: f.published_at,
            refused_at: f.refused_at,
            refusal: f.refusal,
            causation_id,
            region: f.region,
            region_epoch: f.region_epoch,
            trace_id: f.traceparent.as_deref().and_then(trace_id_of),
            payload: inner,
            applied_by,
            source: if f.source == "outbox" { "outbox" } else { "order_history" },
        };
        all_facts.push(fact.clone());
        let s = steps.entry(xact_key(&f.xact, "fact", &f.id)).or_default();
        s.touch(fact.committed_at);
        s.facts.push(fact);
    }
    for (i, (from, to, reason, at, xact)) in transitions.into_iter().enumerate() {
        let s = steps.entry(xact_key(&Some(xact), "transition", &i)).or_default();
        s.touch(at);
        s.transitions.push(Transition { from, to, reason, at });
    }
    for (stripe_event_id, r#type, payment_intent_id, received_at, pending, resolved_at, xact) in webhooks {
        let s = steps.entry(xact_key(&xact, "webhook", &stripe_event_id)).or_default();
        s.touch(received_at);
        s.webhooks.push(Webhook {
            stripe_event_id,
            r#type,
            payment_intent_id,
            received_at,
            pending,
            resolved_at,
        });
    }
    for (i, (kind, detail, at, xact)) in incidents.into_iter().enumerate() {
        let s = steps.entry(xact_key(&xact, "incident", &i)).or_default();
        s.touch(at);
        let detail = serde_json::from_str(&detail)
            .unwrap_or_else(|e| serde_json::json!({ "unreadable_detail": e.to_string() }));
        s.incidents.push(Incident { kind, detail, at });
    }
    let mut steps: Vec<Step> = steps.into_iter().filter_map(|(xact, b)| b.build(xact)).collect();
    order_causally(&mut steps);
    let gaps = gaps(&steps, &all_facts, slo, Utc::now());
    let mut payment_intents: Vec<String> = now.payment_intent_id.iter().cloned().collect();
    for f in &all_facts {
        if let Some(pi) = named_intent(f) {
            if !payment_intents.contains(&pi) {
                payment_intents.push(pi);
            }
        }
    }
    Ok(Some(Timeline { order: now, steps, gaps, slo, payment_intents }))
}

/// The PaymentIntent fact `f` names, as the payment worker reads it
/// ([`boxoffice_domain::PurchaseEvent::payment_intent_id`]: an `OrderConfirmed` names the one
/// it asks to capture); for a fact this build cannot decode, its payload's
/// `payment_intent_id`.
fn named_intent(f: &Fact) -> Option<String> {
    let typed = serde_json::json!({ "event_type": f.event_type, "payload": f.payload });
    match serde_json::from_value::<boxoffice_domain::PurchaseEvent>(typed) {
        Ok(event) => event.payment_intent_id().map(str::to_owned),
        Err(_) => f.payload.get("payment_intent_id").and_then(|v| v.as_str()).map(str::to_owned),
    }
}

/// A step's key: its transaction, or (rows written before transactions were recorded) a key
/// of the row's own.
fn xact_key(xact: &Option<String>, kind: &str, id: &dyn std::fmt::Display) -> String {
    match xact {
        Some(x) => format!("{x:0>20}"),
        None => format!("~{kind}:{id}"),
    }
}

#[derive(Default)]
struct StepBuilder {
    at: Option<DateTime<Utc>>,
    consumer: Option<(String, Uuid, String)>,
    transitions: Vec<Transition>,
    facts: Vec<Fact>,
    webhooks: Vec<Webhook>,
    incidents: Vec<Incident>,
}

impl StepBuilder {
    fn touch(&mut self, at: DateTime<Utc>) {
        self.at = Some(self.at.map_or(at, |a| a.min(at)));
    }

    fn build(mut self, xact: String) -> Option<Step> {
        let at = self.at?;
        let actor = if let Some((consumer, applied, applied_type)) = self.consumer.take() {
            Actor::Consumer { consumer, applied, applied_type }
        } else if let Some(w) = self.webhooks.first() {
            Actor::Webhook { stripe_event_id: w.stripe_event_id.clone(), r#type: w.r#type.clone() }
        } else if self.facts.iter().any(|f| f.event_type == "HoldCreated") {
            Actor::BuyerRequest
        } else {
            let wrote = self
                .facts
                .first()
                .map(|f| f.event_type.clone())
                .or_else(|| self.transitions.first().map(|t| format!("order → {}", t.to)))
                .or_else(|| self.incidents.first().map(|i| format!("incident {}", i.kind)))
                .unwrap_or_default();
            Actor::Sweep { wrote }
        };
        self.facts.sort_by_key(|f| f.committed_at);
        let xact =
            if xact.starts_with('~') { String::new() } else { xact.trim_start_matches('0').to_owned() };
        Some(Step {
            at,
            xact,
            actor,
            transitions: self.transitions,
            facts: self.facts,
            webhooks: self.webhooks,
            incidents: self.incidents,
        })
    }
}

/// Sorts steps by time, then moves any step that applied a fact after the step that wrote
/// it (clocks of two regions' ledgers may disagree; causation may not).
fn order_causally(steps: &mut Vec<Step>) {
    steps.sort_by_key(|s| s.at);
    let mut ordered: Vec<Step> = Vec::with_capacity(steps.len());
    let mut waiting: Vec<Step> = Vec::new();
    let written =
        |ordered: &[Step], id: Uuid| ordered.iter().any(|s| s.facts.iter().any(|f| f.event_id == id));
    let writes_anything =
        |all: &[Step], id: Uuid| all.iter().any(|s| s.facts.iter().any(|f| f.event_id == id));
    let all = steps.clone();
    for s in steps.drain(..) {
        let blocked = match &s.actor {
            Actor::Consumer { applied, .. } => {
                writes_anything(&all, *applied) && !written(&ordered, *applied)
            }
            _ => false,
        };
        if blocked {
            waiting.push(s);
            continue;
        }
        ordered.push(s);
        while let Some(i) = waiting.iter().position(|w| match &w.actor {
            Actor::Consumer { applied, .. } => written(&ordered, *applied),
            _ => true,
        }) {
            ordered.push(waiting.remove(i));
        }
    }
    ordered.extend(waiting);
    *steps = ordered;
}

/// The steps slower than `slo`, as of `now`.
fn gaps(steps: &[Step], facts: &[Fact], slo: Slo, now: DateTime<Utc>) -> Vec<Gap> {
    let mut out = Vec::new();
    let ms = |a: DateTime<Utc>, b: DateTime<Utc>| (b - a).num_milliseconds();
    for f in facts {
        match f.published_at {
            Some(p) if ms(f.committed_at, p) > slo.publish_ms => out.push(Gap {
                kind: "publish",
                event_id: f.event_id,
                event_type: f.event_type.clone(),
                consumer: None,
                took_ms: ms(f.committed_at, p),
                slo_ms: slo.publish_ms,
            }),
            None if ms(f.committed_at, now) > slo.publish_ms => out.push(Gap {
                kind: "unpublished",
                event_id: f.event_id,
                event_type: f.event_type.clone(),
                consumer: None,
                took_ms: ms(f.committed_at, now),
                slo_ms: slo.publish_ms,
            }),
            _ => {}
        }
    }
    for s in steps {
        if let Actor::Consumer { consumer, applied, applied_type } = &s.actor {
            if let Some(f) = facts.iter().find(|f| f.event_id == *applied) {
                let took = ms(f.committed_at, s.at);
                if took > slo.step_ms {
                    out.push(Gap {
                        kind: "apply",
                        event_id: *applied,
                        event_type: applied_type.clone(),
                        consumer: Some(consumer.clone()),
                        took_ms: took,
                        slo_ms: slo.step_ms,
                    });
                }
            }
        }
    }
    out
}

/// The trace id of a W3C `traceparent` (`00-{trace id}-{span id}-{flags}`).
fn trace_id_of(traceparent: &str) -> Option<String> {
    let mut parts = traceparent.split('-');
    let (_version, trace) = (parts.next()?, parts.next()?);
    (trace.len() == 32 && trace.bytes().all(|b| b.is_ascii_hexdigit())).then(|| trace.to_owned())
}

/// Deletes up to `limit` rows each of the order history, of the status changes and of the
/// webhook events recorded with an order id, older than `retention_s` seconds (the webhook
/// events: older than that and than [`crate::stripe_events::MIN_UNCLAIMED_RETENTION_S`],
/// Stripe's redelivery window with a margin, since an event's row is what makes its
/// redelivery a duplicate). Returns how many rows went. Each reads only the rows it deletes,
/// through `order_history_created_idx`, `order_transitions_at_idx` and
/// `stripe_events_ordered_idx` (migration 0031; aged by `now()`, which an index can take;
/// see "Periodic sweeps" in the crate docs). Webhook events without an order id have their
/// own, shorter retention ([`crate::stripe_events::prune_unclaimed`]).
///
/// # Errors
/// Database errors.
pub async fn prune(pool: &PgPool, retention_s: i64, limit: i64) -> Result<u64, sqlx::Error> {
    let mut n = sqlx::query(
        "DELETE FROM stripe_events WHERE ctid = ANY (ARRAY(
            SELECT ctid FROM stripe_events
             WHERE order_id IS NOT NULL AND received_at < now() - make_interval(secs => $1::double precision)
             ORDER BY received_at LIMIT $2))",
    )
    .bind(retention_s.max(crate::stripe_events::MIN_UNCLAIMED_RETENTION_S) as f64)
    .bind(limit)
    .execute(pool)
    .await?
    .rows_affected();
    for sql in [
        "DELETE FROM order_history WHERE ctid = ANY (ARRAY(
            SELECT ctid FROM order_history
             WHERE created_at < now() - make_interval(secs => $1::double precision)
             ORDER BY created_at LIMIT $2))",
        "DELETE FROM order_transitions WHERE ctid = ANY (ARRAY(
            SELECT ctid FROM order_transitions
             WHERE at < now() - make_interval(secs => $1::double precision)
             ORDER BY at LIMIT $2))",
    ] {
        n += sqlx::query(sql).bind(retention_s as f64).bind(limit).execute(pool).await?.rows_affected();
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fact(id: u128, t: &str, at_ms: i64, published_ms: Option<i64>) -> Fact {
        let base = DateTime::<Utc>::from_timestamp(1_700_000_000, 0).unwrap();
        Fact {
            event_id: Uuid::from_u128(id),
            event_type: t.into(),
            committed_at: base + chrono::Duration::milliseconds(at_ms),
            published_at: published_ms.map(|p| base + chrono::Duration::milliseconds(p)),
            refused_at: None,
            refusal: None,
            causation_id: None,
            region: None,
            region_epoch: None,
            trace_id: None,
            payload: serde_json::Value::Null,
            applied_by: vec![],
            source: "outbox",
        }
    }

    #[test]
    fn the_intent_a_capture_request_names_is_one_the_provider_section_reads() {
        let mut confirmed = fact(1, "OrderConfirmed", 0, None);
        confirmed.payload = serde_json::json!({
            "order_id": Uuid::from_u128(7), "hold_id": Uuid::from_u128(8),
            "capture": { "payment_intent_id": "pi_captured", "amount_minor": 100 },
        });
        assert_eq!(named_intent(&confirmed).as_deref(), Some("pi_captured"));
        confirmed.payload["capture"] = serde_json::Value::Null;
        assert_eq!(named_intent(&confirmed), None, "not a request: names none");
        // A fact this build cannot read: its payload's top-level field.
        let mut unknown = fact(2, "SomethingNewer", 0, None);
        unknown.payload = serde_json::json!({ "payment_intent_id": "pi_newer" });
        assert_eq!(named_intent(&unknown).as_deref(), Some("pi_newer"));
    }

    fn step(at_ms: i64, actor: Actor, facts: Vec<Fact>) -> Step {
        let base = DateTime::<Utc>::from_timestamp(1_700_000_000, 0).unwrap();
        Step {
            at: base + chrono::Duration::milliseconds(at_ms),
            xact: String::new(),
            actor,
            transitions: vec![],
            facts,
            webhooks: vec![],
            incidents: vec![],
        }
    }

    #[test]
    fn a_step_comes_after_the_step_that_wrote_what_it_applied_whatever_the_clocks_say() {
        let hold = fact(1, "HoldCreated", 100, Some(120));
        let applied = Actor::Consumer {
            consumer: "payments".into(),
            applied: hold.event_id,
            applied_type: "HoldCreated".into(),
        };
        // The consumer's clock runs 50 ms behind the writer's.
        let mut steps = vec![step(100, Actor::BuyerRequest, vec![hold]), step(50, applied.clone(), vec![])];
        order_causally(&mut steps);
        assert_eq!(steps[0].actor, Actor::BuyerRequest);
        assert_eq!(steps[1].actor, applied);
    }

    #[test]
    fn slow_publishing_slow_applying_and_unpublished_facts_are_gaps_and_the_buyers_time_is_not() {
        let slo = Slo::default();
        let quick = fact(1, "HoldCreated", 0, Some(50));
        let slow = fact(2, "PaymentIntentCreated", 2_500, Some(4_000));
        let stuck = fact(3, "CaptureRequested", 60_000, None);
        let now = quick.committed_at + chrono::Duration::milliseconds(65_000);
        let consumer = |c: &str, f: &Fact| Actor::Consumer {
            consumer: c.into(),
            applied: f.event_id,
            applied_type: f.event_type.clone(),
        };
        let steps = vec![
            step(0, Actor::BuyerRequest, vec![quick.clone()]),
            // 2.5 s after the hold committed: over the 2 s step SLO.
            step(2_500, consumer("payments", &quick), vec![slow.clone()]),
            // 1.6 s after its commit: within the SLO.
            step(4_100, consumer("saga", &slow), vec![]),
            // 46 s of the buyer's own time, then the webhook: no step of ours, no gap.
            step(
                50_000,
                Actor::Webhook { stripe_event_id: "evt_1".into(), r#type: "x".into() },
                vec![stuck.clone()],
            ),
        ];
        let g = gaps(&steps, &[quick.clone(), slow.clone(), stuck.clone()], slo, now);
        let kinds: Vec<(&str, Uuid)> = g.iter().map(|g| (g.kind, g.event_id)).collect();
        assert_eq!(
            kinds,
            [("publish", slow.event_id), ("unpublished", stuck.event_id), ("apply", quick.event_id)]
        );
        assert_eq!(g[0].took_ms, 1_500);
        assert_eq!(g[1].took_ms, 5_000);
        assert_eq!(g[2].consumer.as_deref(), Some("payments"));
    }

    #[test]
    fn a_traceparent_gives_its_trace_id_and_junk_gives_none() {
        assert_eq!(
            trace_id_of("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        assert_eq!(trace_id_of("junk"), None);
        assert_eq!(trace_id_of("00-xyz-1-01"), None);
    }
}
