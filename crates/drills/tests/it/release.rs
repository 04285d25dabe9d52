//! The release controller in closed loop (design §3): real PostgreSQL, Redis and broker. `R`
//! climbs to max while every signal is healthy; a real cause drives one signal over its
//! threshold (an outbox row left unpublished for an hour, a session blocked on a row lock,
//! messages no consumer group has read) and `R` falls, naming that signal on `/metrics`; removing the cause lets `R` recover.
//! The queue moves by exactly the allowance `R` granted, and one controller per cell leads,
//! another taking over when it stops.

use crate::helpers::{eventually, test_brokers, test_redis_url, TestApp};
use boxoffice::config::Config;
use boxoffice::runtime::Role;
use boxoffice_domain::{EventId, Topic, UserId};
use boxoffice_store::venue::VenueSpec;
use boxoffice_waitroom::{Waitroom, WaitroomConfig};
use boxoffice_workers::release::{Action, Controller, ReleaseSettings, Signal, Status, LAG_CONSUMERS};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const MAX: f64 = 20.0;
const MIN: f64 = 2.0;

/// Settings that keep every signal but the driven ones far from their thresholds, so other
/// tests sharing the server cannot move `R`.
fn tune(c: &mut Config, cell: &str) {
    c.purchase_cell = cell.to_owned();
    c.admission_direct = false;
    c.rate_limit_ip_per_s = 0.0;
    c.rate_limit_user_per_s = 0.0;
    c.waitroom_abandon_after_ms = 600_000;
    c.kafka_brokers = Some(test_brokers());
    c.kafka_topic_prefix = format!("t{}.", Uuid::new_v4().simple());
    c.release_max_per_s = MAX;
    c.release_min_per_s = MIN;
    c.release_initial_per_s = MIN;
    c.release_step_per_s = 6.0;
    c.release_decrease_factor = 0.5;
    c.release_tick_ms = 100;
    c.release_probe_timeout_ms = 2_000;
    c.release_threshold_pg_commit_ms = 2_000.0;
    c.release_threshold_lock_waits = 0.0;
    c.release_threshold_deadlocks = 1e6;
    c.release_threshold_connection_saturation = 10.0;
    c.release_threshold_outbox_age_ms = 2_000.0;
    c.release_threshold_consumer_lag = 10.0;
    c.release_threshold_active_holds = 1e6;
    c.release_threshold_expiry_delay_ms = 1e9;
}

/// The value of `name{cell="…"[,extra]}` on `/metrics`.
fn metric(text: &str, name: &str, cell: &str, extra: &str) -> Option<f64> {
    text.lines().filter(|l| l.starts_with(&format!("{name}{{"))).find_map(|l| {
        let (labels, value) = l.rsplit_once(' ')?;
        (labels.contains(&format!("cell=\"{cell}\"")) && labels.contains(extra))
            .then(|| value.parse().ok())?
    })
}

async fn scrape(app: &TestApp) -> String {
    app.http.get(format!("{}/metrics", app.api)).send().await.unwrap().text().await.unwrap()
}

async fn await_status(rx: &watch::Receiver<Status>, what: &str, pred: impl Fn(&Status) -> bool) {
    eventually(Duration::from_secs(20), what, || {
        let ok = pred(&rx.borrow());
        async move { ok }
    })
    .await;
}

fn decreased_for(s: &Status, sig: Signal) -> bool {
    s.decision.as_ref().is_some_and(|d| d.action == Action::Decrease && d.over.contains(&sig))
}

