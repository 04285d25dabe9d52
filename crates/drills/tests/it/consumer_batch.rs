//! The consumer runner's shared transactions (`boxoffice_bus::consumer`, "Batches") against
//! the real broker: facts of several orders that queued up for one lane are applied in one
//! transaction (at most one fact of an order in each), each once, in partition order per
//! order, duplicates included; a fact the
//! consumer ignores costs nothing; what each fact emits is written to the outbox in its
//! transaction, once; and one failing fact rolls its batch back, is dead-lettered alone, and
//! costs the others nothing but a second try. A consumer that calls out (the payment worker)
//! batches too: every call of a batch is made before its transaction begins, and a failure at
//! any boundary fails the batch whole and costs a repeat of the calls under the same
//! idempotency keys, never a second PaymentIntent or a second record. A statement the server
//! gives up under load fails its attempt, never its fact.

use crate::helpers::{eventually, test_brokers, TestApp};
use async_trait::async_trait;
use boxoffice::config::Config;
use boxoffice::runtime::Role;
use boxoffice_bus::consumer::{handle_batch, handle_group, Disposition};
use boxoffice_bus::consumer::{run_consumers, Handler, HandlerError};
use boxoffice_domain::{Envelope, EventKind, HoldId, OrderId, PurchaseEvent, Topic};
use boxoffice_store::venue::VenueSpec;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Records each fact it prepares, when each fact's attempts began, and each fact it applies,
/// with the transaction that applied it; refuses `refuse`; with `locks`, first locks its
/// order's row in `probe_orders` (when there is one).
#[derive(Default)]
struct Probe {
    refuse: Uuid,
    locks: bool,
    /// An order whose facts take `SLOW_APPLY_S` to apply (`pg_sleep` in the transaction).
    slow: Uuid,
    prepared: std::sync::Mutex<Vec<Uuid>>,
    attempts: std::sync::Mutex<Vec<(Uuid, std::time::Instant)>>,
}

#[async_trait]
impl Handler for Probe {
    type Prepared = ();
    type Precheck = ();
    type Rows = ();

    fn name(&self) -> &'static str {
        "probe"
    }

    fn wants(&self, kind: EventKind) -> bool {
        kind == EventKind::TicketIssueRequested
    }

    async fn prepare(&self, env: &Envelope, _: &PurchaseEvent, _: ()) -> Result<(), HandlerError> {
        self.prepared.lock().unwrap().push(env.event_id);
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
        self.attempts.lock().unwrap().push((env.event_id, std::time::Instant::now()));
        if env.event_id == self.refuse {
            return Err(HandlerError::permanent("probe_refused", anyhow::anyhow!("refused")));
        }
        if env.aggregate_id == self.slow {
            sqlx::query("SELECT pg_sleep($1)").bind(SLOW_APPLY_S).execute(&mut **tx).await?;
        }
        if self.locks {
            sqlx::query("SELECT 1 FROM probe_orders WHERE order_id = $1 FOR UPDATE")
                .bind(env.aggregate_id)
                .execute(&mut **tx)
                .await?;
        }
        record_applied(tx, env).await?;
        // A fact that follows, which the runner writes to the outbox (a batch's in one statement).
        Ok(vec![env.follow(&PurchaseEvent::TicketIssued { order_id: env.order_id(), ticket_ids: vec![] })])
    }
}

/// How long the probe takes to apply a fact of its `slow` order, seconds.
const SLOW_APPLY_S: f64 = 3.0;

