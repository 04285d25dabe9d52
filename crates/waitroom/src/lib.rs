//! The waiting room (design §3): a Redis-backed queue in front of the hold endpoint that
//! admits buyers at a measured rate, plus the rate buckets at the API's edge and the
//! revocation set of admission tokens.
//!
//! What it owns, per event: queue positions (FIFO after the onsale opens), the pre-queue
//! (joins before `opens_at`, shuffled once at the opening so arriving first buys nothing),
//! heartbeats (a position whose holder stops polling for `abandon_after_ms` lapses, and lapsed
//! positions are dropped atomically, so they never stall the inlet), the lapse clock (time in
//! which the waiting room could not answer its callers — Redis unreachable or stopped for
//! more than [`STALL_GAP`], or a process that noted its refusals, [`Waitroom::note_refused`]
//! — does not count towards a lapse, up to [`LAPSE_GRACE_FACTOR`] × `abandon_after_ms`),
//! admission slots of released tickets, one position per user and event and a per-user cap
//! across events.
//! Every multi-key step is one Lua script ([`scripts`]), so concurrent API instances cannot
//! interleave half-done steps; every script reads the Redis clock.
//!
//! The invariant it protects is the ledger's: PostgreSQL stays within the write rate it has
//! proved it sustains. Redis is a shield, not a ledger: it never owns seats, and nothing here
//! holds, releases or sells one. When Redis is unreachable every call fails fast (the hold
//! path's are bounded by `timeout_ms`, the queue's own by `queue_timeout_ms`, see
//! [`Patience`]) with [`WaitroomError::Unavailable`]: joins and polls answer 503,
//! while buyers already holding a valid admission token keep buying (their token is verified
//! locally; the revocation check then asks the ledger, see `boxoffice-api`'s `revocation`).
//! Only timeouts, refused, reset or closed connections and a Redis still loading its data
//! count as unavailable; any other error (a wrong password, a script error, an unexpected
//! answer) is [`WaitroomError::Redis`], which callers treat as a fault, never as "Redis is
//! away".
//!
//! Metrics: `boxoffice_waitroom_joins_total{outcome}`, `boxoffice_waitroom_admitted_total`,
//! `boxoffice_waitroom_abandoned_total`, `boxoffice_waitroom_queue_length{event,stage}`,
//! `boxoffice_waitroom_redis_errors_total{op}`, `boxoffice_waitroom_lapse_grace_seconds`.

mod keys;
mod scripts;

use boxoffice_domain::{EventId, UserId};
use chrono::{DateTime, Utc};
use keys::Keys;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use secrecy::{ExposeSecret, SecretString};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Settings of the waiting room.
#[derive(Debug, Clone)]
pub struct WaitroomConfig {
    /// Redis URL, e.g. `redis://127.0.0.1:6379` (may carry a password: secret, `Debug`
    /// redacts it).
    pub redis_url: SecretString,
    /// Prefix of every key (one deployment or test per prefix).
    pub key_prefix: String,
    /// Bound of one Redis call on the hold path (revocation checks, the purchase routes' rate
    /// buckets), connecting included, ms: those callers have a fallback, so a dead Redis
    /// costs at most this.
    pub timeout_ms: u64,
    /// Bound of one call of the waiting room's own routes and of the release step
    /// ([`Patience::Queue`]), ms (≥ `timeout_ms`). Their only alternative is a 503 that the
    /// crowd retries, and a script that timed out on our side has still run in Redis, so
    /// under load a short bound multiplies the work instead of shedding it.
    pub queue_timeout_ms: u64,
    /// A queue position whose holder has not polled for this long lapses, ms.
    pub abandon_after_ms: u64,
    /// Length of the admission slot a released ticket gets, ms (the admission token's `exp`
    /// is no later than its end).
    pub slot_ms: u64,
    /// Live queue positions one user may hold across all events (≥ 1).
    pub max_positions_per_user: u32,
    /// Lapsed positions dropped per call at most (the release step drops any it meets
    /// besides), bounding the work of one script.
    pub sweep_batch: u32,
}

impl Default for WaitroomConfig {
    fn default() -> Self {
        Self {
            redis_url: "redis://127.0.0.1:6379".into(),
            key_prefix: "boxoffice:".into(),
            timeout_ms: 300,
            queue_timeout_ms: 1_000,
            abandon_after_ms: 120_000,
            slot_ms: 900_000,
            max_positions_per_user: 2,
            sweep_batch: 200,
        }
    }
}

/// How long a caller waits for Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Patience {
    /// [`WaitroomConfig::timeout_ms`]: callers with a fallback (the hold path).
    FailFast,
    /// [`WaitroomConfig::queue_timeout_ms`]: the waiting room's own routes.
    Queue,
}

/// The lapse clock not seen for longer than this is a stall of the waiting room: the whole gap
/// is a pause. Every API process sees it every [`CLOCK_TICK_EVERY`] ([`Waitroom::keep_clock`])
/// and every join, poll and release step sees it, so only a Redis unreachable or stalled (or
/// no API process running) goes this long.
pub const STALL_GAP: Duration = Duration::from_secs(5);

/// How often an API process sees the lapse clock ([`Waitroom::keep_clock`]).
pub const CLOCK_TICK_EVERY: Duration = Duration::from_secs(1);

/// Pauses hold a position's lapse back by at most this many times `abandon_after_ms` (by
/// default 6 min on top of the 2 min), so refusals that never end cannot keep abandoned
/// positions for ever.
pub const LAPSE_GRACE_FACTOR: u64 = 3;

/// A process sends its claim of refusals with at most one call per this long.
pub const CLAIM_EVERY: Duration = Duration::from_millis(500);

