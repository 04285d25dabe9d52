//! The hold transaction through the HTTP API: cases C01, C02, C10, C12 and input validation.
//! Only the API role runs (holds need no broker); every race releases its requests together
//! through a barrier.

use crate::helpers::{await_lock_wait, barrier, problem, TestApp};
use boxoffice::runtime::Role;
use boxoffice_admission::{AdmissionClaims, AdmissionSigningKey, AdmissionTokens};
use boxoffice_store::venue::VenueSpec;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

async fn api(opts: PgConnectOptions) -> TestApp {
    TestApp::spawn(opts, &[Role::Api], VenueSpec::small(1, 2, 10)).await
}

/// Races 100 distinct buyers for `seats`; returns (202s, 409 seat_unavailable, others).
async fn race_for(app: &TestApp, seats: Vec<Uuid>) -> (usize, usize, Vec<u16>) {
    let n = 100;
    let gate = barrier(n);
    let mut tasks = Vec::new();
    for _ in 0..n {
        let buyer = app.buyer();
        let adm = app.admission_token(&buyer);
        let (gate, seats) = (gate.clone(), seats.clone());
        let http = app.http.clone();
        let url = format!("{}/events/{}/holds", app.api, app.event);
        tasks.push(tokio::spawn(async move {
            gate.wait().await;
            let r = http
                .post(url)
                .bearer_auth(&buyer.token)
                .header("Idempotency-Key", Uuid::new_v4().to_string())
                .header("X-Admission-Token", adm)
                .json(&serde_json::json!({ "seat_ids": seats }))
                .send()
                .await
                .unwrap();
            problem(r).await
        }));
    }
    let (mut ok, mut conflict, mut other) = (0, 0, vec![]);
    for t in tasks {
        match t.await.unwrap() {
            (202, _, _) => ok += 1,
            (409, code, _) if code == "seat_unavailable" => conflict += 1,
            (s, _, _) => other.push(s),
        }
    }
    (ok, conflict, other)
}

async fn unreleased_rows(app: &TestApp, seat: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM hold_seats WHERE seat_id = $1 AND released_at IS NULL")
        .bind(seat)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// C01 / design §17: 100 buyers, one seat, the same instant → exactly one hold.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c01_one_seat_hundred_buyers_one_hold(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = api(opts).await;
    let seat = app.seats().await[0];
    let (ok, conflict, other) = race_for(&app, vec![seat]).await;
    assert_eq!((ok, conflict), (1, 99), "unexpected statuses: {other:?}");
    assert_eq!(unreleased_rows(&app, seat).await, 1);
    assert_eq!(app.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(app.count("SELECT count(*) FROM outbox WHERE event_type = 'HoldCreated'").await, 1);
    app.stop().await;
}

/// C01 variant: the seat carries a lapsed (but not yet swept) hold; the race reclaims it
/// exactly once and the old order ends expired.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c01_race_over_a_lapsed_hold_reclaims_once(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = api(opts).await;
    let seats = app.seats().await;
    let (seat, other_seat) = (seats[0], seats[1]);
    let first = app.buyer();
    let r = app.hold(&first, &app.admission_token(&first), "k-old", &[seat, other_seat]).await;
    assert_eq!(r.status(), 202);
    let old: serde_json::Value = r.json().await.unwrap();
    sqlx::query("UPDATE holds SET expires_at = now() - interval '1 second', payable_by = NULL, provider_check_until = NULL")
        .execute(&app.pool)
        .await
        .unwrap();

    // Multi-seat requests race against single-seat ones over the lapsed hold's seats.
    let (ok, conflict, other) = race_for(&app, vec![seat]).await;
    assert_eq!((ok, conflict), (1, 99), "unexpected statuses: {other:?}");
    assert_eq!(unreleased_rows(&app, seat).await, 1);
    assert_eq!(unreleased_rows(&app, other_seat).await, 0, "the lapsed hold released all its seats");
    let old_id: Uuid = old["order_id"].as_str().unwrap().parse().unwrap();
    let (_, view) = app.order(&first, old_id).await;
    assert_eq!(view["status"], "expired");
    assert_eq!(app.outbox_count("HoldExpired", old_id).await, 1);
    app.stop().await;
}

