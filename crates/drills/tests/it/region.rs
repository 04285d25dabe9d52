//! The region epoch (design §15, §17): a regional promotion rejects the old region epoch — at
//! the API, in the ledger for a code path that skips every check, and for a returning old
//! primary whose own epoch record was never fenced (its lease lapsed); the fence waits only
//! for writers in flight and queues new ones; facts of a fenced writer outside the ledger's
//! cut are parked, not applied; `region republish` sends the recovery window again.

use crate::helpers::{eventually, problem, Extra, TestApp};
use boxoffice::config::Config;
use boxoffice::runtime::Role;
use boxoffice_bus::consumer::{handle_once_at, Disposition, Handler, HandlerError};
use boxoffice_domain::{Envelope, EventKind, OrderId, PurchaseEvent};
use boxoffice_store::region::{self, Refusal, Writer};
use boxoffice_store::venue::VenueSpec;
use boxoffice_store::{witness, Tx};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use uuid::Uuid;

fn writer(region: &str, epoch: i64) -> Writer {
    Writer { region: region.into(), epoch }
}

/// A pool whose sessions write as `w`.
async fn writer_pool(opts: &PgConnectOptions, w: &Writer) -> PgPool {
    boxoffice_store::connect(region::writer_options(opts.clone(), w), 4, 10_000).await.unwrap()
}

/// An outbox row written straight to the ledger, as a code path that skips every check in
/// Rust would.
async fn raw_outbox_write(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO outbox (id, topic, message_key, event_type, payload) VALUES ($1, 't', 'k', 'Raw', '{}')",
    )
    .bind(Uuid::new_v4())
    .execute(pool)
    .await
    .map(|_| ())
}

fn refusal_of(r: Result<(), sqlx::Error>) -> Option<Refusal> {
    r.err().as_ref().and_then(region::refusal)
}

/// Design §17: after a promotion fences epoch 1, a hold at epoch 1 is 503 `region_fenced`
/// with nothing written, a raw write at epoch 1 is refused by the ledger itself (BXF01), and
/// the new epoch writes.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_promotion_rejects_the_old_region_epoch(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = TestApp::spawn(opts.clone(), &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let seats = app.seats().await;
    let b = app.buyer();
    let adm = app.admission_token(&b);
    let r = app.hold(&b, &adm, &Uuid::new_v4().to_string(), &seats[..1]).await;
    assert_eq!(r.status().as_u16(), 202, "epoch 1 sells before the fence");

    let f = region::fence(&app.pool, &writer("dr", 2), "test").await.unwrap();
    assert_eq!((f.from.epoch, f.to.epoch), (1, 2));
    assert!(matches!(
        region::fence(&app.pool, &writer("primary", 2), "test").await,
        Err(region::FenceError::NotNewer { current: 2, .. })
    ));

    let holds_before = app.count("SELECT count(*) FROM holds").await;
    let outbox_before = app.count("SELECT count(*) FROM outbox").await;
    let b2 = app.buyer();
    let adm2 = app.admission_token(&b2);
    let (status, code, body) =
        problem(app.hold(&b2, &adm2, &Uuid::new_v4().to_string(), &seats[1..2]).await).await;
    assert_eq!((status, code.as_str()), (503, "region_fenced"), "{body}");
    assert_eq!(app.count("SELECT count(*) FROM holds").await, holds_before, "nothing written");
    assert_eq!(app.count("SELECT count(*) FROM outbox").await, outbox_before, "nothing written");

    let old = writer_pool(&opts, &writer("primary", 1)).await;
    assert_eq!(refusal_of(raw_outbox_write(&old).await), Some(Refusal::Fenced));
    let new = writer_pool(&opts, &writer("dr", 2)).await;
    raw_outbox_write(&new).await.expect("the new epoch writes");
    let (region_col, epoch_col): (Option<String>, Option<i64>) =
        sqlx::query_as("SELECT region, region_epoch FROM outbox WHERE event_type = 'Raw'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!((region_col.as_deref(), epoch_col), (Some("dr"), Some(2)), "the outbox stamps the writer");
    app.stop().await;
}

