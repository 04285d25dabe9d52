//! Following facts through in their writer's transaction (`boxoffice_bus::follow`): in a
//! process that runs every role, the saga's steps and the ticket worker's run in the payment
//! worker's transactions, each recorded in its own inbox and named in the fact's `applied_by`,
//! and the bus still carries every fact; a follower that fails costs the writer nothing but a
//! second try without followers; a fact its consumer already applied in its writer's
//! transaction is acknowledged without one.

use crate::helpers::TestApp;
use async_trait::async_trait;
use boxoffice::runtime::Role;
use boxoffice_bus::consumer::{handle_once, handle_once_following, Disposition, Handler, HandlerError};
use boxoffice_bus::Followers;
use boxoffice_domain::{Envelope, EventKind, HoldId, OrderId, PurchaseEvent};
use boxoffice_store::venue::VenueSpec;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// The outbox rows of `order`: type, `applied_by`, writing transaction.
async fn facts(pool: &PgPool, order: Uuid) -> Vec<(String, Vec<String>, String)> {
    sqlx::query_as(
        "SELECT event_type,
                ARRAY(SELECT jsonb_array_elements_text(COALESCE(payload->'applied_by', '[]'::jsonb))),
                xact::text
           FROM outbox WHERE message_key = $1::text ORDER BY created_at",
    )
    .bind(order)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The transaction of the inbox row of `consumer` for the fact of `event_type` of `order`.
async fn applied_in(pool: &PgPool, consumer: &str, event_type: &str, order: Uuid) -> Option<String> {
    sqlx::query_scalar(
        "SELECT i.xact::text FROM inbox i JOIN outbox o ON o.id = i.event_id
          WHERE i.consumer = $1 AND o.event_type = $2 AND o.message_key = $3::text",
    )
    .bind(consumer)
    .bind(event_type)
    .bind(order)
    .fetch_optional(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_purchase_in_one_process_is_followed_through_by_the_saga_and_the_ticket_worker(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = TestApp::spawn(opts, &Role::ALL, VenueSpec::small(1, 1, 4)).await;
    let seat = app.seats().await[0];
    let b = app.buyer();
    let order = app.hold_order(&b, "follow", &[seat]).await;
    app.pay(&b, order, "pm_card_visa").await.expect("authorized");
    app.await_order(&b, order, Duration::from_secs(60), |v| v["status"] == "ticketed").await;
    app.assert_drained_and_clean().await;

    let facts = facts(&app.pool, order).await;
    let xact_of = |t: &str| facts.iter().find(|f| f.0 == t).map(|f| f.2.clone()).expect(t);
    let applied_by = |t: &str| facts.iter().find(|f| f.0 == t).map(|f| f.1.clone()).expect(t);
    // The saga's facts, each applied by the saga in the transaction that wrote it.
    for t in ["PaymentIntentCreated", "PaymentAuthorized", "PaymentCaptured"] {
        assert_eq!(applied_by(t), vec!["saga".to_owned()], "{t}");
        assert_eq!(applied_in(&app.pool, "saga", t, order).await, Some(xact_of(t)), "{t}");
    }
    assert_eq!(applied_by("TicketIssueRequested"), vec!["tickets".to_owned()]);
    assert_eq!(
        applied_in(&app.pool, "tickets", "TicketIssueRequested", order).await,
        Some(xact_of("TicketIssueRequested"))
    );
    // The capture's transaction: the payment worker's capture, the saga's `paid`, the tickets.
    let capture = xact_of("PaymentCaptured");
    for t in ["TicketIssueRequested", "TicketIssued"] {
        assert_eq!(xact_of(t), capture, "{t} in the capture's transaction");
    }
    let moves: Vec<(String, String)> = sqlx::query_as(
        "SELECT from_status, to_status FROM order_transitions WHERE order_id = $1 AND xact::text = $2 ORDER BY at",
    )
    .bind(order)
    .bind(&capture)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        moves,
        vec![("confirming".into(), "paid".into()), ("paid".into(), "ticketed".into())],
        "the order went from confirming to ticketed in the capture's transaction"
    );
    // The capture's own webhook is no claim the provider must answer: it arrived after the
    // capture was recorded (known) or while it was outstanding (a capture claim, which the
    // ledger settles later). One re-fetch in all: the authorization's.
    let refreshes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE message_key = $1::text AND event_type = 'PaymentIntentRefreshRequested'",
    )
    .bind(order)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(refreshes, 1, "one re-fetch: the authorization's; {facts:?}");
    // Each status change happened once, whoever applied it.
    let changes: i64 = sqlx::query_scalar("SELECT count(*) FROM order_transitions WHERE order_id = $1")
        .bind(order)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(changes, 4, "held → payment_required → confirming → paid → ticketed");

    // The order's story names the writer as the step's actor and the followers per fact.
    let t = boxoffice_store::timeline::read(
        &app.pool,
        order,
        &boxoffice_domain::consumers::ALL,
        Default::default(),
    )
    .await
    .unwrap()
    .unwrap();
    let step = t
        .steps
        .iter()
        .find(|s| s.facts.iter().any(|f| f.event_type == "PaymentCaptured"))
        .expect("the capture's step");
    match &step.actor {
        boxoffice_store::timeline::Actor::Consumer { consumer, applied_type, .. } => {
            assert_eq!((consumer.as_str(), applied_type.as_str()), ("payments", "OrderConfirmed"));
        }
        other => panic!("the capture's step was run by {other:?}"),
    }
    let captured = step.facts.iter().find(|f| f.event_type == "PaymentCaptured").unwrap();
    assert!(captured.applied_by.iter().any(|a| a.consumer == "saga" && a.in_writing_transaction));
    app.stop().await;
}

/// Writes one probe row per fact it applies and emits `TicketIssueRequested` for it.
struct Writer;

#[async_trait]
impl Handler for Writer {
    type Prepared = ();
    type Precheck = ();
    type Rows = ();

    fn name(&self) -> &'static str {
        "writer"
    }

    fn wants(&self, kind: EventKind) -> bool {
        kind == EventKind::OrderConfirmed
    }

    async fn prepare(&self, _: &Envelope, _: &PurchaseEvent, _: ()) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn apply(
        &self,
        tx: &mut boxoffice_store::Tx<'_>,
        env: &Envelope,
        _: &PurchaseEvent,
        _: (),
        _: (),
    ) -> Result<Vec<Envelope>, HandlerError> {
        sqlx::query(
            "INSERT INTO probe (who, event_id, xact) VALUES ('writer', $1, pg_current_xact_id()::text)",
        )
        .bind(env.event_id)
        .execute(&mut **tx)
        .await?;
        Ok(vec![env.follow(&PurchaseEvent::TicketIssueRequested {
            order_id: env.order_id(),
            hold_id: HoldId(Uuid::new_v4()),
        })])
    }
}

