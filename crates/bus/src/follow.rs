//! Following a fact through in the transaction that commits it (design §8, §9).
//!
//! When one process runs several consumers, the step a fact triggers in a consumer that makes
//! no remote call (the saga, the ticket worker) can run in the very transaction that commits
//! the fact, instead of one relay hop, one bus delivery and one transaction later. The payment
//! worker's transaction that records a capture then also moves the order to `paid` (the saga's
//! step) and issues the tickets (the ticket worker's), each decided by the module that owns
//! it ([`Follower`] is that consumer's own `apply`).
//!
//! What stays the same (invariants 4 and 5):
//! - every fact is still written to the outbox, published and delivered to every consumer;
//! - a follower's inbox row `(consumer, event_id)` is written in that transaction (with the
//!   facts, in one statement), as its own consumer would write it, and the envelope names it
//!   in `applied_by`: when the fact reaches the
//!   follower's consumer on the bus, it is acknowledged without a transaction (a consumer of
//!   an older build, which does not read the field, finds the inbox row);
//! - the fault points of a follower are those of its consumer: `{consumer}.before_remote`,
//!   `.after_remote` and `.before_commit` inside the shared transaction,
//!   `.after_commit` and `.before_ack` after its commit ([`Followers::after_commit`]).
//!
//! **Failure isolation.** A follower's failure must not cost the writer its step (a ticket
//! issuance that keeps failing must never hold back recording the capture). When following
//! fails, the caller rolls the whole transaction back and applies the writer's message again
//! without followers (the payment worker's remote call is repeated under its idempotency key):
//! the facts then travel the bus as before and each follower's own consumer applies them, with
//! its retries and dead-letter topic.
//!
//! **Locks.** A follower locks the order's rows in the ledger's order (hold, then order; the
//! saga reads the payment row after them, unlocked: its writers lock the hold first); a writer that writes one of them before its followers run locks the hold first
//! (the payment worker does wherever it writes the payment row), so following adds no lock
//! cycle. A follower's run of facts of several orders locks their rows in one statement, in
//! ascending order id, the order a shared consumer batch applies its messages in.
//! A shared consumer batch follows its facts after every message of the batch was applied,
//! orders in the batch's order-id order.

use crate::consumer::{consumer_span, rows_of, Handler, HandlerError};
use async_trait::async_trait;
use boxoffice_domain::{Envelope, EventKind, PurchaseEvent};
use boxoffice_store::outbox::Traced;
use boxoffice_store::Tx;
use std::sync::Arc;
use tracing::Instrument;

/// Most follower steps one transaction runs: a chain of steps longer than the purchase's
/// (authorization → confirmation; capture → paid → tickets) is left to the bus.
pub const MAX_STEPS: usize = 16;

/// A consumer whose step can run inside another consumer's transaction: one that makes no
/// remote call.
#[async_trait]
pub trait Follower: Send + Sync + 'static {
    /// The consumer's name (its inbox key).
    fn name(&self) -> &'static str;

    /// [`Handler::wants`].
    fn wants(&self, kind: EventKind) -> bool;

    /// [`Handler::acts_on`].
    fn acts_on(&self, event: &PurchaseEvent) -> bool;

    /// The consumer's effects for `run` in `tx` (their inbox rows are written by the caller),
    /// in `run`'s order: first the rows all of them work on, locked and read at once
    /// ([`Handler::lock_rows`], in the caller's span, before any fault point of the run), then
    /// each effect inside its span (the consumer span of its fact) and between the consumer's
    /// fault points `before_remote`, `after_remote` and `before_commit`. Returns, per fact of
    /// `run`, the facts that follow, each stored with its span's trace context.
    async fn apply_all(
        &self,
        tx: &mut Tx<'_>,
        run: &[(&Envelope, &PurchaseEvent, tracing::Span)],
    ) -> Result<Vec<Vec<Traced>>, HandlerError>;
}