/// C01 variant: two overlapping multi-seat requests (locks taken in id order) and
/// single-seat requests race; every seat ends with at most one active hold.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c01_overlapping_multi_seat_races_never_double_hold(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = api(opts).await;
    let s = app.seats().await;
    let requests: Vec<Vec<Uuid>> = (0..60)
        .map(|i| match i % 3 {
            0 => vec![s[0], s[1], s[2], s[3]],
            1 => vec![s[3], s[2], s[4]],
            _ => vec![s[(i % 5) as usize]],
        })
        .collect();
    let gate = barrier(requests.len());
    let mut tasks = Vec::new();
    for seats in requests {
        let buyer = app.buyer();
        let adm = app.admission_token(&buyer);
        let gate = gate.clone();
        let (http, url) = (app.http.clone(), format!("{}/events/{}/holds", app.api, app.event));
        tasks.push(tokio::spawn(async move {
            gate.wait().await;
            let r = http
                .post(url)
                .bearer_auth(&buyer.token)
                .header("Idempotency-Key", "same-key-different-users")
                .header("X-Admission-Token", adm)
                .json(&serde_json::json!({ "seat_ids": seats }))
                .send()
                .await
                .unwrap();
            r.status().as_u16()
        }));
    }
    let mut statuses = vec![];
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    assert!(statuses.iter().all(|s| *s == 202 || *s == 409), "{statuses:?}");
    assert!(statuses.contains(&202));
    let doubles = app
        .count("SELECT count(*) FROM (SELECT seat_id FROM hold_seats WHERE released_at IS NULL GROUP BY seat_id HAVING count(*) > 1) d")
        .await;
    assert_eq!(doubles, 0);
    let held = app.count("SELECT count(*) FROM hold_seats WHERE released_at IS NULL").await;
    let orders = app.count("SELECT count(*) FROM orders").await;
    assert_eq!(orders, statuses.iter().filter(|s| **s == 202).count() as i64);
    assert!(held <= 5);
    app.stop().await;
}

/// C02: all-or-nothing; the loser's other seats stay free and the owner keeps its seat.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c02_conflict_is_all_or_nothing(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = api(opts).await;
    let s = app.seats().await;
    let (a, b) = (app.buyer(), app.buyer());
    let r = app.hold(&a, &app.admission_token(&a), "a-1", &[s[5]]).await;
    assert_eq!(r.status(), 202);
    let a_order: Uuid =
        r.json::<serde_json::Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap();

    let b_adm = app.admission_token(&b);
    let (status, code, body) = problem(app.hold(&b, &b_adm, "b-1", &[s[5]]).await).await;
    assert_eq!((status, code.as_str()), (409, "seat_unavailable"));
    assert_eq!(body["unavailable_seat_ids"][0], s[5].to_string());
    let (status, code, _) = problem(app.hold(&b, &b_adm, "b-2", &[s[4], s[5], s[6]]).await).await;
    assert_eq!((status, code.as_str()), (409, "seat_unavailable"));

    assert_eq!(unreleased_rows(&app, s[4]).await, 0);
    assert_eq!(unreleased_rows(&app, s[6]).await, 0);
    let (_, view) = app.order(&a, a_order).await;
    assert_eq!(view["status"], "held");
    assert_eq!(view["seats"][0]["seat_id"], s[5].to_string());
    // B's other seats really are free: B can take them now.
    assert_eq!(app.hold(&b, &b_adm, "b-3", &[s[4], s[6]]).await.status(), 202);
    assert_eq!(app.count("SELECT count(*) FROM orders").await, 2);
    app.stop().await;
}