/// Applies `TicketIssueRequested` (a probe row), or fails while `fail` is set.
struct Follower {
    fail: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl Handler for Follower {
    type Prepared = ();
    type Precheck = ();
    type Rows = ();

    fn name(&self) -> &'static str {
        "follower"
    }

    fn wants(&self, kind: EventKind) -> bool {
        kind == EventKind::TicketIssueRequested
    }

    async fn prepare(&self, _: &Envelope, _: &PurchaseEvent, _: ()) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn apply(
        &self,
        tx: &mut boxoffice_store::Tx<'_>,
        env: &Envelope,
        _: &PurchaseEvent,
        _: (),
        _: (),
    ) -> Result<Vec<Envelope>, HandlerError> {
        sqlx::query(
            "INSERT INTO probe (who, event_id, xact) VALUES ('follower', $1, pg_current_xact_id()::text)",
        )
        .bind(env.event_id)
        .execute(&mut **tx)
        .await?;
        if self.fail.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(HandlerError::Transient(anyhow::anyhow!("the follower fails")));
        }
        Ok(vec![])
    }
}

fn confirmed() -> Envelope {
    let order = OrderId(Uuid::new_v4());
    Envelope::new(
        order,
        &PurchaseEvent::OrderConfirmed { order_id: order, hold_id: HoldId(Uuid::new_v4()), capture: None },
        Uuid::new_v4(),
        None,
    )
}

async fn probes(pool: &PgPool) -> Vec<(String, Uuid, String)> {
    sqlx::query_as("SELECT who, event_id, xact FROM probe ORDER BY seq").fetch_all(pool).await.unwrap()
}