#[async_trait]
impl<H: Handler<Prepared = (), Precheck = ()>> Follower for H {
    fn name(&self) -> &'static str {
        Handler::name(self)
    }

    fn wants(&self, kind: EventKind) -> bool {
        Handler::wants(self, kind)
    }

    fn acts_on(&self, event: &PurchaseEvent) -> bool {
        Handler::acts_on(self, event)
    }

    async fn apply_all(
        &self,
        tx: &mut Tx<'_>,
        run: &[(&Envelope, &PurchaseEvent, tracing::Span)],
    ) -> Result<Vec<Vec<Traced>>, HandlerError> {
        let name = Handler::name(self);
        let locking: Vec<(&Envelope, &PurchaseEvent)> =
            run.iter().map(|(env, event, _)| (*env, *event)).collect();
        let rows = rows_of(self, tx, &locking).await?;
        let mut out = Vec::with_capacity(run.len());
        for ((env, event, span), rows) in run.iter().zip(rows) {
            let tx = &mut *tx;
            let emitted = async move {
                boxoffice_faults::check_consumer(name, "before_remote")?;
                self.prepare(env, event, ()).await?;
                boxoffice_faults::check_consumer(name, "after_remote")?;
                let emitted = Handler::apply(self, tx, env, event, (), rows).await?;
                boxoffice_faults::check_consumer(name, "before_commit")?;
                // Stored with the follower's span: the purchase's trace goes on from it.
                Ok::<_, HandlerError>(emitted.into_iter().map(Traced::here).collect::<Vec<_>>())
            }
            .instrument(span.clone())
            .await?;
            out.push(emitted);
        }
        Ok(out)
    }
}

/// The followers of one consumer: the other consumers of this process that make no remote
/// call. Empty: nothing is followed through (each fact waits for its consumer on the bus).
#[derive(Clone, Default)]
pub struct Followers {
    list: Vec<Arc<dyn Follower>>,
    labels: boxoffice_trace::Labels,
}

impl std::fmt::Debug for Followers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.list.iter().map(|x| x.name())).finish()
    }
}