/// C10 / design §17: idempotency keys per user.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c10_idempotency_key_semantics(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = api(opts).await;
    let s = app.seats().await;
    let a = app.buyer();
    let adm = app.admission_token(&a);

    // Same key, same body, ten concurrent requests: one order, and every answer is that order
    // (each waits for the buyer's lock and reads the first one's answer), nine of them marked
    // as replays.
    let gate = barrier(10);
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let (gate, http, token, adm) = (gate.clone(), app.http.clone(), a.token.clone(), adm.clone());
        let url = format!("{}/events/{}/holds", app.api, app.event);
        let seats = vec![s[0], s[1]];
        tasks.push(tokio::spawn(async move {
            gate.wait().await;
            let r = http
                .post(url)
                .bearer_auth(token)
                .header("Idempotency-Key", "retry-me")
                .header("X-Admission-Token", adm)
                .json(&serde_json::json!({ "seat_ids": seats }))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let replayed = r.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
            (status, replayed, r.json::<serde_json::Value>().await.unwrap())
        }));
    }
    let mut order_ids = std::collections::HashSet::new();
    let mut replays = 0;
    for t in tasks {
        let (status, replayed, body) = t.await.unwrap();
        assert_eq!(status, 202, "{body}");
        order_ids.insert(body["order_id"].as_str().unwrap().to_owned());
        replays += usize::from(replayed);
    }
    assert_eq!((order_ids.len(), replays), (1, 9));
    assert_eq!(app.count("SELECT count(*) FROM orders").await, 1);

    // A sequential retry returns the original response, marked as a replay; the seat list
    // order does not matter.
    let r = app.hold(&a, &adm, "retry-me", &[s[1], s[0]]).await;
    assert_eq!(r.status(), 202);
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    assert_eq!(r.headers()["location"], format!("/orders/{}", order_ids.iter().next().unwrap()));

    // Same key, different body: 409 naming the key conflict, nothing written.
    let (status, code, body) = problem(app.hold(&a, &adm, "retry-me", &[s[2]]).await).await;
    assert_eq!((status, code.as_str()), (409, "idempotency_key_conflict"), "{body}");
    assert_eq!(app.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(unreleased_rows(&app, s[2]).await, 0);

    // Another user with the same key is independent.
    let b = app.buyer();
    let r = app.hold(&b, &app.admission_token(&b), "retry-me", &[s[3]]).await;
    assert_eq!(r.status(), 202);
    assert_eq!(app.count("SELECT count(*) FROM orders").await, 2);
    app.stop().await;
}

/// C10 / invariant 3, the race the buyer's lock does not serialize: the same user's request
/// with the same key for another event, uncommitted while this hold runs (what a request of
/// that event holds between its insert of the key and its commit). The hold waits on the
/// key's primary key; if the other commits, the hold writes nothing and answers 409
/// `idempotency_key_conflict`; if it rolls back, the hold goes on and keeps the key.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c10_a_key_taken_for_another_event_meanwhile_refuses_the_hold(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = api(opts).await;
    let s = app.seats().await;
    let a = app.buyer();
    let adm = app.admission_token(&a);
    for (key, other_commits) in [("k-committed", true), ("k-rolled-back", false)] {
        let mut other = app.pool.begin().await.unwrap();
        sqlx::query(
            "INSERT INTO idempotency_keys (user_id, idempotency_key, request_hash, response_status, expires_at)
             VALUES ($1, $2, 'another event''s request', 202, now() + interval '1 hour')",
        )
        .bind(a.user)
        .bind(key)
        .execute(&mut *other)
        .await
        .unwrap();
        let seat = if other_commits { s[0] } else { s[1] };
        let seats = [seat];
        let (r, ()) = tokio::join!(app.hold(&a, &adm, key, &seats), async {
            crate::helpers::await_lock_wait(
                &app.pool,
                "%INSERT INTO idempotency_keys%",
                "the hold's key insert waits",
            )
            .await;
            if other_commits {
                other.commit().await.unwrap();
            } else {
                other.rollback().await.unwrap();
            }
        });
        let stored: (String, Option<Uuid>) = sqlx::query_as(
            "SELECT request_hash, order_id FROM idempotency_keys WHERE user_id = $1 AND idempotency_key = $2",
        )
        .bind(a.user)
        .bind(key)
        .fetch_one(&app.pool)
        .await
        .unwrap();
        if other_commits {
            let (status, code, body) = problem(r).await;
            assert_eq!((status, code.as_str()), (409, "idempotency_key_conflict"), "{body}");
            assert_eq!(stored, ("another event's request".to_owned(), None));
            assert_eq!(app.count("SELECT count(*) FROM orders").await, 0);
            assert_eq!(unreleased_rows(&app, seat).await, 0);
        } else {
            assert_eq!(r.status(), 202);
            let body: serde_json::Value = r.json().await.unwrap();
            assert_eq!(stored.1.map(|o| o.to_string()), body["order_id"].as_str().map(str::to_owned));
            assert_eq!(unreleased_rows(&app, seat).await, 1);
        }
    }
    app.stop().await;
}

