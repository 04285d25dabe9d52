//! The statements workers repeat on a timer read what is due through an index, never the
//! whole table (`boxoffice_store`, "Periodic sweeps"): each runs once on a ledger that also
//! holds thousands of rows that are not due, and PostgreSQL's own counters
//! (`pg_stat_user_tables.seq_tup_read`, `pg_stat_user_indexes.idx_tup_read`) say how many
//! rows of the swept table it read. A bound compared with `clock_timestamp()` reads them all.

use boxoffice_domain::{EventId, OrderId, SeatId, UserId};
use boxoffice_store::holds::{self, ReserveRequest};
use boxoffice_store::venue::{self, VenueSpec};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::future::Future;
use std::time::Duration;
use uuid::Uuid;

/// Rows that are not due, in each swept table.
const NOT_DUE: i64 = 5_000;

/// Orders ticketed before, each with its confirmed hold.
const SOLD: i64 = 50_000;

/// Confirmed orders awaiting their capture, days from its deadline.
const AWAITING_CAPTURE: i64 = 1_000;

/// Rows a pass may read beyond those it acts on: the neighbours of an index range, the
/// primary-key lookups of the rows it changes.
const SLACK: i64 = 25;

/// Runs each sweep on a pool of one connection, so that its table statistics can be flushed
/// right after it, and reads them on another.
struct Reads {
    pool: PgPool,
    observer: PgPool,
}

impl Reads {
    /// Rows of `table` read so far: by sequential scans, and index entries read by any scan.
    async fn so_far(&self, table: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT t.seq_tup_read + COALESCE((SELECT sum(i.idx_tup_read) FROM pg_stat_user_indexes i
                                                WHERE i.relid = t.relid), 0)::bigint
               FROM pg_stat_user_tables t WHERE t.relname = $1",
        )
        .bind(table)
        .fetch_one(&self.observer)
        .await
        .unwrap()
    }

    /// Runs `sweep` and returns what it returned with the rows of each of `tables` it read.
    async fn measure<T, F, Fut>(&self, tables: &[&str], sweep: F) -> (T, Vec<i64>)
    where
        F: FnOnce(PgPool) -> Fut,
        Fut: Future<Output = T>,
    {
        let mut before = Vec::new();
        for t in tables {
            before.push(self.so_far(t).await);
        }
        let out = sweep(self.pool.clone()).await;
        // The backend flushes its pending statistics, those of the sweep included, when this
        // statement ends, before it answers.
        sqlx::query("SELECT pg_stat_force_next_flush()").execute(&self.pool).await.unwrap();
        let mut read = Vec::new();
        for (t, b) in tables.iter().zip(before) {
            read.push(self.so_far(t).await - b);
        }
        (out, read)
    }
}

async fn exec(pool: &PgPool, sql: &str) {
    sqlx::query(sql).execute(pool).await.unwrap();
}

/// Inserts `n` orders of `event` with status `status` (SQL), each with a hold whose status and
/// `expires_at` are `hold` (SQL), and with a payment whose status and `capture_before` are
/// `payment` (SQL, where `n` is the order's number from 1) when given.
async fn orders(pool: &PgPool, event: EventId, n: i64, status: &str, hold: &str, payment: Option<&str>) {
    let payments = match payment {
        Some(p) => format!(
            ", p AS (INSERT INTO payments (order_id, payment_intent_id, status, capture_before, amount_minor, currency)
                    SELECT id, 'pi_' || id, {p}, 1, 'usd' FROM numbered)"
        ),
        None => String::new(),
    };
    exec(
        pool,
        &format!(
            "WITH o AS (
                INSERT INTO orders (id, user_id, event_id, status, amount_minor, currency, correlation_id)
                SELECT gen_random_uuid(), gen_random_uuid(), '{event}', {status}, 1, 'usd', gen_random_uuid()
                  FROM generate_series(1, {n}) RETURNING id),
             numbered AS (SELECT id, row_number() OVER () AS n FROM o){payments}
             INSERT INTO holds (id, order_id, status, expires_at) SELECT gen_random_uuid(), id, {hold} FROM o",
            event = event.0
        ),
    )
    .await;
}

