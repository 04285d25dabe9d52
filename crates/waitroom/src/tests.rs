//! Unit tests against a real Redis (`BOXOFFICE_TEST_REDIS_URL`, default
//! `redis://127.0.0.1:6379`), each under its own key prefix so they run in parallel.

use super::*;
use std::time::Instant;

fn redis_url() -> String {
    std::env::var("BOXOFFICE_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn room_with(tweak: impl FnOnce(&mut WaitroomConfig)) -> Waitroom {
    let mut cfg = WaitroomConfig {
        redis_url: redis_url().into(),
        key_prefix: format!("test:{}:", Uuid::new_v4().simple()),
        timeout_ms: 2_000,
        queue_timeout_ms: 2_000,
        ..WaitroomConfig::default()
    };
    tweak(&mut cfg);
    Waitroom::new(cfg).unwrap()
}

fn room() -> Waitroom {
    room_with(|_| {})
}

/// Awaits `cond` for at most `timeout`, re-checking every 20 ms.
async fn eventually<F, Fut>(timeout: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn waitroom_queue_is_fifo_and_release_admits_the_head() {
    let wr = room();
    let event = EventId::new();
    let users: Vec<UserId> = (0..5).map(|_| UserId::new()).collect();
    let mut tickets = Vec::new();
    for (i, u) in users.iter().enumerate() {
        let t = wr.join(event, *u).await.unwrap();
        assert_eq!((t.state, t.position, t.created), (TicketState::Queued, Some(i as u64 + 1), true));
        tickets.push(t.ticket);
    }
    let again = wr.join(event, users[2]).await.unwrap();
    assert_eq!(
        (again.ticket, again.created, again.position),
        (tickets[2], false, Some(3)),
        "a repeated join is the same position"
    );
    let r = wr.release(event, 2, None).await.unwrap();
    assert_eq!(r.admitted, tickets[..2]);
    assert_eq!((r.queued, r.admitted_live), (3, 2));
    let s = wr.status(tickets[0], users[0]).await.unwrap();
    assert_eq!(s.state, TicketState::Admitted);
    assert!(s.slot_ends_at.unwrap() > Utc::now());
    assert_eq!(wr.status(tickets[2], users[2]).await.unwrap().position, Some(1));
    assert!(
        matches!(wr.status(tickets[2], users[3]).await, Err(WaitroomError::UnknownTicket)),
        "only the holder may poll"
    );
    wr.leave(tickets[2], users[2]).await.unwrap();
    assert_eq!(wr.status(tickets[3], users[3]).await.unwrap().position, Some(1));
    assert!(matches!(wr.status(tickets[2], users[2]).await, Err(WaitroomError::UnknownTicket)));
    assert!(matches!(wr.leave(tickets[2], users[2]).await, Err(WaitroomError::UnknownTicket)));
    assert_eq!(wr.active_events().await.unwrap(), vec![event]);
    wr.release(event, 10, None).await.unwrap();
    assert!(
        wr.active_events().await.unwrap().is_empty(),
        "an emptied queue leaves the release controller's list"
    );
}

#[tokio::test]
async fn waitroom_limits_positions_per_user_across_events() {
    let wr = room_with(|c| c.max_positions_per_user = 2);
    let u = UserId::new();
    let (e1, e2, e3) = (EventId::new(), EventId::new(), EventId::new());
    let t1 = wr.join(e1, u).await.unwrap();
    wr.join(e2, u).await.unwrap();
    assert!(matches!(wr.join(e3, u).await, Err(WaitroomError::PositionLimit { held: 2, limit: 2 })));
    assert!(
        !wr.join(e1, u).await.unwrap().created,
        "re-joining an event you queue for is not a new position"
    );
    wr.leave(t1.ticket, u).await.unwrap();
    assert!(wr.join(e3, u).await.unwrap().created);
}

/// Joins `n` users one after another into a pre-queue opening far in the future with `seed`,
/// then opens it; returns each arrival's position.
async fn prequeue_positions(wr: &Waitroom, event: EventId, seed: &str, n: usize) -> Vec<u64> {
    wr.schedule(event, Utc::now() + chrono::Duration::hours(1), Some(seed)).await.unwrap();
    let mut joined = Vec::new();
    for _ in 0..n {
        let u = UserId::new();
        let t = wr.join(event, u).await.unwrap();
        assert_eq!((t.state, t.position), (TicketState::PreQueue, None));
        assert!(t.opens_at.is_some());
        joined.push((u, t.ticket));
    }
    assert_eq!(wr.stats(event).await.unwrap().pre_queued, n as u64);
    wr.schedule(event, Utc::now() - chrono::Duration::seconds(1), Some(seed)).await.unwrap();
    let mut positions = Vec::new();
    for (u, t) in joined {
        let s = wr.status(t, u).await.unwrap();
        assert_eq!(s.state, TicketState::Queued);
        positions.push(s.position.unwrap());
    }
    positions
}

#[tokio::test]
async fn waitroom_prequeue_is_shuffled_once_at_opening_reproducibly_with_a_seed() {
    let n = 20;
    let event = EventId::new();
    let a = prequeue_positions(&room(), event, "seed-1", n).await;
    let b = prequeue_positions(&room(), event, "seed-1", n).await;
    let c = prequeue_positions(&room(), event, "seed-2", n).await;
    let mut sorted = a.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (1..=n as u64).collect::<Vec<_>>(), "every pre-queued user has exactly one position");
    assert_ne!(a, (1..=n as u64).collect::<Vec<_>>(), "the order is not the arrival order");
    assert_eq!(a, b, "the same seed gives the same order");
    assert_ne!(a, c, "another seed gives another order");
}

#[tokio::test]
async fn waitroom_joins_after_the_opening_queue_behind_the_prequeue() {
    let wr = room();
    let event = EventId::new();
    wr.schedule(event, Utc::now() + chrono::Duration::hours(1), None).await.unwrap();
    let early = UserId::new();
    let t_early = wr.join(event, early).await.unwrap();
    wr.schedule(event, Utc::now() - chrono::Duration::seconds(1), None).await.unwrap();
    let late = wr.join(event, UserId::new()).await.unwrap();
    assert_eq!(late.position, Some(2));
    assert_eq!(wr.status(t_early.ticket, early).await.unwrap().position, Some(1));
    assert!(matches!(wr.schedule(event, Utc::now(), None).await, Err(WaitroomError::AlreadyOpen)));
}

#[tokio::test]
async fn waitroom_abandoned_positions_lapse_without_blocking_release() {
    // No sweep on polls: the release step itself must step over the lapsed head.
    let wr = room_with(|c| {
        c.abandon_after_ms = 300;
        c.sweep_batch = 0;
    });
    let event = EventId::new();
    let gone = wr.join(event, UserId::new()).await.unwrap();
    let stayer = UserId::new();
    let kept = wr.join(event, stayer).await.unwrap();
    let joined_at = wr.clock_ms().await.unwrap();
    // The stayer keeps polling; the other stopped after joining.
    eventually(Duration::from_secs(10), "the first position lapsed", || async {
        wr.status(kept.ticket, stayer).await.unwrap();
        wr.clock_ms().await.unwrap() > joined_at + 300
    })
    .await;
    let r = wr.release(event, 1, None).await.unwrap();
    assert_eq!(r.admitted, vec![kept.ticket], "the live position behind the lapsed one is admitted");
    assert_eq!((r.abandoned, r.queued), (1, 0));
    assert_ne!(r.admitted[0], gone.ticket);
}

#[tokio::test]
async fn waitroom_polls_sweep_lapsed_positions() {
    let wr = room_with(|c| c.abandon_after_ms = 300);
    let event = EventId::new();
    wr.join(event, UserId::new()).await.unwrap();
    let stayer = UserId::new();
    let kept = wr.join(event, stayer).await.unwrap();
    assert_eq!(kept.position, Some(2));
    eventually(Duration::from_secs(10), "the stayer moves up to position 1", || async {
        wr.status(kept.ticket, stayer).await.unwrap().position == Some(1)
    })
    .await;
    assert_eq!(wr.stats(event).await.unwrap().queued, 1);
}

#[tokio::test]
async fn waitroom_rate_bucket_allows_a_burst_then_limits() {
    let wr = room();
    let b = Bucket { per_s: 2.0, burst: 3 };
    for _ in 0..3 {
        assert_eq!(wr.take("ip", "203.0.113.7", b, Patience::FailFast).await.unwrap(), RateDecision::Allowed);
    }
    match wr.take("ip", "203.0.113.7", b, Patience::FailFast).await.unwrap() {
        RateDecision::Limited { retry_after_ms } => {
            assert!((1..=500).contains(&retry_after_ms), "{retry_after_ms}")
        }
        RateDecision::Allowed => panic!("the fourth request of a burst of 3 passed"),
    }
    assert_eq!(
        wr.take("ip", "203.0.113.8", b, Patience::FailFast).await.unwrap(),
        RateDecision::Allowed,
        "buckets are per id"
    );
}

#[tokio::test]
async fn waitroom_revocation_and_leaving_an_admitted_ticket() {
    let wr = room();
    let jti = Uuid::new_v4();
    assert!(!wr.is_revoked(jti).await.unwrap());
    wr.revoke(jti, Utc::now().timestamp() + 60).await.unwrap();
    assert!(wr.is_revoked(jti).await.unwrap());
    let (event, u) = (EventId::new(), UserId::new());
    let t = wr.join(event, u).await.unwrap();
    wr.release(event, 1, None).await.unwrap();
    let slot = wr.admission_slot(t.ticket, u).await.unwrap().expect("admitted: a running slot");
    assert!(matches!(wr.admission_slot(t.ticket, UserId::new()).await, Err(WaitroomError::UnknownTicket)));
    let revoked_until = wr.leave(t.ticket, u).await.unwrap();
    assert_eq!(revoked_until.map(|t| t.timestamp_millis() / 1000), Some(slot.timestamp_millis() / 1000));
    assert!(wr.is_revoked(t.ticket).await.unwrap(), "leaving during the slot revokes its token");
    let queued = wr.join(event, u).await.unwrap();
    assert_eq!(wr.admission_slot(queued.ticket, u).await.unwrap(), None, "no slot while queued");
    assert_eq!(wr.leave(queued.ticket, u).await.unwrap(), None, "leaving the queue revokes nothing");
}

#[tokio::test]
async fn waitroom_revocation_state_and_seeding() {
    let wr = room();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let s = wr.revocation_state(a).await.unwrap();
    assert_eq!((s.revoked, s.seeded), (false, false), "a fresh Redis cannot vouch for a miss");
    let until = Utc::now().timestamp() + 60;
    assert!(wr.seed_revocations(&[(a, until)]).await.unwrap(), "marked seeded");
    let s = wr.revocation_state(a).await.unwrap();
    assert_eq!((s.revoked, s.seeded), (true, true));
    let s = wr.revocation_state(b).await.unwrap();
    assert_eq!((s.revoked, s.seeded), (false, true), "a trusted miss");
    assert!(wr.seed_revocations(&[]).await.unwrap(), "an empty ledger seeds too");
}

#[tokio::test]
async fn waitroom_unreachable_redis_fails_fast() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let wr = room_with(|c| {
        c.redis_url = format!("redis://127.0.0.1:{port}").into();
        c.timeout_ms = 300;
    });
    let started = Instant::now();
    let e = wr.join(EventId::new(), UserId::new()).await.unwrap_err();
    assert!(e.is_unavailable(), "{e:?}");
    assert!(wr.is_revoked(Uuid::new_v4()).await.unwrap_err().is_unavailable());
    assert!(started.elapsed() < Duration::from_secs(2), "bounded by the timeout: {:?}", started.elapsed());
}