#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_failing_follower_costs_the_writer_nothing_and_a_followed_fact_is_not_applied_twice(
    pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let pool = pool_opts.max_connections(4).connect_with(opts).await.unwrap();
    sqlx::query(
        "CREATE TABLE probe (seq bigserial PRIMARY KEY, who text NOT NULL, event_id uuid NOT NULL, xact text NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let follower = Arc::new(Follower { fail: true.into() });
    let followers = Followers::none().with(follower.clone());

    // The follower fails: everything is rolled back and the writer applies its fact alone.
    let first = confirmed();
    assert_eq!(
        handle_once_following(&pool, &Writer, &followers, &first).await.unwrap(),
        Disposition::Applied
    );
    let rows = probes(&pool).await;
    assert_eq!(rows.len(), 1, "the follower's write was rolled back: {rows:?}");
    assert_eq!((rows[0].0.as_str(), rows[0].1), ("writer", first.event_id));
    let (payload, follower_rows): (serde_json::Value, i64) = sqlx::query_as(
        "SELECT o.payload, (SELECT count(*) FROM inbox WHERE consumer = 'follower')
           FROM outbox o WHERE o.event_type = 'TicketIssueRequested'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(follower_rows, 0, "no inbox row of the follower");
    let left: Envelope = serde_json::from_value(payload).unwrap();
    assert!(left.applied_by.is_empty(), "left to the follower's consumer: {:?}", left.applied_by);
    // Its consumer applies it from the bus as before.
    follower.fail.store(false, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(handle_once(&pool, &*follower, &left).await.unwrap(), Disposition::Applied);

    // The follower succeeds: its step runs in the writer's transaction, recorded in its inbox
    // and in the fact's `applied_by`; the fact, delivered to its consumer, is not applied again.
    sqlx::query("TRUNCATE probe").execute(&pool).await.unwrap();
    let second = confirmed();
    assert_eq!(
        handle_once_following(&pool, &Writer, &followers, &second).await.unwrap(),
        Disposition::Applied
    );
    let rows = probes(&pool).await;
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[0].2, rows[1].2, "the writer and its follower in one transaction");
    let payload: serde_json::Value = sqlx::query_scalar(
        "SELECT payload FROM outbox WHERE event_type = 'TicketIssueRequested' AND payload->>'causation_id' = $1",
    )
    .bind(second.event_id.to_string())
    .fetch_one(&pool)
    .await
    .unwrap();
    let followed: Envelope = serde_json::from_value(payload).unwrap();
    assert_eq!(followed.applied_by, vec!["follower".to_owned()]);
    let inbox_xact: String =
        sqlx::query_scalar("SELECT xact::text FROM inbox WHERE consumer = 'follower' AND event_id = $1")
            .bind(followed.event_id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(inbox_xact, rows[0].2);
    assert_eq!(handle_once(&pool, &*follower, &followed).await.unwrap(), Disposition::Duplicate);
    // A consumer of an older build, which does not read `applied_by`, finds its inbox row.
    let mut older = followed.clone();
    older.applied_by.clear();
    assert_eq!(handle_once(&pool, &*follower, &older).await.unwrap(), Disposition::Duplicate);
    assert_eq!(probes(&pool).await.len(), 2, "applied once");
}

/// With `follow_through` off, every step is its consumer's own transaction on the bus, as in
/// a deployment that runs the saga and the ticket worker in processes of their own.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn without_follow_through_each_consumer_applies_its_facts_from_the_bus(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app =
        TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| c.follow_through = false).await;
    let seat = app.seats().await[0];
    let b = app.buyer();
    let order = app.hold_order(&b, "bus", &[seat]).await;
    app.pay(&b, order, "pm_card_visa").await.expect("authorized");
    app.await_order(&b, order, Duration::from_secs(60), |v| v["status"] == "ticketed").await;
    app.assert_drained_and_clean().await;
    let facts = facts(&app.pool, order).await;
    assert!(facts.iter().all(|f| f.1.is_empty()), "nothing followed through: {facts:?}");
    for (consumer, t) in [
        ("saga", "PaymentIntentCreated"),
        ("saga", "PaymentAuthorized"),
        ("saga", "PaymentCaptured"),
        ("tickets", "TicketIssueRequested"),
    ] {
        let written = facts.iter().find(|f| f.0 == t).map(|f| f.2.clone()).expect(t);
        let applied = applied_in(&app.pool, consumer, t, order).await.expect(t);
        assert_ne!(applied, written, "{consumer} applied {t} in a transaction of its own");
    }
    app.stop().await;
}