/// C10: a retry whose key is known is answered from the key without locking its seats: it
/// does not wait for another transaction holding them (another buyer's hold request in
/// flight).
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c10_a_retry_is_answered_without_waiting_for_its_seats(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = api(opts).await;
    let s = app.seats().await;
    let a = app.buyer();
    let adm = app.admission_token(&a);
    let r = app.hold(&a, &adm, "once", &[s[0]]).await;
    assert_eq!(r.status(), 202);
    let first: serde_json::Value = r.json().await.unwrap();
    // Another transaction holds the seat's row lock, as a hold request of it in flight does.
    let mut blocker = app.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM seats WHERE id = $1 FOR NO KEY UPDATE")
        .bind(s[0])
        .execute(&mut *blocker)
        .await
        .unwrap();
    let r = app.hold(&a, &adm, "once", &[s[0]]).await;
    assert_eq!((r.status().as_u16(), r.headers()["idempotent-replayed"].to_str().unwrap()), (202, "true"));
    let replayed: serde_json::Value = r.json().await.unwrap();
    assert_eq!(replayed, first);
    blocker.rollback().await.unwrap();
    app.stop().await;
}

/// Region fence (design §15): a hold takes the fence's lock, shared, before it locks a seat,
/// so while a fence is pending a new hold waits holding no seat, and a writer already past
/// the fence never waits for it on a seat.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_hold_waits_for_a_pending_fence_before_it_locks_a_seat(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = api(opts).await;
    let s = app.seats().await;
    let a = app.buyer();
    let adm = app.admission_token(&a);
    // The fence's lock taken exclusive, as `region::fence` takes it.
    let mut fence = app.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2)")
        .bind(boxoffice_store::region::FENCE_LOCK.0)
        .bind(boxoffice_store::region::FENCE_LOCK.1)
        .execute(&mut *fence)
        .await
        .unwrap();
    let seats = [s[0]];
    let (r, ()) = tokio::join!(app.hold(&a, &adm, "behind-the-fence", &seats), async {
        crate::helpers::await_lock_wait(
            &app.pool,
            "WITH key_seen AS MATERIALIZED%",
            "the hold waits for the fence",
        )
        .await;
        // The seat is free to lock while the hold waits: it has not locked it.
        let mut writer = app.pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM seats WHERE id = $1 FOR NO KEY UPDATE NOWAIT")
            .bind(s[0])
            .execute(&mut *writer)
            .await
            .expect("a waiting hold holds no seat lock");
        writer.rollback().await.unwrap();
        fence.rollback().await.unwrap();
    });
    assert_eq!(r.status(), 202);
    assert_eq!(unreleased_rows(&app, s[0]).await, 1);
    app.stop().await;
}