/// Spans of refusal a process keeps while it cannot send them (more are joined, oldest
/// first: a longer pause, never a shorter one).
const REFUSALS_KEPT: usize = 8;

/// How long a per-second activity counter ([`Waitroom::add_counts`]) lives, seconds.
pub const COUNTER_TTL_S: i64 = 120;

/// Changes of Redis's health are logged at most this often.
pub const HEALTH_LOG_EVERY: Duration = Duration::from_secs(10);

/// Why a waiting-room call failed.
#[derive(Debug, thiserror::Error)]
pub enum WaitroomError {
    /// Redis is unreachable or did not answer in time (→ 503 with `Retry-After`).
    #[error("the waiting room's Redis is unavailable")]
    Unavailable(#[source] redis::RedisError),
    /// Redis did not answer within the caller's bound, ms (→ 503 with `Retry-After`).
    #[error("the waiting room's Redis did not answer within {0} ms")]
    Timeout(u64),
    /// Redis answered with an error or an unexpected shape (a wrong password, a script
    /// error, …): a fault, never unavailability (→ 500; the revocation check fails closed).
    #[error("the waiting room's Redis answered with an error")]
    Redis(#[source] redis::RedisError),
    /// The user already holds `limit` live positions (→ 429).
    #[error("the user already holds {held} queue positions (limit {limit})")]
    PositionLimit {
        /// Live positions the user holds.
        held: u32,
        /// The configured limit.
        limit: u32,
    },
    /// The ticket is unknown, not this user's, left, lapsed or its slot ended (→ 404).
    #[error("no such queue ticket")]
    UnknownTicket,
    /// `schedule` after the onsale opened or while people queue first-come-first-served.
    #[error("the event's queue is already open")]
    AlreadyOpen,
}

impl WaitroomError {
    /// Whether Redis could not be reached (the caller answers 503 or falls back).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable(_) | Self::Timeout(_))
    }
}

/// Where a ticket stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TicketState {
    /// Joined before the onsale opened; no position until the shuffle at the opening.
    PreQueue,
    /// In the queue at `position`.
    Queued,
    /// Released: may buy until the slot ends.
    Admitted,
}

impl TicketState {
    /// The wire name: `pre_queue`, `queued`, `admitted`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PreQueue => "pre_queue",
            Self::Queued => "queued",
            Self::Admitted => "admitted",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "pre" => Some(Self::PreQueue),
            "queued" => Some(Self::Queued),
            "admitted" => Some(Self::Admitted),
            _ => None,
        }
    }
}

/// The answer of [`Waitroom::join`].
#[derive(Debug, Clone, PartialEq)]
pub struct QueueTicket {
    /// The ticket (secret-ish: the holder polls with it; it is also the admission token's
    /// `jti` once released).
    pub ticket: Uuid,
    /// True for a new position, false when the user already had one in this event (the same
    /// ticket is returned: a retried join is harmless).
    pub created: bool,
    /// Where it stands.
    pub state: TicketState,
    /// 1-based position while [`TicketState::Queued`].
    pub position: Option<u64>,
    /// When the pre-queue opens, while it has not.
    pub opens_at: Option<DateTime<Utc>>,
    /// End of the admission slot once [`TicketState::Admitted`].
    pub slot_ends_at: Option<DateTime<Utc>>,
    /// The event's release rate, positions per second, as the release controller last set
    /// it, while the validity it gave that rate lasts ([`Waitroom::release`]), else `None`.
    pub release_per_s: Option<f64>,
}

/// The answer of [`Waitroom::status`].
#[derive(Debug, Clone, PartialEq)]
pub struct TicketStatus {
    /// The ticket's event.
    pub event: EventId,
    /// Where it stands.
    pub state: TicketState,
    /// 1-based position while [`TicketState::Queued`].
    pub position: Option<u64>,
    /// When the pre-queue opens, while it has not.
    pub opens_at: Option<DateTime<Utc>>,
    /// End of the admission slot once [`TicketState::Admitted`].
    pub slot_ends_at: Option<DateTime<Utc>>,
    /// Live positions in the queue (all of them, not only ahead).
    pub queued: u64,
    /// Entries in the pre-queue.
    pub pre_queued: u64,
    /// The event's live release rate, as in [`QueueTicket::release_per_s`].
    pub release_per_s: Option<f64>,
}

/// The answer of [`Waitroom::release`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// Tickets moved to admitted, in queue order.
    pub admitted: Vec<Uuid>,
    /// Lapsed positions dropped on the way.
    pub abandoned: u64,
    /// Live positions left in the queue.
    pub queued: u64,
    /// Entries left in the pre-queue.
    pub pre_queued: u64,
    /// Admission slots still running.
    pub admitted_live: u64,
}

/// Counts of one event's queue ([`Waitroom::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueStats {
    /// Live positions in the queue.
    pub queued: u64,
    /// Entries in the pre-queue.
    pub pre_queued: u64,
    /// Admission slots still running.
    pub admitted_live: u64,
}

/// A rate bucket: `per_s` requests per second on average, `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    /// Sustained rate, requests per second (> 0).
    pub per_s: f64,
    /// Requests allowed at once (≥ 1).
    pub burst: u32,
}

/// The verdict of a rate bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateDecision {
    /// Go ahead.
    Allowed,
    /// Over the limit: retry after this many ms.
    Limited {
        /// Milliseconds until one more request fits.
        retry_after_ms: u64,
    },
}