/// The table the probe handlers record each applied fact in, with its transaction.
async fn probe_table(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE probe_applied (seq bigserial PRIMARY KEY, event_id uuid NOT NULL, order_id uuid NOT NULL,
                                     xact text NOT NULL)",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// Records `env` as applied in `tx` ([`probe_table`]).
async fn record_applied(tx: &mut boxoffice_store::Tx<'_>, env: &Envelope) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO probe_applied (event_id, order_id, xact) VALUES ($1, $2, pg_current_xact_id()::text)",
    )
    .bind(env.event_id)
    .bind(env.aggregate_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Per applied probe row: whether exactly one outbox row follows it (caused by it, for its
/// order) and was written by the same transaction.
async fn each_applied_fact_emitted_once_in_its_transaction(pool: &PgPool) {
    let bad: Vec<(Uuid, i64)> = sqlx::query_as(
        "SELECT p.event_id, count(x.id) FROM probe_applied p
           LEFT JOIN outbox x ON x.payload->>'causation_id' = p.event_id::text
                             AND x.message_key = p.order_id::text AND x.event_type = 'TicketIssued'
                             AND x.xact::text = p.xact
          GROUP BY p.event_id HAVING count(x.id) <> 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(bad.is_empty(), "facts without exactly one follow-up in their transaction: {bad:?}");
    let follows: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE event_type = 'TicketIssued'")
        .fetch_one(pool)
        .await
        .unwrap();
    let applied: i64 =
        sqlx::query_scalar("SELECT count(*) FROM probe_applied").fetch_one(pool).await.unwrap();
    assert_eq!(follows, applied, "no follow-up of a rolled-back or duplicate fact");
}

fn fact(order: Uuid, kind: &str) -> Envelope {
    let (o, h) = (OrderId(order), HoldId(Uuid::new_v4()));
    let event = match kind {
        "issue" => PurchaseEvent::TicketIssueRequested { order_id: o, hold_id: h },
        _ => PurchaseEvent::OrderConfirmed { order_id: o, hold_id: h, capture: None },
    };
    Envelope::new(o, &event, Uuid::new_v4(), None)
}

async fn publish(
    k: &boxoffice_bus::KafkaConfig,
    producer: &rdkafka::producer::FutureProducer,
    envs: &[Envelope],
) {
    let topic = k.topic(Topic::Purchase.name());
    for env in envs {
        let payload = serde_json::to_vec(env).unwrap();
        let id = env.event_id.to_string();
        boxoffice_bus::producer::send(
            producer,
            &topic,
            &env.aggregate_id.to_string(),
            &payload,
            &[
                (boxoffice_bus::fact_headers::EVENT_ID, id.as_str()),
                (boxoffice_bus::fact_headers::EVENT_TYPE, env.event_type.as_str()),
            ],
        )
        .await
        .unwrap();
    }
}

/// The broker's topics under a fresh prefix (`name` and a random suffix), one partition each,
/// and a producer.
async fn topics(name: &str) -> (boxoffice_bus::KafkaConfig, rdkafka::producer::FutureProducer) {
    let cfg = Config {
        kafka_brokers: Some(test_brokers()),
        kafka_topic_prefix: format!("{name}{}.", &Uuid::new_v4().simple().to_string()[..8]),
        kafka_partitions: 1,
        ..Config::default()
    };
    let k = cfg.kafka().unwrap();
    boxoffice_bus::topics::create_all(&k).await.unwrap();
    let producer = boxoffice_bus::producer::build(&k).unwrap();
    (k, producer)
}

/// One member of `lanes` lanes, batches of at most `batch`, `transactions` slots (0: one per
/// lane), fetching and lingering as by default.
fn members(lanes: usize, batch: usize, transactions: usize) -> boxoffice_bus::Members {
    boxoffice_bus::Members {
        instances: 1,
        lanes,
        batch,
        fetch: Default::default(),
        linger: Default::default(),
        transactions,
        group_commit: false,
        group_commits: 1,
    }
}

/// One member of `lanes` lanes, batches of at most `batch`, committing through its committer
/// (`consumer_group_commit`) with two group transactions open at most.
fn grouped(lanes: usize, batch: usize) -> boxoffice_bus::Members {
    boxoffice_bus::Members { group_commit: true, group_commits: 2, ..members(lanes, batch, 0) }
}

async fn applied(pool: &PgPool) -> Vec<(Uuid, Uuid, String)> {
    sqlx::query_as("SELECT event_id, order_id, xact FROM probe_applied ORDER BY seq")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn queued_facts_of_many_orders_share_a_transaction_and_a_bad_one_goes_alone(
    pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let pool = pool_opts.max_connections(4).connect_with(opts).await.unwrap();
    probe_table(&pool).await;
    let (k, producer) = topics("batch").await;

    // Three orders, four facts each, interleaved; a copy of one fact; facts the probe ignores.
    let orders: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
    let mut first = Vec::new();
    for _ in 0..4 {
        for o in &orders {
            first.push(fact(*o, "issue"));
            first.push(fact(*o, "ignored"));
        }
    }
    let copy = first[0].clone();
    first.insert(7, copy);
    publish(&k, &producer, &first).await;

    // Queued before the consumer starts: one lane finds them all waiting.
    let refuse = fact(orders[1], "issue");
    let shutdown = CancellationToken::new();
    let (tasks, _) = run_consumers(
        &k,
        pool.clone(),
        std::sync::Arc::new(Probe { refuse: refuse.event_id, ..Default::default() }),
        producer.clone(),
        members(1, 32, 0),
        boxoffice_bus::Followers::none(),
        shutdown.clone(),
    )
    .unwrap();
    let wanted: Vec<&Envelope> = first.iter().filter(|e| e.event_type == "TicketIssueRequested").collect();
    eventually(Duration::from_secs(60), "the 12 facts applied", || async {
        applied(&pool).await.len() >= 12
    })
    .await;
    let rows = applied(&pool).await;
    assert_eq!(rows.len(), 12, "each of the 12 facts once, the copy absorbed by the inbox: {rows:?}");
    let ids: std::collections::HashSet<Uuid> = rows.iter().map(|r| r.0).collect();
    assert_eq!(ids.len(), 12);
    for o in &orders {
        let produced: Vec<Uuid> =
            wanted.iter().filter(|e| e.aggregate_id == *o).map(|e| e.event_id).collect::<Vec<_>>();
        let mut seen = Vec::new();
        for id in produced {
            if !seen.contains(&id) {
                seen.push(id);
            }
        }
        let applied_order: Vec<Uuid> = rows.iter().filter(|r| r.1 == *o).map(|r| r.0).collect();
        assert_eq!(applied_order, seen, "order {o}: its facts in partition order");
    }
    let mut per_xact: std::collections::HashMap<&str, Vec<Uuid>> = Default::default();
    for (_, order, xact) in &rows {
        per_xact.entry(xact.as_str()).or_default().push(*order);
    }
    assert!(
        per_xact.values().any(|orders| orders.len() > 1),
        "facts of different orders shared a transaction: {per_xact:?}"
    );
    for orders in per_xact.values() {
        let distinct: std::collections::HashSet<&Uuid> = orders.iter().collect();
        assert_eq!(
            distinct.len(),
            orders.len(),
            "at most one fact of an order per transaction: {per_xact:?}"
        );
    }
    let inbox: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox WHERE consumer = 'probe'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(inbox, 12, "ignored facts leave no inbox row");
    each_applied_fact_emitted_once_in_its_transaction(&pool).await;

    // A refused fact among good ones: rolled back with its batch, then dead-lettered alone;
    // the others applied once each.
    let good: Vec<Envelope> = orders.iter().map(|o| fact(*o, "issue")).collect();
    let second = vec![good[0].clone(), refuse.clone(), good[1].clone(), good[2].clone()];
    publish(&k, &producer, &second).await;
    eventually(Duration::from_secs(60), "the 3 good facts applied", || async {
        applied(&pool).await.len() >= 15
    })
    .await;
    eventually(Duration::from_secs(60), "the refused fact dead-lettered", || {
        let k = k.clone();
        async move { !boxoffice_bus::dlq::list(&k, Duration::from_secs(5)).await.unwrap().is_empty() }
    })
    .await;
    let letters = boxoffice_bus::dlq::list(&k, Duration::from_secs(5)).await.unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].record["error_code"], "probe_refused");
    assert_eq!(letters[0].record["event_id"], refuse.event_id.to_string());
    let rows = applied(&pool).await;
    assert_eq!(rows.len(), 15, "{rows:?}");
    for g in &good {
        assert_eq!(rows.iter().filter(|r| r.0 == g.event_id).count(), 1, "{} applied once", g.event_id);
    }
    assert!(rows.iter().all(|r| r.0 != refuse.event_id));
    each_applied_fact_emitted_once_in_its_transaction(&pool).await;
    shutdown.cancel();
    for t in tasks {
        t.await.unwrap();
    }
}

/// A consumer that calls out: `prepare` records its "remote call" with the wall clock on its
/// own connection, outside any transaction of the runner's; `apply` records the transaction
/// that applies the fact and when that transaction began.
struct Caller {
    pool: PgPool,
    /// Its call is refused (after being made), every time.
    refuse: Uuid,
}

#[async_trait]
impl Handler for Caller {
    type Prepared = ();
    type Precheck = ();
    type Rows = ();

    fn name(&self) -> &'static str {
        "caller"
    }

    fn wants(&self, kind: EventKind) -> bool {
        kind == EventKind::TicketIssueRequested
    }

    fn calls_out(&self) -> bool {
        true
    }

    async fn prepare(&self, env: &Envelope, _: &PurchaseEvent, _: ()) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO caller_calls (event_id, at) VALUES ($1, clock_timestamp())")
            .bind(env.event_id)
            .execute(&self.pool)
            .await?;
        if env.event_id == self.refuse {
            return Err(HandlerError::permanent("caller_refused", anyhow::anyhow!("refused")));
        }
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
            "INSERT INTO caller_applied (event_id, order_id, xact, xact_start)
             VALUES ($1, $2, pg_current_xact_id()::text, now())",
        )
        .bind(env.event_id)
        .bind(env.aggregate_id)
        .execute(&mut **tx)
        .await?;
        Ok(vec![])
    }
}

/// A consumer that calls out batches what queued up for its lane like any other: several
/// orders' facts in one transaction, each fact's call made before that transaction began; a
/// fact whose call is refused is left out of its batch and dead-lettered alone while the
/// others' calls are made once; a copy of an applied fact is caught by the inbox before any
/// call.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_consumer_that_calls_out_makes_its_calls_before_the_shared_transaction(
    pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let pool = pool_opts.max_connections(6).connect_with(opts).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE caller_calls (event_id uuid NOT NULL, at timestamptz NOT NULL);
         CREATE TABLE caller_applied (event_id uuid PRIMARY KEY, order_id uuid NOT NULL, xact text NOT NULL,
                                      xact_start timestamptz NOT NULL);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (k, producer) = topics("call").await;
    // Eight orders' facts and one whose call is refused among them, queued before the
    // consumer starts.
    let facts: Vec<Envelope> = (0..8).map(|_| fact(Uuid::new_v4(), "issue")).collect();
    let refused = fact(Uuid::new_v4(), "issue");
    let mut queued = facts.clone();
    queued.insert(3, refused.clone());
    publish(&k, &producer, &queued).await;
    let shutdown = CancellationToken::new();
    let start = |shutdown: CancellationToken| {
        run_consumers(
            &k,
            pool.clone(),
            Arc::new(Caller { pool: pool.clone(), refuse: refused.event_id }),
            producer.clone(),
            members(1, 16, 0),
            boxoffice_bus::Followers::none(),
            shutdown,
        )
        .unwrap()
    };
    let (tasks, _) = start(shutdown.clone());
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await.unwrap() }
    };
    eventually(Duration::from_secs(60), "the 8 facts applied", || async {
        count("SELECT count(*) FROM caller_applied").await >= 8
    })
    .await;
    let shared: i64 =
        count("SELECT count(*) FROM (SELECT xact FROM caller_applied GROUP BY xact HAVING count(*) > 1) s")
            .await;
    assert!(shared >= 1, "facts of different orders shared a transaction");
    // Every applied fact's call, made before the transaction that applied it began.
    let late: i64 = count(
        "SELECT count(*) FROM caller_applied a
          WHERE NOT EXISTS (SELECT 1 FROM caller_calls c WHERE c.event_id = a.event_id AND c.at < a.xact_start)",
    )
    .await;
    assert_eq!(late, 0, "a call made inside the transaction that applied its fact");
    // The refused call left its own fact out; the others' calls were not made again.
    eventually(Duration::from_secs(60), "the refused fact dead-lettered", || {
        let k = k.clone();
        async move { !boxoffice_bus::dlq::list(&k, Duration::from_secs(5)).await.unwrap().is_empty() }
    })
    .await;
    let letters = boxoffice_bus::dlq::list(&k, Duration::from_secs(5)).await.unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].record["event_id"], refused.event_id.to_string());
    let others = |sql: &'static str| {
        let (pool, refused) = (pool.clone(), refused.event_id);
        async move { sqlx::query_scalar::<_, i64>(sql).bind(refused).fetch_one(&pool).await.unwrap() }
    };
    let calls = others("SELECT count(*) FROM caller_calls WHERE event_id <> $1").await;
    assert_eq!(calls, 8, "one call per good fact: none repeated for the refused one's sake");
    assert_eq!(others("SELECT count(*) FROM caller_applied WHERE event_id = $1").await, 0);
    shutdown.cancel();
    for t in tasks {
        t.await.unwrap();
    }
    // Copies of all eight, from a restarted member: the inbox, read before any call, stops them.
    publish(&k, &producer, &facts).await;
    let marker = fact(Uuid::new_v4(), "issue");
    publish(&k, &producer, std::slice::from_ref(&marker)).await;
    let shutdown = CancellationToken::new();
    let (tasks, _) = start(shutdown.clone());
    eventually(Duration::from_secs(60), "the fact after the copies applied", || async {
        count("SELECT count(*) FROM caller_applied").await >= 9
    })
    .await;
    assert_eq!(
        others("SELECT count(*) FROM caller_calls WHERE event_id <> $1").await,
        9,
        "no call for a copy of an applied fact"
    );
    assert_eq!(count("SELECT count(*) FROM caller_applied").await, 9);
    shutdown.cancel();
    for t in tasks {
        t.await.unwrap();
    }
}

