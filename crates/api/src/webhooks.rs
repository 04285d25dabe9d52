//! Stripe webhook ingress (design §10): the raw body's `Stripe-Signature` is verified before
//! anything is parsed (bad → 400, nothing written); the Stripe event id is recorded in
//! `stripe_events` together with what the event leads to, in one transaction; 2xx is answered
//! only after that commit. A redelivered event finds its row and is acknowledged without
//! effect (invariant 4). Events we do not act on are recorded and acknowledged, so Stripe
//! stops retrying them. Whole bodies are never logged. Under load the endpoint records the
//! events that arrive together in one transaction ([`Ingress`], a group commit whose batch
//! rules are stated there); an event's statements and outcome are the same batched or alone.
//!
//! A webhook is a claim, not the truth (Stripe delivers at least once, late and in any order,
//! and whoever holds the signing secret can sign anything), so no webhook moves an order, a
//! hold's status or a payment row by itself (case C16); the most one does is delay a live
//! hold's lapse until the re-fetch has spoken (below):
//! - **known**: a claim the ledger already records (a redelivered authorization after the
//!   saga confirmed, a capture the payment worker recorded from its own call) is recorded and
//!   has nothing left to do;
//! - **news**: any other claim for the order's PaymentIntent — the saga's next step included,
//!   and any amount or status that contradicts the ledger — is recorded with a
//!   `PaymentIntentRefreshRequested` command: the payment worker re-fetches the PaymentIntent
//!   (and its charge) and the saga acts on what the provider says (counted in
//!   `boxoffice_webhook_claims_verified_total` by reason). One re-fetch per PaymentIntent and
//!   order at a time: a claim that finds one for its order asked for less than
//!   [`stripe_events::REFETCH_COALESCE_S`] ago and not made yet is covered by it and asks
//!   nothing ([`Ingested::Coalesced`]; the worker asks once more if claims came while its call
//!   was under way, [`stripe_events::finish_refetch`]), so forged event ids about one
//!   PaymentIntent cost no provider call each; and the claims about one PaymentIntent and
//!   order ask for at most [`stripe_events::REFETCHES_PER_PAYMENT_INTENT`] re-fetches an hour
//!   (the worker's follow-ups have a budget of their own,
//!   [`stripe_events::FOLLOW_UPS_PER_PAYMENT_INTENT`]), so neither a claim sent each time a
//!   re-fetch ends nor a steady stream keeps provider calls going: a claim past the budget is
//!   recorded and left ([`Ingested::LeftToReconciliation`]) and protects nothing: the
//!   hold's provider check, not budgeted, finds an authorization it reports at the hold's end. A claim naming an object the ledger does not
//!   record for its order — a PaymentIntent that is not the order's current one (or any, before
//!   the order records one), or a dispute — names one of its own that no pending re-fetch
//!   covers; such claims ask for their re-fetch within the order's budget
//!   ([`stripe_events::UNCOVERED_REFETCHES_PER_ORDER`] an hour), and any beyond it are recorded
//!   and left to reconciliation ([`Ingested::LeftToReconciliation`]), which compares the
//!   provider's PaymentIntents with the ledger and has the saga cancel a stray authorization.
//!   A capture claimed while the saga's capture request is outstanding (order `confirming`) — usually the capture's own webhook,
//!   milliseconds ahead of the payment worker's record of the answer — is kept as a capture
//!   claim in the same transaction instead (`capture_outstanding`, [`Ingested::AwaitingCapture`]):
//!   the expiry worker's sweep settles it once [`stripe_events::CAPTURE_CLAIM_GRACE_S`] have
//!   passed, and asks for the re-fetch only when the ledger still does not record the capture
//!   (the capture command may have been dead-lettered);
//! - **early**: an event whose PaymentIntent names no order (no payment row, no metadata) is
//!   kept as pending and re-derived from Stripe once the payment row exists;
//! - **disputes**: `charge.dispute.created` / `.closed` lead to a `DisputeRefreshRequested`
//!   (the payment worker retrieves the dispute) unless the ledger records its status already;
//! - **an authorization in time**: an authorization claim for the order's current
//!   PaymentIntent that agrees with the ledger protects the order's live hold in the same
//!   transaction (`holds::protect_authorized`, case C19), so neither the re-fetch's lag nor
//!   the saga's costs the buyer the seats; a refuting re-fetch clears the protection;
//! - **unknown order**: an event whose metadata names an order this ledger does not have (lost
//!   with a fenced region's unreplicated commits, design §15) is recorded and ignored;
//!   `reconcile --fix` cancels or refunds its PaymentIntent;
//! - **stale**: an event for a PaymentIntent that is not the order's current one is recorded
//!   and ignored — except an authorization, which is checked the same way and then cancelled
//!   by the saga (nobody may keep a buyer's funds reserved for nothing).
//!
//! Ingestion runs in the span `crate::spans::webhook_span` makes: in the order's trace when
//! the PaymentIntent's metadata carries the `traceparent` the payment worker put there, so
//! the `PaymentIntentRefreshRequested` it commits continues that trace (see `crate::spans`).
//!
//! Fault points: `webhook.before_commit`, `webhook.after_commit` (committed, not answered:
//! Stripe redelivers and the duplicate is acknowledged without effect).

use boxoffice_domain::HoldPolicy;
use boxoffice_domain::{Envelope, OrderId, OrderStatus, PaymentIntentStatus, PurchaseEvent};
use boxoffice_payments::webhook::Event;
use boxoffice_store::{holds, outbox, payments, stripe_events, StoreError, Tx};
use serde_json::Value;
use sqlx::PgPool;

