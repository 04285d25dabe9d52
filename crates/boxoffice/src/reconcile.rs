//! Reconciliation of the ledger with the payment provider (`boxoffice reconcile`, and the
//! provider half of `boxoffice audit`).
//!
//! Owns the comparison of each Stripe PaymentIntent in a time window with the local
//! `payments` row: status, amount, amount captured, amount refunded, and rows missing on
//! either side. Each difference is a [`Drift`] naming what the provider says, what the ledger
//! says, and the domain fact that would close it. With `--fix`, those facts are written to
//! the outbox, one transaction per PaymentIntent, and the saga applies them like any other
//! fact; it is state-driven and idempotent (design §9), so a fact emitted twice, or racing
//! the webhook that reports the same thing, changes nothing the second time. `--fix` also
//! resolves early webhooks left pending beside their payment row, of any age, and asks for
//! their re-fetch (`stripe_events::resolve_stranded`), which the expiry worker does only
//! for the last hour's.
//!
//! Invariant protected: the ledger never keeps believing something about money that the
//! provider contradicts (invariant 6: a capture, cancel or refund the ledger missed is found
//! and fed back into the saga). Reconciliation never calls a mutating Stripe endpoint
//! itself: compensations (cancel, refund) stay the saga's and the payment worker's job.
//!
//! Both sides are read as snapshots, without locks, so on a live system a PaymentIntent
//! that changed a moment ago can show as drift until its webhook is applied; running again
//! shows whether it persists. Failure: a provider or database error aborts the scan.

use anyhow::Context;
use boxoffice_domain::{Envelope, OrderId, OrderStatus, PaymentIntentStatus, PurchaseEvent};
use boxoffice_payments::{CreatedWindow, IntentWithCharge, StripeClient};
use boxoffice_store::payments::{self as ledger, LedgerPayment};
use chrono::{DateTime, TimeZone, Utc};
use futures::StreamExt;
use serde::Serialize;
use sqlx::PgPool;
use std::collections::{BTreeMap, HashMap, HashSet};
use uuid::Uuid;

/// Concurrent single-intent lookups for ledger rows the window listing did not return.
const RETRIEVE_CONCURRENCY: usize = 8;

/// The PaymentIntent creation times compared, both ends inclusive (Stripe's `created` has
/// one-second resolution).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Window {
    /// Oldest creation time included.
    pub since: DateTime<Utc>,
    /// Newest creation time included; `None` means up to now.
    pub until: Option<DateTime<Utc>>,
}

impl Window {
    /// The window from `since` (and `until`) given as RFC 3339 timestamps or as durations
    /// before `now` (see [`parse_instant`]). Errors when either does not parse or `until`
    /// is before `since`.
    pub fn parse(since: &str, until: Option<&str>, now: DateTime<Utc>) -> anyhow::Result<Self> {
        let since = parse_instant(since, now).context("--since")?;
        let until = until.map(|u| parse_instant(u, now).context("--until")).transpose()?;
        if let Some(u) = until {
            anyhow::ensure!(u >= since, "--until ({u}) is before --since ({since})");
        }
        Ok(Self { since, until })
    }

    /// Stripe's `created[gte]` / `created[lte]` for this window, unix seconds.
    pub fn created(&self) -> CreatedWindow {
        CreatedWindow { gte: Some(self.since.timestamp()), lte: self.until.map(|u| u.timestamp()) }
    }
}

/// An instant given as an RFC 3339 timestamp (`2025-03-01T12:00:00Z`) or as a duration before
/// `now`: whole numbers with units `s`, `m`, `h`, `d`, `w`, combinable (`90s`, `2h`, `1h30m`,
/// `7d`). Errors name the accepted forms.
pub fn parse_instant(s: &str, now: DateTime<Utc>) -> anyhow::Result<DateTime<Utc>> {
    let s = s.trim();
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    let ago = parse_duration(s).with_context(|| {
        format!("{s:?} is neither an RFC 3339 timestamp nor a duration like 90s, 15m, 2h, 1h30m, 7d")
    })?;
    Ok(now - ago)
}

/// `90s`, `15m`, `2h`, `1h30m`, `7d`, `2w`; `None` for anything else or a zero total.
fn parse_duration(s: &str) -> Option<chrono::Duration> {
    let mut total: i64 = 0;
    let mut digits = String::new();
    for c in s.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit: i64 = match c {
            's' => 1,
            'm' => 60,
            'h' => 3_600,
            'd' => 86_400,
            'w' => 7 * 86_400,
            _ => return None,
        };
        let n: i64 = std::mem::take(&mut digits).parse().ok()?;
        total = total.checked_add(n.checked_mul(unit)?)?;
    }
    if !digits.is_empty() || total <= 0 {
        return None;
    }
    chrono::Duration::try_seconds(total)
}

/// The kinds of provider/ledger drift, a small closed set. `*_not_in_ledger` kinds have a
/// fact that closes them, and so does a stray authorization
/// ([`DriftKind::IntentMissingInLedger`], [`stray_authorization`]); the others need an
/// operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DriftKind {
    /// The provider has a PaymentIntent naming one of our orders (`metadata.order_id`) that
    /// holds or held money (`requires_capture`, `processing`, `succeeded`) and the ledger has
    /// no payment row for it (an extra intent, or a lost row). Closed by `PaymentAuthorized`,
    /// which the saga answers with a cancel, when the intent is authorized and its order's
    /// payment row records another PaymentIntent ([`stray_authorization`]); otherwise no fact
    /// closes it.
    IntentMissingInLedger,
    /// The provider has a PaymentIntent naming one of our orders that never moved money
    /// (`requires_payment_method`, `requires_confirmation`, `requires_action`) and the
    /// ledger has no payment row for it: the payment worker created it and crashed before
    /// recording it, and the order ended meanwhile. Its client secret was never stored, so no
    /// buyer can confirm it: reported, but not an invariant violation. No fact closes it;
    /// cancel it at the provider to tidy up (a `canceled` PaymentIntent the ledger does not
    /// record is no drift: a stray the saga cancelled, or one tidied up).
    UnconfirmedIntentMissingInLedger,
    /// The ledger has a payment row whose PaymentIntent the provider does not know (404).
    /// No fact closes it.
    PaymentMissingAtProvider,
    /// The provider authorized (`requires_capture`) and the ledger still shows the payment
    /// as pending. Closed by `PaymentAuthorized`.
    AuthorizationNotInLedger,
    /// The provider captured more than the ledger records (or the ledger's status is not
    /// `succeeded`). Closed by `PaymentCaptured`.
    CaptureNotInLedger,
    /// The provider canceled the intent and the ledger does not show it canceled. Closed by
    /// `PaymentCanceled`.
    CancelNotInLedger,
    /// The provider refunded more than the ledger records. Closed by `PaymentRefunded`.
    RefundNotInLedger,
    /// The provider refunded the whole capture and the order is still `ticketed` (its tickets
    /// valid), whatever the ledger's refunded amount says (case C14). Closed by
    /// `PaymentRefunded`, which voids the tickets.
    TicketsValidAfterRefund,
    /// The provider's latest dispute of the charge is not the one, or not in the status, the
    /// ledger mirrors (a `charge.dispute.*` webhook was lost, or refuted before the dispute
    /// existed). Closed by `PaymentDisputed` with the provider's dispute and status, which
    /// flags, voids or restores the tickets as a webhook would have.
    DisputeNotInLedger,
    /// The ledger mirrors a lost dispute and the order is still `ticketed` (its tickets
    /// valid). Closed by `PaymentDisputed` (lost), which refunds the order and voids them.
    TicketsValidAfterDisputeLost,
    /// The ledger records something the provider does not: a different amount, more
    /// captured or refunded, or a later status. No fact closes it.
    LedgerDisagrees,
    /// A PaymentIntent requested by a fenced region writer (`metadata.region_epoch` below
    /// the ledger's epoch, design §15) for an order this ledger does not have (committed by
    /// the old primary after the recovery point and lost with it), or has only as ended
    /// without recording this intent. Its money is
    /// released, never attached: closed by `AuthorizationCancelRequested` (not captured) or
    /// `RefundRequested` (captured), which the payment worker carries out under the order's
    /// stable idempotency key.
    IntentOfLostOrder,
    /// Such an intent, canceled or refunded in full: nothing is held for the lost order. Not
    /// a violation.
    LostOrderCompensated,
}