/// The fence waits for a writer already past its first write (whose commit lands before the
/// fence's WAL position) and queues a writer that starts after it; the queued one is then
/// refused, never committed under the old epoch.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn the_fence_waits_for_writers_in_flight_and_refuses_the_ones_behind_it(
    pool: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let admin = pool.connect_with(opts.clone()).await.unwrap();
    let old = writer_pool(&opts, &writer("primary", 1)).await;
    let mut in_flight = old.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO outbox (id, topic, message_key, event_type, payload) VALUES ($1, 't', 'k', 'A', '{}')",
    )
    .bind(Uuid::new_v4())
    .execute(&mut *in_flight)
    .await
    .unwrap();

    let fencing = tokio::spawn({
        let admin = admin.clone();
        async move { region::fence(&admin, &writer("dr", 2), "test").await.unwrap() }
    });
    let waiting = |admin: PgPool, n: i64| async move {
        let c: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks
              WHERE locktype = 'advisory' AND classid = $1::oid AND objid = $2::oid AND objsubid = 2
                AND NOT granted",
        )
        .bind(region::FENCE_LOCK.0 as i64)
        .bind(region::FENCE_LOCK.1 as i64)
        .fetch_one(&admin)
        .await
        .unwrap();
        c >= n
    };
    eventually(Duration::from_secs(10), "the fence waits for the writer in flight", || {
        waiting(admin.clone(), 1)
    })
    .await;
    let behind = tokio::spawn({
        let old = old.clone();
        async move { raw_outbox_write(&old).await }
    });
    eventually(Duration::from_secs(10), "a new writer queues behind the fence", || waiting(admin.clone(), 2))
        .await;
    assert!(!fencing.is_finished() && !behind.is_finished());

    // Just before its commit record: the fence's position must lie after it.
    let (before_commit,): (String,) =
        sqlx::query_as("SELECT pg_current_wal_insert_lsn()::text").fetch_one(&mut *in_flight).await.unwrap();
    in_flight.commit().await.expect("a writer already in flight commits under its epoch");
    let f = fencing.await.unwrap();
    assert!(
        region::lsn_diff(&admin, &f.fence_lsn, &before_commit).await.unwrap() > 0,
        "every old-epoch commit lies before the fence position ({} vs {before_commit})",
        f.fence_lsn
    );
    assert_eq!(refusal_of(behind.await.unwrap()), Some(Refusal::Fenced), "the queued writer is refused");
    let (a, raw): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE event_type = 'A'), count(*) FILTER (WHERE event_type = 'Raw') FROM outbox",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!((a, raw), (1, 0));
}