/// The waiting room: cheap to clone (one multiplexed connection, reconnecting lazily).
#[derive(Clone)]
pub struct Waitroom {
    conn: ConnectionManager,
    keys: Keys,
    cfg: Arc<WaitroomConfig>,
    scripts: Arc<scripts::Scripts>,
    /// The health last logged for each [`Patience`] (a slow Redis may answer within the
    /// queue's bound and not the hold path's): a call that finds another state logs it, at
    /// most one line per [`HEALTH_LOG_EVERY`]; a change inside that time is logged by the
    /// first call after it if it still holds.
    healthy: Arc<[AtomicBool; 2]>,
    /// When Redis was last unavailable, ms after `epoch` (0 = never).
    last_unavailable_ms: Arc<AtomicU64>,
    /// When a change of health was last logged, ms after `epoch` + 1 (0 = never).
    last_health_log_ms: Arc<AtomicU64>,
    epoch: Instant,
    /// This process's refusals not yet recorded in Redis ([`Waitroom::note_refused`]).
    refusals: Arc<std::sync::Mutex<Refusals>>,
}

/// Spans in which a process refused the waiting room's callers, kept until a sweeping call
/// that carried them succeeded (recording one twice changes nothing: pauses are a union).
#[derive(Debug, Default)]
struct Refusals {
    /// Disjoint, oldest first, at most [`REFUSALS_KEPT`].
    pending: Vec<(Instant, Instant)>,
    /// When a claim last went out.
    last_sent: Option<Instant>,
}

impl Refusals {
    fn note(&mut self, from: Instant, to: Instant) {
        if to <= from {
            return;
        }
        // The usual case: the latest span goes on (a refusal streak noted at each refusal).
        if let Some(last) = self.pending.last_mut() {
            if last.0 <= from && from <= last.1 {
                last.1 = last.1.max(to);
                return;
            }
        }
        self.pending.push((from, to));
        self.pending.sort_by_key(|s| s.0);
        let mut merged: Vec<(Instant, Instant)> = Vec::with_capacity(self.pending.len());
        for (a, b) in self.pending.drain(..) {
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        while merged.len() > REFUSALS_KEPT {
            let (_, b) = merged.remove(1);
            merged[0].1 = merged[0].1.max(b);
        }
        self.pending = merged;
    }

    /// The claim to send with a call at `now` (`from_age:to_age,…`, ms) and what it covers,
    /// or `None` when there is nothing to send or one went out less than [`CLAIM_EVERY`] ago.
    fn claim(&mut self, now: Instant, flush: bool) -> Option<(String, Vec<(Instant, Instant)>)> {
        let recent = self.last_sent.is_some_and(|t| now.saturating_duration_since(t) < CLAIM_EVERY);
        if self.pending.is_empty() || (recent && !flush) {
            return None;
        }
        self.last_sent = Some(now);
        let age = |t: Instant| now.saturating_duration_since(t).as_millis();
        let text = self
            .pending
            .iter()
            .map(|(a, b)| format!("{}:{}", age(*a), age(*b)))
            .collect::<Vec<_>>()
            .join(",");
        Some((text, self.pending.clone()))
    }

    /// A call carrying `sent` succeeded: what it covered is recorded.
    fn recorded(&mut self, sent: &[(Instant, Instant)]) {
        self.pending.retain(|p| !sent.iter().any(|s| s.0 <= p.0 && p.1 <= s.1));
    }
}

/// What Redis knows about one admission token ([`Waitroom::revocation_state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RevocationState {
    /// Its `jti` is in the revocation set.
    pub revoked: bool,
    /// The revocation set was seeded from the ledger since Redis last lost its data (the
    /// seed marker is present): a miss can be trusted.
    pub seeded: bool,
}

impl std::fmt::Debug for Waitroom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waitroom").field("key_prefix", &self.cfg.key_prefix).finish_non_exhaustive()
    }
}

/// A rate as the scripts return it (`""` when none or stale).
fn live_rate(s: &str) -> Option<f64> {
    s.parse::<f64>().ok().filter(|r| r.is_finite() && *r >= 0.0)
}

fn ms_to_time(ms: i64) -> Option<DateTime<Utc>> {
    (ms >= 0).then(|| DateTime::from_timestamp_millis(ms)).flatten()
}

fn pos(p: i64) -> Option<u64> {
    (p > 0).then_some(p as u64)
}

fn uuid_of(s: &str) -> Result<Uuid, WaitroomError> {
    s.parse().map_err(|_| {
        WaitroomError::Redis(redis::RedisError::from((redis::ErrorKind::Parse, "a ticket is not a UUID")))
    })
}