/// The event type by which Stripe reports an authorization (manual capture).
const AUTHORIZATION: &str = "payment_intent.amount_capturable_updated";

/// The event types this endpoint subscribes to (Stripe's `enabled_events`); anything else
/// that arrives is recorded and acknowledged.
pub const HANDLED_EVENTS: [&str; 7] = [
    "payment_intent.amount_capturable_updated",
    "payment_intent.succeeded",
    "payment_intent.payment_failed",
    "payment_intent.canceled",
    "charge.refunded",
    "charge.dispute.created",
    "charge.dispute.closed",
];

/// What happened to a verified event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ingested {
    /// First delivery; the ledger already records its claim, or it is an event we do not act on.
    Recorded,
    /// Seen before: acknowledged, nothing written.
    Duplicate,
    /// Its PaymentIntent is not known yet: kept until the payment row exists.
    Pending,
    /// It claims news: a re-fetch of the PaymentIntent is queued, and the provider's answer
    /// is what the saga acts on.
    Refresh,
    /// It claims news about a PaymentIntent whose re-fetch another claim asked for moments
    /// ago and the payment worker has not made yet: that re-fetch, which asks the provider
    /// after this claim arrived, covers it ([`stripe_events::ask_refetch`]).
    Coalesced,
    /// It claims the capture the saga asked for, whose answer the ledger does not record
    /// yet: kept as a capture claim, which the ledger settles half a minute later, asking the
    /// provider only if the capture is still unrecorded then
    /// ([`stripe_events::settle_capture_claims`]).
    AwaitingCapture,
    /// It concerns a PaymentIntent that is not the order's current one: recorded, ignored.
    Stale,
    /// Its re-fetch would be over budget: it names an object the ledger does not record for
    /// its order (a PaymentIntent that is not the order's, or a dispute) after the order's
    /// claims of that kind spent their budget ([`stripe_events::spend_uncovered_refetch`]), or
    /// it is about the order's own PaymentIntent after the claims about it asked for
    /// [`stripe_events::REFETCHES_PER_PAYMENT_INTENT`] re-fetches this hour
    /// ([`stripe_events::RefetchAsk::OverBudget`]). Recorded, not re-fetched, and it protects
    /// nothing (no re-fetch will check it): an authorization it reports is found by the
    /// hold's provider check, asked once as the hold reaches its end and not budgeted; the
    /// hold's expiry cancels an authorization nobody confirmed, and reconciliation, which
    /// reads the provider's PaymentIntents, finds the rest.
    LeftToReconciliation,
    /// It names an order this ledger does not have (one lost with a fenced region's
    /// unreplicated commits, or another deployment's): recorded, ignored; reconciliation
    /// releases the intent's money ([`boxoffice_store::region`], design §15).
    UnknownOrder,
}

impl Ingested {
    fn label(self) -> &'static str {
        match self {
            Ingested::Recorded => "recorded",
            Ingested::Duplicate => "duplicate",
            Ingested::Pending => "pending",
            Ingested::Refresh => "refresh",
            Ingested::Coalesced => "coalesced",
            Ingested::AwaitingCapture => "awaiting_capture",
            Ingested::Stale => "stale",
            Ingested::UnknownOrder => "unknown_order",
            Ingested::LeftToReconciliation => "left_to_reconciliation",
        }
    }
}