/// A returning old primary: its ledger still says epoch 1 (the fence could not reach it), but
/// its processes can no longer renew their lease at the witness, so within the TTL the API
/// refuses holds and the ledger refuses every write of epoch 1 — even one that skips the API.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_returning_old_primary_cannot_sell_once_its_lease_lapses(_: PgPoolOptions, opts: PgConnectOptions) {
    let w = Extra::create(&opts, "wit").await;
    let wpool = boxoffice_store::connect(w.opts(), 2, 10_000).await.unwrap();
    witness::WITNESS_MIGRATOR.run(&wpool).await.unwrap();
    witness::init(&wpool, &writer("primary", 1), "test").await.unwrap();
    let url = w.url();
    let app = TestApp::spawn_with(opts.clone(), &[Role::Api], VenueSpec::small(1, 1, 4), |c: &mut Config| {
        c.witness_database_url = Some(url.clone().into());
        c.region_lease_ttl_ms = 1_500;
        c.region_lease_renew_ms = 300;
        c.region_lease_skew_ms = 500;
    })
    .await;
    let seats = app.seats().await;
    let b = app.buyer();
    let r = app.hold(&b, &app.admission_token(&b), &Uuid::new_v4().to_string(), &seats[..1]).await;
    assert_eq!(r.status().as_u16(), 202, "the lease holds: the region sells");
    assert!(witness::live_leases(&wpool).await.unwrap().iter().any(|l| l.1 == "primary" && l.2 == 1));

    // The DR region fences at the witness; the old primary's ledger is not reached.
    let a = witness::fence(&wpool, &writer("dr", 2), 500, "test").await.unwrap();
    assert_eq!((a.region.as_str(), a.epoch), ("dr", 2));
    assert!(a.writers_clear_at.is_some());
    assert_eq!(region::record(&app.pool).await.unwrap().epoch, 1, "the old ledger was never fenced");

    let b2 = app.buyer();
    let adm2 = app.admission_token(&b2);
    eventually(Duration::from_secs(10), "the old primary refuses holds", || {
        let (app, adm2, b2, seat) = (&app, adm2.clone(), &b2, seats[1]);
        async move {
            let r = app.hold(b2, &adm2, &Uuid::new_v4().to_string(), &[seat]).await;
            r.status().as_u16() == 503
        }
    })
    .await;
    let ready = app.http.get(format!("{}/readyz", app.api)).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 503, "out of the load balancer's rotation");
    let old = writer_pool(&opts, &writer("primary", 1)).await;
    eventually(Duration::from_secs(10), "the ledger refuses epoch 1 by its lease mirror", || {
        let old = old.clone();
        async move { refusal_of(raw_outbox_write(&old).await) == Some(Refusal::LeaseLapsed) }
    })
    .await;
    assert!(
        witness::ms_until_clear(&wpool).await.unwrap() <= 2_000,
        "promotion waits at most TTL + skew after the fence"
    );
    // Holds taken while the old lease still ran are inside the window promotion waits out;
    // none is later than the last lease the witness granted to epoch 1.
    let last_lease: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT max(expires_at) FROM region_leases WHERE epoch = 1")
            .fetch_one(&wpool)
            .await
            .unwrap();
    let last_hold: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT max(created_at) FROM holds").fetch_one(&app.pool).await.unwrap();
    assert!(last_hold < last_lease, "a hold at {last_hold} after the old lease expired at {last_lease}");
    let b3 = app.buyer();
    let (status, code, _) =
        problem(app.hold(&b3, &app.admission_token(&b3), &Uuid::new_v4().to_string(), &seats[2..3]).await)
            .await;
    assert_eq!((status, code.as_str()), (503, "region_fenced"));
    app.stop().await;
    wpool.close().await;
    w.drop().await;
}

/// Counts what it applies.
struct Counting(AtomicUsize);

#[async_trait::async_trait]
impl Handler for Counting {
    type Prepared = ();
    type Precheck = ();
    type Rows = ();
    fn name(&self) -> &'static str {
        "counting"
    }
    fn wants(&self, _: EventKind) -> bool {
        true
    }
    async fn prepare(&self, _: &Envelope, _: &PurchaseEvent, _: ()) -> Result<(), HandlerError> {
        Ok(())
    }
    async fn apply(
        &self,
        _: &mut Tx<'_>,
        _: &Envelope,
        _: &PurchaseEvent,
        _: (),
        _: (),
    ) -> Result<Vec<Envelope>, HandlerError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(vec![])
    }
}

fn fact(epoch: i64) -> Envelope {
    let order = OrderId(Uuid::new_v4());
    let mut env = Envelope::new(
        order,
        &PurchaseEvent::PaymentCanceled { order_id: order, payment_intent_id: "pi_x".into() },
        Uuid::new_v4(),
        None,
    );
    env.region = Some("primary".into());
    env.region_epoch = Some(epoch);
    env
}