/// One order per seat of `seats`, each held by a buyer of its own (Idempotency-Key
/// `{key}-{i}`), and the authorization request each hold wrote (its `HoldCreated`), as the
/// relay sends them (outbox order).
async fn held_with_commands(app: &TestApp, seats: &[Uuid], key: &str) -> (Vec<Uuid>, Vec<Envelope>) {
    let mut orders = Vec::new();
    for (i, seat) in seats.iter().enumerate() {
        let b = app.buyer();
        let r = app.hold(&b, &app.admission_token(&b), &format!("{key}-{i}"), &[*seat]).await;
        assert_eq!(r.status().as_u16(), 202, "{:?}", r.text().await);
        let v: serde_json::Value = r.json().await.unwrap();
        orders.push(v["order_id"].as_str().unwrap().parse::<Uuid>().unwrap());
    }
    let keys: Vec<String> = orders.iter().map(Uuid::to_string).collect();
    let cmds: Vec<Envelope> = sqlx::query_scalar::<_, serde_json::Value>(
        "SELECT payload FROM outbox WHERE event_type = 'HoldCreated'
           AND message_key = ANY($1) ORDER BY created_at, id",
    )
    .bind(&keys)
    .fetch_all(&app.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|p| serde_json::from_value(p).unwrap())
    .collect();
    assert_eq!(cmds.len(), seats.len());
    (orders, cmds)
}

/// The payment worker's commands in one batch ([`handle_batch`], what a lane does with the
/// commands that queued up for it), for every consumer boundary: the batch fails there once,
/// then the runner's next attempt follows. A command whose `prepare` failed (around its
/// call) is left out whole and the other three are recorded, so only its call is repeated;
/// a failure of the transaction repeats every call, under the same idempotency keys. Either
/// way each order ends with one PaymentIntent, one payment row and one
/// `PaymentIntentCreated` (the saga following each through), and the simulator created
/// exactly one intent per order. A copy of a committed batch calls no one.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_batch_of_payment_commands_that_fails_at_any_boundary_repeats_only_its_calls(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 4, 8)).await;
    let seats = app.seats().await;
    let gateway: Arc<dyn boxoffice_payments::PaymentGateway> = Arc::new(app.stripe());
    let worker =
        boxoffice_workers::payment::PaymentWorker::new(gateway, app.pool.clone(), app.cfg.hold_policy());
    let saga = boxoffice_bus::Followers::none().with(Arc::new(boxoffice_workers::saga::Saga::default()));
    let mut next_seat = 0;
    for boundary in boxoffice_faults::CONSUMER_BOUNDARIES {
        // Four orders awaiting their PaymentIntent, and their commands as the relay sends them.
        let (orders, cmds) = held_with_commands(&app, &seats[next_seat..next_seat + 4], boundary).await;
        next_seat += 4;
        let keys: Vec<String> = orders.iter().map(Uuid::to_string).collect();
        let before = app.sim.stats();

        let point = format!("payments.{boundary}");
        boxoffice_faults::set(&point, "1*return").unwrap();
        let first = handle_batch(&app.pool, &worker, &saga, &cmds).await;
        boxoffice_faults::clear(&point);
        assert_eq!(boxoffice_faults::fired(&point), 1, "{point}");
        let around_the_call = matches!(boundary, "before_remote" | "after_remote");
        let committed = matches!(boundary, "after_commit" | "before_ack");
        let recorded = app
            .count(&format!("SELECT count(*) FROM payments WHERE order_id IN ('{}')", keys.join("','")))
            .await;
        if around_the_call {
            // One command failed around its call: left out; the other three recorded.
            let d = first.expect("the batch committed without the failed command");
            assert_eq!(d.iter().filter(|d| d.is_none()).count(), 1, "{point}: {d:?}");
            assert_eq!(d.iter().filter(|d| **d == Some(Disposition::Applied)).count(), 3, "{point}: {d:?}");
            assert_eq!(recorded, 3, "{point}: the others' answers kept");
        } else {
            assert!(first.is_err(), "{point}: the batch failed");
            assert_eq!(recorded, if committed { 4 } else { 0 }, "{point}: all of the batch or nothing");
        }
        let called = app.sim.stats().payment_intents_created - before.payment_intents_created;
        match boundary {
            // The one command whose check failed made no call; the others' calls finished.
            "before_remote" => assert_eq!(called, 3, "{point}"),
            _ => assert_eq!(called, 4, "{point}"),
        }

        // The runner's next attempt: the left-out command alone, or the whole batch again.
        let replays_before = app.sim.stats().idempotent_replays;
        let again = handle_batch(&app.pool, &worker, &saga, &cmds).await.unwrap();
        if around_the_call {
            let applied = again.iter().filter(|d| **d == Some(Disposition::Applied)).count();
            let duplicates = again.iter().filter(|d| **d == Some(Disposition::Duplicate)).count();
            assert_eq!((applied, duplicates), (1, 3), "{point}: {again:?}");
        } else {
            let want = Some(if committed { Disposition::Duplicate } else { Disposition::Applied });
            assert_eq!(again, vec![want; 4], "{point}");
        }
        let after = app.sim.stats();
        assert_eq!(
            after.payment_intents_created - before.payment_intents_created,
            4,
            "{point}: one PaymentIntent per order, however often its call was made"
        );
        let replayed = after.idempotent_replays - replays_before;
        match boundary {
            "before_remote" => assert_eq!(replayed, 0, "{point}: recorded calls are not made again"),
            "after_remote" => assert_eq!(replayed, 1, "{point}: only the left-out call repeated"),
            "before_commit" => {
                assert_eq!(replayed, 4, "{point}: every call of the rolled-back batch repeated")
            }
            _ => assert_eq!(replayed, 0, "{point}: a committed batch is not called again"),
        }
        let per_order: Vec<(Uuid, i64, i64, String)> = sqlx::query_as(
            "SELECT o.id,
                    (SELECT count(*) FROM payments p WHERE p.order_id = o.id),
                    (SELECT count(*) FROM outbox x WHERE x.message_key = o.id::text
                        AND x.event_type = 'PaymentIntentCreated'),
                    o.status::text
               FROM orders o WHERE o.id = ANY($1) ORDER BY o.id",
        )
        .bind(&orders)
        .fetch_all(&app.pool)
        .await
        .unwrap();
        for (order, payments, facts, status) in &per_order {
            assert_eq!((*payments, *facts), (1, 1), "{point}: order {order}");
            assert_eq!(status, "payment_required", "{point}: the saga followed order {order} through");
            let pi: String = sqlx::query_scalar("SELECT payment_intent_id FROM payments WHERE order_id = $1")
                .bind(order)
                .fetch_one(&app.pool)
                .await
                .unwrap();
            let intent = app.sim.payment_intent(&pi).expect("the simulator knows the recorded intent");
            assert_eq!(intent["metadata"]["order_id"], order.to_string(), "{point}");
        }
        let transactions = app
            .count(&format!(
                "SELECT count(DISTINCT xact) FROM outbox WHERE event_type = 'PaymentIntentCreated'
                   AND message_key IN ('{}')",
                keys.join("','")
            ))
            .await;
        let want = if around_the_call { 2 } else { 1 };
        assert_eq!(
            transactions, want,
            "{point}: the batch (and the left-out command) recorded by one transaction each"
        );

        // A copy of the committed batch: nothing applied, no one called.
        let stats = app.sim.stats();
        let copy = handle_batch(&app.pool, &worker, &saga, &cmds).await.unwrap();
        assert_eq!(copy, vec![Some(Disposition::Duplicate); 4], "{point}");
        let now = app.sim.stats();
        assert_eq!(
            (now.payment_intents_created, now.idempotent_replays),
            (stats.payment_intents_created, stats.idempotent_replays),
            "{point}: a copy calls no one"
        );
    }
    let v = boxoffice_store::audit::violations(&app.pool, 600_000, None).await.unwrap();
    assert_eq!(v.total(), 0, "{v:?}");
    app.stop().await;
}