impl Waitroom {
    /// A waiting room on `cfg.redis_url`. Connects lazily: a Redis that is down at start-up
    /// makes calls fail with [`WaitroomError::Unavailable`], not the process.
    ///
    /// # Errors
    /// [`WaitroomError::Redis`] for a malformed URL.
    pub fn new(cfg: WaitroomConfig) -> Result<Self, WaitroomError> {
        let client = redis::Client::open(cfg.redis_url.expose_secret()).map_err(WaitroomError::Redis)?;
        let t = Duration::from_millis(cfg.timeout_ms.max(cfg.queue_timeout_ms));
        let mgr_cfg = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(t))
            .set_response_timeout(Some(t))
            .set_number_of_retries(1)
            .set_max_delay(t);
        let conn = ConnectionManager::new_lazy_with_config(client, mgr_cfg).map_err(WaitroomError::Redis)?;
        Ok(Self {
            conn,
            keys: Keys::new(&cfg.key_prefix),
            cfg: Arc::new(cfg),
            scripts: Arc::new(scripts::Scripts::new()),
            healthy: Arc::new([AtomicBool::new(true), AtomicBool::new(true)]),
            last_unavailable_ms: Arc::new(AtomicU64::new(0)),
            last_health_log_ms: Arc::new(AtomicU64::new(0)),
            epoch: Instant::now(),
            refusals: Arc::new(std::sync::Mutex::new(Refusals::default())),
        })
    }

    /// The settings.
    pub fn config(&self) -> &WaitroomConfig {
        &self.cfg
    }

    /// Whether a call found Redis unavailable within the last `within` (callers with a
    /// fallback use it to skip a Redis that just timed out, instead of waiting `timeout_ms`
    /// again on every request).
    pub fn recently_unavailable(&self, within: Duration) -> bool {
        let at = self.last_unavailable_ms.load(Ordering::Relaxed);
        at != 0 && self.epoch.elapsed().as_millis() as u64 <= at + within.as_millis() as u64
    }

    /// Records that this process refused the waiting room's callers (503) from `from` to
    /// `to`: with its next sweeping call (a join, a poll, the release step, the stats or the
    /// clock's tick; at most one per [`CLAIM_EVERY`]) the span becomes a pause of the lapse
    /// clock, so the positions of buyers who were refused are not lapsed for that time.
    /// Cheap: no Redis call of its own (the tick of [`Self::keep_clock`] sends it within a
    /// second if no queue call does). The API calls it while its queue routes keep refusing their callers
    /// because the waiting room cannot answer (`boxoffice-api`'s `edge::RefusalBackoff`); a
    /// stall of Redis itself is recorded by the scripts ([`STALL_GAP`]).
    pub fn note_refused(&self, from: Instant, to: Instant) {
        self.refusals.lock().unwrap_or_else(std::sync::PoisonError::into_inner).note(from, to);
    }

    /// Keeps the lapse clock; every API process runs it until `until` completes. Every
    /// [`CLOCK_TICK_EVERY`] one call ([`Self::tick_clock`]) marks the clock seen (so a quiet
    /// waiting room is no stall), records a stall since it was last seen, sends this
    /// process's claim of refusals and sets `boxoffice_waitroom_lapse_grace_seconds`; a last
    /// call on the way out sends any claim left. Failed calls are counted
    /// (`boxoffice_waitroom_redis_errors_total{op="tick_clock"}`; the gauge keeps its last
    /// value meanwhile) and the next tick tries again; errors that are faults are logged at
    /// most once per [`HEALTH_LOG_EVERY`]. Shutting down waits for the tick in progress and
    /// the last call, each bounded by `queue_timeout_ms`.
    pub async fn keep_clock(self, until: impl Future<Output = ()>) {
        let mut tick = tokio::time::interval(CLOCK_TICK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut until = std::pin::pin!(until);
        loop {
            tokio::select! {
                _ = &mut until => break,
                _ = tick.tick() => {
                    let _ = self.tick_clock(false).await;
                }
            }
        }
        let _ = self.tick_clock(true).await;
    }

    /// One step of the lapse clock on its own (see [`Self::keep_clock`]), with this process's
    /// claim of refusals (`flush`: even if one went out less than [`CLAIM_EVERY`] ago).
    /// Returns how far pauses hold lapses back now.
    ///
    /// # Errors
    /// [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`].
    pub async fn tick_clock(&self, flush: bool) -> Result<Duration, WaitroomError> {
        let mut inv = self.scripts.tick_clock.prepare_invoke();
        inv.key(self.keys.lapse_clock()).arg(self.cfg.abandon_after_ms);
        let grace_ms: i64 = self.sweeping_call_with("tick_clock", inv, flush).await?;
        let grace = Duration::from_millis(grace_ms.max(0) as u64);
        metrics::gauge!("boxoffice_waitroom_lapse_grace_seconds").set(grace.as_secs_f64());
        Ok(grace)
    }

    /// Runs a sweeping script (`inv` with every argument but the last) with this
    /// process's claim of refusals as its last argument; the claim counts as recorded once
    /// the call succeeded.
    async fn sweeping_call<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        inv: redis::ScriptInvocation<'_>,
    ) -> Result<T, WaitroomError> {
        self.sweeping_call_with(op, inv, false).await
    }

    /// [`Self::sweeping_call`]; `flush` sends the claim even if one went out less than
    /// [`CLAIM_EVERY`] ago.
    async fn sweeping_call_with<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        mut inv: redis::ScriptInvocation<'_>,
        flush: bool,
    ) -> Result<T, WaitroomError> {
        let refusals = || self.refusals.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let claim = refusals().claim(Instant::now(), flush);
        inv.arg(claim.as_ref().map_or("", |(text, _)| text.as_str()));
        let mut conn = self.conn.clone();
        let res = self.queue_call(op, inv.invoke_async(&mut conn)).await;
        if let (Ok(_), Some((_, sent))) = (&res, &claim) {
            refusals().recorded(sent);
        }
        res
    }

    /// Runs one Redis call bounded by `timeout_ms`; see [`Self::call_with`].
    async fn call<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, WaitroomError> {
        self.call_with(Patience::FailFast, op, fut).await
    }

    /// Runs one Redis call of the waiting room's own routes, bounded by `queue_timeout_ms`.
    async fn queue_call<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, WaitroomError> {
        self.call_with(Patience::Queue, op, fut).await
    }

    /// Runs one Redis call bounded as `patience` says, counting and classifying failures.
    /// Unavailability after a success is logged (and the recovery), at most one line per
    /// [`HEALTH_LOG_EVERY`], so neither a dead Redis nor a flapping one floods the log; a
    /// state that still holds when the time has passed is logged then, so the log's last
    /// word is the current state. Every failure is counted
    /// (`boxoffice_waitroom_redis_errors_total`); errors that are not unavailability are
    /// logged each time (they are faults).
    async fn call_with<T>(
        &self,
        patience: Patience,
        op: &'static str,
        fut: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, WaitroomError> {
        let ms = match patience {
            Patience::FailFast => self.cfg.timeout_ms,
            Patience::Queue => self.cfg.queue_timeout_ms,
        };
        let res = match tokio::time::timeout(Duration::from_millis(ms), fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(classify(e)),
            Err(_) => Err(WaitroomError::Timeout(ms)),
        };
        let reachable = match &res {
            Ok(_) => Some(true),
            Err(e) => {
                metrics::counter!("boxoffice_waitroom_redis_errors_total", "op" => op).increment(1);
                if e.is_unavailable() {
                    let at = self.epoch.elapsed().as_millis().max(1) as u64;
                    self.last_unavailable_ms.store(at, Ordering::Relaxed);
                    Some(false)
                } else {
                    // The clock ticks every second in every API process: its faults are
                    // logged at most once per HEALTH_LOG_EVERY (the metric counts each).
                    if op != "tick_clock" || self.may_log() {
                        tracing::error!(redis.op = op, error = ?e, "waiting room: redis error");
                    }
                    None
                }
            }
        };
        // The state last logged for this bound is kept until a line may be written, so a
        // change inside the window is logged once it has passed (on the next call).
        let logged = &self.healthy[patience as usize];
        if let Some(now) = reachable {
            if logged.load(Ordering::Relaxed) != now && self.may_log() {
                logged.store(now, Ordering::Relaxed);
                match &res {
                    Ok(_) => tracing::info!(redis.op = op, "waiting room: redis reachable again"),
                    Err(e) => {
                        tracing::warn!(redis.op = op, error = %e, "waiting room: redis unreachable; queue calls answer 503, the other routes' rate buckets fall back to this process's own limiter, revocation checks ask the ledger")
                    }
                }
            }
        }
        res
    }

    /// Whether a change of Redis's health may be logged now: at most one line per
    /// [`HEALTH_LOG_EVERY`], so a Redis that answers some calls in time and not others
    /// (a process short of CPU) does not flood the log; the metric counts every failure.
    fn may_log(&self) -> bool {
        let now = self.epoch.elapsed().as_millis() as u64 + 1;
        let last = self.last_health_log_ms.load(Ordering::Relaxed);
        (last == 0 || now >= last + HEALTH_LOG_EVERY.as_millis() as u64)
            && self
                .last_health_log_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    fn event_script<'a>(&self, script: &'a redis::Script, event: Uuid) -> redis::ScriptInvocation<'a> {
        let mut inv = script.prepare_invoke();
        for k in self.keys.event(event).0 {
            inv.key(k);
        }
        inv
    }

    /// Sets when `event`'s onsale opens: until then joins go into the pre-queue, shuffled into
    /// the queue at `opens_at` (by a draw from `seed`, or from a random secret seed kept in
    /// Redis when `None`; a given seed makes the order reproducible). May be moved while the
    /// event has not opened.
    ///
    /// # Errors
    /// [`WaitroomError::AlreadyOpen`] once the queue has opened or holds FIFO positions;
    /// [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`].
    pub async fn schedule(
        &self,
        event: EventId,
        opens_at: DateTime<Utc>,
        seed: Option<&str>,
    ) -> Result<(), WaitroomError> {
        let random = Uuid::new_v4().simple().to_string();
        let mut inv = self.event_script(&self.scripts.schedule, event.0);
        inv.arg(opens_at.timestamp_millis()).arg(seed.unwrap_or(random.as_str())).arg(if seed.is_some() {
            "1"
        } else {
            "0"
        });
        let mut conn = self.conn.clone();
        let ok: i64 = self.queue_call("schedule", inv.invoke_async(&mut conn)).await?;
        if ok == 1 {
            Ok(())
        } else {
            Err(WaitroomError::AlreadyOpen)
        }
    }

    /// Queues `user` for `event`: a new ticket at the tail (or in the pre-queue before the
    /// opening), or the user's existing ticket for this event. Counts as a poll.
    ///
    /// # Errors
    /// [`WaitroomError::PositionLimit`] when the user already holds `max_positions_per_user`
    /// live positions; [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`].
    pub async fn join(&self, event: EventId, user: UserId) -> Result<QueueTicket, WaitroomError> {
        let ticket = Uuid::new_v4();
        let mut inv = self.event_script(&self.scripts.join, event.0);
        inv.key(self.keys.ticket(ticket)).key(self.keys.user(user.0)).key(self.keys.user_slots(user.0));
        inv.arg(event.0.to_string())
            .arg(user.0.to_string())
            .arg(ticket.to_string())
            .arg(self.cfg.abandon_after_ms)
            .arg(self.cfg.sweep_batch)
            .arg(self.cfg.max_positions_per_user)
            .arg(self.ticket_ttl_ms());
        let (state, ticket, created, position, opens_at, abandoned, slot_end, rate): (
            String,
            String,
            i64,
            i64,
            i64,
            i64,
            i64,
            String,
        ) = self.sweeping_call("join", inv).await?;
        count_abandoned(abandoned);
        if state == "limit" {
            metrics::counter!("boxoffice_waitroom_joins_total", "outcome" => "limit").increment(1);
            return Err(WaitroomError::PositionLimit {
                held: u32::try_from(created).unwrap_or(u32::MAX),
                limit: self.cfg.max_positions_per_user,
            });
        }
        let state = TicketState::parse(&state).ok_or_else(|| unexpected("join"))?;
        let outcome = if created == 1 { "created" } else { "existing" };
        metrics::counter!("boxoffice_waitroom_joins_total", "outcome" => outcome).increment(1);
        Ok(QueueTicket {
            ticket: uuid_of(&ticket)?,
            created: created == 1,
            state,
            position: pos(position),
            opens_at: ms_to_time(opens_at),
            slot_ends_at: ms_to_time(slot_end),
            release_per_s: live_rate(&rate),
        })
    }

    /// Where `ticket` stands, for its holder `user`; a poll is the heartbeat that keeps the
    /// position alive.
    ///
    /// # Errors
    /// [`WaitroomError::UnknownTicket`] when the ticket is unknown, another user's, left,
    /// lapsed or its slot has ended; [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`].
    pub async fn status(&self, ticket: Uuid, user: UserId) -> Result<TicketStatus, WaitroomError> {
        let event = self.ticket_event(ticket).await?;
        let mut inv = self.event_script(&self.scripts.status, event);
        inv.key(self.keys.ticket(ticket)).key(self.keys.user(user.0)).key(self.keys.user_slots(user.0));
        inv.arg(ticket.to_string())
            .arg(user.0.to_string())
            .arg(self.cfg.abandon_after_ms)
            .arg(self.cfg.sweep_batch)
            .arg(self.ticket_ttl_ms());
        let (state, position, opens_at, abandoned, slot_end, queued, pre, rate): (
            String,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            String,
        ) = self.sweeping_call("status", inv).await?;
        count_abandoned(abandoned);
        let state = match state.as_str() {
            "unknown" => return Err(WaitroomError::UnknownTicket),
            s => TicketState::parse(s).ok_or_else(|| unexpected("status"))?,
        };
        Ok(TicketStatus {
            event: EventId(event),
            state,
            position: pos(position),
            opens_at: ms_to_time(opens_at),
            slot_ends_at: ms_to_time(slot_end),
            queued: queued.max(0) as u64,
            pre_queued: pre.max(0) as u64,
            release_per_s: live_rate(&rate),
        })
    }

    /// The end of `ticket`'s admission slot while it runs (`None` before it is admitted or
    /// after the slot), for its holder `user`: a caller that records the revocation leaving
    /// causes ([`Waitroom::leave`]) elsewhere asks this first.
    ///
    /// # Errors
    /// [`WaitroomError::UnknownTicket`] when the ticket is unknown or not `user`'s;
    /// [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`].
    pub async fn admission_slot(
        &self,
        ticket: Uuid,
        user: UserId,
    ) -> Result<Option<DateTime<Utc>>, WaitroomError> {
        let event = self.ticket_event(ticket).await?;
        let mut conn = self.conn.clone();
        let adm = self.keys.event(event).0[4].clone();
        let mut pipe = redis::pipe();
        pipe.cmd("HGET").arg(self.keys.ticket(ticket)).arg("user");
        pipe.cmd("ZSCORE").arg(&adm).arg(ticket.to_string());
        pipe.cmd("TIME");
        let (owner, slot, (s, us)): (Option<String>, Option<f64>, (i64, i64)) =
            self.queue_call("admission_slot", pipe.query_async(&mut conn)).await?;
        if owner.as_deref() != Some(user.0.to_string().as_str()) {
            return Err(WaitroomError::UnknownTicket);
        }
        let now_ms = s * 1000 + us / 1000;
        Ok(slot.map(|v| v as i64).filter(|end| *end > now_ms).and_then(ms_to_time))
    }

    /// Gives up `ticket` (its holder `user` leaves). Leaving during an admission slot also
    /// revokes the admission token (its `jti` is the ticket) until the slot ends; the answer
    /// is then the slot's end.
    ///
    /// # Errors
    /// [`WaitroomError::UnknownTicket`]; [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`].
    pub async fn leave(&self, ticket: Uuid, user: UserId) -> Result<Option<DateTime<Utc>>, WaitroomError> {
        let event = self.ticket_event(ticket).await?;
        let mut inv = self.event_script(&self.scripts.leave, event);
        inv.key(self.keys.ticket(ticket))
            .key(self.keys.user(user.0))
            .key(self.keys.revoked(ticket))
            .key(self.keys.user_slots(user.0));
        inv.arg(ticket.to_string()).arg(user.0.to_string());
        let mut conn = self.conn.clone();
        let (left, revoked_until): (i64, i64) = self.queue_call("leave", inv.invoke_async(&mut conn)).await?;
        if left == 1 {
            Ok((revoked_until > 0).then(|| ms_to_time(revoked_until)).flatten())
        } else {
            Err(WaitroomError::UnknownTicket)
        }
    }

    /// Admits the next `n` live positions of `event` (each gets a slot of `slot_ms`; `n` may
    /// be 0), dropping lapsed positions met on the way. The release controller calls this
    /// every tick with its rate for the event, positions per second, and how long that rate
    /// stays valid; joins and polls then report it ([`TicketStatus::release_per_s`]) so buyers
    /// far back are told a true wait and poll accordingly. Nothing about seats changes here.
    ///
    /// # Errors
    /// [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`].
    pub async fn release(
        &self,
        event: EventId,
        n: u32,
        rate: Option<(f64, Duration)>,
    ) -> Result<Released, WaitroomError> {
        let mut inv = self.event_script(&self.scripts.release, event.0);
        let (rate, valid) = match rate.filter(|(r, _)| r.is_finite() && *r >= 0.0) {
            Some((r, valid)) => (format!("{r:.6}"), valid.as_millis() as u64),
            None => (String::new(), 0),
        };
        inv.arg(event.0.to_string())
            .arg(n)
            .arg(self.cfg.abandon_after_ms)
            .arg(self.cfg.sweep_batch)
            .arg(self.cfg.slot_ms)
            .arg(rate)
            .arg(valid);
        let (admitted, abandoned, queued, pre, live, _slot_end): (Vec<String>, i64, i64, i64, i64, i64) =
            self.sweeping_call("release", inv).await?;
        count_abandoned(abandoned);
        metrics::counter!("boxoffice_waitroom_admitted_total").increment(admitted.len() as u64);
        let r = Released {
            admitted: admitted.iter().map(|t| uuid_of(t)).collect::<Result<_, _>>()?,
            abandoned: abandoned.max(0) as u64,
            queued: queued.max(0) as u64,
            pre_queued: pre.max(0) as u64,
            admitted_live: live.max(0) as u64,
        };
        record_lengths(event, r.queued, r.pre_queued, r.admitted_live);
        Ok(r)
    }

    /// Counts of `event`'s queue (after dropping lapsed positions); also exported as the
    /// `boxoffice_waitroom_queue_length` gauge.
    ///
    /// # Errors
    /// [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`].
    pub async fn stats(&self, event: EventId) -> Result<QueueStats, WaitroomError> {
        let mut inv = self.event_script(&self.scripts.stats, event.0);
        inv.arg(self.cfg.abandon_after_ms).arg(self.cfg.sweep_batch);
        let (queued, pre, live, abandoned, _now): (i64, i64, i64, i64, i64) =
            self.sweeping_call("stats", inv).await?;
        count_abandoned(abandoned);
        let s = QueueStats {
            queued: queued.max(0) as u64,
            pre_queued: pre.max(0) as u64,
            admitted_live: live.max(0) as u64,
        };
        record_lengths(event, s.queued, s.pre_queued, s.admitted_live);
        Ok(s)
    }

    /// Events that have people queued or pre-queued (the release controller's work list).
    ///
    /// # Errors
    /// [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`].
    pub async fn active_events(&self) -> Result<Vec<EventId>, WaitroomError> {
        let mut conn = self.conn.clone();
        let key = self.keys.events();
        let members: Vec<String> =
            self.queue_call("active_events", redis::cmd("SMEMBERS").arg(&key).query_async(&mut conn)).await?;
        Ok(members.iter().filter_map(|m| m.parse().ok()).map(EventId).collect())
    }

    /// Revokes the admission token `jti` until `until_exp` (unix seconds, its `exp`; the
    /// entry expires with the token).
    ///
    /// # Errors
    /// [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`].
    pub async fn revoke(&self, jti: Uuid, until_exp: i64) -> Result<(), WaitroomError> {
        let mut conn = self.conn.clone();
        let key = self.keys.revoked(jti);
        let cmd = redis::cmd("SET").arg(&key).arg(1).arg("EXAT").arg(until_exp.max(1)).to_owned();
        self.call("revoke", cmd.query_async::<()>(&mut conn)).await
    }

    /// Whether the admission token `jti` was revoked.
    ///
    /// # Errors
    /// [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`]: the caller decides
    /// whether to fail open.
    pub async fn is_revoked(&self, jti: Uuid) -> Result<bool, WaitroomError> {
        let mut conn = self.conn.clone();
        let key = self.keys.revoked(jti);
        self.call("is_revoked", redis::cmd("EXISTS").arg(&key).query_async::<bool>(&mut conn)).await
    }

    /// Whether `jti` is in the revocation set, and whether that set was seeded from the
    /// ledger since Redis last lost its data: one round trip (`MGET` of the token's key and
    /// the seed marker).
    ///
    /// # Errors
    /// [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`] when Redis cannot answer;
    /// [`WaitroomError::Redis`] for any other failure (the caller must not read it as "not
    /// revoked").
    pub async fn revocation_state(&self, jti: Uuid) -> Result<RevocationState, WaitroomError> {
        let mut conn = self.conn.clone();
        let cmd =
            redis::cmd("MGET").arg(self.keys.revoked(jti)).arg(self.keys.revocations_seeded()).to_owned();
        let (revoked, seeded): (Option<String>, Option<String>) =
            self.call("revocation_state", cmd.query_async(&mut conn)).await?;
        Ok(RevocationState { revoked: revoked.is_some(), seeded: seeded.is_some() })
    }

    /// Writes every `(jti, until_exp)` revocation (unix seconds), then the seed marker that
    /// makes misses trustworthy ([`RevocationState::seeded`]). The marker is written only if
    /// the Redis that took the seed's first write still holds it, so a Redis restarting
    /// mid-seed is never marked complete. `Ok(false)`: not marked (retry later).
    ///
    /// # Errors
    /// [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`]; [`WaitroomError::Redis`].
    pub async fn seed_revocations(&self, entries: &[(Uuid, i64)]) -> Result<bool, WaitroomError> {
        let mut conn = self.conn.clone();
        let token = Uuid::new_v4().to_string();
        let guard = self.keys.revocations_seeding();
        let cmd = redis::cmd("SET").arg(&guard).arg(&token).arg("EX").arg(600).to_owned();
        self.call("seed_revocations", cmd.query_async::<()>(&mut conn)).await?;
        for chunk in entries.chunks(500) {
            let mut pipe = redis::pipe();
            for (jti, until) in chunk {
                pipe.cmd("SET").arg(self.keys.revoked(*jti)).arg(1).arg("EXAT").arg((*until).max(1)).ignore();
            }
            self.call("seed_revocations", pipe.query_async::<()>(&mut conn)).await?;
        }
        let mut inv = self.scripts.mark_seeded.prepare_invoke();
        inv.key(&guard).key(self.keys.revocations_seeded()).arg(&token);
        let marked: i64 = self.call("seed_revocations", inv.invoke_async(&mut conn)).await?;
        Ok(marked == 1)
    }

    /// Takes one request from the bucket `scope`/`id` (e.g. `ip`/`203.0.113.7`), waiting
    /// for Redis as `patience` says.
    ///
    /// # Errors
    /// [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`].
    pub async fn take(
        &self,
        scope: &str,
        id: &str,
        bucket: Bucket,
        patience: Patience,
    ) -> Result<RateDecision, WaitroomError> {
        let interval_ms = 1000.0 / bucket.per_s.max(1e-3);
        let mut inv = self.scripts.bucket.prepare_invoke();
        inv.key(self.keys.bucket(scope, id)).arg(interval_ms).arg(bucket.burst.max(1));
        let mut conn = self.conn.clone();
        let (allowed, retry_ms): (i64, i64) =
            self.call_with(patience, "rate_bucket", inv.invoke_async(&mut conn)).await?;
        Ok(if allowed == 1 {
            RateDecision::Allowed
        } else {
            RateDecision::Limited { retry_after_ms: retry_ms.max(1) as u64 }
        })
    }

    /// Adds each `(event, n)` to the per-second counter `name` of second `unix_s` (one
    /// pipeline of `INCRBY` + `EXPIRE`; the keys live [`COUNTER_TTL_S`]). Every API process
    /// flushes its own counts, so the sum over processes is the deployment's.
    ///
    /// # Errors
    /// [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`] (the counts are then lost).
    pub async fn add_counts(
        &self,
        name: &str,
        unix_s: i64,
        counts: &[(EventId, u64)],
    ) -> Result<(), WaitroomError> {
        if counts.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (event, n) in counts {
            let key = self.keys.counter(event.0, name, unix_s);
            pipe.cmd("INCRBY").arg(&key).arg(*n).ignore();
            pipe.cmd("EXPIRE").arg(&key).arg(COUNTER_TTL_S).ignore();
        }
        let mut conn = self.conn.clone();
        self.call("add_counts", pipe.query_async::<()>(&mut conn)).await
    }

    /// The sum of `event`'s counter `name` over the seconds `from_s..to_s` (half-open, at
    /// most [`COUNTER_TTL_S`] seconds): one `MGET`.
    ///
    /// # Errors
    /// [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`].
    pub async fn count_over(
        &self,
        event: EventId,
        name: &str,
        from_s: i64,
        to_s: i64,
    ) -> Result<u64, WaitroomError> {
        let from_s = from_s.max(to_s - COUNTER_TTL_S);
        if to_s <= from_s {
            return Ok(0);
        }
        let mut cmd = redis::cmd("MGET");
        for s in from_s..to_s {
            cmd.arg(self.keys.counter(event.0, name, s));
        }
        let mut conn = self.conn.clone();
        let counts: Vec<Option<u64>> = self.call("count_over", cmd.query_async(&mut conn)).await?;
        Ok(counts.into_iter().flatten().sum())
    }

    /// The Redis clock, ms since the Unix epoch (every script measures time by it).
    ///
    /// # Errors
    /// [`WaitroomError::Unavailable`] / [`WaitroomError::Timeout`].
    pub async fn clock_ms(&self) -> Result<i64, WaitroomError> {
        let mut conn = self.conn.clone();
        let (s, us): (i64, i64) = self.call("time", redis::cmd("TIME").query_async(&mut conn)).await?;
        Ok(s * 1000 + us / 1000)
    }

    /// The event of `ticket`, or [`WaitroomError::UnknownTicket`].
    async fn ticket_event(&self, ticket: Uuid) -> Result<Uuid, WaitroomError> {
        let mut conn = self.conn.clone();
        let key = self.keys.ticket(ticket);
        let event: Option<String> = self
            .queue_call("ticket", redis::cmd("HGET").arg(&key).arg("event").query_async(&mut conn))
            .await?;
        event.and_then(|e| e.parse().ok()).ok_or(WaitroomError::UnknownTicket)
    }

    /// How long a ticket's record outlives its last poll: long enough to cover the longest
    /// lapse (its grace included), a slot and a margin.
    fn ticket_ttl_ms(&self) -> u64 {
        (LAPSE_GRACE_FACTOR + 1) * self.cfg.abandon_after_ms + self.cfg.slot_ms + 3_600_000
    }
}