/// A fact stamped with the fenced epoch is applied when its outbox row is in this ledger
/// (inside the cut), parked as an `orphan_fact` incident when it is not, and a fact of the
/// current epoch is applied as always.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn facts_of_a_fenced_writer_outside_the_cut_are_parked(pool: PgPoolOptions, opts: PgConnectOptions) {
    let admin = pool.connect_with(opts.clone()).await.unwrap();
    region::fence(&admin, &writer("dr", 2), "test").await.unwrap();
    let ledger = writer_pool(&opts, &writer("dr", 2)).await;
    let h = Counting(AtomicUsize::new(0));

    let inside = fact(1);
    sqlx::query("INSERT INTO outbox (id, topic, message_key, event_type, payload, region_epoch) VALUES ($1, 't', 'k', 'PaymentCanceled', '{}', 1)")
        .bind(inside.event_id)
        .execute(&admin)
        .await
        .unwrap();
    assert_eq!(handle_once_at(&ledger, &h, &inside, Some(2)).await.unwrap(), Disposition::Applied);
    assert_eq!(handle_once_at(&ledger, &h, &inside, Some(2)).await.unwrap(), Disposition::Duplicate);

    let orphan = fact(1);
    assert_eq!(handle_once_at(&ledger, &h, &orphan, Some(2)).await.unwrap(), Disposition::Orphan);
    assert_eq!(handle_once_at(&ledger, &h, &orphan, Some(2)).await.unwrap(), Disposition::Duplicate);
    let current = fact(2);
    assert_eq!(handle_once_at(&ledger, &h, &current, Some(2)).await.unwrap(), Disposition::Applied);

    assert_eq!(h.0.load(Ordering::SeqCst), 2, "the orphan was never applied");
    let parked: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM incidents WHERE kind = 'orphan_fact' AND detail->>'event_id' = $1",
    )
    .bind(orphan.event_id.to_string())
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(parked, 1);
}

/// A relay whose session declares a fenced epoch has nothing to publish: its batch read runs
/// the fence's check as a write would (BXF01), while a relay of the current epoch reads the
/// same unpublished row.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_fenced_relay_reads_nothing_to_publish(pool: PgPoolOptions, opts: PgConnectOptions) {
    use sqlx::ConnectOptions;
    let admin = pool.connect_with(opts.clone()).await.unwrap();
    raw_outbox_write(&admin).await.unwrap();
    region::fence(&admin, &writer("dr", 2), "test").await.unwrap();
    let mut old = region::writer_options(opts.clone(), &writer("primary", 1)).connect().await.unwrap();
    let e = boxoffice_store::outbox::pending_batch(&mut old, 10).await.expect_err("fenced");
    assert_eq!(region::refusal(&e), Some(Refusal::Fenced));
    let mut current = region::writer_options(opts, &writer("dr", 2)).connect().await.unwrap();
    assert_eq!(boxoffice_store::outbox::pending_batch(&mut current, 10).await.unwrap().len(), 1);
}

/// `region republish` marks the outbox rows of the recovery window unpublished again (and no
/// older ones), as a writer of the current epoch; a writer of the fenced epoch cannot.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn republish_reopens_the_recovery_window_only(pool: PgPoolOptions, opts: PgConnectOptions) {
    let admin = pool.connect_with(opts.clone()).await.unwrap();
    sqlx::query(
        "INSERT INTO outbox (id, topic, message_key, event_type, payload, created_at, published_at)
         SELECT gen_random_uuid(), 't', 'k', 'Old', '{}'::jsonb, now() - interval '2 hours', now() - interval '2 hours'
           FROM generate_series(1, 3)
         UNION ALL
         SELECT gen_random_uuid(), 't', 'k', 'Recent', '{}'::jsonb, now() - interval '30 seconds', now() - interval '29 seconds'
           FROM generate_series(1, 5)",
    )
    .execute(&admin)
    .await
    .unwrap();
    region::fence(&admin, &writer("dr", 2), "test").await.unwrap();
    let since = chrono::Utc::now() - chrono::Duration::minutes(5);
    let old = writer_pool(&opts, &writer("primary", 1)).await;
    assert!(matches!(
        region::republish(&old, since).await.as_ref().err().and_then(region::refusal),
        Some(Refusal::Fenced)
    ));
    let new = writer_pool(&opts, &writer("dr", 2)).await;
    assert_eq!(region::republish(&new, since).await.unwrap(), 5);
    let (old_open, recent_open): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE event_type = 'Old' AND published_at IS NULL),
                count(*) FILTER (WHERE event_type = 'Recent' AND published_at IS NULL) FROM outbox",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!((old_open, recent_open), (0, 5));
}