/// A payment batch locks the holds of all its commands before any effect, in ascending order
/// id (`PaymentWorker::lock_rows`), not only of those that write the payment row: here a
/// re-fetch of the lower order, whose effect writes its hold (the provider does not confirm
/// the authorization a webhook claimed, so the hold's protection is cleared), and a cancel
/// of the higher order. While the batch waits for the lower order's hold, the higher's is
/// still free: the batch never holds a higher order's row while it waits for a lower one's,
/// so it cannot close a cycle with a saga batch locking the same orders. Once the wait ends
/// both commands are applied.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_payment_batch_locks_the_holds_of_all_its_commands_first(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let seats = app.seats().await;
    let (mut orders, cmds) = held_with_commands(&app, &seats[..2], "locks").await;
    let gateway: Arc<dyn boxoffice_payments::PaymentGateway> = Arc::new(app.stripe());
    let worker =
        boxoffice_workers::payment::PaymentWorker::new(gateway, app.pool.clone(), app.cfg.hold_policy());
    let saga = boxoffice_bus::Followers::none().with(Arc::new(boxoffice_workers::saga::Saga::default()));
    let done = handle_batch(&app.pool, &worker, &saga, &cmds).await.unwrap();
    assert_eq!(done, vec![Some(Disposition::Applied); 2]);
    orders.sort();
    let (low, high) = (OrderId(orders[0]), OrderId(orders[1]));
    let intent = |o: OrderId| {
        let pool = app.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>("SELECT payment_intent_id FROM payments WHERE order_id = $1")
                .bind(o.0)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let (pi_low, pi_high) = (intent(low).await, intent(high).await);
    // A webhook claimed the lower order's authorization; the provider says otherwise.
    sqlx::query(
        "UPDATE holds SET authorized_until = clock_timestamp() + interval '1 hour',
                authorization_reported_at = clock_timestamp()
          WHERE order_id = $1",
    )
    .bind(low.0)
    .execute(&app.pool)
    .await
    .unwrap();
    let refresh = PurchaseEvent::PaymentIntentRefreshRequested {
        order_id: low,
        payment_intent_id: pi_low,
        reason: "webhook_claim".into(),
    };
    let cancel = PurchaseEvent::AuthorizationCancelRequested {
        order_id: high,
        payment_intent_id: pi_high,
        reason: "test".into(),
    };
    let batch_cmds = vec![
        Envelope::new(high, &cancel, Uuid::new_v4(), None),
        Envelope::new(low, &refresh, Uuid::new_v4(), None),
    ];
    for cmd in &batch_cmds {
        crate::helpers::committed(&app.pool, cmd).await;
    }
    let blocker = crate::helpers::hold_lock_elsewhere(&app.pool, low.0).await;
    let batch = {
        let (pool, worker, saga) = (app.pool.clone(), worker.clone(), saga.clone());
        tokio::spawn(async move { handle_batch(&pool, &worker, &saga, &batch_cmds).await })
    };
    crate::helpers::await_lock_wait(&app.pool, "%holds%", "the batch waits for the lower order's hold").await;
    let free = crate::helpers::try_lock_hold(&app.pool, high.0).await;
    assert!(free.is_ok(), "the higher order's hold was locked before the lower's: {free:?}");
    assert!(!batch.is_finished(), "the batch waited for the lower order's hold");
    blocker.commit().await.unwrap();
    let out = batch.await.unwrap().unwrap();
    assert_eq!(out, vec![Some(Disposition::Applied); 2]);
    let protected = app
        .count(&format!(
            "SELECT count(*) FROM holds WHERE order_id = '{low}' AND authorized_until IS NOT NULL"
        ))
        .await;
    assert_eq!(protected, 0, "the unconfirmed authorization no longer protects the hold");
    let canceled = app
        .count(&format!("SELECT count(*) FROM payments WHERE order_id = '{high}' AND status = 'canceled'"))
        .await;
    assert_eq!(canceled, 1, "the cancel was recorded");
    app.stop().await;
}

/// A payment batch of re-fetches reads the payment rows of all its orders in one statement
/// after the holds' locks (`PaymentWorker::lock_rows`), and each effect compares the
/// provider's answer with its own order's row: here three orders, two whose authorizations
/// the provider confirms and one whose claimed authorization it does not. Each confirmed
/// order's hold is protected and its `PaymentAuthorized` written (the row names the
/// PaymentIntent re-fetched, so it is the order's current one, case C19); the third's
/// protection is cleared and nothing is written for it. A row handed to the wrong order, or
/// none, leaves the confirmed holds unprotected.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_payment_batch_of_refetches_judges_each_order_by_its_own_payment_row(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let seats = app.seats().await;
    let (orders, cmds) = held_with_commands(&app, &seats[..3], "refetches").await;
    let gateway: Arc<dyn boxoffice_payments::PaymentGateway> = Arc::new(app.stripe());
    let worker =
        boxoffice_workers::payment::PaymentWorker::new(gateway, app.pool.clone(), app.cfg.hold_policy());
    let none = boxoffice_bus::Followers::none();
    let done = handle_batch(&app.pool, &worker, &none, &cmds).await.unwrap();
    assert_eq!(done, vec![Some(Disposition::Applied); 3]);
    let mut intents = Vec::new();
    for order in &orders {
        let (pi, secret): (String, String) =
            sqlx::query_as("SELECT payment_intent_id, client_secret FROM payments WHERE order_id = $1")
                .bind(order)
                .fetch_one(&app.pool)
                .await
                .unwrap();
        intents.push((pi, secret));
    }
    // The buyers of the first two orders pay; the third's authorization is only claimed.
    for (pi, secret) in &intents[..2] {
        let paid = app
            .stripe()
            .confirm_with_client_secret(&app.cfg.stripe_publishable_key, pi, secret, "pm_card_visa")
            .await
            .unwrap();
        assert_eq!(paid.status, "requires_capture");
    }
    sqlx::query(
        "UPDATE holds SET authorized_until = clock_timestamp() + interval '1 hour',
                authorization_reported_at = clock_timestamp()
          WHERE order_id = $1",
    )
    .bind(orders[2])
    .execute(&app.pool)
    .await
    .unwrap();
    let refetches: Vec<Envelope> = orders
        .iter()
        .zip(&intents)
        .map(|(order, (pi, _))| {
            let refresh = PurchaseEvent::PaymentIntentRefreshRequested {
                order_id: OrderId(*order),
                payment_intent_id: pi.clone(),
                reason: "webhook_claim".into(),
            };
            Envelope::new(OrderId(*order), &refresh, Uuid::new_v4(), None)
        })
        .collect();
    for env in &refetches {
        crate::helpers::committed(&app.pool, env).await;
    }
    let done = handle_batch(&app.pool, &worker, &none, &refetches).await.unwrap();
    assert_eq!(done, vec![Some(Disposition::Applied); 3]);
    let protected = |order: Uuid| {
        let app = &app;
        async move {
            app.count(&format!(
                "SELECT count(*) FROM holds WHERE order_id = '{order}' AND authorized_until IS NOT NULL"
            ))
            .await
        }
    };
    for (i, order) in orders.iter().enumerate() {
        let confirmed = i < 2;
        assert_eq!(protected(*order).await, i64::from(confirmed), "order {i}'s hold protected: {confirmed}");
        assert_eq!(
            app.outbox_count("PaymentAuthorized", *order).await,
            i64::from(confirmed),
            "order {i}'s authorization reported: {confirmed}"
        );
    }
    app.stop().await;
}

