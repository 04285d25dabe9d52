//! The purchase saga orchestrator (design §9): consumes the saga's facts and executes what
//! [`boxoffice_domain::saga::decide`] decides — the decision table, with every step's
//! compensation beside it, lives there; this module reads the order's [`Snapshot`] under the
//! ledger's lock order (hold, then order), executes each [`Step`] through the store's
//! transition functions (which refuse any move the status tables do not list) and emits the
//! next facts and commands through the outbox — all in the consumer's inbox transaction.
//! For a run of facts (a shared consumer batch, or a run of facts followed through), the
//! rows of all their orders are locked and read at once before any of them is decided
//! ([`Locked::load_all`]: one statement for the holds and orders, one for the payments); a
//! second fact of an order in a run reads its rows itself when its turn comes, after the
//! first one's effect.
//!
//! The same `apply` runs on the bus (the saga's consumer) and, in a process that runs the
//! saga beside the payment worker, inside the payment worker's transaction that commits the
//! fact (`boxoffice_bus::follow`): the payment worker locks the hold first, so the lock order
//! holds there too.
//!
//! On the bus, every fact is a claim: the runner applies it only when this ledger committed
//! it, and parks one it did not as an `unknown_fact` incident, leaving its id free
//! ([`Handler::verifies`]; invariant 2: a forged `PaymentAuthorized` confirms nothing, and a
//! forged fact of any type that borrows a real one's id does not make it a duplicate).
//!
//! It also runs the capture-deadline sweep (case C09) through the same executor.
//!
//! Duplicate facts (a webhook and a re-fetch both reporting the authorization, invariant 4)
//! find the order already moved and change nothing: state, not message identity, makes the
//! transition happen once.

use async_trait::async_trait;
use boxoffice_bus::{Handler, HandlerError};
use boxoffice_domain::saga::{self, DisputePolicy, HoldSnapshot, IntentMatch, Snapshot, Step};
use boxoffice_domain::{Envelope, EventKind, OrderId, PurchaseEvent, Topic};
use boxoffice_store::holds::HoldRow;
use boxoffice_store::orders::OrderRow;
use boxoffice_store::{holds, orders, outbox, payments, stripe_events, tickets, StoreError, Tx};
use sqlx::PgPool;

/// The saga consumer.
#[derive(Debug, Default, Clone)]
pub struct Saga {
    /// How a confirmation asks for the capture (configuration
    /// `confirmation_fact_requests_capture`; [`saga::CaptureRequest`]).
    pub capture_request: saga::CaptureRequest,
}

/// Consumer name (inbox key, consumer group `ticketing-saga`).
pub const NAME: &str = boxoffice_domain::consumers::SAGA;

#[async_trait]
impl Handler for Saga {
    type Prepared = ();
    type Precheck = ();

    fn name(&self) -> &'static str {
        NAME
    }

    fn wants(&self, kind: EventKind) -> bool {
        saga::FACTS.contains(&kind)
    }

    fn acts_on(&self, event: &PurchaseEvent) -> bool {
        saga::acts_on(event)
    }

    /// Every fact read from the bus.
    fn verifies(&self, _event: &PurchaseEvent) -> bool {
        true
    }

    async fn prepare(&self, _: &Envelope, _: &PurchaseEvent, _: ()) -> Result<(), HandlerError> {
        Ok(())
    }

    type Rows = Option<Locked>;

    /// Every order's hold and order, locked in one statement, and the payment rows of the
    /// facts that name a PaymentIntent in one more ([`Locked::load_all`]).
    async fn lock_rows(
        &self,
        tx: &mut Tx<'_>,
        run: &[(&Envelope, &PurchaseEvent)],
    ) -> Result<Vec<Option<Locked>>, HandlerError> {
        let facts: Vec<&PurchaseEvent> = run.iter().map(|(_, event)| *event).collect();
        Ok(Locked::load_all(tx, &facts).await?)
    }

    async fn apply(
        &self,
        tx: &mut Tx<'_>,
        env: &Envelope,
        event: &PurchaseEvent,
        _: (),
        rows: Option<Locked>,
    ) -> Result<Vec<Envelope>, HandlerError> {
        apply_locked(tx, env, event, rows, self.capture_request).await
    }
}

/// The rows one decision works on, locked in the ledger's order (hold, then order).
#[derive(Debug)]
pub struct Locked {
    hold: Option<HoldRow>,
    order: OrderRow,
    /// The payment row's PaymentIntent id and status, when recorded.
    payment: Option<payments::PaymentRow>,
    /// The event's dispute policy (read only for dispute facts; `keep` otherwise).
    dispute_policy: DisputePolicy,
}

impl Locked {
    /// `None` when the order does not exist. The payment row is read only `with_payment`: a
    /// fact that names no PaymentIntent (`HoldCreated`) decides without it.
    async fn load(
        tx: &mut Tx<'_>,
        order_id: OrderId,
        with_payment: bool,
    ) -> Result<Option<Locked>, StoreError> {
        let Some((hold, order)) = holds::lock_with_order(tx, order_id).await? else {
            return Ok(None);
        };
        let payment = if with_payment { payments::get(&mut **tx, order_id).await? } else { None };
        Ok(Some(Locked { hold, order, payment, dispute_policy: DisputePolicy::Keep }))
    }