/// A new buyer's hold of `seat`, as the API would place it.
async fn hold(pool: &PgPool, event: EventId, seat: Uuid) -> OrderId {
    let req = ReserveRequest {
        user_id: UserId::new(),
        event_id: event,
        seat_ids: vec![SeatId(seat)],
        idempotency_key: Uuid::new_v4().to_string(),
        correlation_id: Uuid::new_v4(),
        ttl: Duration::from_secs(600),
        payable_within: None,
        cell: "cell-1".into(),
        directory_epoch: 1,
        authorization_request: boxoffice_domain::saga::AuthorizationRequest::InHoldFact,
    };
    holds::reserve(pool, &req).await.unwrap().receipt().order_id
}

/// A new buyer's hold of `seat` whose PaymentIntent `pi` is recorded (the buyer may pay).
async fn payable_hold(pool: &PgPool, event: EventId, seat: Uuid, pi: &str) -> OrderId {
    let order = hold(pool, event, seat).await;
    boxoffice_store::payments::insert_created(
        pool,
        order,
        pi,
        Some("secret"),
        "requires_payment_method",
        1,
        "usd",
    )
    .await
    .unwrap();
    order
}

/// Each sweep, beside `NOT_DUE` rows of its table that it must leave alone (and, where a
/// partial index leaves rows out, as many more of those), acts on exactly the due rows and
/// reads at most those and `SLACK` more.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn every_periodic_sweep_reads_only_what_is_due(_: PgPoolOptions, opts: PgConnectOptions) {
    let pool = boxoffice_store::connect(opts.clone(), 1, 10_000).await.unwrap();
    let observer = boxoffice_store::connect(opts, 2, 10_000).await.unwrap();
    let (event, _) =
        venue::seed(&observer, "Sweeps", &VenueSpec::small(1, 1, 8), chrono::Utc::now(), "cell-1")
            .await
            .unwrap();
    let seats: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM seats WHERE event_id = $1 ORDER BY label")
        .bind(event.0)
        .fetch_all(&observer)
        .await
        .unwrap();

    // Due: three holds past every end, two past their expiry waiting for the provider's word.
    let mut lapsed = Vec::new();
    for s in &seats[..3] {
        lapsed.push(hold(&observer, event, *s).await.0);
    }
    let mut waiting = Vec::new();
    let mut waiting_pis = Vec::new();
    for s in &seats[3..5] {
        let pi = format!("pi_sweep_{}", Uuid::new_v4().simple());
        let order = payable_hold(&observer, event, *s, &pi).await;
        waiting.push(order.0);
        waiting_pis.push(pi);
    }
    sqlx::query(
        "UPDATE holds SET expires_at = now() - interval '1 minute', authorized_until = NULL, payable_by = NULL,
                provider_check_until = CASE WHEN order_id = ANY($2) THEN now() + interval '1 minute' END
          WHERE order_id = ANY($1) OR order_id = ANY($2)",
    )
    .bind(&lapsed)
    .bind(&waiting)
    .execute(&observer)
    .await
    .unwrap();
    // Not due: active holds of a running onsale, ten minutes from their end, each with its
    // PaymentIntent.
    let payment = "'requires_payment_method', NULL::timestamptz";
    orders(&observer, event, NOT_DUE, "'held'", "'active', now() + interval '10 minutes'", Some(payment))
        .await;
    // Tickets sold before: orders and their confirmed holds, as many as every other row here.
    orders(&observer, event, SOLD, "'ticketed'", "'confirmed', now() - interval '30 days'", None).await;
    // Confirmed orders awaiting their capture: a backlog of them days from the deadline, and
    // two within the release margin.
    let capture =
        "'requires_capture', now() + CASE WHEN n <= 2 THEN interval '1 hour' ELSE interval '6 days' END";
    orders(&observer, event, AWAITING_CAPTURE + 2, "'confirming'", "'confirmed', now()", Some(capture)).await;
    // Inbox rows: recent ones, and three past the retention.
    exec(&observer, &format!("INSERT INTO inbox (consumer, event_id) SELECT 'saga', gen_random_uuid() FROM generate_series(1, {NOT_DUE})")).await;
    exec(&observer, "INSERT INTO inbox (consumer, event_id, processed_at) SELECT 'saga', gen_random_uuid(), now() - interval '8 days' FROM generate_series(1, 3)").await;
    // Idempotency keys: live ones, and three expired.
    exec(&observer, &format!("INSERT INTO idempotency_keys (user_id, idempotency_key, request_hash, expires_at) SELECT gen_random_uuid(), 'k', 'h', now() + interval '20 hours' FROM generate_series(1, {NOT_DUE})")).await;
    exec(&observer, "INSERT INTO idempotency_keys (user_id, idempotency_key, request_hash, expires_at) SELECT gen_random_uuid(), 'k', 'h', now() - interval '1 hour' FROM generate_series(1, 3)").await;
    // Outbox: published rows within the retention, unpublished rows past it (not the prune's),
    // and three published rows past it.
    let outbox = |published: &str, age: &str, n: i64| {
        format!(
            "INSERT INTO outbox (id, topic, message_key, event_type, payload, published_at, created_at)
             SELECT gen_random_uuid(), 'purchase', gen_random_uuid()::text, 'HoldCreated', '{{}}', {published}, now() - interval '{age}'
               FROM generate_series(1, {n})"
        )
    };
    exec(&observer, &outbox("now()", "1 minute", NOT_DUE)).await;
    exec(&observer, &outbox("NULL", "2 hours", NOT_DUE)).await;
    exec(&observer, &outbox("now() - interval '2 hours'", "2 hours", 3)).await;
    // The order history and status changes: recent ones, three of each past the retention.
    let history = |age: &str, n: i64| {
        format!(
            "INSERT INTO order_history (event_id, order_id, topic, event_type, payload, created_at)
             SELECT gen_random_uuid(), gen_random_uuid(), 'purchase', 'HoldCreated', '{{}}', now() - interval '{age}'
               FROM generate_series(1, {n})"
        )
    };
    exec(&observer, &history("1 day", NOT_DUE)).await;
    exec(&observer, &history("401 days", 3)).await;
    let transitions = |age: &str, n: i64| {
        format!(
            "INSERT INTO order_transitions (order_id, from_status, to_status, at)
             SELECT gen_random_uuid(), 'held', 'payment_required', now() - interval '{age}' FROM generate_series(1, {n})"
        )
    };
    exec(&observer, &transitions("1 day", NOT_DUE)).await;
    exec(&observer, &transitions("401 days", 3)).await;
    // Webhook events: recent ones without an order id (an unhandled type), pending ones of
    // another integration's PaymentIntents from two hours ago, ones about orders from a month
    // ago (within the history's retention), three without one past their retention, one as
    // old whose PaymentIntent has a payment row (stranded: kept), and three about orders past
    // the history's retention.
    let events = |order: &str, pi: &str, pending: bool, age: &str, n: i64| {
        format!(
            "INSERT INTO stripe_events (stripe_event_id, type, payment_intent_id, order_id, pending, received_at)
             SELECT 'evt_' || gen_random_uuid(), 'payment_intent.succeeded', {pi}, {order}, {pending}, now() - interval '{age}'
               FROM generate_series(1, {n})"
        )
    };
    exec(&observer, &events("NULL", "NULL", false, "1 minute", NOT_DUE)).await;
    exec(&observer, &events("NULL", "'pi_other_' || gen_random_uuid()", true, "2 hours", NOT_DUE)).await;
    exec(&observer, &events("gen_random_uuid()", "'pi_' || gen_random_uuid()", false, "30 days", NOT_DUE))
        .await;
    exec(&observer, &events("NULL", "'pi_other_' || gen_random_uuid()", true, "8 days", 3)).await;
    exec(&observer, &events("NULL", &format!("'{}'", waiting_pis[0]), true, "8 days", 1)).await;
    exec(&observer, &events("gen_random_uuid()", "'pi_' || gen_random_uuid()", false, "401 days", 3)).await;
    // Capture claims: young ones (webhooks of a second ago), and three past the grace for
    // orders awaiting their capture.
    exec(&observer, &format!("INSERT INTO capture_claims (stripe_event_id, order_id, payment_intent_id) SELECT 'evt_' || gen_random_uuid(), gen_random_uuid(), 'pi_' || gen_random_uuid() FROM generate_series(1, {NOT_DUE})")).await;
    exec(
        &observer,
        "INSERT INTO capture_claims (received_at, stripe_event_id, order_id, payment_intent_id)
         SELECT now() - interval '1 minute', 'evt_' || gen_random_uuid(), p.order_id, p.payment_intent_id
           FROM payments p JOIN orders o ON o.id = p.order_id WHERE o.status = 'confirming' LIMIT 3",
    )
    .await;
    // Pending re-fetches: young ones, and three whose last claim is two hours old.
    exec(&observer, &format!("INSERT INTO payment_intent_refetches (payment_intent_id, order_id, asked_at, last_claim_at) SELECT 'pi_' || gen_random_uuid(), gen_random_uuid(), now(), now() FROM generate_series(1, {NOT_DUE})")).await;
    exec(
        &observer,
        "INSERT INTO payment_intent_refetches (payment_intent_id, order_id, asked_at, last_claim_at)
         SELECT 'pi_' || gen_random_uuid(), gen_random_uuid(), now() - interval '2 hours', now() - interval '2 hours'
           FROM generate_series(1, 3)",
    )
    .await;
    // Orders' re-fetch budgets: young ones, and three whose window began two hours ago.
    exec(&observer, &format!("INSERT INTO order_refetch_budget (order_id, window_started_at, asked) SELECT gen_random_uuid(), now(), 1 FROM generate_series(1, {NOT_DUE})")).await;
    exec(
        &observer,
        "INSERT INTO order_refetch_budget (order_id, window_started_at, asked)
         SELECT gen_random_uuid(), now() - interval '2 hours', 4 FROM generate_series(1, 3)",
    )
    .await;
    // Follow-up budgets: young ones, and three whose window began two hours ago.
    exec(&observer, &format!("INSERT INTO payment_intent_follow_ups (payment_intent_id, order_id, window_started_at, made) SELECT 'pi_' || gen_random_uuid(), gen_random_uuid(), now(), 1 FROM generate_series(1, {NOT_DUE})")).await;
    exec(
        &observer,
        "INSERT INTO payment_intent_follow_ups (payment_intent_id, order_id, window_started_at, made)
         SELECT 'pi_' || gen_random_uuid(), gen_random_uuid(), now() - interval '2 hours', 4 FROM generate_series(1, 3)",
    )
    .await;
    exec(&observer, "ANALYZE").await;

    let reads = Reads { pool, observer };
    let due = |what: &str, read: &[i64], acted: i64| {
        for r in read {
            assert!(
                *r <= acted + SLACK,
                "{what}: read {r} rows to act on {acted} (of {NOT_DUE}+ not due): {read:?}"
            );
        }
    };

    // The expiry worker, every 250 ms: provider checks of lapsing holds, then the lapse.
    let (n, read) = reads
        .measure(&["holds", "payments"], |p| async move { holds::check_lapsing(&p, 500).await.unwrap() })
        .await;
    assert_eq!(n, 2);
    due("check_lapsing", &read, 5);
    let ((n, _), read) =
        reads.measure(&["holds"], |p| async move { holds::expire_due(&p, 500).await.unwrap() }).await;
    assert_eq!(n, 3);
    due("expire_due", &read, 5);
    // The capture-deadline sweep, every 10 s: it reads the orders awaiting their capture with
    // their payments, and locks the holds of the two within a day of their deadline.
    let (n, read) = reads
        .measure(&["holds", "payments"], |p| async move {
            let mut tx = p.begin().await.unwrap();
            holds::lock_lapsing_authorizations(&mut tx, 86_400, 100).await.unwrap().len()
        })
        .await;
    assert_eq!(n, 2);
    due("lock_lapsing_authorizations, holds", &read[..1], 2);
    due("lock_lapsing_authorizations, payments", &read[1..], AWAITING_CAPTURE + 2);
    // The release controller's signals of what is due.
    let (delay, read) = reads
        .measure(&["holds"], |p| async move {
            let mut c = p.acquire().await.unwrap();
            boxoffice_store::signals::expiry_delay_ms(&mut c).await.unwrap()
        })
        .await;
    assert_eq!(delay, 0.0, "the lapsed holds were released");
    due("signals::expiry_delay_ms", &read, 2);
    let (_, read) = reads
        .measure(&["holds"], |p| async move {
            let mut c = p.acquire().await.unwrap();
            boxoffice_store::signals::never_payable_share(&mut c, 60.0).await.unwrap()
        })
        .await;
    due("signals::never_payable_share", &read, 2);
    // The expiry worker's janitor, every 10 s.
    let (n, read) = reads
        .measure(&["inbox"], |p| async move {
            boxoffice_store::inbox::prune(&p, 7 * 86_400, 10_000).await.unwrap()
        })
        .await;
    assert_eq!(n, 3);
    due("inbox::prune", &read, 3);
    let (n, read) = reads
        .measure(&["idempotency_keys"], |p| async move {
            boxoffice_store::inbox::prune_idempotency_keys(&p, 10_000).await.unwrap()
        })
        .await;
    assert_eq!(n, 3);
    due("inbox::prune_idempotency_keys", &read, 3);
    let (n, read) = reads
        .measure(&["stripe_events"], |p| async move {
            boxoffice_store::stripe_events::prune_unclaimed(&p, 7 * 86_400, 10_000).await.unwrap()
        })
        .await;
    assert_eq!(n, 3, "the stranded event is kept");
    due("stripe_events::prune_unclaimed", &read, 4);
    let (n, read) = reads
        .measure(&["stripe_events"], |p| async move {
            boxoffice_store::stripe_events::resolve_stranded(
                &p,
                100,
                Some(boxoffice_store::stripe_events::STRANDED_WINDOW_S),
            )
            .await
            .unwrap()
        })
        .await;
    assert_eq!(n, 0, "the stranded event is older than the sweep's window");
    due("stripe_events::resolve_stranded", &read, 0);
    let (s, read) = reads
        .measure(&["capture_claims", "orders", "payments"], |p| async move {
            boxoffice_store::stripe_events::settle_capture_claims(
                &p,
                boxoffice_store::stripe_events::CAPTURE_CLAIM_GRACE_S,
                2_000,
            )
            .await
            .unwrap()
        })
        .await;
    assert_eq!((s.settled, s.recorded, s.refetches), (3, 0, 3), "their captures are not recorded");
    due("stripe_events::settle_capture_claims", &read, 3);
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM capture_claims")
            .fetch_one(&reads.observer)
            .await
            .unwrap(),
        NOT_DUE,
        "the young claims wait"
    );
    let (n, read) = reads
        .measure(&["payment_intent_refetches"], |p| async move {
            boxoffice_store::stripe_events::prune_refetches(
                &p,
                boxoffice_store::stripe_events::REFETCH_RETENTION_S,
                10_000,
            )
            .await
            .unwrap()
        })
        .await;
    assert_eq!(n, 3);
    due("stripe_events::prune_refetches", &read, 3);
    let (n, read) = reads
        .measure(&["order_refetch_budget"], |p| async move {
            boxoffice_store::stripe_events::prune_refetch_budgets(
                &p,
                boxoffice_store::stripe_events::UNCOVERED_REFETCH_WINDOW_S,
                10_000,
            )
            .await
            .unwrap()
        })
        .await;
    assert_eq!(n, 3);
    due("stripe_events::prune_refetch_budgets", &read, 3);
    let (n, read) = reads
        .measure(&["payment_intent_follow_ups"], |p| async move {
            boxoffice_store::stripe_events::prune_follow_ups(
                &p,
                boxoffice_store::stripe_events::REFETCH_BUDGET_WINDOW_S,
                10_000,
            )
            .await
            .unwrap()
        })
        .await;
    assert_eq!(n, 3);
    due("stripe_events::prune_follow_ups", &read, 3);
    // The relay, every 30 s.
    let (n, read) = reads
        .measure(&["outbox"], |p| async move {
            boxoffice_store::outbox::prune_published(&p, 3_600, 10_000).await.unwrap()
        })
        .await;
    assert_eq!(n, 3);
    due("outbox::prune_published", &read, 3);
    let (n, read) = reads
        .measure(&["order_history", "order_transitions", "stripe_events"], |p| async move {
            boxoffice_store::timeline::prune(&p, 400 * 86_400, 10_000).await.unwrap()
        })
        .await;
    assert_eq!(n, 9);
    due("timeline::prune", &read, 3);

    let left: (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM holds WHERE status = 'active'),
                (SELECT count(*) FROM stripe_events WHERE order_id IS NULL AND received_at < now() - interval '7 days'),
                (SELECT count(*) FROM outbox WHERE published_at IS NULL AND created_at < now() - interval '1 hour'),
                (SELECT count(*) FROM stripe_events WHERE order_id IS NOT NULL)",
    )
    .fetch_one(&reads.observer)
    .await
    .unwrap();
    assert_eq!(left, (NOT_DUE + 2, 1, NOT_DUE, NOT_DUE), "what was not due is left as it was");
}