/// The provider concurrency a payment lane's batch may ask for is bounded per process: the
/// Stripe client `runtime::gateway` builds (one per process, shared by its roles) lets
/// `stripe_max_in_flight` calls be in flight at once and queues the others; the same calls
/// through an unbounded client overlap further, so the bound is what held them.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_process_keeps_its_stripe_calls_in_flight_within_its_bound(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use boxoffice_payments::{CreatePaymentIntent, PaymentGateway};
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    app.sim.set_faults(boxoffice_stripe_sim::Faults { latency_ms: 150, ..Default::default() });
    let calls = |g: Arc<dyn PaymentGateway>, run: &'static str| {
        futures::future::join_all((0..12).map(move |i| {
            let g = g.clone();
            async move {
                let req = CreatePaymentIntent {
                    amount_minor: 1_000,
                    currency: "usd".into(),
                    metadata: vec![("order_id".into(), Uuid::new_v4().to_string())],
                };
                g.create_payment_intent(&req, &format!("{run}:{i}")).await.expect("created")
            }
        }))
    };
    let mut cfg = app.cfg.clone();
    cfg.stripe_max_in_flight = 3;
    calls(boxoffice::runtime::gateway(&cfg).unwrap(), "bounded").await;
    assert_eq!(app.sim.stats().peak_requests_in_flight, 3, "the bound was reached and never passed");
    calls(Arc::new(app.stripe()), "unbounded").await;
    assert!(app.sim.stats().peak_requests_in_flight > 3, "unbounded, the same calls overlap further");
    assert_eq!(app.sim.stats().payment_intents_created, 24);
    app.stop().await;
}

/// Counts the [`Handler::precheck`] reads the runner asks of the payment worker it wraps,
/// with the number of messages each covered; everything else is the worker's.
struct CountingPrechecks {
    inner: boxoffice_workers::payment::PaymentWorker,
    reads: std::sync::Mutex<Vec<usize>>,
}

#[async_trait]
impl Handler for CountingPrechecks {
    type Prepared = boxoffice_workers::payment::Prepared;
    type Precheck = boxoffice_store::payments::Precheck;
    type Rows = boxoffice_workers::payment::Locked;

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn wants(&self, kind: EventKind) -> bool {
        self.inner.wants(kind)
    }

    fn calls_out(&self) -> bool {
        self.inner.calls_out()
    }

    fn applied(&self, pre: &Self::Precheck) -> Option<bool> {
        self.inner.applied(pre)
    }

    async fn precheck(
        &self,
        run: &[(&Envelope, &PurchaseEvent)],
    ) -> Result<Vec<Self::Precheck>, HandlerError> {
        self.reads.lock().unwrap().push(run.len());
        self.inner.precheck(run).await
    }

    async fn prepare(
        &self,
        env: &Envelope,
        event: &PurchaseEvent,
        pre: Self::Precheck,
    ) -> Result<Self::Prepared, HandlerError> {
        self.inner.prepare(env, event, pre).await
    }

    async fn lock_rows(
        &self,
        tx: &mut boxoffice_store::Tx<'_>,
        run: &[(&Envelope, &PurchaseEvent)],
    ) -> Result<Vec<boxoffice_workers::payment::Locked>, HandlerError> {
        self.inner.lock_rows(tx, run).await
    }

    async fn apply(
        &self,
        tx: &mut boxoffice_store::Tx<'_>,
        env: &Envelope,
        event: &PurchaseEvent,
        prepared: Self::Prepared,
        rows: boxoffice_workers::payment::Locked,
    ) -> Result<Vec<Envelope>, HandlerError> {
        self.inner.apply(tx, env, event, prepared, rows).await
    }
}

/// A lane's batch of payment commands reads what their calls check first (the inbox, the
/// order, its hold and payment) once for the whole batch, not once per command, and what it
/// reads is the ledger's: before the batch, each order `held` with an `active` hold and no
/// payment; after it, each command applied and each order's payment the intent the
/// simulator created for it; an order the ledger does not know has nothing. A copy of the
/// batch is read once too, and calls no one.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_batch_of_payment_commands_reads_its_prechecks_once(_: PgPoolOptions, opts: PgConnectOptions) {
    use boxoffice_domain::{HoldStatus, OrderStatus};
    use boxoffice_store::payments::prechecks;
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 2, 4)).await;
    let seats = app.seats().await;
    let (orders, cmds) = held_with_commands(&app, &seats[..5], "pre").await;
    let name = boxoffice_workers::payment::NAME;
    let asked: Vec<(OrderId, Uuid)> = cmds.iter().map(|c| (OrderId(c.aggregate_id), c.event_id)).collect();

    let before = prechecks(&app.pool, name, &asked).await.unwrap();
    assert_eq!(before.len(), 5);
    for p in &before {
        assert!(!p.applied && p.payment.is_none(), "{p:?}");
        assert_eq!((p.order_status, p.hold_status), (Some(OrderStatus::Held), Some(HoldStatus::Active)));
    }
    let gateway: Arc<dyn boxoffice_payments::PaymentGateway> = Arc::new(app.stripe());
    let worker = CountingPrechecks {
        inner: boxoffice_workers::payment::PaymentWorker::new(
            gateway,
            app.pool.clone(),
            app.cfg.hold_policy(),
        ),
        reads: Default::default(),
    };
    let none = boxoffice_bus::Followers::none();
    let created = app.sim.stats().payment_intents_created;
    let done = handle_batch(&app.pool, &worker, &none, &cmds).await.unwrap();
    assert_eq!(done, vec![Some(Disposition::Applied); 5]);
    assert_eq!(*worker.reads.lock().unwrap(), vec![5], "one pre-check read for the batch of five");
    assert_eq!(app.sim.stats().payment_intents_created - created, 5);

    // In the order asked, a stranger's order in the middle.
    let mut again = asked.clone();
    again.insert(2, (OrderId(Uuid::new_v4()), Uuid::new_v4()));
    let after = prechecks(&app.pool, name, &again).await.unwrap();
    assert_eq!(after.len(), 6);
    let stranger = &after[2];
    assert!(!stranger.applied && stranger.order_status.is_none() && stranger.hold_status.is_none());
    assert!(stranger.payment.is_none());
    for ((order, _), p) in again.iter().zip(&after).filter(|((o, _), _)| orders.contains(&o.0)) {
        assert!(p.applied, "order {order}: its command is in the inbox");
        let payment = p.payment.as_ref().expect("the payment recorded");
        assert_eq!(payment.order_id, order.0);
        let intent = app.sim.payment_intent(&payment.payment_intent_id).expect("the simulator's intent");
        assert_eq!(intent["metadata"]["order_id"], order.0.to_string());
    }

    let copy = handle_batch(&app.pool, &worker, &none, &cmds).await.unwrap();
    assert_eq!(copy, vec![Some(Disposition::Duplicate); 5]);
    assert_eq!(*worker.reads.lock().unwrap(), vec![5, 5], "the copy's pre-checks in one read too");
    assert_eq!(app.sim.stats().payment_intents_created - created, 5, "a copy calls no one");
    app.stop().await;
}