/// The payment worker's capture, whose ticket issuance fails once when followed through: the
/// order ends ticketed with one capture at the provider (the Stripe call repeated under its
/// idempotency key), each fact once, the capture recorded once; returns the order and its
/// PaymentCaptured fact (type, `applied_by`, transaction).
async fn capture_whose_ticket_issuance_fails_once(app: &TestApp) -> (Uuid, (String, Vec<String>, String)) {
    let seat = app.seats().await[0];
    let b = app.buyer();
    let order = app.hold_order(&b, "isolated", &[seat]).await;
    // Ticket issuance fails once: in the capture's transaction, where the ticket worker follows.
    boxoffice_faults::set("tickets.before_commit", "1*return").unwrap();
    let pi = app.pay(&b, order, "pm_card_visa").await.expect("authorized");
    app.await_order(&b, order, Duration::from_secs(60), |v| v["status"] == "ticketed").await;
    assert_eq!(boxoffice_faults::fired("tickets.before_commit"), 1);
    boxoffice_faults::clear("tickets.before_commit");
    app.assert_drained_and_clean().await;

    assert_eq!(app.sim.captures_for(&pi.id), 1, "one capture at the provider");
    let facts = facts(&app.pool, order).await;
    let count = |t: &str| facts.iter().filter(|f| f.0 == t).count();
    assert_eq!(
        (count("PaymentCaptured"), count("TicketIssueRequested"), count("TicketIssued")),
        (1, 1, 1),
        "{facts:?}"
    );
    let payments_rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM inbox i JOIN outbox o ON o.id = i.event_id
          WHERE i.consumer = 'payments' AND o.event_type = 'OrderConfirmed' AND o.message_key = $1::text",
    )
    .bind(order)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(payments_rows, 1);
    let tickets: i64 = sqlx::query_scalar("SELECT count(*) FROM tickets WHERE order_id = $1")
        .bind(order)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(tickets, 1);
    let captured = facts.iter().find(|f| f.0 == "PaymentCaptured").unwrap().clone();
    (order, captured)
}

/// A lane's own transaction (`consumer_group_commit` false): the capture's transaction, whose
/// ticket issuance fails when followed through, is rolled back whole and the capture applied
/// again alone, without followers; the saga and the ticket worker then apply their steps from
/// the bus.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_capture_whose_ticket_issuance_fails_in_its_transaction_is_recorded_once_and_ticketed_from_the_bus(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app =
        TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| c.consumer_group_commit = false)
            .await;
    let (order, captured) = capture_whose_ticket_issuance_fails_once(&app).await;
    assert!(
        captured.1.is_empty(),
        "the retry without followers left PaymentCaptured to the bus: {captured:?}"
    );
    assert_ne!(
        applied_in(&app.pool, "saga", "PaymentCaptured", order).await,
        Some(captured.2.clone()),
        "the saga applied the capture from the bus"
    );
    app.stop().await;
}

/// Through the member's committer (`consumer_group_commit`): the group that fails with the follower's
/// failure goes back to its lane, which applies the capture alone — its followers first, and
/// without them only if they fail again (here they do not: the failure was once) — and the
/// order ends ticketed as above, each fact once.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_capture_whose_ticket_issuance_fails_in_a_group_transaction_is_recorded_once_and_ticketed(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app =
        TestApp::spawn_with(opts, &Role::ALL, VenueSpec::small(1, 1, 4), |c| c.consumer_group_commit = true)
            .await;
    let (order, captured) = capture_whose_ticket_issuance_fails_once(&app).await;
    assert_eq!(
        applied_in(&app.pool, "saga", "PaymentCaptured", order).await,
        Some(captured.2.clone()),
        "applied alone with its followers the second time: {captured:?}"
    );
    app.stop().await;
}

/// Records what the runner hands it: each `lock_rows` run (its event ids) and, per effect,
/// the rows it was given. Its rows are the event id it was locked for, as the saga's are an
/// order's rows: only the first fact of an order in a run gets them, a second gets `None`.
struct Locking {
    name: &'static str,
    kind: EventKind,
    runs: std::sync::Mutex<Vec<Vec<Uuid>>>,
    applied: std::sync::Mutex<Vec<(Uuid, Option<Uuid>)>>,
}

impl Locking {
    fn new(name: &'static str, kind: EventKind) -> Self {
        Self { name, kind, runs: Default::default(), applied: Default::default() }
    }
    fn runs(&self) -> Vec<Vec<Uuid>> {
        self.runs.lock().unwrap().clone()
    }
    fn applied(&self) -> Vec<(Uuid, Option<Uuid>)> {
        self.applied.lock().unwrap().clone()
    }
}

#[async_trait]
impl Handler for Locking {
    type Prepared = ();
    type Precheck = ();
    type Rows = Option<Uuid>;