/// `region status` on a writing primary: its epoch, role `primary`, writable; after a fence
/// to another region it is no longer writable, and the record names the new writer and the
/// fence's WAL position.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn region_status_tells_whether_this_configuration_may_write(
    pool: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use sqlx::ConnectOptions;
    let admin = pool.connect_with(opts.clone()).await.unwrap();
    let cfg = Config { database_url: opts.to_url_lossy().to_string().into(), ..Config::default() };
    let s = boxoffice::region::status(&cfg).await.unwrap();
    assert_eq!((s.ledger.epoch, s.replication.role, s.writable), (1, "primary", true));
    assert!(!s.replication.lsn.is_empty());
    region::fence(&admin, &writer("dr", 2), "test").await.unwrap();
    let s = boxoffice::region::status(&cfg).await.unwrap();
    assert!(!s.writable, "epoch 1 may not write a ledger at epoch 2");
    assert_eq!((s.ledger.region.as_str(), s.ledger.epoch), ("dr", 2));
    assert!(s.ledger.fence_lsn.is_some());
}

/// The fence needs no right to change the epoch record: an application role that may write
/// the outbox and only read `region_epoch` and `region_lease` (the check runs as the caller,
/// migration 0018) writes at the ledger's epoch, is refused at another, cannot move the epoch
/// itself, and a stale writer's TRUNCATE is refused like any write.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn the_fence_holds_for_a_least_privileged_role_and_for_truncate(
    pool: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let admin = pool.connect_with(opts.clone()).await.unwrap();
    let role = format!("bo_app_{}", &Uuid::new_v4().simple().to_string()[..12]);
    sqlx::query(&format!("CREATE ROLE {role} LOGIN")).execute(&admin).await.unwrap();
    sqlx::query(&format!("GRANT INSERT, SELECT, TRUNCATE ON outbox TO {role}"))
        .execute(&admin)
        .await
        .unwrap();
    sqlx::query(&format!("GRANT SELECT ON region_epoch, region_lease TO {role}"))
        .execute(&admin)
        .await
        .unwrap();
    let as_app = opts.clone().username(&role);
    let current = writer_pool(&as_app, &writer("primary", 1)).await;
    raw_outbox_write(&current).await.expect("the application role writes at the ledger's epoch");
    let moved = sqlx::query("UPDATE region_epoch SET epoch = 9").execute(&current).await;
    assert!(moved.is_err(), "the application role cannot move the epoch");
    let stale = writer_pool(&as_app, &writer("primary", 0)).await;
    assert_eq!(refusal_of(raw_outbox_write(&stale).await), Some(Refusal::Fenced));
    let truncated = sqlx::query("TRUNCATE outbox").execute(&stale).await.map(|_| ());
    assert_eq!(refusal_of(truncated), Some(Refusal::Fenced), "TRUNCATE is a write too");
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox").fetch_one(&admin).await.unwrap(),
        1
    );
    current.close().await;
    stale.close().await;
    sqlx::query(&format!("DROP OWNED BY {role}")).execute(&admin).await.unwrap();
    sqlx::query(&format!("DROP ROLE {role}")).execute(&admin).await.unwrap();
}