#[tokio::test]
async fn polls_report_the_release_controllers_live_rate() {
    let wr = room();
    let event = EventId::new();
    let users: Vec<UserId> = (0..3).map(|_| UserId::new()).collect();
    let first = wr.join(event, users[0]).await.unwrap();
    assert_eq!(first.release_per_s, None, "no controller has released yet");
    wr.join(event, users[1]).await.unwrap();
    wr.release(event, 1, Some((2.5, Duration::from_secs(10)))).await.unwrap();
    let s = wr.status(wr.join(event, users[1]).await.unwrap().ticket, users[1]).await.unwrap();
    assert_eq!((s.position, s.release_per_s), (Some(1), Some(2.5)));
    let third = wr.join(event, users[2]).await.unwrap();
    assert_eq!(third.release_per_s, Some(2.5));
    // A release without a rate (an operator's) leaves the controller's word in place.
    wr.release(event, 1, None).await.unwrap();
    assert_eq!(wr.status(third.ticket, users[2]).await.unwrap().release_per_s, Some(2.5));
    // A rate past its validity says nothing.
    wr.release(event, 0, Some((1.0, Duration::from_millis(1)))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(wr.status(third.ticket, users[2]).await.unwrap().release_per_s, None);
}

/// Sets `ticket`'s last poll to `ms_ago` before the Redis clock, as if its holder had not
/// polled (or been answered) since.
async fn polled_ago(wr: &Waitroom, event: EventId, ticket: Uuid, ms_ago: i64) {
    let now = wr.clock_ms().await.unwrap();
    let hb = wr.keys.event(event.0).0[3].clone();
    let mut conn = wr.conn.clone();
    let _: () = redis::cmd("ZADD")
        .arg(hb)
        .arg(now - ms_ago)
        .arg(ticket.to_string())
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// Sets the last sweeping script's time to `ms_ago` before the Redis clock, as if no call
/// had reached Redis since.
async fn stalled_for(wr: &Waitroom, ms_ago: i64) {
    let now = wr.clock_ms().await.unwrap();
    let mut conn = wr.conn.clone();
    let _: () = redis::cmd("HSET")
        .arg(wr.keys.lapse_clock())
        .arg("seen")
        .arg(now - ms_ago)
        .query_async(&mut conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn waitroom_a_stall_longer_than_the_lapse_time_lapses_nobody_who_polled_before_it() {
    // A lapse time of a minute: the seconds between setting a heartbeat and the script that
    // judges it are far inside every margin below.
    let wr = room_with(|c| c.abandon_after_ms = 60_000);
    let event = EventId::new();
    let (kept_user, far_user) = (UserId::new(), UserId::new());
    let kept = wr.join(event, kept_user).await.unwrap();
    let far = wr.join(event, far_user).await.unwrap();
    // The holder polled just before a 100 s stall (nothing reached Redis); the other one had
    // stopped polling 100 s before that.
    polled_ago(&wr, event, kept.ticket, 100_000).await;
    polled_ago(&wr, event, far.ticket, 200_000).await;
    stalled_for(&wr, 100_000).await;
    let s = wr.status(kept.ticket, kept_user).await.expect("kept: the stall does not count");
    assert_eq!((s.state, s.position), (TicketState::Queued, Some(1)));
    assert!(
        matches!(wr.status(far.ticket, far_user).await, Err(WaitroomError::UnknownTicket)),
        "silent for 100 s of serving time before the stall: lapsed"
    );
    // The grace is bounded: a position silent for longer than four lapse times lapses
    // whatever the stalls.
    polled_ago(&wr, event, kept.ticket, 250_000).await;
    stalled_for(&wr, 250_000).await;
    assert!(
        matches!(wr.status(kept.ticket, kept_user).await, Err(WaitroomError::UnknownTicket)),
        "past the longest grace"
    );
    // Without a stall the lapse time is the lapse time.
    let plain = room_with(|c| c.abandon_after_ms = 60_000);
    let u = UserId::new();
    let t = plain.join(event, u).await.unwrap();
    polled_ago(&plain, event, t.ticket, 70_000).await;
    assert!(matches!(plain.status(t.ticket, u).await, Err(WaitroomError::UnknownTicket)));
}

#[tokio::test]
async fn waitroom_refusals_a_process_noted_do_not_count_towards_a_lapse() {
    let wr = room_with(|c| c.abandon_after_ms = 60_000);
    let event = EventId::new();
    let users: Vec<UserId> = (0..4).map(|_| UserId::new()).collect();
    let mut tickets = Vec::new();
    for u in &users {
        tickets.push(wr.join(event, *u).await.unwrap().ticket);
    }
    // The process refused every poll for the last 80 s. Users 1 and 2 were answered 100 s
    // ago (20 s of serving time, then the refusals); user 0 170 s ago (90 s: lapsed).
    polled_ago(&wr, event, tickets[0], 170_000).await;
    polled_ago(&wr, event, tickets[1], 100_000).await;
    polled_ago(&wr, event, tickets[2], 100_000).await;
    let now = Instant::now();
    wr.note_refused(now - Duration::from_secs(80), now);
    let r = wr.release(event, 1, None).await.unwrap();
    assert_eq!(r.admitted, vec![tickets[1]], "the refused holder is admitted, the silent one dropped");
    assert_eq!(r.abandoned, 1);
    assert!(wr.refusals.lock().unwrap().pending.is_empty(), "the claim is recorded once it went out");
    let again = wr.join(event, users[2]).await.unwrap();
    assert_eq!((again.ticket, again.created), (tickets[2], false), "a repeated join finds its position");
    assert_eq!(wr.status(tickets[3], users[3]).await.unwrap().position, Some(2));
    assert_eq!(wr.stats(event).await.unwrap().queued, 2);
}

#[test]
fn refusals_merge_keep_a_bounded_list_and_go_out_at_most_every_claim_interval() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut r = Refusals::default();
    r.note(at(1_000), at(1_000));
    assert!(r.pending.is_empty(), "a single refusal is no span");
    r.note(at(1_000), at(2_000));
    r.note(at(1_000), at(2_500)); // the same streak, later
    r.note(at(5_000), at(6_000));
    assert_eq!(r.pending, vec![(at(1_000), at(2_500)), (at(5_000), at(6_000))]);
    let (text, sent) = r.claim(at(7_000), false).unwrap();
    assert_eq!(text, "6000:4500,2000:1000");
    assert!(r.claim(at(7_100), false).is_none(), "one claim per CLAIM_EVERY");
    r.note(at(5_000), at(7_200)); // the streak went on while the claim was out
    r.recorded(&sent);
    assert_eq!(r.pending, vec![(at(5_000), at(7_200))], "what grew since is sent again");
    assert!(r.claim(at(7_000) + CLAIM_EVERY, false).is_some());
    let mut many = Refusals::default();
    for i in 0..20 {
        many.note(at(i * 1_000), at(i * 1_000 + 500));
    }
    assert_eq!(many.pending.len(), REFUSALS_KEPT);
    assert_eq!(many.pending[0].0, at(0), "joined into the oldest: longer, never shorter");
    assert_eq!(many.pending.last().unwrap().1, at(19_500));
}

#[tokio::test]
async fn waitroom_the_clock_tick_records_stalls_and_claims_and_reports_the_grace() {
    let wr = room_with(|c| c.abandon_after_ms = 60_000);
    assert_eq!(wr.tick_clock(false).await.unwrap(), Duration::ZERO, "no pause yet");
    // Seen every second, a quiet waiting room is no stall.
    assert_eq!(wr.tick_clock(false).await.unwrap(), Duration::ZERO);
    stalled_for(&wr, 30_000).await;
    let grace = wr.tick_clock(false).await.unwrap();
    assert!((30_000..32_000).contains(&(grace.as_millis() as u64)), "the stall: {grace:?}");

    let wr = room_with(|c| c.abandon_after_ms = 60_000);
    let now = Instant::now();
    wr.note_refused(now - Duration::from_secs(20), now);
    let grace = wr.tick_clock(false).await.unwrap();
    assert!((20_000..22_000).contains(&(grace.as_millis() as u64)), "the claim: {grace:?}");
    assert!(wr.refusals.lock().unwrap().pending.is_empty(), "sent without waiting for traffic");
    // A claim while one went out less than CLAIM_EVERY ago waits, unless flushed (the last
    // tick of a process on its way out).
    let now = Instant::now();
    wr.note_refused(now - Duration::from_secs(25), now);
    wr.refusals.lock().unwrap().last_sent = Some(Instant::now());
    wr.tick_clock(false).await.unwrap();
    assert!(!wr.refusals.lock().unwrap().pending.is_empty());
    wr.tick_clock(true).await.unwrap();
    assert!(wr.refusals.lock().unwrap().pending.is_empty());
}

#[tokio::test]
async fn waitroom_keeps_a_bounded_number_of_pauses_never_a_shorter_one() {
    let wr = room_with(|c| c.abandon_after_ms = 60_000);
    let now = Instant::now();
    // Three claims of eight disjoint half-second spans each, 1 s apart: 24 pauses.
    for k in 0..3u64 {
        for i in 0..8u64 {
            let end = now - Duration::from_millis(1_000 * (8 * k + i) + 100);
            wr.note_refused(end - Duration::from_millis(500), end);
        }
        wr.tick_clock(true).await.unwrap();
    }
    let mut conn = wr.conn.clone();
    let spans: String =
        redis::cmd("HGET").arg(wr.keys.lapse_clock()).arg("spans").query_async(&mut conn).await.unwrap();
    let spans: Vec<(i64, i64)> = spans
        .split(',')
        .map(|s| s.split_once(':').unwrap())
        .map(|(a, b)| (a.parse().unwrap(), b.parse().unwrap()))
        .collect();
    assert_eq!(spans.len(), scripts::MAX_SPANS, "{spans:?}");
    let paused: i64 = spans.iter().map(|(a, b)| b - a).sum();
    assert!(paused >= 24 * 500, "joining spans only lengthens the pauses: {paused} ms");
    assert!(spans.windows(2).all(|w| w[0].1 < w[1].0), "sorted and disjoint: {spans:?}");
}

#[tokio::test]
async fn waitroom_an_ended_admission_slot_stops_counting_at_once_whatever_the_pauses() {
    let wr = room_with(|c| c.max_positions_per_user = 2);
    let u = UserId::new();
    let (e1, e2, e3) = (EventId::new(), EventId::new(), EventId::new());
    let t = wr.join(e1, u).await.unwrap();
    wr.release(e1, 1, None).await.unwrap();
    assert_eq!(wr.status(t.ticket, u).await.unwrap().state, TicketState::Admitted);
    // The slot ended a second ago; the lapse clock holds lapses back by a minute.
    let now = wr.clock_ms().await.unwrap();
    let mut conn = wr.conn.clone();
    for key in [wr.keys.event(e1.0).0[4].clone(), wr.keys.user_slots(u.0)] {
        let _: () = redis::cmd("ZADD")
            .arg(key)
            .arg(now - 1_000)
            .arg(t.ticket.to_string())
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    stalled_for(&wr, 60_000).await;
    wr.join(e2, u).await.unwrap();
    assert!(wr.join(e3, u).await.is_ok(), "the ended slot no longer counts towards the limit");
    assert!(matches!(
        wr.join(EventId::new(), u).await,
        Err(WaitroomError::PositionLimit { held: 2, limit: 2 })
    ));
}

/// Two processes' waiting rooms on one key prefix with lapse times of `long_ms` and `short_ms`.
fn sharing_one_clock(long_ms: u64, short_ms: u64) -> (Waitroom, Waitroom) {
    let long = room_with(|c| c.abandon_after_ms = long_ms);
    let short = room_with(|c| {
        c.abandon_after_ms = short_ms;
        c.key_prefix = long.cfg.key_prefix.clone();
    });
    (long, short)
}

#[tokio::test]
async fn waitroom_processes_with_different_lapse_times_share_the_pauses_without_spoiling_them() {
    let (long, short) = sharing_one_clock(120_000, 60_000);
    let around =
        |grace: Duration, s: u64| (s * 1_000..s * 1_000 + 2_000).contains(&(grace.as_millis() as u64));
    // A cutoff cached by one lapse time is not reused by the other.
    let now = Instant::now();
    short.note_refused(now - Duration::from_secs(30), now);
    let g = short.tick_clock(true).await.unwrap();
    assert!(around(g, 30), "{g:?}");
    let g = long.tick_clock(false).await.unwrap();
    assert!(around(g, 30), "the long lapse time's own cutoff: {g:?}");
    // A pause the long lapse time still needs survives the short one's calls: 200 s ending
    // 250 s ago (before the short one's oldest cutoff, 240 s back) and 200 s ending now.
    let (long, short) = sharing_one_clock(120_000, 60_000);
    let now = Instant::now();
    long.note_refused(now - Duration::from_secs(450), now - Duration::from_secs(250));
    long.note_refused(now - Duration::from_secs(200), now);
    // 120 s of serving time back from now passes both pauses: capped at 360 s.
    let g = long.tick_clock(true).await.unwrap();
    assert!(around(g, 360), "{g:?}");
    let g = short.tick_clock(false).await.unwrap();
    assert!(around(g, 180), "the short one's grace is capped at three lapse times: {g:?}");
    let g = long.tick_clock(false).await.unwrap();
    assert!(around(g, 360), "and the long one's older pause is still there: {g:?}");
    // Pauses older than an hour are kept while a caller's longest grace still needs them:
    // with a 20 min lapse time, 39 min of pause ending 61 min ago and 55 min ending 5 min ago
    // hold lapses back by the whole 60 min grace.
    let (long, short) = sharing_one_clock(1_200_000, 60_000);
    let now = long.clock_ms().await.unwrap();
    let min = 60_000;
    let spans = format!("{}:{},{}:{}", now - 100 * min, now - 61 * min, now - 60 * min, now - 5 * min);
    let mut conn = long.conn.clone();
    let _: () = redis::cmd("HSET")
        .arg(long.keys.lapse_clock())
        .arg("spans")
        .arg(spans)
        .query_async(&mut conn)
        .await
        .unwrap();
    let g = long.tick_clock(false).await.unwrap();
    assert!(around(g, 3_600), "{g:?}");
    short.tick_clock(false).await.unwrap();
    let g = long.tick_clock(false).await.unwrap();
    assert!(around(g, 3_600), "the short lapse time's calls keep what the long one needs: {g:?}");
}

#[tokio::test]
async fn waitroom_a_running_slot_counts_towards_the_limit_however_its_holder_learnt_of_it() {
    let wr = room_with(|c| c.max_positions_per_user = 2);
    let u = UserId::new();
    let e1 = EventId::new();
    let t = wr.join(e1, u).await.unwrap();
    wr.release(e1, 1, None).await.unwrap();
    let again = wr.join(e1, u).await.unwrap();
    assert_eq!((again.ticket, again.state), (t.ticket, TicketState::Admitted), "learnt by a repeated join");
    // Long after its last poll: a queue position would have lapsed by now; the slot runs on.
    let now = wr.clock_ms().await.unwrap();
    let mut conn = wr.conn.clone();
    let _: () = redis::cmd("ZADD")
        .arg(wr.keys.user(u.0))
        .arg(now - 1_000)
        .arg(t.ticket.to_string())
        .query_async(&mut conn)
        .await
        .unwrap();
    wr.join(EventId::new(), u).await.unwrap();
    assert!(
        matches!(wr.join(EventId::new(), u).await, Err(WaitroomError::PositionLimit { held: 2, limit: 2 })),
        "the running slot and the new position"
    );
}

#[test]
fn a_redis_short_of_memory_or_busy_is_unavailable_and_a_refused_script_a_fault() {
    let reply = |line: &str| {
        redis::parse_redis_value(format!("-{line}\r\n").as_bytes()).unwrap().extract_error().unwrap_err()
    };
    for line in
        ["OOM command not allowed when used memory > 'maxmemory'.", "BUSY Redis is busy running a script."]
    {
        assert!(matches!(classify(reply(line)), WaitroomError::Unavailable(_)), "{line}");
    }
    assert!(matches!(classify(reply("ERR Error running script")), WaitroomError::Redis(_)));
}
