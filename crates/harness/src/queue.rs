//! The waiting-room phase of the simulated buyers (design §3): every buyer joins the event's
//! queue (`POST /events/{id}/queue`), polls its ticket (`GET /queue/{ticket}`) as the server
//! advises (`poll_after_ms`) until the release controller admits it, and hands its admission
//! token to the purchase journey of [`crate::buyers`].
//!
//! Owns the dispatcher of join and poll attempts and their statistics. Two pacing modes:
//! - **paced by the server** (`attempt_rate = 0`): new buyers join at the arrival rate and each
//!   queued buyer polls when its `poll_after_ms` has passed, like real clients;
//! - **open loop** (`attempt_rate > 0`): attempt `k` is sent at `start + k / rate` whatever the
//!   server's speed (no attempt waits for an earlier answer), so a slow server meets a constant
//!   offered load instead of a generator that politely slows down. Each slot serves the poll
//!   that is due first; otherwise a new buyer joins; a slot with nothing to do is counted idle.
//!   Latency is measured from the slot's scheduled time, so queueing inside the generator is
//!   not hidden (no coordinated omission).
//!
//! Whatever the mode, a position is kept alive by polls: a 404 on a poll (the position lapsed,
//! e.g. after a long stall) makes the buyer join again. 429 and 503 answers are retried after
//! their `Retry-After`. Nothing here touches seats: it only shapes who may try to hold them.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::Rng;
use reqwest::StatusCode;
use serde::Serialize;
use tokio::sync::{mpsc, Notify, Semaphore};
use uuid::Uuid;

use crate::client::{self, BuyerClient, QueueView};
use crate::stats::{self, Percentiles};

/// Consecutive failed attempts (transport errors, 5xx, unexpected answers) after which a
/// buyer stops queueing.
pub const MAX_FAILURES: u32 = 20;
/// Bound of one join or poll request.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

/// How the waiting-room phase runs.
#[derive(Debug, Clone)]
pub struct QueuePacing {
    /// Join + poll attempts per second, open loop; 0 = joins at `arrival_rate` and polls when
    /// the server's `poll_after_ms` says.
    pub attempt_rate: f64,
    /// New buyers joining per second when `attempt_rate` is 0; 0 = all at once.
    pub arrival_rate: f64,
    /// Attempts in flight at most; a slot finding them all busy is counted `late` and its
    /// work is sent as soon as one finishes (the generator's own limit, reported so it is
    /// never mistaken for the server's).
    pub max_in_flight: usize,
}

/// Statistics of the waiting-room phase.
#[derive(Debug, Clone, Default, Serialize)]
pub struct QueueStats {
    /// `POST /events/{id}/queue` attempts sent.
    pub joins: u64,
    /// `GET /queue/{ticket}` attempts sent.
    pub polls: u64,
    /// Buyers admitted (received an admission token).
    pub admitted: u64,
    /// Buyers who stopped queueing after [`MAX_FAILURES`] failed attempts in a row (503s,
    /// transport errors, 5xx, unreadable answers).
    pub gave_up: u64,
    /// Buyers given an answer they cannot retry (a 4xx other than a poll's 404 and 429:
    /// 401, a join's 404, 409 `queue_position_limit`, …): they stopped queueing at once.
    pub rejected: u64,
    /// Polls answered 404 (the position lapsed): the buyer joined again.
    pub lapsed: u64,
    /// 429 answers (rate buckets).
    pub rate_limited_429: u64,
    /// 503 answers (waiting room unavailable, or shed).
    pub unavailable_503: u64,
    /// The 503 answers by their problem `code` (`waitroom_unavailable`: Redis did not
    /// answer in time; `overloaded`: a bulkhead or the process's slots were full;
    /// `request_timeout`; `unknown` when the body was not problem+json).
    pub unavailable_503_by_code: std::collections::BTreeMap<String, u64>,
    /// Transport errors, other 5xx and unexpected answers.
    pub errors: u64,
    /// Open-loop slots with nothing to send (no due poll, every buyer joined).
    pub idle_slots: u64,
    /// Open-loop slots sent late because `max_in_flight` attempts were outstanding.
    pub late_slots: u64,
    /// Join and poll attempts per second over the phase (first attempt → last answer).
    pub attempts_per_s: f64,
    /// Join or poll latency, ms, from the scheduled slot (open loop) or the send.
    pub attempt_latency_ms: Percentiles,
    /// Time from the first join to admission, ms.
    pub queue_wait_ms: Percentiles,
    /// Largest position a buyer was told, 1-based.
    pub max_position: u64,
}