impl DriftKind {
    /// Every kind, in report order.
    pub const ALL: [DriftKind; 13] = [
        DriftKind::IntentMissingInLedger,
        DriftKind::UnconfirmedIntentMissingInLedger,
        DriftKind::PaymentMissingAtProvider,
        DriftKind::AuthorizationNotInLedger,
        DriftKind::CaptureNotInLedger,
        DriftKind::CancelNotInLedger,
        DriftKind::RefundNotInLedger,
        DriftKind::TicketsValidAfterRefund,
        DriftKind::DisputeNotInLedger,
        DriftKind::TicketsValidAfterDisputeLost,
        DriftKind::LedgerDisagrees,
        DriftKind::IntentOfLostOrder,
        DriftKind::LostOrderCompensated,
    ];

    /// Whether this drift breaks an invariant (all kinds but an unconfirmed intent the ledger
    /// never recorded, which no one can pay).
    pub fn is_violation(self) -> bool {
        !matches!(self, DriftKind::UnconfirmedIntentMissingInLedger | DriftKind::LostOrderCompensated)
    }

    /// The snake_case name used in text and JSON.
    pub fn name(self) -> &'static str {
        match self {
            DriftKind::IntentMissingInLedger => "intent_missing_in_ledger",
            DriftKind::UnconfirmedIntentMissingInLedger => "unconfirmed_intent_missing_in_ledger",
            DriftKind::PaymentMissingAtProvider => "payment_missing_at_provider",
            DriftKind::AuthorizationNotInLedger => "authorization_not_in_ledger",
            DriftKind::CaptureNotInLedger => "capture_not_in_ledger",
            DriftKind::CancelNotInLedger => "cancel_not_in_ledger",
            DriftKind::RefundNotInLedger => "refund_not_in_ledger",
            DriftKind::TicketsValidAfterRefund => "tickets_valid_after_refund",
            DriftKind::DisputeNotInLedger => "dispute_not_in_ledger",
            DriftKind::TicketsValidAfterDisputeLost => "tickets_valid_after_dispute_lost",
            DriftKind::LedgerDisagrees => "ledger_disagrees_with_provider",
            DriftKind::IntentOfLostOrder => "intent_of_lost_order",
            DriftKind::LostOrderCompensated => "lost_order_compensated",
        }
    }
}

/// What the provider says about a PaymentIntent. Amounts are minor units.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProviderSide {
    /// Stripe's status.
    pub status: PaymentIntentStatus,
    /// Amount intended.
    pub amount: i64,
    /// Amount captured.
    pub amount_received: i64,
    /// Amount refunded after capture (`None` when the charge was not available).
    pub amount_refunded: Option<i64>,
}

/// What the ledger says about the same payment. Amounts are minor units.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LedgerSide {
    /// The mirrored PaymentIntent status.
    pub status: PaymentIntentStatus,
    /// Amount authorized.
    pub amount_minor: i64,
    /// Amount captured.
    pub amount_captured_minor: i64,
    /// Amount refunded.
    pub amount_refunded_minor: i64,
    /// The order's status.
    pub order_status: OrderStatus,
}

/// One difference between provider and ledger for one PaymentIntent.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Drift {
    /// `pi_…`
    pub payment_intent_id: String,
    /// The order (from the ledger row, else the intent's metadata).
    pub order_id: Option<Uuid>,
    /// What kind of drift.
    pub kind: DriftKind,
    /// The provider's view; `None` when the provider does not know the intent.
    pub provider: Option<ProviderSide>,
    /// The ledger's view; `None` when the ledger has no row.
    pub ledger: Option<LedgerSide>,
    /// The fact that closes the drift, `None` when only an operator can.
    pub fact: Option<PurchaseEvent>,
    /// Whether `--fix` wrote `fact` to the outbox.
    pub fixed: bool,
}

impl Drift {
    /// The fact's type name, or `None`.
    pub fn fact_name(&self) -> Option<&'static str> {
        Some(match self.fact.as_ref()? {
            PurchaseEvent::PaymentAuthorized { .. } => "PaymentAuthorized",
            PurchaseEvent::PaymentCaptured { .. } => "PaymentCaptured",
            PurchaseEvent::PaymentCanceled { .. } => "PaymentCanceled",
            PurchaseEvent::PaymentRefunded { .. } => "PaymentRefunded",
            PurchaseEvent::PaymentDisputed { .. } => "PaymentDisputed",
            PurchaseEvent::AuthorizationCancelRequested { .. } => "AuthorizationCancelRequested",
            PurchaseEvent::RefundRequested { .. } => "RefundRequested",
            _ => "other",
        })
    }
}

/// Local statuses of a payment that is not yet authorized.
fn pending(status: &PaymentIntentStatus) -> bool {
    status.is_unsettled()
}