/// Orders the lookups below are given (and one more that does not exist).
const LOOKED_UP: i64 = 3;

/// Rows of each table when the lookups' plans are made.
const PLANNED: i64 = 1_000;

/// The purchase path's statements that look rows up by an array of keys (a consumer's batch,
/// a run of facts, the status streams' read), and those of one re-fetch, read each key's rows
/// through an index, whatever the size of the tables when the session planned them: each runs
/// first on a ledger of `PLANNED` rows per table with fresh statistics, on a session that
/// keeps its plans as the product's does (`plan_cache_mode = force_generic_plan`, one
/// prepared statement per connection), and again, on that session, once `NOT_DUE` rows were
/// added to each table counted here (no `ANALYZE` between, as between two of autovacuum's: the
/// plans stay). A statement whose plan joins the keys to the whole table (a hash join over a
/// sequential scan, the planner's choice for an array parameter, which it takes for ten keys,
/// against a table of a thousand rows) reads every row of it at every size until the next
/// `ANALYZE`. The keys are written after the first thousand rows, and one of them has no
/// rows, so a scan that stops at the first match does not pass for a lookup (in the
/// new-ledger variant below, only the key without rows shows such a scan).
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn lookups_by_keys_read_only_their_keys_whatever_size_the_plan_saw(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    lookups_read_only_their_keys(opts, PLANNED).await;
}