    /// [`Locked::load`] for the facts of a run, in two statements for all of them: every
    /// order's hold and order locked at once, in ascending order id
    /// ([`holds::lock_each_with_order`]), then the payment rows of the orders whose fact names
    /// a PaymentIntent ([`payments::get_all`]). One entry per fact, in `facts`' order; `None`
    /// for an order without a hold (the fact's `apply` then takes [`Locked::load`]'s path,
    /// which reads the order alone) and for a second fact of an order (the first one's
    /// effect may change its rows: it loads them itself when it runs).
    async fn load_all(tx: &mut Tx<'_>, facts: &[&PurchaseEvent]) -> Result<Vec<Option<Locked>>, StoreError> {
        let orders: Vec<OrderId> = facts.iter().map(|f| f.order_id()).collect();
        let pairs = holds::lock_each_with_order(tx, &orders).await?;
        let paying: Vec<OrderId> = facts
            .iter()
            .zip(&pairs)
            .filter(|(f, pair)| pair.is_some() && f.payment_intent_id().is_some())
            .map(|(f, _)| f.order_id())
            .collect();
        let mut payment: std::collections::HashMap<uuid::Uuid, payments::PaymentRow> =
            payments::get_all(&mut **tx, &paying).await?.into_iter().map(|p| (p.order_id, p)).collect();
        Ok(facts
            .iter()
            .zip(pairs)
            .map(|(f, pair)| {
                let (hold, order) = pair?;
                let payment = f.payment_intent_id().and_then(|_| payment.remove(&order.id));
                Some(Locked { hold: Some(hold), order, payment, dispute_policy: DisputePolicy::Keep })
            })
            .collect())
    }

    /// What [`saga::decide`] reads: these rows, as they relate to the fact's PaymentIntent,
    /// and how this saga asks for a capture.
    fn snapshot(&self, payment_intent_id: Option<&str>, capture_request: saga::CaptureRequest) -> Snapshot {
        let intent = match (&self.payment, payment_intent_id) {
            (None, _) => IntentMatch::Unrecorded,
            (Some(p), Some(pi)) if p.payment_intent_id != pi => IntentMatch::Other,
            (Some(_), _) => IntentMatch::Current,
        };
        Snapshot {
            order: self.order.status,
            amount_minor: self.order.amount_minor,
            hold: self.hold.as_ref().map(|h| HoldSnapshot {
                id: boxoffice_domain::HoldId(h.id),
                status: h.status,
                lapsed: h.lapsed,
            }),
            intent,
            payment: self.payment.as_ref().map(|p| p.status.clone()),
            dispute_policy: self.dispute_policy,
            capture_request,
        }
    }
}

/// Applies one saga fact inside `tx` (which already holds the inbox row); returns the facts
/// and commands it emits, for the caller to write to the outbox in `tx`. `rows`: those
/// [`Saga`]'s `lock_rows` locked for the fact in `tx` (`None`: it locks them itself);
/// `capture_request`: how a confirmation asks for the capture.
async fn apply_locked(
    tx: &mut Tx<'_>,
    env: &Envelope,
    event: &PurchaseEvent,
    rows: Option<Locked>,
    capture_request: saga::CaptureRequest,
) -> Result<Vec<Envelope>, HandlerError> {
    let order_id = event.order_id();
    let rows = match rows {
        Some(rows) => Some(rows),
        None => Locked::load(tx, order_id, event.payment_intent_id().is_some()).await?,
    };
    let Some(mut locked) = rows else {
        return Err(HandlerError::permanent(
            "unknown_order",
            anyhow::anyhow!("order {order_id} does not exist"),
        ));
    };
    if event.kind() == EventKind::PaymentDisputed {
        let policy = boxoffice_store::venue::dispute_policy(&mut **tx, locked.order.event_id).await?;
        locked.dispute_policy = DisputePolicy::parse(&policy);
    }
    let pi = event.payment_intent_id();
    let steps = saga::decide(&locked.snapshot(pi, capture_request), event).map_err(|r| {
        HandlerError::permanent(r.code(), anyhow::anyhow!(r.clone()).context(format!("{event:?}")))
    })?;
    let emit = execute(tx, &mut locked, pi.unwrap_or_default(), &steps).await?;
    Ok(emit.iter().map(|e| env.follow(e)).collect())
}