/// A stale writer cannot change an event either (freeze it, move it, raise its limits), a
/// REPEATABLE READ transaction is refused rather than trusted with an old snapshot, and a
/// transaction checked before its lease lapsed is refused at commit once it has.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn the_fence_covers_events_snapshots_and_the_commit(pool: PgPoolOptions, opts: PgConnectOptions) {
    let admin = pool.connect_with(opts.clone()).await.unwrap();
    let (event, _) =
        boxoffice_store::venue::seed(&admin, "E", &VenueSpec::small(1, 1, 2), chrono::Utc::now(), "cell-1")
            .await
            .unwrap();
    region::fence(&admin, &writer("dr", 2), "test").await.unwrap();
    let stale = writer_pool(&opts, &writer("primary", 1)).await;
    let frozen = boxoffice_store::cells::freeze(&stale, event, "cell-1").await.map(|_| ());
    assert_eq!(refusal_of(frozen), Some(Refusal::Fenced), "a stale writer cannot freeze an event");

    let current = writer_pool(&opts, &writer("dr", 2)).await;
    let mut rr = current.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ").execute(&mut *rr).await.unwrap();
    let r = sqlx::query(
        "INSERT INTO outbox (id, topic, message_key, event_type, payload) VALUES ($1, 't', 'k', 'RR', '{}')",
    )
    .bind(Uuid::new_v4())
    .execute(&mut *rr)
    .await
    .map(|_| ());
    assert_eq!(refusal_of(r), Some(Refusal::Fenced), "purchase writes run at READ COMMITTED");
    drop(rr);

    // A lease that lapses between the transaction's first write and its commit.
    sqlx::query(
        "INSERT INTO region_lease (required, region, epoch, valid_until)
         VALUES (true, 'dr', 2, clock_timestamp() + interval '300 milliseconds')",
    )
    .execute(&admin)
    .await
    .unwrap();
    let mut tx = current.begin().await.unwrap();
    sqlx::query("INSERT INTO outbox (id, topic, message_key, event_type, payload) VALUES ($1, 't', 'k', 'Late', '{}')")
        .bind(Uuid::new_v4())
        .execute(&mut *tx)
        .await
        .expect("checked while the lease holds");
    let wait_out: f64 = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM valid_until - clock_timestamp())::float8 + 0.05 FROM region_lease",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    // Waits out the lease on the database's clock, inside the transaction.
    sqlx::query("SELECT pg_sleep($1)").bind(wait_out.max(0.0)).execute(&mut *tx).await.unwrap();
    let committed = tx.commit().await.map(|_| ());
    assert_eq!(refusal_of(committed), Some(Refusal::LeaseLapsed), "refused at commit");
    let late: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE event_type = 'Late'")
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(late, 0);
}

/// A fact with no epoch after a failover, or with an epoch no writer has, is parked unless it
/// is inside this ledger's cut; before any failover, a fact without an epoch (written before
/// regions existed) is applied.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn facts_without_an_epoch_or_from_the_future_are_checked_against_the_cut(
    pool: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let _admin = pool.connect_with(opts.clone()).await.unwrap();
    let h = Counting(AtomicUsize::new(0));
    let one = writer_pool(&opts, &writer("primary", 1)).await;
    let mut unstamped = fact(1);
    unstamped.region_epoch = None;
    assert_eq!(handle_once_at(&one, &h, &unstamped, Some(1)).await.unwrap(), Disposition::Applied);
    let future = fact(9);
    assert_eq!(handle_once_at(&one, &h, &future, Some(1)).await.unwrap(), Disposition::Orphan);
    region::fence(&_admin, &writer("dr", 2), "test").await.unwrap();
    let two = writer_pool(&opts, &writer("dr", 2)).await;
    let mut unstamped = fact(1);
    unstamped.region_epoch = None;
    assert_eq!(handle_once_at(&two, &h, &unstamped, Some(2)).await.unwrap(), Disposition::Orphan);
    assert_eq!(h.0.load(Ordering::SeqCst), 1);
}