/// Compares one PaymentIntent with its ledger row (either may be missing, not both) and
/// returns every drift, in the order their facts must be applied.
pub fn compare(p: Option<&IntentWithCharge>, l: Option<&LedgerPayment>) -> Vec<Drift> {
    let (pi_id, order_id) = match (p, l) {
        (_, Some(l)) => (l.payment.payment_intent_id.clone(), Some(l.payment.order_id)),
        (Some(p), None) => (p.intent.id.clone(), p.order_id().and_then(|o| o.parse().ok())),
        (None, None) => return Vec::new(),
    };
    let provider = p.map(|p| ProviderSide {
        status: p.intent.status.clone(),
        amount: p.intent.amount,
        amount_received: p.intent.amount_received,
        amount_refunded: p.charge.as_ref().map(|_| p.amount_refunded()),
    });
    let ledger_side = l.map(|l| LedgerSide {
        status: l.payment.status.clone(),
        amount_minor: l.payment.amount_minor,
        amount_captured_minor: l.payment.amount_captured_minor,
        amount_refunded_minor: l.payment.amount_refunded_minor,
        order_status: l.order_status,
    });
    let drift = |kind: DriftKind, fact: Option<PurchaseEvent>| Drift {
        payment_intent_id: pi_id.clone(),
        order_id,
        kind,
        provider: provider.clone(),
        ledger: ledger_side.clone(),
        fact,
        fixed: false,
    };
    let (Some(p), Some(l)) = (p, l) else {
        let kind = match p {
            // Holds no money and nobody can pay it: nothing to close or to tidy up (a stray
            // the saga cancelled, an unrecorded one an operator cancelled).
            Some(p) if p.intent.status == PaymentIntentStatus::Canceled => return vec![],
            Some(p)
                if matches!(
                    p.intent.status,
                    PaymentIntentStatus::RequiresCapture
                        | PaymentIntentStatus::Processing
                        | PaymentIntentStatus::Succeeded
                ) =>
            {
                DriftKind::IntentMissingInLedger
            }
            Some(_) => DriftKind::UnconfirmedIntentMissingInLedger,
            None => DriftKind::PaymentMissingAtProvider,
        };
        return vec![drift(kind, None)];
    };
    let order = OrderId(l.payment.order_id);
    let pi = &p.intent;
    let row = &l.payment;
    let mut out = Vec::new();
    let mut disagrees = pi.amount != row.amount_minor || row.amount_captured_minor > pi.amount_received;
    match pi.status {
        PaymentIntentStatus::RequiresCapture => {
            if pending(&row.status) {
                out.push(drift(DriftKind::AuthorizationNotInLedger, Some(authorized(order, p))));
            } else if row.status != PaymentIntentStatus::RequiresCapture {
                disagrees = true;
            }
        }
        PaymentIntentStatus::Succeeded => {
            if row.status == PaymentIntentStatus::Canceled {
                disagrees = true;
            } else if row.amount_captured_minor < pi.amount_received
                || row.status != PaymentIntentStatus::Succeeded
            {
                out.push(drift(
                    DriftKind::CaptureNotInLedger,
                    Some(PurchaseEvent::PaymentCaptured {
                        order_id: order,
                        payment_intent_id: pi.id.clone(),
                        amount_captured_minor: pi.amount_received,
                    }),
                ));
            }
            if p.charge.is_some() {
                let refunded = p.amount_refunded();
                if refunded > row.amount_refunded_minor {
                    out.push(drift(
                        DriftKind::RefundNotInLedger,
                        Some(PurchaseEvent::PaymentRefunded {
                            order_id: order,
                            payment_intent_id: pi.id.clone(),
                            amount_refunded_minor: refunded,
                        }),
                    ));
                } else if refunded < row.amount_refunded_minor {
                    disagrees = true;
                } else if l.order_status == OrderStatus::Ticketed
                    && pi.amount_received > 0
                    && refunded >= pi.amount_received
                {
                    // Recorded on the payment, but the tickets were never voided.
                    out.push(drift(
                        DriftKind::TicketsValidAfterRefund,
                        Some(PurchaseEvent::PaymentRefunded {
                            order_id: order,
                            payment_intent_id: pi.id.clone(),
                            amount_refunded_minor: refunded,
                        }),
                    ));
                }
            }
        }
        PaymentIntentStatus::Canceled => {
            if row.amount_captured_minor > 0 {
                disagrees = true;
            } else if row.status != PaymentIntentStatus::Canceled {
                out.push(drift(
                    DriftKind::CancelNotInLedger,
                    Some(PurchaseEvent::PaymentCanceled {
                        order_id: order,
                        payment_intent_id: pi.id.clone(),
                    }),
                ));
            }
        }
        // Not authorized yet at the provider: the ledger must not be further along.
        _ => disagrees |= !pending(&row.status) || row.amount_refunded_minor > 0,
    }
    if let (Some(dispute_id), Some("lost"), OrderStatus::Ticketed) =
        (row.dispute_id.as_deref(), row.dispute_status.as_deref(), l.order_status)
    {
        out.push(drift(
            DriftKind::TicketsValidAfterDisputeLost,
            Some(PurchaseEvent::PaymentDisputed {
                order_id: order,
                payment_intent_id: pi.id.clone(),
                dispute_id: dispute_id.to_owned(),
                status: "lost".into(),
            }),
        ));
    }
    if disagrees {
        out.push(drift(DriftKind::LedgerDisagrees, None));
    }
    out
}

/// Whether the provider's dispute status is final (`won`, `lost`, or an inquiry closed
/// without a dispute): the ledger's mirror of a final status needs no re-check.
fn dispute_is_final(status: &str) -> bool {
    matches!(status, "won" | "lost" | "warning_closed")
}

/// Compares the provider's newest dispute of a PaymentIntent with the ledger's mirror:
/// a dispute the ledger does not know, or knows in another status, is drift closed by
/// `PaymentDisputed` with the provider's word. `None` when they agree (or the provider has
/// no dispute).
pub fn compare_dispute(newest: Option<&boxoffice_payments::Dispute>, l: &LedgerPayment) -> Option<Drift> {
    let d = newest?;
    let row = &l.payment;
    if row.dispute_id.as_deref() == Some(d.id.as_str())
        && row.dispute_status.as_deref() == Some(d.status.as_str())
    {
        return None;
    }
    Some(Drift {
        payment_intent_id: row.payment_intent_id.clone(),
        order_id: Some(row.order_id),
        kind: DriftKind::DisputeNotInLedger,
        provider: None,
        ledger: Some(LedgerSide {
            status: row.status.clone(),
            amount_minor: row.amount_minor,
            amount_captured_minor: row.amount_captured_minor,
            amount_refunded_minor: row.amount_refunded_minor,
            order_status: l.order_status,
        }),
        fact: Some(PurchaseEvent::PaymentDisputed {
            order_id: OrderId(row.order_id),
            payment_intent_id: row.payment_intent_id.clone(),
            dispute_id: d.id.clone(),
            status: d.status.clone(),
        }),
        fixed: false,
    })
}