/// Why ingestion failed (the endpoint answers 5xx and Stripe redelivers).
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    /// The database failed; nothing was committed.
    #[error("database error")]
    Db(#[from] sqlx::Error),
    /// A fault point fired (`webhook.before_commit` / `webhook.after_commit`).
    #[error(transparent)]
    Fault(#[from] boxoffice_faults::Injected),
    /// A ledger row contradicted its own rules (an unknown status); nothing was committed.
    #[error(transparent)]
    Ledger(StoreError),
    /// A signed event whose ids no Stripe object has (empty, longer than [`MAX_ID_LEN`] bytes,
    /// or with a character other than an ASCII letter, digit or underscore; an event type may
    /// also have dots): nothing is written.
    #[error("malformed Stripe event: {0}")]
    Malformed(&'static str),
    /// The event's committer is gone (the process is stopping) or its batch panicked: nothing
    /// of it was written.
    #[error("webhook ingress is stopping")]
    Stopped,
}

fn store_error(e: StoreError) -> IngestError {
    match e {
        StoreError::Db(e) => IngestError::Db(e),
        other => IngestError::Ledger(other),
    }
}

/// The longest Stripe id (event, PaymentIntent, dispute) or event type accepted, bytes.
/// Stripe's are far shorter; a longer one is not Stripe's.
pub const MAX_ID_LEN: usize = 255;

/// A Stripe object id: 1 to [`MAX_ID_LEN`] ASCII letters, digits and underscores (`pi_3Mt…`,
/// `evt_…`, `dp_…`). Anything else is not Stripe's, and some of it is not a path segment
/// either (`.` and `..` would turn a retrieve into a list call).
fn well_formed_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_ID_LEN && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// A Stripe event type: 1 to [`MAX_ID_LEN`] ASCII letters, digits, underscores and dots
/// (`payment_intent.succeeded`).
fn well_formed_type(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_ID_LEN
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
}

/// Refuses a signed event whose ids no Stripe object has, before anything is written.
fn check_ids(event: &Event) -> Result<(), IngestError> {
    let object = &event.data.object;
    if !well_formed_id(&event.id) || !well_formed_type(&event.r#type) {
        return Err(IngestError::Malformed("event id or type"));
    }
    if payment_intent_id(&event.r#type, object).is_some_and(|p| !well_formed_id(&p))
        || dispute_id(&event.r#type, object).is_some_and(|d| !well_formed_id(&d))
    {
        return Err(IngestError::Malformed("object id"));
    }
    Ok(())
}

/// What every answered event passes once its transaction committed: the fault point
/// `webhook.after_commit` (committed, not answered) and the outcome's count.
fn acknowledged(outcome: Ingested) -> Result<Ingested, IngestError> {
    boxoffice_faults::check("webhook.after_commit")?;
    metrics::counter!("boxoffice_stripe_webhooks_total", "outcome" => outcome.label()).increment(1);
    Ok(outcome)
}

/// One event in a transaction of its own (a duplicate's, which wrote nothing, rolled back),
/// waiting at most `lock_wait` for a row lock when given.
async fn ingest_alone(
    pool: &PgPool,
    event: &Event,
    policy: &HoldPolicy,
    lock_wait: Option<std::time::Duration>,
) -> Result<Ingested, IngestError> {
    let mut tx = pool.begin().await?;
    if let Some(wait) = lock_wait {
        sqlx::query(&format!("SET LOCAL lock_timeout = {}", wait.as_millis().max(1)))
            .execute(&mut *tx)
            .await?;
    }
    let mut next = Continuations::default();
    let outcome = ingest_in(&mut tx, event, policy, &mut next).await?;
    if outcome == Ingested::Duplicate {
        tx.rollback().await?;
        return Ok(outcome);
    }
    next.write(&mut tx).await?;
    boxoffice_faults::check("webhook.before_commit")?;
    tx.commit().await?;
    Ok(outcome)
}

/// What the events of one transaction lead to beyond their own rows, written together
/// before its commit ([`Continuations::write`]: one statement each for a whole batch).
#[derive(Default)]
struct Continuations {
    /// The facts asked for, each with its event's trace context.
    facts: Vec<outbox::Traced>,
    /// Captures claimed while the saga's capture was outstanding, kept for the ledger to
    /// settle ([`stripe_events::settle_capture_claims`]).
    capture_claims: Vec<stripe_events::CaptureClaim>,
}

impl Continuations {
    /// Writes the facts to the outbox and keeps the capture claims, in `tx`.
    async fn write(&self, tx: &mut Tx<'_>) -> Result<(), sqlx::Error> {
        outbox::insert_traced(tx, &self.facts).await?;
        stripe_events::await_capture(tx, &self.capture_claims).await
    }
}

/// Records `event` (ids already checked) in `tx`, and what it leads to: its rows' changes in
/// `tx`, the fact it asks for (with the current span's trace context) or the capture claim it
/// leaves to the ledger pushed to `next`, which the caller writes in `tx`
/// ([`Continuations::write`]) and commits. A duplicate writes nothing and pushes nothing.
async fn ingest_in(
    tx: &mut Tx<'_>,
    event: &Event,
    policy: &HoldPolicy,
    next: &mut Continuations,
) -> Result<Ingested, IngestError> {
    let object = &event.data.object;
    let pi = payment_intent_id(&event.r#type, object);
    let order = match order_id(object) {
        Some(o) => Some(o),
        None => match &pi {
            Some(pi) => payments::order_for_intent(&mut **tx, pi).await?,
            None => None,
        },
    };
    let handled = HANDLED_EVENTS.contains(&event.r#type.as_str());
    // The event's row, and for a handled claim about an order the order and its payment as
    // they stand, in one statement.
    let (new, known) = match (order, pi.as_deref()) {
        (Some(order), Some(_)) if handled => {
            stripe_events::record_with_order(tx, &event.id, &event.r#type, pi.as_deref(), order)
                .await
                .map_err(store_error)?
        }
        _ => (stripe_events::record(tx, &event.id, &event.r#type, pi.as_deref(), order).await?, None),
    };
    if !new {
        return Ok(Ingested::Duplicate);
    }
    let mut outcome = Ingested::Recorded;
    match (order, pi.as_deref()) {
        (Some(order), Some(pi)) if handled => {
            if let Some(k) = &known {
                tracing::Span::current().record("correlation_id", tracing::field::display(k.correlation_id));
            }
            let Some(known) = known else {
                // No saga step exists for an order the ledger never had: a re-fetch would only
                // produce facts nobody can apply.
                tracing::warn!(stripe.event_id = %event.id, stripe.event_type = %event.r#type, order.id = %order,
                    "webhook names an order this ledger does not have: recorded, ignored");
                return Ok(Ingested::UnknownOrder);
            };
            let local = known.payment.as_ref();
            match judge(&event.r#type, object, local, known.status, known.amount_minor, pi) {
                Verdict::Known => {}
                Verdict::Stale => {
                    tracing::warn!(stripe.event_id = %event.id, stripe.event_type = %event.r#type, order.id = %order,
                        "webhook for a PaymentIntent that is not the order's current one: ignored");
                    outcome = Ingested::Stale;
                }
                Verdict::Verify(reason) => {
                    let current = local.is_some_and(|p| p.payment_intent_id == pi);
                    let dispute = dispute_id(&event.r#type, object);
                    // A claim naming an object the ledger does not record for the order (a
                    // PaymentIntent that is not its current one, or a dispute) names one of its
                    // own, which no pending re-fetch covers: the order's budget bounds them.
                    if (!current || dispute.is_some())
                        && !stripe_events::spend_uncovered_refetch(tx, order).await?
                    {
                        return Ok(Ingested::LeftToReconciliation);
                    }
                    if reason != UNVERIFIED_CLAIM && reason != CAPTURE_OUTSTANDING {
                        tracing::warn!(stripe.event_id = %event.id, stripe.event_type = %event.r#type, order.id = %order,
                            reason, "webhook contradicts the ledger: asking the provider");
                    }
                    metrics::counter!("boxoffice_webhook_claims_verified_total", "reason" => reason)
                        .increment(1);
                    if reason == CAPTURE_OUTSTANDING {
                        // Nearly always the capture's own webhook, milliseconds ahead of the
                        // payment worker's record of the answer: the ledger settles it later,
                        // and asks the provider only if the capture is still unrecorded then.
                        next.capture_claims.push(stripe_events::CaptureClaim {
                            stripe_event_id: event.id.clone(),
                            order_id: order,
                            payment_intent_id: pi.to_owned(),
                        });
                        return Ok(Ingested::AwaitingCapture);
                    }
                    outcome = Ingested::Refresh;
                    // One re-fetch per PaymentIntent and order at a time, and a bounded number
                    // an hour: a claim that a pending one for its order covers asks nothing,
                    // and one past the budget is left (with the signing secret, each forged
                    // event id would otherwise be a provider call).
                    let ask = match dispute {
                        Some(_) => stripe_events::RefetchAsk::Ask,
                        None => stripe_events::ask_refetch(tx, pi, order).await?,
                    };
                    if ask == stripe_events::RefetchAsk::OverBudget {
                        // No re-fetch will check it, so it protects nothing: an authorization
                        // it reports is found by the hold's provider check at the hold's end.
                        return Ok(Ingested::LeftToReconciliation);
                    }
                    if event.r#type == AUTHORIZATION && current && reason == UNVERIFIED_CLAIM {
                        // Case C19: reported while the hold is live, so our lag (the re-fetch,
                        // the saga) must not cost the buyer the seats. The re-fetch, asked or
                        // pending, confirms the claim or clears the protection.
                        holds::protect_authorized(tx, order, policy, holds::Report::Claim).await?;
                    }
                    let fact = match dispute {
                        Some(dispute_id) => PurchaseEvent::DisputeRefreshRequested {
                            order_id: order,
                            payment_intent_id: pi.to_owned(),
                            dispute_id,
                        },
                        None if ask == stripe_events::RefetchAsk::Coalesced => {
                            return Ok(Ingested::Coalesced)
                        }
                        None => PurchaseEvent::PaymentIntentRefreshRequested {
                            order_id: order,
                            payment_intent_id: pi.to_owned(),
                            reason: reason.to_owned(),
                        },
                    };
                    next.facts.push(outbox::Traced::here(Envelope::new(
                        order,
                        &fact,
                        known.correlation_id,
                        None,
                    )));
                }
            }
        }
        (None, Some(_)) if handled => {
            // Early: the payment worker has not committed the payment row. Keep the event;
            // the fact is re-derived from Stripe when the row is written.
            stripe_events::mark_pending(tx, &event.id).await?;
            outcome = Ingested::Pending;
        }
        _ => {}
    }
    Ok(outcome)
}

/// The most events [`Ingress`] records in one transaction by default
/// (`webhook_batch_max`).
pub const DEFAULT_BATCH_MAX: usize = 32;

/// Group commit of webhook ingress: verified events, recorded several to a transaction.
///
/// Each connection of the webhook pool has one committer. The committer whose turn it is
/// waits for an event. While another committer's batch is in flight (its batch
/// transactions, not the events it records alone afterwards), it gathers the events that
/// arrive meanwhile, until one of those batches ends, `batch_max` are gathered, or
/// [`GATHER_BOUND`] has passed, whichever is first (a batch that begins with an event
/// recorded in a batch of its own, below, gathers nothing). Then it records them in one
/// transaction and commits. At rest an event has a transaction of its own at once; under load one
/// transaction's `BEGIN`, `COMMIT` and commit-time region checks serve several events. A
/// batch is also bounded by the webhook requests a process lets in at once (64, and
/// `webhook_max_in_flight_per_ip` per sender).
///
/// What a batch holds, and in which order:
/// - **one event per order**: an event about the same order as one in the batch (the order
///   its metadata names, or the same PaymentIntent) waits for a later batch, which may
///   commit on another connection before or after this one. So an order's steps stay one
///   transaction each (the order timeline tells them apart), and a redelivery is never in the
///   batch of its first delivery. An event whose metadata names no order (a dispute's or a
///   refund's, or another integration's) has its order looked up inside the transaction,
///   from its PaymentIntent, so it is recorded in a batch of its own;
/// - sorted by (the order its metadata names, the event id), so two batches take the rows of
///   the same orders in the same order.
///
/// What a batch may not change, and why it does not:
/// - **once per event (invariant 4)**: the event's `stripe_events` row is its dedupe in every
///   transaction, batched or not; a redelivery finds it and is a [`Ingested::Duplicate`].
/// - **one event's trouble is its own**: a batch waits at most [`BATCH_LOCK_TIMEOUT_MS`] for any
///   row lock. A batch whose transaction fails commits nothing. When one event's statement
///   failed it (a lock held elsewhere, a deadlock, a bad row), that event is set aside and
///   the others are batched again, up to [`BATCH_ATTEMPTS`] tries; what is left then, and
///   every event of a batch whose commit failed, is recorded one by one, and the events set
///   aside after all of them, each waiting for a row lock no longer than its request waits.
///   An event recorded alone is rolled back if its request is gone meanwhile (unless its
///   statement or commit was already sent); one whose request is gone before its batch
///   starts is not recorded. Stripe delivers both again.
/// - **answers follow commits**: each request is answered after the transaction that
///   recorded its event committed, with that event's outcome, or with the error of the
///   transaction that failed it. A request that gave up while its transaction committed
///   (answered 503) may find its event recorded: Stripe's redelivery is a duplicate.
/// - **the fault points**: `webhook.before_commit` is checked once per transaction (a fired
///   fault fails every event of it, nothing committed, as in a crash before the commit;
///   duplicates in a batch too); `webhook.after_commit` once per answered event.
/// - **what an event leads to** is decided by the same statements as when it is recorded
///   alone, in the span of its own request (its trace, and its `traceparent` on the facts it
///   writes). The facts of all its events go to the outbox in one statement before the
///   commit, in the batch's order, each with its own event's `traceparent`.
#[derive(Clone)]
pub struct Ingress {
    jobs: tokio::sync::mpsc::Sender<Job>,
    answer_within: std::time::Duration,
}

/// The longest a committer gathers events behind another committer's transaction before it
/// starts its own.
pub const GATHER_BOUND: std::time::Duration = std::time::Duration::from_millis(20);

/// How long a statement of a batch waits for a row lock before the batch gives up on the
/// event that waits (`lock_timeout`), ms: well under the request's `webhook_timeout_ms`, so
/// a lock held elsewhere delays the others of the batch by about this much.
pub const BATCH_LOCK_TIMEOUT_MS: u64 = 250;

struct Job {
    event: Event,
    /// The order its metadata names (nil: none).
    order: uuid::Uuid,
    /// The PaymentIntent it is about, if any.
    payment_intent: Option<String>,
    /// When its request stops waiting for the answer.
    deadline: tokio::time::Instant,
    span: tracing::Span,
    reply: tokio::sync::oneshot::Sender<Result<Ingested, IngestError>>,
}

impl Job {
    /// Whether `self` and `other` may be about the same order: the order their metadata
    /// names, or the PaymentIntent they are about. An event whose metadata names no order
    /// may be about any order (its order is found from its PaymentIntent inside the
    /// transaction), so it shares a batch with no other event.
    fn same_order(&self, other: &Job) -> bool {
        self.order.is_nil()
            || other.order.is_nil()
            || self.order == other.order
            || (self.payment_intent.is_some() && self.payment_intent == other.payment_intent)
    }
}

/// The committers' queue: the channel, and the events a batch left for the next one (a
/// second event of an order it holds).
struct Queue {
    rx: tokio::sync::mpsc::Receiver<Job>,
    carried: std::collections::VecDeque<Job>,
}

/// What the committers of one process share: the queue (its lock is the turn to wait for
/// events) and the count of transactions in flight, with a wake-up when one ends.
struct Committers {
    queue: tokio::sync::Mutex<Queue>,
    in_flight: std::sync::atomic::AtomicUsize,
    ended: tokio::sync::Notify,
}

/// One batch in flight; counted until dropped.
struct InFlight<'a>(&'a Committers);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        self.0.ended.notify_waiters();
    }
}

impl Ingress {
    /// Starts one committer per connection of `pool` (at least one), each recording at most
    /// `batch_max` (≥ 1; 1: one transaction per event) events per transaction, for requests
    /// that wait `answer_within` for their answer (`webhook_timeout_ms`). Needs a Tokio
    /// runtime; the committers stop when every clone of this handle is dropped.
    pub fn start(
        pool: PgPool,
        policy: HoldPolicy,
        batch_max: usize,
        answer_within: std::time::Duration,
    ) -> Self {
        let batch_max = batch_max.max(1);
        let committers = pool.options().get_max_connections().max(1) as usize;
        let (jobs, rx) = tokio::sync::mpsc::channel(committers * batch_max * 2);
        let shared = std::sync::Arc::new(Committers {
            queue: tokio::sync::Mutex::new(Queue { rx, carried: Default::default() }),
            in_flight: std::sync::atomic::AtomicUsize::new(0),
            ended: tokio::sync::Notify::new(),
        });
        for _ in 0..committers {
            let (pool, shared) = (pool.clone(), shared.clone());
            tokio::spawn(async move {
                while let Some((batch, in_flight)) = next_batch(&shared, batch_max).await {
                    // A panic costs only its batch (its requests answer 503 and Stripe
                    // delivers again), not the committer.
                    let done = std::panic::AssertUnwindSafe(commit_batch(&pool, &policy, batch, in_flight));
                    if futures::FutureExt::catch_unwind(done).await.is_err() {
                        metrics::counter!("boxoffice_webhook_batches_panicked_total").increment(1);
                        tracing::error!("webhook batch panicked: its events are answered 503");
                    }
                }
            });
        }
        Self { jobs, answer_within }
    }

    /// Events handed to this process's committers and not yet taken from the channel.
    pub fn waiting(&self) -> usize {
        self.jobs.max_capacity() - self.jobs.capacity()
    }

    /// Records a signature-checked Stripe event and what it leads to, with the other events
    /// gathered at the time, and answers once their transaction committed: nothing, a
    /// re-fetch, or pending, as [`Ingested`] says.
    ///
    /// # Errors
    /// [`IngestError::Malformed`] before anything is written; the event's own error, or that
    /// of the batch it was in, otherwise (nothing of the event committed, but for
    /// `webhook.after_commit`); [`IngestError::Stopped`] when the committers are gone or the
    /// event's batch panicked.
    pub async fn ingest(&self, event: Event) -> Result<Ingested, IngestError> {
        check_ids(&event)?;
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job = Job {
            order: order_id(&event.data.object).map_or(uuid::Uuid::nil(), |o| o.0),
            payment_intent: payment_intent_id(&event.r#type, &event.data.object),
            deadline: tokio::time::Instant::now() + self.answer_within,
            event,
            span: tracing::Span::current(),
            reply,
        };
        self.jobs.send(job).await.map_err(|_| IngestError::Stopped)?;
        let outcome = answer.await.map_err(|_| IngestError::Stopped)??;
        acknowledged(outcome)
    }
}

/// The next batch (see [`Ingress`]), counted in flight. None when every sender is gone.
async fn next_batch(c: &Committers, max: usize) -> Option<(Vec<Job>, InFlight<'_>)> {
    use std::sync::atomic::Ordering;
    let mut guard = c.queue.lock().await;
    let queue = &mut *guard;
    let first = match queue.carried.pop_front() {
        Some(job) => job,
        None => queue.rx.recv().await?,
    };
    let mut batch = vec![first];
    // An event of an order already in the batch waits for the next one.
    let add = |batch: &mut Vec<Job>, carried: &mut std::collections::VecDeque<Job>, job: Job| {
        if batch.iter().any(|j| j.same_order(&job)) {
            carried.push_back(job);
        } else {
            batch.push(job);
        }
    };
    // A batch takes no more once it holds `max` events, or an event that shares a batch
    // with no other ([`Job::same_order`]): it does not wait to gather then.
    let full = |batch: &[Job]| batch.len() >= max || batch[0].order.is_nil();
    let mut taken = std::mem::take(&mut queue.carried);
    while !full(&batch) {
        let Some(job) = taken.pop_front() else { break };
        add(&mut batch, &mut queue.carried, job);
    }
    queue.carried.extend(taken);
    // Every event already waiting, until the batch is full.
    let take_waiting = |batch: &mut Vec<Job>, queue: &mut Queue| {
        while !full(batch) {
            match queue.rx.try_recv() {
                Ok(job) => add(batch, &mut queue.carried, job),
                Err(_) => break,
            }
        }
    };
    let deadline = tokio::time::Instant::now() + GATHER_BOUND;
    loop {
        take_waiting(&mut batch, queue);
        let ended = c.ended.notified();
        tokio::pin!(ended);
        ended.as_mut().enable();
        if full(&batch) || c.in_flight.load(Ordering::Acquire) == 0 {
            break;
        }
        tokio::select! {
            // A transaction ended: take what came meanwhile and go.
            _ = &mut ended => {
                take_waiting(&mut batch, queue);
                break;
            }
            job = queue.rx.recv() => match job {
                Some(job) => add(&mut batch, &mut queue.carried, job),
                None => break,
            },
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    c.in_flight.fetch_add(1, Ordering::AcqRel);
    drop(guard);
    batch.sort_by(|a, b| (a.order, a.event.id.as_str()).cmp(&(b.order, b.event.id.as_str())));
    Some((batch, InFlight(c)))
}

/// Why a batch's transaction failed: the event whose statement failed (None: the commit or
/// the fault point), and the error.
type BatchFailure = (Option<usize>, IngestError);

/// `batch` in one transaction, each row lock waited for at most [`BATCH_LOCK_TIMEOUT_MS`].
async fn record_together(
    pool: &PgPool,
    policy: &HoldPolicy,
    batch: &[Job],
) -> Result<Vec<Ingested>, BatchFailure> {
    use tracing::Instrument;
    let mut tx = pool.begin().await.map_err(|e| (None, e.into()))?;
    sqlx::query(&format!("SET LOCAL lock_timeout = {BATCH_LOCK_TIMEOUT_MS}"))
        .execute(&mut *tx)
        .await
        .map_err(|e| (None, e.into()))?;
    let mut outcomes = Vec::with_capacity(batch.len());
    let mut next = Continuations::default();
    for (i, job) in batch.iter().enumerate() {
        let outcome = ingest_in(&mut tx, &job.event, policy, &mut next)
            .instrument(job.span.clone())
            .await
            .map_err(|e| (Some(i), e))?;
        outcomes.push(outcome);
    }
    // Every event's fact, each with its own event's trace context, in one statement, and
    // every capture claim in another.
    next.write(&mut tx).await.map_err(|e| (None, e.into()))?;
    boxoffice_faults::check("webhook.before_commit").map_err(|f| (None, f.into()))?;
    tx.commit().await.map_err(|e| (None, e.into()))?;
    Ok(outcomes)
}

/// How many times a batch is tried, each time without the event whose statement failed the
/// time before, before its remaining events are recorded one by one.
pub const BATCH_ATTEMPTS: usize = 4;

/// Records `batch` (see [`Ingress`]) and answers each event. `in_flight` counts the batch's
/// transactions for the other committers' gathering; events recorded alone afterwards are
/// not counted.
async fn commit_batch(pool: &PgPool, policy: &HoldPolicy, mut batch: Vec<Job>, in_flight: InFlight<'_>) {
    // Events whose statement failed a batch: recorded alone, after every other event.
    let mut set_aside = Vec::new();
    for _ in 0..BATCH_ATTEMPTS {
        // A request gone before its batch starts: not recorded (Stripe delivers it again).
        batch.retain(|j| !j.reply.is_closed());
        if batch.len() <= 1 {
            break;
        }
        metrics::histogram!("boxoffice_webhook_batch_events").record(batch.len() as f64);
        match record_together(pool, policy, &batch).await {
            Ok(outcomes) => {
                for (job, outcome) in batch.drain(..).zip(outcomes) {
                    let _ = job.reply.send(Ok(outcome));
                }
                break;
            }
            Err((_, IngestError::Fault(f))) => {
                for job in batch.drain(..) {
                    let _ = job.reply.send(Err(IngestError::Fault(f.clone())));
                }
                break;
            }
            Err((failed, e)) => {
                metrics::counter!("boxoffice_webhook_batches_failed_total").increment(1);
                match failed {
                    Some(i) => {
                        tracing::info!(events = batch.len(), stripe.event_id = %batch[i].event.id,
                            error = %crate::problem::ErrorChain(&e),
                            "webhook batch failed on one event: the others are batched again, it is recorded alone after them");
                        set_aside.push(batch.remove(i));
                    }
                    None => {
                        tracing::info!(events = batch.len(), error = %crate::problem::ErrorChain(&e),
                            "webhook batch failed: its events are recorded one by one");
                        break;
                    }
                }
            }
        }
    }
    drop(in_flight);
    for job in batch {
        record_alone(pool, policy, job, false).await;
    }
    for job in set_aside {
        record_alone(pool, policy, job, true).await;
    }
}

/// One event in a transaction of its own, rolled back if its request is gone meanwhile (a
/// statement already sent runs on until it ends; a commit already sent may still commit, and
/// Stripe's redelivery is then a duplicate). `bounded` (an event that failed a batch): it
/// waits for a row lock no longer than its request waits for the answer.
async fn record_alone(pool: &PgPool, policy: &HoldPolicy, mut job: Job, bounded: bool) {
    use tracing::Instrument;
    let left = job.deadline.saturating_duration_since(tokio::time::Instant::now());
    if job.reply.is_closed() || (bounded && left.is_zero()) {
        return;
    }
    let lock_wait = bounded.then_some(left);
    let outcome = tokio::select! {
        outcome = ingest_alone(pool, &job.event, policy, lock_wait).instrument(job.span.clone()) => outcome,
        () = job.reply.closed() => return,
    };
    let _ = job.reply.send(outcome);
}

/// The reason sent with a claim that brings news the ledger has not recorded (every claim is
/// checked with the provider before it has any effect, case C16).
const UNVERIFIED_CLAIM: &str = "webhook_claim";

/// The reason sent with a capture claimed while the saga's capture request is outstanding.
const CAPTURE_OUTSTANDING: &str = boxoffice_domain::events::refresh_reason::CAPTURE_OUTSTANDING;

/// What to do with a handled event, given the ledger's view.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// The ledger already records what it claims: nothing to do.
    Known,
    /// It is about another PaymentIntent than the order's current one (and is not an
    /// authorization, which must be cancelled): ignore.
    Stale,
    /// Ask the provider what is true (`PaymentIntentRefreshRequested`); the reason is logged,
    /// counted and sent along.
    Verify(&'static str),
}

/// A webhook is a claim: signed by the provider's key, but it may be late, reordered, or
/// forged by whoever holds the secret. Only a claim the ledger already records is taken as
/// is (and then has nothing to do); every other one — the next step of the saga included —
/// is checked by re-fetching the PaymentIntent, and the saga acts on the provider's answer.
fn judge(
    event_type: &str,
    object: &Value,
    local: Option<&payments::PaymentRow>,
    order_status: OrderStatus,
    order_amount: i64,
    pi: &str,
) -> Verdict {
    if let Some(p) = local {
        if p.payment_intent_id != pi {
            // A stray authorization is checked too: the saga cancels it once confirmed.
            return if event_type == "payment_intent.amount_capturable_updated" {
                Verdict::Verify("not_current_payment_intent")
            } else {
                Verdict::Stale
            };
        }
    }
    let amount_field = match event_type {
        "payment_intent.amount_capturable_updated" => Some("amount_capturable"),
        "payment_intent.succeeded" => Some("amount_received"),
        _ => None,
    };
    if let Some(field) = amount_field {
        if amount(object, field) != order_amount {
            return Verdict::Verify("amount_mismatch");
        }
    }
    let Some(p) = local else { return Verdict::Verify(UNVERIFIED_CLAIM) };
    let contradicts = match event_type {
        "payment_intent.amount_capturable_updated" | "payment_intent.succeeded" => {
            p.status == PaymentIntentStatus::Canceled
        }
        "payment_intent.canceled" | "payment_intent.payment_failed" => {
            p.status == PaymentIntentStatus::Succeeded
        }
        "charge.refunded" => amount(object, "amount_refunded") > p.amount_captured_minor.max(p.amount_minor),
        _ => false,
    };
    if contradicts {
        return Verdict::Verify("status_contradicts_ledger");
    }
    let known = match event_type {
        "charge.dispute.created" | "charge.dispute.closed" => {
            p.dispute_status.as_deref() == object.get("status").and_then(Value::as_str)
        }
        "payment_intent.amount_capturable_updated" => {
            matches!(p.status, PaymentIntentStatus::RequiresCapture | PaymentIntentStatus::Succeeded)
        }
        "payment_intent.succeeded" => {
            p.status == PaymentIntentStatus::Succeeded
                && p.amount_captured_minor >= amount(object, "amount_received")
        }
        "payment_intent.canceled" => p.status == PaymentIntentStatus::Canceled,
        "charge.refunded" => amount(object, "amount_refunded") <= p.amount_refunded_minor,
        _ => false,
    };
    if known {
        Verdict::Known
    } else if event_type == "payment_intent.succeeded"
        && p.status == PaymentIntentStatus::RequiresCapture
        && order_status == OrderStatus::Confirming
    {
        // The saga asked for this capture (`confirming` from the confirmation, whose
        // `OrderConfirmed` is the capture request, until the capture's answer is recorded;
        // a `CaptureRequested` after it in the older form). Still checked — the
        // capture command may never record it (dead-lettered) — but the re-fetch may stop at
        // the ledger once the capture is recorded there.
        Verdict::Verify(CAPTURE_OUTSTANDING)
    } else {
        Verdict::Verify(UNVERIFIED_CLAIM)
    }
}

/// The dispute a `charge.dispute.*` event is about.
fn dispute_id(event_type: &str, object: &Value) -> Option<String> {
    event_type
        .starts_with("charge.dispute.")
        .then(|| object.get("id").and_then(Value::as_str).map(str::to_owned))
        .flatten()
}

fn payment_intent_id(event_type: &str, object: &Value) -> Option<String> {
    let field = if event_type.starts_with("payment_intent.") { "id" } else { "payment_intent" };
    object.get(field).and_then(Value::as_str).map(str::to_owned)
}

fn order_id(object: &Value) -> Option<OrderId> {
    object.pointer("/metadata/order_id").and_then(Value::as_str).and_then(|s| s.parse().ok())
}

fn amount(object: &Value, field: &str) -> i64 {
    object.get(field).and_then(Value::as_i64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payment(status: PaymentIntentStatus) -> payments::PaymentRow {
        payments::PaymentRow {
            order_id: uuid::Uuid::nil(),
            payment_intent_id: "pi_1".into(),
            status,
            amount_minor: 500,
            currency: "usd".into(),
            amount_captured_minor: 0,
            amount_refunded_minor: 0,
            capture_before: None,
            last_error_code: None,
            dispute_id: None,
            dispute_status: None,
        }
    }

    #[test]
    fn only_stripe_shaped_ids_pass() {
        let event = |id: &str, ty: &str, object_id: &str| -> Event {
            let object = if ty.starts_with("charge.dispute.") {
                serde_json::json!({ "id": object_id, "object": "dispute", "payment_intent": "pi_1" })
            } else {
                serde_json::json!({ "id": object_id, "object": "payment_intent" })
            };
            serde_json::from_value(serde_json::json!({
                "id": id, "object": "event", "type": ty, "created": 1, "livemode": false,
                "data": { "object": object }
            }))
            .unwrap()
        };
        let auth = "payment_intent.amount_capturable_updated";
        for ok in [event("evt_1A2b", auth, "pi_3Mt_x9"), event("evt_1", "charge.dispute.created", "dp_1")] {
            assert!(check_ids(&ok).is_ok());
        }
        let long = "p".repeat(MAX_ID_LEN + 1);
        // `.` and `..` would drop out of the request path and make a retrieve a list call.
        for bad_object in
            ["", " ", ".", "..", "pi_1/..", "pi_1?expand[]=x", "pi\u{0}1", long.as_str(), "pi_é"]
        {
            assert!(check_ids(&event("evt_1", auth, bad_object)).is_err(), "{bad_object:?}");
            assert!(
                check_ids(&event("evt_1", "charge.dispute.created", bad_object)).is_err(),
                "{bad_object:?}"
            );
            assert!(check_ids(&event(bad_object, auth, "pi_1")).is_err(), "{bad_object:?}");
        }
        for bad_type in ["", "payment_intent/succeeded", "payment intent.succeeded"] {
            assert!(check_ids(&event("evt_1", bad_type, "pi_1")).is_err(), "{bad_type:?}");
        }
    }

    #[test]
    fn a_capture_claimed_while_the_sagas_capture_is_outstanding_is_checked_with_its_own_reason() {
        let claim = serde_json::json!({ "id": "pi_1", "amount_received": 500 });
        let authorized = payment(PaymentIntentStatus::RequiresCapture);
        let succeeded = "payment_intent.succeeded";
        assert_eq!(
            judge(succeeded, &claim, Some(&authorized), OrderStatus::Confirming, 500, "pi_1"),
            Verdict::Verify(CAPTURE_OUTSTANDING)
        );
        // Before the saga asked for the capture, the claim is news: the provider is asked.
        assert_eq!(
            judge(succeeded, &claim, Some(&authorized), OrderStatus::PaymentRequired, 500, "pi_1"),
            Verdict::Verify(UNVERIFIED_CLAIM)
        );
        // No authorization mirrored (case C16): asked, whatever the order's status.
        let unpaid = payment(PaymentIntentStatus::RequiresPaymentMethod);
        assert_eq!(
            judge(succeeded, &claim, Some(&unpaid), OrderStatus::Confirming, 500, "pi_1"),
            Verdict::Verify(UNVERIFIED_CLAIM)
        );
        // Another amount than the order's is checked, even while the capture is outstanding.
        assert_eq!(
            judge(succeeded, &claim, Some(&authorized), OrderStatus::Confirming, 700, "pi_1"),
            Verdict::Verify("amount_mismatch")
        );
        // Another PaymentIntent than the order's is stale.
        assert_eq!(
            judge(succeeded, &claim, Some(&authorized), OrderStatus::Confirming, 500, "pi_2"),
            Verdict::Stale
        );
    }
}