/// An admitted buyer: its index, bearer header and admission token.
pub struct Admitted {
    /// The buyer's index.
    pub idx: usize,
    /// `Bearer …` of the buyer's user.
    pub bearer: Arc<str>,
    /// The admission token for `X-Admission-Token`.
    pub token: String,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Join,
    Poll,
}

/// One buyer in the waiting room.
struct Waiting {
    bearer: Arc<str>,
    /// A per-buyer client address, sent as `X-Forwarded-For` (honoured only by deployments
    /// that trust it), so the per-IP bucket sees a crowd rather than one host.
    forwarded_for: String,
    ticket: Option<Uuid>,
    first_join: Option<Instant>,
    failures: u32,
}

#[derive(Default)]
struct Schedule {
    /// Due work: (when, sequence, buyer, kind).
    due: BinaryHeap<Reverse<(Instant, u64, usize, Kind)>>,
    seq: u64,
    /// Buyers that have not joined yet: `next_join..n`.
    next_join: usize,
    /// Buyers admitted or given up.
    resolved: usize,
}

#[derive(Default)]
struct Counters {
    joins: AtomicU64,
    polls: AtomicU64,
    admitted: AtomicU64,
    gave_up: AtomicU64,
    rejected: AtomicU64,
    lapsed: AtomicU64,
    rate_limited_429: AtomicU64,
    unavailable_503: AtomicU64,
    errors: AtomicU64,
    idle_slots: AtomicU64,
    late_slots: AtomicU64,
    max_position: AtomicU64,
    last_answer_ms: AtomicU64,
    unavailable_by_code: Mutex<std::collections::BTreeMap<String, u64>>,
}