/// R climbs to max; an old unpublished outbox row drives `outbox_age_ms` over and R falls to
/// min; publishing it lets R recover; a session blocked on a row lock drives `lock_waits`
/// over and R falls again; releasing the lock lets it recover; unread messages on the purchase
/// topic drive `consumer_lag` over until the groups commit the high-water marks. Every signal is exported, the
/// decreases are counted by reason, and the queue moved by what R allowed.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn release_rate_falls_when_a_signal_crosses_and_recovers(_: PgPoolOptions, opts: PgConnectOptions) {
    let cell = format!("cell-{}", Uuid::new_v4().simple());
    let app =
        TestApp::spawn_with(opts.clone(), &[Role::Api], VenueSpec::small(1, 2, 10), |c| tune(c, &cell)).await;
    let status = app.release_status();
    let room = Waitroom::new(app.cfg.waitroom()).unwrap();
    let event = EventId(app.event);
    const QUEUED: u64 = 1_000;
    for _ in 0..QUEUED {
        room.join(event, UserId(Uuid::new_v4())).await.unwrap();
    }

    // Healthy: R climbs to max, and the broker's lag probe answers for real.
    await_status(&status, "R at max", |s| s.leader && s.rate_per_s == MAX).await;
    {
        let s = status.borrow();
        assert!(
            matches!(s.signals.get(Signal::ConsumerLag), boxoffice_workers::release::Reading::Value(v) if v == 0.0),
            "{:?}",
            s.signals
        );
        assert!(s.decreases.is_empty(), "{:?}", s.decreases);
    }
    let m = scrape(&app).await;
    assert_eq!(metric(&m, "boxoffice_release_rate_per_s", &cell, ""), Some(MAX), "{m}");
    assert_eq!(metric(&m, "boxoffice_release_leader", &cell, ""), Some(1.0));
    for sig in Signal::ALL {
        let label = format!("signal=\"{}\"", sig.name());
        assert!(
            metric(&m, "boxoffice_release_signal", &cell, &label).is_some(),
            "{} not exported",
            sig.name()
        );
        assert!(metric(&m, "boxoffice_release_signal_threshold", &cell, &label).is_some());
    }
    assert_eq!(
        metric(&m, "boxoffice_release_signal_threshold", &cell, "signal=\"outbox_age_ms\""),
        Some(2_000.0)
    );

    // An event the relay never published, an hour old.
    let row = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO outbox (id, topic, message_key, event_type, payload, created_at)
         VALUES ($1, 'ticketing.purchase.v1', $1::text, 'HoldPlaced', '{}', now() - interval '1 hour')",
    )
    .bind(row)
    .execute(&app.pool)
    .await
    .unwrap();
    await_status(&status, "R falling for outbox_age_ms", |s| {
        decreased_for(s, Signal::OutboxAgeMs) && s.rate_per_s < MAX
    })
    .await;
    await_status(&status, "R at min", |s| s.rate_per_s == MIN).await;
    let m = scrape(&app).await;
    assert!(
        metric(&m, "boxoffice_release_decreases_total", &cell, "reason=\"outbox_age_ms\"").unwrap() >= 1.0
    );
    assert!(metric(&m, "boxoffice_release_signal", &cell, "signal=\"outbox_age_ms\"").unwrap() > 3_000_000.0);
    assert_eq!(metric(&m, "boxoffice_release_state", &cell, ""), Some(-1.0));

    // Published: R recovers to max.
    sqlx::query("UPDATE outbox SET published_at = now() WHERE id = $1")
        .bind(row)
        .execute(&app.pool)
        .await
        .unwrap();
    await_status(&status, "R back at max", |s| s.rate_per_s == MAX).await;

    // A buyer's transaction holds a seat's row lock; another waits on it.
    let seat = app.seats().await[0];
    let mut holder = PgConnection::connect_with(&opts).await.unwrap();
    let mut tx = holder.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM seats WHERE id = $1 FOR UPDATE").bind(seat).execute(&mut *tx).await.unwrap();
    let waiter_opts = opts.clone();
    let waiter = tokio::spawn(async move {
        let mut c = PgConnection::connect_with(&waiter_opts).await.unwrap();
        sqlx::query("SELECT 1 FROM seats WHERE id = $1 FOR UPDATE").bind(seat).execute(&mut c).await.unwrap();
    });
    await_status(&status, "R falling for lock_waits", |s| {
        decreased_for(s, Signal::LockWaits) && s.rate_per_s < MAX
    })
    .await;
    let m = scrape(&app).await;
    assert!(metric(&m, "boxoffice_release_decreases_total", &cell, "reason=\"lock_waits\"").unwrap() >= 1.0);
    tx.rollback().await.unwrap();
    waiter.await.unwrap();
    await_status(&status, "R back at max after the lock", |s| s.rate_per_s == MAX).await;

    // Messages no consumer has read: the purchase topic's consumer lag goes over.
    let kafka = app.cfg.kafka().unwrap();
    let topic = kafka.topic(Topic::Purchase.name());
    let producer = boxoffice_bus::producer::build(&kafka).unwrap();
    for i in 0..60 {
        boxoffice_bus::producer::send(&producer, &topic, &format!("order-{i}"), b"{}", &[]).await.unwrap();
    }
    await_status(&status, "R falling for consumer_lag", |s| {
        decreased_for(s, Signal::ConsumerLag) && s.rate_per_s < MAX
    })
    .await;
    let m = scrape(&app).await;
    assert!(metric(&m, "boxoffice_release_signal", &cell, "signal=\"consumer_lag\"").unwrap() > 10.0);
    // The consumer groups catch up (commit the high-water marks): R recovers.
    let catch_up = kafka.clone();
    tokio::task::spawn_blocking(move || commit_high_water(&catch_up)).await.unwrap();
    await_status(&status, "R back at max after the lag", |s| s.rate_per_s == MAX).await;

    // The queue moved by the allowance R granted: within one position (the carried fraction).
    app.stop().await;
    let s = status.borrow().clone();
    let stats = room.stats(event).await.unwrap();
    assert!(stats.queued > 0, "the queue never ran dry");
    assert_eq!(QUEUED - stats.queued, s.admitted, "admitted per Redis vs per controller");
    assert_eq!(stats.admitted_live, s.admitted);
    assert!(s.admitted as f64 <= s.allowance + 1e-6 && s.allowance < s.admitted as f64 + 1.0, "{s:?}");
    assert!(s.admitted > 0);
    for sig in [Signal::OutboxAgeMs, Signal::LockWaits, Signal::ConsumerLag] {
        assert!(s.decreases.get(&sig).is_some_and(|n| *n >= 1), "{sig:?}: {:?}", s.decreases);
    }
    println!("last readings: {:?}; one sampling of every signal took {:.1} ms", s.signals, s.sample_ms);
    assert!(!s.decreases.contains_key(&Signal::PgCommitMs), "{:?}", s.decreases);
}