/// The follower steps that ran in one transaction: each follower and the fact it applied.
/// Their inbox rows are written with the facts ([`Followed::inbox_rows`]), and their
/// after-commit fault points fire after the commit ([`Followers::after_commit`]).
#[derive(Debug, Default)]
pub struct Followed(Vec<(&'static str, uuid::Uuid)>);

impl Followed {
    /// How many follower steps ran.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether none ran.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The inbox rows `(consumer, event_id)` of the steps, for
    /// [`boxoffice_store::outbox::insert_traced_with_inbox`] in the same transaction.
    pub fn inbox_rows(&self) -> &[(&'static str, uuid::Uuid)] {
        &self.0
    }
}

impl Followers {
    /// No followers.
    pub fn none() -> Self {
        Self::default()
    }

    /// `handler` follows facts through too. Panics on a handler that calls out: its remote
    /// call would run inside another consumer's transaction.
    pub fn with<H: Handler<Prepared = (), Precheck = ()>>(mut self, handler: Arc<H>) -> Self {
        assert!(
            !handler.calls_out(),
            "{} calls out: it cannot follow inside a transaction",
            Handler::name(&*handler)
        );
        self.list.push(handler);
        self
    }

    /// The labels every follower span carries (region, purchase cell).
    pub fn labelled(mut self, labels: boxoffice_trace::Labels) -> Self {
        self.labels = labels;
        self
    }

    /// The same followers without `consumer` (a consumer never follows its own facts: its
    /// own runner applies what reaches it).
    pub fn without(&self, consumer: &str) -> Self {
        Self {
            list: self.list.iter().filter(|f| f.name() != consumer).cloned().collect(),
            labels: self.labels.clone(),
        }
    }

    /// Whether there is no follower.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Applies, in `tx`, every step the followers take on `facts` and on the facts those
    /// steps emit (breadth first, at most [`MAX_STEPS`]): for each fact and each follower that
    /// acts on it, its fault points up to `before_commit`, its effect inside its own consumer
    /// span, and its name added to the fact's `applied_by`. Returns every fact to write to the
    /// outbox, in order (the given ones first, each step's after the fact it followed), and
    /// the steps that ran, whose inbox rows the caller writes with those facts in `tx`
    /// ([`Followed::inbox_rows`]: every fact followed here was created in this transaction, so
    /// no inbox can hold it yet). On error the caller must roll `tx` back (see the module doc).
    ///
    /// The steps run in that order, a generation of facts at a time; consecutive steps of one
    /// follower on facts of different orders (a batch's captures, say) are one run of
    /// [`Follower::apply_all`], whose rows are locked in one statement. A step on a second
    /// fact of an order already in the run, or of another follower, starts the next run, so
    /// every effect still sees the rows the steps before it left.
    pub async fn follow(
        &self,
        tx: &mut Tx<'_>,
        facts: Vec<Traced>,
    ) -> Result<(Vec<Traced>, Followed), HandlerError> {
        let mut out = Vec::with_capacity(facts.len() + 4);
        let mut followed = Followed::default();
        if self.list.is_empty() {
            return Ok((facts, followed));
        }
        let mut generation = facts;
        while !generation.is_empty() {
            // The generation's steps, in order: (fact, follower), each fact decoded once.
            let mut events: Vec<Option<PurchaseEvent>> = Vec::with_capacity(generation.len());
            let mut steps: Vec<(usize, usize)> = Vec::new();
            for (i, fact) in generation.iter().enumerate() {
                let kind = EventKind::of(&fact.envelope.event_type);
                let taken = followed.len() + steps.len();
                let event = match (kind, taken < MAX_STEPS) {
                    (Some(kind), true) if self.list.iter().any(|f| f.wants(kind)) => {
                        fact.envelope.decode().ok()
                    }
                    _ => None,
                };
                if let Some(event) = &event {
                    for (j, f) in self.list.iter().enumerate() {
                        if followed.len() + steps.len() < MAX_STEPS
                            && f.wants(event.kind())
                            && f.acts_on(event)
                        {
                            steps.push((i, j));
                        }
                    }
                }
                events.push(event);
            }
            // Runs of consecutive steps of one follower on facts of distinct orders.
            let mut emitted: Vec<Vec<Traced>> = Vec::with_capacity(steps.len());
            let mut start = 0;
            while start < steps.len() {
                let follower = steps[start].1;
                let mut orders = std::collections::HashSet::new();
                let mut end = start;
                while end < steps.len()
                    && steps[end].1 == follower
                    && orders.insert(generation[steps[end].0].envelope.aggregate_id)
                {
                    end += 1;
                }
                let f = &self.list[follower];
                let name = f.name();
                let run: Vec<(&Envelope, &PurchaseEvent, tracing::Span)> = steps[start..end]
                    .iter()
                    .map(|&(i, _)| {
                        let env = &generation[i].envelope;
                        let event = events[i].as_ref().expect("a fact with steps was decoded");
                        (env, event, consumer_span(name, env, None, &self.labels))
                    })
                    .collect();
                emitted.extend(f.apply_all(tx, &run).await?);
                drop(run);
                for &(i, _) in &steps[start..end] {
                    let fact = &mut generation[i].envelope;
                    fact.applied_by.push(name.to_owned());
                    followed.0.push((name, fact.event_id));
                    metrics::counter!("boxoffice_consumer_messages_total", "consumer" => name, "outcome" => "Followed")
                        .increment(1);
                }
                start = end;
            }
            // The next generation: each step's facts, in the order of the steps.
            let next: Vec<Traced> = emitted.into_iter().flatten().collect();
            out.append(&mut generation);
            generation = next;
        }
        Ok((out, followed))
    }

    /// The after-commit fault points (`after_commit`, `before_ack`) of the followers that ran
    /// in a transaction that has just committed: an injected failure here is the writer's
    /// failure after its commit (its message is applied again, and the inbox absorbs it).
    pub fn after_commit(followed: &Followed) -> Result<(), boxoffice_faults::Injected> {
        for (name, _) in &followed.0 {
            boxoffice_faults::check_consumer(name, "after_commit")?;
            boxoffice_faults::check_consumer(name, "before_ack")?;
        }
        Ok(())
    }
}