/// C12: every bad admission token is a 403 with its own reason; a retry with the same token
/// and key after the order exists returns the original order.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c12_admission_tokens(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = api(opts).await;
    let s = app.seats().await;
    let a = app.buyer();
    let keys = boxoffice::runtime::admission_tokens(&app.cfg).unwrap();
    let claims = |user: Uuid, event: Uuid, exp_in: i64| {
        let now = chrono::Utc::now().timestamp();
        AdmissionClaims {
            jti: Uuid::new_v4(),
            sub: user,
            event_id: event,
            purchase_cell: "cell-1".into(),
            directory_epoch: 1,
            iat: now,
            exp: now + exp_in,
        }
    };
    let other_cell = boxoffice::config::Config { purchase_cell: "cell-2".into(), ..app.cfg.clone() }
        .admission_tokens()
        .unwrap();
    let good = keys.sign(&claims(a.user, app.event, 300));
    // Flip a character inside the signature (the last one may carry only padding bits).
    let mut tampered = good.clone().into_bytes();
    let i = tampered.len() - 10;
    tampered[i] = if tampered[i] == b'A' { b'B' } else { b'A' };
    let tampered = String::from_utf8(tampered).unwrap();
    let ring_of = |kid: &str, seed: u8| {
        AdmissionTokens::new(&AdmissionSigningKey::from_seed(kid, [seed; 32]), &[], "cell-1").unwrap()
    };
    let foreign_key = ring_of(&app.cfg.admission_kid, 9).sign(&claims(a.user, app.event, 300));
    let unknown_kid = ring_of("retired-key", 9).sign(&claims(a.user, app.event, 300));
    let cases = [
        (keys.sign(&claims(a.user, app.event, -5)), "admission_token_expired"),
        (keys.sign(&claims(a.user, Uuid::new_v4(), 300)), "admission_token_wrong_event"),
        (keys.sign(&claims(Uuid::new_v4(), app.event, 300)), "admission_token_wrong_user"),
        (tampered, "admission_token_bad_signature"),
        (foreign_key, "admission_token_bad_signature"),
        (unknown_kid, "admission_token_unknown_kid"),
        (
            other_cell
                .sign(&AdmissionClaims { purchase_cell: "cell-2".into(), ..claims(a.user, app.event, 300) }),
            "admission_token_wrong_cell",
        ),
        ("not-a-token".to_owned(), "admission_token_malformed"),
    ];
    for (i, (token, want)) in cases.iter().enumerate() {
        let (status, code, _) = problem(app.hold(&a, token, &format!("k{i}"), &[s[0]]).await).await;
        assert_eq!((status, code.as_str()), (403, *want), "case {i}");
    }
    let r = app
        .http
        .post(format!("{}/events/{}/holds", app.api, app.event))
        .bearer_auth(&a.token)
        .header("Idempotency-Key", "no-token")
        .json(&serde_json::json!({ "seat_ids": [s[0]] }))
        .send()
        .await
        .unwrap();
    let (status, code, _) = problem(r).await;
    assert_eq!((status, code.as_str()), (403, "admission_token_missing"));
    assert_eq!(app.count("SELECT count(*) FROM orders").await, 0, "no bad token wrote anything");

    let first = app.hold(&a, &good, "real", &[s[0]]).await;
    assert_eq!(first.status(), 202);
    let first: serde_json::Value = first.json().await.unwrap();
    let retry = app.hold(&a, &good, "real", &[s[0]]).await;
    assert_eq!(retry.status(), 202, "admission is time-bounded, not consumed");
    assert_eq!(retry.json::<serde_json::Value>().await.unwrap()["order_id"], first["order_id"]);
    app.stop().await;
}

