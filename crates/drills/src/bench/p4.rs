//! P4: relay publish throughput. Fills a fresh database's outbox with N `HoldCreated`
//! envelopes (`outbox::insert_all` in large transactions, as business writes would have),
//! then runs the relay role (`boxoffice_workers::relay`, configured as `serve` does) against
//! the broker and times it until every row is marked published: events/s into the broker.
//! The relay's own guarantee (mark only what the broker acknowledged) is unchanged; this
//! only measures it.

use super::{BenchArgs, BenchDb};
use boxoffice::config::Config;
use boxoffice::runtime::{self, Role};
use boxoffice_domain::{Envelope, EventId, HoldId, OrderId, PurchaseEvent, SeatId};
use boxoffice_harness::deploy;
use boxoffice_harness::drain::Drain;
use boxoffice_store::outbox;
use serde::Serialize;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Rows per `insert_all` statement while filling.
const FILL_CHUNK: usize = 5_000;
/// Rows per filling transaction.
const FILL_TX: usize = 50_000;

/// P4's result.
#[derive(Debug, Clone, Serialize)]
pub struct P4Result {
    /// Outbox rows published.
    pub events: usize,
    /// Rows per relay batch (`relay_batch`).
    pub relay_batch: i64,
    /// Seconds to fill the outbox.
    pub fill_seconds: f64,
    /// Seconds from relay start to the last row marked published.
    pub drain_seconds: f64,
    /// `events / drain_seconds`.
    pub events_per_s: f64,
    /// Whether every row was published before the deadline.
    pub drained: bool,
    /// The broker used.
    pub broker: String,
}

/// Runs P4 on a fresh database (dropped afterwards) and a fresh topic prefix.
pub async fn run(
    cfg: &Config,
    args: &BenchArgs,
    embedded: Option<&boxoffice_bus::embedded::EmbeddedBroker>,
) -> anyhow::Result<P4Result> {
    let (db, pool) = BenchDb::migrated(cfg, "p4", 4).await?;
    let result = async {
        let mut cfg = cfg.clone();
        super::fresh_topic_prefix(&mut cfg);
        deploy::create_topics(&cfg, embedded).await?;
        let filled = Instant::now();
        fill(&pool, args.p4_events).await?;
        let fill_seconds = filled.elapsed().as_secs_f64();
        eprintln!("   filled {} outbox rows in {:.1} s", args.p4_events, fill_seconds);
        let shutdown = CancellationToken::new();
        let started = Instant::now();
        let running = runtime::start(&cfg, &[Role::Relay], db.opts.clone(), shutdown.clone()).await?;
        let drained =
            Drain::outbox(Duration::from_secs(600), Duration::from_millis(20)).run(&pool).await?.done;
        let drain_seconds = started.elapsed().as_secs_f64();
        shutdown.cancel();
        running.join().await;
        let events_per_s = args.p4_events as f64 / drain_seconds;
        eprintln!(
            "   relay published {} events in {:.2} s: {:.0} events/s",
            args.p4_events, drain_seconds, events_per_s
        );
        Ok(P4Result {
            events: args.p4_events,
            relay_batch: cfg.relay_batch,
            fill_seconds,
            drain_seconds,
            events_per_s,
            drained,
            broker: if embedded.is_some() { "embedded".into() } else { "external".into() },
        })
    }
    .await;
    pool.close().await;
    db.drop_db().await;
    result
}

/// Inserts `n` envelopes for distinct orders into the outbox.
async fn fill(pool: &sqlx::PgPool, n: usize) -> anyhow::Result<()> {
    let event = EventId(uuid::Uuid::new_v4());
    let mut left = n;
    while left > 0 {
        let mut tx = pool.begin().await?;
        let in_tx = left.min(FILL_TX);
        let mut done = 0;
        while done < in_tx {
            let k = (in_tx - done).min(FILL_CHUNK);
            let envelopes: Vec<Envelope> = (0..k)
                .map(|_| {
                    let order = OrderId::new();
                    Envelope::new(
                        order,
                        &PurchaseEvent::HoldCreated {
                            order_id: order,
                            hold_id: HoldId::new(),
                            event_id: event,
                            seat_ids: vec![SeatId(uuid::Uuid::new_v4()), SeatId(uuid::Uuid::new_v4())],
                            expires_at: chrono::Utc::now() + chrono::Duration::minutes(5),
                            amount_minor: 24_000,
                            currency: "usd".into(),
                            authorization_requested: false,
                            is_authorization_request: true,
                        },
                        uuid::Uuid::new_v4(),
                        None,
                    )
                })
                .collect();
            outbox::insert_all(&mut tx, &envelopes).await?;
            done += k;
        }
        tx.commit().await?;
        left -= in_tx;
    }
    Ok(())
}