    fn name(&self) -> &'static str {
        self.name
    }

    fn wants(&self, kind: EventKind) -> bool {
        kind == self.kind
    }

    async fn prepare(&self, _: &Envelope, _: &PurchaseEvent, _: ()) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn lock_rows(
        &self,
        _: &mut boxoffice_store::Tx<'_>,
        run: &[(&Envelope, &PurchaseEvent)],
    ) -> Result<Vec<Option<Uuid>>, HandlerError> {
        self.runs.lock().unwrap().push(run.iter().map(|(env, _)| env.event_id).collect());
        let mut seen = std::collections::HashSet::new();
        Ok(run.iter().map(|(env, _)| seen.insert(env.aggregate_id).then_some(env.event_id)).collect())
    }

    async fn apply(
        &self,
        _: &mut boxoffice_store::Tx<'_>,
        env: &Envelope,
        _: &PurchaseEvent,
        _: (),
        rows: Option<Uuid>,
    ) -> Result<Vec<Envelope>, HandlerError> {
        self.applied.lock().unwrap().push((env.event_id, rows));
        Ok(vec![])
    }
}

/// Emits one `TicketIssueRequested` per `OrderConfirmed`, two for the order `twice`.
struct Fanout {
    twice: Option<Uuid>,
}

#[async_trait]
impl Handler for Fanout {
    type Prepared = ();
    type Precheck = ();
    type Rows = ();

    fn name(&self) -> &'static str {
        "fanout"
    }

    fn wants(&self, kind: EventKind) -> bool {
        kind == EventKind::OrderConfirmed
    }

    async fn prepare(&self, _: &Envelope, _: &PurchaseEvent, _: ()) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn apply(
        &self,
        _: &mut boxoffice_store::Tx<'_>,
        env: &Envelope,
        _: &PurchaseEvent,
        _: (),
        _: (),
    ) -> Result<Vec<Envelope>, HandlerError> {
        let request = || {
            env.follow(&PurchaseEvent::TicketIssueRequested {
                order_id: env.order_id(),
                hold_id: HoldId(Uuid::new_v4()),
            })
        };
        let n = if self.twice == Some(env.aggregate_id) { 2 } else { 1 };
        Ok((0..n).map(|_| request()).collect())
    }
}

/// The ids of the facts of `event_type` in the outbox, in the order they were written.
async fn written(pool: &PgPool, event_type: &str) -> Vec<(Uuid, Uuid)> {
    sqlx::query_as("SELECT id, message_key::uuid FROM outbox WHERE event_type = $1 ORDER BY created_at")
        .bind(event_type)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// `Handler::lock_rows`: a shared batch locks the rows of every message it applies in one
/// run, in the order their effects run (ascending order id), and leaves out a message
/// applied already; a follower locks the rows of consecutive facts of distinct orders in one
/// run, and a second fact of an order starts the next run, so its effect reads rows the first
/// one left.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn batches_and_followers_lock_their_rows_once_per_run_of_distinct_orders(
    pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use boxoffice_bus::consumer::handle_batch;
    let pool = pool_opts.max_connections(4).connect_with(opts).await.unwrap();
    let mut orders: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
    orders.sort();
    let confirmed_of = |order: Uuid| {
        let o = OrderId(order);
        Envelope::new(
            o,
            &PurchaseEvent::OrderConfirmed { order_id: o, hold_id: HoldId(Uuid::new_v4()), capture: None },
            Uuid::new_v4(),
            None,
        )
    };

    // A shared batch, given in descending order id, one of its facts applied already.
    let main = Locking::new("locking", EventKind::OrderConfirmed);
    let envs: Vec<Envelope> = orders.iter().rev().map(|&o| confirmed_of(o)).collect();
    let done = &envs[1]; // orders[2]
    sqlx::query("INSERT INTO inbox (consumer, event_id) VALUES ('locking', $1)")
        .bind(done.event_id)
        .execute(&pool)
        .await
        .unwrap();
    let out = handle_batch(&pool, &main, &Followers::none(), &envs).await.unwrap();
    assert_eq!(
        out,
        vec![
            Some(Disposition::Applied),
            Some(Disposition::Duplicate),
            Some(Disposition::Applied),
            Some(Disposition::Applied)
        ]
    );
    let by_order = |o: Uuid| envs.iter().find(|e| e.aggregate_id == o).unwrap().event_id;
    let expected: Vec<Uuid> = [orders[0], orders[1], orders[3]].into_iter().map(by_order).collect();
    assert_eq!(main.runs(), vec![expected.clone()], "one run: the new ones, in ascending order id");
    assert_eq!(
        main.applied(),
        expected.iter().map(|&id| (id, Some(id))).collect::<Vec<_>>(),
        "each effect got the rows locked for it, in that order"
    );

    // A batch whose facts a follower follows: one fact per order, one run for all of them.
    let follower = Arc::new(Locking::new("follower", EventKind::TicketIssueRequested));
    let followers = Followers::none().with(follower.clone());
    let envs: Vec<Envelope> = orders[..3].iter().map(|&o| confirmed_of(o)).collect();
    handle_batch(&pool, &Fanout { twice: None }, &followers, &envs).await.unwrap();
    let requests: Vec<Uuid> =
        written(&pool, "TicketIssueRequested").await.into_iter().map(|(id, _)| id).collect();
    assert_eq!(requests.len(), 3);
    assert_eq!(follower.runs(), vec![requests.clone()]);
    assert_eq!(follower.applied(), requests.iter().map(|&id| (id, Some(id))).collect::<Vec<_>>());

    // Two facts of one order: the second starts the next run, which the others join.
    sqlx::query("DELETE FROM outbox").execute(&pool).await.unwrap();
    let follower = Arc::new(Locking::new("follower", EventKind::TicketIssueRequested));
    let followers = Followers::none().with(follower.clone());
    let envs: Vec<Envelope> = orders[..3].iter().map(|&o| confirmed_of(o)).collect();
    handle_batch(&pool, &Fanout { twice: Some(orders[1]) }, &followers, &envs).await.unwrap();
    let requests = written(&pool, "TicketIssueRequested").await;
    let keys: Vec<Uuid> = requests.iter().map(|(_, o)| *o).collect();
    assert_eq!(
        keys,
        vec![orders[0], orders[1], orders[1], orders[2]],
        "written in the order they were emitted"
    );
    let ids: Vec<Uuid> = requests.iter().map(|(id, _)| *id).collect();
    assert_eq!(follower.runs(), vec![ids[..2].to_vec(), ids[2..].to_vec()]);
    assert_eq!(follower.applied(), ids.iter().map(|&id| (id, Some(id))).collect::<Vec<_>>());
    let followed: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox WHERE consumer = 'follower'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(followed, 7, "every fact followed once, each with its inbox row");
}