/// Executes `steps` for the locked rows, in order; returns the facts and commands to emit.
/// `pi` is the PaymentIntent the fact is about (payment steps apply to it).
async fn execute(
    tx: &mut Tx<'_>,
    locked: &mut Locked,
    pi: &str,
    steps: &[Step],
) -> Result<Vec<PurchaseEvent>, StoreError> {
    let order_id = OrderId(locked.order.id);
    let mut emit = Vec::new();
    for step in steps {
        match step {
            Step::SetCaptureBefore(when) => payments::set_capture_before(&mut **tx, pi, *when).await?,
            Step::MirrorPayment(update) => {
                payments::transition(tx, pi, update).await?;
            }
            Step::RecordDecline { reason } => {
                payments::record_decline(&mut **tx, pi, reason).await?;
            }
            Step::MoveHold(to) => {
                let hold = locked.hold.as_mut().ok_or_else(|| missing_hold(order_id))?;
                holds::transition(tx, hold, *to).await?;
            }
            Step::ExpireHold => {
                let hold = locked.hold.as_mut().ok_or_else(|| missing_hold(order_id))?;
                // Emits HoldExpired (and the cancel request, once per payment).
                if holds::expire_locked(tx, hold).await? {
                    locked.order.status = boxoffice_domain::OrderStatus::Expired;
                }
                hold.status = boxoffice_domain::HoldStatus::Expired;
            }
            Step::MoveOrder { to, reason } => {
                orders::transition(tx, &mut locked.order, *to, reason.as_deref()).await?;
            }
            Step::CancelAuthorization { payment_intent_id, reason } => {
                emit.extend(cancel_once(tx, locked, payment_intent_id, reason).await?);
            }
            Step::VoidTickets { reason } => {
                let ticket_ids = tickets::void(tx, order_id, reason).await?;
                if !ticket_ids.is_empty() {
                    metrics::counter!("boxoffice_tickets_voided_total", "reason" => *reason)
                        .increment(ticket_ids.len() as u64);
                    emit.push(PurchaseEvent::TicketsVoided {
                        order_id,
                        ticket_ids,
                        reason: (*reason).to_owned(),
                    });
                }
            }
            Step::MirrorDispute { dispute_id, status } => {
                payments::mirror_dispute(&mut **tx, pi, dispute_id, status).await?;
            }
            Step::FlagTicketsDisputed => {
                tickets::flag_disputed(tx, order_id).await?;
            }
            Step::RestoreDisputedTickets => {
                tickets::restore_disputed(tx, order_id, saga::reason::DISPUTE_OPENED).await?;
            }
            Step::Incident { kind, details } => {
                stripe_events::incident(tx, Some(order_id), kind, details.clone()).await?;
            }
            Step::Emit(e) => emit.push(e.clone()),
            Step::Count(name) => metrics::counter!(*name).increment(1),
        }
    }
    Ok(emit)
}

fn missing_hold(order: OrderId) -> StoreError {
    StoreError::Corrupt(format!("order {order} has no hold"))
}

/// The cancel command for authorization `pi`: for the order's recorded PaymentIntent only
/// the first time (one cancel per payment); for any other, or when the payment row is not
/// recorded yet (the webhook overtook the payment worker), emitted anyway — Stripe's
/// idempotency key `cancel:{payment_intent_id}` makes repeats harmless.
async fn cancel_once(
    tx: &mut Tx<'_>,
    locked: &Locked,
    pi: &str,
    reason: &str,
) -> Result<Option<PurchaseEvent>, sqlx::Error> {
    let order_id = OrderId(locked.order.id);
    let cancel = |payment_intent_id: String| PurchaseEvent::AuthorizationCancelRequested {
        order_id,
        payment_intent_id,
        reason: reason.to_owned(),
    };
    match &locked.payment {
        Some(p) if p.payment_intent_id == pi => {
            Ok(payments::request_cancel(&mut **tx, order_id).await?.map(cancel))
        }
        _ => Ok(Some(cancel(pi.to_owned()))),
    }
}

/// Case C09: confirmed orders whose authorization is still uncaptured within `margin_s`
/// seconds of Stripe's capture deadline are given up on purpose rather than left to lapse
/// ([`saga::give_up_before_capture_deadline`]): hold released, order `failed` with
/// `capture_deadline`, an incident, and `AuthorizationCancelRequested`. Returns how many
/// orders were released. Several workers may run this at once (`SKIP LOCKED`).
pub async fn release_lapsing_authorizations(
    pool: &PgPool,
    margin_s: i64,
    limit: i64,
) -> Result<usize, StoreError> {
    let mut tx = pool.begin().await?;
    let due = holds::lock_lapsing_authorizations(&mut tx, margin_s, limit).await?;
    let mut released = 0;
    for due in due {
        let Some(mut locked) = Locked::load(&mut tx, OrderId(due.order_id), true).await? else { continue };
        let steps = saga::give_up_before_capture_deadline(
            &locked.snapshot(None, saga::CaptureRequest::default()),
            &due.payment_intent_id,
        );
        if steps.is_empty() {
            continue; // captured or failed meanwhile
        }
        let emit = execute(&mut tx, &mut locked, &due.payment_intent_id, &steps).await?;
        let facts: Vec<Envelope> = emit
            .iter()
            .map(|e| Envelope::new(OrderId(due.order_id), e, locked.order.correlation_id, None))
            .collect();
        for env in &facts {
            outbox::insert(&mut tx, Topic::Purchase, env).await?;
        }
        released += 1;
    }
    tx.commit().await?;
    if released > 0 {
        metrics::counter!("boxoffice_capture_deadline_releases_total").increment(released as u64);
    }
    Ok(released)
}