/// One snapshot of both sides over a window.
#[derive(Debug, Clone)]
pub struct Scan {
    /// The window compared.
    pub window: Window,
    /// PaymentIntents the provider listed in the window (all of them, ours or not).
    pub intents_listed: usize,
    /// The intents naming one of our orders (of `event`, when restricted), plus those the
    /// ledger has but the window listing missed (looked up one by one).
    pub intents: Vec<IntentWithCharge>,
    /// The ledger rows of those intents, by PaymentIntent id.
    pub ledger: HashMap<String, LedgerPayment>,
    /// Every drift, grouped by PaymentIntent, in the order facts must be applied.
    pub drift: Vec<Drift>,
}

/// Lists the provider's PaymentIntents created in `window` (with their charges), loads the
/// matching ledger rows and the ledger rows written in the window, looks up one by one the
/// intents of ledger rows the listing did not return (created just before the window, or
/// unknown to the provider), and compares them. With `event`, only orders of that event are
/// compared. Errors: the provider's or the database's, with context.
pub async fn scan(
    pool: &PgPool,
    stripe: &StripeClient,
    window: Window,
    event: Option<Uuid>,
) -> anyhow::Result<Scan> {
    let listed = stripe
        .list_payment_intents_with_charges(window.created())
        .await
        .context("listing PaymentIntents at the provider")?;
    let intents_listed = listed.len();
    // Ours: the intent names an order, and no other purchase cell than this ledger's (the
    // account is shared by every cell). Anything else on the account is not our business.
    let own_cells: HashSet<String> = boxoffice_store::cells::own_cells(pool).await?.into_iter().collect();
    let ours: Vec<IntentWithCharge> = listed
        .into_iter()
        .filter(|i| i.order_id().and_then(|o| o.parse::<Uuid>().ok()).is_some())
        .filter(|i| i.intent.metadata.get("purchase_cell").is_none_or(|c| own_cells.contains(c)))
        .collect();
    let ids: Vec<String> = ours.iter().map(|i| i.intent.id.clone()).collect();
    let mut ledger_rows: HashMap<String, LedgerPayment> = ledger::ledger_for_intents(pool, &ids)
        .await?
        .into_iter()
        .map(|r| (r.payment.payment_intent_id.clone(), r))
        .collect();
    // Intents without a ledger row: does the order exist, and for which event?
    let orphan_orders: Vec<Uuid> = ours
        .iter()
        .filter(|i| !ledger_rows.contains_key(&i.intent.id))
        .filter_map(|i| i.order_id()?.parse().ok())
        .collect();
    let orphan_rows = boxoffice_store::orders::by_ids(pool, &orphan_orders).await?;
    let order_events: HashMap<Uuid, Uuid> = orphan_rows.iter().map(|o| (o.id, o.event_id)).collect();
    let order_final: HashMap<Uuid, bool> = orphan_rows.iter().map(|o| (o.id, o.status.is_final())).collect();
    let in_scope = |i: &IntentWithCharge, rows: &HashMap<String, LedgerPayment>| match event {
        None => true,
        Some(e) => match rows.get(&i.intent.id) {
            Some(r) => r.event_id == e,
            None => i
                .order_id()
                .and_then(|o| o.parse::<Uuid>().ok())
                .and_then(|o| order_events.get(&o))
                .is_some_and(|ev| *ev == e),
        },
    };
    let mut intents: Vec<IntentWithCharge> = ours.into_iter().filter(|i| in_scope(i, &ledger_rows)).collect();

    // Ledger rows written in the window whose intent the listing did not return.
    let seen: HashSet<String> = intents.iter().map(|i| i.intent.id.clone()).collect();
    let unlisted: Vec<LedgerPayment> =
        ledger::ledger_created_between(pool, Some(window.since), window.until, event)
            .await?
            .into_iter()
            .filter(|r| !seen.contains(&r.payment.payment_intent_id))
            .collect();
    let lookups = futures::stream::iter(unlisted.iter().map(|r| {
        let id = r.payment.payment_intent_id.clone();
        async move {
            use boxoffice_payments::PaymentGateway;
            match stripe.retrieve_payment_intent(&id).await {
                Ok(pi) => Ok(Some(pi)),
                Err(e) if e.status() == Some(404) => Ok(None),
                Err(e) => Err(anyhow::Error::new(e).context(format!("retrieving PaymentIntent {id}"))),
            }
        }
    }))
    .buffered(RETRIEVE_CONCURRENCY)
    .collect::<Vec<_>>()
    .await;
    let mut missing_at_provider = Vec::new();
    for (row, found) in unlisted.into_iter().zip(lookups) {
        match found? {
            // Outside the window but known: compare it, without its charge (refunds unknown).
            Some(pi) => intents.push(IntentWithCharge { intent: pi, charge: None }),
            None => missing_at_provider.push(row.payment.payment_intent_id.clone()),
        }
        ledger_rows.insert(row.payment.payment_intent_id.clone(), row);
    }

    let mut drift = Vec::new();
    for i in &intents {
        drift.extend(compare(Some(i), ledger_rows.get(&i.intent.id)));
    }
    // Disputes: the charge says it was disputed, or the ledger mirrors a dispute that has not
    // closed yet. Either way the provider's newest dispute is the word to compare with.
    let disputed: Vec<&LedgerPayment> = intents
        .iter()
        .filter_map(|i| ledger_rows.get(&i.intent.id).map(|l| (i, l)))
        .filter(|(i, l)| {
            i.charge.as_ref().is_some_and(|c| c.disputed)
                || l.payment.dispute_status.as_deref().is_some_and(|s| !dispute_is_final(s))
        })
        .map(|(_, l)| l)
        .collect();
    let newest = futures::stream::iter(disputed.iter().map(|l| {
        let id = l.payment.payment_intent_id.clone();
        async move {
            stripe
                .list_disputes_of(&id)
                .await
                .map(|ds| ds.into_iter().next())
                .with_context(|| format!("listing the disputes of {id}"))
        }
    }))
    .buffered(RETRIEVE_CONCURRENCY)
    .collect::<Vec<_>>()
    .await;
    for (l, d) in disputed.into_iter().zip(newest) {
        drift.extend(compare_dispute(d?.as_ref(), l));
    }
    for id in &missing_at_provider {
        drift.extend(compare(None, ledger_rows.get(id)));
    }
    let epoch = boxoffice_store::region::record(pool).await?.epoch;
    // The payment rows of the orders intents without a row name: a stray is an intent of an
    // order that records another.
    let named: Vec<OrderId> = drift
        .iter()
        .filter(|d| d.kind == DriftKind::IntentMissingInLedger)
        .filter_map(|d| d.order_id.map(OrderId))
        .collect();
    let recorded: HashMap<Uuid, String> =
        ledger::get_all(pool, &named).await?.into_iter().map(|p| (p.order_id, p.payment_intent_id)).collect();
    for d in drift.iter_mut() {
        if let Some(i) = intents.iter().find(|i| i.intent.id == d.payment_intent_id) {
            // Only an intent naming this ledger's cell can be this ledger's lost order.
            let own = i.intent.metadata.get("purchase_cell").is_some_and(|c| own_cells.contains(c));
            let open = d.order_id.and_then(|o| order_final.get(&o)).is_some_and(|f| !f);
            if own {
                lost_order(d, i, epoch, open);
            }
            if let Some(recorded) = d.order_id.and_then(|o| recorded.get(&o)) {
                stray_authorization(d, i, recorded);
            }
        }
    }
    Ok(Scan { window, intents_listed, intents, ledger: ledger_rows, drift })
}