/// Sorts a Redis error: unavailable (timeouts, refused, reset or closed connections, a Redis
/// still loading, without a master, out of memory at `maxmemory` (`OOM`) or running a script
/// too long (`BUSY`) — the caller may fall back, and a buyer gets 503 with `Retry-After`) or a
/// fault.
fn classify(e: redis::RedisError) -> WaitroomError {
    use redis::{ErrorKind, ServerErrorKind};
    let unavailable = e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading | ServerErrorKind::MasterDown | ServerErrorKind::TryAgain
            )
        )
        || matches!(e.code(), Some("OOM" | "BUSY"));
    if unavailable {
        WaitroomError::Unavailable(e)
    } else {
        WaitroomError::Redis(e)
    }
}

fn unexpected(op: &str) -> WaitroomError {
    WaitroomError::Redis(redis::RedisError::from((
        redis::ErrorKind::Parse,
        "unexpected answer from a waiting-room script",
        op.to_owned(),
    )))
}

fn count_abandoned(n: i64) {
    if n > 0 {
        metrics::counter!("boxoffice_waitroom_abandoned_total").increment(n as u64);
    }
}

fn record_lengths(event: EventId, queued: u64, pre: u64, admitted: u64) {
    let e = event.0.to_string();
    metrics::gauge!("boxoffice_waitroom_queue_length", "event" => e.clone(), "stage" => "queued")
        .set(queued as f64);
    metrics::gauge!("boxoffice_waitroom_queue_length", "event" => e.clone(), "stage" => "pre_queue")
        .set(pre as f64);
    metrics::gauge!("boxoffice_waitroom_queue_length", "event" => e, "stage" => "admitted")
        .set(admitted as f64);
}

#[cfg(test)]
mod tests;