/// The runbook refuses to take over from a primary that is not the writing region's own
/// ledger: a returning old primary, fenced at the witness while it was unreachable, cannot
/// fence the live region back.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_returning_old_primary_cannot_run_the_runbook_back(_: PgPoolOptions, opts: PgConnectOptions) {
    use sqlx::ConnectOptions;
    let w = Extra::create(&opts, "wit").await;
    let wpool = boxoffice_store::connect(w.opts(), 2, 10_000).await.unwrap();
    witness::WITNESS_MIGRATOR.run(&wpool).await.unwrap();
    witness::init(&wpool, &writer("primary", 1), "test").await.unwrap();
    // The DR region fenced at the witness; this old primary's ledger never heard of it.
    witness::fence(&wpool, &writer("dr", 2), 0, "test").await.unwrap();
    let old = Config {
        region: "primary".into(),
        database_url: opts.to_url_lossy().to_string().into(),
        witness_database_url: Some(w.url().into()),
        ..Config::default()
    };
    let e = boxoffice::region::fence(&old).await.expect_err("refused");
    assert!(format!("{e:#}").contains("rebuild this database as a replica"), "{e:#}");
    let e = boxoffice::region::promote(&old).await.expect_err("refused");
    assert!(format!("{e:#}").contains("region fence"), "{e:#}");
    let a = witness::authority(&wpool).await.unwrap().unwrap();
    assert_eq!((a.region.as_str(), a.epoch), ("dr", 2), "the witness still names the DR region");
    wpool.close().await;
    w.drop().await;
}

/// After a failover, `reconcile --fix` compensates this cell's lost orders only: an authorized
/// PaymentIntent a fenced writer of this cell requested for an order the ledger lacks gets
/// `AuthorizationCancelRequested`; another cell's intent on the shared account, for an order
/// this ledger never had, is not this ledger's business and is left alone.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn reconcile_compensates_this_cells_lost_orders_and_no_other_cells(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use boxoffice_payments::{CreatePaymentIntent, PaymentGateway, StripeClient, StripeConfig};
    let app = TestApp::spawn(opts.clone(), &[Role::Api], VenueSpec::small(1, 1, 4)).await;
    let stripe = StripeClient::new(StripeConfig {
        api_base: app.cfg.stripe_api_base.clone(),
        secret_key: app.cfg.stripe_secret_key.clone(),
        timeout_ms: 10_000,
    })
    .unwrap();
    let mut authorized = Vec::new();
    for cell in ["cell-1", "cell-b"] {
        let req = CreatePaymentIntent {
            amount_minor: 5_000,
            currency: "usd".into(),
            metadata: vec![
                ("order_id".into(), Uuid::new_v4().to_string()),
                ("hold_id".into(), Uuid::new_v4().to_string()),
                ("purchase_cell".into(), cell.into()),
                ("region".into(), "primary".into()),
                ("region_epoch".into(), "1".into()),
            ],
        };
        let pi = stripe.create_payment_intent(&req, &format!("authorize:{}", Uuid::new_v4())).await.unwrap();
        let pi = stripe
            .confirm_with_client_secret(
                &app.cfg.stripe_publishable_key,
                &pi.id,
                pi.client_secret.as_deref().unwrap(),
                "pm_card_visa",
            )
            .await
            .unwrap();
        authorized.push(pi.id);
    }
    region::fence(&app.pool, &writer("dr", 2), "test").await.unwrap();
    let ledger = writer_pool(&opts, &writer("dr", 2)).await;
    let window = boxoffice::reconcile::Window::parse("1h", None, chrono::Utc::now()).unwrap();
    let rep = boxoffice::reconcile::run(&ledger, &stripe, window, true).await.unwrap();
    let kinds: Vec<(String, &str, Option<&str>)> =
        rep.drift.iter().map(|d| (d.payment_intent_id.clone(), d.kind.name(), d.fact_name())).collect();
    assert_eq!(
        kinds,
        vec![(authorized[0].clone(), "intent_of_lost_order", Some("AuthorizationCancelRequested"))],
        "only this cell's lost order is compensated"
    );
    assert_eq!(rep.facts_emitted, 1);
    let other = stripe.retrieve_payment_intent(&authorized[1]).await.unwrap();
    assert_eq!(other.status.to_string(), "requires_capture", "another cell's authorization is untouched");
    ledger.close().await;
    app.stop().await;
}