/// Commits the purchase topic's high-water marks for every consumer group the controller
/// watches, as caught-up consumers would.
fn commit_high_water(kafka: &boxoffice_bus::KafkaConfig) {
    let topic = kafka.topic(Topic::Purchase.name());
    for name in LAG_CONSUMERS {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &kafka.brokers)
            .set("group.id", kafka.group(name))
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in 0..kafka.partitions {
            let (_, high) = c.fetch_watermarks(&topic, p, Duration::from_secs(5)).unwrap();
            tpl.add_partition_offset(&topic, p, Offset::Offset(high)).unwrap();
        }
        c.commit(&tpl, CommitMode::Sync).unwrap();
    }
}

/// Two controllers of one cell on one database: exactly one holds the advisory lock and
/// releases; when it stops, the other takes over.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn release_controller_has_one_leader_per_cell_and_fails_over(_: PgPoolOptions, opts: PgConnectOptions) {
    let room = Waitroom::new(WaitroomConfig {
        redis_url: test_redis_url().into(),
        key_prefix: format!("t{}:", Uuid::new_v4().simple()),
        ..Default::default()
    })
    .unwrap();
    let settings = ReleaseSettings {
        cell: format!("cell-{}", Uuid::new_v4().simple()),
        tick_ms: 50,
        ..Default::default()
    };
    let start = || {
        let (c, rx) = Controller::new(opts.clone(), room.clone(), None, settings.clone()).unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn(c.run(stop.clone()));
        (rx, stop, task)
    };
    let (a, stop_a, task_a) = start();
    let (b, stop_b, task_b) = start();
    eventually(Duration::from_secs(20), "one leader with ticks", || {
        let (sa, sb) = (a.borrow().clone(), b.borrow().clone());
        async move { sa.leader != sb.leader && sa.ticks + sb.ticks >= 5 }
    })
    .await;
    // Several ticks later it is still exactly one, the same.
    let first_is_a = a.borrow().leader;
    let (lead, follow) = if first_is_a { (&a, &b) } else { (&b, &a) };
    let ticks = lead.borrow().ticks;
    eventually(Duration::from_secs(20), "the leader keeps ticking", || {
        let t = lead.borrow().ticks;
        async move { t >= ticks + 5 }
    })
    .await;
    assert!(!follow.borrow().leader && follow.borrow().ticks == 0);

    // The leader stops (its session ends, and with it the lock): the other takes over.
    let (stop_lead, task_lead, stop_follow, task_follow) =
        if first_is_a { (stop_a, task_a, stop_b, task_b) } else { (stop_b, task_b, stop_a, task_a) };
    stop_lead.cancel();
    task_lead.await.unwrap();
    assert!(!lead.borrow().leader);
    eventually(Duration::from_secs(20), "the other controller took over", || {
        let s = follow.borrow().clone();
        async move { s.leader && s.ticks >= 2 }
    })
    .await;
    stop_follow.cancel();
    task_follow.await.unwrap();
}