/// Turns a drift about an intent with no ledger row into [`DriftKind::IntentOfLostOrder`]
/// (with the compensating command) or [`DriftKind::LostOrderCompensated`] when the intent was
/// requested by a writer of an epoch below `ledger_epoch` and its order is not open here: it
/// does not exist (committed after the recovery point), or it ended without this payment (the
/// order was replicated, the payment row recording the intent was not). An open order is left
/// alone: its republished authorization request reaches the same intent under the same
/// idempotency key and records it.
pub fn lost_order(d: &mut Drift, i: &IntentWithCharge, ledger_epoch: i64, order_open: bool) {
    let fenced = i
        .intent
        .metadata
        .get("region_epoch")
        .and_then(|e| e.parse::<i64>().ok())
        .is_some_and(|e| e < ledger_epoch);
    let (Some(order), true, false, None) = (d.order_id, fenced, order_open, d.ledger.as_ref()) else {
        return;
    };
    let pi = &i.intent;
    let (kind, fact) = match pi.status {
        PaymentIntentStatus::Canceled => (DriftKind::LostOrderCompensated, None),
        PaymentIntentStatus::Succeeded if i.amount_refunded() >= pi.amount_received => {
            (DriftKind::LostOrderCompensated, None)
        }
        PaymentIntentStatus::Succeeded => (
            DriftKind::IntentOfLostOrder,
            Some(PurchaseEvent::RefundRequested {
                order_id: OrderId(order),
                payment_intent_id: pi.id.clone(),
                amount_minor: pi.amount_received - i.amount_refunded(),
                reason: "order_lost_in_failover".into(),
            }),
        ),
        _ => (
            DriftKind::IntentOfLostOrder,
            Some(PurchaseEvent::AuthorizationCancelRequested {
                order_id: OrderId(order),
                payment_intent_id: pi.id.clone(),
                reason: "order_lost_in_failover".into(),
            }),
        ),
    };
    d.kind = kind;
    d.fact = fact;
}

/// Gives a drift about an authorized intent with no ledger row
/// ([`DriftKind::IntentMissingInLedger`]) the fact that closes it when its order's payment row
/// records another PaymentIntent, `recorded`: a stray authorization, which no purchase attaches
/// (one PaymentIntent per order). The fact is `PaymentAuthorized` for the stray intent, what a
/// checked webhook claim would have led to; the saga answers it by cancelling the authorization
/// (invariant 6). Such a claim may have been left to reconciliation once its order's claims
/// spent their re-fetch budget (`stripe_events::spend_uncovered_refetch`). A captured stray
/// stays an operator's (a refund of money captured outside the purchase).
pub fn stray_authorization(d: &mut Drift, i: &IntentWithCharge, recorded: &str) {
    let pi = &i.intent;
    let (DriftKind::IntentMissingInLedger, Some(order), None, PaymentIntentStatus::RequiresCapture) =
        (d.kind, d.order_id, d.ledger.as_ref(), &pi.status)
    else {
        return;
    };
    if recorded == pi.id {
        return;
    }
    d.fact = Some(authorized(OrderId(order), i));
}

/// `PaymentAuthorized` for `order` as the provider reports intent `i`: its capturable amount
/// and its charge's capture deadline.
fn authorized(order: OrderId, i: &IntentWithCharge) -> PurchaseEvent {
    PurchaseEvent::PaymentAuthorized {
        order_id: order,
        payment_intent_id: i.intent.id.clone(),
        amount_capturable_minor: i.intent.amount_capturable,
        capture_before: i
            .charge
            .as_ref()
            .and_then(|c| c.capture_before())
            .and_then(|t| Utc.timestamp_opt(t, 0).single()),
    }
}

/// Writes the fact of every fixable drift to the outbox: per PaymentIntent, all its facts
/// in one transaction, in order, under the order's correlation id. Marks those drifts
/// `fixed` and returns how many facts were written. Drifts without a fact, or whose order
/// no longer exists, are left unfixed.
pub async fn fix(pool: &PgPool, drift: &mut [Drift]) -> anyhow::Result<usize> {
    let mut by_intent: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, d) in drift.iter().enumerate() {
        if d.fact.is_some() && d.order_id.is_some() {
            by_intent.entry(d.payment_intent_id.clone()).or_default().push(i);
        }
    }
    let mut written = 0;
    for (pi, idx) in by_intent {
        let order = drift[idx[0]].order_id.expect("filtered above");
        let mut tx = pool.begin().await?;
        let correlation: Option<Uuid> =
            boxoffice_store::orders::amount_and_correlation(&mut *tx, OrderId(order)).await?.map(|k| k.1);
        // A lost order's compensation starts a journey of its own.
        let lost = idx.iter().any(|&i| drift[i].kind == DriftKind::IntentOfLostOrder);
        let Some(correlation) = correlation.or_else(|| lost.then(Uuid::new_v4)) else {
            tracing::warn!(order.id = %order, stripe.payment_intent = %pi, "order does not exist; drift left for an operator");
            continue;
        };
        let envelopes: Vec<Envelope> = idx
            .iter()
            .filter_map(|&i| drift[i].fact.as_ref())
            .map(|f| Envelope::new(OrderId(order), f, correlation, None))
            .collect();
        boxoffice_store::outbox::insert_all(&mut tx, &envelopes)
            .await
            .with_context(|| format!("writing facts for {pi}"))?;
        tx.commit().await?;
        tracing::info!(order.id = %order, stripe.payment_intent = %pi, facts = envelopes.len(), "reconcile emitted facts");
        written += envelopes.len();
        for i in idx {
            drift[i].fixed = true;
        }
    }
    Ok(written)
}

/// The outcome of `boxoffice reconcile`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The window compared.
    pub window: Window,
    /// PaymentIntents the provider listed in the window.
    pub intents_listed: usize,
    /// PaymentIntents compared with the ledger.
    pub intents_compared: usize,
    /// Every drift found.
    pub drift: Vec<Drift>,
    /// Whether `--fix` was asked for.
    pub fix: bool,
    /// Facts written to the outbox.
    pub facts_emitted: usize,
    /// Drifts not fixed (all of them without `--fix`).
    pub unresolved: usize,
    /// With `--fix`: re-fetches asked (one per PaymentIntent and pass) for the early webhooks
    /// left pending beside their payment row, of any age (`stripe_events::resolve_stranded`
    /// without its window; the expiry worker's sweep takes only the last hour's); 0 without.
    /// Printed, not kept with the run's record.
    pub stranded_webhooks_refetched: usize,
}