/// A planned switchover: the old primary is reachable and the replica still streams from it,
/// so the fence's read-only setting for the application role replicates. The promotion clears
/// it: the new primary takes writes at the new epoch.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_switchover_with_the_old_primary_reachable_leaves_the_new_primary_writable(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let pair = boxoffice_drills::pgcluster::PgPair::create("bo_switch").await.unwrap();
    let primary =
        boxoffice_store::connect(pair.primary.connect_options("postgres"), 2, 10_000).await.unwrap();
    boxoffice_store::MIGRATOR.run(&primary).await.unwrap();
    let w = Extra::create(&opts, "wit").await;
    let cfg = |region: &str, db: String, peer: Option<String>| Config {
        region: region.into(),
        database_url: db.into(),
        witness_database_url: Some(w.url().into()),
        region_peer_database_url: peer.map(Into::into),
        region_lease_skew_ms: 100,
        ..Config::default()
    };
    let old = cfg("primary", pair.primary.url("postgres"), None);
    boxoffice::region::init(&old).await.unwrap();
    let replica =
        boxoffice_store::connect(pair.replica.connect_options("postgres"), 2, 10_000).await.unwrap();
    eventually(Duration::from_secs(30), "the replica has the schema", || {
        let r = replica.clone();
        async move { sqlx::query("SELECT 1 FROM region_epoch").fetch_one(&r).await.is_ok() }
    })
    .await;
    let dr = cfg("dr", pair.replica.url("postgres"), Some(pair.primary.url("postgres")));
    let f = boxoffice::region::fence(&dr).await.unwrap();
    assert!(f.old_primary_fenced, "{:?}", f.old_primary_note);
    // The setting reaches the replica with the WAL.
    let lsn = pair.primary.current_wal_lsn().await.unwrap();
    eventually(Duration::from_secs(30), "the replica replayed the fence", || {
        let pair = &pair;
        async move { pair.replica.last_replay_lsn().await.ok().flatten().is_some_and(|l| l >= lsn) }
    })
    .await;
    replica.close().await;
    let p = boxoffice::region::promote(&dr).await.unwrap();
    assert_eq!(p.writer.epoch, 2);
    let new = writer_pool(&pair.replica.connect_options("postgres"), &writer("dr", 2)).await;
    raw_outbox_write(&new).await.expect("the new primary takes writes at the new epoch");
    let old_writer = writer_pool(&pair.primary.connect_options("postgres"), &writer("primary", 1)).await;
    assert!(raw_outbox_write(&old_writer).await.is_err(), "the old primary refuses them");
    new.close().await;
    old_writer.close().await;
    primary.close().await;
    pair.remove().await.unwrap();
    w.drop().await;
}

/// `boxoffice migrate` redoes an index build a failure left invalid: a `CREATE INDEX
/// CONCURRENTLY` that is cancelled (a timeout, a crash) leaves the index behind, invalid, and
/// its migration unrecorded; the next `boxoffice_store::migrate` drops it and builds it again,
/// where the build alone would stop at "already exists" (or, with `IF NOT EXISTS`, record the
/// migration with the index still invalid).
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn migrate_rebuilds_an_index_a_failed_build_left_invalid(pool: sqlx::PgPool) {
    let version: i64 = sqlx::query_scalar(
        "SELECT version FROM _sqlx_migrations WHERE description LIKE '%outbox parked idx%'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    // As a cancelled build leaves things.
    sqlx::query("UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'outbox_parked_idx'::regclass")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = $1")
        .bind(version)
        .execute(&pool)
        .await
        .unwrap();
    let opts = pool.connect_options().as_ref().clone();
    let dropped = boxoffice_store::migrate(opts.clone()).await.unwrap();
    assert_eq!(dropped, ["outbox_parked_idx"]);
    let (valid, recorded): (bool, bool) = sqlx::query_as(
        "SELECT (SELECT indisvalid FROM pg_index WHERE indexrelid = 'outbox_parked_idx'::regclass),
                EXISTS (SELECT 1 FROM _sqlx_migrations WHERE version = $1 AND success)",
    )
    .bind(version)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(valid && recorded, "valid {valid}, recorded {recorded}");
    // Run again: nothing to drop, nothing to apply.
    assert!(boxoffice_store::migrate(opts).await.unwrap().is_empty());
}