struct Room {
    client: BuyerClient,
    event_id: Uuid,
    buyers: Vec<Mutex<Waiting>>,
    schedule: Mutex<Schedule>,
    wake: Notify,
    in_flight: Arc<Semaphore>,
    stats: Counters,
    attempt_us: Mutex<Histogram<u64>>,
    wait_us: Mutex<Histogram<u64>>,
    admitted: mpsc::UnboundedSender<Admitted>,
    started: Instant,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Runs the waiting-room phase for `bearers.len()` buyers and sends each admitted buyer on
/// `admitted` as soon as its token arrives; returns when every buyer is admitted or gave up.
pub async fn run(
    client: BuyerClient,
    event_id: Uuid,
    bearers: Vec<Arc<str>>,
    pacing: QueuePacing,
    admitted: mpsc::UnboundedSender<Admitted>,
) -> anyhow::Result<QueueStats> {
    anyhow::ensure!(
        pacing.attempt_rate >= 0.0 && pacing.attempt_rate.is_finite(),
        "attempt_rate must be >= 0"
    );
    anyhow::ensure!(pacing.max_in_flight >= 1, "max_in_flight must be at least 1");
    let n = bearers.len();
    let room = Arc::new(Room {
        client,
        event_id,
        buyers: bearers
            .into_iter()
            .enumerate()
            .map(|(i, bearer)| {
                Mutex::new(Waiting {
                    bearer,
                    forwarded_for: client::forwarded_for(i),
                    ticket: None,
                    first_join: None,
                    failures: 0,
                })
            })
            .collect(),
        schedule: Mutex::new(Schedule::default()),
        wake: Notify::new(),
        in_flight: Arc::new(Semaphore::new(pacing.max_in_flight)),
        stats: Counters::default(),
        attempt_us: Mutex::new(stats::histogram()),
        wait_us: Mutex::new(stats::histogram()),
        admitted,
        started: Instant::now(),
    });
    let mut slot: u64 = 0;
    loop {
        if lock(&room.schedule).resolved >= n {
            break;
        }
        let now = Instant::now();
        // When the next attempt may go and, for the open loop, the slot it belongs to.
        let (at, scheduled) = if pacing.attempt_rate > 0.0 {
            let at = room.started + Duration::from_secs_f64(slot as f64 / pacing.attempt_rate);
            slot += 1;
            (at, true)
        } else {
            let s = lock(&room.schedule);
            let next_poll = s.due.peek().map(|Reverse((t, ..))| *t);
            let next_arrival = (s.next_join < n).then(|| {
                if pacing.arrival_rate > 0.0 {
                    room.started + Duration::from_secs_f64(s.next_join as f64 / pacing.arrival_rate)
                } else {
                    now
                }
            });
            match (next_poll, next_arrival) {
                (Some(a), Some(b)) => (a.min(b), false),
                (Some(a), None) | (None, Some(a)) => (a, false),
                (None, None) => (now + Duration::from_millis(200), false),
            }
        };
        if at > now {
            tokio::select! {
                _ = tokio::time::sleep_until(at.into()) => {}
                // An answer scheduled new work (paced mode re-plans; the open loop keeps its slots).
                _ = room.wake.notified(), if !scheduled => continue,
            }
        }
        let work = {
            let mut s = lock(&room.schedule);
            let now = Instant::now();
            match s.due.peek() {
                Some(Reverse((t, ..))) if *t <= now => s.due.pop().map(|Reverse((_, _, i, k))| (i, k)),
                _ => {
                    let arrived = scheduled
                        || pacing.arrival_rate <= 0.0
                        || room.started + Duration::from_secs_f64(s.next_join as f64 / pacing.arrival_rate)
                            <= now;
                    if s.next_join < n && arrived {
                        s.next_join += 1;
                        Some((s.next_join - 1, Kind::Join))
                    } else {
                        None
                    }
                }
            }
        };
        let Some((idx, kind)) = work else {
            if scheduled {
                inc(&room.stats.idle_slots);
            }
            continue;
        };
        let permit = match room.in_flight.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                inc(&room.stats.late_slots);
                match room.in_flight.clone().acquire_owned().await {
                    Ok(p) => p,
                    Err(_) => break, // never closed
                }
            }
        };
        let room2 = room.clone();
        let from = if scheduled { at } else { Instant::now() };
        tokio::spawn(async move {
            room2.attempt(idx, kind, from).await;
            drop(permit);
            room2.wake.notify_one();
        });
    }
    // Every buyer is resolved; answers still in flight can only be stragglers.
    let s = &room.stats;
    let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let attempts = g(&s.joins) + g(&s.polls);
    let secs = g(&s.last_answer_ms) as f64 / 1_000.0;
    let attempt_latency_ms = Percentiles::from_us(&lock(&room.attempt_us));
    let queue_wait_ms = Percentiles::from_us(&lock(&room.wait_us));
    let unavailable_503_by_code = lock(&s.unavailable_by_code).clone();
    Ok(QueueStats {
        joins: g(&s.joins),
        polls: g(&s.polls),
        admitted: g(&s.admitted),
        gave_up: g(&s.gave_up),
        rejected: g(&s.rejected),
        lapsed: g(&s.lapsed),
        rate_limited_429: g(&s.rate_limited_429),
        unavailable_503: g(&s.unavailable_503),
        unavailable_503_by_code,
        errors: g(&s.errors),
        idle_slots: g(&s.idle_slots),
        late_slots: g(&s.late_slots),
        attempts_per_s: if secs > 0.0 { attempts as f64 / secs } else { 0.0 },
        attempt_latency_ms,
        queue_wait_ms,
        max_position: g(&s.max_position),
    })
}

impl Room {
    /// Puts `kind` work for buyer `idx` on the schedule at `at`.
    fn schedule(&self, idx: usize, kind: Kind, at: Instant) {
        {
            let mut s = lock(&self.schedule);
            s.seq += 1;
            let seq = s.seq;
            s.due.push(Reverse((at, seq, idx, kind)));
        }
        self.wake.notify_one();
    }

    fn resolve(&self) {
        lock(&self.schedule).resolved += 1;
        self.wake.notify_one();
    }

    /// Retries the buyer's step after `after`, or gives up after `MAX_FAILURES` in a row.
    fn retry(&self, idx: usize, kind: Kind, after: Duration) {
        let failures = {
            let mut b = lock(&self.buyers[idx]);
            b.failures += 1;
            b.failures
        };
        if failures >= MAX_FAILURES {
            inc(&self.stats.gave_up);
            self.resolve();
        } else {
            self.schedule(idx, kind, Instant::now() + after);
        }
    }