/// During a rolling deploy a newer writer may store an order status this build does not
/// know. A payment command that decides on it fails alone (no inbox row, no provider call),
/// so it stays replayable, instead of being skipped as done; its batch's other commands go
/// on; once the status is one this build knows again, the same command is applied.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_command_on_an_unknown_status_fails_alone_and_is_not_used_up(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let seats = app.seats().await;
    let (orders, cmds) = held_with_commands(&app, &seats[..2], "unknown").await;
    sqlx::query("ALTER TABLE orders DROP CONSTRAINT orders_status_check").execute(&app.pool).await.unwrap();
    sqlx::query("UPDATE orders SET status = 'on_hold_from_a_newer_build' WHERE id = $1")
        .bind(orders[0])
        .execute(&app.pool)
        .await
        .unwrap();
    let gateway: Arc<dyn boxoffice_payments::PaymentGateway> = Arc::new(app.stripe());
    let worker =
        boxoffice_workers::payment::PaymentWorker::new(gateway, app.pool.clone(), app.cfg.hold_policy());
    let none = boxoffice_bus::Followers::none();
    let created = app.sim.stats().payment_intents_created;
    let k = |o: Uuid| cmds.iter().position(|c| c.aggregate_id == o).unwrap();
    let done = handle_batch(&app.pool, &worker, &none, &cmds).await.unwrap();
    assert_eq!(done[k(orders[0])], None, "left out of the batch: {done:?}");
    assert_eq!(done[k(orders[1])], Some(Disposition::Applied), "{done:?}");
    assert_eq!(app.sim.stats().payment_intents_created - created, 1, "only the known order's intent");
    let unknown = &cmds[k(orders[0])];
    let alone = boxoffice_bus::consumer::handle_once(&app.pool, &worker, unknown).await;
    assert!(matches!(alone, Err(HandlerError::Permanent { code: "corrupt_row", .. })), "{alone:?}");
    let in_inbox =
        app.count(&format!("SELECT count(*) FROM inbox WHERE event_id = '{}'", unknown.event_id)).await;
    assert_eq!(in_inbox, 0, "not used up: a replay after the upgrade can apply it");

    sqlx::query("UPDATE orders SET status = 'held' WHERE id = $1")
        .bind(orders[0])
        .execute(&app.pool)
        .await
        .unwrap();
    let again = boxoffice_bus::consumer::handle_once(&app.pool, &worker, unknown).await.unwrap();
    assert_eq!(again, Disposition::Applied);
    assert_eq!(app.sim.stats().payment_intents_created - created, 2);
    app.stop().await;
}

/// A consumer whose first `calls` provider calls wait for one another (each lane's first
/// call, when the lanes make their calls at once), and which counts how many of its effects
/// run at once, each inside its lane's transaction and taking a while there.
struct Slotted {
    calls: std::sync::atomic::AtomicUsize,
    together: tokio::sync::Barrier,
    waiting_calls: usize,
    in_tx: std::sync::atomic::AtomicUsize,
    most_in_tx: std::sync::atomic::AtomicUsize,
}

#[async_trait]
impl Handler for Slotted {
    type Prepared = ();
    type Precheck = ();
    type Rows = ();

    fn name(&self) -> &'static str {
        "slotted"
    }

    fn wants(&self, kind: EventKind) -> bool {
        kind == EventKind::TicketIssueRequested
    }

    fn calls_out(&self) -> bool {
        true
    }

    async fn prepare(&self, _: &Envelope, _: &PurchaseEvent, _: ()) -> Result<(), HandlerError> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.calls.fetch_add(1, SeqCst) < self.waiting_calls {
            self.together.wait().await;
        }
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
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.in_tx.fetch_add(1, SeqCst) + 1;
        self.most_in_tx.fetch_max(now, SeqCst);
        // A while inside the transaction, so that two lanes in theirs at once would overlap.
        let r = async {
            sqlx::query("SELECT pg_sleep(0.02)").execute(&mut **tx).await?;
            sqlx::query("INSERT INTO slotted_applied (event_id) VALUES ($1)")
                .bind(env.event_id)
                .execute(&mut **tx)
                .await
        }
        .await;
        self.in_tx.fetch_sub(1, SeqCst);
        r?;
        Ok(vec![])
    }
}

/// `consumer_transactions_max` (`boxoffice_bus::consumer`, "Transaction slots"): with four
/// lanes and one slot, the lanes' provider calls still run at once — the first four calls
/// wait for each other, which they could not do if a call waited for a slot — while their
/// effects, each inside its lane's transaction, run one at a time, for lanes that apply one
/// message per transaction and lanes that share one among a batch; every fact is applied once.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn one_transaction_slot_lets_the_lanes_call_at_once_and_commit_one_at_a_time(
    pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let pool = pool_opts.max_connections(8).connect_with(opts).await.unwrap();
    sqlx::query("CREATE TABLE slotted_applied (event_id uuid PRIMARY KEY)").execute(&pool).await.unwrap();
    for batch in [1, 16] {
        let (k, producer) = topics("slot").await;
        // 64 orders over four lanes: every lane has some (all but certainly).
        let facts: Vec<Envelope> = (0..64).map(|_| fact(Uuid::new_v4(), "issue")).collect();
        publish(&k, &producer, &facts).await;
        let handler = Arc::new(Slotted {
            calls: Default::default(),
            together: tokio::sync::Barrier::new(4),
            waiting_calls: 4,
            in_tx: Default::default(),
            most_in_tx: Default::default(),
        });
        let shutdown = CancellationToken::new();
        let (tasks, _) = run_consumers(
            &k,
            pool.clone(),
            handler.clone(),
            producer.clone(),
            members(4, batch, 1),
            boxoffice_bus::Followers::none(),
            shutdown.clone(),
        )
        .unwrap();
        let ids: Vec<Uuid> = facts.iter().map(|f| f.event_id).collect();
        let applied = || {
            let (pool, ids) = (pool.clone(), ids.clone());
            async move {
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM slotted_applied WHERE event_id = ANY($1)")
                    .bind(&ids)
                    .fetch_one(&pool)
                    .await
                    .unwrap()
            }
        };
        eventually(Duration::from_secs(60), "the 64 facts applied", || async { applied().await >= 64 }).await;
        shutdown.cancel();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(applied().await, 64, "batch {batch}: each fact once");
        let most = handler.most_in_tx.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(most, 1, "batch {batch}: transactions at once with one slot");
    }
}