/// Invariant 3 outlives the admission slot: a retry of a hold whose answer was lost gets its
/// order back with a token that has since expired or been revoked; the same key with other
/// seats is a 409, and a new key places nothing.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn c12_a_retry_after_the_slot_ended_gets_its_order_back(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = api(opts).await;
    let s = app.seats().await;
    let (a, b) = (app.buyer(), app.buyer());
    let keys = boxoffice::runtime::admission_tokens(&app.cfg).unwrap();
    let token = |user: Uuid, exp_in: i64| {
        let now = chrono::Utc::now().timestamp();
        keys.sign(&AdmissionClaims {
            jti: Uuid::new_v4(),
            sub: user,
            event_id: app.event,
            purchase_cell: "cell-1".into(),
            directory_epoch: 1,
            iat: now,
            exp: now + exp_in,
        })
    };
    let placed_a = app.hold(&a, &token(a.user, 300), "lost-answer", &[s[0], s[1]]).await;
    assert_eq!(placed_a.status(), 202);
    let placed_a: serde_json::Value = placed_a.json().await.unwrap();

    let expired = token(a.user, -5);
    // The same seats in another order are the same request.
    let retry = app.hold(&a, &expired, "lost-answer", &[s[1], s[0]]).await;
    assert_eq!(retry.status(), 202);
    assert_eq!(retry.headers().get("idempotent-replayed").map(|v| v.to_str().unwrap()), Some("true"));
    assert_eq!(retry.json::<serde_json::Value>().await.unwrap(), placed_a, "the original receipt");

    let (status, code, _) = problem(app.hold(&a, &expired, "lost-answer", &[s[2]]).await).await;
    assert_eq!((status, code.as_str()), (409, "idempotency_key_conflict"));
    let (status, code, _) = problem(app.hold(&a, &expired, "new-key", &[s[2]]).await).await;
    assert_eq!((status, code.as_str()), (403, "admission_token_expired"), "an ended slot places nothing");
    // Another buyer's key of the same name is not this buyer's answer.
    let (status, code, _) =
        problem(app.hold(&b, &token(b.user, -5), "lost-answer", &[s[0], s[1]]).await).await;
    assert_eq!((status, code.as_str()), (403, "admission_token_expired"));

    // A retry while its hold is still in flight (here: its key committing under the buyer's
    // lock) waits for it, then gets its answer.
    let mut in_flight = app.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1::text || '/' || $2::text, 0))")
        .bind(app.event)
        .bind(a.user)
        .execute(&mut *in_flight)
        .await
        .unwrap();
    sqlx::query("UPDATE idempotency_keys SET idempotency_key = 'in-flight' WHERE user_id = $1 AND idempotency_key = 'lost-answer'")
        .bind(a.user)
        .execute(&mut *in_flight)
        .await
        .unwrap();
    let both = [s[0], s[1]];
    let (retry, ()) = tokio::join!(app.hold(&a, &expired, "in-flight", &both), async {
        await_lock_wait(&app.pool, "%pg_advisory_xact_lock%", "the retry waits for the buyer's lock").await;
        in_flight.commit().await.unwrap();
    });
    assert_eq!(retry.status(), 202);
    assert_eq!(retry.json::<serde_json::Value>().await.unwrap(), placed_a);

    // A revoked token: the same.
    let room = boxoffice::runtime::waitroom(&app.cfg).unwrap();
    let ring = boxoffice::runtime::admission_tokens(&app.cfg).unwrap();
    let (revoked, claims) =
        ring.issue(boxoffice_domain::UserId(b.user), boxoffice_domain::EventId(app.event), 1, 600);
    let placed = app.hold(&b, &revoked, "b-key", &[s[3]]).await;
    assert_eq!(placed.status(), 202);
    let placed: serde_json::Value = placed.json().await.unwrap();
    boxoffice_api::revocation::revoke(&app.pool, &room, claims.jti, claims.exp).await.unwrap();
    let retry = app.hold(&b, &revoked, "b-key", &[s[3]]).await;
    assert_eq!(retry.status(), 202);
    assert_eq!(retry.json::<serde_json::Value>().await.unwrap(), placed);
    let (status, code, _) = problem(app.hold(&b, &revoked, "b-other", &[s[4]]).await).await;
    assert_eq!((status, code.as_str()), (403, "admission_token_revoked"));
    assert_eq!(app.count("SELECT count(*) FROM orders").await, 2, "no retry placed a hold");
    app.stop().await;
}