/// A capture whose ticket issuance the database gives up (the `tickets` table locked past the
/// statement timeout: SQLSTATE 57014, an overload) is recorded at once all the same: applied
/// again without its followers, not handed to the retry topic with them. Both orders are
/// `paid` while the lock lasts, and `ticketed` after it, each fact once. (The captures may
/// share a batch or not; the runs seen here did not, so this checks the one-message path.)
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_capture_whose_ticket_issuance_the_database_gives_up_is_recorded_at_once(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = TestApp::spawn_with(
        opts.options([("statement_timeout", "1000")]),
        &Role::ALL,
        VenueSpec::small(1, 1, 4),
        |c| {
            // One lane: the two captures come to the same lane.
            c.consumer_lanes = 1;
            // The ticket worker's own retries, after the lock, come soon.
            c.consumer_retry_5s_delay_ms = 1_000;
            c.consumer_retry_1m_delay_ms = 2_000;
        },
    )
    .await;
    let seats = app.seats().await;
    let buyers = [app.buyer(), app.buyer()];
    let orders = [
        app.hold_order(&buyers[0], "locked-tickets-0", &seats[..1]).await,
        app.hold_order(&buyers[1], "locked-tickets-1", &seats[1..2]).await,
    ];
    let mut blocker = app.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE tickets IN SHARE ROW EXCLUSIVE MODE").execute(&mut *blocker).await.unwrap();
    let (first, second) = tokio::join!(
        app.pay(&buyers[0], orders[0], "pm_card_visa"),
        app.pay(&buyers[1], orders[1], "pm_card_visa")
    );
    first.expect("authorized");
    second.expect("authorized");
    for (b, o) in buyers.iter().zip(orders) {
        app.await_order(b, o, Duration::from_secs(30), |v| v["status"] == "paid").await;
    }
    blocker.rollback().await.unwrap();
    for (b, o) in buyers.iter().zip(orders) {
        app.await_order(b, o, Duration::from_secs(60), |v| v["status"] == "ticketed").await;
    }
    app.assert_drained_and_clean().await;
    for o in orders {
        let facts = facts(&app.pool, o).await;
        let count = |t: &str| facts.iter().filter(|f| f.0 == t).count();
        assert_eq!((count("PaymentCaptured"), count("TicketIssued")), (1, 1), "{facts:?}");
    }
    app.stop().await;
}