/// `consumer_group_commit` (`boxoffice_bus::consumer`, "Group commit"): a member's lanes
/// hand what they have ready to one committer, which applies the runs of several lanes in
/// one transaction — with batches of one, a transaction that applied two facts joined two
/// lanes — yet never two facts of one order, each order's facts in partition order, each
/// fact once; a refused fact fails its group, whose other lanes' runs are then committed
/// without it, and is dead-lettered alone.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_member_commits_what_its_lanes_have_ready_in_one_transaction(
    pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let pool = pool_opts.max_connections(8).connect_with(opts).await.unwrap();
    probe_table(&pool).await;
    for batch in [1, 16] {
        sqlx::query("TRUNCATE probe_applied, outbox, inbox").execute(&pool).await.unwrap();
        let (k, producer) = topics("group").await;
        // 48 orders over four lanes, two facts each, interleaved; one more fact is refused.
        let orders: Vec<Uuid> = (0..48).map(|_| Uuid::new_v4()).collect();
        let firsts: Vec<Envelope> = orders.iter().map(|o| fact(*o, "issue")).collect();
        let seconds: Vec<Envelope> = orders.iter().map(|o| fact(*o, "issue")).collect();
        let refuse = fact(Uuid::new_v4(), "issue");
        let mut facts: Vec<Envelope> = firsts.iter().chain(&seconds).cloned().collect();
        facts.insert(20, refuse.clone());
        publish(&k, &producer, &facts).await;
        let shutdown = CancellationToken::new();
        let (tasks, _) = run_consumers(
            &k,
            pool.clone(),
            Arc::new(Probe { refuse: refuse.event_id, ..Default::default() }),
            producer.clone(),
            grouped(4, batch),
            boxoffice_bus::Followers::none(),
            shutdown.clone(),
        )
        .unwrap();
        eventually(Duration::from_secs(60), "the 96 facts applied", || async {
            applied(&pool).await.len() >= 96
        })
        .await;
        eventually(Duration::from_secs(60), "the refused fact dead-lettered", || {
            let k = k.clone();
            async move { !boxoffice_bus::dlq::list(&k, Duration::from_secs(5)).await.unwrap().is_empty() }
        })
        .await;
        shutdown.cancel();
        for t in tasks {
            t.await.unwrap();
        }
        let letters = boxoffice_bus::dlq::list(&k, Duration::from_secs(5)).await.unwrap();
        assert_eq!(letters.len(), 1, "batch {batch}: {letters:?}");
        assert_eq!(letters[0].record["event_id"], refuse.event_id.to_string());
        let rows = applied(&pool).await;
        assert_eq!(rows.len(), 96, "batch {batch}: each fact once, the refused one never");
        let ids: std::collections::HashSet<Uuid> = rows.iter().map(|r| r.0).collect();
        assert_eq!(ids.len(), 96, "batch {batch}");
        for (first, second) in firsts.iter().zip(&seconds) {
            let order: Vec<Uuid> = rows.iter().filter(|r| r.1 == first.aggregate_id).map(|r| r.0).collect();
            assert_eq!(order, vec![first.event_id, second.event_id], "batch {batch}: in partition order");
        }
        let mut per_xact: std::collections::HashMap<&str, Vec<Uuid>> = Default::default();
        for (_, order, xact) in &rows {
            per_xact.entry(xact.as_str()).or_default().push(*order);
        }
        for orders in per_xact.values() {
            let distinct: std::collections::HashSet<&Uuid> = orders.iter().collect();
            assert_eq!(distinct.len(), orders.len(), "batch {batch}: one fact of an order per transaction");
        }
        if batch == 1 {
            // A lane's run is one fact: a transaction with more joined several lanes.
            assert!(
                per_xact.values().any(|orders| orders.len() > 1),
                "the lanes' runs shared a transaction: {} transactions for 96 facts",
                per_xact.len()
            );
        }
        each_applied_fact_emitted_once_in_its_transaction(&pool).await;
    }
}

/// The committer's rules for runs handed to it together (`handle_group`, what a member's
/// committer does with the runs of its lanes): runs of different lanes share one
/// transaction; when one of them fails the group, the others are committed each in its own
/// transaction with the answers they have (their `prepare` is not run again), and the
/// failing run gets its error, nothing of it written.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_group_that_fails_commits_its_other_runs_alone_with_their_answers(
    pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let pool = pool_opts.max_connections(4).connect_with(opts).await.unwrap();
    probe_table(&pool).await;
    let none = boxoffice_bus::Followers::none();
    let issue = || fact(Uuid::new_v4(), "issue");
    let xacts = |pool: PgPool, ids: Vec<Uuid>| async move {
        sqlx::query_scalar::<_, String>("SELECT DISTINCT xact FROM probe_applied WHERE event_id = ANY($1)")
            .bind(&ids)
            .fetch_all(&pool)
            .await
            .unwrap()
    };

    // Three runs that all apply: one transaction.
    let runs = vec![vec![issue(), issue()], vec![issue()], vec![issue()]];
    let probe = Probe::default();
    let answers = handle_group(&pool, &probe, &none, &runs).await.unwrap();
    for (run, answer) in runs.iter().zip(&answers) {
        let d = answer.as_ref().expect("applied");
        assert_eq!(d, &vec![Some(Disposition::Applied); run.len()]);
    }
    let ids: Vec<Uuid> = runs.iter().flatten().map(|e| e.event_id).collect();
    assert_eq!(xacts(pool.clone(), ids).await.len(), 1, "the runs shared one transaction");

    // A refused fact in the second run: the first and third are committed alone, each once,
    // with the answers they had; the second gets its error and writes nothing.
    let refused = issue();
    let runs = vec![vec![issue(), issue()], vec![issue(), refused.clone()], vec![issue()]];
    let probe = Probe { refuse: refused.event_id, ..Default::default() };
    let answers = handle_group(&pool, &probe, &none, &runs).await.unwrap();
    for k in [0, 2] {
        let d = answers[k].as_ref().expect("committed without the failing run");
        assert_eq!(d, &vec![Some(Disposition::Applied); runs[k].len()], "run {k}");
        let ids: Vec<Uuid> = runs[k].iter().map(|e| e.event_id).collect();
        assert_eq!(xacts(pool.clone(), ids.clone()).await.len(), 1, "run {k}: its own transaction");
        let prepared = probe.prepared.lock().unwrap().clone();
        for id in ids {
            assert_eq!(prepared.iter().filter(|p| **p == id).count(), 1, "run {k}: prepared once");
        }
    }
    match &answers[1] {
        Err(HandlerError::Permanent { code, .. }) => assert_eq!(*code, "probe_refused"),
        other => panic!("the failing run gets its error: {other:?}"),
    }
    let ids: Vec<Uuid> = runs[1].iter().map(|e| e.event_id).collect();
    assert!(xacts(pool.clone(), ids).await.is_empty(), "nothing of the failing run written");
    let first = xacts(pool.clone(), runs[0].iter().map(|e| e.event_id).collect()).await;
    let third = xacts(pool.clone(), runs[2].iter().map(|e| e.event_id).collect()).await;
    assert_ne!(first, third, "each run alone");
    each_applied_fact_emitted_once_in_its_transaction(&pool).await;
}

