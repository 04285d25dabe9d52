//! The consumer runner's shared transactions (`boxoffice_bus::consumer`, "Batches") against
//! the real broker: facts of several orders that queued up for one lane are applied in one
//! transaction (at most one fact of an order in each), each once, in partition order per
//! order, duplicates included; a fact the
//! consumer ignores costs nothing; what each fact emits is written to the outbox in its
//! transaction, once; and one failing fact rolls its batch back, is dead-lettered alone, and
//! costs the others nothing but a second try.

use crate::helpers::{eventually, test_brokers};
use async_trait::async_trait;
use boxoffice::config::Config;
use boxoffice_bus::consumer::{run_consumers, Handler, HandlerError};
use boxoffice_domain::{Envelope, EventKind, HoldId, OrderId, PurchaseEvent, Topic};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Records each fact it applies, with the transaction that applied it; refuses `refuse`.
struct Probe {
    refuse: Uuid,
}

#[async_trait]
impl Handler for Probe {
    type Prepared = ();

    fn name(&self) -> &'static str {
        "probe"
    }

    fn wants(&self, kind: EventKind) -> bool {
        kind == EventKind::TicketIssueRequested
    }

    async fn prepare(&self, _: &Envelope, _: &PurchaseEvent) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn apply(
        &self,
        tx: &mut boxoffice_store::Tx<'_>,
        env: &Envelope,
        _: &PurchaseEvent,
        _: (),
    ) -> Result<Vec<Envelope>, HandlerError> {
        if env.event_id == self.refuse {
            return Err(HandlerError::permanent("probe_refused", anyhow::anyhow!("refused")));
        }
        sqlx::query(
            "INSERT INTO probe_applied (event_id, order_id, xact) VALUES ($1, $2, pg_current_xact_id()::text)",
        )
        .bind(env.event_id)
        .bind(env.aggregate_id)
        .execute(&mut **tx)
        .await?;
        // A fact that follows, which the runner writes to the outbox (a batch's in one statement).
        Ok(vec![env.follow(&PurchaseEvent::TicketIssued { order_id: env.order_id(), ticket_ids: vec![] })])
    }
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
        _ => PurchaseEvent::OrderConfirmed { order_id: o, hold_id: h },
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
    sqlx::query(
        "CREATE TABLE probe_applied (seq bigserial PRIMARY KEY, event_id uuid NOT NULL, order_id uuid NOT NULL,
                                     xact text NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let cfg = Config {
        kafka_brokers: Some(test_brokers()),
        kafka_topic_prefix: format!("batch{}.", &Uuid::new_v4().simple().to_string()[..8]),
        kafka_partitions: 1,
        ..Config::default()
    };
    let k = cfg.kafka().unwrap();
    boxoffice_bus::topics::create_all(&k).await.unwrap();
    let producer = boxoffice_bus::producer::build(&k).unwrap();

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
        std::sync::Arc::new(Probe { refuse: refuse.event_id }),
        producer.clone(),
        boxoffice_bus::Members { instances: 1, lanes: 1, batch: 32 },
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