impl Report {
    /// 0 when there was no drift or all of it was fixed, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        i32::from(self.unresolved > 0)
    }
}

/// Scans `window` and, with `fix`, emits the closing facts (see [`scan`] and [`fix`]).
pub async fn run(
    pool: &PgPool,
    stripe: &StripeClient,
    window: Window,
    fix_drift: bool,
) -> anyhow::Result<Report> {
    // First, and whatever the provider does: the stranded early webhooks need only the
    // ledger, and their re-fetches reach the provider through the payment worker.
    let stranded_webhooks_refetched = if fix_drift { resolve_stranded_webhooks(pool).await } else { 0 };
    let mut s = scan(pool, stripe, window, None).await?;
    let facts_emitted = if fix_drift { fix(pool, &mut s.drift).await? } else { 0 };
    let unresolved = s.drift.iter().filter(|d| !d.fixed).count();
    let report = Report {
        window,
        intents_listed: s.intents_listed,
        intents_compared: s.intents.len(),
        drift: s.drift,
        fix: fix_drift,
        facts_emitted,
        unresolved,
        stranded_webhooks_refetched,
    };
    record_metrics(&report, Utc::now());
    // The API role exports the latest run's drift from the ledger: this command's own process
    // has no /metrics to scrape.
    let unresolved: BTreeMap<String, i64> =
        unresolved_by_kind(&report).into_iter().map(|(k, n)| (k.name().to_owned(), n as i64)).collect();
    let fixed = report.drift.iter().filter(|d| d.fixed).count() as i64;
    boxoffice_store::operator::record_reconcile_run(
        pool,
        report.window.since,
        report.window.until,
        &unresolved,
        fixed,
    )
    .await?;
    Ok(report)
}

/// `--fix`'s sweep of early webhooks left pending beside their payment row, of any age
/// (`stripe_events::resolve_stranded` without a window), pass after pass until one resolves
/// nothing: each pass that returns more than 0 has committed at least one event out of
/// pending, so the loop ends (a row another sweeper holds is skipped, and stays for the
/// audit). Re-fetches asked; a failure is logged and ends the sweep, and the run goes on to
/// the provider's drift (the audit still counts what is left).
async fn resolve_stranded_webhooks(pool: &PgPool) -> usize {
    let mut refetched = 0;
    loop {
        match boxoffice_store::stripe_events::resolve_stranded(pool, 1_000, None).await {
            Ok(0) => return refetched,
            Ok(n) => refetched += n,
            Err(e) => {
                tracing::warn!(error = %e, refetched, "resolving stranded early webhooks failed");
                return refetched;
            }
        }
    }
}

/// The drift a run left unresolved, per kind (every kind, 0 when none).
fn unresolved_by_kind(r: &Report) -> BTreeMap<DriftKind, usize> {
    let mut by_kind: BTreeMap<DriftKind, usize> = DriftKind::ALL.iter().map(|&k| (k, 0)).collect();
    for d in r.drift.iter().filter(|d| !d.fixed) {
        *by_kind.entry(d.kind).or_default() += 1;
    }
    by_kind
}

/// Sets the gauges of a completed run (design §16, "Stripe/local status mismatch"; the rules in
/// `deploy/observability/alerts.yml` read them): `boxoffice_reconcile_drift{kind}`, the drift
/// of each kind the run left unresolved (every kind is set, 0 when none, so a kind that was
/// cleared reads 0 and not its last count), and `boxoffice_reconcile_last_run_timestamp_seconds`,
/// when it finished (unix seconds). A run that could not complete sets neither, so its staleness
/// shows. They go to the process's installed recorder, if any; the run is also recorded in
/// the ledger (`reconcile_runs`), from which every API process exports the same gauges.
pub fn record_metrics(r: &Report, finished_at: DateTime<Utc>) {
    for (kind, n) in unresolved_by_kind(r) {
        metrics::gauge!("boxoffice_reconcile_drift", "kind" => kind.name()).set(n as f64);
    }
    metrics::gauge!("boxoffice_reconcile_last_run_timestamp_seconds").set(finished_at.timestamp() as f64);
}