/// An order's row locked by another session (an operator's, say) does not stall a member's
/// committer (`boxoffice_bus::consumer::GROUP_LOCK_TIMEOUT_MS`): with no statement timeout
/// at all, the group that waits for the lock gives up after the lock timeout, its lanes
/// apply their runs alone, and the other lanes' facts are applied while the lock is still
/// held; the locked order's fact is applied once it is released; each fact once, nothing
/// dead-lettered.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_locked_order_holds_up_a_group_for_the_lock_timeout_only(
    pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let pool = pool_opts.max_connections(8).connect_with(opts).await.unwrap();
    probe_table(&pool).await;
    sqlx::query("CREATE TABLE probe_orders (order_id uuid PRIMARY KEY)").execute(&pool).await.unwrap();
    let (k, producer) = topics("locked").await;
    let locked = fact(Uuid::new_v4(), "issue");
    sqlx::query("INSERT INTO probe_orders (order_id) VALUES ($1)")
        .bind(locked.aggregate_id)
        .execute(&pool)
        .await
        .unwrap();
    let mut operator = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM probe_orders WHERE order_id = $1 FOR UPDATE")
        .bind(locked.aggregate_id)
        .execute(&mut *operator)
        .await
        .unwrap();
    // The locked order's fact first, then 24 of other orders.
    let others: Vec<Envelope> = (0..24).map(|_| fact(Uuid::new_v4(), "issue")).collect();
    let facts: Vec<Envelope> = std::iter::once(locked.clone()).chain(others.iter().cloned()).collect();
    publish(&k, &producer, &facts).await;
    let shutdown = CancellationToken::new();
    let (tasks, _) = run_consumers(
        &k,
        pool.clone(),
        Arc::new(Probe { locks: true, ..Default::default() }),
        producer.clone(),
        grouped(4, 1),
        boxoffice_bus::Followers::none(),
        shutdown.clone(),
    )
    .unwrap();
    // Four lanes: the locked order's lane waits for the lock, the other three go on (19 or
    // more of the 24 orders fall on the locked order's lane with a chance of about 4 in 10^8).
    let ids: Vec<Uuid> = others.iter().map(|f| f.event_id).collect();
    let applied_of = |ids: Vec<Uuid>| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM probe_applied WHERE event_id = ANY($1)")
                .bind(&ids)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    eventually(Duration::from_secs(30), "other orders' facts applied while the lock is held", || {
        let n = applied_of(ids.clone());
        async move { n.await >= 6 }
    })
    .await;
    assert_eq!(applied_of(vec![locked.event_id]).await, 0, "the locked order waits");
    operator.rollback().await.unwrap();
    let all: Vec<Uuid> = facts.iter().map(|f| f.event_id).collect();
    eventually(Duration::from_secs(60), "every fact applied once the lock is gone", || {
        let n = applied_of(all.clone());
        async move { n.await >= 25 }
    })
    .await;
    shutdown.cancel();
    for t in tasks {
        t.await.unwrap();
    }
    let rows = applied(&pool).await;
    assert_eq!(rows.len(), 25, "each fact once");
    let letters = boxoffice_bus::dlq::list(&k, Duration::from_secs(2)).await.unwrap();
    assert!(letters.is_empty(), "nothing dead-lettered: {letters:?}");
}

/// With two group transactions open at most (`consumer_group_commits_max` 2), a
/// group that takes long (its fact's effect sleeps in the transaction) does not hold up the
/// other lanes: facts that arrive meanwhile are committed by a second group transaction
/// while the first is still open. With one, each commit waits for the one before: nothing
/// else is committed until the slow group ends. Either way each fact is applied once.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_second_open_group_commits_what_arrives_while_a_slow_one_is_open(
    pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let pool = pool_opts.max_connections(8).connect_with(opts).await.unwrap();
    probe_table(&pool).await;
    for open in [2, 1] {
        sqlx::query("TRUNCATE probe_applied").execute(&pool).await.unwrap();
        let (k, producer) = topics("slow").await;
        let slow = fact(Uuid::new_v4(), "issue");
        let shutdown = CancellationToken::new();
        let (tasks, _) = run_consumers(
            &k,
            pool.clone(),
            Arc::new(Probe { slow: slow.aggregate_id, ..Default::default() }),
            producer.clone(),
            boxoffice_bus::Members { group_commits: open, ..grouped(4, 1) },
            boxoffice_bus::Followers::none(),
            shutdown.clone(),
        )
        .unwrap();
        publish(&k, &producer, std::slice::from_ref(&slow)).await;
        // The slow group open, its effect sleeping: (sleeping, facts of other orders applied),
        // read together.
        let now = || {
            let pool = pool.clone();
            async move {
                sqlx::query_as::<_, (bool, i64)>(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                                     WHERE datname = current_database() AND wait_event = 'PgSleep'),
                            (SELECT count(*) FROM probe_applied WHERE order_id <> $1)",
                )
                .bind(slow.aggregate_id)
                .fetch_one(&pool)
                .await
                .unwrap()
            }
        };
        eventually(Duration::from_secs(30), "the slow group open", || async { now().await.0 }).await;
        // 24 orders on four lanes: 6 or more fall beside the slow order's lane but with a
        // chance of about 4 in 10^8.
        let others: Vec<Envelope> = (0..24).map(|_| fact(Uuid::new_v4(), "issue")).collect();
        publish(&k, &producer, &others).await;
        let mut during = 0;
        loop {
            let (sleeping, applied) = now().await;
            if !sleeping {
                break;
            }
            during = applied;
            if applied >= 6 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        if open == 2 {
            assert!(during >= 6, "facts of other lanes committed while the slow group was open: {during}");
        } else {
            assert_eq!(during, 0, "with one group transaction open, every commit waits for the slow one");
        }
        eventually(Duration::from_secs(60), "every fact applied", || {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM probe_applied")
                    .fetch_one(&pool)
                    .await
                    .unwrap()
                    >= 25
            }
        })
        .await;
        shutdown.cancel();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(applied(&pool).await.len(), 25, "open {open}: each fact once");
    }
}

/// A statement the database gives up (here its `statement_timeout`, while the table it
/// writes is locked: SQLSTATE 57014) fails the attempt, not the fact, and is not tried again
/// in place (`HandlerError::Overloaded`): alone (batch 1) or in a shared batch (batch 16,
/// whose messages are not then tried one by one), each fact's next attempt comes from the
/// retry topic, at least its delay after the one before; once the lock is gone each fact is
/// applied once, and nothing is dead-lettered.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_statement_the_server_gives_up_is_tried_again_later_not_at_once(
    pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let pool = pool_opts.max_connections(4).connect_with(opts.clone()).await.unwrap();
    probe_table(&pool).await;
    // The consumer's sessions give a statement up after 200 ms.
    let impatient = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(opts.options([("statement_timeout", "200")]))
        .await
        .unwrap();
    let delay = Duration::from_millis(1_000);
    for batch in [1, 16] {
        let mut blocker = pool.begin().await.unwrap();
        sqlx::query("LOCK TABLE probe_applied IN ACCESS EXCLUSIVE MODE")
            .execute(&mut *blocker)
            .await
            .unwrap();
        let (mut k, producer) = topics("overload").await;
        k.retry.retry_5s_delay_ms = delay.as_millis() as u64;
        k.retry.retry_1m_delay_ms = delay.as_millis() as u64;
        // Queued before the consumer starts: one lane finds them all waiting.
        let facts: Vec<Envelope> = (0..4).map(|_| fact(Uuid::new_v4(), "issue")).collect();
        publish(&k, &producer, &facts).await;
        let handler = Arc::new(Probe::default());
        let shutdown = CancellationToken::new();
        let (tasks, _) = run_consumers(
            &k,
            impatient.clone(),
            handler.clone(),
            producer.clone(),
            members(1, batch, 0),
            boxoffice_bus::Followers::none(),
            shutdown.clone(),
        )
        .unwrap();
        // The lock is held until six attempts have begun: all of them timed out.
        let begun = || handler.attempts.lock().unwrap().len();
        eventually(Duration::from_secs(60), "six attempts, each given up", || async { begun() >= 6 }).await;
        blocker.rollback().await.unwrap();
        let ids: Vec<Uuid> = facts.iter().map(|f| f.event_id).collect();
        eventually(Duration::from_secs(60), "the facts applied", || async {
            applied(&pool).await.iter().filter(|r| ids.contains(&r.0)).count() >= ids.len()
        })
        .await;
        shutdown.cancel();
        for t in tasks {
            t.await.unwrap();
        }
        let rows: Vec<Uuid> =
            applied(&pool).await.into_iter().map(|r| r.0).filter(|id| ids.contains(id)).collect();
        assert_eq!(rows.len(), ids.len(), "batch {batch}: each fact once: {rows:?}");
        let attempts = handler.attempts.lock().unwrap().clone();
        for id in &ids {
            let times: Vec<std::time::Instant> =
                attempts.iter().filter(|a| a.0 == *id).map(|a| a.1).collect();
            for pair in times.windows(2) {
                assert!(
                    pair[1] - pair[0] >= delay,
                    "batch {batch}: fact {id} tried again {:?} after a given-up attempt, not from the retry topic",
                    pair[1] - pair[0]
                );
            }
        }
        assert_eq!(
            boxoffice_bus::dlq::depth(&k, Duration::from_secs(5)).await.unwrap(),
            0,
            "nothing dead-lettered"
        );
    }
}