/// Bad input gets a clear problem+json and writes nothing.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn bad_requests_are_problems_and_write_nothing(_: PgPoolOptions, opts: PgConnectOptions) {
    let app = api(opts).await;
    let s = app.seats().await;
    let a = app.buyer();
    let adm = app.admission_token(&a);
    let url = format!("{}/events/{}/holds", app.api, app.event);
    let post = |body: String, key: Option<&str>, auth: bool| {
        let mut r = app
            .http
            .post(&url)
            .header("X-Admission-Token", &adm)
            .header("content-type", "application/json")
            .body(body);
        if let Some(k) = key {
            r = r.header("Idempotency-Key", k);
        }
        if auth {
            r = r.bearer_auth(&a.token);
        }
        r.send()
    };
    let one = serde_json::json!({ "seat_ids": [s[0]] }).to_string();
    let cases: Vec<(reqwest::Response, u16, &str)> = vec![
        (post(one.clone(), Some("k"), false).await.unwrap(), 401, "unauthenticated"),
        (post(one.clone(), None, true).await.unwrap(), 400, "idempotency_key_missing"),
        (post("{not json".into(), Some("k"), true).await.unwrap(), 400, "malformed_json"),
        (post(r#"{"seat_ids": []}"#.into(), Some("k"), true).await.unwrap(), 422, "seat_count"),
        (
            post(serde_json::json!({"seat_ids": &s[..9]}).to_string(), Some("k"), true).await.unwrap(),
            422,
            "seat_count",
        ),
        (post(r#"{"seat_ids": ["nope"]}"#.into(), Some("k"), true).await.unwrap(), 422, "invalid_body"),
        (post(r#"{"seat_ids": [], "extra": 1}"#.into(), Some("k"), true).await.unwrap(), 422, "invalid_body"),
        (
            post(serde_json::json!({"seat_ids": [Uuid::new_v4()]}).to_string(), Some("k"), true)
                .await
                .unwrap(),
            422,
            "unknown_seats",
        ),
        (post("x".repeat(100_000), Some("k"), true).await.unwrap(), 413, "body_too_large"),
    ];
    for (i, (resp, want_status, want_code)) in cases.into_iter().enumerate() {
        let (status, code, body) = problem(resp).await;
        assert_eq!((status, code.as_str()), (want_status, want_code), "case {i}: {body}");
    }
    let r =
        app.http.get(format!("{}/orders/not-a-uuid", app.api)).bearer_auth(&a.token).send().await.unwrap();
    assert_eq!(problem(r).await.0, 400);
    let r = app
        .http
        .post(format!("{}/events/{}/holds", app.api, Uuid::new_v4()))
        .bearer_auth(&a.token)
        .header("Idempotency-Key", "k")
        .header("X-Admission-Token", &adm)
        .json(&serde_json::json!({"seat_ids": [s[0]]}))
        .send()
        .await
        .unwrap();
    let (status, code, _) = problem(r).await;
    assert_eq!(
        (status, code.as_str()),
        (404, "not_found"),
        "an unknown event is a 404 whatever the admission token says"
    );
    assert_eq!(app.count("SELECT count(*) FROM orders").await, 0);
    assert_eq!(app.count("SELECT count(*) FROM idempotency_keys").await, 0);

    let r = app.http.delete(format!("{}/events/{}/holds", app.api, app.event)).send().await.unwrap();
    assert_eq!(problem(r).await.0, 405);
    let doc: serde_json::Value =
        app.http.get(format!("{}/openapi.json", app.api)).send().await.unwrap().json().await.unwrap();
    assert!(doc["paths"]["/events/{event_id}/holds"]["post"].is_object());

    // Owner-only order view.
    let r = app.hold(&a, &adm, "mine", &[s[0]]).await;
    let order: Uuid =
        r.json::<serde_json::Value>().await.unwrap()["order_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(app.order(&a, order).await.0, 200);
    assert_eq!(app.order(&app.buyer(), order).await.0, 404);
    assert_eq!(app.order(&a, Uuid::new_v4()).await.0, 404);
    app.stop().await;
}

/// A hold whose statement the database gives up (here the API's `statement_timeout` passes
/// while another transaction holds the seat's row) is answered 503 `unavailable` with a
/// `Retry-After`, not 500, and writes nothing: no order, no hold, the Idempotency-Key not
/// spent; the same request succeeds once the seat is free.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_hold_the_database_gives_up_is_unavailable_and_writes_nothing(
    _: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let app = api(opts.options([("statement_timeout", "300")])).await;
    let seats = app.seats().await;
    let mut blocker = app.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM seats WHERE id = $1 FOR UPDATE")
        .bind(seats[0])
        .execute(&mut *blocker)
        .await
        .unwrap();
    let buyer = app.buyer();
    let admission = app.admission_token(&buyer);
    let r = app.hold(&buyer, &admission, "gave-up", &seats[..1]).await;
    assert!(r.headers().contains_key("retry-after"), "{:?}", r.headers());
    let (status, code, body) = problem(r).await;
    assert_eq!((status, code.as_str()), (503, "unavailable"), "{body}");
    assert!(body["detail"].as_str().is_some_and(|d| d.contains("overloaded")), "{body}");
    let written: (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM holds), (SELECT count(*) FROM idempotency_keys)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(written, (0, 0, 0), "nothing written");
    blocker.rollback().await.unwrap();
    let r = app.hold(&buyer, &admission, "gave-up", &seats[..1]).await;
    assert_eq!(r.status(), 202, "the same request, once the seat is free");
    app.stop().await;
}