/// The same lookups, planned on a new ledger: a venue just seeded (`venue::seed`, which must
/// leave the empty purchase tables unanalyzed), the three orders looked up and nothing else,
/// as at the start of a new ledger's first onsale. A table whose statistics say it is empty
/// (an `ANALYZE` of it while empty) is planned whole even for one key, and read whole for
/// every key once it has grown.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn lookups_by_keys_planned_on_a_new_ledger_read_only_their_keys(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    lookups_read_only_their_keys(opts, 0).await;
}

/// Plans the lookups on a ledger of `planned` rows a table, its statistics fresh (none and no
/// `ANALYZE`: a new ledger), grows it by `NOT_DUE` rows a table and counts what each reads.
async fn lookups_read_only_their_keys(opts: PgConnectOptions, planned: i64) {
    use boxoffice_store::{holds as h, orders as o, outbox, payments, stripe_events};
    const TABLES: [&str; 7] =
        ["orders", "holds", "payments", "inbox", "outbox", "order_history", "payment_intent_refetches"];
    let generic = opts.clone().options([("plan_cache_mode", "force_generic_plan")]);
    let pool = boxoffice_store::connect(generic, 1, 10_000).await.unwrap();
    let observer = boxoffice_store::connect(opts, 1, 10_000).await.unwrap();
    let reads = Reads { pool, observer };
    // Autovacuum's ANALYZE, on a server that runs it, would have the session plan again.
    for t in TABLES {
        exec(&reads.observer, &format!("ALTER TABLE {t} SET (autovacuum_enabled = false)")).await;
    }
    let (event, _) =
        venue::seed(&reads.observer, "Lookups", &VenueSpec::small(1, 1, 8), chrono::Utc::now(), "cell-1")
            .await
            .unwrap();
    let seats: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM seats WHERE event_id = $1 ORDER BY label")
        .bind(event.0)
        .fetch_all(&reads.observer)
        .await
        .unwrap();
    // `n` rows more in each table, none of them the lookups' keys.
    let grow = |n: i64| {
        let observer = reads.observer.clone();
        async move {
            let payment = "'requires_payment_method', NULL::timestamptz";
            orders(&observer, event, n, "'held'", "'active', now() + interval '10 minutes'", Some(payment))
                .await;
            exec(&observer, &format!("INSERT INTO inbox (consumer, event_id) SELECT 'payments', gen_random_uuid() FROM generate_series(1, {n})")).await;
            exec(&observer, &format!("INSERT INTO outbox (id, topic, message_key, event_type, payload) SELECT gen_random_uuid(), 'purchase', gen_random_uuid()::text, 'TicketsVoided', '{{}}' FROM generate_series(1, {n})")).await;
            exec(&observer, &format!("INSERT INTO order_history (event_id, order_id, topic, event_type, payload, created_at) SELECT gen_random_uuid(), gen_random_uuid(), 'purchase', 'TicketsVoided', '{{}}', now() FROM generate_series(1, {n})")).await;
            exec(&observer, &format!("INSERT INTO payment_intent_refetches (payment_intent_id, order_id, asked_at, last_claim_at) SELECT 'pi_' || gen_random_uuid(), gen_random_uuid(), '-infinity', now() FROM generate_series(1, {n})")).await;
            // The observer's own reads of the tables (a foreign key's checks) are counted now,
            // not during a measure.
            exec(&observer, "SELECT pg_stat_force_next_flush()").await;
        }
    };
    if planned > 0 {
        grow(planned).await;
    } else {
        let analyzed: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_class WHERE relname IN ('holds', 'orders', 'hold_seats', 'tickets')
                AND relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema()) AND reltuples >= 0",
        )
        .fetch_one(&reads.observer)
        .await
        .unwrap();
        assert_eq!(analyzed, 0, "the seed analyzed an empty purchase table");
    }

    // The keys: orders with a hold, a payment and a pending re-fetch each.
    let mut keys = Vec::new();
    for (i, s) in seats[..LOOKED_UP as usize].iter().enumerate() {
        let pi = format!("pi_lookup_{i}");
        let order = payable_hold(&reads.observer, event, *s, &pi).await;
        let user: Uuid = sqlx::query_scalar("SELECT user_id FROM orders WHERE id = $1")
            .bind(order.0)
            .fetch_one(&reads.observer)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO payment_intent_refetches (payment_intent_id, order_id, asked_at, last_claim_at)
             VALUES ($1, $2, now() - interval '1 minute', now() - interval '1 minute')",
        )
        .bind(&pi)
        .bind(order.0)
        .execute(&reads.observer)
        .await
        .unwrap();
        keys.push((order, UserId(user), pi));
    }
    let absent = OrderId(Uuid::new_v4());
    let ids: Vec<OrderId> = keys.iter().map(|k| k.0).chain([absent]).collect();
    let commands: Vec<(OrderId, Uuid)> = ids.iter().map(|o| (*o, Uuid::new_v4())).collect();
    let pairs: Vec<(OrderId, UserId)> =
        keys.iter().map(|k| (k.0, k.1)).chain([(absent, UserId(Uuid::new_v4()))]).collect();
    let facts: Vec<boxoffice_domain::Envelope> = ids
        .iter()
        .map(|o| {
            let fact = boxoffice_domain::PurchaseEvent::TicketsVoided {
                order_id: *o,
                ticket_ids: vec![],
                reason: "lookup".into(),
            };
            boxoffice_domain::Envelope::new(*o, &fact, Uuid::new_v4(), None)
        })
        .collect();
    if planned > 0 {
        exec(&reads.observer, &format!("ANALYZE {}", TABLES.join(", "))).await;
    }
    exec(&reads.observer, "SELECT pg_stat_force_next_flush()").await;

    // Each lookup, with the rows it must find (the locks and the re-fetches' ends in a
    // transaction of their own, as a consumer's batch runs them, rolled back).
    const LOOKUPS: [&str; 8] = [
        "payments::prechecks",
        "payments::get_all",
        "orders::views",
        "outbox::not_committed",
        "holds::lock_all_for_orders",
        "holds::lock_all_with_orders",
        "stripe_events::finish_refetch",
        "stripe_events::drop_pending_refetch",
    ];
    let found = LOOKED_UP as usize;
    let run = |p: PgPool, lookup: &'static str| {
        let (ids, commands, pairs, facts, keys) = (&ids, &commands, &pairs, &facts, &keys);
        async move {
            let tx = || async { p.begin().await.unwrap() };
            match lookup {
                "payments::prechecks" => {
                    let pre = payments::prechecks(&p, "payments", commands).await.unwrap();
                    assert_eq!(pre.len(), ids.len());
                    assert_eq!(
                        pre.iter().filter(|c| c.payment.is_some() && c.hold_status.is_some()).count(),
                        found
                    );
                    assert!(pre.iter().all(|c| !c.applied));
                }
                "payments::get_all" => assert_eq!(payments::get_all(&p, ids).await.unwrap().len(), found),
                "orders::views" => {
                    let views = o::views(&p, pairs).await.unwrap();
                    assert_eq!(views.iter().filter(|v| v.2.is_ok()).count(), found);
                }
                "outbox::not_committed" => {
                    let refs: Vec<&boxoffice_domain::Envelope> = facts.iter().collect();
                    assert_eq!(outbox::not_committed(&p, &refs).await.unwrap().len(), ids.len());
                }
                "holds::lock_all_for_orders" => {
                    let mut tx = tx().await;
                    assert_eq!(h::lock_all_for_orders(&mut tx, ids).await.unwrap().len(), found);
                    tx.rollback().await.unwrap();
                }
                "holds::lock_all_with_orders" => {
                    let mut tx = tx().await;
                    assert_eq!(h::lock_all_with_orders(&mut tx, ids).await.unwrap().len(), found);
                    tx.rollback().await.unwrap();
                }
                "stripe_events::finish_refetch" => {
                    let mut tx = tx().await;
                    let at = chrono::Utc::now();
                    for (order, _, pi) in keys {
                        assert!(!stripe_events::finish_refetch(&mut tx, pi, *order, at).await.unwrap());
                    }
                    assert!(!stripe_events::finish_refetch(&mut tx, "pi_absent", absent, at).await.unwrap());
                    tx.rollback().await.unwrap();
                }
                _ => {
                    let mut tx = tx().await;
                    for (order, _, pi) in keys {
                        stripe_events::drop_pending_refetch(&mut tx, pi, *order).await.unwrap();
                    }
                    stripe_events::drop_pending_refetch(&mut tx, "pi_absent", absent).await.unwrap();
                    tx.rollback().await.unwrap();
                }
            }
        }
    };
    for lookup in LOOKUPS {
        run(reads.pool.clone(), lookup).await;
    }
    exec(&reads.pool, "SELECT pg_stat_force_next_flush()").await;

    // The ledger grows; the session's plans stay as they were made.
    grow(NOT_DUE).await;
    for lookup in LOOKUPS {
        let ((), read) = reads.measure(&TABLES, |p| run(p, lookup)).await;
        // Per table, a key's index entry, or two for a row locked (found again after its
        // lock) or changed.
        for (table, read) in TABLES.iter().zip(&read) {
            assert!(
                *read <= 2 * LOOKED_UP + SLACK,
                "{lookup} read {read} rows of {table} for {LOOKED_UP} orders: its plan reads the whole table"
            );
        }
    }
}