    /// Sends one join or poll for buyer `idx` and schedules what follows from its answer.
    async fn attempt(&self, idx: usize, kind: Kind, from: Instant) {
        let (bearer, forwarded_for, ticket) = {
            let b = lock(&self.buyers[idx]);
            (b.bearer.clone(), b.forwarded_for.clone(), b.ticket)
        };
        let req = match (kind, ticket) {
            (Kind::Poll, Some(t)) => {
                inc(&self.stats.polls);
                self.client.poll_queue(&bearer, t)
            }
            _ => {
                inc(&self.stats.joins);
                let mut b = lock(&self.buyers[idx]);
                b.first_join.get_or_insert(from);
                drop(b);
                self.client.join_queue(&bearer, self.event_id)
            }
        };
        let req = req.header("x-forwarded-for", forwarded_for).timeout(ATTEMPT_TIMEOUT);
        let answer = async {
            let resp = req.send().await?;
            let status = resp.status();
            let retry_after = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            let body = resp.bytes().await?;
            Ok::<_, reqwest::Error>((status, retry_after, body))
        }
        .await;
        stats::record(&mut lock(&self.attempt_us), from.elapsed());
        self.stats.last_answer_ms.fetch_max(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
        let backoff = || Duration::from_millis(rand::thread_rng().gen_range(500..1_500));
        let (status, retry_after, body) = match answer {
            Ok(a) => a,
            Err(e) => {
                inc(&self.stats.errors);
                tracing::debug!(error = %e, "queue attempt failed");
                return self.retry(idx, kind, backoff());
            }
        };
        let after_header = |d: Duration| retry_after.map(|s| Duration::from_secs(s.max(1))).unwrap_or(d);
        match status {
            StatusCode::OK | StatusCode::CREATED => {
                let Ok(view) = serde_json::from_slice::<QueueView>(&body) else {
                    inc(&self.stats.errors);
                    return self.retry(idx, kind, backoff());
                };
                let first_join = {
                    let mut b = lock(&self.buyers[idx]);
                    b.ticket = Some(view.ticket);
                    b.failures = 0;
                    b.first_join
                };
                if let Some(p) = view.position {
                    self.stats.max_position.fetch_max(p, Ordering::Relaxed);
                }
                match (view.state.as_str(), view.admission_token) {
                    ("admitted", Some(token)) => {
                        if let Some(t) = first_join {
                            stats::record(&mut lock(&self.wait_us), t.elapsed());
                        }
                        inc(&self.stats.admitted);
                        let _ = self.admitted.send(Admitted { idx, bearer, token });
                        self.resolve();
                    }
                    _ => {
                        // Poll when told, ±10 % so a released crowd does not poll in lockstep.
                        let ms = view.poll_after_ms.max(100) as f64 * rand::thread_rng().gen_range(0.9..1.1);
                        self.schedule(idx, Kind::Poll, Instant::now() + Duration::from_millis(ms as u64));
                    }
                }
            }
            StatusCode::NOT_FOUND if kind == Kind::Poll => {
                // The position lapsed (or the slot ended): join again.
                inc(&self.stats.lapsed);
                lock(&self.buyers[idx]).ticket = None;
                self.schedule(idx, Kind::Join, Instant::now());
            }
            StatusCode::TOO_MANY_REQUESTS => {
                inc(&self.stats.rate_limited_429);
                self.schedule(idx, kind, Instant::now() + after_header(backoff()));
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                inc(&self.stats.unavailable_503);
                let code = serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v.get("code").and_then(|c| c.as_str()).map(str::to_owned))
                    .unwrap_or_else(|| "unknown".into());
                *lock(&self.stats.unavailable_by_code).entry(code).or_default() += 1;
                self.retry(idx, kind, after_header(backoff()));
            }
            s => {
                inc(&self.stats.errors);
                tracing::debug!(status = %s, body = %String::from_utf8_lossy(&body), "unexpected queue answer");
                if s.is_server_error() {
                    self.retry(idx, kind, backoff());
                } else {
                    // 401/404 on join/409 position limit: this buyer cannot queue.
                    inc(&self.stats.rejected);
                    self.resolve();
                }
            }
        }
    }
}