/// The text form: a header, then one line per drift (provider vs ledger, the closing fact).
pub fn render(r: &Report) -> String {
    let at = |t: DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let until = r.window.until.map_or_else(|| "now".to_owned(), at);
    let mut out = format!(
        "reconcile PaymentIntents created {} .. {until}: {} listed, {} compared, {} drift\n",
        at(r.window.since),
        r.intents_listed,
        r.intents_compared,
        r.drift.len()
    );
    for d in &r.drift {
        let provider = match &d.provider {
            Some(p) => format!(
                "{} amount={} received={} refunded={}",
                p.status,
                p.amount,
                p.amount_received,
                p.amount_refunded.map_or_else(|| "?".to_owned(), |n| n.to_string())
            ),
            // A dispute's drift compares the dispute, not the PaymentIntent.
            None => match &d.fact {
                Some(PurchaseEvent::PaymentDisputed { dispute_id, status, .. }) => {
                    format!("dispute {dispute_id} {status}")
                }
                _ => "no such PaymentIntent".to_owned(),
            },
        };
        let ledger = match &d.ledger {
            Some(l) => format!(
                "{} amount={} captured={} refunded={} (order {})",
                l.status, l.amount_minor, l.amount_captured_minor, l.amount_refunded_minor, l.order_status
            ),
            None => "no payment row".to_owned(),
        };
        let close = match (d.fact_name(), d.fixed) {
            (Some(f), true) => format!("{f} emitted"),
            (Some(f), false) => format!("closed by {f} (run with --fix)"),
            (None, _) => "no fact closes this: needs an operator".to_owned(),
        };
        let order = d.order_id.map_or_else(|| "-".to_owned(), |o| o.to_string());
        out.push_str(&format!(
            "  {} order={} {}: provider {} | ledger {} -> {}\n",
            d.payment_intent_id,
            order,
            d.kind.name(),
            provider,
            ledger,
            close
        ));
    }
    if r.fix {
        out.push_str(&format!(
            "{} fact(s) written to the outbox; {} drift unresolved\n",
            r.facts_emitted, r.unresolved
        ));
        if r.stranded_webhooks_refetched > 0 {
            out.push_str(&format!(
                "{} re-fetch(es) asked for early webhooks left pending beside their payment row\n",
                r.stranded_webhooks_refetched
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use boxoffice_payments::{CardDetails, Charge, PaymentIntent, PaymentMethodDetails};
    use boxoffice_store::payments::PaymentRow;

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2025, 3, 1, 12, 0, 0).unwrap()
    }

    #[test]
    fn instants_parse_as_rfc3339_or_durations_before_now() {
        let n = now();
        assert_eq!(parse_instant("2h", n).unwrap(), n - chrono::Duration::hours(2));
        assert_eq!(parse_instant("1h30m", n).unwrap(), n - chrono::Duration::minutes(90));
        assert_eq!(parse_instant(" 7d ", n).unwrap(), n - chrono::Duration::days(7));
        assert_eq!(parse_instant("90s", n).unwrap(), n - chrono::Duration::seconds(90));
        assert_eq!(
            parse_instant("2025-02-28T23:00:00+01:00", n).unwrap(),
            Utc.with_ymd_and_hms(2025, 2, 28, 22, 0, 0).unwrap()
        );
        for bad in ["", "2", "h", "0h", "2x", "-2h", "2h5", "yesterday"] {
            assert!(parse_instant(bad, n).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn window_maps_to_stripe_created_filters() {
        let w = Window::parse("2h", Some("1h"), now()).unwrap();
        let c = w.created();
        assert_eq!(c.gte, Some((now() - chrono::Duration::hours(2)).timestamp()));
        assert_eq!(c.lte, Some((now() - chrono::Duration::hours(1)).timestamp()));
        assert_eq!(Window::parse("2h", None, now()).unwrap().created().lte, None);
        assert!(Window::parse("1h", Some("2h"), now()).is_err(), "until before since");
    }

    fn intent(status: &str, amount: i64, received: i64, refunded: Option<i64>) -> IntentWithCharge {
        let order = Uuid::nil();
        let pi: PaymentIntent = serde_json::from_value(serde_json::json!({
            "id": "pi_1", "status": status, "amount": amount,
            "amount_capturable": if status == "requires_capture" { amount } else { 0 },
            "amount_received": received, "currency": "usd", "capture_method": "manual",
            "client_secret": null, "metadata": {"order_id": order.to_string()}, "created": 1,
            "latest_charge": "ch_1", "last_payment_error": null, "cancellation_reason": null
        }))
        .unwrap();
        let charge = refunded.map(|r| Charge {
            id: "ch_1".into(),
            amount,
            amount_captured: received,
            amount_refunded: r,
            captured: received > 0,
            status: "succeeded".into(),
            payment_method_details: Some(PaymentMethodDetails {
                card: Some(CardDetails { capture_before: Some(1_700_000_000) }),
            }),
            disputed: false,
        });
        IntentWithCharge { intent: pi, charge }
    }

    fn row(status: &str, amount: i64, captured: i64, refunded: i64) -> LedgerPayment {
        LedgerPayment {
            payment: PaymentRow {
                order_id: Uuid::nil(),
                payment_intent_id: "pi_1".into(),
                status: status.into(),
                amount_minor: amount,
                currency: "usd".into(),
                amount_captured_minor: captured,
                amount_refunded_minor: refunded,
                capture_before: None,
                last_error_code: None,
                dispute_id: None,
                dispute_status: None,
            },
            event_id: Uuid::nil(),
            order_status: OrderStatus::Ticketed,
            correlation_id: Uuid::nil(),
            created_at: now(),
            deadline_passed: false,
        }
    }

    fn kinds(
        p: Option<&IntentWithCharge>,
        l: Option<&LedgerPayment>,
    ) -> Vec<(DriftKind, Option<&'static str>)> {
        compare(p, l).iter().map(|d| (d.kind, d.fact_name())).collect()
    }

    #[test]
    fn only_an_authorized_intent_of_an_order_recording_another_is_a_stray_to_cancel() {
        let stray = |status: &str, recorded: &str| {
            let i = intent(status, 100, 0, Some(0));
            let mut d = compare(Some(&i), None).remove(0);
            stray_authorization(&mut d, &i, recorded);
            (d.kind, d.fact)
        };
        match stray("requires_capture", "pi_2") {
            (
                DriftKind::IntentMissingInLedger,
                Some(PurchaseEvent::PaymentAuthorized {
                    payment_intent_id,
                    order_id,
                    amount_capturable_minor,
                    capture_before,
                }),
            ) => {
                assert_eq!(
                    (payment_intent_id.as_str(), order_id, amount_capturable_minor),
                    ("pi_1", OrderId(Uuid::nil()), 100)
                );
                assert_eq!(capture_before, Utc.timestamp_opt(1_700_000_000, 0).single());
            }
            other => panic!("{other:?}"),
        }
        // The order's own intent (its row lost), and a captured stray: an operator's.
        assert_eq!(stray("requires_capture", "pi_1"), (DriftKind::IntentMissingInLedger, None));
        assert_eq!(stray("succeeded", "pi_2"), (DriftKind::IntentMissingInLedger, None));
        // An intent that never moved money is a notice, and stays one; once cancelled (the
        // saga's answer to a stray), it is no drift.
        assert_eq!(
            stray("requires_payment_method", "pi_2"),
            (DriftKind::UnconfirmedIntentMissingInLedger, None)
        );
        assert!(compare(Some(&intent("canceled", 100, 0, Some(0))), None).is_empty());
    }

    #[test]
    fn agreeing_sides_have_no_drift() {
        for (p, l) in [
            (intent("succeeded", 100, 100, Some(0)), row("succeeded", 100, 100, 0)),
            (intent("canceled", 100, 0, Some(100)), row("canceled", 100, 0, 0)),
            (intent("requires_capture", 100, 0, Some(0)), row("requires_capture", 100, 0, 0)),
            (intent("requires_payment_method", 100, 0, None), row("requires_payment_method", 100, 0, 0)),
        ] {
            assert!(compare(Some(&p), Some(&l)).is_empty(), "{p:?} vs {l:?}");
        }
        let mut refunded = row("succeeded", 100, 100, 100);
        refunded.order_status = OrderStatus::Refunded;
        let p = intent("succeeded", 100, 100, Some(100));
        assert!(compare(Some(&p), Some(&refunded)).is_empty(), "a refunded order agrees with its refund");
    }

    #[test]
    fn a_lost_dispute_with_valid_tickets_is_drift_and_a_dispute_the_ledger_missed_too() {
        let p = intent("succeeded", 100, 100, Some(0));
        let mut lost = row("succeeded", 100, 100, 0);
        lost.payment.dispute_id = Some("dp_1".into());
        lost.payment.dispute_status = Some("lost".into());
        assert_eq!(
            kinds(Some(&p), Some(&lost)),
            [(DriftKind::TicketsValidAfterDisputeLost, Some("PaymentDisputed"))]
        );
        lost.order_status = OrderStatus::Refunded;
        assert!(kinds(Some(&p), Some(&lost)).is_empty(), "voided and refunded: settled");

        let dispute = |id: &str, status: &str| boxoffice_payments::Dispute {
            id: id.into(),
            status: status.into(),
            amount: 100,
            charge: "ch_1".into(),
            payment_intent: Some("pi_1".into()),
            reason: None,
        };
        let mut open = row("succeeded", 100, 100, 0);
        assert!(compare_dispute(None, &open).is_none(), "no dispute at the provider");
        let d = compare_dispute(Some(&dispute("dp_1", "needs_response")), &open).expect("missed dispute");
        assert_eq!((d.kind, d.fact_name()), (DriftKind::DisputeNotInLedger, Some("PaymentDisputed")));
        open.payment.dispute_id = Some("dp_1".into());
        open.payment.dispute_status = Some("needs_response".into());
        assert!(compare_dispute(Some(&dispute("dp_1", "needs_response")), &open).is_none(), "agree");
        let d = compare_dispute(Some(&dispute("dp_1", "lost")), &open).expect("missed close");
        match d.fact {
            Some(PurchaseEvent::PaymentDisputed { status, .. }) => assert_eq!(status, "lost"),
            other => panic!("{other:?}"),
        }
        assert!(!dispute_is_final("needs_response") && dispute_is_final("lost") && dispute_is_final("won"));
    }

    #[test]
    fn valid_tickets_of_a_refunded_payment_are_drift() {
        // Case C14: the ledger recorded the refund, but the order is still ticketed.
        let p = intent("succeeded", 100, 100, Some(100));
        assert_eq!(
            kinds(Some(&p), Some(&row("succeeded", 100, 100, 100))),
            [(DriftKind::TicketsValidAfterRefund, Some("PaymentRefunded"))]
        );
        // A partial refund leaves the tickets valid: no drift.
        let p = intent("succeeded", 100, 100, Some(40));
        assert!(kinds(Some(&p), Some(&row("succeeded", 100, 100, 40))).is_empty());
    }

    #[test]
    fn each_drift_names_the_fact_that_closes_it() {
        use DriftKind::*;
        let k = |p: IntentWithCharge, l: LedgerPayment| kinds(Some(&p), Some(&l));
        assert_eq!(
            k(intent("requires_capture", 100, 0, Some(0)), row("requires_payment_method", 100, 0, 0)),
            [(AuthorizationNotInLedger, Some("PaymentAuthorized"))]
        );
        assert_eq!(
            k(intent("succeeded", 100, 100, Some(0)), row("requires_capture", 100, 0, 0)),
            [(CaptureNotInLedger, Some("PaymentCaptured"))]
        );
        assert_eq!(
            k(intent("succeeded", 100, 100, Some(100)), row("requires_capture", 100, 0, 0)),
            [(CaptureNotInLedger, Some("PaymentCaptured")), (RefundNotInLedger, Some("PaymentRefunded"))]
        );
        assert_eq!(
            k(intent("canceled", 100, 0, Some(100)), row("requires_capture", 100, 0, 0)),
            [(CancelNotInLedger, Some("PaymentCanceled"))]
        );
        assert_eq!(
            k(intent("succeeded", 100, 100, Some(0)), row("succeeded", 100, 100, 100)),
            [(LedgerDisagrees, None)]
        );
        assert_eq!(
            k(intent("succeeded", 100, 100, Some(0)), row("succeeded", 90, 100, 0)),
            [(LedgerDisagrees, None)]
        );
        assert_eq!(
            k(intent("requires_payment_method", 100, 0, None), row("succeeded", 100, 100, 0)),
            [(LedgerDisagrees, None)]
        );
        assert_eq!(
            k(intent("canceled", 100, 0, None), row("succeeded", 100, 100, 0)),
            [(LedgerDisagrees, None)]
        );
        let p = intent("succeeded", 100, 100, Some(0));
        assert_eq!(kinds(Some(&p), None), [(IntentMissingInLedger, None)]);
        let p = intent("requires_capture", 100, 0, Some(0));
        assert_eq!(kinds(Some(&p), None), [(IntentMissingInLedger, None)]);
        let p = intent("requires_payment_method", 100, 0, Some(0));
        assert_eq!(kinds(Some(&p), None), [(UnconfirmedIntentMissingInLedger, None)]);
        assert_eq!(kinds(Some(&intent("canceled", 100, 0, Some(0))), None), []);
        assert!(!UnconfirmedIntentMissingInLedger.is_violation() && IntentMissingInLedger.is_violation());
        let l = row("succeeded", 100, 100, 0);
        assert_eq!(kinds(None, Some(&l)), [(PaymentMissingAtProvider, None)]);
        // Without the charge (looked up one by one), refunds are not compared.
        assert!(compare(Some(&intent("succeeded", 100, 100, None)), Some(&row("succeeded", 100, 100, 100)))
            .is_empty());
    }

    #[test]
    fn authorization_fact_carries_the_provider_deadline() {
        let d = compare(
            Some(&intent("requires_capture", 100, 0, Some(0))),
            Some(&row("requires_payment_method", 100, 0, 0)),
        );
        match &d[0].fact {
            Some(PurchaseEvent::PaymentAuthorized { amount_capturable_minor, capture_before, .. }) => {
                assert_eq!(*amount_capturable_minor, 100);
                assert_eq!(capture_before.map(|t| t.timestamp()), Some(1_700_000_000));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_run_sets_drift_per_kind_and_its_time() {
        let mut drift = compare(
            Some(&intent("requires_capture", 100, 0, Some(0))),
            Some(&row("requires_payment_method", 100, 0, 0)),
        );
        drift.extend(compare(
            Some(&intent("succeeded", 100, 100, Some(0))),
            Some(&row("requires_capture", 100, 0, 0)),
        ));
        drift[1].fixed = true;
        let report = Report {
            window: Window::parse("2h", None, now()).unwrap(),
            intents_listed: 2,
            intents_compared: 2,
            drift,
            fix: true,
            facts_emitted: 1,
            unresolved: 1,
            stranded_webhooks_refetched: 0,
        };
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || record_metrics(&report, now()));
        let page = handle.render();
        let line = |l: &str| page.lines().any(|x| x == l);
        assert!(line(r#"boxoffice_reconcile_drift{kind="authorization_not_in_ledger"} 1"#), "{page}");
        // Fixed drift does not count; every other kind reads 0.
        assert!(line(r#"boxoffice_reconcile_drift{kind="capture_not_in_ledger"} 0"#), "{page}");
        assert_eq!(
            page.lines().filter(|l| l.starts_with("boxoffice_reconcile_drift{")).count(),
            DriftKind::ALL.len()
        );
        assert!(
            line(&format!("boxoffice_reconcile_last_run_timestamp_seconds {}", now().timestamp())),
            "{page}"
        );
    }
}
